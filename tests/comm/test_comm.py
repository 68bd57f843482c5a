"""Allreduce algorithms equal psum, and their measured bytes equal the analytic count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from refdl.comm.allreduce import ALGORITHMS, analytic_bytes
from refdl.comm.measure import collective_bytes
from refdl.config.codec import Compression
from refdl.config.mesh import MeshSpec
from refdl.errors import UsageError


def _run(algo: str, p: int, n: int):
    mesh = MeshSpec(data=p, model=8 // p).make(jax.devices()[:8])
    fn = ALGORITHMS[algo]
    f = jax.jit(
        jax.shard_map(
            lambda x: fn(x[0], "data", p)[None], mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    x = jnp.asarray(np.random.default_rng(p + n).standard_normal((p, n)), jnp.float32)
    compiled = f.lower(x).compile()
    return np.asarray(compiled(x)), np.asarray(x), compiled.as_text()


@pytest.mark.parametrize("algo", ["ring", "tree", "halving-doubling", "xla"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 37, 256])
def test_allreduce_equals_psum(algo, p, n):
    out, x, _ = _run(algo, p, n)
    expected = x.sum(axis=0)
    for row in out:  # every device holds the sum; fp32 summation order differs from psum
        np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algo", ["ring", "tree", "halving-doubling"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_measured_bytes_equal_analytic(algo, p):
    n = 1000
    _, _, text = _run(algo, p, n)
    # ppermutes in shard_map run on the `data` sub-groups of all 8 devices: 8/p copies
    measured = collective_bytes(text, 8)["total"]
    assert measured == (8 // p) * analytic_bytes(algo, 4 * n, p)


def test_tree_handles_non_power_of_two_and_hd_refuses():
    mesh = MeshSpec(data=3).make(jax.devices()[:3])
    x = jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5)
    f = jax.jit(
        jax.shard_map(
            lambda v: ALGORITHMS["tree"](v[0], "data", 3)[None],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    np.testing.assert_allclose(np.asarray(f(x)), np.tile(np.asarray(x).sum(0), (3, 1)))
    g = jax.shard_map(
        lambda v: ALGORITHMS["halving-doubling"](v[0], "data", 3)[None],
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    with pytest.raises(UsageError, match="power-of-two"):
        jax.jit(g).lower(x)


def test_collective_bytes_parses_groups():
    line = (
        "  %all-reduce = f32[100]{0} all-reduce(%x), channel_id=1, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, to_apply=%r"
    )
    assert collective_bytes(line, 8)["all-reduce"] == 8 * 2 * 3 * 400 // 4
    line2 = "  %ag = f32[8,4]{1,0} all-gather(%y), replica_groups=[4,2]<=[8], dimensions={0}"
    assert collective_bytes(line2, 8)["all-gather"] == 8 * 1 * 128 // 2
    line3 = "  %ar = f32[10]{0} all-reduce(%z), replica_groups={{0,1,2,3}}, to_apply=%r"
    assert collective_bytes(line3, 4)["total"] == 4 * 2 * 3 * 40 // 4


@pytest.mark.parametrize("codec", ["qsgd:4", "terngrad"])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(codec):
    """Gupta et al. 2015: stochastic rounding's expectation is the value. Over K = 2000
    independent roundings of one vector (n = 2048), the per-coordinate mean error divided
    by its standard error is ~N(0, 1) under no bias, so the sum of squares over the
    coordinates is chi-squared with n degrees of freedom: its mean 1 within 0.1 (n = 2048:
    the statistic's own spread is sqrt(2/n) = 0.03). Nearest rounding is deterministic;
    its error does not shrink with K: its mean error is larger than stochastic rounding's
    by a factor growing like sqrt(K) (here over 10)."""
    from refdl.comm.compress import make_codec

    n, k = 2048, 2000
    v = jnp.asarray(np.random.default_rng(0).standard_normal(n), jnp.float32)
    keys = jax.random.split(jax.random.key(1), k)

    def decoded(text: str):
        c = make_codec(Compression.parse(text))
        out = jax.jit(jax.vmap(lambda key: c.decode(c.encode(v, key), n)))(keys)
        return np.asarray(out, np.float64) - np.asarray(v, np.float64)[None]

    err = decoded(codec)
    mean, se = err.mean(axis=0), err.std(axis=0, ddof=1) / np.sqrt(k)
    moving = se > 0  # (a coordinate quantised exactly has no spread and no error)
    stat = np.mean((mean[moving] / se[moving]) ** 2)
    assert moving.sum() > n // 2 and abs(stat - 1.0) < 0.1, stat
    near = decoded(f"{codec.split(',')[0]},rounding=nearest")
    assert np.all(near == near[0])  # the same every time: no randomness to average out
    bias_near = np.linalg.norm(near[0]) / np.linalg.norm(v)
    bias_stochastic = np.linalg.norm(mean) / np.linalg.norm(v)
    assert bias_near > 10 * bias_stochastic, (bias_near, bias_stochastic)


def test_rounding_is_an_option_of_the_quantizers_only():
    assert Compression.parse("qsgd:8,rounding=nearest").error_feedback  # biased: feedback
    assert not Compression.parse("qsgd:8").error_feedback
    for bad, says in (("topk:0.1,rounding=nearest", "an option of the quantizers"),
                      ("qsgd:8,rounding=up", "is not rounding=stochastic"),
                      ("qsgd:4,q8", "q8 sets the width of topk's kept values"),
                      ("topk:0.1,q8,q4", "a value width \\(q8, q4\\) given twice"),
                      ("qsgd:4,rounding=nearest,rounding=up", "rounding given twice")):  # fmt: skip
        with pytest.raises(UsageError, match=says):
            Compression.parse(bad)
