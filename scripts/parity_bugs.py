"""A zoo of real parallelism bugs, each a small data-parallel strategy registered from
outside ``src/`` through refdl's public registry (``refdl.register_strategy``), for
``scripts/bench_parity.py`` and its test.

Every variant is the same hand-written data-parallel step - each device its share of
the global batch, gradients reduced over the ``data`` axis inside ``shard_map``,
the update applied on every replica - with one mistake that frameworks and users
have made. ``parity_none`` makes none: it is a healthy N-D run (it equals ``single``
to rounding). Refdl's own strategies are never changed.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import refdl
from refdl.strategies import STRATEGIES

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


def register_bugs() -> list[str]:
    """Register ``parity_none`` and one ``parity_<bug>`` strategy per bug (idempotent);
    their names."""
    names = []
    for bug in ("none", *BUGS):
        name = f"parity_{bug}"
        if name not in STRATEGIES:
            cls = type(f"Parity_{bug}", (ShardMapData,), {"bug": bug})
            refdl.register_strategy(name)(cls)
        names.append(name)
    return names
