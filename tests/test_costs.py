"""The costs the runtimes steer by: the least-squares line through timed target calls, the fitted costs within their
bounds, and which runtimes fit them (closed forms: no timing of this machine is asserted)."""

import pytest

from dflash_export.engines.base import EngineInfo, SamplingParams
from dflash_export.engines.torch_ref import TorchEngine
from dflash_export.recipes import load_recipe
from dflash_export.runtime.costs import (
    DEFAULT_DRAFT_COST,
    DEFAULT_VERIFY_TOKEN_COST,
    RowTimeFit,
    StepCosts,
    engine_costs,
    records_costs,
)
from dflash_export.runtime.single import DFlashRuntime


def test_the_row_fit_is_the_least_squares_line_and_waits_for_calls_of_different_sizes():
    fit = RowTimeFit()
    for _ in range(20):  # one size only: no slope to fit
        fit.add(1, 0.02)
    assert fit.line() is None and fit.row_cost() is None
    fit = RowTimeFit()
    for i in range(8):
        fit.add(1 + i % 4, 0.02 + 0.001 * (1 + i % 4))
    assert fit.line() is None  # 8 calls weigh 7.46 (0.98 per call)
    fit.add(8, 0.028)
    c0, c1 = fit.line()
    assert c0 == pytest.approx(0.02) and c1 == pytest.approx(0.001)
    assert fit.row_cost() == pytest.approx(0.001 / 0.021)
    # noisy calls: the weighted least-squares solution of the normal equations, older calls weighing 0.98 per call
    fit, calls = RowTimeFit(), [(1, 0.021), (2, 0.0205), (4, 0.026), (8, 0.027), (1, 0.019), (3, 0.025),
                                (6, 0.024), (2, 0.022), (5, 0.026)]
    for r, t in calls:
        fit.add(r, t)
    w = [0.98 ** (len(calls) - 1 - i) for i in range(len(calls))]
    sw = sum(w)
    mr = sum(wi * r for wi, (r, _) in zip(w, calls)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, calls)) / sw
    slope = sum(wi * (r - mr) * (t - mt) for wi, (r, t) in zip(w, calls)) / sum(
        wi * (r - mr) ** 2 for wi, (r, _) in zip(w, calls))
    assert fit.line() == pytest.approx((mt - slope * mr, slope))
    # a line that does not slope up (a disturbed clock) is no fit
    fit = RowTimeFit()
    for i in range(10):
        fit.add(1 + i % 3, 0.03 - 0.002 * (i % 3))
    assert fit.line() is None


def test_calls_of_different_batch_sizes_share_the_row_slope_and_keep_their_own_intercepts():
    """Calls of B sequences timed 0.017 + 0.0024 (B - 1) + 0.0009 (R - B) seconds (a sequence costs more than a row
    within one): the fit's slope is the row's 0.0009, each group's intercept its own plain call less B rows of it;
    one line through all of them (a single group) would price a row near a sequence's 0.0024."""
    def t(b, r):
        return 0.017 + 0.0024 * (b - 1) + 0.0009 * (r - b)

    grouped, pooled = RowTimeFit(), RowTimeFit()
    for i in range(60):
        b = 1 + i % 8
        r = b + (i // 8) % 3  # some calls verify rows beyond one a sequence
        grouped.add(r, t(b, r), group=b)
        pooled.add(r, t(b, r))
    for b in (1, 4, 8):
        c0, c1 = grouped.line(b)
        assert c1 == pytest.approx(0.0009) and c0 == pytest.approx(t(b, b) - 0.0009 * b)
        assert grouped.row_cost(b) == pytest.approx(0.0009 / (t(b, b) - 0.0009 * (b - 1)))
    assert grouped.line(9) is None  # a batch size not seen yet
    assert pooled.line()[1] > 0.002


def test_step_costs_are_the_priors_until_fitted_then_the_fit_within_four_times_the_prior():
    costs = StepCosts(0.07, 0.3)
    costs.draft_pass(0.005)
    assert costs.current() == (0.07, 0.3)  # no line yet
    for i in range(12):
        costs.target_call(1 + i % 4, 0.020 + 0.001 * (1 + i % 4))
    a, d = costs.current()
    assert a == pytest.approx(0.001 / 0.021) and d == pytest.approx(0.005 / 0.021)
    for _ in range(200):  # the drafter's passes are averaged, 10 % a pass
        costs.draft_pass(0.5)
    assert costs.current()[1] == pytest.approx(4 * 0.3)  # 0.5 / 0.021 = 24 plain steps: held at 4x the prior
    slow = StepCosts(0.07, 0.3)
    for i in range(12):
        slow.target_call(1 + i % 4, 0.020 + 0.000001 * (1 + i % 4))
    assert slow.current()[0] == pytest.approx(0.07 / 4)


class _Info:
    def __init__(self, **costs):
        self.__dict__.update(costs)


class _Engine:
    def __init__(self, **costs):
        self.info = _Info(**costs)


def test_an_engine_that_records_its_costs_keeps_them_and_one_that_does_not_falls_back():
    assert records_costs(_Engine(verify_token_cost=0.25, draft_cost=0.44))
    assert engine_costs(_Engine(verify_token_cost=0.25, draft_cost=0.44)) == (0.25, 0.44)
    assert not records_costs(_Engine()) and engine_costs(_Engine()) == (DEFAULT_VERIFY_TOKEN_COST, DEFAULT_DRAFT_COST)
    assert engine_costs(_Engine(), 0.1, 0.2) == (0.1, 0.2)
    assert EngineInfo.__dataclass_fields__["verify_token_cost"].default is None


@pytest.fixture(scope="module")
def engine():
    return TorchEngine.from_recipe(load_recipe("tiny-qwen3"))


def test_the_runtime_fits_costs_only_where_none_were_recorded_or_given(engine):
    assert DFlashRuntime(engine).costs is not None            # the tiny engine records none
    assert DFlashRuntime(engine, verify_token_cost=0.1).costs is None
    assert DFlashRuntime(engine, adaptive=False).costs is None
    assert DFlashRuntime(engine, draft_cost=0.2, fit_costs=True).costs is not None
    rt = DFlashRuntime(engine)
    ids = list(range(3, 40))
    want = DFlashRuntime(engine, fit_costs=False).generate(ids, SamplingParams(max_new_tokens=40)).tokens
    for _ in range(3):  # the fit carries from request to request; the output stays the target's own
        assert rt.generate(ids, SamplingParams(max_new_tokens=40)).tokens == want
    assert rt.costs.rows._sums[1][0] > 8  # every target call of the requests was timed
    a, d = rt.costs.current()
    assert DEFAULT_VERIFY_TOKEN_COST / 4 <= a <= 4 * DEFAULT_VERIFY_TOKEN_COST
    assert (rt.verify_token_cost, rt.draft_cost) == (a, d)


def test_lookup_acceptance_carries_from_request_to_request(engine):
    rt = DFlashRuntime(engine, proposer="lookup")
    ids = [5, 6, 7, 8] * 6  # a repeating prompt: lookups propose every step
    rt.generate(ids, SamplingParams(max_new_tokens=24))
    lookups, _ = rt._lookup_stats(True, 2 * engine.info.block_size)
    seen = lookups.proposed.sum()
    assert seen > 0
    rt.generate(ids, SamplingParams(max_new_tokens=24))
    assert rt._lookup_stats(True, 2 * engine.info.block_size)[0] is lookups and lookups.proposed.sum() > seen
    assert rt._lookup_stats(False, 2 * engine.info.block_size)[0] is not lookups  # sampled requests learn apart
