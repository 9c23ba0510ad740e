"""The two custom ops of the DFlash graphs, as GPU kernels: `kv_injected_block_attention` and `fused_verify`.

Each op has a Triton kernel (`triton_attention.py`, `triton_verify.py`) and a torch reference (`reference.py`). The
dispatchers here check shapes (bad input is a DFlashError, not a kernel fault) and pick the Triton kernel for CUDA
tensors when triton is importable, the torch reference otherwise. `backend=` forces one ("triton" on CPU tensors
needs TRITON_INTERPRET=1 in the environment before the kernel modules are imported).
"""

from __future__ import annotations

import importlib.util

import torch

from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.kernels.reference import EMIT_PAD, fused_verify_ref, kv_injected_block_attention_ref

__all__ = ["EMIT_PAD", "fused_verify", "fused_verify_ref", "kv_injected_block_attention",
           "kv_injected_block_attention_ref", "triton_available"]

_BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in _BACKENDS:
        raise DFlashError(f"unknown kernel backend {backend!r} (known: {', '.join(_BACKENDS)})", field="backend")
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise MissingDependency("triton is not installed (pip install 'dflash-export[kernels]')")
        return True
    return device.type == "cuda" and triton_available()


def _shape_error(op: str, message: str) -> DFlashError:
    return DFlashError(message, field=op)


def check_attention_inputs(q, k_ctx, v_ctx, k_blk, v_blk) -> None:
    """Raise DFlashError unless the shapes / dtypes / devices form a valid KVInjectedBlockAttention call."""
    op = "KVInjectedBlockAttention"
    names = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
    tensors = (q, k_ctx, v_ctx, k_blk, v_blk)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise _shape_error(op, f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in _FLOAT_DTYPES or t.dtype != q.dtype:
            raise _shape_error(op, f"{name} has dtype {t.dtype}; all inputs must share one of fp32/fp16/bf16")
        if t.device != q.device:
            raise _shape_error(op, f"{name} is on {t.device}, q on {q.device}")
    B, H, S, D = q.shape
    KVH, T = k_ctx.shape[1], k_ctx.shape[2]
    if S == 0 or D == 0 or H == 0 or KVH == 0:
        raise _shape_error(op, f"empty q {tuple(q.shape)} or k_ctx {tuple(k_ctx.shape)}")
    if H % KVH:
        raise _shape_error(op, f"num_heads {H} is not a multiple of num_kv_heads {KVH}")
    if tuple(v_ctx.shape) != (B, KVH, T, D) or tuple(k_ctx.shape) != (B, KVH, T, D):
        raise _shape_error(op, f"k_ctx {tuple(k_ctx.shape)} / v_ctx {tuple(v_ctx.shape)} must be [{B}, KVH, T, {D}]")
    if tuple(k_blk.shape) != (B, KVH, S, D) or tuple(v_blk.shape) != (B, KVH, S, D):
        raise _shape_error(op, f"k_blk {tuple(k_blk.shape)} / v_blk {tuple(v_blk.shape)} must be "
                               f"[{B}, {KVH}, {S}, {D}]")


def kv_injected_block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                                v_blk: torch.Tensor, scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Block attention over injected context K/V + block K/V (non-causal, GQA).

    q [B, H, S, D]; k_ctx, v_ctx [B, KVH, T, D] (T >= 0); k_blk, v_blk [B, KVH, S, D]; one float dtype for all.
    Returns [B, H, S, D] in q's dtype; softmax in fp32; `scale` defaults to D ** -0.5.
    """
    check_attention_inputs(q, k_ctx, v_ctx, k_blk, v_blk)
    if _use_triton(backend, q.device):
        from dflash_export.kernels.triton_attention import kv_injected_block_attention_triton

        return kv_injected_block_attention_triton(q, k_ctx, v_ctx, k_blk, v_blk, scale)
    return kv_injected_block_attention_ref(q, k_ctx, v_ctx, k_blk, v_blk, scale)


def check_verify_inputs(target_logits, draft_tokens, draft_probs, uniforms, temperature) -> None:
    """Raise DFlashError unless the inputs form a valid FusedVerify call."""
    op = "FusedVerify"
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        raise _shape_error(op, f"target_logits must be [B, bs, V], got {getattr(target_logits, 'shape', None)}")
    if target_logits.dtype not in _FLOAT_DTYPES:
        raise _shape_error(op, f"target_logits dtype {target_logits.dtype} is not fp32/fp16/bf16")
    B, BS, V = target_logits.shape
    if BS < 1 or V < 1:  # a one-row block (prefill: no drafts) is valid
        raise _shape_error(op, f"target_logits {tuple(target_logits.shape)}: need at least one row and V >= 1")
    if not isinstance(draft_tokens, torch.Tensor) or tuple(draft_tokens.shape) != (B, BS - 1):
        raise _shape_error(op, f"draft_tokens must be [{B}, {BS - 1}], got {getattr(draft_tokens, 'shape', None)}")
    if draft_tokens.dtype not in (torch.int32, torch.int64):
        raise _shape_error(op, f"draft_tokens dtype {draft_tokens.dtype} is not int32/int64")
    if draft_tokens.numel() and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= V):
        raise _shape_error(op, f"draft_tokens out of range [0, {V})")
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise _shape_error(op, f"temperature must be a number >= 0, got {temperature!r}")
    if temperature > 0:
        if draft_probs is None or uniforms is None:
            raise _shape_error(op, "temperature > 0 needs draft_probs and uniforms")
        if tuple(draft_probs.shape) != (B, BS - 1, V):
            raise _shape_error(op, f"draft_probs must be [{B}, {BS - 1}, {V}], got {tuple(draft_probs.shape)}")
        if tuple(uniforms.shape) != (B, BS):
            raise _shape_error(op, f"uniforms must be [{B}, {BS}], got {tuple(uniforms.shape)}")
        for name, t in (("draft_probs", draft_probs), ("uniforms", uniforms)):
            if not t.is_floating_point():
                raise _shape_error(op, f"{name} must be floating point, got {t.dtype}")
    for name, t in (("draft_tokens", draft_tokens), ("draft_probs", draft_probs), ("uniforms", uniforms)):
        if t is not None and t.device != target_logits.device:
            raise _shape_error(op, f"{name} is on {t.device}, target_logits on {target_logits.device}")


def fused_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
                 uniforms: torch.Tensor | None = None, temperature: float = 0.0, backend: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a drafted block per sequence (greedy when temperature == 0, rejection sampling otherwise).

    target_logits [B, bs, V]; draft_tokens [B, bs-1] int32/int64; draft_probs [B, bs-1, V], uniforms [B, bs]
    (only read when temperature > 0; uniforms[i-1] tests draft i, uniforms[bs-1] draws the last token).
    Returns accept_len [B], emitted_tokens [B, bs] (padded with EMIT_PAD), n_emitted [B], all int64.
    """
    check_verify_inputs(target_logits, draft_tokens, draft_probs, uniforms, temperature)
    if _use_triton(backend, target_logits.device):
        from dflash_export.kernels.triton_verify import fused_verify_triton

        return fused_verify_triton(target_logits, draft_tokens, draft_probs, uniforms, float(temperature))
    return fused_verify_ref(target_logits, draft_tokens, draft_probs, uniforms, float(temperature))
