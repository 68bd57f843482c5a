"""``python -m refdl.train``: train a model with a parallelism strategy.

Examples (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python -m refdl.train                       # lenet5 on digits, strategy single
    .venv/bin/python -m refdl.train --model lstm_lm --dataset pytext --steps 400
    .venv/bin/python -m refdl.train --steps 300 --out runs/a
    .venv/bin/python -m refdl.train --resume runs/a --steps 600
    .venv/bin/python -m refdl.train --list

Exit status: 0 done; 2 bad input (one line on stderr says what to change);
1 the loss became NaN/Inf (the last good checkpoint is kept); 130 interrupted
(a checkpoint of the last completed step was written first).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

PROG = "refdl.train"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The CLI. Every option defaults to "not given" so a resumed run knows what was set."""
    S = argparse.SUPPRESS
    p = _Parser(
        prog=f"python -m {PROG}",
        description=__doc__,
        argument_default=S,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--list", action="store_true", help="list strategies, models and data sets")
    g = p.add_argument_group("what to train")
    g.add_argument("--strategy", help="parallelism strategy (default single)")
    g.add_argument("--model", help="model (default lenet5)")
    g.add_argument(
        "--model-opt",
        action="append",
        metavar="KEY=VALUE",
        dest="model_opts",
        help="model option, e.g. depth=20 or hidden=64 (repeatable)",
    )
    g.add_argument("--dataset", help="data set (default: the model's, digits for images)")
    g.add_argument("--data-dir", help="folder the data set reads (mnist, cifar10, ptb, zarr)")
    g.add_argument(
        "--data-opt",
        action="append",
        metavar="KEY=VALUE",
        dest="data_opts",
        help="data set option, e.g. seq_len=32 or shape=cifar (repeatable)",
    )
    g.add_argument("--loss", help="cross_entropy (default) or squared")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, help="training steps (default 300)")
    g.add_argument("--batch-size", type=int, help="global batch size (default 64)")
    g.add_argument("--optimizer", help="sgd, momentum, nesterov or adam (default: the model's)")
    g.add_argument("--lr", type=float, help="learning rate (default: the model's)")
    g.add_argument("--momentum", type=float, help="momentum for momentum/nesterov (default 0.9)")
    g.add_argument("--weight-decay", type=float, help="L2 weight decay (default 0)")
    g.add_argument("--lr-schedule", help="constant (default), step or cosine")
    g.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default 0)")
    g.add_argument("--lr-decay-every", type=int, help="step schedule: decay every N steps")
    g.add_argument("--lr-decay-factor", type=float, help="step schedule: factor (default 0.1)")
    g.add_argument("--seed", type=int, help="seed of initialisation and data order (default 0)")
    g = p.add_argument_group("devices and output")
    g.add_argument(
        "--devices",
        type=int,
        help="devices to use; on a CPU host, the number simulated (default 1)",
    )
    g.add_argument(
        "--mesh",
        help="mesh degrees, e.g. data=2,model=4 (-1 = the rest; default: all devices on data)",
    )
    g.add_argument("--allreduce", help="data strategy: xla (default), ring, tree, halving-doubling")
    g.add_argument("--microbatches", type=int, help="gradient accumulation steps (default 1)")
    g.add_argument("--compress", help="data strategy: topk:RATIO, qsgd:LEVELS, terngrad, sign")
    g.add_argument(
        "--preset",
        help="hybrid: owt (convolutions data-parallel, fully connected layers model-parallel)",
    )
    g.add_argument(
        "--stages", type=int, help="pipeline: stages, one per device (default --devices)"
    )
    g.add_argument("--schedule", help="pipeline: gpipe, 1f1b (default) or interleaved")
    g.add_argument(
        "--chunks", type=int, help="pipeline: model chunks per device for interleaved (default 1)"
    )
    g.add_argument(
        "--stage-boundaries",
        metavar="I,J,...",
        help="pipeline: layer indices where stages start (default: balanced by parameter count)",
    )
    g.add_argument(
        "--plot-schedule",
        metavar="FILE.png",
        help="pipeline: draw the last executed step's timeline as a Gantt chart",
    )
    g = p.add_argument_group("parameter server and decentralized (also under mpirun)")
    g.add_argument("--ps-mode", help="ps: sync (default), async or ssp")
    g.add_argument("--staleness", type=int, help="ps ssp: no worker runs more than S steps ahead")
    g.add_argument("--servers", type=int, help="ps: server ranks holding parameter shards (1)")
    g.add_argument(
        "--topology", help="decentralized: ring (default), torus, exp2, complete or a 0/1 file"
    )
    g.add_argument("--order", help="decentralized: atc (adapt-then-combine, default) or cta")
    g.add_argument(
        "--gossip", action="store_true", help="decentralized: random pairwise gossip per step"
    )
    g.add_argument(
        "--simulate", action="store_true", help="ps/decentralized: all workers in this process"
    )
    g.add_argument("--workers", type=int, help="--simulate: number of workers (default 4)")
    g.add_argument("--ps-trace", help="--simulate: replay this recorded arrival order (ps)")
    g.add_argument("--straggler", metavar="RANK:SECONDS", help="delay one worker's every step")
    g.add_argument(
        "--timeout",
        type=float,
        help="under mpirun: seconds without progress before every rank aborts (default 300)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--out", help="run folder (default runs/<timestamp>/)")
    g.add_argument("--resume", help="a run folder or checkpoint to continue from")
    g.add_argument("--eval-every", type=int, help="evaluate every N steps (default 100; 0 = end)")
    g.add_argument("--log-every", type=int, help="metrics.jsonl row every N steps (default 10)")
    g.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (default 100)")
    g.add_argument("--keep-checkpoints", type=int, help="checkpoints kept (default 3)")
    g.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")
    return p


def configure_devices(n: int | None) -> None:
    """Simulate ``n`` CPU devices; must run before JAX is imported to take effect."""
    if not n or n <= 1 or "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def spec_from_args(args: argparse.Namespace):
    """The RunSpec: defaults, then (with --resume) the checkpoint's spec, then explicit flags."""
    from refdl.errors import UsageError
    from refdl.spec import RunSpec, parse_pairs

    explicit: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "list"}
    for key, flag in (("model_opts", "--model-opt"), ("data_opts", "--data-opt")):
        if key in explicit:
            explicit[key] = parse_pairs(explicit[key], flag)
    if "stage_boundaries" in explicit:
        try:
            explicit["stage_boundaries"] = tuple(
                int(v) for v in explicit["stage_boundaries"].split(",") if v.strip()
            )
        except ValueError:
            raise UsageError(
                f"--stage-boundaries {explicit['stage_boundaries']!r}: give layer indices like 2,5"
            ) from None
    base: dict[str, Any] = {}
    if "resume" in explicit:
        from refdl import checkpoint
        from refdl.loop import check_resume_compatible

        path = checkpoint.resolve(explicit["resume"])
        saved = checkpoint.read_meta(path)["spec"]
        check_resume_compatible(saved, explicit)
        base = {k: v for k, v in saved.items() if k not in ("resume", "out")}
        if "out" not in explicit:
            explicit["out"] = str(path.parent.parent)
    return RunSpec.from_dict({**base, **explicit})


def print_list() -> None:
    from refdl.data import DATASETS
    from refdl.models import MODELS
    from refdl.strategies import STRATEGIES

    print("strategies: " + ", ".join(STRATEGIES.names()))
    print("models:")
    for name in MODELS.names():
        m = MODELS.get(name)
        opts = ", ".join(f"{k}={v}" for k, v in m.options.items())
        print(f"  {name:12s} {m.doc} [{m.data_kind}] options: {opts}")
    print("data sets:")
    for name in DATASETS.names():
        d = DATASETS.get(name)
        opts = ", ".join(f"{k}={v}" for k, v in d.options.items()) or "none"
        print(
            f"  {name:14s} {d.doc}{' (needs --data-dir)' if d.needs_dir else ''}; options: {opts}"
        )


def main(argv: list[str] | None = None) -> int:
    """Parse, train, print where the results are; returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "list", False):
        print_list()
        return 0
    from refdl import dist

    if dist.under_mpi():  # one device per rank; the ranks are the devices
        dist.one_device_per_rank()
        if not hasattr(args, "devices"):
            args.devices = dist.launched_size()
    else:
        configure_devices(getattr(args, "devices", None))
    from refdl.errors import DivergedError, UsageError

    try:
        from refdl.loop import fit

        spec = spec_from_args(args)
        summary = fit(spec)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        dist.settle_before_exit()  # every rank prints its line before the launcher ends the job
        return 2
    except DivergedError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted; continue from the last checkpoint with --resume", file=sys.stderr
        )
        return 130
    if not summary:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    keys = ("final_train_loss", "test_accuracy", "test_perplexity", "samples_per_second")
    shown = ", ".join(f"{k} {summary[k]:.4g}" for k in keys if summary.get(k) is not None)
    print(
        f"{summary['strategy']} {summary['model']} on {summary['dataset']}: "
        f"{summary['steps']} steps, {shown}; results in {summary['run_dir']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
