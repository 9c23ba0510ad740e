"""The tree+lookup proposer: the drafter's per-slot top-K tree and the context's lookup branches in one trie (a
prefix both propose is verified once; the drafter's pass is skipped where lookups alone pay, TreeState)."""

from __future__ import annotations

from dflash_export.decoding.proposer import Proposer


class TreeLookupProposer(Proposer):
    name = "tree+lookup"
    drafter, lookups = True, True
