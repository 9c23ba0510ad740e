"""dflash_export.decoding.sampling and SamplingParams: the request's sampling settings are checked in one place, and the
adaptive-verification rule keeps exactly the draft prefix whose expected gain pays for its rows (closed forms)."""

import numpy as np
import pytest

from dflash_export.decoding.sampling import (
    probs_from_logits,
    sample_from,
    select_candidates,
    tempered,
    top_probability,
    verify_length,
)
from dflash_export.engines.base import SamplingParams
from dflash_export.errors import DFlashError


def test_verify_length_keeps_the_prefix_worth_verifying():
    assert verify_length(np.array([0.9, 0.5, 0.9, 0.1]), 0.3) == 3     # cumulative 0.9, 0.45, 0.405 | 0.04
    assert verify_length(np.array([0.9, 0.5, 0.9, 0.1]), 0.42) == 2
    assert verify_length(np.array([0.2, 1.0]), 0.3) == 0
    assert verify_length(np.array([1.0, 1.0]), 0.3) == 2
    logits = np.array([[0.0, 0.0], [10.0, -10.0]])
    np.testing.assert_allclose(top_probability(logits), [0.5, 1 / (1 + np.exp(-20))], rtol=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_new_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"seed": -3}, "seed"),
])
def test_sampling_params_are_checked_when_made_naming_the_request_field(kwargs, field):
    """A SamplingParams out of range cannot be made (the CLI, the Python API and the Triton model all make one)."""
    with pytest.raises(DFlashError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0).check()  # the edges pass


def test_an_integer_temperature_too_long_for_a_float_samples_every_kept_token_alike():
    """10^400 is a valid temperature (no upper bound; JSON integers have any length): held as the largest float, so
    decoding can divide by it, giving every token the same probability; the same integer as top_p is out of range."""
    sp = SamplingParams(temperature=10 ** 400, top_k=3)
    assert sp.temperature == 1.7976931348623157e308
    np.testing.assert_allclose(probs_from_logits(np.array([1.0, 5.0, 2.0, 9.0]), sp.temperature, sp.top_k),
                               [0, 1 / 3, 1 / 3, 1 / 3])
    with pytest.raises(DFlashError) as e:
        SamplingParams(top_p=10 ** 400, temperature=1.0)
    assert str(e.value) == "top_p: must be in (0, 1], got 100000000000...000000 (401 digits)"


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("temperature", [1e-300, 1e-310, 5e-324])
def test_a_temperature_near_zero_puts_all_mass_on_the_largest_logit(temperature):
    """softmax(logits / T) as T -> 0: probability 1 on the largest logit (shared evenly by exact ties), whatever top-k
    and top-p keep; every draw is the argmax. A T this small overflows logits / T in float64 (and in float32 the
    tempered scores drafting confidences come from)."""
    logits = (np.random.default_rng(0).normal(size=(4, 50)) * 5).astype(np.float32)
    one_hot = np.eye(50)[logits.argmax(-1)]
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.5), (1, 1.0)]:
        probs = probs_from_logits(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(probs, one_hot)
        assert [sample_from(p, u) for p, u in zip(probs, [0.0, 0.3, 0.7, 0.999])] == list(logits.argmax(-1))
    tied = np.zeros(50)
    tied[[7, 30]] = 2.0
    for top_k in (0, 5):
        np.testing.assert_array_equal(probs_from_logits(tied, temperature, top_k), np.eye(50)[[7, 30]].sum(0) / 2)
    scores = tempered(logits, temperature)
    assert scores.dtype == np.float32 and (scores.argmax(-1) == logits.argmax(-1)).all()
    np.testing.assert_array_equal(top_probability(scores), np.ones(4, np.float32))
    np.testing.assert_array_equal(tempered(logits, 0.5), logits / np.float32(0.5))  # an ordinary T: unchanged


@pytest.mark.filterwarnings("error")
def test_the_candidate_selector_at_a_temperature_near_zero_selects_as_greedy():
    """DFlash 2's selector sampling its candidates at T -> 0 draws the best-scoring one: its greedy choice."""
    rng = np.random.default_rng(1)
    n, v, r = 6, 40, 4
    logits, projected = rng.normal(size=(n, v)) * 4, rng.normal(size=(n, r))
    pred, succ = rng.normal(size=(v, r)), rng.normal(size=(v, r))
    greedy, _ = select_candidates(logits, projected, pred, succ, 3, 5, 0.0)
    for temperature in (1e-310, 5e-324):
        tokens, probs = select_candidates(logits, projected, pred, succ, 3, 5, temperature, rng.random(n))
        assert list(tokens) == list(greedy)
        np.testing.assert_array_equal(probs, np.eye(v)[greedy])


@pytest.mark.parametrize("vocab", [100, 49152])
def test_top_k_keeps_the_k_largest_logits_ties_in_index_order_in_rows_of_any_length(vocab):
    """top-k over a float32 row: the k largest logits, ties at the k-th broken by lower index (the closed form: a
    stable sort by descending logit), their softmax at the temperature; rows with heavy ties, -inf, +inf and a NaN.
    Long rows select first among a subsample, short ones over the whole row: both keep exactly these."""
    rng = np.random.default_rng(7)
    for case in range(12):
        row = rng.normal(size=vocab).astype(np.float32) * 4
        if case % 3 == 1:
            row = np.round(row)  # many values tied at the k-th
        if case % 4 == 2:
            row[rng.integers(0, vocab, vocab // 3)] = -np.inf
        if case % 5 == 3:
            row[rng.integers(0, vocab, 3)] = np.inf
        for k in (1, 5, 20, 64):
            t = 0.7
            with np.errstate(invalid="ignore"):  # +inf logits: inf - inf, NaN probabilities
                probs = probs_from_logits(row, t, k)
            keep = np.argsort(-row.astype(np.float64), kind="stable")[:k]
            want = np.zeros(vocab)
            x = row[keep].astype(np.float64) / t
            with np.errstate(invalid="ignore"):
                want[keep] = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            np.testing.assert_array_equal(np.flatnonzero(probs), np.flatnonzero(want))
            np.testing.assert_allclose(probs, want, rtol=1e-12, atol=0)
    row = rng.normal(size=vocab).astype(np.float32)
    row[rng.permutation(vocab)[:25]] = np.nan  # k NaN logits or more: the k-th largest is NaN, and so is every p
    with np.errstate(invalid="ignore"):
        assert np.isnan(probs_from_logits(row, 0.7, 20)).all()
