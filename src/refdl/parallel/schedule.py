"""Pipeline schedules as data: a table (time slot, stage) -> operation or idle.

A schedule is built from each stage's *order* of operations (forward ``F`` or
backward ``B`` of microbatch ``mb`` on model chunk ``chunk``) by list
scheduling: in every slot each stage runs its next operation if that
operation's inputs were produced in an earlier slot, else it idles. Every
operation takes one slot (``T_F = T_B``, the assumption of the closed forms).
Dependencies, on *virtual stages* ``k = chunk * p + stage`` (a device holds
chunks ``stage, stage + p, ...`` of ``p * v``):

- ``F(mb, k)`` needs ``F(mb, k - 1)``;
- ``B(mb, k)`` needs ``F(mb, k)`` and ``B(mb, k + 1)`` (the last virtual stage
  only its own forward: the loss is computed there).

Definition used everywhere in refdl: the **bubble fraction** is the idle share
of the step's device-time, ``1 - busy / (p * T)`` with ``T`` the slots of the
step. For GPipe and 1F1B it is ``(p - 1) / (m + p - 1)`` (Huang et al. 2019;
Narayanan et al. 2021); for interleaved 1F1B with ``v`` chunks per device, the
idle time is divided by ``v``: ``(p - 1) / (v m + p - 1)``. (Relative to the
ideal compute time instead, the same bubbles are ``(p - 1) / m`` and
``(p - 1) / (v m)``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from refdl.config.choices import PIPELINE_SCHEDULES as SCHEDULES
from refdl.errors import UsageError


@dataclasses.dataclass(frozen=True, order=True)
class Op:
    """One unit of work: ``kind`` F or B, of microbatch ``mb``, on model chunk ``chunk``."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The executed table: ``table[t][s]`` is the Op stage ``s`` runs in slot ``t``, or None."""

    kind: str
    stages: int
    microbatches: int
    chunks: int
    table: tuple[tuple[Op | None, ...], ...]

    @property
    def slots(self) -> int:
        return len(self.table)

    def busy(self, stage: int) -> int:
        return sum(1 for row in self.table if row[stage] is not None)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step's device-time, read off the table."""
        total = self.stages * self.slots
        return 1.0 - sum(self.busy(s) for s in range(self.stages)) / total

    def peak_stash(self, stage: int) -> int:
        """Most microbatch activations stage ``stage`` holds at once (forward done, backward
        not yet), counted per chunk."""
        live, peak = 0, 0
        for row in self.table:
            op = row[stage]
            if op is None:
                continue
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
        return peak

    def p2p_messages(self) -> int:
        """Point-to-point transfers per step: an activation forward and a gradient backward
        across every boundary between consecutive virtual stages, for every microbatch."""
        return 2 * self.microbatches * (self.stages * self.chunks - 1)

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """``(slot, stage, op)`` for every busy cell, in slot order."""
        for t, row in enumerate(self.table):
            for s, op in enumerate(row):
                if op is not None:
                    yield t, s, op

    def render(self) -> str:
        """The table as text, one row per stage (``.`` is idle)."""
        lines = []
        for s in range(self.stages):
            cells = [str(row[s]) if row[s] else "." for row in self.table]
            lines.append(f"stage {s}: " + " ".join(f"{c:>4s}" for c in cells))
        return "\n".join(lines)


def analytic_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """The closed form: ``(p-1)/(m+p-1)``; interleaved ``(p-1)/(v m + p - 1)``."""
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def _orders(kind: str, p: int, m: int, v: int) -> list[list[Op]]:
    """Each stage's sequence of operations under schedule ``kind``."""
    orders = []
    for s in range(p):
        if kind == "gpipe":
            order = [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
        elif kind == "1f1b":
            warm = min(p - s - 1, m)
            order = [Op("F", i) for i in range(warm)]
            for i in range(m - warm):
                order += [Op("F", warm + i), Op("B", i)]
            order += [Op("B", i) for i in range(m - warm, m)]
        else:  # interleaved 1F1B (Narayanan et al. 2021): microbatches in groups of p
            fwd = [Op("F", g * p + j, c) for g in range(m // p) for c in range(v) for j in range(p)]
            bwd = [
                Op("B", g * p + j, c)
                for g in range(m // p)
                for c in reversed(range(v))
                for j in range(p)
            ]
            warm = min((p - s - 1) * 2 + (v - 1) * p, m * v)
            order = fwd[:warm]
            for i in range(m * v - warm):
                order += [fwd[warm + i], bwd[i]]
            order += bwd[m * v - warm :]
        orders.append(order)
    return orders


def build(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule table of ``kind`` for ``p`` stages, ``m`` microbatches, ``v`` chunks."""
    if kind not in SCHEDULES:
        raise UsageError(f"unknown --schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise UsageError(f"stages, microbatches and chunks must be >= 1 (got {p}, {m}, {v})")
    if kind != "interleaved" and v != 1:
        raise UsageError(f"--chunks {v} needs --schedule interleaved")
    if kind == "interleaved" and m % p:
        raise UsageError(
            f"--schedule interleaved needs microbatches divisible by stages ({m} % {p} != 0)"
        )
    orders = _orders(kind, p, m, v)
    last = p * v - 1
    done: set[tuple[str, int, int]] = set()  # (kind, mb, virtual stage)
    pos = [0] * p
    table = []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row: list[Op | None] = []
        finished = []
        for s in range(p):
            op = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if op is not None:
                k = op.chunk * p + s
                if op.kind == "F":
                    ready = k == 0 or ("F", op.mb, k - 1) in done
                else:
                    ready = ("F", op.mb, k) in done and (k == last or ("B", op.mb, k + 1) in done)
                if not ready:
                    op = None
            row.append(op)
            if op is not None:
                pos[s] += 1
                finished.append((op.kind, op.mb, op.chunk * p + s))
        if not finished:
            raise RuntimeError(f"{kind} schedule deadlocked at slot {len(table)}")
        done.update(finished)
        table.append(tuple(row))
    return Schedule(kind, p, m, v, tuple(table))
