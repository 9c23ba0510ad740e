"""The TensorRT-LLM backend: a deployable bundle for TensorRT-LLM's PyTorch backend (`DFlashDecodingConfig`).

TensorRT-LLM (>= 1.3) runs DFlash itself, so nothing is compiled here: the bundle is what its LLM API and `trtllm-serve`
need, written atomically with a manifest:

    drafter/                 the drafter checkpoint normalized for TensorRT-LLM's DFlash loader
    llm_api_options.yaml     LLM-API options: speculative_config (decoding_type DFlash), KV cache, CUDA graphs
    serve.sh, README.md      the exact `trtllm-serve` command
    triton/tensorrt_llm/1/model.yaml   the Triton `llmapi` backend model config (for `deploy` to copy)
    manifest.json

Writing the bundle needs neither tensorrt_llm nor a GPU (tested everywhere); `validate_with_llmapi` needs both.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

from dflash_export.engines.base import check_transformers_tokenizer_files
from dflash_export.engines.manifest import MANIFEST, Manifest, hash_inputs, read_manifest, write_manifest
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.files import atomic_dir
from dflash_export.models.config import DFlashSpec
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import DTYPES, Recipe

BACKEND = "tensorrt-llm"
DRAFTER_DIR = "drafter"
OPTIONS_FILE = "llm_api_options.yaml"
SERVE_FILE = "serve.sh"
README_FILE = "README.md"
TRITON_MODEL_NAME = "tensorrt_llm"
TRITON_MODEL_YAML = f"triton/{TRITON_MODEL_NAME}/1/model.yaml"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
# PyPI's newest tensorrt-llm is 1.2.1 (`pip index versions tensorrt-llm`, 2026-12-03): >= 1.3 comes from NVIDIA.
INSTALL_HINT = ("bring TensorRT-LLM >= 1.3 from NVIDIA's package index or container (PyPI has none) on a machine "
                "with an NVIDIA GPU")


def _missing(what: str) -> MissingDependency:
    return MissingDependency(f"{what}: {INSTALL_HINT}", field="--backend tensorrt-llm")


# ----------------------------------------------------------------------------------------------------------------------
# Normalized drafter checkpoint

def normalized_drafter_config(config, dtype: str, block_size: int) -> dict[str, Any]:
    """The drafter `config.json` TensorRT-LLM's DFlash loader reads.

    Its loader takes the z-lab layout: `block_size` at the top level (read as an attribute of the HF config),
    `dflash_config.mask_token_id` / `.target_layer_ids` (written explicitly even when the source derived them),
    Qwen3 fields for the backbone it builds from `model_type`, and weights without a `model.` prefix.
    """
    _refuse_unsupported(config)
    cfg = config.to_dict()
    cfg["block_size"] = block_size
    cfg["dflash_config"] = {**cfg.get("dflash_config", {}), "block_size": block_size,
                            "mask_token_id": int(config.mask_token_id),
                            "target_layer_ids": [int(i) for i in config.target_layer_ids]}
    cfg["torch_dtype"] = dtype
    return cfg


def _refuse_unsupported(config) -> None:
    """z-lab 0.1.0's drafter keys TensorRT-LLM's DFlash does not reproduce, refused by name (never bundled to run
    differently): its generic block decode is non-causal on every layer, and the window it applies to
    `sliding_attention` layers (dflash_config.use_swa) is not z-lab's causal-within-the-window rule; it reads no
    embedding / logit scales."""
    if config.is_dflash2:
        raise DFlashError("DFlash 2 drafters are not bundled for TensorRT-LLM yet (its DFlash 2 loader is untested "
                          "here)", field="architectures")
    for i in range(config.num_hidden_layers):
        if config.layer_causal(i) or config.layer_window(i) is not None:
            field = "is_causal" if config.is_causal else "layer_types"
            raise DFlashError(f"layer {i} is {'causal' if config.layer_causal(i) else 'windowed'} (z-lab 0.1.0): "
                              "TensorRT-LLM's DFlash block attention would run it bidirectional / unwindowed; use "
                              "--backend onnxruntime", field=field)
    for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                          ("final_logit_softcapping", None)):
        if getattr(config, name) != default:
            raise DFlashError(f"{getattr(config, name)}: TensorRT-LLM's DFlash does not apply this scale; use "
                              "--backend onnxruntime", field=f"dflash_config.{name}")


def write_normalized_drafter(drafter_path, out: Path, dtype: str, block_size: int | None = None) -> dict[str, Any]:
    """Read + check a z-lab / ModelOpt drafter checkpoint and write it to `out` (config.json + model.safetensors)
    in `dtype`. Returns the written config. Bad checkpoints raise DFlashError naming the file and tensor."""
    import torch
    from safetensors.torch import save_file

    from dflash_export.models.checkpoint import read_drafter_checkpoint

    if dtype not in DTYPES:
        raise DFlashError(f"{dtype!r} is not one of {', '.join(DTYPES)}", field="dtype")
    config, state = read_drafter_checkpoint(drafter_path)
    cfg = normalized_drafter_config(config, dtype, DFlashSpec.resolve(config, block_size).block_size)
    torch_dtype = getattr(torch, dtype)
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in sorted(state.items())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return cfg


# ----------------------------------------------------------------------------------------------------------------------
# LLM-API options, serve command, Triton model

def _check_trtllm_options(recipe: Recipe, block_size: int) -> None:
    o = recipe.trtllm
    where = recipe.path
    for name in ("max_batch_size", "max_num_tokens", "tensor_parallel_size"):
        if getattr(o, name) < 1:
            raise DFlashError(f"must be >= 1, got {getattr(o, name)}", path=where, field=f"trtllm.{name}")
    if not 0.0 < o.kv_cache_free_gpu_memory_fraction <= 1.0:
        raise DFlashError(f"must be in (0, 1], got {o.kv_cache_free_gpu_memory_fraction}", path=where,
                          field="trtllm.kv_cache_free_gpu_memory_fraction")
    bad = [b for b in o.cuda_graph_batch_sizes if b < 1 or b > o.max_batch_size]
    if bad:
        raise DFlashError(f"batch sizes {bad} outside 1..max_batch_size ({o.max_batch_size})", path=where,
                          field="trtllm.cuda_graph_batch_sizes")
    # One verify step feeds max_draft_len + 1 tokens per sequence through the target.
    if o.max_num_tokens < o.max_batch_size * block_size:
        raise DFlashError(f"{o.max_num_tokens} < max_batch_size x block_size = {o.max_batch_size * block_size}",
                          path=where, field="trtllm.max_num_tokens")


def llm_api_options(recipe: Recipe, drafter_dir: Path, drafter_cfg: dict[str, Any]) -> dict[str, Any]:
    """The LLM-API keyword arguments (= `--extra_llm_api_options` YAML) for this recipe's DFlash deployment."""
    o = recipe.trtllm
    dcfg = drafter_cfg["dflash_config"]
    return {
        "dtype": recipe.dtype,
        "max_batch_size": o.max_batch_size,
        "max_num_tokens": o.max_num_tokens,
        "max_seq_len": recipe.max_seq_len,
        "tensor_parallel_size": o.tensor_parallel_size,
        "kv_cache_config": {"free_gpu_memory_fraction": o.kv_cache_free_gpu_memory_fraction},
        "cuda_graph_config": {"batch_sizes": sorted(set(o.cuda_graph_batch_sizes)), "enable_padding": True},
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": int(drafter_cfg["block_size"]) - 1,
            "speculative_model": str(drafter_dir),
            "mask_token_id": int(dcfg["mask_token_id"]),
            "target_layer_ids": [int(i) for i in dcfg["target_layer_ids"]],
        },
    }


def serve_command(target_dir: Path, options_file: Path, recipe: Recipe, host: str = DEFAULT_HOST,
                  port: int = DEFAULT_PORT) -> list[str]:
    """argv of `trtllm-serve` for the bundle. Sizes are given as flags too: they take precedence over the YAML in
    every trtllm-serve version, so the server never silently runs with its own defaults."""
    o = recipe.trtllm
    return ["trtllm-serve", str(target_dir), "--backend", "pytorch", "--host", host, "--port", str(port),
            "--max_batch_size", str(o.max_batch_size), "--max_num_tokens", str(o.max_num_tokens),
            "--max_seq_len", str(recipe.max_seq_len), "--tp_size", str(o.tensor_parallel_size),
            "--kv_cache_free_gpu_memory_fraction", str(o.kv_cache_free_gpu_memory_fraction),
            "--extra_llm_api_options", str(options_file)]


def triton_llmapi_model_yaml(target_dir: Path, options: dict[str, Any], decoupled: bool = True) -> dict[str, Any]:
    """model.yaml of Triton's TensorRT-LLM `llmapi` model: every key but `triton_config` becomes an `LLM(...)` argument.

    `deploy` copies it next to the llmapi model.py / config.pbtxt that ship with TensorRT-LLM's Triton backend;
    decoupled = streaming responses. Triton-side batching stays off (max_batch_size 0): the LLM API batches in flight.
    """
    return {"model": str(target_dir), "backend": "pytorch", **options, "pipeline_parallel_size": 1,
            "triton_config": {"max_batch_size": 0, "decoupled": decoupled}}


def _readme(recipe: Recipe, command: list[str], options: dict[str, Any]) -> str:
    spec = options["speculative_config"]
    # program + model on the first line, then one `--flag value` pair per line
    q = [shlex.quote(a) for a in command]
    cmd = " \\\n    ".join([" ".join(q[:2])] + [" ".join(q[i:i + 2]) for i in range(2, len(q), 2)])
    return f"""# {recipe.name}: TensorRT-LLM DFlash bundle

Written by `dflash-export build --backend tensorrt-llm`. Needs TensorRT-LLM >= 1.3 (PyTorch backend) and an NVIDIA GPU.

Serve (OpenAI-compatible HTTP on {DEFAULT_HOST}:{DEFAULT_PORT}; `serve.sh` runs exactly this):

```
{cmd}
```

- drafter: `{DRAFTER_DIR}/` (normalized z-lab checkpoint: block_size {spec['max_draft_len'] + 1},
  mask_token_id {spec['mask_token_id']}, target_layer_ids {spec['target_layer_ids']})
- LLM-API options: `{OPTIONS_FILE}` (`speculative_config.decoding_type: DFlash`, max_draft_len {spec['max_draft_len']})
- Triton: `{TRITON_MODEL_YAML}` is the `model.yaml` of TensorRT-LLM's `llmapi` Triton model
  (`dflash-export deploy` copies it).

Paths inside the YAML files are absolute: after moving this directory, rebuild it (or edit `speculative_model`).
"""


# ----------------------------------------------------------------------------------------------------------------------
# The bundle

def _input_hashes(drafter_dir: Path, target_dir: Path) -> dict[str, str]:
    """Identity of the inputs: every drafter file, and the target's JSON / tokenizer files. The target's weights are
    referenced, not copied, so they are not read here (hashing 16 GB on every build would dominate it)."""
    out = hash_inputs([drafter_dir])
    small = [p for p in sorted(target_dir.iterdir()) if p.is_file() and p.suffix in (".json", ".model", ".txt")]
    out.update(hash_inputs(small))
    return out


def write_trtllm_bundle(recipe: Recipe, out_dir) -> Path:
    """Write the TensorRT-LLM bundle for `recipe` to `out_dir` atomically; returns `out_dir`.

    An existing bundle whose manifest records the same inputs and options is reused as is. The target must be (or
    convert to) an HF checkpoint directory: TensorRT-LLM loads it by path.
    """
    from dflash_export.models.target import resolve_target_dir

    out_dir = Path(out_dir).resolve()
    target_dir = resolve_target_dir(recipe.target_path).resolve()
    drafter_src = resolve_source(recipe.drafter_path)
    if not drafter_src.is_dir():
        raise DFlashError("drafter checkpoint directory not found", path=drafter_src)
    drafter_src = drafter_src.resolve()
    check_transformers_tokenizer_files(target_dir)  # what TensorRT-LLM will serve, named before anything is written
    inputs = _input_hashes(drafter_src, target_dir)
    build_key = hashlib.sha256(json.dumps({"inputs": inputs, "recipe": _recipe_fingerprint(recipe),
                                           "out": str(out_dir)}, sort_keys=True).encode()).hexdigest()
    if (out_dir / MANIFEST).is_file():
        try:
            if read_manifest(out_dir).build_key == build_key:
                return out_dir
        except DFlashError:
            pass  # stale or damaged: rebuild

    with atomic_dir(out_dir, what="the engine") as tmp:
        drafter_cfg = write_normalized_drafter(drafter_src, tmp / DRAFTER_DIR, recipe.dtype, recipe.block_size)
        block_size = int(drafter_cfg["block_size"])
        _check_trtllm_options(recipe, block_size)
        # Paths point at the final location: the temp dir is renamed onto out_dir on success.
        options = llm_api_options(recipe, out_dir / DRAFTER_DIR, drafter_cfg)
        _write_yaml(tmp / OPTIONS_FILE, options, f"LLM-API options for {recipe.name} (trtllm-serve "
                                                 f"--extra_llm_api_options / LLM(**options))")
        command = serve_command(target_dir, out_dir / OPTIONS_FILE, recipe)
        serve = tmp / SERVE_FILE
        serve.write_text("#!/bin/sh\n# Serve the DFlash bundle with TensorRT-LLM (needs an NVIDIA GPU).\nexec "
                         + " ".join(shlex.quote(a) for a in command) + ' "$@"\n', encoding="utf-8")
        serve.chmod(0o755)
        (tmp / README_FILE).write_text(_readme(recipe, command, options), encoding="utf-8")
        model_yaml = tmp / TRITON_MODEL_YAML
        model_yaml.parent.mkdir(parents=True)
        _write_yaml(model_yaml, triton_llmapi_model_yaml(target_dir, options),
                    "Triton llmapi model config; keys other than triton_config are LLM(...) arguments")
        spec = options["speculative_config"]
        write_manifest(tmp, {
            "backend": BACKEND, "recipe": recipe.name, "build_key": build_key,
            "block_size": block_size, "max_draft_len": spec["max_draft_len"],
            "mask_token_id": spec["mask_token_id"], "target_layer_ids": spec["target_layer_ids"],
            "dtypes": {"weights": recipe.dtype}, "target": str(target_dir), "drafter_source": str(drafter_src),
            "inputs": inputs, "serve_command": command,
            "build_flags": {"trtllm": _recipe_fingerprint(recipe)["trtllm"], "max_seq_len": recipe.max_seq_len},
        })
    return out_dir


def _recipe_fingerprint(recipe: Recipe) -> dict[str, Any]:
    import dataclasses

    return {"name": recipe.name, "dtype": recipe.dtype, "block_size": recipe.block_size,
            "max_seq_len": recipe.max_seq_len, "trtllm": dataclasses.asdict(recipe.trtllm)}


def _write_yaml(path: Path, data: dict[str, Any], comment: str) -> None:
    import yaml

    text = f"# {comment}\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    path.write_text(text, encoding="utf-8")


def build_tensorrt_llm(recipe: Recipe, out_dir) -> Path:
    """`build --backend tensorrt-llm`: write the TensorRT-LLM bundle (see module docstring) to `out_dir`.

    Runs anywhere (no GPU, no tensorrt_llm needed); returns the bundle directory.
    """
    return write_trtllm_bundle(recipe, out_dir)


# ----------------------------------------------------------------------------------------------------------------------
# Validation through the LLM API (GPU + tensorrt_llm only)

def read_bundle(bundle) -> tuple[Manifest, dict[str, Any]]:
    """(manifest, LLM-API options) of a bundle, with its files checked against the manifest hashes."""
    import yaml

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    if manifest.backend != BACKEND:
        raise DFlashError(f"not a TensorRT-LLM bundle (backend {manifest.backend!r})", path=bundle)
    return manifest, yaml.safe_load((bundle / OPTIONS_FILE).read_text(encoding="utf-8"))


def _llm_kwargs(options: dict[str, Any], with_speculation: bool) -> dict[str, Any]:
    """Typed LLM-API objects from the YAML options (the LLM constructor wants config objects, not dicts)."""
    from tensorrt_llm.llmapi import CudaGraphConfig, DFlashDecodingConfig, KvCacheConfig

    kw = {k: v for k, v in options.items() if k not in ("kv_cache_config", "cuda_graph_config", "speculative_config")}
    kw["kv_cache_config"] = KvCacheConfig(**options["kv_cache_config"])
    kw["cuda_graph_config"] = CudaGraphConfig(**options["cuda_graph_config"])
    if with_speculation:
        spec = {k: v for k, v in options["speculative_config"].items() if k != "decoding_type"}
        kw["speculative_config"] = DFlashDecodingConfig(**spec)
    return kw


def validate_with_llmapi(bundle, prompts: list[str], max_new_tokens: int = 128) -> dict[str, Any]:
    """Greedy DFlash vs plain autoregressive generation through TensorRT-LLM's LLM API on the bundle's target.

    Returns {"identical_fraction", "first_divergence" (per prompt, -1 = identical), "dflash_tok_s", "ar_tok_s",
    "speedup", "n_prompts"}. The two runs use separate LLM instances, one after the other (one GPU's memory).
    Needs tensorrt_llm and an NVIDIA GPU (MissingDependency otherwise).
    """
    import importlib.util
    import time

    if importlib.util.find_spec("tensorrt_llm") is None:
        raise _missing("tensorrt_llm is not installed")
    import torch

    if not torch.cuda.is_available():
        raise _missing("no CUDA device visible")
    if not prompts:
        raise DFlashError("no prompts to validate with", field="prompts")
    from tensorrt_llm import LLM, SamplingParams

    manifest, options = read_bundle(bundle)
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)

    def run(with_speculation: bool) -> tuple[list[list[int]], float]:
        llm = LLM(model=manifest.require("target"), **_llm_kwargs(options, with_speculation))
        try:
            llm.generate(prompts[:1], sampling)  # warm-up: CUDA graphs and autotuning are not measured
            start = time.perf_counter()
            outs = llm.generate(prompts, sampling)
            elapsed = time.perf_counter() - start
        finally:
            llm.shutdown()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, sum(len(t) for t in tokens) / max(elapsed, 1e-9)

    spec_tokens, spec_rate = run(True)
    ar_tokens, ar_rate = run(False)
    divergence = []
    for a, b in zip(spec_tokens, ar_tokens):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)
        if first == -1 and len(a) != len(b):
            first = min(len(a), len(b))
        divergence.append(first)
    return {"n_prompts": len(prompts), "identical_fraction": sum(d == -1 for d in divergence) / len(prompts),
            "first_divergence": divergence, "dflash_tok_s": spec_rate, "ar_tok_s": ar_rate,
            "speedup": spec_rate / max(ar_rate, 1e-9)}
