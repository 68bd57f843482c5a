"""``fsdp`` (ZeRO 1-3): bytes counted from the compiled program against the stage's formula,
memory per device against the paper's split, the acceptance runs, resume, bad input.
(Equality with ``single`` for every model is in ``test_equivalence.py``.)"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, stderr_lines
from refdl.config.spec import RunSpec
from refdl.run import checkpoint
from refdl.run.build import build
from refdl.run.loop import fit

QUIET = {"progress": False, "eval_every": 0, "checkpoint_every": 0}
MLP_LEAVES = (64 * 256, 256, 256 * 256, 256, 256 * 10, 10)  # mlp: 64-256-256-10, kernels, biases


def _fit(tmp_path, name: str, **kw) -> dict:
    return fit(RunSpec(model="mlp", steps=2, out=str(tmp_path / name), **QUIET, **kw))


@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_measured_bytes_equal_each_stage_formula(tmp_path, microbatches):
    """Reduce-scatters and all-gathers in the compiled step send exactly 2, m + 1 and 3m
    times (P - 1) Psi; the rest is the loss's mean (one fp32 all-reduce)."""
    p, m = 4, microbatches
    got = {z: _fit(tmp_path, f"z{z}", strategy="fsdp", zero=z, devices=p, microbatches=m)
           for z in (1, 2, 3)}  # fmt: skip
    psi = got[1]["padded_param_bytes"]
    assert psi == 4 * sum(-(-n // p) * p for n in MLP_LEAVES)  # each leaf padded to 4k
    for z, rounds in ((1, 2), (2, m + 1), (3, 3 * m)):
        s = got[z]
        by = s["comm_bytes_by_collective"]
        assert s["comm_bytes_per_step_analytic"] == rounds * (p - 1) * psi
        assert by["reduce-scatter"] + by["all-gather"] == s["comm_bytes_per_step_analytic"]
        assert by["reduce-scatter"] == (1 if z == 1 else m) * (p - 1) * psi
        assert by.get("all-reduce", 0) == 2 * (p - 1) * 4  # the loss: one fp32 scalar
        assert s["comm_bytes_per_step"] == sum(by.values())
    assert got[3]["comm_bytes_per_step"] > got[2]["comm_bytes_per_step"]


@pytest.mark.parametrize(
    "model,zero,microbatches",
    [
        pytest.param("transformer", 3, 2, marks=pytest.mark.slow),  # 9 s (the suite's 15 min)
        ("lstm_lm", 3, 1),
        pytest.param("resnet", 3, 1, marks=pytest.mark.slow),
        pytest.param("lenet5", 2, 2, marks=pytest.mark.slow),
        pytest.param("transformer", 2, 2, marks=pytest.mark.slow),
    ],
)
def test_every_models_gathers_and_scatters_equal_the_formula(model, zero, microbatches):
    """The compiled step's reduce-scatters and all-gathers, byte for byte; stage 3 less
    the embedding tables' second gather (an embedding's backward does not read its
    table: XLA drops that gather)."""
    strategy = build(RunSpec(strategy="fsdp", model=model, zero=zero, devices=4,
                             microbatches=microbatches, progress=False)).strategy  # fmt: skip
    by = strategy.comm
    assert by["reduce-scatter"] + by["all-gather"] == strategy.analytic_comm_bytes()
    lookups = strategy.lookup_param_bytes()
    assert (lookups > 0) == (model in ("transformer", "lstm_lm"))
    if zero == 3:
        psi, m = strategy.padded_param_bytes(), microbatches
        p = 4  # forward gathers every layer, the backward all but the tables
        assert by["all-gather"] == (p - 1) * m * (2 * psi - lookups)


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_memory_per_device_follows_the_stages(tmp_path):
    """Live parameters and Adam moments on one device equal the paper's split: stage 3
    holds Psi / P of the parameters, every stage 2 Psi / P of Adam's moments."""
    p = 4
    got = {z: _fit(tmp_path, f"z{z}", strategy="fsdp", zero=z, devices=p, optimizer="adam")
           for z in (1, 2, 3)}  # fmt: skip
    psi = got[1]["padded_param_bytes"]
    params = 4 * sum(MLP_LEAVES)
    for z, s in got.items():
        measured, analytic = s["memory_per_device"], s["memory_per_device_analytic"]
        assert measured["params"] == analytic["params"] == (psi // p if z == 3 else params)
        assert analytic["gradients"] == (psi if z == 1 else psi // p)
        # Adam: two moments per parameter, sharded; its and the schedule's step counts
        # (int32) replicated.
        assert measured["optimizer_state"] == analytic["optimizer_state"] == 2 * psi // p + 8
        assert measured["step_temp"] is None or measured["step_temp"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_acceptance_fsdp_adam_40_steps_equals_single(tmp_path, zero):
    """The issue's acceptance, through the CLI."""
    common = ["--model", "mlp", "--optimizer", "adam", "--steps", "40"]
    single = run_cli("--strategy", "single", *common, "--out", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr
    fsdp = ["--strategy", "fsdp", "--zero", str(zero), "--devices", "4"]
    r = run_cli(*fsdp, *common, "--out", str(tmp_path / "fsdp"))
    assert r.returncode == 0, r.stderr
    ref = json.loads((tmp_path / "single" / "summary.json").read_text())
    got = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert got["params_l2_norm"] == pytest.approx(ref["params_l2_norm"], rel=1e-5)
    assert got["comm_bytes_per_step"] > 0 and got["zero"] == zero


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_stage_3_resumes_bit_identically(tmp_path):
    """A checkpoint holds the logical state (the padding dropped, each leaf still sharded);
    resuming places it back in flat shards and continues the same trajectory."""
    kw = {**QUIET, "strategy": "fsdp", "zero": 3, "devices": 4, "optimizer": "adam", "steps": 6}
    full = fit(RunSpec(model="mlp", out=str(tmp_path / "full"), **{**kw, "checkpoint_every": 3}))
    ckpt = tmp_path / "full" / "checkpoints" / "step_0000003"
    resumed = fit(RunSpec(model="mlp", out=str(tmp_path / "resumed"), resume=str(ckpt), **kw))
    assert resumed["resumed_from_step"] == 3
    assert resumed["params_l2_norm"] == full["params_l2_norm"]
    shapes = {tuple(e["shape"]) for e in checkpoint.read_meta(ckpt)["leaves"]}
    assert (64, 256) in shapes  # the whole kernel, not its padded shard


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_bad_zero_is_one_line(tmp_path):
    r = run_cli("--strategy", "fsdp", "--zero", "4", "--devices", "2", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert stderr_lines(r) == ["refdl.train: error: --zero must be an integer in [1, 3] (got 4)"]
    assert not (tmp_path / "x").exists()
    r = run_cli("--strategy", "data", "--zero", "2", "--devices", "2")
    assert r.returncode == 2
    assert "--zero is an option of --strategy fsdp" in r.stderr
