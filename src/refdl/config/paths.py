"""Output paths checked before any work: a file the run will write can be written there.

Checked by trying, not by permission bits (root passes every permission check, and
``/proc`` refuses files whatever the bits say): the nearest existing folder on the
path must be a folder that accepts a temporary file. Nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO

from refdl.errors import UsageError


def nearest_folder(path: Path) -> Path:
    """The nearest existing ancestor of ``path`` (``path`` itself when it exists)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def writable_file(path: str | Path, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a file to be written later: a one-line UsageError now if it cannot be."""
    p = Path(path)
    if suffixes and p.suffix.lower() not in suffixes:
        kinds = ", ".join(suffixes[:-1]) + " or " + suffixes[-1] if suffixes[1:] else suffixes[0]
        raise UsageError(f"{flag} {path}: give a {kinds} file")
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    _probe(nearest_folder(p.parent), flag, path)
    return p


def writable_folder(path: str | Path, flag: str) -> Path:
    """``path`` as a folder to be made and written later: a one-line UsageError now if it
    cannot be."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path}: is a file; give a folder")
    _probe(nearest_folder(p), flag, path)
    return p


def _probe(folder: Path, flag: str, path: str | Path) -> None:
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".refdl-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: the process's umask, unchanged


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a fresh temporary in the same folder (a name no one
    else could have planted: ``mkstemp`` opens it with ``O_EXCL``), synced, then renamed
    over ``path`` - which replaces a link there instead of writing through it. Missing
    folders above it are made (an output path may name folders not there yet)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would have made it (mkstemp: 0600)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text, refusing to follow a link there (ELOOP), so a
    planted link cannot send refdl's lines to another file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)  # fmt: skip
    return os.fdopen(fd, "a")
