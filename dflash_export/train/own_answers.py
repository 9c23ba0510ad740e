"""The target's own long greedy answers as drafter training data, made fast enough for a CPU.

Why: at inference the drafter drafts the target's own text, and a small target's long answers repeat themselves (loops
after ~100 tokens, lines copied from the prompt). A drafter only learns to draft those if it trains on them, so the
data are the target's greedy answers up to `max_new_tokens` (512 for the SmolLM2 recipe), not 128-token prefixes.

Two passes, both resumable shard by shard (shard i = prompts [i*SHARD_SIZE, (i+1)*SHARD_SIZE) of a fixed order):
- pass 1, tokens: `greedy_answers` decodes many prompts at once in a `SlotCache` -- one slot per sequence with its
  own length, a finished sequence's slot refilled with the next prompt at once -- and writes `answers-XXXXX.pt`
  (index, prompt ids, answer ids). The same decoding steps already compute every position's hidden states and next-token
  logits, so pass 1 also keeps the taps and top-k soft targets and writes the feature shard alongside (capture).
- pass 2, features: `feature_shards` rebuilds a feature shard from a token shard with one causal forward over prompt +
  answer (for another tap choice, or when pass 1 ran without capture).
Feature shards are `train/data.py`'s TrainSequence shards, so the trainer loads them as it loads any generated data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_file, removing_new_dirs
from dflash_export.train.data import (
    TrainSequence,
    UnreadableTensors,
    load_tensors,
    shard_done,
    short_reason,
    teacher_forced_sequences,
)

SHARD_SIZE = 32


@dataclass
class Answer:
    """One finished greedy answer; taps/top-k only when captured."""

    key: int                       # the caller's id of the prompt
    prompt: list[int]
    answer: list[int]              # new tokens, the stop token included when hit
    taps: torch.Tensor | None = None      # [S, n*H] float16 for S = len(prompt) + len(answer); the last row is zero
    top_ids: torch.Tensor | None = None   # [R, K] int64: top-k ids of answer token r (predicted at position P+r-1)
    top_logp: torch.Tensor | None = None  # [R, K] float32


@dataclass
class _Row:
    key: int
    prompt: list[int]
    answer: list[int] = field(default_factory=list)
    taps: list[torch.Tensor] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logp: list[torch.Tensor] = field(default_factory=list)


class SlotCache:
    """A preallocated K/V cache of `slots` sequences, each with its own length, for a LLaMA/Qwen3 HF model whose
    decoder layers it runs by hand (written here because transformers' generic path is what made pass 1 slow: its
    DynamicCache concatenates every step and its attention expands K/V to every query head under a padding mask).

    Per layer, K and V are [slots, kv_heads, max_len, head_dim]; slot b holds positions [0, lens[b]). Attention groups
    the query heads that share a K/V head into the query axis ([B, kv, groups * T, d] @ [B, kv, d, S]), so K/V are read
    once per K/V head and never copied. A sequence is prefilled alone (no padding at all) into a free slot; a decode
    step advances every slot by one token, writing each new K/V at its own slot's length."""

    def __init__(self, hf, slots: int, max_len: int):
        cfg = hf.config
        model = hf.model
        if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention"
                                                            for t in (getattr(cfg, "layer_types", None) or [])):
            raise DFlashError("the fast answer decoder handles full attention only (this target slides a window)",
                              field="layer_types")
        self.hf, self.model = hf, model
        self.layers = list(model.layers[: cfg.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.kv_heads = cfg.num_key_value_heads
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = attn.scaling
        dtype = next(hf.parameters()).dtype
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.lens = torch.zeros(slots, dtype=torch.long)
        self.max_len = max_len

    @property
    def slots(self) -> int:
        return int(self.lens.shape[0])

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only slots `idx` (in that order): the tail of a run, when too few sequences are left to fill them."""
        self.k = [k[idx] for k in self.k]
        self.v = [v[idx] for v in self.v]
        self.lens = self.lens[idx].clone()

    def _attend(self, li: int, layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                positions: torch.Tensor, slot_idx: torch.Tensor, mask: torch.Tensor, prefill: bool) -> torch.Tensor:
        """Layer `li`'s attention for x [B, T, H] at `positions` [B, T], writing K/V into the slots first; the keys
        are the mask's last axis wide."""
        attn = layer.self_attn
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, -1, self.head_dim)
        k = attn.k_proj(x).view(B, T, -1, self.head_dim)
        v = attn.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, heads, T, d]
        cos, sin = rope
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if prefill:  # prefill of one sequence into slot slot_idx[0]: positions 0..T-1
            s = int(slot_idx[0])
            self.k[li][s, :, :T] = k[0]
            self.v[li][s, :, :T] = v[0]
            keys, values = k, v
        else:                       # decode: one token per slot, at its own length
            self.k[li][slot_idx, :, positions[:, 0]] = k[:, :, 0]
            self.v[li][slot_idx, :, positions[:, 0]] = v[:, :, 0]
            width = mask.shape[-1]
            keys, values = self.k[li][:, :, :width], self.v[li][:, :, :width]
        g = self.groups
        q = q.reshape(B, self.kv_heads, g * T, self.head_dim)     # heads kv*g + j share K/V head kv (HF repeat_kv)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling  # [B, kv, g*T, S]
        scores = scores + mask
        out = torch.matmul(torch.softmax(scores.float(), -1).to(values.dtype), values)  # [B, kv, g*T, d]
        out = out.reshape(B, -1, T, self.head_dim).transpose(1, 2).reshape(B, T, -1)
        return attn.o_proj(out)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, slot_idx: torch.Tensor, mask: torch.Tensor,
             prefill: bool, tap_ids: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over ids [B, T]; returns the final normed hidden states [B, T, H] and the taps [B, T, n*H]."""
        h = self.model.embed_tokens(ids)
        rope = tuple(t.unsqueeze(1) for t in self.model.rotary_emb(h, positions))
        wanted = {t: None for t in (tap_ids or [])}
        n = len(self.layers)
        for li, layer in enumerate(self.layers):
            h = h + self._attend(li, layer, layer.input_layernorm(h), rope, positions, slot_idx, mask, prefill)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if li in wanted and li != n - 1:
                wanted[li] = h
        normed = self.model.norm(h)
        if n - 1 in wanted:  # HF's last hidden state is the normed one
            wanted[n - 1] = normed
        taps = torch.cat([wanted[t] for t in tap_ids], -1) if tap_ids else None
        return normed, taps

    def prefill(self, slot: int, prompt: Sequence[int], tap_ids: Sequence[int] | None = None):
        """Runs `prompt` alone into `slot`; returns the last position's logits [V] and the taps [P, n*H]."""
        T = len(prompt)
        if T + 1 > self.max_len:
            raise DFlashError(f"prompt of {T} tokens does not fit the decoder's {self.max_len} positions",
                              field="max_prompt_tokens")
        ids = torch.tensor([list(prompt)])
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1).repeat(self.groups, 1)[None, None]  # rows (group, t)
        h, taps = self._run(ids, pos, torch.tensor([slot]), mask, True, tap_ids)
        self.lens[slot] = T
        logits = self.hf.lm_head(h[0, -1])
        return logits, (taps[0] if taps is not None else None)

    def step(self, tokens: torch.Tensor, tap_ids: Sequence[int] | None = None):
        """Feeds one token per slot (tokens [slots]) at each slot's length; returns logits [slots, V], taps."""
        B = self.slots
        pos = self.lens.clone()
        if int(pos.max()) + 1 > self.max_len:
            raise DFlashError("an answer outgrew the decoder's positions", field="max_new_tokens")
        keys = torch.arange(int(pos.max()) + 1)
        mask = torch.where(keys[None, :] <= pos[:, None], 0.0, float("-inf"))[:, None, None, :]
        h, taps = self._run(tokens[:, None], pos[:, None], torch.arange(B), mask, False, tap_ids)
        self.lens += 1
        return self.hf.lm_head(h[:, 0]), (taps[:, 0] if taps is not None else None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@torch.inference_mode()
def greedy_answers(hf, prompts: Iterable[tuple[int, list[int]]], max_new_tokens: int, stop_ids: Sequence[int],
                   batch_size: int = 32, tap_ids: Sequence[int] | None = None, topk: int = 4,
                   pad_id: int = 0) -> Iterator[Answer]:
    """Greedy answers of the HF causal LM `hf` (LLaMA / Qwen3) to `prompts` ((key, ids)), decoded `batch_size` at a
    time in a SlotCache; yields each as soon as it is finished (stop token or `max_new_tokens`), so not in input order.

    Continuous batching: a finished sequence frees its slot at once and the next prompt is prefilled into it before
    the next step, so every step advances a full batch until the prompts run out (then the cache shrinks to the
    sequences left). Each token is the one unbatched greedy decoding picks, up to fp32 rounding of the batched matmuls
    at near-ties. With `tap_ids`, each row's taps (HF hidden_states[id + 1]) and the top-k log-probabilities of each
    answer token are kept as well. `pad_id` fills idle slots."""
    stop = set(stop_ids)
    source = list(prompts)
    if not source:
        return
    longest = max(len(p) for _, p in source)
    cache = SlotCache(hf, min(batch_size, len(source)), longest + max_new_tokens + 1)
    rows: list[_Row | None] = [None] * cache.slots
    last = torch.full((cache.slots,), pad_id, dtype=torch.long)
    nxt_prompt = 0

    def record(row: _Row, logits: torch.Tensor) -> int:
        logits = logits.float()
        tok = int(logits.argmax(-1))
        if tap_ids is not None:
            t_logp, t_ids = torch.log_softmax(logits, -1).topk(topk, dim=-1)
            row.top_ids.append(t_ids)
            row.top_logp.append(t_logp)
        row.answer.append(tok)
        return tok

    def finished(row: _Row) -> bool:
        return row.answer[-1] in stop or len(row.answer) >= max_new_tokens

    while True:
        # fill every free slot (a prompt whose first token already ends it is yielded at once)
        for s in range(cache.slots):
            while rows[s] is None and nxt_prompt < len(source):
                key, ids = source[nxt_prompt]
                nxt_prompt += 1
                row = _Row(key, list(ids))
                logits, taps = cache.prefill(s, row.prompt, tap_ids)
                if taps is not None:
                    row.taps.append(taps.to(torch.float16))
                last[s] = record(row, logits)
                if finished(row):
                    yield _finish(row, tap_ids is not None)
                    cache.lens[s] = 0
                else:
                    rows[s] = row
        active = [s for s in range(cache.slots) if rows[s] is not None]
        if not active:
            return
        if nxt_prompt >= len(source) and len(active) <= cache.slots // 2:  # the tail: stop computing idle slots
            idx = torch.tensor(active)
            cache.keep(idx)
            rows = [rows[s] for s in active]
            last = last[idx].clone()
        logits, taps = cache.step(last, tap_ids)
        for s in range(cache.slots):
            row = rows[s]
            if row is None:
                continue
            if taps is not None:
                row.taps.append(taps[s:s + 1].to(torch.float16))
            last[s] = record(row, logits[s])
            if finished(row):
                yield _finish(row, tap_ids is not None)
                rows[s] = None
                last[s] = pad_id
        for s in range(cache.slots):
            if rows[s] is None:
                cache.lens[s] = 0  # an idle slot's step wrote at position 0 only; keep it there


def _finish(row: _Row, captured: bool) -> Answer:
    if not captured:
        return Answer(row.key, row.prompt, row.answer)
    taps = torch.cat(row.taps, 0)  # every position but the last answer token (never fed back)
    taps = torch.cat([taps, torch.zeros(1, taps.shape[1], dtype=taps.dtype)], 0)
    return Answer(row.key, row.prompt, row.answer, taps, torch.stack(row.top_ids), torch.stack(row.top_logp))


# --------------------------------------------------------------------------------------------------- the two passes


def answer_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("answers-*.pt"))


def _save(path: Path, rows: list[dict]) -> None:
    try:
        with atomic_file(path, "wb") as f:
            torch.save(rows, f)
    except OSError as e:
        raise DFlashError(f"cannot write training data ({e.strerror or e})", path=path) from None


def load_answers(path: Path, vocab_size: int | None = None) -> list[dict]:
    """The rows of an answer shard; each one's prompt and answer non-empty lists of token ids (below `vocab_size`
    when given: a shard made for another target is named, not decoded)."""
    try:
        rows = load_tensors(path)
        if not isinstance(rows, list) or not all(isinstance(r, dict) and {"index", "prompt", "answer"} <= r.keys()
                                                 for r in rows):
            raise UnreadableTensors("not a list of answers")
    except Exception as e:  # a corrupt shard is never trained on
        raise DFlashError(f"unreadable answer shard ({short_reason(e)}); delete it to regenerate",
                          path=path) from None
    for i, r in enumerate(rows):
        for key in ("prompt", "answer"):
            ids = r[key]
            if not isinstance(ids, list) or not ids or not all(
                    is_int(t) and 0 <= t < (vocab_size or float("inf")) for t in ids):
                raise DFlashError(f"invalid answer shard (row {i}: {key} is not a non-empty list of token ids"
                                  + (f" below {vocab_size}" if vocab_size else "") + "); delete it to regenerate",
                                  path=path)
    return rows


def generate_answer_shards(target, prompts: Sequence[tuple[int, list[int]]], token_dir: Path,
                           feature_dir: Path | None, tap_ids: Sequence[int] | None, max_new_tokens: int,
                           batch_size: int = 32, topk: int = 4,
                           progress: Callable[[int, int, float], None] | None = None,
                           part: tuple[int, int] = (0, 1)) -> int:
    """Pass 1 over `prompts` (fixed order): writes `token_dir/answers-i.pt` for every shard i that is missing, and with
    `feature_dir` + `tap_ids` the captured feature shard `feature_dir/shard-i.pt` too. Returns answers on disk.
    `progress(done prompts, total prompts, generated tok/s)` after each shard. `part` = (i, n): only the shards
    k with k % n == i, so n processes can share the work (prompts of the others' shards count as not done)."""
    n_shards = (len(prompts) + SHARD_SIZE - 1) // SHARD_SIZE
    sizes = [len(prompts[i * SHARD_SIZE:(i + 1) * SHARD_SIZE]) for i in range(n_shards)]
    answered = [shard_done(token_dir / f"answers-{i:05d}.pt", sizes[i]) for i in range(n_shards)]
    todo = [i for i in range(n_shards) if i % part[1] == part[0]
            and (not answered[i] or (feature_dir is not None
                                     and not shard_done(feature_dir / f"shard-{i:05d}.pt", sizes[i])))]
    done_prompts = sum(sizes[i] for i in range(n_shards) if i not in todo and answered[i])
    if not todo:
        if progress is not None:  # every shard on disk already: the bar says so, not 0 of them
            progress(done_prompts, len(prompts), 0.0)
        return done_prompts
    token_dir.mkdir(parents=True, exist_ok=True)
    if feature_dir is not None:
        feature_dir.mkdir(parents=True, exist_ok=True)
    pending: dict[int, dict[int, Answer]] = {i: {} for i in todo}
    queue = [(i * SHARD_SIZE + j, p[1]) for i in todo
             for j, p in enumerate(prompts[i * SHARD_SIZE:(i + 1) * SHARD_SIZE])]
    pad = next(iter(target.stop_token_ids), 0)
    tokens, t0 = 0, time.perf_counter()
    capture = feature_dir is not None and tap_ids is not None
    for ans in greedy_answers(target.hf, queue, max_new_tokens, target.stop_token_ids, batch_size,
                              tap_ids if capture else None, topk, pad_id=pad):
        shard = ans.key // SHARD_SIZE
        pending[shard][ans.key] = ans
        tokens += len(ans.answer)
        size = len(prompts[shard * SHARD_SIZE:(shard + 1) * SHARD_SIZE])
        if len(pending[shard]) < size:
            continue
        answers = [a for _, a in sorted(pending.pop(shard).items())]
        _save(token_dir / f"answers-{shard:05d}.pt",
              [{"index": prompts[a.key][0], "prompt": a.prompt, "answer": a.answer} for a in answers])
        if capture:
            _save(feature_dir / f"shard-{shard:05d}.pt",
                  [TrainSequence(torch.tensor(a.prompt + a.answer), len(a.prompt), a.taps, a.top_ids, a.top_logp,
                                 prompts[a.key][0]).to_dict() for a in answers])
        done_prompts += size
        if progress is not None:
            progress(done_prompts, len(prompts), tokens / max(1e-9, time.perf_counter() - t0))
    return done_prompts


def feature_shards(target, token_dir: Path, feature_dir: Path, tap_ids: Sequence[int], topk: int = 4,
                   batch_size: int = 8, progress: Callable[[int, int], None] | None = None) -> int:
    """Pass 2: a feature shard for every token shard that lacks one -- one causal forward over prompt + answer gives
    every position's taps and the top-k of every answer token. Returns feature shards on disk."""
    paths = answer_paths(token_dir)
    feature_dir.mkdir(parents=True, exist_ok=True)
    for n, path in enumerate(paths):
        out = feature_dir / path.name.replace("answers-", "shard-")
        rows = load_answers(path, target.vocab_size)
        if not shard_done(out, len(rows)):  # none yet, or one made from a shorter answer shard
            items = [(r["index"], list(r["prompt"]) + list(r["answer"]), len(r["prompt"])) for r in rows]
            seqs = teacher_forced_sequences(target, items, tap_ids, batch_size, topk)
            for s in seqs:
                s.teacher_forced = False  # the answer is the target's own greedy text: its tokens are the labels
            _save(out, [s.to_dict() for s in seqs])
        if progress is not None:
            progress(n + 1, len(paths))
    return len(paths)


def own_answer_data(target, prompt_source: Callable[[], list], directory: Path, answers_directory: Path,
                    tap_ids: Sequence[int], max_new_tokens: int, num_prompts: int, batch_size: int, topk: int,
                    progress: Callable[[int, int, float], None] | None = None, part: tuple[int, int] = (0, 1)) -> int:
    """Feature shards in `directory` for the target's greedy answers to the first `num_prompts` prompts of
    `prompt_source()`: pass 1 (own_answers.generate_answer_shards) writes the answer tokens to `answers_directory` and
    the captured features to `directory`; pass 2 fills in the features of answers generated earlier for other taps.
    Both skip the shards already on disk, so an interrupted run resumes where it stopped."""
    prompts = prompt_source()[:num_prompts]
    if not prompts:
        raise DFlashError("the prompt set is empty", field="prompts")
    feature_shards(target, answers_directory, directory, tap_ids, topk)
    return generate_answer_shards(target, prompts, answers_directory, directory, tap_ids, max_new_tokens,
                                  batch_size, topk, progress, part)


def static_index_answers(target, train, num_prompts: int, batch_size: int = 32,
                         progress: Callable[[int, int, float], None] | None = None,
                         chat_template: bool = True) -> list[list[int]]:
    """The target's greedy answers (up to `train.max_new_tokens`) to the first `num_prompts` training prompts of the
    recipe's `train` options -- ShareGPT's train split, less the records whose prompt a held-out record also asks
    (sharegpt.asking_heldout: never its held-out split or an evaluation suite drawn from it), or
    synthetic prompts for tokenizer-less tiny targets; ShareGPT prompts chat-templated as `chat_template` (the
    recipe's) says, as `train` makes them -- what `build` indexes into the static n-gram index
    (decoding/static_ngrams.py). Read from the answer shards `train` caches, the missing ones generated first
    (whole shards, so `train` later finds every shard it expects complete)."""
    from dflash_export.train.data import answers_dir, sharegpt_prompt_ids, sharegpt_source, synthetic_prompt_ids

    shards = (num_prompts + SHARD_SIZE - 1) // SHARD_SIZE
    if train.prompts == "sharegpt":
        # only the whole shards it needs: the split's first prompts in `train`'s order, templated no further
        prompts = sharegpt_prompt_ids(target, "train", train.max_prompt_tokens, seed=train.seed,
                                      limit=shards * SHARD_SIZE, chat_template=chat_template)
        source = sharegpt_source(train.seed, chat_template)
    else:
        prompts = synthetic_prompt_ids(target.vocab_size, num_prompts, train.seed, 2)
        source = f"synthetic-static-s{train.seed}"
    prompts = prompts[:shards * SHARD_SIZE]
    if not prompts:
        raise DFlashError("the prompt set is empty", field="decoding.static_prompts")
    directory = answers_dir(target, train.max_prompt_tokens, train.max_new_tokens, source)
    with removing_new_dirs(directory):  # a failed run leaves its finished shards, and no empty directory
        generate_answer_shards(target, prompts, directory, None, None, train.max_new_tokens, batch_size,
                               progress=progress)
    wanted = {key for key, _ in prompts[:num_prompts]}
    if train.prompts == "sharegpt":
        from dflash_export.train.sharegpt import asking_heldout

        wanted -= asking_heldout()  # answered (the shards are `train`'s), never indexed
    rows = [r for i in range(shards) for r in load_answers(directory / f"answers-{i:05d}.pt", target.vocab_size)]
    return [list(r["answer"]) for r in rows if r["index"] in wanted]
