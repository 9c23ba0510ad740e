"""DFlash drafter training (the paper's recipe, made to fit a CPU budget).

What is trained and on what:
- The target is frozen. Training data are the target's own greedy responses to prompts, generated in batches once and
  cached in shards together with the target's taps (the drafter's context features) and its top-k next-token
  log-probabilities (soft targets). A trainer re-scans the shards, so data generation can run alongside training.
- Each sequence contributes many blocks: a random anchor position `a` in the response opens a block
  `[x_a, mask, ..., mask]` (block_size tokens) at positions a .. a+bs-1. One drafter forward serves all blocks of a batch
  through an attention mask: a block's queries see the context features at positions < a and their own block's keys
  (bidirectionally), never another block's. This is exactly what inference does at an anchor `a`, because greedy
  speculative decoding follows the target's own greedy trajectory -- so held-out block accuracy predicts τ.
- Loss at block slot k (1 .. bs-1) is weighted exp(-(k-1)/γ): early slots decide acceptance. It is computed over the
  vocabulary the cached responses actually use (+ the soft targets' ids) instead of the full LM head, mixing the hard
  greedy label with the target's renormalized top-k distribution.
- Only layers, fc, hidden_norm and norm train; embedding and LM head are the target's. The drafter starts from the
  target: its layers are copies of the target's last layers, `fc` passes the deepest tap through, norms come from the
  target -- so it starts from "what the target's top does" instead of noise.
Checkpoints hold the drafter in the z-lab format plus the optimizer state, written atomically; a step's batch and anchors
come from a generator seeded by (seed, step), so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from dflash_export.errors import DFlashError, atomic_dir, atomic_file, check_output_dir, removing_new_dirs
from dflash_export.models.drafter import (DFlashDrafter, DrafterConfig, apply_rope, attention_mask,
                                          block_attention, check_drafter_fits, is_drafter_dir)
from dflash_export.models.rope import legacy_rope_fields

SHARD_SIZE = 32
_DATA_VERSION = 2  # 2: generated data from own_answers (long answers, taps captured while decoding)


def default_gamma(block_size: int) -> float:
    """The paper's loss decay per block size (7 for 16, 5 for 10, 4 for 8); bs/2 elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[bs-1] weights exp(-(k-1)/γ) for block slots k = 1 .. bs-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


# ----------------------------------------------------------------------------------------------------------- data


@dataclass
class TrainSequence:
    """One cached training example. S = prompt + response length, R = S - prompt_len."""

    ids: torch.Tensor         # [S] int64: prompt then the target's greedy response (stop token included if hit)
    prompt_len: int
    taps: torch.Tensor        # [S, n*H_target] float16: target tap features of every position
    top_ids: torch.Tensor     # [R, K] int64: target's top-k ids for response token r (predicted at position P+r-1)
    top_logp: torch.Tensor    # [R, K] float32: their log-probabilities under the full vocabulary
    index: int                # the prompt's record index (ShareGPT) or synthetic index
    # False: the response is the target's own greedy continuation, so x[a+k] is the label of block slot k.
    # True: the response is the dataset's text (teacher forcing, one forward instead of a generation -- ~30x cheaper
    # per token). Then the label of slot k is the target's argmax top_ids[., 0], and slot k is only trained while the
    # text's tokens a+1 .. a+k-1 agree with those argmaxes, i.e. while the block still lies on the target's greedy path
    # from anchor a -- exactly the blocks inference would verify.
    teacher_forced: bool = False

    def to_dict(self) -> dict:
        return {"ids": self.ids, "prompt_len": self.prompt_len, "taps": self.taps, "top_ids": self.top_ids,
                "top_logp": self.top_logp, "index": self.index, "teacher_forced": self.teacher_forced}


@torch.inference_mode()
def generate_sequences(target, prompts: Sequence[tuple[int, list[int]]], tap_ids: Sequence[int], max_new_tokens: int,
                       batch_size: int = 16, topk: int = 4) -> list[TrainSequence]:
    """Greedy target responses to `prompts` ((index, token ids)), batched with left padding, then one causal forward
    per sequence batch for the taps and top-k soft targets. Returns one TrainSequence per prompt, in input order."""
    hf = target.hf
    stop = set(target.stop_token_ids)
    pad = next(iter(target.stop_token_ids), 0)
    out: dict[int, TrainSequence] = {}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))  # similar lengths share a batch
    for b0 in range(0, len(order), batch_size):
        batch = [prompts[i] for i in order[b0:b0 + batch_size]]
        width = max(len(p) for _, p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (_, p) in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        gen = hf.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=sorted(stop) or None, pad_token_id=pad, temperature=None, top_p=None,
                          top_k=None)
        full = []
        for r, (_, p) in enumerate(batch):
            resp = gen[r, width:].tolist()
            for j, t in enumerate(resp):
                if t in stop:
                    resp = resp[: j + 1]
                    break
            full.append(p + resp)
        # Taps and soft targets from an unpadded-left causal pass (right padding cannot affect earlier positions).
        s_max = max(len(f) for f in full)
        ids2 = torch.full((len(full), s_max), pad, dtype=torch.long)
        for r, f in enumerate(full):
            ids2[r, : len(f)] = torch.tensor(f)
        res = hf(input_ids=ids2, output_hidden_states=True, use_cache=False)
        from dflash_export.models.target import tap_hidden_states

        taps = tap_hidden_states(res.hidden_states, tap_ids)
        for r, ((index, p), f) in enumerate(zip(batch, full)):
            n_p, s = len(p), len(f)
            logp = torch.log_softmax(res.logits[r, n_p - 1: s - 1].float(), dim=-1)
            top_logp, top_ids = logp.topk(topk, dim=-1)
            seq = TrainSequence(torch.tensor(f), n_p, taps[r, :s].to(torch.float16).clone(), top_ids.clone(),
                                top_logp.clone(), index)
            out[order[b0 + r]] = seq
    return [out[i] for i in range(len(prompts))]


@torch.inference_mode()
def teacher_forced_sequences(target, items: Sequence[tuple[int, list[int], int]], tap_ids: Sequence[int],
                             batch_size: int = 16, topk: int = 4) -> list[TrainSequence]:
    """`items` = (index, prompt + reply ids, prompt length): one causal forward per batch (right padding cannot affect
    earlier positions) gives the taps of every position and the target's top-k for every reply token."""
    from dflash_export.models.target import tap_hidden_states

    hf = target.hf
    pad = next(iter(target.stop_token_ids), 0)
    out: dict[int, TrainSequence] = {}
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]))  # similar lengths share a batch
    for b0 in range(0, len(order), batch_size):
        batch = [items[i] for i in order[b0:b0 + batch_size]]
        s_max = max(len(ids) for _, ids, _ in batch)
        ids = torch.full((len(batch), s_max), pad, dtype=torch.long)
        for r, (_, f, _) in enumerate(batch):
            ids[r, : len(f)] = torch.tensor(f)
        res = hf(input_ids=ids, output_hidden_states=True, use_cache=False)
        taps = tap_hidden_states(res.hidden_states, tap_ids)
        for r, (index, f, n_p) in enumerate(batch):
            logp = torch.log_softmax(res.logits[r, n_p - 1: len(f) - 1].float(), dim=-1)
            top_logp, top_ids = logp.topk(topk, dim=-1)
            out[order[b0 + r]] = TrainSequence(torch.tensor(f), n_p, taps[r, : len(f)].to(torch.float16).clone(),
                                               top_ids.clone(), top_logp.clone(), index, teacher_forced=True)
    return [out[i] for i in range(len(items))]


def data_dir(target, tap_ids: Sequence[int], max_prompt_tokens: int, max_new_tokens: int, topk: int,
             source: str) -> Path:
    """Where generated data for this (target, taps, lengths, prompt source) is cached."""
    import hashlib

    from dflash_export.sources import cache_dir

    key = json.dumps({"v": _DATA_VERSION, "target": str(target.model_dir), "config": target.config,
                      "taps": list(tap_ids), "p": max_prompt_tokens, "r": max_new_tokens, "k": topk, "src": source},
                     sort_keys=True, default=str)
    return cache_dir() / "train-data" / f"{source}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def answers_dir(target, max_prompt_tokens: int, max_new_tokens: int, source: str) -> Path:
    """Where pass 1's answer tokens for this (target, lengths, prompt source) are cached: no taps in the key, so a new
    tap choice reuses them (own_answers.feature_shards)."""
    import hashlib

    from dflash_export.sources import cache_dir

    key = json.dumps({"v": 1, "target": str(target.model_dir), "config": target.config, "p": max_prompt_tokens,
                      "r": max_new_tokens, "src": source}, sort_keys=True, default=str)
    return cache_dir() / "train-data" / f"{source}-answers-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def shard_paths(directory: Path) -> list[Path]:
    """The data shards of `directory`, in order (each is written atomically and never changed afterwards)."""
    return sorted(directory.glob("shard-*.pt"))


def shard_loader(sources: Sequence[tuple[Path, int]]) -> Callable[[], list[TrainSequence]]:
    """A loader of the first n sequences of each (directory, n) source, for a trainer that calls it at every
    checkpoint (data generation may be running alongside) and once more for the prompt list. Shards never change
    once written, so they are read again only when new ones have appeared: they hold several GB of context features
    for the SmolLM2 recipe."""
    loaded: dict = {}

    def load() -> list[TrainSequence]:
        paths = [p for d, _ in sources if d.is_dir() for p in shard_paths(d)]
        if loaded.get("paths") != paths:
            loaded["paths"] = paths
            loaded["seqs"] = [s for d, n in sources if d.is_dir() for s in load_shards(d)[:n]]
        return loaded["seqs"]

    return load


def load_shards(directory: Path) -> list[TrainSequence]:
    seqs = []
    for p in shard_paths(directory):
        try:
            rows = torch.load(p, weights_only=True)
            seqs.extend(TrainSequence(**r) for r in rows)
        except Exception as e:  # a corrupt shard is never trained on
            raise DFlashError(f"unreadable data shard ({type(e).__name__}); delete it to regenerate", path=p) from None
    return seqs


def generate_shards(target, prompt_source: Callable[[], list], directory: Path,
                    tap_ids: Sequence[int], max_new_tokens: int, num_prompts: int, batch_size: int, topk: int,
                    deadline: float | None = None, progress: Callable[[int, int, float], None] | None = None,
                    teacher_forced: bool = False) -> int:
    """Fill `directory` with shards of SHARD_SIZE sequences until `num_prompts` prompts are covered (or `deadline`).

    Shard i always holds prompts [i*SHARD_SIZE, (i+1)*SHARD_SIZE) of `prompt_source()`'s fixed order, so an interrupted
    run resumes where it stopped and two runs agree. Each shard is written atomically. Returns sequences on disk.
    `teacher_forced`: the source yields (index, prompt + reply ids, prompt length) and no generation happens."""
    prompts = prompt_source()[:num_prompts]
    if not prompts:
        raise DFlashError("the prompt set is empty", field="prompts")
    done = 0
    tokens = 0
    t0 = time.perf_counter()
    for i, s0 in enumerate(range(0, len(prompts), SHARD_SIZE)):
        path = directory / f"shard-{i:05d}.pt"
        chunk = prompts[s0:s0 + SHARD_SIZE]
        if not path.is_file():
            if deadline is not None and time.time() > deadline:
                break
            if teacher_forced:
                # 8 rows per forward: measured 446 tok/s vs 299 at 32 (less padding, smaller [B, S, V] logits)
                seqs = teacher_forced_sequences(target, chunk, tap_ids, min(batch_size, 8), topk)
            else:
                seqs = generate_sequences(target, chunk, tap_ids, max_new_tokens, batch_size, topk)
            tokens += sum(len(s.ids) - s.prompt_len for s in seqs)
            try:
                with atomic_file(path, "wb") as f:
                    torch.save([s.to_dict() for s in seqs], f)
            except OSError as e:
                raise DFlashError(f"cannot write training data ({e.strerror or e})", path=path) from None
        done += len(chunk)
        if progress is not None:
            progress(done, len(prompts), tokens / max(1e-9, time.perf_counter() - t0))
    return done


def own_answer_data(target, prompt_source: Callable[[], list], directory: Path, answers_directory: Path,
                    tap_ids: Sequence[int], max_new_tokens: int, num_prompts: int, batch_size: int, topk: int,
                    progress: Callable[[int, int, float], None] | None = None) -> int:
    """Feature shards in `directory` for the target's greedy answers to the first `num_prompts` prompts of
    `prompt_source()`: pass 1 (own_answers.generate_answer_shards) writes the answer tokens to `answers_directory` and
    the captured features to `directory`; pass 2 fills in the features of answers generated earlier for other taps.
    Both skip the shards already on disk, so an interrupted run resumes where it stopped."""
    from dflash_export.own_answers import feature_shards, generate_answer_shards

    prompts = prompt_source()[:num_prompts]
    if not prompts:
        raise DFlashError("the prompt set is empty", field="prompts")
    feature_shards(target, answers_directory, directory, tap_ids, topk)
    return generate_answer_shards(target, prompts, answers_directory, directory, tap_ids, max_new_tokens,
                                  batch_size, topk, progress)


def chat_prompt_ids(tokenizer, text: str, use_template: bool = True) -> list[int]:
    if use_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=False)  # transformers 5 returns a BatchEncoding otherwise
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(text)["input_ids"]


def sharegpt_prompt_ids(target, split: str, max_prompt_tokens: int, seed: int, shuffle: bool = True
                        ) -> list[tuple[int, list[int]]]:
    """ShareGPT first-turn prompts of `split`, chat-templated, at most `max_prompt_tokens` tokens, in a seeded order."""
    import random

    from dflash_export.data import sharegpt_prompts

    prompts = sharegpt_prompts(split)
    if shuffle:
        random.Random(seed).shuffle(prompts)
    out = []
    for p in prompts:
        ids = _fitting_prompt_ids(target.tokenizer, p.text, max_prompt_tokens)
        if ids is not None:
            out.append((p.index, ids))
    return out


def _fitting_prompt_ids(tokenizer, text: str, max_prompt_tokens: int) -> list[int] | None:
    """The chat-templated prompt, or None when it is longer than `max_prompt_tokens`."""
    if len(text) > 6 * max_prompt_tokens:  # far too long to fit: skip without tokenizing
        return None
    ids = chat_prompt_ids(tokenizer, text)
    return ids if len(ids) <= max_prompt_tokens else None


def sharegpt_reply_ids(target, split: str, max_prompt_tokens: int, max_reply_tokens: int, seed: int
                       ) -> list[tuple[int, list[int], int]]:
    """ShareGPT first turns with the dataset's own first answer, for teacher-forced data: (index, chat-templated prompt
    + answer tokens, prompt length), the answer cut at `max_reply_tokens` (an uncut one ends with the stop token, as a
    generated one would), in a seeded order. The order is not the prompt-only source's, so the two sets overlap
    only partly and together cover more distinct prompts."""
    import random

    from dflash_export.data import sharegpt_prompts

    prompts = [p for p in sharegpt_prompts(split) if p.reply]
    random.Random(seed + 7919).shuffle(prompts)
    tok = target.tokenizer
    stop = next(iter(target.stop_token_ids), None)
    out = []
    for p in prompts:
        ids = _fitting_prompt_ids(tok, p.text, max_prompt_tokens)
        if ids is None:
            continue
        reply = tok(p.reply[: 8 * max_reply_tokens], add_special_tokens=False)["input_ids"]
        if len(reply) < max_reply_tokens and stop is not None:
            reply = reply + [stop]
        reply = reply[:max_reply_tokens]
        if len(reply) >= 2:
            out.append((p.index, ids + reply, len(ids)))
    return out


def synthetic_prompt_ids(vocab_size: int, n: int, seed: int, reserved: int = 2) -> list[tuple[int, list[int]]]:
    """Random token prompts for tokenizer-less tiny targets (the top `reserved` ids -- eos, mask -- excluded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 17, (1,), generator=g))
        out.append((i, torch.randint(1, vocab_size - reserved, (length,), generator=g).tolist()))
    return out


# ------------------------------------------------------------------------------------------------- blocks & masks


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


# ------------------------------------------------------------------------------------------------ init from target


def drafter_from_target(target, num_layers: int, block_size: int, mask_token_id: int,
                        target_layer_ids: Sequence[int] | None = None, *, recipe_path=None) -> DFlashDrafter:
    """A drafter whose layers are copies of the target's last `num_layers` layers, fc passing the deepest tap
    through, hidden_norm = the first copied layer's input norm (what that layer applied to the deepest tap's output in
    the target), norm = the target's final norm. Taps default to z-lab's rule. `recipe_path` names the file that a
    bad setting came from in the error line."""
    from dflash_export.models.drafter import default_target_layer_ids

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


# ---------------------------------------------------------------------------------------------------- training loop


@dataclass
class TrainConfig:
    block_size: int = 8
    gamma: float | None = None
    lr: float = 3e-4
    warmup_steps: int = 20
    lr_decay_steps: int | None = None
    lr_min_ratio: float = 0.1
    batch_size: int = 4          # sequences per step
    blocks_per_seq: int = 16
    soft_weight: float = 0.5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    steps: int = 1000
    minutes: float | None = None
    checkpoint_every_s: float = 300.0
    log_every: int = 10
    eval_blocks_per_seq: int = 32
    extra: dict = field(default_factory=dict)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then flat or (lr_decay_steps set) cosine down to lr_min_ratio*lr at that step and flat after.
    A function of the total step only, so a resumed run follows the schedule an uninterrupted one would."""
    lr = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_decay_steps and step >= cfg.warmup_steps:
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps))
        lr *= cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return lr


def _vocab_of(seqs: Sequence[TrainSequence]) -> torch.Tensor:
    # a teacher-forced reply's own tokens are never labels (the target's argmaxes are, and they are in top_ids)
    ids = [s.ids[s.prompt_len:] for s in seqs if not s.teacher_forced] + [s.top_ids.flatten() for s in seqs]
    return torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.long)


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def make_batch(seqs: Sequence[TrainSequence], cfg: TrainConfig, mask_token_id: int, step: int) -> BlockBatch:
    g = _step_generator(cfg.seed, step)
    pick = torch.randint(0, len(seqs), (cfg.batch_size,), generator=g).tolist()
    chosen = [seqs[i] for i in pick]
    anchors = [sample_anchors(s, cfg.blocks_per_seq, g) for s in chosen]
    return build_blocks(chosen, anchors, cfg.block_size, mask_token_id)


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target, seqs: Sequence[TrainSequence], block_size: int,
             blocks_per_seq: int = 32, seed: int = 12345) -> dict:
    """Held-out position-k accuracy and implied τ, with the full-vocabulary LM head (as inference argmaxes)."""
    if not seqs:
        return {}
    g = torch.Generator().manual_seed(seed)
    corr, val = [], []
    for s in seqs:
        anc = sample_anchors(s, blocks_per_seq, g)
        if not anc:
            continue
        batch = build_blocks([s], [anc], block_size, drafter.config.mask_token_id)
        hidden = train_forward(drafter, target.embed, batch)
        out = block_loss(hidden, batch, target.hf.get_output_embeddings().weight, None,
                         torch.ones(block_size - 1), 0.0)
        corr.append(out.correct.flatten(0, 1))
        val.append(out.valid.flatten(0, 1))
    if not corr:
        return {}
    return acceptance_stats(torch.cat(corr), torch.cat(val))


def save_checkpoint(work: Path, drafter: DFlashDrafter, optimizer, step: int, wall_s: float, best: dict) -> None:
    """`work/checkpoint/` = z-lab drafter + optimizer/step state, replaced atomically as one directory."""
    from dflash_export.models.drafter import save_drafter

    try:
        with atomic_dir(work / "checkpoint") as tmp:
            save_drafter(drafter, tmp / "drafter")
            torch.save({"step": step, "optimizer": optimizer.state_dict(), "wall_s": wall_s, "best": best},
                       tmp / "train_state.pt")
    except OSError as e:
        raise DFlashError(f"cannot write checkpoint ({e.strerror or e})", path=work / "checkpoint") from None


def _short_reason(e: BaseException) -> str:
    """`Type: first sentence` of an exception, for a one-line error."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". ")[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_checkpoint(work: Path):
    """(drafter, train state) of `work/checkpoint`, or None when there is none. A checkpoint that is there but cannot
    be read back whole -- truncated, garbage, half of it missing -- is one DFlashError naming the file, never a
    silent fresh start."""
    from dflash_export.models.drafter import load_drafter

    ck = work / "checkpoint"
    state_path, drafter_dir = ck / "train_state.pt", ck / "drafter"
    if not ck.exists():
        return None
    if not state_path.is_file():
        raise DFlashError("corrupt checkpoint (train_state.pt is missing)", path=state_path)
    if not (drafter_dir / "config.json").is_file():
        raise DFlashError("corrupt checkpoint (the drafter's config.json is missing)", path=drafter_dir / "config.json")
    try:
        drafter = load_drafter(drafter_dir, dtype=torch.float32)
    except DFlashError as e:
        raise DFlashError(f"corrupt checkpoint ({e.message})", path=e.path or drafter_dir,
                          field=e.field) from None
    except Exception as e:
        raise DFlashError(f"corrupt checkpoint ({_short_reason(e)})", path=drafter_dir) from None
    if state_path.stat().st_size == 0:
        raise DFlashError("corrupt checkpoint (empty file)", path=state_path)
    try:
        state = torch.load(state_path, weights_only=True, map_location="cpu")
    except Exception as e:  # zip errors (truncated), unpickling errors (garbage), ...
        raise DFlashError(f"corrupt checkpoint ({_short_reason(e)})", path=state_path) from None
    problem = _train_state_problem(state, trainable_parameters(drafter))
    if problem:
        raise DFlashError(f"corrupt checkpoint ({problem})", path=state_path)
    return drafter, state


def _train_state_problem(state, params: Sequence[torch.nn.Parameter]) -> str | None:
    """What is wrong with a loaded train_state.pt for a drafter with `params`, or None."""
    if not isinstance(state, dict):
        return f"expected a dict, got {type(state).__name__}"
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a step count"
    wall = state.get("wall_s", 0.0)
    if not isinstance(wall, (int, float)) or not math.isfinite(wall):
        return f"wall_s {wall!r} is not a number"
    if not isinstance(state.get("best", {}), dict):
        return "best is not a dict"
    opt = state.get("optimizer")
    try:
        ids = [i for g in opt["param_groups"] for i in g["params"]]
        if len(ids) != len(params):
            return f"optimizer state for {len(ids)} tensors, the drafter has {len(params)}"
        for i, p in zip(ids, params):
            for key, v in opt["state"].get(i, {}).items():
                if key != "step" and isinstance(v, torch.Tensor) and v.shape != p.shape:
                    return f"optimizer {key} of shape {tuple(v.shape)} for a parameter of shape {tuple(p.shape)}"
    except (TypeError, KeyError, AttributeError):
        return "no usable optimizer state"
    return None


def trainable_parameters(drafter: DFlashDrafter) -> list[torch.nn.Parameter]:
    """Everything the drafter owns (layers, fc, hidden_norm, norm); embedding and LM head are the target's."""
    return [p for n, p in drafter.named_parameters()]


def train_drafter(drafter: DFlashDrafter, target, data_loader: Callable[[], list[TrainSequence]],
                  heldout: Sequence[TrainSequence], cfg: TrainConfig, work: Path, out: Path | None = None,
                  start_state: dict | None = None, progress=None, log: Callable[[dict], None] | None = None) -> dict:
    """Train until `cfg.steps` total steps or `cfg.minutes` of wall time; checkpoint to `work`, export the best
    drafter (by held-out implied τ) to `out`. Returns the last log record."""
    from dflash_export.models.drafter import save_drafter

    torch.manual_seed(cfg.seed)
    for p in target.hf.parameters():
        p.requires_grad_(False)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    weights = position_weights(cfg.block_size, gamma)
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, wall0, best = 0, 0.0, {"tau_est": 0.0}
    if start_state is not None:
        opt.load_state_dict(start_state["optimizer"])
        step, wall0 = start_state["step"], start_state.get("wall_s", 0.0)
        # The best-so-far belongs to the directory it was exported to: a resumed run writing elsewhere starts afresh
        # (else a better score recorded for another directory would keep this one empty).
        if start_state.get("best", {}).get("out") == (str(out) if out is not None else None):
            best = start_state["best"]
    head = target.hf.get_output_embeddings().weight.detach()
    seqs = data_loader()
    if not seqs:
        raise DFlashError("no training sequences (the prompt set is empty or every response was empty)",
                          field="prompts")
    vocab = _vocab_of(seqs)
    t_start = time.perf_counter()
    deadline = None if cfg.minutes is None else t_start + cfg.minutes * 60
    last_ck = t_start
    window: list[dict] = []
    record: dict = {}
    drafter.train()

    def checkpoint_and_eval():
        nonlocal best
        drafter.eval()
        ev = evaluate(drafter, target, heldout, cfg.block_size, cfg.eval_blocks_per_seq)
        drafter.train()
        wall = wall0 + time.perf_counter() - t_start
        rec = {"step": step, "wall_s": round(wall, 1), "sequences": len(seqs), "vocab": len(vocab),
               **{f"heldout_{k}": round(v, 4) for k, v in ev.items()}}
        if out is not None and ev and ev["tau_est"] >= best.get("tau_est", 0.0):
            best = {**ev, "step": step, "out": str(out)}
            save_drafter(drafter, out)
        save_checkpoint(work, drafter, opt, step, wall, best)
        if log:
            log({"event": "checkpoint", **rec, "best_step": best.get("step")})
        return rec

    while step < cfg.steps and (deadline is None or time.perf_counter() < deadline):
        lr = learning_rate(cfg, step)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = make_batch(seqs, cfg, drafter.config.mask_token_id, step)
        hidden = train_forward(drafter, target.embed, batch)
        res = block_loss(hidden, batch, head, vocab, weights, cfg.soft_weight)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        window.append({"loss": res.loss.item(), **acceptance_stats(res.correct, res.valid)})
        if progress is not None:
            progress(step, window[-1]["loss"])
        if step % cfg.log_every == 0:
            record = {"event": "train", "step": step, "lr": lr,
                      "wall_s": round(wall0 + time.perf_counter() - t_start, 1),
                      **{k: round(sum(w[k] for w in window) / len(window), 4) for k in window[0]}}
            window = []
            if log:
                log(record)
        if time.perf_counter() - last_ck > cfg.checkpoint_every_s:
            last_ck = time.perf_counter()
            checkpoint_and_eval()
            fresh = data_loader()  # data generation may be running alongside: pick up new shards
            if len(fresh) > len(seqs):
                seqs = fresh
                vocab = _vocab_of(seqs)
    final = checkpoint_and_eval()
    drafter.eval()
    return {**record, **final, "best": best}


# ------------------------------------------------------------------------------------------------------ the stage


def _prompt_sources(recipe, target, opts, seed: int):
    """(train prompts thunk, held-out prompts thunk, source name) for the recipe's prompt kind."""
    if opts.prompts == "sharegpt":
        if target.config.get("model_type") and not (target.model_dir / "tokenizer_config.json").is_file():
            raise DFlashError("ShareGPT prompts need the target's tokenizer", path=target.model_dir)

        def train_src():
            return sharegpt_prompt_ids(target, "train", opts.max_prompt_tokens, seed=opts.seed)

        def heldout_src():
            return sharegpt_prompt_ids(target, "heldout", opts.max_prompt_tokens, seed=0, shuffle=False)

        def tf_src():
            return sharegpt_reply_ids(target, "train", opts.max_prompt_tokens, opts.max_reply_tokens, opts.seed)
        return train_src, heldout_src, tf_src, f"sharegpt-s{opts.seed}"
    if opts.prompts == "synthetic":
        reserved = target.vocab_size - min(opts.mask_token_id or target.vocab_size - 1, target.vocab_size - 2)

        def tf_src():  # random "answers": exercises the teacher-forced path on tokenizer-less targets
            rows = [ids for _, ids in synthetic_prompt_ids(target.vocab_size, 2 * opts.teacher_forced_prompts,
                                                              opts.seed + 2_000_000, reserved)]
            return [(i, p + q, len(p)) for i, (p, q) in enumerate(zip(rows[0::2], rows[1::2]))]
        return (lambda: synthetic_prompt_ids(target.vocab_size, opts.num_prompts, opts.seed, reserved),
                lambda: synthetic_prompt_ids(target.vocab_size, opts.heldout_prompts, opts.seed + 1_000_000, reserved),
                tf_src, f"synthetic-s{opts.seed}")
    raise DFlashError(f"unknown prompt source {opts.prompts!r} (sharegpt, synthetic)", path=recipe.path,
                      field="train.prompts")


def _check_start(drafter: DFlashDrafter, target, block_size: int, where: Path) -> None:
    """A drafter training starts from (a checkpoint, `--init-from`) must fit the target and the recipe's block."""
    check_drafter_fits(drafter, target, str(where))
    if drafter.config.block_size != block_size:
        raise DFlashError(f"block_size {drafter.config.block_size} != the recipe's {block_size}", path=where,
                          field="block_size")
    c = drafter.config
    for name, value, default in (("output_multiplier", c.output_multiplier, 1.0),
                                 ("final_logit_softcapping", c.final_logit_softcapping, None)):
        if value != default:  # the block loss scores the LM head's plain logits
            raise DFlashError(f"{value}: training drafters with scaled draft logits is not supported", path=where,
                              field=f"dflash_config.{name}")


SEED_MAX = 2**32 - 1  # the per-step generators seed with seed * 1_000_003 + step, which must stay below 2**64


def _check_run_args(steps, minutes, checkpoint_minutes, threads, num_prompts, seed) -> None:
    """The options `train` takes besides the recipe, for callers that bypass the CLI's click types."""
    def bad(option: str, message: str):
        raise DFlashError(message, field=option)

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for option, v, low in (("--steps", steps, 0), ("--threads", threads, 1), ("--num-prompts", num_prompts, 0)):
        if v is not None and (not is_int(v) or v < low):
            bad(option, f"must be an integer >= {low}, got {v!r}")
    if seed is not None and (not is_int(seed) or not 0 <= seed <= SEED_MAX):
        bad("--seed", f"must be an integer in [0, {SEED_MAX}], got {seed!r}")
    for option, v in (("--minutes", minutes), ("--checkpoint-minutes", checkpoint_minutes)):
        if v is None and option == "--minutes":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad(option, f"must be a finite number > 0, got {v!r}")


@contextmanager
def _no_bar_on_error(bar):
    """On an error the progress bars vanish, so that the error is the only line the user sees."""
    try:
        yield
    except Exception:
        bar.live.transient = True
        bar.live.stop()
        bar.disable = True  # else Progress.stop prints a blank line on a non-terminal
        raise


def run_train(recipe_name, *, steps=None, minutes=None, out=None, seed=None, resume=False, work_dir=None,
              num_prompts=None, data_only=False, no_generate=False, checkpoint_minutes=5.0, threads=None,
              init_from=None, console=None) -> dict:
    """The `train` stage: data (cached) -> drafter (the last checkpoint when resuming, else `init_from` grown to the
    recipe's depth, else from the target) -> training -> `out`."""
    from dataclasses import replace

    from rich.console import Console

    from dflash_export.models.target import load_target
    from dflash_export.recipes import load_recipe
    from dflash_export.sources import cache_dir

    console = console or Console(stderr=True)
    # Everything the run is told -- options, recipe fields, where it writes -- is checked before any work starts.
    _check_run_args(steps, minutes, checkpoint_minutes, threads, num_prompts, seed)
    recipe = load_recipe(recipe_name)  # checks every recipe field's type and range
    opts = recipe.train
    if num_prompts is not None:
        opts = replace(opts, num_prompts=num_prompts)
        if num_prompts + opts.teacher_forced_prompts < 1:
            raise DFlashError("the prompt set is empty: 0 training prompts and the recipe's teacher_forced_prompts "
                              "is 0", field="--num-prompts")
    seed = opts.seed if seed is None else seed
    if not recipe.target.startswith("tiny:") and opts.mask_token_id is None:
        raise DFlashError("a real target needs an explicit mask token (a reserved special-token row)",
                          path=recipe.path, field="train.mask_token_id")
    work = Path(work_dir) if work_dir else cache_dir() / "train" / f"{recipe.name}-seed{seed}"
    if out is None:
        if ":" in recipe.drafter.split("/")[0]:
            out = work / "drafter"  # a tiny:/pkg: drafter is generated, not a place to write to
        else:
            out = Path(recipe.drafter_path)
    out = Path(out)
    if not data_only:
        check_output_dir(work, "--work-dir")
        check_output_dir(out, "--out", command="train", is_previous_output=is_drafter_dir, replaced=True)
    if threads:
        torch.set_num_threads(threads)

    target = load_target(recipe.target_path)
    if opts.soft_topk > target.vocab_size:
        raise DFlashError(f"must be <= the target's vocabulary size {target.vocab_size}, got {opts.soft_topk}",
                          path=recipe.path, field="train.soft_topk")
    mask_id = opts.mask_token_id if opts.mask_token_id is not None else target.vocab_size - 1
    if opts.prompts == "synthetic" and mask_id < 2:  # synthetic prompts draw their ids from 1 .. below the mask id
        raise DFlashError(f"must be >= 2 with synthetic prompts, got {mask_id}", path=recipe.path,
                          field="train.mask_token_id")

    # a run that fails before its first checkpoint leaves no work directory: nothing in it could be resumed from
    with removing_new_dirs(work, keep_if=lambda w: (w / "checkpoint").exists()):
        return _run_train(recipe, opts, target, mask_id, work, out, seed, steps=steps, minutes=minutes, resume=resume,
                          data_only=data_only, no_generate=no_generate, checkpoint_minutes=checkpoint_minutes,
                          init_from=init_from, console=console)


def _run_train(recipe, opts, target, mask_id: int, work: Path, out: Path, seed: int, *, steps, minutes, resume,
               data_only, no_generate, checkpoint_minutes, init_from, console) -> dict:
    """run_train after its checks: the start drafter, data, training, the prompt list."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    start_state = None
    drafter = None
    if resume:
        loaded = load_checkpoint(work)
        if loaded is not None:
            drafter, start_state = loaded
            _check_start(drafter, target, opts.block_size, work / "checkpoint" / "drafter")
            console.print(f"resuming from step {start_state['step']} ({work / 'checkpoint'})")
        else:
            console.print(f"--resume: no checkpoint in {work} yet, starting from step 0")
    if drafter is None and init_from is not None:
        from dflash_export.models.drafter import load_drafter

        drafter = load_drafter(init_from, dtype=torch.float32)
        _check_start(drafter, target, opts.block_size, Path(init_from))
        if drafter.config.num_hidden_layers != opts.draft_layers:
            n = drafter.config.num_hidden_layers
            drafter = grow_drafter(drafter, opts.draft_layers, recipe_path=recipe.path)
            console.print(f"growing {init_from} from {n} to {opts.draft_layers} layers (the new ones start as "
                          "identities)")
    if drafter is None:
        drafter = drafter_from_target(target, opts.draft_layers, opts.block_size, mask_id, opts.target_layer_ids,
                                      recipe_path=recipe.path)
    tap_ids = drafter.config.target_layer_ids

    train_src, heldout_src, tf_src, src_name = _prompt_sources(recipe, target, opts, seed)
    ddir = data_dir(target, tap_ids, opts.max_prompt_tokens, opts.max_new_tokens, opts.soft_topk, src_name)
    hdir = data_dir(target, tap_ids, opts.max_prompt_tokens, opts.max_new_tokens, opts.soft_topk,
                    src_name.replace("-s", "-heldout-s"))
    tdir = data_dir(target, tap_ids, opts.max_prompt_tokens, opts.max_reply_tokens, opts.soft_topk,
                    src_name.replace("-s", "-tf-s"))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as bar, _no_bar_on_error(bar):
        if not no_generate:
            for name, src, directory, n, tf, kind in (
                    ("held-out data", heldout_src, hdir, opts.heldout_prompts, False,
                     src_name.replace("-s", "-heldout-s")),
                    ("teacher-forced data", tf_src, tdir, opts.teacher_forced_prompts, True, None),
                    ("train data", train_src, ddir, opts.num_prompts, False, src_name)):
                if n == 0:
                    continue
                task = bar.add_task(name, total=n, info="")
                progress = (lambda d, t, tps, task=task: bar.update(task, completed=d, info=f"{tps:.0f} tok/s"))
                if tf:
                    generate_shards(target, src, directory, tap_ids, opts.max_new_tokens, n, opts.gen_batch_size,
                                    opts.soft_topk, teacher_forced=True, progress=progress)
                else:  # the target's own answers: tokens (pass 1, taps captured) then any missing features (pass 2)
                    own_answer_data(target, src, directory,
                                    answers_dir(target, opts.max_prompt_tokens, opts.max_new_tokens, kind),
                                    tap_ids, opts.max_new_tokens, n, opts.gen_batch_size, opts.soft_topk, progress)
        heldout = load_shards(hdir)[: opts.heldout_prompts] if hdir.is_dir() else []

        sources = [(d, n) for d, n in ((ddir, opts.num_prompts), (tdir, opts.teacher_forced_prompts)) if n]
        loader = shard_loader(sources)

        if data_only:
            return {"data_dir": str(ddir), "sequences": len(loader())}

        # Whether there is anything to train on, without reading the shards (train_drafter reads them next).
        if not any(d.is_dir() and shard_paths(d) for d, _ in sources):
            raise DFlashError("no training data: the prompt set is empty or not generated yet (run without "
                              "--no-generate)", path=ddir)
        cfg = TrainConfig(block_size=opts.block_size, gamma=opts.gamma, lr=opts.lr, warmup_steps=opts.warmup_steps,
                          lr_decay_steps=opts.lr_decay_steps, lr_min_ratio=opts.lr_min_ratio,
                          batch_size=opts.batch_size, blocks_per_seq=opts.blocks_per_seq,
                          soft_weight=opts.soft_weight, seed=seed, steps=opts.steps if steps is None else steps,
                          minutes=minutes, checkpoint_every_s=checkpoint_minutes * 60)
        first = start_state["step"] if start_state else 0
        task = bar.add_task("train", total=cfg.steps, completed=first, info="")
        work.mkdir(parents=True, exist_ok=True)
        log_path = work / "curve.jsonl"

        def log(rec):
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if rec.get("event") == "checkpoint":
                bar.console.print(" ".join(f"{k}={v}" for k, v in rec.items() if k != "event"))

        result = train_drafter(drafter, target, loader, heldout, cfg, work, out, start_state,
                               progress=lambda s, loss: bar.update(task, completed=s, info=f"loss {loss:.3f}"),
                               log=log)
    if opts.prompts == "sharegpt":
        indices = sorted({s.index for s in loader()})  # a prompt can be in both the generated and teacher-forced sets
        try:
            with atomic_file(out.parent / f"{out.name}-train-prompts.txt") as f:
                f.write("# ShareGPT V3 record indices whose first-turn prompt this drafter was trained on\n")
                f.write("\n".join(str(i) for i in indices) + "\n")
        except OSError as e:
            raise DFlashError(f"cannot write the prompt list ({e.strerror or e})", path=out.parent) from None
    console.print(f"drafter: {out}  (best held-out implied τ {result['best'].get('tau_est', 0):.2f} "
                  f"at step {result['best'].get('step')})")
    return result
