"""Parameters sharded over a mesh axis, and layers that gather or scatter them (ZeRO).

ZeRO (Rajbhandari et al., SC 2020) and FSDP give each of the P data-parallel
ranks 1/P of every parameter. Here each parameter leaf is flattened and
zero-padded to a multiple of P, so rank r holds elements ``[r S, (r+1) S)``,
``S = ceil(n / P)``; the optimizer, being element-wise (SGD, momentum, Nesterov,
Adam), updates a shard exactly as it would update those elements of the whole.

Two layer wrappers, used inside ``shard_map`` over the axis:

- ``gathered`` (stage 3): the layer's shards are all-gathered just before its
  forward and dropped after it; the backward gathers them again, computes the
  layer's gradients and reduce-scatters the parameter gradient at once, so at
  most one layer's full parameters are live, in the forward and the backward;
- ``scattered`` (stage 2): the layer runs on full (replicated) parameters, and
  its parameter gradient is reduce-scattered as soon as the backward produces it,
  so only a 1/P share of the gradient outlives the layer's backward.

Both recompute the layer's forward in its backward (only the layer's input is
kept). XLA merges identical collectives in one program (common-subexpression
elimination), which would turn the backward's all-gather into a reuse of the
forward's and keep every layer's full parameters alive in between. ``tie`` makes
each gather's operand depend on the data it serves (``s + 0 * t[0]``, which no
compiler may fold: ``0 * t`` is NaN when ``t`` is), so each gather is its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
LayerFn = Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, PyTree]]


def padded(n: int, p: int) -> int:
    """``n`` rounded up to a multiple of ``p``: the flat length of a sharded leaf."""
    return -(-n // p) * p


def flat_pad(x: Any, p: int) -> Any:
    """``x`` flattened and zero-padded to a multiple of ``p`` (NumPy or JAX arrays)."""
    xp = jnp if isinstance(x, jax.Array) else np
    flat = xp.reshape(x, (-1,))
    return xp.pad(flat, (0, padded(flat.shape[0], p) - flat.shape[0]))


def unflat(flat: Any, shape: tuple[int, ...]) -> Any:
    """The leaf of ``shape`` from its flat padded form (the inverse of ``flat_pad``)."""
    return flat[: math.prod(shape)].reshape(shape)


def tie(x: jax.Array, t: jax.Array) -> jax.Array:
    """``x``, made to depend on ``t``'s first element (see the module's docstring)."""
    return x + jnp.reshape(t, (-1,))[0].astype(x.dtype) * 0


def gather(shards: PyTree, shapes: PyTree, axis: str, after: jax.Array | None = None) -> PyTree:
    """The full leaves of ``shapes`` from this rank's ``shards``, all-gathered over ``axis``
    as one buffer (once ``after`` is known, when given). One buffer, as FSDP's flat
    parameter: XLA cannot drop the leaves a backward does not read (a last layer's bias)."""
    leaves, tree = jax.tree.flatten(shards)
    if not leaves:
        return shards
    buffer = jnp.concatenate(leaves)
    if after is not None:
        buffer = tie(buffer, after)
    every = jax.lax.all_gather(buffer, axis)  # (P, sum of the shard sizes)
    parts = jnp.split(every, np.cumsum([leaf.shape[0] for leaf in leaves])[:-1], axis=1)
    full = [unflat(part.reshape(-1), shape) for part, shape in
            zip(parts, tree.flatten_up_to(shapes), strict=True)]  # fmt: skip
    return tree.unflatten(full)


def scatter(grads: PyTree, axis: str, p: int) -> PyTree:
    """Each leaf's sum over ``axis``, of which this rank keeps its shard: one reduce-scatter
    of a buffer whose row r holds every leaf's r-th shard."""
    leaves, tree = jax.tree.flatten(grads)
    if not leaves:
        return grads
    rows = [flat_pad(g, p).reshape(p, -1) for g in leaves]
    mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, tiled=True)[0]
    return tree.unflatten(jnp.split(mine, np.cumsum([r.shape[1] for r in rows])[:-1]))


def _vjp(apply: LayerFn, params: PyTree, state: PyTree, x: jax.Array, g: jax.Array):
    """``(d params, d x)`` of ``apply``'s output at ``(params, x)`` with cotangent ``g``;
    an integer input (token ids) gets the zero cotangent JAX expects (float0)."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        _, pull = jax.vjp(lambda p_: apply(p_, state, x)[0], params)
        return pull(g)[0], np.zeros(x.shape, jax.dtypes.float0)
    _, pull = jax.vjp(lambda p_, x_: apply(p_, state, x_)[0], params, x)
    return pull(g)


def _zeros(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, tree)


def gathered(apply: LayerFn, shapes: PyTree, axis: str, p: int) -> LayerFn:
    """``apply(full_params, state, x)`` as ``f(shards, state, x)`` (ZeRO stage 3): gather
    before the forward, gather again in the backward, reduce-scatter the gradient."""

    @jax.custom_vjp
    def f(shards, state, x):
        return apply(gather(shards, shapes, axis, x), state, x)

    def forward(shards, state, x):
        return f(shards, state, x), (shards, state, x)

    def backward(saved, cotangents):
        shards, state, x = saved
        g = cotangents[0]
        d_params, d_x = _vjp(apply, gather(shards, shapes, axis, g), state, x, g)
        return scatter(d_params, axis, p), _zeros(state), d_x

    f.defvjp(forward, backward)
    return f


def scattered(apply: LayerFn, axis: str, p: int) -> Callable[..., tuple[jax.Array, PyTree]]:
    """``apply(params, state, x)`` as ``f(params, sink, state, x)`` (ZeRO stage 2): the
    gradient w.r.t. ``sink`` (zeros shaped like this rank's shards) is the layer's
    reduce-scattered parameter gradient; ``params`` get none."""

    @jax.custom_vjp
    def f(params, sink, state, x):
        return apply(params, state, x)

    def forward(params, sink, state, x):
        return f(params, sink, state, x), (params, state, x)

    def backward(saved, cotangents):
        params, state, x = saved
        d_params, d_x = _vjp(apply, params, state, x, cotangents[0])
        return _zeros(params), scatter(d_params, axis, p), _zeros(state), d_x

    f.defvjp(forward, backward)
    return f
