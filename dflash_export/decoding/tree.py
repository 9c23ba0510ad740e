"""Draft trees: what one DFlash step proposes when it proposes more than one chain (written here: no library does it).

A tree is prefix-closed: node 0 is the root (the anchor, the last committed token, not yet in the target's cache);
every other node is one drafted token whose parent comes before it, so nodes are in topological order and a target
pass over them with an ancestor-only mask is causal too. The target verifies every node in one pass, at position
committed length + depth; greedy acceptance walks from the root to the child holding the target's argmax, as far as
one exists, and emits that path plus the target's next token -- exactly the tokens plain decoding would produce.

Where the nodes come from (`build_tree`):
- the drafter: DFlash fills a whole block in one pass, so slot d gives a distribution over the token at depth d
  (a marginal: one pass, no conditioning on the branch taken). Best-first by path probability (DDTree, arXiv
  2604.12989): children of a depth-d node are the top-K tokens of slot d+1, a node's score is the product of its
  path's draft probabilities;
- context lookups: the tokens that followed the latest earlier occurrence of the context's last n tokens (n = 4, 3,
  2: `prompt_lookup.lookup_proposal`), merged into the same trie, so a prefix shared with a drafter branch is verified
  once. A lookup node's score is the running rate at which lookup tokens at its depth were accepted;
- the target's own past answers (decoding/static_ngrams.py): the continuation those answers most often gave the
  context's last n tokens, merged the same way, scored by the static source's own running acceptance per depth.
A node joins the tree while its score pays for its verification (score >= `min_score`: the runtime's cost model
passes λ x verify cost per node) and the node budget lasts; scores fall along every path, so the tree stays
prefix-closed. A chain is the tree with K = 1 and no lookup: the drafts in order, as far as their cumulative
confidence pays -- the rule `sampling.verify_length` applies to chains.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from dflash_export.decoding.prompt_lookup import TREE_NGRAM_SIZES, ContextIndex


@dataclass
class DraftTree:
    """tokens[0] is the root (anchor); parents[0] = -1; parents[i] < i; depths[i] = depths[parents[i]] + 1."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[str] = field(default_factory=list)  # per node: "root", "drafter", "lookup", "both" or "static"
    scores: list[float] = field(default_factory=list)  # per node: its estimated chance of acceptance (root 1)
    # per node: every source that proposed it ("drafter", "lookup" = the context, "static" = past answers)
    origins: list[set] = field(default_factory=list)
    # per node: the longest context n-gram match behind a lookup branch that proposed it (0: none, or not known)
    matches: list[int] = field(default_factory=list)
    # per node: the drafter's probability of its token in its slot (0: the drafter did not propose it), before any
    # calibration -- what DraftCalibration compares with the walk's acceptances
    draft_q: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def proposed_by(self, node: int) -> set:
        """The sources that proposed `node` ("drafter", "lookup", "static"; none for the root)."""
        if self.origins:
            return self.origins[node]
        return {"both": {"drafter", "lookup"}, "root": set()}.get(self.sources[node], {self.sources[node]})

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = np.zeros((n, n), bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask

    def best_chain(self) -> list[int]:
        """The root-to-leaf path with the most expected accepted drafts (the sum of its nodes' scores, each the
        chance that the path up to it is accepted): the one chain worth verifying when only one is."""
        expected = [0.0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            expected[i] = expected[self.parents[i]] + self.scores[i]
        return self.path(int(np.argmax(expected)))

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def chain(anchor: int, drafts) -> DraftTree:
    """The chain anchor, drafts[0], drafts[1], ... as a tree."""
    n = len(drafts)
    return DraftTree([int(anchor)] + [int(t) for t in drafts], list(range(-1, n)), list(range(n + 1)),
                     ["root"] + ["drafter"] * n, [1.0] * (n + 1), [set()] + [{"drafter"} for _ in range(n)])


def greedy_accept(tree: DraftTree, target_next: np.ndarray) -> tuple[list[int], list[int]]:
    """target_next [N]: the target's argmax after each node. Returns (accepted path node indices, root first;
    emitted tokens = the accepted drafts + the target's token after the last of them)."""
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, len(tree)):
        kids.setdefault(tree.parents[i], {}).setdefault(tree.tokens[i], i)  # first node wins a duplicate token
    path = [0]
    while True:
        nxt = kids.get(path[-1], {}).get(int(target_next[path[-1]]))
        if nxt is None:
            break
        path.append(nxt)
    return path, [tree.tokens[i] for i in path[1:]] + [int(target_next[path[-1]])]


def slot_candidates(logits: np.ndarray, top_k: int) -> list[list[tuple[int, float]]]:
    """Per slot of draft logits (or log-probabilities) [D, V]: its top-K (token, log-probability) in descending
    order, ties by token id. Normalizes only what it returns (one logsumexp per slot, in float32 as the logits)."""
    if logits is None or not len(logits):
        return []
    x = np.asarray(logits)
    k = min(top_k, x.shape[-1])
    part = _top_k_ids(x, k)
    peak = x.max(axis=-1, keepdims=True)
    norm = peak[:, 0].astype(np.float64) + np.log(np.exp(x - peak).sum(axis=-1, dtype=np.float64))
    out = []
    for d in range(len(x)):
        cand = part[d][np.lexsort((part[d], -x[d, part[d]]))]
        out.append([(int(t), float(x[d, t]) - float(norm[d])) for t in cand])
    return out


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """[D, k] ids of each row's k largest values, the lowest id first among equal values. For the few candidates a
    tree takes per slot, k passes of argmax (each masking what it found) cost ~0.05 ms on 7 x 16384 logits where an
    argpartition costs ~1 ms (a thirtieth of a SmolLM2 fp32 step). Logits with a value that is not finite (where
    masking with -inf cannot tell found from not) and larger k go by each row's k-th largest value instead."""
    if k > 8 or not np.isfinite(x).all():
        kth = -np.partition(-x, k - 1, axis=-1)[:, k - 1]
        ids = np.argpartition(-x, k - 1, axis=-1)[:, :k]  # rows whose values do not compare (NaN) keep these
        for d in range(len(x)):
            above, tied = np.flatnonzero(x[d] > kth[d]), np.flatnonzero(x[d] == kth[d])
            if len(above) < k <= len(above) + len(tied):
                ids[d] = np.concatenate([above, tied[:k - len(above)]])
        return ids
    y, rows = x.copy(), np.arange(len(x))
    ids = np.empty((len(x), k), np.int64)
    for j in range(k):
        ids[:, j] = y.argmax(axis=-1)
        y[rows, ids[:, j]] = -np.inf
    return ids


def build_tree(anchor: int, draft_logprobs: np.ndarray | None, lookups: list[list[int]], *, top_k: int,
               max_nodes: int, min_score: float = 0.0, lookup_scores=None, static: list[list[int]] = (),
               static_scores=None, lookup_sizes=(), draft_scale: float = 1.0) -> DraftTree:
    """A prefix-closed tree of at most `max_nodes` drafted nodes under `anchor`.

    draft_logprobs [D, V]: logits (or log-probabilities) of the drafter's slots 1..D, None for no drafter branch;
    `lookups`: token paths from the context (merged as trie paths); `top_k`: children per drafter node; `min_score`:
    the score a node needs to be verified; `lookup_scores(depth, size) -> float`: the chance a lookup node at that
    depth (1-based) is accepted, `size` the n-gram match that found its branch (`lookup_sizes`, parallel to
    `lookups`; 0 where not given) (default 1: lookups are always taken, budget permitting); `static`,
    `static_scores(depth)`: the same for the static index's continuations (decoding/static_ngrams.py).
    `draft_scale`: what the drafter's probabilities are multiplied by (each step's at most 1) to be a node's chance
    of acceptance (DraftCalibration.scale). Nodes are taken in descending score, drafter and lookup together; a token
    proposed by both keeps the higher."""
    tree = DraftTree([int(anchor)], [-1], [0], ["root"], [1.0], [set()], [0], [0.0])
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(parent: int, token: int, source: str, score: float, match: int = 0, q: float = 0.0) -> int:
        key = (parent, int(token))
        if key in index:
            node = index[key]
            tree.draft_q[node] = max(tree.draft_q[node], q)
            tree.matches[node] = max(tree.matches[node], match)
            tree.origins[node].add(source)
            if tree.sources[node] == "static":
                tree.sources[node] = source
            elif source != "static" and tree.sources[node] != source:
                tree.sources[node] = "both"
            tree.scores[node] = max(tree.scores[node], score)
            return node
        tree.tokens.append(int(token))
        tree.parents.append(parent)
        tree.depths.append(tree.depths[parent] + 1)
        tree.sources.append(source)
        tree.scores.append(score)
        tree.origins.append({source})
        tree.matches.append(match)
        tree.draft_q.append(q)
        index[key] = len(tree.tokens) - 1
        return index[key]

    # Candidates in one heap: (-score, tiebreak, kind, payload). Drafter nodes expand lazily (k-best enumeration over
    # per-slot top-K lists); lookup nodes are queued a path at a time, each after its parent was taken.
    heap: list = []
    order = 0
    top = slot_candidates(draft_logprobs, top_k) if draft_logprobs is not None and top_k > 0 else None
    if top and draft_scale != 1.0:  # (token, raw log-probability, calibrated log-probability of at most 0)
        shift = float(np.log(draft_scale))
        top = [[(t, lp, min(0.0, lp + shift)) for t, lp in slot] for slot in top]
    elif top:
        top = [[(t, lp, lp) for t, lp in slot] for slot in top]
    if top:
        # a drafter candidate: (parent node, depth of the child, rank among the slot's top-K, parent's log score)
        heapq.heappush(heap, (-float(np.exp(top[0][0][2])), order, "drafter", (0, 1, 0, 0.0)))
        order += 1
    lookup_scores = lookup_scores or (lambda depth, size=0: 1.0)
    sizes = list(lookup_sizes) + [0] * (len(lookups) - len(lookup_sizes))
    for path, size in zip(lookups, sizes):
        if path:
            heapq.heappush(heap, (-lookup_scores(1, size), order, "lookup", (0, list(path), 1, size)))
            order += 1
    static_scores = static_scores or (lambda depth: 1.0)
    for path in static:
        if path:
            heapq.heappush(heap, (-static_scores(1), order, "static", (0, list(path), 1, 0)))
            order += 1
    drafted = 0
    while heap and drafted < max_nodes:
        neg, _, kind, payload = heapq.heappop(heap)
        if -neg < min_score:
            break
        if kind == "drafter":
            parent, depth, rank, base = payload
            token, raw, lp = top[depth - 1][rank]
            before = len(tree.tokens)
            node = add(parent, token, "drafter", -neg, q=float(np.exp(raw)))
            drafted += len(tree.tokens) - before
            score = base + lp
            if rank + 1 < len(top[depth - 1]):  # the next sibling
                heapq.heappush(heap, (-float(np.exp(base + top[depth - 1][rank + 1][2])), order, "drafter",
                                      (parent, depth, rank + 1, base)))
                order += 1
            if depth < len(top):  # the first child
                heapq.heappush(heap, (-float(np.exp(score + top[depth][0][2])), order, "drafter",
                                      (node, depth + 1, 0, score)))
                order += 1
        else:
            parent, path, depth, size = payload
            before = len(tree.tokens)
            node = add(parent, path[depth - 1], kind, -neg, size if kind == "lookup" else 0)
            drafted += len(tree.tokens) - before
            if depth < len(path):
                score = lookup_scores(depth + 1, size) if kind == "lookup" else static_scores(depth + 1)
                heapq.heappush(heap, (-score, order, kind, (node, path, depth + 1, size)))
                order += 1
    return tree


@dataclass
class LookupStats:
    """Running acceptance of one lookup source's nodes per depth (Laplace-smoothed), what such a node's score is.
    `source`: "lookup" (the context's continuations) or "static" (the past answers' index).

    The context's nodes are counted apart by the length of the n-gram match that found their branch (DraftTree.matches;
    row 0: not known, and every static node): on held-out SmolLM2 answers a branch found by an 8-token match had its
    first token right 96 % of the time and one found by a 2-token match 47 % (benchmarks/lookup_calibration.py), so a
    rate pooled over all matches scored short matches far above what they earn."""

    max_depth: int
    proposed: np.ndarray = None
    accepted: np.ndarray = None
    source: str = "lookup"
    prior: tuple[float, float] | None = None

    # match length -> row of the counts
    ROWS = {n: i + 1 for i, n in enumerate(sorted(TREE_NGRAM_SIZES))}

    def __post_init__(self):
        self.proposed = np.zeros((len(self.ROWS) + 1, self.max_depth + 1))
        self.accepted = np.zeros((len(self.ROWS) + 1, self.max_depth + 1))
        self.prior = self.prior or self.PRIOR

    # Prior of each depth's survival rate, as pseudo-counts (accepted, proposed): a lookup token whose parent was
    # accepted is itself accepted about 4 times in 5 (SmolLM2 on held-out chat: given a right first token, prompt
    # lookup accepts 5.55 of 7 drafts; smollm2-135m/README.md), so a request starts trusting lookups that deep.
    PRIOR = (4.0, 5.0)

    def score(self, depth: int, size: int = 0) -> float:
        """P(a lookup node at `depth` is accepted), its branch found by a `size`-token match (0: not known): the
        product of that match length's per-depth survival rates up to it."""
        d = min(depth, self.max_depth)
        row = self.ROWS.get(size, 0)
        rates = (self.accepted[row, 1:d + 1] + self.prior[0]) / (self.proposed[row, 1:d + 1] + self.prior[1])
        return float(np.prod(rates))

    # Counts kept per depth: past it, both halve, so stats shared by many requests (a server's) follow the text
    # they see now.
    MEMORY = 2000

    def record(self, tree: DraftTree, path: list[int], verified=None) -> None:
        """Count, per depth, lookup nodes verified (`verified`: node indices; default all) whose parent was
        accepted, and those accepted themselves (`path`)."""
        on_path = set(path)
        for i in range(1, len(tree)):
            if verified is not None and i not in verified:
                continue
            if self.source in tree.proposed_by(i) and tree.parents[i] in on_path:
                d = min(tree.depths[i], self.max_depth)
                row = self.ROWS.get(tree.matches[i], 0) if self.source == "lookup" and tree.matches else 0
                self.proposed[row, d] += 1
                self.accepted[row, d] += i in on_path
                if self.proposed[row, d] > self.MEMORY:
                    self.proposed[row, d] /= 2
                    self.accepted[row, d] /= 2


# A continuation of other answers is weaker evidence than one of this request's own text: the static source starts at
# one in two per depth and earns its depth from what the target accepts.
STATIC_PRIOR = (1.0, 2.0)


def source_stats(max_depth: int) -> tuple[LookupStats, LookupStats]:
    """Fresh (lookup, static index) acceptance counts per depth, each from its prior."""
    return LookupStats(max_depth), LookupStats(max_depth, source="static", prior=STATIC_PRIOR)


# What the per-source counts call each source (RunStats.accepted_by, `bench`): the tree's names -> the report's.
SOURCE_NAMES = {"drafter": "drafter", "lookup": "context", "static": "static"}


def accepted_by_source(tree: DraftTree, path: list[int]) -> tuple[dict[str, int], dict[str, int]]:
    """Accepted drafts on `path` per source: (proposed by it, whether or not another source did too; proposed by it
    alone), keyed by SOURCE_NAMES' values."""
    by = {name: 0 for name in SOURCE_NAMES.values()}
    only = dict(by)
    for i in path[1:]:
        origins = tree.proposed_by(i)
        for source in origins:
            by[SOURCE_NAMES[source]] += 1
        if len(origins) == 1:
            only[SOURCE_NAMES[next(iter(origins))]] += 1
    return by, only


@dataclass
class DraftCalibration:
    """How often the target accepts the drafter's nodes against what the drafter's probabilities say: `scale()` turns
    a drafter probability into a node's chance of acceptance (build_tree's `draft_scale`). Counted on nodes only the
    drafter proposed, verified, whose parent was accepted (Laplace-smoothed toward 1). Sampled steps need it: the
    drafter's tempered probability overstates the chance that the target's draw is that token about twofold on
    SmolLM2 (walks accepted 0.46-0.56 of what the probabilities of the nodes they reached added up to), so uncalibrated
    trees grow rows that are almost never accepted and the drafter looks worth more than it is."""

    expected: float = 0.0  # the drafter's probabilities of the counted nodes, summed
    accepted: float = 0.0  # how many of them the target accepted
    PRIOR = 4.0  # pseudo-nodes at scale 1
    MEMORY = 2000  # past this many expected acceptances both halve: a server's calibration follows its traffic

    def scale(self) -> float:
        return (self.accepted + self.PRIOR) / (self.expected + self.PRIOR)

    def record(self, tree: DraftTree, path: list[int], verified) -> None:
        if not tree.draft_q:
            return
        on_path = set(path)
        for i in verified:
            if i and tree.draft_q[i] > 0 and tree.proposed_by(i) == {"drafter"} and tree.parents[i] in on_path:
                self.expected += tree.draft_q[i]
                self.accepted += i in on_path
        if self.expected > self.MEMORY:
            self.expected, self.accepted = self.expected / 2, self.accepted / 2


class DrafterGate:
    """Whether the drafter's pass pays, for one kind of step. The pass costs `draft_cost` plain steps and each of its
    drafts verified `verify_cost` more; what it buys is the drafts the target accepts that nothing else proposed. Both
    are running means per drafted step (`gain`, `rows`); the drafter runs while gain >= rate * (draft_cost +
    verify_cost * rows) at the current decoding rate (`rate` tokens per plain-step cost), the marginal rule that
    admits a node to a tree, applied to the pass. A skipped drafter still runs after EXPLORE_EVERY skipped steps, so
    its means stay current; the wait doubles, up to EXPLORE_MAX, while those runs do not show it paying (each costs a
    pass), and starts over once it pays. `state()` / `prior`: where a request left it, the next request's start (a
    short request then still takes its turn); unmeasured it is optimistic (the first steps draft)."""

    EXPLORE_EVERY, EXPLORE_MAX = 8, 64

    def __init__(self, prior: dict | None = None):
        p = {"gain": 1.0, "rows": 0.0, "skipped": 0, "explore": self.EXPLORE_EVERY, **(prior or {})}
        self.gain, self.rows, self.skipped, self.explore = p["gain"], p["rows"], p["skipped"], p["explore"]

    def pays(self, rate: float, draft_cost: float, verify_cost: float = 0.0) -> bool:
        if self.gain >= rate * (draft_cost + verify_cost * self.rows):
            self.explore = self.EXPLORE_EVERY
            return True
        self.skipped += 1
        if self.skipped >= self.explore:
            self.skipped = 0
            self.explore = min(2 * self.explore, self.EXPLORE_MAX)
            return True
        return False

    def record(self, gain: float, rows: int) -> None:
        """A drafted step: `gain` drafts accepted that only the drafter proposed (or their expected number), `rows`
        such drafts verified."""
        self.gain = 0.8 * self.gain + 0.2 * gain
        self.rows = 0.8 * self.rows + 0.2 * rows

    def state(self) -> dict:
        return {"gain": self.gain, "rows": self.rows, "skipped": self.skipped, "explore": self.explore}


class TreeState:
    """One request's proposer state: the context lookups search, lookup acceptance per depth, and whether the drafter
    pays (a `DrafterGate` for steps with a lookup branch, where the drafter adds to the lookups' tokens, and one for
    steps without, where it competes with a plain step)."""

    def __init__(self, context, max_depth: int, static=None, drafter_prior: dict | None = None,
                 stats: tuple[LookupStats, LookupStats] | None = None, calibration: DraftCalibration | None = None):
        self.context = ContextIndex(context)  # prompt + committed tokens, indexed for lookups
        # `stats`: the (lookup, static) acceptance counts to score with and add to -- earlier requests' (a runtime's,
        # shared), else this request's own from the priors
        self.lookups, self.static_stats = stats or source_stats(max_depth)
        self.static = static  # the engine's static n-gram index (decoding/static_ngrams.py), None when off
        # keyed by whether the step had a lookup branch; `drafter_prior`: an earlier request's `drafter_means()`
        self.gates = {k: DrafterGate((drafter_prior or {}).get(k)) for k in (True, False)}
        # the drafter's calibration (shared like `stats`); None: its probabilities are a node's score as they are
        self.calibration = calibration

    def draft_scale(self) -> float:
        """What the drafter's probabilities are multiplied by to score its nodes (DraftCalibration.scale)."""
        return self.calibration.scale() if self.calibration is not None else 1.0

    def drafter_pays(self, have_lookup: bool, rate: float, draft_cost: float, verify_cost: float = 0.0) -> bool:
        """Whether to run the drafter this step (`DrafterGate.pays`); a step without it verifies the lookups alone,
        or is a plain step."""
        return self.gates[bool(have_lookup)].pays(rate, draft_cost, verify_cost)

    def drafter_means(self) -> dict:
        """Both gates' state, as a later request's `drafter_prior`."""
        return {k: gate.state() for k, gate in self.gates.items()}

    def record(self, tree: DraftTree, path: list[int], verified, drafted: bool, had_lookup: bool) -> None:
        self.lookups.record(tree, path, verified)
        self.static_stats.record(tree, path, verified)
        if self.calibration is not None:
            self.calibration.record(tree, path, verified)
        if drafted:
            mine = [i for i in verified if i and tree.sources[i] == "drafter"]
            # Calibrated, the gate learns the drafter's expected gain (its verified nodes' chances, summed): a walk's
            # 0-or-1 outcomes made its running mean drop below the pass's cost after a few zero-gain steps and stay
            # there, though the drafted steps paid on average. Uncalibrated (greedy), what was accepted.
            gain = sum(tree.scores[i] for i in mine) if self.calibration is not None else \
                sum(tree.sources[i] == "drafter" for i in path[1:])
            self.gates[bool(had_lookup)].record(gain, len(mine))
