"""The target's own long greedy answers as drafter training data, made fast enough for a CPU.

Why: at inference the drafter drafts the target's own text, and a small target's long answers repeat themselves (loops
after ~100 tokens, lines copied from the prompt). A drafter only learns to draft those if it trains on them, so the
data are the target's greedy answers up to `max_new_tokens` (512 for the SmolLM2 recipe), not 128-token prefixes.

Two passes, both resumable shard by shard (shard i = prompts [i*SHARD_SIZE, (i+1)*SHARD_SIZE) of a fixed order):
- pass 1, tokens: `greedy_answers` decodes many prompts at once with a KV cache -- left padding, explicit positions,
  finished rows dropped and the freed slots refilled with the next prompts -- and writes `answers-XXXXX.pt`
  (index, prompt ids, answer ids). The same decoding steps already compute every position's hidden states and next-token
  logits, so pass 1 also keeps the taps and top-k soft targets and writes the feature shard alongside (capture).
- pass 2, features: `feature_shards` rebuilds a feature shard from a token shard with one causal forward over prompt +
  answer (for another tap choice, or when pass 1 ran without capture).
Feature shards are `train.py`'s TrainSequence shards, so the trainer loads them as it loads any generated data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from dflash_export.errors import DFlashError, atomic_file

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


def _layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise DFlashError("this transformers version's DynamicCache has no per-layer tensors (need >= 4.56)")
    return layers


def _select_rows(cache, keep: torch.Tensor, trim: int) -> None:
    """Keep batch rows `keep` of every layer, dropping the first `trim` cache columns (padding for every kept row)."""
    for layer in _layers(cache):
        layer.keys = layer.keys[keep, :, trim:].contiguous()
        layer.values = layer.values[keep, :, trim:].contiguous()


def _merge_rows(cache, new_cache) -> None:
    """Append `new_cache`'s rows to `cache`'s, left-padding the shorter one's columns with zeros (masked out)."""
    for layer, new in zip(_layers(cache), _layers(new_cache)):
        a_len, b_len = layer.keys.shape[-2], new.keys.shape[-2]
        width = max(a_len, b_len)

        def pad(t, n):
            return torch.nn.functional.pad(t, (0, 0, width - n, 0)) if n < width else t

        layer.keys = torch.cat([pad(layer.keys, a_len), pad(new.keys, b_len)], 0)
        layer.values = torch.cat([pad(layer.values, a_len), pad(new.values, b_len)], 0)


@torch.inference_mode()
def greedy_answers(hf, prompts: Iterable[tuple[int, list[int]]], max_new_tokens: int, stop_ids: Sequence[int],
                   batch_size: int = 32, tap_ids: Sequence[int] | None = None, topk: int = 4,
                   pad_id: int = 0, refill_at: int | None = None) -> Iterator[Answer]:
    """Greedy answers of the HF causal LM `hf` to `prompts` ((key, ids)), decoded `batch_size` at a time; yields each
    as soon as it is finished (stop token or `max_new_tokens`), so not in input order.

    Each row sits right-aligned in a shared KV cache with its own absolute positions (`position_ids`) and an attention
    mask hiding its left padding, so its tokens are the ones unbatched greedy decoding would pick (up to fp32 rounding
    of the batched matmuls at near-ties). Finished rows leave the cache at once; when `refill_at` or more slots are
    free, the next prompts are prefilled together and merged in. With `tap_ids`, each row's taps (HF
    hidden_states[id + 1]) and the top-k log-probabilities of each answer token are kept as well."""
    stop = set(stop_ids)
    source = iter(prompts)
    refill_at = refill_at or max(1, batch_size // 4)
    rows: list[_Row] = []
    cache = None
    mask = torch.zeros(0, 0, dtype=torch.long)     # [B, L]: 1 = real token in the cache
    pos = torch.zeros(0, dtype=torch.long)          # [B]: position of each row's next input token
    last = torch.zeros(0, dtype=torch.long)         # [B]: each row's next input token
    exhausted = False

    def keep(out_logits: torch.Tensor, rows_slice: Sequence[_Row], col: Sequence[int] | int):
        """Record each row's next token (+ its top-k) from the logits at column(s) `col`."""
        idx = torch.arange(len(rows_slice))
        cols = torch.as_tensor(col) if not isinstance(col, int) else torch.full((len(rows_slice),), col)
        logits = out_logits[idx, cols].float()
        nxt = logits.argmax(-1)
        if tap_ids is not None:
            logp = torch.log_softmax(logits, -1)
            t_logp, t_ids = logp.topk(topk, dim=-1)
            for r, row in enumerate(rows_slice):
                row.top_ids.append(t_ids[r])
                row.top_logp.append(t_logp[r])
        for r, row in enumerate(rows_slice):
            row.answer.append(int(nxt[r]))
        return nxt

    while True:
        free = batch_size - len(rows)
        if not exhausted and (free >= refill_at or not rows):
            new = []
            for _ in range(free):
                try:
                    key, ids = next(source)
                except StopIteration:
                    exhausted = True
                    break
                new.append(_Row(key, list(ids)))
            if new:
                width = max(len(r.prompt) for r in new)
                ids = torch.full((len(new), width), pad_id, dtype=torch.long)
                m = torch.zeros((len(new), width), dtype=torch.long)
                for i, r in enumerate(new):
                    ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                    m[i, width - len(r.prompt):] = 1
                p = (m.cumsum(-1) - 1).clamp(min=0)
                from transformers import DynamicCache

                new_cache = DynamicCache()
                out = hf(input_ids=ids, attention_mask=m, position_ids=p, past_key_values=new_cache, use_cache=True,
                         output_hidden_states=tap_ids is not None)
                if tap_ids is not None:
                    taps = torch.cat([out.hidden_states[t + 1] for t in tap_ids], -1)
                    for i, r in enumerate(new):
                        r.taps.append(taps[i, width - len(r.prompt):].to(torch.float16))
                nxt = keep(out.logits, new, width - 1)
                new_pos = torch.tensor([len(r.prompt) for r in new])
                if cache is None:
                    cache, mask, pos, last = new_cache, m, new_pos, nxt
                else:
                    a_len, b_len = mask.shape[1], m.shape[1]
                    w = max(a_len, b_len)
                    mask = torch.cat([torch.nn.functional.pad(mask, (w - a_len, 0)),
                                      torch.nn.functional.pad(m, (w - b_len, 0))], 0)
                    _merge_rows(cache, new_cache)
                    pos, last = torch.cat([pos, new_pos]), torch.cat([last, nxt])
                rows.extend(new)
        if not rows:  # every prompt answered (the source ran dry only now)
            return
        # retire rows whose last token ended them (the prefill's first token can already do so)
        done = [i for i, r in enumerate(rows) if r.answer[-1] in stop or len(r.answer) >= max_new_tokens]
        if done:
            for i in done:
                yield _finish(rows[i], tap_ids is not None)
            kept = torch.tensor([i for i in range(len(rows)) if i not in set(done)], dtype=torch.long)
            rows = [rows[i] for i in kept.tolist()]
            if not rows:
                cache, mask = None, torch.zeros(0, 0, dtype=torch.long)
                pos = last = torch.zeros(0, dtype=torch.long)
                if exhausted:
                    return
                continue
            mask = mask[kept]
            trim = int((mask.cumsum(-1) == 0).sum(-1).min())  # leading columns that are padding for every row
            mask = mask[:, trim:]
            _select_rows(cache, kept, trim)
            pos, last = pos[kept], last[kept]
            if not exhausted and batch_size - len(rows) >= refill_at:
                continue
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
        out = hf(input_ids=last[:, None], attention_mask=mask, position_ids=pos[:, None], past_key_values=cache,
                 use_cache=True, output_hidden_states=tap_ids is not None)
        if tap_ids is not None:
            taps = torch.cat([out.hidden_states[t + 1] for t in tap_ids], -1)[:, 0].to(torch.float16)
            for r, row in enumerate(rows):
                row.taps.append(taps[r:r + 1])
        last = keep(out.logits, rows, 0)
        pos = pos + 1


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


def load_answers(path: Path) -> list[dict]:
    try:
        rows = torch.load(path, weights_only=True)
        if not isinstance(rows, list) or not all(isinstance(r, dict) and {"index", "prompt", "answer"} <= r.keys()
                                                 for r in rows):
            raise ValueError("not a list of answers")
        return rows
    except Exception as e:  # a corrupt shard is never trained on
        raise DFlashError(f"unreadable answer shard ({type(e).__name__}); delete it to regenerate", path=path) from None


def generate_answer_shards(target, prompts: Sequence[tuple[int, list[int]]], token_dir: Path,
                           feature_dir: Path | None, tap_ids: Sequence[int] | None, max_new_tokens: int,
                           batch_size: int = 32, topk: int = 4,
                           progress: Callable[[int, int, float], None] | None = None) -> int:
    """Pass 1 over `prompts` (fixed order): writes `token_dir/answers-i.pt` for every shard i that is missing, and with
    `feature_dir` + `tap_ids` the captured feature shard `feature_dir/shard-i.pt` too. Returns answers on disk.
    `progress(done prompts, total prompts, generated tok/s)` after each shard."""
    from dflash_export.train import TrainSequence

    n_shards = (len(prompts) + SHARD_SIZE - 1) // SHARD_SIZE
    todo = [i for i in range(n_shards) if not (token_dir / f"answers-{i:05d}.pt").is_file()
            or (feature_dir is not None and not (feature_dir / f"shard-{i:05d}.pt").is_file())]
    done_prompts = len(prompts) - sum(len(prompts[i * SHARD_SIZE:(i + 1) * SHARD_SIZE]) for i in todo)
    if not todo:
        return len(prompts)
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
    from dflash_export.train import teacher_forced_sequences

    paths = answer_paths(token_dir)
    feature_dir.mkdir(parents=True, exist_ok=True)
    for n, path in enumerate(paths):
        out = feature_dir / path.name.replace("answers-", "shard-")
        if not out.is_file():
            rows = load_answers(path)
            items = [(r["index"], list(r["prompt"]) + list(r["answer"]), len(r["prompt"])) for r in rows]
            seqs = teacher_forced_sequences(target, items, tap_ids, batch_size, topk)
            for s in seqs:
                s.teacher_forced = False  # the answer is the target's own greedy text: its tokens are the labels
            _save(out, [s.to_dict() for s in seqs])
        if progress is not None:
            progress(n + 1, len(paths))
    return len(paths)
