"""Files from elsewhere read as data, with limits: a regular file or a one-line refusal.

Every file a user (or someone else) hands refdl - a recipe, a profile, a checkpoint's
manifest, a run folder's records, a data file, a log - is read through these: it
must be a regular file (a FIFO or a device is refused at once instead of blocking),
no larger than a bound, and JSON or TOML no deeper than ``MAX_DEPTH``, checked by a
scan before the parser runs (the parsers recurse) and on the parsed value. Each
problem is one ``error`` (``UsageError`` by default) naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from refdl.errors import UsageError

MAX_DEPTH = 64  # nesting of JSON/TOML values; refdl's own files stay below 8
MiB = 1 << 20
TEXT_LIMIT = 64 * MiB  # recipes, profiles, manifests, logs


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, what: str, limit: int, error: type[Exception] = UsageError
                 ) -> int:  # fmt: skip
    """A read-only descriptor of ``path`` once it is known to be a regular file of at most
    ``limit`` bytes. Opened without blocking, so a FIFO is refused, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file") from None
    except OSError as e:
        raise error(f"{what} {path}: cannot read ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{what} {path}: is {_kind(st.st_mode)}, not a regular file; give a file")
    if st.st_size > limit:
        os.close(fd)
        raise error(
            f"{what} {path}: {st.st_size} bytes, more than the {limit} such a file may have"
        )
    os.set_blocking(fd, True)
    return fd


def check_regular(path: str | Path, what: str, limit: int, error: type[Exception] = UsageError
                  ) -> Path:  # fmt: skip
    """``path`` once it is a regular file of at most ``limit`` bytes (for readers that open
    it themselves, e.g. NumPy's)."""
    os.close(open_regular(path, what, limit, error))
    return Path(path)


def read_bytes(path: str | Path, what: str, limit: int, error: type[Exception] = UsageError
               ) -> bytes:  # fmt: skip
    """The bytes of a regular file of at most ``limit`` bytes (read no further, even if it
    grows meanwhile)."""
    fd = open_regular(path, what, limit, error)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"{what} {path}: cannot read ({e.strerror or e})") from None
    if len(data) > limit:
        raise error(f"{what} {path}: more than the {limit} bytes such a file may have")
    return data


def read_text(path: str | Path, what: str, limit: int = TEXT_LIMIT,
              error: type[Exception] = UsageError) -> str:  # fmt: skip
    """A regular file's UTF-8 text."""
    try:
        return read_bytes(path, what, limit, error).decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path}: not UTF-8 text") from None


def scan_depth(text: str) -> int:
    """The deepest nesting of brackets and braces in JSON or TOML text, outside strings and
    comments - a bound on what the parser will recurse into, found without recursing."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            j = i + len(quote)
            while j < n and not text.startswith(quote, j):
                j += 2 if (text[j] == "\\" and c == '"') else 1
            i = j + len(quote)
            continue
        i += 1
    return deepest


def value_depth(value: Any) -> int:
    """The nesting depth of a parsed value (lists and tables), walked without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            todo.extend((x, d + 1) for x in v)
        else:
            continue
        deepest = max(deepest, d + 1)
    return deepest


def _shallow(text: str, what: str, error: type[Exception], max_depth: int) -> None:
    brackets = text.count("[") + text.count("{")  # a bound on the depth, found quickly
    if brackets > max_depth and scan_depth(text) > max_depth:
        raise error(f"{what}: nested deeper than {max_depth} levels; not a file refdl reads")


def loads_json(text: str, what: str, error: type[Exception] = UsageError,
               max_depth: int = MAX_DEPTH) -> Any:  # fmt: skip
    """JSON text parsed after its depth was checked; a one-line ``error`` otherwise."""
    _shallow(text, what, error, max_depth)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise error(f"{what}: not valid JSON ({e})") from None


def loads_toml(text: str, what: str, error: type[Exception] = UsageError,
               max_depth: int = MAX_DEPTH) -> dict[str, Any]:  # fmt: skip
    """TOML text parsed after its depth was checked (dotted keys checked after parsing)."""
    _shallow(text, what, error, max_depth)
    try:
        value = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise error(f"{what}: not valid TOML ({e})") from None
    if value_depth(value) > max_depth:
        raise error(f"{what}: nested deeper than {max_depth} levels; not a file refdl reads")
    return value


def load_json(path: str | Path, what: str, limit: int = TEXT_LIMIT,
              error: type[Exception] = UsageError) -> Any:  # fmt: skip
    """A JSON file from elsewhere: regular, bounded, shallow."""
    return loads_json(read_text(path, what, limit, error), f"{what} {path}", error)


def load_toml(path: str | Path, what: str, limit: int = TEXT_LIMIT,
              error: type[Exception] = UsageError) -> dict[str, Any]:  # fmt: skip
    """A TOML file from elsewhere: regular, bounded, shallow."""
    return loads_toml(read_text(path, what, limit, error), f"{what} {path}", error)


def printable(text: str, limit: int = 80) -> str:
    """``text`` safe to print on a terminal: control characters escaped, length bounded."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."
