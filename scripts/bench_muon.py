"""Muon measured (issue 51): does it train, and what does each way of distributing it cost.

1. Training: the transformer, 300 steps, ``--optimizer muon`` at several learning rates
   against the model's own Adam run; each run's test loss (``refdl.fit``'s summary).
2. fsdp's schemes (``--muon gather|owner``, ZeRO 1 and 3, 4 devices): the compiled step's
   bytes beside ``refdl.parallel.muon``'s formula, the Newton-Schulz FLOPs each rank runs
   (counted from the matrices: XLA's static count includes the owner's ``cond`` branch on
   every rank, so it cannot show the saving), XLA's FLOP count and temporary memory per
   device and the peak of its buffer assignment (arguments + outputs - donated +
   temporaries), and the step time on this machine (4 simulated devices on 2 CPU cores: a
   ratio, not a GPU figure).

Writes ``docs/bench/muon/muon.json`` and ``muon.png``.

    .venv/bin/python scripts/bench_muon.py          # ~10 min on 2 cores
    .venv/bin/python scripts/bench_muon.py --quick  # 30 steps, one learning rate
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from refdl.parallel.processes import simulate_devices

simulate_devices(8)  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402

import refdl  # noqa: E402
from refdl.core.optim import muon_dims  # noqa: E402
from refdl.perf.muon import ns_flops  # noqa: E402
from refdl.run.build import build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench" / "muon"
MUON_LRS = (1e-3, 3e-3, 1e-2, 3e-2)


def train(steps: int, **kw: Any) -> dict[str, Any]:
    """One ``refdl.fit`` of the transformer; its test loss and time."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        s = refdl.fit(refdl.RunSpec(model="transformer", steps=steps, progress=False,
                                    eval_every=steps, **kw), Path(tmp) / "run")  # fmt: skip
        return {**kw, "test_loss": s["test_loss"], "final_train_loss": s["final_train_loss"],
                "seconds": time.perf_counter() - t0}  # fmt: skip


def scheme(zero: int, name: str, steps: int) -> dict[str, Any]:
    """fsdp's ``name`` scheme at ZeRO ``zero``: bytes, FLOPs, memory, time per step."""
    spec = refdl.RunSpec(strategy="fsdp", model="transformer", optimizer="muon", zero=zero,
                         devices=4, muon=name, progress=False, steps=steps)  # fmt: skip
    run = build(spec)
    s = run.strategy
    cost = s._step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = s._step.memory_analysis()  # XLA's buffer assignment for one device's step
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)  # fmt: skip
    state = s.init_state(0)
    batches = [run.batch(i) for i in range(steps)]
    state, _ = s.train_step(state, batches[0])  # warm: the program is compiled already
    t0 = time.perf_counter()
    for b in batches[1:]:
        state, _ = s.train_step(state, b)
    jax.block_until_ready(state)
    dims = jax.tree_util.tree_flatten_with_path(
        muon_dims(run.task.logical_axes)(run.task.abstract_state().params),
        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers),
    )[0]
    per_matrix = {}
    for path, d in dims:
        key = jax.tree_util.keystr(path)
        if d is not None:
            shape = s.muon_matrices[key]
            fan_in = int(np.prod([shape[i] for i in d.reduction_axis]))
            fan_out = int(np.prod([shape[i] for i in d.output_axis]))
            per_matrix[key] = np.prod(shape) // (fan_in * fan_out) * ns_flops(fan_in, fan_out)
    load = [0.0] * s.p
    for key, flops in per_matrix.items():
        load[s.owner[key]] += flops
    ns_rank = sum(per_matrix.values()) if name == "gather" else max(load)
    return {
        "zero": zero,
        "scheme": name,
        "ns_flops_per_rank": float(ns_rank),
        "ns_flops_all_matrices": float(sum(per_matrix.values())),
        "comm_bytes_measured": s.comm.get("total"),
        "comm_bytes_analytic": s.analytic_comm_bytes(),
        "muon_bytes_analytic": s.muon_bytes(),
        "muon_matrices": len(s.muon_matrices),
        "flops_per_device": float(cost.get("flops", 0.0)),
        "temp_bytes_per_device": s.temp_bytes,
        # arguments (the state's shards, the batch) + outputs - donated + temporaries
        "peak_bytes_per_device": int(peak),
        "seconds_per_step": (time.perf_counter() - t0) / max(len(batches) - 1, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    steps = 30 if args.quick else 300
    t0 = time.perf_counter()
    runs = [train(steps, optimizer="adam")]
    for lr in MUON_LRS[2:3] if args.quick else MUON_LRS:
        runs.append(train(steps, optimizer="muon", lr=lr))
        print(f"muon lr {lr}: test loss {runs[-1]['test_loss']:.4f} (adam "
              f"{runs[0]['test_loss']:.4f})", file=sys.stderr, flush=True)  # fmt: skip
    schemes = []
    for zero in (1, 3):
        for name in ("gather", "owner"):
            schemes.append(scheme(zero, name, 6 if args.quick else 21))
            r = schemes[-1]
            ms = r["seconds_per_step"] * 1e3
            print(f"zero {zero} {name}: {r['comm_bytes_measured']} B (analytic "
                  f"{r['comm_bytes_analytic']}), Newton-Schulz {r['ns_flops_per_rank']:.3g} "
                  f"flop/rank, {ms:.0f} ms/step", file=sys.stderr, flush=True)  # fmt: skip
    adam = runs[0]["test_loss"]
    best = min(runs[1:], key=lambda r: r["test_loss"])
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python scripts/bench_muon.py" + (" --quick" if args.quick else ""),
        "machine": "2-core CPU, 8 simulated devices",
        "steps": steps,
        "training": runs,
        "muon_beats_adam": best["test_loss"] < adam,
        "best_muon_lr": best["lr"],
        "schemes": schemes,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "muon_quick.json" if args.quick else "muon.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    if not args.quick:
        plot(result, out / "muon.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("training", "schemes")}))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    """Test loss by learning rate (Adam's as a line); the schemes' bytes and FLOPs."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    muon = [r for r in result["training"] if r["optimizer"] == "muon"]
    ax1.plot([r["lr"] for r in muon], [r["test_loss"] for r in muon], "o-", label="Muon")
    ax1.axhline(result["training"][0]["test_loss"], color="gray", ls="--",
                label="Adam (the model's learning rate)")  # fmt: skip
    ax1.set_xscale("log")
    ax1.set_xlabel("learning rate (Muon's matrices and AdamW's rest)")
    ax1.set_ylabel(f"test loss after {result['steps']} steps")
    ax1.legend(fontsize=8)
    ax1.set_title("the transformer on the embedded text", fontsize=9)
    labels = [f"ZeRO {r['zero']}\n{r['scheme']}" for r in result["schemes"]]
    x = np.arange(len(labels))
    ax2.bar(x - 0.2, [r["comm_bytes_measured"] / 1e6 for r in result["schemes"]], 0.4,
            label="bytes per step, all ranks (MB)")  # fmt: skip
    ax2.bar(x + 0.2, [r["ns_flops_per_rank"] / 1e8 for r in result["schemes"]], 0.4,
            label="Newton-Schulz FLOPs per rank (1e8)")  # fmt: skip
    ax2.set_xticks(x, labels, fontsize=8)
    ax2.legend(fontsize=8)
    ax2.set_title("fsdp's Muon schemes, 4 devices (bytes: the compiled step)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
