"""User-facing errors: one line naming the file and field, exit code 2, no traceback."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
        self.path = path
        self.field = field


class CheckFailed(DFlashError):
    """A validation threshold failed (exit code 1, distinct from bad input)."""

    exit_code = 1


class MissingDependency(DFlashError):
    """An optional library or hardware needed by a backend is absent."""

    exit_code = 2


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file that must hold an object; missing, unparsable or non-object files are one DFlashError line."""
    import json

    path = Path(path)
    if not path.is_file():
        raise DFlashError("file not found", path=path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"not valid JSON ({e})", path=path) from None
    if not isinstance(data, dict):
        raise DFlashError("expected a JSON object", path=path)
    return data


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `final` only if the block completes.

    A half-written directory is removed on any exception, so it can never be taken for a finished artifact.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a finished artifact should read like any other directory
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(final: str | os.PathLike, mode: str = "w") -> Iterator:
    """Open a temp file next to `final` and move it into place on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
