"""Across the test hosts of ``scripts/hosts.sh``: what the veth links are, the allreduce
between hosts for raw MPI (mpi4py), mpi4jax and jax.distributed's own collectives (XLA's
gloo), and a training step across hosts against the same step on one host.

    .venv/bin/python scripts/bench_hosts.py --out docs/bench/hosts          # as root
    .venv/bin/python scripts/bench_hosts.py --out /tmp/h --quick            # a smoke run

Makes the two hosts when they are not up (and removes them after). The hosts are
namespaces of one machine: their "network" is a memory copy through the kernel's bridge,
sharing this machine's cores, so the link figures say what these tests ran over, never
what a network does. Writes ``hosts.json`` and ``hosts.png`` in ``--out``.

Under mpirun (``collectives`` mode) each rank times every implementation at every size,
interleaved (rotating order) so a slow phase of the machine falls on all alike; a repeat's
time is the slowest rank's (barrier first); rank 0 writes the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ["bash", str(ROOT / "scripts" / "hosts.sh")]
PY = str(ROOT / ".venv" / "bin" / "python")
SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26]  # bytes, float32


def on(host: str, line: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*HOSTS, "agent", host, line], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


# ----- the link: a TCP ping-pong and a bulk transfer between the hosts ---------------------

LINK_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 50311)); s.listen(1)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(1)
    if not b or b == b"q": break
    c.sendall(b)
total = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    total += len(d)
print(total)
"""


def link(rounds: int, megabytes: int) -> dict:
    """Round-trip latency (1 byte, median of ``rounds``) and bulk bandwidth (``megabytes``
    MiB, one TCP stream) from refdl-h1 to refdl-h2."""
    server = subprocess.Popen([*HOSTS, "agent", "refdl-h2", f"{PY} -c {shlex.quote(LINK_SERVER)}"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    client = f"""
import socket, time, json, statistics
for _ in range(100):
    try:
        c = socket.create_connection(("refdl-h2", 50311)); break
    except OSError:
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range({rounds}):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtt.append(time.perf_counter() - t)
c.sendall(b"q")
buf = bytes(1 << 20); t = time.perf_counter()
for _ in range({megabytes}): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); took = time.perf_counter() - t
print(json.dumps({{"rtt_median_s": statistics.median(rtt), "rtt_min_s": min(rtt),
                   "bytes": {megabytes} << 20, "seconds": took}}))
"""
    out = on("refdl-h1", f"{PY} -c {shlex.quote(client)}")
    server.wait(timeout=60)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["bandwidth_GBps"] = r["bytes"] / r["seconds"] / 1e9
    return r


# ----- the allreduce: three implementations, under mpirun ----------------------------------


def collectives(out: Path, sizes: list[int], repeats: int) -> None:
    """One rank's part (under mpirun): time each implementation at each size."""
    sys.path.insert(0, str(ROOT / "src"))
    from refdl.parallel import processes

    processes.init_spmd()  # jax.distributed over the ranks (gloo), as the SPMD strategies
    results = [time_size(nbytes, processes.comm(), repeats) for nbytes in sizes]
    if processes.comm().Get_rank() == 0:
        hosts = processes.rank_hosts()
        record = {"ranks": len(hosts), "hosts": hosts, "results": results}
        out.write_text(json.dumps(record, indent=1))


def time_size(nbytes: int, comm, repeats: int) -> dict:
    """Median seconds (slowest rank) of one allreduce of ``nbytes`` float32 per rank."""
    import jax
    import jax.numpy as jnp
    import mpi4jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = nbytes // 4
    host = np.full(n, rank + 1, np.float32)
    recv = np.empty_like(host)
    local = jnp.asarray(host)
    mpi4jax_sum = jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM, comm=comm))
    glob = jax.make_array_from_callback((n * size,), NamedSharding(mesh, P("x")), lambda i: host)
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))  # fmt: skip
    calls = {
        "mpi4py": lambda: comm.Allreduce(host, recv, op=MPI.SUM) or recv[0],
        "mpi4jax": lambda: mpi4jax_sum(local).block_until_ready()[0],
        "jax_gloo": lambda: psum(glob).block_until_ready().addressable_data(0)[0],
    }
    want = size * (size + 1) / 2
    for name, f in calls.items():  # warm up (compile), and check the sums
        got = float(f())
        assert got == want, (name, got, want)
    times: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            comm.Barrier()
            t = time.perf_counter()
            calls[name]()
            times[name].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return {"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}}


def run_collectives(hosts: str, out: Path, sizes: list[int], repeats: int) -> dict:
    """``collectives`` on ``hosts`` (mpirun started on refdl-h1, as refdl launch does)."""
    mpirun = str(ROOT / ".venv" / "bin" / "mpirun")
    spec = ",".join(hosts.split(","))
    sys.path.insert(0, str(ROOT / "src"))
    from refdl.parallel.processes import MALLOC_TUNABLES  # as refdl launch gives every rank

    line = (f"cd {ROOT} && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
            f"GLIBC_TUNABLES={MALLOC_TUNABLES} "
            f"{mpirun} --host {spec} --map-by slot --mca plm_ssh_agent "
            f"{shlex.quote(' '.join(HOSTS) + ' agent')} "
            f"{PY} {Path(__file__).resolve()} collectives --file {out} "
            f"--sizes {','.join(map(str, sizes))} --repeats {repeats}")  # fmt: skip
    proc = on("refdl-h1", line, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(out.read_text())


# ----- a training step across hosts and on one host ----------------------------------------


def step(hosts: str, out: Path, steps: int, strategy: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "refdl", "launch", "--hosts", hosts, "--launch-agent",
         "bash scripts/hosts.sh agent", "train", "--strategy", strategy, "--model", "lenet5",
         "--steps", str(steps), "--eval-every", "0", "--log-every", "10", "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, timeout=1200)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    s = json.loads((out / "summary.json").read_text())
    return {k: s[k] for k in ("step_time_median_s", "samples_per_second", "params_l2_norm",
                              "hosts", "devices")}  # fmt: skip


def lost(how: str, tmp: Path) -> dict:
    """A long data run across the hosts; after its second checkpoint refdl-h2 is taken
    away (``kill``: SIGKILL to all its processes; ``cut``: its link down): seconds until
    the launcher exits, and what it said."""
    out = tmp / f"lost-{how}"
    cmd = [sys.executable, "-m", "refdl", "launch", "--hosts", "refdl-h1:2,refdl-h2:2",
           "--launch-agent", "bash scripts/hosts.sh agent", "train", "--strategy", "data",
           "--devices", "4", "--model", "mlp", "--steps", "100000", "--checkpoint-every", "20",
           "--eval-every", "0", "--out", str(out), "--no-progress", "--timeout", "20"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    while len(list((out / "checkpoints").glob("step_*"))) < 2:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read()[-3000:])
        time.sleep(0.1)
    subprocess.run([*HOSTS, how, "refdl-h2"], check=True)
    gone = time.monotonic()
    _, err = proc.communicate(timeout=300)
    took = time.monotonic() - gone
    if how == "cut":
        subprocess.run([*HOSTS, "mend", "refdl-h2"], check=True)
    line = next((ln for ln in err.splitlines() if "refdl.launch: error:" in ln), "")
    summary = json.loads((out / "summary.json").read_text())
    return {"exit_status": proc.returncode, "seconds_to_launcher_exit": took, "line": line,
            "summary_status": summary.get("status")}  # fmt: skip


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    # one colour per library; one host dotted with hollow markers, two hosts solid
    styles = {"mpi4py": ("o", "C0"), "mpi4jax": ("s", "C1"),
              "jax_gloo": ("^", "C2")}  # fmt: skip
    names = {"mpi4py": "mpi4py", "mpi4jax": "mpi4jax", "jax_gloo": "jax.distributed (gloo)"}
    for where, ls in (("one_host", ":"), ("two_hosts", "-")):
        for name, (marker, color) in styles.items():
            rows = data["allreduce"][where]["results"]
            a.loglog([r["bytes"] for r in rows], [r[name] * 1e3 for r in rows], marker + ls,
                     color=color, mfc="none" if where == "one_host" else color,
                     label=f"{names[name]}, {where.replace('_', ' ')}")  # fmt: skip
    a.set_xlabel("bytes per rank (float32)")
    a.set_ylabel("allreduce, ms (median, slowest rank)")
    a.set_title(f"2 ranks; link {data['link']['bandwidth_GBps']:.1f} GB/s, "
                f"RTT {data['link']['rtt_median_s'] * 1e6:.0f} us")  # fmt: skip
    a.set_ylim(bottom=1e-3)  # room below the curves for the legend
    a.legend(fontsize=7, loc="lower right")
    labels = list(data["step"])
    b.bar(labels, [data["step"][k]["step_time_median_s"] * 1e3 for k in labels])
    b.set_ylabel("training step, ms (median)")
    b.set_title("data, lenet5, batch 64, 4 ranks")
    b.tick_params(axis="x", labelsize=8)
    fig.suptitle("refdl across test hosts (network namespaces on one 2-core machine, "
                 f"{data['date']})", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", nargs="?", default="all", choices=["all", "collectives"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "hosts")
    p.add_argument("--file", type=Path, help="(collectives mode) rank 0's JSON")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="few sizes, repeats and steps")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.mode == "collectives":
        collectives(args.file, sizes, args.repeats)
        return 0
    if args.quick:
        sizes, args.repeats, args.steps = [1 << 12, 1 << 20], 5, 20
    up = subprocess.run([*HOSTS, "list"], capture_output=True, text=True).stdout.split()
    made = "refdl-h1" not in up
    if made:
        subprocess.run([*HOSTS, "up", "2"], check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-hosts-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        command = "python scripts/bench_hosts.py " + " ".join(argv or sys.argv[1:])
        data: dict = {"date": time.strftime("%Y-%m-%d"), "machine": socket.gethostname(),
                      "cpus": os.cpu_count(), "command": command}  # fmt: skip
        print("bench_hosts: the link (TCP ping-pong, bulk transfer)", file=sys.stderr, flush=True)
        data["link"] = link(1000 if not args.quick else 100, 512 if not args.quick else 64)
        data["allreduce"] = {}
        for where, hosts in (("one_host", "refdl-h1:2"), ("two_hosts", "refdl-h1:1,refdl-h2:1")):
            print(f"bench_hosts: allreduce, 2 ranks, {where.replace('_', ' ')}", file=sys.stderr,
                  flush=True)  # fmt: skip
            data["allreduce"][where] = run_collectives(hosts, tmp / f"{where}.json", sizes,
                                                       args.repeats)  # fmt: skip
        data["step"] = {}
        for label, hosts in (("4 ranks, one host", "refdl-h1:4"),
                             ("2 + 2 ranks, two hosts", "refdl-h1:2,refdl-h2:2")):  # fmt: skip
            print(f"bench_hosts: training step, {label}", file=sys.stderr, flush=True)
            data["step"][label] = step(hosts, tmp / label.replace(" ", "_").replace(",", ""),
                                       args.steps, "data")  # fmt: skip
        data["lost_host"] = {}
        for how in ("kill", "cut"):
            print(f"bench_hosts: a lost host ({how})", file=sys.stderr, flush=True)
            data["lost_host"][how] = lost(how, tmp)
        (args.out / "hosts.json").write_text(json.dumps(data, indent=1))
        plot(data, args.out / "hosts.png")
        print(json.dumps({k: data[k] for k in ("link", "step", "lost_host")}, indent=1))
    finally:
        if made:
            subprocess.run([*HOSTS, "down"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
