"""Draft trees (decoding/tree.py): the tree a step grows (against brute-force enumeration), greedy acceptance, and tree
verification in the ONNX Runtime engine and the PyTorch reference -- identical to plain decoding (transformers'
own forward through the reference's ar_generate) for trees of every shape."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from target_support import assert_as_plain, assert_transformers_greedy

from dflash_export.decoding.options import PROPOSERS
from dflash_export.decoding.prompt_lookup import lookup_branches
from dflash_export.decoding.tree import (
    DraftCalibration,
    DraftTree,
    LookupStats,
    TreeState,
    build_tree,
    chain,
    greedy_accept,
)
from dflash_export.engines.base import SamplingParams
from dflash_export.engines.onnxruntime import tree_inputs
from dflash_export.runtime.single import DFlashRuntime


def _logprobs(rng, depth: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((depth, vocab)) * 2
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[j] for j in tree.path(i)[1:]) for i in range(1, len(tree))}


@pytest.mark.parametrize("top_k,max_nodes", [(1, 7), (2, 5), (3, 12), (4, 30), (4, 1)])
def test_drafter_tree_is_the_best_paths_by_probability(top_k, max_nodes):
    """The drafted nodes are exactly the `max_nodes` most probable paths (product of per-slot probabilities, each
    child among its slot's top-K), enumerated by brute force."""
    rng = np.random.default_rng(top_k * 100 + max_nodes)
    lp = _logprobs(rng, 4, 9)
    tree = build_tree(42, lp, [], top_k=top_k, max_nodes=max_nodes)
    topk = [np.argsort(-lp[d], kind="stable")[:top_k] for d in range(4)]
    scored = []
    for depth in range(1, 5):
        for path in itertools.product(*topk[:depth]):
            scored.append((sum(lp[d, t] for d, t in enumerate(path)), tuple(int(t) for t in path)))
    scored.sort(key=lambda x: -x[0])
    assert tree.tokens[0] == 42 and tree.parents[0] == -1 and len(tree) - 1 == min(max_nodes, len(scored))
    assert _paths(tree) == {p for _, p in scored[:max_nodes]}
    for i in range(1, len(tree)):  # topological, prefix-closed, depths consistent
        assert tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1


def test_min_score_keeps_only_nodes_that_pay():
    rng = np.random.default_rng(3)
    lp = _logprobs(rng, 5, 7)
    tree = build_tree(1, lp, [], top_k=3, max_nodes=100, min_score=0.05)
    for i in range(1, len(tree)):
        path = tree.path(i)[1:]
        assert np.exp(sum(lp[tree.depths[j] - 1, tree.tokens[j]] for j in path)) >= 0.05
    assert len(tree) > 1


@pytest.mark.parametrize("scale", [0.5, 1.7])
def test_calibrated_drafter_nodes_score_each_step_at_its_scaled_probability(scale):
    """draft_scale c: a drafter node's score is the product over its path of min(1, c x its slot probability), the
    tree the `max_nodes` best paths by that score (brute force), and draft_q each node's raw slot probability."""
    rng = np.random.default_rng(int(scale * 10))
    lp = _logprobs(rng, 4, 6)
    lp[0] = np.log([0.02, 0.03, 0.9, 0.02, 0.02, 0.01])  # a probability that scaling by 1.7 would push past 1
    tree = build_tree(5, lp, [], top_k=3, max_nodes=9, draft_scale=scale)
    topk = [np.argsort(-lp[d], kind="stable")[:3] for d in range(4)]
    scored = sorted(((np.prod([min(1.0, scale * np.exp(lp[d, t])) for d, t in enumerate(path)]), path)
                     for depth in range(1, 5) for path in itertools.product(*topk[:depth])), key=lambda x: -x[0])
    assert _paths(tree) == {tuple(int(t) for t in p) for _, p in scored[:9]}
    for i in range(1, len(tree)):
        path = [tree.tokens[j] for j in tree.path(i)[1:]]
        want = np.prod([min(1.0, scale * np.exp(lp[d, t])) for d, t in enumerate(path)])
        assert tree.scores[i] == pytest.approx(want, rel=1e-6)
        assert tree.draft_q[i] == pytest.approx(np.exp(lp[tree.depths[i] - 1, tree.tokens[i]]), rel=1e-6)


def test_draft_calibration_counts_drafter_only_nodes_whose_parent_was_accepted():
    """scale = (accepted + 4) / (sum of their raw probabilities + 4) over verified nodes only the drafter proposed
    whose parent the walk reached; lookup nodes, unverified nodes and nodes under a rejected parent do not count."""
    tree = build_tree(9, np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]])), [[2, 7]], top_k=2, max_nodes=10)
    node = {tuple(tree.tokens[j] for j in tree.path(i)[1:]): i for i in range(1, len(tree))}
    assert tree.proposed_by(node[(2,)]) == {"lookup"} and tree.proposed_by(node[(0,)]) == {"drafter"}
    cal = DraftCalibration()
    assert cal.scale() == 1.0
    path = [0, node[(0,)], node[(0, 1)]]
    cal.record(tree, path, set(range(len(tree))) - {node[(1, 0)]})
    # counted: (0,) 0.6 accepted; (1,) 0.3 not; (0, 0) 0.5 not; (0, 1) 0.4 accepted. Not: (1, 0) unverified, (1, 1)
    # under a rejected parent, (2,) and (2, 7) lookups
    assert cal.expected == pytest.approx(0.6 + 0.3 + 0.5 + 0.4) and cal.accepted == 2
    assert cal.scale() == pytest.approx(6 / 5.8)


def test_draft_calibration_recovers_the_rate_at_which_walks_accept_drafter_nodes():
    """Drafter nodes accepted with probability c x q (q their slot probability): the calibration learns c, and a
    calibrated tree's expected acceptances match what the walks accept (a simulation with a known c)."""
    rng = np.random.default_rng(11)
    for c in (0.5, 0.8):
        cal = DraftCalibration()
        for _ in range(3000):
            lp = _logprobs(rng, 3, 5)
            tree = build_tree(1, lp, [], top_k=2, max_nodes=6)
            path = [0]
            while True:  # the walk: the first child whose draw accepts it (siblings exclusive: c x sum q <= 1)
                u, acc = rng.random(), 0.0
                for k in tree.children(path[-1]):
                    acc += c * tree.draft_q[k]
                    if u < acc:
                        path.append(k)
                        break
                else:
                    break
            cal.record(tree, path, set(range(len(tree))))
        assert cal.scale() == pytest.approx(c, abs=0.04)


def test_a_calibrated_gate_learns_the_drafter_s_expected_gain():
    """With a calibration (sampled steps), a drafted step adds to the gate the sum of its verified drafter nodes'
    scores, whatever the walk accepted; without one (greedy), the drafter's tokens on the accepted path."""
    tree = build_tree(1, np.log(np.array([[0.5, 0.25, 0.25], [0.5, 0.49, 0.01]])), [], top_k=2, max_nodes=3)
    want = sum(tree.scores[1:])
    for calibrated in (True, False):
        state = TreeState([1], 8, calibration=DraftCalibration() if calibrated else None)
        state.record(tree, [0], set(range(len(tree))), drafted=True, had_lookup=False)
        gate = state.gates[False]
        assert gate.gain == pytest.approx(0.8 + 0.2 * (want if calibrated else 0))
        assert gate.rows == pytest.approx(0.2 * 3)


def test_k1_without_lookups_is_the_drafter_chain():
    rng = np.random.default_rng(4)
    lp = _logprobs(rng, 6, 11)
    tree = build_tree(5, lp, [], top_k=1, max_nodes=6)
    assert tree.is_chain and tree.tokens == chain(5, np.argmax(lp, -1)).tokens


def test_lookup_branches_merge_into_the_trie():
    """A lookup that coincides with a drafter branch shares its nodes; one that extends it continues it; one that
    contradicts it is a sibling; a branch longer than the drafter's depth keeps going."""
    lp = np.log(np.full((3, 10), 0.01))
    lp[0, 4], lp[1, 5], lp[2, 6] = np.log(0.9), np.log(0.9), np.log(0.9)  # the drafter's chain 4, 5, 6
    tree = build_tree(0, lp, [[4, 5], [4, 7, 8, 9, 1], [3]], top_k=1, max_nodes=20)
    paths = _paths(tree)
    assert {(4,), (4, 5), (4, 5, 6), (4, 7), (4, 7, 8), (4, 7, 8, 9), (4, 7, 8, 9, 1), (3,)} == paths
    src = {tuple(tree.tokens[j] for j in tree.path(i)[1:]): tree.sources[i] for i in range(1, len(tree))}
    assert src[(4,)] == src[(4, 5)] == "both" and src[(4, 5, 6)] == "drafter" and src[(3,)] == "lookup"
    assert len(tree) - 1 == len(paths)  # shared prefixes verified once


def test_lookup_branches_of_the_context():
    ctx = [1, 2, 3, 4, 9, 9, 2, 3, 4, 7, 8, 5, 3, 4]
    # n=4 "5 3 4"... no: last 4 = (8, 5, 3, 4) never earlier; n=3 (5,3,4) no; n=2 (3,4): latest earlier at 7 -> 7 8 5
    assert lookup_branches(ctx, 3) == [[7, 8, 5]]
    assert lookup_branches([5, 6, 5, 6, 5], 4) == [[6, 5]]  # n=4 (6,5,6,5)? no; n=3 (5,6,5): at 0 -> 6, 5
    assert lookup_branches([1, 2, 3], 2) == []


def test_the_incremental_context_index_finds_what_the_scan_finds():
    """ContextIndex (O(1) per step) against lookup_branches' backward scan, on contexts that grow a token or a
    few at a time over a small vocabulary (many repeats)."""
    from dflash_export.decoding.prompt_lookup import ContextIndex

    rng = np.random.default_rng(11)
    for _ in range(20):
        ctx = [int(t) for t in rng.integers(0, 4, int(rng.integers(0, 12)))]
        index = ContextIndex(ctx)
        for _ in range(40):
            new = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 4)))]
            ctx += new
            index.extend(new)
            for k in (1, 3, 15):
                assert index.branches(k) == lookup_branches(ctx, k), (ctx, k)


def test_greedy_accept_walks_the_target_s_argmax():
    tree = build_tree(0, None, [[1, 2, 3], [1, 5], [6]], top_k=0, max_nodes=10)
    idx = {tuple(tree.tokens[j] for j in tree.path(i)[1:]): i for i in range(len(tree))}
    nxt = np.zeros(len(tree), np.int64)
    nxt[idx[()]], nxt[idx[(1,)]], nxt[idx[(1, 5)]] = 1, 5, 11
    path, emitted = greedy_accept(tree, nxt)
    assert [tree.tokens[i] for i in path] == [0, 1, 5] and emitted == [1, 5, 11]
    nxt[idx[()]] = 9
    assert greedy_accept(tree, nxt) == ([0], [9])


def test_tree_inputs_positions_and_ancestor_bias():
    tree = DraftTree([7, 1, 2, 3], [-1, 0, 0, 1], [0, 1, 1, 2])
    pos, bias = tree_inputs(10, 5, tree)  # one padding row past the tree
    assert pos.tolist() == [[10, 11, 11, 12, 13]]
    assert bias.shape == (1, 1, 5, 15) and (bias[0, 0, :, :10] == 0).all()
    visible = bias[0, 0, :4, 10:14] == 0
    assert visible.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    pos, bias = tree_inputs(3, 2)
    assert pos.tolist() == [[3, 4]] and not bias.any()


def test_lookup_stats_score_is_a_product_of_survival_rates():
    stats = LookupStats(4)
    tree = build_tree(0, None, [[1, 2, 3]], top_k=0, max_nodes=10)
    stats.record(tree, [0, 1])  # depth 1 accepted, depth 2 proposed and rejected, depth 3 never reached
    a, p = LookupStats.PRIOR  # pseudo-counts (accepted, proposed) per depth
    assert stats.score(1) == pytest.approx((a + 1) / (p + 1))
    assert stats.score(2) == pytest.approx((a + 1) / (p + 1) * a / (p + 1))
    assert stats.score(3) == pytest.approx((a + 1) / (p + 1) * a / (p + 1) * a / p)


def test_lookup_branches_carry_the_longest_match_that_found_them():
    """By hand: the suffix 1 2 3 4 5 occurs as 2 3 4 5 after index 0 (continued by 9 7 4; the 3- and 2-token matches
    of that occurrence are the same branch, credited to the 4-token match) and 4 5 occurs last at index 7 (continued
    by 8 1 2): two branches, found by 4 and by 2 tokens. The incremental index says the same."""
    from dflash_export.decoding.prompt_lookup import ContextIndex

    ctx = [1, 2, 3, 4, 5, 9, 7, 4, 5, 8, 1, 2, 3, 4, 5]
    want = [(4, [9, 7, 4]), (2, [8, 1, 2])]
    assert lookup_branches(ctx, 3, with_sizes=True) == want
    assert ContextIndex(ctx).branches(3, with_sizes=True) == want
    assert lookup_branches(ctx, 3) == ContextIndex(ctx).branches(3) == [[9, 7, 4], [8, 1, 2]]


def test_lookup_stats_count_each_match_length_apart():
    """A branch found by an 8-token match accepted at depth 1 and one found by a 2-token match rejected there: each
    length's survival rate moves from the prior by its own count alone; a branch of unknown length, none."""
    stats = LookupStats(4)
    tree = build_tree(0, None, [[1, 2], [3, 4]], top_k=0, max_nodes=10, lookup_sizes=[8, 2])
    assert [tree.matches[i] for i in range(1, len(tree)) if tree.depths[i] == 1] == [8, 2]
    first = next(i for i in range(1, len(tree)) if tree.tokens[i] == 1)
    stats.record(tree, [0, first])
    a, p = LookupStats.PRIOR
    assert stats.score(1, 8) == pytest.approx((a + 1) / (p + 1))
    assert stats.score(1, 2) == pytest.approx(a / (p + 1))
    assert stats.score(1) == stats.score(1, 3) == pytest.approx(a / p)
    # the 8-branch's second token was verified under an accepted parent and rejected (path stops at depth 1)
    assert stats.score(2, 8) == pytest.approx((a + 1) / (p + 1) * a / (p + 1))


# ---------------------------------------------------------------------------------------------------------------------
# Tree verification in the engine and the reference


PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65], [5, 6, 7, 8] * 6]


@pytest.fixture(scope="module")
def pair(ort_pair):
    _, _, eng, torch_eng = ort_pair
    assert eng.tree_verify
    return eng, torch_eng


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_trees_holding_the_true_continuation_anywhere_decode_as_plain_decoding(pair, top_k):
    """Random trees (K siblings per node, up to 40 nodes, branches that coincide with, extend, contradict or run
    past the answer) in which the target's own continuation hides at a random place: every step accepts exactly that
    branch and emits the answer's next tokens; K/V rows compacted after each step leave later steps exact. The answer
    is plain decoding's on the engine, held to the PyTorch target's greedy choice with near-ties allowed either way
    (target_support.TIE: the tiny llama target's 52nd token after [7] is one, 1.4e-4 apart). Where the engine's
    numerics probe found no bit-identical row floor, a step may part from the answer at a near-tie (assert_as_plain),
    and the prompt ends there."""
    eng, torch_eng = pair
    bs = eng.info.block_size
    rng = np.random.default_rng(top_k)
    for prompt in PROMPTS[:4]:
        answer = DFlashRuntime(eng).generate(prompt, SamplingParams(max_new_tokens=64), "ar").tokens
        assert_transformers_greedy(torch_eng.target.hf, prompt, answer, eng.info.stop_token_ids, 64)
        seq = eng.new_sequence(len(prompt) + 64 + 64)
        assert int(np.argmax(eng.prefill(seq, np.array(prompt)))) == answer[0]
        pos = 1
        while pos < len(answer) - bs:
            depth = int(rng.integers(0, bs))
            truth = answer[pos:pos + depth]
            branches = []
            for _ in range(top_k - 1 + int(rng.integers(0, 3))):
                cut = int(rng.integers(0, depth + 1))  # a true prefix, then wrong or random tokens
                tail = [int(t) for t in rng.integers(0, eng.info.vocab_size, int(rng.integers(1, bs)))]
                branches.append(answer[pos:pos + cut] + tail)
            branches.insert(int(rng.integers(0, len(branches) + 1)), truth)
            tree = build_tree(answer[pos - 1], None, [b for b in branches if b], top_k=0, max_nodes=40)
            accept, emitted, path = eng.verify_tree(seq, tree)
            if emitted != answer[pos:pos + len(emitted)]:
                assert_as_plain(eng, prompt, answer[:pos] + emitted, answer[:pos + len(emitted)])
                break
            assert accept >= depth, (prompt, pos, branches)
            assert [tree.tokens[i] for i in path[1:]] == emitted[:-1]
            pos += len(emitted)


def test_tree_rows_agree_with_plain_steps_as_the_engine_states(pair):
    """Each node's logits from one tree pass against those plain decoding computes along its path: the rows of the
    tree's first path bit for bit (they attend exactly as a chain does); the others as the load-time probe states for
    whole trees on this CPU (a tree the probe never saw)."""
    eng, _ = pair
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 200, 17)
    tree = build_tree(int(prompt[-1]), None, [[5, 6, 7], [5, 9], [11, 12, 13, 14]], top_k=0, max_nodes=20)
    seq = eng.new_sequence()
    eng.prefill(seq, prompt[:-1])
    hidden, _ = eng._run_target(seq, np.asarray(tree.tokens, np.int64), len(tree), tree=tree)
    tree_logits = eng._logits(hidden)
    num = eng.numerics
    assert num.tree_bit_identical is not None
    for node in range(len(tree)):
        plain = eng.new_sequence()
        eng.prefill(plain, prompt[:-1])
        for j in tree.path(node):
            logits = eng.decode(plain, tree.tokens[j])
        first_path = tree.path(node) == list(range(node + 1))  # every row before it is an ancestor
        if num.tree_bit_identical or (first_path and num.bit_identical):
            np.testing.assert_array_equal(logits, tree_logits[node])
        else:
            np.testing.assert_allclose(logits, tree_logits[node], atol=1e-4)
    if not num.tree_bit_identical:
        assert num.tree_max_abs_diff > 0 and "lossless within kernel numerics" in num.tree_statement


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("adaptive,tree_mode", [(True, "spine"), (False, "spine"), (True, "full"), (False, "full")])
def test_every_proposer_is_lossless_against_the_reference(pair, proposer, adaptive, tree_mode):
    """Every proposer's greedy tokens are the reference's plain decoding's, as the engine's numerics probe states
    for this CPU (target_support.assert_as_plain)."""
    from dflash_export.runtime.reference import ar_generate

    eng, torch_eng = pair
    rt = DFlashRuntime(eng, adaptive=adaptive, proposer=proposer, tree_nodes=12, tree_mode=tree_mode)
    for prompt in PROMPTS:
        want = ar_generate(torch_eng.target, prompt, 48).tokens
        assert_as_plain(eng, prompt, rt.generate(prompt, SamplingParams(max_new_tokens=48)).tokens, want)


def test_chain_drafts_cut_by_a_stop_token_are_not_counted_as_accepted(pair, monkeypatch):
    """Greedy chain steps whose drafts are the target's own answer (the drafter made an oracle, so every draft is
    accepted): a stop token inside an accepted block ends the answer there, and the drafts after it, accepted by the
    target but never part of the answer, are not counted for the drafter. Its count is the drafted tokens the answer
    kept: each step's block_size - 1 drafts, all of the last step's tokens where the stop cut it."""
    eng, _ = pair
    rt = DFlashRuntime(eng, proposer="chain", adaptive=False)
    plain = DFlashRuntime(eng)
    prompt, answer = next((p, a) for p in PROMPTS  # an answer of several tokens, each a stop token in turn
                          if len(set((a := plain.generate(p, SamplingParams(max_new_tokens=40, stop_token_ids=[]),
                                                          "ar").tokens)[1:30]) - {a[0]}) >= 4)
    real_draft = eng.draft

    def oracle(seq, anchor, sp, uniforms, block_len=None):
        draft, probs = real_draft(seq, anchor, sp, uniforms, block_len=block_len)
        produced = seq.length - len(prompt) + 1  # answer tokens so far (the anchor is the last of them)
        truth = answer[produced:produced + len(draft)]
        return np.asarray(truth + list(draft[len(truth):]), dtype=np.asarray(draft).dtype), probs

    monkeypatch.setattr(eng, "draft", oracle)
    bs, cut = eng.info.block_size, 0
    for stop in sorted(set(answer[1:30]) - {answer[0]}):
        got = rt.generate(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[stop]))
        assert_as_plain(eng, prompt, got.tokens, answer[:answer.index(stop) + 1])
        if got.tokens != answer[:answer.index(stop) + 1]:
            continue  # parted from plain decoding at a near-tie: the oracle's drafts are no longer the answer's
        kept = sum(min(n, bs - 1) for n in got.acceptance_lengths)
        assert got.accepted_by["drafter"] == kept == got.accepted_only["drafter"], stop
        cut += got.acceptance_lengths[-1] < bs
    assert cut or not eng.numerics.bit_identical  # some answers ended inside a block


@pytest.mark.parametrize("tree_mode", ["spine", "full"])
def test_engine_trees_are_the_reference_s_trees(pair, tree_mode):
    """Without the cost model, the engine grows and accepts the very trees the PyTorch reference does (same
    acceptance lengths step by step; the reference verifies whole trees through transformers' attention with a 4-D
    ancestor mask), and both decode as plain decoding (the engine as its numerics probe states for this CPU:
    where it found no bit-identical row floor, its tokens may part from the reference's at a near-tie, and its steps
    are compared only where its tokens are the reference's)."""
    from dflash_export.runtime.reference import ar_generate, tree_spec_generate

    eng, torch_eng = pair
    rt = DFlashRuntime(eng, adaptive=False, proposer="tree+lookup", tree_nodes=15, tree_mode=tree_mode)
    for prompt in PROMPTS:
        ref = tree_spec_generate(torch_eng.drafter, torch_eng.target, prompt, 48, max_nodes=15, tree_mode=tree_mode)
        got = rt.generate(prompt, SamplingParams(max_new_tokens=48))
        assert ref.tokens == ar_generate(torch_eng.target, prompt, 48).tokens
        assert_as_plain(eng, prompt, got.tokens, ref.tokens)
        if got.tokens == ref.tokens:
            assert ref.acceptance_lengths == got.acceptance_lengths


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("sampled_tree_mode", ["spine", "full"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 20, 0.95)])
def test_sampled_walks_are_plain_sampling_draw_for_draw(pair, proposer, sampled_tree_mode, temperature, top_k, top_p):
    """T > 0, every proposer and tree mode, with and without the cost model: the walk emits, token for token, what
    plain sampled decoding on the same engine emits with the same seed (every token is the target's draw with the
    request's next uniform; docs/trees.md), as the engine's numerics probe states for this CPU. A seeded request
    repeats exactly."""
    eng, _ = pair
    for adaptive in (True, False):
        rt = DFlashRuntime(eng, adaptive=adaptive, proposer=proposer, tree_nodes=12,
                           sampled_tree_mode=sampled_tree_mode)
        for seed, prompt in enumerate(PROMPTS[:3]):
            sp = SamplingParams(max_new_tokens=40, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            want = rt.generate(prompt, sp, mode="ar").tokens
            got = rt.generate(prompt, sp)
            assert_as_plain(eng, prompt, got.tokens, want, sp)
            assert rt.generate(prompt, sp).tokens == got.tokens


@pytest.mark.parametrize("exact,diff,whole", [(True, 0.0, True), (False, 0.5e-4, True), (False, 1e-3, False),
                                              (None, None, False)])
def test_sampled_steps_walk_whole_trees_only_where_the_probe_bounds_their_rows(pair, monkeypatch, exact, diff, whole):
    """sampled_tree_mode "full" walks whole trees where the engine's numerics probe found tree rows bit-identical to
    plain steps or within TREE_WALK_ATOL (1e-4) of them, best paths otherwise (not probed included); greedy steps
    keep tree_mode. Either way the output is plain sampling's."""
    import dataclasses

    eng, _ = pair
    monkeypatch.setattr(eng, "numerics", dataclasses.replace(eng.numerics, tree_bit_identical=exact,
                                                             tree_max_abs_diff=diff))
    calls = []
    real = eng.verify_tree
    monkeypatch.setattr(eng, "verify_tree", lambda *a, **k: calls.append(1) or real(*a, **k))
    rt = DFlashRuntime(eng, adaptive=False, proposer="tree+lookup", tree_nodes=6, tree_mode="spine")
    assert rt.describe(0.7).endswith(f"sampled: walked, {'full' if whole else 'spine'})")
    for seed, prompt in enumerate(PROMPTS[:2]):
        sp = SamplingParams(max_new_tokens=24, temperature=0.7, seed=seed)
        assert_as_plain(eng, prompt, rt.generate(prompt, sp).tokens, rt.generate(prompt, sp, mode="ar").tokens, sp)
    assert bool(calls) == whole
    calls.clear()
    rt.generate(PROMPTS[0], SamplingParams(max_new_tokens=24))
    assert not calls  # greedy: tree_mode spine


def test_the_chain_sampler_keeps_the_drafter_s_chain_whatever_the_proposer(pair):
    """sampling "chain": the drafter's own sampled chain with min(1, p/q), the same draws whatever the proposer."""
    eng, _ = pair
    sp = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.9, seed=5)
    for prompt in PROMPTS[:3]:
        want = DFlashRuntime(eng, sampling="chain").generate(prompt, sp).tokens
        assert DFlashRuntime(eng, proposer="tree+lookup", sampling="chain").generate(prompt, sp).tokens == want


def test_the_recipe_s_decoding_options_reach_the_runtime_through_the_manifest(tmp_path):
    """A recipe's `decoding:` section is recorded at build and is what DFlashRuntime starts from; options override."""
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.recipes import load_recipe

    y = tmp_path / "r.yaml"
    y.write_text("name: r\ntarget: tiny:llama/target\ndrafter: tiny:llama/drafter\nmax_seq_len: 256\n"
                 "decoding: {proposer: tree+lookup, tree_nodes: 9, tree_mode: full}\n")
    out = build_onnxruntime(load_recipe(y), tmp_path / "engine", threads=1)
    assert read_manifest(out).raw["decoding"] == {"proposer": "tree+lookup", "tree_top_k": 4, "tree_nodes": 9,
                                                  "tree_mode": "full", "sampled_tree_mode": "full", "sampling": "walk",
                                                  "static_ngrams": False, "static_prompts": 256,
                                                  "static_entries": 200_000}
    eng = load_engine(out, threads=1)
    rt = DFlashRuntime(eng)
    assert (rt.proposer, rt.tree_nodes, rt.tree_mode, rt.tree_top_k) == ("tree+lookup", 9, "full", 4)
    assert DFlashRuntime(eng, proposer="lookup", tree_mode="spine").describe() == "lookup (<= 9 nodes, spine)"


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 12])
@pytest.mark.parametrize("masked", [False, True])
def test_slot_candidates_are_each_slot_s_best_by_value_then_id(k, masked):
    """Each slot's top-K against a full sort of the row by (-value, id), values drawn from a handful so ties are
    everywhere, with and without -inf entries; log-probabilities against a float64 log-softmax."""
    from dflash_export.decoding.tree import slot_candidates

    rng = np.random.default_rng(k)
    x = rng.integers(0, 6, (5, 300)).astype(np.float32) * np.float32(0.5)
    if masked:
        x[:, rng.choice(300, 290, replace=False)] = -np.inf
    got = slot_candidates(x, k)
    for d in range(len(x)):
        order = np.lexsort((np.arange(300), -x[d]))[:k]
        assert [t for t, _ in got[d]] == [int(t) for t in order]
        ref = x[d].astype(np.float64) - np.logaddexp.reduce(x[d].astype(np.float64))
        np.testing.assert_allclose([v for _, v in got[d]], ref[order], rtol=0, atol=1e-5)


def test_the_drafter_runs_while_its_tokens_pay_for_its_pass_and_its_rows():
    """DrafterGate's rule, in closed form: draft while gain >= rate * (draft_cost + verify_cost * rows), gain and rows
    being running means per drafted step (a tree step keeps one gate for steps with a lookup branch and one for steps
    without); a skipped drafter is tried again after 8 skipped steps, then 16, 32, 64 while it does not pay, and every
    8 again once it does; the state carries into a later request."""
    prior = {False: {"gain": 0.5, "rows": 2.0}}
    assert TreeState([1, 2], 16, drafter_prior=prior).drafter_pays(False, 1.0, 0.3, 0.1)       # 0.5 >= 0.5
    assert not TreeState([1, 2], 16, drafter_prior=prior).drafter_pays(False, 1.0, 0.3, 0.11)  # 0.5 < 0.52
    assert not TreeState([1, 2], 16, drafter_prior=prior).drafter_pays(False, 2.0, 0.3, 0.0)   # 0.5 < 0.6

    state = TreeState([1, 2, 3], 16)
    assert state.drafter_pays(False, 1.0, 0.3, 0.07) and state.drafter_pays(True, 1.0, 0.3, 0.07)  # unmeasured
    missed = chain(3, [5, 6, 7])  # three drafter rows verified, none accepted
    for _ in range(12):
        state.record(missed, [0], {0, 1, 2, 3}, drafted=True, had_lookup=False)
    gate = state.gates[False]
    assert gate.gain == pytest.approx(0.8 ** 12) and gate.rows == pytest.approx(3 * (1 - 0.8 ** 12))
    assert state.gates[True].gain == 1.0  # steps with a lookup branch keep their own means
    assert state.drafter_pays(True, 1.0, 0.3, 0.07)
    calls = [state.drafter_pays(False, 1.0, 0.3, 0.07) for _ in range(8 + 16 + 32 + 64 + 64)]
    assert [i + 1 for i, ran in enumerate(calls) if ran] == [8, 8 + 16, 8 + 16 + 32, 8 + 16 + 32 + 64,
                                                              8 + 16 + 32 + 64 + 64]
    hit = chain(3, [5, 6, 7])
    for _ in range(6):  # two of three drafts accepted per step: 2 >= 1.0 * (0.3 + 0.07 * 3)
        state.record(hit, [0, 1, 2], {0, 1, 2, 3}, drafted=True, had_lookup=False)
    assert state.drafter_pays(False, 1.0, 0.3, 0.07)
    for _ in range(20):  # misses again: the wait starts over at 8
        state.record(missed, [0], {0, 1, 2, 3}, drafted=True, had_lookup=False)
    assert [i + 1 for i, ran in enumerate(state.drafter_pays(False, 1.0, 0.3, 0.07) for _ in range(8)) if ran] == [8]
    # a later request starts from where this one ended, its exploration schedule too: requests shorter than the
    # wait still take their turn (the wait is 16 now; 4 skipped steps here, the 12th after them in the next request)
    assert not any(state.drafter_pays(False, 1.0, 0.3, 0.07) for _ in range(4))
    later = TreeState([1, 2, 3], 16, drafter_prior=state.drafter_means())
    assert later.drafter_means() == state.drafter_means()
    assert [later.drafter_pays(False, 1.0, 0.3, 0.07) for _ in range(12)] == [False] * 11 + [True]
