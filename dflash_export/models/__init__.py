"""PyTorch models: the DFlash drafter (written here) and the targets (transformers). A drafter checkpoint is loaded by
`dflash_export.checkpoint.load_drafter`, which reads and checks the z-lab format this package knows nothing of."""

from dflash_export.models.config import DrafterConfig
from dflash_export.models.drafter import DFlashDrafter, save_drafter
from dflash_export.models.target import TargetModel, load_target

__all__ = ["DFlashDrafter", "DrafterConfig", "save_drafter", "TargetModel", "load_target"]
