"""Where models come from: plain paths (with ~ and $VARS), Hugging Face ids (`Qwen/Qwen3-8B`) found in the local
Hugging Face cache (never fetched: this tool does not talk to a hub), `tiny:<name>` pairs built on the fly, and
`pkg:<dist>` files shipped inside installed Python packages (located through importlib metadata, never a hard-coded
path)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dflash_export.errors import DFlashError


def package_file(dist: str, suffix: str) -> Path:
    """The one file ending in `suffix` inside installed distribution `dist` (e.g. the SmolLM2 GGUF)."""
    from importlib import metadata

    from dflash_export.environment import install_hint_for_dist

    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise DFlashError(f"package {dist!r} is not installed ({install_hint_for_dist(dist)})", field=dist) from None
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


HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*(?:@[A-Za-z0-9_.\-/]+)?$")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (XDG_CACHE_HOME honoured)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def is_hf_id(spec: str) -> bool:
    """`org/name[@revision]` that is not a path that exists (a local directory of that name wins)."""
    return bool(HF_ID.match(spec)) and not Path(spec.split("@")[0]).exists()


def hf_snapshot(repo_id: str, field: str | None = None) -> Path:
    """The local snapshot of a Hugging Face model id (`org/name`, or `org/name@revision`: a branch, tag or commit),
    in huggingface_hub's cache layout (models--org--name/refs/<rev> -> snapshots/<commit>/). Offline; when it is not
    there, one line saying how to fetch it."""
    repo, _, rev = repo_id.partition("@")
    rev = rev or "main"
    root = hf_cache_dir() / ("models--" + repo.replace("/", "--"))
    commit = rev
    ref = root / "refs" / rev
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    snap = root / "snapshots" / commit
    if not root.is_dir() or not snap.is_dir():
        raise DFlashError(f"{repo_id} is not in the local Hugging Face cache ({hf_cache_dir()}); fetch it where a hub "
                          f"is reachable with `hf download {repo}{'' if rev == 'main' else f' --revision {rev}'}` "
                          "(HF_HUB_CACHE / HF_HOME choose the cache), or give a local path", field=field)
    return snap


class SourcePath(str):
    """A source already made a local path (`~` and $VARS expanded, made absolute: a recipe's resolved target or
    drafter, a command line's path): `resolve_source` takes it as it is, so a `$` or `~` that a directory's name
    holds is never expanded a second time."""


def resolve_source(spec) -> Path:
    """`tiny:NAME[/target|/drafter]`, `pkg:DIST:SUFFIX`, a Hugging Face id in the local cache, or a filesystem
    path (`~` and $VARS expanded, except in a Path or a SourcePath: those are paths already)."""
    if isinstance(spec, (Path, SourcePath)):
        return Path(spec)
    s = str(spec)
    if s.startswith("tiny:"):
        from dflash_export.models.tiny import tiny_pair_path

        return tiny_pair_path(s[len("tiny:"):])
    if s.startswith("pkg:"):
        return package_file(*split_pkg_spec(s))
    s = os.path.expandvars(os.path.expanduser(s))
    if is_hf_id(s):
        return hf_snapshot(s)
    return Path(s)
