"""A synthetic Qwen3 stack with random weights and the shapes it is built at, for the one-shot GPU check's timings
(`gpu_check.py`) and its losslessness sections (`gpu_lossless.py`). Torch only, no transformers: the GPU image's
version is not ours to pin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class Shapes:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = 151936
    drafter_layers: int = 5
    target_layers: int = 4          # of Qwen3-8B's 36: enough for a per-layer ratio, small enough to fit the budget
    block: int = 16
    context: int = 512              # tokens already in the caches
    sdpa_contexts: tuple[int, ...] = (512, 2048, 8192)
    dtype: str = "bfloat16"
    iters: int = 20
    warmup: int = 5



def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_tables(positions: torch.Tensor, head_dim: int, dtype, theta: float = 1e6):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    f = positions.float()[:, None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Qwen3Layers:
    """Random-weight Qwen3 decoder layers (q/k norms, GQA, SwiGLU) in one dtype on one device."""

    def __init__(self, s: Shapes, n_layers: int, device, dtype, seed: int):
        # generated on the device: drawing ~3e9 numbers on one CPU core would take most of the time budget
        g = torch.Generator(device=device).manual_seed(seed)
        H, D, KVH, I = s.hidden, s.head_dim, s.kv_heads, s.intermediate

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5).to(dtype)

        self.s, self.layers = s, []
        for _ in range(n_layers):
            self.layers.append({
                "q": w(s.heads * D, H), "k": w(KVH * D, H), "v": w(KVH * D, H), "o": w(H, s.heads * D),
                "gate": w(I, H), "up": w(I, H), "down": w(H, I),
                "in_norm": torch.ones(H, device=device, dtype=dtype), "post_norm": torch.ones(H, device=device,
                                                                                              dtype=dtype),
                "q_norm": torch.ones(D, device=device, dtype=dtype), "k_norm": torch.ones(D, device=device,
                                                                                          dtype=dtype),
            })
        self.final_norm = torch.ones(H, device=device, dtype=dtype)
        self.lm_head = w(s.vocab, H)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.s.head_dim).transpose(1, 2)

    def qkv(self, lw: dict, x_n: torch.Tensor, cos, sin):
        s = self.s
        q = _rope(_rms(self.heads(F.linear(x_n, lw["q"]), s.heads), lw["q_norm"]), cos, sin)
        k = _rope(_rms(self.heads(F.linear(x_n, lw["k"]), s.kv_heads), lw["k_norm"]), cos, sin)
        v = self.heads(F.linear(x_n, lw["v"]), s.kv_heads)
        return q, k, v

    def finish(self, lw: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, -1), lw["o"])
        h = _rms(x, lw["post_norm"])
        return x + F.linear(F.silu(F.linear(h, lw["gate"])) * F.linear(h, lw["up"]), lw["down"])


def drafter_step(model: Qwen3Layers, x: torch.Tensor, ctx_kv: list, cos, sin, attention: Callable) -> torch.Tensor:
    """One DFlash drafter pass: every layer attends (non-causally) over injected context K/V + the tokens of x."""
    for lw, (k_ctx, v_ctx) in zip(model.layers, ctx_kv):
        q, k, v = model.qkv(lw, _rms(x, lw["in_norm"]), cos, sin)
        x = model.finish(lw, x, attention(q, k_ctx, v_ctx, k, v))
    return F.linear(_rms(x, model.final_norm), model.lm_head)


def target_step(model: Qwen3Layers, x: torch.Tensor, caches: list, past: int, cos, sin, mask) -> torch.Tensor:
    """Target forward of x's tokens over a static KV cache holding `past` tokens; logits for every position."""
    t = x.shape[1]
    for lw, (kc, vc) in zip(model.layers, caches):
        q, k, v = model.qkv(lw, _rms(x, lw["in_norm"]), cos, sin)
        kc[:, :, past:past + t] = k
        vc[:, :, past:past + t] = v
        attn = F.scaled_dot_product_attention(q, kc[:, :, :past + t], vc[:, :, :past + t], attn_mask=mask,
                                              enable_gqa=True)
        x = model.finish(lw, x, attn)
    return F.linear(_rms(x, model.final_norm), model.lm_head)
