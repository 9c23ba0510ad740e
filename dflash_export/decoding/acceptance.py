"""Acceptance of a verified draft tree, greedy and sampled (the argument for exactness: docs/trees.md).

Greedy (`tree.greedy_accept`): follow the child holding the target's argmax as far as one exists.
Sampled (`walk_accept`): at each node draw the target's token from its own distribution (temperature, top-k, top-p
applied by `sampling.probs_from_logits`, inverse CDF with the next uniform of the request's stream, exactly what a
plain sampled step does), follow the child carrying it, stop where none does. Every emitted token is the target's
draw at its position with the request's next uniform, so the output is plain sampling's draw for draw whatever was
proposed -- provided proposing consumed none of those uniforms (the drafter's argmax / top-K, lookups), so the stream
stays one uniform per emitted token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dflash_export.decoding.sampling import probs_from_logits, sample_from
from dflash_export.decoding.tree import DraftTree


def walk_accept(tree: DraftTree, logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                uniform: Callable[[], float], probs: Callable[[np.ndarray], np.ndarray] | None = None
                ) -> tuple[list[int], list[int]]:
    """logits [N, V]: the target's logits after each node of `tree` (row i = after node i). `uniform()`: the
    request's next uniform in [0, 1), called once per emitted token. `probs(row)`: the sampling distribution of one
    row (default: `probs_from_logits` with the request's temperature, top-k, top-p, as a plain step draws). Returns
    (accepted path node indices, root first; emitted tokens = the accepted drafts + the target's draw after the last
    of them)."""
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, len(tree)):
        kids.setdefault(tree.parents[i], {}).setdefault(tree.tokens[i], i)  # first node wins a duplicate token
    path, emitted = [0], []
    while True:
        node = path[-1]
        p = probs(logits[node]) if probs is not None else probs_from_logits(logits[node], temperature, top_k, top_p)
        token = sample_from(p, uniform())
        emitted.append(token)
        child = kids.get(node, {}).get(token)
        if child is None:
            return path, emitted
        path.append(child)


@dataclass
class Walk:
    """A sampled acceptance to hand an engine's verify (`accept=`): called with the verified rows' logits [N, V], it
    returns (path, emitted) as `walk_accept` over `tree` with the request's settings and uniform stream."""

    tree: DraftTree
    temperature: float
    top_k: int
    top_p: float
    uniform: Callable[[], float]

    def __call__(self, logits: np.ndarray, probs: Callable[[np.ndarray], np.ndarray] | None = None
                 ) -> tuple[list[int], list[int]]:
        return walk_accept(self.tree, logits, self.temperature, self.top_k, self.top_p, self.uniform, probs)
