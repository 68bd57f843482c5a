"""Parity at any scale (``refdl validate --results TEST --control CONTROL``): the verdict
from two logs alone, the same in every format a framework writes, its report, its exit
status, and rates that belong to the rule in force."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from refdl.errors import UsageError
from refdl.run.events import EventFile
from refdl.validate import parity
from refdl.validate.__main__ import main

STEPS = np.arange(1, 101)
CONTROL = 2.3 * np.exp(-STEPS / 40.0) + 0.1  # a loss curve
HEALTHY = CONTROL * (1 + 1e-8 * np.sin(STEPS))  # another reduction order's rounding
DRIFT = CONTROL + 0.05 * (STEPS > 40) * (STEPS - 40) / 60  # departs after step 40


def write(path: Path, losses: np.ndarray, fmt: str) -> Path:
    """One curve in one of the formats the ecosystem writes."""
    rows = list(zip(STEPS.tolist(), losses.tolist(), strict=False))  # (a short log: its steps)
    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in rows))
    elif fmt == "csv":
        path = path.with_suffix(".csv")
        path.write_text("step,loss\n" + "".join(f"{s},{v!r}\n" for s, v in rows))
    elif fmt == "tensorboard":  # torchtitan's tag
        path.mkdir()
        events = EventFile(path)
        for s, v in rows:
            events.scalar("loss_metrics/global_avg_loss", v, s, 1.0e9 + s)
        events.close()
    elif fmt == "megatron":  # Megatron-LM's training_log line
        path = path.with_suffix(".log")
        path.write_text("".join(
            f" [2026-11-26 12:00:00] iteration {s:8d}/     100 | consumed samples: {64 * s:12d} "
            f"| elapsed time per iteration (ms): 101.2 | learning rate: 1.000000E-04 | "
            f"global batch size:    64 | lm loss: {v:E} | loss scale: 1.0 | number of "
            "skipped iterations:   0 | number of nan iterations:   0 |\n"
            for s, v in rows))  # fmt: skip
    elif fmt == "trainer_state":  # Hugging Face Trainer's trainer_state.json
        path = path.with_suffix(".json")
        history = [{"epoch": s / 100, "learning_rate": 1e-4, "loss": v, "step": s}
                   for s, v in rows]  # fmt: skip
        history.append({"eval_loss": 1.0, "step": 100})  # evaluation entries are skipped
        path.write_text(json.dumps({"global_step": 100, "log_history": history}))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tensorboard", "megatron", "trainer_state"])
def test_the_same_pair_gets_the_same_verdict_in_every_format(tmp_path, fmt):
    control = write(tmp_path / "control", CONTROL, fmt)
    healthy = parity.parity_report(str(write(tmp_path / "healthy", HEALTHY, fmt)), [str(control)])
    drift = parity.parity_report(str(write(tmp_path / "drift", DRIFT, fmt)), [str(control)])
    assert healthy["passed"] and healthy["common_steps"] == 100
    assert not drift["passed"]
    first = drift["first_departing_window"]
    assert 40 < first["last_step"] <= 80 and first["level_rel"] > 0  # where, and which way
    assert "above the control" in drift["how"]
    # every format reads the same numbers (TensorBoard's float32 and Megatron's 7 digits
    # round below the rule's floor)
    assert drift["z_max"] == pytest.approx(_reference_z(), rel=1e-3)


def _reference_z() -> float:
    r = parity.judge(parity.Curve(STEPS, DRIFT), [parity.Curve(STEPS, CONTROL)])
    return r["z_max"]


def test_a_second_control_gives_the_runs_own_noise():
    rng = np.random.default_rng(0)
    seed_noise = 0.01 * rng.standard_normal(100)  # another seed's loss wanders this much
    other = parity.Curve(STEPS, CONTROL + seed_noise)
    test = parity.Curve(STEPS, CONTROL + 0.01 * rng.standard_normal(100))
    r = parity.judge(test, [parity.Curve(STEPS, CONTROL), other])
    assert r["passed"] and "two controls" in r["noise"]
    shifted = parity.Curve(STEPS, CONTROL + 0.2)  # far outside that noise from the start
    r = parity.judge(shifted, [parity.Curve(STEPS, CONTROL), other])
    assert not r["passed"] and r["first_departing_window"]["first_step"] == 1


def test_cli_report_and_exit_status(tmp_path, capsys):
    control = write(tmp_path / "control", CONTROL, "jsonl")
    healthy = write(tmp_path / "healthy", HEALTHY, "jsonl")
    drift = write(tmp_path / "drift", DRIFT, "csv")
    out = tmp_path / "out"
    assert main(["--results", str(healthy), "--control", str(control)]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["--results", str(drift), "--control", str(control), "--report", str(out)]) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["first_departing_window"]["z"] > parity.Z_DEPART
    assert (out / "loss.png").stat().st_size > 10_000
    md = (out / "report.md").read_text()
    assert "FAILED" in md
    # the rates quoted are those of the setting judged: one control, the envelope's
    assert "rates (same seed; held-out pairs)" in md and "two controls" not in md
    two = tmp_path / "two"
    assert main(["--results", str(drift), "--control", str(control), "--control",
                 str(healthy), "--report", str(two)]) == 1  # fmt: skip
    md = (two / "report.md").read_text()
    assert "rates (same seed, two controls;" in md and "rates (another seed;" in md
    assert "rates (same seed;" not in md
    capsys.readouterr()
    for bad, says in (
        (["--control", str(control)], "--control is the control of --results"),
        (["--results", str(tmp_path / "nope.jsonl"), "--control", str(control)], "no such"),
        (["--results", str(healthy), "--control", str(write(tmp_path / "short", CONTROL[:5],
                                                             "jsonl"))], "share"),
    ):  # fmt: skip
        assert main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


def test_a_bf16_log_with_one_control_is_advised_to_give_two(tmp_path, capsys):
    """The bf16 envelope is the mlp's noise, wider than a transformer's: with one control
    the verdict says so and names the second control that measures the run's own noise
    (docs/validation.md's recipe); with two it says nothing."""
    control = write(tmp_path / "control", CONTROL, "jsonl")
    healthy = write(tmp_path / "healthy", HEALTHY, "jsonl")
    out = tmp_path / "one"
    args = ["--results", str(healthy), "--control", str(control), "--set", "precision=bf16"]
    assert main([*args, "--report", str(out)]) == 0
    err = capsys.readouterr().err
    assert "advice: bf16 with one control" in err and "--control A --control B" in err
    assert "Advice: bf16 with one control" in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["advice"].startswith("bf16")
    assert main([*args, "--control", str(healthy)]) == 0
    assert "advice" not in capsys.readouterr().err
    assert main(["--results", str(healthy), "--control", str(control)]) == 0  # fp32
    assert "advice" not in capsys.readouterr().err
    # a precision refdl measured no envelope for: the advice says the noise is a default
    assert main(["--results", str(healthy), "--control", str(control), "--set",
                 "precision=fp16"]) == 0  # fmt: skip
    assert "refdl measured no fp16 envelope" in capsys.readouterr().err


def test_too_few_common_steps_is_one_line():
    short = parity.Curve(STEPS[:3], CONTROL[:3])
    with pytest.raises(UsageError, match="share 3 logged steps"):
        parity.judge(short, [parity.Curve(STEPS, CONTROL)])


def test_the_rates_belong_to_the_rule_in_force_and_meet_the_goal():
    """``scripts/bench_parity.py --write-rates``'s file: measured for these constants, on
    held-out seeds; healthy pairs at most 5 % false alarms."""
    rates = parity.measured()
    assert rates is not None, "run: python scripts/bench_parity.py --write-rates"
    assert rates["rule"] == parity.rule_fingerprint()
    fa = rates["false_alarms"]
    assert fa["n"] >= 100 and fa["rate"] <= 0.05
    assert len(rates["detected"]) >= 8
    for precision, value in rates["envelope_rel"].items():
        assert precision in ("fp32", "bf16") and 0 < value < 1 and math.isfinite(value)


def test_the_benchmark_measures_pairs_and_bugs(tmp_path):
    """``scripts/bench_parity.py --quick`` (issue 50: in the default suite; 11 s on 2 cores,
    2026-11-27, compiled programs cached across seeds; slow-marked for a day while the
    suite ran 16 min 47 s, back since it runs 9 min 18 s): real runs of refdl's layouts and
    of the zoo's bugs (registered from outside src/), judged as the CLI judges them, in its
    three settings."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "scripts/bench_parity.py", "--quick", "--steps",
                           "50", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "parity_quick.json").read_text())
    assert r["rule"] == parity.rule_fingerprint() and r["false_alarms"]["n"] == 4
    by = r["false_alarms_by_setting"]  # data d=4 with single and data d=2 as controls
    assert by["same seed, two controls"]["n"] == 1
    assert r["false_alarms"]["rate"] == 0.0
    assert r["detected"]["double_mean"]["rate"] == 1.0  # same seed and another seed
    assert r["detected"]["no_allreduce"]["by_setting"]["same seed"]["rate"] == 1.0


@pytest.mark.slow  # ~60 s: five transformer runs of 40 steps
def test_the_transformers_planted_bugs_depart_and_its_layouts_pass():
    """The zoo's transformer bugs (a context-parallel mask and positions, a stale pipeline
    stage) depart from ``single`` with the same seed; the healthy layouts they live in do
    not (one control, fp32, refdl's envelope)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_parity as B
    from parity_bugs import register_bugs

    register_bugs()
    base = {**B.SEQUENCE, "model": "transformer", "precision": "fp32", "seed": 1}
    control = B.curve({**base, "strategy": "single"}, 40)
    envelope = parity.measured()["envelope_rel"]
    bugs = B.TRANSFORMER_BUG_SPECS
    cases = {"context c=2 ring": (B.TRANSFORMER_LAYOUTS["context c=2 ring"], True)}
    for bug in ("cp_mask_order", "cp_local_positions", "pipe_stale_stage"):
        cases[bug] = ({"strategy": f"parity_{bug}", **bugs[bug]}, False)
    for name, (spec, healthy) in cases.items():
        r = B.verdict({"test": B.curve({**base, **spec}, 40), "controls": [control],
                       "precision": "fp32"}, envelope)  # fmt: skip
        assert r["passed"] == healthy, (name, r)


@pytest.mark.slow  # 6 min 24 s (2026-11-27, beside a benchmark): 32 PyTorch runs, fp32 and bf16
def test_pytorchs_own_parallel_runs_pass_against_pytorch_single_and_its_bugs_depart(tmp_path):
    """``scripts/bench_parity_torch.py --models mlp``: PyTorch's DDP, FSDP2, DTensor TP and
    1F1B runs against PyTorch's single run pass the rule (refdl's envelope); the twins'
    planted bugs (FSDP2's gradients summed, a RowwiseParallel left out, a stage's loss
    not scaled) depart, from the same seed; another seed's pairs are judged too; fp32 and
    bf16."""
    import subprocess
    import sys

    from conftest import ROOT

    pytest.importorskip("torch")
    out = tmp_path / "torch.json"
    proc = subprocess.run([sys.executable, "scripts/bench_parity_torch.py", "--seeds", "1",
                           "--steps", "20", "--models", "mlp", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads(out.read_text())["summary"]
    same, other = s["fp32 same seed"], s["fp32 another seed"]
    assert (same["false_alarms"], same["healthy"]) == (0, 4)
    assert (same["detected"], same["bugs"]) == (3, 3)
    assert (other["false_alarms"], other["healthy"]) == (0, 4) and other["bugs"] == 3
    # bf16 (torch.autocast, every twin and the control): the healthy pairs pass against
    # refdl's bf16 envelope; the summed gradients and the unscaled stage loss depart
    bf16 = s["bf16 same seed"]
    assert (bf16["false_alarms"], bf16["healthy"]) == (0, 4) and bf16["detected"] >= 2
