"""Torch reference math of the two custom ops: what the Triton kernels and TensorRT plugins are checked against.

Both functions are batched versions of what the PyTorch reference model does one sequence at a time
(`models.drafter.block_attention`, `sampling.verify_block`), written with torch ops only so they run on any device.
"""

from __future__ import annotations

import torch

# Positions of `emitted_tokens` past `n_emitted` hold this value (a token id can never be negative).
EMIT_PAD = -1


def kv_injected_block_attention_ref(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                                    v_blk: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Non-causal GQA attention of a block over injected context K/V plus the block's own K/V.

    q [B, H, S, D]; k_ctx, v_ctx [B, KVH, T, D] (T may be 0); k_blk, v_blk [B, KVH, S, D]; H % KVH == 0.
    Every block query sees all T context keys and all S block keys (no mask). Scores and softmax in fp32.
    Returns [B, H, S, D] in q's dtype. `scale` defaults to D ** -0.5.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalized `weights` [V] with uniform `u` (0-d): count of cdf entries <= u * total.

    Same rule as `sampling.sample_from` (searchsorted, side='right', clamped to V-1).
    """
    cdf = torch.cumsum(weights, dim=0)
    idx = int((cdf <= u * cdf[-1]).sum())
    return torch.tensor(min(idx, weights.shape[0] - 1))


def fused_verify_ref(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     uniforms: torch.Tensor | None = None, temperature: float = 0.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a drafted block per sequence; the op `FusedVerify`.

    target_logits [B, bs, V] (the target's prediction after each block slot, slot 0 = anchor);
    draft_tokens [B, bs-1] integer; draft_probs [B, bs-1, V] and uniforms [B, bs] float, needed when temperature > 0.
    Greedy (temperature == 0): accept_len = longest prefix where draft == argmax(target), then one target token.
    Sampling: target probs = softmax(logits / temperature) in fp32; draft i is accepted iff uniforms[i-1] * q < p
    (q, p the draft / target probability of the drafted token); on the first rejection the last token is drawn from
    normalize(max(p - q, 0)) (from p when that is all zero), otherwise the bonus is drawn from the last slot's p, both
    by inverse CDF with uniforms[bs-1].
    Returns accept_len [B] int64, emitted_tokens [B, bs] int64 (accepted drafts + one target token, then EMIT_PAD),
    n_emitted [B] int64 (= accept_len + 1).
    """
    bsz, bs, _ = target_logits.shape
    n = bs - 1
    device = target_logits.device
    accept_len = torch.zeros(bsz, dtype=torch.int64, device=device)
    emitted = torch.full((bsz, bs), EMIT_PAD, dtype=torch.int64, device=device)
    logits = target_logits.float()
    for b in range(bsz):
        drafts = draft_tokens[b].long()
        if temperature <= 0:
            target_next = logits[b].argmax(dim=-1)
            a = 0
            while a < n and drafts[a] == target_next[a]:
                a += 1
            last = target_next[a]
        else:
            p = torch.softmax(logits[b] / temperature, dim=-1)
            q = draft_probs[b].float()
            u = uniforms[b].float()
            a = 0
            while a < n and u[a] * q[a, drafts[a]] < p[a, drafts[a]]:
                a += 1
            if a < n:
                weights = torch.clamp(p[a] - q[a], min=0.0)
                if float(weights.sum()) <= 0:  # p == q: the residual's limit is p itself
                    weights = p[a]
            else:
                weights = p[n]
            last = _inverse_cdf(weights, u[n])
        accept_len[b] = a
        emitted[b, :a] = drafts[:a]
        emitted[b, a] = last
    return accept_len, emitted, accept_len + 1
