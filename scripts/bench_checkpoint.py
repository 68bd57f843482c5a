"""Orbax checkpoints measured (issue 53): what a save costs a training step, blocking
against asynchronous; the bytes each process writes and reads; and a restore onto
another mesh.

Four ranks under mpirun (``--hosts refdl-h1:2,refdl-h2:2`` makes the test hosts of
``scripts/hosts.sh`` and runs across them; without it, on this machine), ZeRO-3 over
the four, the transformer scaled up by ``--model-opt`` (``--width``, ``--layers``).
Each rank:

1. runs ``--steps`` steps three times, saving every ``--every`` steps: never, with a
   blocking save (orbax without its background thread: the step waits for the commit),
   and asynchronously (the step waits only for the copy to host memory). The time lost
   to saving is each mode's wall time minus the no-save run's, per save;
2. counts the bytes it wrote (its own OCDBT store, and ``wchar`` of ``/proc/self/io``
   across the save) and the bytes a format-1 save would have gathered into it (the
   whole state: ``to_host`` all-gathers every shard to every process);
3. restores the newest checkpoint onto hybrid data=2,model=2 over the same four devices,
   reading only what its devices need (``rchar`` across the restore), and times it.

Rank 0 writes ``checkpoint.json`` and ``checkpoint.png`` in ``--out``.

    .venv/bin/python scripts/bench_checkpoint.py --out docs/bench/checkpoint   # ~5 min
    .venv/bin/python scripts/bench_checkpoint.py --out /tmp/c --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def io_counters() -> dict[str, int]:
    """This process's ``rchar`` and ``wchar`` (bytes through read and write calls)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value)
    return out


def store_bytes(step: Path, rank: int) -> int:
    store = step / "state" / f"ocdbt.process_{rank}"
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file())


def worker(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from refdl.config.spec import RunSpec
    from refdl.parallel import processes
    from refdl.run import checkpoint
    from refdl.run.build import build

    opts = [("d_model", str(args.width)), ("heads", "8"), ("layers", str(args.layers)),
            ("mlp_dim", str(4 * args.width))]  # fmt: skip
    common = dict(model="transformer", model_opts=opts, batch_size=8, steps=args.steps,
                  eval_every=0, progress=False, optimizer="adam", lr=1e-3)  # fmt: skip
    spec = RunSpec(strategy="fsdp", zero=3, **common)
    run = build(spec)
    rank, strategy = jax.process_index(), run.strategy
    work = Path(args.work)
    rows: dict[str, object] = {"rank": rank, "host": os.uname().nodename}

    trained = {}

    def steps(mode: str) -> float:
        state = strategy.init_state(0)
        saver = None
        if mode != "none":
            saver = checkpoint.Saver(work / mode, keep=2, asynchronous=(mode == "async"))
        processes.barrier()
        t0 = time.perf_counter()
        for i in range(args.steps):
            state, _ = strategy.train_step(state, strategy.batches(i))
            jax.block_until_ready(state)
            if saver is not None and (i + 1) % args.every == 0:
                saver.save(strategy.checkpoint_view(state), {"spec": spec.to_dict()})
        if saver is not None:
            saver.close()
        processes.barrier()
        trained["state"] = state
        return time.perf_counter() - t0

    steps("none")  # compile
    times = {m: [] for m in ("none", "blocking", "async")}
    for _ in range(args.repeats):
        for mode in times:  # interleaved: a slow phase of the machine falls on all alike
            times[mode].append(steps(mode))
    saves = args.steps // args.every
    rows["wall_s"] = times
    rows["saves"] = saves

    # the bytes of one save, of a trained state (Adam's moments at zero compress to nothing)
    view = strategy.checkpoint_view(trained["state"])
    saver = checkpoint.Saver(work / "bytes", keep=1, asynchronous=False)
    before = io_counters()
    path = saver.save(view, {"spec": spec.to_dict()})
    saver.close()
    rows["wchar_save"] = io_counters()["wchar"] - before["wchar"]
    processes.barrier()
    rows["store_bytes"] = store_bytes(path, rank)
    rows["state_bytes"] = int(sum(np.prod(x.shape) * x.dtype.itemsize
                                  for x in jax.tree.leaves(view)))  # fmt: skip

    # a restore onto another mesh
    other = build(RunSpec(strategy="hybrid", devices=4, mesh="data=2,model=2", **common))
    target = checkpoint.abstract(other.strategy.checkpoint_target(0))
    processes.barrier()
    before, t0 = io_counters(), time.perf_counter()
    choice = checkpoint.resolve(path, like=target)
    restored = other.strategy.from_checkpoint(checkpoint.restore(choice, target))
    jax.block_until_ready(restored)
    rows["restore_s"] = time.perf_counter() - t0
    rows["rchar_restore"] = io_counters()["rchar"] - before["rchar"]
    parts = processes.comm().gather(rows, root=0)
    if rank == 0:
        Path(args.result).write_text(json.dumps(parts))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = ["blocking", "async"]
    a.bar(modes, [result["lost_per_save_s"][m] for m in modes], color=["#c44", "#4a4"])
    a.set_ylabel("training time lost per save (s)")
    a.set_title(f"{result['state_mb']:.0f} MB state, 4 ranks")
    ranks = [r["rank"] for r in result["ranks"]]
    b.bar([r - 0.2 for r in ranks], [r["store_bytes"] / 1e6 for r in result["ranks"]], 0.4,
          label="written by the rank (orbax)")  # fmt: skip
    b.bar([r + 0.2 for r in ranks], [r["rchar_restore"] / 1e6 for r in result["ranks"]], 0.4,
          label="read by the rank (restore onto hybrid)")  # fmt: skip
    b.axhline(result["state_mb"], color="k", ls="--", label="whole state (format 1 gathers)")
    b.set_xlabel("rank")
    b.set_ylabel("MB")
    b.set_xticks(ranks)
    b.legend(fontsize=8)
    fig.suptitle("refdl checkpoints: orbax, ZeRO-3 transformer "
                 f"({result['date']}, {result['where']})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/bench/checkpoint")
    p.add_argument("--hosts", help="NAME:RANKS,... of scripts/hosts.sh (made and removed)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.width, args.layers, args.steps, args.repeats = 128, 2, 6, 1
    from refdl.parallel.hosts import agent_words, parse_hosts
    from refdl.parallel.processes import launch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hosts = agent = None
    made = False
    if args.hosts:
        hosts = parse_hosts(args.hosts)
        up = subprocess.run(["bash", "scripts/hosts.sh", "up", str(len(hosts))], cwd=ROOT)
        made = up.returncode == 0
        agent = agent_words("bash scripts/hosts.sh agent", ROOT)
    work = Path(tempfile.mkdtemp(prefix=".bench-ckpt-", dir=ROOT))  # the hosts share it
    result_file = work / "ranks.json"
    argv = [str(Path(__file__).resolve()), "--worker", "--work", str(work), "--result",
            str(result_file), "--width", str(args.width), "--layers", str(args.layers),
            "--steps", str(args.steps), "--every", str(args.every), "--repeats",
            str(args.repeats)]  # fmt: skip
    try:
        t0 = time.time()
        status = launch(4, argv, hosts, agent)
        if status != 0:
            sys.exit(f"bench_checkpoint: the ranks failed (exit {status})")
        ranks = json.loads(result_file.read_text())
    finally:
        subprocess.run(["rm", "-rf", str(work)])
        if made:
            subprocess.run(["bash", "scripts/hosts.sh", "down"], cwd=ROOT)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    slowest = {m: median([max(r["wall_s"][m][i] for r in ranks) for i in range(args.repeats)])
               for m in ("none", "blocking", "async")}  # fmt: skip
    saves = ranks[0]["saves"]
    state = ranks[0]["state_bytes"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "where": f"2 test hosts x 2 ranks ({args.hosts})" if hosts else "4 ranks, one machine",
        "machine": f"{os.cpu_count()} cores",
        "model": f"transformer d_model={args.width} layers={args.layers} mlp_dim={4 * args.width}",
        "strategy": "fsdp --zero 3, 4 ranks; restore onto hybrid data=2,model=2",
        "steps": args.steps,
        "every": args.every,
        "repeats": args.repeats,
        "wall_s_median_slowest_rank": slowest,
        "lost_per_save_s": {
            m: (slowest[m] - slowest["none"]) / saves for m in ("blocking", "async")
        },
        "state_mb": state / 1e6,
        "gathered_bytes_per_rank_format1": state,
        "ranks": ranks,
        "bench_seconds": round(time.time() - t0, 1),
    }
    (out / "checkpoint.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "checkpoint.png")
    lost = result["lost_per_save_s"]
    print(f"state {state / 1e6:.1f} MB; lost per save: blocking {lost['blocking']:.3f} s, "
          f"async {lost['async']:.3f} s; written per rank "
          f"{[round(r['store_bytes'] / 1e6, 2) for r in ranks]} MB; read per rank on restore "
          f"{[round(r['rchar_restore'] / 1e6, 2) for r in ranks]} MB; restore "
          f"{max(r['restore_s'] for r in ranks):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
