"""The training loop end to end: accuracy, resume, divergence, interruption, checkpoints."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from refdl.config.spec import RunSpec
from refdl.core.state import to_host
from refdl.errors import DivergedError, UsageError
from refdl.run import checkpoint
from refdl.run.build import build
from refdl.run.loop import fit
from refdl.run.report import SUMMARY_KEYS

QUIET = {"progress": False}


@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lenet")
    spec = RunSpec(model="lenet5", dataset="digits", steps=300, out=str(out), **QUIET)
    return out, fit(spec)


def test_lenet5_reaches_95_percent_on_digits(lenet_run):
    out, summary = lenet_run
    assert summary["test_accuracy"] >= 0.95
    assert summary["final_train_loss"] < 0.1
    for key in SUMMARY_KEYS:  # the contract of the foundation issue; keys only grow
        assert summary[key] is not None, key
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["params_l2_norm"] == summary["params_l2_norm"]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10, 301, 10))
    assert "test_accuracy" in rows[9] and "test_accuracy" not in rows[8]  # eval at step 100
    assert [p.name for p in checkpoint.all_checkpoints(out / "checkpoints")] == [
        "step_0000100",
        "step_0000200",
        "step_0000300",
    ]


def test_resume_from_step_100_equals_uninterrupted_300(lenet_run, tmp_path):
    out, full = lenet_run
    spec = RunSpec(
        model="lenet5",
        dataset="digits",
        steps=300,
        out=str(tmp_path),
        resume=str(out / "checkpoints" / "step_0000100"),
        **QUIET,
    )
    resumed = fit(spec)
    assert resumed["resumed_from_step"] == 100
    # Same compiled step, same data order, same state: the trajectory is bit-identical on CPU.
    assert resumed["params_l2_norm"] == full["params_l2_norm"]


def test_mlp_reaches_95_percent_on_digits(tmp_path):
    s = fit(RunSpec(model="mlp", steps=300, out=str(tmp_path), eval_every=0, **QUIET))
    assert s["test_accuracy"] >= 0.95


@pytest.mark.slow  # 9 s; the main job and the equivalence tests train resnet by default
def test_small_resnet_loss_falls(tmp_path):
    s = fit(
        RunSpec(
            model="resnet",
            model_opts=(("depth", "8"), ("width", "8")),
            steps=40,
            log_every=10,
            eval_every=0,
            out=str(tmp_path),
            **QUIET,
        )
    )
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss_avg"] < 0.6 * rows[0]["loss_avg"]
    assert s["test_accuracy"] > 0.5


@pytest.mark.parametrize(
    "model,opts",
    [
        pytest.param("lstm_lm", (("hidden", "64"),), marks=pytest.mark.slow),  # 9 s: suite's time
        pytest.param(
            "transformer", (("d_model", "64"), ("mlp_dim", "128")), marks=pytest.mark.slow
        ),
    ],
)
def test_small_language_models_beat_unigram(tmp_path, model, opts):
    s = fit(
        RunSpec(
            model=model,
            model_opts=opts,
            steps=150,
            lr=0.01,
            eval_every=0,
            out=str(tmp_path),
            **QUIET,
        )
    )
    assert s["dataset"] == "pytext"
    assert s["test_perplexity"] < 0.6 * s["unigram_test_perplexity"]


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    spec = RunSpec(
        model="mlp",
        optimizer="sgd",
        lr=1e6,
        steps=50,
        checkpoint_every=1,
        out=str(tmp_path),
        **QUIET,
    )
    with pytest.raises(DivergedError, match=r"loss is (nan|inf) at step (\d+)") as err:
        fit(spec)
    bad_step = int(str(err.value).split("at step ")[1].split(":")[0])
    kept = checkpoint.all_checkpoints(tmp_path / "checkpoints")
    assert kept and kept[-1].name == f"step_{bad_step - 1:07d}"
    like = to_host(build(spec).task.init_state(0))
    good = checkpoint.restore(kept[-1], like)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(good.params))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "diverged"


def test_checkpoint_round_trip_and_mismatch(tmp_path):
    run = build(RunSpec(model="mlp", optimizer="adam"))
    state = to_host(run.task.init_state(3))
    path = checkpoint.save(tmp_path, state, {"spec": {}})
    back = checkpoint.restore(path, state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.asarray(a).dtype == np.asarray(b).dtype
    # an empty (half-made) checkpoint folder is skipped, and the report says why
    (tmp_path / "step_0000009").mkdir()
    choice = checkpoint.resolve(tmp_path)
    assert choice.path == path and choice.skipped == (("step_0000009", "meta/metadata is missing"),)
    other = to_host(build(RunSpec(model="mlp", optimizer="sgd")).task.init_state(0))
    with pytest.raises(UsageError, match="does not match"):
        checkpoint.restore(path, other)
