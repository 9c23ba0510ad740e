"""The reference generators: greedy spec gives the target's greedy tokens (AR's, near-ties aside); sampled spec has
exactly the target's distribution."""

import numpy as np
import pytest
import torch
from scipy import stats
from target_support import assert_transformers_greedy

from dflash_export.decoding.sampling import probs_from_logits, verify_block
from dflash_export.models import load_target
from dflash_export.models.checkpoint import load_drafter
from dflash_export.models.drafter import DFlashDrafter
from dflash_export.runtime.reference import ar_generate, spec_generate


class OracleDrafter(DFlashDrafter):
    """Test double: drafts the target's own greedy continuation, wrong at chosen slots, so that the acceptance
    paths (long accepts, stops inside a block, max_new_tokens cutting a block) are exercised with a tiny model."""

    def __init__(self, base: DFlashDrafter, prompt_len: int, continuation: list[int], wrong_every: int = 3):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.prompt_len, self.continuation, self.wrong_every = prompt_len, continuation, wrong_every
        self.block_lens: list[int] = []

    def draft_step(self, target, taps, ctx_positions, block_ids, block_positions, cache=None):
        self.block_lens.append(block_ids.shape[1])
        real, hidden = super().draft_step(target, taps, ctx_positions, block_ids, block_positions, cache)
        start = int(block_positions[0, 0])
        out = torch.full_like(real, -10.0)
        for j in range(1, block_ids.shape[1]):
            k = start + j - self.prompt_len
            tok = self.continuation[k] if k < len(self.continuation) else 0
            if (start + j) % self.wrong_every == 0:
                tok = (tok + 1) % real.shape[-1]
            out[0, j - 1, tok] = 10.0
        return out, hidden


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 3, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_spec_equals_ar_random_drafter(family, block_size, request):
    """Greedy spec's tokens are the target's greedy ones, each the argmax of the target's logits after the tokens
    before it: AR's, but where AR's best two logits lie within TIE, which the verify block's and the one-token step's
    rounding may order apart (tiny llama, block 4: 2e-5 apart, 24th token of the 13th prompt)."""
    target, drafter = request.getfixturevalue(f"tiny_{family}")
    for ids in _prompts(20, target.vocab_size, seed=block_size):
        sp = spec_generate(drafter, target, ids, max_new_tokens=24, block_size=block_size)
        assert_transformers_greedy(target.hf, ids, sp.tokens, target.stop_token_ids, 24)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_spec_equals_ar_with_long_accepts_stops_and_cuts(family, block_size, request):
    target, drafter = request.getfixturevalue(f"tiny_{family}")
    seen_multi, seen_stop_inside, seen_cut = False, False, False
    for i, ids in enumerate(_prompts(20, target.vocab_size, seed=100 + block_size)):
        full = ar_generate(target, ids, max_new_tokens=40, stop_token_ids=[])
        oracle = OracleDrafter(drafter, len(ids), full.tokens, wrong_every=5 + i % 7)
        # a stop token taken from inside the continuation, so it lands inside an accepted block
        stop = [full.tokens[7 + i % 9]] if i % 2 == 0 else []
        max_new = 13 + i  # not a multiple of the block size: cuts a block
        sp = spec_generate(oracle, target, ids, max_new_tokens=max_new, stop_token_ids=stop, block_size=block_size)
        assert_transformers_greedy(target.hf, ids, sp.tokens, stop, max_new)  # AR's tokens, near-ties aside
        assert sp.finish_reason == ("stop" if sp.tokens[-1] in stop else "length"), i
        seen_multi |= max(sp.acceptance_lengths, default=0) > 1
        seen_stop_inside |= sp.finish_reason == "stop" and sp.acceptance_lengths[-1:] > [1]
        # z-lab's acceptance lengths: the tokens each step committed, so they add up to the output (+ the first)
        assert sum(sp.acceptance_lengths) + 1 == len(sp.tokens)
        # the last block shortened to what max_new_tokens leaves (+1), as z-lab's verify_size
        owed = max_new - (len(sp.tokens) - sp.acceptance_lengths[-1]) if sp.acceptance_lengths else 0
        if sp.finish_reason == "length" and sp.acceptance_lengths:
            assert oracle.block_lens[-1] == min(block_size, owed + 1)
        seen_cut |= bool(oracle.block_lens) and oracle.block_lens[-1] < block_size
    assert seen_multi and (seen_cut or block_size == 2)  # a 2-slot block is never shortened
    if block_size > 2:
        assert seen_stop_inside
    assert sp.tau > 1.0


def test_acceptance_rule_output_distribution_is_exactly_the_target_distribution():
    """Closed form: P(first emitted token = x) under rejection sampling equals p(x), for given p and q."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        v = 6
        p = rng.dirichlet(np.ones(v))
        q = rng.dirichlet(np.ones(v) * 0.5)
        # P(out = x) = q(x) min(1, p/q) + (1 - sum_y q(y) min(1, p(y)/q(y))) * residual(x)
        accept = np.minimum(q, p)
        residual = np.maximum(p - q, 0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        dist = accept + (1 - accept.sum()) * residual
        assert np.allclose(dist, p, atol=1e-12)
        # verify_block implements that rule: integrate over each uniform on a fine 1-D grid (they are independent)
        grid = (np.arange(1000) + 0.5) / 1000
        tp = np.stack([p, p])
        out = np.zeros(v)
        for d in range(v):
            acc = np.mean([verify_block(tp, np.log(tp), np.array([d]), q[None], np.array([u, 0.5]), False)[0] == 1
                           for u in grid])
            out[d] += q[d] * acc
            if acc < 1:
                for u in grid:
                    n_acc, emitted = verify_block(tp, np.log(tp), np.array([d]), q[None], np.array([1 - 1e-12, u]),
                                                  False)
                    out[emitted[-1]] += q[d] * (1 - acc) / len(grid)
        assert np.abs(out - p).max() < 3e-3


def test_greedy_verify_block_all_and_none_accepted():
    logits = np.eye(5)[[1, 2, 3, 4]] * 3.0  # target argmax after each slot: 1, 2, 3, 4
    assert verify_block(None, logits, np.array([1, 2, 3]), None, None, True) == (3, [1, 2, 3, 4])
    assert verify_block(None, logits, np.array([0, 2, 3]), None, None, True) == (0, [1])
    assert verify_block(None, logits, np.array([1, 0, 3]), None, None, True) == (1, [1, 2])


def test_top_k_keeps_exactly_k_even_with_ties():
    """As torch.topk: exactly k tokens survive, ties with the k-th value included in index order (torch leaves the
    order among ties unspecified; the count is what the distribution depends on)."""
    logits = np.array([[1.0, 2.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    p = probs_from_logits(logits, 1.0, top_k=2)
    assert ((p > 0).sum(-1) == 2).all()
    assert np.allclose(p, [[0, 0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0, 0]])
    for k in range(1, 5):  # the kept values are torch.topk's values
        kept = np.sort(logits[0][probs_from_logits(logits[0], 1.0, top_k=k) > 0])
        assert np.array_equal(kept, np.sort(torch.topk(torch.tensor(logits[0]), k).values.numpy()))


def test_top_k_top_p_filtering():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.allclose(probs_from_logits(logits, 1.0, top_k=2), [0.625, 0.375, 0, 0])
    assert np.allclose(probs_from_logits(logits, 1.0, top_p=0.7), [0.625, 0.375, 0, 0])
    assert np.allclose(probs_from_logits(logits, 1.0), [0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (20, 0.95), (3, 0.3)])
def test_top_k_matches_torch_s_filters_row_by_row(top_k, top_p):
    """Top-k (filtered over the k survivors only), one row and a block of rows, against torch: each row's survivors
    are torch.topk's values (with ties, exactly k), and its distribution is torch's softmax over them, cut to the
    smallest most likely prefix reaching top_p and renormalized."""
    rng = np.random.default_rng(top_k)
    for trial in range(40):
        x = rng.standard_normal((3, int(rng.integers(top_k + 1, 400)))) * 3
        if trial % 2:
            x = np.round(x)  # ties at the k-th value
        block = probs_from_logits(x, 0.7, top_k, top_p)
        for row, p in [(x[0], probs_from_logits(x[0], 0.7, top_k, top_p))] + list(zip(x, block)):
            t = torch.tensor(row) / 0.7
            vals = torch.topk(t, top_k).values
            if top_p == 1.0:
                np.testing.assert_array_equal(np.sort(t.numpy()[p > 0]), np.sort(vals.numpy()))
            q = torch.softmax(vals, 0)  # descending
            keep = int(((torch.cumsum(q, 0) - q) < top_p).sum())
            want = np.sort((q[:keep] / q[:keep].sum()).numpy())
            np.testing.assert_allclose(np.sort(p[p > 0]), want, rtol=1e-12)
            assert (p > 0).sum() == keep


@pytest.fixture(scope="module")
def small_vocab_pair():
    return load_target("tiny:llama-small-vocab/target"), load_drafter("tiny:llama-small-vocab/drafter")


def _joint_counts(gen, n_samples, vocab, k=3):
    """Counts of the first k sampled tokens as one joint outcome (vocab**k cells)."""
    counts = np.zeros((vocab,) * k)
    for s in range(n_samples):
        counts[tuple(gen(s).tokens[:k])] += 1
    return counts


@torch.inference_mode()
def _exact_joint_of_three(target, ids):
    """The target's exact distribution of its next three tokens at temperature 1, in closed form: one transformers
    forward over every two-token continuation (vocab**2 rows), softmax per position, chain rule."""
    v = target.vocab_size
    t0, t1 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    rows = torch.tensor([ids + [a, b] for a, b in zip(t0.ravel(), t1.ravel())])
    logits = target.hf(input_ids=rows).logits.double()
    p = torch.softmax(logits[:, len(ids) - 1:], dim=-1).numpy()  # [v*v, 3, v]
    p0 = p[0, 0]  # the same first distribution on every row
    p1 = p[::v, 1].reshape(v, v)  # rows with t1 = 0 carry p(t1 | t0)
    p2 = p[:, 2].reshape(v, v, v)
    return p0[:, None, None] * p1[:, :, None] * p2


def _gof_p(observed, expected_probs):
    """Chi-square goodness of fit of counts against exact probabilities, cells expected below 5 pooled."""
    observed, expected = observed.ravel(), expected_probs.ravel() * observed.sum()
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum())[1]


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["random", "poor"])
def test_sampled_spec_matches_target_distribution_end_to_end(small_vocab_pair, drafter_kind):
    """Sampled speculative decoding's first three tokens against the target's exact joint distribution (not against
    a second sampler): each position's marginal and the joint of all three."""
    target, drafter = small_vocab_pair
    if drafter_kind == "poor":  # a deliberately bad drafter: sharp, wrong distributions
        drafter = load_drafter("tiny:llama-small-vocab/drafter")
        with torch.no_grad():
            drafter.norm.weight.mul_(25.0)
    ids, n, v = [1, 2, 3, 4], 3000, target.vocab_size
    stop = []  # keep 3 tokens always
    spec = _joint_counts(lambda s: spec_generate(drafter, target, ids, max_new_tokens=3, temperature=1.0,
                                                 stop_token_ids=stop, seed=s), n, v)
    exact = _exact_joint_of_three(target, ids)
    assert abs(exact.sum() - 1) < 1e-9
    for j in range(3):
        axes = tuple(a for a in range(3) if a != j)
        p = _gof_p(spec.sum(axis=axes), exact.sum(axis=axes))
        assert p > 1e-3, (j, p)
    assert _gof_p(spec, exact) > 1e-3
