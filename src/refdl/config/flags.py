"""The command line, made from ``RunSpec``'s fields, and settings files in the same words.

Every flag of ``refdl train`` is a RunSpec field: its type, default, help, section and
choices are read from the field's metadata (``refdl.config.spec.option``), so an
option is declared once and ``--help`` shows the default the run will use. Every
option defaults to "not given" so that a resumed run knows what was set.
``--config FILE`` reads the same settings from a TOML file (field names as keys)
or a run folder's ``config.json``; flags given beside it override it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from refdl.config.files import load_json, load_toml
from refdl.config.spec import OUTPUT_KEYS, RunSpec, flag, parse_pairs
from refdl.config.values import Choice, Flag, Float, Int, Optional, Pairs
from refdl.errors import UsageError


def inner(value: Any) -> Any:
    return value.inner if isinstance(value, Optional) else value


def flag_of(field: dataclasses.Field) -> str:
    """The flag a RunSpec field has on the command line."""
    return field.metadata.get("flag") or flag(field.name)


def _help(field: dataclasses.Field) -> str:
    text = field.metadata["help"]
    if "(default" in text or "default:" in text:  # the help says the default in words
        return text
    if isinstance(field.metadata["value"], Flag):
        return text if field.default else f"{text} (default: off)"
    return f"{text} (default {field.default})"


def add_run_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per RunSpec field (``only`` those named), in its section of ``--help``."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(RunSpec):
        if only is not None and f.name not in only:
            continue
        meta, value = f.metadata, inner(f.metadata["value"])
        title = meta.get("group") or "options"
        group = groups.setdefault(title, parser.add_argument_group(title))
        kw: dict[str, Any] = {"help": _help(f), "dest": f.name}
        if isinstance(value, Flag):
            kw["action"] = "store_false" if f.default else "store_true"
        elif isinstance(value, Pairs):
            kw.update(action="append", metavar=meta.get("metavar") or "KEY=VALUE")
        else:
            kw["type"] = (
                int if isinstance(value, Int) else float if isinstance(value, Float) else str
            )
            if isinstance(value, Choice):
                kw["metavar"] = "{" + ",".join(value.options) + "}"
            if meta.get("metavar"):
                kw["metavar"] = meta["metavar"]
        group.add_argument(flag_of(f), **kw)


def _pairs(value: Any, where: str) -> list[list[str]]:
    """A file's options (``model_opts``) as ``[key, value]`` pairs: a table
    (``[model_opts]`` then ``hidden = 128``), a list of ``"KEY=VALUE"`` strings as the
    flags give them, or a list of ``[key, value]`` pairs (a run's ``config.json``)."""
    if isinstance(value, dict):
        return [[str(k), str(v)] for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [list(p) for p in parse_pairs(value, where)]
    pair = (list, tuple)
    if isinstance(value, list) and all(isinstance(v, pair) and len(v) == 2 for v in value):
        return [[str(k), str(v)] for k, v in value]
    raise UsageError(f"{where} must be a table ([{where.rsplit(' ', 1)[-1]}] then KEY = VALUE "
                     f'lines) or a list of "KEY=VALUE" strings (got {value!r})')  # fmt: skip


def file_settings(path: str) -> dict[str, Any]:
    """The settings of ``--config FILE``: a TOML table of RunSpec fields, or a run
    folder's ``config.json``. Unknown keys are refused; values equal to a field's default
    are dropped (they set nothing). Where a run writes comes from the command line only:
    a TOML file naming it is refused, a run's record has it dropped."""
    record = path.endswith(".json")
    table = load_json(Path(path), "--config") if record else load_toml(Path(path), "--config")
    if not isinstance(table, dict):
        raise UsageError(f"--config {path}: not a table of settings")
    fields = {f.name: f for f in dataclasses.fields(RunSpec)}
    unknown = sorted(k for k in table if k not in fields)
    if unknown:
        raise UsageError(
            f"--config {path}: unknown setting {unknown[0]!r}; the keys are those of a run's "
            "config.json, mostly the long flags' names with underscores (batch_size, lr; "
            "model_opts for --model-opt, progress = false for --no-progress)"
        )
    out = {}
    for key, value in table.items():
        if key in OUTPUT_KEYS:
            if record or value in (None, False):
                continue
            raise UsageError(
                f"--config {path}: {key!r} says where a run writes, which only the command "
                f"line says; give {flag(key)} instead"
            )
        if isinstance(inner(fields[key].metadata["value"]), Pairs):
            value = _pairs(value, f"--config {path}: {key}")
        if value != fields[key].default and value is not None:
            out[key] = value
    return RunSpec.settings(out, f"--config {path}")
