"""``python -m refdl.validate``: check another framework against refdl.

Two modes:

- ``--framework torch|tensorflow|mxnet --strategy single|data|pipeline|ps --model M
  --steps N`` trains the same model from the same initial weights on the same
  batches with the same optimizer and learning rates in refdl and in the framework
  - PyTorch (plain, ``DistributedDataParallel`` over gloo,
  ``torch.distributed.pipelining``), TensorFlow (plain, ``MirroredStrategy`` with
  ``--devices``, ``MultiWorkerMirroredStrategy`` with ``--workers``,
  ``ParameterServerStrategy``) or MXNet (plain, KVStore ``local`` with
  ``--devices``, ``dist_sync``/``dist_async`` with ``--workers``) - and reports the
  per-step loss difference, the final parameter difference (max abs, relative L2)
  and Deep500's error metrics. ``--strategy ps --ps-mode async`` compares by
  outcome instead: accuracy band, throughput, staleness. Exit status 1 when a
  tolerance is exceeded.
- ``--results TEST --control CONTROL [--control CONTROL2] [--report DIR]`` judges a
  parallel run's log against its own 1-D control's, from the two logs alone (any
  size, any framework; ``refdl.validate.parity``): the same training within the noise,
  or where and how it departs.
- ``--results LOG [--hw PROFILE] [--report DIR]`` reads a framework's own training
  log (JSON lines, a CSV with a header, or TensorBoard event files; the
  configuration in the log, ``--config FILE.toml`` or ``--set KEY=VALUE``), reruns
  that configuration in refdl over seeds (or exactly, from refdl's exported start),
  tests the log's statistics against the seeds' with a rule whose false-alarm rate
  is measured (``scripts/bench_validate.py``), puts its throughput beside refdl's
  and the performance model's, and writes ``report.md``, ``report.json`` and
  ``loss.png``.

Examples::

    .venv/bin/python -m refdl.validate --framework torch --strategy data --model lenet5 \
        --steps 20 --json
    .venv/bin/python -m refdl.validate --strategy pipeline --model resnet --schedule gpipe
    .venv/bin/python -m refdl.validate --framework mxnet --strategy ps --ps-mode sync \
        --workers 2 --model mlp --steps 10
    .venv/bin/python -m refdl.validate --results torch_log.jsonl --hw local --report out/
    .venv/bin/python -m refdl.validate --results runs/tb/ --config run.toml --report out/

Exit status: 0 passed; 1 a difference exceeded its tolerance; 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from refdl.cli import Parser
from refdl.config.flags import add_run_arguments
from refdl.config.paths import writable_folder
from refdl.config.spec import command_line
from refdl.config.values import Float, Int, Optional
from refdl.errors import UsageError, ValidationFailed
from refdl.parallel.processes import simulate_devices
from refdl.validate.request import SPEC_OPTIONS, Request
from refdl.validate.tolerances import FIRST_STEP_RTOL, FP64_RTOL

# Only light modules above: the options and a log's own checks answer before JAX loads
# (about 1 s; the comparisons' modules, torch's log readers included, 4-5 s in all).

PROG = "refdl.validate"
# Steps of an asynchronous comparison by default: at 20 steps (40 updates) LeNet-5's test
# accuracy under TensorFlow's parameter server ranged 0.24-0.39 in three runs against a
# floor of 0.35 (one false alarm); at 100 steps 0.90-0.92 against 0.82 (2026-11-24).
ASYNC_STEPS = 100


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        name=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--framework", default="torch", choices=["torch", "tensorflow", "mxnet"])
    p.add_argument(
        "--strategy",
        default="single",
        help="single, data, pipeline (torch), ps (tensorflow, mxnet), or any "
        "synchronous strategy (compared with the framework's plain training)",
    )
    p.add_argument("--ps-mode", default="sync", choices=["sync", "async"],
                   help="ps: sync (MXNet dist_sync, compared step by step) or async "
                        "(TensorFlow ParameterServerStrategy, MXNet dist_async)")  # fmt: skip
    p.add_argument("--workers", type=int,
                   help="processes: ps workers (default 2); TensorFlow data: "
                        "MultiWorkerMirroredStrategy workers")  # fmt: skip
    p.add_argument("--model", default="lenet5", help="mlp, lenet5, resnet or lstm_lm")
    p.add_argument(
        "--steps",
        type=int,
        help="steps of both runs (default 20; an asynchronous "
        f"parameter server, compared by outcome, {ASYNC_STEPS})",
    )
    p.add_argument("--devices", type=int, help="workers/stages (default: 1 single, 2 otherwise)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, help="pipeline microbatches (default 4)")
    p.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule: gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zbv "
                        "or dualpipev (each run by PyTorch's own schedule class)")  # fmt: skip
    p.add_argument("--optimizer",
                   help="sgd, momentum, nesterov, adam or muon (default: the model's)")  # fmt: skip
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
        help="tolerance of the first loss and of the parameters after one update "
        f"(default {FIRST_STEP_RTOL:g}; fp64 {FP64_RTOL:g})",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp64"],
                   help="both sides in float32, or in float64 (JAX's 64-bit mode, "
                        f"torch.float64; every tolerance {FP64_RTOL:g})")  # fmt: skip
    add_run_arguments(p, only=SPEC_OPTIONS)  # the strategies' options, as refdl train has them
    p.add_argument("--plant-bug", metavar="NAME",
                   help="plant a realistic bug in PyTorch's side (checks that the check can "
                        "fail): divide (FSDP2 sums gradients), rowwise (a RowwiseParallel "
                        "left out), microbatch-scale (a stage's loss not scaled), "
                        "expert-return (tokens back to the wrong rank), mixing (a wrong "
                        "neighbour weight); with --optimizer muon, any twin: muon-momentum "
                        "(0.9), muon-nesterov (off), muon-scale (Moonlight's RMS-matched "
                        "scale)")  # fmt: skip
    p.add_argument("--perturb", type=float, default=0.0,
                   help="add this relative noise to the PyTorch side's initial weights "
                        "(checks that the check can fail)")  # fmt: skip
    p.add_argument("--torch-batchnorm", default="composite", choices=["composite", "native"],
                   help="PyTorch side's BatchNorm: the adapter's (tensor ops) or "
                        "torch.nn.BatchNorm2d (loses precision on CPU; see README)")  # fmt: skip
    p.add_argument("--torch-muon-ns", default="bf16", choices=["bf16", "native"],
                   help="with --optimizer muon: torch.optim.Muon as shipped (its Newton-Schulz "
                        "in bf16; the tolerances follow how far bf16 alone moves refdl's run) "
                        "or native (the same iteration without its bf16 cast: the usual "
                        "tolerances, fp64 included)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600, help="seconds for the PyTorch workers")
    p.add_argument("--results", help="a framework's log (CSV or JSONL) to compare with refdl")
    p.add_argument("--control", action="append", metavar="LOG",
                   help="with --results: the 1-D control run's log (same seed, data order and "
                        "global batch); a second --control gives the run's own noise. "
                        "Judges the two logs alone, no rerun")  # fmt: skip
    p.add_argument("--hw", default="local", help="hardware profile for --results' prediction")
    p.add_argument("--report", help="with --results: directory for report.md and report.json")
    p.add_argument("--seeds", type=int, default=10,
                   help="with --results: refdl runs per configuration for the statistical "
                        "comparison (default 10)")  # fmt: skip
    p.add_argument("--config", metavar="FILE.toml",
                   help="with --results: the log's configuration in a TOML file (for CSV and "
                        "TensorBoard logs; overrides the log's own)")  # fmt: skip
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="with --results: one configuration key (repeatable; wins over "
                        "--config and the log)")  # fmt: skip
    p.add_argument(
        "--scalars",
        metavar="loss=TAG,...",
        help="with --results: the CSV columns or TensorBoard tags of loss, "
        "test_accuracy, samples_per_s, wall_time (default: usual names)",
    )
    p.add_argument("--seed-cache", metavar="DIR",
                   help="with --results: keep refdl's seed runs in DIR and reuse them for the "
                        "same configuration (the code's hash is part of the key)")  # fmt: skip
    p.add_argument(
        "--export-start",
        metavar="DIR",
        help="write refdl's start of --model (weights in refdl/PyTorch/Keras layouts, batch "
        "order, data, loaders) for an exactly comparable run",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def by_outcome(args: argparse.Namespace) -> bool:
    """Whether the comparison is by outcome: an asynchronous parameter server."""
    from refdl.strategies import traits_of

    traits = traits_of(args.strategy)
    return bool(traits.synchronous_modes) and not traits.synchronous_with(args.ps_mode)


# Each option's declared value type (refdl.config.values), checked before any work.
ARG_VALUES = {
    "steps": Int(min=1, max=100_000),
    "devices": Optional(Int(min=1, max=8)),  # simulated CPU devices or PyTorch processes
    "workers": Optional(Int(min=1, max=8)),  # framework processes
    "batch_size": Int(min=1, max=10**6),
    "microbatches": Optional(Int(min=1, max=1024)),
    "lr": Optional(Float(min=0.0, min_open=True)),
    "seed": Int(min=0, max=2**32 - 1),
    "param_rtol": Optional(Float(min=0.0, min_open=True)),
    "loss_rtol": Optional(Float(min=0.0, min_open=True)),
    "first_step_rtol": Optional(Float(min=0.0, min_open=True)),
    "perturb": Float(min=0.0, max=10.0),
    "timeout": Float(min=0.0, min_open=True, max=1e6),
    "seeds": Int(min=2, max=100),
}


# What each mode of --results reads; any other flag off its default is refused.
CONTROL_OPTIONS = ("results", "control", "report", "json", "scalars", "config", "set")
RESULTS_OPTIONS = (*CONTROL_OPTIONS, "seeds", "seed_cache", "hw", "loss_rtol", "param_rtol")
LOG_ONLY = ("report", "config", "set", "scalars", "seed_cache", "seeds", "hw")
TORCH_ONLY = ("plant_bug", "perturb", "torch_batchnorm")


def _given(args: argparse.Namespace) -> list[str]:
    """The options set off the parser's defaults (their dests)."""
    parser = build_parser()
    return [a.dest for a in parser._actions
            if a.dest != "help" and getattr(args, a.dest) != a.default]  # fmt: skip


def _first(given: list[str], keys: Iterable[str]) -> str | None:
    """The first of ``keys`` given, as its flag's words (``seed_cache`` -> ``seed-cache``)."""
    key = next((k for k in keys if k in given), None)
    return key and key.replace("_", "-")


def _fp64_only() -> UsageError:
    return UsageError("--precision fp64 compares refdl with PyTorch step by step "
                      "(--framework torch, a synchronous strategy); drop it")  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """Every option against its declared value; an unwritable ``--report`` before any run
    (light: ``--steps`` may still be unset, its default depends on the strategy)."""
    for key, kind in ARG_VALUES.items():
        if (key != "steps" or args.steps is not None) and (
            problem := kind.problem(getattr(args, key))
        ):
            raise UsageError(f"--{key.replace('_', '-')} must be {problem}")
    if args.precision == "fp64" and (args.framework != "torch" or args.results):
        raise _fp64_only()
    for key in ("results", "report", "export_start", "seed_cache", "config", "hw"):
        if getattr(args, key) is not None and not str(getattr(args, key)).strip():
            raise UsageError(f"--{key.replace('_', '-')} is empty; give a path or drop it")
    if args.control is not None and not all(str(c).strip() for c in args.control):
        raise UsageError("--control is empty; give a log or drop it")
    if args.torch_muon_ns != "bf16" and args.optimizer != "muon":
        raise UsageError("--torch-muon-ns sets torch.optim.Muon's Newton-Schulz; add "
                         "--optimizer muon, or drop it")  # fmt: skip
    given = _given(args)  # the options set off their defaults
    if args.framework != "torch" and (key := _first(given, TORCH_ONLY)):
        raise UsageError(f"--{key} changes PyTorch's side; --framework {args.framework} has "
                         "none, drop it")  # fmt: skip
    if args.export_start and (args.results or args.control):
        raise UsageError("--export-start writes refdl's start for another run, and checks "
                         "nothing; give it alone, or drop it to check --results")  # fmt: skip
    if args.results:  # the log's settings are the run's: the flags of a new run do nothing
        allowed = CONTROL_OPTIONS if args.control else RESULTS_OPTIONS
        why = (
            "--control: the two logs are judged alone, nothing is rerun"
            if args.control
            else "--results: the log's settings (or --config, --set) say what is rerun"
        )
        if key := _first(given, [k for k in given if k not in allowed]):
            raise UsageError(f"--{key} does nothing with {why}; drop it")
    elif key := _first(given, LOG_ONLY):  # the options of a log's check would change nothing
        raise UsageError(f"--{key} is an option of --results LOG (checking a framework's "
                         "log); add --results, or drop it")  # fmt: skip
    if args.report:
        writable_folder(args.report, "--report")
    if args.export_start:
        writable_folder(args.export_start, "--export-start")
        if (Path(args.export_start) / "config.json").exists():  # a run's folder: not mixed
            raise UsageError(f"--export-start {args.export_start} holds a training run "
                             "(config.json); give a new folder")  # fmt: skip
    if args.seed_cache:
        writable_folder(args.seed_cache, "--seed-cache")


def _parity(args: argparse.Namespace) -> int:
    """``--results TEST --control CONTROL``: the verdict, its report; 0 passed, 1 departed."""
    if not args.results:
        raise UsageError("--control is the control of --results TEST; add --results")
    from refdl.validate import parity

    r = parity.parity_report(args.results, args.control, args.scalars, args.config, args.set)
    if args.report:
        try:
            parity.write_report(r, Path(args.report))
        except OSError as e:
            print(f"{PROG}: error: cannot write {e.filename} ({e.strerror or e})",
                  file=sys.stderr)  # fmt: skip
            return 1
    print(json.dumps(r, indent=2) if args.json else parity.summary_line(r))
    if r.get("advice") and not args.json:
        print(f"advice: {r['advice']}", file=sys.stderr)
    if args.report and not args.json:
        print(f"report: {Path(args.report) / 'report.md'}")
    return 0 if r["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    with command_line():  # a refused setting is named by its flag
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    devices = args.devices if args.devices and 1 <= args.devices <= 8 else 2
    simulate_devices(max(devices, 8))  # before JAX starts its backend

    try:
        check_args(args)
        checked = None
        if args.results and not args.control:  # the log's own checks, before JAX loads
            from refdl.validate.logs import checked_log

            checked = checked_log(args.results, args.config, args.set, args.scalars)
        from refdl.strategies import traits_of

        if args.schedule != "1f1b" and "schedule" not in traits_of(args.strategy).options:
            raise UsageError(f"--schedule orders pipeline stages; --strategy {args.strategy} "
                             "has none: use --strategy pipeline, or drop it")  # fmt: skip
        if args.steps is None:
            args.steps = ASYNC_STEPS if by_outcome(args) else 20
        if args.precision == "fp64" and by_outcome(args):  # (by outcome: JAX loads to know)
            raise _fp64_only()
        request = Request.of(vars(args))  # the library's typed view of the flags
        from refdl.validate.asynchronous import print_async, validate_async
        from refdl.validate.exact import print_report, validate
        from refdl.validate.export import export_start
        from refdl.validate.results import results_report, summary_line, write_report

        if args.export_start:
            config = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size,
                      "seed": args.seed, "optimizer": args.optimizer, "lr": args.lr,
                      "dataset": args.dataset}  # fmt: skip
            start = export_start(config, Path(args.export_start))
            print(f"refdl's start of {args.model} ({args.steps} steps, batch {args.batch_size}, "
                  f"seed {args.seed}) in {args.export_start}: fingerprint {start['fingerprint']} "
                  "(log it as \"start\"; loaders: load_torch.py, load_keras.py)")  # fmt: skip
            return 0
        if args.control:
            return _parity(args)
        if args.results:
            r = results_report(request, checked)
            if args.report:
                try:
                    write_report(r, Path(args.report))
                except OSError as e:
                    print(f"{PROG}: error: cannot write {e.filename} ({e.strerror or e})",
                          file=sys.stderr)  # fmt: skip
                    return 1
            if args.json:
                print(json.dumps(r, indent=2))
            else:
                print(summary_line(r))
                for line in (*r["assumptions"], *r["warnings"]):
                    print(f"  {line}")
                print(f"  {r['samples_per_s']['note']}")
                if args.report:
                    print(f"report: {Path(args.report) / 'report.md'}")
            return 0 if r["passed"] else 1
        r = validate_async(request) if by_outcome(args) else validate(request)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ValidationFailed as e:
        print(f"{PROG}: {args.framework} failed: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r, indent=2))
    elif by_outcome(args):
        print_async(r)
    else:
        print_report(r)
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl.validate"))
