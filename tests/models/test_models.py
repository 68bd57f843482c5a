"""Every registered model: output shape, finite gradients, logical axes on every parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from refdl.core.losses import cross_entropy
from refdl.data import DataInfo
from refdl.errors import UsageError
from refdl.models import MODELS

IMAGE = DataInfo("img", "image", (8, 8, 1), "float32", 10, 100, 10)
TOKENS = DataInfo("tok", "tokens", (12,), "int32", 30, 100, 10)
SMALL = {
    "mlp": {"hidden": "32,32"},
    "lenet5": {},
    "resnet": {"depth": "8", "width": "4"},
    "lstm_lm": {"hidden": "16"},
    "transformer": {"d_model": "16", "heads": "2", "layers": "1", "mlp_dim": "32"},
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet" else n for n in sorted(SMALL)]
)
def test_model_shapes_and_gradients(name):
    mdef = MODELS.get(name)
    info = IMAGE if mdef.data_kind == "image" else TOKENS
    model = mdef.make(info, SMALL[name])
    rng = np.random.default_rng(0)
    if info.kind == "image":
        x = jnp.asarray(rng.standard_normal((4, *info.input_shape)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 10, 4), jnp.int32)
        out_shape = (4, 10)
    else:
        x = jnp.asarray(rng.integers(0, 30, (4, 12)), jnp.int32)
        y = jnp.asarray(rng.integers(0, 30, (4, 12)), jnp.int32)
        out_shape = (4, 12, 30)
    params, state, axes = model.init(jax.random.key(0), x)
    out, _ = model.apply(params, state, x, train=True)
    assert out.shape == out_shape

    def loss(p):
        return cross_entropy(model.apply(p, state, x, train=True)[0], y)

    grads = jax.grad(loss)(params)
    leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
    assert leaves and all(np.isfinite(g).all() for g in leaves)
    assert sum(float(np.abs(g).sum()) for g in leaves) > 0
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))
    for a, p in zip(flat_axes, jax.tree.leaves(params), strict=True):
        assert len(a) == p.ndim, f"{name}: a parameter lacks logical axis names"


def test_resnet20_has_the_papers_parameter_count():
    from refdl.core.layers import param_count

    info = DataInfo("c", "image", (32, 32, 3), "float32", 10, 1, 1)
    model = MODELS.get("resnet").make(info, {"depth": "20"})
    params, state, _ = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    assert len(model) == 1 + 9 + 2  # stem, 3 x 3 blocks, pool, classifier
    assert 0.26e6 < param_count(params) < 0.28e6  # He et al.: 0.27 M
    assert "batch_stats" in next(iter(state.values()))


def test_lstm_lm_default_is_zaremba_small():
    model = MODELS.get("lstm_lm").make(DataInfo("t", "tokens", (20,), "int32", 10000, 1, 1))
    params, _, _ = model.init(jax.random.key(0), jnp.zeros((1, 20), jnp.int32))
    lstm = [k for k in params if "lstm" in k]
    assert len(lstm) == 2
    assert all(params[k]["w_hh"].shape == (200, 800) for k in lstm)


def test_model_errors():
    with pytest.raises(UsageError, match="needs a tokens data set"):
        MODELS.get("lstm_lm").make(IMAGE)
    with pytest.raises(UsageError, match="no option 'depth'"):
        MODELS.get("mlp").make(IMAGE, {"depth": "3"})
    with pytest.raises(UsageError, match="6n\\+2"):
        MODELS.get("resnet").make(IMAGE, {"depth": "21"})
    with pytest.raises(
        UsageError, match=r"--model-opt depth='deep': must be an integer in \[8, 1000\]"
    ):
        MODELS.get("resnet").make(IMAGE, {"depth": "deep"})
