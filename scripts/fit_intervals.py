"""Fit the prediction intervals (``src/refdl/perf/intervals.toml``) to the calibration part.

Run after ``scripts/fit_achieved.py``: the profiles' achieved figures as they are predict
every calibration point of ``docs/published/measurements.toml``, and the spread of their
errors per kind becomes the stated 80 % interval (``refdl.perf.intervals``). The held-out
part is never read here; ``refdl bench published`` measures the intervals' coverage on it.

    .venv/bin/python scripts/fit_intervals.py
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from refdl.bench.published import DATA, evaluate, fit_intervals, load
from refdl.perf import intervals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args(argv)
    points, _ = load(args.data)
    calibration = [p for p in points if p.part == "calibration"]
    fits = fit_intervals(evaluate(calibration), calibration)
    today = datetime.date.today().isoformat()
    lines = [
        f"# Written by scripts/fit_intervals.py on {today} from the calibration part of",
        "# docs/published/measurements.toml (refdl.perf.intervals): percentiles 10 and 90 of",
        "# log(published / predicted) for times, published - predicted for efficiencies;",
        "# borrowed figures widen by half the log-range of the fitted figures.",
    ]
    for kind, v in fits.items():
        lines += ["", f"[{kind}]", *[f"{k} = {x:.6g}" if isinstance(x, float) else f"{k} = {x}"
                                     for k, x in v.items()]]  # fmt: skip
    intervals.PATH.write_text("\n".join(lines) + "\n")
    for kind, v in fits.items():
        print(kind, v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
