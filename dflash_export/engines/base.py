"""The backend-agnostic engine contract and the engine directory (manifest, hashes, atomic builds).

An engine owns the compiled graphs and the per-sequence state (KV caches, pending context features); the runtime
(`dflash_export.runtime`) owns the loop, sampling randomness, stop handling and streaming. Keeping the two apart is what
lets one loop drive ONNX Runtime, TensorRT and the PyTorch reference alike.

This module imports neither torch nor onnxruntime: a served ORT engine needs only numpy, onnxruntime and tokenizers.
"""

from __future__ import annotations

import json
import platform
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_export.errors import DFlashError
from dflash_export.files import read_json_object, sha256_file

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass
class SamplingParams:
    """Per-request decoding settings. temperature 0 = greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: list[int] | None = None  # None: the target's own stop ids

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class EngineInfo:
    backend: str
    recipe: str
    block_size: int
    mask_token_id: int
    vocab_size: int
    stop_token_ids: list[int]
    max_seq_len: int
    target_layer_ids: list[int] = field(default_factory=list)
    # Cost of verifying one more draft, in plain steps (verify of n drafts ~ 1 + n * this); None = the runtime's
    # default. Quantized ONNX Runtime engines record theirs (their int8 kernels grow with the rows, fp32's barely).
    verify_token_cost: float | None = None
    draft_cost: float | None = None


class Sequence:
    """Per-request state. `length` = committed tokens in the target cache; the next anchor sits at `length`."""

    def __init__(self):
        self.length = 0
        # Set by `draft` in greedy mode on backends that can: the drafter's probability of each greedy draft [bs-1].
        # Lets the runtime verify only the drafts worth their verification cost (see DFlashRuntime).
        self.draft_confidence = None


class Engine(ABC):
    """What a compiled backend provides to the runtime. Arrays are numpy; batch size 1.

    Call order per request: `prefill` once, then either AR `decode` steps or DFlash steps of `draft` + `verify`.
    """

    info: EngineInfo
    codec: Any  # dflash_export.tokenization.TextCodec
    # True when `verify` appends its context features to those still pending (a verify with no draft before it,
    # e.g. a one-token block) instead of replacing them: then the runtime may skip drafting for a few steps.
    accumulates_context: bool = False
    # True when the graphs take blocks of exactly block_size (TensorRT profiles): then the runtime never shortens the
    # last block (z-lab does), which leaves the tokens unchanged and only the last step's acceptance length may differ.
    fixed_block: bool = False

    @abstractmethod
    def new_sequence(self, max_tokens: int | None = None) -> Sequence:
        """A fresh sequence. `max_tokens`: how long it may grow (prompt + new tokens + a block), a hint that lets
        an engine size its caches once instead of growing them."""

    @abstractmethod
    def prefill(self, seq: Sequence, input_ids: np.ndarray) -> np.ndarray:
        """Run the prompt [S] int64 through the target; keep its context features pending for the drafter.

        Returns the logits of the last prompt position [V] float32. Afterwards seq.length == S.
        """

    @abstractmethod
    def decode(self, seq: Sequence, token: int) -> np.ndarray:
        """AR step: commit `token` at position seq.length and return the next-token logits [V] float32."""

    @abstractmethod
    def draft(self, seq: Sequence, anchor: int, sp: SamplingParams, uniforms: np.ndarray | None,
              block_len: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Draft block slots 1..n-1 after `anchor` (at position seq.length), consuming the pending context.

        `block_len` n (2..bs, default bs): the drafter runs over a block of n slots; the runtime shortens the last
        block to what the request still needs, as z-lab's release does (a shorter block changes what a bidirectional
        drafter proposes, not what is emitted). An engine with fixed block shapes may draft the full block.
        Returns draft tokens [>= n-1] int64 and, when sampling, their draft distributions [>= n-1, V] (float64, after
        temperature / top-k / top-p). `uniforms` [bs-1] drive the inverse-CDF draws when sampling.
        """

    @abstractmethod
    def verify(self, seq: Sequence, block: np.ndarray, draft_probs: np.ndarray | None, sp: SamplingParams,
               uniforms: np.ndarray | None) -> tuple[int, list[int]]:
        """Score `block` [bs] (anchor + drafts) with the target, accept, and commit.

        Returns (accept_len, emitted) as `sampling.verify_block`. Afterwards the target cache holds anchor + accepted
        drafts (seq.length += accept_len + 1) and their context features are pending for the next draft (appended to
        those still pending when the engine `accumulates_context`).
        """

    def close(self) -> None:
        """Release sessions / device memory."""


# ----------------------------------------------------------------------------------------------------------------------
# Engine directories


def hash_inputs(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under the given files / directories, keyed by path (the build's identity)."""
    out = {}
    for p in paths:
        p = Path(p)
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            out[str(f)] = sha256_file(f)
    return out


def library_versions(names=("numpy", "onnx", "onnxruntime", "torch", "transformers", "optimum-onnx", "tensorrt",
                            "tensorrt-llm", "tokenizers")) -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def write_manifest(engine_dir: Path, manifest: dict[str, Any]) -> None:
    """Record hashes of every file in `engine_dir` (so tampering or truncation is caught at load) + the manifest."""
    from dflash_export import __version__

    files = {str(p.relative_to(engine_dir)): sha256_file(p) for p in sorted(engine_dir.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    full = {"manifest_version": MANIFEST_VERSION, "tool": "dflash-export", "tool_version": __version__,
            "libraries": library_versions(), **manifest, "files": files}
    (engine_dir / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=False) + "\n")


BACKEND_NAMES = ("onnxruntime", "tensorrt", "tensorrt-llm", "pytorch")  # what a manifest may name (engines/registry)
_SHAPE_KEYS = ("target_layers", "target_kv_heads", "target_head_dim", "drafter_layers", "drafter_kv_heads",
               "drafter_head_dim")
# Fields each backend's loader reads from the manifest; the others are checked only when present. (TensorRT's loader
# names its own missing fields with a rebuild hint: older TensorRT builds did not record them.)
_REQUIRED = {"onnxruntime": ("engine_format", "vocab_size", "stop_token_ids", "max_seq_len", "target_layer_ids",
                             "shapes", "shared_tensors"),
             "pytorch": ("recipe_path",), "tensorrt": (), "tensorrt-llm": ()}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def validate_manifest(manifest, path) -> dict[str, Any]:
    """Check the structure, types and ranges of every manifest field the loaders use; DFlashError naming `path`
    (the manifest.json) and the field otherwise. Returns the manifest unchanged.

    Fields a backend needs must be present; the others are checked when present. An unknown manifest_version is
    refused (a manifest without one predates versioning and reads as version 1).
    """
    path = Path(path)

    def bad(field, message):
        return DFlashError(message, path=path, field=field)

    if not isinstance(manifest, dict):
        raise DFlashError(f"expected a JSON object, got {_kind(manifest)}", path=path)
    version = manifest.get("manifest_version", MANIFEST_VERSION)
    if not _is_int(version) or version != MANIFEST_VERSION:
        raise bad("manifest_version", f"unsupported manifest version {version!r} (this dflash-export reads version "
                                      f"{MANIFEST_VERSION}): rebuild the engine with this version")
    for key in ("backend", "files", "block_size", "mask_token_id"):
        if key not in manifest:
            raise bad(key, "missing field")
    backend = manifest["backend"]
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise bad("backend", f"unknown backend {backend!r} (known: {', '.join(BACKEND_NAMES)})")
    for key in _REQUIRED[backend]:
        if key not in manifest:
            raise bad(key, f"missing field (a {backend} engine needs it)")

    files = manifest["files"]
    if not isinstance(files, dict):
        raise bad("files", f"expected a mapping of file name to sha256, got {_kind(files)}")
    for rel, digest in files.items():
        p = Path(rel)
        if not rel or p.is_absolute() or ".." in p.parts or rel == MANIFEST:
            raise bad("files", f"{rel!r} is not a file inside the engine directory")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise bad(f"files.{rel}", f"expected a sha256 hex digest, got {digest!r}")

    def integer(key, minimum, value=None, name=None):
        v = manifest[key] if value is None else value
        if not _is_int(v):
            raise bad(name or key, f"expected an integer, got {_kind(v)} ({v!r})")
        if v < minimum:
            raise bad(name or key, f"must be >= {minimum}, got {v}")
        return v

    def int_list(key, minimum=0, nonempty=False):
        v = manifest[key]
        if not isinstance(v, list) or (nonempty and not v):
            raise bad(key, f"expected a{' non-empty' if nonempty else ''} list of integers, got {_kind(v)} ({v!r})")
        for i, x in enumerate(v):
            integer(key, minimum, x, f"{key}[{i}]")
        return v

    def mapping(key):
        v = manifest[key]
        if not isinstance(v, dict):
            raise bad(key, f"expected a mapping, got {_kind(v)}")
        return v

    def string(key):
        v = manifest[key]
        if not isinstance(v, str) or not v:
            raise bad(key, f"expected a non-empty string, got {_kind(v)} ({v!r})")
        return v

    bs = integer("block_size", 2)
    mask = integer("mask_token_id", 0)
    vocab = integer("vocab_size", 2) if "vocab_size" in manifest else None
    if vocab is not None and mask >= vocab:
        raise bad("mask_token_id", f"{mask} is outside the vocabulary (vocab_size {vocab})")
    if "max_seq_len" in manifest and integer("max_seq_len", 1) < bs:
        raise bad("max_seq_len", f"{manifest['max_seq_len']} is shorter than one block ({bs})")
    if "stop_token_ids" in manifest:
        int_list("stop_token_ids")
    if "target_layer_ids" in manifest:
        int_list("target_layer_ids", nonempty=True)
    for key in ("engine_format", "max_draft_len"):
        if key in manifest:
            integer(key, 0)
    for key in ("recipe", "recipe_path", "target", "build_key"):
        if key in manifest and (manifest[key] is not None or key in _REQUIRED[backend]):
            string(key)
    if "optimized" in manifest and not isinstance(manifest["optimized"], bool):
        raise bad("optimized", f"expected true or false, got {manifest['optimized']!r}")
    if "inputs" in manifest:
        for k, v in mapping("inputs").items():
            if not isinstance(v, str):
                raise bad(f"inputs.{k}", f"expected a sha256 hex digest, got {_kind(v)}")
    for key in ("engines", "dtypes", "libraries"):
        if key in manifest:
            mapping(key)
    if "shapes" in manifest:
        shapes = mapping("shapes")
        for k in _SHAPE_KEYS:
            if k not in shapes:
                raise bad("shapes", f"incomplete (no {k!r})")
            integer("shapes", 1, shapes[k], f"shapes.{k}")
        ids = manifest.get("target_layer_ids")
        if isinstance(ids, list) and any(t >= shapes["target_layers"] for t in ids):
            raise bad("target_layer_ids", f"{ids} outside the target's {shapes['target_layers']} layers (shapes)")
    if "shared_tensors" in manifest:
        shared = mapping("shared_tensors")
        for name, e in shared.items():
            where = f"shared_tensors.{name}"
            if not isinstance(e, dict) or not all(k in e for k in ("offset", "length", "shape")):
                raise bad(where, "needs offset, length, shape")
            integer(where, 0, e["offset"], where + ".offset")
            integer(where, 0, e["length"], where + ".length")
            if not isinstance(e["shape"], list) or not e["shape"]:
                raise bad(where + ".shape", f"expected a non-empty list of integers, got {e['shape']!r}")
            for d in e["shape"]:
                integer(where, 1, d, where + ".shape")
        if backend == "onnxruntime" and "shared.embed_tokens" not in shared:
            raise bad("shared_tensors", "no shared.embed_tokens (the embedding table)")
    if "flags" in manifest:
        flags = mapping("flags")
        for key in ("verify_token_cost", "draft_cost"):
            v = flags.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 100):
                raise bad(f"flags.{key}", f"expected a positive number, got {v!r}")
        rows = flags.get("plain_step_rows")
        if rows is not None and (not _is_int(rows) or rows not in (1, 2)):
            raise bad("flags.plain_step_rows", f"expected 1 or 2, got {rows!r}")
        dv = flags.get("draft_vocab")
        if dv is not None:
            integer("flags", 2, dv, "flags.draft_vocab")
            if vocab is not None and dv > vocab:
                raise bad("flags.draft_vocab", f"{dv} is larger than the vocabulary (vocab_size {vocab})")
    return manifest


def read_manifest(engine_dir, verify_files: bool = True) -> dict[str, Any]:
    """Read and validate an engine's manifest (see `validate_manifest`), and refuse it when any listed file is
    missing or differs from its hash. Every problem is one DFlashError naming the file and the field."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise DFlashError("engine directory not found" if not engine_dir.exists() else "not a directory",
                          path=engine_dir)
    if not path.is_file():
        raise DFlashError("no manifest.json: not a finished engine (an interrupted build leaves none)", path=engine_dir)
    manifest = validate_manifest(read_json_object(path), path)
    if verify_files:
        check_no_unlisted_files(engine_dir, manifest["files"])
        for rel, digest in manifest["files"].items():
            f = engine_dir / rel
            if not f.is_file():
                raise DFlashError("file listed in the manifest is missing", path=f, field="files")
            if sha256_file(f) != digest:
                raise DFlashError("file does not match its manifest hash (modified or truncated)", path=f,
                                  field="files")
    return manifest


def check_no_unlisted_files(engine_dir: Path, files: dict[str, str]) -> None:
    """Refuse any file in the engine directory that the manifest does not hash (manifest.json aside).

    Whatever a loader or a graph opens (graphs, their external data, shared weights, tokenizer files, whatever new
    kind a backend adds) is a file of the directory, so "every file present is listed" covers them all without a
    list of names: deleting a file's entry from `files` no longer disables its hash check, it makes the engine
    unloadable. Symbolic links are refused too (their target is outside what the hashes vouch for).
    """
    listed = set(files)
    for p in sorted(engine_dir.rglob("*")):
        rel = p.relative_to(engine_dir).as_posix()
        if p.is_symlink():
            raise DFlashError("a symbolic link in the engine directory (engines hold plain files only)", path=p,
                              field="files")
        if p.is_file() and rel != MANIFEST and rel not in listed:
            raise DFlashError("not listed in the manifest's `files` (every file of an engine must be listed and "
                              "hashed): rebuild the engine, or remove the file", path=p, field="files")


def is_engine_dir(d) -> bool:
    """Whether `d` holds a manifest written by dflash-export (a finished or tampered engine that `build` may
    replace), as opposed to a directory of someone else's files."""
    try:
        m = json.loads((Path(d) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and (m.get("tool") == "dflash-export" or "backend" in m)


def load_codec(engine_dir):
    """The engine's TextCodec, with its files checked first: a malformed tokenizer_config.json, codec.json or
    chat template is one DFlashError naming the file, not a traceback when the first prompt is encoded."""
    from dflash_export.tokenization import TextCodec

    d = Path(engine_dir)
    if (d / "tokenizer.json").is_file():
        cfg_path = d / "tokenizer_config.json"
        cfg = read_json_object(cfg_path) if cfg_path.is_file() else {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = cfg.get(key)
            if v is not None and not isinstance(v, str) and not (isinstance(v, dict)
                                                                 and isinstance(v.get("content"), str)):
                raise DFlashError(f"expected a string or an object with a string 'content', got {_kind(v)}",
                                  path=cfg_path, field=key)
        template, src, field = cfg.get("chat_template"), cfg_path, "chat_template"
        if template is not None and not isinstance(template, str):
            raise DFlashError(f"expected a string (one template), got {_kind(template)}", path=cfg_path,
                              field="chat_template")
        if template is None and (d / "chat_template.jinja").is_file():
            src, field = d / "chat_template.jinja", None
            try:
                template = src.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DFlashError(f"not UTF-8 text (byte {e.start})", path=src) from None
        if template:
            import jinja2

            from dflash_export.tokenization import chat_environment

            try:  # compiled as tokenization.TextCodec renders it (sandboxed): unknown filters / tests fail here too
                chat_environment().from_string(template)
            except jinja2.TemplateSyntaxError as e:
                raise DFlashError(f"invalid chat template (line {e.lineno}: {e.message})", path=src,
                                  field=field) from None
    elif (d / "codec.json").is_file():
        cfg_path = d / "codec.json"
        cfg = read_json_object(cfg_path)
        v = cfg.get("vocab_size", 256)
        if not _is_int(v) or v < 1:
            raise DFlashError(f"expected a positive integer, got {v!r}", path=cfg_path, field="vocab_size")
        r = cfg.get("reserved", [])
        if not isinstance(r, list) or not all(_is_int(x) and x >= 0 for x in r):
            raise DFlashError(f"expected a list of non-negative integers, got {r!r}", path=cfg_path, field="reserved")
    return TextCodec.from_dir(d)


