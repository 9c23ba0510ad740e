"""The chain proposer: the drafter's block as drafted, one token per slot (as far as the cost model says it pays)."""

from __future__ import annotations

from dflash_export.decoding.proposer import Proposer


class ChainProposer(Proposer):
    name = "chain"
    drafter, lookups = True, False

    def __init__(self, top_k: int = 1):
        super().__init__(1)  # a chain has one child per node whatever the tree options say
