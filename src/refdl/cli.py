"""The one argparse parser of refdl's commands: a bad flag is one line and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Callable
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (``NAME: error: ... (see --help)``)
    and exit status 2, never argparse's usage block."""

    def __init__(
        self, *args: Any, name: str = "refdl", say: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        self.name = name
        # how the error line is printed: on stderr, or (refdl train) once under mpirun,
        # not once per rank (``refdl.parallel.processes.say_once``, a layer above this one)
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        kwargs.setdefault("prog", name.replace("refdl.", "refdl ", 1))  # as the README writes it
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.say(f"{self.name}: error: {message}{self._did_you_mean(message)} (see --help)")
        raise SystemExit(2)

    def _did_you_mean(self, message: str) -> str:
        """``; did you mean --strategy?`` for an unrecognized flag close to a known one."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        guesses = []
        for word in message.split(":", 1)[1].split():
            flag = word.split("=", 1)[0]
            if flag.startswith("--"):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                guesses += [f"{close[0]} (not {flag})"] if close else []
        return f"; did you mean {', '.join(guesses)}?" if guesses else ""

    def sub_parsers(self, **kwargs: Any) -> Any:
        """``add_subparsers`` whose parsers report errors the same way, under this name."""
        name = self.name

        class Sub(Parser):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, name=name, **kw)

        return self.add_subparsers(parser_class=Sub, **kwargs)


def given_dests(make: Callable[[], argparse.ArgumentParser], argv: list[str]) -> set[str]:
    """The destinations ``argv`` sets itself, a flag at its default value included (a
    command whose parser has defaults cannot tell ``--cp ring`` from no ``--cp``): a fresh
    parser from ``make``, every default made a marker, parses it again."""
    parser, unset = make(), object()
    parser.set_defaults(**dict.fromkeys(vars(parser.parse_args(argv)), unset))
    return {k for k, v in vars(parser.parse_args(argv)).items() if v is not unset}


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
