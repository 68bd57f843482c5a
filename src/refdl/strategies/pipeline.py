"""``pipeline``: consecutive layers form stages on different devices; microbatches flow
through them in the order a schedule table gives (``refdl.pipeline.schedule``).

The model's layers are cut into ``stages x chunks`` contiguous virtual stages,
balanced by parameter count; virtual stage ``k`` lives on device ``k % stages``.
The executor walks the table slot by slot: in each slot it dispatches every
stage's operation (asynchronously, so the devices run concurrently), then waits
for them and records when each finished. A forward sends its output activation
to the next stage's device; a backward recomputes its stage's forward under
``jax.vjp`` from the stashed input (rematerialisation), accumulates the
parameter gradient and sends the input gradient back. The last stage's loss
is scaled by ``1/microbatches``, so the summed gradient is the full batch's
and the step equals ``single``'s. Each stage then applies the optimizer to its
own parameters (optax's sgd/momentum/nesterov/adam are element-wise, so
per-stage updates equal one update of the whole tree).

Bubble accounting: ``bubble_fraction_analytic`` is read off the table
(idle share of ``stages x slots``); ``bubble_fraction_measured`` is
``1 - sum(busy) / (stages x step time)`` from the recorded timeline, where an
operation is busy from its slot's start until its result is ready.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.config.plan import Traits
from refdl.config.rules import partition_spec
from refdl.core.losses import LOSSES
from refdl.core.state import TrainState
from refdl.parallel.schedule import build as build_schedule
from refdl.strategies.base import Batch, History, Strategy, register, steady_median


@register("pipeline")
class Pipeline(Strategy):
    """GPipe, 1F1B or interleaved 1F1B over ``--stages`` devices, executed from the table."""

    traits = Traits(
        axes=("pipe",),
        options=frozenset({"stages", "schedule", "chunks", "stage_boundaries", "plot_schedule"}),
    )

    def __init__(self, task, spec, plan, devices, batches) -> None:
        """One stage per device; under ``hybrid`` (``plan.mesh`` with ``data`` or ``model``
        > 1) each stage owns the ``data x model`` sub-mesh at its ``pipe`` index and its
        parameters are split by the plan's tensor-parallel rules."""
        super().__init__(task, spec, plan, devices, batches)
        p, v, m = plan.mesh.pipe, plan.chunks, plan.microbatches
        mesh = plan.mesh.make(devices)
        self.submeshes = [Mesh(mesh.devices[:, :, s], ("data", "model")) for s in range(p)]
        self.rules = plan.rules if plan.mesh.size > p else {}
        self.schedule = build_schedule(spec.schedule, p, m, v)
        self.boundaries = list(plan.cuts)
        self.chunks = task.model.split(self.boundaries)
        self.p, self.v, self.m = p, v, m
        self.k_last = p * v - 1
        self.abstract = task.abstract_state()  # the whole state's structure, for gather_state
        self.shardings = [
            self.state_sharding(k, self.stage_state(self.abstract, k))
            for k in range(len(self.chunks))
        ]
        self._jit()

    def act_sharding(self, k: int) -> NamedSharding:
        """Where virtual stage ``k``'s inputs live: its sub-mesh, batch split on ``data``."""
        return NamedSharding(self.submeshes[k % self.p], P("data"))

    def state_sharding(self, k: int, st: TrainState) -> TrainState:
        """Virtual stage ``k``'s state on its sub-mesh: parameters (and their optimizer
        moments) split by the tensor-parallel rules, everything else replicated."""
        mesh = self.submeshes[k % self.p]
        rep = NamedSharding(mesh, P())
        params = {
            key: jax.tree.map(
                lambda a: NamedSharding(mesh, partition_spec(a, self.rules)),
                self.task.logical_axes[key],
                is_leaf=lambda a: isinstance(a, tuple),
            )
            for key in st.params
        }
        opt = optax.tree_map_params(
            self.task.optimizer,
            lambda _, sh: sh,
            st.opt_state,
            params,
            transform_non_params=lambda _: rep,
        )
        every = lambda tree: jax.tree.map(lambda _: rep, tree)  # noqa: E731
        return TrainState(rep, params, every(st.model_state), opt, rep, every(st.extras))

    def _jit(self) -> None:
        loss_fn = LOSSES.get(self.task.loss)
        scale = 1.0 / self.m

        def make(chunk, last):
            def fwd(params, state, x):
                return chunk.apply(params, state, x, train=True)

            def bwd(params, state, x, g):
                _, vjp = jax.vjp(
                    lambda p_, x_: chunk.apply(p_, state, x_, train=True)[0], params, x
                )
                return vjp(g)

            def fwd_loss(params, state, x, y):
                out, new_state = chunk.apply(params, state, x, train=True)
                return loss_fn(out, y), new_state

            def bwd_loss(params, state, x, y):
                def f(p_, x_):
                    return loss_fn(chunk.apply(p_, state, x_, train=True)[0], y) * scale

                return jax.grad(f, argnums=(0, 1))(params, x)

            if last:
                return jax.jit(fwd_loss), jax.jit(bwd_loss)
            return jax.jit(fwd), jax.jit(bwd)

        self._fns = [make(c, k == self.k_last) for k, c in enumerate(self.chunks)]
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        # Each stage's update returns its state with the shardings it was placed with, so a
        # state restored from a checkpoint runs the very programs an uninterrupted run does.
        self._updates = [
            jax.jit(self.task.apply_gradients, donate_argnums=0, out_shardings=sh)
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
            jax.device_put(self.stage_state(host_state, k), self.shardings[k])
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
        m = self.m
        xs = np.split(batch["x"], m)
        ys = np.split(batch["y"], m)
        stash: dict[tuple[int, int], Any] = {}  # (mb, k) -> input activation of k
        out: dict[tuple[int, int], Any] = {}  # (mb, k) -> output activation of k
        grad_out: dict[tuple[int, int], Any] = {}  # (mb, k) -> d loss / d output of k
        gsum: list[Any] = [None] * len(self.chunks)
        new_model_state = [s.model_state for s in state]
        losses = []
        timeline: list[tuple[int, str, float, float]] = []
        p2p = 0
        live, peak = [0] * self.p, [0] * self.p  # stashed activation bytes per device
        t0 = time.perf_counter()
        for row in self.schedule.table:
            start = time.perf_counter() - t0
            pending = []
            for s, op in enumerate(row):
                if op is None:
                    continue
                k = op.chunk * self.p + s
                st, dev = state[k], self.act_sharding(k)
                fwd, bwd = self._fns[k]
                if op.kind == "F":
                    if k == 0:
                        x = jax.device_put(xs[op.mb], dev)
                    else:
                        x = jax.device_put(out.pop((op.mb, k - 1)), dev)
                        p2p += x.nbytes
                    stash[(op.mb, k)] = x
                    live[s] += x.nbytes
                    peak[s] = max(peak[s], live[s])
                    if k == self.k_last:
                        loss, new_model_state[k] = fwd(
                            st.params, new_model_state[k], x, jax.device_put(ys[op.mb], dev)
                        )
                        losses.append(loss)
                        result = loss
                    else:
                        result, new_model_state[k] = fwd(st.params, new_model_state[k], x)
                        out[(op.mb, k)] = result
                else:
                    x = stash.pop((op.mb, k))
                    live[s] -= x.nbytes
                    if k == self.k_last:
                        g_params, g_x = bwd(
                            st.params, st.model_state, x, jax.device_put(ys[op.mb], dev)
                        )
                    else:
                        g = jax.device_put(grad_out.pop((op.mb, k)), dev)
                        p2p += g.nbytes
                        g_params, g_x = bwd(st.params, st.model_state, x, g)
                    gsum[k] = g_params if gsum[k] is None else self._add(gsum[k], g_params)
                    if k > 0:
                        grad_out[(op.mb, k - 1)] = g_x
                    result = g_x
                pending.append((s, str(op), result))
            for s, name, result in pending:
                jax.block_until_ready(result)
                timeline.append((s, name, start, time.perf_counter() - t0))
        total = time.perf_counter() - t0
        state = [
            update(st, g, ms)
            for update, st, g, ms in zip(self._updates, state, gsum, new_model_state, strict=True)
        ]
        jax.block_until_ready(state)
        busy = sum(end - begin for _, _, begin, end in timeline)
        measured = 1.0 - busy / (self.p * total)
        loss = jnp.mean(jnp.stack(losses))
        return state, {
            "loss": loss,
            "bubble_fraction_measured": measured,
            "comm_bytes": p2p,
            "peak_activation_bytes_per_stage": peak,
            "timeline": timeline,
        }

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


def _by_path(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
