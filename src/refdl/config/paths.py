"""Output paths checked before any work: a file the run will write can be written there.

Checked by trying, not by permission bits (root passes every permission check, and
``/proc`` refuses files whatever the bits say): the nearest existing folder on the
path must be a folder that accepts a temporary file. Nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
