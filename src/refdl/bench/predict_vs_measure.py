"""``python -m refdl.bench predict-vs-measure``: hold the performance model against this machine.

Each configuration runs here - the SPMD strategies and the pipeline on simulated
CPU devices in this process, ``ps`` and ``decentralized`` (with ``--mpi``) as
real ``mpirun`` jobs - and its median step time is set beside the prediction
of the ``local`` profile (``refdl.hw calibrate``) for the same model, strategy,
batch and worker count. The error is ``(predicted - measured) / measured``.
Configurations run interleaved, ``--rounds`` times each, and the median of all
timed steps is kept, so a noisy moment of the machine does not hit one
configuration only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SPMD = (
    ("single", 1, {}),
    ("data", 2, {}),
    ("data", 4, {}),
    ("model", 2, {}),
    ("pipeline", 2, {"microbatches": 4}),
)
MPI = (
    ("ps", 3, {}),
    ("decentralized", 4, {}),
)
MODELS = ("mlp", "lenet5")


def measure_in_process(
    model: str, strategy: str, devices: int, kw: dict, steps: int
) -> list[float]:
    """Step times of ``steps`` steps after 3 warm-up steps, in this process."""
    import jax

    from refdl.loop import build, global_batch
    from refdl.spec import RunSpec

    run = build(RunSpec(strategy=strategy, model=model, devices=devices, progress=False, **kw))
    state = run.strategy.init_state(0)
    times = []
    for t in range(3 + steps):
        batch = global_batch(run, t)
        t0 = time.perf_counter()
        state, metrics = run.strategy.train_step(state, batch)
        jax.block_until_ready((state, metrics["loss"]))
        if t >= 3:
            times.append(time.perf_counter() - t0)
    return times


def measure_mpi(model: str, strategy: str, ranks: int, steps: int) -> list[float]:
    """Median step time of an ``mpirun`` job (rank 0's summary), as a one-element list."""
    from refdl import dist

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["-m", "refdl.train", "--strategy", strategy, "--model", model,
                "--steps", str(steps + 3), "--batch-size", "60", "--eval-every", "0",
                "--checkpoint-every", "0", "--no-progress", "--out", tmp]  # fmt: skip
        proc = subprocess.run(
            dist.mpirun_command(ranks, argv),
            capture_output=True,
            text=True,
            timeout=600,
            env=dist.mpirun_env(),
        )
        if proc.returncode != 0:
            raise RuntimeError(f"mpirun {strategy} failed: {proc.stderr[-2000:]}")
        return [json.loads((Path(tmp) / "summary.json").read_text())["step_time_median_s"]]


def predict(model: str, strategy: str, workers: int, batch: int, kw: dict) -> dict[str, Any]:
    from refdl.perf import PredictOptions
    from refdl.predict import predict_steps

    opts = PredictOptions(
        microbatches=kw.get("microbatches", 4),
        link="inter" if strategy in ("ps", "decentralized") else None,
        servers=1,
    )
    w = workers - 1 if strategy == "ps" else workers  # ps: one rank is the server
    return predict_steps("local", strategy, model, batch, [w], "strong", opts)[0]


def run(rounds: int, steps: int, with_mpi: bool) -> dict[str, Any]:
    configs = [(m, s, d, kw) for m in MODELS for s, d, kw in SPMD]
    times: dict[tuple, list[float]] = {c[:3]: [] for c in configs}
    for r in range(rounds):
        for model, strategy, devices, kw in configs:
            print(f"round {r + 1}/{rounds}: {model} {strategy} x{devices}", file=sys.stderr)
            times[(model, strategy, devices)] += measure_in_process(
                model, strategy, devices, kw, steps
            )
    if with_mpi:
        for model in MODELS:
            for strategy, ranks, kw in MPI:
                print(f"mpirun: {model} {strategy} -n {ranks}", file=sys.stderr)
                configs.append((model, strategy, ranks, kw))
                times[(model, strategy, ranks)] = measure_mpi(model, strategy, ranks, steps)
    rows = []
    for model, strategy, devices, kw in configs:
        batch = 60 if strategy in ("ps", "decentralized") else 64
        p = predict(model, strategy, devices, batch, kw)
        measured = statistics.median(times[(model, strategy, devices)])
        rows.append(
            {
                "model": model,
                "strategy": strategy,
                "workers": devices,
                "measured_s": measured,
                "predicted_s": p["step_time_s"],
                "predicted_compute_s": p["compute_s"],
                "predicted_comm_s": p["comm_s"],
                "predicted_bubble_s": p["bubble_s"],
                "error": (p["step_time_s"] - measured) / measured,
            }
        )
    errors = [abs(r["error"]) for r in rows]
    return {
        "profile": "local",
        "rows": rows,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "rounds": rounds,
        "steps_per_round": steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m refdl.bench predict-vs-measure", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mpi", action="store_true", help="also ps and decentralized under mpirun")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    result = run(args.rounds, args.steps, args.mpi)
    print(f"{'model':8s} {'strategy':14s} {'P':>2s} {'measured ms':>12s} {'predicted ms':>13s} "
          f"{'error':>7s}")  # fmt: skip
    for r in result["rows"]:
        print(
            f"{r['model']:8s} {r['strategy']:14s} {r['workers']:2d} {r['measured_s'] * 1e3:12.3f} "
            f"{r['predicted_s'] * 1e3:13.3f} {r['error']:+7.0%}"
        )
    print(f"median |error| {result['median_abs_error']:.0%}, max {result['max_abs_error']:.0%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def configure() -> None:
    """Simulated devices for the in-process configurations (before JAX starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
