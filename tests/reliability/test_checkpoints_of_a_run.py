"""A resume continues only the run's own configuration, from a manifest that keeps to its
schema: a checkpoint written by other settings is skipped (and named), never resumed;
a manifest damaged in any field is refused or falls back to an older intact one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_cli
from refdl.core.state import TrainState
from refdl.errors import UsageError
from refdl.run import checkpoint
from refdl.run.checkpoint import config_key

BASE = {"model": "mlp", "strategy": "single", "lr": 0.1, "seed": 0, "optimizer": "sgd",
        "model_opts": [["hidden", "32"]], "steps": 100, "out": "runs/a"}  # fmt: skip
# Settings that make another configuration, and those that only say how long or loudly.
OTHER = {"lr": 0.05, "seed": 1, "optimizer": "adam", "model": "lenet5",
         "model_opts": [["hidden", "64"]], "batch_size": 32}  # fmt: skip
CONTROL = {"steps": 400, "out": "elsewhere", "eval_every": 7, "progress": False}


def state(step: int) -> TrainState:
    return TrainState(step=np.asarray(step, np.int32), params={"w": np.full(4, float(step))},
                      model_state={}, opt_state=(), rng=np.zeros(2, np.uint32))  # fmt: skip


def test_the_key_ignores_run_control_and_defaults_but_not_settings():
    key = config_key(BASE)
    assert all(config_key({**BASE, k: v}) == key for k, v in CONTROL.items())
    assert config_key({**BASE, "zero": 3, "momentum": 0.9}) == key  # defaults left out
    assert all(config_key({**BASE, k: v}) != key for k, v in OTHER.items())


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(kinds=st.lists(st.one_of(st.just(None), st.sampled_from(sorted(OTHER)),
                                st.sampled_from(sorted(CONTROL))),
                      min_size=1, max_size=6))  # fmt: skip
def test_a_checkpoint_of_another_configuration_is_never_resumed(tmp_path_factory, kinds):
    """Checkpoints at steps 1..n, each written by the run's settings (None), by settings
    that differ in one key, or by the run's settings with other run controls: resolve
    takes the newest of the run's own, names each newer one it skipped, or refuses."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    own = []
    for step, kind in enumerate(kinds, start=1):
        spec = dict(BASE)
        if kind in OTHER:
            spec[kind] = OTHER[kind]
        elif kind in CONTROL:
            spec[kind] = CONTROL[kind]
        checkpoint.save(ckpt, state(step), {"spec": spec}, keep=100)
        if kind not in OTHER:
            own.append(step)
    if not own:
        with pytest.raises(UsageError, match=r"no intact checkpoint of this run .*another "
                                             r"configuration"):  # fmt: skip
            checkpoint.resolve(ckpt.parent, BASE)
        return
    choice = checkpoint.resolve(ckpt.parent, BASE)
    assert choice.meta["step"] == own[-1]
    assert np.array_equal(choice.leaves[1], np.full(4, float(own[-1])))
    skipped = [name for name, why in choice.skipped]
    assert skipped == [f"step_{s:07d}" for s in range(len(kinds), own[-1], -1)]
    assert all("written by another configuration" in why for _, why in choice.skipped)


FIELDS = ("format", "step", "spec", "tree_paths", "leaves", "config")
ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))  # fmt: skip


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(field=st.sampled_from((*FIELDS, "leaf.shape", "leaf.dtype", "leaf.fingerprint")), value=ODD)
def test_a_manifest_damaged_in_any_field_is_refused_or_falls_back(tmp_path_factory, field,
                                                                   value):  # fmt: skip
    """Any field of the newest manifest replaced by a value of another type or range:
    the older intact checkpoint is chosen (exactly its arrays), or the newer one still
    verifies against its arrays; never an exception other than the one-line refusal."""
    ckpt = tmp_path_factory.mktemp("meta") / "checkpoints"
    checkpoint.save(ckpt, state(1), {"spec": BASE})
    newest = checkpoint.save(ckpt, state(2), {"spec": BASE})
    meta = json.loads((newest / checkpoint.META_FILE).read_text())
    if field.startswith("leaf."):
        meta["leaves"][1][field[5:]] = value
    else:
        meta[field] = value
    (newest / checkpoint.META_FILE).write_text(json.dumps(meta))
    choice = checkpoint.resolve(ckpt.parent, BASE)
    step = choice.meta["step"]
    assert step in (1, 2) and np.array_equal(choice.leaves[1], np.full(4, float(step)))
    if step == 2:  # accepted only when the change left a valid manifest of these arrays
        assert isinstance(step, int) and not isinstance(meta["step"], bool)
        assert choice.meta["tree_paths"] == json.loads(
            (ckpt / "step_0000001" / checkpoint.META_FILE).read_text())["tree_paths"]  # fmt: skip
    else:
        assert choice.skipped and choice.skipped[0][0] == "step_0000002"


def test_a_step_true_manifest_is_damage(tmp_path):
    ckpt = checkpoint.save(tmp_path, state(1), {"spec": BASE})
    meta = json.loads((ckpt / checkpoint.META_FILE).read_text())
    for step in (True, -1, 2, 1.0, "1", 10**13):
        (ckpt / checkpoint.META_FILE).write_text(json.dumps({**meta, "step": step}))
        with pytest.raises(checkpoint.Damaged):
            checkpoint.read_meta(ckpt)


@pytest.mark.slow
def test_resume_skips_a_checkpoint_copied_in_from_another_run(tmp_path):
    """The reported case, through the CLI: the newest checkpoint in a run folder came
    from a run with another learning rate. Resume names it, skips it and continues the
    folder's own run; naming that checkpoint directly is refused unless --out is new."""
    common = ("--model", "mlp", "--checkpoint-every", "10", "--no-progress")
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(*common, "--lr", "0.1", "--steps", "20", "--out", str(a)).returncode == 0
    assert run_cli(*common, "--lr", "0.05", "--steps", "30", "--out", str(b)).returncode == 0
    foreign = a / "checkpoints" / "step_0000030"
    (b / "checkpoints" / "step_0000030").rename(foreign)
    proc = run_cli("--resume", str(a), "--steps", "40", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("resuming from " + str(a / "checkpoints" / "step_0000020") in proc.stderr
            and "skipped step_0000030: written by another configuration (lr 0.05, the "
            "run's 0.1)" in proc.stderr)  # fmt: skip
    summary = json.loads((a / "summary.json").read_text())
    assert summary["lr"] == 0.1 and summary["steps"] == 40 and summary["status"] == "completed"
    # step_30 was rewritten by the run itself (the foreign one replaced, not kept)
    assert json.loads((foreign / checkpoint.META_FILE).read_text())["spec"]["lr"] == 0.1
    c = tmp_path / "c"
    assert run_cli(*common, "--lr", "0.05", "--steps", "50", "--out", str(c)).returncode == 0
    named = a / "checkpoints" / "step_0000050"
    (c / "checkpoints" / "step_0000050").rename(named)
    proc = run_cli("--resume", str(named), "--steps", "52", "--no-progress")
    assert proc.returncode == 2 and "this checkpoint's lr differ from those" in proc.stderr
    proc = run_cli("--resume", str(named), "--steps", "52", "--out", str(tmp_path / "d"),
                   "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["lr"] == 0.05


def test_config_json_that_is_damaged_is_one_line(tmp_path):
    from refdl.run.settings import resumed_settings

    checkpoint.save(tmp_path / "checkpoints", state(1), {"spec": BASE})
    (tmp_path / "config.json").write_text("[" * 1000 + "]" * 1000)
    with pytest.raises(UsageError, match="nested deeper than 64"):
        resumed_settings({"resume": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "lr": 0.5}))
    with pytest.raises(UsageError, match=r"another configuration .*lr 0\.1, the run's 0\.5"):
        resumed_settings({"resume": str(Path(tmp_path))})
