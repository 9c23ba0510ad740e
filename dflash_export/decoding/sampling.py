"""Token sampling shared by the reference and the runtime: temperature, top-k, top-p, and inverse-CDF draws.

Random numbers are uniforms drawn by the caller (numpy's PCG64 seeded per request), so the PyTorch reference and the
compiled engines consume the same stream and a seeded run is reproducible on every backend.
"""

from __future__ import annotations

import numpy as np

TINY_TEMPERATURE = 1e-20  # below it, dividing logits by T is checked for overflow (the T -> 0 limit taken instead)


def probs_from_logits(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """logits [..., V] -> probabilities (float64) after temperature, top-k and top-p (nucleus) filtering."""
    logits = np.asarray(logits)
    if not (top_k and 0 < top_k < logits.shape[-1]):
        return _softmax_nucleus(_over_temperature(np.asarray(logits, dtype=np.float64), temperature), top_p)
    # Exactly k survive, as torch.topk keeps (z-lab's release): every value above the k-th, then values tied with it
    # in index order until k are kept. Softmax and nucleus run over those k alone, row by row: over the whole
    # vocabulary they cost 2.7 ms a row on SmolLM2's 49k (the nucleus sort most of it), over the k 0.4 ms.
    # The k are chosen on the logits as given: float32 -> float64 and x / T (T >= TINY_TEMPERATURE, no overflow) keep
    # their order and ties exactly; a smaller T may send several logits to the same -inf (_over_temperature), so it
    # selects on the tempered scores.
    scores = logits if logits.dtype == np.float32 and temperature >= TINY_TEMPERATURE else \
        _over_temperature(np.asarray(logits, dtype=np.float64), temperature)
    rows = scores.reshape(-1, scores.shape[-1])
    kept = []
    for row in rows:
        keep = _top_k_indices(row, top_k)
        x = _over_temperature(row[keep].astype(np.float64), temperature) if row.dtype == np.float32 else row[keep]
        # a k-th value that is NaN (k NaN logits or more) keeps nothing: NaN, as softmax over all -inf gives
        kept.append((keep, _softmax_nucleus(x[None], top_p)[0] if len(keep) else np.nan))
    out = np.zeros(rows.shape, np.float64)  # allocated after the partitions: before them, 0.2 ms a row in page faults
    for r, (keep, p) in enumerate(kept):
        out[r, keep if len(keep) else slice(None)] = p
    return out.reshape(scores.shape)


# _top_k_indices selects first among every SAMPLE_STRIDE-th value of a row (one of at least 4 x SAMPLE_STRIDE x k).
SAMPLE_STRIDE = 16


def _top_k_indices(row: np.ndarray, k: int) -> np.ndarray:
    """The indices (ascending) of the k values torch.topk keeps: every value above the k-th largest, then values tied
    with it in index order until k; none where the k-th is NaN. The k-th largest of every SAMPLE_STRIDE-th value is
    at most the row's, so the values reaching it hold all of the row's k largest: the selection runs over those
    (about SAMPLE_STRIDE x k of them) instead of the whole row: on SmolLM2's 49k logits (16 sampled sequences, top-k
    20, AMD EPYC with AVX-512) the selection took 0.03 against 0.43 ms a row, probs_from_logits 0.25 against 0.79 ms.
    A row holding NaN (np.partition sorts it above every number) selects over the whole row."""
    if len(row) >= 4 * SAMPLE_STRIDE * k and not np.isnan(row.max()):
        cand = np.flatnonzero(row >= np.partition(row[::SAMPLE_STRIDE], -k)[-k])
    else:
        cand = np.arange(len(row))
    vals = row[cand]
    kth = np.partition(vals, -k)[-k]
    above, tied = cand[vals > kth], cand[vals == kth]
    return np.sort(np.concatenate([above, tied[:k - len(above)]]))


def _over_temperature(x: np.ndarray, temperature: float) -> np.ndarray:
    """x / T for float64 scores of float32 size (|x| <= 3.4e38). Only a T below TINY_TEMPERATURE can overflow that;
    where it does, each row less its maximum, divided, is 0 at the maximum and -inf (probability 0) or finite below:
    the limit T -> 0."""
    with np.errstate(over="ignore"):
        out = x / temperature
        if temperature < TINY_TEMPERATURE and np.isinf(out).any():
            out = (x - x.max(axis=-1, keepdims=True)) / temperature
    return out


def tempered(logits: np.ndarray, temperature: float) -> np.ndarray:
    """logits / temperature in float32: scores whose softmax is the tempered distribution (what a sampled step's
    drafter confidences and tree scores are taken from). A temperature so small that the quotient overflows float32,
    or rounds to 0 in it, gives the same scores less each row's maximum, computed in float64: 0 at the maximum, -inf
    or a finite negative below it."""
    x = np.asarray(logits, np.float32)
    t = np.float32(temperature)
    if temperature >= TINY_TEMPERATURE:  # no model's logit reaches 3.4e38 * TINY_TEMPERATURE: no overflow to check
        return x / t
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        out = x / t
        if t > 0 and np.isfinite(out).all():
            return out
        x64 = x.astype(np.float64)
        return ((x64 - x64.max(axis=-1, keepdims=True)) / temperature).astype(np.float32)


def _softmax_nucleus(x: np.ndarray, top_p: float) -> np.ndarray:
    """softmax over the last axis, then the smallest set of most likely values whose mass reaches `top_p` (ties in
    index order), renormalized."""
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        keep_sorted = (cum - sorted_p) < top_p  # always keeps the most likely token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def top_probability(logits: np.ndarray) -> np.ndarray:
    """softmax(logits).max(-1) per row: the drafter's confidence in its greedy token (what adaptive verification
    weighs against the cost of one more verified position)."""
    x = np.asarray(logits, np.float32)
    return 1.0 / np.exp(x - x.max(-1, keepdims=True)).sum(-1)


def verify_length(confidence: np.ndarray, threshold: float) -> int:
    """How many leading drafts to verify: the longest prefix whose cumulative confidence (the chance, by the
    drafter's own account, that every draft up to it is accepted) stays >= `threshold`."""
    reach = np.cumprod(np.asarray(confidence, np.float64))
    below = np.nonzero(reach < threshold)[0]
    return int(below[0]) if len(below) else len(reach)


def select_candidates(logits: np.ndarray, projected: np.ndarray, predecessor: np.ndarray, successor: np.ndarray,
                      anchor: int, top_k: int, temperature: float, uniforms=None
                      ) -> tuple[np.ndarray, np.ndarray | None]:
    """DFlash 2's candidate selector (z-lab's CandidateSelector.select) for one block, in numpy.

    logits [n, V] draft logits of slots 1..n; projected [n, R] hidden_projection of those slots; predecessor /
    successor [V, R] the codebooks. Slot i scores its top-k candidates c by logits[i, c] + sum_r predecessor[prev, r]
    * projected[i, r] * successor[c, r], prev being the token chosen at slot i-1 (the anchor first), and takes the
    argmax (greedy) or a draw from softmax(scores / T) with uniforms[i] (candidates in descending-logit order).
    Returns tokens [n] int64 and, when sampling, draft distributions [n, V] float64 (q on the candidates, 0 elsewhere).
    """
    n, v = logits.shape
    part = np.argpartition(-logits, top_k - 1, axis=-1)[:, :top_k]
    tokens = np.zeros(n, np.int64)
    probs = None if temperature <= 0 else np.zeros((n, v), np.float64)
    prev = int(anchor)
    for i in range(n):
        cand = part[i][np.lexsort((part[i], -logits[i, part[i]]))]  # descending logit, ties by token id
        scores = logits[i, cand].astype(np.float64) + successor[cand].astype(np.float64) @ (
            predecessor[prev].astype(np.float64) * projected[i].astype(np.float64))
        if temperature <= 0:
            index = int(np.argmax(scores))
        else:
            x = _over_temperature(scores, temperature)
            q = np.exp(x - x.max())
            q /= q.sum()
            index = sample_from(q, uniforms[i])
            probs[i, cand] = q
        prev = int(cand[index])
        tokens[i] = prev
    return tokens, probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a 1-D distribution with the uniform `u` in [0, 1)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(idx, len(probs) - 1)


def verify_block(target_probs: np.ndarray | None, target_logits: np.ndarray, draft_tokens: np.ndarray,
                 draft_probs: np.ndarray | None, uniforms: np.ndarray | None, greedy: bool) -> tuple[int, list[int]]:
    """Accept a drafted block. The heart of speculative decoding, lossless by construction.

    target_logits/probs [bs, V]: the target's prediction after each block slot (slot 0 = anchor).
    draft_tokens [bs-1]: drafted tokens for slots 1..bs-1; draft_probs [bs-1, V] their draft distributions.
    uniforms [bs]: uniforms[i-1] tests draft i; uniforms[bs-1] draws the final (residual or bonus) token.
    Returns (accept_len, emitted) where emitted = accepted drafts + one token from the target.
    """
    n = len(draft_tokens)
    if greedy:
        target_next = np.argmax(target_logits, axis=-1)
        accept = 0
        while accept < n and draft_tokens[accept] == target_next[accept]:
            accept += 1
        return accept, [int(t) for t in draft_tokens[:accept]] + [int(target_next[accept])]
    for i in range(n):
        tok = int(draft_tokens[i])
        p, q = target_probs[i, tok], draft_probs[i, tok]
        if uniforms[i] * q < p:  # accept with probability min(1, p/q)
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        if residual.sum() <= 0:  # p == q exactly: any draw from p is the residual's limit
            residual = target_probs[i]
        return i, [int(t) for t in draft_tokens[:i]] + [sample_from(residual, uniforms[n])]
    return n, [int(t) for t in draft_tokens] + [sample_from(target_probs[n], uniforms[n])]
