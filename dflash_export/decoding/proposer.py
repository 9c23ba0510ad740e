"""The proposer interface: what one DFlash step drafts, as a draft tree (decoding/tree.py), from the drafter's
per-slot logits and the context's lookup branches. One module per method: chain.py, draft_tree.py, lookup.py,
tree_lookup.py; decoding/options.py names them."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dflash_export.decoding.tree import DraftTree, build_tree


class Proposer:
    """A step's proposal strategy. `drafter`: whether it runs the drafter; `lookups`: whether it merges the context's
    lookup branches; `top_k`: drafter children per node (1: the drafter's chain)."""

    name = ""
    drafter = True
    lookups = False

    def __init__(self, top_k: int = 1):
        self.top_k = top_k

    @property
    def chain_only(self) -> bool:
        """Whether every proposal is one chain (the drafter's block): then it can be verified as a chain, sampled
        with the drafter's own min(1, p/q) test too."""
        return self.drafter and not self.lookups and self.top_k == 1

    def propose(self, anchor: int, draft_logprobs: np.ndarray | None, branches: Sequence[Sequence[int]], *,
                max_nodes: int, min_score: float = 0.0, lookup_scores: Callable[..., float] | None = None,
                static: Sequence[Sequence[int]] = (), static_scores: Callable[[int], float] | None = None,
                lookup_sizes: Sequence[int] = (), draft_scale: float = 1.0) -> DraftTree:
        """The step's draft tree under `anchor`: the drafter's slots (logits or log-probabilities [D, V], None when
        it did not run this step) and the lookup `branches` this proposer uses, nodes scoring >= `min_score`, at most
        `max_nodes` (decoding/tree.build_tree); `static`: the static index's continuations (decoding/static_ngrams.py),
        merged by every proposer that grows trees when the runtime passes them; `lookup_sizes`: the n-gram match
        behind each branch (ContextIndex.branches(..., with_sizes=True)), which the lookup scores depend on;
        `draft_scale`: the drafter's calibration (decoding/tree.DraftCalibration)."""
        return build_tree(anchor, draft_logprobs if self.drafter else None, list(branches) if self.lookups else [],
                          top_k=self.top_k, max_nodes=max_nodes, min_score=min_score, lookup_scores=lookup_scores,
                          static=[list(b) for b in static], static_scores=static_scores,
                          lookup_sizes=list(lookup_sizes) if self.lookups else [], draft_scale=draft_scale)
