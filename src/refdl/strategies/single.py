"""``single``: the whole step on one device, the reference every strategy is checked against."""

from __future__ import annotations

import functools
from typing import Any

import jax

from refdl.core.state import TrainState
from refdl.errors import UsageError
from refdl.mesh import MeshSpec
from refdl.perf import CostBreakdown, Hardware, roofline_time, xla_cost
from refdl.strategies.base import Batch, Strategy, register


@register("single")
class Single(Strategy):
    """``Task.step`` jitted on one device; no communication."""

    @classmethod
    def predict_cost(cls, model_cost, hw, batch, workers, opts):
        from refdl.perf import costs

        return costs.single(model_cost, hw, batch, workers, opts)

    def __init__(self, task, spec, devices) -> None:
        if len(devices) != 1:
            raise UsageError(
                f"--strategy single runs on one device, not {len(devices)}; "
                "drop --devices or pick a parallel strategy"
            )
        if spec.allreduce != "xla" or spec.compress:
            raise UsageError("--allreduce and --compress are for --strategy data only")
        if spec.mesh:
            raise UsageError("--strategy single takes no --mesh; use data, model or hybrid")
        MeshSpec().check_batch(spec.batch_size, spec.microbatches)
        super().__init__(task, spec, devices)
        self.device = devices[0]
        self._step = jax.jit(
            functools.partial(task.step, microbatches=spec.microbatches), donate_argnums=0
        )

    def place_state(self, host_state: TrainState) -> TrainState:
        return jax.device_put(host_state, self.device)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        return self._step(state, jax.device_put(batch, self.device))

    def compiled(self, state: TrainState, batch: Batch) -> Any:
        """The executable ``train_step`` runs (the profiler names its operations by the
        HLO instruction names of this program)."""
        return self._step.lower(state, jax.device_put(batch, self.device)).compile()

    def summary(self) -> dict[str, Any]:
        return {"mesh": MeshSpec().as_dict(), "comm_bytes_per_step": 0}

    def cost(self, hw: Hardware, batch: Batch) -> CostBreakdown:
        """Roofline time of XLA's cost analysis of the compiled step."""
        state = self.task.init_state(0)
        compiled = jax.jit(self.task.step).lower(state, batch).compile()
        flops, nbytes = xla_cost(compiled)
        return CostBreakdown(compute_s=roofline_time(flops, nbytes, hw), flops=flops)
