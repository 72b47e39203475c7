"""The one exception type users see.

Anything raised as :class:`PsringError` reaches the command line as a single
paragraph (what went wrong and how to fix it) and a non-zero exit status, never as
a traceback. Everything else is a bug and keeps its traceback.
:func:`run_guarded` is where that happens, for the ``psring`` command and for the
modules that have a ``python -m`` entry point of their own.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


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


def run_guarded(func: Callable[[Any], int], args: Any) -> int:
    """Run a command: a PsringError is one paragraph and its exit status; Ctrl-C is 130."""
    try:
        return func(args)
    except PsringError as e:
        print(f"psring: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("psring: interrupted", file=sys.stderr)
        return 130
