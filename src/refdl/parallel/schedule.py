"""Pipeline schedules as data: a table (time slot, stage) -> operation or idle.

An operation is a forward ``F``, a backward ``B``, or - in the zero-bubble
schedules, which split the backward in two (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024) - an input-gradient ``B`` and a weight-gradient ``W``,
of microbatch ``mb`` on model chunk ``chunk`` of a stage (a device). A device
holds ``chunks`` model chunks; chunk ``c`` of device ``s`` is *virtual stage*
``k``: ``k = c * p + s`` for the looped placements (interleaved, looped-bfs),
``k = s`` and ``k = 2p - 1 - s`` for the V placement of ZB-V. Dependencies:

- ``F(mb, k)`` needs ``F(mb, k - 1)``;
- ``B(mb, k)`` needs ``F(mb, k)`` and ``B(mb, k + 1)`` (the last virtual stage
  only its own forward: the loss is computed there);
- ``W(mb, k)`` needs ``B(mb, k)``.

A table is built by list scheduling: in every slot each stage runs the next
operation of its *order* if that operation's inputs were produced in an earlier
slot, else it idles. Every operation takes one slot (``T_F = T_B = T_W``, the assumption of
the closed forms).

Definition used everywhere in refdl: the **bubble fraction** is the idle share
of the step's device-time, ``1 - busy / (p * T)`` with ``T`` the slots of the
step. Closed forms (``analytic_bubble``), p stages, m microbatches, v chunks:

- GPipe, 1F1B: ``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2021);
- interleaved 1F1B: ``(p - 1) / (v m + p - 1)`` (the idle time divided by v;
  Narayanan et al. 2021);
- ZB-H1, ``m >= p``: ``(p - 1) / (3 m + p - 1)``: the backward is two slots (B,
  W), and the deferred W's fill all but ``p - 1`` idle slots per stage, a third
  of 1F1B's ``3 (p - 1)`` with the same split (Qi et al. 2024, section 3.1);
- ZB-V, ``m >= (3p - 1) / 2``: ``(p - 1) / (6 m + p - 1)``: a slot is a third of
  a chunk's work (a chunk is half a stage), and each device idles only ``p - 1``
  slots, ``s`` before its first forward and ``p - 1 - s`` after its last W
  (read off the tables: it holds for every ``p <= 8``, ``m < 40`` tried;
  Qi et al. 2024, section 6, call the V "zero bubble" in the steady state);
- looped BFS, ``m >= p``: as interleaved (Lamy-Poirier 2023);
- DualPipeV, ``m >= 2p`` (the least it runs with, as in PyTorch): ZB-V's
  ``(p - 1) / (6 m + p - 1)``. Its overlapped forward-and-backward pairs (one
  microbatch's forward beside another's backward, so that one's communication hides
  behind the other's compute - DeepSeek-V3's reason for it) are, in slots of compute,
  the forward then the backward: with ``T_F = T_B = T_W`` each device idles ``p - 1``
  slots, as in ZB-V (read off the tables for every ``p <= 8``, ``2p <= m < 2p + 12``).

Below those ``m`` the schedules wait for their dependencies in ways no simple
form captures; ``bubble`` then reads the table. The orders match PyTorch's
``torch.distributed.pipelining`` schedules action for action
(``tests/parallel/test_schedule.py``).

(Relative to the ideal compute time instead, 1F1B's bubble is ``(p - 1) / m``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from refdl.config.choices import LOOPED, SPLIT_BACKWARD, V_SHAPED, chunks_of
from refdl.config.choices import PIPELINE_SCHEDULES as SCHEDULES
from refdl.errors import UsageError


@dataclasses.dataclass(frozen=True, order=True)
class Op:
    """One unit of work: ``kind`` F, B or W, of microbatch ``mb``, on model chunk
    ``chunk`` of its stage."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def virtual_stage(kind: str, p: int, stage: int, chunk: int) -> int:
    """The virtual stage (position in the model) of ``chunk`` on device ``stage``."""
    if kind in V_SHAPED:
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def device_of(kind: str, p: int, k: int) -> tuple[int, int]:
    """``(stage, chunk)`` holding virtual stage ``k`` (the inverse of ``virtual_stage``)."""
    if kind in V_SHAPED:
        return (k, 0) if k < p else (2 * p - 1 - k, 1)
    return k % p, k // p


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

    @property
    def split_backward(self) -> bool:
        return self.kind in SPLIT_BACKWARD

    def virtual(self, stage: int, op: Op) -> int:
        return virtual_stage(self.kind, self.stages, stage, op.chunk)

    def busy(self, stage: int) -> int:
        return sum(1 for row in self.table if row[stage] is not None)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step's device-time, read off the table."""
        total = self.stages * self.slots
        return 1.0 - sum(self.busy(s) for s in range(self.stages)) / total

    def peak_stash(self, stage: int) -> int:
        """Most microbatch activations stage ``stage`` holds at once, counted per chunk: a
        forward stashes its input until the backward that last needs it (the W of a split
        backward, which needs the layer's input too)."""
        release = "W" if self.split_backward else "B"
        live, peak = 0, 0
        for row in self.table:
            op = row[stage]
            if op is None:
                continue
            live += 1 if op.kind == "F" else (-1 if op.kind == release else 0)
            peak = max(peak, live)
        return peak

    def p2p_messages(self) -> int:
        """Point-to-point transfers per step: an activation forward and a gradient backward
        across every boundary between consecutive virtual stages, for every microbatch
        (in the V, the boundary between a device's two chunks stays on the device)."""
        boundaries = self.stages * self.chunks - 1
        if self.kind in V_SHAPED:
            boundaries -= 1  # virtual stages p - 1 and p are both on device p - 1
        return 2 * self.microbatches * boundaries

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


def analytic_bubble(kind: str, p: int, m: int, v: int = 1) -> float | None:
    """The closed form of ``kind``'s bubble fraction where one holds (see the module's
    docstring), else None: ZB-H1 and looped BFS below ``m = p``, ZB-V below
    ``m = ceil((3p - 1) / 2)``. ``v`` is the chunks per device (ZB-V's 2 implied)."""
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved" or (kind == "looped-bfs" and m >= p):
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1" and m >= p:
        return (p - 1) / (3 * m + p - 1)
    if (kind == "zbv" and 2 * m >= 3 * p - 1) or (kind == "dualpipev" and m >= 2 * p):
        return (p - 1) / (6 * m + p - 1)
    return None


def bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of ``kind``: the closed form where one holds, else the table's."""
    closed = analytic_bubble(kind, p, m, chunks_of(kind, v))
    return closed if closed is not None else build(kind, p, m, v).bubble_fraction


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
        elif kind == "looped-bfs":  # breadth first: every microbatch through a chunk first
            order = [Op("F", i, c) for c in range(v) for i in range(m)]
            order += [Op("B", i, c) for c in reversed(range(v)) for i in reversed(range(m))]
        elif kind == "zbv":
            order = _zbv_order(p, m, s)
        elif kind == "dualpipev":
            order = _dualpipev_order(p, m, s)
        elif kind == "zb-h1":
            order = _zb_h1_order(p, m, s)
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


def _zbv_order(p: int, m: int, s: int) -> list[Op]:
    """ZB-V's order on stage ``s`` (Qi et al. 2024, section 6; the order of PyTorch's
    ``ScheduleZBVZeroBubble``), written for ``max(m, 2p - 1)`` microbatches; those beyond
    ``m`` are dropped, and list scheduling then waits wherever the order waits."""
    n = max(m, 2 * p - 1)
    order: list[Op] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - s) - 1):
        order.append(Op("F", f0, 0))
        f0 += 1
    for _ in range(s):
        order += [Op("F", f1, 1), Op("F", f0, 0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - s):
        order += [Op("F", f1, 1), Op("B", b1, 1), Op("W", b1, 1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append(Op("F", f0, 0))
            f0 += 1
        order += [Op("B", b0, 0), Op("W", b0, 0), Op("F", f1, 1), Op("B", b1, 1),
                  Op("W", b1, 1)]  # fmt: skip
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(s):
        order += [Op("B", b0, 0), Op("B", b1, 1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - s):
        order += [Op("B", b0, 0), Op("W", w0, 0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [Op("W", i, 1) for i in range(w1, b1)]
    order += [Op("W", i, 0) for i in range(w0, b0)]
    return [op for op in order if op.mb < m]


def _dualpipev_order(p: int, m: int, s: int) -> list[Op]:
    """DualPipeV's order on stage ``s`` (DeepSeek-V3's DualPipe cut in half, arXiv
    2412.19437; the order of PyTorch's ``ScheduleDualPipeV``), on ZB-V's V placement, for
    ``m >= 2p``. Its overlapped forward-and-backward pairs and its full backwards are
    written out as their operations: a full backward is ``B`` then ``W`` of one microbatch,
    a pair is the forward, then the other chunk's full backward; a split ``B`` queues its
    ``W``, run at the next free ``W`` step, oldest first."""
    count: dict[tuple[int, str], int] = {}
    queue: list[tuple[int, int]] = []
    order: list[Op] = []

    def take(chunk: int, kind: str) -> int:
        mb = count.get((chunk, kind), 0)
        count[chunk, kind] = mb + 1
        return mb

    def forward(chunk: int) -> None:
        order.append(Op("F", take(chunk, "F"), chunk))

    def full(chunk: int) -> None:  # backward input and weight together
        mb = take(chunk, "B")
        order.extend([Op("B", mb, chunk), Op("W", mb, chunk)])

    def split(chunk: int) -> None:  # backward input now, its weight queued
        mb = take(chunk, "B")
        order.append(Op("B", mb, chunk))
        queue.append((chunk, mb))

    def weight() -> None:
        if queue:
            chunk, mb = queue.pop(0)
            order.append(Op("W", mb, chunk))

    rest = p - s - 1
    for _ in range(2 * rest):  # 1: chunk 0's warm-up
        forward(0)
    for _ in range(s + 1):  # 2: both chunks
        forward(0)
        forward(1)
    for _ in range(rest):  # 3: zero-bubble steps on chunk 1
        split(1)
        weight()
        forward(1)
    for _ in range(m - 2 * p + s + 1):  # 4: the steady state, F0 with B1, F1 with B0
        forward(0)
        full(1)
        forward(1)
        full(0)
    for _ in range(rest):  # 5: B1, then F1 with B0
        full(1)
        forward(1)
        full(0)
    zb = False
    for i in range(s + 1):  # 6: B1 B0, the second half split
        zb = zb or (i == (s + 1) // 2 and s % 2 == 1)
        (split if zb else full)(1)
        zb = zb or (i == (s + 1) // 2 and s % 2 == 0)
        (split if zb else full)(0)
    for _ in range(rest):  # 7: W0 B0
        weight()
        (split if zb else full)(0)
    for _ in range(s + 1):  # 8: the queued W's
        weight()
    return order


def _ready(done: set, kind: str, op: Op, k: int, last: int) -> bool:
    if op.kind == "F":
        return k == 0 or ("F", op.mb, k - 1) in done
    if op.kind == "W":
        return ("B", op.mb, k) in done
    return ("F", op.mb, k) in done and (k == last or ("B", op.mb, k + 1) in done)


def build(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule table of ``kind`` for ``p`` stages, ``m`` microbatches, ``v`` chunks
    (the looped schedules' chunks per device; ZB-V always has 2)."""
    if kind not in SCHEDULES:
        raise UsageError(f"unknown --schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise UsageError(f"stages, microbatches and chunks must be >= 1 (got {p}, {m}, {v})")
    if kind not in LOOPED and v != 1:
        raise UsageError(f"--chunks {v} needs --schedule interleaved or looped-bfs")
    if kind == "interleaved" and m % p:
        raise UsageError(
            f"--schedule interleaved needs microbatches divisible by stages ({m} % {p} != 0)"
        )
    if kind == "dualpipev" and m < 2 * p:
        raise UsageError(
            f"--schedule dualpipev needs at least 2 x stages = {2 * p} microbatches (got {m}); "
            f"use --microbatches {2 * p} or more"
        )
    chunks = chunks_of(kind, v)
    last = p * chunks - 1
    orders = _orders(kind, p, m, v)
    done: set[tuple[str, int, int]] = set()  # (kind, mb, virtual stage)
    pos = [0] * p
    table = []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row: list[Op | None] = []
        finished = []
        for s in range(p):
            op = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if op is not None:
                k = virtual_stage(kind, p, s, op.chunk)
                if not _ready(done, kind, op, k, last):
                    op = None
            row.append(op)
            if op is not None:
                pos[s] += 1
                finished.append((op.kind, op.mb, virtual_stage(kind, p, s, op.chunk)))
        if not finished:
            raise RuntimeError(f"{kind} schedule deadlocked at slot {len(table)}")
        done.update(finished)
        table.append(tuple(row))
    return Schedule(kind, p, m, chunks, tuple(table))


def _zb_h1_order(p: int, m: int, s: int) -> list[Op]:
    """ZB-H1's order on stage ``s`` (Qi et al. 2024, figure 3; the order of PyTorch's
    ``ScheduleInterleavedZeroBubble`` with one chunk per device): 1F1B's warm-up of
    ``p - s - 1`` forwards, then 1F1B's forward-backward alternation, with the W of each
    backward deferred by ``s`` backwards; the deferred W's fill the slots where 1F1B idles,
    and the remaining ones run at the end. The stash stays 1F1B's."""
    warm = min(p - s - 1, m)
    order = [Op("F", i) for i in range(warm)]
    f = warm
    for i in range(m):
        if f < m:
            order.append(Op("F", f))
            f += 1
        order.append(Op("B", i))
        if i >= s:
            order.append(Op("W", i - s))
    order += [Op("W", i) for i in range(max(m - s, 0), m)]
    return order
