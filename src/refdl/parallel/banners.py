"""mpirun's standard error as a launcher shows it: the ranks' lines pass through as they
come, and mpirun's banners (a block of text between two rules of dashes, such as
"prterun noticed that process rank 1 ... exited on signal 9") are held back. At the end
they are shown only when nothing else said why the run ended: when a rank printed its
own error line, or the launcher prints one, the banner would be a second, noisier
account of the same event (issue 54: one line under ``refdl launch``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import IO

RULE = b"-" * 60  # Open MPI's and PRRTE's banners open and close with 74 dashes
SAID = b": error: "  # a refdl line that says why a rank ended


def _is_rule(line: bytes) -> bool:
    text = line.rstrip(b"\r\n")
    return text.startswith(RULE) and not text.strip(b"-")


class Banners:
    """Reads ``stream`` (mpirun's stderr pipe) on a thread, writing to ``out`` (a file
    descriptor) all but the banners; ``finish`` shows the banners when ``needed``."""

    def __init__(self, stream: IO[bytes], out: int = 2) -> None:
        self.stream, self.out = stream, out
        self.held: list[bytes] = []
        self.said = False  # a rank printed a refdl error line
        self._thread = threading.Thread(target=self._pump, daemon=True, name="refdl-banners")
        self._thread.start()

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # (our own stderr closed: nowhere to show it)
            os.write(self.out, data)

    def _pump(self) -> None:
        fd, pending, block = self.stream.fileno(), b"", None
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
                else:
                    self.said = self.said or SAID in line
                    self._write(line)
            # a line still being written (a progress bar's \r updates) passes at once,
            # unless it may be a banner's rule or is inside a banner
            if block is None and pending and pending.strip(b"-"):
                self._write(pending)
                pending = b""
        if block is not None:
            self.held.append(b"".join(block))
        if pending:
            self._write(pending)

    def finish(self, needed: bool, wait_s: float = 5.0) -> None:
        """After mpirun: wait at most ``wait_s`` for its last output (ranks it left behind
        may hold the pipe), then show the banners if ``needed`` and no rank said why."""
        self._thread.join(wait_s)
        if needed and not self.said:
            for block in self.held:
                self._write(block)
