"""Layers, losses and optimizers against hand-computed values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from refdl.core import layers as L
from refdl.core.losses import accuracy, cross_entropy, error_rate, squared_error
from refdl.core.optim import make_optimizer, make_schedule
from refdl.errors import UsageError


def test_cross_entropy_hand_computed():
    logits = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    labels = jnp.array([2, 0])
    lse = np.log(np.exp(1) + np.exp(2) + np.exp(3))
    expected = ((lse - 3.0) + np.log(3.0)) / 2
    assert float(cross_entropy(logits, labels)) == pytest.approx(expected, rel=1e-6)


def test_squared_error_hand_computed():
    out = jnp.array([[0.5, 0.0], [0.0, 0.0]])
    labels = jnp.array([0, 1])
    # example 1: 0.5*((0.5-1)^2 + 0) = 0.125 ; example 2: 0.5*(0 + 1) = 0.5
    assert float(squared_error(out, labels)) == pytest.approx((0.125 + 0.5) / 2)


def test_accuracy_and_error_rate():
    logits = jnp.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    labels = jnp.array([1, 0, 0, 1])
    assert float(accuracy(logits, labels)) == 0.5
    assert float(error_rate(logits, labels)) == 0.5


def _init_apply(layer, x):
    model = L.Sequential((layer,))
    params, state, axes = model.init(jax.random.key(0), x)
    y, _ = model.apply(params, state, x)
    return params[model.keys[0]], axes[model.keys[0]], y


def test_dense_matches_numpy_and_names_axes():
    x = jnp.arange(6.0).reshape(2, 3)
    p, axes, y = _init_apply(L.Dense(4, "embed", "mlp", act="relu"), x)
    expected = np.maximum(np.asarray(x) @ np.asarray(p["kernel"]) + np.asarray(p["bias"]), 0)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    assert axes == {"kernel": ("embed", "mlp"), "bias": ("mlp",)}


def test_conv_matches_direct_sum():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 4, 4, 2)), jnp.float32)
    p, axes, y = _init_apply(L.Conv(3, (3, 3), padding="VALID"), x)
    k, b = np.asarray(p["kernel"]), np.asarray(p["bias"])
    xn = np.asarray(x)
    expected = np.zeros((1, 2, 2, 3), np.float32)
    for i in range(2):
        for j in range(2):
            patch = xn[0, i : i + 3, j : j + 3, :]
            expected[0, i, j] = np.einsum("hwc,hwco->o", patch, k) + b
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert axes["kernel"] == (None, None, "conv_in", "conv_out")


@pytest.mark.parametrize(
    "shape, kernel, stride, padding",
    [((3, 8, 8, 1), 5, 1, "SAME"), ((3, 4, 4, 8), 5, 1, "SAME"), ((2, 7, 6, 3), 3, 2, "SAME"),
     ((2, 4, 4, 32), 3, 2, "SAME"), ((2, 9, 9, 4), 3, 2, "VALID")],
)  # fmt: skip
def test_im2col_conv_and_its_gradients_equal_xlas(shape, kernel, stride, padding):
    """The CPU's patches x kernel formulation: values and both gradients as XLA's convolution
    (fp32 summation order only), and chosen for exactly these small shapes."""
    from refdl.core import conv

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    k = jnp.asarray(rng.standard_normal((kernel, kernel, shape[-1], 16)), jnp.float32)
    s = (stride, stride)
    dims = ("NHWC", "HWIO", "NHWC")

    def ref(x, k):
        return jnp.sum(jnp.tanh(jax.lax.conv_general_dilated(x, k, s, padding,
                                                             dimension_numbers=dims)))  # fmt: skip

    def mine(x, k):
        return jnp.sum(jnp.tanh(conv.im2col_conv(x, k, s, padding)))

    assert conv.use_im2col(shape, k.shape, s, padding)
    for a, b in zip(jax.grad(ref, (0, 1))(x, k), jax.grad(mine, (0, 1))(x, k), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    y_ref = jax.lax.conv_general_dilated(x, k, s, padding, dimension_numbers=dims)
    np.testing.assert_allclose(jax.jit(conv.conv2d, static_argnums=(2, 3))(x, k, s, padding),
                               y_ref, rtol=1e-5, atol=1e-5)  # fmt: skip
    assert not conv.use_im2col((64, 32, 32, 16), (3, 3, 16, 16), (1, 1), "SAME")


def test_lstm_matches_hand_written_step():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    p, _, y = _init_apply(L.LSTM(5), x)
    w_ih, w_hh, b = (np.asarray(p[k], np.float64) for k in ("w_ih", "w_hh", "bias"))
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    h = np.zeros((2, 5))
    c = np.zeros((2, 5))
    for t in range(3):
        z = np.asarray(x[:, t], np.float64) @ w_ih + h @ w_hh + b
        i, f, g, o = np.split(z, 4, axis=-1)
        c = sig(f) * c + sig(i) * np.tanh(g)
        h = sig(o) * np.tanh(c)
        np.testing.assert_allclose(y[:, t], h, rtol=1e-5, atol=1e-6)


def test_attention_is_causal():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 6, 8)), jnp.float32)
    model = L.Sequential((L.TransformerBlock(2, 16),))
    params, state, _ = model.init(jax.random.key(0), x)
    y1, _ = model.apply(params, state, x)
    x2 = x.at[:, 4:].set(0.0)  # change only the future of positions 0..3
    y2, _ = model.apply(params, state, x2)
    np.testing.assert_allclose(y1[:, :4], y2[:, :4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(y1[:, 4:], y2[:, 4:])


def test_sequential_stages_compose_to_the_whole():
    model = L.Sequential((L.Dense(8, act="relu"), L.Dense(8, "mlp", "embed"), L.Dense(3)))
    x = jnp.ones((2, 4))
    params, state, axes = model.init(jax.random.key(0), x)
    y, _ = model.apply(params, state, x)
    h = x
    for stage in model.split([1, 2]):
        h, _ = stage.apply({k: params[k] for k in stage.keys}, {}, h)
    np.testing.assert_array_equal(y, h)
    assert [len(s) for s in model.split([1])] == [1, 2]
    # every parameter array carries one logical name per dimension
    for leaf_axes, leaf in zip(
        jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple)),
        jax.tree.leaves(params),
        strict=True,
    ):
        assert len(leaf_axes) == leaf.ndim


def test_schedules():
    s = make_schedule(1.0, "step", decay_every=10, decay_factor=0.5)
    assert [float(s(t)) for t in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    c = make_schedule(2.0, "cosine", total_steps=100)
    assert float(c(0)) == pytest.approx(2.0)
    assert float(c(50)) == pytest.approx(1.0, rel=1e-5)
    assert float(c(100)) == pytest.approx(0.0, abs=1e-6)
    w = make_schedule(1.0, "constant", total_steps=100, warmup_steps=10)
    assert [float(w(t)) for t in (0, 5, 10, 50)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    with pytest.raises(UsageError, match="lr-schedule"):
        make_schedule(1.0, "linear")


def _two_updates(name: str) -> np.ndarray:
    opt = make_optimizer(name, optax.constant_schedule(0.1), momentum=0.9)
    p = jnp.array([1.0])
    g = jnp.array([2.0])
    st = opt.init(p)
    for _ in range(2):
        u, st = opt.update(g, st, p)
        p = optax.apply_updates(p, u)
    return np.asarray(p)


def test_optimizers_hand_computed():
    # sgd: 1 - 0.1*2 - 0.1*2
    np.testing.assert_allclose(_two_updates("sgd"), [0.6], rtol=1e-6)
    # momentum: v1 = 2, v2 = 0.9*2 + 2 = 3.8; p = 1 - 0.2 - 0.38
    np.testing.assert_allclose(_two_updates("momentum"), [0.42], rtol=1e-6)
    # nesterov: step uses g + 0.9*v: 2 + 1.8 = 3.8, then 2 + 0.9*3.8 = 5.42
    np.testing.assert_allclose(_two_updates("nesterov"), [1 - 0.38 - 0.542], rtol=1e-6)
    # adam: bias-corrected first steps move by ~lr each
    np.testing.assert_allclose(_two_updates("adam"), [0.8], rtol=1e-4)
    with pytest.raises(UsageError, match="optimizer"):
        make_optimizer("rmsprop", optax.constant_schedule(0.1))
