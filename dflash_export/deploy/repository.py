"""Write a Triton model repository for a built engine directory.

Layout for this project's engines (onnxruntime, tensorrt, pytorch):

    <repo>/dflash_repository.json      what was deployed (Triton ignores plain files at the repository root)
    <repo>/dflash/config.pbtxt         python backend, one response per request
    <repo>/dflash/1/model.py           dflash_export/deploy/triton_model.py
    <repo>/dflash/engine/              the engine directory, copied (reflinked where the filesystem allows)
    <repo>/dflash_stream/...           the same model, decoupled: one response per DFlash step (generate_stream)

The engine is copied rather than referenced so the repository is self-contained: it can be moved or mounted into a
container, and a rebuild of `engines/…` in place never changes a running deployment under the server's feet. The copy
is a real copy (a reflink on filesystems that share extents, e.g. btrfs / XFS), never a hard link: with a hard link,
editing a file of the engine would edit the deployment too. Its manifest hashes are checked again when each instance
loads.

For a TensorRT-LLM bundle (manifest backend "tensorrt-llm") the repository instead holds one `llmapi`-style model,
named as in the bundle (`tensorrt_llm`): TensorRT-LLM's own python model reads `1/model.yaml` (the DFlash speculative
config, with absolute paths into the bundle, which is therefore referenced rather than copied).

Every config.pbtxt is rendered from a structured description, parsed back and checked (names, data types, dims)
before anything is written (`deploy/pbtxt.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import stat
from pathlib import Path
from typing import Any

import dflash_export
from dflash_export.deploy.connection import DEFAULT_MAX_UPSTREAM_CALLS, Limits
from dflash_export.deploy.handler import INPUT_TYPES
from dflash_export.deploy.kv_memory import KV_MEMORY_FRACTION, default_kv_tokens, kv_bytes_per_token
from dflash_export.deploy.pbtxt import (
    MAX_INSTANCES,
    NAME_PATTERN,
    ModelConfig,
    TensorSpec,
    check_config_text,
    parse_pbtxt,
    render_config,
    write_config,
)
from dflash_export.engines.manifest import Manifest, library_versions, read_manifest
from dflash_export.engines.registry import BACKENDS, MAX_BATCH, check_engine_manifest
from dflash_export.environment import available_memory_bytes, require_module
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.files import atomic_dir, check_output_dir, read_json_object, sha256_file

MODEL_NAME = "dflash"
STREAM_MODEL_NAME = "dflash_stream"
MARKER = "dflash_repository.json"
TRITON_MODEL = Path(__file__).with_name("triton_model.py")  # what deploy writes as each model's 1/model.py
# The marker's `format`: the repository layout this version writes and serves. A repository of another format (an
# older or newer dflash-export) is refused by `serve`, never run: deploy it again.
REPO_FORMAT = 2
DEFAULT_MAX_QUEUE_SIZE = 64
MAX_THREADS = 1024  # deploy --threads: intra-op threads per instance
MAX_TOKEN_COUNT = 10**12 - 1  # deploy --max-queued-tokens / --max-kv-tokens: what serve reads back (12 digits)
MAX_QUEUE_SIZE = 2**32 - 1  # deploy --max-queue-size: Triton's max_queue_size is an unsigned 32-bit field


# The request/response contract of the `dflash` models (docs/serving.md); the inputs' types live with the request
# checks in deploy/handler.py.
INPUTS = [TensorSpec(name, "TYPE_" + ("STRING" if dtype == "BYTES" else dtype), list(dims), optional=True)
          for name, (dtype, dims) in INPUT_TYPES.items()]
OUTPUTS = [
    TensorSpec("text_output", "TYPE_STRING", [1]),
    TensorSpec("finish_reason", "TYPE_STRING", [1]),
    TensorSpec("completion_tokens", "TYPE_INT32", [1]),
    TensorSpec("accepted_tokens", "TYPE_INT32", [1]),
    TensorSpec("drafted_tokens", "TYPE_INT32", [1]),
    TensorSpec("acceptance_length", "TYPE_FP32", [1]),
    TensorSpec("prompt_tokens", "TYPE_INT32", [1]),
    TensorSpec("step_stats", "TYPE_STRING", [1]),  # JSON, last response only: acceptance length per step, seconds
]

# What the TensorRT-LLM llmapi python model reads and writes (a subset of its optional inputs).
LLMAPI_INPUTS = [
    TensorSpec("text_input", "TYPE_STRING", [-1]),
    TensorSpec("streaming", "TYPE_BOOL", [1], optional=True),
    TensorSpec("sampling_param_temperature", "TYPE_FP32", [1], optional=True),
    TensorSpec("sampling_param_top_k", "TYPE_INT32", [1], optional=True),
    TensorSpec("sampling_param_top_p", "TYPE_FP32", [1], optional=True),
    TensorSpec("sampling_param_max_tokens", "TYPE_INT32", [1], optional=True),
    TensorSpec("sampling_param_stop", "TYPE_STRING", [-1], optional=True),
    TensorSpec("sampling_param_seed", "TYPE_UINT64", [1], optional=True),
    TensorSpec("return_finish_reason", "TYPE_BOOL", [1], optional=True),
]
LLMAPI_OUTPUTS = [
    TensorSpec("text_output", "TYPE_STRING", [-1]),
    TensorSpec("finish_reason", "TYPE_STRING", [-1]),
    TensorSpec("acceptance_rate", "TYPE_FP32", [1]),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    TensorSpec("total_draft_tokens", "TYPE_INT32", [1]),
]


# ----------------------------------------------------------------------------------------------------------------------
# Rendering and checking config.pbtxt


# ----------------------------------------------------------------------------------------------------------------------
# Writing the repository


_FICLONE = 0x40049409  # linux/fs.h: share the source's extents (copy-on-write), or fail


def _reflink_or_copy(src, dst):
    """Copy `src` to `dst` as its own file: a copy-on-write clone where the filesystem can, a byte copy otherwise."""
    try:
        import fcntl

        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
        shutil.copystat(src, dst)
        return dst
    except (OSError, ImportError):
        pass
    return shutil.copy2(src, dst)


def _needed_libraries(backend: str) -> dict[str, str]:
    """Versions of the libraries the served engine imports, recorded so the model can refuse a different set (one
    installed under another distribution name, such as onnxruntime-gpu, has no version under this name: not
    recorded). MissingDependency with the install line for one that cannot be imported here: the repository is served
    from this environment (`serve` starts the model stubs in it), so the model could not load."""
    spec = BACKENDS.get(backend)
    names = ["numpy", "tokenizers", *(spec.serve_libraries if spec else ())]
    versions = {k: v for k, v in library_versions(tuple(names)).items() if k != "python"}
    for name in names:
        if name not in versions:
            try:
                require_module(name)
            except MissingDependency as e:
                raise MissingDependency(f"{e.message} (the served {backend} engine imports it)",
                                        field="--engine") from None
    return versions


# ----------------------------------------------------------------------------------------------------------------------
# Checking the engine and the target before anything is written


def check_repo_path(repo_arg, engine_dir: Path | None = None) -> Path:
    """Resolve `--repo` and refuse, before anything is written, a target deploy must not (or cannot) replace."""
    if repo_arg is None or not str(repo_arg).strip():
        raise DFlashError("empty path: name the repository directory to write", field="--repo")
    repo = Path(repo_arg).expanduser().resolve()
    if engine_dir is not None:
        if repo == engine_dir or engine_dir in repo.parents:
            raise DFlashError(f"is inside the engine directory {engine_dir}; choose a directory outside it",
                              path=repo, field="--repo")
        if repo in engine_dir.parents:
            raise DFlashError(f"contains the engine directory {engine_dir}, which deploy would replace; choose "
                              "another directory", path=repo, field="--repo")
    # written as a sibling temp directory, then renamed: never the cwd, never someone else's directory, and its parent
    # must be (or become) writable
    check_output_dir(repo, "--repo", command="deploy", is_previous_output=lambda d: (d / MARKER).is_file(),
                     replaced=True)
    return repo


def _check_llmapi_model_py(llmapi_model_py, backend: str, engine_dir: Path) -> Path | None:
    if llmapi_model_py is None:
        return None
    if not str(llmapi_model_py).strip():
        raise DFlashError("empty path", field="--llmapi-model-py")
    src = Path(llmapi_model_py).expanduser()
    if backend != "tensorrt-llm":
        raise DFlashError(f"only used with a TensorRT-LLM bundle, but {engine_dir} is an engine for backend "
                          f"{backend!r} (its Triton model comes with dflash-export): drop the option", path=src,
                          field="--llmapi-model-py")
    if not src.exists():
        raise DFlashError("file not found", path=src, field="--llmapi-model-py")
    if not src.is_file():
        raise DFlashError("not a file (expected TensorRT-LLM's llmapi model.py)", path=src, field="--llmapi-model-py")
    if not os.access(src, os.R_OK):
        raise DFlashError("not readable", path=src, field="--llmapi-model-py")
    return src.resolve()


def _os_error(e: OSError, engine_dir: Path, repo_dir: Path) -> DFlashError:
    """One line for a filesystem failure while writing (shutil.Error carries a list of (src, dst, why))."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        src, _dst, why = e.args[0][0]
        return DFlashError(f"cannot copy it into the repository ({why})", path=src)
    name = Path(str(e.filename)) if e.filename else None
    if name is not None and (name == engine_dir or engine_dir in name.parents):
        return DFlashError(f"cannot read it ({e.strerror or e})", path=name)
    where = f": {name}" if name is not None and name != repo_dir else ""
    return DFlashError(f"cannot write the repository ({e.strerror or e}{where})", path=repo_dir, field="--repo")


def write_repository(engine_dir, repo_dir, instances: int = 1, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
                     decoupled: bool | None = None, threads: int = 0, llmapi_model_py=None,
                     max_body_bytes: int | None = None, max_json_depth: int | None = None, max_batch: int = 1,
                     max_queued_tokens: int = 65536, plain: bool = False, max_kv_tokens: int = 0) -> Path:
    """Write (atomically: a temp dir renamed on success) the Triton repository for `engine_dir` into `repo_dir`.

    decoupled: None writes both `dflash` and the streaming `dflash_stream`; True / False only that one (named
    `dflash` either way). max_queue_size 0 means unbounded. threads: intra-op threads per instance (0: the
    server's cores divided by `instances`, decided at load). max_body_bytes / max_json_depth: the request limits
    the HTTP front applies (recorded in the marker; defaults in deploy/connection.py). max_batch > 1: each instance
    feeds its concurrent requests into one shared continuous batch of at most that many sequences (dflash_export.
    batching; onnxruntime engines, and tensorrt engines up to the bound their batch engines were built for), with at
    most `max_queued_tokens` prompt tokens waiting to join it and at most `max_kv_tokens` K/V token cells in its
    buffers (0: decided when each instance loads, `default_kv_tokens`, every model's instances sharing the memory);
    1: one request at a time per instance. plain: the models decode without the drafter (plain decoding on the same
    engine, the served yardstick). Returns the repository path.

    Every check (engine manifest, options, target directory) runs before anything is written; a failure while
    writing leaves neither a partial repository nor the parent directories it created.
    """
    if engine_dir is None or not str(engine_dir).strip():
        raise DFlashError("empty path: name a built engine directory", field="--engine")
    engine_dir = Path(engine_dir).expanduser().resolve()
    manifest = check_engine_manifest(engine_dir)
    if not 1 <= instances <= MAX_INSTANCES:
        raise DFlashError(f"must be in 1..{MAX_INSTANCES}, got {instances}", field="--instances")
    if not 0 <= max_queue_size <= MAX_QUEUE_SIZE:
        raise DFlashError(f"must be in 0..{MAX_QUEUE_SIZE}, got {max_queue_size}", field="--max-queue-size")
    if not 0 <= threads <= MAX_THREADS:
        raise DFlashError(f"must be in 0..{MAX_THREADS}, got {threads}", field="--threads")
    if not 1 <= max_batch <= MAX_BATCH:
        raise DFlashError(f"must be in 1..{MAX_BATCH}, got {max_batch}", field="--max-batch")
    if not 1 <= max_queued_tokens <= MAX_TOKEN_COUNT:
        raise DFlashError(f"must be in 1..{MAX_TOKEN_COUNT}, got {max_queued_tokens}", field="--max-queued-tokens")
    if not 0 <= max_kv_tokens <= MAX_TOKEN_COUNT:
        raise DFlashError(f"must be in 0..{MAX_TOKEN_COUNT} (0: from the memory available), got {max_kv_tokens}",
                          field="--max-kv-tokens")
    if max_batch > 1 and not BACKENDS[manifest.backend].batched:
        batched = ", ".join(b.name for b in BACKENDS.values() if b.batched)
        raise DFlashError(f"batched serving runs on {batched} engines (this one is {manifest.backend})",
                          field="--max-batch")
    bound = BACKENDS[manifest.backend].batch_bound
    if max_batch > 1 and bound is not None and max_batch > (built := bound(manifest)):
        raise DFlashError(f"{max_batch} sequences per call, but the engine's batched engines were built for at most "
                          f"{built}", path=manifest.path, field="--max-batch")
    limits = Limits(**{k: v for k, v in (("max_body_bytes", max_body_bytes), ("max_json_depth", max_json_depth))
                       if v is not None}).check()
    backend = manifest.backend
    # What the served engine imports, checked installed before anything is written and recorded in each model
    libraries = _needed_libraries(backend) if BACKENDS[backend].served_by_dflash else {}
    model_py = _check_llmapi_model_py(llmapi_model_py, backend, engine_dir)
    repo_dir = check_repo_path(repo_dir, engine_dir)
    created = []  # parent directories atomic_dir will create, removed again if writing fails
    anc = repo_dir.parent
    while not anc.exists() and anc != anc.parent:
        created.append(anc)
        anc = anc.parent
    try:
        with atomic_dir(repo_dir, field="--repo") as tmp:
            if not BACKENDS[backend].served_by_dflash:  # TensorRT-LLM: its own llmapi model
                models = _write_llmapi(engine_dir, tmp, model_py)
            else:
                models = _write_python_models(engine_dir, tmp, libraries, instances, max_queue_size, decoupled,
                                              threads, max_batch, max_queued_tokens, plain, max_kv_tokens)
            (tmp / MARKER).write_text(json.dumps({
                "format": REPO_FORMAT, "engine": str(engine_dir),
                "engine_manifest_sha256": sha256_file(engine_dir / "manifest.json"), "backend": backend,
                "recipe": manifest.recipe, "models": models,
                "instances": instances, "max_queue_size": max_queue_size, "max_batch": max_batch, "plain": plain,
                "max_kv_tokens": max_kv_tokens,
                "precision": (manifest.precision or {}).get("target"),
                "limits": {"max_body_bytes": limits.max_body_bytes, "max_json_depth": limits.max_json_depth}},
                indent=2) + "\n", encoding="utf-8")
    except BaseException as e:
        for d in created:  # deepest first; only the ones left empty
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError):
            raise _os_error(e, engine_dir, repo_dir) from None
        raise
    return repo_dir


def _write_python_models(engine_dir: Path, repo: Path, libraries: dict[str, str], instances: int, max_queue_size: int,
                         decoupled: bool | None, threads: int, max_batch: int = 1,
                         max_queued_tokens: int = 65536, plain: bool = False, max_kv_tokens: int = 0) -> list[str]:
    variants = [(MODEL_NAME, False), (STREAM_MODEL_NAME, True)] if decoupled is None else [(MODEL_NAME, decoupled)]
    home = repo / variants[0][0]
    shutil.copytree(engine_dir, home / "engine", copy_function=_reflink_or_copy)
    # The copy's directories keep their source's modes, but a read-only engine (installed by another user) must
    # not make the repository one its owner cannot remove or replace: each is made writable by its owner.
    for d, _, _ in os.walk(home / "engine"):
        os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | stat.S_IWUSR)
    for name, is_decoupled in variants:
        model_dir = repo / name
        engine_ref = os.path.relpath(home / "engine", model_dir)
        write_config(model_dir, ModelConfig(
            name=name, inputs=INPUTS, outputs=OUTPUTS, instances=instances, decoupled=is_decoupled,
            max_queue_size=max_queue_size,
            # No path of this machine: the engine is referenced relative to the model, and the stub finds the
            # project and its libraries through the environment `serve` starts it in (deploy/triton_install.py),
            # so the repository can move to another machine or into a container.
            parameters={"engine_dir": engine_ref, "threads": str(threads),
                        "max_batch": str(max_batch), "max_queued_tokens": str(max_queued_tokens),
                        "max_kv_tokens": str(max_kv_tokens),
                        "kv_instances": str(kv_instances(len(variants), instances)),
                        "mode": "ar" if plain else "dflash",
                        "library_versions": json.dumps(libraries)},
        ))
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(TRITON_MODEL, model_dir / "1" / "model.py")
    return [name for name, _ in variants]


LLMAPI_NOTE = """This model runs on TensorRT-LLM's `llmapi` python model, which ships with TensorRT-LLM's Triton
backend (the tritonserver *-trtllm-python-py3 containers), not with dflash-export. 1/model.yaml carries the DFlash
speculative config; its paths point at the TensorRT-LLM bundle, which must stay where it is. Copy TensorRT-LLM's
triton_backend/all_models/llmapi/tensorrt_llm/1/model.py (and helpers.py) into 1/, or redeploy with
`dflash-export deploy --llmapi-model-py PATH`.
"""


def _find_model_yaml(bundle: Path) -> Path:
    found = sorted(bundle.glob("triton/*/1/model.yaml")) or sorted(bundle.glob("model.yaml"))
    if len(found) != 1:
        raise DFlashError("TensorRT-LLM bundle must hold exactly one triton/<model>/1/model.yaml (the llmapi "
                          f"model config), found {len(found)}", path=bundle)
    return found[0]


def _write_llmapi(bundle: Path, repo: Path, llmapi_model_py: Path | None) -> list[str]:
    model_yaml = _find_model_yaml(bundle)
    # The bundle names its model (TensorRT-LLM's docs use `tensorrt_llm`); a root-level model.yaml gets ours.
    name = model_yaml.parent.parent.name if model_yaml.parent.name == "1" else MODEL_NAME
    model_dir = repo / name
    # Batch size, transaction policy and instances are model.yaml's `triton_config` to decide: the llmapi model
    # applies them itself, so config.pbtxt leaves them out (as TensorRT-LLM's own config.pbtxt does).
    write_config(model_dir, ModelConfig(name=name, inputs=LLMAPI_INPUTS, outputs=LLMAPI_OUTPUTS,
                                        max_batch_size=None, instances=None, decoupled=None))
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    # model.yaml refers to the bundle by absolute path, so the bundle is referenced, not copied.
    shutil.copy2(model_yaml, model_dir / "1" / "model.yaml")
    if llmapi_model_py is not None:  # checked by write_repository: a readable file, for this backend only
        src = llmapi_model_py
        shutil.copy2(src, model_dir / "1" / "model.py")
        if (src.parent / "helpers.py").is_file():
            shutil.copy2(src.parent / "helpers.py", model_dir / "1" / "helpers.py")
    else:
        (model_dir / "README.txt").write_text(LLMAPI_NOTE, encoding="utf-8")
    return [name]


# ----------------------------------------------------------------------------------------------------------------------
# Checking a written repository before serving it


def _config_parameters(cfg: dict[str, Any]) -> dict[str, str]:
    params = cfg.get("parameters", [])
    out = {}
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and isinstance(p.get("key"), str) and isinstance(p.get("value"), dict):
            out[p["key"]] = p["value"].get("string_value")
    return out


def _check_library_versions(recorded: str | None, cfg_path: Path) -> None:
    """The versions recorded at deploy must be the ones `serve` gives the model (numpy is the stub's own)."""
    from importlib import metadata

    where = "parameters.library_versions"
    try:
        want = json.loads(recorded or "{}")
    except json.JSONDecodeError as e:
        raise DFlashError(f"not valid JSON ({e.msg})", path=cfg_path, field=where) from None
    if not isinstance(want, dict):
        raise DFlashError("expected a JSON object of package versions", path=cfg_path, field=where)
    for name, version in want.items():
        if name == "numpy":
            continue
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            raise DFlashError(f"deployed with {name} {version}, but this environment has "
                              f"{name + ' ' + have if have else 'no ' + name}: serve from the environment that "
                              "deployed it, or deploy again from this one", path=cfg_path, field=where)


def check_repository(repo) -> dict[str, Any]:
    """Refuse, before a server starts, a directory `dflash-export deploy` did not write or that was changed since.

    Checks the marker (its format: this version's), that Triton would load exactly the deployed models and nothing
    else (no other model, version, file or symbolic link), the options the marker records (which `serve` goes by),
    every config.pbtxt (deploy's fields only, as deploy writes them for those options), that each model's model.py is
    this version's own, the copied engine (manifest fields and file hashes, and the one deploy recorded) and the
    recorded library versions. A TensorRT-LLM repository is refused: its model.py is TensorRT-LLM's.
    Returns the marker.
    """
    repo = Path(repo)
    if not repo.exists():
        raise DFlashError("model repository not found", path=repo, field="--repo")
    if not repo.is_dir():
        raise DFlashError("not a directory", path=repo, field="--repo")
    marker_path = repo / MARKER
    if not marker_path.is_file():
        raise DFlashError(f"not a model repository written by `dflash-export deploy` (no {MARKER})", path=repo,
                          field="--repo")
    marker = read_json_object(marker_path)
    models = _marker_models(marker, marker_path)
    if marker.get("format") != REPO_FORMAT:
        raise DFlashError(f"written by another version of dflash-export (repository format "
                          f"{marker.get('format', 1)!r}; this version serves format {REPO_FORMAT}): deploy again",
                          path=marker_path, field="format")
    if marker.get("backend") == "tensorrt-llm":
        raise DFlashError("a TensorRT-LLM repository: its model.py is TensorRT-LLM's own, which `dflash-export serve` "
                          "does not run; serve it with tritonserver in TensorRT-LLM's Triton container",
                          path=marker_path, field="backend")
    try:
        entries = sorted(repo.iterdir())
    except OSError as e:
        raise DFlashError(f"cannot read it ({e.strerror})", path=repo) from None
    for d in entries:
        if d.is_symlink():
            raise DFlashError(_NOT_DEPLOYED.format("a symbolic link"), path=d)
        if d.is_dir() and d.name not in models:
            raise DFlashError(f"not one of the deployed models {models} (Triton would try to load it); remove it or "
                              "deploy again", path=d)
    options = _marker_options(marker, marker_path)
    home = repo / models[0]  # the model whose directory holds the engine every model of the repository serves
    for name in models:
        model_dir = repo / name
        cfg_path = model_dir / "config.pbtxt"
        if not model_dir.is_dir():
            raise DFlashError(f"model directory listed in {MARKER} is missing", path=model_dir)
        _, params = _read_python_config(cfg_path, name, home, options, len(models))
        if not (model_dir / "1" / "model.py").is_file():
            raise DFlashError("missing: deploy again", path=model_dir / "1" / "model.py")
        _check_python_model(model_dir, home)
        if model_dir == home:
            _check_served_engine(check_engine_manifest(home / "engine"), marker, marker_path)
        _check_library_versions(params.get("library_versions"), cfg_path)
    return marker


_NOT_DEPLOYED = "{} that `dflash-export deploy` did not write (tritonserver would load or import it): remove it or " \
                "deploy again"
# What deploy writes into a python model's config.pbtxt (pbtxt.render_config) and its `parameters`: anything else
# (another backend or model file, an EXECUTION_ENV_PATH, a sys_path, a version policy) is refused, not run.
_CONFIG_FIELDS = {"name", "backend", "max_batch_size", "model_transaction_policy", "input", "output", "instance_group",
                  "dynamic_batching", "parameters"}
_CONFIG_PARAMETERS = {"engine_dir", "threads", "max_batch", "max_queued_tokens", "max_kv_tokens", "kv_instances",
                      "mode", "library_versions"}
_INTEGER_PARAMETERS = {"threads": (0, MAX_THREADS), "max_batch": (1, MAX_BATCH),  # the ranges deploy writes
                       "max_queued_tokens": (1, MAX_TOKEN_COUNT), "max_kv_tokens": (0, MAX_TOKEN_COUNT),
                       "kv_instances": (1, 2 * MAX_INSTANCES)}  # dflash and dflash_stream
# The marker's record of deploy's options: (key, range, value when absent: a marker written before the key existed).
_MARKER_OPTIONS = (("instances", (1, MAX_INSTANCES), 1), ("max_batch", (1, MAX_BATCH), 1),
                   ("max_queue_size", (0, MAX_QUEUE_SIZE), DEFAULT_MAX_QUEUE_SIZE),
                   ("max_kv_tokens", (0, MAX_TOKEN_COUNT), 0))


def _marker_models(marker: dict[str, Any], marker_path: Path) -> list[str]:
    models = marker.get("models")
    if not isinstance(models, list) or not models or any(not isinstance(m, str) or not NAME_PATTERN.match(m)
                                                         for m in models):
        raise DFlashError(f"expected a non-empty list of model names, got {models!r}", path=marker_path,
                          field="models")
    return models


def _marker_options(marker: dict[str, Any], marker_path: Path) -> dict[str, Any]:
    """The deploy options the marker records, each checked as deploy writes it (the front sizes itself by them and
    every model's config.pbtxt must agree with them), the front's recorded limits among them. Returns them by key,
    with `plain`."""
    out: dict[str, Any] = {}
    for key, (lo, hi), default in _MARKER_OPTIONS:
        value = marker.get(key, default)
        if type(value) is not int or not lo <= value <= hi:
            raise DFlashError(f"must be an integer in {lo}..{hi}, got {value!r}: deploy again", path=marker_path,
                              field=key)
        out[key] = value
    out["plain"] = marker.get("plain", False)
    if type(out["plain"]) is not bool:
        raise DFlashError(f"must be true or false, got {out['plain']!r}: deploy again", path=marker_path,
                          field="plain")
    recorded_limits(marker, marker_path)
    return out


def recorded_limits(marker: dict[str, Any], marker_path: Path | None = None) -> dict[str, int]:
    """The front's request size and JSON depth limits deploy recorded in the marker (Limits' defaults where a marker
    records none), checked as Limits checks them: the `serve` front's defaults."""
    recorded = marker.get("limits", {})
    if not isinstance(recorded, dict):
        raise DFlashError(f"expected a JSON object, got {recorded!r}: deploy again", path=marker_path, field="limits")
    values = {}
    for key in ("max_body_bytes", "max_json_depth"):
        value = recorded.get(key, getattr(Limits, key))
        if type(value) is not int:
            raise DFlashError(f"must be an integer, got {value!r}: deploy again", path=marker_path,
                              field=f"limits.{key}")
        values[key] = value
    try:
        Limits(**values).check()
    except DFlashError as e:
        raise DFlashError(f"{e.message}: deploy again", path=marker_path,
                          field="limits." + ("max_body_bytes" if e.field == "--max-request-bytes" else "max_json_depth")
                          ) from None
    return values


def _check_config_agrees(cfg: dict[str, Any], params: dict[str, str], options: dict[str, Any], cfg_path: Path,
                         name: str, n_models: int) -> None:
    """A `dflash` model's parsed config.pbtxt must be the one deploy writes for the options the marker records: the
    same tensors (input_ids may be absent: deployed before it existed), transaction policy, instances, queue and
    batch parameters, and the instances of the deployment, every model's, that share the default K/V memory (a
    config written without `kv_instances`, whose model stub counts its own model's instances alone, agrees only where
    there is one model). `params` are its parameters, already checked by `_read_python_config`."""
    decoupled = cfg.get("model_transaction_policy", {}).get("decoupled") if isinstance(
        cfg.get("model_transaction_policy"), dict) else None
    if n_models > 1 or type(decoupled) is not bool:  # one model of each kind, or one: streaming or not
        decoupled = name == STREAM_MODEL_NAME
    want = parse_pbtxt(render_config(ModelConfig(
        name=name, inputs=INPUTS, outputs=OUTPUTS, instances=options["instances"], decoupled=decoupled,
        max_queue_size=options["max_queue_size"])), cfg_path)
    recorded = f"deploy wrote it from the options {MARKER} records"

    def refuse(field: str, have, expected) -> None:
        have, expected = (r if len(r := repr(v)) <= 100 else r[:97] + "..." for v in (have, expected))
        raise DFlashError(f"{have} differs from {expected} ({recorded}): deploy again", path=cfg_path, field=field)

    for key in ("max_batch_size", "model_transaction_policy", "instance_group", "dynamic_batching", "output"):
        if cfg.get(key) != want.get(key):
            refuse(key, cfg.get(key), want.get(key))
    declared = cfg.get("input", [])
    declared = {t.get("name"): t for t in (declared if isinstance(declared, list) else [declared])}
    for spec in want["input"]:
        if spec["name"] not in declared and spec["name"] != "input_ids":
            raise DFlashError(f"missing ({recorded}): deploy again", path=cfg_path, field=f"input {spec['name']}")
        if spec["name"] in declared and (have := declared.pop(spec["name"])) != spec:
            refuse(f"input {spec['name']}", have, spec)
    if declared:
        raise DFlashError(f"not an input deploy writes ({recorded}): deploy again", path=cfg_path,
                          field=f"input {next(iter(declared))}")
    for key, expected, default in (("max_batch", str(options["max_batch"]), "1"),
                                   ("max_kv_tokens", str(options["max_kv_tokens"]), "0"),
                                   ("kv_instances", str(kv_instances(n_models, options["instances"])),
                                    str(options["instances"])),
                                   ("mode", "ar" if options["plain"] else "dflash", "dflash")):
        if key not in params and default != expected:  # what the model stub does without it is not what was deployed
            raise DFlashError(f"missing, which the model reads as {default!r}, not {expected!r} ({recorded}): deploy "
                              "again", path=cfg_path, field=f"parameters.{key}")
        if params.get(key, default) != expected:
            refuse(f"parameters.{key}", params.get(key, default), expected)


def _read_python_config(cfg_path: Path, name: str, home: Path, options: dict[str, Any],
                        n_models: int) -> tuple[str, dict[str, str]]:
    """A `dflash` python model's config.pbtxt, read once and checked as deploy writes it: the python backend,
    deploy's fields and parameters only, the engine referenced inside the repository, the rest as deploy writes it for
    the `options` its marker records (`_marker_options`; `n_models` in the repository). Returns the text checked and
    its parameters."""
    if not cfg_path.is_file():
        raise DFlashError("missing: deploy again", path=cfg_path)
    try:
        text = cfg_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DFlashError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=cfg_path) from None
    cfg = check_config_text(text, cfg_path, expect_name=name)
    params = _config_parameters(cfg)
    if cfg.get("backend") != "python":
        raise DFlashError(f"must be \"python\" (deploy writes a python backend model), got {cfg.get('backend')!r}",
                          path=cfg_path, field="backend")
    if extra := sorted(set(cfg) - _CONFIG_FIELDS):
        raise DFlashError("not a field deploy writes: remove it or deploy again", path=cfg_path, field=extra[0])
    if extra := sorted(set(params) - _CONFIG_PARAMETERS):
        raise DFlashError("not a parameter deploy writes: remove it or deploy again", path=cfg_path,
                          field=f"parameters.{extra[0]}")
    for key, (lo, hi) in _INTEGER_PARAMETERS.items():  # the model reads these with int() as it loads
        value = params.get(key)
        if value is not None and not (re.fullmatch(r"[0-9]{1,12}", value) and lo <= int(value) <= hi):
            raise DFlashError(f"must be an integer in {lo}..{hi}, got {value!r}: deploy again", path=cfg_path,
                              field=f"parameters.{key}")
    ref = params.get("engine_dir")
    if not ref:
        raise DFlashError("missing: deploy again", path=cfg_path, field="parameters.engine_dir")
    model_dir = cfg_path.parent
    if os.path.isabs(ref) or Path(os.path.normpath(model_dir / ref)) != home / "engine":
        raise DFlashError(f"must name the repository's own engine {os.path.relpath(home / 'engine', model_dir)!r}, "
                          f"got {ref!r}", path=cfg_path, field="parameters.engine_dir")
    _check_config_agrees(cfg, params, options, cfg_path, name, n_models)
    return text, params


def _check_python_model(model_dir: Path, home: Path) -> None:
    """A `dflash` python model's files exactly as deploy writes them: config.pbtxt, `1/model.py` byte for byte this
    version's triton_model.py and nothing else beside it (the stub imports from that directory), the engine in the
    first model's directory, no symbolic link anywhere."""
    expected = {"config.pbtxt": False, "1": True, **({"engine": True} if model_dir == home else {})}
    for p in sorted(model_dir.iterdir()):
        if p.is_symlink():
            raise DFlashError(_NOT_DEPLOYED.format("a symbolic link"), path=p)
        if p.name not in expected or expected[p.name] != p.is_dir():
            raise DFlashError(_NOT_DEPLOYED.format("a file or directory"), path=p)
    for p in sorted((model_dir / "1").iterdir()):
        if p.name != "model.py" or p.is_symlink() or not p.is_file():
            raise DFlashError(_NOT_DEPLOYED.format("a symbolic link" if p.is_symlink() else "a file or directory"),
                              path=p)
    if (model_dir / "1" / "model.py").read_bytes() != TRITON_MODEL.read_bytes():
        raise DFlashError("not the model this version of dflash-export serves (edited, or written by another "
                          "version): deploy again", path=model_dir / "1" / "model.py")


def served_copy(repo: Path, dest: Path) -> Path:
    """The repository tritonserver loads: `dest` (made anew, in a directory only this user can enter) holds each
    model's config.pbtxt as read and checked here, this version's own model.py, and a link to the repository's
    engine, which the model checks against its manifest's hashes as it loads it. What tritonserver imports and
    configures is then what was checked, even if the repository changes between `check_repository` and the load;
    the engine is data (graphs, weights, a tokenizer), never executed. Returns `dest`."""
    repo = Path(repo)
    marker_path = repo / MARKER
    if not marker_path.is_file():
        raise DFlashError(f"not a model repository written by `dflash-export deploy` (no {MARKER})", path=repo,
                          field="--repo")
    marker = read_json_object(marker_path)
    models = _marker_models(marker, marker_path)
    options = _marker_options(marker, marker_path)
    home = repo / models[0]
    shutil.rmtree(dest, ignore_errors=True)
    for name in models:
        text, _ = _read_python_config(repo / name / "config.pbtxt", name, home, options, len(models))
        (dest / name / "1").mkdir(parents=True, mode=0o700)
        (dest / name / "config.pbtxt").write_text(text, encoding="utf-8")
        shutil.copyfile(TRITON_MODEL, dest / name / "1" / "model.py")
    (dest / models[0] / "engine").symlink_to(home / "engine", target_is_directory=True)
    return dest


def model_inputs(served: Path) -> dict[str, frozenset[str]]:
    """The input names each model of a served copy (`served_copy`) declares in its config.pbtxt: the inputs
    tritonserver takes for it (the config is loaded as written, never auto-completed). A repository deployed before an
    input existed (input_ids) declares none of it."""
    out = {}
    for model_dir in sorted(Path(served).iterdir()):
        cfg_path = model_dir / "config.pbtxt"
        if cfg_path.is_file():
            text = cfg_path.read_text(encoding="utf-8")
            tensors = check_config_text(text, cfg_path, expect_name=model_dir.name).get("input", [])
            out[model_dir.name] = frozenset(t["name"] for t in (tensors if isinstance(tensors, list) else [tensors]))
    return out


def _check_served_engine(manifest: Manifest, marker: dict[str, Any], marker_path: Path) -> None:
    """The repository's engine must be the one deploy copied: same manifest bytes, recipe and backend."""
    for key, have in (("recipe", manifest.recipe), ("backend", manifest.backend)):
        if marker.get(key) != have:
            raise DFlashError(f"the repository's engine is for {key} {have!r}, but deploy recorded "
                              f"{marker.get(key)!r} (the engine was replaced): deploy again", path=manifest.path,
                              field=key)
    if marker.get("engine_manifest_sha256") != sha256_file(manifest.path):
        raise DFlashError("changed since deploy (the engine was replaced or rebuilt in place): deploy again",
                          path=manifest.path, field="engine_manifest_sha256")


def stub_python_path() -> list[str]:
    """Directories the stub must import from: the project root, then this environment's site-packages."""
    project_root = str(Path(dflash_export.__file__).resolve().parent.parent)
    paths = [project_root] + [p for p in site.getsitepackages() if Path(p).is_dir()]
    return list(dict.fromkeys(paths))


def shared_batch_note(precision, max_batch) -> str | None:
    """What a user of a quantized engine served in a shared batch should know, or None (from the repository marker's
    `precision` and `max_batch`): its greedy answers come from the batched graph, whose attention (plain operators
    over the K/V buffer) rounds differently in the last bits from the single-stream graph `run` uses, and int8 / int4
    engines quantize activations to int8, which turns such differences into other tokens (measured on SmolLM2-135M
    int4: docs/serving.md). Each answer is still that engine's plain decoding, whatever shares its batch;
    `--max-batch 1` answers as `run`."""
    if precision not in ("int8", "int4") or not isinstance(max_batch, int) or max_batch <= 1:
        return None
    return (f"note: this {precision} engine decodes requests in a shared batch (--max-batch {max_batch}): a greedy "
            f"answer is the batched engine's plain decoding whatever shares its batch, but can differ from "
            f"`dflash-export run`'s (its {precision} products quantize activations to int8, which turns the two "
            f"graphs' last-bit differences in attention into other tokens); --max-batch 1 answers as run does")


def upstream_call_bound(marker: dict) -> int:
    """The front's bound on its calls open to tritonserver at once when `serve` is given none (`--max-upstream-calls`;
    from the repository marker): what the repository's models hold at once, each instance's batch and each model's
    queue, so that a full queue is still refused by tritonserver (503) rather than waited out at the front; at least
    DEFAULT_MAX_UPSTREAM_CALLS. With an unbounded queue (--max-queue-size 0) only the batches count, and the calls
    past the bound wait at the front."""
    def count(key: str, default: int) -> int:
        v = marker.get(key, default)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default

    models = marker.get("models")
    held = (len(models) if isinstance(models, list) and models else 1) * (
        count("instances", 1) * count("max_batch", 1) + count("max_queue_size", DEFAULT_MAX_QUEUE_SIZE))
    return min(65536, max(DEFAULT_MAX_UPSTREAM_CALLS, held))


def kv_instances(models: int, instances: int) -> int:
    """The instances of a deployment of `models` models, `instances` each: every one holds its own shared batch (with
    max_batch > 1), so together they share the default K/V memory (`default_kv_tokens`)."""
    return models * instances


def kv_memory_note(engine_dir: Path, instances: int, max_batch: int, models: int, available: int | None = None,
                   max_kv_tokens: int = 0) -> str | None:
    """What bounds the K/V of each instance's shared batch, in a deployment of `models` models of `instances`
    instances each: `max_kv_tokens` token cells when given, else the bound `default_kv_tokens` gives for this
    machine's available memory now, shared by every model's instances (each instance works it out again when it
    loads), with what that allows of full-length sequences; a warning when a given bound's K/V, for every instance of
    every model, passes the memory available. None when max_batch is 1 (no shared batch), when the engine records no
    shapes, and when no bound is given and the default holds max_batch full-length sequences (nothing to say)."""
    if max_batch <= 1 or not (Path(engine_dir) / "manifest.json").is_file():  # a TensorRT-LLM bundle: its own batch
        return None
    manifest = read_manifest(engine_dir, verify_files=False)  # checked where the repository was written or served
    per_token = kv_bytes_per_token(manifest)
    available = available_memory_bytes() if available is None else available
    if per_token is None or not manifest.max_seq_len:
        return None
    gib = 2**30
    total = kv_instances(models, instances)
    counted = f"the {total} instances of {models} models" if models > 1 else f"{total} instance(s)"
    if max_kv_tokens:
        tokens, how = max_kv_tokens, "--max-kv-tokens"
    else:
        tokens = default_kv_tokens(manifest, total, max_batch, available)
        if tokens is None and manifest.backend != "onnxruntime":  # K/V on the device: --max-batch bounds it
            return None
        if tokens is None:
            return ("note: the memory available is unknown here: each instance bounds its shared batch's K/V by the "
                    "memory available when it loads (by --max-batch alone where that is unknown too)")
        how = (f"at most {KV_MEMORY_FRACTION:.0%} of the {available / gib:.1f} GiB available now, shared by "
               f"{counted}; each instance works it out again when it loads")
    full = tokens // manifest.max_seq_len
    if full >= max_batch and not max_kv_tokens:  # the default bound holds every sequence at full length: no note
        return None
    note = (f"note: each instance's shared batch holds at most {tokens} K/V tokens ({tokens * per_token / gib:.2f} GiB "
            f"at {per_token} bytes a token; {how}): ")
    if full >= max_batch:
        note += f"all {max_batch} sequences fit at full length (max_seq_len {manifest.max_seq_len})"
    else:
        note += (f"{full} sequence(s) at full length (max_seq_len {manifest.max_seq_len}) or more shorter ones at "
                 f"once (at most --max-batch {max_batch}); a request waits to join until its K/V fits, and one that "
                 "needs more than the whole bound is refused (HTTP 400)")
    if available is not None and total * tokens * per_token > available:
        note += (f". Warning: {counted} at this bound may hold more K/V than the "
                 f"{available / gib:.1f} GiB this machine has available (the out-of-memory killer may end a model "
                 "stub: it reloads, its requests in flight fail)")
    return note


CACHED_REPOSITORIES_KEPT = 4  # repositories `serve --engine` can reuse, kept beside the one in use (the newest used)
_held_locks: list = []  # this process's shared locks on the cached repositories it serves from, held until it exits


def _cached_name(engine: Path, manifest_bytes: bytes, recipe: str | None, instances: int, max_batch: int,
                 plain: bool, max_kv_tokens: int = 0) -> str:
    """The cache's directory name for these inputs: a hash of the engine's manifest and path, the options, this
    project's repository code and the models' inputs and outputs, so a rebuilt engine, a changed model.py or a new
    input never reuses an old repository."""
    import hashlib

    key = hashlib.sha256()
    for part in (manifest_bytes, str(engine).encode(), f"{instances}/{max_batch}/{plain}/{max_kv_tokens}".encode(),
                 TRITON_MODEL.read_bytes(), Path(__file__).read_bytes(), repr(INPUTS + OUTPUTS).encode()):
        key.update(hashlib.sha256(part).digest())
    return f"{(recipe or 'engine')[:40]}-{key.hexdigest()[:16]}"


def cached_repository(engine_dir, instances: int = 1, max_batch: int | None = None, plain: bool = False,
                      max_kv_tokens: int = 0) -> tuple[Path, dict[str, Any]]:
    """The model repository `serve --engine` runs and its marker: written on first use under `cache_dir()/repos/`,
    keyed by the engine's manifest, the options and this project's model code, then reused. Either way it is checked
    (`check_repository`, which hashes the engine) once here, and the marker that check returned goes to `serve`, which
    then does not hash the engine a second time.

    Each holds a full copy of its engine, so the cache is pruned whenever one is asked for: a repository no
    `serve --engine` would pick again (its engine rebuilt or gone, or written by other code) is removed, and of the
    reusable ones only the CACHED_REPOSITORIES_KEPT most recently used stay. A repository a running server uses
    (this process keeps a shared lock on it until it exits) is never removed."""
    import fcntl

    from dflash_export.files import cache_dir

    if engine_dir is None or not str(engine_dir).strip():
        raise DFlashError("empty path: name a built engine directory", field="--engine")
    engine = Path(engine_dir).expanduser().resolve()
    # Its fields name the repository; its files are hashed where they count: by `write_repository` before they are
    # copied, and in the copy by the check below (a reused repository serves its own checked copy).
    manifest = read_manifest(engine, verify_files=False)
    if max_batch is None:  # 8, or what a TensorRT engine's batched engines were built for when that is less
        backend = BACKENDS[manifest.backend]
        max_batch = min(8, backend.batch_bound(manifest) if backend.batch_bound else 8) if backend.batched else 1
    repos = cache_dir() / "repos"
    repo = repos / _cached_name(engine, (engine / "manifest.json").read_bytes(), manifest.recipe, instances,
                                max_batch, plain, max_kv_tokens)
    # Two `serve`s of one engine starting at once must not both write it: the second would rename the first's
    # repository away under its starting server. One writes under the write lock; the other waits, then reuses it.
    # The use lock, shared, is held from before the check until this process exits: pruning takes both, never
    # blocking, so it passes over a repository a server runs from or is about to.
    locks = repos.parent / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        use = open(locks / f"repo-{repo.name}.use", "a")
    except OSError as e:
        raise DFlashError(f"cannot write the model repository cache ({e.strerror or e}); set DFLASH_CACHE to a "
                          "writable directory", path=locks, field="--engine") from None
    try:
        fcntl.flock(use, fcntl.LOCK_SH)
        os.utime(use.fileno())  # last use, for the pruning below
        with open(locks / f"repo-{repo.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            marker = None
            if (repo / MARKER).is_file():
                try:
                    marker = check_repository(repo)
                except DFlashError:
                    pass  # stale or damaged: written again
            if marker is None:
                write_repository(engine, repo, instances=instances, max_batch=max_batch, plain=plain,
                                 max_kv_tokens=max_kv_tokens)
                marker = check_repository(repo)
    except OSError as e:
        use.close()
        raise DFlashError(f"cannot write the model repository cache ({e.strerror or e}); set DFLASH_CACHE to a "
                          "writable directory", path=locks, field="--engine") from None
    except BaseException:
        use.close()
        raise
    _held_locks.append(use)
    _prune_repository_cache(repos, locks, keep=repo)
    return repo, marker


def _prune_repository_cache(repos: Path, locks: Path, keep: Path) -> None:
    """Remove from `repos` what `cached_repository` would never reuse, and the reusable repositories past the
    CACHED_REPOSITORIES_KEPT most recently used. Only directories whose locks are free are touched (none in use or
    being written); a temporary directory is removed only when the process that wrote it is gone."""
    import fcntl
    import re
    from contextlib import ExitStack

    from dflash_export.files import remove_stale_temps

    reusable: list[tuple[float, Path]] = []  # (last use, repository) of those `cached_repository` could pick again

    def remove_if(d: Path, condition) -> None:
        with ExitStack() as held:
            try:
                for suffix in ("lock", "use"):
                    f = held.enter_context(open(locks / f"repo-{d.name}.{suffix}", "a"))
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # BlockingIOError: being written, served from, or about to be
                return
            if condition(d, f):
                _remove_tree(d)

    def dead(d: Path, use) -> bool:
        if _reusable(d):
            reusable.append((os.stat(use.fileno()).st_mtime, d))
            return False
        return True

    try:
        entries = sorted(repos.iterdir())
    except OSError:
        return
    for d in entries:
        if d == keep:
            continue
        m = re.match(r"^\.(.+)\.(?:tmp-\d+-.+|old-\d+)$", d.name)
        if m:  # left by a writer that was killed
            remove_stale_temps(repos / m.group(1))
            continue
        remove_if(d, dead)
    reusable.sort(reverse=True)
    for _, d in reusable[CACHED_REPOSITORIES_KEPT:]:
        remove_if(d, lambda d, use: True)


def _reusable(repo: Path) -> bool:
    """Whether `cached_repository` could pick `repo` again: its marker names an engine whose manifest, with the
    marker's options and this code, hashes to the directory's own name."""
    from dflash_export.files import read_cache_json

    try:
        marker = read_cache_json(repo / MARKER)
        engine = Path(marker["engine"])
        options = marker["instances"], marker["max_batch"], marker["plain"], marker.get("max_kv_tokens", 0)
        if not (isinstance(marker.get("recipe"), (str, type(None))) and all(type(o) is int for o in options[:2])
                and type(options[3]) is int
                and type(options[2]) is bool):
            return False
        return repo.name == _cached_name(engine, (engine / "manifest.json").read_bytes(), marker["recipe"], *options)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


def _remove_tree(d: Path) -> None:
    if d.is_symlink() or not d.is_dir():
        d.unlink(missing_ok=True)
    else:
        shutil.rmtree(d, ignore_errors=True)
