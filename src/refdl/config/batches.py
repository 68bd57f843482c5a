"""A growing global batch (Smith et al. 2017, "Don't decay the learning rate, increase the
batch size"): ``--batch-schedule 0:64,100:128,200:256`` trains with batch 64 from step 0,
128 from step 100 and 256 from step 200, the learning rate as it is.

The data order stays one stream (``refdl.data.order``): step ``t`` takes the ``B(t)``
examples after the ``sum(B(u), u < t)`` taken before it, whatever the schedule.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from refdl.errors import UsageError

MAX_ENTRIES = 64


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """``(first step, global batch)`` pairs, the first at step 0, steps and batches
    increasing."""

    entries: tuple[tuple[int, int], ...]
    given: str = dataclasses.field(default="", compare=False, repr=False)  # the flag's text

    def __str__(self) -> str:
        return self.given or ",".join(f"{s}:{b}" for s, b in self.entries)

    @classmethod
    def parse(cls, text: str) -> BatchSchedule:
        """``STEP:BATCH,...`` (``0:64,100:128``); anything else is a one-line error."""
        entries = []
        for part in str(text).split(","):
            step, sep, batch = part.strip().partition(":")
            if not sep or not step.strip().isdigit() or not batch.strip().isdigit():
                raise UsageError(f"--batch-schedule {text!r}: each entry is STEP:BATCH, "
                                 f"e.g. 0:64,100:128 (got {part.strip()!r})")  # fmt: skip
            entries.append((int(step), int(batch)))
        if not entries or entries[0][0] != 0 or len(entries) > MAX_ENTRIES:
            raise UsageError(f"--batch-schedule {text!r}: start at step 0 (0:BATCH,...), "
                             f"at most {MAX_ENTRIES} entries")  # fmt: skip
        steps = [s for s, _ in entries]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise UsageError(f"--batch-schedule {text!r}: the steps must increase")
        if any(not 1 <= b <= 10**7 for _, b in entries):
            raise UsageError(f"--batch-schedule {text!r}: batches must be in [1, 10000000]")
        batches = [b for _, b in entries]
        if any(b <= a for a, b in itertools.pairwise(batches)):  # what the schedule is for
            raise UsageError(f"--batch-schedule {text!r}: each batch must be larger than the "
                             "one before (the schedule grows the batch instead of decaying "
                             "the learning rate)")  # fmt: skip
        return cls(tuple(entries), str(text))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The distinct batch sizes, in order of first use."""
        return tuple(dict.fromkeys(b for _, b in self.entries))

    def size_at(self, step: int) -> int:
        """The global batch of ``step``."""
        i = bisect.bisect_right([s for s, _ in self.entries], step) - 1
        return self.entries[i][1]

    def start_at(self, step: int) -> int:
        """How many examples the steps before ``step`` took (its place in the stream)."""
        total = 0
        for i, (s, b) in enumerate(self.entries):
            end = self.entries[i + 1][0] if i + 1 < len(self.entries) else None
            if end is None or step <= end:
                return total + (step - s) * b
            total += (end - s) * b
        return total
