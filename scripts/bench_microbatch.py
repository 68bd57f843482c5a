"""A microbatch's price on one device (issue 52): refdl's own transformer steps timed on a
lent GPU (``scripts/bench_gpu.py --only sweep,microbatch``) beside ``refdl predict``'s
step and 80 % interval for the same shape, batch and sequence.

- ``sweep``: a whole step (forward, backward, Adam) at each batch;
- ``microbatch``: one microbatch of a gradient-accumulated step (forward, backward, the
  gradients added to an fp32 buffer; no optimizer), what a pipeline or accumulation
  repeats per microbatch.

For each shape, a line ``t = fixed + per_sequence x batch`` is fitted to the measured
and to the predicted times (least squares), so the per-microbatch constant and the
per-sequence rate are set side by side; nothing here is fitted back into refdl.
Predictions use ``--hw h100-nvlink`` (the H200 measured is the H100's GH100 with faster
memory; refdl has no H200 profile).

    .venv/bin/python scripts/bench_microbatch.py [docs/bench/gpu/gpu_steps-2026-11-28.json]

Writes ``docs/bench/microbatch_price.json`` and prints the table (~2 s on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from refdl import predict  # noqa: E402

RESULTS = ROOT / "docs" / "bench" / "gpu" / "gpu_steps-2026-11-28.json"
OUT = ROOT / "docs" / "bench" / "microbatch_price.json"
HW = "h100-nvlink"
VOCAB = 50257  # bench_gpu.py's synthetic tokens


def predicted(case: dict) -> dict:
    """``refdl predict``'s single-device step for the case's shape and batch."""
    shape = (f"layers={case['layers']},d_model={case['d_model']},heads={case['heads']},"
             f"ffn={4 * case['d_model']},vocab={VOCAB},positions=1")  # fmt: skip
    argv = ["--hw", HW, "--strategy", "single", "--workers", "1", "--model-shape", shape,
            "--seq-len", str(case["seq_len"]), "--batch-size", str(case["batch"]),
            "--precision", "bf16", "--optimizer", "adam", "--json"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = predict.main(argv)
    if rc != 0:
        raise SystemExit(f"bench_microbatch: predict {' '.join(argv)}: {err.getvalue()}")
    got = json.loads(out.getvalue())
    got = got[0] if isinstance(got, list) else got
    return {"command": "refdl predict " + " ".join(argv), "step_time_s": got["step_time_s"],
            "low_s": got["step_time_low_s"], "high_s": got["step_time_high_s"],
            "compute_shape_s": got["compute_shape_s"], "params": got["params"]}  # fmt: skip


def line(points: list[tuple[float, float]]) -> tuple[float, float, float | None]:
    """Least-squares ``(fixed, per_sequence, fixed's standard error)`` of ``t = fixed +
    per_sequence x batch`` (the error from the residuals; None through two points)."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx
    fixed = my - slope * mx
    if n < 3:
        return fixed, slope, None
    rss = sum((t - fixed - slope * b) ** 2 for b, t in points)
    return fixed, slope, math.sqrt(rss / (n - 2) * (1 / n + mx * mx / sxx))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    doc = json.loads(a.results.read_text())
    cases = [c for c in doc["cases"]
             if c["group"] in ("sweep", "microbatch") and c.get("step_time_s")]  # fmt: skip
    rows = []
    print(f"{'group':10s} {'shape':9s} {'batch':>5s} {'measured ms':>11s} "
          f"{'predicted ms [80 %]':>26s} {'err':>7s} inside")  # fmt: skip
    for c in cases:
        p = predicted(c)
        t = c["step_time_s"]
        row = {"group": c["group"], "model": c["model"], "batch": c["batch"],
               "measured_s": t, **p, "error": p["step_time_s"] / t - 1,
               "inside": p["low_s"] <= t <= p["high_s"]}  # fmt: skip
        rows.append(row)
        print(f"{c['group']:10s} {c['model']:9s} {c['batch']:5d} {t * 1e3:11.2f} "
              f"{p['step_time_s'] * 1e3:8.2f} [{p['low_s'] * 1e3:7.2f}, {p['high_s'] * 1e3:7.2f}] "
              f"{100 * row['error']:+6.1f}% {row['inside']}")  # fmt: skip
    lines = []
    for group in ("sweep", "microbatch"):
        for model in dict.fromkeys(r["model"] for r in rows if r["group"] == group):
            sel = sorted((r for r in rows if r["group"] == group and r["model"] == model),
                         key=lambda r: r["batch"])  # fmt: skip
            if len(sel) < 2:
                continue
            mf, ms, se = line([(r["batch"], r["measured_s"]) for r in sel])
            pf, ps, _ = line([(r["batch"], r["step_time_s"]) for r in sel])
            first, last = sel[0], sel[-1]

            def ratio(k: str, first=first, last=last) -> float:
                """A sequence's time at the first batch over that at the last."""
                return (first[k] / first["batch"]) / (last[k] / last["batch"])

            lines.append({"group": group, "model": model,
                          "batches": [r["batch"] for r in sel],
                          "measured_fixed_s": mf, "measured_fixed_se_s": se,
                          "measured_per_sequence_s": ms,
                          "predicted_fixed_s": pf, "predicted_per_sequence_s": ps,
                          "measured_ratio_first_to_last": ratio("measured_s"),
                          "predicted_ratio_first_to_last": ratio("step_time_s")})  # fmt: skip
            pm = f" +- {se * 1e3:.2f}" if se is not None else ""
            print(f"{group:10s} {model:9s} fixed {mf * 1e3:5.2f}{pm} ms measured, "
                  f"{pf * 1e3:5.2f} predicted; per sequence {ms * 1e3:6.2f} / {ps * 1e3:6.2f} ms; "
                  f"a sequence at batch {first['batch']} over batch {last['batch']}: "
                  f"{ratio('measured_s'):.3f} measured, "
                  f"{ratio('step_time_s'):.3f} predicted")  # fmt: skip
    inside = sum(r["inside"] for r in rows)
    errs = [abs(r["error"]) for r in rows]
    summary = {"cases": len(rows), "inside": inside,
               "median_abs_error": statistics.median(errs) if errs else None}  # fmt: skip
    print(
        f"{inside} of {len(rows)} inside predict's 80 % interval; "
        f"median |error| {100 * summary['median_abs_error']:.1f} %"
    )
    result = {"command": "python scripts/bench_microbatch.py " + " ".join(argv or sys.argv[1:]),
              "results": str(a.results.resolve().relative_to(ROOT))
              if a.results.resolve().is_relative_to(ROOT) else str(a.results),
              "device": doc["device"], "measured": doc["date"], "hw": HW,
              "summary": summary, "lines": lines, "rows": rows}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
