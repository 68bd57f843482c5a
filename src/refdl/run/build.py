"""Build a run from a spec: data set, task, checked plan, devices, strategy.

Order matters and is the contract: the spec is validated, the launcher is
checked and the ranks joined (``jax.distributed`` must start before anything
touches JAX's backend), then the data set and the task are made, every degree
and divisibility is checked against the model (``refdl.config.plan``), and only
then are devices taken and the strategy built. Any bad input raises a one-line
``UsageError`` before a device is used or a file written.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from refdl.assemble import assemble
from refdl.config.plan import Plan, check_launch, plan
from refdl.config.spec import RunSpec
from refdl.core.task import Task
from refdl.data import Dataset
from refdl.data.order import global_batch_indices, stream_indices
from refdl.errors import UsageError
from refdl.parallel import processes
from refdl.strategies import STRATEGIES, Strategy, declared_traits


@dataclasses.dataclass
class Run:
    """Everything built from a spec: data set, task (model, loss, optimizer), plan, strategy."""

    spec: RunSpec
    dataset: Dataset
    task: Task
    plan: Plan
    strategy: Strategy
    hosts: list[str] = dataclasses.field(default_factory=list)  # each rank's host name

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch of ``step`` in the shared deterministic order."""
        return global_batch(self.dataset, self.spec, step)

    def lr(self, step: int) -> float:
        """The learning rate of ``step``."""
        return float(self.task.schedule(step)) if self.task.schedule else float(self.spec.lr)


def global_batch(dataset: Dataset, spec: RunSpec, step: int) -> dict[str, np.ndarray]:
    """The global batch of ``step``: a pure function of (seed, step) (``refdl.data.order``);
    with ``--batch-schedule``, of the schedule's size at that step and the examples the
    steps before took."""
    n = dataset.info.train_size
    if spec.batch_schedule is None:
        return dataset.train_batch(global_batch_indices(spec.seed, step, spec.batch_size, n))
    s = spec.batch_schedule
    return dataset.train_batch(stream_indices(spec.seed, s.start_at(step), s.size_at(step), n))


def resized(run: Run, state: Any, batch: int, built: dict[int, Run]) -> tuple[Run, Any]:
    """The run rebuilt for a global batch of ``batch`` (a growing batch's next size; each
    size built once, kept in ``built``), with ``state`` moved to its strategy (gathered,
    placed: a collective under mpirun, where every rank comes to the same step)."""
    if batch not in built:
        built[batch] = build(dataclasses.replace(run.spec, batch_size=batch))
    new = built[batch]
    return new, new.strategy.place_state(run.strategy.gather_state(state))


def build(spec: RunSpec) -> Run:
    """Build the pieces of a run; raises UsageError for anything that does not fit."""
    cls = STRATEGIES.get(spec.strategy)
    ranks = processes.launched_size()
    check_launch(spec, spec.strategy, cls.traits, ranks)  # before the ranks join
    hosts = processes.join(cls.traits.multiprocess, spec.timeout)
    made = assemble(dataclasses.replace(spec, devices=ranks) if ranks > 1 else spec)
    checked = plan(made.spec, made.spec.strategy, cls.traits, made.shape, ranks=ranks,
                   owners=declared_traits())  # fmt: skip
    spec = dataclasses.replace(made.spec, microbatches=checked.microbatches)  # the checked
    devices = _devices(spec, checked, ranks)
    batches = functools.partial(global_batch, made.dataset, spec)
    strategy = cls.executor(checked)(made.task, spec, checked, devices, batches)
    return Run(spec, made.dataset, made.task, checked, strategy, hosts)


def _devices(spec: RunSpec, checked: Plan, ranks: int) -> list[Any]:
    """The devices the strategy runs on: one per rank for message-passing strategies under
    mpirun, else the first ``--devices`` of JAX's devices."""
    if ranks > 1 and checked.mode == "mpi":
        return jax.local_devices()[:1]  # one runtime per rank; ranks are the workers
    available = jax.devices()
    need = 1 if checked.mode == "simulate" else spec.devices
    if len(available) < need:
        raise UsageError(
            f"--devices {need} asked for more devices than JAX sees ({len(available)}); "
            "on a CPU host python -m refdl.train simulates them, in a library set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts"
        )
    return available[:need]
