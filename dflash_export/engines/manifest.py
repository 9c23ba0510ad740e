"""The engine directory's manifest: one typed `Manifest`, read and validated here and nowhere else.

`write_manifest` records what a build made (every file's sha256, the tool and library versions, the backend's fields);
`read_manifest` checks the structure, types and ranges of every field a loader uses, then every listed file against
its hash, and returns a `Manifest` whose fields are already the right types: a backend's loader reads attributes and
never re-parses JSON. Fields a backend does not need are optional (None); `Manifest.require` names a missing one.
`raw` keeps the whole JSON object for records (validate's report, the deploy log).
"""

from __future__ import annotations

import json
import platform
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dflash_export import __version__
from dflash_export.decoding.options import decoding_problem
from dflash_export.decoding.request import is_int
from dflash_export.decoding.static_ngrams import StaticNgramIndex
from dflash_export.engines.base import EngineInfo
from dflash_export.engines.numerics import MAX_ROW_FLOOR
from dflash_export.errors import DFlashError, json_kind
from dflash_export.files import UnreadableArrays, read_json_object, read_npz, sha256_file
from dflash_export.models.config import MAX_SEQ_LEN
from dflash_export.recipes import BACKENDS, PRECISIONS, RECIPES_DIR

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Shapes:
    """K/V cache geometry of the two models (what an engine allocates before any graph runs)."""

    target_layers: int
    target_kv_heads: int
    target_head_dim: int
    drafter_layers: int
    drafter_kv_heads: int
    drafter_head_dim: int


@dataclass(frozen=True)
class SharedTensor:
    """A tensor inside shared_weights.bin: byte offset, byte length, shape (float32)."""

    offset: int
    length: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Flags:
    """Run-time hints a build records; every one has a default for engines that predate it."""

    verify_token_cost: float | None = None  # verify of n drafts ~ 1 + n * this plain steps; None = runtime default
    draft_cost: float | None = None
    plain_step_rows: int = 1                 # row floor the build's numerics probe found (engines/numerics.py)
    draft_vocab: int = 0                     # draft among the first N ids; 0 = the whole vocabulary


@dataclass(frozen=True)
class Selector:
    """DFlash 2's candidate selector: candidates per slot and codebook rank."""

    top_k: int
    rank: int


# How TensorRT built a dflash plugin layer: "aot", the Triton kernel compiled to PTX inside the engine (no Python at
# run time), or "jit", the Python impl (tensorrt.plugin must be registered wherever the engine is deserialized).
PLUGIN_PATHS = ("aot", "jit")


@dataclass(frozen=True)
class PluginBuild:
    """A TensorRT engine's dflash plugins: namespace / version, the path the build asked TensorRT's parser for (the
    nodes' `aot` attribute) and, per op, the path TensorRT used (each one of PLUGIN_PATHS)."""

    namespace: str
    version: str
    requested: str
    implementation: Mapping[str, str]


@dataclass(frozen=True)
class Manifest:
    path: Path                               # the manifest.json it was read from (errors name it)
    backend: str
    block_size: int
    mask_token_id: int
    files: Mapping[str, str]                 # relative path -> sha256 of every file of the engine
    vocab_size: int | None = None
    max_seq_len: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    target_layer_ids: tuple[int, ...] | None = None
    engine_format: int | None = None
    max_draft_len: int | None = None
    recipe: str | None = None
    recipe_path: str | None = None
    target: str | None = None
    build_key: str | None = None
    optimized: bool = False
    shapes: Shapes | None = None
    shared_tensors: Mapping[str, SharedTensor] = field(default_factory=dict)
    flags: Flags = Flags()
    selector: Selector | None = None
    plugins: PluginBuild | None = None
    engines: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, str] | None = None
    precision: Mapping[str, str] | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)

    def require(self, name: str, hint: str = ""):
        """The field `name`; one DFlashError naming the manifest and the field when the engine did not record it."""
        value = getattr(self, name)
        if value is None:
            raise DFlashError("missing field" + (f" ({hint})" if hint else ""), path=self.path, field=name)
        return value

    def engine_info(self, hint: str = "") -> EngineInfo:
        """What the runtime needs to know of a compiled engine (ONNX Runtime, TensorRT)."""
        req = self.require
        return EngineInfo(backend=self.backend, recipe=self.recipe or "", block_size=self.block_size,
                          mask_token_id=self.mask_token_id, vocab_size=req("vocab_size", hint),
                          stop_token_ids=list(req("stop_token_ids", hint)), max_seq_len=req("max_seq_len", hint),
                          target_layer_ids=list(req("target_layer_ids", hint)),
                          verify_token_cost=self.flags.verify_token_cost, draft_cost=self.flags.draft_cost,
                          decoding=dict(self.raw.get("decoding") or {}))

    def static_index(self):
        """The engine's static n-gram index (decoding/static_ngrams.py), read and checked against the sha256 the
        manifest records; None when the build stored none."""
        static = self.raw.get("static_ngrams")
        if not static:
            return None
        path = self.path.parent / static["file"]
        if not path.is_file() or sha256_file(path) != static["sha256"]:
            raise DFlashError("the static n-gram index is missing or differs from the sha256 the manifest records: "
                              "rebuild the engine", path=path, field="static_ngrams.sha256")
        return load_static_index(path, self.require("vocab_size"))


def load_static_index(path: Path, vocab_size: int) -> StaticNgramIndex:
    """The static n-gram index `StaticNgramIndex.save` wrote at `path`: its arrays read by files.read_npz (none
    unpickled, none declaring more than the file holds), then checked (`StaticNgramIndex.from_arrays`); one
    DFlashError naming the file otherwise."""
    try:
        data = read_npz(path)
    except UnreadableArrays as e:
        raise DFlashError(f"unreadable static n-gram index ({e})", path=path, field="static_ngrams") from None
    return StaticNgramIndex.from_arrays(data, vocab_size, Path(path))


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
    files = {str(p.relative_to(engine_dir)): sha256_file(p) for p in sorted(engine_dir.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    full = {"manifest_version": MANIFEST_VERSION, "tool": "dflash-export", "tool_version": __version__,
            "libraries": library_versions(), **manifest, "files": files}
    (engine_dir / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=False) + "\n", encoding="utf-8")


BACKEND_NAMES = ("onnxruntime", "tensorrt", "tensorrt-llm", "pytorch")  # what a manifest may name (engines/registry)
_SHAPE_KEYS = ("target_layers", "target_kv_heads", "target_head_dim", "drafter_layers", "drafter_kv_heads",
               "drafter_head_dim")
# Fields each backend's loader reads from the manifest; the others are checked only when present. (TensorRT's loader
# names its own missing fields with a rebuild hint: older TensorRT builds did not record them.)
_REQUIRED = {"onnxruntime": ("engine_format", "vocab_size", "stop_token_ids", "max_seq_len", "target_layer_ids",
                             "shapes", "shared_tensors"),
             "pytorch": ("recipe_path",), "tensorrt": (), "tensorrt-llm": ()}


_FIELD = object()  # _Fields.integer's default: read the manifest's own field (a recorded null is a value to refuse)


class _Fields:
    """Typed reads of one manifest's fields, each failing as a DFlashError naming the manifest and the field."""

    def __init__(self, manifest: dict, path: Path):
        self.manifest, self.path = manifest, path

    def bad(self, field, message) -> DFlashError:
        return DFlashError(message, path=self.path, field=field)

    def integer(self, key, minimum, value=_FIELD, name=None):
        """The integer `value` (default: the manifest's field `key`), at least `minimum`; the error names `name`."""
        v = self.manifest[key] if value is _FIELD else value
        if not is_int(v):
            raise self.bad(name or key, f"expected an integer, got {json_kind(v)} ({v!r})")
        if v < minimum:
            raise self.bad(name or key, f"must be >= {minimum}, got {v}")
        return v

    def int_list(self, key, minimum=0, nonempty=False):
        v = self.manifest[key]
        if not isinstance(v, list) or (nonempty and not v):
            raise self.bad(key, f"expected a{' non-empty' if nonempty else ''} list of integers, got {json_kind(v)} "
                                f"({v!r})")
        for i, x in enumerate(v):
            self.integer(key, minimum, x, f"{key}[{i}]")
        return v

    def mapping(self, key):
        v = self.manifest[key]
        if not isinstance(v, dict):
            raise self.bad(key, f"expected an object, got {json_kind(v)}")
        return v

    def string(self, key):
        v = self.manifest[key]
        if not isinstance(v, str) or not v:
            raise self.bad(key, f"expected a non-empty string, got {json_kind(v)} ({v!r})")
        return v


def _check_backend(f: _Fields) -> str:
    """The manifest version, the fields every manifest has and those its backend needs; returns the backend."""
    manifest = f.manifest
    version = manifest.get("manifest_version", MANIFEST_VERSION)
    if not is_int(version) or version != MANIFEST_VERSION:
        raise f.bad("manifest_version", f"unsupported manifest version {version!r} (this dflash-export reads "
                                        f"version {MANIFEST_VERSION}): rebuild the engine with this version")
    for key in ("backend", "files", "block_size", "mask_token_id"):
        if key not in manifest:
            raise f.bad(key, "missing field")
    backend = manifest["backend"]
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise f.bad("backend", f"unknown backend {backend!r} (known: {', '.join(BACKEND_NAMES)})")
    for key in _REQUIRED[backend]:
        if key not in manifest:
            raise f.bad(key, f"missing field (a {backend} engine needs it)")
    return backend


def _check_files(f: _Fields) -> None:
    """`files`: relative paths inside the engine directory, each with a sha256 hex digest."""
    files = f.manifest["files"]
    if not isinstance(files, dict):
        raise f.bad("files", f"expected an object of file name to sha256, got {json_kind(files)}")
    for rel, digest in files.items():
        p = Path(rel)
        if not rel or p.is_absolute() or ".." in p.parts or rel == MANIFEST:
            raise f.bad("files", f"{rel!r} is not a file inside the engine directory")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise f.bad(f"files.{rel}", f"expected a sha256 hex digest, got {digest!r}")


def _check_scalars(f: _Fields, backend: str) -> int | None:
    """The single-valued fields (sizes, token ids, names) and the plain mappings; returns vocab_size (None: absent)."""
    manifest = f.manifest
    bs = f.integer("block_size", 2)
    mask = f.integer("mask_token_id", 0)
    vocab = f.integer("vocab_size", 2) if "vocab_size" in manifest else None
    if vocab is not None and mask >= vocab:
        raise f.bad("mask_token_id", f"{mask} is outside the vocabulary (vocab_size {vocab})")
    if "max_seq_len" in manifest:
        if f.integer("max_seq_len", 1) < bs:
            raise f.bad("max_seq_len", f"{manifest['max_seq_len']} is shorter than one block ({bs})")
        if manifest["max_seq_len"] > MAX_SEQ_LEN:  # what a recipe may ask; runtimes size buffers by it
            raise f.bad("max_seq_len", f"{manifest['max_seq_len']} is more than {MAX_SEQ_LEN}, the most a recipe "
                                       "may ask")
    if "stop_token_ids" in manifest:
        for i, t in enumerate(f.int_list("stop_token_ids")):
            if vocab is not None and t >= vocab:
                raise f.bad(f"stop_token_ids[{i}]", f"{t} is outside the vocabulary (vocab_size {vocab})")
    if "target_layer_ids" in manifest:
        f.int_list("target_layer_ids", nonempty=True)
    if "engine_format" in manifest:
        f.integer("engine_format", 0)
    if "max_draft_len" in manifest and f.integer("max_draft_len", 0) != bs - 1:
        raise f.bad("max_draft_len", f"must be block_size - 1 = {bs - 1} (the drafts of one block)")
    for key in ("recipe", "recipe_path", "target", "build_key"):
        if key in manifest and (manifest[key] is not None or key in _REQUIRED[backend]):
            f.string(key)
    if "optimized" in manifest and not isinstance(manifest["optimized"], bool):
        raise f.bad("optimized", f"expected true or false, got {manifest['optimized']!r}")
    if "inputs" in manifest:
        for k, v in f.mapping("inputs").items():
            if not isinstance(v, str):
                raise f.bad(f"inputs.{k}", f"expected a sha256 hex digest, got {json_kind(v)}")
    for key in ("dtypes", "libraries"):
        if key in manifest:
            f.mapping(key)
    if "engines" in manifest:
        _check_engines(f)
    if "decoding" in manifest:
        _check_decoding(f)
    if "static_ngrams" in manifest:
        _check_static_ngrams(f)
    return vocab


def _check_static_ngrams(f: _Fields) -> None:
    """The static n-gram index the build stored (decoding/static_ngrams.py): its file, listed in `files` with the
    same sha256, and what it was built from."""
    static = f.mapping("static_ngrams")
    name = static.get("file")
    if not isinstance(name, str) or name not in f.manifest["files"]:
        raise f.bad("static_ngrams.file", f"expected the name of a file listed in `files`, got {name!r}")
    if static.get("sha256") != f.manifest["files"][name]:
        raise f.bad("static_ngrams.sha256", f"expected the sha256 `files` lists for {name}")
    for key in ("entries", "answers", "answer_tokens"):
        v = static.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise f.bad(f"static_ngrams.{key}", f"expected a non-negative integer, got {v!r}")


def _check_decoding(f: _Fields) -> None:
    """The recipe's decoding options the build recorded (decoding/options.py's one check)."""
    problem = decoding_problem(f.mapping("decoding"))
    if problem is not None:
        raise f.bad(*problem)


def _check_shapes(f: _Fields) -> None:
    shapes = f.mapping("shapes")
    for k in _SHAPE_KEYS:
        if k not in shapes:
            raise f.bad("shapes", f"incomplete (no {k!r})")
        f.integer("shapes", 1, shapes[k], f"shapes.{k}")
    ids = f.manifest.get("target_layer_ids")
    if isinstance(ids, list) and any(t >= shapes["target_layers"] for t in ids):
        raise f.bad("target_layer_ids", f"{ids} outside the target's {shapes['target_layers']} layers (shapes)")


def _check_shared_tensors(f: _Fields, backend: str) -> None:
    shared = f.mapping("shared_tensors")
    for name, e in shared.items():
        where = f"shared_tensors.{name}"
        if not isinstance(e, dict) or not all(k in e for k in ("offset", "length", "shape")):
            raise f.bad(where, "needs offset, length, shape")
        f.integer(where, 0, e["offset"], where + ".offset")
        f.integer(where, 0, e["length"], where + ".length")
        if not isinstance(e["shape"], list) or not e["shape"]:
            raise f.bad(where + ".shape", f"expected a non-empty list of integers, got {e['shape']!r}")
        for d in e["shape"]:
            f.integer(where, 1, d, where + ".shape")
    if backend == "onnxruntime" and "shared.embed_tokens" not in shared:
        raise f.bad("shared_tensors", "no shared.embed_tokens (the embedding table)")


def _check_flags(f: _Fields, vocab: int | None) -> None:
    flags = f.mapping("flags")
    for key in ("verify_token_cost", "draft_cost"):
        v = flags.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 100):
            raise f.bad(f"flags.{key}", f"expected a positive number, got {v!r}")
    rows = flags.get("plain_step_rows")
    if rows is not None and (not is_int(rows) or not 1 <= rows <= MAX_ROW_FLOOR):
        raise f.bad("flags.plain_step_rows", f"expected an integer from 1 to {MAX_ROW_FLOOR}, got {rows!r}")
    ops = flags.get("row_pad_ops")
    if ops is not None and (not isinstance(ops, list) or not all(o in ("MatMul", "MatMulNBits", "GroupQueryAttention")
                                                                 for o in ops)):
        raise f.bad("flags.row_pad_ops", f"expected a list of MatMul, MatMulNBits, GroupQueryAttention, got {ops!r}")
    dv = flags.get("draft_vocab")
    if dv is not None:
        f.integer("flags", 2, dv, "flags.draft_vocab")
        if vocab is not None and dv > vocab:
            raise f.bad("flags.draft_vocab", f"{dv} is larger than the vocabulary (vocab_size {vocab})")


def _check_selector(f: _Fields, vocab: int | None) -> Selector:
    sel = f.manifest["selector"]
    if not isinstance(sel, dict) or not all(is_int(sel.get(k)) for k in ("top_k", "rank")):
        raise f.bad("selector", "needs integer top_k and rank")
    f.integer("selector", 1, sel["rank"], "selector.rank")
    if not 1 < sel["top_k"] <= (vocab or sel["top_k"]):
        raise f.bad("selector.top_k", f"top_k {sel['top_k']} outside 2..{vocab}")
    return Selector(sel["top_k"], sel["rank"])


def _check_engines(f: _Fields) -> None:
    """`engines` (TensorRT engines): per engine file, a mapping of its build facts, with the facts the runtime reads
    typed: `profiles` (the optimization profiles by index: distinct non-empty names) and `max_batch` (>= 1)."""
    for name, entry in f.mapping("engines").items():
        where = f"engines.{name}"
        if not isinstance(entry, dict):
            raise f.bad(where, f"expected an object of the engine's build facts, got {json_kind(entry)}")
        names = entry.get("profiles")
        if names is not None:
            if not isinstance(names, list):
                raise f.bad(f"{where}.profiles", f"expected a list of profile names, got {json_kind(names)}")
            seen = set()
            for i, n in enumerate(names):
                if not isinstance(n, str) or not n:
                    raise f.bad(f"{where}.profiles[{i}]", f"expected a non-empty string, got {json_kind(n)}")
                if n in seen:
                    raise f.bad(f"{where}.profiles[{i}]", f"{n[:40]!r} is named twice (one name per profile)")
                seen.add(n)
        if "max_batch" in entry:
            f.integer(where, 1, entry["max_batch"], f"{where}.max_batch")


def _check_plugins(f: _Fields) -> PluginBuild:
    """`plugins` (TensorRT engines): namespace and version strings, `requested` and every op's `implementation`
    one of PLUGIN_PATHS, and each op built the way the build asked (a strict request leaves TensorRT no other)."""
    plugins = f.mapping("plugins")
    for key in ("namespace", "version", "requested", "implementation"):
        if key not in plugins:
            raise f.bad(f"plugins.{key}", "missing field (rebuild the engine with this version)")
    for key in ("namespace", "version"):
        if not isinstance(plugins[key], str) or not plugins[key]:
            raise f.bad(f"plugins.{key}", f"expected a non-empty string, got {plugins[key]!r}")
    requested = plugins["requested"]
    if requested not in PLUGIN_PATHS:
        raise f.bad("plugins.requested", f"expected one of {', '.join(PLUGIN_PATHS)}, got {requested!r}")
    impl = plugins["implementation"]
    if not isinstance(impl, dict):
        raise f.bad("plugins.implementation", f"expected an object of op to path, got {json_kind(impl)}")
    for op, path in impl.items():
        if path not in PLUGIN_PATHS:
            raise f.bad(f"plugins.implementation.{op}", f"expected one of {', '.join(PLUGIN_PATHS)}, got {path!r}")
        if path != requested:
            raise f.bad(f"plugins.implementation.{op}", f"built as {path!r}, the build asked for {requested!r}")
    return PluginBuild(plugins["namespace"], plugins["version"], requested, MappingProxyType(dict(impl)))


def validate_manifest(manifest, path) -> Manifest:
    """Check the structure, types and ranges of every manifest field the loaders use; DFlashError naming `path`
    (the manifest.json) and the field otherwise. Returns the typed `Manifest`.

    Fields a backend needs must be present; the others are checked when present. An unknown manifest_version is
    refused (a manifest without one predates versioning and reads as version 1).
    """
    path = Path(path)
    if not isinstance(manifest, dict):
        raise DFlashError(f"expected a JSON object, got {json_kind(manifest)}", path=path)
    f = _Fields(manifest, path)
    backend = _check_backend(f)
    _check_files(f)
    vocab = _check_scalars(f, backend)
    if "shapes" in manifest:
        _check_shapes(f)
    if "shared_tensors" in manifest:
        _check_shared_tensors(f, backend)
    if "flags" in manifest:
        _check_flags(f, vocab)
    selector = _check_selector(f, vocab) if manifest.get("selector") is not None else None
    plugins = _check_plugins(f) if manifest.get("plugins") is not None else None
    if manifest.get("precision") is not None:
        for k, v in f.mapping("precision").items():
            if not isinstance(v, str):
                raise f.bad(f"precision.{k}", f"expected a string, got {json_kind(v)}")
            if v not in PRECISIONS:  # read by `deploy` / `serve` (the shared-batch note) and by rebuild commands
                raise f.bad(f"precision.{k}", f"expected one of {', '.join(PRECISIONS)}, got {v[:40]!r}")
    return _typed(manifest, path, selector, plugins)


def _typed(m: dict[str, Any], path: Path, selector: Selector | None, plugins: PluginBuild | None = None) -> Manifest:
    """The validated JSON object as a Manifest (every check above has passed)."""
    flags = m.get("flags") or {}

    def tuple_or_none(v):
        return None if v is None else tuple(v)

    return Manifest(
        path=path, backend=m["backend"], block_size=m["block_size"], mask_token_id=m["mask_token_id"],
        files=MappingProxyType(dict(m["files"])), vocab_size=m.get("vocab_size"), max_seq_len=m.get("max_seq_len"),
        stop_token_ids=tuple_or_none(m.get("stop_token_ids")),
        target_layer_ids=tuple_or_none(m.get("target_layer_ids")),
        engine_format=m.get("engine_format"), max_draft_len=m.get("max_draft_len"), recipe=m.get("recipe"),
        recipe_path=m.get("recipe_path"), target=m.get("target"), build_key=m.get("build_key"),
        optimized=bool(m.get("optimized", False)),
        shapes=Shapes(**{k: m["shapes"][k] for k in _SHAPE_KEYS}) if "shapes" in m else None,
        shared_tensors=MappingProxyType({name: SharedTensor(e["offset"], e["length"], tuple(e["shape"]))
                                         for name, e in (m.get("shared_tensors") or {}).items()}),
        flags=Flags(verify_token_cost=flags.get("verify_token_cost"), draft_cost=flags.get("draft_cost"),
                    plain_step_rows=flags.get("plain_step_rows") or 1, draft_vocab=flags.get("draft_vocab") or 0),
        selector=selector, plugins=plugins, engines=MappingProxyType(dict(m.get("engines") or {})),
        inputs=None if m.get("inputs") is None else MappingProxyType(dict(m["inputs"])),
        precision=None if m.get("precision") is None else MappingProxyType(dict(m["precision"])),
        raw=MappingProxyType(m))


def read_manifest(engine_dir, verify_files: bool = True) -> Manifest:
    """Read and validate an engine's manifest (see `validate_manifest`), and refuse it when any listed file is
    missing or differs from its hash. Every problem is one DFlashError naming the file and the field."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise DFlashError(("engine directory not found" if not engine_dir.exists() else "not a directory") +
                          f"; {build_hint(engine_dir)}", path=engine_dir)
    if not path.is_file():
        raise DFlashError("no manifest.json: not a finished engine (an interrupted build leaves none); "
                          f"{build_hint(engine_dir)}", path=engine_dir)
    manifest = validate_manifest(read_json_object(path), path)
    if verify_files:
        check_no_unlisted_files(engine_dir, manifest.files)
        for rel, digest in manifest.files.items():
            f = engine_dir / rel
            if not f.is_file():
                raise DFlashError(f"file listed in the manifest is missing; {rebuild_advice(engine_dir, manifest)}",
                                  path=f, field="files")
            if sha256_file(f) != digest:
                raise DFlashError("file does not match its manifest hash (modified or truncated); "
                                  f"{rebuild_advice(engine_dir, manifest)}", path=f, field="files")
    return manifest


def rebuild_advice(engine_dir: Path, manifest: Manifest) -> str:
    """How to write `engine_dir` again: the `dflash-export build` line with its recipe (by name when recipes/ has it,
    else the recipe file the build read), backend, precisions and output root (engine_dir = OUT/<recipe>/<dir>).
    An engine copied or renamed out of that layout is rebuilt where a build writes it, so the advice says so."""
    recipe = manifest.recipe or engine_dir.parent.name
    if manifest.recipe_path and not (RECIPES_DIR / f"{recipe}.yaml").is_file():
        recipe = manifest.recipe_path
    parts = ["dflash-export build --recipe", _shell_word(recipe), "--backend", manifest.backend]
    p = manifest.precision or {}
    if p.get("target", "fp32") != "fp32":
        parts += ["--precision", p["target"]]
    if p.get("drafter", p.get("target", "fp32")) != p.get("target", "fp32"):
        parts += ["--drafter-precision", p["drafter"]]
    if p and (p.get("lm_head"), p.get("draft_head")) != (p.get("target"), p.get("drafter")):
        parts.append("--fp32-heads")
    name = manifest_dir_name(manifest)
    in_layout = engine_dir.name == name and (manifest.recipe is None or engine_dir.parent.name == manifest.recipe)
    out = engine_dir.resolve().parent.parent
    if in_layout and out != (Path.cwd() / "engines").resolve():
        parts += ["--out", _shell_word(str(out))]
    advice = f"rebuild the engine with `{' '.join(parts)} --force`"
    if not in_layout:
        written = Path("engines") / (manifest.recipe or "RECIPE") / name
        advice += f" (it writes {written}, then copy that directory to {engine_dir})"
    return advice


def engine_dir_name(backend: str, precisions: Mapping[str, str] | None = None) -> str:
    """`onnxruntime` for an fp32 engine; `onnxruntime-int4` (target precision), `onnxruntime-int4-drafter-int8` when
    the drafter's differs, `...-fp32-heads` when the heads were kept fp32 under quantized graphs."""
    if not precisions or set(precisions.values()) == {"fp32"}:
        return backend
    name = f"{backend}-{precisions['target']}"
    if precisions["drafter"] != precisions["target"]:
        name += f"-drafter-{precisions['drafter']}"
    if (precisions["lm_head"], precisions["draft_head"]) != (precisions["target"], precisions["drafter"]):
        name += "-fp32-heads"
    return name


def manifest_dir_name(manifest: Manifest) -> str:
    """The directory name `build` gives the engine this manifest describes (`engine_dir_name` of its backend and
    precisions): where it is written under engines/<recipe>/, and what validate's default report directory is named."""
    p = manifest.precision or {}
    return engine_dir_name(manifest.backend, p if set(p) >= {"target", "drafter", "lm_head", "draft_head"} else None)


def build_hint(engine_dir: Path) -> str:
    """What to run when no engine is at `engine_dir`: the build line when the path has the shape a build writes
    (OUT/<recipe>/<backend>[-<precision>]) for a recipe in recipes/, else how to build one."""
    engine_dir = Path(engine_dir)
    recipe, leaf = engine_dir.parent.name, engine_dir.name
    backend = next((b for b in sorted(BACKENDS, key=len, reverse=True) if leaf == b or leaf.startswith(b + "-")),
                   None)
    if backend is None or not (RECIPES_DIR / f"{recipe}.yaml").is_file():
        return "build one with `dflash-export build --recipe NAME` (it writes engines/NAME/onnxruntime)"
    parts = ["dflash-export build --recipe", recipe, "--backend", backend]
    precision = leaf[len(backend) + 1:].split("-")[0] if leaf != backend else ""
    if precision in ("int8", "int4"):
        parts += ["--precision", precision]
    out = engine_dir.absolute().parent.parent
    if out != (Path.cwd() / "engines").absolute():
        parts += ["--out", _shell_word(str(engine_dir.parent.parent))]
    return f"build it with `{' '.join(parts)}`"


def _shell_word(s: str) -> str:
    return shlex.quote(s)


def check_engine_recipe(engine_dir: Path, recipe):
    """The engine's validated manifest; DFlashError when it was built for another recipe (measuring it against this
    recipe's reference would mislead). Shared by `validate` and `bench`."""
    manifest = read_manifest(engine_dir)
    built_for = manifest.recipe
    if built_for and built_for != recipe.name:
        raise DFlashError(f"engine was built for recipe {built_for!r}, not {recipe.name!r}", path=manifest.path,
                          field="recipe")
    return manifest


def check_no_unlisted_files(engine_dir: Path, files: Mapping[str, str]) -> None:
    """Refuse any file in the engine directory that the manifest does not hash (manifest.json aside).

    Whatever a loader or a graph opens (graphs, their external data, shared weights, tokenizer files, whatever new
    kind a backend adds) is a file of the directory, so "every file present is listed" covers them all without a
    list of names: deleting a file's entry from `files` no longer disables its hash check, it makes the engine
    unloadable. Symbolic links are refused too (their target is outside what the hashes vouch for).
    """
    listed = set(files)
    for p in sorted(engine_dir.rglob("*")):
        rel = p.relative_to(engine_dir).as_posix()
        if p.is_symlink():
            raise DFlashError("a symbolic link in the engine directory (engines hold plain files only)", path=p,
                              field="files")
        if not p.is_file() and not p.is_dir():  # a copy or a hash would open it and wait (a FIFO) or read a device
            raise DFlashError("not a regular file or directory (a FIFO, socket or device; engines hold plain files "
                              "only): remove it", path=p, field="files")
        if p.is_file() and rel != MANIFEST and rel not in listed:
            raise DFlashError("not listed in the manifest's `files` (every file of an engine must be listed and "
                              "hashed): rebuild the engine, or remove the file", path=p, field="files")
