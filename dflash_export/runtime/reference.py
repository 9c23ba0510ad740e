"""The yardstick: DFlash speculative generation and plain autoregressive generation in PyTorch (batch size 1).

Every compiled engine is judged against these two functions, so they stay small and plain. Greedy decoding uses argmax;
T>0 uses standard speculative rejection sampling (`sampling.verify_block`), which is lossless: the output distribution
equals the target's. Uniforms come from numpy's PCG64 stream seeded by `seed`, consumed in a fixed order
(AR: one per token; spec: one for the first token, then bs-1 for drafting and bs for verifying per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_export.decoding.prompt_lookup import lookup_branches
from dflash_export.decoding.sampling import probs_from_logits, sample_from, verify_block
from dflash_export.decoding.tree import TreeState, build_tree, chain, greedy_accept
from dflash_export.engines.numerics import PROBE_ROWS


@dataclass
class GenerationResult:
    tokens: list[int]                      # new tokens only (prompt excluded), stop token included if hit
    acceptance_lengths: list[int] = field(default_factory=list)  # per spec step: tokens committed (accepted + bonus)
    ttft_s: float = 0.0                    # time to first token
    tpot_s: float = 0.0                    # mean time per output token after the first
    total_s: float = 0.0
    finish_reason: str = "length"          # "stop" | "length"

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (τ); 1.0 for AR."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 1.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0


def _pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, rng) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    return sample_from(probs_from_logits(logits.double().numpy(), temperature, top_k, top_p), rng.random())


def _finish(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], str]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens[:max_new_tokens], "length"


def _as_ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    return ids[None] if ids.ndim == 1 else ids


@torch.inference_mode()
def ar_generate(target, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, stop_token_ids=None, seed: int = 0) -> GenerationResult:
    """Plain target decoding, one token per forward."""
    ids = _as_ids(input_ids)
    stop_ids = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    rng = np.random.default_rng(seed)
    cache = target.new_cache()
    n = ids.shape[1]
    t0 = time.perf_counter()
    out = target.forward(ids, torch.arange(n)[None], cache)
    tokens = [_pick(out.logits[0, -1], temperature, top_k, top_p, rng)]
    ttft = time.perf_counter() - t0
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        pos = n + len(tokens) - 1
        out = target.forward(torch.tensor([[tokens[-1]]]), torch.tensor([[pos]]), cache)
        tokens.append(_pick(out.logits[0, -1], temperature, top_k, top_p, rng))
    total = time.perf_counter() - t0
    tokens, reason = _finish(tokens, max_new_tokens, stop_ids)
    return GenerationResult(tokens, [1] * len(tokens), ttft, (total - ttft) / max(1, len(tokens) - 1), total, reason)


@torch.inference_mode()
def spec_generate(drafter, target, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, stop_token_ids=None, seed: int = 0, block_size: int | None = None
                  ) -> GenerationResult:
    """DFlash speculative decoding: draft a block in one drafter pass, verify it in one target pass, repeat."""
    ids = _as_ids(input_ids)
    spec = drafter.spec(block_size)
    bs, mask_id, tap_ids = spec.block_size, spec.mask_token_id, list(spec.target_layer_ids)
    stop_ids = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    greedy = temperature <= 0
    rng = np.random.default_rng(seed)
    t_cache, d_cache = target.new_cache(), drafter.new_cache()

    t0 = time.perf_counter()
    start = ids.shape[1]  # position of the anchor = number of committed tokens in the target cache
    out = target.forward(ids, torch.arange(start)[None], t_cache, tap_ids)
    tokens = [_pick(out.logits[0, -1], temperature, top_k, top_p, rng)]
    ttft = time.perf_counter() - t0
    taps, taps_pos = out.taps, torch.arange(start)[None]
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        # The last block holds no more slots than tokens are still owed (+1), as z-lab's release does.
        n = min(bs, max_new_tokens - len(tokens) + 1)
        block = torch.full((1, n), mask_id, dtype=torch.long)
        block[0, 0] = tokens[-1]
        block_pos = torch.arange(start, start + n)[None]
        # Draft: one pass over the block (the anchor slot yields nothing), then argmax / draws -- or, for DFlash 2,
        # the candidate selector's walk. A full block's uniforms are drawn whatever n is (the runtime's stream).
        draft_logits, hidden = drafter.draft_step(target, taps, taps_pos, block, block_pos, d_cache)
        draft, draft_probs = drafter.propose(draft_logits[0].float(), hidden[0], tokens[-1], temperature, top_k,
                                             top_p, None if greedy else rng.random(bs - 1))
        block[0, 1:] = torch.from_numpy(draft)
        # Verify: the target scores the whole block in one pass.
        snapshot = target.snapshot(t_cache)
        out = target.forward(block, block_pos, t_cache, tap_ids)
        logits = out.logits[0].double().numpy()
        target_probs = None if greedy else probs_from_logits(logits, temperature, top_k, top_p)
        accept, emitted = verify_block(target_probs, logits, draft, draft_probs, None if greedy else rng.random(bs),
                                       greedy)
        # Acceptance length = tokens this step committed: accepted drafts + bonus, cut at max_new_tokens and
        # after a stop token (z-lab's `acceptance_lengths`).
        committed, _ = _finish(emitted, max_new_tokens - len(tokens), stop_ids)
        tokens.extend(committed)
        accepted.append(len(committed))
        # Commit anchor + accepted drafts; the last emitted token becomes the next anchor (not yet in any cache).
        start += accept + 1
        target.commit(t_cache, start, snapshot, block[:, : accept + 1], block_pos[:, : accept + 1])
        taps, taps_pos = out.taps[:, : accept + 1], block_pos[:, : accept + 1]
    total = time.perf_counter() - t0
    tokens, reason = _finish(tokens, max_new_tokens, stop_ids)
    return GenerationResult(tokens, accepted, ttft, (total - ttft) / max(1, len(tokens) - 1), total, reason)


@torch.inference_mode()
def tree_spec_generate(drafter, target, input_ids, max_new_tokens: int = 128, stop_token_ids=None,
                       block_size: int | None = None, top_k: int = 4, max_nodes: int = 15,
                       drafter_branches: bool = True, lookups: bool = True,
                       tree_mode: str = "full") -> GenerationResult:
    """Greedy DFlash with draft trees (decoding/tree.py): each step grows a tree from the drafter's per-slot
    distributions (top `top_k` per depth) and the context's lookup branches, at most `max_nodes` drafted nodes (no cost
    model: a fixed budget), verifies every node in one target pass with an ancestor-only mask at positions committed
    length + depth ("full"; "spine": only the tree's best path, as a chain), accepts the longest path the target
    agrees with and keeps its cache rows."""
    ids = _as_ids(input_ids)
    spec = drafter.spec(block_size)
    bs, mask_id, tap_ids = spec.block_size, spec.mask_token_id, list(spec.target_layer_ids)
    stop_ids = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    t_cache, d_cache = target.new_cache(), drafter.new_cache()
    t0 = time.perf_counter()
    start = ids.shape[1]
    out = target.forward(ids, torch.arange(start)[None], t_cache, tap_ids)
    tokens = [int(torch.argmax(out.logits[0, -1]))]
    ttft = time.perf_counter() - t0
    taps, taps_pos = out.taps, torch.arange(start)[None]
    state, accepted = TreeState([int(t) for t in ids[0]] + tokens, 2 * bs), []
    lookup_depth = max(bs, PROBE_ROWS) - 1  # as deep as the engine's runtime lets lookup branches go
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        depth = min(bs - 1, max_new_tokens - len(tokens))
        logprobs = None
        if drafter_branches:
            block = torch.full((1, depth + 1), mask_id, dtype=torch.long)
            block[0, 0] = tokens[-1]
            positions = torch.arange(start, start + depth + 1)[None]
            draft_logits, _ = drafter.draft_step(target, taps, taps_pos, block, positions, d_cache)
            logprobs = draft_logits[0].float().numpy()  # build_tree normalizes the top-K it keeps per slot
        owed = max_new_tokens - len(tokens)
        found = lookup_branches(state.context.tokens, min(lookup_depth, owed), with_sizes=True) if lookups else []
        branches = [b for _, b in found]
        full = build_tree(tokens[-1], logprobs, branches, top_k=top_k, max_nodes=min(max_nodes, lookup_depth),
                          lookup_scores=state.lookups.score, lookup_sizes=[n for n, _ in found])
        spine = full.best_chain()
        tree = full if tree_mode == "full" else chain(tokens[-1], [full.tokens[i] for i in spine[1:]])
        n = len(tree)
        visible = torch.ones(1, 1, n, start + n, dtype=torch.bool)
        visible[0, 0, :, start:] = torch.from_numpy(tree.ancestor_mask())
        positions = torch.tensor([start + d for d in tree.depths])[None]
        out = target.forward(torch.tensor([tree.tokens]), positions, t_cache, tap_ids, attention_mask=visible)
        path, emitted = greedy_accept(tree, out.logits[0].argmax(-1).numpy())
        if tree_mode == "full":
            state.record(tree, path, set(range(len(tree))), drafter_branches, bool(branches))
        else:
            state.record(full, spine[:len(path)], set(spine), drafter_branches, bool(branches))
        committed, _ = _finish(emitted, max_new_tokens - len(tokens), stop_ids)
        tokens.extend(committed)
        state.context.extend(committed)
        accepted.append(len(committed))
        target.keep_rows(t_cache, start, path)
        taps, taps_pos = out.taps[:, path], torch.arange(start, start + len(path))[None]
        start += len(path)
    total = time.perf_counter() - t0
    tokens, reason = _finish(tokens, max_new_tokens, stop_ids)
    return GenerationResult(tokens, accepted, ttft, (total - ttft) / max(1, len(tokens) - 1), total, reason)
