"""``--batch-schedule``: a global batch that grows at given steps (Smith et al. 2017), for
every strategy that steps in lockstep; the data order stays one stream, each batch size
compiles once, and a synchronous strategy still equals ``single`` on the same schedule.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli, stderr_lines
from refdl.config.batches import BatchSchedule
from refdl.data.order import stream_indices
from refdl.errors import UsageError
from refdl.run.checkpoint import load_leaves

SCHEDULE = "0:64,100:128,200:256"


def test_the_schedule_reads_and_counts_the_stream():
    s = BatchSchedule.parse(SCHEDULE)
    assert s.sizes == (64, 128, 256)
    assert [s.size_at(t) for t in (0, 99, 100, 199, 200, 10**6)] == [64, 64, 128, 128, 256, 256]
    assert [s.start_at(t) for t in (0, 100, 150, 200, 300)] == [0, 6400, 12800, 19200, 44800]
    bad_ones = (("64,128", "STEP:BATCH"), ("10:64", "start at step 0"),
                ("0:64,50:32,40:16", "must increase"), ("0:0", "batches must be"),
                ("0:64,50:32", "larger than the one before"),
                ("0:64,50:64", "larger than the one before"))  # fmt: skip
    for bad, says in bad_ones:
        with pytest.raises(UsageError, match=says):
            BatchSchedule.parse(bad)


def test_the_batches_of_a_schedule_tile_the_stream():
    """Every example of the stream exactly once, in order, whatever the sizes."""
    from refdl.config.spec import RunSpec
    from refdl.data import load_dataset
    from refdl.run.build import global_batch

    ds = load_dataset("digits")
    spec = RunSpec(batch_schedule="0:16,3:48,5:56", batch_size=16)
    got = [global_batch(ds, spec, t)["y"] for t in range(8)]
    assert [len(g) for g in got] == [16, 16, 16, 48, 48, 56, 56, 56]
    want = ds.train_batch(stream_indices(spec.seed, 0, 312, ds.info.train_size))["y"]
    np.testing.assert_array_equal(np.concatenate(got), want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("schedule")
    common = ("--model", "mlp", "--eval-every", "0", "--no-progress")
    for name, args in (("single", ("--strategy", "single", "--batch-schedule", "0:64,10:128")),
                       ("data", ("--strategy", "data", "--devices", "4",
                                 "--batch-schedule", "0:64,10:128")),
                       ("fixed", ("--strategy", "data", "--devices", "4"))):  # fmt: skip
        proc = run_cli(*args, *common, "--steps", "20", "--out", str(d / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return d


@pytest.mark.slow  # the default suite's time (15 min on 2 cores; 15 min 25 s, 2026-11-26)
def test_a_synchronous_strategy_on_a_schedule_equals_single_on_it(runs):
    """data on 4 devices, batch 64 then 128 from step 10: single's parameters (rtol 1e-5);
    one compilation more than the fixed batch's (the second size's step)."""

    def params(name):
        return {k: v for k, v in load_leaves(runs / name).items() if k.startswith(".params")}

    a, b = params("data"), params("single")
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
    s, fixed = (json.loads((runs / n / "summary.json").read_text()) for n in ("data", "fixed"))
    assert (s["global_batch"], s["global_batch_last"]) == (64, 128)
    assert s["compilations"] == fixed["compilations"] + 1


@pytest.mark.parametrize(
    "args, says",
    [
        (["--strategy", "data", "--devices", "4", "--batch-schedule", "0:64,10:66"],
         "does not"),
        (["--strategy", "ps", "--simulate", "--workers", "2", "--batch-schedule", "0:64,5:128"],
         "workers take their own shares"),
        (["--batch-schedule", "0:64,5:128", "--batch-size", "32"], "starts at batch 64"),
    ],
)  # fmt: skip
def test_a_schedule_that_cannot_run_is_one_line_before_anything_is_written(tmp_path, args, says):
    out = tmp_path / "run"
    proc = run_cli(*args, "--model", "mlp", "--steps", "20", "--out", str(out))
    lines = stderr_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not out.exists()


@pytest.mark.slow  # the default suite's time (15 min on 2 cores; 19 min 23 s measured 2026-11-26)
def test_a_resumed_schedule_continues_exactly(tmp_path):
    """Stopped at step 15 (batch 128 since step 10), resumed to 30 (256 from step 20):
    bit-equal to the uninterrupted run."""
    args = ("--strategy", "data", "--devices", "2", "--model", "mlp", "--eval-every", "0",
            "--batch-schedule", "0:64,10:128,20:256", "--no-progress")  # fmt: skip
    for name, steps in (("cut", "15"), ("whole", "30")):
        proc = run_cli(*args, "--steps", steps, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("--resume", str(tmp_path / "cut"), "--steps", "30", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = load_leaves(tmp_path / "cut"), load_leaves(tmp_path / "whole")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_run_on_a_schedule_writes_its_text_in_the_summary_and_config(tmp_path):
    """The schedule is a type inside the run and its text in the files (summary.json,
    config.json): a library run on a growing batch, three steps."""
    from refdl.config.spec import RunSpec
    from refdl.run.loop import fit

    out = tmp_path / "run"
    summary = fit(RunSpec(model="mlp", steps=3, batch_size=32, batch_schedule="0:32,2:64",
                          eval_every=0, progress=False, out=str(out)))  # fmt: skip
    assert summary["batch_schedule"] == "0:32,2:64" and summary["global_batch_last"] == 64
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["batch_schedule"] == "0:32,2:64"
    assert json.loads((out / "config.json").read_text())["batch_schedule"] == "0:32,2:64"
