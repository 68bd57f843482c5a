"""Context parallelism: the sequence split over a mesh axis, causal attention across pieces.

Layout (load balancing): the ``T`` positions are cut into ``2c`` chunks, and device ``i``
of ``c`` holds chunk ``i`` and chunk ``2c-1-i`` (the zig-zag order of Megatron-Core's
context parallelism and of ring-flash-attention), so under a causal mask every device
has the same work: an early chunk sees little, its late partner sees much. When ``T/c``
is odd the early chunks are one token longer than the late ones; only ``T % c == 0`` is
needed.

Attention (inside ``shard_map``, the local queries, keys and values ``[B, T/c, H, D]``):

- ``ring``: the keys and values travel around the ring (``ppermute``, ``c-1`` hops) and
  each block's result is merged by its log-sum-exp (online softmax, Liu et al.,
  "Ring Attention", arXiv 2310.01889). With the zig-zag layout the block of an earlier
  device is needed only for its first chunk, that of a later device only by the local
  second chunk: half a block's work every hop, the same on every device;
- ``all-to-all``: DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509): one all-to-all
  trades the sequence split for a split of the heads, attention runs over the whole
  sequence for ``H/c`` heads, one all-to-all trades back.

Bytes per layer and step, summed over the ``c`` devices (forward and backward; ``n`` is one
device's ``B·T/c·H·D`` values of 4 bytes): ring ``4(c-1)·c·4n`` (K and V forward, their
gradients back, each hop ``c`` messages), all-to-all ``8(c-1)·4n`` (Q, K, V, the output and
their gradients, each all-to-all keeping ``1/c`` of its ``c·4n``);
``refdl.strategies.context`` checks them against the compiled program.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from refdl.core.layers import SequenceShard
from refdl.core.precision import wide

Array = jax.Array
MODES = ("ring", "all-to-all")
LOAD_BALANCE = "zig-zag: device i holds chunks i and 2c-1-i of 2c"  # the summaries' words


def zigzag_order(length: int, c: int) -> np.ndarray:
    """``[c, length/c]``: the global positions each device holds, in its local order.

    >>> zigzag_order(8, 2).tolist()
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    per = length // c
    early, late = (per + 1) // 2, per // 2

    def chunk(k: int) -> range:
        start = k * early if k < c else c * early + (k - c) * late
        return range(start, start + (early if k < c else late))

    return np.array([[*chunk(i), *chunk(2 * c - 1 - i)] for i in range(c)], np.int32)


def _block(q: Array, k: Array, v: Array, mask: Array | None = None) -> tuple[Array, Array]:
    """Softmax attention of ``q`` over ``k, v`` (``[B, T, H, D]``), scores in fp32: the
    normalised output ``[B, Tq, H, D]`` and the log-sum-exp ``[B, H, Tq]`` of each row
    (scores in fp64 under fp64)."""
    acc = wide(q.dtype)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=acc)
    s = s / math.sqrt(q.shape[-1])
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None]).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=acc), lse


def _merge(o: Array, lse: Array, o2: Array, lse2: Array) -> tuple[Array, Array]:
    """Two partial softmax results over disjoint keys, as one (online softmax)."""
    new = jnp.logaddexp(lse, lse2)
    w = lambda x: jnp.exp(x - new).transpose(0, 2, 1)[..., None]  # noqa: E731  [B,Tq,H,1]
    return o * w(lse) + o2 * w(lse2), new


def ring_attention(q: Array, k: Array, v: Array, axis: str, order: np.ndarray) -> Array:
    """Causal attention of the local queries over every device's keys and values, the
    keys and values passed around the ring of ``axis`` (layout ``zigzag_order``)."""
    c = order.shape[0]
    early = (order.shape[1] + 1) // 2
    i = jax.lax.axis_index(axis)
    pos = jnp.asarray(order)[i]
    o, lse = _block(q, k, v, pos[:, None] >= pos[None, :])  # its own block, masked
    right = [(j, (j + 1) % c) for j in range(c)]

    def earlier(k, v):  # an earlier device's block: visible to every local query, but
        return _block(q, k[:, :early], v[:, :early])  # only its early chunk is before them

    def later(k, v):  # a later device's block: only the local late chunk comes after it
        o2, lse2 = _block(q[:, early:], k, v)
        b, _, h, d = q.shape
        zeros = jnp.zeros((b, early, h, d), o2.dtype)
        none = jnp.full((b, h, early), -jnp.inf, lse2.dtype)
        return jnp.concatenate([zeros, o2], 1), jnp.concatenate([none, lse2], 2)

    for hop in range(1, c):
        k = jax.lax.ppermute(k, axis, right)
        v = jax.lax.ppermute(v, axis, right)
        o2, lse2 = jax.lax.cond((i - hop) % c < i, earlier, later, k, v)
        o, lse = _merge(o, lse, o2, lse2)
    return o.astype(q.dtype)


def all_to_all_attention(q: Array, k: Array, v: Array, axis: str, order: np.ndarray) -> Array:
    """Causal attention by trading the sequence split for a split of the heads (Ulysses)."""
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731
    q, k, v = to_heads(q), to_heads(k), to_heads(v)  # [B, T, H/c, D], device-major order
    pos = jnp.asarray(order.reshape(-1))
    o, _ = _block(q, k, v, pos[:, None] >= pos[None, :])
    return jax.lax.all_to_all(o.astype(q.dtype), axis, 1, 2, tiled=True)


def context_shard(mode: str, axis: str, order: np.ndarray) -> SequenceShard:
    """The model's view of a sequence split over ``axis`` in ``order`` (``zigzag_order``)."""
    attend = ring_attention if mode == "ring" else all_to_all_attention
    return SequenceShard(
        positions=lambda _t: jnp.asarray(order)[jax.lax.axis_index(axis)],
        attention=lambda q, k, v: attend(q, k, v, axis, order),
    )


def context_attention(mode: str, mesh: Any, batch_axes: Any, order: np.ndarray) -> SequenceShard:
    """The model's view under ``jax.jit`` shardings (``hybrid``): whole sequences held in
    ``order``'s token order and split over ``context``, attention run by ``mode`` in a
    ``shard_map`` over the batch axes and ``context`` (the other axes stay with XLA)."""
    attend = ring_attention if mode == "ring" else all_to_all_attention
    names = {batch_axes} if isinstance(batch_axes, str) else set(batch_axes or ())
    split = P(batch_axes, "context")
    attention = jax.shard_map(
        lambda q, k, v: attend(q, k, v, "context", order),
        mesh=mesh,
        in_specs=(split, split, split),
        out_specs=split,
        axis_names=names | {"context"},
    )
    return SequenceShard(
        positions=lambda _t: jnp.asarray(order.reshape(-1)), attention=attention, whole=True
    )


def sequence_split(mesh: Any, batch_axes: Any) -> Callable[[Array], Array]:
    """Megatron's sequence parallelism as a layout (``refdl.core.layers.residual_layout``):
    the residual stream ``[B, T, D]`` split along the sequence over ``model`` between the
    column/row-parallel pairs, so the norms and residual adds run on ``1/model`` of the
    tokens and XLA gathers the sequence into each pair and scatters it out of each."""
    split = NamedSharding(mesh, P(batch_axes, "model", None))
    return lambda x: jax.lax.with_sharding_constraint(x, split)


def attention_widths(params: Any) -> list[int]:
    """``d_model`` of every attention layer of ``params`` (its query projection ``wq``,
    ``[d_model, heads, head_dim]``), in order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [w.shape[0] for path, w in flat if getattr(path[-1], "key", None) == "wq"]


def attention_bytes(mode: str, c: int, local_values: int, layers: int) -> int:
    """Bytes the attention of ``layers`` layers moves per step, summed over the ``c``
    devices (forward and backward), for one device's ``local_values = B·T/c·H·D`` fp32."""
    if c == 1:
        return 0
    n = 4 * local_values
    per_layer = 4 * (c - 1) * n * c if mode == "ring" else 8 * (c - 1) * n
    return layers * per_layer
