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


@dataclass
class ConditionalFit:
    """Likelihood-ratio (G) fit of sampled tokens to their exact conditional distributions, over a prefix tree."""

    statistic: float       # sum over prefixes of G = 2 * sum_cells O ln(O / E)
    null_mean: float       # its mean and variance under the null, by simulation
    null_var: float
    p_value: float
    n: int                 # tokens tested
    groups: int            # prefixes (nodes of the tree)


def _node_cells(p: np.ndarray, counts: dict[int, int], min_p: float, max_cells: int = 256
                ) -> tuple[np.ndarray, np.ndarray]:
    """(cell probabilities, observed counts): each token of p >= min_p its own cell (the `max_cells` likeliest at
    most, which bounds the simulation's cost on a full vocabulary), the rest pooled into one."""
    p = np.asarray(p, np.float64)
    own = np.nonzero(p >= min_p)[0]
    if len(own) > max_cells:
        own = np.sort(np.argsort(-p, kind="stable")[:max_cells])
    rest = 1.0 - float(p[own].sum())
    obs = np.array([counts.get(int(t), 0) for t in own], np.float64)
    owned = set(own.tolist())
    seen_rest = sum(c for t, c in counts.items() if t not in owned)
    if rest > 1e-12 or seen_rest:
        return np.append(p[own], max(rest, 1e-300)), np.append(obs, seen_rest)
    return p[own], obs


def _g(obs: np.ndarray, n: int, probs: np.ndarray) -> np.ndarray:
    """G = 2 sum O ln(O / (n p)) along the last axis (0 ln 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(obs > 0, obs * np.log(obs / (n * probs)), 0.0)
    return 2.0 * terms.sum(-1)


def conditional_g_test(groups, replicates: int = 2000, seed: int = 0, min_p: float = 1e-4) -> ConditionalFit:
    """Goodness of fit of tokens drawn from known conditionals, grouped by identical conditional (= same prefix).

    `groups`: iterable of (p [V], {token: count}); tokens of p == 0 must be counted as impossible by the caller.
    Statistic: the sum over prefixes of the likelihood-ratio G of the prefix's counts against n * p, one cell per token
    (tokens below `min_p` pooled), which keeps the power against faults that move mass between likely tokens or drop
    one (G weighs a missing cell twice as much as Pearson's X2 does). Null law: given its sample count a prefix's
    counts are multinomial(n, p) whatever came before (the tokens are drawn in sequence), so the centred per-prefix
    statistics are uncorrelated; their sum's mean and variance are estimated by drawing every prefix's multinomial
    `replicates` times, and the p-value is two-sided on the moment-matched scaled chi-square (Satterthwaite): twice
    the smaller tail, each tail no smaller than the share of simulated sums at least as extreme. The lower tail
    matters: most sampled prefixes are seen once, where G = 2 ln(1 / p(token)), so a sampler sharper than the target
    (temperature applied twice, greedy leaking in) draws likelier tokens and makes G fall below its null mean, which
    an upper tail alone reads as a perfect fit. Exact at any n (no >= 5 expected rule), so prefixes seen once count
    too.
    """
    from scipy.stats import chi2

    rng = np.random.default_rng(seed)
    stat, n_total, used = 0.0, 0, 0
    null = np.zeros(replicates)
    for p, counts in groups:
        n = int(sum(counts.values()))
        if n == 0:
            continue
        probs, obs = _node_cells(p, counts, min_p)
        if len(probs) < 2:
            continue
        probs = probs / probs.sum()
        stat += float(_g(obs, n, probs))
        null += _g(rng.multinomial(n, probs, size=replicates).astype(np.float64), n, probs)
        n_total += n
        used += 1
    if not used:
        return ConditionalFit(0.0, 0.0, 0.0, 1.0, 0, 0)
    mean, var = float(null.mean()), float(null.var(ddof=1))
    # Each tail is at least the share of simulated sums as extreme as the statistic: where a few rare tokens carry the
    # variance (peaked conditionals, every replicate at or near the same sum), the moment-matched chi-square has a
    # near-zero dof and puts the likeliest outcome far out in a tail, while the simulation shows it is typical.
    tol = 1e-9 * max(1.0, abs(stat))
    empirical = float(np.mean(null >= stat - tol)), float(np.mean(null <= stat + tol))
    if var > 1e-12 * max(1.0, mean * mean) and mean > 0:
        scale, dof = var / (2 * mean), 2 * mean * mean / var
        tails = (max(chi2.sf(stat / scale, dof), empirical[0]), max(chi2.cdf(stat / scale, dof), empirical[1]))
    else:  # G is constant under the simulated null (every prefix uniform over its cells and seen once, say)
        tails = empirical
    return ConditionalFit(stat, mean, var, float(min(1.0, 2 * min(tails))), n_total, used)


def median(values) -> float:
    v = [float(x) for x in values if x is not None]
    return float(np.median(v)) if v else 0.0
