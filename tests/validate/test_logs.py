"""A framework's own log, as users have it: real PyTorch scripts (tests/validate/scripts/)
checked statistically against refdl's seeds, or exactly from refdl's exported start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from refdl.validate import __main__ as VM

pytest.importorskip("torch", reason="PyTorch not installed (bash scripts/setup.sh does)")
SCRIPT = Path(__file__).parent / "scripts" / "train_digits_mlp_torch.py"


def train(tmp: Path, name: str, *args: str) -> Path:
    """Run the user's PyTorch script; its JSONL log."""
    log = tmp / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(log), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return log


def report(log: Path, tmp: Path, *extra: str) -> tuple[int, dict]:
    out = tmp / f"report-{log.stem}"
    code = VM.main(["--results", str(log), "--report", str(out), *extra])
    return code, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logs")
    start = tmp / "start"
    assert VM.main(["--export-start", str(start), "--model", "mlp", "--steps", "200"]) == 0
    return tmp, {
        "healthy": train(tmp, "healthy"),
        "no_zero_grad": train(tmp, "no_zero_grad", "--bug", "no-zero-grad"),
        "from_start": train(tmp, "from_start", "--start", str(start)),
    }


def test_a_healthy_run_with_its_own_init_passes_statistically(logs):
    tmp, paths = logs
    code, r = report(paths["healthy"], tmp)
    assert code == 0 and r["passed"], r["failed"]
    assert r["comparison"] == "statistical" and "no exported start" in r["why"]
    assert r["init"] == "torch"  # refdl's seeds drawn as PyTorch draws (the log says so)
    assert r["seeds"] == 5 and r["end_in_band"]
    acc = r["final_test_accuracy"]
    assert acc["framework"] >= acc["floor"] and 0.9 < acc["refdl_mean"] <= 1.0
    lo, hi = r["final_loss"]["band"]
    assert lo <= r["final_loss"]["framework"] <= hi
    assert r["assumptions"] == [] and r["warnings"] == []  # the script declares every key
    text = (tmp / "report-healthy" / "report.md").read_text()
    assert "**Comparison: statistical**" in text and "rule:" in text


def test_gradients_never_zeroed_fail_naming_the_step(logs):
    tmp, paths = logs
    code, r = report(paths["no_zero_grad"], tmp)
    assert code == 1 and not r["passed"]
    assert "end_in_band" in r["failed"] and "final_accuracy" in r["failed"]
    assert r["outside_from_step"] is not None and r["outside_from_step"] < 100
    assert r["final_loss"]["framework"] > 10 * r["final_loss"]["band"][1]


def test_a_run_from_the_exported_start_passes_exactly(logs):
    tmp, paths = logs
    code, r = report(paths["from_start"], tmp)
    assert code == 0 and r["passed"], r
    assert r["comparison"] == "exact" and "exported start" in r["why"]
    assert r["steps_compared"] == 200 and r["loss_max_rel_diff"] < 1e-4
    assert r["param_rel_l2_diff"] < 1e-4  # the final weights the script saved


def test_missing_and_unknown_keys_are_reported_not_refused(tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [json.dumps({"step": t, "loss": 2.3 - 0.01 * t}) for t in range(20)]
    log.write_text(json.dumps({"config": {"model": "mlp", "steps": 20, "gpus": 2}}) + "\n"
                   + "\n".join(rows) + "\n")  # fmt: skip
    code, r = report(log, tmp_path, "--seeds", "2")
    assert code in (0, 1) and r["comparison"] == "statistical"
    assert any(a.startswith("init not given") for a in r["assumptions"])
    assert any("'gpus'" in w for w in r["warnings"])


def test_a_start_for_another_configuration_is_compared_statistically(tmp_path):
    log = tmp_path / "log.jsonl"
    config = {"model": "mlp", "steps": 5, "start": "0123456789abcdef", "init": "refdl"}
    rows = [json.dumps({"step": t, "loss": 2.3}) for t in range(5)]
    log.write_text(json.dumps({"config": config}) + "\n" + "\n".join(rows) + "\n")
    _code, r = report(log, tmp_path, "--seeds", "2")
    assert r["comparison"] == "statistical" and "but refdl's export" in r["why"]


def test_export_start_writes_every_layout(tmp_path):
    import numpy as np

    out = tmp_path / "start"
    assert VM.main(["--export-start", str(out), "--model", "lenet5", "--steps", "3",
                    "--batch-size", "8"]) == 0  # fmt: skip
    start = json.loads((out / "start.json").read_text())
    assert len(start["fingerprint"]) == 16 and start["config"]["model"] == "lenet5"
    assert np.load(out / "batches.npy").shape == (3, 8)
    names = [p["name"] for p in start["torch_parameters"]]
    assert names[0] == "00_conv.weight" and start["torch_parameters"][0]["shape"] == [8, 1, 5, 5]
    with np.load(out / "init_torch.npz") as t, np.load(out / "init_refdl.npz") as r:
        assert np.array_equal(t["p000"], r["00_conv/kernel"].transpose(3, 2, 0, 1))
    for loader in ("load_torch.py", "load_keras.py"):
        assert "def load_start" in (out / loader).read_text()
    # a second export of the same configuration has the same fingerprint
    again = tmp_path / "again"
    VM.main(["--export-start", str(again), "--model", "lenet5", "--steps", "3",
             "--batch-size", "8"])  # fmt: skip
    assert json.loads((again / "start.json").read_text())["fingerprint"] == start["fingerprint"]
