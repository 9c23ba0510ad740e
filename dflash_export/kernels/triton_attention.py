"""Triton kernel of `KVInjectedBlockAttention`: a block of queries over injected context K/V plus the block's own K/V.

One program computes BLOCK_M query rows of one (batch, head) with an online softmax (fp32 running max / sum), streaming
first the context keys and then the block keys, so the two K/V sources are never concatenated in memory (that copy is
what the op exists to avoid). GQA: query head h reads kv head h // (H // KVH). No mask: the block is non-causal.

Runs natively on CUDA and on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, n_keys, qk_scale,
                 offs_d, d_mask, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Fold `n_keys` keys starting at k_base / v_base into the running (acc, m_i, l_i) of the query tile."""
    for start in range(0, n_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_keys
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_program(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, o_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kcb, stride_kch, stride_kct, stride_kcd,
    stride_vcb, stride_vch, stride_vct, stride_vcd,
    stride_kbb, stride_kbh, stride_kbt, stride_kbd,
    stride_vbb, stride_vbh, stride_vbt, stride_vbd,
    stride_ob, stride_oh, stride_os, stride_od,
    num_heads, groups, S, T, D, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (batch x head, query tile) program; launched directly for strided tensors and called by the TensorRT AOT
    kernel."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)  # batch offsets can pass 2**31 elements
    h = pid_bh % num_heads
    kvh = h // groups
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < S
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, kc_ptr + b * stride_kcb + kvh * stride_kch,
                                 vc_ptr + b * stride_vcb + kvh * stride_vch, stride_kct, stride_kcd, stride_vct,
                                 stride_vcd, T, qk_scale, offs_d, d_mask, BLOCK_N, PRECISION)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, kb_ptr + b * stride_kbb + kvh * stride_kbh,
                                 vb_ptr + b * stride_vbb + kvh * stride_vbh, stride_kbt, stride_kbd, stride_vbt,
                                 stride_vbd, S, qk_scale, offs_d, d_mask, BLOCK_N, PRECISION)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def kv_injected_block_attention_aot_kernel(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr,
    H, KVH, S, T, D,
    o_ptr,
    QK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The TensorRT AOT entry point: contiguous tensors, arguments in the plugin's order (inputs, int32 scalars,
    outputs); the float scale is compiled in (AOT plugins pass only int32 scalars). Grid (B*H, cdiv(S, BLOCK_M))."""
    _attention_program(q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, o_ptr,
                       H * S * D, S * D, D, 1, KVH * T * D, T * D, D, 1, KVH * T * D, T * D, D, 1,
                       KVH * S * D, S * D, D, 1, KVH * S * D, S * D, D, 1, H * S * D, S * D, D, 1,
                       H, H // KVH, S, T, D, QK_SCALE, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION)


def launch_config(S: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): tiles of at least 16 (tl.dot's minimum on GPU), powers of two."""
    block_m = min(64, max(16, triton.next_power_of_2(S)))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = 64 if block_d <= 128 else 32
    return block_m, block_n, block_d


def kv_injected_block_attention_triton(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                                       v_blk: torch.Tensor, scale: float | None = None,
                                       block_n: int | None = None) -> torch.Tensor:
    """Triton launch. Shapes and dtypes as `reference.kv_injected_block_attention_ref` (checked by the dispatcher).

    fp32 inputs use IEEE fp32 dot products (not TF32) so the result matches the reference to ~1e-5.
    """
    B, H, S, D = q.shape
    KVH, T = k_ctx.shape[1], k_ctx.shape[2]
    if scale is None:
        scale = D ** -0.5
    out = torch.empty_like(q)
    block_m, default_n, block_d = launch_config(S, D)
    block_n = block_n or default_n
    precision = "ieee" if q.dtype == torch.float32 else None
    grid = (B * H, math.ceil(S / block_m))
    _attention_program[grid](
        q, k_ctx, v_ctx, k_blk, v_blk, out,
        *q.stride(), *k_ctx.stride(), *v_ctx.stride(), *k_blk.stride(), *v_blk.stride(), *out.stride(),
        H, H // KVH, S, T, D, float(scale) * _LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision,
    )
    return out
