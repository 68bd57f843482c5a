"""``python -m refdl.train``: train a model with a parallelism strategy.

Examples (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python -m refdl.train --strategy hybrid     # the main job: data x model x pipe
    .venv/bin/python -m refdl.train                       # lenet5 on digits, strategy single
    .venv/bin/python -m refdl.train --model lstm_lm --dataset pytext --steps 400
    .venv/bin/python -m refdl.train --strategy data --devices 4 --out runs/a
    .venv/bin/python -m refdl.train --resume runs/a --steps 600
    .venv/bin/python -m refdl.train --list

``--strategy hybrid`` with neither ``--devices`` nor ``--mesh`` simulates 8 devices
on a CPU host as ``data=2,model=2,pipe=2``, and on accelerators takes every visible
device and factors them (``MeshSpec.factor``), printing the mesh it chose.
``--resume DIR`` continues a run as it was started (devices, mesh, every option);
flags given again must agree, except how long and how loudly it runs.

Exit status: 0 done; 2 bad input (one line on stderr says what to change);
1 the loss became NaN/Inf or a file could not be written (the last good checkpoint
is kept); 130 / 143 interrupted by SIGINT / SIGTERM (a checkpoint of the last
completed step was written first).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from refdl.config.choices import PIPELINE_SCHEDULES
from refdl.errors import DivergedError, Interrupted, UsageError, WriteError
from refdl.parallel.signals import STOPPER

# Only light modules are imported above, so SIGINT/SIGTERM are handled from the first
# moments of `python -m refdl.train` (main() installs the handlers before anything else);
# the rest (JAX among them) is imported inside the functions that need it.

PROG = "refdl.train"
MAIN_JOB_MESH = "data=2,model=2,pipe=2"  # the main job on a CPU host: 8 simulated devices


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
    g.add_argument(
        "--init",
        help="initialisation: lecun_normal (refdl's, default), torch or keras (those "
        "frameworks' default Dense/Conv draws, for comparing with their runs)",
    )
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
        help="devices to use; on a CPU host, the number simulated (default 1; hybrid: 8 on a "
        "CPU host, every device on accelerators)",
    )
    g.add_argument(
        "--mesh",
        help="mesh degrees, e.g. data=2,model=4 (-1 = the rest; default: all devices on data)",
    )
    g.add_argument("--allreduce", help="data strategy: xla (default), ring, tree, halving-doubling")
    g.add_argument("--microbatches", type=int, help="gradient accumulation steps (default 1)")
    g.add_argument("--compress", help="data strategy: topk:RATIO, qsgd:LEVELS, terngrad, sign")
    g.add_argument(
        "--zero",
        type=int,
        help="fsdp: ZeRO stage - 1 shards the optimizer state, 2 also the gradients, 3 also "
        "the parameters (default 3)",
    )
    g.add_argument(
        "--preset",
        help="hybrid: owt (convolutions data-parallel, fully connected layers model-parallel)",
    )
    g.add_argument(
        "--stages", type=int, help="pipeline: stages, one per device (default --devices)"
    )
    g.add_argument("--schedule", help=f"pipeline: {', '.join(PIPELINE_SCHEDULES)} (default 1f1b)")
    g.add_argument(
        "--chunks",
        type=int,
        help="pipeline: model chunks per device for interleaved or looped-bfs (default 1)",
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
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an --out folder that holds another run (never needed for --resume)",
    )
    return p


def explicit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave, as RunSpec fields (parsed, not yet checked)."""
    from refdl.config.spec import parse_pairs

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
    return explicit


def run_config(resume: str) -> tuple[Path | None, dict[str, Any] | None]:
    """The run folder ``--resume`` names (a run folder, its ``checkpoints``, or one of its
    checkpoints) and the settings it was started with (its ``config.json``; None when it
    has none). A damaged ``config.json`` is a one-line error, never a guess."""
    from refdl.config.files import load_json
    from refdl.run.checkpoint import is_checkpoint

    p = Path(resume)
    if is_checkpoint(p):
        folder = p.parent.parent
    elif p.name == "checkpoints":
        folder = p.parent
    else:
        folder = p
    record = folder / "config.json"
    if not record.exists():
        return (folder if (folder / "checkpoints").is_dir() else None), None
    config = load_json(record, "--resume: the run's")
    if not isinstance(config, dict):
        raise UsageError(f"--resume {resume}: {record} is not a table of settings")
    return folder, config


def resumed_settings(explicit: dict[str, Any]) -> dict[str, Any]:
    """With ``--resume``: the run's own settings, then the flags given again (which must
    agree on everything but how long and how loudly the run goes). The checkpoint is the
    newest intact one of the run's own configuration (its ``config.json``); where it
    writes, only the command line says."""
    from refdl.config.spec import OUTPUT_KEYS, config_key, differing, flag
    from refdl.parallel import processes
    from refdl.run import checkpoint

    folder, config = run_config(explicit["resume"])
    named = checkpoint.is_checkpoint(explicit["resume"])
    choice = checkpoint.resolve(explicit["resume"], None if named else config)
    path, saved = choice.path, choice.meta["spec"]
    other = named and config is not None and config_key(config) != config_key(saved)
    if other and Path(explicit.get("out", folder)).resolve() == Path(folder).resolve():
        keys = ", ".join(differing(config, saved)[:4]) or "settings"
        raise UsageError(
            f"--resume {explicit['resume']}: this checkpoint's {keys} differ from those "
            f"{folder} was started with; continue it in another folder with --out DIR"
        )
    if processes.under_mpi() and "devices" not in explicit:
        explicit = {**explicit, "devices": processes.launched_size()}
    diff = differing(saved, explicit)
    if diff:
        parts = ", ".join(f"{flag(k)} {explicit[k]!r} (the run has {saved[k]!r})" for k in diff)
        raise UsageError(
            f"--resume {explicit['resume']}: {parts}; drop these flags to continue the run as "
            "it was started, or start a new run without --resume"
        )
    # Where a run writes comes from the command line only, never from a file.
    base = {k: v for k, v in saved.items() if k not in OUTPUT_KEYS}
    if "out" not in explicit:
        explicit = {**explicit, "out": str(path.parent.parent)}
    return {**base, **explicit}


def choose_devices(settings: dict[str, Any]) -> dict[str, Any]:
    """Decide the device count before JAX starts its backend: the ranks under mpirun; the
    main job's 8 simulated devices (or every accelerator) for a bare ``--strategy hybrid``;
    the product of a ``--mesh`` given without ``--devices``; else ``--devices``."""
    from refdl.parallel import processes

    if processes.under_mpi():  # one device per rank; the ranks are the devices
        processes.one_device_per_rank()
        return {"devices": processes.launched_size(), **settings}
    if "devices" not in settings and settings.get("mesh"):
        degrees = [p.partition("=")[2].strip() for p in str(settings["mesh"]).split(",")]
        if all(d.isdigit() for d in degrees):
            settings = {**settings, "devices": math.prod(int(d) for d in degrees)}
    if settings.get("strategy") == "hybrid" and "devices" not in settings:
        processes.simulate_devices(8)  # takes effect on a CPU host only
        import jax

        n = jax.device_count()
        if jax.default_backend() == "cpu":
            mesh = MAIN_JOB_MESH if n >= 8 else None
            where = f"{min(n, 8)} simulated CPU devices"
        else:
            from refdl.config.mesh import MeshSpec

            mesh, where = MeshSpec.factor(n).text(), f"{n} {jax.default_backend()} devices"
        n = min(n, 8) if jax.default_backend() == "cpu" else n
        if mesh:
            print(f"{PROG}: hybrid on {where}, mesh {mesh.replace(',', ' x ')}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return {**settings, "devices": n, "mesh": mesh}
        return {**settings, "devices": n}
    processes.simulate_devices(settings.get("devices"))
    return settings


def check_given_options(settings: dict[str, Any], given: set[str]) -> None:
    """A strategy's option given on the command line for another strategy is refused,
    even at its default value (``--zero 3`` with ``single`` would be silently ignored)."""
    from refdl.config.plan import check_options
    from refdl.config.spec import RunSpec
    from refdl.strategies import STRATEGIES

    name = settings.get("strategy", "single")
    if name not in STRATEGIES.names():
        return  # refused with the list of strategies when the run is built
    owners = {n: STRATEGIES.get(n).traits for n in STRATEGIES.names()}
    spec = RunSpec.from_dict(settings, "the flags")
    check_options(spec, name, owners[name], owners, given)


def check_plot_path(path: str | None) -> None:
    """``--plot-schedule``'s file must be writable before the run starts, not after."""
    from refdl.config.paths import writable_file

    if path is not None:
        writable_file(path, "--plot-schedule", (".png", ".pdf", ".svg"))


def plot_schedule(summary: dict[str, Any], path: str) -> str | None:
    """Draw the last executed step's timeline (``timeline.json`` of the run) as a Gantt
    chart; returns the file, or None when the run recorded no pipeline timeline."""
    from refdl.bench.plots import gantt
    from refdl.config.files import load_json

    record = Path(summary["run_dir"]) / "timeline.json"
    if not record.is_file():
        return None
    data = load_json(record, "the run's", limit=256 << 20)
    title = (f"{summary.get('schedule')}, {summary.get('stages')} stages, "
             f"{summary.get('microbatches')} mb")  # fmt: skip
    return str(gantt(data["timeline"], data["stages"], path, title))


def print_list() -> None:
    from refdl.data import DATASETS
    from refdl.models import MODELS
    from refdl.strategies import STRATEGIES

    print("strategies: " + ", ".join(STRATEGIES.names()))
    print("models:")
    for name in MODELS.names():
        m = MODELS.get(name)
        opts = ", ".join(f"{k}={v}" for k, v in m.defaults_of_options().items())
        trains = ", ".join(f"{k} {v}" for k, v in m.defaults.items())
        print(f"  {name:12s} {m.doc} [{m.data_kind}] trains with: {trains}; options: {opts}")
    print("data sets:")
    for name in DATASETS.names():
        d = DATASETS.get(name)
        opts = ", ".join(f"{k}={v}" for k, v in d.defaults_of_options().items()) or "none"
        print(
            f"  {name:14s} {d.doc}{' (needs --data-dir)' if d.needs_dir else ''}; options: {opts}"
        )


def main(argv: list[str] | None = None) -> int:
    """Parse, train, print where the results are; returns the exit status."""
    STOPPER.install(exit_as=PROG)  # SIGINT/SIGTERM from here on: one line, 130/143
    try:
        return _main(argv)
    except Interrupted as e:  # before the loop started: nothing to save
        print(f"{PROG}: interrupted by {signal.Signals(e.signum).name} before training began",
              file=sys.stderr)  # fmt: skip
        return 128 + e.signum


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "list", False):
        print_list()
        return 0
    try:
        settings = explicit_settings(args)
        given = set(settings)
        if "resume" in settings:
            settings = resumed_settings(settings)
        check_given_options(settings, given)
        settings = choose_devices(settings)
        check_plot_path(settings.get("plot_schedule"))
        from refdl.config.spec import RunSpec
        from refdl.parallel.processes import keep_freed_memory
        from refdl.run.loop import fit

        keep_freed_memory()  # a step's large temporaries reused, not faulted in every step
        summary = fit(RunSpec.from_dict(settings, "the flags"))
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        from refdl.parallel import processes

        processes.settle_before_exit()  # every rank prints its line before the launcher ends
        return 2
    except (DivergedError, WriteError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Interrupted as e:
        name = signal.Signals(e.signum).name
        where = f"; continue from {e.checkpoint} with --resume" if e.checkpoint else ""
        print(f"{PROG}: interrupted by {name}{where}", file=sys.stderr, flush=True)
        return 128 + e.signum
    if not summary:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    if settings.get("plot_schedule"):
        try:
            drawn = plot_schedule(summary, settings["plot_schedule"])
            if drawn:
                from refdl.run.report import write_json

                summary["schedule_plot"] = drawn
                write_json(Path(summary["run_dir"]) / "summary.json", summary)
        except OSError as e:
            print(f"{PROG}: error: cannot write {e.filename} ({e.strerror or e}); the run's "
                  f"results are in {summary['run_dir']}", file=sys.stderr)  # fmt: skip
            return 1
    keys = ("final_train_loss", "test_accuracy", "test_perplexity", "samples_per_second")
    shown = ", ".join(f"{k} {summary[k]:.4g}" for k in keys if summary.get(k) is not None)
    print(
        f"{summary['strategy']} {summary['model']} on {summary['dataset']}: "
        f"{summary['steps']} steps, {shown}; results in {summary['run_dir']}"
    )
    return 0


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl.train"))
