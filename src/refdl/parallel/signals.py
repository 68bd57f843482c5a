"""SIGINT and SIGTERM (and their stand-ins under mpirun, SIGUSR1 and SIGUSR2), handled so
that a run ends whole. Imports nothing heavy: a CLI installs it before anything else."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, ClassVar

from refdl.errors import Interrupted


class Stopper:
    """SIGINT and SIGTERM, handled so that a run ends whole.

    While ``armed`` (the training loop is stepping or checkpointing), the first signal
    only asks the loop to stop after the step in flight: a step's input state may be
    donated, so stopping inside one would lose the state. Otherwise - during start-up,
    or at a second signal - it raises ``Interrupted`` at once. Under ``mpirun`` OpenMPI
    forwards the signals to every rank; the loop's ranks agree on the step to stop at.
    """

    def __init__(self) -> None:
        self.requested, self.signum, self.armed = False, 0, False
        self.exit_before_training: str | None = None  # a CLI's name: exit at once, quietly
        self._old: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._old)

    # OpenMPI's mpirun forwards SIGUSR1/SIGUSR2 to every rank and leaves the job alone,
    # while it answers SIGINT/SIGTERM with SIGTERM to the ranks and SIGKILL 0.25 s later
    # (PRRTE 3): so the launcher (``launch``) turns SIGINT/SIGTERM into SIGUSR1/SIGUSR2,
    # which the ranks take for the signal they stand for.
    MEANS: ClassVar[dict[int, int]] = {
        signal.SIGUSR1: signal.SIGINT,
        signal.SIGUSR2: signal.SIGTERM,
    }

    def install(self, exit_as: str | None = None) -> None:
        """Take over SIGINT, SIGTERM and their stand-ins SIGUSR1, SIGUSR2 (only from the
        main thread: elsewhere a no-op). ``exit_as`` (a CLI's name): a signal before the
        loop is armed ends the process at once with one line - nothing is written yet, and
        an exception raised from a handler can land where Python swallows it (a garbage
        collector callback)."""
        if exit_as:
            self.exit_before_training = exit_as
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            self._old[sig] = signal.signal(sig, self._handle)

    def reinstall(self) -> None:
        """Take the signals back from a library that installed its own handlers."""
        if self.installed:
            for sig in self._old:
                signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum: int, frame: Any) -> None:
        signum = int(self.MEANS.get(signum, signum))
        if not self.armed and self.exit_before_training:
            name = signal.Signals(signum).name
            os.write(2, f"{self.exit_before_training}: interrupted by {name} before training "
                        "began\n".encode())  # fmt: skip
            os._exit(128 + signum)
        if self.armed and not self.requested:
            self.requested, self.signum = True, signum
            if sys.stderr.isatty():  # a person at a terminal: say it was heard
                name = signal.Signals(signum).name
                print(f"refdl: {name}: stopping after this step ({name} again to stop at once)",
                      file=sys.stderr, flush=True)  # fmt: skip
            return
        raise Interrupted(signum)


STOPPER = Stopper()
