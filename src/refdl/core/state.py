"""``TrainState``: everything a training step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

PyTree = Any


@struct.dataclass
class TrainState:
    """Parameters, model state (BatchNorm statistics), optimizer state, step, RNG, extras.

    ``rng`` holds raw key data (``uint32[2]``) so the state saves and restores as
    plain arrays. ``extras`` is the strategies' room (error-feedback residuals,
    per-replica parameters, ...), a dict of arrays.
    """

    step: jax.Array
    params: PyTree
    model_state: PyTree
    opt_state: PyTree
    rng: jax.Array
    extras: PyTree = struct.field(default_factory=dict)


def place(tree: PyTree, shardings: Any) -> PyTree:
    """Host arrays onto devices as ``shardings`` says (one sharding or device for the whole
    tree, or a tree of them, as for ``jax.device_put``), each device taking only its own
    slice (``jax.make_array_from_callback``). Across processes nothing moves between hosts:
    ``jax.device_put`` of a host array first checks that every process holds the same
    value, an all-gather of the whole state through every host."""

    def one(x: Any, sh: Any) -> Any:
        if isinstance(sh, jax.Device):
            sh = jax.sharding.SingleDeviceSharding(sh)
        if isinstance(x, jax.Array):
            return jax.device_put(x, sh)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda index: x[index])

    return jax.tree.map(lambda sh, part: jax.tree.map(lambda x: one(x, sh), part), shardings, tree)


def to_host(tree: PyTree) -> PyTree:
    """Every leaf as a NumPy array on the host (gathers sharded arrays).

    Across processes (``jax.distributed``) a replicated array is read from this
    process's copy and a sharded one is all-gathered, so every process must call
    this at the same point.
    """

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)
