"""Numeric precision of a run: the master weights' dtype and JAX's 64-bit mode.

``fp32`` and ``bf16`` keep fp32 master weights (bf16 computes each layer on bf16 copies);
``fp64`` keeps and computes everything in float64, which needs JAX's 64-bit mode
(``jax_enable_x64``). The proofs of equivalence run in fp64: summation order then moves
a result by ~1e-16 relative a step instead of ~1e-7, so two strategies that compute the
same thing agree to ~1e-10 after tens of steps, whatever the optimizer.

JAX's 64-bit mode is a thread-local setting that enters every compiled program's cache
key, so a whole run - build, steps, evaluation - must happen inside one ``scope``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def master_dtype(precision: str) -> Any:
    """The dtype parameters, gradients, optimizer state and the loss are kept in."""
    return jnp.float64 if precision == "fp64" else jnp.float32


def wide(dtype: Any) -> Any:
    """``dtype`` raised to at least fp32 (the loss, the router, attention's accumulators):
    bf16 -> fp32, fp32 stays, fp64 stays."""
    return jnp.promote_types(dtype, jnp.float32)


@contextlib.contextmanager
def scope(precision: str) -> Iterator[None]:
    """Run what is inside with JAX's 64-bit mode on for ``fp64`` and off otherwise."""
    with jax.enable_x64(precision == "fp64"):
        yield


def to_master(tree: Any, precision: str) -> Any:
    """Floating leaves of ``tree`` cast to the master dtype (``fp64``); others unchanged."""
    if precision != "fp64":
        return tree
    return jax.tree.map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def abstract_to_master(tree: Any, precision: str) -> Any:
    """``to_master`` for a tree of ``ShapeDtypeStruct``s."""
    if precision != "fp64":
        return tree
    return jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, np.float64)
            if jnp.issubdtype(a.dtype, jnp.floating)
            else a
        ),
        tree,
    )
