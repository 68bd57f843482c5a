"""``fsdp``: sharded data parallelism, ZeRO stages 1-3 (Rajbhandari et al., SC 2020).

Data parallelism over the ``data`` axis, written with ``shard_map``, in which
each of the P ranks keeps 1/P of what plain data parallelism replicates
(``refdl.parallel.sharded``: every parameter leaf flat, padded, split in P):

- ``--zero 1``: the optimizer state. Full gradients are computed, summed and
  scattered at the end of the backward (reduce-scatter), each rank updates its
  shard of the parameters, and the shards are all-gathered into the replicated
  parameters: ``2 Psi`` per rank, as an allreduce.
- ``--zero 2``: also the gradients: each layer's gradient is reduce-scattered as
  soon as the backward produces it; with m microbatches every microbatch's
  backward does so: ``(m + 1) Psi``.
- ``--zero 3``: also the parameters: only shards are stored; each layer gathers
  its parameters before its forward and again in its backward:
  ``3 m Psi`` - less ``m Psi_lookup``, the tables of embedding lookups, whose
  backward (a scatter-add of the output gradient) does not read them, so XLA
  drops their second gather.

``Psi`` is the padded parameter bytes and a collective's bytes are what its ring
sends (``refdl.comm.measure``): a reduce-scatter or all-gather of ``Psi`` sends
``(P - 1) / P * Psi`` per rank, so the totals over the P ranks are ``2 (P - 1)
Psi``, ``(m + 1)(P - 1) Psi`` and ``3 m (P - 1) Psi`` - the ZeRO paper's 2Psi, 2Psi
and 3Psi per rank (section 7) for m = 1 and large P. The summary reports the
count read from the compiled program beside this formula, and the memory each
rank holds (the live shards; XLA's temporary buffers of the step) beside the
paper's ``(2 + 2 + K) Psi`` split.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.comm.measure import collective_bytes
from refdl.config.plan import Traits
from refdl.core.layers import Embed, PositionalEmbed, batch_axis
from refdl.core.losses import LOSSES
from refdl.core.moe import step_stats, with_step_stats
from refdl.core.optim import muon_dims, orthogonalized_by
from refdl.core.state import TrainState, place, to_host
from refdl.parallel.muon import muon_leaf_bytes, muon_shapes, orthogonalizer, owners, scheme_bytes
from refdl.parallel.sharded import flat_pad, gather, gathered, padded, scatter, scattered, unflat
from refdl.strategies.base import Batch, History, Strategy, last, memory_of, register

AXIS = "data"


@register("fsdp")
class FSDP(Strategy):
    """ZeRO stage 1, 2 or 3 over every device on ``data``."""

    traits = Traits(
        axes=("data",),
        options=frozenset({"mesh", "zero", "muon"}),
        multiprocess="spmd",
        shards_params=True,
        cost="zero_sharding",
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        super().__init__(task, spec, plan, devices, batches)
        self.p, self.zero, self.m = plan.mesh.data, spec.zero, plan.microbatches
        self.stage = STAGES[spec.zero]  # what the stage shards and where it communicates
        self.mesh = plan.mesh.make(devices)
        abstract = task.abstract_state()
        self.abstract_opt = abstract.opt_state  # the whole state's optimizer leaves' shapes
        self.shapes = jax.tree.map(lambda a: a.shape, abstract.params)
        self.layers = task.model.split(range(1, len(task.model)))  # one sub-model per layer
        self._muon(spec, abstract)
        flat = jax.tree.map(lambda a: jax.ShapeDtypeStruct((padded(a.size, self.p),), a.dtype),
                            abstract.params)  # fmt: skip
        # Replicated parameters (stages 1, 2) or their shards (3); the optimizer's state
        # always sharded; everything else replicated.
        shard, rep = P(AXIS), P()
        self.specs = TrainState(
            step=rep,
            params=jax.tree.map(lambda _: shard if self.stage.shards_params else rep,
                                abstract.params),
            model_state=jax.tree.map(lambda _: rep, abstract.model_state),
            opt_state=optax.tree_map_params(
                task.optimizer, lambda _: shard, jax.eval_shape(task.optimizer.init, flat),
                transform_non_params=lambda _: rep,
            ),
            rng=rep,
            extras={},
        )  # fmt: skip
        self.shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.specs, is_leaf=lambda x: isinstance(x, P)
        )
        self.batch_sharding = NamedSharding(self.mesh, P(AXIS))
        # Unchecked replication (as ``data``): every collective is the one written here, none
        # is inserted by autodiff for the replicated parameters' gradients.
        step = jax.shard_map(self._local_step, mesh=self.mesh, in_specs=(self.specs, P(AXIS)),
                             out_specs=(self.specs, P()), check_vma=False)  # fmt: skip
        state = self.placed(self.to_layout(abstract, abstract=True))
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
                 for k, v in self.abstract_batch().items()}  # fmt: skip
        self._step = self.jit(step, donate_argnums=0).lower(state, batch).compile()
        self.comm = collective_bytes(self._step.as_text(), self.p)
        # The optimizer's words per parameter (SGD 0, momentum 1, Adam 2): its leaves shaped
        # like the parameters, over the parameter leaves.
        marks = optax.tree_map_params(task.optimizer, lambda _: 1, abstract.opt_state,
                                      transform_non_params=lambda _: 0)  # fmt: skip
        self.words = sum(jax.tree.leaves(marks)) // len(jax.tree.leaves(abstract.params))
        self.param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract.params))
        self.opt_scalar_bytes = sum(
            a.size * a.dtype.itemsize
            for a, marked in zip(jax.tree.leaves(abstract.opt_state), jax.tree.leaves(marks),
                                 strict=True)
            if not marked
        )  # fmt: skip
        memory = memory_of(self._step)  # XLA's buffers inside the step
        self.temp_bytes = int(memory.temp_size_in_bytes) if memory is not None else None

    def _muon(self, spec: Any, abstract: TrainState) -> None:
        """Muon's matrices and how a rank's flat shards of them are orthogonalized
        (``--muon``, ``refdl.parallel.muon``); nothing without ``--optimizer muon``."""
        self.muon_matrices: dict[str, tuple[int, ...]] = {}
        self.orthogonalize = None
        if spec.optimizer != "muon":
            return
        dims = muon_dims(self.task.logical_axes)(abstract.params)
        self.muon_matrices = muon_shapes(dims, self.shapes)
        sizes = {k: int(np.prod(v)) for k, v in self.muon_matrices.items()}
        self.owner = owners(sizes, self.p)
        self.orthogonalize = orthogonalizer(spec.muon, self.muon_matrices, self.owner, AXIS,
                                            self.p)  # fmt: skip

    def muon_bytes(self) -> int:
        """Bytes the Muon scheme sends per step, summed over ranks (0 without Muon)."""
        if not self.muon_matrices:
            return 0
        leaves = muon_leaf_bytes(self.muon_matrices, 4, self.p)
        return scheme_bytes(self.spec.muon, leaves, self.p)

    # -- the state's layout ---------------------------------------------------------------------

    def to_layout(self, state: TrainState, abstract: bool = False) -> TrainState:
        """A whole host state in this strategy's layout: optimizer leaves (and with stage 3
        the parameters) flat and padded; shapes only when ``abstract``."""
        to_flat = (
            (lambda a: jax.ShapeDtypeStruct((padded(a.size, self.p),), a.dtype))
            if abstract
            else (lambda a: flat_pad(np.asarray(a), self.p))
        )
        params = jax.tree.map(to_flat, state.params) if self.stage.shards_params else state.params
        opt = optax.tree_map_params(self.task.optimizer, to_flat, state.opt_state)
        return state.replace(params=params, opt_state=opt, extras={})

    def from_layout(self, state: TrainState) -> TrainState:
        """The inverse of ``to_layout`` (host arrays)."""
        shaped = lambda a, shape: np.asarray(unflat(a, shape))  # noqa: E731
        params = state.params
        if self.stage.shards_params:
            params = jax.tree.map(shaped, params, self.shapes)
        # leaf by leaf against the whole state's shapes (its masks, as Muon's, in the same
        # places): a flat leaf takes its parameter's shape, a scalar stays
        opt = jax.tree.map(lambda a, ref: a if np.shape(a) == ref.shape else shaped(a, ref.shape),
                           state.opt_state, self.abstract_opt)  # fmt: skip
        return state.replace(params=params, opt_state=opt)

    # -- checkpoints: the logical arrays, sharded on their first axis where it divides ---------

    @functools.cached_property
    def _logical(self) -> TrainState:
        """The shardings of the checkpoint view: each leaf's first axis split over ``data``
        where P divides it, else replicated (written once, by the process holding
        replica 0)."""

        def one(a: Any) -> NamedSharding:
            split = len(a.shape) > 0 and a.shape[0] % self.p == 0
            return NamedSharding(self.mesh, P(AXIS) if split else P())

        return jax.tree.map(one, self.task.abstract_state())

    @functools.cached_property
    def _to_logical(self) -> Any:
        def f(state: TrainState) -> TrainState:
            params = state.params
            if self.stage.shards_params:
                params = jax.tree.map(unflat, params, self.shapes)
            opt = jax.tree.map(lambda a, ref: a if a.shape == ref.shape else unflat(a, ref.shape),
                               state.opt_state, self.abstract_opt)  # fmt: skip
            return state.replace(params=params, opt_state=opt)

        return self.jit(f, out_shardings=self._logical)

    @functools.cached_property
    def _from_logical(self) -> Any:
        def f(view: TrainState) -> TrainState:
            to_flat = functools.partial(flat_pad, p=self.p)
            params = view.params
            if self.stage.shards_params:
                params = jax.tree.map(to_flat, params)
            opt = optax.tree_map_params(self.task.optimizer, to_flat, view.opt_state)
            return view.replace(params=params, opt_state=opt, extras={})

        return self.jit(f, out_shardings=self.shardings)

    def checkpoint_view(self, state: TrainState) -> TrainState:
        return self._to_logical(state)

    def checkpoint_target(self, seed: int) -> TrainState:
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            self.task.abstract_state(), self._logical)  # fmt: skip

    def from_checkpoint(self, view: TrainState) -> TrainState:
        return self._from_logical(view)

    def placed(self, tree: TrainState) -> TrainState:
        """Abstract shapes carrying this strategy's shardings (for compiling)."""
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, self.shardings
        )

    def place_state(self, host_state: TrainState) -> TrainState:
        return place(self.to_layout(host_state), self.shardings)

    def gather_state(self, state: TrainState) -> TrainState:
        return self.from_layout(to_host(state))

    # -- one step, as one rank sees it ----------------------------------------------------------

    def layer_by_layer(self, run: Any, params: Any, sinks: Any, model_state: Any, x: jax.Array):
        """The model a layer at a time, each layer with parameters run by ``run(apply, key,
        params, sinks, state, x)`` (stage 2 scatters its gradient, stage 3 gathers it)."""
        new_state = {}
        for sub in self.layers:
            key = sub.keys[0]
            state = {key: model_state[key]} if key in model_state else {}
            if not jax.tree.leaves(params[key]):
                x, updated = sub.apply({}, state, x, train=True)
            else:
                apply = functools.partial(_apply_one, sub, key)
                x, updated = run(apply, key, params, sinks, state, x)
            new_state.update(updated)
        return x, new_state

    def _local_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Any]:
        loss_of, stage = LOSSES.get(self.task.loss), self.stage
        size = lambda a: padded(a.size, self.p) // self.p  # noqa: E731
        # Stage 2's gradient sinks: zeros shaped like this rank's shards.
        sinks = jax.tree.map(lambda a: jnp.zeros((size(a),), a.dtype), state.params)

        def loss_fn(differentiated, model_state, mb):
            params, sink = stage.arguments(differentiated, state.params, sinks)
            out, new_state = stage.forward(self, params, sink, model_state, mb["x"])
            return loss_of(out, mb["y"]), new_state

        wrt = stage.arguments_of(state.params, sinks)
        model_state, losses, grads, stats = state.model_state, [], None, []
        with batch_axis(AXIS):
            for mb in _microbatches(batch, self.m):
                (loss, model_state), g = jax.value_and_grad(loss_fn, has_aux=True)(
                    wrt, model_state, mb
                )
                losses.append(loss)
                stats.append(step_stats(model_state))
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        # mixture-of-experts statistics: the step's, the mean over its microbatches
        model_state = with_step_stats(model_state, jax.tree.map(lambda *v: sum(v) / self.m, *stats))
        grads = stage.reduce(grads, self.p)
        grads = jax.tree.map(lambda g: g / (self.p * self.m), grads)  # the global mean
        shards = stage.shards_of(state.params, jax.lax.axis_index(AXIS), self.p)
        with orthogonalized_by(self.orthogonalize) if self.orthogonalize else nullcontext():
            updates, opt_state = self.task.optimizer.update(grads, state.opt_state, shards)
        shards = optax.apply_updates(shards, updates)
        params = stage.params_of(shards, self.shapes)
        new = state.replace(step=state.step + 1, params=params, model_state=model_state,
                            opt_state=opt_state)  # fmt: skip
        loss = jax.lax.pmean(jnp.mean(jnp.stack(losses)), AXIS)
        return new, {"loss": loss}

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        state, metrics = self._step(state, jax.device_put(batch, self.batch_sharding))
        if self.serialize_steps:
            jax.block_until_ready(state)
        return state, {**metrics, "comm_bytes": self.comm.get("total", 0)}

    # -- what the summary reports ----------------------------------------------------------------

    def padded_param_bytes(self, shapes: Any = None) -> int:
        """``Psi``: bytes of every parameter leaf (of ``shapes``, default all), padded to a
        multiple of P elements."""
        leaves = jax.tree.leaves(self.shapes if shapes is None else shapes,
                                 is_leaf=lambda x: isinstance(x, tuple))  # fmt: skip
        return sum(4 * padded(int(np.prod(s)), self.p) for s in leaves)

    def lookup_param_bytes(self) -> int:
        """``Psi_lookup``: padded bytes of the embedding tables (``Embed``, ``PositionalEmbed``),
        which a backward does not read."""
        keys = [k for k, layer in zip(self.task.model.keys, self.task.model.layers, strict=True)
                if isinstance(layer, Embed | PositionalEmbed)]  # fmt: skip
        return self.padded_param_bytes({k: self.shapes[k] for k in keys})

    def analytic_comm_bytes(self) -> int:
        """Bytes the stage's reduce-scatters and all-gathers send per step, summed over ranks
        (the module's docstring)."""
        if self.p == 1:
            return 0
        per_rank = self.stage.comm(self.padded_param_bytes(), self.m, self.lookup_param_bytes())
        return (self.p - 1) * per_rank + self.muon_bytes()

    def extra_metrics(self, state: TrainState) -> dict[str, Any]:
        """Bytes of the live parameter and optimizer-state arrays on the first device."""
        device = self.devices[0]

        def on_device(tree: Any) -> int:
            return sum(
                s.data.nbytes
                for leaf in jax.tree.leaves(tree)
                for s in leaf.addressable_shards
                if s.device == device
            )

        return {
            "param_bytes_per_device": on_device(state.params),
            "optimizer_bytes_per_device": on_device(state.opt_state),
        }

    def analytic_memory(self) -> dict[str, int]:
        """Bytes per rank of the stage's split (the ZeRO paper's figure 1, fp32 here):
        parameters ``Psi`` (stage 3: ``Psi / P``, padded), gradients ``Psi`` (stages 2, 3:
        ``Psi / P``), optimizer state ``K Psi / P`` with K its words per parameter (Adam 2)
        plus its scalars (Adam's step count)."""
        psi, p = self.padded_param_bytes(), self.p
        return {
            "params": psi // p if self.stage.shards_params else self.param_bytes,
            "gradients": psi // p if self.stage.shards_grads else psi,
            "optimizer_state": self.words * psi // p + self.opt_scalar_bytes,
        }

    def compiled_steps(self) -> list[Any]:
        return [self._step]

    def summary(self, history: History) -> dict[str, Any]:
        measured = {
            "params": last(history, "param_bytes_per_device"),
            "optimizer_state": last(history, "optimizer_bytes_per_device"),
            "step_temp": self.temp_bytes,  # XLA's buffers inside the step, gradients among them
        }
        return {
            "mesh": self.plan.mesh.as_dict(),
            "zero": self.zero,
            **(
                {
                    "muon": self.spec.muon,
                    "muon_comm_bytes_per_step_analytic": self.muon_bytes(),
                    "muon_owners": self.owner,
                }
                if self.muon_matrices
                else {}
            ),
            "microbatches": self.m,
            "comm_bytes_per_step": self.comm.get("total"),
            "comm_bytes_per_step_analytic": self.analytic_comm_bytes(),
            "comm_bytes_by_collective": {k: v for k, v in self.comm.items() if k != "total"},
            "padded_param_bytes": self.padded_param_bytes(),
            "memory_per_device": measured,
            "memory_per_device_analytic": self.analytic_memory(),
        }


def _apply_one(sub: Any, key: str, params: Any, state: Any, x: jax.Array):
    """A one-layer sub-model applied to that layer's parameters alone."""
    return sub.apply({key: params}, state, x, train=True)


def _microbatches(batch: Batch, m: int) -> list[Batch]:
    """``batch`` cut into ``m`` equal consecutive slices (unrolled: each slice's collectives
    appear, and are counted, in the compiled program)."""
    n = next(iter(batch.values())).shape[0] // m
    return [{k: v[i * n : (i + 1) * n] for k, v in batch.items()} for i in range(m)]


class Zero1:
    """Stage 1, the optimizer state sharded: the plain model's full gradient, accumulated
    over the microbatches, then one reduce-scatter; the updated shards all-gathered."""

    shards_params, shards_grads = False, False

    def forward(self, fsdp: FSDP, params: Any, sinks: Any, model_state: Any, x: jax.Array):
        return fsdp.task.model.apply(params, model_state, x, train=True)

    def arguments_of(self, params: Any, sinks: Any) -> Any:
        """What the gradient is taken with respect to."""
        return params

    def arguments(self, differentiated: Any, params: Any, sinks: Any) -> tuple[Any, Any]:
        """The forward's parameters and sinks, given the differentiated argument."""
        return differentiated, sinks

    def reduce(self, grads: Any, p: int) -> Any:
        return scatter(grads, AXIS, p)

    def shards_of(self, params: Any, rank: jax.Array, p: int) -> Any:
        """This rank's shard of the replicated parameters."""
        size = lambda a: padded(a.size, p) // p  # noqa: E731
        return jax.tree.map(
            lambda a: jax.lax.dynamic_slice(flat_pad(a, p), (rank * size(a),), (size(a),)),
            params,
        )

    def params_of(self, shards: Any, shapes: Any) -> Any:
        """Every rank's updated shard, all-gathered into the replicated parameters."""
        return gather(shards, shapes, AXIS)

    def comm(self, psi: int, m: int, lookup: int) -> int:
        """Bytes a rank's collectives carry per step, in units the module's docstring uses."""
        return 2 * psi


class Zero2(Zero1):
    """Stage 2, also the gradients: each layer's gradient reduce-scattered into a sink as
    the backward produces it, every microbatch."""

    shards_grads = True

    def forward(self, fsdp: FSDP, params: Any, sinks: Any, model_state: Any, x: jax.Array):
        def run(apply, key, params, sinks, state, x):
            return scattered(apply, AXIS, fsdp.p)(params[key], sinks[key], state, x)

        return fsdp.layer_by_layer(run, params, sinks, model_state, x)

    def arguments_of(self, params: Any, sinks: Any) -> Any:
        return sinks

    def arguments(self, differentiated: Any, params: Any, sinks: Any) -> tuple[Any, Any]:
        return params, differentiated

    def reduce(self, grads: Any, p: int) -> Any:
        return grads  # already this rank's shards

    def comm(self, psi: int, m: int, lookup: int) -> int:
        return (m + 1) * psi


class Zero3(Zero1):
    """Stage 3, also the parameters: only shards stored; each layer gathers its parameters
    before its forward and again in its backward, and reduce-scatters its gradient."""

    shards_params, shards_grads = True, True

    def forward(self, fsdp: FSDP, params: Any, sinks: Any, model_state: Any, x: jax.Array):
        def run(apply, key, params, sinks, state, x):
            return gathered(apply, fsdp.shapes[key], AXIS, fsdp.p)(params[key], state, x)

        return fsdp.layer_by_layer(run, params, sinks, model_state, x)

    def reduce(self, grads: Any, p: int) -> Any:
        return grads  # the shards' gradients

    def shards_of(self, params: Any, rank: jax.Array, p: int) -> Any:
        return params

    def params_of(self, shards: Any, shapes: Any) -> Any:
        return shards

    def comm(self, psi: int, m: int, lookup: int) -> int:
        return m * (3 * psi - lookup)  # embedding tables are not gathered for their backward


STAGES = {1: Zero1(), 2: Zero2(), 3: Zero3()}
