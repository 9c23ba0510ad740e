"""`build`: one engine directory per (recipe, backend), reused when its inputs are unchanged.

The backend builders write into a temporary directory that is renamed only when complete (files.atomic_dir), so an
interrupted build never leaves a directory that loads as an engine; `read_manifest` also re-checks every file hash.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflash_export.engines.manifest import MANIFEST, engine_dir_name, hash_inputs, read_manifest
from dflash_export.engines.onnxruntime import ENGINE_FORMAT
from dflash_export.engines.ort_build import graph_precisions, stage
from dflash_export.engines.registry import BACKENDS, MAX_BATCH, backend_builder
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_file, check_output_dir, is_engine_dir, removing_new_dirs
from dflash_export.models.sources import resolve_source

DEFAULT_ROOT = Path("engines")
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def default_engine_dir(recipe_name: str) -> Path:
    """`engines/<recipe>/onnxruntime` under the working directory, else under the repository; when only a quantized
    engine was built (`onnxruntime-int4`, ...) that one; DFlashError if none, or if several and no fp32 one."""
    rel = Path("engines") / recipe_name
    for root in (Path.cwd() / rel, REPO_ROOT / rel):
        if (root / "onnxruntime" / "manifest.json").is_file():
            return root / "onnxruntime"
        built = sorted(d for d in root.glob("onnxruntime-*") if (d / "manifest.json").is_file())
        if len(built) == 1:
            return built[0]
        if built:
            raise DFlashError(f"several engines built for recipe {recipe_name!r} ({', '.join(d.name for d in built)}"
                              f" under {root}): pass one with --engine DIR", field="--engine")
    raise DFlashError(f"no engine built for recipe {recipe_name!r} at {rel / 'onnxruntime'}: build it first with "
                      f"`dflash-export build --recipe {recipe_name} --backend onnxruntime`, or pass --engine DIR",
                      field="--engine")


@contextmanager
def _build_turn(engine_dir: Path) -> Iterator[None]:
    """This process's turn to build `engine_dir`: an exclusive lock on its parent directory (created if needed), held
    until the block ends. Builds of one engine started at once then run one after the other, the later one reusing
    (or, forced or with other inputs, replacing) what the earlier one finished, never adding its input hashes to
    another's engine. The kernel drops the lock with its process, killed or not: nothing is left to clean up."""
    import fcntl
    import os

    parent = engine_dir.parent
    announced = False
    while True:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise DFlashError(f"cannot write here ({e.strerror or e})", path=engine_dir, field="--out") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not announced:
                    stage(f"waiting for another build of {engine_dir} to finish")
                    announced = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(parent))
            except FileNotFoundError:  # removed by a build that failed (its empty directories go)
                same = False
            if same:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # locked a directory no longer at that path: lock the one there now
    try:
        yield
    finally:
        os.close(fd)  # closing releases the lock


@dataclass
class BuildResult:
    engine_dir: Path
    reused: bool
    inputs: dict[str, str]


def recipe_inputs(recipe) -> dict[str, str]:
    """Hashes of everything an engine is built from: the recipe file, the target (GGUF or HF dir), the drafter."""
    paths = [Path(recipe.path)] if recipe.path else []
    for spec in (recipe.target_path, recipe.drafter_path):
        p = resolve_source(spec)
        if not p.exists():
            raise DFlashError("not found", path=p, field="target" if spec == recipe.target_path else "drafter")
        paths.append(p)
    return hash_inputs(paths)


def _record_inputs(engine_dir: Path, inputs: dict[str, str]) -> None:
    """Add the input hashes to the manifest if the backend did not (atomic replace; the manifest is not hashed)."""
    path = engine_dir / MANIFEST
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("inputs") == inputs:
        return
    manifest["inputs"] = inputs
    with atomic_file(path) as f:
        f.write(json.dumps(manifest, indent=2) + "\n")


def _refuse_ort_options(backend: str, precision: str | None, drafter_precision: str | None,
                        quantize_heads: bool | None) -> None:
    """The weight-precision options of the ONNX Runtime engines, given for a backend that builds none: one error
    naming the option (a TensorRT build would otherwise ignore it)."""
    for option, value in (("--precision", precision), ("--drafter-precision", drafter_precision)):
        if value not in (None, "fp32"):
            raise DFlashError(f"weight quantization is built for the onnxruntime backend only, not {backend}",
                              field=option)
    if quantize_heads is not None:
        raise DFlashError(f"keeps the heads of quantized onnxruntime graphs fp32; {backend} builds no quantized "
                          "graphs", field="--fp32-heads")


def build_engine(recipe, backend: str = "onnxruntime", out_root: Path | str = DEFAULT_ROOT, force: bool = False,
                 precision: str | None = None, drafter_precision: str | None = None,
                 quantize_heads: bool | None = None, max_batch: int | None = None) -> BuildResult:
    """Build (or reuse) `out_root/<recipe>/<backend>/` (fp32) or `.../<backend>-<precision>[...]/` (quantized
    ONNX Runtime engines; `precision` / `drafter_precision` default to the recipe's, see `engine_dir_name`).
    `max_batch`: the most sequences per call continuous batching's engines are built for, for backends whose batch
    is fixed at build time (TensorRT's profiles; None: the backend's default for a new build, and an earlier engine
    reused whatever bound it was built for); an engine built for another bound, or without the batch engines, is
    rebuilt, not reused. ONNX Runtime batches are bounded where they run (`deploy --max-batch`).

    An existing engine directory is replaced only when it is an earlier engine (its manifest.json says so):
    anything else there is refused, never deleted. A failed build leaves no directory it created behind.
    """
    if backend not in recipe.backends:
        raise DFlashError(f"backend {backend!r} is not listed in the recipe's backends {recipe.backends}",
                          path=recipe.path, field="backends")
    build = backend_builder(backend)
    precisions = None
    if BACKENDS[backend].quantizable:  # the ONNX Runtime engines
        precisions = graph_precisions(recipe, precision, drafter_precision, quantize_heads)
    else:
        _refuse_ort_options(backend, precision, drafter_precision, quantize_heads)
    bound = BACKENDS[backend].batch_bound
    if max_batch is not None and (bound is None or not 1 <= max_batch <= MAX_BATCH):
        raise DFlashError(f"must be in 1..{MAX_BATCH}, got {max_batch}" if bound is not None else
                          f"sizes the batch engines of backends that fix it at build time (tensorrt), not {backend}: "
                          "an onnxruntime batch is bounded where it runs (deploy --max-batch)", field="--max-batch")
    options = {} if max_batch is None else {"max_batch": max_batch}
    if not str(out_root).strip():
        raise DFlashError("empty path: name the directory engines go under", field="--out")
    out_root = Path(out_root)
    if out_root.exists() and not out_root.is_dir():
        raise DFlashError("exists and is a file, not a directory", path=out_root, field="--out")
    engine_dir = out_root / recipe.name / engine_dir_name(backend, precisions)
    check_output_dir(engine_dir, command="build", is_previous_output=is_engine_dir, replaced=True)
    inputs = recipe_inputs(recipe)
    with removing_new_dirs(engine_dir), _build_turn(engine_dir):
        if engine_dir.exists() and not force:  # an engine another build just finished counts
            try:
                manifest = read_manifest(engine_dir)
                if (manifest.inputs == inputs and manifest.backend == backend
                        and (precisions is None or (manifest.precision == precisions
                                                    and manifest.engine_format == ENGINE_FORMAT))
                        # a batch bound to read (an engine without batch engines is rebuilt), the one asked if any
                        and (bound is None or max_batch in (None, bound(manifest)))):
                    return BuildResult(engine_dir, True, inputs)
            except DFlashError:
                pass  # an earlier engine, unreadable or tampered: rebuild over it
        if precisions is not None:
            build(recipe, engine_dir, draft_vocab=recipe.draft_vocab, precision=precisions["target"],
                  drafter_precision=precisions["drafter"],
                  quantize_heads=precisions["lm_head"] != "fp32" or precisions["draft_head"] != "fp32")
        else:
            build(recipe, engine_dir, **options)
        if not (engine_dir / MANIFEST).is_file():
            raise DFlashError("the backend finished without writing a manifest", path=engine_dir)
        _record_inputs(engine_dir, inputs)
    return BuildResult(engine_dir, False, inputs)
