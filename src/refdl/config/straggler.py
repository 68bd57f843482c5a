"""``Straggler``: ``--straggler RANK:SECONDS``, one worker delayed every step, parsed once."""

from __future__ import annotations

import dataclasses
import math

from refdl.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Straggler:
    """The rank (or simulated worker) delayed, and its delay per step in seconds."""

    rank: int
    seconds: float
    given: str = dataclasses.field(default="", compare=False, repr=False)  # the flag's text

    def __str__(self) -> str:
        return self.given or f"{self.rank}:{self.seconds:g}"

    @classmethod
    def parse(cls, text: str) -> Straggler:
        """``"2:0.05"`` -> ``Straggler(2, 0.05)``; anything else is a one-line error."""
        rank, sep, secs = str(text).partition(":")
        try:
            out = cls(int(rank), float(secs), str(text))
        except ValueError:
            out = None
        if (
            not sep
            or out is None
            or out.rank < 0
            or not (0 <= out.seconds <= 3600 and math.isfinite(out.seconds))
        ):
            raise UsageError(f"--straggler takes RANK:SECONDS, e.g. 1:0.05 (got {text!r})")
        return out
