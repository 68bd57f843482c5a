"""Errors a user can act on: each becomes one line on stderr and exit status 2."""


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do."""


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
