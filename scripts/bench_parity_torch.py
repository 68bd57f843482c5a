"""The parity rule on PyTorch's own parallelism (issue 50): PyTorch's DDP, FSDP2, DTensor
TP and pipelining runs judged against PyTorch's single-process run of the same start and
batches, from the two loss curves alone (``refdl.validate.parity.judge``, refdl's
measured envelope, as ``refdl validate --results TEST --control CONTROL`` judges logs).

The mlp, the transformer (FSDP2; DTensor TP with SequenceParallel; Adam, and SGD for one
bug) and the MoE (experts over all_to_all_single). Healthy pairs must pass; PyTorch's
twins with a real bug planted (``refdl validate --plant-bug``: FSDP2's gradients summed,
a RowwiseParallel left out, a stage's loss not scaled, tokens sent back to the wrong
rank) must depart. Two settings,
as ``bench_parity.py``'s: the same seed with one control (refdl's fp32 envelope), and
the test from another seed with two controls of two more seeds. The envelope was set on
refdl's own pairs (``bench_parity.py``, seed 0); every pair here is held out. The twins
run fp32 (and fp64) only: no bf16 pair. Writes ``docs/bench/parity/torch.json``.

    .venv/bin/python scripts/bench_parity_torch.py     # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench" / "parity" / "torch.json"
# name: (model, refdl strategy whose PyTorch twin runs, devices, its options, planted bug)
HEALTHY = {
    "DDP d=2": ("mlp", "data", 2, {}, None),
    "FSDP2 fully_shard zero=3 d=2": ("mlp", "fsdp", 2, {"zero": 3}, None),
    "DTensor TP t=2": ("mlp", "model", 2, {}, None),
    "pipelining Schedule1F1B p=2": ("mlp", "pipeline", 2, {"microbatches": 4}, None),
    "transformer FSDP2 zero=3 d=2": ("transformer", "fsdp", 2, {"zero": 3}, None),
    "transformer DTensor TP + SequenceParallel t=2": (
        "transformer", "model", 2, {"sequence_parallel": True}, None),
    "MoE data=2 x expert=2 (all_to_all_single)": (
        "moe", "hybrid", 4, {"mesh": "data=2,expert=2"}, None),
}  # fmt: skip
BUGGY = {
    "FSDP2 gradients summed (divide)": ("mlp", "fsdp", 2, {"zero": 2}, "divide"),
    "TP RowwiseParallel left out (rowwise)": ("mlp", "model", 2, {}, "rowwise"),
    "pipelining loss not scaled (microbatch-scale)": ("mlp", "pipeline", 2,
                                                      {"microbatches": 4}, "microbatch-scale"),
    "transformer FSDP2 gradients summed (divide)": ("transformer", "fsdp", 2, {"zero": 3},
                                                    "divide"),
    "transformer (SGD) FSDP2 gradients summed (divide)": ("transformer sgd", "fsdp", 2,
                                                          {"zero": 3}, "divide"),
    "MoE tokens back to the wrong rank (expert-return)": (
        "moe", "hybrid", 4, {"mesh": "data=2,expert=2"}, "expert-return"),
}  # fmt: skip
# the runs' settings besides the layout, by the name the tables use (the transformer trains
# with Adam unless told: Adam's step does not see a gradient scaled by a constant)
FAMILIES = {"mlp": {"model": "mlp"}, "transformer": {"model": "transformer"},
            "transformer sgd": {"model": "transformer", "optimizer": "sgd"},
            "moe": {"model": "moe"}}  # fmt: skip
# another seed: the test from seed + ANOTHER, judged against the control of the seed and a
# second control of seed + SECOND (the rule's noise is then the controls' difference)
ANOTHER, SECOND = 100, 200


def losses(family: str, seed: int, steps: int, strategy: str, devices: int, opts: dict,
           bug: str | None) -> list[float]:  # fmt: skip
    """PyTorch's per-step losses of ``strategy``'s twin (``single``: plain PyTorch) on
    refdl's start and batches of ``seed``."""
    from refdl.config.spec import RunSpec
    from refdl.validate.exact import reference_run, torch_run

    spec = RunSpec(strategy=strategy, steps=steps, seed=seed, progress=False,
                   devices=devices, **FAMILIES[family], **opts)  # fmt: skip
    ref = reference_run(spec)
    return torch_run(ref, strategy, devices, 0.0, 900, bug=bug).losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--models", default=",".join(FAMILIES), help="of " + ", ".join(FAMILIES))
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    import numpy as np

    from refdl.validate import parity

    t0 = time.perf_counter()
    rows, models = [], a.models.split(",")
    steps = np.arange(1, a.steps + 1)

    def curve(model: str, seed: int, strategy: str = "single", devices: int = 1,
              opts: dict | None = None, bug: str | None = None) -> Any:  # fmt: skip
        found = losses(model, seed, a.steps, strategy, devices, opts or {}, bug)
        return parity.Curve(steps, np.asarray(found))

    cases = [(kind, name, case) for kind, table in (("healthy", HEALTHY), ("bug", BUGGY))
             for name, case in table.items()]  # fmt: skip
    for seed in (int(s) for s in a.seeds.split(",")):
        for model in models:
            control, second = curve(model, seed), curve(model, seed + SECOND)
            for kind, name, (m, strategy, devices, opts, bug) in cases:
                if m != model:
                    continue
                for setting, test_seed, controls in (("same seed", seed, [control]),
                                                     ("another seed", seed + ANOTHER,
                                                      [control, second])):  # fmt: skip
                    test = curve(m, test_seed, strategy, devices, opts, bug)
                    r = parity.judge(test, controls, "fp32")
                    w = r["first_departing_window"]
                    rows.append({"seed": seed, "model": m, "kind": kind, "pair": name,
                                 "setting": setting, "passed": r["passed"], "z_max": r["z_max"],
                                 "how": r["how"],
                                 "detected_at": None if w is None else w["last_step"]})  # fmt: skip
                    print(f"seed {seed} {setting} {kind} {name}: passed {r['passed']} z_max "
                          f"{r['z_max']:.3g} ({time.perf_counter() - t0:.0f} s)",
                          flush=True)  # fmt: skip
    summary: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1)}
    for setting in ("same seed", "another seed"):
        healthy = [r for r in rows if r["kind"] == "healthy" and r["setting"] == setting]
        bugs = [r for r in rows if r["kind"] == "bug" and r["setting"] == setting]
        summary[setting] = {
            "false_alarms": sum(not r["passed"] for r in healthy), "healthy": len(healthy),
            "detected": sum(not r["passed"] for r in bugs), "bugs": len(bugs),
            "by_pair": {name: f"{sum(not r['passed'] for r in rows_of)} of {len(rows_of)} "
                              f"{'depart' if rows_of[0]['kind'] == 'bug' else 'false alarms'}"
                        for name in {**HEALTHY, **BUGGY}
                        if (rows_of := [r for r in healthy + bugs if r["pair"] == name])},
        }  # fmt: skip
    doc = {"command": " ".join(["python", "scripts/bench_parity_torch.py",
                                *(argv or sys.argv[1:])]),
           "date": datetime.date.today().isoformat(), "steps": a.steps, "models": models,
           "rule": parity.rule_fingerprint(), "summary": summary, "pairs": rows}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
