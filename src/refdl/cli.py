"""The one argparse parser of refdl's commands: a bad flag is one line and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (``NAME: error: ... (see --help)``)
    and exit status 2, never argparse's usage block (under mpirun every rank prints it)."""

    def __init__(self, *args: Any, name: str = "refdl", **kwargs: Any) -> None:
        self.name = name
        kwargs.setdefault("prog", f"python -m {name}")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.name}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)

    def sub_parsers(self, **kwargs: Any) -> Any:
        """``add_subparsers`` whose parsers report errors the same way, under this name."""
        name = self.name

        class Sub(Parser):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, name=name, **kw)

        return self.add_subparsers(parser_class=Sub, **kwargs)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The RunSpec fields the flags gave (parsed, not yet checked)."""
    from refdl.config.flags import flag_of, inner  # (JAX comes with them: not at start-up)
    from refdl.config.spec import RunSpec, parse_pairs
    from refdl.config.values import Ints, Pairs
    from refdl.errors import UsageError

    fields = {f.name: f for f in dataclasses.fields(RunSpec)}
    out: dict[str, Any] = {}
    for name, raw in vars(args).items():
        if name not in fields:
            continue
        value = inner(fields[name].metadata["value"])
        if isinstance(value, Pairs):
            raw = parse_pairs(raw, flag_of(fields[name]))
        elif isinstance(value, Ints):
            try:
                raw = value.parse(raw)
            except ValueError as e:
                raise UsageError(f"{flag_of(fields[name])} {raw!r}: give {e}") from None
        out[name] = raw
    return out
