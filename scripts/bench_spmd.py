"""Benchmark the SPMD strategies side by side in one process: step time and samples/s.

For lenet5 and mlp on digits: ``single``; ``data`` on 2, 4, 8 devices with each
allreduce algorithm; ``model`` on 2, 4, 8; ``hybrid`` on 4 (2x2) and 8 (2x4, 4x2)
simulated CPU devices. Every configuration runs in this one process, interleaved
round-robin over ``--rounds`` rounds so machine noise hits all of them alike;
the reported step time is the median over all timed steps.

    .venv/bin/python scripts/bench_spmd.py --out bench_out/spmd          # JSON + PNG
    .venv/bin/python scripts/bench_spmd.py --steps 5 --rounds 1 --models mlp  # quick look

Writes ``OUT/bench_spmd.json`` and ``OUT/bench_spmd.png``.
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


def configs(model: str) -> list[dict]:
    out = [{"strategy": "single", "devices": 1}]
    for p in (2, 4, 8):
        for algo in ("xla", "ring", "tree", "halving-doubling"):
            out.append({"strategy": "data", "devices": p, "allreduce": algo})
    for p in (2, 4, 8):
        out.append({"strategy": "model", "devices": p})
    for mesh in ("data=2,model=2", "data=2,model=4", "data=4,model=2"):
        d, m = (int(x.split("=")[1]) for x in mesh.split(","))
        out.append({"strategy": "hybrid", "devices": d * m, "mesh": mesh})
    return [{"model": model, **c} for c in out]


def label(c: dict) -> str:
    extra = c.get("allreduce") or c.get("mesh") or ""
    return f"{c['strategy']}[{c['devices']}{',' + extra if extra else ''}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/spmd")
    ap.add_argument("--models", default="lenet5,mlp")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from refdl.config.spec import RunSpec
    from refdl.run.build import build
    from refdl.run.trajectory import trajectory

    runs = []
    for model in args.models.split(","):
        for c in configs(model):
            spec = RunSpec(batch_size=args.batch_size, progress=False, **c)
            run = build(spec)
            state = run.strategy.init_state(0)
            t0 = time.perf_counter()
            state, m = run.strategy.train_step(state, run.batch(0))  # compile
            float(np.mean(m["loss"]))
            runs.append(
                {
                    "config": c,
                    "run": run,
                    "state": state,
                    "times": [],
                    "compile_s": time.perf_counter() - t0,
                    "step": 1,
                }
            )
            print(f"compiled {model} {label(c)} in {runs[-1]['compile_s']:.1f}s", file=sys.stderr)
    for r in range(args.rounds):
        for entry in runs:
            run = entry["run"]
            first = entry["step"]
            for out in trajectory(run, entry["state"], first, first + args.steps, per_step=True):
                entry["state"] = out.state
                entry["times"].append(out.seconds)
            entry["step"] = first + args.steps
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    results = []
    for entry in runs:
        med = statistics.median(entry["times"])
        summary = entry["run"].strategy.summary({"loss": [], "step_time_s": entry["times"]})
        results.append(
            {
                **entry["config"],
                "label": label(entry["config"]),
                "step_time_median_s": med,
                "samples_per_second": args.batch_size / med,
                "compile_s": entry["compile_s"],
                "comm_bytes_per_step": summary.get("comm_bytes_per_step", 0),
            }
        )
    for model in args.models.split(","):
        base = next(r for r in results if r["model"] == model and r["strategy"] == "single")
        for r in results:
            if r["model"] == model:
                r["speedup_vs_single"] = base["step_time_median_s"] / r["step_time_median_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "jax": jax.__version__,
        "devices": len(jax.devices()),
        "cpus": os.cpu_count(),
        "batch_size": args.batch_size,
        "timed_steps": args.steps * args.rounds,
    }
    (out / "bench_spmd.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, args.models.split(","), out / "bench_spmd.png", meta)
    for r in results:
        print(
            f"{r['model']:7s} {r['label']:28s} {r['step_time_median_s'] * 1e3:8.2f} ms "
            f"{r['samples_per_second']:9.0f} samples/s  x{r['speedup_vs_single']:.2f}  "
            f"{r['comm_bytes_per_step'] or 0:>10d} B/step"
        )
    return 0


def plot(results: list[dict], models: list[str], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in results if r["model"] == model]
        colors = {
            "single": "grey",
            "data": "tab:blue",
            "model": "tab:orange",
            "hybrid": "tab:green",
        }
        ax.barh(
            [r["label"] for r in rows],
            [r["samples_per_second"] for r in rows],
            color=[colors[r["strategy"]] for r in rows],
        )
        ax.invert_yaxis()
        ax.set_xlabel("samples/s (median step)")
        ax.set_title(f"{model}, global batch {meta['batch_size']}")
    fig.suptitle(
        f"Simulated CPU devices on {meta['cpus']} cores (jax {meta['jax']}): "
        "all devices share the cores, so more devices cannot be faster"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
