"""Triton kernel of `FusedVerify`: block acceptance (greedy or rejection sampling) without leaving the GPU.

One program per sequence streams each block row of target logits over the vocabulary in BLOCK_V tiles, so only
[accept_len, emitted_tokens, n_emitted] (a few dozen bytes) go back to the host instead of [bs, V] logits.
Semantics are exactly `reference.fused_verify_ref` (= `sampling.verify_block` without top-k / top-p).
Runs natively on CUDA and on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_export.kernels.reference import EMIT_PAD


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """First index of the maximum of row [V] (np.argmax's tie rule)."""
    best_val = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, axis=0)
        tile_idx = tl.min(tl.where(x == tile_max, offs, V), axis=0)
        better = tile_max > best_val  # strict: an earlier tile keeps ties
        best_idx = tl.where(better, tile_idx, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    return best_idx


@triton.jit
def _row_softmax_stats(row_ptr, V, inv_temp, BLOCK_V: tl.constexpr):
    """(max, sum of exp(x - max)) of x = row * inv_temp, one pass with a running rescale."""
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s


@triton.jit
def _draw_weights(logit_row, draft_row, V, inv_temp, m, s, use_residual, use_p, offs):
    """Sampling weights of one tile: residual max(p - q, 0), or p when use_p (all-zero residual) or no rejection."""
    mask = offs < V
    p = tl.exp(tl.load(logit_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp - m) / s
    # q is read only at a rejected slot: after full acceptance the draft row may not exist (n == 0)
    q = tl.load(draft_row + offs, mask=mask & ((offs * 0 + use_residual) != 0), other=0.0).to(tl.float32)
    r = tl.maximum(p - q, 0.0)
    w = tl.where((use_residual != 0) & (use_p == 0), r, p)
    return tl.where(mask, w, 0.0)


@triton.jit
def _verify_program(
    logits_ptr, draft_tok_ptr, draft_prob_ptr, unif_ptr, accept_ptr, emitted_ptr, n_emitted_ptr,
    stride_lb, stride_ls, stride_lv,
    stride_tb, stride_ts,
    stride_pb, stride_ps, stride_pv,
    stride_ub, stride_us,
    stride_eb, stride_es,
    BS, V, inv_temp,
    GREEDY: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_BS: tl.constexpr, PAD: tl.constexpr,
):
    """One sequence per program; launched directly for strided tensors and called by the TensorRT AOT kernel."""
    b = tl.program_id(0).to(tl.int64)  # batch offsets can pass 2**31 elements
    n = BS - 1
    logit_base = logits_ptr + b * stride_lb
    tok_base = draft_tok_ptr + b * stride_tb
    offs_v = tl.arange(0, BLOCK_V)
    accept = n          # first rejected slot; n when every draft is accepted
    still = 1           # no rejection seen yet
    last = 0            # the target's token (greedy)
    if GREEDY:
        for i in range(0, BS):
            target_tok = _row_argmax(logit_base + i * stride_ls, V, BLOCK_V)
            # a one-row block (prefill: n == 0) has no drafts to read
            draft_tok = tl.load(tok_base + tl.maximum(tl.minimum(i, n - 1), 0) * stride_ts, mask=i < n,
                                other=-1).to(tl.int32)
            stop = (i == n) | (draft_tok != target_tok)
            take = still * stop.to(tl.int32)
            accept = tl.where(take == 1, i, accept)
            last = tl.where(take == 1, target_tok, last)
            still = still * (1 - stop.to(tl.int32))
    else:
        unif_base = unif_ptr + b * stride_ub
        for i in range(0, n):
            row = logit_base + i * stride_ls
            m, s = _row_softmax_stats(row, V, inv_temp, BLOCK_V)
            draft_tok = tl.load(tok_base + i * stride_ts).to(tl.int64)
            p_tok = tl.exp(tl.load(row + draft_tok * stride_lv).to(tl.float32) * inv_temp - m) / s
            q_tok = tl.load(draft_prob_ptr + b * stride_pb + i * stride_ps + draft_tok * stride_pv).to(tl.float32)
            u = tl.load(unif_base + i * stride_us).to(tl.float32)
            rejected = (u * q_tok < p_tok) == 0
            take = still * rejected.to(tl.int32)
            accept = tl.where(take == 1, i, accept)
            still = still * (1 - rejected.to(tl.int32))
        # The last token: from the residual at the rejected slot, or the bonus from p at slot n.
        row = logit_base + accept * stride_ls
        draft_row = draft_prob_ptr + b * stride_pb + tl.maximum(tl.minimum(accept, n - 1), 0) * stride_ps
        use_residual = (accept < n).to(tl.int32)
        m, s = _row_softmax_stats(row, V, inv_temp, BLOCK_V)
        total = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + offs_v
            total += tl.sum(_draw_weights(row, draft_row, V, inv_temp, m, s, use_residual, 0, offs), axis=0)
        use_p = (total <= 0.0).to(tl.int32)  # p == q exactly: draw from p, the residual's limit
        if use_p == 1:
            total = 0.0
            for start in range(0, V, BLOCK_V):
                offs = start + offs_v
                total += tl.sum(_draw_weights(row, draft_row, V, inv_temp, m, s, use_residual, 1, offs), axis=0)
        threshold = tl.load(unif_base + n * stride_us).to(tl.float32) * total
        # Inverse CDF: the drawn index is the count of cdf entries <= threshold (searchsorted, side="right").
        carry = 0.0
        count = 0
        for start in range(0, V, BLOCK_V):
            offs = start + offs_v
            w = _draw_weights(row, draft_row, V, inv_temp, m, s, use_residual, use_p, offs)
            cdf = carry + tl.cumsum(w, axis=0)
            count += tl.sum(((cdf <= threshold) & (offs < V)).to(tl.int32), axis=0)
            carry += tl.sum(w, axis=0)
        last = tl.minimum(count, V - 1)
    # emitted_tokens in tiles of BLOCK_BS slots: any block size, whatever tile the kernel was compiled with
    for start in range(0, BS, BLOCK_BS):
        offs_e = start + tl.arange(0, BLOCK_BS)
        e_mask = offs_e < BS
        drafts = tl.load(tok_base + offs_e * stride_ts, mask=offs_e < n, other=0).to(tl.int64)
        emitted = tl.where(offs_e < accept, drafts, tl.where(offs_e == accept, last.to(tl.int64), PAD))
        tl.store(emitted_ptr + b * stride_eb + offs_e * stride_es, emitted, mask=e_mask)
    tl.store(accept_ptr + b, accept.to(tl.int64))
    tl.store(n_emitted_ptr + b, (accept + 1).to(tl.int64))


@triton.jit
def fused_verify_aot_kernel(
    logits_ptr, draft_tok_ptr, draft_prob_ptr, unif_ptr,
    BS, V,
    accept_ptr, emitted_ptr, n_emitted_ptr,
    INV_TEMP: tl.constexpr, GREEDY: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_BS: tl.constexpr,
    PAD: tl.constexpr,
):
    """The TensorRT AOT entry point: contiguous tensors, arguments in the plugin's order (inputs, int32 scalars,
    outputs); 1/temperature is compiled in (AOT plugins pass only int32 scalars). Grid (B,)."""
    _verify_program(logits_ptr, draft_tok_ptr, draft_prob_ptr, unif_ptr, accept_ptr, emitted_ptr, n_emitted_ptr,
                    BS * V, V, 1, BS - 1, 1, (BS - 1) * V, V, 1, BS, 1, BS, 1, BS, V, INV_TEMP,
                    GREEDY, BLOCK_V, BLOCK_BS, PAD)


def fused_verify_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        uniforms: torch.Tensor | None, temperature: float,
                        block_v: int = 1024, block_bs: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launch. Shapes, dtypes and outputs as `reference.fused_verify_ref` (checked by the dispatcher)."""
    B, BS, V = target_logits.shape
    device = target_logits.device
    greedy = temperature <= 0
    if greedy:  # the sampling inputs are not read; any valid pointer will do
        draft_probs = target_logits[:, :1, :]
        uniforms = target_logits.new_zeros((B, BS), dtype=torch.float32)
    accept = torch.empty(B, dtype=torch.int64, device=device)
    n_emitted = torch.empty(B, dtype=torch.int64, device=device)
    emitted = torch.empty((B, BS), dtype=torch.int64, device=device)
    block_v = min(block_v, triton.next_power_of_2(V))
    _verify_program[(B,)](
        target_logits, draft_tokens, draft_probs, uniforms, accept, emitted, n_emitted,
        *target_logits.stride(), *draft_tokens.stride(), *draft_probs.stride(), *uniforms.stride(), *emitted.stride(),
        BS, V, 1.0 / temperature if not greedy else 1.0,
        GREEDY=greedy, BLOCK_V=block_v, BLOCK_BS=min(block_bs, triton.next_power_of_2(BS)), PAD=EMIT_PAD,
    )
    return accept, emitted, n_emitted
