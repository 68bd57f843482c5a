"""Ranks that vanish: under mpirun every rank keeps a TCP connection to rank 0 and the
two ends send each other a heartbeat every ``INTERVAL`` seconds. A connection that
closes without a goodbye (the peer's processes were killed) or stays silent for
``lost_after`` seconds (its host's link went down) means that rank is lost.

Rank 0 then records the failure (``on_lost``: the loop writes ``summary.json`` with
status ``failed``), tells the other ranks, and every rank prints one line naming the
lost rank, its host and the last good checkpoint, and exits with status 3 - instead of
waiting in a collective that can never complete (XLA's and MPI's wait without end).
A rank that loses rank 0 says so and exits the same way. The watchdog
(``processes.Watchdog``) still ends ranks whose peers are alive but hang.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from refdl.errors import UsageError
from refdl.parallel.signals import LAUNCH_RECORD, STOPPER, under_launch

INTERVAL = 1.0  # seconds between heartbeats
GATHER_S = 0.3  # after a lost rank, how long the others lost with it have to show
LOST_AFTER_MAX = 30.0  # silence that means a lost host, at most (half --timeout if shorter,
# so that the watchdog's "no progress" after --timeout never comes first)
EXIT_LOST = 3  # the exit status of every rank when one was lost (as the watchdog's)
RECORD_VAR = LAUNCH_RECORD  # a file refdl launch reads when mpirun has ended


def _send(sock: socket.socket, data: bytes) -> None:
    """Send, ignoring a peer already gone (its loss is seen by its reader)."""
    with contextlib.suppress(OSError):
        sock.sendall(data)


class Monitor:
    """One rank's end of the heartbeats (``start`` makes it)."""

    def __init__(self, rank: int, hosts: list[str], lost_after: float, prog: str) -> None:
        self.rank, self.hosts, self.lost_after, self.prog = rank, hosts, lost_after, prog
        # rank 0: records the line and the time the lost rank was last heard from
        self.on_lost: Callable[[str, float], str] | None = None
        self.step = 0  # the last step the loop completed (named in the line)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failing = False
        STOPPER.before_exit.append(self.close)  # a signal's exit says goodbye first

    # -- the line every rank prints --------------------------------------------------------

    def _fail(self, why: str, tell: Callable[[str], None] | None = None,
              since: float | None = None) -> None:  # fmt: skip
        """Print the line (rank 0: recorded and told to the others first), exit 3."""
        with self._lock:
            if self._stop.is_set():
                return  # closed normally meanwhile
            self._failing = True
            line = f"{why}, after step {self.step}"
            try:
                if self.on_lost is not None:
                    try:
                        line = self.on_lost(line, time.monotonic() if since is None else since)
                    except Exception as e:  # the record must not keep the ranks waiting
                        line += f" (summary.json not written: {e})"
                record_for_launcher(line, self.rank)  # first: mpirun may end this rank soon
                if tell is not None:
                    tell(line)
            finally:
                record_for_launcher(line, self.rank)  # (if telling failed half-way)
                self._exit(line)

    def _exit(self, line: str) -> None:
        """Print the line (mpirun may have gone, taking the pipe behind stderr with it)
        and end the process (its record for the launcher was written already)."""
        try:
            if not under_launch():  # under refdl launch, the launcher says it once
                os.write(2, f"{self.prog}: error: rank {self.rank}: {line}\n".encode())
        except OSError:
            pass
        finally:
            os._exit(EXIT_LOST)

    def settle(self, seconds: float = 1.0) -> None:
        """The main thread met an error (a collective failing as a peer's connection
        resets): give the heartbeats ``seconds`` to find a lost rank behind it, in which
        case this process ends here with the monitor's line, not the error's."""
        deadline = time.monotonic() + seconds
        while not self._failing and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._failing:
            with self._lock:  # the monitor ends the process while holding it
                pass

    def close(self) -> None:
        """The run ended on this rank (normally or with its own error): say goodbye, so
        the other end does not take the closing connection for a lost rank."""
        self._stop.set()


class _Root(Monitor):
    """Rank 0: accepts every other rank's connection and watches them all."""

    def __init__(self, listener: socket.socket, size: int, **kw) -> None:
        super().__init__(0, **kw)
        self.listener, self.size = listener, size
        self.peers: dict[socket.socket, int] = {}
        self.heard: dict[int, float] = {}
        self.gone: set[int] = set()  # said goodbye
        self.started = time.monotonic()
        mark_for_launcher("started")
        threading.Thread(target=self._run, daemon=True, name="refdl-liveness").start()

    def _tell(self, line: str) -> None:
        for s in list(self.peers):
            _send(s, f"LOST {line}\n".encode())
        deadline = time.monotonic() + 2.0  # let them print before mpirun ends the job
        while self.peers and time.monotonic() < deadline:
            for s in list(self.peers):
                s.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    if not s.recv(64):
                        del self.peers[s]
                except (TimeoutError, OSError):
                    del self.peers[s]

    def _lose(self, r: int, why: str) -> None:
        """Rank ``r`` is lost: the ranks that go with it (a host's processes die together)
        are gathered for a moment, then every rank is told. mpirun, losing that host's
        daemon at the same moment, ends this rank 0.25 s after its SIGTERM - sooner than
        the gather - so what is known at once is left for the launcher first."""
        early = {r} | self._also_gone(0.02)
        record_for_launcher(f"{self._lost_line(early, why)}, after step {self.step}", early=True)
        lost = early | self._also_gone(GATHER_S)
        since = min(self.heard.get(k, self.started) for k in lost)
        self._fail(self._lost_line(lost, why), self._tell, since)

    def _lost_line(self, lost: set[int], why: str) -> str:
        by_host = {h: [k for k in sorted(lost) if self.hosts[k] == h] for h in self.hosts}
        parts = [f"rank{'s' * (len(ks) > 1)} {', '.join(map(str, ks))} on {h}"
                 for h, ks in by_host.items() if ks]  # fmt: skip
        were = "were" if len(lost) > 1 else "was"
        return f"{' and '.join(parts)} {were} lost ({why})"

    def _also_gone(self, seconds: float) -> set[int]:
        """The ranks whose connections close within ``seconds`` (a goodbye meanwhile
        counts as none), or that are silent already."""
        gone: set[int] = set()
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as sel:
            for s, r in self.peers.items():
                sel.register(s, selectors.EVENT_READ, r)
            while (left := deadline - time.monotonic()) > 0:
                ready = sel.select(timeout=left)
                if not ready:
                    break
                for key, _ in ready:
                    try:
                        data = key.fileobj.recv(4096)
                    except OSError:
                        data = b""
                    if b"BYE" in data:
                        self.gone.add(key.data)
                    if not data or b"BYE" in data:
                        sel.unregister(key.fileobj)
                        if not data:
                            gone.add(key.data)
        now = time.monotonic()
        silent = {k for k, t in self.heard.items() if now - t > self.lost_after / 2}
        return (gone | silent) - self.gone

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        buffers: dict[socket.socket, bytes] = {}
        last_beat = 0.0
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=INTERVAL / 4):
                s = key.fileobj
                if s is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:  # out of descriptors, a connection reset at once
                        continue
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    buffers[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                r = self.peers.get(s)
                if not data:
                    sel.unregister(s)
                    self.peers.pop(s, None)
                    if r is not None and r not in self.gone and not self._stop.is_set():
                        self._lose(r, "connection closed: the processes ended")
                    continue
                buffers[s] += data
                *lines, buffers[s] = buffers[s].split(b"\n")
                for line in lines:
                    word, _, rest = line.decode(errors="replace").partition(" ")
                    if word == "HELLO" and rest.isdigit() and 0 < int(rest) < self.size:
                        r = int(rest)
                        self.peers[s] = r
                    elif word == "BYE" and r is not None:
                        self.gone.add(r)
                    if r is not None:  # anything else a connection says is only a beat
                        self.heard[r] = time.monotonic()
                if len(buffers[s]) > 1 << 16:  # no line: not one of ours
                    sel.unregister(s)
                    buffers.pop(s)
                    s.close()
            now = time.monotonic()
            if now - last_beat >= INTERVAL:
                last_beat = now
                for s in list(self.peers):
                    _send(s, b"BEAT\n")
            for r in range(1, self.size):
                if r in self.gone:
                    continue
                since = self.heard.get(r, self.started)
                if now - since > self.lost_after:
                    what = "never connected" if r not in self.heard else "silent"
                    self._lose(r, f"{what} for {now - since:.0f} s: its host is unreachable")

    def close(self) -> None:
        super().close()
        mark_for_launcher("ended")
        for s in list(self.peers):
            _send(s, b"BYE\n")


class _Member(Monitor):
    """Rank r > 0: connected to rank 0, beating, listening for its word."""

    def __init__(self, sock: socket.socket, rank: int, **kw) -> None:
        super().__init__(rank, **kw)
        self.sock = sock
        sock.sendall(f"HELLO {rank}\n".encode())
        threading.Thread(target=self._run, daemon=True, name="refdl-liveness").start()

    def _run(self) -> None:
        buffer, heard, last_beat = b"", time.monotonic(), 0.0
        self.sock.settimeout(INTERVAL / 4)
        lost0 = f"rank 0 on {self.hosts[0]} was lost"
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_beat >= INTERVAL:
                last_beat = now
                _send(self.sock, b"BEAT\n")
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                if not self._stop.is_set():
                    self._fail(f"{lost0} (connection closed: the process ended)")
                return
            if data is None:
                if now - heard > self.lost_after:
                    self._fail(f"{lost0} (silent for {now - heard:.0f} s: unreachable)")
                continue
            heard = time.monotonic()
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                word, _, rest = line.decode(errors="replace").partition(" ")
                if word == "LOST":
                    with self._lock:
                        self._failing = True
                        record_for_launcher(rest, 0)
                        self._exit(rest)
                if word == "BYE":
                    self._stop.set()  # rank 0 finished: its closing is no loss

    def close(self) -> None:
        super().close()
        _send(self.sock, b"BYE\n")


def record_for_launcher(line: str, rank: int = 0, early: bool = False) -> None:
    """Leave ``line`` where ``refdl launch`` looks after mpirun ends (``RECORD_VAR``): mpirun
    may end the ranks before their output reaches it, and exit 0 when a host's daemon is
    lost. Rank 0 (or a rank it told) writes the record itself; a rank that lost rank 0
    writes ``record.RANK``, read only when there is no record (when a link goes down both
    sides see the other fall silent: rank 0's side is the run's). ``early``: rank 0's
    first word, ``record.0``, before it gathers who else went (read before the others'
    when rank 0 was ended meanwhile). The first write wins; nothing if not launched."""
    path = os.environ.get(RECORD_VAR)
    if not path:
        return
    if rank or early:
        path = f"{path}.{rank}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")


def mark_for_launcher(word: str) -> None:
    """Rank 0's word beside the records: ``started`` when its heartbeats start, ``ended``
    when its run ends (normally or with its own error). mpirun's status 0 after
    ``started`` without ``ended`` is a job ended from outside: mpirun exits 0 when it
    loses a host's daemon, and may end rank 0 before it could leave a record."""
    path = os.environ.get(RECORD_VAR)
    if path:
        with contextlib.suppress(OSError):
            Path(path).with_name(f"rank0.{word}").touch()


def ended_unseen(path: Path) -> bool:
    """Whether rank 0 ``started`` and never ``ended`` (``mark_for_launcher``), beside the
    record ``path``."""
    return path.with_name("rank0.started").exists() and not path.with_name("rank0.ended").exists()


def read_record(path: Path) -> str | None:
    """The launcher's reading of the records: rank 0's, else its early word (``.0``), else
    the lowest other rank's; None when no rank left one."""
    found = (
        [path]
        if path.exists()
        else sorted(path.parent.glob(f"{path.name}.*"), key=lambda p: int(p.suffix[1:] or 0))
    )
    return found[0].read_text(errors="replace").strip() if found else None


def start(comm, hosts: list[str], name: str, local: bool, timeout_s: float, prog: str) -> Monitor:
    """Every rank calls it at the same point: rank 0 listens (on loopback when every rank
    is on its host, ``local``, else on every interface) and tells the others its port
    and ``name``, which each resolves itself (rank 0's own resolution of its name may
    be loopback); each other rank connects. ``timeout_s``: the run's ``--timeout``
    (silence beyond ``min(timeout_s / 2, LOST_AFTER_MAX)`` is a lost rank)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lost_after = max(3 * INTERVAL, min(timeout_s / 2, LOST_AFTER_MAX))
    kw = {"hosts": hosts, "lost_after": lost_after, "prog": prog}
    port = None
    if rank == 0:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1" if local else "", 0))
        listener.listen(size)
        port = listener.getsockname()[1]
    name, port = comm.bcast((name, port), root=0)
    if rank == 0:
        return _Root(listener, size, **kw)
    try:
        sock = socket.create_connection((name, port), timeout=30)
    except OSError as e:
        raise UsageError(
            f"rank {rank} cannot reach rank 0's heartbeats at {name}:{port} ({e}); set "
            "REFDL_COORDINATOR_HOST to an address of rank 0's host the others reach"
        ) from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Member(sock, rank, **kw)
