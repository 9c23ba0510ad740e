"""Continuous batching: many requests share each engine step (ONNX Runtime engine, `engines/ort_batch.py`).

Requests join and leave between steps. A step: sequences that joined are prefilled together; the sequences that
speculate draft together (one drafter call); then one target call verifies every active sequence's block (a plain
step is a block of one). Each request keeps its own sampling randomness, consumed exactly as `runtime.DFlashRuntime`
consumes it, its own stop handling and statistics, so its tokens are those of the request run alone.

Bounds: at most `max_batch` active sequences (their K/V is what the engine holds), at most `max_queued_tokens`
prompt tokens waiting to join (a request that would pass it is refused with a DFlashError naming `max_queued_tokens`),
and, `max_kv_tokens` set, at most that many K/V token cells in the batch's buffers: they give every slot the rows of
the longest sequence (its prompt + max_new_tokens + a block, rounded up to the engine's key alignment), so a request
joins only while (sequences + 1) x the longest reservation, its own included, stays within the bound. The queue is
first in, first out: a request that does not fit waits at its head until sequences finish or are cancelled, and
the requests behind it wait too (a long request is never starved by short ones). A request that would not fit even
alone is refused at `submit` with a DFlashError naming `max_kv_tokens`.

The scheduling rule (greedy requests and sampled ones that walk, decoding/acceptance.py, whose drafter confidences
are tempered; those sampling the drafter's own chain verify full blocks, as DFlashRuntime does):
    A target call over B sequences whose blocks hold R rows in all (the graph takes them packed: only attention runs on
    the blocks padded to the longest) costs about 1 + a * (R - 1) single-sequence plain steps (a = the engine's
    verify_token_cost, 0.07 for fp32 SmolLM2 on ORT: a step's weights are read once whatever its rows), and a draft over
    B_d sequences about draft_cost * (1 + a_d * (B_d - 1)). Once measured, both are fitted on the batch's own calls, in
    the unit of its own one-row call (`_learn_row_cost`, `_learn_draft_cost`). Let q[b, k] be sequence b's chance that
    its first k drafts are all accepted (the product of the drafter's confidences, as adaptive verification uses) and λ
    the batch's decoding rate in tokens per unit of that cost (tracked online). Sequence b verifies draft k while c *
    q[b, k] >= λ * a  (B > 1; c below: the drafter's chances scaled to what recent verifies of them accepted; the
    context's branches alone are scored by their own acceptance rates, c = 1), i.e. while the tokens the row is expected
    to add pay for one more row at the current rate; one sequence's rows cost the others nothing. With one sequence the
    chances are taken unscaled (c = 1), DFlashRuntime's own rule: a lone sequence's verifies are what keep c measured,
    and scaled rows could shrink to none. As the load grows, λ grows (a plain batched step yields B tokens for 1 +
    a(B-1)), the bar rises and the verified block shrinks towards plain decoding (one row each). Drafting itself is
    skipped for the step (B > 1, or one sampled sequence: one greedy sequence keeps DFlashRuntime's rule) unless it is
    expected to beat plain batched decoding:  B (1 + c g) / (draft(B) + 1 + a (B S' - 1))  >  B / (1 + a (B - 1)),
    where g and S' are EMAs, over recent drafts, of the drafts each sequence's confidences expect accepted and of the
    rows they would verify at the current rate (1 + verify_length(confidences, λ a)), and c (at most 1) is how much of
    what the confidences expected recent verifies accepted (SmolLM2's drafter on held-out chat: 0.2-0.5, its confidences
    run high; unscaled, g would keep a small batch drafting where plain steps yield more). While drafting does not pay,
    one sequence (in turn) drafts now and then to keep g current: after `max_skip` + 1 plain steps, then after twice as
    many each time the probe leaves drafting unprofitable (at most PROBE_MAX_GAP), back to `max_skip` + 1 as soon as
    drafting pays. A probe costs one drafter call over one sequence (its pending context included); its drafts are
    verified only if the rule above says so, which at high load it does not (measured at 16 sequences x 32 tokens:
    probes + commits 0.05 s of a 6.3 s run). Per sequence, after n drafts of which nothing was accepted the next 2^n - 1
    steps are plain (at most `max_skip`), as DFlashRuntime does.
Whole trees (tree_mode "full", engines whose batched graph takes a tree mask: `BatchedEngine.verifies_trees`):
    a sequence's block is its tree -- the drafter's top-K per slot and the context's lookup branches, lookups as
    deep as the engine's numerics probe checked rows, at most `tree_nodes` and a block's rows -- and its rows are
    the tree's nodes, best first: node k is row k and its score (the chance its path is accepted) is what q[b, k]
    is for a chain, so the rule above sizes each sequence's tree as it sizes its chain. Each step chooses between the
    trees and their best paths (`_choose_step`): each option's rows by the rule above, and the one with more expected
    tokens per modelled cost, (B + c * sum of the verified rows' chances) / (draft + 1 + a (R - 1) + a GRID_PAD_COST (B
    S - R) + t * trees), wins (S: the longest block; attention pads the others to it); t is what a sequence verifying a
    tree adds to the call beyond its rows (mask, positions, the accepted path's K/V moved down), fitted online from the
    call times' residuals, 0 until measured. Rows the bar pays for that are a chain verify as a chain. So trees are
    verified where their nodes off the best path pay (a low bar: one sequence, a slow batch) and never where the bar
    stops at the best path (a fast batch). Where the engine cannot verify trees for the call (an engine built before the
    batched graph's tree mask, B > 1), each sequence verifies its tree's best path ("spine").
Greedy output is unchanged by any of these choices: every token is the target's argmax given the same prefix; and a
walked sampled request's is plain sampling's, draw for draw: every token is the target's draw with its next uniform.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dflash_export.decoding.acceptance import walk_accept
from dflash_export.decoding.options import resolve_options
from dflash_export.decoding.sampling import (
    probs_from_logits,
    tempered,
    top_probability,
    verify_block,
    verify_length,
)
from dflash_export.decoding.tree import DraftTree, LookupStats, TreeState, chain, greedy_accept, source_stats
from dflash_export.engines.base import SamplingParams
from dflash_export.engines.numerics import walks_whole_trees
from dflash_export.engines.ort_batch import BatchedEngine, BatchSeq
from dflash_export.engines.registry import batched_engine
from dflash_export.errors import DFlashError
from dflash_export.runtime.costs import StepCosts, engine_costs
from dflash_export.runtime.single import (
    GREEDY,
    RequestStopped,
    RunStats,
    StepEvent,
    _Emitter,
    _pick,
    check_request,
    count_drafter_block,
    count_sources,
)

# A draft over B_d sequences costs draft_cost * (1 + DRAFT_ROW_COST * (B_d - 1)) (measured with
# benchmarks/batch_costs.py on SmolLM2 fp32, 2 cores).
DRAFT_ROW_COST = 0.3


def draft_units(sequences: int) -> float:
    """What a draft over `sequences` sequences costs in one-sequence drafts (DRAFT_ROW_COST)."""
    return 1 + DRAFT_ROW_COST * (sequences - 1)

# A padding cell of the call's grid (attention runs every sequence at the longest block's rows) costs this fraction of
# a verified row (which pays for its projections, MLP and attention). It grows with the K/V buffer every cell
# attends over: `python benchmarks/batch_costs.py --batches 1,8` on SmolLM2, 8 sequences, measured 0.19 (fp32, context
# 200) and 0.34 / 0.20 (fp32 / int4, context 500).
GRID_PAD_COST = 0.3
PROBE_MAX_GAP = 64  # the most plain steps between two probes of a batch where drafting does not pay


@dataclass
class Request:
    """One generation. `events` collects StepEvents as they come (or `on_event` is called with each). `stop`: a cheap
    check the stepping thread makes before every step the request is in (True: the request leaves the batch there,
    its consumer gets RequestStopped), so a cancel seen by it costs no more steps however far the consumer trails."""

    prompt_ids: list[int]
    sp: SamplingParams
    mode: str = "dflash"
    id: int = 0
    on_event: object = None
    stats: RunStats = field(default_factory=RunStats)
    events: list = field(default_factory=list)
    submitted_s: float = 0.0
    done: bool = False
    cancelled: bool = False
    joined: bool = False  # taken from the queue into the batch (set by the stepping thread)
    error: Exception | None = None
    stop: object = None


class _Active:
    """A request's decoding state while it holds a slot."""

    def __init__(self, req: Request, seq: BatchSeq, stop_ids: set[int]):
        self.req, self.seq, self.stop_ids = req, seq, stop_ids
        self.rng = np.random.default_rng(req.sp.seed)
        # Sampled requests that walk (decoding/acceptance.py) are scheduled as greedy ones are: the drafter's argmax
        # and top-K (its confidences tempered), every row drawn by the target with the request's next uniform.
        self.walk = False
        self.emit = _Emitter(req.sp, stop_ids, req.stats, req.submitted_s)  # DFlashRuntime's stop / length cut
        self.last = -1
        self.misses = self.skip = 0
        self.n_draft = 0
        self.drafts: np.ndarray | None = None
        self.draft_probs = None
        self.block_len = 0
        # Greedy requests whose proposer has lookup branches (decoding/tree.py): the context index and lookup stats,
        # and this step's proposal -- the best path of a tree of the drafter's block and the lookups -- with each
        # draft's chance of acceptance (what _choose_step weighs instead of the drafter's confidences).
        self.state: TreeState | None = None
        self.spine: tuple[DraftTree, list[int], bool] | None = None  # tree, best path, drafter in it
        self.spine_scores: np.ndarray | None = None
        # Whole trees (tree_mode "full"): this step's tree, verified node for node (`_block` cuts it to the rows the
        # step verifies), and the accepted path of node indices that `commit` keeps.
        self.tree: tuple[DraftTree, bool] | None = None  # tree, drafter in it
        self.path: list[int] | None = None
        # tree_mode "full": the whole tree proposed this step, which `_choose_step` verifies instead of its best path
        # when the cost model says its nodes off that path pay
        self.whole: tuple[DraftTree, bool] | None = None

    @property
    def produced(self) -> int:
        return self.emit.produced

    @property
    def argmax_drafts(self) -> bool:
        """Whether this request drafts the drafter's argmax (greedy, or sampled and walked): then its drafts come
        with confidences and the cost model schedules it; the drafter's own sampled chain verifies full blocks."""
        return self.req.sp.greedy or self.walk


def _check_kv_bound(max_kv_tokens: int | None) -> None:
    if max_kv_tokens is not None and max_kv_tokens < 1:
        raise DFlashError(f"must be >= 1, got {max_kv_tokens}", field="max_kv_tokens")


class BatchingRuntime:
    """Continuous batching over one ONNX Runtime engine. `step()` advances every active request by one engine step;
    one thread steps it. `submit` and `cancel` may come from other threads at any time: the queue has its own lock,
    held only to append or pop (never across an engine call), and a request joins at the next step boundary. See the
    module docstring for the scheduling rule."""

    def __init__(self, engine, max_batch: int = 16, max_queued_tokens: int = 65536, adaptive: bool = True,
                 verify_token_cost: float | None = None, draft_cost: float | None = None, max_skip: int = 7,
                 proposer: str | None = None, sampling: str | None = None, tree_mode: str | None = None,
                 fit_costs: bool = True, max_kv_tokens: int | None = None):
        if max_queued_tokens < 1:
            raise DFlashError(f"must be >= 1, got {max_queued_tokens}", field="max_queued_tokens")
        _check_kv_bound(max_kv_tokens)
        # The engine's recorded decoding options with the caller's, checked once (decoding/options.py).
        self.options = resolve_options(getattr(engine.info, "decoding", None), proposer=proposer, sampling=sampling,
                                       tree_mode=tree_mode)
        self.max_kv_tokens = max_kv_tokens  # K/V token cells the batch may hold (None: unbounded)
        self.batch = self.new_batch(engine, max_batch)
        self.info = engine.info
        self.codec = engine.codec
        self.full_last_block = getattr(engine, "fixed_block", False)
        # Steps propose lookup branches too when the engine's proposer has them. tree_mode "spine": each sequence
        # verifies its tree's best path, as DFlashRuntime's "spine" mode does (its lookups merged with its drafter's
        # block as a chain); "full": each sequence's block is its whole tree (the drafter's top-K per slot and the
        # lookups), its rows the tree's nodes, where the batched engine verifies trees (engines/ort_batch.py).
        proposal = self.options.proposer_for()
        self.lookups, self.drafter = proposal.lookups, proposal.drafter
        self.trees = not proposal.chain_only  # steps propose trees: lookup branches, the drafter's top-K, or both
        self.spine_proposal = type(proposal)(1)
        self.tree_proposal = proposal
        self.full_trees = self.options.tree_mode == "full"
        # Walked sampled sequences verify whole trees only where the single-stream runtime walks them too (their rows
        # close enough to plain steps: engines/numerics.walks_whole_trees), else their best paths.
        self.walks_trees = walks_whole_trees(engine)
        numerics = getattr(engine, "numerics", None)
        self.max_rows = numerics.max_rows if numerics is not None and numerics.max_rows else self.info.block_size
        self.trees_verified = 0  # sequence-steps that verified a tree with branches
        # Lookup nodes are scored by the batch's lookup acceptance per depth, learned from every sequence's steps:
        # a request's own counts start from an optimistic prior, which at high load (a high bar per row) would pay
        # padded rows for lookups this text does not accept until each request had learned it alone.
        self.lookup_stats = LookupStats(2 * self.info.block_size)
        self.adaptive = adaptive
        self.a, self.draft_cost = engine_costs(engine, verify_token_cost, draft_cost)
        self.a_recorded, self.draft_cost_recorded = self.a, self.draft_cost
        # The cost of a target row as this machine runs the batch now, fitted online (time = c0 + c1 * rows over the
        # recent target calls, forgetting 2 % per call, each batch size its own intercept: runtime/costs.RowTimeFit);
        # `a` becomes c1 / (c0 + c1) for the current batch size once the fit has a line for it, kept within
        # [recorded / COST_SPAN, min(0.5, recorded * COST_SPAN)] as the single-stream runtime keeps its own. The
        # recorded cost is a single sequence's verify row in single-sequence steps; a row among a batch's packed rows,
        # in the batch's own one-row call, costs less (fp32 at 8 sequences: a row 0.05 of a single-sequence step, the
        # call 1.95 of them; int4 0.25 recorded, 0.08-0.10 measured by benchmarks/batch_costs.py), and a floor at
        # the recorded cost kept int4's bar 2.5x too high. One line through calls of every batch size (before) priced
        # a row at what a sequence costs and could leave `a` at its 0.5 cap for a whole run.
        # The drafter's pass in the same unit, the fit's one-row call c0 + c1 (as the single-stream runtime's costs):
        # seconds per drafted sequence-equivalent (a draft of B_d sequences counts 1 + DRAFT_ROW_COST (B_d - 1)),
        # averaged over recent drafts (10 % per draft). The unit is the current batch's own call, whose intercept c0
        # carries the batch's per-sequence cost: at 8 sequences it is ~1.6-2 single-sequence plain steps, and a draft
        # cost kept in single-sequence steps charged the drafter that much too much beside rows priced in the fit's
        # unit. Both fits are the single-stream runtime's (runtime/costs.StepCosts), one group per batch size.
        self.costs = StepCosts(self.a, self.draft_cost)
        self._group = 1  # the sequences of the last target call: whose one-row call the costs are priced in
        self.fit_costs = fit_costs  # False: the recorded costs only (what a rule does with them, clock aside)
        # What a sequence verifying a whole tree adds to a target call beyond its rows (the tree's mask and
        # positions, its accepted path's K/V moved down), in single-sequence plain steps: the fit's residual per tree
        # on calls that verified trees, over its residual on calls that did not (forgetting 10 % per call). Starts at
        # 0, so that trees are tried where their nodes pay and their cost is measured.
        self.tree_cost = 0.0
        self._residual = np.zeros(2)  # EMAs: calls without trees, per tree on calls with trees
        self.tree_steps = 0           # steps that verified whole trees (_choose_step chose them)
        self.max_skip = max_skip
        self.max_queued_tokens = max_queued_tokens
        self.queue: collections.deque[Request] = collections.deque()
        self.queued_tokens = 0
        self._queue_lock = threading.Lock()  # queue + queued_tokens: submitters vs the stepping thread
        self.active: list[_Active] = []
        self.rate = 1.0           # λ: tokens per unit of single-sequence plain-step cost
        # What drafting is expected to yield per drafting sequence (EMAs over recent drafts, B > 1; see
        # _learn_from_drafts). Optimistic at start, so that drafting is tried and measured.
        self.accepted_per_draft = 1.0
        self.rows_per_draft_step = self.info.block_size / 2
        # How far the confidences' expectation is borne out: drafts accepted over drafts expected accepted (the sum
        # of each verified draft's chance), over recent verifies (forgetting 5 % per step); scales g above. A
        # drafter whose confidences run high would otherwise keep a batch drafting where plain steps yield more.
        self._accepted_vs_expected = np.array([1.0, 1.0])
        self._since_draft = 0
        self._probe_gap = max_skip + 1  # plain steps before the next probe (doubles while probes find no gain)
        self._probe_turn = 0
        self.probes = 0
        self._ids = itertools.count()
        # The work done, for the bench's report: target calls (= steps), their rows (packed: each block's own),
        # drafter calls and the sequences they drafted, and the cost model's total (in single-sequence plain steps).
        # Deterministic for a given load, so two modes' work can be compared without timing noise.
        self.steps = 0
        self.rows_verified = 0    # drafts verified (sum over sequences and steps)
        self.target_rows = 0
        self.draft_calls = 0
        self.draft_seqs = 0
        self.modelled_cost = 0.0
        self.drafting_steps = 0   # steps in which some sequence drafted (the others were plain batched steps)

    def set_kv_bound(self, max_kv_tokens: int | None) -> None:
        """Bound the batch's K/V token cells from now on (None: unbounded): for a bound worked out from the memory
        left once the batched graph is loaded. Sequences already running keep their rows."""
        _check_kv_bound(max_kv_tokens)
        self.max_kv_tokens = self.batch.kv_token_limit = max_kv_tokens

    def new_batch(self, engine, max_batch: int) -> BatchedEngine:
        """An empty batched engine for `engine` (its backend's: engines.registry), its buffers bounded by
        `max_kv_tokens`."""
        batch = batched_engine(engine, max_batch)
        batch.kv_token_limit = self.max_kv_tokens
        return batch

    def reservation(self, req: Request) -> int:
        """The tokens a request's sequence may grow to (what `batch.add` reserves): prompt + max_new_tokens + a
        block."""
        return len(req.prompt_ids) + req.sp.max_new_tokens + self.info.block_size

    def _fits(self, req: Request) -> bool:
        """Whether the batch's K/V, with `req` joined, stays within `max_kv_tokens`."""
        return self.max_kv_tokens is None or self.batch.kv_cells(self.reservation(req)) <= self.max_kv_tokens

    # Requests -----------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids, sp: SamplingParams, mode: str = "dflash", on_event=None,
               stats: RunStats | None = None, stop=None) -> Request:
        """Queue a request; DFlashError when it is invalid, when its K/V alone would pass `max_kv_tokens`, or when
        the queue holds `max_queued_tokens` already.
        `stats`: the RunStats to fill (the request's own otherwise), set before the stepping thread can see it;
        `stop`: the request's `Request.stop` check."""
        if mode not in ("dflash", "ar"):
            raise DFlashError(f"unknown mode {mode!r} (dflash, ar)", field="mode")
        prompt_ids = [int(t) for t in prompt_ids]
        check_request(self.info, prompt_ids, sp)
        req = Request(prompt_ids, sp, mode, 0, on_event, stop=stop)
        if self.max_kv_tokens is not None:
            alone = self.batch.aligned(self.reservation(req))  # one slot's rows
            if alone > self.max_kv_tokens:
                raise DFlashError(f"the request's K/V needs {alone} tokens ({len(prompt_ids)} prompt + "
                                  f"{sp.max_new_tokens} new + a block of {self.info.block_size}, in the engine's "
                                  f"alignment), more than the batch's bound of {self.max_kv_tokens}: ask for fewer "
                                  "new tokens or send a shorter prompt", field="max_kv_tokens")
        with self._queue_lock:
            if self.queued_tokens + len(prompt_ids) > self.max_queued_tokens:
                raise DFlashError(f"the queue is full ({self.queued_tokens} prompt tokens waiting, bound "
                                  f"{self.max_queued_tokens})", field="max_queued_tokens")
            req.id = next(self._ids)
            if stats is not None:
                req.stats = stats
            req.submitted_s = time.perf_counter()
            req.stats.prompt_tokens = len(prompt_ids)
            self.queue.append(req)
            self.queued_tokens += len(prompt_ids)
        return req

    def take_queue(self) -> list[Request]:
        """Empty the queue (for a caller that ends the queued requests itself) and return what it held."""
        with self._queue_lock:
            queued, self.queued_tokens = list(self.queue), 0
            self.queue.clear()
        return queued

    def cancel(self, req: Request) -> None:
        """Drop a request. A queued one leaves the queue now (its prompt tokens stop counting against
        `max_queued_tokens`); a running one at the next step boundary, its slot freed then."""
        req.cancelled = True
        with self._queue_lock:
            if req.joined:
                return
            for i, queued in enumerate(self.queue):
                if queued is req:
                    del self.queue[i]
                    self.queued_tokens -= len(req.prompt_ids)
                    req.done = True
                    req.stats.finish_reason = "cancelled"
                    return

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    def generate_many(self, prompts, sps, mode: str = "dflash") -> list[RunStats]:
        """Run the requests together (all submitted at once) to completion; their stats in order."""
        if isinstance(sps, SamplingParams):
            sps = [sps] * len(prompts)
        reqs = [self.submit(p, sp, mode) for p, sp in zip(prompts, sps)]
        while not self.idle:
            self.step()
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.stats for r in reqs]

    # The step -----------------------------------------------------------------------------------------------------

    def _emit(self, act: _Active, new: list[int], accept: int | None) -> StepEvent:
        ev = act.emit(new, accept)
        act.req.events.append(ev)
        if act.req.on_event is not None:
            act.req.on_event(ev)
        return ev

    def _finish(self, act: _Active) -> None:
        act.req.done = True
        self.batch.remove(act.seq)
        self.active.remove(act)

    def _admit(self) -> None:
        joiners: list[_Active] = []
        while len(self.active) + len(joiners) < self.batch.max_batch:
            with self._queue_lock:  # a cancel from another thread may empty the queue at any moment
                if not self.queue:
                    break
                req = self.queue[0]
                if not req.cancelled and not self._fits(req):  # waits at the head, and so does every later one
                    break
                self.queue.popleft()
                self.queued_tokens -= len(req.prompt_ids)
                req.joined = True
            req.stats.admission_wait_s = time.perf_counter() - req.submitted_s
            req.stats.kv_token_limit = self.max_kv_tokens or 0
            if req.cancelled:  # cancelled while being taken from the queue
                req.done = True
                req.stats.finish_reason = "cancelled"
                continue
            sp = req.sp
            seq = self.batch.add(self.reservation(req))
            seq.keep_context = req.mode == "dflash"
            stop = set(self.info.stop_token_ids if sp.stop_token_ids is None else sp.stop_token_ids)
            act = _Active(req, seq, stop)
            act.walk = req.mode == "dflash" and not sp.greedy and self.options.sampling == "walk" and \
                not self.full_last_block
            joiners.append(act)
        if not joiners:
            return
        self.active.extend(joiners)
        logits = self.batch.prefill([a.seq for a in joiners], [a.req.prompt_ids for a in joiners])
        for act, row in zip(joiners, logits):
            act.last = _pick(row, act.req.sp, act.rng)
            if self.trees and act.req.mode == "dflash" and (act.req.sp.greedy or act.walk):
                # scored and counted by the batch's lookup acceptance (one count for every sequence)
                depth = 2 * self.info.block_size
                act.state = TreeState(act.req.prompt_ids + [act.last], depth,
                                      stats=(self.lookup_stats, source_stats(depth)[1]))
            act.req.stats.ttft_s = time.perf_counter() - act.req.submitted_s
            if self._emit(act, [act.last], None).finished:
                self._finish(act)

    def step(self) -> None:
        """Admit queued requests (prefill), then one draft + verify (or plain) step for every active request."""
        self._drop_cancelled()
        self._admit()
        if not self.active:
            return
        self.steps += 1
        acts = list(self.active)  # slot order
        acts.sort(key=lambda a: a.seq.slot)
        t0 = time.perf_counter()
        drafting, probe = self._drafting(acts)
        draft_cost = self._draft(drafting) if drafting else 0.0
        modelled_draft_cost = self.draft_cost_recorded * draft_units(len(drafting)) if drafting else 0.0
        self.drafting_steps += bool(drafting)
        self._propose_lookups(acts)
        blocks = [self._block(a, n) for a, n in zip(acts, self._choose_step(acts, drafting, draft_cost))]
        rows = sum(len(b) for b in blocks)  # the call's packed rows (engines/ort_batch.py)
        t1 = time.perf_counter()
        logits = self.batch.target_step([a.seq for a in acts], blocks,
                                        [a.tree[0] if a.tree is not None else None for a in acts],
                                        [a.req.sp.greedy for a in acts])
        t2 = time.perf_counter()
        if self.adaptive and self.fit_costs:
            trees = sum(a.tree is not None and not a.tree[0].is_chain for a in acts)
            self._learn_row_cost(rows, t2 - t1, trees, len(acts))
        # Each request's share of the step's time (what /metrics sums): the drafting ones share the drafter's,
        # every one the target's.
        for a in drafting:
            a.req.stats.draft_s += (t1 - t0) / len(drafting)
        for a in acts:
            a.req.stats.verify_s += (t2 - t1) / len(acts)
        tokens = 0
        done = []
        self._accepted_vs_expected *= 0.95
        for a, blk, lg in zip(acts, blocks, logits):
            accept, emitted = self._verify(a, blk, lg, probe)
            self._learn_acceptance(a, accept)
            self.batch.commit(a.seq, accept, a.path)
            a.last = emitted[-1]
            tokens += accept + 1
            ev = self._emit(a, emitted, None if a.req.mode == "ar" else accept)
            a.req.stats.acceptance_lengths.append(len(ev.tokens) if a.req.mode == "dflash" else 1)
            if a.req.mode == "dflash" and accept:
                self._count_sources(a, min(accept, len(ev.tokens)))
            if a.state is not None:
                a.state.context.extend(ev.tokens)
            if ev.finished:
                done.append(a)
        for a in done:  # after every commit: a freed slot takes the last slot's rows, committed ones only
            self._finish(a)
        cost = draft_cost + 1.0 + self.a * (rows - 1)
        self.target_rows += rows
        self.modelled_cost += modelled_draft_cost + 1.0 + self.a_recorded * (rows - 1)  # deterministic for a load
        self.rate = 0.9 * self.rate + 0.1 * tokens / cost

    def _drop_cancelled(self) -> None:
        for act in [a for a in self.active if a.req.cancelled or self._stopped(a.req)]:
            act.req.stats.finish_reason = "cancelled"
            act.req.stats.total_s = time.perf_counter() - act.req.submitted_s
            self._finish(act)
            if not act.req.cancelled:  # dropped by its stop check: its consumer still waits for an event
                act.req.cancelled = True
                if act.req.on_event is not None:
                    act.req.on_event(RequestStopped())

    @staticmethod
    def _stopped(req: Request) -> bool:
        try:
            return req.stop is not None and bool(req.stop())
        except Exception:  # noqa: BLE001 - a failing check stops nothing; the consumer still checks between events
            return False

    def _drafting(self, acts: list[_Active]) -> tuple[list[_Active], _Active | None]:
        """The sequences that draft this step (their per-step fields reset, every sequence's), and the probe: when
        drafting does not pay for the batch, one greedy sequence drafts now and then anyway."""
        drafting = []
        # One greedy sequence follows DFlashRuntime's rule (its lookups and drafts measured 1.5-1.8x plain alone); a
        # sampled one alone is judged as a batch is: at T 0.7 it drafted at 0.76x plain (8 held-out prompts).
        batch_may_draft = (len(acts) == 1 and acts[0].req.sp.greedy) or self._drafting_pays(len(acts))
        probe = None
        if batch_may_draft:
            self._since_draft = 0
            self._probe_gap = self.max_skip + 1
        else:  # one sequence drafts now and then, to keep the estimate of what drafting would yield current
            self._since_draft += 1
            candidates = [a for a in acts if a.req.mode == "dflash" and a.argmax_drafts]
            if self._since_draft >= self._probe_gap and candidates:
                probe = candidates[self._probe_turn % len(candidates)]
                self._probe_turn += 1
                self.probes += 1
                self._since_draft = 0
                self._probe_gap = min(2 * self._probe_gap, PROBE_MAX_GAP)
        for a in acts:
            a.n_draft, a.drafts, a.draft_probs, a.spine, a.spine_scores = 0, None, None, None, None
            a.tree = a.path = a.whole = None
            if a.req.mode != "dflash":
                continue
            if a.argmax_drafts and not self.drafter:  # lookups only (_propose_lookups)
                continue
            if a.argmax_drafts and a is not probe and (a.skip > 0 or not batch_may_draft):
                a.skip = max(0, a.skip - 1)
                continue
            drafting.append(a)
        return drafting, probe

    def _draft(self, drafting: list[_Active]) -> float:
        """One batched draft for `drafting` (drafts and their probabilities stored on each); returns its cost in plain
        steps."""
        bs = self.info.block_size
        us = []
        for a in drafting:
            sp = a.req.sp
            us.append(None if a.argmax_drafts else a.rng.random(bs - 1))
            a.block_len = bs if self.full_last_block else min(bs, sp.max_new_tokens - a.produced + 1)
        # Walked requests draft the argmax (never a draw: their proposal must not consume their random stream).
        t = time.perf_counter()
        res = self.batch.draft([a.seq for a in drafting], [a.last for a in drafting],
                               [GREEDY if a.walk else a.req.sp for a in drafting], us,
                               [a.block_len for a in drafting])
        if self.adaptive and self.fit_costs:
            self._learn_draft_cost(len(drafting), time.perf_counter() - t)
        for a, (d, p) in zip(drafting, res):
            a.drafts, a.draft_probs = d, p
            if a.walk and a.seq.draft_logits is not None:  # the chance each draft is the target's tempered draw
                a.seq.draft_confidence = top_probability(tempered(a.seq.draft_logits, a.req.sp.temperature))
        draft_cost = self.draft_cost * draft_units(len(drafting))
        self.draft_calls += 1
        self.draft_seqs += len(drafting)
        self._learn_from_drafts(drafting)
        return draft_cost

    def _propose_lookups(self, acts: list[_Active]) -> None:
        """For sequences whose proposer grows trees (greedy, or walked): this step's drafts become the best path of a
        tree of the drafter's block or top-K (when it drafted) and the context's lookup branches (when the proposer
        has them), no deeper than a block; with tree_mode "full", the whole tree too."""
        bs = self.info.block_size
        full = self.full_trees and self.batch.verifies_trees(len(acts))
        # every sequence of the call gets the call's rows (padding included): the longest one bounds them
        room = self.info.max_seq_len - max(a.seq.length for a in acts) - 1
        for a in acts:
            if a.state is None:
                continue
            owed = a.req.sp.max_new_tokens - a.produced - 1
            depth = min(bs - 1, owed)
            whole = full and (self.walks_trees or not a.walk)
            # Whole trees: lookup branches as deep as the numerics probe checked rows (never more rows than a block)
            found = a.state.context.branches(min(self.max_rows - 1, owed) if whole else depth, with_sizes=True) \
                if owed > 0 and self.lookups else []  # the tree proposer grows from the drafter alone
            branches, sizes = [b for _, b in found], [n for n, _ in found]
            logits = a.seq.draft_logits[:depth] if a.drafts is not None and a.seq.draft_logits is not None else None
            if not branches and logits is None:
                continue
            if logits is not None and a.walk:
                logits = tempered(logits, a.req.sp.temperature)
            if whole:
                nodes = min(self.options.tree_nodes, self.max_rows - 1, self.batch.max_step_rows - 1, room)
                tree = self.tree_proposal.propose(a.last, logits, branches, max_nodes=nodes,
                                                  lookup_scores=self.lookup_stats.score, lookup_sizes=sizes)
                if len(tree) < 2:
                    continue
                # Nodes come best-first (decoding/tree.build_tree), parents before children: the first n rows of
                # the tree are a tree, and each node's score is what verifying its row is expected to add. The
                # step verifies its best path unless _choose_step finds the whole tree pays more.
                a.whole = (tree, logits is not None)
            else:
                tree = self.spine_proposal.propose(a.last, logits, branches, max_nodes=bs - 1,
                                                   lookup_scores=self.lookup_stats.score, lookup_sizes=sizes)
            spine = tree.best_chain()
            if len(spine) < 2:
                continue
            a.spine = (tree, spine, logits is not None)
            a.drafts = np.asarray([tree.tokens[i] for i in spine[1:]], np.int64)
            a.spine_scores = np.asarray([tree.scores[i] for i in spine[1:]], np.float64)
            a.block_len = len(spine)

    def _use_whole_tree(self, a: _Active) -> None:
        """This step verifies `a`'s whole tree, node for node, instead of its best path."""
        tree, drafted = a.whole
        a.tree, a.spine = (tree, drafted), None
        a.drafts = np.asarray(tree.tokens[1:], np.int64)
        a.spine_scores = np.asarray(tree.scores[1:], np.float64)
        a.block_len = len(tree)

    def _block(self, a: _Active, s: int) -> np.ndarray:
        """The rows this sequence verifies when the step gives it `s` rows: its last token, then its drafts (sets
        `a.n_draft`)."""
        if a.drafts is not None:
            cap = a.block_len - 1
            if a.tree is not None:  # a tree's depth is within what the request owes; its rows are its nodes
                a.n_draft = max(0, min(s - 1, cap)) if self.adaptive else cap
            elif a.argmax_drafts and self.adaptive and (a.spine is not None or a.seq.draft_confidence is not None):
                cap = min(cap, a.req.sp.max_new_tokens - a.produced - 1)
                a.n_draft = max(0, min(s - 1, cap))
            else:
                a.n_draft = cap
        if a.tree is not None:  # the rows this step verifies: the tree's first n_draft + 1 nodes
            a.tree = (_first_nodes(a.tree[0], a.n_draft + 1), a.tree[1])
        blk = np.empty(a.n_draft + 1, np.int64)
        blk[0] = a.last
        if a.n_draft:
            blk[1:] = a.drafts[: a.n_draft]
        return blk

    @staticmethod
    def _count_sources(a: _Active, kept: int) -> None:
        """Count the `kept` drafts this step added to `a`'s answer for the sources that proposed them (its tree's
        accepted path, its best path verified as a chain, or the drafter's block)."""
        stats = a.req.stats
        if a.tree is not None and a.path is not None:
            count_sources(stats, a.tree[0], a.path[:1 + kept])
        elif a.spine is not None:
            count_sources(stats, a.spine[0], a.spine[1][:1 + kept])
        else:
            count_drafter_block(stats, kept)

    def _verify(self, a: _Active, blk: np.ndarray, lg: np.ndarray, probe: _Active | None) -> tuple[int, list[int]]:
        """(drafts accepted, tokens emitted) of one sequence from its target logits `lg`; updates its back-off."""
        sp = a.req.sp
        if a.req.mode == "ar":
            a.last = _pick(lg[0], sp, a.rng)
            return 0, [a.last]
        tree = None if a.tree is None else a.tree[0]
        if a.walk:  # the target's draws with the request's next uniforms, along its tree (decoding/acceptance.py)
            path, emitted = walk_accept(tree if tree is not None else chain(blk[0], blk[1:]), lg, sp.temperature,
                                        sp.top_k, sp.top_p, a.rng.random)
            if a.drafts is None:
                return 0, emitted
            accept = len(path) - 1
            if tree is not None:
                a.path = path
        elif tree is not None:
            a.path, emitted = greedy_accept(tree, np.argmax(lg, axis=-1))
            accept = len(a.path) - 1
        elif a.drafts is None:  # a plain step whose features stay pending (back-off)
            return verify_block(None, lg, blk[1:], None, None, True)
        else:
            u = None if sp.greedy else a.rng.random(self.info.block_size)
            probs = None if sp.greedy else probs_from_logits(lg.astype(np.float64), sp.temperature, sp.top_k,
                                                              sp.top_p)
            accept, emitted = verify_block(probs, lg, blk[1:], a.draft_probs, u, sp.greedy)
        if tree is not None:
            checked = set(range(len(tree)))
            a.state.record(tree, a.path, checked, a.tree[1], True)
            self.trees_verified += not tree.is_chain
        elif a.spine is not None:
            tree, spine, drafted = a.spine
            a.state.record(tree, spine[:accept + 1], set(spine[:a.n_draft + 1]), drafted, True)
        a.req.stats.drafted_tokens += a.n_draft
        self.rows_verified += a.n_draft
        if a.argmax_drafts and self.adaptive and a is not probe:  # DFlashRuntime's per-sequence back-off
            a.misses = a.misses + 1 if accept == 0 else 0
            a.skip = min(self.max_skip, (1 << a.misses) - 1)
        return accept, emitted

    def _learn_from_drafts(self, drafting: list[_Active]) -> None:
        """Update what drafting is expected to yield per sequence: the rows each drafting sequence's own confidences
        would have it verify at the current rate (1 + verify_length(conf, λ a), the batch rule per sequence) and the
        drafts it would then get accepted (the sum of its cumulative confidences over them)."""
        gains, rows = [], []
        for a in drafting:
            conf = a.seq.draft_confidence
            if not (a.argmax_drafts and self.adaptive and conf is not None):
                continue
            room = max(0, min(a.block_len - 1, a.req.sp.max_new_tokens - a.produced - 1))
            conf = np.asarray(conf[:room], np.float64)
            n = verify_length(conf, self.rate * self.a)
            gains.append(float(np.cumprod(conf)[:n].sum()) if n else 0.0)
            rows.append(1 + n)
        if gains:
            self.accepted_per_draft = 0.8 * self.accepted_per_draft + 0.2 * float(np.mean(gains))
            self.rows_per_draft_step = 0.8 * self.rows_per_draft_step + 0.2 * float(np.mean(rows))

    def _learn_acceptance(self, a: _Active, accept: int) -> None:
        """Add one sequence's verify to the realized / expected acceptance (argmax drafts with chances only)."""
        if not (a.argmax_drafts and a.n_draft and a.req.mode == "dflash") or not _drafter_scored(a):
            return  # the context's branches are scored by their own acceptance rates (decoding/tree.LookupStats)
        if a.spine_scores is not None:
            chances = a.spine_scores[: a.n_draft]
        elif a.seq.draft_confidence is not None:
            chances = np.cumprod(np.asarray(a.seq.draft_confidence[: a.n_draft], np.float64))
        else:
            return
        self._accepted_vs_expected += (accept, float(np.sum(chances)))

    @property
    def acceptance_calibration(self) -> float:
        """Drafts accepted per draft the confidences expected accepted, recently (1 before any verify; at most 1:
        a drafter whose confidences run low is not trusted beyond them)."""
        accepted, expected = self._accepted_vs_expected
        return float(min(1.0, accepted / expected)) if expected > 0 else 1.0

    def _learn_row_cost(self, rows: int, seconds: float, trees: int = 0, seqs: int = 1) -> None:
        """A target call over `seqs` sequences and `rows` rows took `seconds`: the row cost `a` (and the drafter's)
        in the unit of a one-row call of a batch that size (`_price`)."""
        self._group = seqs
        line = self.costs.rows.line(seqs)
        if line is not None:  # the tree overhead: this call's time against the fit before it
            c0, c1 = line
            residual = (seconds - c0 - c1 * rows) / (c0 + c1)
            if trees:
                self._residual[1] = 0.9 * self._residual[1] + 0.1 * residual / trees
            else:
                self._residual[0] = 0.9 * self._residual[0] + 0.1 * residual
            self.tree_cost = float(min(1.0, max(0.0, self._residual[1] - self._residual[0])))
        if trees:  # the row fit is of rows alone
            return
        self.costs.target_call(rows, seconds, seqs)
        self._price(row_too=True)

    def _learn_draft_cost(self, seqs: int, seconds: float) -> None:
        self.costs.draft_pass(seconds / draft_units(seqs))
        self._price()

    def _price(self, row_too: bool = False) -> None:
        """The fitted costs of the last call's batch size (each within COST_SPAN of the recorded one, a at most 0.5),
        the last estimate while that size has no line of its own yet."""
        fitted = self.costs.fitted(self._group)
        if fitted is None:
            return
        a, self.draft_cost = fitted
        if row_too:
            self.a = min(0.5, a)

    def _drafting_pays(self, b: int) -> bool:
        """Whether a drafting step is expected to yield more tokens per unit of cost than a plain batched step,
        from what drafting has yielded lately (B > 1, or one sampled sequence; one greedy one follows DFlashRuntime's
        rule)."""
        plain = b / (1.0 + self.a * (b - 1))
        cost = self.draft_cost * draft_units(b) + 1.0 + self.a * (b * self.rows_per_draft_step - 1)
        return b * (1.0 + self.acceptance_calibration * self.accepted_per_draft) / cost > plain

    def _choose_step(self, acts: list[_Active], drafting: list[_Active], draft_cost: float) -> list[int]:
        """The rows each sequence verifies in this step's target call (in `acts` order), and whether the sequences
        with a whole tree (tree_mode "full") verify it or its best path: the option whose rows the bar pays for
        (`rows_paid`) and whose expected tokens per modelled cost are higher (`step_rate`; a tree costs its rows
        plus the measured tree overhead)."""
        wholes = [a for a in acts if a.whole is not None]
        if not self.adaptive:  # every node verified: whole trees as they are
            for a in wholes:
                self._use_whole_tree(a)
            self.tree_steps += bool(wholes)
        # A batch pays for rows with the drafts they are expected to get accepted: the drafter's chances scaled by
        # what recent verifies of them accepted (the context's branches are scored by their own acceptance rates).
        # Alone, a sequence keeps its unscaled chances: its rows are what keeps c measured (scaled rows can shrink to
        # none, and then no verify would ever move c again).
        c = self.acceptance_calibration if len(acts) > 1 else 1.0
        bar = self._bar(len(acts))
        rows, scored = self._rows(acts, drafting, c, bar)
        if not wholes or not self.adaptive:
            return rows
        spine_gain = expected_gain(scored, rows)
        paths = {id(a): (a.spine, a.drafts, a.spine_scores, a.block_len) for a in wholes}
        for a in wholes:
            self._use_whole_tree(a)
        t_rows, t_scored = self._rows(acts, drafting, c, bar)
        trees = sum(not _first_nodes(a.tree[0], n).is_chain for a, n in zip(acts, t_rows) if a.tree is not None)
        b = len(acts)  # the tree-or-path choice weighs calibrated gains at every size
        c1 = 1.0 if b > 1 else self.acceptance_calibration
        if trees and step_rate(b, c1 * expected_gain(t_scored, t_rows), draft_cost, self.a, t_rows, trees,
                               self.tree_cost) > \
                step_rate(b, c1 * spine_gain, draft_cost, self.a, rows, 0, self.tree_cost):
            self.tree_steps += 1
            return t_rows
        for a in wholes:  # the best paths pay at least as much: back to them
            a.tree = None
            a.spine, a.drafts, a.spine_scores, a.block_len = paths[id(a)]
        return rows

    def _rows(self, acts: list[_Active], drafting: list[_Active], c: float, bar: float
              ) -> tuple[list[int], list[np.ndarray | None]]:
        """(the rows of each sequence, the scaled chances of acceptance row by row of each scored one, None for the
        others). Trees' and best paths' node scores (already cumulative) and chains' cumulative confidences are scored:
        their rows are what `rows_paid` pays for, then capped where the grid's padding does not pay (`fit_grid`). The
        rest verify their whole block (rules that are not adaptive, drafts sampled from the drafter's chain) or one row
        (no drafts)."""
        rows, scored = [], []
        for a in acts:
            q = None
            if a.spine_scores is not None:  # each draft's chance of acceptance along its tree's best path
                q = a.spine_scores if self.adaptive else None
                fixed = a.block_len
            elif a in drafting:
                fixed = a.block_len
                if a.argmax_drafts and self.adaptive and a.seq.draft_confidence is not None:
                    room = min(a.block_len - 1, a.req.sp.max_new_tokens - a.produced - 1)
                    q = np.cumprod(np.asarray(a.seq.draft_confidence[:max(room, 0)], np.float64))
            else:
                fixed = 1
            if q is None:
                rows.append(fixed)
                scored.append(None)
            else:
                q = (c if _drafter_scored(a) else 1.0) * np.asarray(q, np.float64)
                rows.append(rows_paid(q, a.block_len, bar))
                scored.append(q)
        if len(acts) > 1:
            rows = fit_grid(rows, scored, bar)
        return rows, scored

    def _bar(self, b: int) -> float:
        # λ is at least what a plain batched step yields (b tokens for 1 + a(b - 1)): a batch that has just grown,
        # or a run that has just started, would otherwise judge rows against a stale lower rate.
        return max(self.rate, b / (1.0 + self.a * (b - 1))) * self.a


def _drafter_scored(a: _Active) -> bool:
    """Whether a sequence's chances of acceptance this step came from the drafter's confidences (a chain, or a tree
    or best path grown with its slots), which c calibrates; the context's branches alone are scored by their own
    running acceptance rates (decoding/tree.LookupStats), calibrated already."""
    if a.spine_scores is None:
        return True
    if a.tree is not None:
        return bool(a.tree[1])
    return a.spine is None or bool(a.spine[2])


def rows_paid(scored: np.ndarray, top: int, bar: float) -> int:
    """The rows one sequence verifies: row k (k >= 1 drafts deep) is added while its chance of being accepted
    (`scored[k - 1]`) reaches `bar` (= λ a: what one more row of the call costs at the batch's rate); at most `top`.
    The call takes its sequences' rows packed, so one sequence's rows cost the others nothing."""
    k = 1
    while k < top and k <= len(scored) and scored[k - 1] > 0 and scored[k - 1] >= bar:
        k += 1
    return k


def fit_grid(rows: list[int], scored: list[np.ndarray | None], bar: float) -> list[int]:
    """Each sequence's rows capped at the grid length S that pays: attention runs every sequence at the longest
    block's rows, so the sequences reaching row S must pay, beyond their own rows, for the padding cells they make
    the others take -- their chances at row S over the bar must sum to bar x GRID_PAD_COST per shorter sequence.
    Sequences whose rows are not scored keep theirs, and S never falls below them."""
    floor = max([n for n, q in zip(rows, scored) if q is None], default=1)
    s = max(rows)
    while s > floor:
        surplus = sum(q[s - 2] - bar for n, q in zip(rows, scored) if q is not None and n >= s)
        if surplus >= bar * GRID_PAD_COST * sum(n < s for n in rows):
            break
        s -= 1
    return [n if q is None else min(n, s) for n, q in zip(rows, scored)]


def expected_gain(scored: list[np.ndarray | None], rows: list[int]) -> float:
    """Drafts expected accepted when every scored sequence verifies its rows (the sum of their chances)."""
    return float(sum(np.sum(q[: n - 1]) for q, n in zip(scored, rows) if q is not None))


def step_rate(b: int, gain: float, draft_cost: float, a: float, rows: list[int], trees: int, tree_cost: float
              ) -> float:
    """Expected tokens per modelled cost of a step of B sequences verifying `rows` (each sequence's), R in all,
    expecting `gain` accepted drafts, `trees` of them verifying a tree:
    (B + gain) / (draft + 1 + a (R - 1) + a GRID_PAD_COST (B S - R) + tree_cost * trees), S = the longest."""
    r = sum(rows)
    pad = len(rows) * max(rows) - r
    return (b + gain) / (draft_cost + 1.0 + a * (r - 1) + a * GRID_PAD_COST * pad + tree_cost * trees)


def _first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first `n` nodes (a tree: every parent comes before its children)."""
    if n >= len(tree):
        return tree
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.sources[:n], tree.scores[:n],
                     tree.origins[:n], tree.matches[:n], tree.draft_q[:n])


class BatchingService:
    """A `BatchingRuntime` shared by many threads: one scheduler thread steps it while requests are active, callers
    submit and consume their own events. Duck-types what `deploy.handler.RequestRunner` reads from a DFlashRuntime
    (`engine`, `encode`, `check_request`, `stream`), so the Triton model can hand every request to one batch.

    A consumer that stops iterating `stream` (its client went away: RequestRunner stops between steps) cancels its
    request; the slot is freed at the next step boundary. An engine failure ends every active request with it.

    The scheduler holds the service's lock only to sleep while idle, never across a step: a lock held through every
    step and retaken at once would starve the submitting threads (Python's locks are not fair), and new requests would
    wait for the running ones to finish instead of joining the next step.
    """

    def __init__(self, engine, max_batch: int = 8, max_queued_tokens: int = 65536, on_resize=None,
                 idle_release_s: float = 5.0, **runtime_kwargs):
        """`on_resize(bytes, slots, capacity)`: called whenever the batch's K/V buffers are reallocated or released.
        The buffers stay allocated between requests and are freed once the batch has been idle `idle_release_s`."""
        self.runtime = BatchingRuntime(engine, max_batch, max_queued_tokens, **runtime_kwargs)
        # The batched-verify graph (a second copy of the target's weights) is loaded now, not at the first step that
        # verifies several sequences: a served model's memory is all there once it reports ready, and no request
        # pays for the load.
        self.runtime.batch.preload()
        self.on_resize = on_resize
        self.idle_release_s = idle_release_s
        self._configure(self.runtime.batch)
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="dflash-batching", daemon=True)
        self._thread.start()

    def encode(self, prompt, chat: bool = True) -> list[int]:
        return self.engine.codec.encode_prompt(prompt, chat)

    def check_request(self, prompt_ids, sp: SamplingParams) -> None:
        check_request(self.runtime.info, prompt_ids, sp)

    # A caller's `cancelled()` is asked this often while its request waits to join the batch.
    QUEUED_POLL_S = 0.05
    polls_cancel_while_queued = True  # what deploy.handler.RequestRunner looks for
    stops_between_steps = True  # `stream` takes `stopped`, asked by the batch's own thread (RequestRunner)

    def stream(self, prompt_ids, sp: SamplingParams, mode: str = "dflash", stats: RunStats | None = None,
               cancelled=None, stopped=None):
        """Yield the request's StepEvents as the shared batch commits them; the last has finished=True.

        `cancelled()` (optional): asked every QUEUED_POLL_S while the request still waits to join the batch; when it
        answers (anything but None) the request leaves the queue and the stream ends without a finished event, so a
        client that went away costs no prefill. Once the request has joined, the caller checks between events, and
        `stopped()` (optional, cheap: it runs on the batch's thread) is asked before each step of the batch: True
        drops the request there and the stream raises RequestStopped, however many events the caller has yet to
        read."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            if self._closed:
                raise DFlashError("the batching service is closed", field="model")
            req = self.runtime.submit(prompt_ids, sp, mode, on_event=events.put, stats=stats, stop=stopped)
            self._work.notify()
        try:
            while True:
                if cancelled is not None and not req.joined:
                    try:
                        ev = events.get(timeout=self.QUEUED_POLL_S)
                    except queue.Empty:
                        if not req.joined and cancelled() is not None:
                            return
                        continue
                else:
                    ev = events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finished:
                    return
        finally:
            if not req.done:
                with self._lock:
                    self.runtime.cancel(req)

    def _configure(self, batch: BatchedEngine) -> None:
        batch.on_resize = self.on_resize
        batch.keep_buffers = True

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and self.runtime.idle:
                    if not self._work.wait(timeout=self.idle_release_s):
                        self.runtime.batch.release()  # idle for a while: give the K/V memory back
                if self._closed:
                    return
            try:
                self.runtime.step()
            except Exception as e:  # noqa: BLE001 - every waiting consumer gets the failure, the loop goes on
                self._fail_all(e)

    def _fail_all(self, exc: BaseException) -> None:
        rt = self.runtime
        for act in list(rt.active):
            act.req.done = True
            if act.req.on_event is not None:
                act.req.on_event(exc)
            try:
                rt.batch.remove(act.seq)
            except DFlashError:
                pass
        rt.active.clear()
        for req in rt.take_queue():
            req.done = True
            if req.on_event is not None:
                req.on_event(exc)
        rt.batch = rt.new_batch(self.engine, rt.batch.max_batch)  # a fresh, empty batch
        self._configure(rt.batch)
        if self.on_resize is not None:
            self.on_resize(0, 0, 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._work.notify()
        self._thread.join(timeout=10)
