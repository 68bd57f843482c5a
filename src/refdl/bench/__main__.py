"""``python -m refdl.bench COMMAND``: benchmarks that check refdl against measurement.

.venv/bin/python -m refdl.bench predict-vs-measure [--mpi] [--out FILE.json]
.venv/bin/python -m refdl.bench op-profile --model lenet5 [--hw local] [--json] [--out FILE.json]
.venv/bin/python -m refdl.bench run recipes/FILE.toml [--set KEY=VALUE ...] [--out DIR] [--json]
.venv/bin/python -m refdl.bench compare --frameworks refdl,torch --model lenet5 \
    --strategy data --devices 1,2,4
.venv/bin/python -m refdl.bench published [--json] [--plot FILE.png]
.venv/bin/python -m refdl.bench microbatch --model resnet --memory-limit 64MiB [--mode shared]

Exit status: 0 done (run: every metric within its bounds); 1 a recipe's metric missed
its threshold; 2 bad input.
"""

from __future__ import annotations

import importlib
import json
import sys

from refdl.cli import Parser
from refdl.errors import UsageError

COMMANDS = ("predict-vs-measure", "op-profile", "run", "compare", "published", "microbatch")


def _command(name: str):
    """A command's module, imported only when it runs (each loads JAX and more)."""
    return importlib.import_module(f"refdl.bench.{name}")


def _simulated_devices() -> None:
    _command("predict_vs_measure").configure()  # before JAX starts its backend


def run_main(argv: list[str]) -> int:
    """``bench run``: one or more recipes; exit 1 when any metric misses its bounds."""
    ap = Parser(name="refdl bench run")
    ap.add_argument("recipes", nargs="+", help="recipe TOML files")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a mutable key of the recipe")  # fmt: skip
    ap.add_argument("--out", help="run directory (one recipe) for the run's files")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    recipes = _command("recipes")
    try:
        overrides = {}
        for pair in args.set:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise UsageError(f"--set {pair!r}: give KEY=VALUE")
            if key.replace("-", "_") in overrides:  # the last would win silently
                raise UsageError(f"--set gives {key} twice; give it once")
            overrides[key.replace("-", "_")] = value
        if args.out and len(args.recipes) > 1:
            raise UsageError("--out takes one recipe; run the recipes one by one")
        loaded = [recipes.load(p) for p in args.recipes]  # check every file before running
        results = [recipes.run(r, overrides, args.out) for r in loaded]
    except UsageError as e:
        print(f"refdl.bench run: error: {e}", file=sys.stderr)
        return 2
    except recipes.RecipeFailed as e:
        print(f"refdl.bench run: {e}", file=sys.stderr)
        return 1
    for r in results:
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            recipes.print_result(r)
    return 0 if all(r["passed"] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    from refdl.config.spec import command_line

    with command_line():  # a refused setting is named by its flag
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\ncommands: " + ", ".join(COMMANDS)
              + " (COMMAND --help shows its options)")  # fmt: skip
        return 0
    if not argv or argv[0] not in COMMANDS:
        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"refdl.bench: error: {what}; choose one of: {', '.join(COMMANDS)} (see --help)",
              file=sys.stderr)  # fmt: skip
        return 2
    from refdl.parallel.processes import keep_freed_memory

    keep_freed_memory()  # as refdl.train: the steps timed here are the steps it runs
    if argv[0] in ("predict-vs-measure", "op-profile"):
        _simulated_devices()  # (op-profile: as predict-vs-measure and the calibration run)
    if argv[0] == "run":
        return run_main(argv[1:])
    # compare simulates as many devices as its --devices asks
    try:
        return _command(argv[0].replace("-", "_")).main(argv[1:])
    except UsageError as e:  # (where a command's own main did not catch it)
        print(f"refdl bench {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from refdl.errors import exit_status

    sys.exit(exit_status(main, "refdl.bench"))
