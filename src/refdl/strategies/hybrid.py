"""``hybrid``: any product of the mesh axes on one device mesh, via ``jax.jit`` shardings.

The state and the batch get ``NamedSharding``s and XLA's SPMD partitioner
(GSPMD) inserts the collectives: the batch is split on ``data`` (gradients
all-reduced over it), parameters are split on ``model`` where their logical
axis names say so (Megatron-style tensor parallelism, the ``model`` strategy's
rules). Model code stays single-device: only the rules table
(``refdl.config.rules``, ``--preset tensor|owt``) decides. An ``fsdp`` axis splits
the batch further and every parameter with its optimizer state
(``refdl.config.rules.param_spec``): XLA all-gathers a parameter where it is used
and reduce-scatters its gradient (sharded data parallelism as GSPMD places it;
``--strategy fsdp`` writes the ZeRO stages out by hand). With ``pipe`` > 1 the
layers are cut into stages over ``pipe``, each stage on its ``data x fsdp x model``
sub-mesh, run by the pipeline executor (``refdl.strategies.pipeline``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.measure import collective_bytes
from refdl.config.plan import Plan, Traits
from refdl.config.rules import param_spec
from refdl.core import conv
from refdl.core.layers import residual_layout
from refdl.core.state import TrainState
from refdl.parallel.context import sequence_split
from refdl.strategies.base import Batch, History, Strategy, register
from refdl.strategies.pipeline import Pipeline


@register("hybrid")
class Hybrid(Strategy):
    """Data x model x pipe parallelism on one mesh, collectives placed by XLA."""

    traits = Traits(
        axes=("data", "fsdp", "model", "pipe"),
        options=frozenset(
            {
                "mesh",
                "preset",
                "schedule",
                "chunks",
                "stage_boundaries",
                "plot_schedule",
                "sequence_parallel",
            }
        ),
        multiprocess="spmd",
        fills_host=True,
    )

    @classmethod
    def executor(cls, plan: Plan) -> type[Strategy]:
        """With ``pipe`` > 1 the pipeline executor runs the stages, each on its
        ``data x fsdp x model`` sub-mesh; otherwise one program over the whole mesh."""
        return HybridPipeline if plan.mesh.pipe > 1 else cls

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.mesh = plan.mesh.make(devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(plan.batch_axes))
        abstract = task.abstract_state()
        self.shardings = self.state_shardings(abstract)
        step = self.jit(
            functools.partial(task.step, microbatches=plan.microbatches),
            in_shardings=(self.shardings, self.batch_sharding),
            out_shardings=(self.shardings, self.replicated),
            donate_argnums=0,
        )
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
                 for k, v in self.abstract_batch().items()}  # fmt: skip
        layout = sequence_split(self.mesh, plan.batch_axes) if spec.sequence_parallel else None
        with conv.xla_only(plan.mesh.model > 1), residual_layout(layout):
            self._step = step.lower(abstract, batch).compile()
        self.comm = collective_bytes(self._step.as_text(), len(devices))

    def state_shardings(self, state: TrainState) -> TrainState:
        """Shardings for every leaf of ``state``: parameters and their optimizer moments split
        by the rules, everything else replicated."""
        params = jax.tree.map(
            lambda a, names: NamedSharding(
                self.mesh, param_spec(names, a.shape, self.plan.rules, self.plan.mesh.fsdp)
            ),
            state.params,
            self.task.logical_axes,
        )
        opt = optax.tree_map_params(
            self.task.optimizer,
            lambda _, sh: sh,
            state.opt_state,
            params,
            transform_non_params=lambda _: self.replicated,
        )
        rep = lambda tree: jax.tree.map(lambda _: self.replicated, tree)  # noqa: E731
        return TrainState(
            step=self.replicated,
            params=params,
            model_state=rep(state.model_state),
            opt_state=opt,
            rng=self.replicated,
            extras=rep(state.extras),
        )

    def place_state(self, host_state: TrainState) -> TrainState:
        return jax.device_put(host_state, self.shardings)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        state, metrics = self._step(state, jax.device_put(batch, self.batch_sharding))
        if self.serialize_steps:
            jax.block_until_ready(state)
        return state, {**metrics, "comm_bytes": self.comm.get("total", 0)}

    def compiled_steps(self) -> list[Any]:
        return [self._step]

    def summary(self, history: History) -> dict[str, Any]:
        return {
            "mesh": self.plan.mesh.as_dict(),
            "preset": self.spec.preset or "tensor",
            "sequence_parallel": self.spec.sequence_parallel,
            "microbatches": self.plan.microbatches,
            "comm_bytes_per_step": self.comm.get("total"),
            "comm_bytes_by_collective": {k: v for k, v in self.comm.items() if k != "total"},
        }


class HybridPipeline(Pipeline):
    """``hybrid`` with ``pipe`` > 1: the pipeline executor over the stages' sub-meshes
    (their parameters split by the plan's rules), reported as hybrid."""

    name = "hybrid"
    traits = Hybrid.traits

    def summary(self, history: History) -> dict[str, Any]:
        return {**super().summary(history), "preset": "tensor"}
