"""Losses and metrics: softmax cross-entropy, squared error, 0-1 accuracy.

Every loss is the *mean* over all examples (and time steps for sequences), so
the loss of a global batch equals the mean of the losses of equal-sized
shards: the identity data parallelism and microbatching rely on.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from refdl.core.precision import wide
from refdl.registry import Registry

Array = jax.Array
LossFn = Callable[[Array, Array], Array]

LOSSES: Registry[LossFn] = Registry("loss")


@LOSSES.register("cross_entropy")
def cross_entropy(logits: Array, labels: Array) -> Array:
    """Mean softmax cross-entropy, ``-log softmax(logits)[label]``; labels are class ids.

    >>> float(cross_entropy(jnp.zeros((1, 4)), jnp.array([2])))  # log 4
    1.3862943649291992
    """
    logits = logits.astype(wide(logits.dtype))  # bf16 compute: the loss still in fp32
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@LOSSES.register("squared")
def squared_error(outputs: Array, labels: Array) -> Array:
    """Mean over examples of ``0.5 * ||outputs - onehot(labels)||^2`` (labels are class ids)."""
    outputs = outputs.astype(wide(outputs.dtype))
    target = jax.nn.one_hot(labels, outputs.shape[-1], dtype=outputs.dtype)
    return jnp.mean(0.5 * jnp.sum((outputs - target) ** 2, axis=-1))


def accuracy(logits: Array, labels: Array) -> Array:
    """0-1 accuracy: the fraction of examples whose arg-max equals the label."""
    return jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))


def error_rate(logits: Array, labels: Array) -> Array:
    """The 0-1 loss: ``1 - accuracy``."""
    return 1.0 - accuracy(logits, labels)
