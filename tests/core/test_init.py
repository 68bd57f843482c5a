"""The frameworks' default initialisations refdl draws to compare with their runs."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from refdl.config.spec import RunSpec
from refdl.core.init import redraw
from refdl.run.build import build


@pytest.fixture(scope="module")
def mlp():
    run = build(RunSpec(model="mlp", progress=False))
    return jax.device_get(run.task.init_state(0).params), run.task.model


@pytest.mark.parametrize("scheme", ["torch", "keras", "mxnet"])
def test_each_scheme_draws_within_its_bound(mlp, scheme):
    """Issue 54: an MXNet log from a bare ``net.initialize()`` (U(-0.07, 0.07), biases 0)
    failed as a bug because refdl could not draw that start; ``--init mxnet`` does."""
    params, model = mlp
    drawn = jax.device_get(redraw(params, model, scheme, jax.random.PRNGKey(1)))
    for key, layer in drawn.items():
        if "kernel" not in layer:  # (a flatten)
            continue
        kernel = np.asarray(layer["kernel"])
        fan_in, fan_out = math.prod(kernel.shape[:-1]), kernel.shape[-1]
        bound = {"torch": 1 / math.sqrt(fan_in), "keras": math.sqrt(6 / (fan_in + fan_out)),
                 "mxnet": 0.07}[scheme]  # fmt: skip
        assert np.abs(kernel).max() <= bound and np.abs(kernel).max() > 0.9 * bound, key
        assert abs(kernel.std() - bound / math.sqrt(3)) < 0.1 * bound, key  # uniform's std
        bias = np.asarray(layer["bias"])
        if scheme == "torch":
            assert np.abs(bias).max() <= bound and bias.any(), key
        else:
            assert not bias.any(), key
