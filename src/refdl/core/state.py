"""``TrainState``: everything a training step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
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


def per_param(optimizer: Any, opt_state: PyTree, values: PyTree, other: Any) -> PyTree:
    """The optimizer state's shape with each leaf that belongs to a parameter (a moment)
    replaced by that parameter's entry of ``values`` (shaped like the parameters) and every
    other leaf (a step count) by ``other``. Found by the leaf's path, so it holds where
    ``optax.tree_map_params`` with a second tree does not: a state whose parts cover only
    some parameters (Muon's matrices and AdamW's rest, masked)."""
    marks = optax.tree_map_params(optimizer, lambda _: True, opt_state,
                                  transform_non_params=lambda _: False)  # fmt: skip
    flat = jax.tree_util.tree_flatten_with_path(values, is_leaf=lambda x: not isinstance(x, dict))
    by_path = {jax.tree_util.keystr(p): v for p, v in flat[0]}

    def one(path: tuple, mark: bool) -> Any:
        if not mark:
            return other
        for i in range(len(path)):  # the longest suffix naming a parameter
            found = by_path.get(jax.tree_util.keystr(path[i:]))
            if found is not None:
                return found
        raise KeyError(f"no parameter at the end of {jax.tree_util.keystr(path)}")

    return jax.tree_util.tree_map_with_path(one, marks)
