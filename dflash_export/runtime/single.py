"""The backend-agnostic DFlash loop over a built engine: prefill, draft, verify (fused accept + commit), repeat.

Streams tokens as they are committed. Consumes randomness exactly as `runtime/reference.py` does (numpy PCG64 seeded
per request: one uniform for the first token, then bs-1 for drafting and bs for verifying per step), so a seeded
sampled run on an engine is comparable with the PyTorch reference. Imports neither torch nor onnxruntime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from dflash_export.decoding.acceptance import Walk
from dflash_export.decoding.options import resolve_options
from dflash_export.decoding.sampling import probs_from_logits, sample_from, tempered, verify_length
from dflash_export.decoding.tree import (
    SOURCE_NAMES,
    DraftCalibration,
    DrafterGate,
    DraftTree,
    LookupStats,
    TreeState,
    accepted_by_source,
    chain,
    source_stats,
)
from dflash_export.engines.base import Engine, EngineInfo, SamplingParams
from dflash_export.engines.numerics import walks_whole_trees
from dflash_export.errors import DFlashError
from dflash_export.runtime.costs import StepCosts, engine_costs, records_costs


@dataclass
class StepEvent:
    """Tokens committed by one target forward (prefill or one DFlash/AR step)."""

    tokens: list[int]
    accept_len: int | None = None   # accepted drafts in this step (None for prefill / AR)
    finished: bool = False
    finish_reason: str | None = None


class RequestStopped(Exception):
    """What a request's consumer gets from a shared batch's event stream when the batch dropped the request because
    its stop check said so (runtime/batching.py `Request.stop`; the consumer then asks why it was cancelled)."""


@dataclass
class RunStats:
    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"
    prompt_tokens: int = 0
    drafted_tokens: int = 0
    draft_s: float = 0.0    # time in the drafter (and the proposal around it)
    verify_s: float = 0.0   # time in target passes after the prefill (verifications and plain steps)
    # Behind a shared batch (runtime/batching.py): seconds queued before joining it (its prefill), and the batch's K/V
    # token bound (0: none). A request run alone has neither.
    admission_wait_s: float = 0.0
    kv_token_limit: int = 0
    # Accepted drafts per source (decoding/tree.SOURCE_NAMES: drafter, context, static): proposed by it (a draft
    # two sources proposed counts for both), and proposed by it alone (what it added beyond the others).
    accepted_by: dict = field(default_factory=lambda: dict.fromkeys(SOURCE_NAMES.values(), 0))
    accepted_only: dict = field(default_factory=lambda: dict.fromkeys(SOURCE_NAMES.values(), 0))

    @property
    def tau(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 1.0

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / max(1, len(self.tokens) - 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def accepted_tokens(self) -> int:
        """Drafted tokens the target accepted (bonus tokens excluded)."""
        return sum(self.acceptance_lengths) - len(self.acceptance_lengths)


GREEDY = SamplingParams(temperature=0.0)  # what a walked step drafts with: the drafter's argmax and logits


def _pick(logits: np.ndarray, sp: SamplingParams, rng) -> int:
    if sp.greedy:
        return int(np.argmax(logits))
    return sample_from(probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p), rng.random())


class _Emitter:
    """One request's committed tokens: new tokens cut at a stop token or at max_new_tokens, recorded in its stats."""

    def __init__(self, sp: SamplingParams, stop_ids: set[int], stats: RunStats, t0: float):
        self.sp, self.stop_ids, self.stats, self.t0 = sp, stop_ids, stats, t0
        self.produced = 0

    def __call__(self, new: list[int], accept: int | None) -> StepEvent:
        out = []
        reason = None
        for t in new:
            out.append(t)
            self.produced += 1
            if t in self.stop_ids:
                reason = "stop"
                break
            if self.produced >= self.sp.max_new_tokens:
                reason = "length"
                break
        self.stats.tokens.extend(out)
        if reason:
            self.stats.finish_reason = reason
            self.stats.total_s = time.perf_counter() - self.t0
        return StepEvent(out, accept, reason is not None, reason)


def count_sources(stats: RunStats, tree: DraftTree, path: list[int]) -> None:
    """Add the drafts on `path` (the committed part of a step's accepted path) to `stats`' per-source counts."""
    by, only = accepted_by_source(tree, path)
    for name in by:
        stats.accepted_by[name] += by[name]
        stats.accepted_only[name] += only[name]


def count_drafter_block(stats: RunStats, kept: int) -> None:
    """Add `kept` committed drafts of a step that verified the drafter's own block (drafts no other source proposed)
    to `stats`' per-source counts: the drafter's, both proposed by it and by it alone."""
    name = SOURCE_NAMES["drafter"]
    stats.accepted_by[name] += kept
    stats.accepted_only[name] += kept


def check_request(info: EngineInfo, prompt_ids, sp: SamplingParams) -> None:
    """The one check of a request against an engine (single stream and batching alike): a DFlashError naming the
    request field otherwise. `sp` was checked when it was made (decoding/request.py); what is left depends on the
    engine."""
    if len(prompt_ids) == 0:
        raise DFlashError("empty prompt", field="text_input")
    # Room for the prompt, the new tokens and one speculative block beyond them.
    need = len(prompt_ids) + sp.max_new_tokens + info.block_size
    if need > info.max_seq_len:
        raise DFlashError(f"prompt ({len(prompt_ids)} tokens) + {sp.max_new_tokens} new tokens + block "
                          f"({info.block_size}) exceeds the engine's max_seq_len {info.max_seq_len}",
                          field="max_tokens" if len(prompt_ids) + info.block_size < info.max_seq_len
                          else "text_input")
    if any(not 0 <= int(t) < info.vocab_size for t in prompt_ids):
        raise DFlashError("token id outside the vocabulary", field="input_ids")


class DFlashRuntime:
    """Drives an `Engine`. `mode="dflash"` speculates with the drafter; `mode="ar"` decodes one token per forward
    on the same engine (the fair baseline).

    Adaptive verification (greedy, on backends that report draft confidences): a verify pass costs about
    1 + `verify_token_cost` * (drafts verified) plain steps (measured by benchmarks/engine_costs.py: 0.07 for SmolLM2
    on ORT, 2 cores), and draft k is accepted with probability ~ q_k = prod of the drafter's top probabilities up to k.
    Verifying draft k pays off while q_k >= λ * verify_token_cost, λ being the decoding rate in tokens per plain-step
    cost (tracked online) -- the marginal rule that maximizes tokens per unit of time. Drafts past the request's
    remaining tokens are never verified either. Greedy output is unchanged: a shorter block only ends the accepted
    prefix earlier and the bonus token is the target's argmax there, as it would have been. Sampling keeps full blocks
    so its random stream matches the reference's draw for draw.

    The costs are the engine's recorded ones (`runtime.costs.engine_costs`) until this runtime has timed enough of its
    own target calls and drafter passes, then what this machine measures now (`runtime.costs.StepCosts`, carried from
    request to request); a caller that gives either cost fixes both (`fit_costs` says otherwise).

    Draft back-off (same conditions, on engines that `accumulates_context`): a draft of which nothing was accepted
    cost `draft_cost` for no token, and hard stretches of text come in runs. After n such drafts in a row the next
    2^n - 1 steps (at most `max_skip`) are plain one-token verifies that leave their context features pending; the
    next draft reads them all. One accepted draft resets n. Beside it, a greedy chain drafts only while its accepted
    drafts pay for the pass and the rows verified (decoding/tree.DrafterGate, the rule tree steps use). Greedy output
    is unchanged (every step is the target's).
    """

    def __init__(self, engine: Engine, adaptive: bool = True, verify_token_cost: float | None = None,
                 draft_cost: float | None = None, max_skip: int = 7, full_last_block: bool = False,
                 proposer: str | None = None, tree_top_k: int | None = None, tree_nodes: int | None = None,
                 tree_mode: str | None = None, sampling: str | None = None, static_ngrams: bool | None = None,
                 fit_costs: bool | None = None, sampled_tree_mode: str | None = None):
        # Unset: what the engine's recipe says (manifest `decoding`), else DecodingOptions' defaults; checked once.
        self.options = resolve_options(getattr(engine.info, "decoding", None), proposer=proposer,
                                       tree_top_k=tree_top_k, tree_nodes=tree_nodes, tree_mode=tree_mode,
                                       sampling=sampling, static_ngrams=static_ngrams,
                                       sampled_tree_mode=sampled_tree_mode)
        if self.options.tree_mode == "full" and self.options.proposer != "chain" \
                and getattr(engine, "linear_layers", None):
            raise DFlashError("full draft trees are not verified on hybrid targets (each node would need its "
                              "ancestors' Gated DeltaNet state): use tree_mode spine", field="tree_mode")
        self.engine = engine
        # What a step proposes (decoding/options.py): the drafter's chain, a tree grown from its per-slot
        # distributions (top `tree_top_k` per depth), context lookups, or a tree holding both; at most `tree_nodes`
        # drafted nodes, fewer when the cost model says they do not pay. `tree_mode` "spine" verifies the tree's
        # best path as a chain (rows bit-identical to plain steps where the numerics probe says chains are);
        # "full" verifies every node in one pass (engines with tree inputs; a node off the first path attends past
        # masked keys, which rounds differently from a plain step: lossless within kernel numerics, see
        # engines/numerics.py). Sampling (T > 0) walks the proposal with the target's own draws ("walk", engines
        # that accept on the host; its tree verified as `sampled_tree_mode` says, whole by default where the engine
        # verifies trees close enough to plain steps) or drafts the drafter's sampled chain ("chain", the
        # reference's stream).
        self.proposal = self.options.proposer_for()
        self.proposer, self.tree_top_k = self.options.proposer, self.options.tree_top_k
        self.tree_nodes, self.tree_mode = self.options.tree_nodes, self.options.tree_mode
        # Walked sampled steps verify whole trees only where the engine's numerics probe found tree rows within
        # TREE_WALK_ATOL of plain steps on a float target, or bit-identical (engines/numerics.walks_whole_trees),
        # else best paths.
        self.sampled_tree_mode = self.options.sampled_tree_mode if walks_whole_trees(engine) else "spine"
        # z-lab shortens a request's last block to what it still needs; engines with fixed block shapes cannot, and
        # `full_last_block` makes any engine match them draw for draw (same tokens either way when greedy).
        self.full_last_block = full_last_block or getattr(engine, "fixed_block", False)
        self.adaptive = adaptive
        self.verify_token_cost, self.draft_cost = engine_costs(engine, verify_token_cost, draft_cost)
        # This machine's costs, fitted from the calls the adaptive rules make anyway, for engines that record none
        # (the fallback above is another machine's); recorded and given costs stay fixed unless `fit_costs`. On the
        # int4 engine the fitted row cost (0.17-0.19 against the recorded 0.25) made the rules verify lookup rows
        # that did not pay (16 held-out prompts x 64: 1.15x plain against 1.19x): their chances run high there.
        if fit_costs is None:
            fit_costs = verify_token_cost is None and draft_cost is None and not records_costs(engine)
        self.costs = StepCosts(self.verify_token_cost, self.draft_cost) if fit_costs and adaptive else None
        self.max_skip = max_skip
        # The engine's static n-gram index of the target's past answers (decoding/static_ngrams.py), merged into
        # trees and lookups while `static_ngrams` is on; asking for it on an engine built without one is an error.
        index = getattr(engine.info, "static_index", None)
        if static_ngrams and index is None:
            if getattr(engine, "fixed_block", False):  # TensorRT: no build of a fixed-block engine makes one
                raise DFlashError("this engine verifies fixed blocks of the drafter's chain (no lookups), so it holds "
                                  "no static n-gram index: build --backend onnxruntime with decoding.static_ngrams "
                                  "true runs one", field="static_ngrams")
            raise DFlashError("this engine holds no static n-gram index: build it with decoding.static_ngrams true",
                              field="static_ngrams")
        self.static_index = index if self.options.static_ngrams else None
        # Where the last request left the drafter's gates (decoding/tree.DrafterGate), the next request's start: tree
        # steps ("tree", greedy?) and greedy chains ("chain", True)
        self._drafter_means: dict[tuple, dict] = {}
        # Lookup and static-index acceptance per depth, learned over every request of this runtime (greedy and
        # sampled apart), as the batching runtime learns them over its batch: one request of a few dozen tokens
        # would score its lookups by the prior alone.
        self._lookups: dict[bool, tuple[LookupStats, LookupStats]] = {}
        self._calibration = DraftCalibration()

    def _lookup_stats(self, greedy: bool, depth: int) -> tuple[LookupStats, LookupStats]:
        if greedy not in self._lookups:
            self._lookups[greedy] = source_stats(depth)
        return self._lookups[greedy]

    def walks(self, sp: SamplingParams) -> bool:
        """Whether a sampled request walks its proposals with the target's own draws (decoding/acceptance.py)."""
        return (not sp.greedy and self.options.sampling == "walk" and getattr(self.engine, "host_accept", False)
                and not self.full_last_block)

    def describe(self, temperature: float = 0.0) -> str:
        """What a DFlash step of this runtime proposes, in a few words (run's and the demo's summary line)."""
        if self.proposer != "chain" and self.full_last_block:
            return "chain (this engine verifies fixed blocks: no trees or lookups)"
        sampled = temperature > 0
        if sampled and not self.walks(SamplingParams(temperature=temperature)):
            return "chain" + (" (sampling drafts the drafter's chain)" if self.proposer != "chain" else "")
        if self.proposer == "chain":
            return "chain" + (" (sampled: the target's draws walk it)" if sampled else "")
        tree = f"K {self.tree_top_k}, <= {self.tree_nodes} nodes" if "tree" in self.proposer else \
            f"<= {self.tree_nodes} nodes"
        if sampled:
            return f"{self.proposer} ({tree}, sampled: walked, {self.sampled_tree_mode})"
        return f"{self.proposer} ({tree}, {self.tree_mode})"

    def tau_counts(self, temperature: float = 0.0) -> str:
        """What a τ of this runtime counted, for every line that prints one. τ is tokens committed per target verify
        pass (the accepted drafts + the target's own token; plain decoding: 1); it depends on what was drafted (the
        drafter's chain, or the recipe's tree+lookup) and on whether the cost model cut drafts (adaptive)."""
        recorded = resolve_options(getattr(self.engine.info, "decoding", None))
        walk = self.walks(SamplingParams(temperature=temperature))
        chain = (temperature > 0 and not walk) or self.proposer == "chain" or self.full_last_block
        what = "drafter chain" if chain else self.proposer
        if not chain and (self.proposer, self.tree_mode) == (recorded.proposer, recorded.tree_mode):
            what += " (the recipe's default decoding)"
        if walk:
            what += ", sampled by walking it"
        cut = self.adaptive and (temperature == 0 or walk) and not self.full_last_block
        return what + ("; adaptive: drafts verified while they pay" if cut else "; every draft verified")

    def check_request(self, prompt_ids, sp: SamplingParams) -> None:
        check_request(self.engine.info, prompt_ids, sp)

    def stream(self, prompt_ids, sp: SamplingParams, mode: str = "dflash", stats: RunStats | None = None
               ) -> Iterator[StepEvent]:
        """Yield committed tokens step by step; the last event has finished=True. Fills `stats` when given."""
        eng, info = self.engine, self.engine.info
        self.check_request(prompt_ids, sp)
        stats = stats if stats is not None else RunStats()
        stats.prompt_tokens = len(prompt_ids)
        stop_ids = set(info.stop_token_ids if sp.stop_token_ids is None else sp.stop_token_ids)
        rng = np.random.default_rng(sp.seed)
        bs = info.block_size
        seq = eng.new_sequence(len(prompt_ids) + sp.max_new_tokens + bs)
        t0 = time.perf_counter()
        logits = eng.prefill(seq, np.asarray(prompt_ids, dtype=np.int64))
        last = _pick(logits, sp, rng)
        stats.ttft_s = time.perf_counter() - t0
        emit = _Emitter(sp, stop_ids, stats, t0)
        ev = emit([last], None)
        yield ev
        if ev.finished:
            return
        rate = 1.0  # λ: tokens per plain-step cost, for adaptive verification
        misses = skip = 0  # draft back-off: fruitless drafts in a row, plain steps still to take
        walk = self.walks(sp)
        backoff = sp.greedy and self.adaptive and eng.accumulates_context
        # Greedy trees and lookups, and every sampled step that walks (the chain too): one tree step each.
        trees = mode == "dflash" and not self.full_last_block and (
            walk or (sp.greedy and not self.proposal.chain_only))
        if trees:
            # the drafter's running means start where the last request's ended (greedy and sampled apart: a
            # sampled step's drafts are accepted less often); sampled steps score the drafter's nodes by its
            # calibration, learned over this runtime's walks (decoding/tree.DraftCalibration)
            state = TreeState(list(prompt_ids) + [last], 2 * bs, self.static_index,
                              self._drafter_means.get(("tree", sp.greedy)), self._lookup_stats(sp.greedy, 2 * bs),
                              None if sp.greedy else self._calibration)
        # Greedy chains: the same rule decides whether the drafter's block pays (its drafts are all its own)
        gate = DrafterGate(self._drafter_means.get(("chain", True))) \
            if mode == "dflash" and not trees and backoff else None
        while True:
            if trees:
                accept, emitted, n_draft, drafted, (tree, path) = self._tree_step(
                    seq, last, sp, bs, rate, emit.produced, state, stats, rng if walk else None)
                stats.drafted_tokens += n_draft
                cost = (self.draft_cost if drafted else 0.0) + 1.0 + self.verify_token_cost * n_draft
                rate = 0.9 * rate + 0.1 * (accept + 1) / cost
                # Tree steps, greedy and walked, weigh the drafter by what it adds against its pass and rows
                # (TreeState.drafter_pays), never by back-off: backing off cost greedy trees τ, and walked ones,
                # whose drafts go unaccepted one step in two however good they are, most of their drafter's gain
                # (8 held-out prompts x 128 at T 0.7: 1.08x plain sampling with back-off, 1.11x without).
                last = emitted[-1]
                ev = emit(emitted, accept)
                count_sources(stats, tree, path[:1 + min(accept, len(ev.tokens))])  # drafts committed
                state.context.extend(ev.tokens)
                self._drafter_means[("tree", sp.greedy)] = state.drafter_means()
                stats.acceptance_lengths.append(len(ev.tokens))
            elif mode == "ar":
                t = time.perf_counter()
                logits = eng.decode(seq, last, greedy=sp.greedy)
                stats.verify_s += time.perf_counter() - t
                last = _pick(logits, sp, rng)
                stats.acceptance_lengths.append(1)
                ev = emit([last], 0)
            elif skip > 0 or (gate is not None and not gate.pays(rate, self.draft_cost, self.verify_token_cost)):
                # back-off, or a drafter that does not pay: a plain step whose context features stay pending for the
                # next draft
                skip = max(0, skip - 1)
                t = time.perf_counter()
                _, emitted = eng.verify(seq, np.array([last], np.int64), None, sp, None)
                t = time.perf_counter() - t
                stats.verify_s += t
                self._timed(1, t)
                rate = 0.9 * rate + 0.1  # one token for one step's cost
                last = emitted[-1]
                ev = emit(emitted, 0)
                stats.acceptance_lengths.append(len(ev.tokens))
            else:
                accept, emitted, n_draft = self._draft_and_verify(seq, last, sp, rng, bs, rate, emit.produced, stats)
                stats.drafted_tokens += n_draft
                cost = self.draft_cost + 1.0 + self.verify_token_cost * n_draft
                rate = 0.9 * rate + 0.1 * (accept + 1) / cost
                if backoff:
                    misses = misses + 1 if accept == 0 else 0
                    skip = min(self.max_skip, (1 << misses) - 1)
                if gate is not None:
                    gate.record(accept, n_draft)
                    self._drafter_means[("chain", True)] = gate.state()
                last = emitted[-1]
                ev = emit(emitted, accept)
                stats.acceptance_lengths.append(len(ev.tokens))  # committed: cut at max_new_tokens / a stop
                count_drafter_block(stats, min(accept, len(ev.tokens)))
            yield ev
            if ev.finished:
                return

    def _draft_and_verify(self, seq, last: int, sp: SamplingParams, rng, bs: int, rate: float,
                          produced: int, stats: RunStats | None = None) -> tuple[int, list[int], int]:
        """One DFlash step after `produced` tokens: draft a block from `last`, verify its drafts (as many as pay, when
        adaptive) with the target. Returns (drafts accepted, tokens emitted, drafts verified)."""
        eng = self.engine
        u_draft = None if sp.greedy else rng.random(bs - 1)
        seq.draft_confidence = None
        # The last block holds no more slots than tokens are still owed (+1), as z-lab's release does.
        block_len = bs if self.full_last_block else min(bs, sp.max_new_tokens - produced + 1)
        t0 = time.perf_counter()
        draft, draft_probs = eng.draft(seq, last, sp, u_draft, block_len=block_len)
        t1 = time.perf_counter()
        n_draft = block_len - 1
        if sp.greedy and self.adaptive and seq.draft_confidence is not None:
            n_draft = min(verify_length(seq.draft_confidence, rate * self.verify_token_cost),
                          sp.max_new_tokens - produced - 1)
        block = np.empty(n_draft + 1, dtype=np.int64)
        block[0], block[1:] = last, draft[:n_draft]
        t2 = time.perf_counter()
        accept, emitted = eng.verify(seq, block, draft_probs, sp, None if sp.greedy else rng.random(bs))
        t3 = time.perf_counter()
        if self.costs is not None:
            self.costs.draft_pass(t1 - t0)
        self._timed(len(block), t3 - t2)
        if stats is not None:
            stats.draft_s += t1 - t0
            stats.verify_s += t3 - t1
        return accept, emitted, n_draft

    def _timed(self, rows: int, seconds: float) -> None:
        """A target call of `rows` rows took `seconds`: this machine's costs, when the runtime fits them."""
        if self.costs is not None:
            self.costs.target_call(rows, seconds)
            self.verify_token_cost, self.draft_cost = self.costs.current()

    def _tree_step(self, seq, last: int, sp: SamplingParams, bs: int, rate: float, produced: int,
                   state: TreeState, stats: RunStats | None = None, rng=None
                   ) -> tuple[int, list[int], int, bool, tuple[DraftTree, list[int]]]:
        """One step with a draft tree (decoding/): grow it from the context's lookup branches and the drafter's
        slots (when its pass pays), verify it -- its best path as a chain, or every node in one pass -- and accept
        greedily, or, with `rng` (a sampled request that walks), with the target's own draws from the request's
        stream (decoding/acceptance.walk_accept). Returns (drafts accepted, tokens emitted, nodes verified, whether
        the drafter ran, (the tree, its accepted path))."""
        eng, info, proposal = self.engine, self.engine.info, self.proposal
        t0 = time.perf_counter()
        # Depth: a block's slots for the drafter; lookup branches may run deeper, up to the rows the engine's
        # numerics probe checked; never more than the request still owes. Nodes: the budget and the engine's room.
        owed = sp.max_new_tokens - produced - 1
        numerics = getattr(eng, "numerics", None)
        max_rows = numerics.max_rows if numerics is not None and numerics.max_rows else bs
        depth = min(bs - 1, owed)
        room = min(info.max_seq_len - seq.length - 1, max_rows - 1)
        found = state.context.branches(min(max_rows - 1, owed), with_sizes=True) \
            if proposal.lookups and owed > 0 else []
        lookups, sizes = [b for _, b in found], [n for n, _ in found]
        static = state.static.branches(state.context.tokens, min(max_rows - 1, owed)) \
            if state.static is not None and owed > 0 else []
        logprobs, drafted, drafts = None, False, None
        if proposal.drafter and depth > 0 and (
                not self.adaptive or state.drafter_pays(bool(lookups), rate, self.draft_cost, self.verify_token_cost)):
            seq.draft_logits = None
            # The drafter's argmax / top-K, never a draw: a walked proposal must not consume the request's stream.
            t = time.perf_counter()
            drafts, _ = eng.draft(seq, last, sp if sp.greedy else GREEDY, None, block_len=depth + 1)
            if self.costs is not None:
                self.costs.draft_pass(time.perf_counter() - t)
            drafted = True
            if seq.draft_logits is not None:  # build_tree normalizes the top-K it keeps per slot
                logprobs = seq.draft_logits[:depth]
                if not sp.greedy:  # scores = the tempered chance each draft is the target's draw
                    logprobs = tempered(logprobs, sp.temperature)
        min_score = rate * self.verify_token_cost if self.adaptive else 0.0
        # a drafter without logits (DFlash 2's selector), nothing else proposed: its block
        if drafted and logprobs is None and not lookups and not static:
            tree = chain(last, drafts[:depth])
        else:
            tree = proposal.propose(last, logprobs, lookups, max_nodes=min(self.tree_nodes, room),
                                    min_score=min_score, lookup_scores=state.lookups.score, static=static,
                                    static_scores=state.static_stats.score, lookup_sizes=sizes,
                                    draft_scale=state.draft_scale())
        t1 = time.perf_counter()

        def accept_with(t):
            return None if rng is None else Walk(t, sp.temperature, sp.top_k, sp.top_p, rng.random)

        mode = self.tree_mode if rng is None else self.sampled_tree_mode
        if tree.is_chain or mode == "spine" or not getattr(eng, "tree_verify", False):
            spine = tree.best_chain()  # the chain kernel path: one row for no drafts, the block otherwise
            block = np.asarray([tree.tokens[i] for i in spine], np.int64)
            walked = accept_with(chain(block[0], block[1:]))
            if walked is None:
                accept, emitted = eng.verify(seq, block, None, sp, None)
            else:
                accept, emitted = eng.verify(seq, block, None, sp, None, accept=walked)
            path, checked = spine[:accept + 1], set(spine)
        else:
            walked = accept_with(tree)
            if walked is None:
                accept, emitted, path = eng.verify_tree(seq, tree)
            else:
                accept, emitted, path = eng.verify_tree(seq, tree, accept=walked)
            checked = set(range(len(tree)))
        t2 = time.perf_counter()
        self._timed(len(checked), t2 - t1)
        if stats is not None:
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
        state.record(tree, path, checked, drafted, bool(lookups))
        return accept, emitted, len(checked) - 1, drafted, (tree, path)

    def generate(self, prompt_ids, sp: SamplingParams, mode: str = "dflash") -> RunStats:
        stats = RunStats()
        for _ in self.stream(prompt_ids, sp, mode, stats):
            pass
        return stats

    # Text-level helpers ----------------------------------------------------------------------------------------------

    def encode(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        return self.engine.codec.encode_prompt(prompt, chat)

    def stream_text(self, prompt: str | list[dict], sp: SamplingParams, mode: str = "dflash", chat: bool = True,
                    stats: RunStats | None = None) -> Iterator[str]:
        """Yield text deltas; decodes the whole output each time so multi-byte tokens never split characters."""
        ids = self.encode(prompt, chat)
        codec = self.engine.codec
        done: list[int] = []
        shown = ""
        for ev in self.stream(ids, sp, mode, stats):
            done.extend(ev.tokens)
            text = codec.decode(done)
            if ev.finish_reason == "length" and len(text.rstrip("\ufffd")) >= len(shown):
                text = text.rstrip("\ufffd")  # cut mid-character by max_new_tokens: its incomplete tail never shows
            if ev.finished or not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
