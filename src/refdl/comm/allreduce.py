"""Allreduce algorithms written out with ``ppermute``, for use inside ``shard_map``.

Each reduces a flat vector over a named mesh axis of ``p`` devices and returns
the sum on every device, equal to ``jax.lax.psum`` up to fp32 summation order.
Costs in the Hockney model (alpha latency per message, beta seconds per byte,
gamma seconds per byte reduced, n bytes; Thakur, Rabenseifner & Gropp,
IJHPCA 2005) are in each docstring. All three move ``2(p-1)n`` bytes in total
over all devices per allreduce (for p a power of two); they differ in the
number of rounds and in how evenly the bytes are spread.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from refdl.errors import UsageError

Array = jax.Array


def _pad_to(x: Array, multiple: int) -> tuple[Array, int]:
    n = x.shape[0]
    pad = (-n) % multiple
    return (jnp.pad(x, (0, pad)) if pad else x), n


def ring(x: Array, axis: str, p: int) -> Array:
    """Ring allreduce: reduce-scatter then allgather around a ring, ``2(p-1)`` rounds.

    Time ``2(p-1)α + 2n(p-1)/p·β + n(p-1)/p·γ``; every device sends ``2(p-1)/p·n``
    bytes (bandwidth-optimal), in messages of ``n/p``.
    """
    if p == 1:
        return x
    buf, n = _pad_to(x, p)
    buf = buf.reshape(p, -1)
    i = jax.lax.axis_index(axis)
    right = [(j, (j + 1) % p) for j in range(p)]
    for s in range(p - 1):  # reduce-scatter: device i ends owning chunk (i+1) % p
        recv = jax.lax.ppermute(buf[(i - s) % p], axis, right)
        buf = buf.at[(i - s - 1) % p].add(recv)
    for s in range(p - 1):  # allgather the reduced chunks
        recv = jax.lax.ppermute(buf[(i + 1 - s) % p], axis, right)
        buf = buf.at[(i - s) % p].set(recv)
    return buf.reshape(-1)[:n]


def tree(x: Array, axis: str, p: int) -> Array:
    """Binomial-tree reduce to device 0, then binomial-tree broadcast; ``2⌈lg p⌉`` rounds.

    Time ``2⌈lg p⌉(α + nβ) + ⌈lg p⌉nγ`` (reduce ``lg p·(α + nβ + nγ)`` plus
    broadcast ``lg p·(α + nβ)``); ``2(p-1)`` messages of the full ``n`` bytes,
    latency-optimal but the root's link carries ``n`` per round.
    """
    if p == 1:
        return x
    i = jax.lax.axis_index(axis)
    rounds = (p - 1).bit_length()
    for k in range(rounds):  # reduce: senders i % 2d == d pass their partial sum to i - d
        d = 1 << k
        pairs = [(j, j - d) for j in range(p) if j % (2 * d) == d]
        x = x + jax.lax.ppermute(x, axis, pairs)  # non-receivers get zeros
    for k in reversed(range(rounds)):  # broadcast from 0 down the same tree
        d = 1 << k
        pairs = [(j, j + d) for j in range(p) if j % (2 * d) == 0 and j + d < p]
        recv = jax.lax.ppermute(x, axis, pairs)
        x = jnp.where(i % (2 * d) == d, recv, x)
    return x


def halving_doubling(x: Array, axis: str, p: int) -> Array:
    """Rabenseifner: reduce-scatter by recursive halving, allgather by recursive doubling.

    Time ``2 lg p·α + 2n(p-1)/p·β + n(p-1)/p·γ``; ``2 lg p`` rounds, every device
    sends ``2(p-1)/p·n`` bytes. Needs ``p`` a power of two.
    """
    if p == 1:
        return x
    if p & (p - 1):
        raise UsageError(f"--allreduce halving-doubling needs a power-of-two data degree, not {p}")
    buf, n = _pad_to(x, p)
    i = jax.lax.axis_index(axis)
    d = p // 2
    while d >= 1:  # keep one half, send the other to partner i ^ d, add what comes back
        lo, hi = jnp.split(buf, 2)
        upper = (i & d) != 0
        send = jnp.where(upper, lo, hi)
        keep = jnp.where(upper, hi, lo)
        buf = keep + jax.lax.ppermute(send, axis, [(j, j ^ d) for j in range(p)])
        d //= 2
    d = 1
    while d < p:  # device i holds reduced block i; double it back up
        recv = jax.lax.ppermute(buf, axis, [(j, j ^ d) for j in range(p)])
        upper = (i & d) != 0
        buf = jnp.where(upper, jnp.concatenate([recv, buf]), jnp.concatenate([buf, recv]))
        d *= 2
    return buf[:n]


def psum(x: Array, axis: str, p: int) -> Array:
    """XLA's own all-reduce (``lax.psum``); the algorithm is the backend's choice."""
    return jax.lax.psum(x, axis)


ALGORITHMS: dict[str, Callable[[Array, str, int], Array]] = {
    "xla": psum,
    "ring": ring,
    "tree": tree,
    "halving-doubling": halving_doubling,
}


def analytic_bytes(algo: str, n_bytes: int, p: int) -> int:
    """Bytes sent per allreduce of ``n_bytes``, summed over all ``p`` devices.

    Ring and halving-doubling: ``2(p-1)`` x ``n/p`` per device (n padded to a
    multiple of p); tree: ``2(p-1)`` messages of ``n``. For ``xla`` we charge
    the ring's ``2(p-1)/p·n`` per device, unpadded (nccl-tests' busbw convention).
    """
    if p == 1:
        return 0
    if algo in ("tree", "xla"):
        return 2 * (p - 1) * n_bytes
    chunk = -(-n_bytes // (4 * p)) * 4  # n padded to a multiple of p fp32 elements
    return 2 * (p - 1) * p * chunk


def allreduce_mean(tree_: object, axis: str, p: int, algo: str) -> object:
    """Mean over the axis of a pytree of arrays, as one flat buffer (a fusion bucket)."""
    if algo == "xla":
        return jax.tree.map(lambda g: jax.lax.psum(g, axis) / p, tree_)
    flat, unravel = ravel_pytree(tree_)
    return unravel(ALGORITHMS[algo](flat, axis, p) / p)
