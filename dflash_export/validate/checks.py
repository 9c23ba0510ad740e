"""The figures `validate` judges an engine by, as small pure functions over token lists and probabilities.

Nothing here runs a model: the runner feeds in outputs, drafts and reference logits, so each rule is testable alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_export.validate.instrument import StepRecord


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (a length mismatch counts); None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def window(tokens: list[int], at: int, before: int = 4, after: int = 4) -> list[int]:
    """The tokens around position `at` (the divergence is at index `min(at, before)` of the result)."""
    return list(tokens[max(0, at - before): at + after + 1])


def diagnose(engine_dflash: list[int], engine_ar: list[int], reference_ar: list[int]) -> str:
    """Which layer broke losslessness: the export (engine AR already differs) or speculation (only DFlash differs)."""
    if engine_dflash == reference_ar:
        return "identical"
    if engine_ar != reference_ar:
        return "export changed the model"
    return "speculation changed the output"


def online_acceptance(steps: list[StepRecord], engine_tokens: list[int], reference_next: list[int]) -> list[int]:
    """Per step, 1 + the drafts that match the reference target's greedy choice after the engine's own prefix.

    `reference_next[j]` is the reference argmax for output index j given prompt + engine_tokens[:j] (one teacher-forced
    pass, so len == len(engine_tokens) + 1). Judging each step against the prefix the engine actually committed (not the
    reference's own output) keeps one early divergence from spoiling every later step. A draft is judged only while the
    drafts before it follow the engine's path (beyond it no reference logits exist), so the final, truncated step may
    count short.
    """
    out = []
    for st in steps:
        k = 0
        for i, d in enumerate(st.drafts):
            j = st.out_index + i
            if j >= len(reference_next) or d != reference_next[j]:
                break
            k += 1
            if j >= len(engine_tokens) or d != engine_tokens[j]:
                break
        out.append(k + 1)
    return out


def histogram(lengths: list[int], block_size: int) -> list[int]:
    """Counts of acceptance lengths 1..block_size (index 0 = length 1)."""
    counts = [0] * block_size
    for n in lengths:
        counts[min(max(n, 1), block_size) - 1] += 1
    return counts


def randomized_pit(probs: np.ndarray, token: int, w: float) -> float:
    """Randomized probability integral transform of a discrete draw: Uniform(0, 1) exactly when `token` ~ `probs`.

    Tokens are ordered by descending probability (ties by id) so that a sampler that favours unlikely tokens pushes
    values towards 1 and one that over-favours the mode pushes them towards 0.
    """
    order = np.lexsort((np.arange(len(probs)), -probs))
    rank = int(np.nonzero(order == token)[0][0])
    below = float(probs[order[:rank]].sum())
    return min(1.0, below + w * float(probs[token]))


@dataclass
class UniformityTest:
    statistic: float
    p_value: float
    n: int
    bins: int


def uniformity_chi2(values: list[float], bins: int | None = None) -> UniformityTest:
    """Pearson chi-square of values in [0, 1] against Uniform(0, 1) over equal bins (>= 5 expected per bin)."""
    from scipy.stats import chisquare

    n = len(values)
    if n == 0:
        return UniformityTest(0.0, 1.0, 0, 0)
    k = bins or int(max(2, min(20, n // 10)))
    counts = np.bincount(np.minimum((np.asarray(values) * k).astype(int), k - 1), minlength=k)
    res = chisquare(counts)
    return UniformityTest(float(res.statistic), float(res.pvalue), n, k)


def median(values) -> float:
    v = [float(x) for x in values if x is not None]
    return float(np.median(v)) if v else 0.0
