"""``Task``: a model, a loss and an optimizer bound into pure training functions.

The single-device reference step is ``Task.step``; every strategy reuses
``Task.loss_and_grads`` and ``Task.apply_gradients`` and adds only placement and
communication, which is what makes the strategies comparable.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from refdl.core.init import redraw
from refdl.core.layers import Sequential
from refdl.core.losses import LOSSES, accuracy
from refdl.core.moe import step_stats, with_step_stats
from refdl.core.precision import master_dtype
from refdl.core.state import TrainState

PyTree = Any
Batch = dict[str, Any]


@functools.cache
def _accepted(option: str, value: str) -> bool:
    """Whether this jaxlib's CPU compiler takes ``option=value`` (options are speed only:
    one a newer XLA renamed is dropped, not an error)."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
        jax.jit(lambda x: x + 1, compiler_options={option: value})(jax.device_put(0.0, cpu))
    except Exception:  # XLA's INVALID_ARGUMENT: No such compile option / bad value
        return False
    return True


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The shard_map axes ``x`` varies over (empty outside shard_map): JAX 0.10's
    ``manual_axis_type.varying``, earlier versions' ``vma``."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


@dataclasses.dataclass(frozen=True)
class Task:
    """What to train: ``model`` on ``loss`` with ``optimizer``; ``sample_x`` fixes input shapes."""

    model: Sequential
    loss: str
    optimizer: optax.GradientTransformation
    sample_x: np.ndarray
    logical_axes: PyTree = None
    schedule: Any = None  # the learning rate by step (for the logs), when known
    init: str = "lecun_normal"  # refdl.core.init: refdl's draws or a framework's default
    cpu_compiler_options: tuple[tuple[str, str], ...] = ()  # the model's (ModelDef)

    def compiler_options(self, platform: str) -> dict[str, str] | None:
        """The XLA options this task's programs compile with on ``platform``: the model's
        CPU options on a CPU, none elsewhere (``jax.jit(..., compiler_options=...)``)."""
        if platform == "cpu" and self.cpu_compiler_options:
            return {k: v for k, v in self.cpu_compiler_options if _accepted(k, v)} or None
        return None

    def init_state(self, seed: int) -> TrainState:
        """The initial state from ``seed`` (deterministic, on the default device)."""
        key = jax.random.key(seed)
        init_key, state_key = jax.random.split(key)
        params, model_state, _ = self.model.init(init_key, jnp.asarray(self.sample_x))
        params = redraw(params, self.model, self.init, jax.random.fold_in(init_key, 1))
        return TrainState(
            step=jnp.asarray(0, jnp.int32),
            params=params,
            model_state=model_state,
            opt_state=self.optimizer.init(params),
            rng=jax.random.key_data(state_key),
        )

    def abstract_state(self) -> TrainState:
        """The state as ``ShapeDtypeStruct``s, from shapes alone (nothing allocated)."""
        params, model_state = self.model.abstract_variables(jnp.asarray(self.sample_x))
        return TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params=params,
            model_state=model_state,
            opt_state=jax.eval_shape(self.optimizer.init, params),
            rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        )

    def loss_fn(
        self, params: PyTree, model_state: PyTree, batch: Batch
    ) -> tuple[jax.Array, PyTree]:
        """Mean loss over the batch, and the updated model state."""
        out, new_state = self.model.apply(params, model_state, batch["x"], train=True)
        return LOSSES.get(self.loss)(out, batch["y"]), new_state

    def loss_and_grads(
        self, params: PyTree, model_state: PyTree, batch: Batch
    ) -> tuple[jax.Array, PyTree, PyTree]:
        """``(loss, grads, new_model_state)`` for one batch (or one shard of it)."""
        (loss, new_state), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
            params, model_state, batch
        )
        return loss, grads, new_state

    def accumulated_grads(
        self, params: PyTree, model_state: PyTree, batch: Batch, microbatches: int = 1
    ) -> tuple[jax.Array, PyTree, PyTree]:
        """``loss_and_grads`` as the mean over ``microbatches`` equal slices of ``batch``.

        The survey's microbatching (gradient accumulation): the mean of the
        microbatch means equals the full-batch mean, so the gradient is the same
        up to fp32 summation order. Layers with batch statistics (BatchNorm) see
        each microbatch alone, so for them it is not the same step.
        """
        if microbatches == 1:
            return self.loss_and_grads(params, model_state, batch)
        split = jax.tree.map(
            lambda a: a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:]), batch
        )

        def body(carry, mb):
            loss_sum, grad_sum, state, stats = carry
            loss, grads, state = self.loss_and_grads(params, state, mb)
            stats = jax.tree.map(jnp.add, stats, step_stats(state))
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), state, stats), None

        # The carry's zeros vary (under shard_map) over every axis the inputs vary over, as
        # the body's sums will (a decentralized replica's params and batch): scan needs the
        # carry's types to match. Outside shard_map nothing varies and they stay plain.
        inputs = jax.tree.leaves((params, batch, model_state))
        axes = tuple(sorted(set().union(*(varying_axes(a) for a in inputs))))

        def varying(x: jax.Array) -> jax.Array:
            missing = tuple(a for a in axes if a not in varying_axes(x))
            return jax.lax.pcast(x, missing, to="varying") if missing else x

        zeros = jax.tree.map(lambda p: varying(jnp.zeros_like(p)), params)
        stats = jax.tree.map(lambda s: varying(jnp.zeros_like(s)), step_stats(model_state))
        loss0 = varying(jnp.zeros((), master_dtype(self.model.precision)))
        init = (loss0, zeros, model_state, stats)
        (loss, grads, state, stats), _ = jax.lax.scan(body, init, split)
        # mixture-of-experts statistics: the step's, the mean over its microbatches
        state = with_step_stats(state, jax.tree.map(lambda v: v / microbatches, stats))
        return loss / microbatches, jax.tree.map(lambda g: g / microbatches, grads), state

    def apply_gradients(self, state: TrainState, grads: PyTree, model_state: PyTree) -> TrainState:
        """One optimizer update with ``grads``; advances the step."""
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        return state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            model_state=model_state,
            opt_state=opt_state,
        )

    def step(
        self, state: TrainState, batch: Batch, microbatches: int = 1
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """The reference step on the whole global batch (gradient accumulated over
        ``microbatches`` slices when > 1)."""
        loss, grads, model_state = self.accumulated_grads(
            state.params, state.model_state, batch, microbatches
        )
        return self.apply_gradients(state, grads, model_state), {"loss": loss}

    def eval_sums(self, params: PyTree, model_state: PyTree, batch: Batch) -> dict[str, jax.Array]:
        """Sums over a test chunk: loss x count, correct predictions, and the count."""
        out, _ = self.model.apply(params, model_state, batch["x"], train=False)
        labels = batch["y"]
        n = jnp.asarray(labels.size, jnp.float32)
        return {
            "loss_sum": LOSSES.get(self.loss)(out, labels) * n,
            "correct": accuracy(out, labels) * n,
            "count": n,
        }
