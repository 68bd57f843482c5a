"""Declared value types: each option carries one, so none can be added without its check.

A ``Value`` parses a command-line string (``parse``) and checks a value of any
origin - a flag, a recipe, a saved config, a log - (``problem``: ``None`` when
fine, else what is wrong, in words that fit "--lr must be ..."). RunSpec's
fields, every model's and data set's options, recipes and framework logs
declare their values with these.

>>> Int(min=1).problem(0)
'an integer >= 1 (got 0)'
>>> Float(min=0.0, min_open=True).parse("nan")
Traceback (most recent call last):
  ...
ValueError: a finite number > 0 (got 'nan')
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any

from refdl.errors import UsageError

MAX_INT = 2**63 - 1  # the largest integer any option takes (NumPy's int64)


@dataclasses.dataclass(frozen=True)
class Int:
    """An integer in ``[min, max]`` (bools are not integers here)."""

    min: int | None = None
    max: int | None = MAX_INT

    def _range(self) -> str:
        if self.min is not None and self.max is not None and self.max < MAX_INT:
            return f"an integer in [{self.min}, {self.max}]"
        return f"an integer >= {self.min}" if self.min is not None else "an integer"

    def problem(self, v: Any) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool)
        ok = ok and (self.min is None or v >= self.min) and (self.max is None or v <= self.max)
        return None if ok else f"{self._range()} (got {v!r})"

    def parse(self, raw: str) -> int:
        try:
            v = int(str(raw).strip())
        except ValueError:
            raise ValueError(f"{self._range()} (got {raw!r})") from None
        if msg := self.problem(v):
            raise ValueError(msg)
        return v


@dataclasses.dataclass(frozen=True)
class Float:
    """A finite number in ``[min, max]`` (``min_open``: strictly above ``min``)."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    def _range(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f"{'>' if self.min_open else '>='} {self.min:g}")
        if self.max is not None:
            parts.append(f"{'<' if self.max_open else '<='} {self.max:g}")
        return "a finite number" + (" " + " and ".join(parts) if parts else "")

    def problem(self, v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return f"{self._range()} (got {v!r})"
        lo, hi = self.min, self.max
        if lo is not None and (v <= lo if self.min_open else v < lo):
            return f"{self._range()} (got {v!r})"
        if hi is not None and (v >= hi if self.max_open else v > hi):
            return f"{self._range()} (got {v!r})"
        return None

    def parse(self, raw: str) -> float:
        try:
            v = float(str(raw).strip())
        except ValueError:
            raise ValueError(f"{self._range()} (got {raw!r})") from None
        if msg := self.problem(v):
            raise ValueError(msg.replace(repr(v), repr(raw)))
        return v


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of a fixed set of words."""

    options: tuple[str, ...]

    def problem(self, v: Any) -> str | None:
        if v in self.options:
            return None
        close = difflib.get_close_matches(str(v), self.options, n=1, cutoff=0.6)
        guess = f"; did you mean {close[0]}?" if close else ""
        return f"one of {', '.join(self.options)} (got {v!r}){guess}"

    def parse(self, raw: str) -> str:
        if msg := self.problem(str(raw).strip()):
            raise ValueError(msg)
        return str(raw).strip()


@dataclasses.dataclass(frozen=True)
class Ints:
    """A non-empty list of integers in ``[min, max]``, written ``64,64`` (or ``64x64``)."""

    min: int = 1
    max: int = 1 << 20
    like: str = "64,64"  # an example, in the message of a bad value

    def problem(self, v: Any) -> str | None:
        ok = isinstance(v, tuple | list) and len(v) > 0
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ok = ok and all(self.min <= x <= self.max for x in v)
        return None if ok else f"integers in [{self.min}, {self.max}] like {self.like} (got {v!r})"

    def parse(self, raw: str) -> tuple[int, ...]:
        try:
            v = tuple(int(x) for x in str(raw).replace("x", ",").split(","))  # "1,,2": no
        except ValueError:
            v = None
        if msg := self.problem(v):
            raise ValueError(msg.replace(repr(v), repr(raw)))
        return v  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Text:
    """A non-empty string without control characters (a name or a path)."""

    def problem(self, v: Any) -> str | None:
        ok = isinstance(v, str) and v.strip() != "" and v.isprintable()
        return None if ok else f"a non-empty printable text (got {v!r})"

    def parse(self, raw: str) -> str:
        if msg := self.problem(raw):
            raise ValueError(msg)
        return raw


@dataclasses.dataclass(frozen=True)
class Flag:
    """true or false (``1``/``0``, ``yes``/``no`` from a command line)."""

    def problem(self, v: Any) -> str | None:
        return None if isinstance(v, bool) else f"true or false (got {v!r})"

    def parse(self, raw: str) -> bool:
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ValueError(f"true or false (got {raw!r})")


@dataclasses.dataclass(frozen=True)
class Optional:
    """``None`` or a value of ``inner``."""

    inner: Any

    def problem(self, v: Any) -> str | None:
        return None if v is None else self.inner.problem(v)

    def parse(self, raw: str) -> Any:
        return self.inner.parse(raw)


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A setting that is more than a word or a number (a batch schedule, a codec, a
    straggler): its text parsed once into ``kind`` (``kind.parse(text)``, which raises a
    one-line UsageError), and ``str(value)`` gives the text back."""

    kind: type
    like: str

    def problem(self, v: Any) -> str | None:
        return None if isinstance(v, self.kind) else f"text like {self.like} (got {v!r})"

    def parse(self, raw: str) -> Any:
        try:
            return self.kind.parse(raw)
        except UsageError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None


def parse_typed(obj: Any, skip: tuple[str, ...] = ()) -> None:
    """Parse, in place and once, the text a frozen dataclass was given for its ``Parsed``
    fields (``RunSpec``, ``PredictOptions``): the edge where text becomes a type."""
    for f in dataclasses.fields(obj):
        kind = f.metadata.get("value")
        kind = kind.inner if isinstance(kind, Optional) else kind
        value = getattr(obj, f.name)
        if isinstance(kind, Parsed) and isinstance(value, str) and f.name not in skip:
            object.__setattr__(obj, f.name, kind.kind.parse(value))


@dataclasses.dataclass(frozen=True)
class Pairs:
    """``KEY=VALUE`` pairs (``--model-opt``): a tuple of ``(key, value)`` strings; the
    keys and values are checked by whatever they configure (a model, a data set)."""

    def problem(self, v: Any) -> str | None:
        ok = isinstance(v, tuple | list) and all(
            isinstance(p, tuple | list) and len(p) == 2 and all(isinstance(s, str) for s in p)
            and p[0] for p in v
        )  # fmt: skip
        return None if ok else f"KEY=VALUE pairs (got {v!r})"

    def parse(self, raw: str) -> tuple[tuple[str, str], ...]:
        key, sep, value = str(raw).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"KEY=VALUE (got {raw!r})")
        return ((key.strip(), value.strip()),)


def like(default: Any) -> Any:
    """The value type a plain default suggests (for options declared by a default only)."""
    if isinstance(default, bool):
        return Flag()
    if isinstance(default, int):
        return Int()
    if isinstance(default, float):
        return Float()
    if isinstance(default, tuple):
        return Ints()
    return Text()


@dataclasses.dataclass(frozen=True)
class Option:
    """A named knob of a model or data set: its default, its value type and what it does."""

    default: Any
    value: Any
    help: str = ""

    def parse(self, key: str, raw: str, flag: str) -> Any:
        """``raw`` (a command-line string) as this option's value, or a UsageError."""
        try:
            return self.value.parse(raw)
        except ValueError as e:
            raise UsageError(f"{flag} {key}={raw!r}: must be {e}") from None


def parse_options(
    options: dict[str, Option], overrides: dict[str, str], owner: str, flag: str
) -> dict[str, Any]:
    """The options' defaults with ``overrides`` (strings) parsed and checked; an unknown key
    names the known ones."""
    out = {k: o.default for k, o in options.items()}
    for key, raw in overrides.items():
        if key not in options:
            raise UsageError(
                f"{owner} has no option {key!r}; its options are: "
                f"{', '.join(sorted(options)) or 'none'}"
            )
        out[key] = options[key].parse(key, raw, flag)
    return out


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def memory_size(text: str) -> float:
    """``80GB``, ``64MiB``, ``1.5e9`` or a plain byte count, in bytes."""
    try:
        value = float(text)
        if value > 0 and math.isfinite(value):
            return value
    except ValueError:
        pass
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--memory-limit {text!r}: give bytes, e.g. 80GB, 64MiB or 8e10")
    if (m.group(2) or "").endswith("b"):  # a lower-case b is bits (Gb): say bytes
        raise UsageError(f"--memory-limit {text!r}: a lower-case b is bits; give bytes with "
                         f"B, e.g. {m.group(1)}{m.group(2)[:-1].capitalize()}B")  # fmt: skip
    unit = (m.group(2) or "B").upper().rstrip("B")
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    return float(m.group(1)) * base**power
