"""Validate a framework's own training log (``--results FILE``) as users have it.

Which comparison is made follows from what the log declares (the report says
which and why):

- **exact**, when its configuration carries ``"start"``: the fingerprint of
  refdl's exported start (``refdl validate --export-start DIR``) for the same
  configuration. Both sides then began from the same weights and saw the same
  batches, so per-step losses (and, with ``final_params``, the final weights)
  are compared at fp32 tolerances;
- **statistical** otherwise (``refdl.validate.statistical``): refdl reruns the
  configuration over ``--seeds`` seeds, from the log's declared initialisation,
  and places the framework's curve and final accuracy in that spread.

The configuration names what changes results (``CONFIG_VALUES``): the data set
and its preprocessing, initialisation, optimizer details, loss reduction, dtype.
Keys a log leaves out are listed as the assumptions refdl made; keys it does not
know are warnings. Throughput is put in context: the framework's samples/s, refdl's
on this machine, and the performance model's prediction for the declared profile.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from refdl import hw as hwmod
from refdl.config.choices import LR_SCHEDULES, OPTIMIZERS, PIPELINE_SCHEDULES
from refdl.config.spec import RunSpec
from refdl.config.values import Choice, Flag, Float, Int, Text
from refdl.errors import UsageError
from refdl.perf import PredictOptions
from refdl.predict import predict_steps
from refdl.validate import statistical
from refdl.validate.exact import LOSS_RTOL, PARAM_RTOL, compare_params, reference_run
from refdl.validate.export import start_of, start_spec

# What a log may hold, declared with its value type (refdl.config.values).
ROW_VALUES = {
    "step": Int(min=0, max=10**9),
    "loss": Float(),
    "samples_per_s": Float(min=0.0, min_open=True),
    "test_accuracy": Float(min=0.0, max=1.0),
}
INITS = {"refdl": "lecun_normal", "lecun_normal": "lecun_normal", "torch": "torch",
         "torch_default": "torch", "keras": "keras", "keras_default": "keras",
         "glorot_uniform": "keras"}  # fmt: skip
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
    "preprocessing": Text(),
    "data_order": Text(),
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
}
CONFIG_KEYS = tuple(CONFIG_VALUES)
# Keys that change results: when a log leaves one out, the report names what refdl assumed.
ASSUMED = {
    "dataset": "the model's default data set",
    "preprocessing": "refdl's preprocessing of that data set",
    "init": "refdl's lecun_normal (the log's framework may draw otherwise)",
    "optimizer": "the model's default optimizer",
    "lr": "the model's default learning rate",
    "momentum": "0.9",
    "weight_decay": "0",
    "lr_schedule": "constant",
    "loss": "cross_entropy",
    "loss_reduction": "mean over the batch",
    "dtype": "float32",
    "batch_size": "64",
}


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
    for key, value in config.items():
        if key in CONFIG_VALUES and (problem := CONFIG_VALUES[key].problem(value)):
            raise UsageError(f"--results {path}: configuration {key} must be {problem}")
    if "model" not in config:
        raise UsageError(f"--results {path}: the configuration must name the model")
    rows.sort(key=lambda r: r["step"])
    return rows, config


def declared(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(assumptions, warnings)``: the result-changing keys the log leaves out (with what
    refdl assumed), and the keys it gives that refdl does not know or cannot honour."""
    assumptions = [f"{k} not given: assumed {v}" for k, v in ASSUMED.items() if k not in config]
    framework = str(config.get("framework", "")).lower()
    own = {"torch": "torch_default", "pytorch": "torch_default", "tensorflow": "keras_default",
           "keras": "keras_default"}.get(framework)  # fmt: skip
    if "init" not in config and own:
        assumptions = [a + f"; a {framework} run starts from its framework's own draws unless "
                       f"it loads other weights: declare \"init\": \"{own}\""
                       if a.startswith("init ") else a for a in assumptions]  # fmt: skip
    warnings = [f"unknown configuration key {k!r} (ignored); known: {', '.join(CONFIG_KEYS)}"
                for k in sorted(set(config) - set(CONFIG_KEYS))]  # fmt: skip
    if config.get("dtype", "float32") != "float32":
        warnings.append(f"dtype {config['dtype']}: refdl's reference runs float32")
    if config.get("loss_reduction") == "sum":
        warnings.append("loss_reduction sum: refdl runs the mean with lr x batch_size "
                        "(the same SGD steps)")  # fmt: skip
    return assumptions, warnings


def _number(text: str) -> int | float | str:
    """A CSV cell as an int or a float where it is one (else the text, refused later)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _spec(config: dict[str, Any], steps: int) -> RunSpec:
    """refdl's single-device run of the log's configuration (for the seeds)."""
    kw: dict[str, Any] = {}
    for key in ("dataset", "lr", "momentum", "weight_decay", "lr_schedule", "loss"):
        if key in config:
            kw[key] = config[key]
    if "optimizer" in config:
        nesterov = config.get("nesterov") and config["optimizer"] == "momentum"
        kw["optimizer"] = "nesterov" if nesterov else config["optimizer"]
    if config.get("loss_reduction") == "sum" and "lr" in config:
        kw["lr"] = config["lr"] * int(config.get("batch_size", 64))
    kw["init"] = INITS[config.get("init", "refdl")]
    return RunSpec(strategy="single", model=config["model"], steps=steps,
                   batch_size=int(config.get("batch_size", 64)), seed=int(config.get("seed", 0)),
                   progress=False, **kw)  # fmt: skip


def _choose(config: dict[str, Any], steps: int) -> tuple[str, str]:
    """``(comparison, why)`` from what the log declares."""
    start = config.get("start")
    if not start:
        return "statistical", (
            'the log declares no exported start ("start"), so its initial weights and '
            "batches are its own: refdl reruns the configuration with several seeds and "
            "compares the spread"
        )
    mine = start_of(start_spec({**config, "steps": steps}))[3]
    if mine == start:
        return "exact", (
            f"the log's start {start} is refdl's exported start of this "
            "configuration: same weights, same batches, compared step by step"
        )
    return "statistical", (
        f"the log declares start {start}, but refdl's export of this configuration is "
        f"{mine} (model, data set, seed, batch size or steps differ): compared statistically"
    )


def _throughput(rows: list[dict], config: dict[str, Any], args: argparse.Namespace,
                refdl_sps: float, spec: RunSpec) -> dict[str, Any]:  # fmt: skip
    """The framework's samples/s beside refdl's here and the prediction, with a sentence."""
    hw_name = config.get("hw", args.hw)
    profile = hwmod.load(hw_name)
    devices = int(config.get("devices", 1))
    strategy = config.get("strategy", "single")
    opts = PredictOptions(microbatches=spec.microbatches or 1, schedule=spec.schedule)
    pred = predict_steps(hw_name, strategy if strategy in ("single", "data") else "single",
                         spec.model, spec.batch_size, [devices], "strong", opts)[0]  # fmt: skip
    sps = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
    theirs = statistics.median(sps) if sps else None
    if theirs is None:
        note = "The log gives no samples/s."
    else:
        to_pred, to_here = theirs / pred["throughput"], theirs / refdl_sps
        if hw_name == "local":
            note = (
                f"The framework ran at {to_here:.2f}x refdl's speed on this machine and "
                f"{to_pred:.2f}x the prediction for it; "
            )
            note += (
                "plausible for one machine."
                if 0.25 <= to_here <= 4
                else "far from refdl's here: was it measured on other hardware than declared?"
            )
        else:
            note = f"The framework ran at {to_pred:.2f}x the prediction for {profile.name}; "
            note += ("plausible for that profile." if 0.2 <= to_pred <= 1.25 else
                     "faster than the prediction: the declared profile may be wrong."
                     if to_pred > 1.25 else
                     "well below the prediction: an input pipeline or synchronisation "
                     "may bound it, or the hardware differs.")  # fmt: skip
    return {"framework": theirs, "refdl_here": refdl_sps, "predicted": pred["throughput"],
            "predicted_hw": profile.name,
            "framework_vs_predicted": (theirs / pred["throughput"]) if theirs else None,
            "note": note}  # fmt: skip


def results_report(args: argparse.Namespace) -> dict[str, Any]:
    """Compare a framework's log with refdl: exactly from an exported start, else over
    seeds (the module docstring); throughput in context; assumptions and warnings."""
    rows, config = read_log(args.results)
    steps = int(config.get("steps", max(int(r["step"]) for r in rows) + 1))
    assumptions, warnings = declared(config)
    comparison, why = _choose(config, steps)
    theirs = {int(r["step"]): float(r["loss"]) for r in rows}
    accs = [r["test_accuracy"] for r in rows if "test_accuracy" in r]
    final_acc = config.get("final_test_accuracy", accs[-1] if accs else None)
    out: dict[str, Any] = {
        "log": str(args.results),
        "config": config,
        "comparison": comparison,
        "why": why,
        "assumptions": assumptions,
        "warnings": warnings,
    }
    if comparison == "exact":
        spec = start_spec({**config, "steps": steps})
        ref = reference_run(spec)
        compared = [(t, ref.losses[t], theirs[t]) for t in range(steps) if t in theirs]
        # Relative to the larger of the step's and the first loss: fp32 differences grow
        # with the steps while the loss falls (200 steps of the mlp: 1.5e-5 on a loss of
        # 0.036 at the end, 4e-4 of it, 6e-6 of the first loss).
        scale = abs(ref.losses[0])
        rels = [abs(a - b) / max(abs(a), scale, 1e-12) for _, a, b in compared]
        tol = {"loss_rel": args.loss_rtol or LOSS_RTOL.get(spec.model, 1e-4)}
        failed = [] if rels and max(rels) <= tol["loss_rel"] else ["loss_rel"]
        out.update(
            steps_compared=len(compared),
            loss_max_rel_diff=max(rels) if rels else None,
            loss_max_abs_diff=max((abs(a - b) for _, a, b in compared), default=None),
            loss_rows=[{"step": t, "refdl": a, "framework": b} for t, a, b in compared],
        )
        if config.get("final_params"):
            params = _final_params(args.results, config["final_params"])
            d = compare_params(ref.params, params)
            tol["param_rel_l2"] = args.param_rtol or PARAM_RTOL.get(spec.model, 1e-4)
            out["param_rel_l2_diff"] = d["rel_l2"]
            if not d["rel_l2"] <= tol["param_rel_l2"]:
                failed.append("param_rel_l2")
        refdl_sps = spec.batch_size / statistics.median(ref.step_times[1:] or ref.step_times)
        out.update(tolerance=tol, failed=failed, passed=not failed,
                   rule="passed when every logged step's |loss difference| is within the "
                   "tolerance times the larger of refdl's loss at that step and at the first "
                   "(and the final parameters, when given, within theirs)")  # fmt: skip
    else:
        spec = _spec(config, steps)
        seeds = statistical.seed_runs(spec, args.seeds)
        stats = statistical.compare(theirs, final_acc, seeds)
        refdl_sps = seeds.samples_per_s
        out.update(stats)
        out["init"] = spec.init
    out["samples_per_s"] = _throughput(rows, config, args, refdl_sps, spec)
    return out


def _final_params(log: str, name: str) -> dict[str, np.ndarray]:
    """The final weights a log points to (an npz in refdl's layout, relative to the log)."""
    path = Path(name) if Path(name).is_absolute() else Path(log).parent / name
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise UsageError(f"--results {log}: final_params {name}: cannot read it ({e})") from None


def summary_line(r: dict[str, Any]) -> str:
    """One line: which comparison, the verdict and its main figure."""
    verdict = "PASSED" if r["passed"] else "FAILED"
    if r["comparison"] == "exact":
        return (f"{r['log']}: exact comparison, {r['steps_compared']} steps, max relative loss "
                f"difference {r['loss_max_rel_diff']:.2e} (tolerance "
                f"{r['tolerance']['loss_rel']:g}): {verdict}")  # fmt: skip
    first, acc = r["first_departure"], r["final_test_accuracy"]
    where = ("inside refdl's seed band at every logged step" if first is None else
             f"leaves refdl's seed band at step {first['step']} ({first['side']}, "
             f"{abs(first['beyond']):.0%} beyond)"
             + (f", outside from step {r['outside_from_step']} on"
                if r["outside_from_step"] is not None else ""))  # fmt: skip
    acc_text = ("" if acc["framework"] is None else
                f"; final test accuracy {acc['framework']:.3f} (refdl {acc['refdl_min']:.3f}-"
                f"{acc['refdl_max']:.3f})")  # fmt: skip
    return (
        f"{r['log']}: statistical comparison over {r['seeds']} seeds, {where}{acc_text}: {verdict}"
    )


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
        f"**Comparison: {r['comparison']}**, because {r['why']}.",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}** - rule: {r['rule']}."
        + (f" Failed: {', '.join(r['failed'])}." if r["failed"] else ""),
        "",
        summary_line(r),
        "",
    ]
    if r["assumptions"]:
        lines += ["Assumed (the log does not say):", "", *[f"- {a}" for a in r["assumptions"]], ""]
    if r["warnings"]:
        lines += ["Warnings:", "", *[f"- {w}" for w in r["warnings"]], ""]
    lines += [
        "| throughput | samples/s |",
        "|---|---|",
        f"| framework (median of the log) | {fmt(s['framework'])} |",
        f"| refdl on this machine | {fmt(s['refdl_here'])} |",
        f"| predicted for `{s['predicted_hw']}` | {fmt(s['predicted'])} |",
        "",
        s["note"],
        "",
    ]
    if r["comparison"] == "exact":
        lines += ["| step | refdl loss | framework loss |", "|---:|---:|---:|",
                  *[f"| {x['step']} | {x['refdl']:.6f} | {x['framework']:.6f} |"
                    for x in r["loss_rows"]]]  # fmt: skip
    else:
        acc, tt = r["final_test_accuracy"], r["time_to_target"]
        lines += [
            f"Band: {r['band_rule']}, smoothed over {r['smoothing_window_steps']} steps, "
            f"{r['seeds']} seeds from refdl's `{r['init']}` initialisation.",
            "",
            f"- logged steps outside the band: {r['steps_outside_band']} of "
            f"{r['steps_compared']}; final smoothed loss {fmt(r['final_loss']['framework'])} "
            f"(refdl mean {r['final_loss']['refdl_mean']:.4g}, band "
            f"{r['final_loss']['band'][0]:.4g}-{r['final_loss']['band'][1]:.4g})",
            f"- final test accuracy: {fmt(acc['framework'])} (refdl mean {acc['refdl_mean']:.4f},"
            f" range {acc['refdl_min']:.4f}-{acc['refdl_max']:.4f}, floor {acc['floor']:.4f}"
            + (f", z {acc['z']:.2f}" if acc["z"] is not None else "") + ")",
            f"- steps to loss {tt['target_loss']:.4g} (refdl's mean halfway): framework "
            f"{fmt(tt['framework_step'])}, refdl {tt['refdl_step']}",
            "",
            "| step | framework (smoothed) | band low | band high |",
            "|---:|---:|---:|---:|",
            *[f"| {x['step']} | {x['framework']:.4f} | {x['lo']:.4f} | {x['hi']:.4f} |"
              for x in r["band_rows"]],
        ]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
