"""The parity rule on PyTorch's own parallelism (issue 50): PyTorch's DDP, FSDP2, DTensor
TP and pipelining runs judged against PyTorch's single-process run of the same start and
batches, from the two loss curves alone (``refdl.validate.parity.judge``, refdl's
measured envelope, as ``refdl validate --results TEST --control CONTROL`` judges logs).

Healthy pairs must pass; PyTorch's twins with a real bug planted (``refdl validate
--plant-bug``: FSDP2's gradients summed, a RowwiseParallel left out, a stage's loss not
scaled) must depart. The envelope was set on refdl's own pairs (``bench_parity.py``,
seed 0); every pair here is held out. Writes ``docs/bench/parity/torch.json``.

    .venv/bin/python scripts/bench_parity_torch.py     # ~5 min on 2 cores
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

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench" / "parity" / "torch.json"
# name: (refdl strategy whose PyTorch twin runs, devices, its options, planted bug)
HEALTHY = {
    "DDP d=2": ("data", 2, {}, None),
    "FSDP2 fully_shard zero=3 d=2": ("fsdp", 2, {"zero": 3}, None),
    "DTensor TP t=2": ("model", 2, {}, None),
    "pipelining Schedule1F1B p=2": ("pipeline", 2, {"microbatches": 4}, None),
}
BUGGY = {
    "FSDP2 gradients summed (divide)": ("fsdp", 2, {"zero": 2}, "divide"),
    "TP RowwiseParallel left out (rowwise)": ("model", 2, {}, "rowwise"),
    "pipelining loss not scaled (microbatch-scale)": ("pipeline", 2, {"microbatches": 4},
                                                      "microbatch-scale"),
}  # fmt: skip


def losses(seed: int, steps: int, strategy: str, devices: int, opts: dict,
           bug: str | None) -> list[float]:  # fmt: skip
    """PyTorch's per-step losses of ``strategy``'s twin (``single``: plain PyTorch) on
    refdl's start and batches of ``seed``."""
    from refdl.config.spec import RunSpec
    from refdl.validate.exact import reference_run, torch_run

    spec = RunSpec(strategy=strategy, model="mlp", steps=steps, seed=seed, progress=False,
                   devices=devices, **opts)  # fmt: skip
    ref = reference_run(spec)
    return torch_run(ref, strategy, devices, 0.0, 600, bug=bug).losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    import numpy as np

    from refdl.validate import parity

    t0 = time.perf_counter()
    rows = []
    for seed in (int(s) for s in a.seeds.split(",")):
        steps = np.arange(1, a.steps + 1)
        control = parity.Curve(steps, np.asarray(losses(seed, a.steps, "single", 1, {}, None)))
        for kind, table in (("healthy", HEALTHY), ("bug", BUGGY)):
            for name, (strategy, devices, opts, bug) in table.items():
                test = parity.Curve(steps, np.asarray(losses(seed, a.steps, strategy, devices,
                                                             opts, bug)))  # fmt: skip
                r = parity.judge(test, [control], "fp32")
                w = r["first_departing_window"]
                rows.append({"seed": seed, "kind": kind, "pair": name, "passed": r["passed"],
                             "z_max": r["z_max"], "how": r["how"],
                             "detected_at": None if w is None else w["last_step"]})  # fmt: skip
                print(f"seed {seed} {kind} {name}: passed {r['passed']} z_max "
                      f"{r['z_max']:.3g}", flush=True)  # fmt: skip
    healthy = [r for r in rows if r["kind"] == "healthy"]
    bugs = [r for r in rows if r["kind"] == "bug"]
    summary = {"false_alarms": sum(not r["passed"] for r in healthy), "healthy": len(healthy),
               "detected": sum(not r["passed"] for r in bugs), "bugs": len(bugs),
               "seconds": time.perf_counter() - t0}  # fmt: skip
    doc = {"command": " ".join(["python", "scripts/bench_parity_torch.py",
                                *(argv or sys.argv[1:])]),
           "date": datetime.date.today().isoformat(), "steps": a.steps, "model": "mlp",
           "rule": parity.rule_fingerprint(), "summary": summary, "pairs": rows}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
