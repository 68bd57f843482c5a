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

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.core.layers import param_count
from refdl.core.losses import LOSSES
from refdl.core.state import TrainState
from refdl.errors import UsageError
from refdl.mesh import MeshSpec
from refdl.pipeline.schedule import build as build_schedule
from refdl.strategies.base import Batch, Strategy, register
from refdl.strategies.hybrid import partition_spec


def balance(costs: list[int], parts: int) -> list[int]:
    """Cut points splitting ``costs`` into ``parts`` contiguous non-empty groups that
    minimise the largest group's sum (exact, by dynamic programming).

    >>> balance([1, 1, 1, 1], 2)
    [2]
    """
    n = len(costs)
    prefix = np.concatenate([[0], np.cumsum(costs)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    cuts, i = [], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        cuts.append(i)
    return sorted(cuts)[1:]


@register("pipeline")
class Pipeline(Strategy):
    """GPipe, 1F1B or interleaved 1F1B over ``--stages`` devices, executed from the table."""

    @classmethod
    def predict_cost(cls, model_cost, hw, batch, workers, opts):
        from refdl.perf import costs

        return costs.pipeline(model_cost, hw, batch, workers, opts)

    def __init__(
        self, task, spec, devices, mesh_spec: MeshSpec | None = None, rules: dict | None = None
    ) -> None:
        """Plain pipeline: one device per stage. ``hybrid`` passes its ``mesh_spec`` (with
        ``pipe`` > 1) and its tensor-parallel ``rules``: each stage then owns the
        ``data x model`` sub-mesh at its ``pipe`` index."""
        super().__init__(task, spec, devices)
        if mesh_spec is None:
            p = spec.stages or len(devices)
            if p != len(devices):
                raise UsageError(
                    f"--strategy pipeline runs one stage per device: --stages {p} needs "
                    f"--devices {p}"
                )
            if spec.mesh or spec.allreduce != "xla" or spec.compress:
                raise UsageError(
                    "--mesh, --allreduce and --compress do not apply to --strategy "
                    "pipeline; use --stages, --microbatches and --schedule"
                )
            mesh_spec = MeshSpec(pipe=p)
        p = mesh_spec.pipe
        if spec.stages not in (None, p):
            raise UsageError(f"--stages {spec.stages} disagrees with --mesh pipe={p}")
        self.mesh_spec, self.rules = mesh_spec, rules or {}
        MeshSpec(data=mesh_spec.data).check_batch(spec.batch_size, spec.microbatches)
        mesh = mesh_spec.make(devices)
        self.submeshes = [Mesh(mesh.devices[:, :, s], ("data", "model")) for s in range(p)]
        v, m = spec.chunks, spec.microbatches
        self.schedule = build_schedule(spec.schedule, p, m, v)
        n_layers = len(task.model)
        if p * v > n_layers:
            raise UsageError(
                f"{p} stages x {v} chunks = {p * v} need at least as many layers; "
                f"{spec.model} has {n_layers}: use fewer --stages or --chunks"
            )
        if spec.schedule == "interleaved" and n_layers % (p * v):
            raise UsageError(
                f"--schedule interleaved needs the {n_layers} layers of {spec.model} to divide "
                f"into {p} x {v} = {p * v} equal chunks; change --stages or --chunks"
            )
        shapes = task.model.abstract_params(np.asarray(task.sample_x))
        costs = [max(param_count(shapes[k]), 1) for k in task.model.keys]
        if spec.stage_boundaries is not None:
            cuts = list(spec.stage_boundaries)
            ordered = cuts == sorted(set(cuts)) and all(0 < c < n_layers for c in cuts)
            if len(cuts) != p * v - 1 or not ordered:
                raise UsageError(
                    f"--stage-boundaries {','.join(map(str, cuts))}: need {p * v - 1} increasing "
                    f"layer indices between 1 and {n_layers - 1} for {p * v} stages"
                )
        elif spec.schedule == "interleaved":
            cuts = list(range(n_layers // (p * v), n_layers, n_layers // (p * v)))
        else:
            cuts = balance(costs, p * v)
        self.boundaries = cuts
        self.chunks = task.model.split(cuts)
        self.p, self.v, self.m = p, v, m
        self.k_last = p * v - 1
        self.timelines: list[list[tuple[int, str, float, float]]] = []
        self.measured: list[float] = []
        self.p2p_bytes = 0
        self.peak_activation_bytes = [0] * p
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
        self._update = jax.jit(self.task.apply_gradients, donate_argnums=0)

    # -- state: one TrainState per virtual stage, on its device ------------------------------

    def place_state(self, host_state: TrainState) -> TrainState:
        self._template = host_state
        by_path = _by_path(host_state.opt_state)
        states = []
        for k, chunk in enumerate(self.chunks):
            params = {key: host_state.params[key] for key in chunk.keys}
            opt_shape = jax.eval_shape(self.task.optimizer.init, params)
            opt = jax.tree_util.tree_map_with_path(
                lambda path, _: by_path[jax.tree_util.keystr(path)], opt_shape
            )
            st = TrainState(
                step=host_state.step,
                params=params,
                model_state={
                    key: v for key, v in host_state.model_state.items() if key in chunk.keys
                },
                opt_state=opt,
                rng=host_state.rng,
            )
            states.append(jax.device_put(st, self.state_sharding(k, st)))
        return states  # type: ignore[return-value]

    def gather_state(self, state: Any) -> TrainState:
        host = [jax.device_get(s) for s in state]
        params = {k: v for s in host for k, v in s.params.items()}
        model_state = {k: v for s in host for k, v in s.model_state.items()}
        found: dict[str, Any] = {}
        for s in reversed(host):  # shared leaves (e.g. Adam's count) from stage 0
            found.update(_by_path(s.opt_state))
        opt = jax.tree_util.tree_map_with_path(
            lambda path, _: np.asarray(found[jax.tree_util.keystr(path)]),
            self._template.opt_state,
        )
        return TrainState(
            step=np.asarray(host[0].step),
            params=jax.tree.map(np.asarray, params),
            model_state=jax.tree.map(np.asarray, model_state),
            opt_state=opt,
            rng=np.asarray(host[0].rng),
            extras=self._template.extras,
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
            self._update(st, g, ms) for st, g, ms in zip(state, gsum, new_model_state, strict=True)
        ]
        jax.block_until_ready(state)
        busy = sum(end - begin for _, _, begin, end in timeline)
        measured = 1.0 - busy / (self.p * total)
        self.timelines.append(timeline)
        self.measured.append(measured)
        self.p2p_bytes = p2p
        self.peak_activation_bytes = peak
        loss = float(np.mean([float(x) for x in losses]))
        return state, {"loss": loss, "bubble_fraction_measured": measured, "comm_bytes": p2p}

    def timeline(self) -> list[tuple[int, str, float, float]] | None:
        return self.timelines[-1] if self.timelines else None

    def summary(self) -> dict[str, Any]:
        steady = self.measured[1:] or self.measured  # the first step includes compilation
        return {
            "mesh": self.mesh_spec.as_dict(),
            "schedule": self.spec.schedule,
            "stages": self.p,
            "chunks": self.v,
            "microbatches": self.m,
            "stage_boundaries": self.boundaries,
            "bubble_fraction_analytic": self.schedule.bubble_fraction,
            "bubble_fraction_measured": statistics.median(steady) if steady else None,
            "peak_stash_per_stage": [self.schedule.peak_stash(s) for s in range(self.p)],
            "peak_activation_bytes_per_stage": self.peak_activation_bytes,
            "p2p_messages_per_step": self.schedule.p2p_messages(),
            "comm_bytes_per_step": self.p2p_bytes,
        }


def _by_path(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
