"""User-facing errors: one line naming the file and field, no traceback; and the exit codes every command uses."""

from __future__ import annotations

import os
import signal

# The exit codes of every command (the `dflash-export --help` epilogue and docs/stages.md say the same): a script or
# CI job can tell a failed check from a wrong command line from a bug.
EXIT_OK = 0             # the command did its work and every check it makes held
EXIT_CHECK_FAILED = 1   # the work was done, and a check failed (a validate threshold, an incomplete drain)
EXIT_INPUT = 2          # usage or input error: bad option, bad file, missing library or engine; nothing was done
EXIT_INTERNAL = 3       # a bug or a crashed subprocess (tritonserver): one line, the traceback in a file

EXIT_CODES_HELP = ("Exit codes: 0 done (every check held), 1 a check failed, 2 usage or input error (nothing done), "
                   "3 internal error.")


class DFlashError(Exception):
    """A problem with the user's input. The CLI prints `error: <message>` and exits with `exit_code`."""

    exit_code = EXIT_INPUT

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


# How an error message names the type of a value read from a file or a request ("expected a string, got null"): the
# words of YAML and JSON, not Python's type names.
_KIND_OF_TYPE = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
                 int: "an integer", float: "a number"}


def kind_of_type(typ: type, mapping: str = "a mapping") -> str:
    """The words for values of `typ` ("an integer"); `mapping`: those for a dict (JSON's "an object")."""
    return mapping if typ is dict else _KIND_OF_TYPE.get(typ, typ.__name__)


def kind(value, mapping: str = "a mapping") -> str:
    """The words for `value`'s type ("a string", "null")."""
    return kind_of_type(type(value), mapping)


def json_kind(value) -> str:
    """The words for a JSON value's type: `kind` with JSON's "an object" for a dict (manifests, configs, requests)."""
    return kind(value, "an object")


# The signals that stop a command (Ctrl-C, `kill`, a closed terminal): KeyboardInterrupt or Terminated where it is.
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) raised like Ctrl-C, so that every writer's cleanup runs (files.atomic_dir, atomic_file,
    removing_new_dirs) instead of the process vanishing with its temporary siblings left behind. args[0]: the signal
    number (the CLI exits 128 + it)."""


class CheckFailed(DFlashError):
    """A validation threshold failed (exit code 1, distinct from bad input)."""

    exit_code = EXIT_CHECK_FAILED


class MissingDependency(DFlashError):
    """An optional library or hardware a command needs is absent (exit code 2: the environment is the input)."""

    exit_code = EXIT_INPUT


# ------------------------------------------------------------------------------------------------ output paths
# Checked before any work: a run that can only fail at its last step, or that would replace someone's directory,
# is refused up front with one line naming the option.


