"""The lookup proposer: the context's own continuations of its last n tokens (decoding/prompt_lookup.ContextIndex),
merged into one trie; no drafter pass."""

from __future__ import annotations

from dflash_export.decoding.proposer import Proposer


class LookupProposer(Proposer):
    name = "lookup"
    drafter, lookups = False, True
