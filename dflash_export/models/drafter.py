"""The DFlash drafter in PyTorch: the yardstick every compiled engine is measured against.

Written by hand because no library carries it (transformers has no DFlash model). The math is DESIGN.md's:

    ctx = hidden_norm(fc(concat(taps)))                       once per new context token
    x = target.embed(block) * input_embedding_scale
    per layer:  x_n = input_layernorm(x)
                q = q_norm(q_proj(x_n))
                k = k_norm([k_proj(ctx); k_proj(x_n)]),  v = [v_proj(ctx); v_proj(x_n)]
                RoPE at absolute positions, attention over context + block (see `attention_mask`), GQA
                x = x + o_proj(attn);  x = x + mlp(post_attention_layernorm(x))
    hidden = norm(x);  draft logits = softcap(target.lm_head(hidden[:, 1:]) * output_multiplier)

Attention is non-causal over all context and the whole block, except as z-lab's release (dflash 0.1.0) has it:
`sliding_attention` layers are causal (unless the config's top-level `is_causal` says otherwise) and see only keys
less than `sliding_window` positions away; a top-level `is_causal: true` makes every layer causal.

Context K/V (after k_norm and RoPE) are kept in a `ContextCache` across steps; the block's K/V are not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_export.decoding.sampling import probs_from_logits, sample_from
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_dir
from dflash_export.models.config import DFlashSpec, DrafterConfig
from dflash_export.models.rope import rope_inverse_frequencies


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the activation dtype (DESIGN.md: numerics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """RoPE tables from transformers' own initializers (models/rope.py says which types are honoured)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(config.rope_parameters, config.head_dim,
                                                   config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scale)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin [B, S, head_dim]."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [B, S, D] (rotate-half convention, as HF Qwen3/LLaMA)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class ContextCache:
    """Per-layer context K/V [B, kv_heads, T, D] after k_norm + RoPE, plus their positions [B, T]."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.window = c.layer_window(layer_idx)
        self.causal = c.layer_causal(layer_idx)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of new context features (k_norm on context keys too), RoPE'd at their own positions."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(ctx), self.num_kv_heads)

    def forward(self, x_n, cos, sin, k_ctx, v_ctx, q_positions, k_positions) -> torch.Tensor:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x_n), self.num_heads)), cos, sin)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x_n), self.num_kv_heads)), cos, sin)
        v_blk = self._heads(self.v_proj(x_n), self.num_kv_heads)
        k = torch.cat([k_ctx, k_blk], dim=2) if k_ctx is not None else k_blk
        v = torch.cat([v_ctx, v_blk], dim=2) if v_ctx is not None else v_blk
        mask = attention_mask(q_positions, k_positions, self.causal, self.window)
        out = block_attention(q, k, v, self.scale, mask)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool, window: int | None
                   ) -> torch.Tensor | None:
    """Which keys each block query sees, [B, 1, S, T] bool (None: all), from absolute positions.

    As z-lab's release: causal layers see keys at or before the query; a window keeps keys less than `window`
    positions behind the query (and, in a non-causal layer, less than `window` ahead of it).
    """
    if not causal and window is None:
        return None
    delta = q_positions[:, None, :, None] - k_positions[:, None, None, :]  # query minus key position
    visible = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        visible &= delta >= 0
    if window is not None:
        visible &= delta < window
        if not causal:
            visible &= -delta < window
    return visible


def block_attention(q, k, v, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal GQA attention. q [B, H, S, D]; k, v [B, KVH, T, D]; softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedDynamicCausalConv(nn.Module):
    """DFlash 2's convolution along the block (z-lab's GroupedDynamicCausalConv): slot t mixes slots t, t-1, ...,
    t-K+1 of the block (zeros before the anchor), channel c of group g with weight base[o, c] + dynamic[t, o, g],
    the dynamic part projected from the (normed) layer input. `prepare` convolves the sublayer's input with
    base_kernel[0]; `finish` convolves its output with base_kernel[1] and the second half of the same projection."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [B, L, H]; dynamic [B, L, K, G]; base [K, H] -> [B, L, H]."""
        b, length, h = x.shape
        blocks = x.view(b, length, self.groups, self.group_size)
        out = torch.zeros_like(blocks)
        for o in range(self.kernel_size):
            # shifted o slots later, zeros before the anchor (pad, then cut back: exact for blocks shorter than K)
            shifted = blocks if o == 0 else F.pad(blocks, (0, 0, 0, 0, o, 0))[:, :length]
            weight = base[o].view(1, 1, self.groups, self.group_size) + dynamic[:, :, o, :, None]
            out = out + weight * shifted
        return out.view(b, length, h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self.convolve(x, dyn[..., 0, :, :], self.base_kernel[0]), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """DFlash 2's proposal over the top-k draft tokens of each slot (z-lab's CandidateSelector): a walk along the
    block where slot i scores its candidates c by
        logit(c) + sum_r predecessor_codebook[prev, r] * hidden_projection(h_i)[r] * successor_codebook[c, r]
    with prev the token chosen at slot i-1 (the anchor for slot 1): argmax when greedy, a draw from
    softmax(scores / T) when sampling (no top-k / top-p: z-lab's selector ignores them)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, temperature: float,
               uniforms=None) -> tuple[np.ndarray, np.ndarray | None]:
        """hidden [n, H], logits [n, V] of one block -> draft tokens [n] and, when sampling, their draft
        distributions [n, V] (float64, the selector's q on its candidates, 0 elsewhere) drawn with `uniforms`[n]."""
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()
        succ = self.successor_codebook.weight.float()
        pred_code = self.predecessor_codebook.weight.float()
        prev = int(anchor)
        tokens = np.zeros(len(logits), np.int64)
        probs = None if temperature <= 0 else np.zeros((len(logits), logits.shape[-1]), np.float64)
        for i in range(len(logits)):
            scores = unary[i] + (succ[candidates[i]] @ (pred_code[prev] * proj[i]))
            if temperature <= 0:
                index = int(torch.argmax(scores))
            else:
                x = scores.double() / temperature
                if not torch.isfinite(x).all():  # T so small the quotient overflows: the scores less their maximum
                    x = (scores.double() - scores.double().max()) / temperature
                q = torch.softmax(x, dim=-1).numpy()
                index = sample_from(q, uniforms[i])
                probs[i, candidates[i].numpy()] = q
            prev = int(candidates[i, index])
            tokens[i] = prev
        return tokens, probs


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)
        if config.is_dflash2:
            args = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.attention_conv = GroupedDynamicCausalConv(*args)
            self.mlp_conv = GroupedDynamicCausalConv(*args)


class DFlashDrafter(nn.Module):
    """State-dict keys are exactly the z-lab checkpoint's (no `model.` prefix, no embedding, no LM head)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(config)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def spec(self, block_size: int | None = None) -> DFlashSpec:
        """The DFlash constants of this drafter drafting blocks of `block_size` (None: its own)."""
        return DFlashSpec.resolve(self.config, block_size)

    def new_cache(self) -> ContextCache:
        return ContextCache(len(self.layers))

    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, S, n*H_target] (concatenated target layer outputs) -> ctx [B, S, H], in the drafter's dtype."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx: torch.Tensor | None = None,
        ctx_positions: torch.Tensor | None = None,
        cache: ContextCache | None = None,
    ) -> torch.Tensor:
        """One bidirectional pass over a block.

        block_embeds [B, bs, H] (target embeddings of anchor + masks), block_positions [B, bs];
        ctx [B, S_new, H] projected features of the context tokens not yet in `cache`, at ctx_positions [B, S_new].
        The new context K/V are appended to `cache` (when given). Returns norm(h) [B, bs, H].
        """
        x = block_embeds
        cos, sin = self.rotary(block_positions, x.dtype)
        if ctx is not None and ctx.shape[1] > 0:
            c_cos, c_sin = self.rotary(ctx_positions, x.dtype)
        else:
            ctx = None
        k_positions = block_positions
        if cache is not None and ctx is not None:
            cache.positions = (ctx_positions if cache.positions is None
                               else torch.cat([cache.positions, ctx_positions], 1))
        if cache is not None and cache.positions is not None:
            k_positions = torch.cat([cache.positions, block_positions], dim=1)
        elif ctx is not None:
            k_positions = torch.cat([ctx_positions, block_positions], dim=1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k_ctx = v_ctx = None
            if ctx is not None:
                k_ctx, v_ctx = attn.context_kv(ctx, c_cos, c_sin)
            if cache is not None:
                if k_ctx is not None:
                    k_ctx, v_ctx = cache.append(i, k_ctx, v_ctx)
                else:
                    k_ctx, v_ctx = cache.keys[i], cache.values[i]
            if self.config.is_dflash2:  # DFlash 2: the block convolutions around attention and MLP
                x_n, dyn = layer.attention_conv.prepare(layer.input_layernorm(x))
                x = x + layer.attention_conv.finish(
                    attn(x_n, cos, sin, k_ctx, v_ctx, block_positions, k_positions), dyn)
                x_n, dyn = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
                x = x + layer.mlp_conv.finish(layer.mlp(x_n), dyn)
                continue
            x = x + attn(layer.input_layernorm(x), cos, sin, k_ctx, v_ctx, block_positions, k_positions)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def draft_logits(
        self,
        target,
        taps: torch.Tensor | None,
        ctx_positions: torch.Tensor | None,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        cache: ContextCache | None = None,
    ) -> torch.Tensor:
        """Block logits from context taps, block ids and positions: [B, bs-1, V] for block slots 1..bs-1.

        `target` supplies the shared embedding and LM head (`embed`, `lm_head`). Drafter and target may differ in
        dtype (a drafter stored in half precision next to an fp32 target): the boundary casts both ways.
        """
        return self.draft_step(target, taps, ctx_positions, block_ids, block_positions, cache)[0]

    def draft_step(self, target, taps, ctx_positions, block_ids, block_positions, cache=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `draft_logits`, also returning the normed hidden states of slots 1..bs-1 [B, bs-1, H] (DFlash 2's
        candidate selector reads them)."""
        ctx = self.project_context(taps) if taps is not None else None
        embeds = target.embed(block_ids) * self.config.input_embedding_scale
        hidden = self(embeds.to(self.fc.weight.dtype), block_positions, ctx, ctx_positions, cache)[:, 1:]
        return self.scale_logits(target.lm_head(hidden.to(embeds.dtype))), hidden

    def propose(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: int, temperature: float, top_k: int = 0,
                top_p: float = 1.0, uniforms=None) -> tuple[np.ndarray, np.ndarray | None]:
        """Draft tokens [n] for one block from its logits [n, V] (and hidden [n, H]), plus their draft distributions
        [n, V] (float64) when sampling: argmax / temperature-top-k-top-p draws for DFlash, the candidate selector's
        walk for DFlash 2. `uniforms` [>= n] drive the draws."""
        if self.config.is_dflash2:
            return self.candidate_selector.select(hidden, logits, anchor, temperature, uniforms)
        if temperature <= 0:
            return torch.argmax(logits.float(), dim=-1).numpy(), None
        probs = probs_from_logits(logits.double().numpy(), temperature, top_k, top_p)
        return np.array([sample_from(p, u) for p, u in zip(probs, uniforms)], np.int64), probs

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`output_multiplier`, then `final_logit_softcapping` (c * tanh(x / c)) when set and > 0, as z-lab."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping and c.final_logit_softcapping > 0:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


def save_drafter(model: DFlashDrafter, path, max_shard_bytes: int | None = None) -> None:
    """Write `config.json` + `model.safetensors` (or shards + index) in the z-lab format, atomically."""
    import json

    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "")
    with atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        if max_shard_bytes is None:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            shards: list[dict[str, torch.Tensor]] = [{}]
            size = 0
            for k, v in state.items():
                nbytes = v.numel() * v.element_size()
                if shards[-1] and size + nbytes > max_shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][k] = v
                size += nbytes
            weight_map = {}
            n = len(shards)
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(v.numel() * v.element_size() for v in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def check_drafter_fits(drafter: DFlashDrafter, target, where: str = "drafter") -> None:
    """The shape contract between a drafter and a target; DFlashError naming the field that disagrees."""
    c = drafter.config
    if c.target_hidden_size != target.hidden_size:
        raise DFlashError(f"drafter expects target hidden size {c.target_hidden_size}, target has "
                          f"{target.hidden_size}", path=where, field="target_hidden_size")
    if c.hidden_size != target.hidden_size:
        raise DFlashError(f"drafter hidden size {c.hidden_size} != target embedding width {target.hidden_size}",
                          path=where, field="hidden_size")
    # The drafter embeds and reads out through the target's tables, so its own vocab_size sizes only DFlash-2's
    # selector codebooks, indexed by the target's token ids (z-lab's model reads it nowhere else).
    if c.is_dflash2 and c.vocab_size != target.vocab_size:
        raise DFlashError(f"drafter vocab {c.vocab_size} != target vocab {target.vocab_size} (the selector's "
                          "codebooks are indexed by the target's token ids)", path=where, field="vocab_size")
    if any(not 0 <= t < target.num_layers for t in c.target_layer_ids):
        raise DFlashError(f"target_layer_ids {c.target_layer_ids} outside the target's {target.num_layers} layers",
                          path=where, field="dflash_config.target_layer_ids")
    if not 0 <= c.mask_token_id < target.vocab_size:
        raise DFlashError(f"mask_token_id {c.mask_token_id} outside the target vocabulary", path=where,
                          field="dflash_config.mask_token_id")


def is_drafter_dir(d) -> bool:
    """Whether `d` holds a drafter checkpoint (config.json + safetensors), the only directory `train --out` may
    replace."""
    d = Path(d)
    return (d / "config.json").is_file() and ((d / "model.safetensors").is_file()
                                              or (d / "model.safetensors.index.json").is_file())
