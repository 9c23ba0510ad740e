"""Blocks, the training attention mask, the one-pass forward over all blocks of a batch, and the block loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dflash_export.models.drafter import DFlashDrafter, apply_rope, attention_mask, block_attention
from dflash_export.train.data import TrainSequence


def default_gamma(block_size: int) -> float:
    """The paper's loss decay per block size (7 for 16, 5 for 10, 4 for 8); bs/2 elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[bs-1] weights exp(-(k-1)/γ) for block slots k = 1 .. bs-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class BlockBatch:
    """Many blocks over a padded batch of sequences. B sequences, N blocks each, bs = block size, S = max length."""

    taps: torch.Tensor            # [B, S, n*H] context features (padding rows are zero and never visible)
    ctx_positions: torch.Tensor   # [B, S]
    block_ids: torch.Tensor       # [B, N*bs] anchor id then mask ids, per block
    block_positions: torch.Tensor # [B, N*bs] a .. a+bs-1
    attn_mask: torch.Tensor       # [B, N*bs, S + N*bs] bool: True = query may attend to key
    labels: torch.Tensor          # [B, N, bs-1] target token at slot k (= x[a+k]); -100 where past the sequence end
    soft_ids: torch.Tensor        # [B, N, bs-1, K] target's top-k ids for the same slot (0 where label is -100)
    soft_logp: torch.Tensor       # [B, N, bs-1, K]
    anchors: torch.Tensor         # [B, N] anchor positions; -1 for padding blocks

    def to(self, device, non_blocking: bool = False) -> "BlockBatch":
        """The same batch with every tensor on `device` (laid out on a CPU, trained on an accelerator)."""
        return BlockBatch(**{k: v.to(device, non_blocking=non_blocking) for k, v in vars(self).items()})


def sample_anchors(seq: TrainSequence, n: int, generator: torch.Generator) -> list[int]:
    """Up to `n` distinct anchor positions in the response, sorted: a in [P, S-2] (an anchor needs one label)."""
    lo, hi = seq.prompt_len, len(seq.ids) - 2
    if hi < lo:
        return []
    count = hi - lo + 1
    pick = torch.randperm(count, generator=generator)[: min(n, count)]
    return sorted((lo + pick).tolist())


def build_blocks(seqs: Sequence[TrainSequence], anchors: Sequence[Sequence[int]], block_size: int,
                 mask_token_id: int) -> BlockBatch:
    """Lay out blocks and the attention mask that makes one forward equal to independent per-anchor drafts."""
    bs = block_size
    b = len(seqs)
    n = max(1, max((len(a) for a in anchors), default=1))
    s_max = max(len(s.ids) for s in seqs)
    tap_dim = seqs[0].taps.shape[-1]
    k_top = seqs[0].top_ids.shape[-1]
    taps = torch.zeros(b, s_max, tap_dim, dtype=torch.float32)
    block_ids = torch.full((b, n * bs), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(b, n * bs, dtype=torch.long)
    mask = torch.zeros(b, n * bs, s_max + n * bs, dtype=torch.bool)
    labels = torch.full((b, n, bs - 1), -100, dtype=torch.long)
    soft_ids = torch.zeros(b, n, bs - 1, k_top, dtype=torch.long)
    soft_logp = torch.zeros(b, n, bs - 1, k_top, dtype=torch.float32)
    anchor_t = torch.full((b, n), -1, dtype=torch.long)
    for i, (seq, anc) in enumerate(zip(seqs, anchors)):
        s = len(seq.ids)
        taps[i, :s] = seq.taps.float()
        greedy = seq.top_ids[:, 0].tolist()  # the target's argmax for response token r
        ids = seq.ids.tolist()
        for j in range(n):
            q0 = j * bs
            # every block -- padding ones too -- sees its own keys, so no softmax row is empty
            mask[i, q0:q0 + bs, s_max + q0: s_max + q0 + bs] = True
            if j >= len(anc):
                continue
            a = anc[j]
            anchor_t[i, j] = a
            block_ids[i, q0] = seq.ids[a]
            block_pos[i, q0:q0 + bs] = torch.arange(a, a + bs)
            mask[i, q0:q0 + bs, :a] = True  # context strictly before the anchor (the anchor's taps are not known yet)
            for k in range(1, min(bs, s - a)):
                r = a + k - seq.prompt_len
                if seq.teacher_forced:
                    if k > 1 and ids[a + k - 1] != greedy[r - 1]:
                        break  # the text left the target's greedy path inside this block: later slots are unknown
                    labels[i, j, k - 1] = greedy[r]
                else:
                    labels[i, j, k - 1] = ids[a + k]
                soft_ids[i, j, k - 1] = seq.top_ids[r]
                soft_logp[i, j, k - 1] = seq.top_logp[r]
    ctx_pos = torch.arange(s_max)[None].expand(b, s_max).contiguous()
    return BlockBatch(taps, ctx_pos, block_ids, block_pos, mask, labels, soft_ids, soft_logp, anchor_t)


def train_forward(drafter: DFlashDrafter, embed: Callable[[torch.Tensor], torch.Tensor], batch: BlockBatch
                  ) -> torch.Tensor:
    """Drafter hidden states norm(h) [B, N*bs, H] for every block of `batch` in one pass.

    Same layers and math as `DFlashDrafter.forward`, with an explicit attention mask over [context; all blocks]
    instead of "everything visible"; with one block and full context it reproduces `forward` exactly."""
    ctx = drafter.project_context(batch.taps)
    x = (embed(batch.block_ids) * drafter.config.input_embedding_scale).to(ctx.dtype)
    cos, sin = drafter.rotary(batch.block_positions, x.dtype)
    c_cos, c_sin = drafter.rotary(batch.ctx_positions, x.dtype)
    key_pos = torch.cat([batch.ctx_positions, batch.block_positions], dim=1)
    b, q_len, _ = x.shape
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        k_ctx, v_ctx = attn.context_kv(ctx, c_cos, c_sin)
        x_n = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn._heads(attn.q_proj(x_n), attn.num_heads)), cos, sin)
        k_blk = apply_rope(attn.k_norm(attn._heads(attn.k_proj(x_n), attn.num_kv_heads)), cos, sin)
        v_blk = attn._heads(attn.v_proj(x_n), attn.num_kv_heads)
        mask = batch.attn_mask[:, None]
        layer_mask = attention_mask(batch.block_positions, key_pos, attn.causal, attn.window)
        if layer_mask is not None:  # causal / sliding layers, as at inference (z-lab's release)
            mask = mask & layer_mask
        out = block_attention(q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2), attn.scale, mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@dataclass
class LossOut:
    loss: torch.Tensor
    correct: torch.Tensor   # [B, N, bs-1] bool: argmax (over the loss vocabulary) == label
    valid: torch.Tensor     # [B, N, bs-1] bool


def block_loss(hidden: torch.Tensor, batch: BlockBatch, head_weight: torch.Tensor, vocab: torch.Tensor | None,
               weights: torch.Tensor, soft_weight: float) -> LossOut:
    """Weighted block loss. hidden [B, N*bs, H]; head_weight [V, H] (the target's LM head, frozen);
    vocab [V'] sorted token ids the loss is computed over (None = full vocabulary); weights [bs-1]."""
    b, n, k1 = batch.labels.shape
    h = hidden.view(b, n, k1 + 1, -1)[:, :, 1:]  # the anchor slot predicts nothing
    w_head = head_weight if vocab is None else head_weight[vocab]
    logits = h @ w_head.T.to(h.dtype)  # [B, N, bs-1, V']
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = batch.labels >= 0

    def to_sub(ids: torch.Tensor) -> torch.Tensor:
        if vocab is None:
            return ids.clamp(min=0)
        pos = torch.searchsorted(vocab, ids.clamp(min=0))
        return pos.clamp(max=len(vocab) - 1)

    lab = to_sub(batch.labels)
    hard = -logp.gather(-1, lab[..., None])[..., 0]
    loss_pos = hard
    if soft_weight > 0:
        sid = to_sub(batch.soft_ids)
        p = torch.softmax(batch.soft_logp, dim=-1)  # the target's top-k, renormalized
        if vocab is not None:  # a soft id outside the loss vocabulary contributes nothing
            p = p * (vocab[sid] == batch.soft_ids)
        soft = -(p * logp.gather(-1, sid)).sum(-1)
        loss_pos = (1 - soft_weight) * hard + soft_weight * soft
    w = weights.to(loss_pos.dtype)[None, None, :] * valid
    loss = (loss_pos * w).sum() / w.sum().clamp(min=1e-9)
    correct = (logits.argmax(-1) == lab) & valid
    return LossOut(loss, correct, valid)


def acceptance_stats(correct: torch.Tensor, valid: torch.Tensor) -> dict:
    """Position-k accuracy (k = 1..4) and the greedy τ the blocks imply, over blocks whose slots are all labelled:
    `tau_est` = harmonic mean of (1 + leading correct drafts) -- the decoding estimate -- and `tau_arith` its arithmetic
    mean (what the curve of the shipped drafter logged as tau_est; an overestimate)."""
    full = valid.all(-1)
    c = correct[full].float()
    stats = {}
    for k in range(min(4, correct.shape[-1])):
        stats[f"acc{k + 1}"] = float(c[:, k].mean()) if len(c) else 0.0
    # Decoding does not visit anchors uniformly: a block that accepts L drafts skips the next L anchors, so τ is the
    # harmonic, not the arithmetic, mean of (1 + L) over anchors (easy stretches are crossed in few steps).
    steps = 1 + c.cumprod(-1).sum(-1)
    stats["tau_est"] = float(1 / (1 / steps).mean()) if len(c) else 1.0
    stats["tau_arith"] = float(steps.mean()) if len(c) else 1.0
    return stats
