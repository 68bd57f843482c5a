"""The examples of docs/library.md run from a fresh clone, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_every_example_is_here():
    assert EXAMPLES == ["custom_cost.py", "custom_model.py", "local_sgd.py"]


SLOW = ("custom_model.py", "local_sgd.py")  # 10-13 s each on 2 cores (-m slow runs them)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in EXAMPLES]
)
def test_example_runs(tmp_path, name):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets it
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if name != "custom_cost.py":
        assert "equal" in proc.stdout and "test accuracy" in proc.stdout
        again = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True,
                               text=True, timeout=600, cwd=tmp_path, env=env)  # fmt: skip
        assert again.returncode == 0, again.stderr[-3000:]  # an example can be run again
    if name == "local_sgd.py":
        assert "wrong period (3) fails" in proc.stdout


def test_library_refusals_name_arguments_not_flags(tmp_path):
    """A library caller is told which argument to change (``overwrite=True``), not a flag."""
    import refdl

    (tmp_path / "config.json").write_text("{}")  # a folder holding another run
    with pytest.raises(refdl.UsageError) as refused:
        refdl.fit(refdl.RunSpec(model="mlp", steps=2, progress=False), out=str(tmp_path))
    message = str(refused.value)
    assert "overwrite=True" in message and f"resume={str(tmp_path)!r}" in message
    assert "--" not in message
    with pytest.raises(refdl.UsageError, match=r"warmup_steps=50 is beyond steps=2"):
        refdl.run_steps(refdl.RunSpec(model="mlp", steps=2, warmup_steps=50), 1)
