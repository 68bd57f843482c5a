"""``say_once``: ranks that fail alike under mpirun print their error line once (rank 0),
ranks whose lines differ are each named, and a rank that fails alone still speaks. Real
``mpirun`` jobs of three ranks, each a small Python program: a rank failing alone ends
the job at once, not after the others' 30 s of work (it would wait in MPI's finalize)."""

from __future__ import annotations

import subprocess
import time

import pytest

from refdl.parallel import processes

SAY = """
import sys
import time
from refdl.parallel.processes import comm, launched_rank, say_once
rank, kind = launched_rank(), sys.argv[1]
comm()  # MPI started on every rank (its start waits for all), as a run's ranks have it
if (kind == "alone" and rank != 2) or (kind == "zero" and rank != 0):
    import time; time.sleep(30)  # never meets: the others are still at work
line = {"same": "x: error: bad", "differ": f"x: error: bad {rank % 2}"}.get(kind, "x: error: 2")
say_once(line, 2, timeout_s=2.0)
"""


def _run(kind: str) -> list[str]:
    start = time.monotonic()
    cmd = processes.mpirun_command(3, ["-c", SAY, kind])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=processes.mpirun_env())  # fmt: skip
    assert proc.returncode == 2 and time.monotonic() - start < 25, proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("x: error")]


@pytest.mark.mpi
def test_the_same_line_on_every_rank_is_said_once():
    assert _run("same") == ["x: error: bad"]


@pytest.mark.mpi
def test_differing_lines_are_each_said_once_naming_their_ranks():
    assert sorted(_run("differ")) == ["x: error: bad 0 (ranks 0,2)", "x: error: bad 1 (rank 1)"]


@pytest.mark.mpi
def test_a_rank_failing_alone_still_says_its_line():
    assert _run("alone") == ["x: error: 2"]


def test_without_mpirun_the_line_is_printed(capsys):
    processes.say_once("x: error: once")
    assert capsys.readouterr().err == "x: error: once\n"


@pytest.mark.mpi
def test_rank_0_failing_alone_says_its_line_naming_itself():
    assert _run("zero") == ["x: error: 2 (rank 0)"]
