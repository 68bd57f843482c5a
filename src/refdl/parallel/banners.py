"""mpirun's standard error as a launcher shows it: the ranks' lines pass through as they
come, and mpirun's banners (a block of text between two rules of dashes, such as
"prterun noticed that process rank 1 ... exited on signal 9") are held back. At the end
they are shown only when nothing else said why the run ended: when a rank printed its
own error line, or the launcher prints one, the banner would be a second, noisier
account of the same event (issue 54: one line under ``refdl launch``). A host mpirun could
not start its daemon on (a name that does not resolve, ssh refused) is one launcher line
naming the host, with ssh's own words, in place of PRRTE's banner (on its standard output).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import IO

RULE = b"-" * 60  # Open MPI's and PRRTE's banners open and close with 74 dashes
SAID = b": error: "  # a refdl line that says why a rank ended
SSH = b"ssh: "  # ssh's own complaint (a host it cannot resolve or reach), said before a banner
NO_DAEMON = b"daemon failed to report back"  # PRRTE's banner when a host's daemon never came


def _is_rule(line: bytes) -> bool:
    text = line.rstrip(b"\r\n")
    return text.startswith(RULE) and not text.strip(b"-")


class Banners:
    """Reads ``stream`` (mpirun's stderr pipe) on a thread, writing to ``out`` (a file
    descriptor) all but the banners; ``finish`` shows the banners when ``needed``.
    ``more``: other ``(pipe, file descriptor)`` pairs read the same way (mpirun's standard
    output, where PRRTE prints some banners); what they hold is shown on ``out``."""

    def __init__(
        self, stream: IO[bytes], out: int = 2, more: tuple[tuple[IO[bytes], int], ...] = ()
    ) -> None:
        self.out = out
        self.held: list[bytes] = []
        self.said = False  # a rank printed a refdl error line
        self.ssh: list[bytes] = []  # ssh's lines, folded into the line of a host not reached
        self.unresolved = False  # a host's name did not resolve: the user's bad input
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._pump, args=pipe, daemon=True, name="refdl-banners")
            for pipe in ((stream, out), *more)
        ]
        for thread in self._threads:
            thread.start()

    def _write(self, data: bytes, out: int | None = None) -> None:
        with contextlib.suppress(OSError):  # (our own stderr closed: nowhere to show it)
            os.write(self.out if out is None else out, data)

    def _pump(self, stream: IO[bytes], out: int) -> None:
        fd, pending, block = stream.fileno(), b"", None
        while chunk := os.read(fd, 65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in (x + b"\n" for x in lines):
                if _is_rule(line):
                    if block is None:
                        block = [line]
                        continue
                    self.held.append(b"".join([*block, line]))
                    block = None
                elif block is not None:
                    block.append(line)
                elif line.startswith(SSH):
                    with self._lock:  # (two streams, two threads)
                        self.ssh.append(line.strip())
                else:
                    self._release_ssh()  # the ranks run: ssh's lines were warnings, in order
                    self.said = self.said or SAID in line
                    self._write(line, out)
            # a line still being written (a progress bar's \r updates) passes at once,
            # unless it may be a banner's rule or is inside a banner
            if block is None and pending and pending.strip(b"-"):
                self._write(pending, out)
                pending = b""
        if block is not None:
            self.held.append(b"".join(block))
        if pending:
            self._write(pending, out)

    def finish(self, needed: bool, wait_s: float = 5.0) -> None:
        """After mpirun: wait at most ``wait_s`` for its last output (ranks it left behind
        may hold the pipe), then show the banners if ``needed`` and no rank said why."""
        end = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        lost = self.host_not_reached() if needed and not self.said else None
        if lost is not None:  # one line for the banner and ssh's words
            self._write(lost.encode() + b"\n")
        else:
            self._release_ssh()
        if needed and not self.said:
            for block in self.held:
                if lost is None or NO_DAEMON not in block:
                    self._write(block)

    def _release_ssh(self) -> None:
        with self._lock:
            held, self.ssh = self.ssh, []
        if held:
            self._write(b"\n".join(held) + b"\n")

    def host_not_reached(self) -> str | None:
        """The launcher's line when mpirun could not start its daemon on a host (its banner
        names the host; ssh said why), else None."""
        block = next((b for b in self.held if NO_DAEMON in b), None)
        if block is None:
            return None
        host = next((line.split(b":", 1)[1].strip() for line in block.splitlines()
                     if line.strip().startswith(b"Remote host:")), b"a host")  # fmt: skip
        why = b"; ".join(self.ssh).decode(errors="replace")
        self.unresolved = b"Could not resolve hostname" in b" ".join(self.ssh)
        return (f"refdl.launch: error: mpirun could not start its daemon on "
                f"{host.decode(errors='replace')}" + (f" ({why})" if why else "")
                + "; check the host's name, and that `ssh HOST` works from here without a "
                "password (or give --launch-agent)")  # fmt: skip
