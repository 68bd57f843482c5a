"""Benchmark the transformer-era options side by side in one process: context parallelism
(ring, all-to-all), sequence parallelism, activation recomputation and bf16.

For the transformer (2 blocks, d_model 128) at ``--seq`` tokens: ``single`` with
``--remat none|full|selective`` and ``--precision fp32|bf16``; ``context`` on 2 and 4
devices with each attention; ``model`` on 4 with and without ``--sequence-parallel``.
Every configuration is compiled first, then run interleaved round-robin over ``--rounds``
rounds so machine noise hits all alike. Reported per configuration: the median step time,
XLA's peak memory per device (``peak_memory_bytes_per_device``), the bytes a step
communicates as the compiled program says and, where the strategy has one, as its formula
says; and the loss after the timed steps (every configuration saw the same batches).

    .venv/bin/python scripts/bench_sequence.py --out bench_out/sequence
    .venv/bin/python scripts/bench_sequence.py --seq 128 --steps 3 --rounds 1   # quick look

Writes ``OUT/bench_sequence.json`` and ``OUT/bench_sequence.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def configs() -> list[dict]:
    out = [{"strategy": "single", "devices": 1, "remat": r} for r in ("none", "full", "selective")]
    out.append({"strategy": "single", "devices": 1, "precision": "bf16"})
    for c in (2, 4):
        for cp in ("ring", "all-to-all"):
            out.append({"strategy": "context", "devices": c, "cp": cp})
    out.append({"strategy": "model", "devices": 4})
    out.append({"strategy": "model", "devices": 4, "sequence_parallel": True})
    return out


def label(c: dict) -> str:
    extra = [f"{k}={v}" for k, v in c.items() if k not in ("strategy", "devices")]
    return f"{c['strategy']}[{c['devices']}{',' + ','.join(extra) if extra else ''}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/sequence")
    ap.add_argument("--seq", type=int, default=256, help="tokens per example")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from refdl.config.spec import RunSpec
    from refdl.run.build import build
    from refdl.run.trajectory import trajectory
    from refdl.strategies.base import peak_bytes

    runs = []
    for c in configs():
        spec = RunSpec(model="transformer", batch_size=args.batch_size, progress=False,
                       data_opts=(("seq_len", str(args.seq)),), **c)  # fmt: skip
        t0 = time.perf_counter()
        run = build(spec)
        state = run.strategy.init_state(0)
        state, m = run.strategy.train_step(state, run.batch(0))  # compile and one step
        float(np.mean(m["loss"]))
        entry = {"config": c, "run": run, "state": state, "times": [], "step": 1,
                 "compile_s": time.perf_counter() - t0, "loss": None}  # fmt: skip
        runs.append(entry)
        print(f"compiled {label(c)} in {entry['compile_s']:.1f}s", file=sys.stderr)
    for r in range(args.rounds):
        for entry in runs:
            first = entry["step"]
            for out in trajectory(entry["run"], entry["state"], first, first + args.steps,
                                  per_step=True):  # fmt: skip
                entry["state"] = out.state
                entry["times"].append(out.seconds)
                entry["loss"] = float(np.mean(out.metrics["loss"]))
            entry["step"] = first + args.steps
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    results = []
    for entry in runs:
        strategy = entry["run"].strategy
        med = statistics.median(entry["times"])
        comm = getattr(strategy, "comm", {}) or {}
        analytic = getattr(strategy, "analytic_comm_bytes", None)
        results.append({
            **entry["config"],
            "label": label(entry["config"]),
            "step_time_median_s": med,
            "compile_s": entry["compile_s"],
            "peak_memory_bytes_per_device": peak_bytes(strategy.compiled_steps()),
            "comm_bytes_per_step": comm.get("total", 0),
            "comm_bytes_by_collective": {k: v for k, v in comm.items() if k != "total"},
            "comm_bytes_per_step_analytic": analytic()["total"] if analytic else None,
            "loss_after_timed_steps": entry["loss"],
        })  # fmt: skip
    base = results[0]["step_time_median_s"]
    for r in results:
        r["time_vs_single"] = r["step_time_median_s"] / base
    meta = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpus": os.cpu_count(),
        "seq": args.seq,
        "batch_size": args.batch_size,
        "timed_steps": args.steps * args.rounds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sequence.json").write_text(json.dumps({"meta": meta, "results": results},
                                                        indent=1))  # fmt: skip
    plot(results, out / "bench_sequence.png", meta)
    for r in results:
        mem = r["peak_memory_bytes_per_device"]
        ms, ratio = r["step_time_median_s"] * 1e3, r["time_vs_single"]
        formula, loss = r["comm_bytes_per_step_analytic"], r["loss_after_timed_steps"]
        peak = mem / 2**20 if mem else float("nan")
        print(
            f"{r['label']:38s} {ms:8.1f} ms  x{ratio:.2f}  peak {peak:7.1f} MiB  "
            f"{r['comm_bytes_per_step']:>10d} B/step (formula {formula})  loss {loss:.5f}"
        )
    return 0


def plot(results: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 6))
    names = [r["label"] for r in results]
    a.barh(names, [r["step_time_median_s"] * 1e3 for r in results], color="tab:blue")
    a.set_xlabel("median step time (ms)")
    b.barh(names, [(r["peak_memory_bytes_per_device"] or 0) / 2**20 for r in results],
           color="tab:orange")  # fmt: skip
    b.set_xlabel("XLA peak memory per device (MiB)")
    b.set_yticks([])
    fig.suptitle(f"transformer, seq {meta['seq']}, batch {meta['batch_size']}, "
                 f"{meta['backend']} ({meta['cpus']} cores), {meta['date']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
