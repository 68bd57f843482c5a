"""The parameter server in one process, deterministically: the oracle of the MPI run.

Synchronous: every worker's gradient at the current parameters, averaged in
worker order, one update. Asynchronous / SSP: the arrival order
``(worker, clock, version read)`` comes from a recorded run (``--ps-trace``) or
from a timing model (every worker's step takes 1 s, a ``--straggler`` adds its
delay; ``ssp.simulate_trace``); each gradient is taken at the parameters of the
version it read and applied in that order. It calls the strategy's compiled
gradient and update functions - the very ones the MPI executor runs - so a
replay is bit-identical.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from refdl.core.state import TrainState
from refdl.strategies.ps.ssp import (
    load_trace,
    simulate_softsync_trace,
    simulate_trace,
    softsync_scale,
    softsync_updates,
)


class Simulator:
    """The running simulation: the arrival order, and the parameter versions still needed
    by gradients not yet applied. Starts at the step of the first state it sees."""

    def __init__(self, ps: Any) -> None:
        self.ps = ps
        self.trace: list[tuple[int, int, int]] = []  # what was applied, in order
        self.start_step: int | None = None
        if ps.spec.ps_trace:  # a bad file is refused before the run folder is made
            load_trace(ps.spec.ps_trace, ps.w, ps.spec.steps, 0)

    def _begin(self, state: TrainState, step: int) -> None:
        ps = self.ps
        self.start_step = step
        if ps.spec.ps_trace:
            self.events = load_trace(ps.spec.ps_trace, ps.w, ps.spec.steps, step)
        else:
            step_s = [1.0] * ps.w
            if ps.straggler:
                step_s[ps.straggler.rank - ps.k] += ps.straggler.seconds
            if ps.spec.ps_mode == "softsync":
                self.events = simulate_softsync_trace(
                    ps.w, step, ps.spec.steps, ps.per_update, step_s
                )
            else:
                self.events = simulate_trace(ps.w, step, ps.spec.steps, ps.bound, step_s)
        self.needed = Counter(v for _, _, v in self.events)
        self.update_of = softsync_updates(self.events, ps.w, step, ps.spec.steps, ps.per_update)
        self.acc = None  # softsync: the open update's weighted sum
        self.snapshots = {0: state.params}
        self.version = 0

    def _gradient(self, w: int, clock: int, v: int) -> tuple[Any, Any]:
        """Worker ``w``'s loss and gradient of ``clock`` at the parameters of version ``v``
        (a snapshot kept until its last reader has read it)."""
        read = self.snapshots[v]
        self.needed[v] -= 1
        if not self.needed[v]:
            del self.snapshots[v]
        return self.ps.grads(read, self.ps.share(clock, w))

    def step(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        ps = self.ps
        step = int(np.asarray(state.step))
        groups = ps.layout.split(state.params)
        opt = list(state.opt_state)
        losses = []
        if ps.spec.ps_mode == "sync":
            acc = None
            for w in range(ps.w):
                loss, grads = ps.grads(state.params, ps.share(step, w))
                losses.append(loss)
                acc = grads if acc is None else jax.tree.map(jnp.add, acc, grads)
            gsplit = ps.layout.split(acc)
            for s in range(ps.k):
                groups[s], opt[s] = ps.update(groups[s], opt[s], gsplit[s], 1.0 / ps.w)
        elif ps.spec.ps_mode == "softsync":
            if self.start_step is None:
                self._begin(state, step)
            done, last = len(self.trace), len(self.events) - 1
            for i in range(done, done + ps.w):  # an update closes where update_of moves on
                w, clock, v = self.events[i]
                loss, grads = self._gradient(w, clock, v)
                losses.append(loss)
                if self.acc is None:
                    self.acc = [[jnp.zeros_like(x) for x in g] for g in groups]
                scale = jnp.float32(softsync_scale(ps.per_update, self.version - v))
                gsplit = ps.layout.split(grads)
                self.acc = [ps.accumulate(self.acc[s], gsplit[s], scale) for s in range(ps.k)]
                self.trace.append((w, clock, v))
                if i == last or self.update_of[i + 1] != self.update_of[i]:
                    for s in range(ps.k):
                        groups[s], opt[s] = ps.update(groups[s], opt[s], self.acc[s], 1.0)
                    self.acc = None
                    self.version += 1
                    if self.needed[self.version]:
                        self.snapshots[self.version] = ps.layout.join(groups)
        else:
            if self.start_step is None:
                self._begin(state, step)
            done = len(self.trace)
            for w, clock, v in self.events[done : done + ps.w]:
                loss, grads = self._gradient(w, clock, v)
                losses.append(loss)
                gsplit = ps.layout.split(grads)
                for s in range(ps.k):
                    groups[s], opt[s] = ps.update(groups[s], opt[s], gsplit[s], 1.0 / ps.w)
                self.version += 1
                if self.needed[self.version]:
                    self.snapshots[self.version] = ps.layout.join(groups)
                self.trace.append((w, clock, v))
        new = state.replace(
            step=state.step + 1, params=ps.layout.join(groups), opt_state=tuple(opt)
        )
        return new, {"loss": jnp.mean(jnp.stack(losses))}
