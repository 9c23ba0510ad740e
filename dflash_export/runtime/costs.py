"""What a step costs on the machine that runs it: the engine's recorded costs, and an online fit of the target calls'
and the drafter's times that both runtimes (single stream and continuous batching) steer by.

Costs are in units of a one-row target call (a plain step): a target call of r rows costs about 1 + a * (r - 1), a
drafter pass `draft_cost`. They are properties of the CPU, its load and the engine's precision, not of the model
alone: benchmarks/engine_costs.py measured the fp32 SmolLM2 engine at a = 0.05, draft 0.26 on a 2-core AVX-512 EPYC
(0.04 / 0.24 on another run) where the runtime's fallback for engines that record no costs is 0.07 / 0.3; the int4
engine records 0.25 / 0.44 from its build. A fit on the calls the runtime makes anyway corrects both.
"""

from __future__ import annotations

import numpy as np

from dflash_export.engines.base import Engine

# What an engine that records no costs is assumed to cost (fp32 SmolLM2 on ONNX Runtime, 2 cores, measured with
# benchmarks/engine_costs.py when the runtime's rules were written).
DEFAULT_VERIFY_TOKEN_COST = 0.07
DEFAULT_DRAFT_COST = 0.3
# How far a fitted cost may stray from the engine's recorded (or assumed) one, either way: a fit further out is a
# disturbed clock, not a machine.
COST_SPAN = 4.0


def engine_costs(engine: Engine, verify_token_cost: float | None = None, draft_cost: float | None = None
                 ) -> tuple[float, float]:
    """(verify_token_cost, draft_cost) in plain steps: the caller's, else the engine's own measured costs when it
    records them (quantized engines), else the fp32 ONNX Runtime engine's (benchmarks/engine_costs.py)."""
    info = engine.info
    return (verify_token_cost or getattr(info, "verify_token_cost", None) or DEFAULT_VERIFY_TOKEN_COST,
            draft_cost or getattr(info, "draft_cost", None) or DEFAULT_DRAFT_COST)


def records_costs(engine: Engine) -> bool:
    """Whether the engine's manifest records costs measured at its build (quantized ONNX Runtime engines do)."""
    return bool(getattr(engine.info, "verify_token_cost", None) or getattr(engine.info, "draft_cost", None))


class RowTimeFit:
    """Least-squares line seconds = c0 + c1 * rows through recent target calls, each older call's weight multiplied
    by `keep` at every new one (0.98: the last ~50 calls count). Calls come in groups, a batch's call by the
    sequences it holds (single-stream calls are all group 1): each group has its own intercept and all share the
    slope, fitted on the rows' spread within each group (a pooled within-group regression). A call over more
    sequences costs more than one with as many rows over fewer (each sequence's attention reads its own K/V: on
    SmolLM2 fp32, 8 sequences x 1 row 1.95 plain steps, 1 sequence x 8 rows 1.2), so one line through calls of
    different batch sizes prices a row at what a sequence costs. `line(group)` is None until the calls' weights add
    up to 8 (the ninth call) and the group's to 2, before some group has seen two sizes, and while it does not
    slope up from above zero (a loaded machine's noise can make it)."""

    def __init__(self, keep: float = 0.98):
        self.keep = keep
        self._sums: dict[int, np.ndarray] = {}  # group -> sums of 1, r, r^2, t, r t

    def add(self, rows: int, seconds: float, group: int = 1) -> None:
        for g in self._sums:
            self._sums[g] *= self.keep
        new = np.array([1.0, rows, rows * rows, seconds, rows * seconds])
        self._sums[group] = self._sums[group] + new if group in self._sums else new

    def line(self, group: int = 1) -> tuple[float, float] | None:
        sums = self._sums.get(group)
        total = sum(g[0] for g in self._sums.values())
        if sums is None or total < 8 or sums[0] < 2:
            return None
        sxx = sxy = 0.0
        for n, sr, srr, st, srt in self._sums.values():  # spreads about each group's own means
            sxx += srr - sr * sr / n
            sxy += srt - sr * st / n
        if sxx <= 1e-9 * total:
            return None
        c1 = sxy / sxx
        n, sr, _, st, _ = sums
        c0 = (st - c1 * sr) / n
        return (c0, c1) if c1 > 0 and c0 > 0 else None

    def row_cost(self, group: int = 1) -> float | None:
        """a = c1 / (c0 + c1): what one more row adds, in the group's one-row calls; None while the line is."""
        line = self.line(group)
        return None if line is None else line[1] / (line[0] + line[1])


class StepCosts:
    """A runtime's costs: the recorded ones (`engine_costs`) until the fit has seen enough calls, then the fit's --
    a = c1 / (c0 + c1) from the target calls' times against their rows (`RowTimeFit`), and the drafter's pass (an
    average of its recent times, 10 % per pass) over the one-row call c0 + c1. Each is kept within [prior /
    COST_SPAN, prior * COST_SPAN]: a fit far outside what the engine was measured at is a disturbed clock, not a
    machine. One object per runtime, carried from request to request (a short request would not see enough calls).
    The batching runtime passes each call's batch size as its group and gets the costs in that batch's one-row call."""

    def __init__(self, verify_token_cost: float, draft_cost: float):
        self.prior = (verify_token_cost, draft_cost)
        self.rows = RowTimeFit()
        self._draft_s: float | None = None

    def target_call(self, rows: int, seconds: float, group: int = 1) -> None:
        self.rows.add(rows, seconds, group)

    def draft_pass(self, seconds: float) -> None:
        self._draft_s = seconds if self._draft_s is None else 0.9 * self._draft_s + 0.1 * seconds

    def _within(self, value: float, prior: float) -> float:
        return float(min(prior * COST_SPAN, max(prior / COST_SPAN, value)))

    def current(self, group: int = 1) -> tuple[float, float]:
        """(verify_token_cost, draft_cost) as this machine runs the engine now (the priors until measured)."""
        return self.fitted(group) or self.prior

    def fitted(self, group: int = 1) -> tuple[float, float] | None:
        """(verify_token_cost, draft_cost) from the fit of `group`'s calls (the draft cost the prior until a pass was
        timed); None while the fit has no line for the group."""
        a, d = self.prior
        line = self.rows.line(group)
        if line is None:
            return None
        c0, c1 = line
        a = self._within(c1 / (c0 + c1), a)
        if self._draft_s is not None:
            d = self._within(self._draft_s / (c0 + c1), d)
        return a, d
