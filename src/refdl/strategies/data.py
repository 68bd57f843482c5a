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
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.allreduce import allreduce_mean, analytic_bytes
from refdl.comm.measure import collective_bytes
from refdl.core.layers import batch_axis, param_count
from refdl.core.state import TrainState, to_host
from refdl.errors import UsageError
from refdl.mesh import MeshSpec
from refdl.strategies.base import Batch, Strategy, register


@register("data")
class DataParallel(Strategy):
    """Replicated state, batch split on ``data``, explicit gradient allreduce."""

    multiprocess = "spmd"

    @classmethod
    def predict_cost(cls, model_cost, hw, batch, workers, opts):
        from refdl.perf import costs

        return costs.data(model_cost, hw, batch, workers, opts)

    def __init__(self, task, spec, devices) -> None:
        super().__init__(task, spec, devices)
        self.mesh_spec = MeshSpec.parse(spec.mesh, len(devices))
        if self.mesh_spec.model != 1 or self.mesh_spec.pipe != 1:
            raise UsageError(
                "--strategy data uses only the data axis; use --strategy hybrid for "
                f"--mesh {spec.mesh}"
            )
        self.p = self.mesh_spec.data
        self.mesh_spec.check_batch(spec.batch_size, spec.microbatches)
        if spec.allreduce == "halving-doubling" and self.p & (self.p - 1):
            raise UsageError(
                f"--allreduce halving-doubling needs a power-of-two data degree, not {self.p}"
            )
        self.mesh = self.mesh_spec.make(devices)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.codec = None
        if spec.compress:
            from refdl.comm.compress import make_codec

            self.codec = make_codec(spec.compress)
        # Replicated state; a compressor's residuals are per worker, split on `data`.
        extras = P("data") if self.codec is not None else P()
        self.state_specs = TrainState(P(), P(), P(), P(), P(), extras)
        self._jitted = jax.jit(
            jax.shard_map(
                self._local_step,
                mesh=self.mesh,
                in_specs=(self.state_specs, P("data")),
                out_specs=(self.state_specs, P("data")),
                check_vma=False,  # ppermute results are typed "varying"; they are equal
            ),
            donate_argnums=0,
        )
        self._compiled = None
        self.measured: dict[str, int] = {}
        self.last_metrics: dict[str, Any] = {}

    def _local_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Any]:
        """One step as seen by one device: its shard in, the replicated new state out."""
        with batch_axis("data"):
            loss, grads, model_state = self.task.accumulated_grads(
                state.params, state.model_state, batch, self.spec.microbatches
            )
        metrics = {"loss": loss[None]}
        if self.codec is not None:
            grads, state, extra = self.codec.exchange(grads, state, "data", self.p)
            metrics.update({k: v[None] for k, v in extra.items()})
        else:
            grads = allreduce_mean(grads, "data", self.p, self.spec.allreduce)
        return self.task.apply_gradients(state, grads, model_state), metrics

    def place_state(self, host_state: TrainState) -> TrainState:
        self.n_params = param_count(host_state.params)
        if self.codec is not None and not host_state.extras:
            host_state = host_state.replace(
                extras=self.codec.init_extras(host_state.params, self.p)
            )
        shardings = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.state_specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        return jax.device_put(host_state, shardings)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        batch = jax.device_put(batch, self.batch_sharding)
        if self._compiled is None:
            self._compiled = self._jitted.lower(state, batch).compile()
            self.measured = collective_bytes(self._compiled.as_text(), self.p)
        state, metrics = self._compiled(state, batch)
        # Finish each step before dispatching the next: with simulated CPU devices, queued
        # steps can occupy every thread of XLA's pool inside a collective's rendezvous and
        # deadlock (seen with 8 devices on 2 cores when steps were not awaited).
        jax.block_until_ready(state)
        out = {"loss": metrics.pop("loss"), "comm_bytes": self.measured.get("total", 0)}
        out.update({k: float(np.mean(to_host(v))) for k, v in metrics.items()})
        self.last_metrics = out
        return state, out

    def analytic_comm_bytes(self) -> int:
        """Bytes the allreduce of all fp32 gradients should send per step (all devices)."""
        n_bytes = 4 * self.n_params
        if self.codec is not None:
            return self.codec.analytic_bytes(n_bytes // 4, self.p)
        return analytic_bytes(self.spec.allreduce, n_bytes, self.p)

    def summary(self) -> dict[str, Any]:
        out = {
            "mesh": self.mesh_spec.as_dict(),
            "allreduce": self.spec.allreduce,
            "microbatches": self.spec.microbatches,
            "comm_bytes_per_step": self.measured.get("total"),
            "comm_bytes_per_step_analytic": self.analytic_comm_bytes(),
            "comm_bytes_by_collective": {k: v for k, v in self.measured.items() if k != "total"},
        }
        if self.codec is not None:
            out["compress"] = self.spec.compress
            out["compression_error"] = self.last_metrics.get("compression_error")
            dense = analytic_bytes("ring", 4 * self.n_params, self.p)
            out["comm_bytes_per_step_uncompressed"] = dense
            out["comm_bytes_saved_per_step"] = dense - (self.measured.get("total") or 0)
        return out
