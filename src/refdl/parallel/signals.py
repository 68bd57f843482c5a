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
        self.run_dir: str | None = None  # the run folder, told to mpirun's caller on a signal
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
        if signum not in self.MEANS and "OMPI_COMM_WORLD_RANK" in os.environ:
            _tell_mpiruns_caller(signum, self.run_dir)
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


LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")


def _tell_mpiruns_caller(signum: int, run_dir: str | None) -> None:
    """Plain ``mpirun`` answers SIGINT/SIGTERM by ending the ranks within a quarter second
    and drops what they print meanwhile: rank 0 writes its one line straight to the
    stderr of ``mpirun`` itself (its parent process on the launching host)."""
    if os.environ.get("OMPI_COMM_WORLD_RANK") != "0":
        return
    name = signal.Signals(signum).name
    where = (f"the newest intact checkpoint in {run_dir}/checkpoints continues it with "
             f"--resume {run_dir}" if run_dir else "nothing was written yet")  # fmt: skip
    line = (
        f"refdl (rank 0): interrupted by {name} through mpirun, which ends the ranks "
        f"at once; {where} (refdl launch, or kill -USR1 to mpirun, stops cleanly)\n"
    )
    try:
        parent = os.getppid()
        with open(f"/proc/{parent}/comm") as f:
            if f.read().strip() not in LAUNCHERS:
                return
        fd = os.open(f"/proc/{parent}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # no /proc, another launcher: the rank's own stderr is all there is


STOPPER = Stopper()
