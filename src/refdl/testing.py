"""Helpers for research code and tests: does a strategy compute what the reference computes?

    from refdl import RunSpec
    from refdl.testing import assert_equivalent

    assert_equivalent(RunSpec(strategy="data", devices=4, model="mlp", batch_size=32))

``assert_equivalent`` runs the spec and its single-device reference (the same
model, data, optimizer and seed, strategy ``single``) for a few steps of the one
trajectory (``refdl.run.trajectory``) and checks the per-step losses and the
final parameters with ``refdl.core.compare.assert_close``; a failure names the
tensor and prints the max and mean difference and both norms.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from refdl.config.plan import STRATEGY_OPTIONS
from refdl.config.spec import RunSpec
from refdl.core.compare import Difference, assert_close, compare
from refdl.run.trajectory import Trajectory, run_steps

__all__ = ["Difference", "assert_close", "assert_equivalent", "compare", "reference_of"]


def reference_of(spec: RunSpec) -> RunSpec:
    """The single-device reference of ``spec``: the same model, data, optimizer and seed on
    ``single`` (one device, no strategy options, no microbatches)."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    reset = {k: defaults[k] for k in (*STRATEGY_OPTIONS, "microbatches")}
    return dataclasses.replace(spec, strategy="single", devices=1, **reset)


def assert_equivalent(
    spec: RunSpec,
    steps: int = 5,
    *,
    reference: RunSpec | Trajectory | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    loss_rtol: float = 1e-5,
    loss_atol: float = 1e-6,
) -> Difference:
    """``steps`` steps of ``spec`` give the reference's per-step losses (``loss_rtol``,
    ``loss_atol``) and final parameters (``rtol``, ``atol``, per tensor as
    ``numpy.allclose``); the reference is ``reference_of(spec)`` unless given (a spec, or
    an already computed ``Trajectory``). Returns the parameters' ``Difference``."""
    if not isinstance(reference, Trajectory):
        reference = run_steps(reference or reference_of(spec), steps)
    got = run_steps(spec, steps)
    ref_losses, losses = np.asarray(reference.losses), np.asarray(got.losses)
    if not np.allclose(losses, ref_losses, rtol=loss_rtol, atol=loss_atol):
        d = np.abs(losses - ref_losses)
        raise AssertionError(
            f"per-step loss differs: max {d.max():.3g}, mean {d.mean():.3g}\n"
            f"  reference {ref_losses}\n  got       {losses}"
        )
    return assert_close(reference.params, got.params, rtol, atol)
