"""Walking a pipeline schedule's table for one step: one small function per operation
kind, and a recorder of what the walk measures kept apart from its arithmetic.

``Walk.forward`` (F), ``Walk.backward`` (B: both gradients, or only the input's when
the schedule splits the backward) and ``Walk.weight`` (W: the parameters' gradient,
from the kept input and output gradient) each take a device slot, a virtual stage and
a microbatch, and return the value the slot waits for on a timed step. ``Recorder``
counts the bytes sent between devices, the activation bytes each device holds (and
their peak) and, on timed steps, when each slot's operations ran (the timeline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from refdl.core.moe import step_stats, with_step_stats


class Recorder:
    """What a walk measures: point-to-point bytes, stashed bytes per device, the timeline."""

    def __init__(self, device: list[int], p: int, timed: bool) -> None:
        self.device, self.timed = device, timed  # virtual stage -> device; wait slot by slot?
        self.p2p = 0
        self.live, self.peak = [0] * p, [0] * p
        self.timeline: list[tuple[int, str, float, float]] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def moved(self, nbytes: int, origin: int, k: int) -> None:
        """A value sent from virtual stage ``origin`` to ``k`` (free on the same device)."""
        self.p2p += nbytes if self.device[origin] != self.device[k] else 0

    def hold(self, s: int, nbytes: int) -> None:
        self.live[s] += nbytes
        self.peak[s] = max(self.peak[s], self.live[s])

    def release(self, s: int, nbytes: int) -> None:
        self.live[s] -= nbytes

    def slot(self, start: float, pending: list[tuple[int, str, Any]]) -> None:
        """On a timed step: wait for each operation of the slot that began at ``start``."""
        if not self.timed:
            return
        for s, name, result in pending:
            jax.block_until_ready(result)
            self.timeline.append((s, name, start, self.now()))

    def metrics(self, total: float) -> dict[str, Any]:
        out: dict[str, Any] = {"comm_bytes": self.p2p, "peak_activation_bytes_per_stage": self.peak}
        if self.timed:
            busy = sum(end - begin for _, _, begin, end in self.timeline)
            p = len(self.peak)
            out.update(bubble_fraction_measured=1.0 - busy / (p * total), timeline=self.timeline)
        return out


class Walk:
    """One step's values in flight: stashed inputs, sent activations and gradients, kept
    output gradients, the accumulated parameter gradients, each stage's new model state
    and the last stage's losses."""

    def __init__(
        self, state: list, xs: list, ys: list, programs: list, place: Callable[[Any, int], Any],
        add: Callable[[Any, Any], Any], split_backward: bool, rec: Recorder,
    ) -> None:  # fmt: skip
        self.state, self.xs, self.ys, self.programs = state, xs, ys, programs
        self.place, self.add, self.split, self.rec = place, add, split_backward, rec
        self.last = len(programs) - 1
        self.stash: dict[tuple[int, int], Any] = {}  # (mb, k) -> input activation of k
        self.sent: dict[tuple[int, int], Any] = {}  # (mb, k) -> k's output, or d loss / d output
        self.kept: dict[tuple[int, int], Any] = {}  # (mb, k) -> output gradient kept for W
        self.gsum: list[Any] = [None] * len(programs)
        self.model_state = [s.model_state for s in state]
        self.stats: dict[int, Any] = {}  # k -> its moe statistics summed over microbatches
        self.losses: list[Any] = []
        self.ops = {"F": self.forward, "B": self.backward, "W": self.weight}

    def receive(self, value: Any, k: int, origin: int) -> Any:
        """``value`` moved to virtual stage ``k``'s devices from ``origin``'s."""
        value = self.place(value, k)
        self.rec.moved(value.nbytes, origin, k)
        return value

    def step_model_state(self, k: int, microbatches: int) -> Any:
        """Stage ``k``'s model state after the step, its statistics the microbatches' mean."""
        if k not in self.stats:
            return self.model_state[k]
        mean = jax.tree.map(lambda v: v / microbatches, self.stats[k])
        return with_step_stats(self.model_state[k], mean)

    def accumulate(self, k: int, g: Any) -> Any:
        self.gsum[k] = g if self.gsum[k] is None else self.add(self.gsum[k], g)
        return self.gsum[k]

    def forward(self, s: int, k: int, mb: int) -> Any:
        """F: stage ``k``'s forward of microbatch ``mb``; its input is stashed for B."""
        x = self.xs[mb] if k == 0 else self.receive(self.sent.pop((mb, k - 1)), k, k - 1)
        self.stash[(mb, k)] = x
        self.rec.hold(s, x.nbytes)
        last = k == self.last
        y = (self.ys[mb],) if last else ()
        fwd = self.programs[k].fwd
        result, self.model_state[k] = fwd(self.state[k].params, self.model_state[k], x, *y)
        stats = step_stats(self.model_state[k])
        if stats:  # mixture-of-experts statistics, summed over the step's microbatches
            self.stats[k] = self.add(self.stats[k], stats) if k in self.stats else stats
        if last:
            self.losses.append(result)
            self.kept[(mb, k)] = y[0]  # the labels stand for the output gradient
        else:
            self.sent[(mb, k)] = result
        return result

    def backward(self, s: int, k: int, mb: int) -> Any:
        """B: the gradient w.r.t. the input, sent back at once; also the parameters' unless
        the schedule splits the backward (then W computes them later)."""
        if (mb, k) not in self.kept:  # the output gradient arrives
            self.kept[(mb, k)] = self.receive(self.sent.pop((mb, k)), k, k + 1)
            self.rec.hold(s, self.kept[(mb, k)].nbytes if self.split else 0)
        x, g = self.stash[(mb, k)], self.kept[(mb, k)]
        st, fns = self.state[k], self.programs[k]
        if self.split:
            result = g_x = fns.bwd_input(st.params, st.model_state, x, g)
        else:
            result = g_params, g_x = fns.bwd(st.params, st.model_state, x, g)
            self.accumulate(k, g_params)
            self.drop(s, k, mb)
        if k > 0:
            self.sent[(mb, k - 1)] = g_x
        return result

    def weight(self, s: int, k: int, mb: int) -> Any:
        """W: the parameters' gradient, from the kept input and output gradient."""
        x, g = self.stash[(mb, k)], self.kept[(mb, k)]
        st = self.state[k]
        result = self.accumulate(k, self.programs[k].bwd_weight(st.params, st.model_state, x, g))
        self.drop(s, k, mb)
        return result

    def drop(self, s: int, k: int, mb: int) -> None:
        """Microbatch ``mb`` is done with stage ``k``: its stashed input (and kept output
        gradient, when the backward is split and it came from another stage) freed."""
        x, g = self.stash.pop((mb, k)), self.kept.pop((mb, k))
        self.rec.release(s, x.nbytes + (g.nbytes if self.split and k != self.last else 0))

    def run(self, kind: str, s: int, k: int, mb: int) -> Any:
        """The operation ``kind`` (F, B or W)."""
        return self.ops[kind](s, k, mb)
