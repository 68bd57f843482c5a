"""refdl as the referee of PyTorch's own parallelism: every twin of ``refdl validate``, in
fp32 and fp64, and every planted bug; one JSON of the figures docs/validation.md's table
quotes.

    .venv/bin/python scripts/bench_referee.py --steps 10 --out docs/bench/validate/referee.json

Each row: the command's flags, the PyTorch API it ran (``framework_impl``), the largest
per-step loss difference (absolute and relative), the parameters' relative L2 after the
last step, whether it passed, and the wall time. A planted bug's row must fail.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROWS = [
    ("fsdp", "transformer", ["--strategy", "fsdp", "--zero", "3", "--devices", "2"]),
    ("fsdp", "mlp", ["--strategy", "fsdp", "--zero", "2", "--devices", "2"]),
    ("fsdp", "mlp", ["--strategy", "fsdp", "--zero", "1", "--devices", "2"]),
    ("model", "transformer", ["--strategy", "model", "--devices", "2", "--sequence-parallel"]),
    ("model", "mlp", ["--strategy", "model", "--devices", "2"]),
    ("hybrid", "mlp", ["--strategy", "hybrid", "--devices", "4", "--mesh", "fsdp=2,model=2"]),
    ("hybrid", "mlp", ["--strategy", "hybrid", "--devices", "4", "--mesh", "data=2,model=2"]),
    ("hybrid", "moe", ["--strategy", "hybrid", "--devices", "4", "--mesh", "data=2,expert=2"]),
    *[("pipeline", "mlp", ["--strategy", "pipeline", "--devices", "2", "--schedule", s,
                           *(["--chunks", "2"] if s in ("interleaved", "looped-bfs") else [])])
      for s in ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv", "dualpipev")],
    ("decentralized", "mlp", ["--strategy", "decentralized", "--workers", "4", "--topology",
                              "ring"]),
    ("decentralized", "mlp", ["--strategy", "decentralized", "--workers", "4", "--topology",
                              "torus"]),
]  # fmt: skip
BUGS = [
    ("divide", "mlp", ["--strategy", "fsdp", "--zero", "2", "--devices", "2"]),
    ("rowwise", "mlp", ["--strategy", "model", "--devices", "2"]),
    ("microbatch-scale", "mlp", ["--strategy", "pipeline", "--devices", "2"]),
    ("expert-return", "moe", ["--strategy", "hybrid", "--devices", "4", "--mesh",
                              "data=2,expert=2"]),
    ("mixing", "mlp", ["--strategy", "decentralized", "--workers", "4"]),
]  # fmt: skip


def run(flags: list[str]) -> dict:
    from refdl.validate import __main__ as VM
    from refdl.validate.exact import validate

    t = time.perf_counter()
    r = validate(VM.build_parser().parse_args(["--framework", "torch", *flags]))
    keep = ("framework_impl", "strategy", "model", "steps", "precision", "optimizer",
            "loss_max_abs_diff", "loss_max_rel_diff", "param_rel_l2_diff", "worst_tensor",
            "first_failing_step", "passed", "failed", "tolerance")  # fmt: skip
    return {**{k: r[k] for k in keep}, "flags": flags, "seconds": time.perf_counter() - t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="docs/bench/validate/referee.json")
    ap.add_argument("--only", help="rows whose flags contain this word")
    args = ap.parse_args()
    rows, bugs = [], []
    for _, model, flags in ROWS:
        for precision in ("fp32", "fp64"):
            f = [*flags, "--model", model, "--steps", str(args.steps), "--precision", precision]
            if args.only and args.only not in " ".join(f):
                continue
            rows.append(run(f))
            r = rows[-1]
            print(f"{r['framework_impl'][:60]:60s} {model:12s} {precision} loss "
                  f"{r['loss_max_rel_diff']:.1e} params {r['param_rel_l2_diff']:.1e} "
                  f"{'ok' if r['passed'] else 'FAIL'}", flush=True)  # fmt: skip
    for bug, model, flags in BUGS:
        f = [*flags, "--model", model, "--steps", str(args.steps), "--plant-bug", bug]
        if args.only and args.only not in " ".join(f):
            continue
        bugs.append({"bug": bug, **run(f)})
        b = bugs[-1]
        print(f"planted {bug:17s} params {b['param_rel_l2_diff']:.1e} first failing step "
              f"{b['first_failing_step']} {'caught' if not b['passed'] else 'MISSED'}",
              flush=True)  # fmt: skip
    out = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
           "rows": rows, "planted_bugs": bugs}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["passed"] for r in rows) and not any(b["passed"] for b in bugs) else 1


if __name__ == "__main__":
    sys.exit(main())
