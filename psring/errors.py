"""The one exception type users see.

Anything raised as :class:`PsringError` reaches the command line as a single
paragraph (what went wrong and how to fix it) and a non-zero exit status, never as
a traceback. Everything else is a bug and keeps its traceback.
"""


class PsringError(Exception):
    """A failure with a message written for the user: the cause and the fix."""

    exit_code = 2


class ConfigError(PsringError):
    """Bad input: a flag, a combination of flags, or the machine can't do what was asked."""


class RunFailed(PsringError):
    """A launched run did not finish: a process failed, or the run was interrupted."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
