"""The Strategy protocol and the registry of strategies.

A strategy owns **placement and communication** only: it receives a ``Task``
(model, loss, optimizer as pure functions) and the global batch of each step
from the loop, and decides where state lives and what moves between devices.
It never owns the loop, the data order, the model or the loss, which is what
makes every strategy comparable with the single-device reference ``single``.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import numpy as np

from refdl.core.state import TrainState, to_host
from refdl.core.task import Task
from refdl.perf import CostBreakdown, Hardware
from refdl.registry import Registry

PyTree = Any
Batch = dict[str, np.ndarray]


class Strategy(abc.ABC):
    """One way of running ``Task.step`` on devices.

    ``init_state``/``place_state`` put the state where the strategy wants it;
    ``train_step`` performs one SGD step on the *global* batch and returns the
    new state and metrics (``loss`` plus whatever the strategy measured);
    ``gather_state`` brings the full state to the host (checkpoints,
    evaluation, equivalence checks); ``cost`` predicts a step's cost.
    """

    name: ClassVar[str]
    # How the strategy runs under mpirun: "spmd" (jax.distributed joins the ranks into
    # one runtime), "mpi" (one runtime per rank, mpi4jax messages), None (one process only).
    multiprocess: ClassVar[str | None] = None

    def __init__(self, task: Task, spec: Any, devices: list[jax.Device]) -> None:
        self.task = task
        self.spec = spec
        self.devices = devices
        self.batch_of: Any = None  # step -> global batch, set by the loop (for async workers)

    @property
    def primary(self) -> bool:
        """Whether this process writes files (rank 0 under MPI; always in one process)."""
        from refdl import dist

        return dist.launched_rank() == 0

    @property
    def drives_loop(self) -> bool:
        """Whether this process runs the training loop; ranks that do not (parameter-server
        workers, secondary servers) call ``serve`` instead."""
        return True

    def serve(self, state: TrainState, start: int, watchdog: Any = None) -> None:
        """This rank's whole part of the run when it does not drive the loop."""
        raise NotImplementedError

    def finish(self) -> None:
        """Called once on every loop-driving rank after the summary (release helper ranks)."""
        return None

    def host_template(self, seed: int) -> TrainState:
        """A host state with this strategy's checkpoint structure (for ``--resume``)."""
        return to_host(self.task.init_state(seed))

    def eval_state(self, host_state: TrainState) -> TrainState:
        """The single model evaluated from a gathered state (e.g. the replicas' average)."""
        return host_state

    def extra_metrics(self, state: TrainState) -> dict[str, Any]:
        """Metrics measured only on logged steps (e.g. consensus distance); every rank calls it."""
        return {}

    def init_state(self, seed: int) -> TrainState:
        """The initial state from ``seed``, placed by this strategy."""
        return self.place_state(to_host(self.task.init_state(seed)))

    @abc.abstractmethod
    def place_state(self, host_state: TrainState) -> TrainState:
        """Place a full host state (fresh or restored from a checkpoint) on the devices."""

    @abc.abstractmethod
    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        """One step on the global ``batch``: ``(new_state, {"loss": ..., ...})``."""

    def gather_state(self, state: TrainState) -> TrainState:
        """The full state on the host as NumPy arrays."""
        return to_host(state)

    def gather_params(self, state: TrainState) -> PyTree:
        """The full parameters on the host (for equivalence checks and evaluation)."""
        return self.gather_state(state).params

    @classmethod
    def predict_cost(
        cls, model_cost: Any, hw: Hardware, batch: int, workers: int, opts: Any
    ) -> CostBreakdown:
        """The predicted cost of one step of a ``batch``-sample global batch on ``workers``
        devices of ``hw`` (``refdl.perf.costs``); needs no devices, so works at paper scale."""
        raise NotImplementedError(f"strategy {cls.name!r} has no cost model")

    def cost(self, hw: Hardware, batch: Batch) -> CostBreakdown:
        """The analytic cost of one step of ``batch`` on ``hw``."""
        raise NotImplementedError(f"strategy {self.name!r} has no cost model yet")

    def timeline(self) -> list[tuple[int, str, float, float]] | None:
        """The last step's executed schedule ``(stage, op, start, end)``, where recorded."""
        return None

    def summary(self) -> dict[str, Any]:
        """Strategy-specific keys for ``summary.json`` (e.g. ``comm_bytes_per_step``)."""
        return {}


STRATEGIES: Registry[type[Strategy]] = Registry("strategy")


def register(name: str):
    """Class decorator: register a Strategy subclass under ``name``."""

    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        return STRATEGIES.register(name)(cls)

    return deco
