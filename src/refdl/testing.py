"""Helpers for research code and tests: does a strategy compute what the reference computes?

    from refdl import RunSpec
    from refdl.testing import assert_equivalent

    assert_equivalent(RunSpec(strategy="data", devices=4, model="mlp", batch_size=32))
    assert_equivalent(RunSpec(strategy="fsdp", zero=3, devices=4, model="mlp",
                              optimizer="adam", precision="fp64"), steps=20)  # to 1e-10

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

__all__ = ["TOLERANCES", "Difference", "assert_close", "assert_equivalent", "compare",
           "reference_of"]  # fmt: skip


def reference_of(spec: RunSpec) -> RunSpec:
    """The single-device reference of ``spec``: the same model, data, optimizer and seed on
    ``single`` (one device, no strategy options, no microbatches)."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    reset = {k: defaults[k] for k in (*STRATEGY_OPTIONS, "microbatches")}
    return dataclasses.replace(spec, strategy="single", devices=1, **reset)


# Default tolerances by precision: (rtol, atol) of the parameters and of the per-step loss.
# fp32: a strategy reorders fp32 sums, a few ulps (~1e-7 relative) a step; fp64: ~1e-16 a
# step, so 1e-10 holds after tens of steps of any optimizer, Adam included
# (tests/strategies/test_fp64_matrix.py measures what each case keeps below it).
TOLERANCES = {"fp32": (1e-5, 1e-6, 1e-5, 1e-6), "bf16": (1e-5, 1e-6, 1e-5, 1e-6),
              "fp64": (1e-10, 1e-10, 1e-10, 1e-12)}  # fmt: skip


def assert_equivalent(
    spec: RunSpec,
    steps: int = 5,
    *,
    reference: RunSpec | Trajectory | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    loss_rtol: float | None = None,
    loss_atol: float | None = None,
) -> Difference:
    """``steps`` steps of ``spec`` give the reference's per-step losses (``loss_rtol``,
    ``loss_atol``) and final parameters (``rtol``, ``atol``, per tensor as
    ``numpy.allclose``); the reference is ``reference_of(spec)`` unless given (a spec, or
    an already computed ``Trajectory``). A tolerance not given is ``TOLERANCES``' for the
    spec's precision (``precision="fp64"``: the proof, 1e-10). Returns the parameters'
    ``Difference``."""
    default = TOLERANCES[spec.precision]
    given = (rtol, atol, loss_rtol, loss_atol)
    rtol, atol, loss_rtol, loss_atol = (
        d if v is None else v for v, d in zip(given, default, strict=True)
    )
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
