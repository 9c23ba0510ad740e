"""The batch step's draft-or-plain decision against the cost model's closed form, with planted costs: drafting B
sequences pays when B (1 + c g) tokens for draft(B) + 1 + a (B S' - 1) plain-step costs beat plain batched decoding's
B tokens for 1 + a (B - 1), i.e. when c g exceeds the break-even gain

    g* = (draft_cost (1 + r (B - 1)) + 1 + a (B S' - 1)) / (1 + a (B - 1)) - 1

(r = the drafter's per-sequence row cost); c = drafts accepted / drafts the confidences expected, from the verifies.
No timing: every cost is planted."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_export.decoding.tree import DraftTree
from dflash_export.engines.base import SamplingParams
from dflash_export.runtime.batching import DRAFT_ROW_COST, GRID_PAD_COST, BatchingRuntime, _Active


@pytest.fixture(scope="module")
def engine(ort_pair):
    return ort_pair[2]


def _break_even(b: int, a: float, draft_cost: float, rows: float) -> float:
    return (draft_cost * (1 + DRAFT_ROW_COST * (b - 1)) + 1 + a * (b * rows - 1)) / (1 + a * (b - 1)) - 1


@pytest.mark.parametrize("a, draft_cost", [(0.07, 0.3), (0.2, 0.6), (0.03, 0.1)])
def test_drafting_pays_exactly_above_the_break_even_gain_at_every_occupancy(engine, a, draft_cost):
    rt = BatchingRuntime(engine, max_batch=16, verify_token_cost=a, draft_cost=draft_cost)
    assert (rt.a, rt.draft_cost, rt.acceptance_calibration) == (a, draft_cost, 1.0)
    for b in (1, 2, 4, 8, 16):
        for rows in (1.5, 3.0, 6.0):
            rt.rows_per_draft_step = rows
            g_star = _break_even(b, a, draft_cost, rows)
            rt.accepted_per_draft = g_star * 1.02
            assert rt._drafting_pays(b), (b, rows)
            rt.accepted_per_draft = g_star * 0.98
            assert not rt._drafting_pays(b), (b, rows)


def test_at_the_measured_fp32_costs_eight_sequences_never_draft(engine):
    """a = 0.07, draft 0.3: at 8 sequences each verifying one draft (S' = 2) drafting only breaks even when every
    draft is accepted (g* = 1.0, the most one draft can give), and needs more at S' = 3 (1.38); two sequences pay
    from g* = 0.50. A drafter expecting g = 0.7 drafts at 2 sequences until its verifies accept 45 % of that."""
    assert _break_even(8, 0.07, 0.3, 2.0) == pytest.approx(1.0)
    assert _break_even(8, 0.07, 0.3, 3.0) == pytest.approx(1.3758, abs=1e-3)
    assert _break_even(2, 0.07, 0.3, 2.0) == pytest.approx(0.4953, abs=1e-3)
    rt = BatchingRuntime(engine, max_batch=16, verify_token_cost=0.07, draft_cost=0.3)
    rt.rows_per_draft_step, rt.accepted_per_draft = 2.0, 0.7
    assert rt._drafting_pays(2) and not rt._drafting_pays(8) and not rt._drafting_pays(16)
    rt._accepted_vs_expected = np.array([0.45 * 10.0, 10.0])  # verifies accepted 45 % of what was expected
    assert rt.acceptance_calibration == pytest.approx(0.45)
    assert not rt._drafting_pays(2)


def _act(conf, n_draft, spine=None):
    a = _Active.__new__(_Active)
    a.req = type("R", (), {"sp": SamplingParams(max_new_tokens=100), "mode": "dflash"})()
    a.walk, a.n_draft, a.spine_scores, a.tree, a.spine = False, n_draft, spine, None, None
    a.seq = type("S", (), {"draft_confidence": np.asarray(conf)})()
    return a


def test_the_calibration_is_accepted_over_expected_drafts_and_never_above_one(engine):
    rt = BatchingRuntime(engine, max_batch=4)
    rt._accepted_vs_expected = np.zeros(2)
    # confidences 0.9, 0.8, 0.5: three verified drafts expect 0.9 + 0.72 + 0.36 = 1.98 accepted; one was.
    rt._learn_acceptance(_act([0.9, 0.8, 0.5, 0.9], 3), 1)
    assert rt.acceptance_calibration == pytest.approx(1 / 1.98)
    # the best path of a tree grown with the drafter's slots: its chances are already cumulative, 0.5 + 0.25
    # expected, 2 accepted
    grown = _act([0.1, 0.1], 2, spine=np.array([0.5, 0.25, 0.1]))
    grown.spine = (None, None, True)
    rt._learn_acceptance(grown, 2)
    assert rt._accepted_vs_expected == pytest.approx([3, 2.73])
    assert rt.acceptance_calibration == 1.0  # more accepted than expected: the confidences are taken as they are
    # the context's branches alone are scored by their own acceptance rates: their verifies leave c
    lookups = _act([0.1, 0.1], 2, spine=np.array([0.9, 0.8]))
    lookups.spine = (None, None, False)
    rt._learn_acceptance(lookups, 0)
    assert rt._accepted_vs_expected == pytest.approx([3, 2.73])
    # plain steps (no draft verified) and sampled chains (no chances) leave it
    before = rt._accepted_vs_expected.copy()
    rt._learn_acceptance(_act([0.9], 0), 0)
    chain = _act([0.9], 1)
    chain.req = type("R", (), {"sp": SamplingParams(max_new_tokens=100, temperature=0.7), "mode": "dflash"})()
    rt._learn_acceptance(chain, 0)
    assert (rt._accepted_vs_expected == before).all()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_one_request_alone_drafts_by_the_single_rule_when_greedy_and_by_the_cost_model_when_sampled(engine,
                                                                                                  temperature):
    """Drafting planted unprofitable: a greedy request alone still drafts (DFlashRuntime's rule, back-off aside);
    a sampled one alone makes plain steps, its drafter called only by the probes (steps 8, 24, 56: 3 in 60)."""
    rt = BatchingRuntime(engine, max_batch=2, max_skip=7)
    rt._drafting_pays = lambda b: False
    sp = SamplingParams(max_new_tokens=80, stop_token_ids=[], temperature=temperature, top_k=20, top_p=0.95, seed=3)
    rt.submit([1, 2, 3, 4, 5], sp)
    for _ in range(60):
        rt.step()
    if temperature:
        assert (rt.draft_calls, rt.probes) == (3, 3)
    else:
        assert rt.probes == 0 and rt.draft_calls > 3


# A planted tree, nodes best first as decoding/tree.build_tree orders them: the root's children A (0.6) and B (0.35),
# A's child C (0.3, the chance that A and C are both accepted). Its best path is root, A, C (0.9 expected accepted).
TREE = DraftTree([7, 11, 12, 13], [-1, 0, 0, 1], [0, 1, 1, 2], ["root", "drafter", "drafter", "lookup"],
                 [1.0, 0.6, 0.35, 0.3])


def _whole(tree):
    """A greedy sequence whose step proposed `tree` whole, its best path the default (as _propose_lookups leaves it)."""
    a = _act([0.5], 0)
    spine = tree.best_chain()
    a.whole, a.tree, a.spine = (tree, True), None, (tree, spine, True)
    a.drafts = np.asarray([tree.tokens[i] for i in spine[1:]], np.int64)
    a.spine_scores = np.asarray([tree.scores[i] for i in spine[1:]], np.float64)
    a.block_len = len(spine)
    return a


def _closed_form(scores_per_seq, b, a, rate, draft_cost, tree_cost, is_tree):
    """Each sequence's rows and the option's expected tokens per modelled cost, from the rule's definition: a
    sequence verifies row k while row k's chance reaches max(λ, B / (1 + a (B - 1))) a, and the call costs the rows
    of all its sequences, packed: 1 + a (R - 1)."""
    bar = max(rate, b / (1 + a * (b - 1))) * a
    rows = []
    for q in scores_per_seq:
        s = 1
        while s <= len(q) and q[s - 1] >= bar:
            s += 1
        rows.append(s)
    gain = sum(sum(q[: s - 1]) for q, s in zip(scores_per_seq, rows))
    trees = sum(is_tree and s > 2 for s in rows)  # the first two nodes (root, A) are a chain
    return rows, (b + gain) / (draft_cost + 1 + a * (sum(rows) - 1) + tree_cost * trees)


@pytest.mark.parametrize("b", [1, 8])
def test_a_step_verifies_whole_trees_exactly_where_their_rows_and_overhead_pay(engine, b):
    """With planted costs (a = 0.07, draft 0.3, λ = what a plain batched step yields, or 1.5 alone) and the planted
    tree: alone, the tree's third node (B, 0.35) pays its row (bar 0.105) and the step verifies the whole tree
    unless a tree costs more than the break-even overhead (0.196 plain steps); at 8 sequences (λ 5.4, bar 0.38) B's
    row does not pay, the rows paid are the root and A, a chain, and every sequence verifies its best path whatever
    a tree would cost."""
    a, draft_cost = 0.07, 0.3
    rate = 1.5 if b == 1 else b / (1 + a * (b - 1))
    spine_scores = [[0.6, 0.3]] * b
    tree_scores = [[0.6, 0.35, 0.3]] * b
    s_spine, r_spine = _closed_form(spine_scores, b, a, rate, draft_cost, 0.0, False)
    s_tree, _ = _closed_form(tree_scores, b, a, rate, draft_cost, 0.0, True)
    if b == 1:
        assert (s_spine, s_tree) == ([3], [4])
        break_even = (b + 0.6 + 0.35 + 0.3) / r_spine - (draft_cost + 1 + a * (s_tree[0] - 1))
        assert break_even == pytest.approx(0.1959, abs=1e-3)
    else:
        assert (s_spine, s_tree) == ([2] * b, [2] * b)
        break_even = None
    for tree_cost in (0.0, 0.1, 0.19, 0.2, 0.5):
        rt = BatchingRuntime(engine, max_batch=16, verify_token_cost=a, draft_cost=draft_cost)
        rt.rate, rt.tree_cost = rate, tree_cost
        acts = [_whole(TREE) for _ in range(b)]
        s = rt._choose_step(acts, [], draft_cost)
        whole = _closed_form(tree_scores, b, a, rate, draft_cost, tree_cost, True)[1] > r_spine
        assert whole == (break_even is not None and tree_cost < break_even)
        assert [x.tree is not None for x in acts] == [whole] * b, tree_cost
        assert s == (s_tree if whole else s_spine)
        assert rt.tree_steps == int(whole)
        if not whole:  # back to the best path, as proposed
            assert all(x.spine is not None and list(x.drafts) == [11, 13] for x in acts)


@pytest.mark.parametrize("b, c, rows", [(1, 1.0, 6), (1, 0.2, 6), (8, 1.0, 4), (8, 0.6, 3), (8, 0.3, 1)])
def test_a_batch_pays_for_rows_with_the_drafts_they_are_expected_to_get_accepted(engine, b, c, rows):
    """In a batch, rows are paid for by calibrated chances: where verifies accepted c of the drafts the confidences
    expected, a sequence verifies row k while c times row k's chance reaches the bar (the closed form on the scaled
    chances). Eight sequences (a 0.07, λ = plain batching's rate: bar 0.38) with chances 0.9, 0.72, 0.5, 0.3, ...
    pay 3 drafts each at c = 1, 2 at c = 0.6 and none at c = 0.3. Alone (λ 1.5: bar 0.105) the chances are taken as
    they are (5 drafts whatever c): a lone sequence's verifies are what keep c measured."""
    a, draft_cost = 0.07, 0.3
    rate = 1.5 if b == 1 else b / (1 + a * (b - 1))
    chances = [0.9, 0.72, 0.5, 0.3, 0.12, 0.05, 0.02]
    rt = BatchingRuntime(engine, max_batch=16, verify_token_cost=a, draft_cost=draft_cost)
    rt.rate = rate
    rt._accepted_vs_expected = np.array([c * 10.0, 10.0])
    acts = []
    for _ in range(b):  # best paths only (no whole tree) of trees grown with the drafter, these cumulative chances
        x = _act([0.5], 0, spine=np.asarray(chances))
        x.whole, x.block_len, x.drafts, x.spine = None, len(chances) + 1, np.arange(len(chances)), (None, None, True)
        acts.append(x)
    s = rt._choose_step(acts, [], draft_cost)
    scale = c if b > 1 else 1.0
    assert s == [rows] * b == _closed_form([[scale * q for q in chances]] * b, b, a, rate, draft_cost, 0.0, False)[0]
    for x in acts:  # the context's branches alone: their chances are their own acceptance rates, taken as they are
        x.spine = (None, None, False)
    assert rt._choose_step(acts, [], draft_cost) == _closed_form([chances] * b, b, a, rate, draft_cost, 0.0, False)[0]


@pytest.mark.parametrize("chances, rows", [
    ([[0.97, 0.95, 0.93, 0.9]] + [[0.1, 0.05]], [5, 1]),
    ([[0.97, 0.95, 0.93, 0.9]] * 2 + [[0.1, 0.05]] * 6, [5, 5] + [1] * 6),
    ([[0.97, 0.95, 0.93, 0.9]] + [[0.1, 0.05]] * 7, [1] * 8),
    ([[0.97, 0.95, 0.93, 0.9], [0.97, 0.3]] + [[0.1, 0.05]] * 6, [2, 2] + [1] * 6),
])
def test_a_sequence_s_rows_pay_for_themselves_and_for_the_padding_they_make(engine, chances, rows):
    """The call takes its rows packed and pads only attention to the longest block: a sequence verifies row k while
    its chance reaches the bar (λ a: 0.131 at 2 sequences, 0.376 at 8, plain batching's rate) and the sequences
    reaching row S pay, with their chances over the bar, for the padding cells of the shorter ones (GRID_PAD_COST =
    0.3 of a row each). Beside one other sequence a sure lookup branch (0.97 .. 0.9) verifies all four drafts; two
    of them among eight pay for six padded sequences (surplus 2 x 0.52 >= 0.376 x 0.3 x 6 at row 5); one alone
    among eight does not (0.59 < 0.79 already at row 2); beside a second sequence sure of its first draft only, the
    two verify one draft each (row 2 is where their surplus, 2 x 0.59, covers six padded sequences)."""
    a, draft_cost = 0.07, 0.3
    rt = BatchingRuntime(engine, max_batch=16, verify_token_cost=a, draft_cost=draft_cost)
    b = len(chances)
    rt.rate = b / (1 + a * (b - 1))
    acts = []
    for q in chances:
        x = _act([0.5], 0, spine=np.asarray(q))
        x.whole, x.block_len, x.drafts, x.spine = None, len(q) + 1, np.arange(len(q)), (None, None, False)
        acts.append(x)
    assert rt._choose_step(acts, [], draft_cost) == rows
    bar = rt._bar(b)
    assert bar == pytest.approx(a * b / (1 + a * (b - 1)))
    s = max(rows)
    if s > 1:  # the closed form at the grid kept: the longest rows' surplus covers the padding they make
        assert sum(q[s - 2] - bar for q, n in zip(chances, rows) if n == s) >= bar * GRID_PAD_COST * rows.count(1)


def test_the_tree_overhead_is_the_time_trees_add_to_a_call_beyond_its_rows(engine):
    """Calls timed as c0 + c1 * rows (c0 = 40 ms, c1 = 3 ms: a = 0.07), those verifying trees 4.3 ms more per tree:
    the fitted overhead converges to 4.3 / 43 = 0.1 plain steps, and the row cost is the rows' alone."""
    rt = BatchingRuntime(engine, max_batch=16, verify_token_cost=0.03)
    for i in range(400):
        rows = (1, 2, 4, 8, 16)[i % 5]
        trees = (i % 3 == 0) * (1 + i % 2)
        rt._learn_row_cost(rows, 0.040 + 0.003 * rows + 0.0043 * trees, trees)
    assert rt.tree_cost == pytest.approx(0.1, abs=1e-3)
    assert rt.a == pytest.approx(0.003 / 0.043, abs=1e-3)
