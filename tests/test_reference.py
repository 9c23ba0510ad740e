"""The reference generators: greedy spec == AR exactly; sampled spec has exactly the target's distribution."""

import numpy as np
import pytest
import torch
from scipy import stats

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
    target, drafter = request.getfixturevalue(f"tiny_{family}")
    for ids in _prompts(20, target.vocab_size, seed=block_size):
        ar = ar_generate(target, ids, max_new_tokens=24)
        sp = spec_generate(drafter, target, ids, max_new_tokens=24, block_size=block_size)
        assert sp.tokens == ar.tokens


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
        ar = ar_generate(target, ids, max_new_tokens=max_new, stop_token_ids=stop)
        sp = spec_generate(oracle, target, ids, max_new_tokens=max_new, stop_token_ids=stop, block_size=block_size)
        assert sp.tokens == ar.tokens, (i, sp.tokens, ar.tokens)
        assert sp.finish_reason == ar.finish_reason
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


@pytest.fixture(scope="module")
def small_vocab_pair():
    return load_target("tiny:llama-small-vocab/target"), load_drafter("tiny:llama-small-vocab/drafter")


def _first_tokens_hist(gen, n_samples, vocab, k=3):
    counts = np.zeros((k, vocab))
    for s in range(n_samples):
        toks = gen(s).tokens
        for j in range(k):
            counts[j, toks[j]] += 1
    return counts


def _chi2_p(a, b):
    keep = (a + b) >= 10  # pool rare categories so the chi-square approximation holds
    table = np.stack([np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table)[1]


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["random", "poor"])
def test_sampled_spec_matches_ar_distribution_end_to_end(small_vocab_pair, drafter_kind):
    target, drafter = small_vocab_pair
    if drafter_kind == "poor":  # a deliberately bad drafter: sharp, wrong distributions
        drafter = load_drafter("tiny:llama-small-vocab/drafter")
        with torch.no_grad():
            drafter.norm.weight.mul_(25.0)
    ids, n, v = [1, 2, 3, 4], 5000, target.vocab_size
    stop = []  # keep 3 tokens always
    spec = _first_tokens_hist(lambda s: spec_generate(drafter, target, ids, max_new_tokens=3, temperature=1.0,
                                                      stop_token_ids=stop, seed=s), n, v)
    ar = _first_tokens_hist(lambda s: ar_generate(target, ids, max_new_tokens=3, temperature=1.0,
                                                  stop_token_ids=stop, seed=10_000 + s), n, v)
    for j in range(3):
        p = _chi2_p(spec[j], ar[j])
        assert p > 1e-3, (j, p, spec[j], ar[j])
