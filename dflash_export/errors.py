"""User-facing errors: one line naming the file and field, exit code 2, no traceback."""

from __future__ import annotations

import os


class DFlashError(Exception):
    """A problem with the user's input. The CLI prints `error: <message>` and exits with `exit_code`."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, field: str | None = None):
        where = ""
        if path is not None:
            where = str(path)
            if field:
                where += f": {field}"
            where += ": "
        elif field:
            where = f"{field}: "
        super().__init__(where + message)
        self.message = message  # without the `path: field: ` prefix, for errors that wrap another
        self.path = path
        self.field = field


class CheckFailed(DFlashError):
    """A validation threshold failed (exit code 1, distinct from bad input)."""

    exit_code = 1


class MissingDependency(DFlashError):
    """An optional library or hardware needed by a backend is absent."""

    exit_code = 2


# ------------------------------------------------------------------------------------------------ output paths
# Checked before any work: a run that can only fail at its last step, or that would replace someone's directory,
# is refused up front with one line naming the option.


