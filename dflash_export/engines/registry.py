"""Opening a built engine directory with the backend its manifest names.

This module sits above every backend (each imports `engines.base`, none imports this), so the dispatch no longer makes
`base` import the backends that import it. The backends are imported when an engine of theirs is opened: a served ONNX
Runtime engine must not import torch (the PyTorch reference backend's dependency) nor TensorRT's modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dflash_export.engines.base import MANIFEST, Engine, read_manifest
from dflash_export.errors import DFlashError


def _open_onnxruntime(engine_dir: Path, manifest: dict, **kwargs) -> Engine:
    from dflash_export.engines.onnxruntime import OrtEngine

    return OrtEngine(engine_dir, manifest, **kwargs)


def _open_tensorrt(engine_dir: Path, manifest: dict, **kwargs) -> Engine:
    from dflash_export.engines.tensorrt import TensorRTEngine

    return TensorRTEngine(engine_dir, manifest, **kwargs)


def _open_pytorch(engine_dir: Path, manifest: dict, **kwargs) -> Engine:
    from dflash_export.engines.torch_ref import TorchEngine

    return TorchEngine.from_manifest(engine_dir, manifest, **kwargs)


# backend name (the manifest's "backend") -> how to open its engine directory
OPENERS: dict[str, Callable[..., Engine]] = {
    "onnxruntime": _open_onnxruntime,
    "tensorrt": _open_tensorrt,
    "pytorch": _open_pytorch,
}


def load_engine(engine_dir, **kwargs) -> Engine:
    """Open a built engine directory with the backend its manifest names."""
    manifest = read_manifest(engine_dir)
    backend = manifest["backend"]
    opener = OPENERS.get(backend)
    if opener is None:
        raise DFlashError(f"a {backend!r} engine does not load here ({', '.join(OPENERS)})",
                          path=Path(engine_dir) / MANIFEST, field="backend")
    return opener(Path(engine_dir), manifest, **kwargs)
