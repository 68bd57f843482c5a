"""The run folder: made only once the inputs are valid, one run at a time, never two mixed.

``RunFolder.open`` (rank 0 under mpirun) checks that ``--out`` can hold the run
before training starts: it is a folder or can be made one, it is writable, no
other process is using it (an advisory lock on ``.lock``, released when the
process ends, even by ``kill -9``), and it does not hold another run - a
fresh run into a folder with another run's files is refused unless
``--overwrite`` (which removes them first), while ``--resume`` continues the
run the folder holds. Temporary checkpoint folders a killed writer left are
removed. Anything wrong is a one-line ``UsageError``.

Nothing refdl writes there follows a link it did not make: the lock is opened with
``O_NOFOLLOW`` (a link planted at ``.lock`` is removed, never followed), temporaries
are fresh ``mkstemp``/``mkdtemp`` names, files are renamed into place (replacing a
link instead of writing through it), and a ``checkpoints`` that is a link is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO

from refdl.errors import UsageError
from refdl.run import checkpoint

RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "timeline.json", "checkpoints")


def _holds_a_run(out: Path) -> str | None:
    """The first file of a run found in ``out`` (None when it holds none)."""
    for name in RUN_FILES:
        if (out / name).exists():
            return name
    return None


def _open_lock(out: Path) -> IO[str]:
    """``out/.lock`` as a regular file refdl opened itself: a link planted there is
    removed (never followed), anything else that is not a file is refused."""
    path = out / ".lock"
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        os.unlink(path)
        fd = os.open(path, flags | os.O_EXCL, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"--out {out}: .lock is not a regular file; remove it and run again")
    return os.fdopen(fd, "r+")


class RunFolder:
    """The ``--out`` folder of one run, locked while the run writes to it."""

    def __init__(self, out: Path, resume: bool, overwrite: bool) -> None:
        self.out, self.resume, self.overwrite = Path(out), resume, overwrite
        self._lock: IO[str] | None = None
        self.made = False

    def open(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file; give a folder for the run")
        try:
            self.made = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            self._lock = _open_lock(out)
        except OSError as e:
            self._undo()
            raise UsageError(f"--out {out}: cannot write there ({e.strerror or e})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            pid = self._lock.read().strip() or "?"
            self._lock.close()
            self._lock = None
            raise UsageError(
                f"--out {out} is in use by another run (pid {pid}); wait for it or choose "
                "another folder"
            ) from None
        try:
            self._lock.seek(0)
            self._lock.truncate()
            self._lock.write(f"{os.getpid()}\n")
            self._lock.flush()
            if (out / "checkpoints").is_symlink() and (self.resume or not self.overwrite):
                raise UsageError(
                    f"--out {out}: checkpoints is a link to {os.readlink(out / 'checkpoints')}; "
                    "refdl writes only inside the run folder: put the folder itself there"
                )
            found = _holds_a_run(out)
            if found and not self.resume:
                if not self.overwrite:
                    raise UsageError(
                        f"--out {out} holds another run ({found}); choose another folder, "
                        f"continue it with --resume {out}, or replace it with --overwrite"
                    )
                self._clear()
            checkpoint.remove_temporaries(out / "checkpoints")
            fd, probe = tempfile.mkstemp(dir=out, prefix=".write-test-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            self.close()
            self._undo()
            raise UsageError(f"--out {out}: cannot write there ({e.strerror or e})") from None
        except UsageError:
            self.close()
            raise

    def _clear(self) -> None:
        """``--overwrite``: remove the other run's files (nothing else in the folder)."""
        for name in RUN_FILES:
            p = self.out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        for p in self.out.glob("events.out.tfevents.*"):
            p.unlink()

    def _undo(self) -> None:
        """Remove the folder again if this run made it (so a refused run leaves nothing)."""
        if self.made:
            shutil.rmtree(self.out, ignore_errors=True)

    def close(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
