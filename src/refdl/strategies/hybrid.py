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

A ``context`` axis splits each sequence (held in the zig-zag order of
``refdl.parallel.context``; attention by ``--cp ring|all-to-all`` in a ``shard_map``
over the batch and context axes); an ``expert`` axis splits the batch and the experts
of a mixture-of-experts model, its tokens sent to their experts by all-to-all
(``refdl.parallel.expert``). Everything else stays with XLA's partitioner.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.measure import collective_bytes
from refdl.config.plan import Plan, Traits
from refdl.config.rules import degree, param_spec
from refdl.core import conv
from refdl.core.moe import moe_layers
from refdl.core.state import TrainState, per_param, place
from refdl.parallel.context import LOAD_BALANCE, attention_bytes, attention_widths
from refdl.parallel.expert import expert_bytes, expert_widths
from refdl.parallel.tracing import batch_dims, in_order, token_order, traced_on
from refdl.strategies.base import Batch, History, Strategy, register
from refdl.strategies.pipeline import Pipeline


@register("hybrid")
class Hybrid(Strategy):
    """Data x fsdp x expert x context x model x pipe on one mesh, collectives placed by XLA
    (attention over ``context`` and the experts' all-to-alls in ``shard_map``)."""

    traits = Traits(
        axes=("data", "fsdp", "expert", "context", "model", "pipe"),
        options=frozenset(
            {
                "mesh",
                "cp",
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
        cost="mesh",
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
        self.order = token_order(plan, task.sample_x)
        self.batch_sharding = NamedSharding(self.mesh, P(*batch_dims(plan, self.order)))
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
        with conv.xla_only(plan.mesh.model > 1), traced_on(self.mesh, plan, spec, self.order):
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
        opt = per_param(self.task.optimizer, state.opt_state, params, self.replicated)
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
        return place(host_state, self.shardings)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        batch = in_order(batch, self.order)
        state, metrics = self._step(state, jax.device_put(batch, self.batch_sharding))
        if self.serialize_steps:
            jax.block_until_ready(state)
        return state, {**metrics, "comm_bytes": self.comm.get("total", 0)}

    def compiled_steps(self) -> list[Any]:
        return [self._step]

    def analytic_comm_bytes(self) -> dict[str, int]:
        """What the new axes should move per step, summed over all devices: ``context``'s
        attention (``refdl.parallel.context``) and ``expert``'s all-to-alls
        (``refdl.parallel.expert``), for fp32 and heads not split over ``model``."""
        mesh, n = self.plan.mesh, len(self.devices)
        if mesh.context == 1 and mesh.expert == 1:
            return {}
        b = self.spec.batch_size // degree(mesh, self.plan.batch_axes)  # per device
        t, c = np.shape(self.task.sample_x)[1], mesh.context
        params = self.task.abstract_state().params
        out = {}
        if c > 1:  # each of the n/c rings moves the context strategy's bytes
            out["context"] = sum(
                attention_bytes(self.spec.cp, c, b * t // c * d, 1) * n // c
                for d in attention_widths(params)
            )
        if mesh.expert > 1:
            slots = [ffn.slots(t) for ffn in moe_layers(self.task.model)]
            out["expert"] = sum(
                expert_bytes(n, mesh.expert, b * e * s * d, 1)
                for (e, d), s in zip(expert_widths(params), slots, strict=True)
            )
        return out

    def summary(self, history: History) -> dict[str, Any]:
        out = {
            "mesh": self.plan.mesh.as_dict(),
            "preset": self.spec.preset or "tensor",
            "sequence_parallel": self.spec.sequence_parallel,
            "microbatches": self.plan.microbatches,
            "comm_bytes_per_step": self.comm.get("total"),
            "comm_bytes_by_collective": {k: v for k, v in self.comm.items() if k != "total"},
        }
        if self.order is not None:
            out["cp"] = self.spec.cp
            out["load_balance"] = LOAD_BALANCE
        analytic = self.analytic_comm_bytes()
        if analytic:
            out["comm_bytes_per_step_analytic_by_axis"] = analytic
        return out


class HybridPipeline(Pipeline):
    """``hybrid`` with ``pipe`` > 1: the pipeline executor over the stages' sub-meshes
    (their parameters split by the plan's rules), reported as hybrid."""

    name = "hybrid"
    traits = Hybrid.traits

    def summary(self, history: History) -> dict[str, Any]:
        out = {**super().summary(history), "preset": "tensor"}
        if self.order is not None:
            out["cp"] = self.spec.cp
            out["load_balance"] = LOAD_BALANCE
        return out
