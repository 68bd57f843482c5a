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

4. a model whose whole state does not fit one rank's memory (``--big-width``,
   ``--big-layers``: 2.7 GB with Adam at the defaults; each rank capped at ``--cap``
   bytes by a cgroup of its own) is filled sharded (random values in the state's shapes,
   each process making only its own shards) and saved twice, each in its own
   mpirun: with orbax, and as format 1 did (every shard gathered to every process, rank 0
   writing one file). The cap ends the second; the first saves.

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
    if args.single:  # one process on its default device (a GPU where there is one)
        spec = RunSpec(strategy="single", precision="bf16", **{**common, "batch_size": 16})
    run = build(spec)
    rank, strategy = jax.process_index(), run.strategy
    work = Path(args.work)
    rows: dict[str, object] = {"rank": rank, "host": os.uname().nodename}

    trained = {}

    def steps(mode: str, repeat: int = 0) -> float:
        state = strategy.init_state(0)
        saver = None
        if mode != "none":  # a fresh folder each time: an existing step would not be saved
            saver = checkpoint.Saver(work / f"{mode}-{repeat}", keep=2,
                                     asynchronous=(mode == "async"))  # fmt: skip
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
    for repeat in range(args.repeats):
        for mode in times:  # interleaved: a slow phase of the machine falls on all alike
            times[mode].append(steps(mode, repeat))
    saves = args.steps // args.every
    rows["wall_s"] = times
    rows["saves"] = saves

    if args.single:
        Path(args.result).write_text(json.dumps([{
            **rows, "device": str(jax.devices()[0].device_kind), "spec": spec.to_dict(),
            "state_bytes": int(sum(x.size * x.dtype.itemsize
                                   for x in jax.tree.leaves(trained["state"]))),
        }]))  # fmt: skip
        return

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


def join_memory_cap(limit: int, rank: int) -> bool:
    """Put this process in a cgroup (v1) of its own that ``limit`` bytes bound; False where
    cgroups cannot be made here."""
    group = Path("/sys/fs/cgroup/memory") / f"refdl-bench-ckpt-{rank}"
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit))
        (group / "memory.memsw.limit_in_bytes").exists() and (
            group / "memory.memsw.limit_in_bytes").write_text(str(limit))  # fmt: skip
        (group / "tasks").write_text(str(os.getpid()))
        return True
    except OSError:
        return False


def big_worker(args: argparse.Namespace) -> None:
    """A model whose whole state does not fit one rank's memory cap: initialised sharded
    (never whole on a host), then saved with orbax (``--format orbax``) or as format 1 did
    (``--format gathered``: ``to_host`` all-gathers every shard to every process, rank 0
    writes one file). Writes this rank's line to ``--result``.K before and after."""
    import resource

    import numpy as np

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    capped = join_memory_cap(args.cap, rank)
    import dataclasses

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from refdl.assemble import assemble
    from refdl.config.spec import RunSpec
    from refdl.core.state import to_host
    from refdl.parallel import processes
    from refdl.run import checkpoint, checkpoint_npz

    opts = [("d_model", str(args.width)), ("heads", "8"), ("layers", str(args.layers)),
            ("mlp_dim", str(4 * args.width))]  # fmt: skip
    spec = RunSpec(strategy="fsdp", zero=3, model="transformer", model_opts=opts, batch_size=8,
                   steps=1, eval_every=0, progress=False, optimizer="adam")  # fmt: skip
    processes.join("spmd", 120.0)  # jax.distributed, without compiling a training step
    task = assemble(dataclasses.replace(spec, devices=4)).task
    mesh = jax.make_mesh((4,), ("data",))
    # fsdp's checkpoint view: each leaf split on its first axis where 4 divides it
    logical = task.abstract_state()
    shardings = jax.tree.map(
        lambda a: NamedSharding(mesh, P("data") if a.shape and a.shape[0] % 4 == 0 else P()),
        logical,
    )
    # a state of the checkpoint view's shapes and shardings, each process making only its
    # own shards (random values: the model's own init runs whole, on one device)
    rng = np.random.default_rng(rank)

    def shard(a: object, index: tuple) -> np.ndarray:
        shape = tuple(len(range(*i.indices(d))) for i, d in zip(index, a.shape, strict=True))
        if np.issubdtype(a.dtype, np.floating):
            return rng.standard_normal(shape, np.float32).astype(a.dtype)
        return np.zeros(shape, a.dtype)

    view = jax.tree.map(
        lambda a, sh: jax.make_array_from_callback(a.shape, sh, lambda i: shard(a, i)),
        logical, shardings,
    )  # fmt: skip
    jax.block_until_ready(view)
    filled_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state_bytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(logical)))
    note = Path(f"{args.result}.{rank}")
    line = {"rank": rank, "capped": capped, "cap": args.cap, "state_bytes": state_bytes,
            "format": args.format, "saved": False, "peak_rss_before_save": filled_rss}  # fmt: skip
    note.write_text(json.dumps(line))
    t0 = time.perf_counter()
    if args.format == "orbax":
        checkpoint.save(Path(args.work) / "big", view, {"spec": spec.to_dict()})
    else:
        host = to_host(view)  # every shard to every process, as format 1's save did
        if rank == 0:
            checkpoint_npz.save(Path(args.work) / "big-npz", host, {"spec": spec.to_dict()})
    line.update(
        saved=True,
        save_s=time.perf_counter() - t0,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    note.write_text(json.dumps(line))


def big(args: argparse.Namespace, hosts, agent, work: Path) -> dict:
    """Both formats of the capped model, each its own mpirun (a rank the cap ends ends
    that job)."""
    from refdl.parallel.processes import launch

    out = {}
    for fmt in ("orbax", "gathered"):
        result = work / f"big-{fmt}"
        argv = [str(Path(__file__).resolve()), "--worker-big", "--work", str(work), "--result",
                str(result), "--width", str(args.big_width), "--layers", str(args.big_layers),
                "--cap", str(args.cap), "--format", fmt]  # fmt: skip
        t0 = time.time()
        status = launch(4, argv, hosts, agent)
        ranks = [json.loads(p.read_text()) for p in sorted(work.glob(f"big-{fmt}.*"))]
        out[fmt] = {"exit_status": status, "wall_s": round(time.time() - t0, 1), "ranks": ranks}
    return out


def single(args: argparse.Namespace) -> None:
    """``--single``: the step-time cost of a save on one device, blocking and async."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bench-ckpt-", dir=out) as work:
        args.work, args.result = work, str(Path(work) / "rank.json")
        worker(args)
        (row,) = json.loads(Path(args.result).read_text())
    wall = {m: sorted(v)[len(v) // 2] for m, v in row["wall_s"].items()}
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "device": row["device"],
        "model": f"transformer d_model={args.width} layers={args.layers}, bf16, Adam",
        "state_mb": row["state_bytes"] / 1e6,
        "steps": args.steps,
        "every": args.every,
        "repeats": args.repeats,
        "wall_s_median": wall,
        "lost_per_save_s": {
            m: (wall[m] - wall["none"]) / row["saves"] for m in ("blocking", "async")
        },
        "wall_s": row["wall_s"],
    }
    name = "checkpoint-" + row["device"].lower().replace(" ", "-") + ".json"
    (out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("device", "state_mb", "lost_per_save_s")}))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = ["blocking", "async"]
    a.bar(modes, [result["lost_per_save_s"][m] for m in modes], color=["#c44", "#4a4"])
    a.set_ylabel("training time lost per save (s)")
    a.set_title(f"{result['state_mb']:.0f} MB state, 4 ranks: a save's cost to training",
                fontsize=10)  # fmt: skip
    ranks = [r["rank"] for r in result["ranks"]]
    b.bar([r - 0.2 for r in ranks], [r["store_bytes"] / 1e6 for r in result["ranks"]], 0.4,
          label="written by the rank (orbax)")  # fmt: skip
    b.bar([r + 0.2 for r in ranks], [r["rchar_restore"] / 1e6 for r in result["ranks"]], 0.4,
          label="read by the rank (restore onto hybrid)")  # fmt: skip
    b.axhline(result["state_mb"], color="k", ls="--",
              label="whole state (refdl's format 1 gathered it to rank 0)")  # fmt: skip
    b.set_title("bytes each rank writes, and reads when restored\nonto another layout (hybrid)",
                fontsize=10)  # fmt: skip
    b.set_xlabel("rank")
    b.set_ylabel("MB")
    b.set_xticks(ranks)
    b.set_ylim(0, result["state_mb"] * 1.5)  # room for the legend above the dashed line
    b.legend(fontsize=9, loc="upper center")
    a.set_xlabel(
        f"({result['machine']}: the background writer shares them with training)", fontsize=8
    )
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
    p.add_argument("--big-width", type=int, default=1536)
    p.add_argument("--big-layers", type=int, default=8)
    p.add_argument(
        "--cap",
        type=int,
        default=2_400_000_000,
        help="bytes of memory each rank may use in the capped case",
    )
    p.add_argument("--single", action="store_true",
                   help="one process on its default device (a GPU where there is one): "
                        "the time a save costs, blocking against asynchronous")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-big", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--format", default="orbax", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.worker_big:
        big_worker(args)
        return
    if args.quick:
        args.width, args.layers, args.steps, args.repeats = 128, 2, 6, 1
    if args.single:
        single(args)
        return
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
        capped = big(args, hosts, agent, work) if not args.quick else None
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
        "capped_model": capped
        and {
            "model": f"transformer d_model={args.big_width} layers={args.big_layers} "
            f"mlp_dim={4 * args.big_width}, Adam, fsdp --zero 3 on 4 ranks",
            "cap_bytes_per_rank": args.cap,
            **capped,
        },
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
