"""``python -m refdl.train``: train a model with a parallelism strategy.

Examples (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python -m refdl.train --strategy hybrid     # the main job: data x model x pipe
    .venv/bin/python -m refdl.train                       # lenet5 on digits, strategy single
    .venv/bin/python -m refdl.train --model lstm_lm --dataset pytext --steps 400
    .venv/bin/python -m refdl.train --strategy data --devices 4 --out runs/a
    .venv/bin/python -m refdl.train --config run.toml --steps 50   # flags override the file
    .venv/bin/python -m refdl.train --resume runs/a --steps 600
    .venv/bin/python -m refdl.train --list

``--strategy hybrid`` with neither ``--devices`` nor ``--mesh`` simulates 8 devices
on a CPU host as ``data=2,model=2,pipe=2``, and on accelerators takes every visible
device and factors them (``MeshSpec.factor``), printing the mesh it chose.
``--resume DIR`` continues a run as it was started (devices, mesh, every option);
flags given again must agree, except how long and how loudly it runs. ``--config``
takes a TOML file of settings (the long flags' names with underscores) or a run
folder's ``config.json``.

Exit status: 0 done; 2 bad input (one line on stderr says what to change);
1 the loss became NaN/Inf or a file could not be written (the last good checkpoint
is kept); 3 under mpirun, a rank was lost or made no progress; 130 / 143 interrupted by
SIGINT / SIGTERM (a checkpoint of the last completed step was written first).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from refdl.cli import Parser, given_settings
from refdl.errors import DivergedError, Interrupted, UsageError, WriteError
from refdl.parallel.signals import STOPPER, say, signal_exit_status

if TYPE_CHECKING:
    from refdl.config.spec import RunSpec

# Only light modules above: SIGINT/SIGTERM are handled from the first moments; JAX later.
PROG = "refdl.train"
SHOWN = ("final_train_loss", "test_accuracy", "test_perplexity", "samples_per_second")


def build_parser() -> argparse.ArgumentParser:
    """The CLI: ``--list``, ``--config`` and one flag per RunSpec field."""
    from refdl.config.flags import add_run_arguments
    from refdl.parallel.processes import say_once  # (no JAX: a typo still answers at once)

    p = Parser(name=PROG, description=__doc__, argument_default=argparse.SUPPRESS, say=say_once,
               formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--list", action="store_true", help="list strategies, models and data sets")
    p.add_argument("--config", metavar="FILE", help="settings from a TOML file (keys as in a "
                   "run's config.json: batch_size, model_opts, progress ...) or a run's "
                   "config.json; flags given beside it override it")  # fmt: skip
    add_run_arguments(p)
    return p


def check_flags(argv: list[str]) -> RunSpec | None:
    """The flags' own checks, without training: ``refdl launch`` runs them once, before it
    starts any rank, so bad input is one line and not one per rank (raises UsageError; a
    bad flag exits 2 from the parser). The run's spec (None for ``--list``)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "list", False):
        return None
    from refdl.config.spec import RunSpec
    from refdl.run.settings import run_settings

    settings = run_settings(given_settings(args), getattr(args, "config", None), PROG)
    return RunSpec.from_dict(settings, "the flags")


def _check_one_process(given: dict) -> None:
    """``--timeout`` given on this command line bounds a rank's wait for the others: in a
    process no launcher started it would change nothing (a resumed run's or a ``--config``
    record's is kept quietly; ``refdl launch`` checks the flags outside mpirun, so not in
    ``check_flags``)."""
    from refdl.parallel.processes import launched

    if given.get("timeout") is not None and not launched():
        raise UsageError(
            f"--timeout {given['timeout']:g} bounds how long a rank waits for the others "
            "under mpirun, and this run was not started by a launcher: drop it, or start "
            "the ranks with refdl launch -n N"
        )


def main(argv: list[str] | None = None) -> int:
    """Parse, train, print where the results are; returns the exit status."""
    STOPPER.install(exit_as=PROG)  # SIGINT/SIGTERM from here on: one line, 130/143
    args = build_parser().parse_args(argv)
    try:
        from refdl.config.spec import RunSpec
        from refdl.run.settings import run_settings

        if getattr(args, "list", False):
            from refdl.run.catalog import print_list

            return print_list() or 0
        given = given_settings(args)
        settings = run_settings(given, getattr(args, "config", None), PROG)
        spec = RunSpec.from_dict(settings, "the flags")
        from refdl.models import MODELS
        from refdl.strategies import STRATEGIES

        STRATEGIES.get(spec.strategy)  # an unknown name is refused before the loop loads
        MODELS.get(spec.model)
        from refdl.assemble import resolve
        from refdl.config.spec import command_line

        with command_line():  # the model's defaults filled in: their refusals name flags
            resolve(spec)
        _check_one_process(given)
        # the training loop (and the event writer's tensorboardX, which loads torch) only
        # once the flags passed their own checks: a typo costs no second of imports more
        from refdl.parallel.processes import keep_freed_memory
        from refdl.run.loop import fit

        keep_freed_memory()  # a step's large temporaries reused, not faulted in every step
        summary = fit(spec)
    except UsageError as e:
        from refdl.parallel.processes import say_once

        say_once(f"{PROG}: error: {e}")  # under mpirun: once, not once per rank
        return 2
    except DivergedError as e:  # (every rank of a synchronous run sees the same loss)
        from refdl.parallel.processes import say_once

        say_once(f"{PROG}: error: {e}", status=1)
        return 1
    except WriteError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Interrupted as e:
        where = f"; continue from {e.checkpoint} with --resume" if e.checkpoint else ""
        say(f"{PROG}: interrupted by {signal.Signals(e.signum).name}{where}", e.signum)
        return signal_exit_status(e.signum)
    if not summary:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    if path := settings.get("plot_schedule"):
        from refdl.plots import run_schedule
        from refdl.run.report import record_drawing

        if not record_drawing(summary, "schedule_plot", lambda s: run_schedule(s, path), PROG):
            return 1
    shown = ", ".join(f"{k} {summary[k]:.4g}" for k in SHOWN if summary.get(k) is not None)
    print(f"{summary['strategy']} {summary['model']} on {summary['dataset']}: "
          f"{summary['steps']} steps, {shown}; results in {summary['run_dir']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, PROG))
