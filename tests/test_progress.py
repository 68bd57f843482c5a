"""Long commands show progress where their output goes: a bar on a terminal, plain lines
in a file or a pipe (a log, CI, ``| tee``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli
from refdl.progress import Progress


def test_off_a_terminal_progress_is_plain_lines_with_count_share_and_time_left(capsys):
    bar = Progress(40, "job", unit="step", every_s=0.02)
    for i in range(40):
        time.sleep(0.002)
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
    bar.write("an evaluation line")
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    counted = [ln for ln in lines if re.match(r"job: \d+/40 steps \(\d+ %\)", ln)]
    assert len(counted) >= 2, lines
    assert all("s left" in ln for ln in counted[:-1]) and "loss" in counted[-1]
    assert "an evaluation line" in lines
    assert counted[-1].startswith("job: 40/40 steps (100 %)")  # the last word: where it got


def test_the_time_left_leaves_out_the_first_steps_compilation(capsys):
    """Issue 54: "282 s left" on a 45 s run - the first step (its compilation) was counted
    as a typical one. A 0.5 s first unit, then 0.01 s units: about 0.1 s left of 10."""
    bar = Progress(20, "job", unit="step", every_s=1e9)  # lines only when asked
    time.sleep(0.5)
    bar.update(1)
    for _ in range(9):
        time.sleep(0.01)
        bar.update(1)
    bar._line(time.monotonic())
    left = float(re.search(r", ([\d.]+) s left", capsys.readouterr().err).group(1))
    assert left < 0.5  # counting the first unit would say ~ (10 x 0.59 / 10) = 0.6 s


@pytest.mark.slow
def test_a_long_train_writes_progress_lines_to_a_file(tmp_path):
    proc = run_cli("--model", "resnet", "--steps", "400", "--eval-every", "0", "--out",
                   str(tmp_path / "run"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("refdl.train: ")]
    assert lines and all(re.match(r"refdl.train: \d+/400 steps", ln) for ln in lines), lines


@pytest.mark.slow
def test_bench_published_says_how_far_it_is():
    proc = subprocess.run([sys.executable, "-m", "refdl.bench", "published"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("refdl.bench published: ")]
    assert lines and all(re.search(r"\d+/\d+ points", ln) for ln in lines), proc.stderr[-2000:]
