"""Subtle sampling faults, planted in the PyTorch reference engine, that `validate`'s distribution check must catch.

Each is a plausible one-line bug in a T>0 verify step; none changes greedy output, so only the sampled check can see
them. `benchmarks/sampling_power.py` measures how often the check catches each at a given sample size (the figures that
fix the default, README "The T>0 distribution check"), and tests/test_validate.py asserts it catches all of them at the
default while passing the correct sampler.

  residual_from_p         after a rejection, the replacement token is drawn from p instead of norm(max(p - q, 0))
  bonus_from_wrong_row    after full acceptance, the bonus token is drawn from the last draft's row (n-1), not row n
  top_p_off_by_one        the nucleus drops the token that crosses top_p (keeps cum <= top_p, not cum - p < top_p)
  temperature_twice       target probabilities from logits / T, then tempered again by T
  draft_probs_wrong_slot  draft i is judged (and the residual formed) with the draft distribution of slot i - 1
The walk over a tree or lookup branches (decoding/acceptance.py, `decoding.sampling: walk`) has its own:
  walk_one_uniform        one uniform per step, reused for every draw of the walk (instead of one per token)
  walk_parent_row         after following a child, the next draw comes from the parent's row (an off-by-one row)
  walk_argmax_child       a child holding the target's argmax is followed without drawing (greedy leaking in)
The chain faults act on the drafter's sampled chain (`sampling: chain`), the walk faults on the walk; the two target
distribution faults (top_p_off_by_one, temperature_twice) on both.
"""

from __future__ import annotations

import numpy as np

from dflash_export.decoding.sampling import probs_from_logits, sample_from, verify_block
from dflash_export.engines.torch_ref import TorchEngine

CHAIN_FAULTS = ("residual_from_p", "bonus_from_wrong_row", "draft_probs_wrong_slot")
WALK_FAULTS = ("walk_one_uniform", "walk_parent_row", "walk_argmax_child")
FAULTS = ("residual_from_p", "bonus_from_wrong_row", "top_p_off_by_one", "temperature_twice",
          "draft_probs_wrong_slot", *WALK_FAULTS)


def _nucleus_off_by_one(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    p = probs_from_logits(logits, temperature, top_k, 1.0)
    if top_p >= 1.0:
        return p
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    keep_sorted = np.cumsum(sorted_p, axis=-1) <= top_p   # the bug: the crossing token is dropped
    keep_sorted[..., 0] = True
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def _verify_with_fault(fault: str, probs, logits, draft_tokens, draft_probs, uniforms):
    """`sampling.verify_block` (sampling branch) with one planted fault in the accept / resample rule."""
    n = len(draft_tokens)
    q_all = draft_probs
    if fault == "draft_probs_wrong_slot" and n > 1:
        q_all = np.roll(draft_probs, 1, axis=0)
    for i in range(n):
        tok = int(draft_tokens[i])
        if uniforms[i] * q_all[i, tok] < probs[i, tok]:
            continue
        residual = probs[i] if fault == "residual_from_p" else np.maximum(probs[i] - q_all[i], 0.0)
        if residual.sum() <= 0:
            residual = probs[i]
        return i, [int(t) for t in draft_tokens[:i]] + [sample_from(residual, uniforms[n])]
    row = max(n - 1, 0) if fault == "bonus_from_wrong_row" else n
    return n, [int(t) for t in draft_tokens] + [sample_from(probs[row], uniforms[n])]


def _walk_with_fault(fault: str, walk, logits: np.ndarray, probs) -> tuple[list[int], list[int]]:
    """`acceptance.walk_accept` over `walk.tree` with one planted fault; `probs(row)` each row's distribution."""
    tree = walk.tree
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, len(tree)):
        kids.setdefault(tree.parents[i], {}).setdefault(tree.tokens[i], i)
    path, emitted = [0], []
    u = walk.uniform() if fault == "walk_one_uniform" else None
    while True:
        node = path[-1]
        row = tree.parents[node] if fault == "walk_parent_row" and node > 0 else node
        children = kids.get(node, {})
        best = int(np.argmax(logits[node]))
        if fault == "walk_argmax_child" and best in children:
            token = best
        else:
            token = sample_from(probs(logits[row]), u if u is not None else walk.uniform())
        emitted.append(token)
        if token not in children:
            return path, emitted
        path.append(children[token])


class FaultyTorchEngine(TorchEngine):
    """The PyTorch reference engine with one planted sampling fault (`fault` in FAULTS, or None for none). A chain
    fault makes the runtime sample the drafter's chain (no host walk), where it lives."""

    fault: str | None = None

    @property
    def host_accept(self) -> bool:
        return self.fault not in CHAIN_FAULTS

    def walk(self, walk, logits, sp):
        if self.fault not in WALK_FAULTS:
            return super().walk(walk, logits, sp)
        return _walk_with_fault(self.fault, walk, logits, lambda row: self.target_probs(row, sp))

    def target_probs(self, logits, sp):
        if self.fault == "temperature_twice":
            return probs_from_logits(np.asarray(logits, np.float64) / sp.temperature, sp.temperature, sp.top_k,
                                     sp.top_p)
        if self.fault == "top_p_off_by_one":
            return _nucleus_off_by_one(logits, sp.temperature, sp.top_k, sp.top_p)
        return super().target_probs(logits, sp)

    def accept_block(self, probs, logits, draft_tokens, draft_probs, uniforms, greedy):
        if greedy or self.fault not in ("residual_from_p", "bonus_from_wrong_row", "draft_probs_wrong_slot"):
            return verify_block(probs, logits, draft_tokens, draft_probs, uniforms, greedy)
        return _verify_with_fault(self.fault, probs, logits, draft_tokens, draft_probs, uniforms)


def faulty_engine(fault: str | None, target, drafter, recipe_name: str = "", max_seq_len: int = 2048
                  ) -> FaultyTorchEngine:
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
    eng = FaultyTorchEngine(target, drafter, recipe_name, max_seq_len)
    eng.fault = fault
    return eng
