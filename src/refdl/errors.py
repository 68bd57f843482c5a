"""Errors a user can act on: each becomes one line on stderr and exit status 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do, on one
    line (text from elsewhere, e.g. a library's exception, is folded into it)."""

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).split()))


def together(*checks: Callable[[], object]) -> None:
    """Run independent checks and name every mistake at once: their UsageErrors become
    one (``first; second``), so a user fixes a command in one round, not one per run."""
    found: list[str] = []
    for check in checks:
        try:
            check()
        except UsageError as e:
            if str(e) not in found:
                found.append(str(e))
    if found:
        raise problems(found)


def problems(found: list[str]) -> UsageError:
    """One error naming every problem found (``2 problems: first; second``)."""
    return UsageError(
        found[0] if len(found) == 1 else f"{len(found)} problems: " + "; ".join(found)
    )


class DataError(UsageError):
    """A data file is missing or malformed: the message names the file."""


class DivergedError(RuntimeError):
    """The loss became NaN or Inf; the message names the step."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the run; ``checkpoint`` is the one written on the way out
    (None if none could be). The CLI exits ``128 + signum`` (130, 143)."""

    def __init__(self, signum: int, checkpoint: object = None) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum, self.checkpoint = signum, checkpoint


class ValidationFailed(RuntimeError):
    """Another framework's run, which refdl validate started, failed: the message says how
    (one line; exit status 1)."""


class WriteError(RuntimeError):
    """A run's file could not be written (disk full, unwritable); the message names the
    last good checkpoint. The CLI prints it as one line and exits 1."""


def exit_status(main: Callable[[], int | None], prog: str) -> int:
    """Run a CLI's ``main`` and flush its output: a write that fails where no command
    handled it (standard output on a full disk, a closed pipe) is one line and exit 1,
    not a traceback; so is running out of memory (exit 1) and a ``UsageError`` no command
    caught (exit 2)."""
    try:
        status = main()
        sys.stdout.flush()
        return int(status or 0)
    except UsageError as e:  # (a command that did not catch its own: still one line)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in a command that keeps no state (plan, predict,
        # bench): one line and the shell's 130, not a traceback (train handles its own)
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head` closed the pipe: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        where = e.filename or "standard output"
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to say
        print(f"{prog}: error: cannot write {where} ({e.strerror or e})", file=sys.stderr)
        return 1
    except Exception as e:  # out of memory (the host's or XLA's): one line, not a traceback
        if not (isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)):
            raise
        what = (str(e).strip().splitlines() or ["MemoryError"])[0][:300]
        print(f"{prog}: error: out of memory ({what}); use a smaller --batch-size or model, "
              "more devices, or --remat", file=sys.stderr)  # fmt: skip
        return 1
