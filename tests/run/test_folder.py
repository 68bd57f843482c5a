"""The run folder: never two runs mixed, one run at a time, a full disk is one line, and
``summary.json`` never claims more than happened."""

from __future__ import annotations

import fcntl
import json

import pytest

from conftest import run_cli, stderr_lines
from refdl.errors import UsageError
from refdl.run.folder import RunFolder

MLP = ("--model", "mlp", "--eval-every", "0", "--no-progress")


def one_line(proc) -> str:
    lines = stderr_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_a_folder_holding_another_run_is_refused_unless_overwrite(tmp_path):
    from refdl.config.spec import RunSpec
    from refdl.run.checkpoint import resolve
    from refdl.run.loop import fit

    def spec(seed: int, **kw) -> RunSpec:
        return RunSpec(model="mlp", steps=5, seed=seed, eval_every=0, progress=False,
                       out=str(tmp_path), **kw)  # fmt: skip

    assert fit(spec(0))["status"] == "completed"
    with pytest.raises(UsageError, match=f"--out {tmp_path} holds another run \\(config.json\\)"):
        fit(spec(7))
    assert json.loads((tmp_path / "summary.json").read_text())["seed"] == 0  # untouched
    assert fit(spec(7, overwrite=True))["seed"] == 7
    assert json.loads((tmp_path / "summary.json").read_text())["seed"] == 7
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_0000005"]
    assert resolve(tmp_path).meta["spec"]["seed"] == 7  # the old run's checkpoints are gone


def test_one_run_per_folder_at_a_time(tmp_path):
    folder = RunFolder(tmp_path, resume=False, overwrite=False)
    folder.open()
    try:
        proc = run_cli(*MLP, "--steps", "5", "--out", str(tmp_path))
        assert proc.returncode == 2
        assert f"--out {tmp_path} is in use by another run (pid " in one_line(proc)
        with pytest.raises(UsageError, match="is in use by another run"):
            RunFolder(tmp_path, resume=False, overwrite=False).open()
    finally:
        folder.close()
    with open(tmp_path / ".lock") as f:  # released
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_file_is_no_folder_and_a_new_folder_is_made(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        RunFolder(tmp_path / "f", False, False).open()
    new = tmp_path / "made" / "here"
    RunFolder(new, False, False).open()  # made, then usable
    assert new.is_dir() and (new / ".lock").exists()


@pytest.fixture
def small_disk(tmpfs):
    """A 2 MiB tmpfs: room for two of the mlp's checkpoints and not a third."""
    return tmpfs("2m")


@pytest.mark.slow  # 11 s; tests/reliability's full-disk test runs by default
def test_a_full_disk_is_one_line_exit_1_naming_the_last_good_checkpoint(small_disk):
    out = small_disk / "run"
    proc = run_cli(*MLP, "--steps", "400", "--checkpoint-every", "50", "--keep-checkpoints",
                   "10", "--out", str(out))  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = one_line(proc)
    good = sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("."))
    assert line.startswith("refdl.train: error: cannot write ") and "No space left" in line
    assert f"the last good checkpoint is {out / 'checkpoints' / good[-1]}" in line
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "failed" and "No space left" in s["reason"]
    assert s["last_checkpoint"] == str(out / "checkpoints" / good[-1])
    # the last good checkpoint resumes (elsewhere, with room)
    res = run_cli("--resume", str(out), "--out", str(small_disk.parent / "more"), "--steps",
                  str(int(good[-1][5:]) + 5), "--no-progress")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_diverged_run_says_so(tmp_path):
    proc = run_cli("--model", "mlp", "--lr", "1e6", "--steps", "50", "--out", str(tmp_path),
                   "--no-progress")  # fmt: skip
    assert proc.returncode == 1
    assert "training diverged" in one_line(proc)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "diverged" and "training diverged" in s["reason"]
