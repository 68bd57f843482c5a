"""``pipeline``: consecutive layers form stages on different devices; microbatches flow
through them in the order a schedule table gives (``refdl.parallel.schedule``).

The model's layers are cut into ``stages x chunks`` contiguous virtual stages,
balanced by parameter count; the schedule places virtual stage ``k`` on a device
(``k % stages`` for the looped schedules, a V for ZB-V and DualPipeV). The executor walks the
table dispatching every operation without waiting (JAX orders them by their
data), except on the steps it times (below) and where a stage's programs hold
collectives on simulated CPU devices (``dispatch_ahead``): there it waits slot
by slot. A forward sends its output activation to the next virtual stage's
device; a backward recomputes its chunk's forward under ``jax.vjp`` from the
stashed input (rematerialisation), accumulates the parameter gradient and sends
the input gradient back. The zero-bubble schedules split that backward into two
programs: ``B`` (the gradient w.r.t. the chunk's input, sent back at once) and
``W`` (w.r.t. its parameters, run later from the kept input and output
gradient). The last stage's loss is scaled by ``1/microbatches``, so the summed
gradient is the full batch's and the step equals ``single``'s. Each stage then
applies the optimizer to its own parameters (optax's sgd/momentum/nesterov/adam
are element-wise, so per-stage updates equal one update of the whole tree).

Bubble accounting: ``bubble_fraction_analytic`` is read off the table
(idle share of ``stages x slots``); ``bubble_fraction_measured`` is
``1 - sum(busy) / (stages x step time)`` from the recorded timeline of the steps
it times (``StepClock``: the first two and the ones the loop logs), walked slot by
slot, each operation busy from its slot's start until its result is ready. The other steps
carry no timeline (the host cannot see when an operation dispatched ahead starts).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.config.choices import LOOPED
from refdl.config.mesh import AXES
from refdl.config.plan import Traits
from refdl.config.rules import param_spec
from refdl.core import conv
from refdl.core.losses import LOSSES
from refdl.core.moe import loss_scale
from refdl.core.state import TrainState, per_param, place
from refdl.parallel.schedule import build as build_schedule
from refdl.parallel.schedule import device_of
from refdl.parallel.tracing import batch_dims, in_order, token_order, traced_on
from refdl.strategies.base import (
    Batch,
    FirstCall,
    History,
    Strategy,
    memory_of,
    register,
    steady_median,
)
from refdl.strategies.pipeline_walk import Recorder, Walk

MEASURE_EVERY = 5  # steps between timed ones when the loop logs none (--log-every 0)


class StepClock:
    """Which steps the executor times (walks slot by slot): the first two it takes, and
    those the training loop logs, every ``every``-th step counted from the state's own
    step (read once, on the first call, so a resumed run logs the same steps)."""

    def __init__(self, every: int) -> None:
        self.every, self.step, self.calls = every, None, 0

    def timed(self, state: Any) -> bool:
        if self.step is None:
            self.step = int(jax.device_get(state[0].step))
        self.step, self.calls = self.step + 1, self.calls + 1
        return self.calls <= 2 or self.step % self.every == 0


@register("pipeline")
class Pipeline(Strategy):
    """GPipe, 1F1B, interleaved 1F1B, looped BFS, ZB-H1, ZB-V or DualPipeV over
    ``--stages`` devices, executed from the table."""

    gathered_checkpoint = True  # each stage's state on its own devices: gathered to save

    traits = Traits(
        axes=("pipe",),
        options=frozenset({"stages", "schedule", "chunks", "stage_boundaries", "plot_schedule"}),
        pipeline=True,
        cost="pipeline",
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        """One stage per device; under ``hybrid`` (``plan.mesh`` with ``data``, ``fsdp`` or
        ``model`` > 1) each stage owns the ``data x fsdp x model`` sub-mesh at its ``pipe``
        index and its parameters are split by the plan's rules."""
        super().__init__(task, spec, plan, devices, batches)
        p, v, m = plan.mesh.pipe, plan.chunks, plan.microbatches
        mesh = plan.mesh.make(devices)
        self.submeshes = [Mesh(mesh.devices[..., s], AXES[:-1]) for s in range(p)]
        self.rules = plan.rules if plan.mesh.size > p else {}
        # The plan's chunks per device (checked); the table takes the looped schedules' own.
        self.schedule = build_schedule(spec.schedule, p, m, v if spec.schedule in LOOPED else 1)
        self.boundaries = list(plan.cuts)
        self.chunks = task.model.split(self.boundaries)
        self.p, self.v, self.m = p, v, m
        self.k_last = p * v - 1
        self.device = [device_of(spec.schedule, p, k)[0] for k in range(p * v)]
        self.abstract = task.abstract_state()  # the whole state's structure, for gather_state
        self.order = token_order(plan, task.sample_x)  # a context axis's token order
        self._clock = StepClock(spec.log_every or MEASURE_EVERY)  # the steps it times
        self.shardings = [
            self.state_sharding(k, self.stage_state(self.abstract, k))
            for k in range(len(self.chunks))
        ]
        self._jit()

    def act_sharding(self, k: int) -> NamedSharding:
        """Where virtual stage ``k``'s inputs live: its sub-mesh, the batch split as the plan
        says (``data``, or ``data x fsdp``; with ``expert``), the sequence over ``context``."""
        dims = batch_dims(self.plan, self.order)
        return NamedSharding(self.submeshes[self.device[k]], P(*dims))

    def state_sharding(self, k: int, st: TrainState) -> TrainState:
        """Virtual stage ``k``'s state on its sub-mesh: parameters (and their optimizer
        moments) split by the tensor-parallel rules, everything else replicated."""
        mesh = self.submeshes[self.device[k]]
        rep = NamedSharding(mesh, P())
        fsdp = self.plan.mesh.fsdp
        params = {
            key: jax.tree.map(
                lambda a, names: NamedSharding(mesh, param_spec(names, a.shape, self.rules, fsdp)),
                st.params[key],
                self.task.logical_axes[key],
            )
            for key in st.params
        }
        opt = per_param(self.task.optimizer, st.opt_state, params, rep)
        every = lambda tree: jax.tree.map(lambda _: rep, tree)  # noqa: E731
        return TrainState(rep, params, every(st.model_state), opt, rep, every(st.extras))

    def _jit(self) -> None:
        loss_fn = LOSSES.get(self.task.loss)
        scale = 1.0 / self.m

        def make(chunk, last, mesh):
            """Chunk ``chunk``'s programs: forward; backward (both gradients); and the split
            backward's input-gradient and weight-gradient halves. On the last virtual stage
            the output gradient is the scaled loss's, so ``g`` is the labels there.
            ``mesh``: the stage's sub-mesh, which its programs are traced on
            (``refdl.parallel.tracing.traced_on``)."""

            def apply(p_, state, x_):
                with traced_on(mesh, self.plan, self.spec, self.order), loss_scale(scale):
                    return chunk.apply(p_, state, x_, train=True)  # traced at the first call

            def out(p_, state, x_, g):
                y = apply(p_, state, x_)[0]
                return loss_fn(y, g) * scale if last else y

            def fwd(params, state, x, *y):
                o, new_state = apply(params, state, x)
                return (loss_fn(o, y[0]) if last else o), new_state

            def pull(f, primal, g):  # the vector-Jacobian product of f at primal, with g
                value, vjp = jax.vjp(f, primal)
                return vjp(jnp.ones_like(value) if last else g)[0]

            def bwd(params, state, x, g):
                return pull(lambda px: out(px[0], state, px[1], g), (params, x), g)

            def bwd_input(params, state, x, g):
                return pull(lambda x_: out(params, state, x_, g), x, g)

            def bwd_weight(params, state, x, g):
                return pull(lambda p_: out(p_, state, x, g), params, g)

            return Programs(*(FirstCall(self.jit(f)) for f in (fwd, bwd, bwd_input, bwd_weight)))

        self._fns = [
            make(c, k == self.k_last, self.submeshes[self.device[k]])
            for k, c in enumerate(self.chunks)
        ]
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        # Each stage's update returns its state with the shardings it was placed with, so a
        # state restored from a checkpoint runs the very programs an uninterrupted run does.
        self._updates = [
            self.jit(self.task.apply_gradients, donate_argnums=0, out_shardings=sh)
            for sh in self.shardings
        ]

    # -- state: one TrainState per virtual stage, on its device ------------------------------

    def stage_state(self, state: TrainState, k: int) -> TrainState:
        """Virtual stage ``k``'s part of a whole state (host arrays or abstract shapes): its
        layers' parameters, model state and optimizer moments, the shared step and RNG."""
        keys = self.chunks[k].keys
        params = {key: state.params[key] for key in keys}
        by_path = _by_path(state.opt_state)
        opt = jax.tree_util.tree_map_with_path(
            lambda path, _: by_path[jax.tree_util.keystr(path)],
            jax.eval_shape(self.task.optimizer.init, params),
        )
        model_state = {key: v for key, v in state.model_state.items() if key in keys}
        return TrainState(state.step, params, model_state, opt, state.rng)

    def place_state(self, host_state: TrainState) -> TrainState:
        return [  # type: ignore[return-value]
            place(self.stage_state(host_state, k), self.shardings[k])
            for k in range(len(self.chunks))
        ]

    def gather_state(self, state: Any) -> TrainState:
        host = [jax.device_get(s) for s in state]
        params = {k: v for s in host for k, v in s.params.items()}
        model_state = {k: v for s in host for k, v in s.model_state.items()}
        found: dict[str, Any] = {}
        for s in reversed(host):  # shared leaves (e.g. Adam's count) from stage 0
            found.update(_by_path(s.opt_state))
        opt = jax.tree_util.tree_map_with_path(
            lambda path, _: np.asarray(found[jax.tree_util.keystr(path)]),
            self.abstract.opt_state,
        )
        return TrainState(
            step=np.asarray(host[0].step),
            params=jax.tree.map(np.asarray, params),
            model_state=jax.tree.map(np.asarray, model_state),
            opt_state=opt,
            rng=np.asarray(host[0].rng),
            extras={},
        )

    # -- one step: walk the table --------------------------------------------------------------

    def train_step(self, state: Any, batch: Batch) -> tuple[Any, dict[str, Any]]:
        # The stage programs are traced at their first call, here: a stage split by the
        # tensor-parallel rules keeps XLA's convolution (``refdl.core.conv.xla_only``).
        with conv.xla_only(self.plan.mesh.model > 1):
            return self._walk(state, batch)

    def _walk(self, state: Any, batch: Batch) -> tuple[Any, dict[str, Any]]:
        """One step: the table walked, an operation at a time (``pipeline_walk``), then each
        stage's optimizer update."""
        batch = in_order(batch, self.order)
        # Every microbatch's input to the first stage and labels to the last, in one
        # transfer each (a device_put per microbatch cost ~100 us of host time apiece).
        xs = jax.device_put(np.split(batch["x"], self.m), self.act_sharding(0))
        ys = jax.device_put(np.split(batch["y"], self.m), self.act_sharding(self.k_last))
        # Timed steps (the first two and the logged ones) wait slot by slot and record the
        # timeline (the bubble); the others dispatch the whole table and return at once.
        rec = Recorder(self.device, self.p, self._clock.timed(state) or not self.dispatch_ahead)
        place = lambda value, k: jax.device_put(value, self.act_sharding(k))  # noqa: E731
        walk = Walk(state, xs, ys, self._fns, place, self._add, self.schedule.split_backward, rec)
        for row in self.schedule.table:
            start = rec.now()
            rec.slot(start, [(s, str(op), walk.run(op.kind, s, self.schedule.virtual(s, op), op.mb))
                             for s, op in enumerate(row) if op is not None])  # fmt: skip
        total = rec.now()
        state = [
            update(st, g, walk.step_model_state(k, self.m))
            for k, (update, st, g) in enumerate(zip(self._updates, state, walk.gsum, strict=True))
        ]
        if rec.timed:
            jax.block_until_ready(state)
        return state, {"loss": jnp.mean(jnp.stack(walk.losses)), **rec.metrics(total)}

    @property
    def dispatch_ahead(self) -> bool:
        """Whether untimed steps dispatch the whole table before waiting: always, except
        where a stage's programs hold collectives (stages of several devices) on simulated
        CPU devices, where queued programs can deadlock XLA's thread pool
        (``serialize_steps``)."""
        return not (self.serialize_steps and self.plan.mesh.size > self.p)

    def peak_memory_bytes_per_device(self, history: History) -> int | None:
        """The most one device holds, added up from what it keeps between its programs: its
        virtual stages' state and gradient sums (their shards), the batch's inputs (first
        stage) and labels (last), the activations it held at its peak (the walk's count,
        split as the stage's batch is; stage 0's stashed inputs are counted again, so this
        errs high), plus the largest temporaries and outputs of one of its programs (XLA's
        memory analysis)."""
        stash = history.get("peak_activation_bytes_per_stage")
        batch = self.abstract_batch()
        peaks = []
        for d in range(self.p):
            stages = [k for k in range(len(self.chunks)) if self.device[k] == d]
            held = 0
            for k in stages:  # the state, and the gradient sums as large as the parameters
                st, sh = self.stage_state(self.abstract, k), self.shardings[k]
                held += _shard_bytes(st, sh) + _shard_bytes(st.params, sh.params)
            ends = [(0, "x"), (self.k_last, "y")]
            held += sum(_shard_bytes(batch[key], self.act_sharding(k)) for k, key in ends
                        if self.device[k] == d)  # fmt: skip
            if stash:
                held += stash[d] // _ways(self.act_sharding(stages[0]))
            analyses = [memory_of(c) for k in stages for f in self._fns[k]
                        if (c := f.compiled()) is not None]  # fmt: skip
            transient = [m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                         for m in analyses if m is not None]  # fmt: skip
            if not stash or not transient:
                return None  # no step ran, or a backend without the analysis
            peaks.append(held + max(transient))
        return int(max(peaks))

    def summary(self, history: History) -> dict[str, Any]:
        return {
            "mesh": self.plan.mesh.as_dict(),
            "schedule": self.spec.schedule,
            "stages": self.p,
            "chunks": self.v,
            "microbatches": self.m,
            "stage_boundaries": self.boundaries,
            "bubble_fraction_analytic": self.schedule.bubble_fraction,
            "bubble_fraction_measured": steady_median(history, "bubble_fraction_measured"),
            "peak_stash_per_stage": [self.schedule.peak_stash(s) for s in range(self.p)],
            "peak_activation_bytes_per_stage": history.get("peak_activation_bytes_per_stage"),
            "p2p_messages_per_step": self.schedule.p2p_messages(),
            "comm_bytes_per_step": (history.get("comm_bytes") or [None])[-1],
        }


class Programs(NamedTuple):
    """One virtual stage's compiled programs (``refdl.strategies.pipeline.Pipeline._jit``)."""

    fwd: Any
    bwd: Any
    bwd_input: Any
    bwd_weight: Any


def _ways(sharding: NamedSharding) -> int:
    """Into how many pieces ``sharding`` splits an array."""
    named = [a for e in sharding.spec if e for a in (e if isinstance(e, tuple) else (e,))]
    return math.prod(sharding.mesh.shape[a] for a in named)


def _shard_bytes(tree: Any, shardings: Any) -> int:
    """The bytes of one device's shards of ``tree`` (shapes) placed by ``shardings`` (one
    sharding for every leaf, or a tree of them)."""
    if isinstance(shardings, NamedSharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return sum(
        math.prod(sh.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
        for a, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


def _by_path(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
