"""What the benchmark-script tests share: a script under benchmarks/ loaded as a module by its path (the scripts are
not a package; no tests here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(path: Path, name: str) -> ModuleType:
    """The benchmark script at `path`, imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
