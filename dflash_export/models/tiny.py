"""Tiny random Qwen3 / LLaMA target + drafter pairs, built from transformers configs (never downloaded).

Used by the tests and by the `tiny-*` recipes, so every stage can run end to end in seconds on a CPU.
`tiny:qwen3/target` and `tiny:qwen3/drafter` resolve to directories in the cache, built once, deterministically.
Torch is imported by the builders alone, so that a recipe's `tiny:` source is checked (split_tiny_spec) without it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_export.errors import DFlashError
from dflash_export.files import atomic_dir, cache_dir
from dflash_export.models.config import DrafterConfig
from dflash_export.models.hfutil import quiet_transformers

_VERSION = 3  # bump when the builders change so cached pairs are rebuilt


@dataclass(frozen=True)
class TinySpec:
    family: str = "qwen3"            # "qwen3" | "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    draft_layers: int = 2
    block_size: int = 4
    target_layer_ids: tuple[int, ...] = (1, 3)
    rope_theta: float = 10000.0
    seed: int = 0
    num_experts: int = 0             # qwen3_moe: experts per MoE layer
    experts_per_token: int = 2
    moe_intermediate_size: int = 32
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int = 0          # gpt_oss: layers alternate sliding (this window) and full attention; qwen3:
    #                                  use_sliding_window, layers from `max_window_layers` on windowed
    max_window_layers: int = 2
    full_attention_interval: int = 0  # hybrids: every n-th layer full attention, the others Gated DeltaNet

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 1  # a reserved row that the tokenizer never emits

    @property
    def eos_token_id(self) -> int:
        return self.vocab_size - 2


TINY = {
    "qwen3": TinySpec("qwen3"),
    "llama": TinySpec("llama"),
    "qwen3-b16": TinySpec("qwen3", block_size=16),
    "qwen3-swa": TinySpec("qwen3", sliding_window=8),  # layers 0, 1 full attention, 2..5 an 8-token window
    "gpt-oss": TinySpec("gpt_oss", num_experts=8, experts_per_token=2, intermediate_size=32, sliding_window=8,
                        num_layers=4, target_layer_ids=(0, 2)),
    "qwen3-moe": TinySpec("qwen3_moe", num_experts=8, experts_per_token=2, mlp_only_layers=(2,)),
    # Hybrids: layers L L F L L F (Gated DeltaNet with 2 key heads of 16 and 4 value heads of 8, conv kernel 4;
    # gated full attention with RoPE on a quarter of each head, as published).
    "qwen3.5": TinySpec("qwen3_5", full_attention_interval=3),
    "qwen3.5-moe": TinySpec("qwen3_5_moe", full_attention_interval=3, num_experts=8, experts_per_token=2),
    "qwen3-next": TinySpec("qwen3_next", full_attention_interval=3, num_experts=8, experts_per_token=2,
                           mlp_only_layers=(2,)),
    "llama-small-vocab": TinySpec("llama", vocab_size=16, hidden_size=32, num_layers=4, head_dim=8,
                                  intermediate_size=64, target_layer_ids=(1, 2)),
}


# gpt-oss's YaRN (its factor and original length scaled down to the tiny model's 1024 positions); z-lab's drafters
# carry their target's RoPE, so the tiny drafter does too.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 256, "rope_theta": 150000.0}


def build_target(spec: TinySpec, out: Path) -> Path:
    import torch
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    quiet_transformers()
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=1024, rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=spec.family == "llama", eos_token_id=spec.eos_token_id,
        bos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(spec.seed)
    if spec.family == "qwen3":
        window = dict(use_sliding_window=True, sliding_window=spec.sliding_window,
                      max_window_layers=spec.max_window_layers) if spec.sliding_window else {}
        model = Qwen3ForCausalLM(Qwen3Config(**common, **window))
    elif spec.family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif spec.family == "gpt_oss":
        common.pop("rope_theta")
        model = GptOssForCausalLM(GptOssConfig(
            **common, num_local_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
            sliding_window=spec.sliding_window, layer_types=["sliding_attention", "full_attention"] * (
                spec.num_layers // 2), attention_bias=True,
            rope_parameters=dict(GPT_OSS_ROPE)))
    elif spec.family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1,
            mlp_only_layers=list(spec.mlp_only_layers), norm_topk_prob=True))
    elif spec.family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        model = _hybrid_target(spec, common, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                               Qwen3_5MoeForConditionalGeneration, Qwen3NextConfig, Qwen3NextForCausalLM)
    else:
        raise DFlashError(f"unknown tiny family {spec.family!r}")
    # Larger-than-init weights so the tiny model's distributions are peaked (more like a trained LM's).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and not name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(4.0)
            elif p.ndim == 3:  # experts: transformers leaves them uninitialised (torch.empty)
                p.normal_(0.0, 0.08)
            elif name.endswith(("sinks", "_bias")) or (p.ndim == 1 and "experts" in name):
                p.normal_(0.0, 0.5)  # sinks and expert biases are uninitialised too
            elif name.endswith("norm.weight") and spec.full_attention_interval:
                p.add_(0.1 * torch.randn_like(p))  # hybrids' (1 + weight) norms start at 0: make them non-trivial
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _hybrid_target(spec: TinySpec, common: dict, *classes):
    """A tiny Qwen3.5 (composite: a one-block vision tower beside the text model, as the checkpoints are published),
    Qwen3.5-MoE (composite) or Qwen3-Next (text only, MoE with a shared expert) model."""
    q35_cfg, q35_cls, q35moe_cfg, q35moe_cls, next_cfg, next_cls = classes
    n = spec.num_layers
    text = dict(common, layer_types=["full_attention" if (i + 1) % spec.full_attention_interval == 0
                                     else "linear_attention" for i in range(n)],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "partial_rotary_factor": 0.25}
    moe = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
               moe_intermediate_size=spec.moe_intermediate_size, shared_expert_intermediate_size=32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=spec.hidden_size)
    if spec.family == "qwen3_next":
        return next_cls(next_cfg(**text, **moe, rope_parameters=rope, decoder_sparse_step=1, norm_topk_prob=True,
                                 mlp_only_layers=list(spec.mlp_only_layers)))
    tie = text.pop("tie_word_embeddings")
    if spec.family == "qwen3_5_moe":
        text.pop("intermediate_size")
        cfg = q35moe_cfg(text_config={**text, **moe, "rope_parameters": rope}, vision_config=vision,
                         tie_word_embeddings=tie)
        return q35moe_cls(cfg)
    return q35_cls(q35_cfg(text_config={**text, "rope_parameters": rope}, vision_config=vision,
                           tie_word_embeddings=tie))


def build_drafter(spec: TinySpec, out: Path) -> Path:
    import torch

    from dflash_export.models.drafter import DFlashDrafter, save_drafter

    cfg = DrafterConfig(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.draft_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
        rms_norm_eps=1e-6, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids), num_target_layers=spec.num_layers, vocab_size=spec.vocab_size,
        target_hidden_size=spec.hidden_size, max_position_embeddings=1024,
        rope_theta=GPT_OSS_ROPE["rope_theta"] if spec.family == "gpt_oss" else spec.rope_theta,
        rope_scaling={k: v for k, v in GPT_OSS_ROPE.items() if k != "rope_theta"} if spec.family == "gpt_oss"
        else None,
    )
    torch.manual_seed(spec.seed + 1)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms so tests see them
            else:
                p.normal_(0.0, 0.1)
    save_drafter(model, out)
    return out


def build_pair(spec: TinySpec, root: Path) -> tuple[Path, Path]:
    from dflash_export.models.weights import cached_model_whole

    root.mkdir(parents=True, exist_ok=True)
    target, drafter = root / "target", root / "drafter"
    if not cached_model_whole(target):
        with atomic_dir(target) as tmp:
            build_target(spec, tmp)
    if not cached_model_whole(drafter):
        build_drafter(spec, drafter)
    return target, drafter


def split_tiny_spec(spec_str: str, path=None, field: str | None = "tiny") -> tuple[str, str]:
    """`tiny:qwen3/target` (or `qwen3/target`) -> ("qwen3", "target"); an unknown pair or a part other than target
    and drafter is a DFlashError naming `path` and `field`."""
    name, _, part = spec_str.removeprefix("tiny:").partition("/")
    if name not in TINY:
        raise DFlashError(f"unknown tiny pair {name!r} (known: {', '.join(TINY)})", path=path, field=field)
    if part not in ("target", "drafter"):
        raise DFlashError(f"expected tiny:{name}/target or tiny:{name}/drafter", path=path, field=field)
    return name, part


def tiny_pair_path(spec_str: str) -> Path:
    """`qwen3/target` -> the cached directory of that part of the named tiny pair (built if needed)."""
    name, part = split_tiny_spec(spec_str)
    spec = TINY[name]
    # older pairs' digests: fields added since are left out at their defaults
    fields = {k: v for k, v in spec.__dict__.items()
              if (k != "full_attention_interval" or v) and (k != "max_window_layers" or spec.sliding_window)}
    digest = hashlib.sha256(json.dumps(fields, default=list, sort_keys=True).encode()).hexdigest()[:10]
    root = cache_dir() / "tiny" / f"{name}-v{_VERSION}-{digest}"
    target, drafter = build_pair(spec, root)
    return target if part == "target" else drafter


__all__ = ["TinySpec", "TINY", "build_target", "build_drafter", "build_pair", "split_tiny_spec", "tiny_pair_path",
           "replace"]
