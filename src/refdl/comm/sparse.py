"""SparCML's sparse allreduce (Renggli et al., SC'19), for use inside ``shard_map``.

Each device holds a sparse vector of ``k`` (index, value) pairs out of ``n``. Recursive
doubling over ``lg p`` rounds: in round ``s`` device ``i`` swaps its set with ``i ^ 2^s``
and both keep the union, lower rank's half first, so partners hold identical sets (and
the replicas identical sums). A set after round ``s`` has room for ``k 2^(s+1)`` pairs:
XLA's shapes are static, so the union is kept with its duplicates (they add when the set
is made dense) and a message carries its capacity, what disjoint supports would need -
the worst case of the paper's dynamic sizes. Their DSAR switch becomes static: from the
first round whose sparse message would carry at least the dense vector's ``4n`` bytes,
the set is made dense and the remaining rounds swap dense fp32 vectors.

SparCML's other static algorithm, split-allgather (``algorithm="split-allgather"``, any
``p``): the ``n`` entries are split into ``p`` partitions of ``m = ceil(n/p)``; each
device sends every other device the pairs in its partition (an all-to-all; room for
``min(k, m)`` pairs each, since all ``k`` may fall in one), the owner sums them, and the
``p`` partition sums are all-gathered (room for ``min(p k, m)`` pairs). Either phase
sends dense partitions where its sparse message would carry at least ``4m`` bytes. Its
messages carry worst cases too, so it moves more than recursive doubling while the sets
are sparse; once the union is dense it is the reduce-scatter + all-gather of the dense
ring (``2 (p-1) 4m`` bytes a device) where recursive doubling swaps whole vectors
``lg p`` times.

Values may be quantized (``bits`` 8 or 4, the paper's Q8/Q4): each message's values are
``|v|/max|v|`` stochastically rounded to ``2^(bits-1) - 1`` levels with their signs and
one fp32 scale; both partners keep the dequantized values, so they still agree. The
unquantized allreduce equals the dense sum of the same sparse vectors (fp32 summation
order aside).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SparseAllreduce:
    """The rounds of a sparse allreduce of ``k`` of ``n`` fp32 values over ``p`` devices."""

    n: int
    k: int
    p: int
    bits: int = 32  # value bits on the wire: 32 (fp32), 8 or 4
    algorithm: str = "recursive-doubling"  # or "split-allgather"

    @property
    def part(self) -> int:
        """Entries a device owns in split-allgather: ``ceil(n / p)``."""
        return -(-self.n // self.p)

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def message_bytes(self, pairs: int) -> int:
        """A sparse message of ``pairs`` entries: int32 indices, the values, the scale."""
        if self.bits == 32:
            return 8 * pairs
        return 4 * pairs + -(-pairs * self.bits // 8) + 4

    def rounds(self) -> list[tuple[str, int]]:
        """Per round, ``("sparse", pairs)`` or ``("dense", n)``: what each device sends
        (split-allgather: per phase, what it sends each of the ``p - 1`` others)."""
        if self.algorithm == "split-allgather":
            if self.p == 1:
                return []
            m = self.part
            return [("dense", m) if self.message_bytes(c) >= 4 * m else ("sparse", c)
                    for c in (min(self.k, m), min(self.p * self.k, m))]  # fmt: skip
        out, pairs, dense = [], self.k, False
        for _ in range((self.p - 1).bit_length()):
            dense = dense or self.message_bytes(pairs) >= 4 * self.n
            out.append(("dense", self.n) if dense else ("sparse", pairs))
            pairs *= 2
        return out

    def switch_round(self) -> int | None:
        """The first dense round (DSAR's switch), or None when every round is sparse."""
        kinds = [kind for kind, _ in self.rounds()]
        return kinds.index("dense") if "dense" in kinds else None

    def bytes_per_device(self) -> list[int]:
        """Per round (phase), the bytes one device sends."""
        each = [self.message_bytes(c) if kind == "sparse" else 4 * c for kind, c in self.rounds()]
        return [(self.p - 1) * b for b in each] if self.algorithm == "split-allgather" else each

    def analytic_bytes(self) -> int:
        """Bytes all devices send for one allreduce."""
        return self.p * sum(self.bytes_per_device())

    def __call__(self, idx: Array, val: Array, axis: str, key: Array) -> Array:
        """The dense sum over ``axis`` of every device's ``(idx, val)`` sparse vector."""
        if self.algorithm == "split-allgather":
            return self._split_allgather(idx, val, axis, key)
        i = jax.lax.axis_index(axis)
        dense = None
        for s, (kind, _) in enumerate(self.rounds()):
            d = 1 << s
            pairs = [(j, j ^ d) for j in range(self.p)]
            upper = (i & d) != 0
            if kind == "sparse":
                payload = self.quantize(val, jax.random.fold_in(key, s))
                val = self.dequantize(payload, idx.shape[0])  # what the partner will see
                other = jax.lax.ppermute((idx, *payload), axis, pairs)
                theirs = self.dequantize(other[1:], idx.shape[0])
                idx = jnp.where(upper, jnp.concatenate([other[0], idx]),
                                jnp.concatenate([idx, other[0]]))  # fmt: skip
                val = jnp.where(upper, jnp.concatenate([theirs, val]),
                                jnp.concatenate([val, theirs]))  # fmt: skip
            else:
                if dense is None:
                    dense = jnp.zeros((self.n,), jnp.float32).at[idx].add(val)
                dense = dense + jax.lax.ppermute(dense, axis, pairs)
        if dense is None:
            dense = jnp.zeros((self.n,), jnp.float32).at[idx].add(val)
        return dense

    def _split_allgather(self, idx: Array, val: Array, axis: str, key: Array) -> Array:
        """Phase 1: each partition's pairs to its owner (all-to-all), summed there; phase
        2: the partition sums to everyone (all-gather)."""
        if self.p == 1:
            return jnp.zeros((self.n,), jnp.float32).at[idx].add(val)
        p, m, i = self.p, self.part, jax.lax.axis_index(axis)
        (first, c1), (second, c2) = self.rounds()
        if first == "dense":
            rows = jnp.zeros((p * m,), jnp.float32).at[idx].add(val).reshape(p, m)
            part = jax.lax.all_to_all(rows, axis, 0, 0).sum(0)
        else:  # row j: my pairs in partition j, padded with zeros at its first entry
            order = jnp.argsort(idx // m, stable=True)
            owner, idx, val = idx[order] // m, idx[order], val[order]
            start = jnp.searchsorted(owner, jnp.arange(p))
            count = jnp.searchsorted(owner, jnp.arange(p), side="right") - start
            at = jnp.minimum(start[:, None] + jnp.arange(c1), idx.shape[0] - 1)
            ok = jnp.arange(c1) < count[:, None]
            rows = (jnp.where(ok, idx[at], (jnp.arange(p) * m)[:, None]),
                    jnp.where(ok, val[at], 0.0))  # fmt: skip
            got = self._exchange(rows, jax.random.fold_in(key, 0), jax.lax.all_to_all,
                                 axis, 0, 0)  # fmt: skip
            part = jnp.zeros((m,), jnp.float32).at[got[0] - i * m].add(got[1])
        if second == "dense":
            return jax.lax.all_gather(part, axis).reshape(-1)[: self.n]
        _, at = jax.lax.top_k(jnp.abs(part), c2)  # every nonzero: at most c2 of them
        rows = ((at + i * m).astype(jnp.int32), part[at])
        got = self._exchange(rows, jax.random.fold_in(key, 1), jax.lax.all_gather, axis)
        return jnp.zeros((p * m,), jnp.float32).at[got[0]].add(got[1])[: self.n]

    def _exchange(self, pairs: tuple[Array, Array], key: Array, collective, *args) -> tuple:
        """``(indices, values)`` through ``collective`` with the values quantized (each
        row its own message: its own scale), flattened back to fp32 pairs."""
        keys = jax.random.split(key, pairs[1].shape[0]) if pairs[1].ndim > 1 else key
        quantize = jax.vmap(self.quantize) if pairs[1].ndim > 1 else self.quantize
        payload = quantize(pairs[1], keys)
        got = jax.tree.map(lambda a: collective(a, *args), (pairs[0], *payload))
        count = pairs[1].shape[-1]
        val = jax.vmap(lambda *q: self.dequantize(q, count))(*got[1:])
        return got[0].reshape(-1), val.reshape(-1)

    def pack(self, v: Array, key: Array) -> tuple[Array, ...]:
        """The message of ``v``'s ``k`` largest-magnitude entries: ``(indices, *payload)``,
        the values quantized as a sparse round sends them (one message, not a sum)."""
        _, idx = jax.lax.top_k(jnp.abs(v), self.k)
        return (idx.astype(jnp.int32), *self.quantize(v[idx], key))

    def unpack(self, message: tuple[Array, ...]) -> Array:
        """The dense ``n`` vector a ``pack`` message carries (zeros for an empty one)."""
        val = self.dequantize(message[1:], message[0].shape[0])
        return jnp.zeros((self.n,), jnp.float32).at[message[0]].add(val)

    def quantize(self, val: Array, key: Array) -> tuple[Array, ...]:
        """``(values,)`` in fp32, or ``(codes, scale)``: signed levels, 4-bit ones packed
        two to a byte."""
        if self.bits == 32:
            return (val,)
        scale = jnp.max(jnp.abs(val))
        x = jnp.abs(val) / jnp.where(scale > 0, scale, 1.0) * self.levels
        q = (jnp.sign(val) * jnp.floor(x + jax.random.uniform(key, x.shape))).astype(jnp.int8)
        if self.bits == 4:
            nib = jnp.pad((q + 8).astype(jnp.uint8), (0, q.shape[0] % 2)).reshape(-1, 2)
            q = nib[:, 0] | (nib[:, 1] << 4)
        return q, scale[None]

    def dequantize(self, payload: tuple[Array, ...], count: int) -> Array:
        """The ``count`` fp32 values a payload carries."""
        if self.bits == 32:
            return payload[0]
        q, scale = payload
        if self.bits == 4:
            q = jnp.stack([q & 15, q >> 4], axis=1).reshape(-1).astype(jnp.int8) - 8
        return q[:count].astype(jnp.float32) / self.levels * scale[0]
