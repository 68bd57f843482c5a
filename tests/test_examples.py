"""The examples of docs/library.md run from a fresh clone, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_every_example_is_here():
    assert EXAMPLES == ["custom_cost.py", "custom_dataset.py", "custom_model.py", "local_sgd.py"]


# 10-17 s each on 2 cores (-m slow runs them)
SLOW = ("custom_dataset.py", "custom_model.py", "local_sgd.py")


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


def test_the_library_pages_model_recipe_is_the_examples():
    """Issue 54: docs/library.md's custom-model recipe and examples/custom_model.py had
    drifted apart; the page's build and registration are the example's, line for line."""
    import re

    page = (ROOT / "docs" / "library.md").read_text()
    block = page.split("## A model of your own", 1)[1].split("```python", 1)[1].split("```")[0]
    example = (ROOT / "examples" / "custom_model.py").read_text()
    plain = lambda text: [re.sub(r"\s+#.*$", "", ln).strip() for ln in text.splitlines()]  # noqa: E731
    lines = [ln for ln in plain(block) if ln]
    wanted = lines[
        lines.index("def build(info, width: int = 8, hidden: int = 32) -> Sequential:") :
    ]
    have = set(plain(example))
    missing = [ln for ln in wanted if ln not in have and not ln.startswith("refdl.assert")]
    assert not missing, missing


def test_the_library_pages_data_set_recipe_is_the_examples():
    """Issue 54: each registration on docs/library.md is its runnable example's."""
    import re

    page = (ROOT / "docs" / "library.md").read_text()
    block = page.split("## A data set of your own", 1)[1].split("```python", 1)[1].split("```")[0]
    example = (ROOT / "examples" / "custom_dataset.py").read_text()
    plain = lambda text: [re.sub(r"\s+#.*$", "", ln).strip() for ln in text.splitlines()]  # noqa: E731
    have = set(plain(example))
    missing = [ln for ln in plain(block) if ln and ln != "..." and ln not in have]
    assert not missing, missing
