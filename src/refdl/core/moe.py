"""A mixture-of-experts feed-forward layer: top-k routing with a capacity, the
load-balancing loss, and a hook through which expert parallelism reaches the experts.

Routing (GShard, Lepikhin et al., arXiv 2006.16668; Switch, Fedus et al., arXiv
2101.03961): a router picks each token's ``top_k`` experts by softmax probability, and
the chosen gates are renormalised to sum to one. Tokens are routed in **groups of one
sequence**: each expert takes at most ``C = min(T, ceil(capacity_factor · T · top_k /
experts))`` of a sequence's ``T`` tokens, first choices first, then in the order of
positions; a choice past the capacity is dropped (the token keeps its residual). A
sequence's drops depend on that sequence alone, so any split of the batch - data, fsdp,
expert, pipeline microbatches - and any order the tokens are held in (context
parallelism's zig-zag) drops exactly the tokens one device drops.

The load-balancing loss of a sequence is ``experts · Σ_e f_e · P_e`` (``f_e``: the share
of its choices that went to expert ``e``; ``P_e``: its mean router probability for
``e``), averaged over sequences like the loss, times ``aux_weight``. It enters the
gradient where the layer is (``with_loss``), so it reaches the router in every strategy,
pipeline stages included; the ``loss`` refdl reports stays the cross-entropy. The layer
keeps the step's ``tokens_dropped_fraction`` - the share of the (token, expert) choices
dropped, so a token losing one of its two experts counts a half - and ``router_aux_loss``
in its ``moe`` collection (averaged over the devices' shards under ``batch_axis``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from refdl.core.layers import batch_mean, param, scoped, sequence_now
from refdl.core.precision import wide

Array = jax.Array
PyTree = Any
Experts = Callable[[Array, PyTree], Array]  # ([B, E, C, D] buffers, expert params) -> same


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """How the buffers reach the experts while tracing with the experts split over a mesh
    axis: ``run(experts, buffers, params)`` applies ``experts`` to the ``[B, E, C, D]``
    buffers of every expert (``refdl.parallel.expert``: all-to-all there and back)."""

    run: Callable[[Experts, Array, PyTree], Array]


_EXPERTS: contextvars.ContextVar[ExpertShard | None] = contextvars.ContextVar(
    "experts", default=None
)


def expert_shard(shard: ExpertShard | None) -> contextlib.AbstractContextManager[None]:
    """While tracing, the mixture-of-experts layers reach their experts through ``shard``."""
    return scoped(_EXPERTS, shard)


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots per expert in a group of ``tokens``: ``min(T, ceil(factor · T · k / E))``.

    >>> capacity(20, 8, 2, 1.25), capacity(20, 8, 2, 100.0)
    (7, 20)
    """
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / experts)))


_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("loss_scale", default=1.0)


def loss_scale(scale: float) -> contextlib.AbstractContextManager[None]:
    """While tracing, each (micro)batch's backward pass differentiates ``scale × loss``
    (the pipeline's ``1/microbatches``), so a loss added by ``with_loss`` is scaled alike."""
    return scoped(_SCALE, scale)


def with_loss(y: Array, loss: Array) -> Array:
    """``y``, with ``loss`` added to the objective being differentiated: the backward pass
    gives ``loss`` the cotangent ``loss_scale`` (1 unless set), as if each (micro)batch's
    loss were ``L + loss``."""
    scale = _SCALE.get()

    @jax.custom_vjp
    def attach(y: Array, loss: Array) -> Array:
        return y

    def backward(loss: Array, g: Array) -> tuple[Array, Array]:
        return g, jnp.full_like(loss, scale)

    attach.defvjp(lambda y, loss: (y, loss), backward)
    return attach(y, loss)


def route(
    probs: Array, top_k: int, slots: int, positions: Array | None = None
) -> tuple[Array, Array, Array, Array]:
    """Top-``k`` routing of ``probs [B, T, E]`` into ``slots`` per expert and sequence.

    Returns ``dispatch [B, T, E, C]`` (1 where a token's choice sits in a slot),
    ``combine`` (the same holding the choice's gate), ``kept [B, T, k]`` and the choices
    ``[B, T, k, E]`` (one-hot). Slots are
    given first choices first, then by position: ``positions [T]`` are the tokens' places
    in the sequence when they are held in another order (else their index)."""
    experts = probs.shape[-1]
    gates, chosen = jax.lax.top_k(probs, top_k)  # [B, T, k]
    if top_k > 1:  # top-1 keeps its probability (Switch), else its gate would be 1
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # [B, T, k, E]
    natural = onehot if positions is None else onehot[:, jnp.argsort(positions)]
    b, t, k, e = natural.shape
    ranked = natural.transpose(0, 2, 1, 3).reshape(b, k * t, e)  # first choices first
    slot = jnp.sum((jnp.cumsum(ranked, axis=1) - 1) * ranked, axis=-1)
    slot = slot.reshape(b, k, t).transpose(0, 2, 1)  # [B, T, k] in position order
    if positions is not None:
        slot = slot[:, positions]
    kept = slot < slots
    place = jax.nn.one_hot(jnp.where(kept, slot, slots), slots, dtype=probs.dtype)  # dropped: 0
    dispatch = jnp.einsum("btke,btkc->btec", onehot.astype(probs.dtype), place)
    combine = jnp.einsum("btke,btkc,btk->btec", onehot.astype(probs.dtype), place, gates)
    return dispatch, combine, kept, onehot


def balance_loss(probs: Array, dispatch_choices: Array) -> Array:
    """Switch's load-balancing loss ``E · Σ_e f_e · P_e`` per sequence, averaged: ``probs
    [B, T, E]`` the router's, ``dispatch_choices [B, T, k, E]`` each token's choices."""
    experts = probs.shape[-1]
    share = jnp.mean(jnp.mean(dispatch_choices, axis=2), axis=1)  # f [B, E]
    mean_prob = jnp.mean(probs, axis=1)  # P [B, E]
    return jnp.mean(experts * jnp.sum(share * mean_prob, axis=-1))


def expert_mlp(buffers: Array, params: PyTree) -> Array:
    """Every expert's two-layer GELU MLP on its ``[B, E, C, D]`` buffer (weights lead with
    the expert axis, so a device holding some experts runs this on their slice)."""
    h = jnp.einsum("becd,edf->becf", buffers, params["w1"]) + params["b1"][None, :, None]
    h = jax.nn.gelu(h)
    return jnp.einsum("becf,efd->becd", h, params["w2"]) + params["b2"][None, :, None]


class MoEFeedForward(nn.Module):
    """``experts`` GELU MLPs of width ``mlp_dim``, each token through its ``top_k`` (see the
    module's docstring); expert weights carry the ``expert`` logical axis."""

    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    mlp_dim: int = 256
    aux_weight: float = 0.01

    def slots(self, tokens: int) -> int:
        """Slots per expert for a sequence of ``tokens`` (``capacity``)."""
        return capacity(tokens, self.experts, self.top_k, self.capacity_factor)

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        _, t, d = x.shape
        e, f = self.experts, self.mlp_dim
        init = nn.initializers.lecun_normal(batch_axis=(0,))  # fan-in per expert
        router = param(self, "router", nn.initializers.lecun_normal(), (d, e), ("embed", None))
        params = {
            "w1": param(self, "w1", init, (e, d, f), ("expert", "embed", "mlp")),
            "b1": param(self, "b1", nn.initializers.zeros, (e, f), ("expert", "mlp")),
            "w2": param(self, "w2", init, (e, f, d), ("expert", "mlp", "embed")),
            "b2": param(self, "b2", nn.initializers.zeros, (e, d), ("expert", "embed")),
        }
        # the router in fp32 (under bf16 compute too; fp64 under fp64): its choices are discrete
        rt = wide(x.dtype)
        logits = jnp.einsum("btd,de->bte", x.astype(rt), router.astype(rt))
        probs = jax.nn.softmax(logits, axis=-1)
        split = sequence_now()
        if split is not None and not split.whole:
            raise ValueError("MoEFeedForward routes whole sequences; got one device's piece")
        positions = split.positions(t) if split is not None else None
        dispatch, combine, kept, chosen = route(probs, self.top_k, self.slots(t), positions)
        buffers = jnp.einsum("btec,btd->becd", dispatch.astype(x.dtype), x)
        shard = _EXPERTS.get()
        out = shard.run(expert_mlp, buffers, params) if shard else expert_mlp(buffers, params)
        y = jnp.einsum("btec,becd->btd", combine.astype(out.dtype), out)
        aux = self.aux_weight * balance_loss(probs, chosen.astype(rt))
        dropped = jnp.mean((~kept).astype(rt))
        stats = {"tokens_dropped_fraction": dropped, "router_aux_loss": aux}
        for name, value in stats.items():
            var = self.variable("moe", name, jnp.zeros, (), jnp.float32)
            if train and self.is_mutable_collection("moe"):
                var.value = batch_mean(jax.lax.stop_gradient(value)).astype(var.value.dtype)
        return with_loss(y, aux) if train else y


def moe_layers(model: Any) -> list[MoEFeedForward]:
    """The mixture-of-experts layers of a ``Sequential`` (blocks whose ``ffn`` is one)."""
    found = (getattr(layer, "ffn", None) for layer in model.layers)
    return [f for f in found if isinstance(f, MoEFeedForward)]


def step_stats(model_state: PyTree) -> PyTree:
    """The ``moe`` collections of a ``Sequential``'s model state (``{}`` without any)."""
    return {k: {"moe": v["moe"]} for k, v in model_state.items() if "moe" in v}


def with_step_stats(model_state: PyTree, stats: PyTree) -> PyTree:
    """``model_state`` with its ``moe`` collections replaced by ``stats``'s: a step's
    statistics as the mean over its microbatches, not the last one's."""
    return {**model_state, **{k: {**model_state[k], **v} for k, v in stats.items()}}


def moe_stats(tree: PyTree, to_host: Callable[[Any], Any] = np.asarray) -> dict[str, float]:
    """The mean over a model state's mixture-of-experts layers of each ``moe`` statistic
    (``{}`` for a model without any); ``tree`` may hold several stages' states, on any
    devices (``to_host`` brings a leaf to the host)."""
    found: dict[str, list[float]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(p, "key", None) for p in path]
        if "moe" in keys and keys[-1] in ("tokens_dropped_fraction", "router_aux_loss"):
            found.setdefault(keys[-1], []).append(float(np.mean(to_host(leaf))))
    return {k: float(np.mean(v)) for k, v in found.items()}
