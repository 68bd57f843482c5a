"""Compute by shape (issue 52): two models of a matrix product's time (``refdl.perf.gemm``)
fitted to DeepBench's per-shape GEMMs on the P100 and judged on the V100's (fp32, and fp16
inputs with Tensor Cores), held out by generation before any fit.

Writes ``docs/bench/gemm_shapes.json`` (each model's figures, the median and 90th
percentile |error| per part, the rows) and prints the table.

    .venv/bin/python scripts/bench_gemm_shapes.py      # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from refdl import hw  # noqa: E402
from refdl.perf import gemm  # noqa: E402

DATA = ROOT / "docs" / "published" / "gemm_deepbench.csv"
OUT = ROOT / "docs" / "bench" / "gemm_shapes.json"
DTYPE = {"fp32": ("float32", 4), "fp16": ("float16", 2)}


def rows_of(path: Path) -> list[dict]:
    """The CSV's rows with each one's device figures (``gemm.Device``) and time (s)."""
    out = []
    with path.open() as fh:
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            d = hw.load(r["hw"]).need_device()
            dtype, width = DTYPE[r["precision"]]
            dev = gemm.Device(d.peak_flops[dtype], d.memory_bandwidth, gemm.SMS[d.name])
            mnk = {x: int(r[x]) for x in "mnk"}
            out.append({**r, **mnk, "width": width, "device": dev,
                        "seconds": float(r["time_ms"]) / 1e3})  # fmt: skip
    return out


def tail(errs: list[float], q: float) -> float:
    a = sorted(abs(e) for e in errs)
    return a[min(len(a) - 1, int(q * len(a)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    rows = rows_of(DATA)
    key = lambda r: (r["m"], r["n"], r["k"], r["width"], r["device"], r["seconds"])  # noqa: E731
    cal = [key(r) for r in rows if r["part"] == "calibration"]
    doc = {"command": "python scripts/bench_gemm_shapes.py",
           "date": datetime.date.today().isoformat(), "models": {}}  # fmt: skip
    print(f"{'model':9s} {'part':12s} {'rows':>5s} {'median |err|':>13s} {'90th |err|':>11s}")
    for model in gemm.MODELS:
        f = gemm.fit(model, cal)
        res = {"figures": {"fraction": f.fraction, "latency_s": f.latency_s, "decay": f.decay}}
        for part, sheet in (("calibration", None), ("heldout", "fp32"), ("heldout", "fp16")):
            sel = [r for r in rows if r["part"] == part and sheet in (None, r["precision"])]
            errs = [gemm.gemm_s(model, *key(r)[:5], f) / r["seconds"] - 1 for r in sel]
            name = part if sheet is None else f"{part} {sheet}"
            res[name] = {"rows": len(sel), "median_abs_error": median(abs(e) for e in errs),
                         "p90_abs_error": tail(errs, 0.9),
                         "errors": [round(e, 4) for e in errs]}  # fmt: skip
            med, p90 = res[name]["median_abs_error"], res[name]["p90_abs_error"]
            print(f"{model:9s} {name:15s} {len(sel):5d} {100 * med:12.1f} % {100 * p90:9.1f} %")
        doc["models"][model] = res
        print(
            f"{model}: fraction {f.fraction}, latency {f.latency_s * 1e6:.2f} us, decay {f.decay}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
