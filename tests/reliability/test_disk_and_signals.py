"""A full disk while metrics and TensorBoard events are written is one line, exit 1 and a
``summary.json`` that says ``failed`` (the run no longer hangs on tensorboardX's dead
writer thread); a plain ``mpirun`` stopped by SIGTERM leaves one line on its own
stderr naming the checkpoints, and a checkpoint of the step it stopped at."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mpirun_path, run_cli, stderr_lines


def test_a_disk_that_fills_with_metrics_is_one_line_exit_1_and_a_failed_summary(tmpfs):
    out = tmpfs("64k") / "run"  # room for the first records, not for 3,000 metrics rows
    proc = run_cli("--model", "mlp", "--steps", "3000", "--log-every", "1", "--eval-every", "0",
                   "--checkpoint-every", "0", "--out", str(out), "--no-progress",
                   timeout=240)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = stderr_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("refdl.train: error: cannot write ") and "No space left" in lines[0]
    assert "metrics.jsonl" in lines[0] or "events.out.tfevents" in lines[0], lines[0]
    summary = json.loads((out / "summary.json").read_text())  # written in the reserved bytes
    assert summary["status"] == "failed" and "No space left" in summary["reason"]
    assert summary["last_checkpoint"] is None


@pytest.mark.slow
@pytest.mark.mpi
def test_plain_mpirun_sigterm_says_where_the_checkpoints_are(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.pop("XLA_FLAGS", None)
    cmd = [mpirun_path(), "--oversubscribe", "-n", "2", sys.executable, "-m", "refdl.train",
           "--strategy", "data", "--model", "mlp", "--steps", "1000000", "--checkpoint-every",
           "50", "--out", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not list((out / "checkpoints").glob("step_*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert list((out / "checkpoints").glob("step_*")), "no checkpoint within 180 s"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = [ln for ln in err.splitlines() if ln.startswith("refdl (rank 0): ended by")]
    assert len(said) == 1, err[-3000:]
    assert "SIGTERM" in said[0] and f"--resume {out}" in said[0]
    # the stop step's checkpoint usually lands within mpirun's quarter second; whichever
    # is newest verifies and resumes
    from refdl.run import checkpoint

    choice = checkpoint.resolve(out)
    assert choice.meta["step"] >= 50 and choice.meta["spec"]["strategy"] == "data"
