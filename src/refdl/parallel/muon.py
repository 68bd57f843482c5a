"""Muon where no rank holds a whole matrix: ``fsdp``'s flat shards (ZeRO 1-3).

Muon's update of a matrix needs the whole matrix (``refdl.core.optim.orthogonal_update``);
each rank holds ``1/P`` of its flat, padded elements. Two schemes, each exact:

- ``gather``: every rank all-gathers the matrix's Nesterov momentum, orthogonalizes it
  (redundantly: ``P`` ranks do the same Newton-Schulz) and keeps its shard of the result.
  Bytes per step, summed over ranks: ``(P - 1) Psi_muon`` (an all-gather's ring).
- ``owner``: each matrix has one owner rank (the largest matrices first, each to the
  least-loaded rank, as Megatron-Core's layer-wise distributed Muon). The other ranks
  send their shards to it, it alone orthogonalizes the matrix, and sends each rank its
  shard back: ``2 (P - 1) / P Psi_muon`` (point-to-point), no redundant FLOPs, and the
  owners' loads as balanced as the matrices' sizes allow.

``Psi_muon`` is the padded bytes of the matrices Muon updates (its other parameters go to
AdamW, which needs no whole matrix).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from optax.contrib import MuonDimensionNumbers

from refdl.core.optim import orthogonal_update
from refdl.parallel.sharded import flat_pad, padded, unflat

SCHEMES = ("gather", "owner")


def owners(sizes: dict[str, int], p: int) -> dict[str, int]:
    """Each matrix's owner rank: the largest first, each to the least-loaded rank.

    >>> owners({"a": 10, "b": 6, "c": 5}, 2)
    {'a': 0, 'b': 1, 'c': 1}
    """
    load, out = [0] * p, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(p), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return out


def orthogonalizer(
    scheme: str, shapes: dict[str, tuple[int, ...]], owner: dict[str, int], axis: str, p: int
) -> Callable[[tuple, jax.Array, MuonDimensionNumbers], jax.Array]:
    """``refdl.core.optim.orthogonalized_by``'s function for flat shards over ``axis``:
    ``shapes`` and ``owner`` by the leaf's path (``jax.tree_util.keystr``)."""

    def by_gather(path: tuple, shard: jax.Array, dims: MuonDimensionNumbers) -> jax.Array:
        shape = shapes[jax.tree_util.keystr(path)]
        full = unflat(jax.lax.all_gather(shard, axis, tiled=True), shape)
        return _mine(flat_pad(orthogonal_update(full, dims), p), axis, p)

    def by_owner(path: tuple, shard: jax.Array, dims: MuonDimensionNumbers) -> jax.Array:
        name = jax.tree_util.keystr(path)
        shape, o = shapes[name], owner[name]
        me = jax.lax.axis_index(axis)
        pieces = [  # on the owner: every rank's shard in rank order (elsewhere: zeros)
            shard if r == o else jax.lax.ppermute(shard, axis, [(r, o)]) for r in range(p)
        ]
        pieces[o] = jnp.where(me == o, shard, jnp.zeros_like(shard))

        def solve(parts: list[jax.Array]) -> jax.Array:
            full = unflat(jnp.concatenate(parts), shape)
            return flat_pad(orthogonal_update(full, dims), p).reshape(p, -1)

        idle = lambda _parts: jnp.zeros((p, shard.shape[0]), shard.dtype)  # noqa: E731
        rows = jax.lax.cond(me == o, solve, idle, pieces)
        sent = [jax.lax.ppermute(rows[r], axis, [(o, r)]) for r in range(p) if r != o]
        return jnp.where(me == o, rows[o], sum(sent[1:], sent[0]) if sent else rows[o])

    return {"gather": by_gather, "owner": by_owner}[scheme]


def _mine(flat: jax.Array, axis: str, p: int) -> jax.Array:
    """This rank's shard of a flat, padded leaf."""
    n = flat.shape[0] // p
    return jax.lax.dynamic_slice_in_dim(flat, jax.lax.axis_index(axis) * n, n)


def scheme_bytes(scheme: str, muon_bytes: list[int], p: int) -> int:
    """Bytes a step's Muon scheme sends, summed over ranks (the module's docstring), for
    matrices of ``muon_bytes`` (each padded to a multiple of ``p`` elements)."""
    psi = sum(muon_bytes)
    if p == 1:
        return 0
    return (p - 1) * psi if scheme == "gather" else 2 * (p - 1) * psi // p


def muon_leaf_bytes(shapes: dict[str, tuple[int, ...]], itemsize: int, p: int) -> list[int]:
    """Each Muon matrix's padded bytes."""
    out = []
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        out.append(itemsize * padded(n, p))
    return out


def muon_shapes(dims: Any, shapes: Any) -> dict[str, tuple[int, ...]]:
    """The whole shapes of the leaves Muon updates, by path (``dims``: ``muon_dims``'s tree
    for the parameters, ``shapes``: each parameter's shape)."""
    found = jax.tree_util.tree_flatten_with_path(
        dims, is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers)
    )[0]
    flat_shapes = dict(
        (jax.tree_util.keystr(k), v)
        for k, v in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda x: isinstance(x, tuple)
        )[0]
    )
    return {jax.tree_util.keystr(k): flat_shapes[jax.tree_util.keystr(k)]
            for k, d in found if d is not None}  # fmt: skip
