"""RoPE settings of a `config.json`, read the way transformers 5 reads them, and the ones this project can honour.

A config may carry the base and scaling as `rope_theta` + `rope_scaling` (transformers 4) or inside `rope_parameters`
(written by transformers 5, often without a top-level `rope_theta`). Reading only one of the two silently falls back to
the default base, which runs and quietly lowers acceptance; so both go through transformers' own config class, which
standardizes them into one dict `{rope_type, rope_theta, ...scaling}`.

Honoured: types whose inverse frequencies are fixed at load (`STATIC_ROPE_TYPES`): exact cos/sin tables in every graph.
Refused by name: types that change with the sequence length (`dynamic`, `longrope`), per-layer-type RoPE, partial
rotary factors, and anything transformers does not know.
"""

from __future__ import annotations

import copy

from dflash_export.decoding.request import is_finite_number, is_int, is_number, is_positive_number, shown
from dflash_export.errors import DFlashError
from dflash_export.models.arch import ARCHS, CONFIG_CLASSES
from dflash_export.models.config import MAX_CONTEXT_LENGTH
from dflash_export.models.hfutil import quiet_transformers

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def hf_config(cfg: dict, path, model_type: str = "qwen3"):
    """`cfg` through transformers' config class for `model_type` (Qwen3Config for every DFlash drafter, as z-lab's
    release loads them). A value transformers rejects is a DFlashError naming the file and field."""
    import transformers

    quiet_transformers()
    arch = ARCHS.get(model_type)
    cls_name = CONFIG_CLASSES.get(model_type) or (arch.hf_architecture if arch else "Qwen3ForCausalLM").replace(
        "ForCausalLM", "Config")
    cls = getattr(transformers, cls_name)
    # a copy: transformers standardizes the RoPE settings in place (a legacy rope_scaling gains rope_type), and `cfg`
    # is read as config.json spells it afterwards
    fields = copy.deepcopy({k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                                      "transformers_version")})
    try:
        return cls.from_dict(fields)
    except Exception as e:  # huggingface_hub's strict-dataclass errors, ValueError/KeyError from rope validation
        msg = " ".join(str(e).split())
        raise DFlashError(f"transformers cannot read this config ({msg[:300]})", path=path,
                          field=_rejected_field(msg, cfg)) from None


def _rejected_field(msg: str, cfg: dict) -> str:
    """The key of `cfg` that transformers' config class rejected, from its error text: the field a strict-dataclass
    field error names ("Validation error for field 'num_experts': ..."), the RoPE settings for its RoPE validator's
    errors and RoPE errors naming them; "config" when the text names no key."""
    import re

    named = re.match(r"Validation error for field '([^']+)'", msg)
    if named:
        return named.group(1)
    if "'validate_rope'" in msg:
        return rope_source_field(cfg)
    return next((k for k in ("rope_parameters", "rope_scaling", "rope_theta") if k in msg), "config")


def rope_source_field(cfg: dict) -> str:
    """The key a config's RoPE settings came from, for error messages."""
    if isinstance(cfg.get("rope_parameters"), dict):
        return "rope_parameters"
    return "rope_scaling" if cfg.get("rope_scaling") else "rope_theta"


def rope_parameters_of(cfg: dict, path, model_type: str = "qwen3") -> dict:
    """The standardized RoPE dict of a config dict (`rope_type` and `rope_theta` always present)."""
    params = dict(hf_config(cfg, path, model_type).rope_parameters or {})
    params.pop("type", None)  # transformers keeps the legacy alias next to rope_type
    return params


def _per_layer_type(params: dict) -> bool:
    """Whether standardized RoPE parameters are given per layer type ({"full_attention": {...}, ...})."""
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def _each_layer_type(params: dict) -> list[dict]:
    """The RoPE parameter dicts to check: each layer type's, or `params` itself."""
    return list(params.values()) if _per_layer_type(params) else [params]


def _partial_rotary_field(cfg: dict) -> str:
    """The key config dict `cfg` gives its partial rotary factor under."""
    nested = isinstance(cfg.get("rope_parameters"), dict) and "partial_rotary_factor" in cfg["rope_parameters"]
    return "rope_parameters.partial_rotary_factor" if nested else "partial_rotary_factor"


def _given(v) -> str:
    """A refused setting as a message quotes it: as Python spells it, an integer of JSON's unbounded length cut to
    its first and last digits (decoding.request.shown)."""
    return shown(v) if is_int(v) else repr(v)


def rope_theta_problem(params: dict, field: str = "rope_parameters") -> tuple[str, str] | None:
    """(field, reason) when the RoPE base of these standardized parameters (of each layer type's, when per layer type)
    is not a positive finite number: a base of 0, below 0 or NaN makes every cos/sin table NaN, one that is not a
    number cannot be computed with. `field`: the key the settings came from (`rope_source_field`)."""
    name = "rope_parameters.rope_theta" if field == "rope_parameters" else "rope_theta"
    for p in _each_layer_type(params):
        theta = p.get("rope_theta", 10000.0)
        if not is_positive_number(theta):
            return name, f"expected a positive number (the RoPE base), got {_given(theta)}"
    return None


# The scaling settings of the RoPE types with tables (transformers' rope init functions): those the tables divide by
# or take the logarithm of must be positive, the others finite, where given; 0 or NaN makes every table non-finite.
_POSITIVE_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                       "original_max_position_embeddings")
_FINITE_ROPE_KEYS = ("attention_factor", "mscale", "mscale_all_dim")


def rope_scaling_problem(params: dict, field: str = "rope_parameters") -> tuple[str, str] | None:
    """(field, reason) when a scaling setting of these standardized RoPE parameters (of each layer type's, when per
    layer type) would make the cos/sin tables non-finite: a factor or correction bound of 0, below 0, NaN or not a
    number, a finite setting that is not, llama3's two frequency factors equal (its smoothing divides by their
    difference); or an original context past config.MAX_CONTEXT_LENGTH. `field`: the key the settings came from
    (`rope_source_field`)."""
    for p in _each_layer_type(params):
        if p.get("rope_type", "default") == "default":
            continue
        for key in _POSITIVE_ROPE_KEYS + _FINITE_ROPE_KEYS:
            v = p.get(key)
            if v is None:
                continue
            if key == "original_max_position_embeddings" and is_number(v) and v > MAX_CONTEXT_LENGTH:
                return f"{field}.{key}", f"{shown(v)}: more than the {MAX_CONTEXT_LENGTH} this project reads"
            if key in _POSITIVE_ROPE_KEYS and not is_positive_number(v):
                return f"{field}.{key}", f"expected a positive number, got {_given(v)}"
            if key in _FINITE_ROPE_KEYS and not is_finite_number(v):
                return f"{field}.{key}", f"expected a finite number, got {_given(v)}"
        if p.get("rope_type") == "llama3" and p.get("low_freq_factor") == p.get("high_freq_factor") is not None:
            return (f"{field}.high_freq_factor", f"equals low_freq_factor ({p['low_freq_factor']!r}): llama3's "
                    "smoothing divides by their difference")
    return None


def rope_type_problem(params: dict, cfg: dict, field: str = "rope_parameters") -> tuple[str, str] | None:
    """(field, reason) when the RoPE type of these standardized parameters (of each layer type's, when per layer type)
    is none transformers has tables for: its model classes then fail as they are made, with nothing but the type's
    name (a KeyError). `cfg`: the config dict, for the key the type is spelled under (`type`, the legacy alias, in a
    `rope_scaling` that has no `rope_type`); `field`: the key the settings came from (`rope_source_field`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ("default", *ROPE_INIT_FUNCTIONS)
    for p in _each_layer_type(params):
        kind = p.get("rope_type", "default")
        if isinstance(kind, str) and kind in known:
            continue
        given = cfg.get(field)
        key = "type" if isinstance(given, dict) and "rope_type" not in given and "type" in given else "rope_type"
        return f"{field}.{key}", f"{kind!r} is not a RoPE type transformers knows (known: {', '.join(known)})"
    return None


def rotary_dim_problem(params: dict, head_dim: int, cfg: dict) -> tuple[str, str] | None:
    """(field, reason) when RoPE would turn an odd number of each head's channels: it turns them in pairs (rotate-half
    pairs channel i with i + dim / 2), so transformers' tables then hold one channel more than it turns and the model
    fails at its first forward pass. `head_dim`: the head size transformers' attention takes (config.json's head_dim,
    else hidden_size / num_attention_heads); the partial rotary factor of `params` (checked by
    `partial_rotary_problem` first) takes its share of it. The field is head_dim, or the factor's key where the factor
    makes an even head size's share odd."""
    factor = params.get("partial_rotary_factor", 1.0)
    if not is_number(factor) or int(head_dim * factor) % 2 == 0:
        return None
    if head_dim % 2:
        how = "" if cfg.get("head_dim") is not None else " (absent: hidden_size / num_attention_heads)"
        return "head_dim", f"{head_dim}{how} is odd, but RoPE turns a head's channels in pairs"
    return (_partial_rotary_field(cfg),
            f"{factor} of head_dim {head_dim} is {int(head_dim * factor)} channels, an odd number, but RoPE turns a "
            "head's channels in pairs")


def partial_rotary_problem(params: dict, cfg: dict) -> tuple[str, str] | None:
    """(field, reason) when the partial rotary factor of the standardized parameters `params` of config dict `cfg` is
    given but is not a number in [0, 1]: the fraction of each head's channels RoPE turns, which transformers' rotary
    module multiplies the head size by (None, a string or a negative factor fail as it loads the model; above 1 it
    turns more channels than a head has). The field is the key `cfg` gives it under."""
    factor = params.get("partial_rotary_factor", 1.0)
    if is_number(factor) and 0 <= factor <= 1:
        return None
    return (_partial_rotary_field(cfg),
            f"expected a number from 0 to 1 (the fraction of each head's channels RoPE turns), got {factor!r}")


def rope_problem(params: dict, field: str = "rope_parameters", partial_ok: bool = False) -> tuple[str, str] | None:
    """(field, reason) when these standardized RoPE parameters cannot be honoured exactly; None when they can.
    `partial_ok`: a partial rotary factor is honoured (hybrid targets' gated attention: export/linear_attention.py)."""
    theta = rope_theta_problem(params, field) or rope_scaling_problem(params, field)
    if theta:
        return theta
    if _per_layer_type(params):
        return field, f"per-layer-type RoPE ({sorted(params)}) is not supported"
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        why = ("depends on the sequence length, which fixed cos/sin tables in the exported graphs cannot follow"
               if rope_type in ("dynamic", "longrope") else "is not a RoPE type this project implements")
        return f"{field}.rope_type", f"{rope_type!r} {why} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    factor = params.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0) and not partial_ok:
        return f"{field}.partial_rotary_factor", f"{factor} (partial rotary embeddings are not supported)"
    return None


def legacy_rope_fields(params: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) equivalent to standardized `params`: the form both transformers 4 and 5 read."""
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, {k: v for k, v in params.items() if k != "rope_theta"}


def rope_inverse_frequencies(params: dict, head_dim: int, max_position_embeddings: int, path=None):
    """(inv_freq [head_dim/2] float32, attention_scaling) from transformers' own initializer for the RoPE type."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    problem = rope_problem(params)
    if problem:
        raise DFlashError(problem[1], path=path, field=problem[0])
    cfg = Qwen3Config(head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                      rope_parameters=dict(params))
    rot = Qwen3RotaryEmbedding(cfg)
    return rot.inv_freq.float(), float(rot.attention_scaling)


__all__ = ["STATIC_ROPE_TYPES", "hf_config", "rope_parameters_of", "rope_problem", "rope_source_field",
           "rope_theta_problem", "rope_scaling_problem", "rope_type_problem", "rotary_dim_problem",
           "partial_rotary_problem", "legacy_rope_fields",
           "rope_inverse_frequencies"]
