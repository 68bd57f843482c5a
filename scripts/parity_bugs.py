"""A zoo of real parallelism bugs, each a small strategy registered from outside ``src/``
through refdl's public registry (``refdl.register_strategy``), for
``scripts/bench_parity.py`` and its test.

Two families, each with one mistake that frameworks and users have made:

- ``BUGS``: the same hand-written data-parallel step - each device its share of the
  global batch, gradients reduced over the ``data`` axis inside ``shard_map``, the update
  applied on every replica - with the mistake planted. ``parity_none`` makes none: it is a
  healthy N-D run (it equals ``single`` to rounding).
- ``TRANSFORMER_BUGS``: subclasses of refdl's ``context`` and ``pipeline`` strategies that
  change one thing (the causal mask, the positions, the microbatch loss scale, one stage's
  update), for the transformer.

Refdl's own strategies are never changed.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import refdl
from refdl.core.layers import SequenceShard
from refdl.parallel.context import _block
from refdl.strategies import STRATEGIES
from refdl.strategies.context import ContextParallel
from refdl.strategies.pipeline import Pipeline

AXIS = "data"
CLIP = 0.5  # the global-norm clip of local_clip (the mlp's gradient norm is ~1 at the start)

# bug -> (what goes wrong, the public source that documents the pitfall)
BUGS = {
    "double_mean": (
        "the gradient averaged over the data-parallel degree, then divided by it again "
        "(a loss pre-divided by the world size on top of an averaging allreduce)",
        "Horovod's allreduce averages by default (op=Average); dividing the loss by "
        "hvd.size() as well is the classic double division",
    ),
    "sum_not_mean": (
        "the gradients summed over replicas and never divided (an allreduce SUM where a "
        "mean was meant)",
        "torch.distributed.all_reduce sums (ReduceOp.SUM); DDP divides by the world size "
        "itself, a hand-written loop must",
    ),
    "no_allreduce": (
        "no gradient reduction: each replica steps on its own shard's gradient "
        "(the replicas drift apart; replica 0 is reported)",
        "a ZeRO-2 gradient shard or a DDP no_sync() context left on",
    ),
    "local_clip": (
        f"gradient clipping (global norm {CLIP}) on each replica's local gradient before "
        "the reduction, not on the reduced one",
        "PyTorch's FullyShardedDataParallel.clip_grad_norm_ exists because "
        "torch.nn.utils.clip_grad_norm_ on sharded gradients sees the local norm",
    ),
    "microbatch_sum": (
        "the microbatches' gradients accumulated as a sum, not a mean (the loss not "
        "scaled by the number of microbatches)",
        "gradient accumulation without dividing the loss by the accumulation steps "
        "(PyTorch's and Hugging Face's accumulation recipes scale it)",
    ),
    "drop_replica": (
        "one replica's gradient left out of the mean (the mean of the other p-1)",
        "a rank outside the allreduce's process group",
    ),
    "same_shard": (
        "every replica trains on replica 0's shard of the batch (the data not split by rank)",
        "a DataLoader without DistributedSampler (PyTorch's DDP tutorial: each rank must "
        "get its own shard)",
    ),
    "bf16_reduce": (
        "the gradients cast to bfloat16 before the reduction and the mean kept in bf16",
        "PyTorch DDP's bf16_compress_hook (a documented trade, a bug where fp32 was meant)",
    ),
}


class ShardMapData(refdl.Strategy):
    """Data parallelism written by hand (``shard_map``), with ``bug`` planted."""

    bug: ClassVar[str] = "none"
    traits = refdl.Traits(axes=("data",), options=frozenset({"mesh"}), multiprocess="spmd",
                          batch_stats=False, cost="data_parallel")  # fmt: skip

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        mesh = plan.mesh.make(devices)
        self.p, self.m = plan.mesh.data, plan.microbatches
        self.replicated = NamedSharding(mesh, P())
        self.split = NamedSharding(mesh, P(AXIS))
        step = jax.shard_map(self._local, mesh=mesh, in_specs=(P(), P(AXIS)),
                             out_specs=(P(), P()), check_vma=False)  # fmt: skip
        self._step = self.jit(step, donate_argnums=0)

    def _local(self, state: Any, batch: Any) -> tuple[Any, Any]:
        if self.bug == "same_shard":
            batch = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS)[0], batch)
        if self.bug == "microbatch_sum":
            loss, grads, model_state = self.task.accumulated_grads(
                state.params, state.model_state, batch, self.m)  # fmt: skip
            grads = jax.tree.map(lambda g: g * self.m, grads)
        else:
            loss, grads, model_state = self.task.accumulated_grads(
                state.params, state.model_state, batch, self.m)  # fmt: skip
        grads = self._reduce(grads)
        return self.task.apply_gradients(state, grads, model_state), jax.lax.pmean(loss, AXIS)

    def _reduce(self, grads: Any) -> Any:
        mean = functools.partial(jax.lax.pmean, axis_name=AXIS)
        if self.bug == "double_mean":
            return jax.tree.map(lambda g: mean(g) / self.p, grads)
        if self.bug == "sum_not_mean":
            return jax.lax.psum(grads, AXIS)
        if self.bug == "no_allreduce":
            return grads
        if self.bug == "local_clip":
            norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
            factor = jnp.minimum(1.0, CLIP / jnp.maximum(norm, 1e-12))
            return mean(jax.tree.map(lambda g: g * factor, grads))
        if self.bug == "drop_replica":
            keep = (jax.lax.axis_index(AXIS) != self.p - 1).astype(jnp.float32)
            return jax.tree.map(
                lambda g: jax.lax.psum(g * keep.astype(g.dtype), AXIS) / (self.p - 1), grads
            )
        if self.bug == "bf16_reduce":
            return jax.tree.map(lambda g: mean(g.astype(jnp.bfloat16)).astype(g.dtype), grads)
        return mean(grads)

    def place_state(self, host_state: Any) -> Any:
        return jax.device_put(host_state, self.replicated)

    def train_step(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        state, loss = self._step(state, jax.device_put(batch, self.split))
        if self.serialize_steps:
            jax.block_until_ready(state)
        return state, {"loss": loss}


# bug -> (what goes wrong, the public source that documents the pitfall); the transformer's
TRANSFORMER_BUGS = {
    "cp_mask_order": (
        "context parallelism (all-to-all): the causal mask built from the gathered tokens' "
        "index, not from their place in the sequence (the zig-zag load balancing forgotten "
        "in the mask: some queries see later tokens, some miss earlier ones)",
        "Megatron-Core and ring-flash-attention reorder the sequence zig-zag for load "
        "balance; the mask must follow the permuted positions (Megatron-LM "
        "get_batch_on_this_cp_rank)",
    ),
    "cp_local_positions": (
        "context parallelism (ring): each device's tokens given positions 0..T/c-1, not "
        "their global places (position ids not sharded with the sequence)",
        "Hugging Face accelerate's and Megatron's context-parallel recipes shard "
        "position_ids with input_ids; a model that rebuilds them locally restarts at 0",
    ),
    "pipe_loss_unscaled": (
        "pipeline (1F1B): the microbatches' losses summed at the last stage, not averaged "
        "(the loss not divided by the number of microbatches)",
        "Megatron-LM's forward_step divides each microbatch's loss by num_microbatches; "
        "a schedule that omits it multiplies the gradient by the microbatch count",
    ),
    "pipe_stale_stage": (
        "pipeline (1F1B): stage 0 applies the previous step's gradient (its weights one "
        "update behind the others: asynchronous weight updates where synchronous were meant)",
        "PipeDream's weight stashing (Narayanan et al., SOSP 2019): without it, or with it "
        "wrong, a stage updates with gradients of other weights",
    ),
}


class ContextBug(ContextParallel):
    """``context`` with its piece of the sequence described wrongly (``bug``)."""

    bug: ClassVar[str] = "cp_mask_order"

    def sequence_view(self) -> SequenceShard:
        right = super().sequence_view()
        if self.bug == "cp_local_positions":
            local = self.order.shape[1]
            return SequenceShard(lambda _t: jnp.arange(local), right.attention)

        def attention(q, k, v):  # Ulysses with the mask of the gathered index order
            to_heads = lambda x: jax.lax.all_to_all(x, "context", 2, 1, tiled=True)  # noqa: E731
            q, k, v = to_heads(q), to_heads(k), to_heads(v)
            pos = jnp.arange(q.shape[1])
            o, _ = _block(q, k, v, pos[:, None] >= pos[None, :])
            return jax.lax.all_to_all(o.astype(q.dtype), "context", 1, 2, tiled=True)

        return SequenceShard(right.positions, attention)


class PipelineBug(Pipeline):
    """``pipeline`` with one stage's arithmetic wrong (``bug``)."""

    bug: ClassVar[str] = "pipe_loss_unscaled"

    def _jit(self) -> None:
        m = self.m
        if self.bug == "pipe_loss_unscaled":
            self.m = 1  # the last stage's scale is 1 / self.m, read once here
        try:
            super()._jit()
        finally:
            self.m = m
        if self.bug == "pipe_stale_stage":
            update, held = self._updates[0], {}

            def stale(state, grads, model_state):  # the previous step's gradient, or none
                prev = held.get("g", jax.tree.map(jnp.zeros_like, grads))
                held["g"] = grads
                return update(state, prev, model_state)

            self._updates[0] = stale


def register_bugs() -> list[str]:
    """Register ``parity_none`` and one ``parity_<bug>`` strategy per bug of both families
    (idempotent); their names."""
    names = []
    bases = {**dict.fromkeys(("none", *BUGS), ShardMapData),
             **{b: ContextBug if b.startswith("cp_") else PipelineBug
                for b in TRANSFORMER_BUGS}}  # fmt: skip
    for bug, base in bases.items():
        name = f"parity_{bug}"
        if name not in STRATEGIES:
            refdl.register_strategy(name)(type(f"Parity_{bug}", (base,), {"bug": bug}))
        names.append(name)
    return names
