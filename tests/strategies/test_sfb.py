"""``--sfb``: sufficient-factor broadcasting (Xie et al. 2015). A fully connected layer's
weight gradient ``X^T dZ`` travels as its factors, all-gathered; every device forms the
mean gradient itself. The result equals ``single``'s to fp32 rounding (the sum over the
batch is one matmul over the gathered rows rather than a sum of per-device matmuls), and
the bytes the compiled step moves are the ones the rule priced.

Tolerance (fp32): parameters rtol 1e-5 / atol 1e-6 after 5 steps (tests/strategies/
test_equivalence.py gives the reasoning; a wrong scale or a missing device is > 1e-2).
"""

from __future__ import annotations

import re

import pytest

from refdl.comm.allreduce import analytic_bytes
from refdl.config.spec import RunSpec, command_line
from refdl.errors import UsageError
from refdl.run.build import build
from refdl.run.loop import fit
from refdl.run.trajectory import run_steps
from refdl.testing import assert_equivalent

STEPS, RTOL, ATOL = 5, 1e-5, 1e-6
QUIET = {"progress": False, "eval_every": 0, "checkpoint_every": 0}
MLP = {"model": "mlp", "model_opts": (("hidden", "32,32"),), "batch_size": 32, "progress": False}


@pytest.fixture(scope="module")
def reference():
    return run_steps(RunSpec(**MLP), STEPS)


@pytest.mark.parametrize(
    "kw",
    [
        {"sfb": "all", "devices": 4},
        {"sfb": "all", "devices": 2, "microbatches": 2, "allreduce": "ring"},
        {"sfb": "auto", "devices": 8},
    ],
)
def test_factored_steps_equal_single(reference, kw):
    spec = RunSpec(**MLP, strategy="data", **kw)
    assert_equivalent(spec, STEPS, reference=reference, rtol=RTOL, atol=ATOL,
                      loss_rtol=RTOL, loss_atol=ATOL)  # fmt: skip


@pytest.mark.slow  # the default suite's time (15 min on 2 cores; 19 min 23 s measured 2026-11-26)
def test_a_language_models_head_factors_over_its_tokens():
    """The transformer's output layer sees batch x sequence rows; all of them gather."""
    model = {"model": "transformer", "data_opts": (("seq_len", "8"),), "batch_size": 16,
             "model_opts": (("d_model", "32"), ("heads", "4"), ("layers", "1"),
                            ("mlp_dim", "64")), "progress": False}  # fmt: skip
    run = build(RunSpec(**model, strategy="data", devices=4, sfb="all"))
    factored = {k: v for k, v in run.strategy.factors.items() if v["mode"] == "factors"}
    assert factored and all(v["rows"] == 4 * 8 for v in factored.values())
    assert_equivalent(RunSpec(**model, strategy="data", devices=4, sfb="all"), STEPS,
                      rtol=RTOL, atol=1e-5, loss_rtol=RTOL, loss_atol=ATOL)  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: the factors travel in fp32
def test_measured_bytes_are_the_priced_ones(tmp_path, precision):
    """mlp 64-256-256-10, batch 64 on 4 devices: 16 rows a device. The hidden layers'
    factors, 12 x 4 x 16 x (m + n), undercut their ring all-reduce, ~2 x 3 x 4 (m n + n);
    ``auto`` factors exactly those, and the compiled step moves the priced bytes."""
    s = fit(RunSpec(strategy="data", devices=4, model="mlp", sfb="auto", allreduce="ring",
                    precision=precision, steps=2, out=str(tmp_path), **QUIET))  # fmt: skip
    layers = s["sfb_layers"]
    for v in layers.values():
        assert v["factor_bytes"] == 4 * 3 * 4 * v["rows"] * (v["in"] + v["out"])
        assert v["gradient_bytes"] == analytic_bytes("ring", 4 * v["params"], 4)
        assert v["mode"] == ("factors" if v["factor_bytes"] < v["gradient_bytes"] else "gradient")
    assert [v["rows"] for v in layers.values()] == [16, 16, 16]
    assert [v["mode"] for v in layers.values()] == ["factors", "factors", "gradient"]
    dense = analytic_bytes("ring", 4 * sum(v["params"] for v in layers.values()), 4)
    factored = sum(v["factor_bytes"] for v in layers.values() if v["mode"] == "factors")
    rest = sum(v["gradient_bytes"] for v in layers.values() if v["mode"] == "gradient")
    assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_analytic"] == factored + rest
    assert s["comm_bytes_per_step"] < 0.4 * dense  # 700,704 against 2,040,096 bytes


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"sfb": "all", "compress": "qsgd:4", "devices": 4}, "use it without --compress"),
        ({"sfb": "maybe", "devices": 4}, "--sfb"),
    ],
)
def test_bad_sfb_is_refused_up_front(kw, message):
    with pytest.raises(UsageError, match=re.escape(message)), command_line():
        build(RunSpec(strategy="data", model="mlp", **kw))


def test_sfb_is_an_option_of_data_alone():
    with pytest.raises(UsageError, match=re.escape("--sfb is an option of")):
        build(RunSpec(strategy="model", model="mlp", devices=2, sfb="all"))
