"""PyTorch models: the DFlash drafter (written here) and the targets (transformers)."""

from dflash_export.models.config import DrafterConfig
from dflash_export.models.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash_export.models.target import TargetModel, load_target

__all__ = ["DFlashDrafter", "DrafterConfig", "load_drafter", "save_drafter", "TargetModel", "load_target"]
