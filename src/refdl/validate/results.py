"""Validate a framework's own training log (``--results FILE``): rerun its configuration in
refdl, predict its step time with the performance model, and report the comparison."""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

from refdl import hw as hwmod
from refdl.config.choices import OPTIMIZERS, PIPELINE_SCHEDULES
from refdl.config.spec import RunSpec
from refdl.config.values import Choice, Float, Int, Text
from refdl.errors import UsageError
from refdl.perf import PredictOptions
from refdl.predict import predict_steps
from refdl.validate.exact import LOSS_RTOL, reference_run

# What a log may hold, declared with its value type (refdl.config.values).
ROW_VALUES = {
    "step": Int(min=0, max=10**9),
    "loss": Float(),
    "samples_per_s": Float(min=0.0, min_open=True),
}
CONFIG_VALUES = {
    "model": Text(),
    "strategy": Text(),
    "devices": Int(min=1, max=1 << 16),
    "batch_size": Int(min=1, max=10**7),
    "optimizer": Choice(OPTIMIZERS),
    "lr": Float(min=0.0, min_open=True),
    "dataset": Text(),
    "seed": Int(min=0, max=2**32 - 1),
    "microbatches": Int(min=1, max=1 << 16),
    "schedule": Choice(PIPELINE_SCHEDULES),
    "steps": Int(min=1, max=10**6),
    "hw": Text(),
}
CONFIG_KEYS = tuple(CONFIG_VALUES)


def read_log(path: str) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """A framework's log: rows of ``step, loss[, samples_per_s]`` and the configuration,
    every value checked against ``ROW_VALUES`` / ``CONFIG_VALUES``.

    JSONL: one object per line; a line ``{"config": {...}}`` gives the configuration.
    CSV: a header with ``step`` and ``loss`` (and optionally ``samples_per_s``); lines
    starting ``# config:`` carry the configuration as JSON.
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--results {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--results {path}: cannot read it as UTF-8 text ({e})") from None
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    try:
        if p.suffix in (".jsonl", ".json"):
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
        elif p.suffix == ".csv":
            lines = []
            for line in text.splitlines():
                if line.startswith("# config:"):
                    config.update(json.loads(line.split(":", 1)[1]))
                elif line.strip() and not line.startswith("#"):
                    lines.append(line)
            rows = [{k: _number(v) for k, v in r.items() if k and v not in ("", None)}
                    for r in csv.DictReader(lines)]  # fmt: skip
        else:
            raise UsageError(f"--results {path}: give a .csv or .jsonl file")
    except UsageError:
        raise
    except (json.JSONDecodeError, ValueError, AttributeError) as e:
        raise UsageError(f"--results {path}: cannot parse it ({e})") from None
    if not rows:
        raise UsageError(f"--results {path}: no rows of step and loss")
    for i, row in enumerate(rows, 1):
        for key in ("step", "loss"):
            if key not in row:
                raise UsageError(f"--results {path}: row {i} has no {key}")
        for key, value in row.items():
            if key in ROW_VALUES and (problem := ROW_VALUES[key].problem(value)):
                raise UsageError(f"--results {path}: row {i}: {key} must be {problem}")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise UsageError(
            f"--results {path}: unknown configuration keys {unknown}; "
            f"known: {', '.join(CONFIG_KEYS)}"
        )
    for key, value in config.items():
        if problem := CONFIG_VALUES[key].problem(value):
            raise UsageError(f"--results {path}: configuration {key} must be {problem}")
    if "model" not in config:
        raise UsageError(f"--results {path}: the configuration must name the model")
    rows.sort(key=lambda r: r["step"])
    return rows, config


def _number(text: str) -> int | float | str:
    """A CSV cell as an int or a float where it is one (else the text, refused later)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def results_report(args: argparse.Namespace) -> dict[str, Any]:
    """Compare a framework's log with a refdl run of its configuration and a prediction."""
    rows, config = read_log(args.results)
    steps = int(config.get("steps", max(int(r["step"]) for r in rows) + 1))
    strategy = config.get("strategy", "single")
    devices = int(config.get("devices", 1))
    kw = {k: config[k] for k in ("optimizer", "lr", "dataset", "microbatches", "schedule")
          if k in config}  # fmt: skip
    spec = RunSpec(
        strategy=strategy,
        model=config["model"],
        steps=steps,
        batch_size=int(config.get("batch_size", 64)),
        seed=int(config.get("seed", 0)),
        devices=devices,
        progress=False,
        **kw,
    )
    ref = reference_run(spec)
    theirs = {int(r["step"]): r for r in rows}
    compared = [(t, ref.losses[t], theirs[t]["loss"]) for t in range(steps) if t in theirs]
    diffs = [abs(a - b) for _, a, b in compared]
    rels = [d / max(abs(a), 1e-12) for d, (_, a, _) in zip(diffs, compared, strict=True)]
    hw_name = config.get("hw", args.hw)
    profile = hwmod.load(hw_name)
    opts = PredictOptions(microbatches=ref.spec.microbatches, schedule=ref.spec.schedule)
    pred = predict_steps(hw_name, strategy, ref.spec.model, ref.spec.batch_size, [devices],
                         "strong", opts)[0]  # fmt: skip
    sps = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
    refdl_sps = ref.spec.batch_size / statistics.median(ref.step_times[1:] or ref.step_times)
    their_sps = statistics.median(sps) if sps else None
    return {
        "log": str(args.results),
        "config": config,
        "steps_compared": len(compared),
        "loss_max_abs_diff": max(diffs) if diffs else None,
        "loss_max_rel_diff": max(rels) if rels else None,
        "final_loss": {"framework": compared[-1][2], "refdl": compared[-1][1]}
        if compared
        else None,
        "loss_rows": [{"step": t, "refdl": a, "framework": b} for t, a, b in compared],
        "samples_per_s": {
            "framework": their_sps,
            "refdl_here": refdl_sps,
            "predicted": pred["throughput"],
            "predicted_hw": profile.name,
            "framework_vs_predicted": (their_sps / pred["throughput"]) if their_sps else None,
        },
        "predicted_step_time_s": pred["step_time_s"],
        "tolerance": {"loss_rel": args.loss_rtol or LOSS_RTOL.get(ref.spec.model, 1e-4)},
        "passed": bool(rels)
        and max(rels) <= (args.loss_rtol or LOSS_RTOL.get(ref.spec.model, 1e-4)),
    }


def write_report(r: dict[str, Any], out: Path) -> None:
    """``report.json`` and ``report.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(r, indent=2) + "\n")
    s = r["samples_per_s"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
    lines = [
        f"# Validation of `{r['log']}`",
        "",
        f"Configuration: `{json.dumps(r['config'])}`",
        "",
        "| | value |",
        "|---|---|",
        f"| steps compared | {r['steps_compared']} |",
        f"| max |loss difference| | {fmt(r['loss_max_abs_diff'])} |",
        f"| max relative loss difference | {fmt(r['loss_max_rel_diff'])} "
        f"(tolerance {r['tolerance']['loss_rel']:g}) |",
        f"| framework samples/s (median) | {fmt(s['framework'])} |",
        f"| refdl samples/s here | {fmt(s['refdl_here'])} |",
        f"| predicted samples/s on `{s['predicted_hw']}` | {fmt(s['predicted'])} |",
        f"| framework / predicted | {fmt(s['framework_vs_predicted'])} |",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}**: the framework's losses "
        + ("match" if r["passed"] else "do not match")
        + " refdl's reference run of the same configuration.",
        "",
        "| step | refdl loss | framework loss |",
        "|---:|---:|---:|",
        *[f"| {x['step']} | {x['refdl']:.6f} | {x['framework']:.6f} |" for x in r["loss_rows"]],
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
