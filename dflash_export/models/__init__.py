"""PyTorch models: the DFlash drafter (written here) and the targets (transformers). A drafter checkpoint is loaded by
`dflash_export.models.checkpoint.load_drafter`, which reads and checks the z-lab format this package knows nothing of.

The names below load on first use: `dflash_export.models.config` (the drafter's contract, `DFlashSpec`) is plain
Python, and a served ONNX Runtime engine that reads it must not import torch through this package."""

import importlib

_WHERE = {"DFlashSpec": "config", "DrafterConfig": "config", "DFlashDrafter": "drafter", "save_drafter": "drafter",
          "TargetModel": "target", "load_target": "target"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
