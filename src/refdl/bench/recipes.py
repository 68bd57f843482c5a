"""Deep500-style recipes: a TOML file fixes a benchmark, names what may change, and
states the acceptable metric set; ``python -m refdl.bench run FILE`` checks it.

A recipe::

    [recipe]
    name = "digits-data"
    description = "..."

    [fixed]          # the definition of the benchmark: never overridden
    model = "lenet5"
    dataset = "digits"
    steps = 300

    [mutable]        # defaults that --set KEY=VALUE may change
    strategy = "data"
    devices = 2      # simulated devices; or ranks = 4 to launch under mpirun

    [acceptable]     # Deep500 metric -> bounds (refdl.bench.metrics.METRICS)
    TestAccuracy = { min = 0.9 }
    WallclockTime = { max = 300 }

    [options]        # how to measure, not what
    target_accuracy = 0.9   # for TimeToAccuracy
    timeout = 900

Keys of ``[fixed]`` and ``[mutable]`` are ``python -m refdl.train`` flags
(``batch_size`` for ``--batch-size``; lists for repeatable flags such as
``model_opt``); ``ranks`` runs the job with ``mpirun -n RANKS``. The run's
files are kept in ``--out`` (a temporary directory otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from refdl.bench.metrics import METRICS, from_run, read_run
from refdl.config.files import load_toml, printable
from refdl.config.spec import OUTPUT_KEYS, RunSpec
from refdl.config.values import Float, Int
from refdl.errors import UsageError
from refdl.parallel.processes import mpirun_command, mpirun_env

SECTIONS = ("recipe", "fixed", "mutable", "acceptable", "options")
# [options], each with its declared value type (refdl.config.values)
OPTIONS = {
    "target_accuracy": Float(min=0.0, max=1.0),
    "timeout": Float(min=0.0, min_open=True, max=1e6),
}
BOUND = Float()  # a metric's min or max


class RecipeFailed(RuntimeError):
    """The recipe's run failed (not bad input): one line, exit status 1."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A parsed recipe (see the module docstring)."""

    name: str
    description: str
    fixed: dict[str, Any]
    mutable: dict[str, Any]
    acceptable: dict[str, dict[str, float]]
    options: dict[str, Any]
    path: str = "<recipe>"

    def settings(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's settings: ``fixed`` plus ``mutable`` with ``overrides`` applied."""
        out = dict(self.mutable)
        for key, value in (overrides or {}).items():
            if key in self.fixed:
                raise UsageError(
                    f"{self.path}: {key} is fixed by the recipe; only its mutable keys "
                    f"({', '.join(sorted(self.mutable)) or 'none'}) may be --set"
                )
            if key not in self.mutable:
                raise UsageError(
                    f"{self.path}: no mutable key {key!r}; the recipe's mutable keys are "
                    f"{', '.join(sorted(self.mutable)) or 'none'}"
                )
            out[key] = _like(key, value, self.mutable[key])
        return {**self.fixed, **out}


def _like(key: str, raw: Any, default: Any) -> Any:
    if not isinstance(raw, str) or isinstance(default, str):
        return raw
    try:
        if isinstance(default, bool):
            return raw.lower() in ("1", "true", "yes")
        if isinstance(default, list):
            return [v.strip() for v in raw.split(",") if v.strip()]
        return type(default)(raw)
    except ValueError:
        raise UsageError(f"--set {key}={raw!r}: expected a value like {default!r}") from None


def _table(raw: dict, name: str, path: str | Path) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise UsageError(f"recipe {path}: [{name}] must be a table of KEY = VALUE lines")
    return dict(value)


REPEATED = ("model_opt", "data_opt")  # repeatable flags: a text or a list of texts
SETTINGS = {f.name: f.metadata["value"] for f in dataclasses.fields(RunSpec)
            if f.name not in (*OUTPUT_KEYS, "model_opts", "data_opts")}  # fmt: skip
RANKS = Int(min=1, max=4096)


def _setting(key: str, value: Any, section: str, path: str | Path) -> Any:
    """A [fixed] or [mutable] value: one of ``refdl.train``'s flags with a value of its
    declared type (a text is parsed as the flag would parse it), a list only for the
    repeatable flags. Where the run writes is never a recipe's to say."""
    where = f"recipe {path}: [{section}] {key}"
    if key in OUTPUT_KEYS:
        raise UsageError(f"{where}: where a run writes is given on the command line "
                         "(bench run --out DIR), never by a recipe; remove it")  # fmt: skip
    if key in REPEATED:
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise UsageError(f"{where} must be a text KEY=VALUE or a list of them")
        return value
    declared = RANKS if key == "ranks" else SETTINGS.get(key)
    if declared is None:
        raise UsageError(f"{where}: not a flag of refdl.train (use its long name, e.g. "
                         "batch_size for --batch-size)")  # fmt: skip
    problem = None
    if isinstance(value, str):  # as the flag would parse it
        try:
            declared.parse(value)
        except ValueError as e:
            problem = str(e)
    else:
        problem = declared.problem(value)
    if problem:
        raise UsageError(f"{where} must be {problem}")
    return value


def load(path: str | Path) -> Recipe:
    """Read and check a recipe; a bad file raises UsageError naming the key."""
    p = Path(path)
    raw = load_toml(p, "recipe", limit=1 << 20)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise UsageError(f"recipe {path}: unknown section(s) {unknown}; use {', '.join(SECTIONS)}")
    head = _table(raw, "recipe", p)
    fixed = {k: _setting(k, v, "fixed", p) for k, v in _table(raw, "fixed", p).items()}
    mutable = {k: _setting(k, v, "mutable", p) for k, v in _table(raw, "mutable", p).items()}
    both = sorted(set(fixed) & set(mutable))
    if both:
        raise UsageError(f"recipe {path}: {both} both fixed and mutable; keep each in one")
    if "model" not in fixed:
        raise UsageError(f"recipe {path}: [fixed] must name the model")
    acceptable: dict[str, dict[str, float]] = {}
    for metric, bounds in _table(raw, "acceptable", p).items():
        if metric not in METRICS:
            raise UsageError(
                f"recipe {path}: [acceptable] {metric} is not a metric; known: {', '.join(METRICS)}"
            )
        if not isinstance(bounds, dict) or not bounds or set(bounds) - {"min", "max"}:
            raise UsageError(f"recipe {path}: [acceptable] {metric} needs {{ min = ... }} "
                             "and/or { max = ... }")  # fmt: skip
        for key, value in bounds.items():
            if problem := BOUND.problem(value):
                raise UsageError(f"recipe {path}: [acceptable] {metric} {key} must be {problem}")
        acceptable[metric] = {k: float(v) for k, v in bounds.items()}
        if acceptable[metric].get("min", -math.inf) > acceptable[metric].get("max", math.inf):
            raise UsageError(f"recipe {path}: [acceptable] {metric} min {bounds['min']} is "
                             f"above its max {bounds['max']}: no run could pass")  # fmt: skip
    if not acceptable:
        raise UsageError(f"recipe {path}: [acceptable] names no metric")
    options = _table(raw, "options", p)
    for key, value in options.items():
        if key not in OPTIONS:
            raise UsageError(f"recipe {path}: unknown option {key!r}; known: {', '.join(OPTIONS)}")
        if problem := OPTIONS[key].problem(value):
            raise UsageError(f"recipe {path}: [options] {key} must be {problem}")
        options[key] = float(value)
    if "TimeToAccuracy" in acceptable and "target_accuracy" not in options:
        raise UsageError(f"recipe {path}: TimeToAccuracy needs [options] target_accuracy")
    for key in ("name", "description"):
        if key in head and not isinstance(head[key], str):
            raise UsageError(f"recipe {path}: [recipe] {key} must be a text")
    return Recipe(
        name=printable(head.get("name", p.stem)),
        description=printable(head.get("description", ""), 400),
        fixed=fixed,
        mutable=mutable,
        acceptable=acceptable,
        options=options,
        path=str(path),
    )


def train_argv(settings: dict[str, Any], out: str) -> tuple[list[str], int]:
    """``python -m refdl.train`` arguments for ``settings``, and the MPI rank count (0: none)."""
    argv = ["-m", "refdl.train", "--no-progress", "--out", out, "--checkpoint-every", "0"]
    ranks = 0
    for key, value in settings.items():
        if key == "ranks":
            ranks = int(value)
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv, ranks


def check(recipe: Recipe, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per acceptable metric: value, bounds and whether it passed."""
    rows = []
    for name, bounds in recipe.acceptable.items():
        value = metrics.get(name)
        ok = value is not None
        if ok and "min" in bounds:
            ok = value >= bounds["min"]
        if ok and "max" in bounds:
            ok = value <= bounds["max"]
        rows.append({"metric": name, "value": value, **bounds, "passed": bool(ok)})
    return rows


def run(recipe: Recipe, overrides: dict[str, Any] | None = None, out: str | None = None) -> dict:
    """Run the recipe's training job, compute its metrics, check the acceptable set."""
    settings = recipe.settings(overrides)
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", recipe.name)[:40]  # a name is never a path
    out_dir = out or tempfile.mkdtemp(prefix=f"refdl-recipe-{tag}-")
    argv, ranks = train_argv(settings, out_dir)
    if ranks:
        cmd, env = mpirun_command(ranks, argv), mpirun_env()
    else:
        cmd, env = [sys.executable, *argv], None
    timeout = recipe.options.get("timeout", 1800.0)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise UsageError(
            f"recipe {recipe.name}: the run took longer than {timeout:.0f} s"
        ) from None
    if proc.returncode == 2:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        if out is None:  # the folder made here, left empty: the run wrote nothing
            shutil.rmtree(out_dir, ignore_errors=True)
        raise UsageError(f"recipe {recipe.name}: the run refused its settings: {last}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RecipeFailed(f"recipe {recipe.name}: the run failed (exit {proc.returncode}): "
                           f"{last}; its files are in {out_dir}")  # fmt: skip
    summary, rows = read_run(out_dir)
    metrics = from_run(summary, rows, recipe.options.get("target_accuracy"))
    checks = check(recipe, metrics)
    result = {
        "recipe": recipe.name,
        "path": recipe.path,
        "settings": settings,
        "command": " ".join(cmd),
        "metrics": metrics,
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
        "run_dir": out_dir,
    }
    Path(out_dir, "recipe_result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_result(result: dict[str, Any]) -> None:
    """The acceptable set as a table, then PASSED/FAILED."""
    print(f"recipe {result['recipe']} ({result['path']}): {result['command']}")
    print(f"{'metric':22s} {'value':>14s} {'bounds':>22s}  ")
    for c in result["checks"]:
        bounds = " ".join(f"{k} {c[k]:g}" for k in ("min", "max") if k in c)
        value = "n/a" if c["value"] is None else f"{c['value']:.6g}"
        print(f"{c['metric']:22s} {value:>14s} {bounds:>22s}  {'ok' if c['passed'] else 'MISSED'}")
    others = {k: v for k, v in result["metrics"].items()
              if v is not None and k not in {c["metric"] for c in result["checks"]}}  # fmt: skip
    if others:
        print("also: " + ", ".join(f"{k} {v:.4g}" for k, v in others.items()))
    print(("PASSED" if result["passed"] else "FAILED") + f"; run files in {result['run_dir']}")
