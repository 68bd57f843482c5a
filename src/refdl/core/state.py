"""``TrainState``: everything a training step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

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
    """Every leaf as a NumPy array on the host (gathers sharded arrays)."""
    import numpy as np

    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
