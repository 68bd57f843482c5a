"""Benchmark the distributed architectures across real MPI ranks.

1. Parameter server, 1 server + 3 workers under ``mpirun -n 4``: samples/s of
   sync, async and SSP (S=1), without and with a straggler (rank 1 sleeps
   ``--straggler-s`` per step), and the staleness histograms of those runs.
2. Decentralized, 8 workers: consensus distance over the steps for ring,
   torus and complete (``mpirun -n 8`` when ``--decentralized-ranks 8``, else the
   same algorithm on 8 simulated devices in one process - equal by test).
3. Allreduce time of mpi4jax inside jit next to raw MPI (mpi4py on NumPy) for
   4 KiB ... 32 MiB at 2 and 4 ranks (``refdl.bench.mpi_allreduce``), before
   and after the per-rank thread settings that close the gap.

    .venv/bin/python scripts/bench_distributed.py --out docs/bench/distributed

Writes ``bench_distributed.json``, ``ps_throughput.png``, ``staleness.png``,
``consensus.png`` and ``mpi_allreduce.png``. Each part runs its configurations
side by side in one invocation; on a 2-core machine the ranks share the cores,
so absolute rates are low and the ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(out: Path, ranks: int, *args: str, timeout: float = 600) -> dict:
    """One ``python -m refdl.train`` run (under mpirun when ranks > 1); its summary."""
    from refdl.parallel import processes as dist

    argv = ["-m", "refdl.train", *args, "--out", str(out), "--no-progress"]
    if ranks > 1:
        cmd, env = dist.mpirun_command(ranks, argv), dist.mpirun_env()
    else:
        cmd, env = [sys.executable, *argv], {**os.environ}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["bench_wall_s"] = time.perf_counter() - t0
    print(f"  {out.name}: {summary['samples_per_second']:.0f} samples/s", file=sys.stderr)
    return summary


def bench_ps(runs: Path, steps: int, straggler_s: float) -> list[dict]:
    rows = []
    common = (
        "--strategy",
        "ps",
        "--model",
        "lenet5",
        "--steps",
        str(steps),
        "--batch-size",
        "60",
        "--eval-every",
        str(steps),
        "--checkpoint-every",
        "0",
    )
    modes = {
        "sync": (),
        "async": ("--ps-mode", "async"),
        "ssp": ("--ps-mode", "ssp", "--staleness", "1"),
    }
    for straggler in (None, f"1:{straggler_s}"):
        for mode, extra in modes.items():
            tag = f"ps_{mode}_{'straggler' if straggler else 'even'}"
            args = (*common, *extra, *(("--straggler", straggler) if straggler else ()))
            s = train(runs / tag, 4, *args)
            rows.append(
                {
                    "mode": mode,
                    "straggler": straggler,
                    "samples_per_second": s["samples_per_second"],
                    "step_time_median_s": s["step_time_median_s"],
                    "test_accuracy": s["test_accuracy"],
                    "staleness_histogram": s["staleness_histogram"],
                    "staleness_updates_histogram": s.get("staleness_updates_histogram"),
                    "staleness_max": s["staleness_max"],
                }
            )
    return rows


def bench_consensus(runs: Path, steps: int, ranks: int) -> list[dict]:
    rows = []
    for topo in ("ring", "torus", "complete"):
        args = (
            "--strategy",
            "decentralized",
            "--model",
            "lenet5",
            "--topology",
            topo,
            "--steps",
            str(steps),
            "--log-every",
            "2",
            "--eval-every",
            str(steps),
            "--checkpoint-every",
            "0",
        )
        run = runs / f"consensus_{topo}"
        s = train(run, ranks, *args) if ranks > 1 else train(run, 1, *args, "--devices", "8")
        metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        rows.append(
            {
                "topology": topo,
                "executor": s["executor"],
                "spectral_gap": s["spectral_gap"],
                "test_accuracy": s["test_accuracy"],
                "steps": [m["step"] for m in metrics],
                "consensus_distance": [m["consensus_distance"] for m in metrics],
            }
        )
    return rows


def bench_allreduce(out: Path, repeats: int) -> dict:
    """``refdl.bench.mpi_allreduce`` at 2 and 4 ranks, before (plain environment) and after
    ``dist.MALLOC_TUNABLES``; its JSON per ``"{ranks}_{before|after}"``."""
    from refdl.parallel import processes as dist

    res = {}
    for ranks in (2, 4):
        for when in ("before", "after"):
            path = out / f"mpi_allreduce_{ranks}_{when}.json"
            env = dist.mpirun_env()
            if when == "before":
                env.pop("GLIBC_TUNABLES", None)
            argv = ["-m", "refdl.bench.mpi_allreduce", "--out", str(path),
                    "--repeats", str(repeats)]  # fmt: skip
            proc = subprocess.run(dist.mpirun_command(ranks, argv), capture_output=True,
                                  text=True, timeout=900, cwd=ROOT, env=env)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(
                    f"bench: allreduce at {ranks} ranks failed:\n{proc.stderr[-3000:]}"
                )
            print(f"  allreduce {ranks} ranks, {when}", file=sys.stderr)
            res[f"{ranks}_{when}"] = json.loads(path.read_text())
            path.unlink()
    return res


def allreduce_table(res: dict) -> list[dict]:
    """Median seconds of raw MPI, naive mpi4jax and the best mpi4jax variant, and ratios."""
    rows = []
    for key, data in res.items():
        ranks, when = key.split("_")
        for r in data["results"]:
            v = r["variants"]
            raw, naive = v["raw"]["median_s"], v["naive"]["median_s"]
            rows.append({
                "ranks": int(ranks), "malloc_tunables": when == "after", "bytes": r["bytes"],
                "raw_s": raw, "naive_s": naive, "naive_over_raw": naive / raw,
                "unordered_over_raw": v.get("unordered", {}).get("median_s", float("nan")) / raw,
                "unrolled_s": v.get("unrolled", {}).get("median_s"),
                "raw_loop_s": v.get("raw_loop", {}).get("median_s"),
                "naive_page_faults": v["naive"].get("minor_faults_per_op"),
            })  # fmt: skip
    return rows


def plot(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ps = result["ps"]
    if ps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        modes = ["sync", "async", "ssp"]
        for k, cond in enumerate((None, "straggler")):
            vals = [
                next(
                    r["samples_per_second"]
                    for r in ps
                    if r["mode"] == m and bool(r["straggler"]) == bool(cond)
                )
                for m in modes
            ]
            xs = [i + 0.38 * k for i in range(3)]
            ax.bar(xs, vals, width=0.36, label="with straggler" if cond else "no straggler")
        ax.set_xticks([i + 0.19 for i in range(3)], modes)
        ax.set_ylabel("samples/s (server 0)")
        ax.set_title("Parameter server, 1 server + 3 workers (mpirun -n 4)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ps_throughput.png", dpi=120)
        plt.close(fig)

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        for ax, mode in zip(axes, ("async", "ssp"), strict=True):
            r = next(r for r in ps if r["mode"] == mode and r["straggler"])
            h = {int(k): v for k, v in r["staleness_histogram"].items()}
            ax.bar(list(h), list(h.values()))
            rank, _, sleep = str(r["straggler"]).partition(":")
            ax.set_title(f"{mode}: rank {rank} sleeps {sleep} s a step")
            ax.set_xlabel("staleness (clocks behind the slowest worker)")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0].set_ylabel("applied gradients")
        fig.tight_layout()
        fig.savefig(out / "staleness.png", dpi=120)
        plt.close(fig)

    if result["consensus"]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in result["consensus"]:
            pairs = [(s, y) for s, y in zip(r["steps"], r["consensus_distance"], strict=True)
                     if y > 0]  # fmt: skip
            label = f"{r['topology']} (spectral gap {r['spectral_gap']:.2f})"
            ax.semilogy([s for s, _ in pairs], [y for _, y in pairs], "o-", ms=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("consensus distance")
        ax.set_title("Decentralized, 8 workers (each steps, then averages with its\n"
                     "neighbours); distance = mean over workers of ||x_i - mean x||^2",
                     fontsize=9)  # fmt: skip
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "consensus.png", dpi=120)
        plt.close(fig)

    if result["allreduce"]:
        rows = result["allreduce_table"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for ax, ranks in zip(axes, (2, 4), strict=True):
            for when in (False, True):
                sel = [r for r in rows if r["ranks"] == ranks and r["malloc_tunables"] == when]
                tag = "with malloc settings" if when else "without"
                xs = [r["bytes"] for r in sel]
                face = None if when else "none"  # without: hollow markers, lighter colours
                ax.loglog(xs, [r["raw_s"] for r in sel], "o-" if when else "o--",
                          color="k" if when else "grey", mfc=face,
                          label=f"raw MPI, {tag}")  # fmt: skip
                ax.loglog(xs, [r["naive_s"] for r in sel], "s-" if when else "s--",
                          color="tab:red" if when else "lightcoral", mfc=face,
                          label=f"mpi4jax in jit, {tag}")  # fmt: skip
            ax.set_title(f"allreduce, {ranks} ranks (2 cores)")
            ax.set_xlabel("bytes")
        axes[0].set_ylabel("median time (s)")
        axes[0].legend(fontsize=8)
        fig.suptitle("malloc settings: freed buffers stay mapped (processes.MALLOC_TUNABLES)",
                     fontsize=9)  # fmt: skip
        fig.tight_layout()
        fig.savefig(out / "mpi_allreduce.png", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/distributed")
    ap.add_argument("--ps-steps", type=int, default=60)
    ap.add_argument("--straggler-s", type=float, default=0.05)
    ap.add_argument("--consensus-steps", type=int, default=60)
    ap.add_argument("--decentralized-ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--skip", default="", help="comma list of parts to skip: ps,consensus,allreduce"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(",")) - {""}
    runs = Path(tempfile.mkdtemp(prefix="refdl-bench-"))  # run folders (checkpoints): not kept
    result = {"ps": [], "consensus": [], "allreduce": {}, "host_cpus": os.cpu_count()}
    previous = out / "bench_distributed.json"
    if skip and previous.exists():  # keep the parts not re-run from the last run
        result.update(json.loads(previous.read_text()))
    if "ps" not in skip:
        print("parameter server ...", file=sys.stderr)
        result["ps"] = bench_ps(runs, args.ps_steps, args.straggler_s)
    if "consensus" not in skip:
        print("decentralized consensus ...", file=sys.stderr)
        result["consensus"] = bench_consensus(runs, args.consensus_steps, args.decentralized_ranks)
    if "allreduce" not in skip:
        print("mpi4jax vs raw MPI allreduce ...", file=sys.stderr)
        result["allreduce"] = bench_allreduce(out, args.repeats)
        result["allreduce_table"] = allreduce_table(result["allreduce"])
    (out / "bench_distributed.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(out, result)
    print(f"wrote {out}/bench_distributed.json and plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
