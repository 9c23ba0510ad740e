"""The tree proposer: a tree grown best-first from the drafter's per-slot top-K (DDTree's rule, decoding/tree.py)."""

from __future__ import annotations

from dflash_export.decoding.proposer import Proposer


class TreeProposer(Proposer):
    name = "tree"
    drafter, lookups = True, False
