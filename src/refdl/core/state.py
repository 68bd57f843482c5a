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
