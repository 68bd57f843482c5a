"""``context``: context parallelism. Each example's sequence is split over the ``context``
mesh axis; every device holds a replica of the state and one piece of every sequence.

Placement: the batch's tokens are put in the zig-zag order of
``refdl.parallel.context.zigzag_order`` (device ``i`` holds chunks ``i`` and ``2c-1-i``,
so causal attention costs every device the same) and split on ``context``; positions are
looked up by their global index. Communication: attention reaches the other pieces by
``--cp ring`` (keys and values around the ring) or ``--cp all-to-all`` (Ulysses); the
gradients are averaged over ``context`` like data parallelism's (each device's loss is
the mean over an equal share of the tokens). The loss is a mean over tokens, so the
order of the tokens does not change it: a step equals ``single``'s.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.allreduce import analytic_bytes
from refdl.comm.measure import collective_bytes
from refdl.config.plan import Traits
from refdl.core.layers import SequenceShard, param_count, sequence_shard
from refdl.core.state import TrainState, place
from refdl.parallel.context import (
    LOAD_BALANCE,
    attention_bytes,
    attention_widths,
    context_shard,
    zigzag_order,
)
from refdl.strategies.base import Batch, History, Strategy, register

AXIS = "context"


@register("context")
class ContextParallel(Strategy):
    """Replicated state, each sequence split on ``context``; attention by ring or all-to-all."""

    traits = Traits(
        axes=(AXIS,),
        options=frozenset({"mesh", "cp"}),
        multiprocess="spmd",
        whole_sequences=False,
        cost="context",
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.c = plan.mesh.context
        self.mesh = plan.mesh.make(devices)
        self.order = zigzag_order(np.shape(task.sample_x)[1], self.c)  # [device, local]
        self.token_order = self.order.reshape(-1)  # every token to the device holding it
        self.batch_sharding = NamedSharding(self.mesh, P(None, AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        step = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(P(), P(None, AXIS)),
            out_specs=(P(), P()),
            check_vma=False,  # the averaged gradients and the new state are equal everywhere
        )
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
                 for k, v in self.abstract_batch().items()}  # fmt: skip
        state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated),
            task.abstract_state(),
        )
        self._step = self.jit(step, donate_argnums=0).lower(state, batch).compile()
        self.comm = collective_bytes(self._step.as_text(), self.c)

    def _local_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Any]:
        """One device's step: its pieces of the sequences in, the replicated new state out."""
        with sequence_shard(self.sequence_view()):
            loss, grads, model_state = self.task.accumulated_grads(
                state.params, state.model_state, batch, self.plan.microbatches
            )
        grads = jax.lax.pmean(grads, AXIS)
        state = self.task.apply_gradients(state, grads, model_state)
        return state, {"loss": jax.lax.pmean(loss, AXIS)}

    def sequence_view(self) -> SequenceShard:
        """How the model sees this device's piece of each sequence: its positions and the
        attention across pieces (``--cp``)."""
        return context_shard(self.spec.cp, AXIS, self.order)

    def place_state(self, host_state: TrainState) -> TrainState:
        return place(host_state, self.replicated)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        batch = {k: np.asarray(v)[:, self.token_order] for k, v in batch.items()}
        state, metrics = self._step(state, jax.device_put(batch, self.batch_sharding))
        if self.serialize_steps:
            jax.block_until_ready(state)
        return state, {**metrics, "comm_bytes": self.comm.get("total", 0)}

    def analytic_comm_bytes(self) -> dict[str, int]:
        """What the attention and the gradient average should move per step (all devices)."""
        b, t = self.spec.batch_size, np.shape(self.task.sample_x)[1]
        params = self.task.abstract_state().params
        attention = sum(
            attention_bytes(self.spec.cp, self.c, b * (t // self.c) * d, 1)
            for d in attention_widths(params)
        )
        grads = analytic_bytes("ring", 4 * param_count(params), self.c)
        return {"attention": attention, "gradients": grads, "total": attention + grads}

    def compiled_steps(self) -> list[Any]:
        return [self._step]

    def summary(self, history: History) -> dict[str, Any]:
        return {
            "mesh": self.plan.mesh.as_dict(),
            "cp": self.spec.cp,
            "load_balance": LOAD_BALANCE,
            "microbatches": self.plan.microbatches,
            "comm_bytes_per_step": self.comm.get("total"),
            "comm_bytes_per_step_analytic": self.analytic_comm_bytes()["total"],
            "comm_bytes_by_collective": {k: v for k, v in self.comm.items() if k != "total"},
        }
