"""A framework's own worker processes, started from its adapter: free loopback ports for
their rendezvous, and waiting for all of them (standard library only, so it imports in
any framework's environment)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on loopback now (bound, read, released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    """Wait for every process; any failure (or the timeout) stops the others and raises
    with the failing process's last line (``what``: whose processes, for the message)."""
    deadline = time.monotonic() + timeout
    try:
        for proc, log in zip(procs, logs, strict=True):
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if rc != 0:
                lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                raise RuntimeError(f"{log.stem} exited {rc}: {lines[-1] if lines else ''}")
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} processes did not finish within {timeout:.0f} s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
