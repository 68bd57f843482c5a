"""``refdl``: one command for refdl's tools (``python -m refdl.X`` works as well).

refdl train --strategy hybrid                  # train (python -m refdl.train)
refdl predict --hw p100-nvlink --model resnet50 --workers 1,8,64
refdl plan --hw a100-nvlink-ib-hdr --model gpt3-175b --devices 1024 --batch-size 1536
refdl validate --framework torch --strategy data --model mlp
refdl bench run recipes/digits-hybrid.toml
refdl hw show local
refdl data convert --dataset digits --out digits.zarr
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("refdl.train", "train a model with a parallelism strategy"),
    "launch": ("refdl.launch", "run a command on N ranks under mpirun (signals handled)"),
    "predict": ("refdl.predict", "predict step time, scaling and collectives from a profile"),
    "plan": ("refdl.plan", "the best parallel configuration for a model and a machine"),
    "validate": ("refdl.validate.__main__", "check a framework's training against refdl"),
    "bench": ("refdl.bench.__main__", "benchmarks: recipes, compare, predict-vs-measure"),
    "hw": ("refdl.hw.__main__", "hardware profiles: show one, calibrate this machine"),
    "data": ("refdl.data.__main__", "data sets: convert one into a zarr store"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:9s} {doc}" for name, (_, doc) in COMMANDS.items())
    return (
        "usage: refdl COMMAND [ARGS...]\n\ncommands:\n"
        + rows
        + "\n\n`refdl COMMAND --help` shows a command's options."
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``refdl COMMAND ARGS`` (the console script's entry): the command's own CLI with
    ``ARGS``, its failures to write and Ctrl-C one line each (``exit_status``)."""
    from refdl.errors import exit_status

    return exit_status(lambda: _dispatch(argv), "refdl")


def _dispatch(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # bad input: one line on stderr, as every command's
        print(f"refdl: error: no command given; choose one of: {', '.join(COMMANDS)} "
              "(see refdl --help)", file=sys.stderr)  # fmt: skip
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"refdl: error: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
