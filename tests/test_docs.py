"""Every shell command in README.md and docs/*.md runs as written.

Each command of a ```bash block is run in a copy of the repository (so what it writes -
profiles, results - lands in the copy), with the copy's package first on the path. The
test changes only what a test must: fewer training steps (``--steps``, added when the
command has none), a run folder of its own (``--out``, added when none is given),
optional ``[...]`` parts left out, and the placeholders a reader fills in (``runs/<run>``,
``my_run.jsonl``) replaced by files the test makes first - with refdl itself, or with the
PyTorch user script ``scripts/user_runs/torch_digits.py``. A few cheap commands run by
default; ``-m slow`` runs every one. The commands not run say why in ``NOT_RUN``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, mpirun_path

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("refdl", ".venv/bin/refdl", ".venv/bin/python", "python", "python3", "mpirun",
            "bash")  # fmt: skip
STEPS = 20  # training steps a command gets here (its own --steps when smaller)

# Commands that are not run here, and why (each is run elsewhere, or needs what CI lacks).
NOT_RUN = {
    "bash scripts/setup.sh && .venv/bin/python -m pytest": "this very suite: .ci/run runs it",
    # both ran as written on a lent H100 on 2026-11-26 (docs/bench/gpu/gpu_steps-2026-11-26.json)
    "scripts/bench_gpu.py": "needs a GPU (docs/benchmarks.md: run on a lent one)",
    "scripts/gpu_rows.py": "reads bench_gpu.py's output of a GPU run",
    # ran as written on a lent H200 on 2026-11-28 (docs/bench/gpu/gemm-2026-11-28.json)
    "scripts/measure_shapes.py": "needs a GPU (docs/benchmarks.md: run on a lent one)",
    # ran as written on a lent H200 on 2026-11-27 (docs/bench/gpu/train_cli-2026-11-27.json);
    # here its 2.42 B parameters' Adam state (39 GB) outgrows the 24 GiB and it is killed
    "--model-opt layers=48 --model-opt mlp_dim=8192": "needs a GPU's memory (a lent H200)",
}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str  # as written (continuations joined, comment dropped)


def commands() -> list[Command]:
    """The shell commands of README.md and docs/*.md, in order."""
    out = []
    for path in DOCS:
        lines, block, i = path.read_text().splitlines(), None, 0
        while i < len(lines):
            line, start = lines[i].strip(), i + 1
            if line.startswith("```"):
                block = None if block is not None else line[3:].strip()
            elif block in ("bash", "sh", "console"):
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1].rstrip() + " " + lines[i].strip()
                text = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
                if text.split(" ", 1)[0] in PROGRAMS:
                    out.append(Command(f"{path.relative_to(ROOT)}:{start}", text))
            i += 1
    return out


COMMANDS = commands()


def is_fast(where: str, text: str) -> bool:
    """Cheap enough for the default suite (a few seconds each): the README's listing and
    predictions, and the prediction tables."""
    readme = where.startswith("README.md") and re.search(
        r"refdl (train --list|predict collective)\b", text)  # fmt: skip
    return bool(readme or re.search(r"refdl predict (models|profiles)$", text))


def not_run(text: str) -> str | None:
    return next((why for key, why in NOT_RUN.items() if key in text), None)


def test_the_docs_hold_commands_and_each_is_run_or_says_why():
    assert len(COMMANDS) >= 80, len(COMMANDS)
    assert sum(not_run(c.text) is not None for c in COMMANDS) <= 9  # 8: the GPU's own
    assert sum(is_fast(c.where, c.text) for c in COMMANDS) >= 4


@pytest.fixture(scope="module", autouse=True)
def no_test_hosts_left():
    """docs/distributed.md brings test hosts and Slurm up: nothing of them outlives this."""
    yield
    for script in ("slurm_hosts.sh", "hosts.sh"):
        if os.geteuid() == 0 and shutil.which("ip"):
            subprocess.run(["bash", str(ROOT / "scripts" / script), "down"], capture_output=True)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files, with the inputs the docs' placeholders
    stand for made first."""
    tree = tmp_path_factory.mktemp("docs") / "refdl"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)
    for venv in ROOT.glob(".venv*"):  # .venv, and .venv-mxnet for MXNet's adapter
        (tree / venv.name).symlink_to(venv)
    return tree


def env_for(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=str(tree / "src"), PYTHONWARNINGS="ignore",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # fmt: skip
    return env


def made(tree: Path, what: str) -> Path:
    """The file a placeholder stands for, made once: refdl runs, the PyTorch user script's
    logs (JSONL, CSV + TOML, TensorBoard events), a log of a run from refdl's start."""
    env, py = env_for(tree), sys.executable
    logs = tree / "user-logs"
    if what == "logs" and not logs.exists():
        subprocess.run([py, "scripts/user_runs/torch_digits.py", "--out", str(logs), "--steps",
                        "200", "--formats", "jsonl,csv,tb", "--seeds", "7"], cwd=tree, env=env,
                       check=True, capture_output=True, timeout=600)  # fmt: skip
    if what == "start" and not (tree / "from-start").exists():
        subprocess.run([py, "-m", "refdl.validate", "--export-start", "start-made", "--model",
                        "mlp", "--steps", "200"], cwd=tree, env=env, check=True,
                       capture_output=True, timeout=600)  # fmt: skip
        subprocess.run([py, "scripts/user_runs/torch_digits.py", "--out", "from-start",
                        "--start", "start-made", "--seeds", "1"], cwd=tree, env=env,
                       check=True, capture_output=True, timeout=600)  # fmt: skip
    if what.startswith("parity-") and not (tree / f"runs/made-{what}").exists():
        # the test and the second 1-D control: plain data parallelism on 2 devices
        two = what in ("parity-test", "parity-control2")
        layout = ["--strategy", "data", "--devices", "2"] if two else []
        subprocess.run([py, "-m", "refdl.train", *layout, "--model", "mlp", "--steps",
                        str(STEPS), "--log-every", "1", "--out", f"runs/made-{what}"], cwd=tree,
                       env=env, check=True, capture_output=True, timeout=600)  # fmt: skip
    if what in ("run", "ps") and not (tree / f"runs/made-{what}").exists():
        args = (["--strategy", "ps", "--simulate", "--workers", "3", "--batch-size", "96",
                 "--ps-mode", "async"] if what == "ps" else ["--model", "mlp"])  # fmt: skip
        subprocess.run([py, "-m", "refdl.train", *args, "--steps", str(STEPS), "--out",
                        f"runs/made-{what}"], cwd=tree, env=env, check=True,
                       capture_output=True, timeout=600)  # fmt: skip
        return tree / f"runs/made-{what}"
    return tree / {"logs": "user-logs", "start": "from-start"}.get(what, f"runs/made-{what}")


def placeholders(text: str, tree: Path) -> str:
    """The reader's placeholders replaced by files the test made."""
    if "runs/<run>" in text:
        text = text.replace("runs/<run>", str(made(tree, "run")))
    if "runs/X/" in text:
        text = text.replace("runs/X/", str(made(tree, "ps")) + "/")
    for name in ("my_torch_log.jsonl", "torch_log.jsonl", "my_run.jsonl", "my_run.csv",
                 "my_run.toml", "run.toml", "runs/tb/"):  # fmt: skip
        if re.search(rf"(?<![\w/]){re.escape(name)}", text):
            stem = next(made(tree, "logs").glob("*.jsonl")).with_suffix("")
            real = {".jsonl": ".jsonl", ".csv": ".csv", ".toml": ".toml", "/": ".tb"}
            suffix = next(v for k, v in real.items() if name.endswith(k))
            text = re.sub(rf"(?<![\w/]){re.escape(name)}", str(stem) + suffix, text)
    # an N-D run and its 1-D controls (one device; two), every step logged
    for role, run in (("test", "test"), ("control", "control"), ("control_1gpu", "control"),
                      ("control_2gpu", "control2")):  # fmt: skip
        if re.search(rf"(?<![\w/]){role}\.jsonl", text):
            log = made(tree, f"parity-{run}") / "metrics.jsonl"
            text = re.sub(rf"(?<![\w/]){role}\.jsonl", str(log), text)
    if "hosts.txt" in text and not (tree / "hosts.txt").exists():
        (tree / "hosts.txt").write_text("refdl-h1 slots=2\nrefdl-h2 slots=2\n")
    if "my_run_from_start.jsonl" in text:
        text = text.replace("my_run_from_start.jsonl",
                            str(next(made(tree, "start").glob("*.jsonl"))))  # fmt: skip
    return text


def argv_of(text: str, tree: Path, where: str) -> list[str]:
    """The command as run here: programs resolved, fewer steps, its own run folder."""
    text = re.sub(r"\s*\[[^\]]*\]", "", text)  # optional parts left out
    text = text.split("&&")[-1].strip()  # "bash scripts/setup.sh && X": set up already
    argv = shlex.split(placeholders(text, tree))
    head = argv[0]
    if head in ("refdl", ".venv/bin/refdl"):
        argv = [sys.executable, "-m", "refdl", *argv[1:]]
    elif head in (".venv/bin/python", "python", "python3"):
        argv = [sys.executable, *argv[1:]]
    elif head == "mpirun":
        argv = [mpirun_path(), "--oversubscribe", *argv[1:]]
        argv = [sys.executable if a == ".venv/bin/python" else a for a in argv]
    trains = "train" in argv or "refdl.train" in argv
    if trains and "--list" not in argv:
        if "--steps" in argv:
            i = argv.index("--steps") + 1
            argv[i] = str(STEPS + 10 if "--resume" in argv else min(int(argv[i]), STEPS))
        else:
            argv += ["--steps", str(STEPS)]
        if "--out" not in argv and "--resume" not in argv:
            argv += ["--out", f"runs/doc-{re.sub(r'[^A-Za-z0-9]', '-', where)}"]
    validates = "refdl.validate" in argv or (len(argv) > 3 and argv[3] == "validate")
    by_outcome = "async" in argv  # an asynchronous server is compared by what it learns
    if validates and ("--framework" in argv or "--strategy" in argv) and not by_outcome:
        # a twin run: 10 steps
        if "--steps" in argv:
            i = argv.index("--steps") + 1
            argv[i] = str(min(int(argv[i]), 10))
        else:
            argv += ["--steps", "10"]
    return argv


PARAMS = [pytest.param(c, id=c.where, marks=() if is_fast(c.where, c.text) else pytest.mark.slow)
          for c in COMMANDS]  # fmt: skip


@pytest.mark.parametrize("command", PARAMS)
def test_command_runs_as_written(tree, command):
    why = not_run(command.text)
    if why:
        pytest.skip(why)
    if command.text.startswith("mpirun") and mpirun_path() is None:
        pytest.skip("mpirun not found")
    argv = argv_of(command.text, tree, command.where)
    proc = subprocess.run(argv, cwd=tree, env=env_for(tree), capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    said = f"{command.where}: {' '.join(argv)}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    assert "Traceback" not in proc.stderr, said
