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
