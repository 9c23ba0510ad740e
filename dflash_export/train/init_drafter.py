"""A drafter to start training from: the target's own top layers, or a trained drafter grown by identity layers."""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_export.errors import DFlashError
from dflash_export.models.config import DrafterConfig, default_target_layer_ids
from dflash_export.models.drafter import DFlashDrafter
from dflash_export.models.rope import legacy_rope_fields


def drafter_from_target(target, num_layers: int, block_size: int, mask_token_id: int,
                        target_layer_ids: Sequence[int] | None = None, *, recipe_path=None) -> DFlashDrafter:
    """A drafter whose layers are copies of the target's last `num_layers` layers, fc passing the deepest tap
    through, hidden_norm = the first copied layer's input norm (what that layer applied to the deepest tap's output in
    the target), norm = the target's final norm. Taps default to z-lab's rule. `recipe_path` names the file that a
    bad setting came from in the error line."""
    hf_cfg = target.hf.config
    n_t = target.num_layers
    if not 1 <= num_layers < n_t:
        raise DFlashError(f"draft layers must be in 1..{n_t - 1} for a {n_t}-layer target, got {num_layers}",
                          path=recipe_path, field="train.draft_layers")
    if not 0 <= mask_token_id < target.vocab_size:
        raise DFlashError(f"mask_token_id {mask_token_id} is outside the target vocabulary ({target.vocab_size})",
                          path=recipe_path, field="train.mask_token_id")
    taps = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(n_t, num_layers)
    if any(not 0 <= t < n_t for t in taps):
        raise DFlashError(f"target_layer_ids {taps} outside 0..{n_t - 1}", path=recipe_path,
                          field="train.target_layer_ids")
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    rope_theta, rope_scaling = legacy_rope_fields(dict(hf_cfg.rope_parameters or {}))  # the target's RoPE, as is
    cfg = DrafterConfig(
        hidden_size=hf_cfg.hidden_size, num_hidden_layers=num_layers, num_attention_heads=hf_cfg.num_attention_heads,
        num_key_value_heads=hf_cfg.num_key_value_heads, head_dim=head_dim,
        intermediate_size=hf_cfg.intermediate_size, rms_norm_eps=float(hf_cfg.rms_norm_eps), block_size=block_size,
        mask_token_id=mask_token_id, target_layer_ids=taps, num_target_layers=n_t, vocab_size=target.vocab_size,
        target_hidden_size=hf_cfg.hidden_size, rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=int(getattr(hf_cfg, "max_position_embeddings", 32768)),
    )
    drafter = DFlashDrafter(cfg)
    src_layers = target.hf.model.layers[n_t - num_layers:]
    with torch.no_grad():
        for dst, src in zip(drafter.layers, src_layers):
            sa, da = src.self_attn, dst.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(da, name).weight.copy_(getattr(sa, name).weight)
            for name in ("q_norm", "k_norm"):  # Qwen3 has them; LLaMA does not (then identity-like ones stay)
                if hasattr(sa, name):
                    getattr(da, name).weight.copy_(getattr(sa, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        h = cfg.hidden_size
        deepest = taps.index(max(taps))
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
        drafter.hidden_norm.weight.copy_(src_layers[0].input_layernorm.weight)
        drafter.norm.weight.copy_(target.hf.model.norm.weight)
    return drafter


def grow_drafter(drafter: DFlashDrafter, num_layers: int, *, recipe_path=None) -> DFlashDrafter:
    """`drafter` with layers appended up to `num_layers`, drafting exactly as before until trained.

    Each new layer copies the last one's weights except its two output projections (attention `o_proj`, MLP
    `down_proj`), which start at zero: the layer then adds nothing to the residual stream, so the grown drafter's
    logits equal the original's, and training adds capacity on top of what was learned instead of starting over
    (the zero-initialized-residual idea behind LoRA's B = 0 and net2net-style growth).
    """
    from dataclasses import replace

    c = drafter.config
    n = c.num_hidden_layers
    if num_layers < n:
        raise DFlashError(f"cannot grow a {n}-layer drafter to {num_layers} layers", path=recipe_path,
                          field="train.draft_layers")
    types = None if c.layer_types is None else list(c.layer_types) + [c.layer_types[-1]] * (num_layers - n)
    grown = DFlashDrafter(replace(c, num_hidden_layers=num_layers, layer_types=types))
    state = dict(drafter.state_dict())
    last = f"layers.{n - 1}."
    last_layer = {k[len(last):]: v for k, v in state.items() if k.startswith(last)}
    for i in range(n, num_layers):
        state.update({f"layers.{i}.{k}": v.clone() for k, v in last_layer.items()})
        for key in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
            if f"layers.{i}.{key}" in state:
                state[f"layers.{i}.{key}"].zero_()
    grown.load_state_dict(state)
    return grown.to(next(drafter.parameters()).dtype)
