"""Validate TensorFlow and MXNet against refdl on every case their adapters cover.

Runs ``python -m refdl.validate --framework F ... --steps N --json`` for each
case below, one after another, and writes each report (``F_strategy_model.json``)
and the table of ``docs/validation.md`` (``table.md``).

    .venv/bin/python scripts/bench_frameworks.py --out docs/bench/frameworks
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    ("tensorflow", "single", "mlp", []),
    ("tensorflow", "single", "lenet5", []),
    ("tensorflow", "single", "lstm_lm", []),
    ("tensorflow", "data", "mlp", ["--devices", "2"]),
    ("tensorflow", "data", "lenet5", ["--devices", "2"]),
    ("tensorflow", "data", "mlp", ["--workers", "2"]),
    ("tensorflow", "ps", "mlp", ["--ps-mode", "async", "--workers", "2"]),
    ("tensorflow", "ps", "lenet5", ["--ps-mode", "async", "--workers", "2"]),
    ("mxnet", "single", "mlp", []),
    ("mxnet", "single", "lenet5", []),
    ("mxnet", "data", "mlp", ["--devices", "2"]),
    ("mxnet", "data", "lenet5", ["--devices", "2"]),
    ("mxnet", "ps", "mlp", ["--ps-mode", "sync", "--workers", "2"]),
    ("mxnet", "ps", "lenet5", ["--ps-mode", "sync", "--workers", "2"]),
    ("mxnet", "ps", "mlp", ["--ps-mode", "async", "--workers", "2"]),
    ("mxnet", "ps", "lenet5", ["--ps-mode", "async", "--workers", "2"]),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/frameworks")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sync_rows, async_rows = [], []
    for fw, strategy, model, extra in CASES:
        cmd = [sys.executable, "-m", "refdl.validate", "--framework", fw, "--strategy", strategy,
               "--model", model, "--steps", str(args.steps), *extra, "--json"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if not proc.stdout.strip():
            print(f"{fw} {strategy} {model}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
            continue
        r = json.loads(proc.stdout)
        tag = "_".join([fw, strategy, model, *[e.strip("-") for e in extra]])
        (out / f"{tag}.json").write_text(json.dumps(r, indent=1))
        print(f"{tag}: {'PASSED' if r['passed'] else 'FAILED'}", file=sys.stderr)
        (async_rows if r.get("ps_mode") == "async" else sync_rows).append(r)
    lines = [
        f"`.venv/bin/python scripts/bench_frameworks.py --out docs/bench/frameworks` "
        f"({time.strftime('%Y-%m-%d')}, {args.steps} steps):",
        "",
        "| framework | how | model | first loss | params after 1 update | loss, all steps "
        "| params, all steps | passed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sync_rows:
        c = r["checks"]
        first = f"{c['first_update_param_rel_l2']:.1e}"
        lines.append(f"| {r['framework']} | {r['framework_impl']} | {r['model']} | "
                     f"{c['first_loss_rel']:.1e} | {first} | {c['loss_rel']:.1e} | "
                     f"{c['param_rel_l2']:.1e} | {r['passed']} |")  # fmt: skip
    lines += [
        "",
        "| framework | how | model | test accuracy (refdl async / sync) | samples/s "
        "| staleness (updates) | passed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in async_rows:
        a = r["test_accuracy"]
        lines.append(f"| {r['framework']} | {r['framework_impl']} | {r['model']} | "
                     f"{a['framework']:.3f} ({a['refdl_async']:.3f} / {a['refdl_sync']:.3f}) | "
                     f"{r['samples_per_s']['framework']:.0f} | "
                     f"{r['staleness_histogram']['framework']} | {r['passed']} |")  # fmt: skip
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
