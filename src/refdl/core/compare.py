"""The one comparator of two sets of parameters (or any two trees of arrays).

``compare`` reports what a reader needs to judge a difference: the largest and
mean absolute difference, the relative L2 difference, both norms, the worst
tensor, and Deep500's ``NormDifference`` family (Ben-Nun et al., IPDPS 2019,
deep500/metrics/test_metrics.py). ``assert_close`` checks every tensor with
``numpy.allclose`` semantics and fails with those figures. The equivalence
suite, ``refdl.testing``, the cross-framework validation and the examples all
use these two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def flat(tree: Any) -> dict[str, np.ndarray]:
    """A tree of arrays as ``{path: float64 array}`` (a flat dict keeps its keys)."""
    if isinstance(tree, Mapping) and all(
        hasattr(v, "shape") and not isinstance(v, Mapping) for v in tree.values()
    ):
        return {str(k): np.asarray(v) for k, v in tree.items()}
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def norm_difference(reference: Any, other: Any, order: float) -> float:
    """Deep500's ``NormDifference(ord)``: ``||reference - other||_ord`` of the flattened
    tensors."""
    d = (np.asarray(reference, np.float64) - np.asarray(other, np.float64)).ravel()
    return float(np.linalg.norm(d, order)) if d.size else 0.0


def deep500_errors(reference: Any, other: Any) -> dict[str, float]:
    """``NormDifference`` (ord 1, Deep500's L1Error), ``L2Error`` (ord 2) and ``MaxError``
    (ord inf) between two tensors."""
    return {
        "NormDifference": norm_difference(reference, other, 1),
        "L2Error": norm_difference(reference, other, 2),
        "MaxError": norm_difference(reference, other, np.inf),
    }


@dataclasses.dataclass(frozen=True)
class Difference:
    """How two trees of arrays differ (all figures in float64)."""

    max_abs: float
    mean_abs: float
    rel_l2: float  # ||a - b|| / ||a|| over all elements
    norm_reference: float
    norm_other: float
    worst: str  # the tensor with the largest relative L2 difference
    worst_rel_l2: float
    count: int
    deep500: dict[str, float]

    def __str__(self) -> str:
        return (
            f"max |diff| {self.max_abs:.3g}, mean {self.mean_abs:.3g}, relative L2 "
            f"{self.rel_l2:.3g}; norms {self.norm_reference:.9g} vs {self.norm_other:.9g}; "
            f"worst tensor {self.worst} ({self.worst_rel_l2:.3g})"
        )


def compare(reference: Any, other: Any) -> Difference:
    """The differences of ``other`` from ``reference`` (same paths and shapes)."""
    a, b = flat(reference), flat(other)
    missing = sorted(set(a) ^ set(b))
    if missing:
        raise ValueError(f"the two trees' paths differ: {missing[:5]}")
    keys = sorted(a)
    for k in keys:
        if np.shape(a[k]) != np.shape(b[k]):
            raise ValueError(f"{k}: shapes differ, {np.shape(a[k])} vs {np.shape(b[k])}")
    ra = np.concatenate([np.asarray(a[k], np.float64).ravel() for k in keys] or [np.zeros(0)])
    rb = np.concatenate([np.asarray(b[k], np.float64).ravel() for k in keys] or [np.zeros(0)])
    d = np.abs(ra - rb)
    per = {}
    for k in keys:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        per[k] = float(np.linalg.norm(x - y) / (np.linalg.norm(x) or 1.0))
    worst = max(per, key=per.get) if per else ""
    norm_a = float(np.linalg.norm(ra))
    return Difference(
        max_abs=float(d.max()) if d.size else 0.0,
        mean_abs=float(d.mean()) if d.size else 0.0,
        rel_l2=float(np.linalg.norm(ra - rb) / (norm_a or 1.0)),
        norm_reference=norm_a,
        norm_other=float(np.linalg.norm(rb)),
        worst=worst,
        worst_rel_l2=per.get(worst, 0.0),
        count=int(ra.size),
        deep500=deep500_errors(ra, rb),
    )


def assert_close(
    reference: Any, other: Any, rtol: float, atol: float, what: str = "parameters"
) -> Difference:
    """Every tensor of ``other`` within ``atol + rtol * |reference|`` of ``reference``
    (``numpy.allclose``); else an AssertionError naming the first tensor that is not,
    with its max and mean difference and norms, and the whole trees' figures."""
    diff = compare(reference, other)
    a, b = flat(reference), flat(other)
    for k in sorted(a):
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if not np.allclose(y, x, rtol=rtol, atol=atol):
            e = np.abs(x - y)
            raise AssertionError(
                f"{what} differ beyond rtol {rtol:g}, atol {atol:g} at {k}: max |diff| "
                f"{e.max():.3g}, mean {e.mean():.3g}, norms {np.linalg.norm(x):.9g} vs "
                f"{np.linalg.norm(y):.9g}; over all {what}: {diff}"
            )
    return diff
