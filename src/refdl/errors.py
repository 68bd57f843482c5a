"""Errors a user can act on: each becomes one line on stderr and exit status 2."""


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do."""


class DataError(UsageError):
    """A data file is missing or malformed: the message names the file."""


class DivergedError(RuntimeError):
    """The loss became NaN or Inf; the message names the step."""
