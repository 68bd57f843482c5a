"""``data``: data parallelism. The minibatch is split over the ``data`` mesh axis;
each device computes the gradient of its shard, the gradients are averaged with
an allreduce, and every device applies the same update to its replica.

Written with ``shard_map`` so the allreduce is explicit: ``--allreduce xla``
(``lax.psum``, the collective XLA emits) or one of the reference algorithms in
``refdl.comm.allreduce`` (``ring``, ``tree``, ``halving-doubling``) applied to
the gradients as one flat buffer. ``--microbatches m`` accumulates each
shard's gradient over m slices first. ``--compress`` sends compressed
gradients with error feedback (``refdl.comm.compress``) - an inconsistent
variant that reports the bytes saved and the compression error; with ``--allreduce
sparse`` (``sparse-split``) the top-k pairs are summed by SparCML's sparse allreduce,
recursive doubling (split-allgather) (``refdl.comm.sparse``).
``--sfb auto|all``
(sufficient-factor broadcasting, Xie et al. 2015; Poseidon's hybrid): a fully connected
layer's weight gradient ``X^T dZ`` is not all-reduced; its factors, the layer's ``r``
input rows and the gradient at its output (``r (m + n)`` numbers against ``m n``), are
all-gathered and every device forms the mean gradient itself - where that moves fewer
bytes than the all-reduce (``auto``) or for every such layer (``all``); equal to the
dense exchange to fp32 rounding.

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
from refdl.comm.compress import SPARSE, make_codec
from refdl.comm.measure import collective_bytes
from refdl.config.choices import SPARSE_ALLREDUCE
from refdl.config.plan import Plan, Traits
from refdl.config.spec import RunSpec
from refdl.core.layers import batch_axis, param_count, sfb_mode, sufficient_factors
from refdl.core.state import TrainState, place
from refdl.errors import UsageError
from refdl.strategies.base import Batch, History, Strategy, last, register


def check_exchange(spec: RunSpec, plan: Plan) -> None:
    """The gradient exchange fits the data degree: halving-doubling and the sparse
    allreduce (top-k pairs by recursive doubling) want a power of two (``sparse-split``
    takes any), the sparse allreduce a top-k codec, quantized top-k values the sparse
    allreduce, and sufficient factors no codec."""
    p = plan.mesh.data
    if spec.allreduce == "halving-doubling" and p & (p - 1):
        raise UsageError(f"--allreduce halving-doubling needs a power-of-two data degree, not {p}")
    if spec.allreduce in SPARSE_ALLREDUCE:
        if not (spec.compress and spec.compress.topk):
            raise UsageError(f"--allreduce {spec.allreduce} sums the top-k of each gradient; add "
                             "--compress topk:RATIO (e.g. topk:0.01 or topk:0.01,q4)")  # fmt: skip
        if spec.allreduce == "sparse" and p & (p - 1):
            raise UsageError(f"--allreduce sparse needs a power-of-two data degree, not {p}; "
                             "--allreduce sparse-split takes any")  # fmt: skip
    elif spec.compress and spec.compress.bits != 32:
        raise UsageError(f"--compress {spec.compress}: q8/q4 values are the sparse allreduce's; "
                         "add --allreduce sparse")  # fmt: skip
    if spec.sfb != "off" and spec.compress:
        raise UsageError(f"--sfb {spec.sfb} sends factors uncompressed; use it without --compress")


@register("data")
class DataParallel(Strategy):
    """Replicated state, batch split on ``data``, explicit gradient allreduce."""

    traits = Traits(
        axes=("data",),
        options=frozenset({"mesh", "allreduce", "compress", "sfb"}),
        multiprocess="spmd",
        checks=(check_exchange,),
        cost="data_parallel",
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.p = plan.mesh.data
        self.mesh = plan.mesh.make(devices)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.codec = make_codec(spec.compress) if spec.compress else None
        self.n_params = param_count(task.model.abstract_params(task.sample_x))
        self.factors = self._factor_layers()  # layer key -> its exchange, with --sfb
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
        by_collective = collective_bytes(self._step.as_text(), self.p)
        self.comm_bytes = by_collective.pop("total", 0)
        self.comm_by_collective = by_collective

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
        keys = frozenset(k for k, v in self.factors.items() if v["mode"] == "factors")
        with batch_axis("data"), sufficient_factors("data", keys, self.p):
            loss, grads, model_state = self.task.accumulated_grads(
                state.params, state.model_state, batch, self.plan.microbatches
            )
        metrics = {"loss": loss[None]}
        if self.codec is not None:
            grads, state, extra = self.codec.exchange(
                grads, state, "data", self.p, self.spec.allreduce
            )
            metrics.update({k: v[None] for k, v in extra.items()})
        else:  # the factored layers' gradients are averaged already
            rest = {k: v for k, v in grads.items() if k not in keys}
            rest = allreduce_mean(rest, "data", self.p, self.spec.allreduce)
            grads = {k: rest.get(k, v) for k, v in grads.items()}
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

    def _factor_layers(self) -> dict[str, dict[str, Any]]:
        """With ``--sfb``: each fully connected layer's exchange, the bytes of both (all
        devices, a step): ``p (p - 1) 4 r (m + n)`` per microbatch for the fp32
        all-gathered factors of its ``r`` input rows on a device, the all-reduce's count
        of its ``m n + n`` gradient; ``auto`` takes the smaller, ``all`` the factors."""
        if self.spec.sfb == "off" or self.p == 1:
            return {}
        model, task = self.task.model, self.task
        params, state = model.abstract_variables(task.sample_x)
        b = self.spec.batch_size // (self.p * self.plan.microbatches)
        x = jax.ShapeDtypeStruct((b, *task.sample_x.shape[1:]), task.sample_x.dtype)
        out = {}
        for key, d in model.dense_layers(params, state, x).items():
            factors = (
                self.plan.microbatches
                * self.p
                * (self.p - 1)
                * 4
                * d["rows"]
                * (d["in"] + d["out"])
            )
            gradient = analytic_bytes(self.spec.allreduce, 4 * d["params"], self.p)
            mode = sfb_mode(self.spec.sfb, factors, gradient)
            out[key] = {"mode": mode, **d, "factor_bytes": factors, "gradient_bytes": gradient}
        return out

    def analytic_comm_bytes(self) -> int:
        """Bytes the allreduce of all fp32 gradients should send per step (all devices);
        with ``--sfb``, the factored layers' factors and the rest's all-reduce."""
        if self.codec is not None:
            return self.codec.analytic_bytes(self.n_params, self.p, self.spec.allreduce)
        factored = [v for v in self.factors.values() if v["mode"] == "factors"]
        rest = self.n_params - sum(v["params"] for v in factored)
        return analytic_bytes(self.spec.allreduce, 4 * rest, self.p) + sum(
            v["factor_bytes"] for v in factored
        )

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
        if self.factors:
            out["sfb"] = self.spec.sfb
            out["sfb_layers"] = self.factors
        if self.codec is not None:
            dense = analytic_bytes("ring", 4 * self.n_params, self.p)
            out["compress"] = str(self.spec.compress)
            out["compression_error"] = last(history, "compression_error")
            out["comm_bytes_per_step_uncompressed"] = dense
            out["comm_bytes_saved_per_step"] = dense - self.comm_bytes
        if self.spec.allreduce in SPARSE:
            sparse = self.codec.sparse(self.n_params, self.p, self.spec.allreduce)
            out["sparse_allreduce"] = {
                "algorithm": sparse.algorithm,
                "n": sparse.n, "k": sparse.k, "value_bits": sparse.bits,
                "rounds": [kind for kind, _ in sparse.rounds()],
                "bytes_per_device_by_round": sparse.bytes_per_device(),
                "switch_round": sparse.switch_round(),
                "union_density": last(history, "union_density"),
            }  # fmt: skip
        return out


def _broadcast(shardings: TrainState, state: TrainState) -> TrainState:
    """The per-field shardings of ``shardings`` spread over every leaf of ``state``."""
    return jax.tree.map(
        lambda sh, sub: jax.tree.map(lambda _: sh, sub),
        shardings,
        state,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
