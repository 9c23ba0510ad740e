"""The prompt-lookup yardstick against hand-computed cases (the definition in
dflash_export/decoding/prompt_lookup.py)."""

import pytest

from dflash_export.decoding.prompt_lookup import lookup_proposal, pooled_tau, prompt_lookup_steps, prompt_lookup_tau


def test_no_repeated_bigram_commits_one_token_per_step():
    # nothing ever recurs: no proposal, every step is the target's bonus token alone
    assert prompt_lookup_steps([1, 2, 3], [4, 5, 6, 7, 8], block_size=8) == [1, 1, 1, 1]


def test_periodic_answer_by_hand():
    # context [1 2 3 4 | 1]: no earlier [4 1] -> 1 token; then [1 2] occurred at 0 -> propose 3 4 1, all right -> 4;
    # then [3 4 1 2] occurred at 2 -> propose 3 4 1, all right -> 4. 9 tokens after the first in 3 steps.
    steps = prompt_lookup_steps([1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], block_size=4)
    assert steps == [1, 4, 4]
    assert prompt_lookup_tau([([1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2])], 4) == 3.0


def test_wrong_proposal_keeps_its_right_prefix_plus_the_bonus():
    # after [9 | 5 6]: [5 6] occurred in the prompt followed by 7 8 9; the answer goes 7 0 ...: 1 accepted + bonus
    steps = prompt_lookup_steps([5, 6, 7, 8, 9], [5, 6, 7, 0, 1], block_size=8)
    # step 1 from context [5 6 7 8 9 5]: [9 5] new, [5] alone is not looked up -> 1; step 2: [9 5 6]? no; [5 6] at 0
    # -> propose 7 8 9 5 6 ..., answer 7 0 1: accept 1, commit 2; step 3: [6 7 0] new, [7 0] new -> 1
    assert steps == [1, 2, 1]


def test_last_step_never_commits_past_the_answer():
    # the proposal 3 4 1 2 3 4 1 is right, but only 2 tokens are left after the first
    assert prompt_lookup_steps([1, 2, 3, 4, 1, 2], [3, 4, 1], block_size=8) == [2]


def test_longest_ngram_wins_over_a_later_shorter_match():
    ctx = [1, 2, 3, 4, 9, 7, 3, 4, 8, 1, 2, 3, 4]
    assert lookup_proposal(ctx, 3) == [9, 7, 3]     # the 4-gram [1 2 3 4] at 0, not the later bigram [3 4] at 6
    assert lookup_proposal(ctx[-6:], 3) == []       # [8 1 2 3 4 ]... no earlier n-gram in the last 6 tokens
    assert lookup_proposal([5, 1, 5, 2, 5, 1, 5], 2) == [2, 5]  # latest of two [1 5]? [5 1 5] at 0 -> 2 5


def test_pooled_over_prompts_not_averaged():
    # one prompt of 1 step committing 5, one of 4 steps committing 1: pooled 9/5, not the mean of 5 and 1
    assert pooled_tau([[5], [1, 1, 1, 1]]) == pytest.approx(9 / 5)
    assert pooled_tau([]) == 1.0


def test_block_size_below_two_is_refused():
    with pytest.raises(ValueError):
        prompt_lookup_steps([1], [1, 2], block_size=1)
