"""The engine backends in one table: how each is built, opened, and checked before `deploy` / `run` use it.

This module sits above every backend (each imports `engines.base`, none imports this), so dispatching on a backend
name never makes `base` import the backends that import it. A backend's module is imported only when one of its
engines is built or opened: a served ONNX Runtime engine must not import torch (the PyTorch reference backend's
dependency) nor TensorRT's modules.

To add a backend: write its module under `engines/` (a builder writing an engine directory with a manifest, and / or
an `Engine` class), then one `Backend` row in BACKENDS -- `build`, `run`, `bench`, `validate` and `deploy` read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_export.engines.base import Engine, check_codec_files, check_transformers_tokenizer_files
from dflash_export.engines.manifest import MANIFEST, Manifest, read_manifest
from dflash_export.environment import require_module
from dflash_export.errors import DFlashError, MissingDependency

# The most sequences one batched call may hold, whatever the backend: `build --max-batch` (TensorRT's batch profiles)
# and `deploy` / `serve --max-batch` (one instance's shared batch) take at most this.
MAX_BATCH = 256


@dataclass(frozen=True)
class Backend:
    """One backend. `builder()` returns its build function (recipe, engine_dir, **options), importing its module;
    `opener(engine_dir, manifest, **kwargs)` returns an Engine; `check(engine_dir, manifest)` is what `run` and
    `deploy` check beyond the manifest's shape, without loading weights. None: not built / not opened in-process."""

    name: str
    builder: Callable[[], Callable] | None
    opener: Callable[..., Engine] | None
    check: Callable[[Path, Manifest], None]
    quantizable: bool = False              # builds weight-quantized engines (`--precision`)
    # (engine, max_batch) -> its batched engine (engines/ort_batch.BatchedEngine) for continuous batching
    # (`batching.py`, deploy --max-batch > 1, bench --concurrency); None: one sequence per call only.
    batcher: Callable[[Engine, int], Any] | None = None
    # The most sequences one batched call of this engine directory takes (its build's bound; one error naming the
    # manifest field when it has no batched engines); None: bounded only by memory.
    batch_bound: Callable[[Manifest], int] | None = None
    serve_libraries: tuple[str, ...] = ()  # what the served engine imports besides numpy and tokenizers
    # What opening its engines needs of this environment (a library, a device): MissingDependency with the install
    # line otherwise, checked before anything else is read or printed (`require_backend`). None: nothing beyond
    # `serve_libraries`' presence.
    require: Callable[[], None] | None = None
    served_by_dflash: bool = True          # Triton serves it through this project's python model (else its own)

    @property
    def batched(self) -> bool:
        return self.batcher is not None


# --------------------------------------------------------------------------------------------------- ONNX Runtime


def _build_onnxruntime():
    import importlib.util

    def missing(name):
        return MissingDependency(f"the onnxruntime backend needs `pip install 'dflash-export[onnx]'` ({name})",
                                 field="--backend")

    # Both come with the onnx extra; ort_build imports them only once the build is under way, so look first.
    for module in ("onnx", "onnxruntime"):
        if importlib.util.find_spec(module) is None:
            raise missing(module)
    try:
        from dflash_export.engines.ort_build import build_onnxruntime
    except ImportError as e:
        raise missing(e.name) from None
    return build_onnxruntime


def _open_onnxruntime(engine_dir: Path, manifest: Manifest, **kwargs) -> Engine:
    from dflash_export.engines.onnxruntime import OrtEngine

    return OrtEngine(engine_dir, manifest, **kwargs)


def _check_onnxruntime(engine_dir: Path, manifest: Manifest) -> None:
    from dflash_export.engines.onnxruntime import check_ort_manifest

    check_ort_manifest(manifest)


def _batch_onnxruntime(engine: Engine, max_batch: int):
    from dflash_export.engines.ort_batch import BatchedOrtEngine

    return BatchedOrtEngine(engine, max_batch)  # refuses anything but an OrtEngine, naming the backend


# --------------------------------------------------------------------------------------------------- TensorRT


def _build_tensorrt():
    from dflash_export.engines.tensorrt import build_tensorrt

    return build_tensorrt


def _open_tensorrt(engine_dir: Path, manifest: Manifest, **kwargs) -> Engine:
    from dflash_export.engines.tensorrt import TensorRTEngine

    return TensorRTEngine(engine_dir, manifest, **kwargs)


def _check_tensorrt(engine_dir: Path, manifest: Manifest) -> None:
    from dflash_export.engines.tensorrt_runtime import engine_profiles, tensorrt_engine_info

    tensorrt_engine_info(manifest)  # the same manifest reading the TensorRT engine does
    engine_profiles(manifest)  # and the engine table its runner opens


def _require_tensorrt() -> None:
    from dflash_export.engines import tensorrt_plugins as plugins

    plugins.require_tensorrt()  # through the module: the tests' emulated TensorRT replaces it there


def _tensorrt_batch_bound(manifest: Manifest) -> int:
    from dflash_export.engines.tensorrt_batch import check_batch_manifest

    return check_batch_manifest(manifest)


def _batch_tensorrt(engine: Engine, max_batch: int):
    from dflash_export.engines.tensorrt_batch import BatchedTensorRTEngine
    from dflash_export.engines.tensorrt_runtime import TensorRTEngine

    if not isinstance(engine, TensorRTEngine):  # e.g. the ONNX Runtime twin of a TensorRT directory's graphs
        raise DFlashError(f"batched decoding on tensorrt needs the TensorRT engine itself (got "
                          f"{type(engine).__name__})", field="backend")
    return BatchedTensorRTEngine(engine, max_batch)


# --------------------------------------------------------------------------------------------------- TensorRT-LLM


def _build_tensorrt_llm():
    from dflash_export.engines.tensorrt_llm import build_tensorrt_llm

    return build_tensorrt_llm


def _check_tensorrt_llm(engine_dir: Path, manifest: Manifest) -> None:
    manifest.require("target_layer_ids")
    if manifest.target is not None:  # the bundle holds no tokenizer: TensorRT-LLM serves its target's
        check_transformers_tokenizer_files(manifest.target)


# --------------------------------------------------------------------------------------------------- PyTorch


def _open_pytorch(engine_dir: Path, manifest: Manifest, **kwargs) -> Engine:
    from dflash_export.engines.torch_ref import TorchEngine

    return TorchEngine.from_manifest(engine_dir, manifest, **kwargs)


def _check_pytorch(engine_dir: Path, manifest: Manifest) -> None:
    if not Path(manifest.recipe_path).is_file():
        raise DFlashError(f"recipe {manifest.recipe_path} not found", path=manifest.path, field="recipe_path")
    from dflash_export.models.sources import resolve_source
    from dflash_export.recipes import load_recipe

    source = load_recipe(manifest.recipe_path).target_path
    if str(source).startswith("tiny:"):  # a tiny random pair: no tokenizer files, built only when the engine loads
        return
    target = resolve_source(source)
    if (target / "tokenizer.json").is_file():  # what the engine encodes with (torch_ref.TorchEngine; else bytes)
        check_codec_files(target)


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("onnxruntime", _build_onnxruntime, _open_onnxruntime, _check_onnxruntime, quantizable=True,
            batcher=_batch_onnxruntime, serve_libraries=("onnxruntime",)),
    Backend("tensorrt", _build_tensorrt, _open_tensorrt, _check_tensorrt, batcher=_batch_tensorrt,
            batch_bound=_tensorrt_batch_bound, serve_libraries=("tensorrt",), require=_require_tensorrt),
    # a TensorRT-LLM bundle is served by TensorRT-LLM itself (Triton's llmapi model), never opened here
    Backend("tensorrt-llm", _build_tensorrt_llm, None, _check_tensorrt_llm, served_by_dflash=False),
    # the PyTorch reference as an engine (a manifest the tests write; no `build` makes one): nothing to build
    Backend("pytorch", None, _open_pytorch, _check_pytorch, serve_libraries=("torch",)),
)}

# backend name (the manifest's "backend") -> how to open its engine directory
OPENERS: dict[str, Callable[..., Engine]] = {b.name: b.opener for b in BACKENDS.values() if b.opener}
BUILDABLE = tuple(b.name for b in BACKENDS.values() if b.builder)


def backend_builder(name: str) -> Callable:
    """The build function of backend `name` (imports its module); one error naming the buildable backends else."""
    spec = BACKENDS.get(name)
    if spec is None or spec.builder is None:
        raise DFlashError(f"unknown backend {name!r} ({', '.join(BUILDABLE)})", field="--backend")
    return spec.builder()


def check_engine_manifest(engine_dir) -> Manifest:
    """The engine's manifest with the checks `run` and `deploy` apply, without loading any weights.

    `read_manifest` validates every field and hashes every listed file, `check_codec_files` the tokenizer files and the
    chat template; what is left is what a backend's own loader checks beyond the manifest's shape (the ORT engine
    format, TensorRT's engine table, the PyTorch engine's recipe and its target's tokenizer files, the tokenizer
    files of the target a TensorRT-LLM bundle serves)."""
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    check_codec_files(engine_dir)  # the tokenizer files and chat template, named at deploy and serve's check too
    spec = BACKENDS.get(manifest.backend)
    if spec is not None:
        spec.check(engine_dir, manifest)
    return manifest


def require_backend(engine_dir, manifest: Manifest) -> None:
    """What opening the engine at `engine_dir` needs of this environment (its backend's library, a GPU), or one
    MissingDependency naming its manifest's `backend` field and the install line: the user gave the engine, not a
    --backend. `run`, `bench` and `validate` check it before any other output; `load_engine` checks it too."""
    spec = BACKENDS.get(manifest.backend)
    if spec is None:
        return
    try:
        if spec.require is not None:
            spec.require()
        else:
            for module in spec.serve_libraries:
                require_module(module)
    except MissingDependency as e:
        raise MissingDependency(f"this {manifest.backend} engine cannot open here: {e.message}",
                                path=Path(engine_dir) / MANIFEST, field="backend") from None


def batched_engine(engine: Engine, max_batch: int = 16):
    """The batched engine (engines/ort_batch.BatchedEngine) for `engine`'s backend -- ONNX Runtime's over its
    sessions, TensorRT's over the batch engines its build compiled -- what `dflash_export.runtime.batching` drives;
    one error naming the backends that batch for any other."""
    spec = BACKENDS.get(engine.info.backend)
    if spec is None or spec.batcher is None:
        batched = " and ".join(b.name for b in BACKENDS.values() if b.batched)
        raise DFlashError(f"batched decoding runs on the {batched} backends (got {engine.info.backend})",
                          field="backend")
    if getattr(engine, "linear_layers", None) and engine.info.backend != "onnxruntime":
        raise DFlashError(f"batched decoding of hybrid targets (Gated DeltaNet state per sequence) runs on the "
                          f"onnxruntime backend (got {engine.info.backend})", field="model_type")
    return spec.batcher(engine, max_batch)


def load_engine(engine_dir, manifest: Manifest | None = None, **kwargs) -> Engine:
    """Open a built engine directory with the backend its manifest names. `manifest`: the directory's manifest as
    `read_manifest` just returned it (its files hashed), so a caller that has read it does not hash them again.

    A build may replace the directory while it loads (files.atomic_dir swaps in a whole new one): the files opened
    could then come from two engines. When the directory there after the load is not the one there before it, or
    holds another manifest than the one loaded, the load starts again from the engine there now."""
    from dflash_export.files import dir_identity

    engine_dir = Path(engine_dir)
    for attempt in range(3):
        before = dir_identity(engine_dir)
        try:
            engine, loaded = _load_once(engine_dir, manifest if attempt == 0 else None, **kwargs)
        except (DFlashError, OSError):
            if dir_identity(engine_dir) == before:
                raise
            continue  # replaced while it loaded: what failed may be the mixture
        if dir_identity(engine_dir) == before and _manifest_unchanged(engine_dir, loaded):
            return engine
        engine.close()
    raise DFlashError("replaced by other builds while it loaded, three times over: load it again once they finish",
                      path=engine_dir)


def _load_once(engine_dir: Path, manifest: Manifest | None, **kwargs) -> tuple[Engine, Manifest]:
    if manifest is None:
        manifest = read_manifest(engine_dir)
    backend = manifest.backend
    opener = OPENERS.get(backend)
    if opener is None:
        raise DFlashError(f"a {backend!r} engine does not load here ({', '.join(OPENERS)})",
                          path=engine_dir / MANIFEST, field="backend")
    require_backend(engine_dir, manifest)
    engine = opener(engine_dir, manifest, **kwargs)
    engine.info.static_index = manifest.static_index()
    return engine, manifest


def _manifest_unchanged(engine_dir: Path, manifest: Manifest) -> bool:
    """Whether `engine_dir` still holds the manifest `manifest` was read from (the same fields and file hashes)."""
    from dflash_export.files import MAX_JSON_BYTES, read_cache_json

    return read_cache_json(engine_dir / MANIFEST, MAX_JSON_BYTES) == dict(manifest.raw)
