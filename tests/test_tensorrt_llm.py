"""The TensorRT-LLM bundle: every file it writes, checked on the tiny Qwen3 pair (no GPU, no tensorrt_llm needed)."""

import dataclasses
import importlib.util
import json
import shlex

import pytest
import torch
import yaml

from dflash_export.engines import tensorrt_llm as trtllm
from dflash_export.engines.manifest import read_manifest
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.models.checkpoint import read_drafter_checkpoint
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import TrtLlmOptions, load_recipe


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("tiny-qwen3")


@pytest.fixture(scope="module")
def bundle(recipe, tmp_path_factory):
    return trtllm.build_tensorrt_llm(recipe, tmp_path_factory.mktemp("trtllm") / "tiny-qwen3" / "tensorrt-llm")


def test_bundle_holds_the_documented_files_and_a_valid_manifest(bundle):
    for rel in ("drafter/config.json", "drafter/model.safetensors", trtllm.OPTIONS_FILE, trtllm.SERVE_FILE,
                trtllm.README_FILE, trtllm.TRITON_MODEL_YAML):
        assert (bundle / rel).is_file(), rel
    manifest = read_manifest(bundle)
    assert manifest.backend == "tensorrt-llm"
    assert manifest.block_size == 4 and manifest.max_draft_len == 3
    assert manifest.mask_token_id == 255 and manifest.target_layer_ids == (1, 3)
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind


def test_options_yaml_carries_the_dflash_speculative_config(bundle, recipe):
    options = yaml.safe_load((bundle / trtllm.OPTIONS_FILE).read_text())
    spec = options["speculative_config"]
    assert spec == {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": str(bundle / "drafter"),
                    "mask_token_id": 255, "target_layer_ids": [1, 3]}
    o = recipe.trtllm
    assert options["kv_cache_config"] == {"free_gpu_memory_fraction": o.kv_cache_free_gpu_memory_fraction}
    assert options["cuda_graph_config"] == {"batch_sizes": [1, 2, 4, 8], "enable_padding": True}
    assert options["max_batch_size"] == o.max_batch_size and options["max_num_tokens"] == o.max_num_tokens
    assert options["max_seq_len"] == recipe.max_seq_len and options["tensor_parallel_size"] == 1
    assert options["dtype"] == "float32"


def test_normalized_checkpoint_loads_back_with_the_same_weights(bundle, recipe):
    src_cfg, src_state = read_drafter_checkpoint(recipe.drafter_path)
    cfg, state = read_drafter_checkpoint(bundle / "drafter")
    assert cfg.block_size == src_cfg.block_size and cfg.mask_token_id == src_cfg.mask_token_id
    assert cfg.target_layer_ids == src_cfg.target_layer_ids
    assert set(state) == set(src_state)
    assert all(torch.equal(state[k], src_state[k]) for k in state)
    raw = json.loads((bundle / "drafter" / "config.json").read_text())
    # What TensorRT-LLM's DFlash loader reads: top-level block_size, explicit dflash_config, no `model.` prefix
    assert raw["block_size"] == 4 and raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["mask_token_id"] == 255 and raw["dflash_config"]["target_layer_ids"] == [1, 3]
    assert not any(k.startswith("model.") for k in state)


def test_serve_command_is_written_verbatim_in_script_readme_and_manifest(bundle, recipe):
    command = read_manifest(bundle).raw["serve_command"]
    target = str(resolve_source(recipe.target_path).resolve())
    assert command[:4] == ["trtllm-serve", target, "--backend", "pytorch"]
    flags = dict(zip(command[4::2], command[5::2]))
    assert flags["--extra_llm_api_options"] == str(bundle / trtllm.OPTIONS_FILE)
    assert flags["--max_batch_size"] == "8" and flags["--tp_size"] == "1" and flags["--host"] == "127.0.0.1"
    script = (bundle / trtllm.SERVE_FILE).read_text()
    assert script.startswith("#!/bin/sh") and "exec trtllm-serve " in script
    assert (bundle / trtllm.SERVE_FILE).stat().st_mode & 0o111
    readme = (bundle / trtllm.README_FILE).read_text()
    block = readme.split("```")[1]
    assert shlex.split(block.replace("\\\n", " ")) == command  # the README's command is the exact argv


def test_triton_llmapi_model_yaml_is_llm_arguments_plus_triton_config(bundle, recipe):
    model = yaml.safe_load((bundle / trtllm.TRITON_MODEL_YAML).read_text())
    assert model["model"] == str(resolve_source(recipe.target_path).resolve()) and model["backend"] == "pytorch"
    assert model["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert model["speculative_config"]["decoding_type"] == "DFlash"
    assert model["speculative_config"]["speculative_model"] == str(bundle / "drafter")


def test_unchanged_inputs_reuse_the_bundle(bundle, recipe):
    before = (bundle / "manifest.json").stat().st_mtime_ns
    assert trtllm.build_tensorrt_llm(recipe, bundle) == bundle
    assert (bundle / "manifest.json").stat().st_mtime_ns == before


def test_recipe_dtype_and_block_size_override_reach_weights_and_yaml(recipe, tmp_path):
    r = dataclasses.replace(recipe, dtype="bfloat16", block_size=3)
    out = trtllm.build_tensorrt_llm(r, tmp_path / "b")
    cfg, state = read_drafter_checkpoint(out / "drafter")
    assert cfg.block_size == 3 and {v.dtype for v in state.values()} == {torch.bfloat16}
    options = yaml.safe_load((out / trtllm.OPTIONS_FILE).read_text())
    assert options["speculative_config"]["max_draft_len"] == 2 and options["dtype"] == "bfloat16"


@pytest.mark.parametrize("options,field", [
    (TrtLlmOptions(max_batch_size=2, cuda_graph_batch_sizes=[1, 4]), "cuda_graph_batch_sizes"),
    (TrtLlmOptions(max_batch_size=8, max_num_tokens=16), "max_num_tokens"),
    (TrtLlmOptions(kv_cache_free_gpu_memory_fraction=1.5), "kv_cache_free_gpu_memory_fraction"),
])
def test_bad_trtllm_options_fail_naming_the_field_and_leave_nothing(recipe, tmp_path, options, field):
    with pytest.raises(DFlashError, match=field):
        trtllm.build_tensorrt_llm(dataclasses.replace(recipe, trtllm=options), tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_missing_drafter_is_a_dflash_error(recipe, tmp_path):
    with pytest.raises(DFlashError, match="not found"):
        trtllm.build_tensorrt_llm(dataclasses.replace(recipe, drafter=str(tmp_path / "nope")), tmp_path / "b")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed")
def test_llmapi_validation_without_tensorrt_llm_says_where_it_comes_from_and_the_gpu(bundle):
    """PyPI has no TensorRT-LLM >= 1.3, so the line points at NVIDIA's index, not at the extra."""
    with pytest.raises(MissingDependency, match=r"TensorRT-LLM >= 1\.3 from NVIDIA.*NVIDIA GPU"):
        trtllm.validate_with_llmapi(bundle, ["hello"])


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64), "layer_types"),
    (dict(is_causal=True), "is_causal"),
    (dict(output_multiplier=0.5), "dflash_config.output_multiplier"),
    (dict(final_logit_softcapping=30.0), "dflash_config.final_logit_softcapping"),
    (dict(input_embedding_scale=2.0), "dflash_config.input_embedding_scale"),
])
def test_zlab_keys_tensorrt_llm_would_run_differently_are_refused_by_name(recipe, change, field):
    """TensorRT-LLM's generic DFlash decodes every layer bidirectionally and reads no scales: a drafter that z-lab's
    release runs causal / windowed / scaled is refused, not bundled to run otherwise."""
    import dataclasses as dc

    config, _ = read_drafter_checkpoint(recipe.drafter_path)
    with pytest.raises(DFlashError) as e:
        trtllm.normalized_drafter_config(dc.replace(config, **change), "bfloat16", 4)
    assert e.value.field == field
    plain = trtllm.normalized_drafter_config(config, "float32", 4)
    assert "use_swa" not in plain["dflash_config"] and "use_sliding_window" not in plain and "is_causal" not in plain


# ----------------------------------------------------------------------------------------------------------------------
# The bundle's YAML against TensorRT-LLM's documented config schema, written down here as data (not from our writer).
# Sources (read 2026-12-01; field names, types and constraints only):
#   DFlashDecodingConfig  https://nvidia.github.io/TensorRT-LLM/llm-api/reference/DFlashDecodingConfig.html and
#                         tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig + DFlashDecodingConfig; StrictBaseModel:
#                         unknown keys are rejected)
#   TorchLlmArgs          https://nvidia.github.io/TensorRT-LLM/llm-api/reference/TorchLlmArgs.html
#   KvCacheConfig         https://nvidia.github.io/TensorRT-LLM/llm-api/reference/KvCacheConfig.html
#                         (free_gpu_memory_fraction: float in [0, 1])
#   DecodeCudaGraphConfig https://nvidia.github.io/TensorRT-LLM/llm-api/reference/DecodeCudaGraphConfig.html
#                         (max_batch_size, when given with batch_sizes, must equal max(batch_sizes))
#   Triton llmapi model   triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml (model, backend "pytorch",
#                         parallel sizes, triton_config {max_batch_size, decoupled}; other keys are LLM arguments)
#   DFlash worker         tensorrt_llm/_torch/speculative/dflash.py: a max_draft_len whose block exceeds the
#                         checkpoint's trained block_size is refused ("Lower max_draft_len"): max_draft_len <= bs - 1

_INT, _FLOAT, _STR, _BOOL = ("int",), ("float", "int"), ("str",), ("bool",)
DFLASH_DECODING_CONFIG = {
    "max_draft_len": (_INT, lambda v: v >= 0), "max_total_draft_tokens": (_INT, None),
    "speculative_model": (_STR, None), "speculative_model_dir": (_STR, None),
    "max_concurrency": (_INT, lambda v: v > 0), "draft_len_schedule": (("dict",), None), "load_format": (_STR, None),
    "acceptance_rate_window_size": (_INT, lambda v: v >= 0),
    "acceptance_rate_threshold": (_FLOAT, lambda v: 0.0 <= v <= 1.0),
    "use_rejection_sampling": (_BOOL, None), "allow_advanced_sampling": (_BOOL, None),
    "advanced_sampling_mode": (_STR, lambda v: v in ("full", "no_topk", "no_topp", "no_topk_no_topp")),
    "enable_penalty": (_BOOL, None), "mask_token_id": (_INT, None), "target_layer_ids": (("list",), None),
    "decoding_type": (_STR, lambda v: v == "DFlash"), "attention_backend": (_STR, lambda v: v in ("VANILLA", "TRTLLM")),
}
KV_CACHE_CONFIG = {"free_gpu_memory_fraction": (_FLOAT, lambda v: 0.0 <= v <= 1.0), "enable_block_reuse": (_BOOL, None),
                   "max_tokens": (_INT, None), "dtype": (_STR, None)}
CUDA_GRAPH_CONFIG = {"batch_sizes": (("list",), lambda v: all(isinstance(b, int) and b >= 1 for b in v)),
                     "max_batch_size": (_INT, lambda v: v >= 0), "enable_padding": (_BOOL, None),
                     "mode": (_STR, lambda v: v == "decode")}
TORCH_LLM_ARGS = {
    "model": (_STR, None), "backend": (_STR, lambda v: v == "pytorch"), "dtype": (_STR, lambda v: v in (
        "auto", "float16", "bfloat16", "float32")),
    "tensor_parallel_size": (_INT, lambda v: v >= 1), "pipeline_parallel_size": (_INT, lambda v: v >= 1),
    "max_batch_size": (_INT, lambda v: v >= 1), "max_num_tokens": (_INT, lambda v: v >= 1),
    "max_seq_len": (_INT, lambda v: v >= 1),
    "kv_cache_config": (("dict",), KV_CACHE_CONFIG), "cuda_graph_config": (("dict",), CUDA_GRAPH_CONFIG),
    "speculative_config": (("dict",), DFLASH_DECODING_CONFIG),
}
TRITON_MODEL_YAML = {**TORCH_LLM_ARGS, "triton_config": (("dict",), {"max_batch_size": (_INT, lambda v: v >= 0),
                                                                      "decoupled": (_BOOL, None)})}


def _schema_violations(obj: dict, schema: dict, where: str = "") -> list[str]:
    """Every key of `obj` that the documented schema does not have, or whose value has the wrong type or breaks the
    documented constraint (sub-dicts checked recursively)."""
    out = []
    for key, value in obj.items():
        path = f"{where}{key}"
        if key not in schema:
            out.append(f"{path}: not a documented field")
            continue
        types, rule = schema[key]
        if value is None:
            continue
        kind = type(value).__name__
        if kind not in types or (isinstance(value, bool) and "bool" not in types):
            out.append(f"{path}: {kind}, documented {types}")
        elif isinstance(rule, dict):
            out += _schema_violations(value, rule, path + ".")
        elif rule is not None and not rule(value):
            out.append(f"{path}: {value!r} breaks the documented constraint")
    return out


def _cross_field_violations(options: dict, drafter_cfg: dict, target_cfg: dict) -> list[str]:
    out = []
    spec, graphs = options["speculative_config"], options.get("cuda_graph_config") or {}
    if spec["max_draft_len"] > int(drafter_cfg["block_size"]) - 1:
        out.append("speculative_config.max_draft_len exceeds the drafter's block_size - 1")
    if not all(0 <= i < int(target_cfg["num_hidden_layers"]) for i in spec["target_layer_ids"]):
        out.append("speculative_config.target_layer_ids outside the target's layers")
    if "max_batch_size" in graphs and graphs.get("batch_sizes") and graphs["max_batch_size"] != max(
            graphs["batch_sizes"]):
        out.append("cuda_graph_config.max_batch_size != max(batch_sizes)")
    if graphs.get("batch_sizes") and max(graphs["batch_sizes"]) > options["max_batch_size"]:
        out.append("cuda_graph_config.batch_sizes beyond max_batch_size")
    return out


def test_options_yaml_fits_the_documented_trtllm_schema(bundle, recipe):
    options = yaml.safe_load((bundle / trtllm.OPTIONS_FILE).read_text())
    assert _schema_violations(options, TORCH_LLM_ARGS) == []
    drafter_cfg = json.loads((bundle / "drafter" / "config.json").read_text())
    target_cfg = json.loads((resolve_source(recipe.target_path) / "config.json").read_text())
    assert _cross_field_violations(options, drafter_cfg, target_cfg) == []
    assert (bundle / options["speculative_config"]["speculative_model"] / "config.json").is_file()
    model = yaml.safe_load((bundle / trtllm.TRITON_MODEL_YAML).read_text())
    assert _schema_violations(model, TRITON_MODEL_YAML) == []


@pytest.mark.parametrize("mutate,problem", [
    (lambda o: o["speculative_config"].update(block_size=4), "speculative_config.block_size: not a documented"),
    (lambda o: o["speculative_config"].update(decoding_type="dflash"), "decoding_type: 'dflash' breaks"),
    (lambda o: o["speculative_config"].update(max_draft_len="3"), "max_draft_len: str"),
    (lambda o: o["kv_cache_config"].update(free_gpu_memory_fraction=1.2), "free_gpu_memory_fraction: 1.2 breaks"),
    (lambda o: o.update(max_batch_size=True), "max_batch_size: bool"),
    (lambda o: o.update(cuda_graph_batch_sizes=[1]), "cuda_graph_batch_sizes: not a documented"),
])
def test_schema_check_catches_what_trtllm_would_reject(bundle, mutate, problem):
    """The check above has teeth: each mutation is one TensorRT-LLM's pydantic models refuse."""
    options = yaml.safe_load((bundle / trtllm.OPTIONS_FILE).read_text())
    mutate(options)
    assert any(problem in v for v in _schema_violations(options, TORCH_LLM_ARGS)), _schema_violations(
        options, TORCH_LLM_ARGS)


def test_cross_field_rules_catch_a_draft_longer_than_the_trained_block(bundle, recipe):
    options = yaml.safe_load((bundle / trtllm.OPTIONS_FILE).read_text())
    drafter_cfg = json.loads((bundle / "drafter" / "config.json").read_text())
    target_cfg = json.loads((resolve_source(recipe.target_path) / "config.json").read_text())
    options["speculative_config"]["max_draft_len"] = drafter_cfg["block_size"]
    options["cuda_graph_config"]["batch_sizes"] = [1, 2, 4, 8, 16]
    problems = _cross_field_violations(options, drafter_cfg, target_cfg)
    assert any("block_size - 1" in p for p in problems) and any("beyond max_batch_size" in p for p in problems)
