"""A target's config.json is checked before transformers reads it: its sizes, its dtype, and its agreement with the
weights' safetensors headers. Each defect is one line naming the file and the field or tensor, from `inspect` and from
the loader every stage uses; that the weights disagree with the config is judged by transformers' own loading report."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dflash_export.cli import main
from dflash_export.errors import DFlashError
from dflash_export.models.sources import resolve_source

FAMILIES = ("qwen3", "llama", "gpt-oss", "qwen3-moe", "qwen3.5", "qwen3.5-moe", "qwen3-next")


def _target(tmp_path, family="qwen3") -> Path:
    target = tmp_path / "target"
    shutil.copytree(resolve_source(f"tiny:{family}/target"), target)
    return target


def _edit(target: Path, fn) -> None:
    cfg = json.loads((target / "config.json").read_text())
    fn(cfg.get("text_config", cfg), cfg)
    (target / "config.json").write_text(json.dumps(cfg))


def _errors(target: Path, family: str) -> list[str]:
    """`inspect`'s error lines about the target's own files (exit 2)."""
    r = CliRunner().invoke(main, ["inspect", f"tiny:{family}/drafter", "--target", str(target)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    return [ln for ln in r.output.splitlines() if ln.startswith(f"error: {target}")]


def _refused(target: Path, family: str, file: str, field: str) -> DFlashError:
    """inspect names `file`: `field`, and so does the loader every stage goes through."""
    from dflash_export.models import load_target

    assert any(ln.startswith(f"error: {target / file}: {field}: ") for ln in _errors(target, family)), field
    with pytest.raises(DFlashError) as e:
        load_target(target)
    assert (e.value.path, e.value.field) == (target / file, field), e.value
    return e.value


@pytest.mark.parametrize("field, value", [
    ("max_position_embeddings", 0), ("max_position_embeddings", -1), ("num_attention_heads", 0),
    ("num_key_value_heads", 3), ("head_dim", True), ("intermediate_size", -128),
])
def test_a_target_size_that_is_not_a_positive_integer_its_attention_can_use_is_named(tmp_path, field, value):
    # num_key_value_heads 3 does not divide the 4 query heads: grouped-query attention shares each K/V head by a group
    target = _target(tmp_path)
    _edit(target, lambda text, cfg: text.__setitem__(field, value))
    _refused(target, "qwen3", "config.json", field)


def test_a_composite_targets_bad_size_is_named_under_text_config(tmp_path):
    target = _target(tmp_path, "qwen3.5")
    _edit(target, lambda text, cfg: text.__setitem__("max_position_embeddings", -1))
    _refused(target, "qwen3.5", "config.json", "text_config.max_position_embeddings")


@pytest.mark.parametrize("family, key, value", [
    ("qwen3", "torch_dtype", "nonsense"), ("qwen3", "dtype", "int8"), ("qwen3", "torch_dtype", 16),
    ("qwen3.5", "text_config.dtype", "nonsense"),
])
def test_a_target_dtype_that_is_not_a_float_dtype_is_named(tmp_path, family, key, value):
    import torch
    from transformers import AutoConfig

    target = _target(tmp_path, family)
    *under, name = key.split(".")
    def declare(text, cfg):
        where = text if under else cfg
        where.pop("dtype", None), where.pop("torch_dtype", None)
        where[name] = value

    _edit(target, declare)
    try:  # transformers itself: an error, or something that is not a floating-point torch dtype
        hf = AutoConfig.from_pretrained(str(target))
        declared = (hf.get_text_config() if under else hf).dtype
    except Exception:
        declared = None
    assert not (isinstance(declared, torch.dtype) and declared.is_floating_point)
    _refused(target, family, "config.json", key)


def _transformers_complaints(target: Path) -> set[str]:
    """The tensors transformers' own loading report names (missing, unexpected or of the wrong shape), under the names
    of the checkpoint's files (a composite checkpoint's `model.language_model.` prefix put back)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_export.models.hfutil import quiet_transformers

    quiet_transformers()
    _, info = AutoModelForCausalLM.from_pretrained(str(target), output_loading_info=True, ignore_mismatched_sizes=True)
    names = set(info["missing_keys"]) | set(info["unexpected_keys"]) | {k[0] for k in info["mismatched_keys"]}
    if AutoConfig.from_pretrained(str(target)).model_type in ("qwen3_5", "qwen3_5_moe"):
        names = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n for n in names}
    return names


def _layers(n):
    def edit(text, cfg):
        text["layer_types"] = (text["layer_types"] * 3)[:n]
        text["num_hidden_layers"] = n
    return edit


def _drop_lm_head(target):
    sd = load_file(str(target / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})


# (family, config edit or weights edit, the tensor inspect names or None for num_hidden_layers)
DISAGREEMENTS = {
    "hidden_size": ("qwen3", lambda t, c: t.update(hidden_size=32), "model.embed_tokens.weight"),
    "vocab_size": ("qwen3", lambda t, c: t.update(vocab_size=300), "model.embed_tokens.weight"),
    "more_layers": ("qwen3", _layers(8), None),
    "fewer_layers": ("qwen3", _layers(4), None),
    "kv_heads": ("qwen3", lambda t, c: t.update(num_key_value_heads=4), "model.layers.0.self_attn.k_proj.weight"),
    "query_heads": ("qwen3-moe", lambda t, c: t.update(num_attention_heads=8),
                    "model.layers.0.self_attn.q_proj.weight"),
    "head_dim": ("gpt-oss", lambda t, c: t.update(head_dim=8), "model.layers.0.self_attn.q_proj.weight"),
    "llama_head_dim": ("llama", lambda t, c: t.update(head_dim=32), "model.layers.0.self_attn.q_proj.weight"),
    "untied_head_missing": ("qwen3", "drop_lm_head", "lm_head.weight"),
    "composite_vocab": ("qwen3.5", lambda t, c: t.update(vocab_size=300), "model.language_model.embed_tokens.weight"),
    "composite_layers": ("qwen3.5-moe", _layers(4), None),
    "hybrid_layers": ("qwen3-next", _layers(8), None),
    "hybrid_hidden": ("qwen3-next", lambda t, c: t.update(hidden_size=32), "model.embed_tokens.weight"),
}


@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_a_config_that_disagrees_with_its_weights_is_named_before_transformers_loads(tmp_path, case):
    family, edit, tensor = DISAGREEMENTS[case]
    target = _target(tmp_path, family)
    if edit == "drop_lm_head":
        _drop_lm_head(target)
    else:
        _edit(target, edit)
    complaints = _transformers_complaints(target)
    assert complaints  # transformers would load something the config does not describe, or fail
    if tensor is None:
        n = json.loads((target / "config.json").read_text())
        n = n.get("text_config", n)["num_hidden_layers"]
        e = _refused(target, family, "config.json", "num_hidden_layers")
        layers = {int(c.split("layers.")[1].split(".")[0]) for c in complaints}
        assert all((i >= n) == ("also hold" in e.message) for i in layers), (layers, e.message)
        assert f"N = {min(layers)}..{max(layers)}" in e.message
    else:
        assert tensor in complaints, sorted(complaints)[:5]
        # a tensor of the wrong shape is named in its file, an absent one in the model directory
        _refused(target, family, "model.safetensors" if case != "untied_head_missing" else "", tensor)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_that_fit_their_config_pass_in_every_family(tmp_path, family):
    from dflash_export.models.target import read_target_config, target_weight_problems

    target = resolve_source(f"tiny:{family}/target")
    assert not _transformers_complaints(target)
    cfg, cfg_path = read_target_config(target)
    assert target_weight_problems(target, cfg, cfg_path) == []


def test_a_llama_config_without_head_dim_takes_transformers_default(tmp_path):
    # LLaMA's head_dim defaults to hidden_size / num_attention_heads (16 here, what the weights hold)
    from dflash_export.models import load_target

    target = _target(tmp_path, "llama")
    _edit(target, lambda text, cfg: text.pop("head_dim"))
    assert not _transformers_complaints(target)
    assert load_target(target).hidden_size == 64
