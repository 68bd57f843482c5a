"""``data``: data parallelism. The minibatch is split over the ``data`` mesh axis;
each device computes the gradient of its shard, the gradients are averaged with
an allreduce, and every device applies the same update to its replica.

Written with ``shard_map`` so the allreduce is explicit: ``--allreduce xla``
(``lax.psum``, the collective XLA emits) or one of the reference algorithms in
``refdl.comm.allreduce`` (``ring``, ``tree``, ``halving-doubling``) applied to
the gradients as one flat buffer. ``--microbatches m`` accumulates each
shard's gradient over m slices first. ``--compress`` sends compressed
gradients with error feedback (``refdl.comm.compress``) - an inconsistent
variant that reports the bytes saved and the compression error.

BatchNorm statistics are averaged over the ``data`` axis (synchronised
BatchNorm), so a step equals ``single``'s for every model (without
microbatches).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.allreduce import allreduce_mean, analytic_bytes
from refdl.comm.compress import make_codec
from refdl.comm.measure import collective_bytes
from refdl.config.plan import Traits
from refdl.core.layers import batch_axis, param_count
from refdl.core.state import TrainState, place
from refdl.strategies.base import Batch, History, Strategy, last, register


@register("data")
class DataParallel(Strategy):
    """Replicated state, batch split on ``data``, explicit gradient allreduce."""

    traits = Traits(
        axes=("data",), options=frozenset({"mesh", "allreduce", "compress"}), multiprocess="spmd"
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.p = plan.mesh.data
        self.mesh = plan.mesh.make(devices)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.codec = make_codec(spec.compress) if spec.compress else None
        self.n_params = param_count(task.model.abstract_params(task.sample_x))
        # Replicated state; a compressor's residuals are per worker, split on `data`.
        extras = P("data") if self.codec is not None else P()
        specs = TrainState(P(), P(), P(), P(), P(), extras)
        self.shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )
        step = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(specs, P("data")),
            out_specs=(specs, P("data")),
            check_vma=False,  # ppermute results are typed "varying"; they are equal
        )
        self._step = (
            self.jit(step, donate_argnums=0)
            .lower(self._abstract_state(), self._abstract_sharded_batch())
            .compile()
        )
        self.comm_bytes = collective_bytes(self._step.as_text(), self.p).get("total", 0)
        self.comm_by_collective = {
            k: v for k, v in collective_bytes(self._step.as_text(), self.p).items() if k != "total"
        }

    def _abstract_state(self) -> TrainState:
        state = self.task.abstract_state()
        if self.codec is not None:
            state = state.replace(
                extras={"residual": jax.ShapeDtypeStruct((self.p, self.n_params), "float32")}
            )
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            state,
            _broadcast(self.shardings, state),
        )

    def _abstract_sharded_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
                for k, v in self.abstract_batch().items()}  # fmt: skip

    def _local_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Any]:
        """One step as seen by one device: its shard in, the replicated new state out."""
        with batch_axis("data"):
            loss, grads, model_state = self.task.accumulated_grads(
                state.params, state.model_state, batch, self.plan.microbatches
            )
        metrics = {"loss": loss[None]}
        if self.codec is not None:
            grads, state, extra = self.codec.exchange(grads, state, "data", self.p)
            metrics.update({k: v[None] for k, v in extra.items()})
        else:
            grads = allreduce_mean(grads, "data", self.p, self.spec.allreduce)
        return self.task.apply_gradients(state, grads, model_state), metrics

    def place_state(self, host_state: TrainState) -> TrainState:
        if self.codec is not None and not host_state.extras:
            host_state = host_state.replace(
                extras=self.codec.init_extras(host_state.params, self.p)
            )
        return place(host_state, _broadcast(self.shardings, host_state))

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        state, metrics = self._step(state, jax.device_put(batch, self.batch_sharding))
        if self.serialize_steps:
            jax.block_until_ready(state)
        return state, {**metrics, "comm_bytes": self.comm_bytes}

    def analytic_comm_bytes(self) -> int:
        """Bytes the allreduce of all fp32 gradients should send per step (all devices)."""
        if self.codec is not None:
            return self.codec.analytic_bytes(self.n_params, self.p)
        return analytic_bytes(self.spec.allreduce, 4 * self.n_params, self.p)

    def compiled_steps(self) -> list[Any]:
        return [self._step]

    def summary(self, history: History) -> dict[str, Any]:
        out = {
            "mesh": self.plan.mesh.as_dict(),
            "allreduce": self.spec.allreduce,
            "microbatches": self.plan.microbatches,
            "comm_bytes_per_step": self.comm_bytes,
            "comm_bytes_per_step_analytic": self.analytic_comm_bytes(),
            "comm_bytes_by_collective": self.comm_by_collective,
        }
        if self.codec is not None:
            dense = analytic_bytes("ring", 4 * self.n_params, self.p)
            out["compress"] = self.spec.compress
            out["compression_error"] = last(history, "compression_error")
            out["comm_bytes_per_step_uncompressed"] = dense
            out["comm_bytes_saved_per_step"] = dense - self.comm_bytes
        return out


def _broadcast(shardings: TrainState, state: TrainState) -> TrainState:
    """The per-field shardings of ``shardings`` spread over every leaf of ``state``."""
    return jax.tree.map(
        lambda sh, sub: jax.tree.map(lambda _: sh, sub),
        shardings,
        state,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
