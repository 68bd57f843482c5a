"""A run started before 2026-11-28 with a setting that changes nothing - refused for new
runs since then (momentum beside Adam, a step decay without the step schedule, a folder
for a built-in data set) - still resumes, as it was started: its checkpoints'
configuration is its own, and the flags given again must equal it. The run is named
relative to where it is resumed from."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import run_cli
from refdl.run import checkpoint
from refdl.run.checkpoint_npz import config_key

OLD = {"momentum": 0.5, "lr_decay_every": 5}


def test_a_run_with_settings_now_refused_resumes_as_it_was_started(tmp_path):
    run, folder = tmp_path / "run", tmp_path / "images"
    folder.mkdir()
    common = ("--model", "mlp", "--optimizer", "adam", "--eval-every", "0", "--no-progress")
    first = run_cli(*common, "--steps", "4", "--checkpoint-every", "2", "--out", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    # what such a run's files held: its config.json and each checkpoint's settings and key
    old = {**OLD, "data_dir": str(folder)}
    config = {**json.loads((run / "config.json").read_text()), **old}
    (run / "config.json").write_text(json.dumps(config))
    for step in sorted((run / "checkpoints").iterdir()):
        meta = step / "meta" / "metadata"
        m = json.loads(meta.read_text())
        m["spec"] = {**m["spec"], **old}
        m["config"] = config_key(m["spec"])
        meta.write_text(json.dumps(m))
    # named relative to where it is resumed from, as the docs write it (--resume runs/mlp:
    # orbax reads absolute paths only, and refused it until 2026-11-28)
    again = subprocess.run([sys.executable, "-m", "refdl.train", "--resume", "run", "--steps",
                            "6", "--no-progress"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["status"] == "completed"
    assert checkpoint.resolve(run).meta["spec"]["momentum"] == 0.5  # kept, as started
    # a new run with any of them is refused, one line, exit 2
    new = run_cli(*common, "--steps", "2", "--momentum", "0.5", "--out", str(tmp_path / "new"))
    assert new.returncode == 2 and "--momentum sets the heavy ball" in new.stderr
    assert not (tmp_path / "new").exists()
