"""``python -m refdl.validate``: check another framework against refdl.

Two modes:

- ``--framework torch --strategy single|data|pipeline --model M --steps N``
  trains the same model from the same initial weights on the same batches with
  the same optimizer and learning rates in refdl and in PyTorch (plain,
  ``DistributedDataParallel`` over gloo, or ``torch.distributed.pipelining``),
  and reports the per-step loss difference, the final parameter difference
  (max abs, relative L2) and Deep500's error metrics. Exit status 1 when a
  tolerance is exceeded.
- ``--results FILE [--hw PROFILE]`` reads a framework's own training log (CSV or
  JSONL of step, loss, samples/s and the configuration), reruns that
  configuration in refdl, predicts its step time with the performance model,
  and writes a report (markdown and JSON).

Examples::

    .venv/bin/python -m refdl.validate --framework torch --strategy data --model lenet5 \
        --steps 20 --json
    .venv/bin/python -m refdl.validate --strategy pipeline --model resnet --schedule gpipe
    .venv/bin/python -m refdl.validate --results torch_log.jsonl --hw local --report out/

Exit status: 0 passed; 1 a difference exceeded its tolerance; 2 bad input.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

PROG = "refdl.validate"
STRATEGIES = ("single", "data", "pipeline")

# fp32 tolerances (README, "Cross-framework validation"). Two tight checks hold for
# every model: the first step's loss (the forward pass) and the parameters after the
# first update (backward pass and optimizer) agree to FIRST_STEP_RTOL. Over N steps,
# rounding differences grow with the model's sensitivity, so the trajectory's
# tolerances (parameters' relative L2, per-step loss) are per model, set above the
# differences measured over 20 steps: mlp/lenet5 ~5e-8; lstm_lm (Adam) 1.3e-4 (the
# same distance refdl keeps from a float64 run); resnet 2e-2 (ResNet-20 with BatchNorm
# at lr 0.05 amplifies a 1e-7 difference ~1.8x per step: float32 PyTorch and refdl
# each drift from float64 PyTorch by 1e-3 and 2e-2 by step 20).
FIRST_STEP_RTOL = 1e-5
PARAM_RTOL = {"mlp": 1e-4, "lenet5": 1e-4, "lstm_lm": 1e-3, "resnet": 1e-1}
LOSS_RTOL = {"mlp": 1e-4, "lenet5": 1e-4, "lstm_lm": 1e-3, "resnet": 0.25}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=f"python -m {PROG}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--framework", default="torch", choices=["torch"])
    p.add_argument("--strategy", default="single", help="single, data or pipeline")
    p.add_argument("--model", default="lenet5", help="mlp, lenet5, resnet or lstm_lm")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, help="workers/stages (default: 1 single, 2 otherwise)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, help="pipeline microbatches (default 4)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe or 1f1b")
    p.add_argument("--optimizer", help="sgd, momentum, nesterov or adam (default: the model's)")
    p.add_argument("--lr", type=float, help="learning rate (default: the model's)")
    p.add_argument("--dataset", help="default: the model's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param-rtol", type=float,
                   help="largest relative L2 difference of the final parameters "
                        "(default: per model, see README)")  # fmt: skip
    p.add_argument(
        "--loss-rtol",
        type=float,
        help="largest per-step |loss difference| / |refdl loss| (default: per model)",
    )
    p.add_argument(
        "--first-step-rtol",
        type=float,
        default=FIRST_STEP_RTOL,
        help="tolerance of the first loss and of the parameters after one update",
    )
    p.add_argument("--perturb", type=float, default=0.0,
                   help="add this relative noise to the PyTorch side's initial weights "
                        "(checks that the check can fail)")  # fmt: skip
    p.add_argument("--torch-batchnorm", default="composite", choices=["composite", "native"],
                   help="PyTorch side's BatchNorm: the adapter's (tensor ops) or "
                        "torch.nn.BatchNorm2d (loses precision on CPU; see README)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600, help="seconds for the PyTorch workers")
    p.add_argument("--results", help="a framework's log (CSV or JSONL) to compare with refdl")
    p.add_argument("--hw", default="local", help="hardware profile for --results' prediction")
    p.add_argument("--report", help="with --results: directory for report.md and report.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


# ----------------------------------------------------------------------------- metrics


def deep500_errors(reference: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Deep500's ``NormDifference`` family on two flattened tensors: ``NormDifference``
    (ord 1, Deep500's L1Error), ``L2Error`` (ord 2) and ``MaxError`` (ord inf) of
    ``reference - other`` (Ben-Nun et al. 2019, deep500/metrics/test_metrics.py)."""
    d = (np.asarray(reference, np.float64) - np.asarray(other, np.float64)).ravel()
    return {
        "NormDifference": float(np.linalg.norm(d, 1)),
        "L2Error": float(np.linalg.norm(d, 2)),
        "MaxError": float(np.linalg.norm(d, np.inf)) if d.size else 0.0,
    }


def compare_params(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict:
    """Global and per-tensor differences of two parameter sets with the same paths."""
    missing = sorted(set(reference) ^ set(other))
    if missing:
        raise ValueError(f"parameter paths differ: {missing[:5]}")
    keys = sorted(reference)
    a = np.concatenate([np.asarray(reference[k], np.float64).ravel() for k in keys])
    b = np.concatenate([np.asarray(other[k], np.float64).ravel() for k in keys])
    per = {}
    for k in keys:
        r, o = np.asarray(reference[k], np.float64), np.asarray(other[k], np.float64)
        norm = float(np.linalg.norm(r)) or 1.0
        per[k] = float(np.linalg.norm(r - o) / norm)
    worst = max(per, key=per.get)
    errs = deep500_errors(a, b)
    return {
        "max_abs": errs["MaxError"],
        "rel_l2": errs["L2Error"] / (float(np.linalg.norm(a)) or 1.0),
        "deep500": errs,
        "worst_tensor": worst,
        "worst_tensor_rel_l2": per[worst],
        "count": int(a.size),
    }


# ----------------------------------------------------------------------------- refdl side


@dataclasses.dataclass
class Reference:
    """A refdl run kept in memory: per-step losses, initial and final parameters."""

    spec: Any
    losses: list[float]
    init_params: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    first_params: dict[str, np.ndarray]  # after the first update
    batches: list[dict[str, np.ndarray]]
    lrs: list[float]
    boundaries: list[int] | None
    plan: Any
    step_times: list[float]


def reference_run(spec: Any) -> Reference:
    """Run ``spec`` for ``spec.steps`` steps with refdl, keeping what the other side needs."""
    import time

    import jax

    from refdl.adapters.torch import ModelPlan, flatten
    from refdl.core.state import to_host
    from refdl.loop import build, global_batch

    run = build(spec)
    strategy = run.strategy
    init = flatten(jax.device_get(run.task.init_state(run.spec.seed).params))
    state = strategy.init_state(run.spec.seed)
    losses, batches, times = [], [], []
    for t in range(run.spec.steps):
        batch = global_batch(run, t)
        batches.append(batch)
        t0 = time.perf_counter()
        state, metrics = strategy.train_step(state, batch)
        losses.append(float(np.mean(to_host(metrics["loss"]))))
        times.append(time.perf_counter() - t0)
        if t == 0:
            first = flatten(jax.device_get(strategy.gather_params(state)))
    params = flatten(jax.device_get(strategy.gather_params(state)))
    lrs = [float(run.schedule(t)) for t in range(run.spec.steps)]
    return Reference(
        spec=run.spec,
        losses=losses,
        init_params=init,
        params=params,
        first_params=first,
        batches=batches,
        lrs=lrs,
        boundaries=list(getattr(strategy, "boundaries", [])) or None,
        plan=ModelPlan.of(run.task.model, run.task.sample_x),
        step_times=times,
    )


def torch_run(
    ref: Reference, strategy: str, devices: int, perturb: float, timeout: float,
    native_bn: bool = False,
) -> Any:  # fmt: skip
    """The same training in PyTorch (``refdl.adapters.torch``)."""
    from refdl.adapters import torch as adapter

    init = dict(ref.init_params)
    if perturb:
        rng = np.random.default_rng(1)
        init = {k: v + perturb * np.abs(v).mean() * rng.standard_normal(v.shape).astype(v.dtype)
                for k, v in init.items()}  # fmt: skip
    s = ref.spec
    plan = adapter.TrainPlan(
        model=ref.plan,
        params=init,
        batches=tuple(ref.batches),
        lrs=tuple(ref.lrs),
        optimizer=s.optimizer,
        momentum=s.momentum,
        weight_decay=s.weight_decay,
        loss=s.loss,
        native_bn=native_bn,
    )
    if strategy == "single":
        return adapter.train_single(plan)
    if strategy == "data":
        return adapter.train_ddp(plan, devices, timeout)
    return adapter.train_pipeline(plan, ref.boundaries, s.microbatches, s.schedule, timeout)


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides of one configuration, compared; ``passed`` says whether within tolerance."""
    from refdl.adapters import torch as adapter
    from refdl.errors import UsageError
    from refdl.spec import RunSpec

    adapter.require()
    if args.strategy not in STRATEGIES:
        raise UsageError(
            f"validate compares --strategy {', '.join(STRATEGIES)} with PyTorch; "
            f"not {args.strategy!r}"
        )
    if args.model not in ("mlp", "lenet5", "resnet", "lstm_lm"):
        raise UsageError(
            f"the torch adapter covers --model mlp, lenet5, resnet and lstm_lm; not {args.model!r}"
        )
    if args.strategy == "pipeline" and args.schedule not in ("gpipe", "1f1b"):
        raise UsageError("--schedule must be gpipe or 1f1b (PyTorch's pipelining twins)")
    if args.strategy == "data" and args.torch_batchnorm == "native":
        raise UsageError(adapter.NATIVE_DDP_REFUSED)  # before the reference run, not after
    devices = args.devices or (1 if args.strategy == "single" else 2)
    if args.strategy == "single" and devices != 1:
        raise UsageError("--strategy single runs on 1 device; drop --devices")
    kw: dict[str, Any] = {}
    for name in ("optimizer", "lr", "dataset", "microbatches"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.strategy == "pipeline":
        kw["schedule"] = args.schedule
    spec = RunSpec(
        strategy=args.strategy,
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        devices=devices,
        progress=False,
        **kw,
    )
    ref = reference_run(spec)
    other = torch_run(
        ref, args.strategy, devices, args.perturb, args.timeout,
        args.torch_batchnorm == "native",
    )  # fmt: skip
    loss_diff = [abs(a - b) for a, b in zip(ref.losses, other.losses, strict=True)]
    loss_rel = [d / max(abs(a), 1e-12) for d, a in zip(loss_diff, ref.losses, strict=True)]
    params = compare_params(ref.params, other.params)
    first = compare_params(ref.first_params, other.first_params)
    tol = {
        "first_loss_rel": args.first_step_rtol,
        "first_update_param_rel_l2": args.first_step_rtol,
        "param_rel_l2": args.param_rtol or PARAM_RTOL[args.model],
        "loss_rel": args.loss_rtol or LOSS_RTOL[args.model],
    }
    checks = {
        "first_loss_rel": loss_rel[0],
        "first_update_param_rel_l2": first["rel_l2"],
        "param_rel_l2": params["rel_l2"],
        "loss_rel": max(loss_rel),
    }
    failed = [k for k in checks if not checks[k] <= tol[k]]
    s = ref.spec
    return {
        "framework": "torch",
        "strategy": args.strategy,
        "model": args.model,
        "dataset": s.dataset,
        "devices": devices,
        "steps": args.steps,
        "batch_size": s.batch_size,
        "optimizer": s.optimizer,
        "lr": s.lr,
        "microbatches": s.microbatches if args.strategy == "pipeline" else None,
        "schedule": s.schedule if args.strategy == "pipeline" else None,
        "stage_boundaries": ref.boundaries,
        "perturb": args.perturb,
        "refdl_loss": ref.losses,
        "torch_loss": other.losses,
        "loss_abs_diff": loss_diff,
        "loss_max_rel_diff": max(loss_rel),
        "param_max_abs_diff": params["max_abs"],
        "param_rel_l2_diff": params["rel_l2"],
        "worst_tensor": params["worst_tensor"],
        "worst_tensor_rel_l2": params["worst_tensor_rel_l2"],
        "first_update_param_rel_l2_diff": first["rel_l2"],
        "deep500": params["deep500"],
        "checks": checks,
        "tolerance": tol,
        "failed": failed,
        "passed": not failed,
    }


def print_report(r: dict[str, Any]) -> None:
    """The validation as a few readable lines."""
    what = f"{r['strategy']} {r['model']} x{r['devices']}, {r['steps']} steps"
    if r["schedule"]:
        what += f", {r['schedule']} {r['microbatches']} microbatches, cuts {r['stage_boundaries']}"
    print(
        f"refdl vs torch: {what}"
        + (f" (torch side perturbed {r['perturb']:g})" if r["perturb"] else "")
    )
    print(f"{'step':>4s} {'refdl loss':>12s} {'torch loss':>12s} {'|diff|':>10s}")
    n = len(r["refdl_loss"])
    shown = sorted({0, 1, n // 2, n - 1} & set(range(n)))
    for t in shown:
        print(f"{t:4d} {r['refdl_loss'][t]:12.6f} {r['torch_loss'][t]:12.6f} "
              f"{r['loss_abs_diff'][t]:10.2e}")  # fmt: skip
    tol, c, d = r["tolerance"], r["checks"], r["deep500"]
    names = {
        "first_loss_rel": "first loss, relative difference",
        "first_update_param_rel_l2": "parameters after 1 update, relative L2",
        "loss_rel": f"loss over {r['steps']} steps, max relative difference",
        "param_rel_l2": f"parameters after {r['steps']} steps, relative L2",
    }
    for key, name in names.items():
        mark = "ok  " if key not in r["failed"] else "FAIL"
        print(f"{mark} {name}: {c[key]:.2e} (tolerance {tol[key]:g})")
    print(
        f"final parameters: max abs difference {r['param_max_abs_diff']:.2e}; worst tensor "
        f"{r['worst_tensor']} ({r['worst_tensor_rel_l2']:.2e}); Deep500 NormDifference "
        f"{d['NormDifference']:.3e}, L2Error {d['L2Error']:.3e}, MaxError {d['MaxError']:.3e}"
    )
    print(
        "PASSED"
        if r["passed"]
        else f"FAILED: PyTorch and refdl differ beyond the tolerance ({', '.join(r['failed'])})"
    )


# ----------------------------------------------------------------------------- --results

CONFIG_KEYS = ("model", "strategy", "devices", "batch_size", "optimizer", "lr", "dataset",
               "seed", "microbatches", "schedule", "steps", "hw")  # fmt: skip


def read_log(path: str) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """A framework's log: rows of ``step, loss[, samples_per_s]`` and the configuration.

    JSONL: one object per line; a line ``{"config": {...}}`` gives the configuration.
    CSV: a header with ``step`` and ``loss`` (and optionally ``samples_per_s``); lines
    starting ``# config:`` carry the configuration as JSON.
    """
    from refdl.errors import UsageError

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--results {path}: no such file")
    text = p.read_text()
    rows: list[dict[str, float]] = []
    config: dict[str, Any] = {}
    try:
        if p.suffix in (".jsonl", ".json"):
            for line in text.splitlines():
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "config" in obj:
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
            rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(lines)]
        else:
            raise UsageError(f"--results {path}: give a .csv or .jsonl file")
    except (json.JSONDecodeError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"--results {path}: cannot parse it ({e})") from None
    if not rows or not all("step" in r and "loss" in r for r in rows):
        raise UsageError(f"--results {path}: every row needs step and loss")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise UsageError(
            f"--results {path}: unknown configuration keys {unknown}; "
            f"known: {', '.join(CONFIG_KEYS)}"
        )
    if "model" not in config:
        raise UsageError(f"--results {path}: the configuration must name the model")
    rows.sort(key=lambda r: r["step"])
    return rows, config


def results_report(args: argparse.Namespace) -> dict[str, Any]:
    """Compare a framework's log with a refdl run of its configuration and a prediction."""
    import statistics

    from refdl import hw as hwmod
    from refdl.perf import PredictOptions
    from refdl.predict import predict_steps
    from refdl.spec import RunSpec

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from refdl.train import configure_devices

    devices = args.devices or (1 if args.strategy == "single" else 2)
    configure_devices(max(devices, 8))
    from refdl.errors import UsageError

    try:
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1 (got {args.steps})")
        if args.results:
            r = results_report(args)
            if args.report:
                write_report(r, Path(args.report))
            if args.json:
                print(json.dumps(r, indent=2))
            else:
                s = r["samples_per_s"]
                print(f"{r['log']}: {r['steps_compared']} steps compared, max relative loss "
                      f"difference {r['loss_max_rel_diff']:.2e}; samples/s framework "
                      f"{s['framework']}, refdl here {s['refdl_here']:.4g}, predicted "
                      f"{s['predicted']:.4g} ({s['predicted_hw']}); "
                      + ("PASSED" if r["passed"] else "FAILED"))  # fmt: skip
                if args.report:
                    print(f"report: {Path(args.report) / 'report.md'}")
            return 0 if r["passed"] else 1
        r = validate(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_report(r)
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
