"""Errors with exit codes from the command-line contract (DESIGN.md).

InputError (exit 2): the user's input is wrong; the message names the file and the problem.
GuardError (exit 3 unless the guard is about input): a named guard stopped the run.
"""

from __future__ import annotations


class EntrenarError(Exception):
    exit_code = 1


class InputError(EntrenarError, ValueError):
    """Bad input: a missing file, a malformed checkpoint, an unknown name. Exit 2."""

    exit_code = 2


class GuardError(EntrenarError):
    """A named guard fired. ``str()`` is 'GUARD-ID: cause. Remedy: ...'."""

    exit_code = 3

    def __init__(self, guard_id: str, cause: str, remedy: str = "", exit_code: int | None = None,
                 details: dict | None = None):
        self.guard_id, self.cause, self.remedy = guard_id, cause, remedy
        self.details = details or {}
        if exit_code is not None:
            self.exit_code = exit_code
        super().__init__(f"{guard_id}: {cause}" + (f" Remedy: {remedy}" if remedy else ""))


class LoadError(GuardError, ValueError):
    """GUARD-LOAD: checkpoint tensors and model disagree. Bad input, so exit 2."""

    def __init__(self, cause: str, remedy: str = "", details: dict | None = None):
        super().__init__("GUARD-LOAD", cause, remedy, exit_code=2, details=details)
