"""How a DFlash step proposes and accepts drafts: the options, their one check, and the proposer they name.

A recipe's `decoding:` section (recipes.py), a built engine's manifest (engines/manifest.py), the runtime's arguments
(`run`, `bench`, `validate`, the served model) all go through `decoding_problem`; the loops (runtime/single.py,
runtime/batching.py) ask `resolve_options` for the options and `DecodingOptions.proposer()` for what to propose.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dflash_export.decoding.chain import ChainProposer
from dflash_export.decoding.draft_tree import TreeProposer
from dflash_export.decoding.lookup import LookupProposer
from dflash_export.decoding.proposer import Proposer
from dflash_export.decoding.tree_lookup import TreeLookupProposer
from dflash_export.errors import DFlashError

# What a DFlash step proposes: the drafter's block ("chain"), a tree grown from its per-slot distributions, the
# context's lookup branches, or a tree holding both; one module each.
PROPOSER_CLASSES: dict[str, type[Proposer]] = {
    "chain": ChainProposer, "tree": TreeProposer, "lookup": LookupProposer, "tree+lookup": TreeLookupProposer}
PROPOSERS = tuple(PROPOSER_CLASSES)
# How a tree is verified: its best path as a chain ("spine"), or every node in one target pass ("full").
TREE_MODES = ("spine", "full")
# How a sampled (T > 0) step accepts (docs/trees.md): "walk" draws the target's token at each node from its own
# distribution and follows the child carrying it (exact for any proposer; the output is plain sampling's, draw for
# draw, with the same seed); "chain" is the drafter's own sampled chain tested with min(1, p/q) (exact; the PyTorch
# reference's random stream, draw for draw).
SAMPLERS = ("walk", "chain")
# Upper bounds of the integer options (a tree's node count is what a verify pass holds).
LIMITS = {"tree_top_k": 8, "tree_nodes": 64, "static_prompts": 100_000, "static_entries": 1_000_000}
# Switches (true / false).
SWITCHES = ("static_ngrams",)


@dataclass
class DecodingOptions:
    """How a DFlash step proposes drafts. A recipe's `decoding:` section; built engines record it; `run`, `bench`,
    `validate` and the served model start from it and their options override it."""

    proposer: str = "chain"                  # one of PROPOSERS
    tree_top_k: int = 4                      # drafter children per tree node
    tree_nodes: int = 15                     # drafted nodes per step at most (the cost model may take fewer)
    tree_mode: str = "spine"                 # one of TREE_MODES
    # How a sampled step that walks verifies its tree: the walk needs breadth (a draw that leaves the best path can
    # still land on a sibling), so by default every node, where the engine verifies trees (else its best path).
    sampled_tree_mode: str = "full"          # one of TREE_MODES
    sampling: str = "walk"                   # one of SAMPLERS
    # The static n-gram index (decoding/static_ngrams.py): `build` indexes the target's greedy answers to the first
    # `static_prompts` training prompts, keeping at most `static_entries` n-grams; a step merges its continuations
    # into trees and lookups while `static_ngrams` is on (and the engine holds an index).
    static_ngrams: bool = False
    static_prompts: int = 256
    static_entries: int = 200_000

    def proposer_for(self) -> Proposer:
        """The proposer these options name (top-K children per drafter node where it grows trees)."""
        return PROPOSER_CLASSES[self.proposer](self.tree_top_k)


def decoding_problem(values: dict) -> tuple[str, str] | None:
    """The one check of decoding options: (field, what is wrong) for the first bad key of `values` (a recipe's or
    manifest's `decoding` mapping, or the runtime's overrides), None when all are good. Callers raise their own error
    naming their file."""
    known = [f.name for f in fields(DecodingOptions)]
    for key, value in values.items():
        if key not in known:
            return f"decoding.{key}", f"unknown key (known: {', '.join(known)})"
    for key, allowed in (("proposer", PROPOSERS), ("tree_mode", TREE_MODES), ("sampled_tree_mode", TREE_MODES),
                         ("sampling", SAMPLERS)):
        if key in values and values[key] not in allowed:
            return f"decoding.{key}", f"expected one of {', '.join(allowed)}, got {values[key]!r}"
    for key in SWITCHES:
        if key in values and not isinstance(values[key], bool):
            return f"decoding.{key}", f"expected true or false, got {values[key]!r}"
    for key, high in LIMITS.items():
        v = values.get(key)
        if key in values and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= high):
            return f"decoding.{key}", f"expected an integer from 1 to {high}, got {v!r}"
    return None


def resolve_options(recorded: dict | None, **overrides) -> DecodingOptions:
    """An engine's recorded options (its manifest's `decoding`, checked when read) with the caller's overrides
    (None = keep), checked once; a DFlashError naming the field otherwise."""
    given = {k: v for k, v in overrides.items() if v is not None}
    problem = decoding_problem(given)
    if problem is not None:
        field, message = problem
        raise DFlashError(message, field=field.split(".", 1)[1])
    known = {f.name for f in fields(DecodingOptions)}
    return DecodingOptions(**{**{k: v for k, v in (recorded or {}).items() if k in known}, **given})
