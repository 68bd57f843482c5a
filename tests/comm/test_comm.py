"""Allreduce algorithms equal psum, and their measured bytes equal the analytic count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from refdl.comm.allreduce import ALGORITHMS, analytic_bytes
from refdl.comm.measure import collective_bytes
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
