"""The package's floors (docs/architecture.md): every import of the package's own modules, at module top or inside a
function, goes to the same folder or to a floor below; no two folders import each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_export"

# The table of docs/architecture.md, floor by floor (root modules by name, folders by name).
FLOORS = {
    "errors": 1, "decoding": 1, "environment": 1,
    "files": 2, "clitypes": 2, "kernels": 2,
    "models": 3,
    "recipes": 4,
    "export": 5, "train": 5,
    "engines": 6,
    "runtime": 7,
    "validate": 8, "deploy": 8,
    "bench": 9,
    "cli": 10, "__main__": 10, "__init__": 0,
}


def _room(module: str) -> str:
    """'dflash_export.models.arch' -> 'models'; 'dflash_export.errors' -> 'errors'; 'dflash_export' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> list[tuple[str, str, int]]:
    """(importing room, imported module, line) for every import of dflash_export inside the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("dflash_export.") and name != module:
                    target = name.split(".")
                    # `from dflash_export import __version__` and `from dflash_export.x import y` name a room
                    if target[1] in FLOORS or (PACKAGE / target[1]).exists() or (PACKAGE / f"{target[1]}.py").exists():
                        found.append((_room(module), name, node.lineno))
                        break
    return found


def test_every_package_module_has_a_floor():
    rooms = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms - set(FLOORS) == set(), "a new root module or folder: give it a floor here and in docs/architecture.md"


def test_imports_only_go_down_a_floor_or_stay_in_the_folder():
    up = [(src, name, line) for src, name, line in _imports()
          if _room(name) != src and FLOORS[_room(name)] > FLOORS[src]]
    assert up == []


def test_no_two_folders_import_each_other():
    edges = {(src, _room(name)) for src, name, _ in _imports() if _room(name) != src}
    assert {(a, b) for a, b in edges if (b, a) in edges} == set()
