"""dflash-export: turn DFlash drafters and their targets into deployable, validated inference engines."""

__version__ = "0.1.0"
