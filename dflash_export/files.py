"""Files the project keeps for itself: where its cache lives, and the content hash that names a build's inputs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """The user's cache for converted targets, generated data and tiny pairs (DFLASH_CACHE overrides)."""
    root = os.environ.get("DFLASH_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "dflash-export")
    p = Path(os.path.expanduser(root))
    p.mkdir(parents=True, exist_ok=True)
    return p


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
