"""``refdl plan`` against this machine: the configurations it ranks for mlp, lenet5 and the
transformer on the ``local`` profile with 8 simulated devices, each measured by
``refdl train``; Kendall's tau between predicted and measured step times, and the
measured time of the predicted best against the measured best.

    .venv/bin/python scripts/bench_plan.py --out docs/bench/plan          # ~15 min, 2 cores
    .venv/bin/python scripts/bench_plan.py --out /tmp/plan --models mlp --count 6 --steps 10

Which configurations: those ``refdl train`` can run (``--run``'s space), ranked by the
prediction; the predicted best and then evenly spaced ranks down to the slowest, ``--count``
in all, so the measured order is tested over the whole ranking, not only near its top.
Each is trained ``--steps`` steps (``--batch-size``, 64 by default); its time is the
run's median step time (``summary.json``: the first step, which compiles, left out).
Writes ``plan.json`` (every row: the configuration, predicted time and interval,
measured time) and ``plan.png`` (``plan-bN.*`` at another batch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def chosen(found: list, count: int) -> list[tuple[int, object]]:
    """(rank, priced) of the predicted best and evenly spaced ranks down to the slowest."""
    if len(found) <= count:
        return list(enumerate(found, 1))
    step = (len(found) - 1) / (count - 1)
    ranks = sorted({round(i * step) for i in range(count)})
    return [(r + 1, found[r]) for r in ranks]


def measure(model: str, batch: int, flags: list[str], steps: int, out: Path) -> float:
    """Median step time of ``refdl train`` with ``flags``."""
    cmd = [sys.executable, "-m", "refdl.train", "--model", model, "--batch-size", str(batch),
           *flags, "--steps", str(steps), "--eval-every", "0", "--log-every", "5",
           "--checkpoint-every", "0", "--no-progress", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())["step_time_median_s"]


def bench(model: str, batch: int, count: int, steps: int, tmp: Path) -> dict:
    from refdl import hw
    from refdl.bench.searches import kendall_tau_b
    from refdl.perf.model_cost import model_cost
    from refdl.perf.search import Planner
    from refdl.strategies import declared_traits

    m = model_cost(model)
    planner = Planner(m, hw.load("local"), 8, batch, runnable_only=True, optimizer_words=1,
                      strategies=declared_traits())  # fmt: skip
    found = planner.search().found
    rows = []
    for rank, p in chosen(found, count):
        flags = p.config.train_flags(m.transformer is not None, planner.owners)
        t0 = time.perf_counter()
        measured = measure(model, batch, flags, steps, tmp / f"{model}-{rank}")
        print(f"bench_plan: {model} #{rank}/{len(found)} {p.config.describe()}: predicted "
              f"{p.step_time_s * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        rows.append({"rank": rank, "configuration": p.config.describe(), "flags": flags,
                     "predicted_s": p.step_time_s, "low_s": p.low_s, "high_s": p.high_s,
                     "measured_s": measured, "dominant": p.dominant})  # fmt: skip
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    best_measured = min(meas)
    first = rows[0]["measured_s"]  # the predicted best (rank 1 is always measured)
    inside = sum(r["low_s"] <= r["measured_s"] <= r["high_s"] for r in rows if r["low_s"])
    return {
        "model": model,
        "ranked": len(found),
        "priced": planner.priced,
        "measured": len(rows),
        "kendall_tau_b": kendall_tau_b(pred, meas),
        "predicted_best_measured_s": first,
        "measured_best_s": best_measured,
        "measured_best": rows[meas.index(best_measured)]["configuration"],
        "best_gap": first / best_measured - 1.0,
        "interval_coverage": inside / len(rows),
        "rows": rows,
    }


def plot(results: list[dict], path: Path, heading: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2))
    for ax, r in zip(axes if len(results) > 1 else [axes], results, strict=True):
        pred = [x["predicted_s"] * 1e3 for x in r["rows"]]
        meas = [x["measured_s"] * 1e3 for x in r["rows"]]
        ax.scatter(pred, meas, s=18)
        ax.scatter(pred[:1], meas[:1], s=60, facecolors="none", edgecolors="r",
                   label="predicted best")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        both = pred + meas  # y = x: where a prediction equals its measurement
        ax.plot([min(both), max(both)], [min(both), max(both)], "k:", lw=0.8, label="y = x")
        for axis in (ax.xaxis, ax.yaxis):  # no crowded minor labels on a short log axis
            axis.set_minor_formatter(NullFormatter())
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.set_xlabel("predicted step, ms (local profile)")
        ax.set_ylabel("measured step, ms")
        title = (f"{r['model']}: tau {r['kendall_tau_b']:.2f}, best gap {r['best_gap']:.0%} "
                 f"({r['measured']} of {r['ranked']})")  # fmt: skip
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(heading or "refdl plan against refdl train, 8 simulated devices on this machine",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def heading(record: dict) -> str:
    """A figure's title: what was run, and when."""
    return (f"refdl plan against refdl train: global batch {record['batch']}, "
            f"{record['devices']} simulated devices on this machine, {record['date']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "plan")
    p.add_argument("--models", default="mlp,lenet5,transformer")
    p.add_argument("--count", type=int, default=24, help="configurations measured per model")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--replot", metavar="NAME.json",
                   help="redraw NAME.png from --out's NAME.json (no runs)")  # fmt: skip
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((args.out / args.replot).read_text())
        plot(saved["results"], (args.out / args.replot).with_suffix(".png"), heading(saved))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            results.append(bench(model, args.batch_size, args.count, args.steps, Path(tmp)))
    record = {"date": time.strftime("%Y-%m-%d"), "profile": "local", "devices": 8,
              "batch": args.batch_size, "steps": args.steps,
              "command": "python scripts/bench_plan.py " + " ".join(argv or sys.argv[1:]),
              "results": results}  # fmt: skip
    stem = "plan" if args.batch_size == 64 else f"plan-b{args.batch_size}"
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    plot(results, args.out / f"{stem}.png", heading(record))
    for r in results:
        print(f"{r['model']}: {r['measured']} of {r['ranked']} configurations measured, "
              f"Kendall tau-b {r['kendall_tau_b']:.2f}, predicted best measured "
              f"{r['predicted_best_measured_s'] * 1e3:.2f} ms against the measured best "
              f"{r['measured_best_s'] * 1e3:.2f} ms ({r['best_gap']:+.0%}), interval "
              f"coverage {r['interval_coverage']:.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
