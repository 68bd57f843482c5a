"""Progress on long commands, seen wherever the output goes: a tqdm bar on a terminal,
plain lines otherwise (a log, CI, ``| tee``), never silence. The time left is estimated
from the units after the first (a first training step includes its compilation).

``Progress(total, what)`` has tqdm's ``update``, ``set_postfix``, ``write`` and
``close``; off a terminal it prints ``what: 120/300 (40 %), loss 0.41, 9 s left`` at
most every ``every_s`` seconds and at the end. ``phase(what)`` prints one line when a
command starts a new part of its work.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def on_terminal() -> bool:
    return sys.stderr.isatty()


def phase(what: str) -> None:
    """One line saying what a command does now (stderr, flushed)."""
    print(what, file=sys.stderr, flush=True)


class Progress:
    """A bar on a terminal, else a plain line every ``every_s`` seconds and at the end."""

    def __init__(self, total: int, what: str, initial: int = 0, unit: str = "step",
                 every_s: float = 10.0, leave: bool = True) -> None:  # fmt: skip
        self.total, self.what, self.n, self.unit = total, what, initial, unit
        self.every_s, self.postfix = every_s, ""
        self.t0 = self.last = time.monotonic()
        self.start = initial
        self.first: tuple[float, int] | None = None  # when the first unit ended, and n then
        self.bar = None
        if on_terminal():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True,
                            mininterval=0.5, file=sys.stderr, desc=what,
                            leave=leave)  # fmt: skip

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.first is None:
            self.first = (time.monotonic(), self.n)
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        t1, n1 = self.first or (self.t0, self.start)
        done = self.n - n1  # the units after the first: its compilation left out
        left = (self.total - self.n) * (now - t1) / done if done > 0 else None
        eta = f", {left:.0f} s left" if left is not None and self.n < self.total else ""
        pct = f" ({100 * self.n / self.total:.0f} %)" if self.total else ""
        post = f", {self.postfix}" if self.postfix else ""
        print(f"{self.what}: {self.n}/{self.total} {self.unit}s{pct}{post}{eta}",
              file=sys.stderr, flush=True)  # fmt: skip

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(refresh=refresh, **values)
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def write(self, line: str, file: Any = None) -> None:
        if self.bar is not None:
            self.bar.write(line, file=file or sys.stderr)
        else:
            print(line, file=file or sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.n > self.start and time.monotonic() - self.t0 >= self.every_s:
            self._line(time.monotonic())  # a long run's last word: where it got to
        self.bar = None
