"""A target's config.json is checked before transformers reads it: its sizes, its dtype, its layer settings, and its
agreement with the weights' safetensors headers, in every family (hybrid and MoE targets included). Each defect is one
line naming the file and the field or tensor, from `inspect`, from the loader every stage uses and from `export` /
`build` (exit 2, nothing written); that the weights disagree with the config is judged by transformers' own loading
report."""

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


def _export_refused(target: Path, family: str, file: str, field: str | None) -> str:
    """`export` of the target with its tiny drafter: exit 2, one error line naming `file`: `field` (`field` None:
    the file alone), no traceback, and nothing left where the export was to go. Returns the line."""
    out = target.parent / "exported"
    r = CliRunner().invoke(main, ["export", "--target", str(target), "--drafter", f"tiny:{family}/drafter",
                                  "--out", str(out)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {target / file}: " + (f"{field}: " if field else "")), errors[0]
    assert not out.exists()
    return errors[0]


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


@pytest.mark.parametrize("family, key", [("qwen3", "num_hidden_layers"), ("qwen3-moe", "num_local_experts")])
def test_a_layer_or_expert_count_past_the_limit_is_refused_before_anything_is_built_for_each(tmp_path, family, key):
    """10**9 layers or experts: transformers' config class would build a list of 10**9 layer kinds, the weight checks
    an entry per layer and expert (gigabytes, minutes); refused at once, naming the key."""
    from dflash_export.models.config import MAX_EXPERTS, MAX_LAYERS

    target = _target(tmp_path, family)
    _edit(target, lambda t, c: (t.update({key: 10**9}), t.pop("layer_types", None)))
    e = _refused(target, family, "config.json", key)
    what = "layers" if key == "num_hidden_layers" else "experts"
    limit = MAX_LAYERS if key == "num_hidden_layers" else MAX_EXPERTS
    assert e.message == f"1000000000 {what}: more than the {limit} this project reads", e.message
    _export_refused(target, family, "config.json", key)


@pytest.mark.parametrize("family, key, bound", [
    ("qwen3", "max_position_embeddings", 1 << 24), ("qwen3", "hidden_size", 1 << 20), ("qwen3", "head_dim", 1 << 20),
    ("qwen3", "intermediate_size", 1 << 20), ("qwen3", "num_attention_heads", 1 << 12),
    ("qwen3", "vocab_size", 1 << 22), ("qwen3-moe", "moe_intermediate_size", 1 << 20),
    ("qwen3-next", "linear_key_head_dim", 1 << 20), ("qwen3.5", "text_config.max_position_embeddings", 1 << 24),
])
def test_a_size_past_its_bound_is_refused_by_its_own_key(tmp_path, family, key, bound):
    """2**40: a context no tensor's shape checks, or a width the weights' shapes would be held against only after
    the settings derived from it: one line naming config.json and the key, from inspect, the loader and export."""
    target = _target(tmp_path, family)
    _edit(target, lambda text, cfg: text.update({key.removeprefix("text_config."): 2 ** 40}))
    e = _refused(target, family, "config.json", key)
    assert e.message == f"1099511627776: more than the {bound} this project reads", e.message
    _export_refused(target, family, "config.json", key)


@pytest.mark.parametrize("value, says", [
    (2 ** 40, "1099511627776: more than the 16777216 this project reads"),
    (10 ** 400, "100000000000...000000 (401 digits): more than the 16777216 this project reads"),
], ids=["2**40", "10**400"])
def test_a_yarn_original_context_past_the_bound_is_named(tmp_path, value, says):
    """YaRN's original context, which transformers divides by as a float (10**400 has no float), bounded as the
    context itself is."""
    target = _target(tmp_path)
    _edit(target, lambda text, cfg: text.update(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": value, "rope_theta": 10000.0}))
    e = _refused(target, "qwen3", "config.json", "rope_parameters.original_max_position_embeddings")
    assert e.message == says, e.message


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


def _transformers_objects(target: Path) -> bool:
    """Whether transformers' loading reports a tensor missing, unexpected or misshapen, or fails outright (experts
    it cannot stack into its own layout)."""
    try:
        return bool(_transformers_complaints(target))
    except RuntimeError:
        return True


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
    "conv_kernel": ("qwen3.5", lambda t, c: t.update(linear_conv_kernel_dim=3),
                    "model.language_model.layers.0.linear_attn.conv1d.weight"),
    "value_heads": ("qwen3-next", lambda t, c: t.update(linear_num_value_heads=8),
                    "model.layers.0.linear_attn.conv1d.weight"),
    "key_head_dim": ("qwen3-next", lambda t, c: t.update(linear_key_head_dim=8),
                     "model.layers.0.linear_attn.conv1d.weight"),
    "gated_query_heads": ("qwen3.5", lambda t, c: t.update(num_attention_heads=8),
                          "model.language_model.layers.2.self_attn.q_proj.weight"),
    "router_rows": ("gpt-oss", lambda t, c: t.update(num_local_experts=4), "model.layers.0.mlp.router.weight"),
    "expert_width": ("gpt-oss", lambda t, c: t.update(intermediate_size=16), "model.layers.0.mlp.experts.gate_up_proj"),
    "experts": ("qwen3-moe", lambda t, c: t.update(num_local_experts=4), "model.layers.0.mlp.gate.weight"),
    "shared_expert": ("qwen3-next", lambda t, c: t.update(shared_expert_intermediate_size=16),
                      "model.layers.0.mlp.shared_expert.gate_proj.weight"),
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
        field = "text_config.num_hidden_layers" if "text_config" in n else "num_hidden_layers"  # as config.json has it
        n = n.get("text_config", n)["num_hidden_layers"]
        e = _refused(target, family, "config.json", field)
        _export_refused(target, family, "config.json", field)
        layers = {int(c.split("layers.")[1].split(".")[0]) for c in complaints}
        assert all((i >= n) == ("also hold" in e.message) for i in layers), (layers, e.message)
        assert f"N = {min(layers)}..{max(layers)}" in e.message
    else:
        assert tensor in complaints, sorted(complaints)[:5]
        # a tensor of the wrong shape is named in its file, an absent one in the model directory
        file = "model.safetensors" if case != "untied_head_missing" else ""
        _refused(target, family, file, tensor)
        _export_refused(target, family, file, tensor)


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


def _edit_weights(target: Path, fn) -> None:
    """`fn(state, prefix)` on the target's tensors, `prefix` the decoder's ("model." or a composite checkpoint's
    "model.language_model.")."""
    sd = load_file(str(target / "model.safetensors"))
    fn(sd, "model.language_model." if "model.language_model.embed_tokens.weight" in sd else "model.")
    save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})


def _decoder(family: str) -> str:
    return "model.language_model." if family in ("qwen3.5", "qwen3.5-moe") else "model."


@pytest.mark.parametrize("family, tensor", [
    *[("qwen3.5", f"layers.0.linear_attn.{n}") for n in (
        "conv1d.weight", "A_log", "dt_bias", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
        "in_proj_a.weight", "norm.weight", "out_proj.weight")],
    ("qwen3.5", "layers.2.self_attn.q_norm.weight"), ("qwen3.5", "layers.1.mlp.up_proj.weight"),
    ("qwen3-next", "layers.3.linear_attn.in_proj_qkvz.weight"),
    ("qwen3-next", "layers.0.linear_attn.in_proj_ba.weight"),
    ("qwen3-next", "layers.0.mlp.experts.3.up_proj.weight"), ("qwen3-next", "layers.1.mlp.shared_expert_gate.weight"),
    ("qwen3-next", "norm.weight"), ("qwen3.5-moe", "layers.1.mlp.experts.0.down_proj.weight"),
    ("qwen3-moe", "layers.0.mlp.gate.weight"), ("qwen3-moe", "layers.1.self_attn.k_norm.weight"),
    ("gpt-oss", "layers.0.self_attn.sinks"), ("gpt-oss", "layers.0.mlp.router.bias"),
    ("gpt-oss", "layers.1.mlp.experts.down_proj_bias"), ("gpt-oss", "layers.1.self_attn.q_proj.bias"),
])
def test_a_missing_layer_tensor_is_named_before_transformers_makes_one_up(tmp_path, family, tensor):
    """transformers loads a checkpoint that lacks one of its tensors and initializes it afresh (the export then runs
    on made-up weights), or fails with its own text (an expert missing from a stack): refused instead, the tensor
    named in the model directory."""
    target = _target(tmp_path, family)
    _edit_weights(target, lambda sd, prefix: sd.pop(prefix + tensor))
    assert _transformers_objects(target)
    name = _decoder(family) + tensor
    assert "transformers would initialize it afresh" in _refused(target, family, "", name).message
    _export_refused(target, family, "", name)


@pytest.mark.parametrize("family, tensor, shape", [
    ("qwen3.5", "layers.0.linear_attn.conv1d.weight", (96, 1, 3)),
    ("qwen3-next", "layers.0.linear_attn.in_proj_qkvz.weight", (96, 64)),
    ("qwen3-next", "layers.4.linear_attn.A_log", (2,)),
    ("qwen3-moe", "layers.1.mlp.experts.7.down_proj.weight", (64, 16)),
])
def test_a_tensor_whose_shape_disagrees_with_config_is_named_in_its_file(tmp_path, family, tensor, shape):
    import torch

    target = _target(tmp_path, family)
    _edit_weights(target, lambda sd, prefix: sd.__setitem__(prefix + tensor, torch.zeros(shape)))
    assert _transformers_objects(target)
    e = _refused(target, family, "model.safetensors", _decoder(family) + tensor)
    assert f"shape {list(shape)} != " in e.message and "config.json" in e.message
    _export_refused(target, family, "model.safetensors", _decoder(family) + tensor)


def _layer_kinds(kinds):
    return lambda text, cfg: text.update(layer_types=kinds)


# (family, config edit, the field named in config.json)
LAYER_SETTINGS = {
    "layer_types_short": ("qwen3.5", _layer_kinds(["linear_attention", "full_attention"] * 2 + ["linear_attention"]),
                          "text_config.layer_types"),
    "layer_types_long": ("qwen3-next", _layer_kinds(["linear_attention", "linear_attention", "full_attention"] * 3),
                         "layer_types"),
    "layer_kind_unbuilt": ("qwen3-next", _layer_kinds(["linear_attention", "sliding_attention", "full_attention"] * 2),
                           "layer_types"),
    "gpt_oss_layer_kind": ("gpt-oss", _layer_kinds(["sliding_attention", "linear_attention"] * 2), "layer_types"),
    "interval_zero": ("qwen3.5", lambda t, c: (t.pop("layer_types"), t.update(full_attention_interval=0)),
                      "text_config.full_attention_interval"),
    "value_heads_grouping": ("qwen3-next", lambda t, c: t.update(linear_num_value_heads=3), "linear_num_value_heads"),
    "top_k_over_experts": ("qwen3-moe", lambda t, c: t.update(num_experts_per_tok=9), "num_experts_per_tok"),
    "top_k_over_experts_hybrid": ("qwen3.5-moe", lambda t, c: t.update(num_experts_per_tok=9),
                                  "text_config.num_experts_per_tok"),
    "top_k_over_experts_gpt_oss": ("gpt-oss", lambda t, c: t.update(num_experts_per_tok=9), "num_experts_per_tok"),
    "top_k_zero": ("qwen3-next", lambda t, c: t.update(num_experts_per_tok=0), "num_experts_per_tok"),
    "sparse_step_zero": ("qwen3-moe", lambda t, c: t.update(decoder_sparse_step=0), "decoder_sparse_step"),
    "activation": ("qwen3-next", lambda t, c: t.update(hidden_act="gelu"), "hidden_act"),
    "hybrid_attention_bias": ("qwen3.5", lambda t, c: t.update(attention_bias=True), "text_config.attention_bias"),
    "no_window": ("gpt-oss", lambda t, c: t.update(sliding_window=0), "sliding_window"),
    "window_past_int64": ("gpt-oss", lambda t, c: t.update(sliding_window=2 ** 70), "sliding_window"),
    "swiglu_limit": ("gpt-oss", lambda t, c: t.update(swiglu_limit=-1.0), "swiglu_limit"),
    "expert_count_spelled_twice": ("qwen3-moe", lambda t, c: t.update(num_experts=4), "num_experts"),
    # values transformers' config class rejects: named by their key (under text_config in a composite checkpoint)
    "linear_heads_null": ("qwen3-next", lambda t, c: t.update(linear_num_key_heads=None), "linear_num_key_heads"),
    "experts_null_composite": ("qwen3.5-moe", lambda t, c: t.update(num_experts=None), "text_config.num_experts"),
    "router_normalization_text": ("qwen3-moe", lambda t, c: t.update(norm_topk_prob="yes"), "norm_topk_prob"),
    "window_text": ("gpt-oss", lambda t, c: t.update(sliding_window="8"), "sliding_window"),
    # a partial rotary factor outside [0, 1]: no rotary module transformers builds (or one turning more channels
    # than a head has)
    "partial_rotary_above_one": ("qwen3-next", lambda t, c: t["rope_parameters"].update(partial_rotary_factor=1.5),
                                 "rope_parameters.partial_rotary_factor"),
    "partial_rotary_negative": ("qwen3.5", lambda t, c: t["rope_parameters"].update(partial_rotary_factor=-0.5),
                                "text_config.rope_parameters.partial_rotary_factor"),
    "partial_rotary_null": ("qwen3-next", lambda t, c: t["rope_parameters"].update(partial_rotary_factor=None),
                            "rope_parameters.partial_rotary_factor"),
    # YaRN scaling settings whose tables transformers computes as NaN / inf (factor 0) or cannot compute (a string)
    "yarn_factor_zero": ("gpt-oss", lambda t, c: t["rope_parameters"].update(factor=0), "rope_parameters.factor"),
    "yarn_factor_text": ("gpt-oss", lambda t, c: t["rope_parameters"].update(factor="4"), "rope_parameters.factor"),
    "yarn_beta_zero": ("gpt-oss", lambda t, c: t["rope_parameters"].update(beta_slow=0.0), "rope_parameters.beta_slow"),
    # a RoPE type transformers has no tables for: its model class fails as it is made, naming the type alone
    "rope_type_unknown": ("llama", lambda t, c: t["rope_parameters"].update(rope_type="bogus"),
                          "rope_parameters.rope_type"),
    "rope_type_unknown_legacy": ("qwen3", lambda t, c: (t.pop("rope_parameters"), t.update(
        rope_theta=1e6, rope_scaling={"type": "bogus", "factor": 2.0})), "rope_scaling.type"),
    # an odd number of channels per head for RoPE to turn (in pairs): the model fails at its first forward pass
    "odd_head_dim": ("qwen3", lambda t, c: t.update(head_dim=15), "head_dim"),
    "odd_rotary_share": ("qwen3-next", lambda t, c: t["rope_parameters"].update(partial_rotary_factor=0.0625),
                         "rope_parameters.partial_rotary_factor"),
}


@pytest.mark.parametrize("case", sorted(LAYER_SETTINGS))
def test_a_layer_setting_the_layers_cannot_be_built_from_is_named(tmp_path, case):
    """Settings transformers' config class reads (or fails on with its own text) but that build no model the
    exported graphs compute: unbuilt layer kinds, a layer_types list of the wrong length, value heads in no whole
    groups, more experts per token than there are, an activation or biases the graphs would leave out; and a setting
    given under two spellings that disagree (transformers reads one, silently)."""
    family, edit, field = LAYER_SETTINGS[case]
    target = _target(tmp_path, family)
    _edit(target, edit)
    errors = _errors(target, family)
    assert len(errors) == 1 and errors[0].startswith(f"error: {target / 'config.json'}: {field}: "), errors
    _refused(target, family, "config.json", field)
    _export_refused(target, family, "config.json", field)


# (family, config edit, the field named: the layers' token mixers or MLPs in the weights are of the other kind)
LAYOUTS = {
    "layer_types_swapped": ("qwen3.5", _layer_kinds(["full_attention", "linear_attention", "linear_attention"] * 2),
                            "text_config.layer_types"),
    "interval": ("qwen3.5", lambda t, c: (t.pop("layer_types"), t.update(full_attention_interval=2)),
                 "text_config.full_attention_interval"),
    "dense_layer_made_moe": ("qwen3-next", lambda t, c: t.update(mlp_only_layers=[]), "mlp_only_layers"),
    "moe_layers_made_dense": ("qwen3-moe", lambda t, c: t.update(decoder_sparse_step=2), "decoder_sparse_step"),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_layer_kinds_that_disagree_with_the_weights_are_named_in_config(tmp_path, case):
    """transformers builds the layer kinds the config names, loads none of the other kind's tensors and draws the
    named kind's at random: one error naming the config's setting instead of one per tensor."""
    family, edit, field = LAYOUTS[case]
    target = _target(tmp_path, family)
    _edit(target, edit)
    assert _transformers_complaints(target)
    e = _refused(target, family, "config.json", field)
    assert "but the weights hold" in e.message
    _export_refused(target, family, "config.json", field)


@pytest.mark.parametrize("family, tensor", [
    ("qwen3.5", "model.language_model.layers.0.linear_attn.conv1d.bias"),
    ("qwen3-next", "model.layers.3.linear_attn.extra"),
    ("qwen3-moe", "model.layers.1.mlp.experts.8.up_proj.weight"),  # a ninth expert where config.json says 8
    ("gpt-oss", "stray.weight"),
])
def test_a_tensor_transformers_would_drop_is_named(tmp_path, family, tensor):
    import torch

    target = _target(tmp_path, family)
    _edit_weights(target, lambda sd, prefix: sd.__setitem__(tensor, torch.zeros(4)))
    assert _transformers_objects(target)
    assert "transformers would drop it" in _refused(target, family, "model.safetensors", tensor).message
    _export_refused(target, family, "model.safetensors", tensor)


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_tensors_transformers_deliberately_ignores_pass(tmp_path, family):
    """Multi-token-prediction heads (and Qwen3.5's vision tower, in the tiny composite checkpoint already) are
    outside the decoder transformers loads, by its own model class's list."""
    import torch

    from dflash_export.models.target import read_target_config, target_weight_problems

    target = _target(tmp_path, family)
    _edit_weights(target, lambda sd, prefix: sd.__setitem__("mtp.fc.weight", torch.zeros(4, 4)))
    assert not _transformers_complaints(target)
    cfg, cfg_path = read_target_config(target)
    assert target_weight_problems(target, cfg, cfg_path) == []


def test_experts_stored_stacked_as_transformers_holds_them_pass(tmp_path):
    """A Qwen-MoE checkpoint may store each layer's experts one tensor per projection ([E, 2I, H] and [E, H, I], the
    layout transformers converts the per-expert tensors into) instead of one per expert."""
    import torch

    from dflash_export.models.target import read_target_config, target_weight_problems

    target = _target(tmp_path, "qwen3-next")

    def stack(sd, prefix):
        for i in range(6):
            p = f"{prefix}layers.{i}.mlp.experts."
            if p + "0.gate_proj.weight" not in sd:
                continue
            take = lambda proj: [sd.pop(f"{p}{e}.{proj}.weight") for e in range(8)]  # noqa: E731
            sd[p + "gate_up_proj"] = torch.cat([torch.stack(take("gate_proj")), torch.stack(take("up_proj"))], 1)
            sd[p + "down_proj"] = torch.stack(take("down_proj"))

    _edit_weights(target, stack)
    assert not _transformers_complaints(target)
    cfg, cfg_path = read_target_config(target)
    assert target_weight_problems(target, cfg, cfg_path) == []


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next", "gpt-oss"])
def test_a_truncated_shard_of_a_hybrid_or_moe_target_is_named(tmp_path, family):
    target = _target(tmp_path, family)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[:-1000])
    line = _export_refused(target, family, "model.safetensors", None)
    assert "truncated safetensors file" in line


@pytest.mark.parametrize("family, edit, file, field", [
    ("qwen3.5", lambda target: _edit_weights(target, lambda sd, prefix: sd.pop(prefix + "layers.3.linear_attn.A_log")),
     "", "model.language_model.layers.3.linear_attn.A_log"),
    ("gpt-oss", lambda target: _edit(target, lambda text, cfg: text.update(num_experts_per_tok=9)), "config.json",
     "num_experts_per_tok"),
    # a window no wider than the drafter's block of 4, which the batched graph cannot mask
    ("gpt-oss", lambda target: _edit(target, lambda text, cfg: text.update(sliding_window=4)), "config.json",
     "sliding_window"),
    ("qwen3", lambda target: _edit(target, lambda text, cfg: text.update(max_position_embeddings=2 ** 40)),
     "config.json", "max_position_embeddings"),
])
def test_build_refuses_a_faulty_target_before_writing_an_engine(tmp_path, family, edit, file, field):
    target = _target(tmp_path, family)
    edit(target)
    engines = tmp_path / "engines"
    r = CliRunner().invoke(main, ["build", "--target", str(target), "--drafter", f"tiny:{family}/drafter",
                                  "--out", str(engines)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {target / file}: {field}: "), errors[0]
    assert not engines.exists()


def _plant(sd: dict, name: str, dtype=None) -> None:
    """Every tensor of `sd` stored as `dtype` (when given), then a NaN and a -inf planted in `name`."""
    import torch

    for k in sd if dtype else ():
        sd[k] = sd[k].to(getattr(torch, dtype))
    flat = sd[name].view(-1)
    flat[0], flat[-1] = float("nan"), float("-inf")


@pytest.mark.parametrize("family, tensor, dtype, file, field", [
    ("qwen3", "layers.1.mlp.up_proj.weight", None, "model.safetensors", "model.layers.1.mlp.up_proj.weight"),
    ("llama", "embed_tokens.weight", "bfloat16", "model.safetensors", "model.embed_tokens.weight"),
    ("qwen3", "layers.0.self_attn.k_norm.weight", "float16", "model.safetensors",
     "model.layers.0.self_attn.k_norm.weight"),
    # per-expert tensors, which transformers stacks into one parameter: named by the model directory and the name
    # transformers gives the stack
    ("qwen3-moe", "layers.1.mlp.experts.3.down_proj.weight", None, "", "model.layers.1.mlp.experts.down_proj"),
])
def test_a_weight_holding_nan_or_inf_is_named_by_export(tmp_path, family, tensor, dtype, file, field):
    """NaN / inf in a target weight (stored in float32, bfloat16 or float16) would make every logit NaN, and the
    engine emit token 0 with exit 0: found in the weights as loaded, named by file and tensor, nothing written."""
    target = _target(tmp_path, family)
    _edit_weights(target, lambda sd, prefix: _plant(sd, "model." + tensor, dtype))
    line = _export_refused(target, family, file, field)
    assert ": 2 non-finite values (NaN/inf) of " in line, line


def test_build_refuses_a_target_weight_holding_nan_before_writing_an_engine(tmp_path):
    target = _target(tmp_path)
    _edit_weights(target, lambda sd, prefix: _plant(sd, "lm_head.weight"))
    engines = tmp_path / "engines"
    r = CliRunner().invoke(main, ["build", "--target", str(target), "--drafter", "tiny:qwen3/drafter",
                                  "--out", str(engines)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {target / 'model.safetensors'}: lm_head.weight: 2 non-finite values "
                                f"(NaN/inf) of "), errors[0]
    assert not engines.exists()


def test_a_float32_weight_beyond_float16s_range_is_named_when_loaded_as_float16(tmp_path):
    """Finite in the file, inf once loaded as float16 (the recipes' `dtype: float16`): refused, saying so."""
    import torch

    from dflash_export.models import load_target

    target = _target(tmp_path)
    _edit_weights(target, lambda sd, prefix: sd[prefix + "norm.weight"].__setitem__(0, 1e6))
    assert load_target(target).hidden_size == 64  # float32: finite
    with pytest.raises(DFlashError) as e:
        load_target(target, torch.float16)
    assert (e.value.path, e.value.field) == (target / "model.safetensors", "model.norm.weight")
    assert e.value.message.startswith("1 non-finite values (NaN/inf) of 64 once loaded as float16 (stored as F32)")


def test_a_target_whose_heads_rope_cannot_turn_is_named_before_the_reference_runs(tmp_path):
    """A LLaMA target with an odd head size, its weights made for it: transformers loads it and fails at the first
    forward pass (the reference exited 3, an internal error). Refused at load, naming config.json's head_dim."""
    from dflash_export.models.tiny import TinySpec, build_drafter, build_target, replace

    spec = TinySpec("llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=9,
                    intermediate_size=32, target_layer_ids=(0, 1), draft_layers=1)
    target, drafter = build_target(spec, tmp_path / "target"), build_drafter(replace(spec, head_dim=8),
                                                                             tmp_path / "drafter")
    r = CliRunner().invoke(main, ["reference", "--target", str(target), "--drafter", str(drafter),
                                  "--max-new-tokens", "2"])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {target / 'config.json'}: head_dim: 9 is odd"), errors[0]


def test_a_tied_config_over_a_distinct_lm_head_is_refused_before_an_engine_is_written(tmp_path):
    """tie_word_embeddings true over weights that also hold an lm_head.weight of other values: transformers 5 keeps
    that head (with a warning), transformers 4 and other runtimes tie it to the embedding table -- two models.
    Refused by the loader every stage uses, naming config.json's tie_word_embeddings; the same head stored twice is
    one model and loads."""
    from dflash_export.models import load_target

    target = _target(tmp_path)  # tiny Qwen3: untied, its own lm_head.weight
    _edit(target, lambda text, cfg: text.update(tie_word_embeddings=True))
    with pytest.raises(DFlashError) as e:
        load_target(target)
    assert (e.value.path, e.value.field) == (target / "config.json", "tie_word_embeddings"), e.value
    engines = tmp_path / "engines"
    r = CliRunner().invoke(main, ["build", "--target", str(target), "--drafter", "tiny:qwen3/drafter",
                                  "--out", str(engines)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {target / 'config.json'}: tie_word_embeddings: "), errors[0]
    assert not engines.exists()
    _edit_weights(target, lambda sd, prefix: sd.__setitem__("lm_head.weight",
                                                         sd[prefix + "embed_tokens.weight"].clone()))
    assert load_target(target).hidden_size == 64
