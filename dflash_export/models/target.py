"""Targets (Qwen3, LLaMA, Qwen3-MoE, gpt-oss) through transformers, with DFlash's layer taps and a croppable cache.

Taps follow the +1 convention: `target_layer_ids` name a decoder layer's *output*, which is HF `hidden_states[id + 1]`
(index 0 is the embedding output). Getting this wrong silently lowers acceptance, so it lives in exactly one place:
`tap_hidden_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_export.decoding.request import is_int, is_positive_number
from dflash_export.errors import DFlashError
from dflash_export.files import native_path, read_json_object
from dflash_export.models.arch import ARCHS, REFUSED, text_settings
from dflash_export.models.config import MAX_EXPERTS, MAX_LAYERS, oversize
from dflash_export.models.gguf import hf_dir_from_gguf
from dflash_export.models.hfutil import config_dtype, quiet_transformers, stop_token_ids_of
from dflash_export.models.rope import (
    hf_config,
    partial_rotary_problem,
    rope_scaling_problem,
    rope_source_field,
    rope_theta_problem,
    rope_type_problem,
    rotary_dim_problem,
)
from dflash_export.models.sources import resolve_source
from dflash_export.models.weights import (
    INTEGER_DTYPES,
    SAFETENSORS_DTYPES,
    check_finite,
    dtype_name,
    has_safetensors,
    narrows,
    tensor_headers,
)


def tap_hidden_states(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of `layer_ids` (HF hidden_states[id + 1]) on the last axis -> [B, S, n*H]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def resolve_target_dir(path) -> Path:
    """An HF model directory for `path`: an HF directory as is, a `.gguf` file through the cached conversion."""
    p = resolve_source(path)
    if p.is_file() and p.suffix == ".gguf":
        return hf_dir_from_gguf(p)
    if not p.exists():
        raise DFlashError("target not found", path=p)
    if not (p / "config.json").is_file():
        raise DFlashError("not an HF model directory (no config.json) nor a .gguf file: a target directory holds "
                          "config.json, model.safetensors (or its index and shards) and the tokenizer files", path=p)
    return p


# Sizes transformers builds the layers from, checked when config.json gives them (its defaults stand otherwise): the
# attention's and MLP's, the experts' (MoE families) and the Gated DeltaNet's (hybrids). Each size is a positive
# integer, at most its config.MAX_SIZES bound.
OPTIONAL_SIZES = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "max_position_embeddings", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "num_experts_per_tok", "decoder_sparse_step", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval")
# The layer kinds a family's `layer_types` may name (transformers' config classes accept more, which its decoder
# layers of these families do not build).
_LAYER_KINDS = {"hybrid": ("linear_attention", "full_attention"), "sliding": ("sliding_attention", "full_attention")}


def _spelled(raw: dict[str, Any]):
    """`where(key)`: a decoder setting's key as config.json `raw` spells it (`text_config.<key>` where a composite
    checkpoint keeps it there, arch.text_settings)."""
    text = raw["text_config"] if text_settings(raw) is not raw else {}
    return lambda f: f"text_config.{f}" if f in text else f


def read_target_config(path) -> tuple[dict[str, Any], Path]:
    """The target's config.json as a dict, plus `stop_token_ids` from its generation config / eos. A composite
    (vision + text) checkpoint's decoder settings come from its `text_config` (arch.text_settings)."""
    d = resolve_target_dir(path)
    cfg_path = d / "config.json"
    raw = read_json_object(cfg_path)
    cfg = text_settings(raw)
    text = raw["text_config"] if cfg is not raw else {}
    where = _spelled(raw)
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", "model_type"):
        if f not in cfg:
            raise DFlashError("missing required field", path=cfg_path, field=f)
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", *OPTIONAL_SIZES):
        v = cfg.get(f)
        if (v is not None or f not in OPTIONAL_SIZES) and (not is_int(v) or v < 1):
            raise DFlashError(f"expected a positive integer, got {v!r}", path=cfg_path, field=where(f))
        if v is not None and (why := oversize(f, v)):
            raise DFlashError(why, path=cfg_path, field=where(f))
    if cfg["num_hidden_layers"] > MAX_LAYERS:
        raise DFlashError(f"{cfg['num_hidden_layers']} layers: more than the {MAX_LAYERS} this project reads",
                          path=cfg_path, field=where("num_hidden_layers"))
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise DFlashError(f"{kv} does not divide num_attention_heads {heads} (grouped-query attention)",
                          path=cfg_path, field=where("num_key_value_heads"))
    if not isinstance(cfg["model_type"], str):
        raise DFlashError(f"expected a string, got {cfg['model_type']!r}", path=cfg_path, field="model_type")
    if cfg["model_type"] in REFUSED:
        raise DFlashError(f"{cfg['model_type']!r}: {REFUSED[cfg['model_type']]} (supported: {', '.join(ARCHS)})",
                          path=cfg_path, field="model_type")
    if cfg["model_type"] not in ARCHS:
        raise DFlashError(f"unsupported model_type {cfg['model_type']!r} (supported: {', '.join(ARCHS)})",
                          path=cfg_path, field="model_type")
    config_dtype(raw, cfg_path)
    if text:
        config_dtype(text, cfg_path, "text_config.")
    _check_layer_settings(cfg, cfg_path, where)
    cfg["stop_token_ids"] = stop_token_ids_of(d, cfg)
    return cfg, cfg_path


def _check_layer_settings(cfg: dict[str, Any], cfg_path: Path, where) -> None:
    """The family's layer settings, read through transformers' config class: `layer_types` one known kind per layer,
    value heads in whole groups per key head (Gated DeltaNet), a window for sliding layers (at most a context's
    length), a positive SwiGLU clamp (gpt-oss), each token routed to 1..num_experts experts, a positive RoPE base, a
    RoPE type transformers knows, RoPE scaling settings that give finite tables, a partial rotary factor in [0, 1], an
    even number of channels per head for RoPE to turn, a positive RMSNorm epsilon, and no setting the exported graphs
    would ignore (an activation other than SiLU, biases they do not add). A value transformers' config class rejects
    is named by its key. `where(key)` spells a key as config.json does."""
    arch = ARCHS[cfg["model_type"]]
    n, types = cfg["num_hidden_layers"], cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n):
        got = f"{len(types)} entries" if isinstance(types, list) else repr(types)
        raise DFlashError(f"expected one layer kind per layer (num_hidden_layers {n}), got {got}", path=cfg_path,
                          field=where("layer_types"))
    kinds = _LAYER_KINDS["hybrid" if arch.hybrid else "sliding"] if arch.hybrid or arch.sliding_layers else None
    for i, kind in enumerate(types if kinds and types else []):
        if kind not in kinds:
            raise DFlashError(f"layer {i}: {kind!r} (supported: {', '.join(kinds)})", path=cfg_path,
                              field=where("layer_types"))
    try:
        hf = hf_config(cfg, cfg_path, cfg["model_type"])
    except DFlashError as e:  # the rejected key as config.json spells it
        raise DFlashError(e.message, path=cfg_path, field=where(e.field)) from None
    for alias, key in getattr(hf, "attribute_map", {}).items():  # two spellings of one setting: transformers reads key
        if alias in cfg and key in cfg and cfg[alias] != cfg[key]:
            raise DFlashError(f"{cfg[alias]!r} disagrees with {key} {cfg[key]!r}, which transformers reads",
                              path=cfg_path, field=where(alias))
    eps = getattr(hf, "rms_norm_eps", None)
    if eps is not None and not is_positive_number(eps):
        raise DFlashError(f"must be a positive finite number, got {eps!r}", path=cfg_path, field=where("rms_norm_eps"))
    params = dict(getattr(hf, "rope_parameters", None) or {})
    # a base of 0, below 0, NaN or not a number, or a scaling factor of 0: the model computes NaN (or nothing) at
    # every position; a RoPE type transformers has no tables for, a partial factor outside [0, 1] or an odd number of
    # channels to turn builds no model that runs
    source = rope_source_field(cfg)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # as its attention takes it
    rope = (rope_theta_problem(params, source) or rope_type_problem(params, cfg, source)
            or rope_scaling_problem(params, source) or partial_rotary_problem(params, cfg)
            or rotary_dim_problem(params, head_dim, cfg))
    if rope:
        key, _, rest = rope[0].partition(".")
        raise DFlashError(rope[1], path=cfg_path, field=where(key) + (f".{rest}" if rest else ""))
    own_activation = arch.moe is not None and arch.moe.swiglu_limit is not None  # gpt-oss's experts: hidden_act unread
    if not own_activation and getattr(hf, "hidden_act", "silu") != "silu":
        raise DFlashError(f"{hf.hidden_act!r}: the exported MLPs are SiLU-gated", path=cfg_path,
                          field=where("hidden_act"))
    if getattr(hf, "mlp_bias", False):
        raise DFlashError("true: the exported MLPs have no biases", path=cfg_path, field=where("mlp_bias"))
    if arch.hybrid is not None:
        if getattr(hf, "attention_bias", False):
            raise DFlashError("true: the exported gated attention has no q / k / v biases", path=cfg_path,
                              field=where("attention_bias"))
        s = arch.hybrid.linear_shapes(hf)
        if s["value_heads"] % s["key_heads"]:
            raise DFlashError(f"{s['value_heads']} is not a multiple of linear_num_key_heads {s['key_heads']} (each "
                              f"key head serves a whole group of value heads)", path=cfg_path,
                              field=where("linear_num_value_heads"))
    window, kinds_read = getattr(hf, "sliding_window", None), getattr(hf, "layer_types", None)
    windowed = "sliding_attention" in kinds_read if kinds_read else window is not None  # arch.sliding_windows
    if arch.sliding_layers and windowed and not (is_int(window) and window >= 1):
        raise DFlashError(f"sliding_attention layers need a window of at least 1 position, got {window!r}",
                          path=cfg_path, field=where("sliding_window"))
    if arch.sliding_layers and windowed and (why := oversize("sliding_window", window)):
        raise DFlashError(why, path=cfg_path, field=where("sliding_window"))
    if arch.moe is not None and arch.moe.swiglu_limit:
        limit = getattr(hf, arch.moe.swiglu_limit, None)
        if limit is not None and not is_positive_number(limit):
            raise DFlashError(f"must be a positive number (the experts clamp to it), got {limit!r}", path=cfg_path,
                              field=where(arch.moe.swiglu_limit))
    if arch.moe is not None:
        experts, top_k = int(getattr(hf, arch.moe.num_experts, 0) or 0), getattr(hf, arch.moe.top_k, None)
        if experts > MAX_EXPERTS:
            aliases = getattr(hf, "attribute_map", {}).items()  # the key as config.json spells it
            key = next((k for k in (arch.moe.num_experts, *(b for a, b in aliases if a == arch.moe.num_experts),
                                    *(a for a, b in aliases if b == arch.moe.num_experts)) if k in cfg),
                       arch.moe.num_experts)
            raise DFlashError(f"{experts} experts: more than the {MAX_EXPERTS} this project reads", path=cfg_path,
                              field=where(key))
        if experts and not (is_int(top_k) and 1 <= top_k <= experts):
            default = "" if arch.moe.top_k in cfg else " (absent: transformers' default)"
            raise DFlashError(f"{top_k}{default}: each token is routed to 1..{arch.moe.num_experts} ({experts}) "
                              f"experts", path=cfg_path, field=where(arch.moe.top_k))


def _ranges(ids) -> str:
    """Sorted layer indices as runs: [0, 1, 2, 5] -> "0..2, 5"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _embedding_name(tensors: dict) -> str | None:
    """The decoder's embedding table: `model.embed_tokens.weight`, or under a composite checkpoint's language model
    (`model.language_model.embed_tokens.weight`); the shortest such name when a checkpoint holds several."""
    names = [n for n in tensors if n.split(".")[-2:] == ["embed_tokens", "weight"] and not n.startswith("mtp.")]
    return min(names, key=lambda n: (n.count("."), n)) if names else None


def _attention_tensors(arch, hf, hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A full-attention layer's tensors: name under `layers.N.` -> (shape, how config.json gives it). Hybrids'
    q_proj also yields the output gate (twice the rows)."""
    heads = int(hf.num_attention_heads)
    kv = int(hf.num_key_value_heads or heads)
    d = getattr(hf, "head_dim", None) or hidden // heads  # as transformers' attention modules take it
    gate = 2 if arch.hybrid else 1
    q, k = "num_attention_heads x head_dim" + (" x 2" if arch.hybrid else ""), "num_key_value_heads x head_dim"
    out = {"q_proj.weight": ((heads * d * gate, hidden), f"[{q}, hidden_size]"),
           "k_proj.weight": ((kv * d, hidden), f"[{k}, hidden_size]"),
           "v_proj.weight": ((kv * d, hidden), f"[{k}, hidden_size]"),
           "o_proj.weight": ((hidden, heads * d), "[hidden_size, num_attention_heads x head_dim]")}
    if getattr(hf, "attention_bias", False):
        out.update({"q_proj.bias": ((heads * d * gate,), f"[{q}]"), "k_proj.bias": ((kv * d,), f"[{k}]"),
                    "v_proj.bias": ((kv * d,), f"[{k}]"), "o_proj.bias": ((hidden,), "[hidden_size]")})
    if arch.qk_norm:
        out.update({"q_norm.weight": ((d,), "[head_dim]"), "k_norm.weight": ((d,), "[head_dim]")})
    if arch.attention_sinks:
        out["sinks"] = ((heads,), "[num_attention_heads]")
    return {"self_attn." + n: v for n, v in out.items()}


def _linear_attention_tensors(hybrid, hf, hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A Gated DeltaNet layer's tensors (arch.HybridSpec): name under `layers.N.` -> (shape, how config.json gives
    it). Qwen3-Next fuses its input projections into in_proj_qkvz / in_proj_ba, Qwen3.5 keeps four."""
    s = hybrid.linear_shapes(hf)
    hk, hv, dk, dv, c = s["key_heads"], s["value_heads"], s["key_dim"], s["value_dim"], s["conv_channels"]
    keys, values = "linear_num_key_heads x linear_key_head_dim", "linear_num_value_heads x linear_value_head_dim"
    out = {"conv1d.weight": ((c, 1, s["conv_kernel"]), f"[2 x {keys} + {values}, 1, linear_conv_kernel_dim]"),
           "A_log": ((hv,), "[linear_num_value_heads]"), "dt_bias": ((hv,), "[linear_num_value_heads]"),
           "norm.weight": ((dv,), "[linear_value_head_dim]"),
           "out_proj.weight": ((hidden, hv * dv), f"[hidden_size, {values}]")}
    if hybrid.fused_projections:
        out.update({"in_proj_qkvz.weight": ((2 * hk * dk + 2 * hv * dv, hidden), f"[2 x ({keys} + {values}), "
                                                                                   f"hidden_size]"),
                    "in_proj_ba.weight": ((2 * hv, hidden), "[2 x linear_num_value_heads, hidden_size]")})
    else:
        out.update({"in_proj_qkv.weight": ((c, hidden), f"[2 x {keys} + {values}, hidden_size]"),
                    "in_proj_z.weight": ((hv * dv, hidden), f"[{values}, hidden_size]"),
                    "in_proj_b.weight": ((hv, hidden), "[linear_num_value_heads, hidden_size]"),
                    "in_proj_a.weight": ((hv, hidden), "[linear_num_value_heads, hidden_size]")})
    return {"linear_attn." + n: v for n, v in out.items()}


def _mlp_tensors(inter: int, key: str, hidden: int, prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """A SwiGLU MLP of width `inter` (config key `key`): gate / up [inter, hidden], down [hidden, inter]."""
    return {prefix + "gate_proj.weight": ((inter, hidden), f"[{key}, hidden_size]"),
            prefix + "up_proj.weight": ((inter, hidden), f"[{key}, hidden_size]"),
            prefix + "down_proj.weight": ((hidden, inter), f"[hidden_size, {key}]")}


def _moe_tensors(arch, hf, hidden: int, fused: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """A mixture-of-experts MLP's tensors (arch.MoeSpec): the router, the experts (one stacked tensor per projection
    when `fused`, as transformers holds them, else one per expert, as Qwen's checkpoints store them) and hybrids'
    shared expert; name under `layers.N.` -> (shape, how config.json gives it)."""
    spec = arch.moe
    e, i = int(getattr(hf, spec.num_experts)), int(getattr(hf, spec.intermediate_size))
    ek, ik = spec.num_experts, spec.intermediate_size  # the config keys, for messages
    out = {f"{spec.router}.weight": ((e, hidden), f"[{ek}, hidden_size]")}
    if spec.expert_bias:
        out[f"{spec.router}.bias"] = ((e,), f"[{ek}]")
    if spec.interleaved_transposed:
        out.update({"experts.gate_up_proj": ((e, hidden, 2 * i), f"[{ek}, hidden_size, 2 x {ik}]"),
                    "experts.down_proj": ((e, i, hidden), f"[{ek}, {ik}, hidden_size]")})
    elif fused:
        out.update({"experts.gate_up_proj": ((e, 2 * i, hidden), f"[{ek}, 2 x {ik}, hidden_size]"),
                    "experts.down_proj": ((e, hidden, i), f"[{ek}, hidden_size, {ik}]")})
    else:
        for x in range(e):
            out.update(_mlp_tensors(i, ik, hidden, f"experts.{x}."))
    if spec.expert_bias:
        out.update({"experts.gate_up_proj_bias": ((e, 2 * i), f"[{ek}, 2 x {ik}]"),
                    "experts.down_proj_bias": ((e, hidden), f"[{ek}, hidden_size]")})
    if arch.hybrid is not None and arch.hybrid.shared_expert:
        out.update(_mlp_tensors(int(hf.shared_expert_intermediate_size), "shared_expert_intermediate_size", hidden,
                                "shared_expert."))
        out["shared_expert_gate.weight"] = ((1, hidden), "[1, hidden_size]")
    return {"mlp." + n: v for n, v in out.items()}


def _tensor_kind(name: str) -> str:
    """A layer tensor's name with its layer and expert numbers taken out: problems are reported once per kind."""
    return ".".join("N" if part.isdigit() else part for part in name.split("."))


def target_weight_problems(model_dir: Path, cfg: dict[str, Any], cfg_path: Path) -> list[DFlashError]:
    """config.json (`cfg`, from read_target_config) against the safetensors headers, no tensor data read: the
    embedding is [vocab_size, hidden_size], the LM head too unless tie_word_embeddings, decoder layers
    0..num_hidden_layers-1 are there and no other, each layer holds the token mixer its layer kind names (attention,
    or a hybrid's Gated DeltaNet) and the MLP its family gives it (dense, or a mixture of experts), every tensor of
    them with the shape the config's sizes give, and nothing transformers would drop. transformers would otherwise
    fail with its own text, or load a model the config does not describe (layers past num_hidden_layers dropped, a
    missing tensor initialized afresh), and each stored as floats. A quantized checkpoint (`quantization_config`)
    stores its tensors as its quantizer does: only the shapes of the tensors it holds under their plain names are
    checked. One DFlashError per disagreement, at most one per tensor kind; [] when the weights fit."""
    tensors = tensor_headers(model_dir)
    vocab, hidden, n_layers = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    embed = _embedding_name(tensors)
    if embed is None:
        return [DFlashError("no embed_tokens.weight tensor (the decoder's embedding table)", path=model_dir,
                            field="embed_tokens.weight")]
    problems: list[DFlashError] = []
    quantized = cfg.get("quantization_config") is not None

    def shape_problem(name: str, want: tuple[int, ...], spelled: str) -> bool:
        shape, dtype, f = tensors[name]
        if not quantized and dtype in INTEGER_DTYPES:
            problems.append(DFlashError(f"stored as {dtype}, but {cfg_path.name} describes a model that is not "
                                        f"quantized (no quantization_config): its weights are floating point",
                                        path=f, field=name))
            return True
        if shape == want:
            return False
        problems.append(DFlashError(f"shape {list(shape)} != {spelled} = {list(want)} of {cfg_path.name}", path=f,
                                    field=name))
        return True

    shape_problem(embed, (vocab, hidden), "[vocab_size, hidden_size]")
    arch = ARCHS[cfg["model_type"]]
    hf = hf_config(cfg, cfg_path, cfg["model_type"])
    if "lm_head.weight" in tensors:
        shape_problem("lm_head.weight", (vocab, hidden), "[vocab_size, hidden_size]")
    elif not getattr(hf, "tie_word_embeddings", False):
        problems.append(DFlashError("missing tensor: tie_word_embeddings is false, so the LM head is not the "
                                    "embedding table and transformers would draw it at random", path=model_dir,
                                    field="lm_head.weight"))
    root = embed[:-len("embed_tokens.weight")]
    prefix = root + "layers."
    if root + "norm.weight" in tensors:
        shape_problem(root + "norm.weight", (hidden,), "[hidden_size]")
    elif not quantized:
        problems.append(DFlashError(f"missing tensor (the final norm): {cfg_path.name} describes it, and "
                                    f"transformers would initialize it afresh", path=model_dir,
                                    field=root + "norm.weight"))
    by_layer: dict[int, dict[str, str]] = {}  # layer -> name under `layers.N.` -> full name
    for name in tensors:
        head, _, rest = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if head.isdigit():
            by_layer.setdefault(int(head), {})[rest] = name
    present = set(by_layer)
    missing, extra = sorted(set(range(n_layers)) - present), sorted(present - set(range(n_layers)))
    if missing:
        problems.append(DFlashError(f"{n_layers}, but the weights hold no {prefix}N.* tensors for N = "
                                    f"{_ranges(missing)}", path=cfg_path, field="num_hidden_layers"))
    if extra:
        problems.append(DFlashError(f"{n_layers}, but the weights also hold {prefix}N.* for N = {_ranges(extra)} "
                                    f"(transformers would drop them)", path=cfg_path, field="num_hidden_layers"))
    layers = sorted(present & set(range(n_layers)))
    expected, skipped = _layer_expectations(arch, hf, cfg, cfg_path, hidden, layers, by_layer, problems)
    absent: dict[str, list[str]] = {}
    wrong: set[str] = set()
    for i in layers:
        for rest, (shape, spelled) in expected[i].items():
            kind = _tensor_kind(rest)
            if rest not in by_layer[i]:
                absent.setdefault(kind, []).append(f"{prefix}{i}.{rest}")
            elif kind not in wrong and shape_problem(f"{prefix}{i}.{rest}", shape, spelled):
                wrong.add(kind)
    for kind, names in absent.items():
        if not quantized:
            more = f" ({len(names)} such tensors missing)" if len(names) > 1 else ""
            problems.append(DFlashError(f"missing tensor{more}: {cfg_path.name} describes it, and transformers "
                                        f"would initialize it afresh", path=model_dir, field=names[0]))
    unexpected = [] if quantized else [
        full for i in layers for rest, full in by_layer[i].items()
        if rest not in expected[i] and not rest.startswith(skipped.get(i, ("\0",)))] + \
        _dropped_by_transformers(tensors, arch, root)
    unexpected = [n for n in unexpected if not n.endswith("rotary_emb.inv_freq")]  # a buffer transformers recomputes
    if unexpected:
        also = unexpected[1:4] + (["..."] if len(unexpected) > 4 else [])
        more = f" ({len(unexpected)} in all, also {', '.join(also)})" if also else ""
        problems.append(DFlashError(f"unexpected tensor: {cfg_path.name} describes no such weight, and transformers "
                                    f"would drop it{more}", path=tensors[unexpected[0]][2], field=unexpected[0]))
    where = _spelled(read_json_object(cfg_path))
    return [DFlashError(e.message, path=e.path, field=where(e.field)) if e.path == cfg_path else e for e in problems]


def _layer_expectations(arch, hf, cfg: dict, cfg_path: Path, hidden: int, layers: list[int],
                        by_layer: dict[int, dict[str, str]], problems: list[DFlashError]
                        ) -> tuple[dict[int, dict], dict[int, tuple[str, ...]]]:
    """Per layer, the tensors config.json describes (name under `layers.N.` -> (shape, spelled)), and the parts left
    unchecked where the weights hold another kind of token mixer or MLP than the config names: one problem each for
    those (layer_types / full_attention_interval; the settings that make a layer's MLP experts or dense)."""
    kinds = arch.hybrid.layer_kinds(hf) if arch.hybrid else None
    moe_layers = arch.moe.layers(hf) if arch.moe else None
    mixers = {"full_attention": "self_attn.", "linear_attention": "linear_attn."}
    expected: dict[int, dict] = {}
    skipped: dict[int, tuple[str, ...]] = {}
    wrong_kind: list[int] = []
    wrong_mlp: list[int] = []
    for i in layers:
        held = by_layer[i]
        want: dict = {"input_layernorm.weight": ((hidden,), "[hidden_size]"),
                      "post_attention_layernorm.weight": ((hidden,), "[hidden_size]")}
        kind = kinds[i] if kinds else "full_attention"
        other = next((k for k, p in mixers.items() if k != kind and any(r.startswith(p) for r in held)), None)
        if kinds and other is not None and not any(r.startswith(mixers[kind]) for r in held):
            wrong_kind.append(i)
            skipped[i] = tuple(mixers.values())
        else:
            want.update(_linear_attention_tensors(arch.hybrid, hf, hidden) if kind == "linear_attention" else
                        _attention_tensors(arch, hf, hidden))
        moe = bool(moe_layers and moe_layers[i])
        dense_held = any(r.startswith(("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")) for r in held)
        moe_held = any(r.startswith(("mlp.experts.", f"mlp.{arch.moe.router}.")) for r in held) if arch.moe else False
        if (moe and dense_held and not moe_held) or (not moe and moe_held and not dense_held):
            wrong_mlp.append(i)
            skipped[i] = skipped.get(i, ()) + ("mlp.",)
        elif moe:
            want.update(_moe_tensors(arch, hf, hidden, fused="mlp.experts.gate_up_proj" in held))
        else:
            want.update(_mlp_tensors(int(hf.intermediate_size), "intermediate_size", hidden, "mlp."))
        expected[i] = want
    if wrong_kind:
        field = "layer_types" if cfg.get("layer_types") is not None or not arch.hybrid else "full_attention_interval"
        first = kinds[wrong_kind[0]]
        held = "linear_attn" if first == "full_attention" else "self_attn"
        problems.append(DFlashError(
            f"makes layers {_ranges(j for j in wrong_kind if kinds[j] == first)} {first}, but the weights hold "
            f"{held}.* tensors there (the other layer kind)", path=cfg_path, field=field))
    if wrong_mlp:
        spec, i = arch.moe, wrong_mlp[0]
        dense = getattr(hf, spec.mlp_only_layers, None) or [] if spec.mlp_only_layers else []
        step = int(getattr(hf, spec.sparse_step, 1) or 1) if spec.sparse_step else 1
        if moe_layers[i]:  # the setting that would have made it dense
            field = spec.mlp_only_layers or spec.num_experts
        else:  # the setting that made it dense
            field = spec.mlp_only_layers if i in dense else spec.sparse_step if (i + 1) % step else spec.num_experts
        said, held = ("a mixture of experts", "a dense MLP") if moe_layers[i] else ("a dense MLP", "experts")
        problems.append(DFlashError(
            f"makes layers {_ranges(j for j in wrong_mlp if moe_layers[j] == moe_layers[i])} {said} (with "
            f"{', '.join(k for k in (spec.num_experts, spec.sparse_step, spec.mlp_only_layers) if k)}), but the "
            f"weights hold {held} there", path=cfg_path, field=field))
    return expected, skipped


def _dropped_by_transformers(tensors: dict, arch, root: str) -> list[str]:
    """The tensors outside the decoder layers (`root` the decoder's prefix) that transformers' model class neither
    loads nor deliberately ignores (its `_keys_to_ignore_on_load_unexpected`: Qwen3.5's vision tower,
    multi-token-prediction heads)."""
    import re

    import transformers

    ignored = getattr(getattr(transformers, arch.hf_architecture, None), "_keys_to_ignore_on_load_unexpected", None)
    loaded = (root + "embed_tokens.weight", root + "norm.weight", "lm_head.weight")
    return [n for n in tensors if not n.startswith(root + "layers.") and n not in loaded
            and not any(re.search(p, n) for p in ignored or [])]


def check_target_weights(model_dir: Path, cfg: dict[str, Any], cfg_path: Path) -> None:
    """target_weight_problems' first problem raised, for loaders; nothing for weights that fit their config."""
    problems = target_weight_problems(model_dir, cfg, cfg_path)
    if problems:
        raise problems[0]


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, S, V]
    taps: torch.Tensor | None  # [B, S, n*H] concatenated tapped layer outputs


class TargetModel:
    """A transformers causal LM plus what DFlash needs from it: embedding, LM head, taps, cache cropping."""

    def __init__(self, hf_model, model_dir: Path, config: dict[str, Any]):
        self.hf = hf_model.eval()
        self.model_dir = model_dir
        self.config = config
        self.arch = ARCHS[config["model_type"]]
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self.stop_token_ids: list[int] = list(config.get("stop_token_ids", []))
        self._tokenizer = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            for name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
                if (self.model_dir / name).is_file():  # a corrupt one named here, not inside transformers
                    read_json_object(self.model_dir / name)
            # trust_remote_code=False: an `auto_map` in the tokenizer files never imports the directory's code
            # (left unset, transformers asks on stdin whether to run it when no built-in class matches).
            try:
                with native_path(self.model_dir) as d:  # tokenizers (Rust) opens tokenizer.json by a UTF-8 path
                    self._tokenizer = AutoTokenizer.from_pretrained(d, trust_remote_code=False)
            except (ValueError, OSError, KeyError, ImportError) as e:
                first = " ".join(str(e).split())[:200] or type(e).__name__
                raise DFlashError(f"cannot load the tokenizer ({first})", path=self.model_dir) from None
        return self._tokenizer

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.get_output_embeddings()(hidden)

    def new_cache(self):
        from transformers import DynamicCache

        # Hybrids: transformers builds the per-layer kinds (K/V or conv + recurrent state) from the config.
        return DynamicCache(config=self.hf.config) if self.arch.hybrid else DynamicCache()

    @staticmethod
    def crop(cache, length: int) -> None:
        cache.crop(length)

    def snapshot(self, cache):
        """What `commit` needs to roll `cache` back after a verify: a copy for hybrids (transformers' Gated DeltaNet
        state cannot be cropped: it holds the state after the last row only), None for K/V caches (cropped)."""
        import copy

        return copy.deepcopy(cache) if self.arch.hybrid else None

    def commit(self, cache, length: int, snapshot, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the first `length` tokens of `cache` after a verify: crop a K/V cache; a hybrid's goes back to its
        `snapshot` (taken before the verify) and runs the accepted `rows` [1, n] at `positions` again."""
        if snapshot is None:
            cache.crop(length)
            return
        cache.__dict__.update(snapshot.__dict__)
        self.forward(rows, positions, cache)

    def keep_rows(self, cache, start: int, rows: Sequence[int]) -> None:
        """Keep the cache's first `start` rows and then the rows start + r for r in `rows`, in that order (a draft
        tree's accepted path, compacted behind the committed tokens)."""
        if self.arch.hybrid:
            raise DFlashError("draft trees are not verified on hybrid targets (Gated DeltaNet state)",
                              field="tree_mode")
        index = torch.tensor(list(range(start)) + [start + r for r in rows])
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, tap_ids: Sequence[int] | None = None,
                attention_mask: torch.Tensor | None = None) -> TargetOutput:
        """input_ids [B, S] at absolute `positions` [B, S]; appends to `cache`. Returns all logits and the taps.
        `attention_mask` [B, 1, S, past + S] bool (True = visible), when given, replaces the causal mask (a draft
        tree's ancestor-only mask); transformers takes a 4-D mask as it is."""
        out = self.hf(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=tap_ids is not None,
        )
        taps = tap_hidden_states(out.hidden_states, tap_ids) if tap_ids is not None else None
        return TargetOutput(out.logits, taps)


def load_target(path, dtype: torch.dtype = torch.float32) -> TargetModel:
    """Load a Qwen3 / LLaMA target from an HF directory or a GGUF file (converted once, cached)."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model_dir = resolve_target_dir(path)
    config, cfg_path = read_target_config(model_dir)
    if has_safetensors(model_dir):  # headers bounds-checked and held against the config before transformers reads them
        check_target_weights(model_dir, config, cfg_path)
    try:
        with native_path(model_dir) as d:  # safetensors (Rust) opens the weights by a UTF-8 path
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, trust_remote_code=False,
                                                      attn_implementation=ARCHS[config["model_type"]].attn_implementation)
    except Exception as e:  # OSError, safetensors' own errors, shape mismatches from a config that lies
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"cannot load target weights ({first})", path=model_dir) from None
    check_finite_parameters(hf, model_dir)
    check_tied_head(hf, cfg_path)
    return TargetModel(hf, model_dir, config)


def check_tied_head(hf, cfg_path: Path) -> None:
    """A config that ties the LM head to the embedding table (tie_word_embeddings true) over weights that store an
    lm_head.weight of other values describes two models: transformers 5 then keeps the stored head (and says so in a
    warning this project silences), transformers 4 and other runtimes replace it by the table. A DFlashError naming
    config.json's tie_word_embeddings, checked on the loaded model (the two tensors are in memory already)."""
    head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
    if not getattr(hf.config, "tie_word_embeddings", False) or head is None or embed is None \
            or head.weight is embed.weight or torch.equal(head.weight, embed.weight):
        return
    where = _spelled(read_json_object(cfg_path))
    raise DFlashError("true, but the weights hold an lm_head.weight that differs from the embedding table (a tied "
                      "head is the table): set it to false to use that head, or remove lm_head.weight",
                      path=cfg_path, field=where("tie_word_embeddings"))


def check_finite_parameters(hf, model_dir: Path) -> None:
    """Every weight transformers loaded is finite (weights.check_finite), checked on the loaded model tensor by
    tensor, so the weights are not read a second time. A tensor is named in the safetensors file holding it when the
    checkpoint stores it under the name transformers gives it, else in the model directory under that name (a
    checkpoint whose names transformers renames, or *.bin weights). When it was loaded in a dtype of smaller range
    than it is stored in, the line says so: a float32 weight beyond float16's range becomes inf loaded as float16."""
    stored = tensor_headers(model_dir) if has_safetensors(model_dir) else {}
    for name, p in hf.named_parameters():
        path, note = model_dir, ""
        if name in stored:
            _, dtype, path = stored[name]
            held = SAFETENSORS_DTYPES.get(dtype)
            if held is not None and narrows(p.dtype, held):
                note = f" once loaded as {dtype_name(p.dtype)} (stored as {dtype})"
        check_finite(p, path, name, note)
