"""The static n-gram index: continuations taken from the target's own past answers, a third source of tree branches.

The context's lookups (prompt_lookup.ContextIndex) only find what the request itself already said; a small target
also repeats phrases across answers ("Here is a", "I hope this helps"). The index is built once, at `build`, from the
target's greedy answers to training prompts (never an evaluation suite's), stored in the engine as plain integer
arrays (`static_ngrams.npz`, read back by files.read_npz: nothing in it is unpickled or executed), and merged into the
same draft tree as the drafter's top-K and the context's continuations (decoding/tree.build_tree).

Definition (what `StaticNgramIndex.branches` returns, in closed form; tests/test_static_ngrams.py checks it against
a brute-force scan of the answers). For an n-gram g, an occurrence is a position in an answer where g ends with at
least one answer token after it. g's continuation is the majority walk through its occurrences: the most frequent
token after them (ties: the smallest id), then, among the occurrences followed by that token, the most frequent token
after it, and so on, up to `depth` tokens or until no surviving occurrence has a next token. The index keeps the
n-grams (n in `sizes`) seen at least `min_count` times; when there are more than `max_entries`, the most frequent ones
(ties: larger n first, then the smaller key). `branches(context)` gives, for each n (largest first) whose last-n
suffix of the context is kept, its continuation, without duplicates.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from dflash_export.errors import DFlashError

STATIC_FILE = "static_ngrams.npz"
FORMAT_VERSION = 1
# Longer n-grams first: the longer the shared suffix, the likelier the answers' continuation is this one's.
STATIC_NGRAM_SIZES = (4, 3, 2)
STATIC_DEPTH = 8        # tokens per continuation (the deepest lookup branch a verify block takes on the CPU engines)
STATIC_MIN_COUNT = 2    # an n-gram seen once in other answers is no evidence of a habit


def majority_walk(occurrences: Sequence[tuple[Sequence[int], int]], depth: int) -> list[int]:
    """The continuation of one n-gram: occurrences are (answer, index just after the n-gram) pairs (see the module
    docstring)."""
    alive = [(a, i) for a, i in occurrences if i < len(a)]
    out: list[int] = []
    while alive and len(out) < depth:
        counts = Counter(int(a[i]) for a, i in alive)
        best = max(counts.values())
        token = min(t for t, c in counts.items() if c == best)
        out.append(token)
        alive = [(a, i + 1) for a, i in alive if int(a[i]) == token and i + 1 < len(a)]
    return out


class StaticNgramIndex:
    """n-gram -> (its continuation, its count), for each n in `sizes`. Build with `from_answers`, store with
    `save`, read back (checked) with `load`."""

    def __init__(self, table: dict[tuple[int, ...], tuple[list[int], int]], sizes: Sequence[int], depth: int):
        self.table = table
        self.sizes = tuple(sorted(set(int(n) for n in sizes), reverse=True))
        self.depth = int(depth)

    def __len__(self) -> int:
        return len(self.table)

    @classmethod
    def from_answers(cls, answers: Iterable[Sequence[int]], sizes: Sequence[int] = STATIC_NGRAM_SIZES,
                     depth: int = STATIC_DEPTH, min_count: int = STATIC_MIN_COUNT, max_entries: int | None = None
                     ) -> "StaticNgramIndex":
        """The index of `answers` (token id lists: the target's greedy answers, prompts excluded)."""
        answers = [[int(t) for t in a] for a in answers]
        found: dict[tuple[int, ...], list[tuple[list[int], int]]] = defaultdict(list)
        for a in answers:
            for n in sizes:
                for end in range(n, len(a)):  # the n-gram a[end-n:end] has a token after it
                    found[tuple(a[end - n:end])].append((a, end))
        kept = [(key, occ) for key, occ in found.items() if len(occ) >= min_count]
        kept.sort(key=lambda kv: (-len(kv[1]), -len(kv[0]), kv[0]))
        if max_entries is not None:
            kept = kept[:max_entries]
        return cls({key: (majority_walk(occ, depth), len(occ)) for key, occ in kept}, sizes, depth)

    def branches(self, context: Sequence[int], max_tokens: int) -> list[list[int]]:
        """The continuations (up to `max_tokens` each) of the context's last n tokens, largest n first, distinct."""
        out: list[list[int]] = []
        size = len(context)
        for n in self.sizes:
            if size < n:
                continue
            hit = self.table.get(tuple(int(t) for t in context[size - n:]))
            if hit is not None:
                branch = hit[0][:max_tokens]
                if branch and branch not in out:
                    out.append(branch)
        return out

    # Storage: per n, keys [M, n], continuations [M, depth] (-1 after a continuation's end), counts [M]; int32 all.

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"version": np.asarray([FORMAT_VERSION], np.int32), "sizes": np.asarray(self.sizes, np.int32),
               "depth": np.asarray([self.depth], np.int32)}
        for n in self.sizes:
            rows = sorted((k, v) for k, v in self.table.items() if len(k) == n)
            keys = np.asarray([k for k, _ in rows], np.int32).reshape(len(rows), n)
            conts = np.full((len(rows), self.depth), -1, np.int32)
            for r, (_, (cont, _)) in enumerate(rows):
                conts[r, :len(cont)] = cont
            out[f"keys_{n}"], out[f"continuations_{n}"] = keys, conts
            out[f"counts_{n}"] = np.asarray([c for _, (_, c) in rows], np.int32)
        return out

    def save(self, path: Path) -> None:
        with open(path, "wb") as f:
            np.savez(f, **self.arrays())

    @classmethod
    def from_arrays(cls, data: Mapping[str, np.ndarray], vocab_size: int, path: Path) -> "StaticNgramIndex":
        """The index of the arrays `save` wrote, read back from the file `path` (engines/manifest.py reads it with
        files.read_npz), every array checked (dtype, shape, token ids below `vocab_size`); one DFlashError naming the
        file and the array otherwise."""

        def array(name: str, ndim: int) -> np.ndarray:
            a = data.get(name)
            if a is None:
                raise DFlashError("missing array", path=path, field=name)
            if a.dtype != np.int32 or a.ndim != ndim:
                raise DFlashError(f"expected a {ndim}-d int32 array, got {a.ndim}-d {a.dtype}", path=path, field=name)
            return a

        version, sizes, depth = array("version", 1), array("sizes", 1), array("depth", 1)
        if version.tolist() != [FORMAT_VERSION]:
            raise DFlashError(f"expected format version {FORMAT_VERSION}, got {version.tolist()}", path=path,
                              field="version")
        if len(depth) != 1 or not 1 <= int(depth[0]) <= 64:
            raise DFlashError(f"expected one depth from 1 to 64, got {depth.tolist()}", path=path, field="depth")
        if not len(sizes) or len(set(sizes.tolist())) != len(sizes) or not all(1 <= n <= 16 for n in sizes.tolist()):
            raise DFlashError(f"expected distinct n-gram sizes from 1 to 16, got {sizes.tolist()}", path=path,
                              field="sizes")
        d = int(depth[0])
        table: dict[tuple[int, ...], tuple[list[int], int]] = {}
        for n in sizes.tolist():
            keys, conts, counts = array(f"keys_{n}", 2), array(f"continuations_{n}", 2), array(f"counts_{n}", 1)
            if keys.shape[1] != n or conts.shape != (len(keys), d) or counts.shape != (len(keys),):
                raise DFlashError(f"shapes {keys.shape}, {conts.shape}, {counts.shape} disagree with n {n}, depth {d}",
                                  path=path, field=f"keys_{n}")
            if keys.size and (keys.min() < 0 or keys.max() >= vocab_size):
                raise DFlashError(f"token id outside the vocabulary ({vocab_size})", path=path, field=f"keys_{n}")
            valid = conts >= 0
            if conts.size and (conts.max() >= vocab_size or (conts < -1).any()
                               or (valid[:, 1:] & ~valid[:, :-1]).any() or not valid[:, 0].all()):
                raise DFlashError(f"expected token ids below {vocab_size}, -1 only after a continuation's end",
                                  path=path, field=f"continuations_{n}")
            if counts.size and counts.min() < 1:
                raise DFlashError("expected positive counts", path=path, field=f"counts_{n}")
            before = len(table)
            for key, cont, count in zip(keys.tolist(), conts.tolist(), counts.tolist()):
                table[tuple(key)] = ([t for t in cont if t >= 0], count)
            if len(table) != before + len(keys):
                raise DFlashError("a key appears twice", path=path, field=f"keys_{n}")
        return cls(table, sizes.tolist(), d)


def store_static_index(engine_dir: Path, index: StaticNgramIndex, answers: int, answer_tokens: int) -> dict:
    """Write `index` into `engine_dir` as STATIC_FILE; returns the manifest's `static_ngrams` field (the file, its
    sha256, its entries and what it was built from)."""
    import hashlib

    path = Path(engine_dir) / STATIC_FILE
    index.save(path)
    return {"file": STATIC_FILE, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "entries": len(index),
            "answers": int(answers), "answer_tokens": int(answer_tokens), "sizes": list(index.sizes),
            "depth": index.depth}
