"""The one trajectory: build -> init -> steps over the global batches of the data order.

``trajectory`` yields every step of a run; the training loop, the
cross-framework validation, the benchmarks and the tests all walk it, so they
all run the same steps in the same order. A step returns without waiting for
the devices unless ``sync`` says so: then the trajectory waits for that step's
loss and reports the wall time per step since the last synchronised step.
``run_steps`` is the short form the tests and examples use.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from refdl.config.spec import RunSpec
from refdl.core import precision
from refdl.core.state import to_host
from refdl.run.build import Run, build, resized


@dataclasses.dataclass
class StepOut:
    """One step of a trajectory: ``done`` steps are complete; ``seconds`` is the wall time
    per step over the steps since the previous synchronised one (None when not synced)."""

    done: int
    state: Any
    metrics: dict[str, Any]
    batch: dict[str, np.ndarray]
    seconds: float | None = None
    window: int = 0  # steps that ``seconds`` averages over
    run: Run | None = None  # the run that took the step (a growing batch rebuilds it)


def every_step(done: int) -> bool:
    """Synchronise after every step (per-step times, as the benchmarks take them)."""
    return True


def trajectory(
    run: Run,
    state: Any,
    start: int,
    stop: int,
    sync: Callable[[int], bool] = every_step,
    per_step: bool = False,
) -> Iterator[StepOut]:
    """Steps ``start .. stop - 1`` of ``run`` from ``state``. A synchronised step waits for its
    loss; its ``seconds`` is the window's wall time over the window's steps (host batches
    included: they overlap the devices' work). ``per_step``: time each step alone from the
    call to the wait (its host batch built untimed, as ``refdl.hw calibrate`` times steps)."""
    t_last, since = time.perf_counter(), 0
    schedule = run.spec.batch_schedule
    built = {run.spec.batch_size: run}
    for t in range(start, stop):
        if schedule is not None and schedule.size_at(t) != run.spec.batch_size:
            run, state = resized(run, state, schedule.size_at(t), built)
        batch = run.batch(t)
        if per_step:
            t_last = time.perf_counter()
        # The old state may be donated to the step: from here the new one is the state.
        state, metrics = run.strategy.train_step(state, batch)
        since += 1
        done = t + 1
        seconds, window = None, 0
        if per_step or sync(done) or done == stop:
            jax.block_until_ready(metrics["loss"])
            now = time.perf_counter()
            seconds = (now - t_last) / since
            t_last, window, since = now, since, 0
        yield StepOut(done, state, metrics, batch, seconds, window, run)


def loss_value(metrics: dict[str, Any]) -> float:
    """The step's loss as a float (the mean over shards where the strategy returns several)."""
    return float(np.mean(to_host(metrics["loss"])))


@dataclasses.dataclass
class Trajectory:
    """What ``run_steps`` returns: per-step losses and times, the final state on the host."""

    run: Run
    losses: list[float]
    seconds: list[float]
    state: Any  # the final state, on the host

    @property
    def params(self) -> Any:
        """The parameters of the model the run trains (the replicas' average where a
        strategy keeps replicas: ``Strategy.eval_state``)."""
        return self.run.strategy.eval_state(self.state).params


def run_steps(spec: RunSpec, steps: int | None = None, seed: int | None = None) -> Trajectory:
    """Build ``spec``, initialise from ``seed`` (default the spec's) and take ``steps``
    steps (default ``spec.steps``) synchronised one by one, in the spec's precision (the
    final state comes back as host arrays, usable outside that scope)."""
    with precision.scope(spec.precision):
        return _run_steps(spec, steps, seed)


def _run_steps(spec: RunSpec, steps: int | None, seed: int | None) -> Trajectory:
    run = build(spec)
    n = run.spec.steps if steps is None else steps
    state = run.strategy.init_state(run.spec.seed if seed is None else seed)
    losses, seconds = [], []
    for out in trajectory(run, state, 0, n, per_step=True):
        losses.append(loss_value(out.metrics))
        seconds.append(out.seconds)
        state = out.state
    return Trajectory(run, losses, seconds, run.strategy.gather_state(state))
