"""SIGINT and SIGTERM (and their stand-ins under mpirun, SIGUSR1 and SIGUSR2), handled so
that a run ends whole. Imports nothing heavy: a CLI installs it before anything else."""

from __future__ import annotations

import contextlib
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
        self.before_exit: list[Any] = []  # called before a signal ends the process at once

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

    def poll(self) -> bool:
        """Whether a stop was asked: by a signal, or under ``refdl launch`` by the launcher's
        stop file, which also reaches ranks that were still starting when mpirun forwarded
        the signal (mpirun drops a signal for ranks it has not started)."""
        if not self.requested and (path := launch_file("stop")) and os.path.exists(path):
            try:
                with open(path) as f:
                    signum = int(f.read().strip() or signal.SIGINT)
            except (OSError, ValueError):
                signum = int(signal.SIGINT)
            self.requested, self.signum = True, signum
        return self.requested

    def _handle(self, signum: int, frame: Any) -> None:
        if signum not in self.MEANS and "OMPI_COMM_WORLD_RANK" in os.environ:
            _tell_mpiruns_caller(signum, self.run_dir)
        signum = int(self.MEANS.get(signum, signum))
        if not self.armed and self.exit_before_training:
            name = signal.Signals(signum).name
            say(f"{self.exit_before_training}: interrupted by {name} before training began", signum)
            for close in self.before_exit:  # (the heartbeats' goodbye: no rank is "lost")
                with contextlib.suppress(Exception):
                    close()
            os._exit(signal_exit_status(signum))
        if self.armed and not self.requested:
            self.requested, self.signum = True, signum
            if sys.stderr.isatty():  # a person at a terminal: say it was heard
                name = signal.Signals(signum).name
                print(f"refdl: {name}: stopping after this step ({name} again to stop at once)",
                      file=sys.stderr, flush=True)  # fmt: skip
            return
        raise Interrupted(signum)


LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")
LAUNCH_RECORD = "REFDL_LAUNCH_RECORD"  # refdl launch's record file (liveness.RECORD_VAR)


def launch_file(name: str) -> str | None:
    """A file ``NAME`` beside ``refdl launch``'s record, where the launcher and the ranks
    leave each other words (None when ``refdl launch`` did not start this process)."""
    path = os.environ.get(LAUNCH_RECORD)
    return os.path.join(os.path.dirname(path), name) if path else None


def signal_exit_status(signum: int) -> int:
    """A rank's exit status after a signal: ``128 + signum``, but 0 under ``refdl launch``,
    whose own status says it (a non-zero rank makes mpirun print a banner and end the
    others at once)."""
    return 0 if under_launch() else 128 + int(signum)


def under_launch() -> bool:
    """Whether ``refdl launch`` started this process (it then says the run's line)."""
    return launch_file("stop") is not None


def say(line: str, signum: int) -> None:
    """A rank's last line to the user. Under ``refdl launch`` it is left for the launcher,
    which prints one line per run (mpirun drops what ranks print as it ends them, and
    every rank would print its own); elsewhere it goes to stderr."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    path = launch_file(f"said.{rank}")
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{int(signum)}\n{line}\n")  # the launcher's exit status, then words
            return
        except OSError:
            pass  # the launcher's folder is gone: stderr is all there is
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def _tell_mpiruns_caller(signum: int, run_dir: str | None) -> None:
    """Plain ``mpirun`` answers SIGINT/SIGTERM by ending the ranks within a quarter second
    and drops what they print meanwhile: rank 0 writes its one line straight to the
    stderr of ``mpirun`` itself (its parent process on the launching host)."""
    if os.environ.get("OMPI_COMM_WORLD_RANK") != "0" or under_launch():
        return  # (under refdl launch, mpirun's SIGTERM ends a job the launcher explains)
    name = signal.Signals(signum).name
    saved = run_dir and any(p.startswith("step_") for p in _listdir(f"{run_dir}/checkpoints"))
    where = (f"the newest intact checkpoint in {run_dir}/checkpoints continues it with "
             f"--resume {run_dir}" if saved else "no checkpoint was written yet")  # fmt: skip
    line = (  # mpirun sends it when it was interrupted, and when a rank ended or was lost
        f"refdl (rank 0): ended by {name} from mpirun (it was interrupted, or a rank ended "
        f"or was lost); {where} (refdl launch, or kill -USR1 to mpirun, stops cleanly)\n"
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


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


STOPPER = Stopper()
