"""Strategy-specific contracts: communication bytes, compression, bad input."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from conftest import run_cli, stderr_lines
from refdl.config.spec import RunSpec, command_line
from refdl.errors import UsageError
from refdl.run.build import build
from refdl.run.loop import fit


def model_shape(run):
    from refdl.assemble import model_shape as shape

    return shape(run.task, run.dataset, run.spec.model)


def assert_usage_error(kw: dict, message: str) -> None:
    """Building a run from ``kw`` fails up front with ``message`` in its one line (the
    flags' words: the spec made as a command line makes it)."""
    with pytest.raises(UsageError, match=re.escape(message)), command_line():
        build(RunSpec(**kw))


QUIET = {"progress": False, "eval_every": 0, "checkpoint_every": 0}


@pytest.mark.parametrize("algo", ["ring", "tree", "halving-doubling", "xla"])
def test_data_measured_bytes_equal_analytic(tmp_path, algo):
    s = fit(
        RunSpec(
            strategy="data",
            devices=8,
            allreduce=algo,
            model="mlp",
            steps=2,
            out=str(tmp_path),
            **QUIET,
        )
    )
    assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_analytic"] > 0
    assert s["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "model": 1, "pipe": 1}


@pytest.mark.slow  # slow since 2026-11-26 (the default suite's 15 min)
def test_model_and_hybrid_report_measured_bytes(tmp_path):
    m = fit(
        RunSpec(strategy="model", devices=4, model="mlp", steps=2, out=str(tmp_path / "m"), **QUIET)
    )
    assert m["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "model": 4, "pipe": 1}
    # The mlp's one all-reduce (the row layer's output, 64 x 256 fp32) over 4 devices, ring
    # bytes summed over the devices: 4 x 2 (4 - 1) / 4 x 65536.
    assert m["comm_bytes_by_collective"] == {"all-reduce": 4 * 2 * 3 * 65536 // 4}
    assert m["comm_bytes_per_step"] == 393216
    h = fit(
        RunSpec(
            strategy="hybrid",
            devices=8,
            mesh="data=2,model=4",
            steps=2,
            out=str(tmp_path / "h"),
            **QUIET,
        )
    )
    assert h["mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "model": 4, "pipe": 1}
    assert h["comm_bytes_per_step"] == sum(h["comm_bytes_by_collective"].values())
    # At least the gradient all-reduce over data=2: every device sends its local share of
    # the fp32 gradients once (2 (2 - 1) / 2), split layers 1/4 per device.
    run = build(RunSpec(strategy="hybrid", devices=8, mesh="data=2,model=4", progress=False))
    split = sum(
        int(np.prod(shape))
        for layer in model_shape(run).layers
        for shape, axes in layer.params.values()
        if "conv_out" in axes or "mlp" in axes
    )
    whole = run.task.model.abstract_params(run.task.sample_x)
    total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(whole))
    assert h["comm_bytes_by_collective"]["all-reduce"] >= 8 * 4 * (split / 4 + total - split)


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense")
    return fit(RunSpec(strategy="data", devices=4, steps=300, out=str(out), **QUIET))


@pytest.mark.parametrize(
    "codec",
    [
        pytest.param("topk:0.1", marks=pytest.mark.slow),  # the default suite's time (15 min)
        pytest.param("sign", marks=pytest.mark.slow),
        pytest.param("qsgd:16", marks=pytest.mark.slow),
        pytest.param("terngrad", marks=pytest.mark.slow),
    ],
)
def test_compressed_runs_reach_the_accuracy_band(tmp_path, uncompressed, codec):
    s = fit(
        RunSpec(strategy="data", devices=4, steps=300, compress=codec, out=str(tmp_path), **QUIET)
    )
    # the band: within 3 points of the uncompressed run's test accuracy (measured: all four
    # land within 1.1 points of it, 0.972)
    assert s["test_accuracy"] >= uncompressed["test_accuracy"] - 0.03
    assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_analytic"]
    assert s["comm_bytes_saved_per_step"] > 0.45 * s["comm_bytes_per_step_uncompressed"]
    assert 0 < s["compression_error"] < float("inf")  # ||v - decode(encode(v))|| / ||v||


@pytest.mark.parametrize("codec", ["topk:0.01", "qsgd:4", "terngrad", "sign"])
def test_compressed_bytes_equal_analytic(tmp_path, codec):
    s = fit(
        RunSpec(
            strategy="data",
            devices=4,
            model="mlp",
            steps=2,
            compress=codec,
            out=str(tmp_path),
            **QUIET,
        )
    )
    assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_analytic"]
    assert s["comm_bytes_saved_per_step"] > 0


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            {"strategy": "data", "devices": 8, "batch_size": 60},
            "does not split into 8 shards x 1 microbatches; use a multiple of 8",
        ),
        (
            {"strategy": "data", "devices": 4, "microbatches": 3},
            "does not split into 4 shards x 3 microbatches; use a multiple of 12",
        ),
        (
            {"strategy": "data", "devices": 6, "batch_size": 48, "allreduce": "halving-doubling"},
            "needs a power-of-two data degree, not 6",
        ),
        ({"strategy": "data", "devices": 8, "mesh": "data=2,model=4"}, "use --strategy hybrid"),
        ({"strategy": "model", "devices": 3}, "3-way split of layer 00_conv's conv_out width 8"),
        (
            {
                "strategy": "model",
                "devices": 4,
                "model": "mlp",
                "model_opts": (("hidden", "30,30"),),
            },
            "4-way split of layer 01_dense's mlp width 30",
        ),
        (
            {"strategy": "hybrid", "devices": 8, "mesh": "data=2,model=2"},
            "multiplies to 4 devices but --devices is 8",
        ),
        (
            {"strategy": "hybrid", "devices": 8, "preset": "zero"},
            "--preset must be one of tensor, owt (got 'zero')",
        ),
        ({"strategy": "data", "devices": 2, "compress": "topk:2"}, "--compress 'topk:2'"),
        (
            {"strategy": "hybrid", "devices": 2, "allreduce": "ring"},
            "--allreduce is an option of --strategy data, decentralized, not of --strategy hybrid",
        ),
        ({"strategy": "fsdp", "devices": 2, "zero": 0}, "--zero must be an integer in [1, 3]"),
        (
            {"strategy": "fsdp", "devices": 4, "mesh": "data=2,model=2"},
            "--strategy fsdp splits over data, not model; use --strategy hybrid or model",
        ),
        (
            {"strategy": "hybrid", "devices": 4, "mesh": "fsdp=4", "preset": "owt"},
            "--preset owt does not combine with an fsdp axis",
        ),
        (
            {"strategy": "hybrid", "devices": 4, "mesh": "fsdp=4", "batch_size": 30},
            "--batch-size 30 does not split into 4 shards",
        ),
    ],
)
def test_bad_parallel_settings(kw, message):
    assert_usage_error(kw, message)


def test_cli_mesh_errors_are_one_line(tmp_path):
    proc = run_cli(
        "--strategy",
        "hybrid",
        "--devices",
        "8",
        "--mesh",
        "data=3,model=4",
        "--out",
        str(tmp_path),
        timeout=120,
    )
    lines = stderr_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1
    assert "multiplies to 12 devices but --devices is 8" in lines[0]


@pytest.mark.slow
def test_300_steps_on_digits_data_and_hybrid_match_single(tmp_path):
    """The acceptance run: same test accuracy, params_l2_norm within 1e-5 relative."""
    base = {"steps": 300, "progress": False, "eval_every": 0, "checkpoint_every": 0}
    single = fit(RunSpec(out=str(tmp_path / "s"), **base))
    data = fit(RunSpec(strategy="data", devices=8, out=str(tmp_path / "d"), **base))
    hybrid = fit(
        RunSpec(
            strategy="hybrid", devices=8, mesh="data=2,model=4", out=str(tmp_path / "h"), **base
        )
    )
    for other in (data, hybrid):
        assert other["test_accuracy"] == single["test_accuracy"] >= 0.95
        rel = abs(other["params_l2_norm"] - single["params_l2_norm"]) / single["params_l2_norm"]
        assert rel < 1e-5, (other["strategy"], rel)


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            {"strategy": "pipeline", "devices": 8, "model": "mlp"},
            "8 stages x 1 chunks = 8 need at least as many layers; mlp has 4",
        ),
        (
            {"strategy": "pipeline", "devices": 2, "microbatches": 3},
            "does not split into 1 shards x 3 microbatches",
        ),
        (
            {"strategy": "pipeline", "devices": 2, "schedule": "zigzag"},
            "--schedule must be one of gpipe",
        ),
        (
            {
                "strategy": "pipeline",
                "devices": 2,
                "schedule": "interleaved",
                "chunks": 3,
                "microbatches": 2,
            },
            "needs the 8 layers of lenet5 to divide into 2 x 3 = 6 equal chunks",
        ),
        ({"strategy": "pipeline", "devices": 2, "stages": 4}, "--stages 4 needs --devices 4"),
        (
            {"strategy": "pipeline", "devices": 2, "schedule": "zbv", "chunks": 2},
            "--chunks 2 needs --schedule interleaved or looped-bfs",
        ),
        (
            {"strategy": "pipeline", "devices": 8, "schedule": "zbv", "model": "mlp"},
            "8 stages x 2 chunks = 16 need at least as many layers; mlp has 4",
        ),
        (
            {"strategy": "data", "devices": 2, "plot_schedule": "x.png"},
            "--plot-schedule is an option of --strategy hybrid, pipeline, not of --strategy data",
        ),
    ],
)
def test_bad_pipeline_settings(kw, message):
    assert_usage_error(kw, message)


@pytest.mark.slow  # slow since 2026-11-26: the default suite took 15 min 33 s
def test_pipeline_cli_reports_bubbles_and_draws_the_schedule(tmp_path):
    proc = run_cli(
        "--strategy",
        "pipeline",
        "--devices",
        "4",
        "--microbatches",
        "8",
        "--schedule",
        "gpipe",
        "--steps",
        "3",
        "--out",
        str(tmp_path),
        "--plot-schedule",
        str(tmp_path / "gantt.png"),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    import json

    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["bubble_fraction_analytic"] == pytest.approx(3 / 11)
    assert 0 < s["bubble_fraction_measured"] < 1
    assert s["peak_stash_per_stage"] == [8, 8, 8, 8]
    assert (tmp_path / "gantt.png").stat().st_size > 10_000


def test_pipeline_times_the_first_two_and_the_logged_steps_only():
    """StepClock: steps 1, 2 and every log_every-th are walked slot by slot and carry the
    timeline; the others are dispatched ahead and carry none; a resumed run counts from
    its state's step."""
    from types import SimpleNamespace

    from refdl.strategies.pipeline import StepClock

    def steps(start, n, every=5):
        clock = StepClock(every)
        state = [SimpleNamespace(step=np.asarray(start, np.int32))]
        return [start + i + 1 for i in range(n) if clock.timed(state)]

    assert steps(0, 12) == [1, 2, 5, 10]
    assert steps(7, 9) == [8, 9, 10, 15]
    run = build(RunSpec(strategy="pipeline", devices=2, microbatches=2, log_every=3))
    state = run.strategy.init_state(0)
    got = []
    for t in range(4):
        state, m = run.strategy.train_step(state, run.batch(t))
        got.append("timeline" in m and 0 <= m["bubble_fraction_measured"] < 1)
    assert got == [True, True, True, False]


def test_explicit_stage_boundaries(tmp_path):
    run = build(RunSpec(strategy="pipeline", devices=2, microbatches=2, stage_boundaries=(5,)))
    assert [len(c) for c in run.strategy.chunks] == [5, 3]
    with pytest.raises(UsageError, match="need 1 increasing layer indices between 1 and 7"):
        build(RunSpec(strategy="pipeline", devices=2, microbatches=2, stage_boundaries=(9,)))
    proc = run_cli(
        "--strategy",
        "pipeline",
        "--devices",
        "2",
        "--stage-boundaries",
        "a,b",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 2 and "like 2,5" in stderr_lines(proc)[0]
