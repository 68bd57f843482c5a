"""Compute by shape (issue 52): two models of a matrix product's time (``refdl.perf.gemm``)
fitted to DeepBench's per-shape GEMMs on the P100 and judged on the V100's (fp32, and fp16
inputs with Tensor Cores), held out by generation before any fit.

A third generation, measured here: the same 160 shapes on a lent H200 (Hopper), fp32,
TF32 and bf16 (``scripts/measure_shapes.py``, ``docs/bench/gpu/gemm-2026-11-28.json``).
The P100's figures are judged on it as they stand (``hopper ...``), and each model is
fitted again to each dtype's even rows (in the file's order) and judged on its odd ones
(``hopper fit ... odd``); with TF32 and bf16, Tensor Cores run the products, so the
aligned rows fit the figures and the others the share of the rate they keep.

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
from refdl.perf.transformer import TransformerShape  # noqa: E402

DATA = ROOT / "docs" / "published" / "gemm_deepbench.csv"
OUT = ROOT / "docs" / "bench" / "gemm_shapes.json"
DTYPE = {"fp32": ("float32", 4), "fp16": ("float16", 2)}
HOPPER = ROOT / "docs" / "bench" / "gpu" / "gemm-2026-11-28.json"
# The H200 is the H100's GH100 (132 SMs, the same clocks and Tensor Core peaks) with HBM3e
# at 4.8 TB/s (NVIDIA's H200 announcement, SC23, 2023-11-13): the h100-nvlink profile's
# peaks of each dtype, 4.8 TB/s.
HOPPER_DTYPE = {"fp32": ("float32", 4), "tf32": ("tf32", 4), "bf16": ("bfloat16", 2)}
HOPPER_BANDWIDTH = 4.8e12
ATTENTION = ROOT / "docs" / "bench" / "gpu" / "attention-2026-11-28.json"


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


def hopper_rows(path: Path) -> list[dict]:
    """The H200's measured products (``scripts/measure_shapes.py``) with its device
    figures, as ``rows_of`` gives DeepBench's."""
    d = hw.load("h100-nvlink").need_device()
    out = []
    for r in json.loads(path.read_text())["rows"]:
        if "time_ms" not in r:
            continue
        dtype, width = HOPPER_DTYPE[r["precision"]]
        dev = gemm.Device(d.peak_flops[dtype], HOPPER_BANDWIDTH, gemm.SMS[d.name])
        out.append({"precision": r["precision"], "m": r["m"], "n": r["n"], "k": r["k"],
                    "width": width, "device": dev, "seconds": r["time_ms"] / 1e3})  # fmt: skip
    return out


def alignment(rows: list[dict], least: float = 1e10) -> dict:
    """Per dtype: how many products have a dimension of no whole 16 bytes, and the median
    fraction of peak of the aligned and the other products of at least ``least`` FLOP."""
    out = {}
    for p in HOPPER_DTYPE:
        sel = [r for r in rows if r["precision"] == p]
        split = {True: [], False: []}
        for r in sel:
            flops = 2.0 * r["m"] * r["n"] * r["k"]
            if flops >= least:
                share = flops / r["seconds"] / r["device"].peak
                split[gemm.aligned(r["m"], r["n"], r["k"], r["width"])].append(share)
        out[p] = {"unaligned": sum(not gemm.aligned(r["m"], r["n"], r["k"], r["width"])
                                   for r in sel),
                  "least_flops": least,
                  "aligned_fraction_of_peak": median(split[True]),
                  "unaligned_fraction_of_peak": median(split[False])}  # fmt: skip
        print(f"{p}: {out[p]['unaligned']} of {len(sel)} products unaligned; of those of "
              f">= {least:.0e} FLOP, aligned {out[p]['aligned_fraction_of_peak']:.3f} of "
              f"peak, unaligned {out[p]['unaligned_fraction_of_peak']:.3f}")  # fmt: skip
    return out


def attention(path: Path) -> dict:
    """The fused attention core measured on the H200 beside refdl's price of it: its FLOPs
    (the full ``4 b s^2 h d`` a pass, as refdl counts them, backward twice the forward)
    at the H100 profile's ``transformer`` fraction, plus ``gemm.attention_overhead_s``
    each pass (at 4.8 TB/s)."""
    prof = hw.load("h100-nvlink")
    peak = prof.need_device().peak_flops["bfloat16"]
    frac = prof.achieved.fraction("transformer", "bfloat16")
    doc = json.loads(path.read_text())
    rows = []
    print(f"{'attention':17s} {'b':>3s} {'s':>5s} {'h':>3s} {'d':>4s} {'ms':>8s} "
          f"{'refdl ms':>9s} {'refdl/measured':>15s} {'full-count TFLOP/s':>19s}")  # fmt: skip
    for r in doc["rows"]:
        if "time_ms" not in r:
            continue
        b, s, h, d = r["batch"], r["seq"], r["heads"], r["head_dim"]
        shape = TransformerShape(layers=1, d_model=h * d, heads=h, seq=s, vocab=1)
        passes = 1 if r["pass"] == "forward" else 3
        flops = passes * 4.0 * b * s * s * h * d
        over = gemm.attention_overhead_s(shape, b * s, 2, peak, HOPPER_BANDWIDTH)
        price = flops / (peak * frac) + passes * over
        t = r["time_ms"] / 1e3
        rows.append({**{k: r[k] for k in ("pass", "batch", "seq", "heads", "head_dim")},
                     "seconds": t, "refdl_s": price, "ratio": price / t,
                     "full_count_flops_per_s": flops / t})  # fmt: skip
        print(f"{r['pass']:17s} {b:3d} {s:5d} {h:3d} {d:4d} {t * 1e3:8.3f} {price * 1e3:9.3f} "
              f"{price / t:15.2f} {flops / t / 1e12:19.0f}")  # fmt: skip
    return {"measured": str(path.relative_to(ROOT)), "transformer_fraction": frac,
            "rows": rows}  # fmt: skip


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
    print(f"{'model':9s} {'part':29s} {'rows':>5s} {'median |err|':>13s} {'90th |err|':>11s}")
    hopper = hopper_rows(HOPPER)
    doc["hopper"] = {"measured": str(HOPPER.relative_to(ROOT)), "models": {}}

    def judge(res: dict, model: str, f, name: str, sel: list[dict]) -> None:
        errs = [gemm.gemm_s(model, *key(r)[:5], f) / r["seconds"] - 1 for r in sel]
        res[name] = {"rows": len(sel), "median_abs_error": median(abs(e) for e in errs),
                     "median_error": median(errs), "p90_abs_error": tail(errs, 0.9),
                     "errors": [round(e, 4) for e in errs]}  # fmt: skip
        med, p90 = res[name]["median_abs_error"], res[name]["p90_abs_error"]
        print(f"{model:9s} {name:29s} {len(sel):5d} {100 * med:12.1f} % {100 * p90:9.1f} %")

    def figures(f) -> dict:
        return {"fraction": f.fraction, "latency_s": f.latency_s, "decay": f.decay,
                "unaligned": f.unaligned}  # fmt: skip

    for model in gemm.MODELS:
        f = gemm.fit(model, cal)
        res = {"figures": figures(f)}
        for part, sheet in (("calibration", None), ("heldout", "fp32"), ("heldout", "fp16")):
            sel = [r for r in rows if r["part"] == part and sheet in (None, r["precision"])]
            judge(res, model, f, part if sheet is None else f"{part} {sheet}", sel)
        doc["models"][model] = res
        print(
            f"{model}: fraction {f.fraction}, latency {f.latency_s * 1e6:.2f} us, decay {f.decay}"
        )
        # Hopper: the P100's figures as they stand, then figures of its own from bf16.
        hres = {}
        for p in HOPPER_DTYPE:
            judge(hres, model, f, f"hopper {p}", [r for r in hopper if r["precision"] == p])
        for p in HOPPER_DTYPE:
            sel = [r for r in hopper if r["precision"] == p]
            own = gemm.fit(model, [key(r) for r in sel[0::2]], tensor_cores=p != "fp32")
            hres[f"figures {p}"] = figures(own)
            judge(hres, model, own, f"hopper fit {p} odd", sel[1::2])
            if p != "fp32":  # the same without the alignment rule
                plain = gemm.fit(model, [key(r) for r in sel[0::2]])
                judge(hres, model, plain, f"hopper fit {p} odd, one rate", sel[1::2])
            print(
                f"{model} on Hopper's {p}, even rows: fraction {own.fraction}, "
                f"latency {own.latency_s * 1e6:.2f} us, decay {own.decay}, "
                f"unaligned {own.unaligned}"
            )
        doc["hopper"]["models"][model] = hres
    doc["hopper"]["alignment"] = alignment(hopper)
    doc["attention"] = attention(ATTENTION)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
