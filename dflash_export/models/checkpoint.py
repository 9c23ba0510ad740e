"""The drafter checkpoint contract (z-lab format; NVIDIA ModelOpt writes the same) and its lint rules.

Reading fails early with the file and field or tensor named (llama.cpp's habit): a truncated shard, an index that names
a missing tensor, or a wrong shape is reported at load, not as a confusing error deep in a forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_export.decoding.request import is_finite_number, shown
from dflash_export.errors import DFlashError, json_kind, kind_of_type
from dflash_export.files import read_json_object
from dflash_export.models.arch import ARCHS
from dflash_export.models.config import MAX_LAYERS, MAX_SEQ_LEN, DrafterConfig, default_target_layer_ids, oversize
from dflash_export.models.drafter import DFlashDrafter
from dflash_export.models.hfutil import config_dtype
from dflash_export.models.rope import (
    hf_config,
    legacy_rope_fields,
    rope_parameters_of,
    rope_problem,
    rope_source_field,
    rope_theta_problem,
)
from dflash_export.models.sources import resolve_source
from dflash_export.models.target import read_target_config, target_weight_problems
from dflash_export.models.weights import (
    INTEGER_DTYPES,
    check_finite,
    dtype_name,
    has_safetensors,
    load_state_dict,
    narrows,
    tensor_headers,
)


def _field(cfg: dict, path: Path, name: str, typ, default=...):
    """config.json's `name` as a `typ`, or `default` when absent or null (required when no default is given). Every
    int field read this way is a size or a count, so it must be >= 1 (a bool is not an int here) and at most its
    config.MAX_SIZES bound."""
    if name not in cfg or cfg[name] is None:
        if default is ...:
            raise DFlashError("missing required field", path=path, field=name)
        return default
    value = cfg[name]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise DFlashError(f"expected {kind_of_type(typ, 'an object')}, got {json_kind(value)}", path=path, field=name)
    if typ is int and value < 1:
        raise DFlashError(f"must be >= 1, got {shown(value)}", path=path, field=name)
    if typ is int and (why := oversize(name, value)):
        raise DFlashError(why, path=path, field=name)
    if typ is float and not (math.isfinite(value) and value > 0):  # rms_norm_eps: under a square root
        raise DFlashError(f"must be a positive finite number, got {value}", path=path, field=name)
    return value


ZLAB_DEFAULT_BLOCK_SIZE = 16  # dflash 0.1.0's DFlashDraftModel when neither block_size key is present
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _number(value, path: Path, field: str, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise DFlashError(f"expected a number, got {value!r}", path=path, field=field)
    if isinstance(value, int) and not is_finite_number(value):
        raise DFlashError(f"expected a number a float holds, got {shown(value)}", path=path, field=field)
    return float(value)


def _draft_value(cfg: dict, dcfg: dict, name: str, default=None):
    """A DFlash key as z-lab's `_draft_value` reads it: `dflash_config` first, then the top level."""
    return dcfg.get(name, cfg.get(name, default))


def _draft_field(dcfg: dict, name: str) -> str:
    """The field an error about DFlash key `name` names: where the key was read from."""
    return f"dflash_config.{name}" if name in dcfg else name


def _dflash2_keys(cfg: dict, dcfg: dict, path: Path) -> dict:
    """The DFlash 2 keys ({} for a DFlash drafter), after checking that the architecture is a drafter's."""
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch and arch[0] not in DRAFTER_ARCHITECTURES:
        raise DFlashError(f"{arch[0]}: expected one of {list(DRAFTER_ARCHITECTURES)}", path=path,
                          field="architectures")
    dflash2 = {}
    if isinstance(arch, list) and "DFlash2DraftModel" in arch:  # z-lab's rule: the architecture decides the kind
        for name in DFLASH2_KEYS:
            value = _draft_value(cfg, dcfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DFlashError(f"DFlash 2 needs a positive integer, got {value!r}", path=path,
                                  field=_draft_field(dcfg, name))
            dflash2[name] = value
    return dflash2


def _block_size(cfg: dict, dcfg: dict, path: Path, max_positions: int) -> int:
    """The drafter's block: an anchor and at least one drafted token, drafted in one pass at the positions after at
    least one context token, so fewer than `max_positions` (max_position_embeddings) and than any engine's
    max_seq_len (MAX_SEQ_LEN)."""
    top_bs, inner_bs = cfg.get("block_size"), dcfg.get("block_size")
    if top_bs is not None and inner_bs is not None and top_bs != inner_bs:
        raise DFlashError(f"block_size {top_bs} disagrees with dflash_config.block_size {inner_bs}", path=path,
                          field="block_size")
    block_size = inner_bs if inner_bs is not None else top_bs
    if block_size is None:
        block_size = ZLAB_DEFAULT_BLOCK_SIZE
    field = "dflash_config.block_size" if inner_bs is not None else "block_size"
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise DFlashError(f"must be an integer >= 2, got {block_size!r}", path=path, field=field)
    if block_size >= max_positions:
        raise DFlashError(f"a block of {block_size} positions after the context does not fit max_position_embeddings "
                          f"{max_positions}", path=path, field=field)
    if block_size >= MAX_SEQ_LEN:
        raise DFlashError(f"a block of {block_size} does not fit the longest sequence an engine is built for "
                          f"({MAX_SEQ_LEN} tokens)", path=path, field=field)
    return block_size


def _mask_token_id(cfg: dict, dcfg: dict, path: Path) -> int:
    if "mask_token_id" not in dcfg and "mask_token_id" not in cfg:
        raise DFlashError("missing", path=path, field="dflash_config.mask_token_id")
    mask_token_id = _draft_value(cfg, dcfg, "mask_token_id")
    if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool):
        raise DFlashError(f"expected int, got {mask_token_id!r}", path=path,
                          field=_draft_field(dcfg, "mask_token_id"))
    return mask_token_id


def _layer_sizes(cfg: dict, path: Path) -> tuple[int, int, int, int]:
    """hidden_size, num_hidden_layers, num_attention_heads, num_target_layers: each present and >= 1, the layer counts
    at most MAX_LAYERS."""
    sizes = (_field(cfg, path, "hidden_size", int), _field(cfg, path, "num_hidden_layers", int),
             _field(cfg, path, "num_attention_heads", int), _field(cfg, path, "num_target_layers", int))
    for name, n in (("num_hidden_layers", sizes[1]), ("num_target_layers", sizes[3])):
        if n > MAX_LAYERS:
            raise DFlashError(f"{n} layers: more than the {MAX_LAYERS} this project reads", path=path, field=name)
    return sizes


def _attention_sizes(cfg: dict, path: Path, hidden: int, heads: int) -> tuple[int, int]:
    """num_key_value_heads and head_dim as the drafter's attention uses them: K/V heads repeated over whole query-head
    groups, RoPE rotating head halves. An absent key takes transformers' Qwen3Config default, as z-lab's release
    builds the drafter from that class (head_dim 128 whatever hidden_size / num_attention_heads is; K/V heads 32, or
    the query heads when the key is null)."""
    absent = [k for k in ("num_key_value_heads", "head_dim") if k not in cfg or cfg[k] is None]
    defaults = hf_config(cfg, path, "qwen3") if absent else None
    kv = _field(cfg, path, "num_key_value_heads", int, getattr(defaults, "num_key_value_heads", None) or heads)
    if heads % kv:
        note = " (absent: Qwen3Config's default)" if "num_key_value_heads" in absent else ""
        raise DFlashError(f"{kv}{note} does not divide num_attention_heads {heads}", path=path,
                          field="num_key_value_heads")
    head_dim = _field(cfg, path, "head_dim", int, getattr(defaults, "head_dim", None))
    if head_dim % 2:
        raise DFlashError(f"{head_dim} must be even for RoPE", path=path, field="head_dim")
    return kv, head_dim


def _target_layer_ids(cfg: dict, dcfg: dict, path: Path, n_target: int, layers: int) -> list[int]:
    """The tapped target layers, or z-lab's default for this many target and drafter layers when absent."""
    ids = _draft_value(cfg, dcfg, "target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(n_target, layers)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DFlashError(f"expected a non-empty list of ints, got {repr(ids)[:200]}", path=path,
                          field=_draft_field(dcfg, "target_layer_ids"))
    if len(ids) > n_target:  # each a distinct target layer
        raise DFlashError(f"{len(ids)} layers tapped, more than num_target_layers {n_target}", path=path,
                          field=_draft_field(dcfg, "target_layer_ids"))
    return ids


def _qwen3_fields(cfg: dict, path: Path, layers: int) -> tuple[float, dict | None, list[str] | None, int | None]:
    """rope_theta, rope_scaling, layer_types and sliding_window as transformers' Qwen3Config reads them (the release
    builds its drafter from it)."""
    hf = hf_config(cfg, path, "qwen3")
    rope = dict(hf.rope_parameters or {})
    rope.pop("type", None)
    problem = rope_problem(rope, rope_source_field(cfg))
    if problem:
        raise DFlashError(problem[1], path=path, field=problem[0])
    rope_theta, rope_scaling = legacy_rope_fields(rope)
    layer_types = list(hf.layer_types) if hf.layer_types is not None else None
    if layer_types is not None and len(layer_types) != layers:
        raise DFlashError(f"{len(layer_types)} entries != num_hidden_layers {layers}", path=path, field="layer_types")
    for i, layer_kind in enumerate(layer_types or []):
        if layer_kind not in ("full_attention", "sliding_attention"):
            raise DFlashError(f"layer {i}: {layer_kind!r} (supported: full_attention, sliding_attention)", path=path,
                              field="layer_types")
    window = hf.sliding_window
    if layer_types and "sliding_attention" in layer_types:
        if window is None:
            why = ("use_sliding_window is not true, so transformers drops sliding_window"
                   if cfg.get("sliding_window") else "no sliding_window")
            raise DFlashError(f"sliding_attention layers but {why}: z-lab's release cannot build their cache either",
                              path=path, field="sliding_window")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise DFlashError(f"must be an integer >= 1, got {window!r}", path=path, field="sliding_window")
        if why := oversize("sliding_window", window):
            raise DFlashError(why, path=path, field="sliding_window")
    return rope_theta, rope_scaling, layer_types, window


def _is_causal(cfg: dict, dcfg: dict, path: Path) -> bool | None:
    if "is_causal" in dcfg:
        raise DFlashError("z-lab's release reads is_causal from the top level only (it would ignore this one): "
                          "move it there", path=path, field="dflash_config.is_causal")
    is_causal = cfg.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise DFlashError(f"expected true, false or null, got {is_causal!r}", path=path, field="is_causal")
    return is_causal


def _check_dflash2_sizes(dflash2: dict, cfg: dict, dcfg: dict, path: Path, hidden: int) -> None:
    if hidden % dflash2["conv_group_size"]:
        raise DFlashError(f"{dflash2['conv_group_size']} does not divide hidden_size {hidden}", path=path,
                          field=_draft_field(dcfg, "conv_group_size"))
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int) and not 1 < dflash2["selector_top_k"] <= vocab:
        raise DFlashError(f"must be in 2..vocab_size ({vocab}), got {dflash2['selector_top_k']}", path=path,
                          field=_draft_field(dcfg, "selector_top_k"))


# Every config.json key parse_drafter_config reads; the others are kept in DrafterConfig.extra.
_DRAFTER_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "attention_bias", "hidden_act", "vocab_size", "block_size", "num_target_layers",
    "target_hidden_size", "torch_dtype", "dtype", "dflash_config", "layer_types", "sliding_window",
    "use_sliding_window", "max_window_layers", "is_causal", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping", "mask_token_id", "target_layer_ids", "transformers_version", *DFLASH2_KEYS,
})


def parse_drafter_config(cfg: dict, path: Path, fc_in_features: int | None = None) -> DrafterConfig:
    """Normalize a drafter `config.json` dict as z-lab's release (dflash 0.1.0, transformers 5) reads it.

    DFlash keys come from `dflash_config` or the top level, `dflash_config` first (z-lab's `_draft_value`); block_size
    may sit in both but then must agree. The Qwen3 fields go through transformers' Qwen3Config, so `rope_theta` /
    `rope_scaling` and transformers 5's `rope_parameters`, `use_sliding_window` and the `layer_types` it derives mean
    what they mean to the release. A key the project cannot honour is a DFlashError naming it, never ignored.
    """
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise DFlashError("expected an object", path=path, field="dflash_config")
    dflash2 = _dflash2_keys(cfg, dcfg, path)
    torch_dtype = config_dtype(cfg, path) or "float32"  # before transformers' config class reads it
    max_positions = _field(cfg, path, "max_position_embeddings", int, 32768)
    block_size = _block_size(cfg, dcfg, path, max_positions)
    mask_token_id = _mask_token_id(cfg, dcfg, path)
    hidden, layers, heads, n_target = _layer_sizes(cfg, path)
    kv_heads, head_dim = _attention_sizes(cfg, path, hidden, heads)
    ids = _target_layer_ids(cfg, dcfg, path, n_target, layers)
    target_hidden = _field(cfg, path, "target_hidden_size", int, None)
    if target_hidden is None:
        target_hidden = fc_in_features // len(ids) if fc_in_features else hidden
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise DFlashError(f"{act!r}: only the SiLU-gated MLP of Qwen3 drafters is implemented", path=path,
                          field="hidden_act")
    rope_theta, rope_scaling, layer_types, window = _qwen3_fields(cfg, path, layers)
    is_causal = _is_causal(cfg, dcfg, path)
    embed_scale = _number(_draft_value(cfg, dcfg, "input_embedding_scale", 1.0), path,
                          _draft_field(dcfg, "input_embedding_scale"))
    multiplier = _number(_draft_value(cfg, dcfg, "output_multiplier", 1.0), path,
                         _draft_field(dcfg, "output_multiplier"))
    softcap = _number(_draft_value(cfg, dcfg, "final_logit_softcapping"), path,
                      _draft_field(dcfg, "final_logit_softcapping"), allow_none=True)
    if dflash2:
        _check_dflash2_sizes(dflash2, cfg, dcfg, path, hidden)
    return DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_field(cfg, path, "intermediate_size", int),
        rms_norm_eps=_field(cfg, path, "rms_norm_eps", float, 1e-6),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(ids),
        num_target_layers=n_target,
        vocab_size=_field(cfg, path, "vocab_size", int, 0),
        target_hidden_size=target_hidden,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        attention_bias=_field(cfg, path, "attention_bias", bool, False),
        hidden_act=act,
        layer_types=layer_types if layer_types and "sliding_attention" in layer_types else None,
        sliding_window=window if layer_types and "sliding_attention" in layer_types else None,
        is_causal=is_causal,
        input_embedding_scale=embed_scale,
        output_multiplier=multiplier,
        final_logit_softcapping=softcap,
        **dflash2,
        torch_dtype=torch_dtype,
        extra={k: v for k, v in cfg.items() if k not in _DRAFTER_CONFIG_KEYS},
    )


def expected_drafter_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (c.hidden_size, len(c.target_layer_ids) * c.target_hidden_size),
        "hidden_norm.weight": (c.hidden_size,),
        "norm.weight": (c.hidden_size,),
    }
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (c.hidden_size,)})
        if c.is_dflash2:
            groups = c.hidden_size // c.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes.update({p + conv + ".base_kernel": (2, c.conv_kernel_size, c.hidden_size),
                               p + conv + ".kernel_projection.weight": (2 * c.conv_kernel_size * groups,
                                                                        c.hidden_size)})
    if c.is_dflash2:
        shapes.update({"candidate_selector.predecessor_codebook.weight": (c.vocab_size, c.selector_rank),
                       "candidate_selector.successor_codebook.weight": (c.vocab_size, c.selector_rank),
                       "candidate_selector.hidden_projection.weight": (c.selector_rank, c.hidden_size)})
    return shapes


def normalized_tensor_name(name: str) -> str:
    """z-lab's released DFlash 2 checkpoints store the selector codebooks without `.weight` (its from_pretrained maps
    them); models saved by its code carry it. Both read as the `.weight` name."""
    if name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        return name + ".weight"
    return name


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Some exporters write a `model.` prefix; the contract has none. Accept and normalize.
    if state and all(k.startswith("model.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items()}
    return {normalized_tensor_name(k): v for k, v in state.items()}


def read_drafter_config(path) -> DrafterConfig:
    """A drafter checkpoint directory's config.json, checked as `read_drafter_checkpoint` checks it, without reading a
    tensor: what a command checks its options against before it loads the weights."""
    ckpt = resolve_source(path)
    if not ckpt.is_dir():
        raise DFlashError("drafter checkpoint directory not found", path=ckpt)
    return parse_drafter_config(read_json_object(ckpt / "config.json"), ckpt / "config.json")


def read_drafter_checkpoint(path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read and check a drafter checkpoint directory: config + every tensor present with the right shape."""
    ckpt = resolve_source(path)
    if not ckpt.is_dir():
        raise DFlashError("drafter checkpoint directory not found", path=ckpt)
    cfg_path = ckpt / "config.json"
    cfg = read_json_object(cfg_path)
    state = _strip_prefix(load_state_dict(ckpt))
    fc = state.get("fc.weight")
    config = parse_drafter_config(cfg, cfg_path, fc.shape[1] if fc is not None and fc.ndim == 2 else None)
    expected = expected_drafter_shapes(config)
    for name, shape in expected.items():
        if name not in state:
            raise DFlashError("missing tensor", path=ckpt, field=name)
        if tuple(state[name].shape) != shape:
            raise DFlashError(f"shape {tuple(state[name].shape)} != expected {shape}", path=ckpt, field=name)
        if not state[name].is_floating_point():  # stored as integers: loading would turn them into floats silently
            raise DFlashError(f"stored as {dtype_name(state[name].dtype)}: a drafter's weights are floating point",
                              path=ckpt, field=name)
    # d2t/t2d (reduced draft vocabularies) are not supported yet: say so instead of silently ignoring them.
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise DFlashError(f"unexpected tensors {unexpected[:4]}", path=ckpt, field=unexpected[0])
    return config, state


# ----------------------------------------------------------------------------------------------------------------------
# Lint (`dflash-export inspect`)


@dataclass
class Finding:
    level: str  # "error" | "warning"
    file: str
    field: str
    message: str

    def line(self) -> str:
        return f"{self.level}: {self.file}: {self.field}: {self.message}"


class _Findings(list):
    """The findings of one lint, errors and warnings defaulting to the drafter's config.json."""

    def __init__(self, cfg_path: Path):
        super().__init__()
        self.cfg_path = cfg_path

    def err(self, field, msg, file=None):
        self.append(Finding("error", str(self.cfg_path if file is None else file), field, msg))

    def warn(self, field, msg, file=None):
        self.append(Finding("warning", str(self.cfg_path if file is None else file), field, msg))


def _lint_target_weights(findings: _Findings, tcfg: dict, tcfg_path: Path) -> None:
    """The target's weights too, from their headers: a truncated or missing shard, or tensors the config does not
    describe, fail here, not at export."""
    try:
        if has_safetensors(tcfg_path.parent):
            problems = target_weight_problems(tcfg_path.parent, tcfg, tcfg_path)
        else:
            problems = []
            if not any(tcfg_path.parent.glob("*.bin")):
                findings.err("weights", "no model.safetensors, index or *.bin weights", file=tcfg_path.parent)
    except DFlashError as e:
        problems = [e]
    for e in problems:
        findings.append(Finding("error", str(e.path or tcfg_path.parent), e.field or "weights", e.message))


def _drafter_tensor_headers(ckpt: Path) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Tensor name (normalized) -> (shape, dtype, file), from the safetensors headers only: no weights loaded."""
    headers = tensor_headers(ckpt)
    prefixed = all(k.startswith("model.") for k in headers)
    return {normalized_tensor_name(name[len("model."):] if prefixed else name): info for name, info in headers.items()}


def _lint_dflash_keys(findings: _Findings, raw: dict, c: DrafterConfig) -> None:
    """Warnings about the drafter's own keys: architecture, DFlash keys left to their defaults or never read."""
    if raw.get("architectures") not in (None, ["DFlashDraftModel"], ["DFlash2DraftModel"]):
        findings.warn("architectures", f"expected ['DFlashDraftModel'] or ['DFlash2DraftModel'], got "
                                       f"{raw.get('architectures')}")
    dcfg = raw.get("dflash_config") or {}
    if "target_layer_ids" not in dcfg and "target_layer_ids" not in raw:
        findings.warn("dflash_config.target_layer_ids", f"absent; derived with z-lab's rule as {c.target_layer_ids}")
    if "block_size" not in dcfg and "block_size" not in raw:
        findings.warn("dflash_config.block_size", f"absent; z-lab's default {c.block_size} is used")
    unread = sorted(set(dcfg) - DFLASH_CONFIG_KEYS)
    if unread:
        findings.warn("dflash_config", f"keys neither z-lab's release nor this project reads: {unread}")


def _lint_target_fit(findings: _Findings, c: DrafterConfig, tcfg: dict, fc_shape: tuple, tensors: dict) -> None:
    """The drafter against its target: tapped layers, fc input width, mask token and vocabulary."""
    n_layers, t_hidden = tcfg["num_hidden_layers"], tcfg["hidden_size"]
    if c.target_hidden_size != t_hidden:
        findings.err("target_hidden_size", f"{c.target_hidden_size} != target hidden_size {t_hidden}")
    if c.num_target_layers != n_layers:
        findings.err("num_target_layers", f"{c.num_target_layers} != target num_hidden_layers {n_layers}")
    outside = [i for i in c.target_layer_ids if not 0 <= i < n_layers]
    if outside:  # one finding, not one per layer
        more = f" ({len(outside)} such layers)" if len(outside) > 1 else ""
        findings.err("dflash_config.target_layer_ids", f"layer {outside[0]} outside the target's 0..{n_layers - 1}"
                                                       f"{more}")
    for i in c.target_layer_ids:
        if i == n_layers - 1:
            findings.warn("dflash_config.target_layer_ids",
                          f"layer {i} is the target's last: its HF hidden state is taken after the final norm")
    if len(set(c.target_layer_ids)) != len(c.target_layer_ids):
        findings.err("dflash_config.target_layer_ids", f"duplicate layer ids {c.target_layer_ids}")
    want_fc = len(c.target_layer_ids) * t_hidden
    if len(fc_shape) == 2 and fc_shape[1] != want_fc:
        findings.err("fc.weight", f"input width {fc_shape[1]} != len(target_layer_ids) {len(c.target_layer_ids)} x "
                                  f"target hidden_size {t_hidden} = {want_fc}", file=tensors["fc.weight"][2])
    vocab = tcfg["vocab_size"]
    if not 0 <= c.mask_token_id < vocab:
        findings.err("dflash_config.mask_token_id",
                     f"{c.mask_token_id} outside the target's embedding rows 0..{vocab - 1}")
    stops = set(tcfg.get("stop_token_ids", []))
    if c.mask_token_id in stops:
        findings.err("dflash_config.mask_token_id", f"{c.mask_token_id} is a stop token of the target")
    if c.vocab_size and c.vocab_size != vocab:
        findings.warn("vocab_size", f"{c.vocab_size} != target vocab_size {vocab} (the target's LM head is used)")
        if c.is_dflash2:  # the selector's codebooks are indexed by the target's token ids
            findings[-1].level = "error"


def _lint_rope(findings: _Findings, c: DrafterConfig, tcfg: dict, tcfg_path: Path) -> None:
    """The target's RoPE is one the project implements, and the drafter's is the same."""
    try:
        t_rope = rope_parameters_of(tcfg, tcfg_path, tcfg["model_type"])
    except DFlashError as e:
        findings.err(e.field or "config", e.message, file=tcfg_path)
        t_rope = None
    if t_rope is None:
        return
    hybrid = getattr(ARCHS.get(tcfg["model_type"]), "hybrid", None) is not None  # partial RoPE: its own graph
    problem = rope_problem(t_rope, rope_source_field(tcfg), partial_ok=hybrid)
    if problem:
        findings.err(problem[0], problem[1], file=tcfg_path)
    if rope_theta_problem(t_rope, rope_source_field(tcfg)):  # no base to compare with (named above)
        return
    t_theta, t_scaling = legacy_rope_fields(t_rope)
    if abs(c.rope_theta - t_theta) > 1e-6 * max(1.0, t_theta):
        findings.err("rope_theta", f"{c.rope_theta:g} != target rope_theta {t_theta:g}")
    if _rope_scaling_key(c.rope_scaling) != _rope_scaling_key(t_scaling):
        findings.err("rope_scaling", f"{c.rope_scaling} != target rope_scaling {t_scaling}")


def _lint_hidden_size(findings: _Findings, c: DrafterConfig, t_hidden: int) -> None:
    if c.hidden_size != t_hidden:
        findings.warn("hidden_size", f"{c.hidden_size} != target hidden_size {t_hidden}: the block embeddings come "
                                     f"from the target's table, so they must match")
        if c.hidden_size != t_hidden:
            findings[-1].level = "error"


MAX_MISSING_LISTED = 20  # missing or unexpected tensors named one per line by `inspect`; the rest are counted


def _lint_tensors(findings: _Findings, c: DrafterConfig, tensors: dict, ckpt: Path) -> set[str]:
    """Every expected tensor present with its shape, no other, one dtype (the config's): returns the dtypes seen."""
    expected = expected_drafter_shapes(c)
    missing = [name for name in expected if name not in tensors]
    for name in missing[:MAX_MISSING_LISTED]:
        findings.err(name, "missing tensor", file=ckpt)
    if len(missing) > MAX_MISSING_LISTED:  # a config naming far more layers than the weights hold: a count, not a flood
        findings.err("num_hidden_layers", f"{len(missing) - MAX_MISSING_LISTED} more tensors missing "
                                          f"({len(missing)} of {len(expected)} expected)")
    for name, shape in expected.items():
        if name in tensors and tensors[name][0] != shape and name != "fc.weight":
            findings.err(name, f"shape {tensors[name][0]} != expected {shape}", file=tensors[name][2])
    unexpected = sorted(set(tensors) - set(expected))
    for name in unexpected[:MAX_MISSING_LISTED]:
        findings.err(name, "unexpected tensor (embedding and LM head belong to the target)", file=tensors[name][2])
    if len(unexpected) > MAX_MISSING_LISTED:  # a file of thousands of foreign tensors: a count, not a flood
        findings.err("weights", f"{len(unexpected) - MAX_MISSING_LISTED} more unexpected tensors "
                                f"({len(unexpected)} in all)", file=ckpt)
    integer = [name for name in expected if name in tensors and tensors[name][1] in INTEGER_DTYPES]
    if integer:  # one finding, not one per tensor
        more = f" ({len(integer)} such tensors)" if len(integer) > 1 else ""
        findings.err(integer[0], f"stored as {tensors[integer[0]][1]}: a drafter's weights are floating point{more}",
                     file=tensors[integer[0]][2])
    dtypes = {t[1] for t in tensors.values()}
    if len(dtypes) > 1:
        odd = sorted(tensors, key=lambda n: tensors[n][1])
        findings.err(odd[0], f"mixed tensor dtypes {sorted(dtypes)}", file=tensors[odd[0]][2])
    want_dtype = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(c.torch_dtype)
    if want_dtype and dtypes and dtypes != {want_dtype}:
        findings.warn("torch_dtype", f"config says {c.torch_dtype} but tensors are {sorted(dtypes)}")
    return dtypes


def _pair_summary(ckpt: Path, tcfg: dict, tcfg_path: Path, c: DrafterConfig, tensors: dict,
                  dtypes: set[str]) -> dict[str, Any]:
    return {
        "drafter": str(ckpt),
        "target": str(tcfg_path),
        "target architecture": tcfg.get("architectures", ["?"])[0],
        "target layers / hidden": f"{tcfg['num_hidden_layers']} / {tcfg['hidden_size']}",
        "drafter kind": (f"DFlash 2 (conv kernel {c.conv_kernel_size}, group {c.conv_group_size}; selector rank "
                         f"{c.selector_rank}, top-{c.selector_top_k})" if c.is_dflash2 else "DFlash"),
        "drafter layers / hidden": f"{c.num_hidden_layers} / {c.hidden_size}",
        "heads / kv heads / head_dim": f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}",
        "block_size": c.block_size,
        "target_layer_ids (HF hidden_states index = id+1)": c.target_layer_ids,
        "mask_token_id": c.mask_token_id,
        "rope": c.rope_parameters,
        "attention": _attention_summary(c),
        "input_embedding_scale / output_multiplier / final_logit_softcapping":
            f"{c.input_embedding_scale:g} / {c.output_multiplier:g} / {c.final_logit_softcapping}",
        "drafter parameters": sum(_numel(t[0]) for t in tensors.values()),
        "dtypes": ", ".join(sorted(dtypes)),
    }


# What `inspect` says a drafter directory must hold when it holds none of it (DESIGN.md, the checkpoint contract).
DRAFTER_DIRECTORY = ("a drafter directory holds config.json (architectures [\"DFlashDraftModel\"], block_size, "
                     "num_target_layers, dflash_config {mask_token_id, target_layer_ids}, the Qwen3 layer fields) "
                     "and model.safetensors (fc, hidden_norm, norm, layers.*; no embedding or LM head)")


def lint_pair(drafter_path, target_path) -> tuple[list[Finding], dict[str, Any]]:
    """All contract rules between a drafter checkpoint and its target. Returns findings and a summary dict."""
    ckpt = resolve_source(drafter_path)
    cfg_path = ckpt / "config.json"
    if ckpt.is_dir() and not cfg_path.exists():
        raise DFlashError(f"not a DFlash drafter checkpoint (no config.json): {DRAFTER_DIRECTORY}", path=ckpt)
    findings = _Findings(cfg_path)
    raw = read_json_object(cfg_path)
    tcfg, tcfg_path = read_target_config(target_path)
    _lint_target_weights(findings, tcfg, tcfg_path)
    tensors = _drafter_tensor_headers(ckpt)
    fc_shape = tensors.get("fc.weight", ((), None, None))[0]
    try:
        c = parse_drafter_config(raw, cfg_path, fc_shape[1] if len(fc_shape) == 2 else None)
    except DFlashError as e:
        findings.err(e.field or "config", e.message)
        return list(findings), {}

    _lint_dflash_keys(findings, raw, c)
    _lint_target_fit(findings, c, tcfg, fc_shape, tensors)
    _lint_rope(findings, c, tcfg, tcfg_path)
    _lint_hidden_size(findings, c, tcfg["hidden_size"])
    dtypes = _lint_tensors(findings, c, tensors, ckpt)
    return list(findings), _pair_summary(ckpt, tcfg, tcfg_path, c, tensors, dtypes)


DFLASH_CONFIG_KEYS = {"block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
                      "final_logit_softcapping", "is_causal", *DFLASH2_KEYS}


def _rope_scaling_key(scaling: dict | None):
    """rope_scaling compared by meaning: the legacy `type` alias dropped, numbers as floats."""
    if not scaling:
        return None
    return sorted((k, float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                  for k, v in scaling.items() if k != "type")


def _attention_summary(c: DrafterConfig) -> str:
    kinds = []
    for i in range(c.num_hidden_layers):
        w = c.layer_window(i)
        kinds.append(("causal" if c.layer_causal(i) else "bidirectional") + (f", window {w}" if w else ""))
    if len(set(kinds)) == 1:
        return f"all layers {kinds[0]}"
    return "; ".join(f"layer {i}: {k}" for i, k in enumerate(kinds))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def load_drafter(path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a z-lab / ModelOpt drafter checkpoint directory (single or sharded safetensors)."""
    config, state = read_drafter_checkpoint(path)
    model = DFlashDrafter(config)
    model.load_state_dict(state, strict=True)
    target_dtype = dtype or getattr(torch, config.torch_dtype, torch.float32)
    model = model.to(target_dtype).eval()
    # The stored tensors were found finite as they were read (weights.load_state_dict); a cast to a dtype of smaller
    # range (float32 -> float16) turns values beyond it into inf, so the weights cast so are checked again.
    for name, p in model.named_parameters():
        held = state[name].dtype
        if narrows(p.dtype, held):
            check_finite(p, resolve_source(path), name, f" once cast to {dtype_name(p.dtype)} (stored as "
                                                        f"{dtype_name(held)})")
    return model
