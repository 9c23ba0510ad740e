"""The backend-agnostic engine contract and the engine directory (manifest, hashes, atomic builds).

An engine owns the compiled graphs and the per-sequence state (KV caches, pending context features); the runtime
(`dflash_export.runtime`) owns the loop, sampling randomness, stop handling and streaming. Keeping the two apart is what
lets one loop drive ONNX Runtime, TensorRT and the PyTorch reference alike.

This module imports neither torch nor onnxruntime: a served ORT engine needs only numpy, onnxruntime and tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import platform
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_export.errors import DFlashError, read_json_object

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
    def draft(self, seq: Sequence, anchor: int, sp: SamplingParams, uniforms: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """Draft block slots 1..bs-1 after `anchor` (at position seq.length), consuming the pending context.

        Returns draft tokens [bs-1] int64 and, when sampling, their draft distributions [bs-1, V] (float64, after
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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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


def read_manifest(engine_dir, verify_files: bool = True) -> dict[str, Any]:
    """Read an engine's manifest and refuse it when any listed file is missing or differs from its hash."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise DFlashError("engine directory not found", path=engine_dir)
    if not path.is_file():
        raise DFlashError("no manifest.json: not a finished engine (an interrupted build leaves none)", path=engine_dir)
    manifest = read_json_object(path)
    for key in ("backend", "files", "block_size", "mask_token_id"):
        if key not in manifest:
            raise DFlashError("missing field", path=path, field=key)
    if verify_files:
        for rel, digest in manifest["files"].items():
            f = engine_dir / rel
            if not f.is_file():
                raise DFlashError("file listed in the manifest is missing", path=f, field="files")
            if sha256_file(f) != digest:
                raise DFlashError("file does not match its manifest hash (modified or truncated)", path=f,
                                  field="files")
    return manifest


def load_engine(engine_dir, **kwargs) -> Engine:
    """Open a built engine directory with the backend its manifest names."""
    manifest = read_manifest(engine_dir)
    backend = manifest["backend"]
    if backend == "onnxruntime":
        from dflash_export.engines.onnxruntime import OrtEngine

        return OrtEngine(Path(engine_dir), manifest, **kwargs)
    if backend == "tensorrt":
        from dflash_export.engines.tensorrt import TensorRTEngine  # type: ignore[attr-defined]

        return TensorRTEngine(Path(engine_dir), manifest, **kwargs)
    if backend == "pytorch":
        from dflash_export.engines.torch_ref import TorchEngine

        return TorchEngine.from_manifest(Path(engine_dir), manifest, **kwargs)
    raise DFlashError(f"unknown backend {backend!r}", path=Path(engine_dir) / MANIFEST, field="backend")
