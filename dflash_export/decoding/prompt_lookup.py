"""The prompt-lookup yardstick: the τ a training-free n-gram drafter would reach on the very same output tokens.

Prompt lookup is a yardstick here, never a drafter: it is replayed on the tokens a run already produced (no second
decode), so `validate` and `bench` can show next to DFlash τ whether a drafter beats the free baseline.

Definition (greedy, block size bs). The first answer token comes from the prefill, as in DFlash; then each step:
- context = prompt + the answer committed so far;
- for n = 4, 3, 2 (the first that matches wins): find the latest earlier occurrence of the context's last n tokens
  (one that starts before the suffix itself) and propose the up to bs-1 tokens that followed it in the context;
  no match at any n: no proposal;
- accepted = the longest prefix of the proposal equal to the next answer tokens; the step commits accepted + 1 tokens
  (the target's bonus token), never more than the answer has left.
τ = committed tokens / steps, pooled over prompts (`pooled_tau`), exactly how DFlash τ is pooled.
"""

from __future__ import annotations

from typing import Sequence

NGRAM_SIZES = (4, 3, 2)


def lookup_proposal(context: Sequence[int], max_tokens: int, ngram_sizes: Sequence[int] = NGRAM_SIZES) -> list[int]:
    """The up to `max_tokens` tokens that followed the latest earlier occurrence of the last n tokens of `context`
    (largest n first); [] when none of them occurs earlier."""
    size = len(context)
    for n in ngram_sizes:
        if size <= n:
            continue
        suffix = list(context[size - n:])
        for start in range(size - n - 1, -1, -1):  # latest occurrence first, the suffix itself excluded
            if list(context[start:start + n]) == suffix:
                return list(context[start + n:start + n + max_tokens])
    return []


# Draft trees match longer n-grams first: in text that repeats itself with variations, the latest match of a short
# suffix is often the wrong occurrence, the latest match of a long one rarely.
TREE_NGRAM_SIZES = (8, 6, 4, 3, 2)


def lookup_branches(context: Sequence[int], max_tokens: int, ngram_sizes: Sequence[int] = TREE_NGRAM_SIZES,
                    with_sizes: bool = False) -> list:
    """The distinct continuations (up to `max_tokens` each) of the latest earlier occurrence of the context's last n
    tokens, for each n (largest first): the lookup branches a draft tree merges (decoding/tree.py). The first is
    `lookup_proposal`'s. `with_sizes`: (n, branch) pairs, n the longest match that found the branch."""
    out: list[tuple[int, list[int]]] = []
    for n in ngram_sizes:
        branch = lookup_proposal(context, max_tokens, (n,))
        if branch and all(branch != b for _, b in out):
            out.append((n, branch))
    return out if with_sizes else [b for _, b in out]


class ContextIndex:
    """`lookup_branches` over a growing context in O(1) per call: for every n-gram size, the latest start of each
    n-gram that has a token after it (so it starts before any suffix of the same size), updated as tokens arrive."""

    def __init__(self, context: Sequence[int] = (), ngram_sizes: Sequence[int] = TREE_NGRAM_SIZES):
        self.tokens: list[int] = []
        self.sizes = tuple(ngram_sizes)
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1  # the n-grams that end just before this token now have a continuation
            for n in self.sizes:
                if end >= n:
                    self._latest[n][tuple(self.tokens[end - n:end])] = end - n

    def branches(self, max_tokens: int, with_sizes: bool = False) -> list:
        """What `lookup_branches(self.tokens, max_tokens, sizes, with_sizes)` returns."""
        out: list[tuple[int, list[int]]] = []
        size = len(self.tokens)
        for n in self.sizes:
            if size <= n:
                continue
            start = self._latest[n].get(tuple(self.tokens[size - n:]))
            if start is not None:
                branch = self.tokens[start + n:start + n + max_tokens]
                if branch and all(branch != b for _, b in out):
                    out.append((n, branch))
        return out if with_sizes else [b for _, b in out]


def prompt_lookup_steps(prompt: Sequence[int], answer: Sequence[int], block_size: int,
                        ngram_sizes: Sequence[int] = NGRAM_SIZES) -> list[int]:
    """Tokens committed per step when prompt lookup drafts `answer` (after its first token) in blocks of
    `block_size`: accepted proposals + 1, capped at what is left. Sum = len(answer) - 1."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    context = list(prompt) + list(answer[:1])
    done, total = min(1, len(answer)), len(answer)
    steps = []
    while done < total:
        proposal = lookup_proposal(context, block_size - 1, ngram_sizes)
        accepted = 0
        while accepted < len(proposal) and done + accepted < total and proposal[accepted] == answer[done + accepted]:
            accepted += 1
        commit = min(accepted + 1, total - done)
        context.extend(answer[done:done + commit])
        done += commit
        steps.append(commit)
    return steps


def pooled_tau(step_lists: Sequence[Sequence[int]]) -> float:
    """Committed tokens / steps over all prompts (1.0 when there were no steps)."""
    steps = sum(len(s) for s in step_lists)
    return sum(sum(s) for s in step_lists) / steps if steps else 1.0


def prompt_lookup_tau(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], block_size: int) -> float:
    """Pooled prompt-lookup τ over (prompt ids, answer ids) pairs."""
    return pooled_tau([prompt_lookup_steps(p, a, block_size) for p, a in pairs])
