"""``single``: the whole step on one device, the reference every strategy is checked against."""

from __future__ import annotations

import functools
from typing import Any

import jax

from refdl.config.mesh import MeshSpec
from refdl.config.plan import Traits
from refdl.core.state import TrainState
from refdl.strategies.base import Batch, History, Strategy, register


@register("single")
class Single(Strategy):
    """``Task.step`` jitted on one device; no communication."""

    traits = Traits(cost="one_device")

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.device = devices[0]
        # The batch goes in as NumPy: jit's own transfer to the sharding costs a fraction of
        # a separate ``device_put`` (~150 us a step on a 2-core host, docs/speed.md).
        # Compiled here from shapes, so its memory analysis is known before the first step.
        on = jax.sharding.SingleDeviceSharding(self.device)
        self._step = self.jit(
            functools.partial(task.step, microbatches=plan.microbatches),
            donate_argnums=0, in_shardings=on, out_shardings=on,
        ).lower(task.abstract_state(), self.abstract_batch()).compile()  # fmt: skip

    def place_state(self, host_state: TrainState) -> TrainState:
        return jax.device_put(host_state, self.device)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        return self._step(state, batch)

    def compiled_steps(self) -> list[Any]:
        """The executable ``train_step`` runs (the profiler names its operations by the
        HLO instruction names of this program)."""
        return [self._step]

    def summary(self, history: History) -> dict[str, Any]:
        return {"mesh": MeshSpec().as_dict(), "comm_bytes_per_step": 0}
