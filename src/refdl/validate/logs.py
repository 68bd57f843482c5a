"""A framework's training log as users have it: JSON lines, a CSV with a header, a
TensorBoard event file (or a folder of them; torchtitan's, MaxText's, NeMo's and
Megatron-LM's loss tags are known), Megatron-LM's text log lines or Hugging Face
Trainer's ``trainer_state.json``, with the configuration in the file, in a TOML file
(``--config``) or on the command line (``--set KEY=VALUE``).

Every row value and configuration value is checked against its declared type
(``ROW_VALUES``, ``CONFIG_VALUES``); a wrong one is a one-line error. Which column or
tag gave each quantity is stated in ``Log.notes`` (and so in the report): CSV columns and
TensorBoard tags are found under the names users give them (``NAMES``) or named with
``--scalars loss=TAG,test_accuracy=TAG,samples_per_s=TAG``.

Nothing in a log is executed: JSON, CSV and TOML are parsed as data, event files with
``refdl.validate.tfevents``. Input is read only from regular files of at most
``MAX_BYTES``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from refdl.config.choices import LR_SCHEDULES, OPTIMIZERS, PIPELINE_SCHEDULES
from refdl.config.files import check_regular, read_text
from refdl.config.values import Choice, Flag, Float, Int, Text
from refdl.errors import UsageError

MAX_BYTES = 256 << 20
# What a row may hold, declared with its value type (refdl.config.values); the loss is
# any number: a diverged run's NaN is a result to judge, not bad input.
ROW_VALUES = {
    "step": Int(min=0, max=10**9),
    "samples_per_s": Float(min=0.0, min_open=True),
    "test_accuracy": Float(min=0.0, max=1.0),
    "wall_time": Float(min=0.0),
}
# The names users give each quantity, tried in this order (refdl's own TensorBoard tags too).
NAMES = {
    "step": ("step", "iteration", "iter", "global_step"),
    # torchtitan's TensorBoard tag, MaxText's, NeMo/Lightning's, Megatron-LM's
    "loss": (
        "loss",
        "train/loss",
        "train_loss",
        "training_loss",
        "loss/train",
        "loss_metrics/global_avg_loss",
        "learning/loss",
        "reduced_train_loss",
        "lm loss",
    ),
    "test_accuracy": (
        "test_accuracy",
        "accuracy",
        "test/accuracy",
        "test_acc",
        "acc/test",
        "eval/accuracy",
    ),
    "samples_per_s": (
        "samples_per_s",
        "samples_per_second",
        "speed/samples_per_second",
        "throughput",
        "samples/s",
    ),
    "wall_time": ("wall_time", "time", "elapsed_s"),
}
INITS = {
    "refdl": "lecun_normal",
    "lecun_normal": "lecun_normal",
    "torch": "torch",
    "torch_default": "torch",
    "keras": "keras",
    "keras_default": "keras",
    "glorot_uniform": "keras",
    "mxnet": "mxnet",
    "mxnet_default": "mxnet",
    "uniform_0.07": "mxnet",
}


class _DataOptions:
    """A data set's options as ``start.json`` writes them (``{"KEY": VALUE}``)."""

    def problem(self, v: Any) -> str | None:
        ok = isinstance(v, dict) and all(isinstance(k, str) for k in v)
        ok = ok and all(isinstance(x, str | int | float | bool) for x in v.values())
        return None if ok else 'an object of "KEY": VALUE (as start.json\'s data_opts)'


CONFIG_VALUES = {
    "model": Text(),
    "strategy": Text(),
    "devices": Int(min=1, max=1 << 16),
    "batch_size": Int(min=1, max=10**7),
    "optimizer": Choice(OPTIMIZERS),
    "lr": Float(min=0.0, min_open=True),
    "momentum": Float(min=0.0, max=1.0, max_open=True),
    "nesterov": Flag(),
    "weight_decay": Float(min=0.0),
    "lr_schedule": Choice(LR_SCHEDULES),
    "loss": Choice(("cross_entropy", "squared")),
    "loss_reduction": Choice(("mean", "sum")),
    "dtype": Choice(("float32", "float16", "bfloat16", "float64")),
    "init": Choice(tuple(INITS)),
    "dataset": Text(),
    "data_opts": _DataOptions(),
    "preprocessing": Text(),
    "data_order": Text(),
    "split": Choice(("refdl", "own", "all")),
    "seed": Int(min=0, max=2**32 - 1),
    "microbatches": Int(min=1, max=1 << 16),
    "schedule": Choice(PIPELINE_SCHEDULES),
    "steps": Int(min=1, max=10**6),
    "hw": Text(),
    "framework": Text(),
    "framework_version": Text(),
    "start": Text(),
    "final_test_accuracy": Float(min=0.0, max=1.0),
    "final_params": Text(),
    "throughput": Choice(("per_step", "cumulative")),
}
CONFIG_KEYS = tuple(CONFIG_VALUES)
SET_KEYS = (*CONFIG_KEYS, "precision")  # --set's: parity's envelope reads the precision


@dataclasses.dataclass
class Log:
    """A log read and checked: rows sorted by step, the configuration, its format, and
    what was read from where (stated in the report)."""

    rows: list[dict[str, float]]
    config: dict[str, Any]
    format: str
    notes: list[str]


def _text(path: Path, what: str) -> str:
    """A regular file's text (not a FIFO or device: those would block or never end)."""
    return read_text(path, what, limit=MAX_BYTES)


def _number(text: str) -> int | float | str:
    """A CSV cell as an int or a float where it is one (else the text, refused later)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _names(scalars: str | None) -> dict[str, tuple[str, ...]]:
    """``NAMES`` with ``--scalars loss=TAG,...`` put first."""
    names = dict(NAMES)
    for item in filter(None, (scalars or "").split(",")):
        key, sep, tag = item.partition("=")
        if not sep or key.strip() not in NAMES or not tag.strip():
            raise UsageError(
                f"--scalars {scalars!r}: give QUANTITY=NAME pairs, QUANTITY one "
                f"of {', '.join(NAMES)}"
            )
        names[key.strip()] = (tag.strip(),)
    return names


def _pick(available: list[str], key: str, names: dict[str, tuple[str, ...]]) -> str | None:
    return next((n for n in names[key] if n in available), None)


def _jsonl(text: str) -> tuple[list[dict], dict]:
    rows, config = [], {}
    for line in text.splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError(f"a line is not an object: {line[:40]!r}")
        if "config" in obj:
            if not isinstance(obj["config"], dict):
                raise ValueError("config must be an object")
            config.update(obj["config"])
        else:
            rows.append(obj)
    return rows, config


def _csv(text: str, names: dict, notes: list[str]) -> tuple[list[dict], dict]:
    config: dict[str, Any] = {}
    lines = []
    for line in text.splitlines():
        if line.startswith("# config:"):
            given = json.loads(line.split(":", 1)[1])
            if not isinstance(given, dict):
                raise ValueError("the '# config:' line must hold a JSON object")
            config.update(given)
        elif line.strip() and not line.startswith("#"):
            lines.append(line)
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    header = [h.strip() for h in (reader.fieldnames or [])]
    columns = {key: col for key in NAMES if (col := _pick(header, key, names))}
    ignored = sorted(set(header) - set(columns.values()))
    notes.append(
        "CSV columns: "
        + ", ".join(f"{k} from {c!r}" for k, c in columns.items())
        + (f"; ignored: {', '.join(ignored)}" if ignored else "")
    )
    rows = []
    for r in reader:
        r = {(k or "").strip(): v for k, v in r.items()}
        rows.append(
            {key: _number(r[col]) for key, col in columns.items() if r.get(col) not in ("", None)}
        )
    return rows, config


def _events(path: Path, names: dict, notes: list[str]) -> list[dict]:
    from refdl.validate.tfevents import event_files, read_event_scalars  # (torch comes along)

    scalars, dropped = read_event_scalars(path)
    tags = {
        key: tag
        for key in ("loss", "test_accuracy", "samples_per_s")
        if (tag := _pick(list(scalars), key, names))
    }
    if "loss" not in tags:
        raise UsageError(
            f"--results {path}: no loss among the event file's scalar tags "
            f"({', '.join(sorted(scalars)) or 'none'}); name it with "
            "--scalars loss=TAG"
        )
    rows: dict[int, dict[str, float]] = {}
    for key, tag in tags.items():
        for s in scalars[tag]:
            row = rows.setdefault(s.step, {"step": s.step})
            row[key] = s.value
            if key == "loss":
                row["wall_time"] = s.wall_time
    files = len(event_files(path))
    notes.append(
        f"TensorBoard events ({files} file{'s' * (files > 1)}): "
        + ", ".join(f"{k} from tag {t!r}" for k, t in tags.items())
        + (f"; {dropped} partial last record dropped" if dropped else "")
    )
    return [rows[s] for s in sorted(rows)]


# Megatron-LM's training log line (megatron/training/training.py, training_log):
# " [date] iteration      100/  500000 | consumed samples: ... | lm loss: 7.339117E+00 | ..."
_MEGATRON_STEP = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_MEGATRON_LOSS = re.compile(r"\|\s*lm loss:\s*([-+0-9.eE]+|nan|inf)\s*\|", re.IGNORECASE)


def _megatron(text: str, notes: list[str]) -> list[dict]:
    """Megatron-LM's text log: one row per ``iteration N/ M | ... | lm loss: X |`` line."""
    rows = []
    for line in text.splitlines():
        step, loss = _MEGATRON_STEP.search(line), _MEGATRON_LOSS.search(line)
        if step and loss:
            rows.append({"step": int(step.group(1)), "loss": float(loss.group(1))})
    if not rows:
        raise ValueError("no 'iteration N/ M | ... | lm loss: X |' line (Megatron-LM's log)")
    notes.append(f"Megatron-LM text log: {len(rows)} 'iteration ... | lm loss' lines")
    return rows


def _trainer_state(state: dict, notes: list[str]) -> list[dict]:
    """Hugging Face Trainer's ``trainer_state.json``: the training entries of
    ``log_history`` (those with ``loss`` and ``step``; evaluation entries are skipped)."""
    history = state["log_history"]
    if not isinstance(history, list):
        raise ValueError("log_history must be a list")
    rows = [{"step": e["step"], "loss": e["loss"]} for e in history
            if isinstance(e, dict) and "loss" in e and "step" in e]  # fmt: skip
    notes.append(f"Hugging Face trainer_state.json: {len(rows)} log_history entries with a loss")
    return rows


def read_config(path: str) -> dict[str, Any]:
    """A TOML file of configuration keys (``--config``): a flat table, or a ``[config]``."""
    p = Path(path)
    try:
        data = tomllib.loads(_text(p, "--config"))
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise UsageError(f"--config {path}: not valid TOML ({e})") from None
    data = data.get("config", data)
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: [config] must be a table")
    return data


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs: VALUE read as JSON where it is one (numbers, true), else
    as text."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: give KEY=VALUE")
        if key.strip() not in SET_KEYS:  # a log may carry others; a typo here is ours
            raise UsageError(f"--set {key.strip()}: not a configuration key; known: "
                             f"{', '.join(SET_KEYS)}")  # fmt: skip
        if key.strip() in out:  # the last would win silently
            raise UsageError(f"--set gives {key.strip()} twice; give it once")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def read_log(
    path: str,
    config_file: str | None = None,
    sets: list[str] | None = None,
    scalars: str | None = None,
    rerun: bool = True,
) -> Log:
    """A framework's log (the module docstring), every value checked. The configuration
    is the file's own, then ``config_file``'s, then ``sets`` (a later one wins); it must
    name the model where refdl reruns it (``rerun``; a parity check reruns nothing)."""
    p = Path(path)
    names = _names(scalars)
    notes: list[str] = []
    config: dict[str, Any] = {}
    is_events = p.is_dir() or "tfevents" in p.name
    if not p.exists():
        raise UsageError(f"--results {path}: no such file")
    try:
        if is_events:
            fmt, rows = "tensorboard", _events(p, names, notes)
        elif p.suffix == ".json" and (state := _json_object(_text(p, "--results"))):
            fmt, rows = "trainer_state", _trainer_state(state, notes)
        elif p.suffix in (".jsonl", ".json"):
            fmt, (rows, config) = "jsonl", _jsonl(_text(p, "--results"))
        elif p.suffix == ".csv":
            fmt, (rows, config) = "csv", _csv(_text(p, "--results"), names, notes)
        elif p.suffix in (".log", ".txt", ".out"):
            fmt, rows = "megatron", _megatron(_text(p, "--results"), notes)
        else:
            raise UsageError(
                f"--results {path}: give a .jsonl or .csv file, a TensorBoard event file or "
                "folder, Megatron-LM's text log (.log, .txt, .out) or Hugging Face's "
                "trainer_state.json"
            )
    except UsageError:
        raise
    except (json.JSONDecodeError, ValueError, AttributeError, KeyError, RecursionError,
            csv.Error) as e:  # fmt: skip
        raise UsageError(f"--results {path}: cannot parse it ({e})") from None
    if config_file:
        config.update(read_config(config_file))
        notes.append(f"configuration from {config_file}")
    if sets:
        given = parse_sets(sets)
        config.update(given)
        notes.append(f"configuration set on the command line: {', '.join(given)}")
    return Log(_checked(rows, path), _checked_config(config, path, rerun), fmt, notes)


def _json_object(text: str) -> dict | None:
    """A ``.json`` file that is one object with a ``log_history`` (Hugging Face's Trainer
    state), else None (JSON lines)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and "log_history" in obj else None


def _checked(rows: list[dict], path: str) -> list[dict]:
    if not rows:
        raise UsageError(f"--results {path}: no rows of step and loss")
    for i, row in enumerate(rows, 1):
        for key in ("step", "loss"):
            if key not in row:
                raise UsageError(f"--results {path}: row {i} has no {key}")
        loss = row["loss"]
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            raise UsageError(f"--results {path}: row {i}: loss must be a number (got {loss!r})")
        for key, value in row.items():
            if key in ROW_VALUES and (problem := ROW_VALUES[key].problem(value)):
                raise UsageError(f"--results {path}: row {i}: {key} must be {problem}")
    return sorted(rows, key=lambda r: r["step"])


def _checked_config(config: dict[str, Any], path: str, rerun: bool = True) -> dict[str, Any]:
    for key, value in config.items():
        if key in CONFIG_VALUES and (problem := CONFIG_VALUES[key].problem(value)):
            raise UsageError(f"--results {path}: configuration {key} must be {problem}")
    if rerun and "model" not in config:
        raise UsageError(
            f"--results {path}: the configuration must name the model "
            "(in the log, --config FILE.toml or --set model=NAME)"
        )
    return config


RERUN_STEPS = 100_000  # the most steps a log's rerun takes (refdl validate's own --steps bound)
PARAMS_LIMIT = 16 << 30  # the largest final_params npz read


def params_path(log: str, name: str) -> Path:
    """Where a log's ``final_params`` is: relative to the log, unless absolute."""
    return Path(name) if Path(name).is_absolute() else Path(log).parent / name


def checked_log(path: str, config_file: str | None = None, sets: list[str] | None = None,
                scalars: str | None = None) -> tuple[Log, int]:  # fmt: skip
    """A log for ``--results`` with its checks that need no rerun (before JAX loads): the
    steps to rerun, at most ``RERUN_STEPS``; a ``final_params`` that is there must be a
    regular file (a FIFO would hang its reader)."""
    log = read_log(path, config_file, sets, scalars)
    config = log.config
    steps = int(config.get("steps", max(int(r["step"]) for r in log.rows) + 1))
    if steps > RERUN_STEPS:  # refused at once, not found out after hours of reruns
        whose = "configuration's steps" if "steps" in config else "last logged step"
        raise UsageError(
            f"--results {path}: its {whose} ask{'s' * (whose[-1] != 's')} for a rerun "
            f"of {steps:,} steps, more than the {RERUN_STEPS:,} refdl reruns; compare the "
            f"first N steps with --set steps=N"
        )
    if config.get("final_params") and os.path.lexists(params_path(path, config["final_params"])):
        check_regular(params_path(path, config["final_params"]),
                      f"--results {path}: final_params", PARAMS_LIMIT)  # fmt: skip
    return log, steps
