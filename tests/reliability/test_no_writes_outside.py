"""Nothing refdl writes follows a link it did not make: links planted at every lock and
temporary name of a run folder (to files, folders, or nowhere) leave their targets'
bytes and modification times as they were - after a real run, and after its resume."""

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
from refdl.run.folder import RunFolder
from refdl.run.report import Writer, write_json

# Every name refdl has used for a lock or temporary in a run folder (and the new ones'
# prefixes: mkstemp/mkdtemp add a random tail no one can plant in advance).
PLANTED = (".lock", ".metrics.jsonl.tmp", ".summary.json.tmp", ".config.json.tmp",
           ".timeline.json.tmp", ".write-test", ".metrics.jsonl.", ".summary.json.")  # fmt: skip
PLANTED_IN_CHECKPOINTS = (".step_0000005.tmp-1", ".step_0000010.tmp-1", ".step_0000015.tmp-1")


def targets(root: Path) -> dict[str, Path]:
    """Files and a folder outside the run folder, with known contents."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for i in range(4):
        out[f"file{i}"] = root / f"precious-{i}.txt"
        out[f"file{i}"].write_bytes(f"precious {i}\n".encode() * 10)
    out["folder"] = root / "precious-folder"
    out["folder"].mkdir(exist_ok=True)
    (out["folder"] / "inside.txt").write_text("inside\n")
    return out


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time (ns)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def plant(folder: Path, names: tuple[str, ...], aims: list[Path]) -> None:
    if names:
        folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        link = folder / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(aims[i % len(aims)])


MLP = ("--model", "mlp", "--checkpoint-every", "5", "--log-every", "1", "--eval-every", "5",
       "--no-progress")  # fmt: skip


@pytest.mark.slow  # slow since 2026-11-26: the default suite took 15 min 33 s
def test_links_at_every_lock_and_temporary_are_never_written_through(tmp_path):
    """The acceptance of issue 32: a run, then its resume, with links planted at every
    lock and temporary name (a fresh run first, then the resumed one with links also in
    ``checkpoints/`` and at ``summary.json``): the targets are untouched."""
    outside = tmp_path / "outside"
    aims = [*list(targets(outside).values()), outside / "dangling"]
    before = snapshot(outside)
    out = tmp_path / "run"
    plant(out, PLANTED, aims)
    first = run_cli(*MLP, "--steps", "10", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    assert snapshot(outside) == before
    plant(out, PLANTED, aims)
    plant(out / "checkpoints", PLANTED_IN_CHECKPOINTS, aims)
    (out / "summary.json").unlink()
    (out / "summary.json").symlink_to(aims[0])
    again = run_cli("--resume", str(out), "--steps", "15", "--no-progress")
    assert again.returncode == 0, again.stderr[-2000:]
    assert snapshot(outside) == before, "a file outside --out changed"
    assert not (outside / "dangling").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 15
    assert not (out / "summary.json").is_symlink() and not (out / ".lock").is_symlink()


def tiny_state(step: int) -> TrainState:
    return TrainState(step=np.asarray(step, np.int32), params={"w": np.arange(6.0)},
                      model_state={}, opt_state=(), rng=np.zeros(2, np.uint32))  # fmt: skip


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    names=st.sets(st.sampled_from(PLANTED), min_size=1),
    in_checkpoints=st.sets(st.sampled_from(PLANTED_IN_CHECKPOINTS)),
    aim=st.sampled_from(["file", "folder", "dangling"]),
    resume=st.booleans(),
)
def test_planted_links_never_touch_their_targets(tmp_path_factory, names, in_checkpoints, aim,
                                                 resume):  # fmt: skip
    """The run folder's own writers - its lock, metrics, events, JSON records and
    checkpoints - with links planted at any of their names."""
    tmp = tmp_path_factory.mktemp("links")
    outside = targets(tmp / "outside")
    aims = {"file": [outside["file0"], outside["file1"]], "folder": [outside["folder"]],
            "dangling": [tmp / "outside" / "nowhere"]}[aim]  # fmt: skip
    before = snapshot(tmp / "outside")
    out = tmp / "run"
    plant(out, tuple(sorted(names)), aims)
    plant(out / "checkpoints", tuple(sorted(in_checkpoints)), aims)
    folder = RunFolder(out, resume=resume, overwrite=False)
    try:
        folder.open()
    except UsageError as e:  # only a fresh run into a folder with checkpoints is refused
        assert "holds another run" in str(e) and in_checkpoints and not resume
        assert snapshot(tmp / "outside") == before
        return
    writer = Writer(out, True, None)
    writer.json("config.json", {"model": "mlp"})
    for step in range(1, 4):
        writer.metric({"step": step, "loss": 1.0 / step})
    for step in (5, 10, 15):
        checkpoint.save(out / "checkpoints", tiny_state(step), {"spec": {"model": "mlp"}}, keep=2)
    write_json(out / "summary.json", {"status": "completed"})
    writer.close()
    folder.close()
    assert snapshot(tmp / "outside") == before
    assert not (tmp / "outside" / "nowhere").exists()
    assert [p.name for p in checkpoint.all_checkpoints(out / "checkpoints")] == [
        "step_0000010", "step_0000015"]  # fmt: skip


def test_a_checkpoints_folder_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match=r"checkpoints is a link to .*elsewhere"):
        RunFolder(tmp_path / "run", resume=True, overwrite=False).open()
    RunFolder(tmp_path / "run", resume=False, overwrite=True).open()  # --overwrite: link gone
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert (tmp_path / "elsewhere").is_dir()


def test_paths_from_files_never_decide_where_refdl_writes(tmp_path):
    """A checkpoint's stored plot path is not replayed on --resume; a recipe may not name
    where its run writes (nor overwrite another run)."""
    from refdl.bench import recipes
    from refdl.run.settings import resumed_settings

    ckpt = tmp_path / "run" / "checkpoints"
    spec = {"model": "mlp", "strategy": "pipeline", "devices": 2,
            "plot_schedule": str(tmp_path / "outside.png"), "overwrite": True}  # fmt: skip
    checkpoint.save(ckpt, tiny_state(5), {"spec": spec})
    settings_ = resumed_settings({"resume": str(tmp_path / "run")})
    assert "plot_schedule" not in settings_ and "overwrite" not in settings_
    assert settings_["out"] == str(tmp_path / "run")
    head = '[recipe]\nname = "../../x"\n[acceptable]\nTestAccuracy = { min = 0.5 }\n[fixed]\n'
    for key, value in (("out", '"/tmp/x"'), ("overwrite", "true"),
                       ("plot_schedule", '"/tmp/g.png"'), ("resume", '"/tmp/r"')):  # fmt: skip
        (tmp_path / "r.toml").write_text(f'{head}model = "mlp"\n{key} = {value}\n')
        with pytest.raises(UsageError, match=f"{key}: where a run writes is given on the command"):
            recipes.load(tmp_path / "r.toml")
