"""The static n-gram index of the target's own answers (decoding/static_ngrams.py): its lookups against a brute-force
scan of the answers, its size bound, storage and the loading errors, its nodes in the draft tree, and greedy
decoding with it identical to plain decoding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from target_support import assert_as_plain

from dflash_export.decoding.static_ngrams import STATIC_FILE, StaticNgramIndex, store_static_index
from dflash_export.decoding.tree import accepted_by_source, build_tree, greedy_accept
from dflash_export.engines.manifest import load_static_index
from dflash_export.errors import DFlashError


def _answers(seed: int, n: int = 30, vocab: int = 6) -> list[list[int]]:
    """Short answers over a small vocabulary with a repeated phrase, so n-grams recur with competing continuations."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = [int(t) for t in rng.integers(0, vocab, rng.integers(3, 25))]
        if rng.random() < 0.5:
            at = int(rng.integers(0, len(a)))
            a[at:at] = [1, 2, 3, 4, 5]
        out.append(a)
    return out


def _scan(answers, key, depth):
    """Brute force: the majority walk over every answer position where `key` ends with a token after it."""
    n = len(key)
    alive = [(a, e) for a in answers for e in range(n, len(a)) if tuple(a[e - n:e]) == key]
    count = len(alive)
    out = []
    while alive and len(out) < depth:
        c = Counter(a[e] for a, e in alive)
        token = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
        out.append(token)
        alive = [(a, e + 1) for a, e in alive if a[e] == token and e + 1 < len(a)]
    return out, count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookups_are_the_majority_continuation_of_a_brute_force_scan(seed):
    answers = _answers(seed)
    index = StaticNgramIndex.from_answers(answers, sizes=(3, 2), depth=5, min_count=2)
    rng = np.random.default_rng(100 + seed)
    checked = 0
    for _ in range(300):
        context = [int(t) for t in rng.integers(0, 6, rng.integers(1, 8))]
        want = []
        for n in (3, 2):
            if len(context) < n:
                continue
            cont, count = _scan(answers, tuple(context[-n:]), 5)
            branch = cont[:4]
            if count >= 2 and branch and branch not in want:
                want.append(branch)
        assert index.branches(context, 4) == want, context
        checked += bool(want)
    assert checked > 50  # the contexts do hit the index


def test_the_size_bound_keeps_the_most_frequent_ngrams():
    answers = _answers(7, n=40)
    full = StaticNgramIndex.from_answers(answers, sizes=(3, 2), depth=4, min_count=1)
    counts = {k: _scan(answers, k, 0)[1] for k in full.table}
    assert all(full.table[k][1] == c for k, c in counts.items())
    bounded = StaticNgramIndex.from_answers(answers, sizes=(3, 2), depth=4, min_count=1, max_entries=10)
    ranked = sorted(counts, key=lambda k: (-counts[k], -len(k), k))[:10]
    assert set(bounded.table) == set(ranked)
    assert all(bounded.table[k] == full.table[k] for k in ranked)


def test_the_index_stores_plain_arrays_and_reads_back_the_same(tmp_path):
    index = StaticNgramIndex.from_answers(_answers(3), sizes=(4, 3, 2), depth=6)
    field = store_static_index(tmp_path, index, 30, 123)
    assert field["file"] == STATIC_FILE and field["entries"] == len(index) > 0
    back = load_static_index(tmp_path / STATIC_FILE, vocab_size=6)
    assert back.table == index.table and back.sizes == index.sizes and back.depth == index.depth


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("change,field", [
    (lambda a: a.update(keys_2=a["keys_2"].astype(np.int64)), "keys_2"),
    (lambda a: a.pop("continuations_3"), "continuations_3"),
    (lambda a: a.update(version=np.asarray([9], np.int32)), "version"),
    (lambda a: a["keys_2"].__setitem__((0, 0), 6), "keys_2"),
    (lambda a: a["continuations_2"].__setitem__((0, 0), -1), "continuations_2"),
    (lambda a: a.update(counts_4=a["counts_4"][:-1]), "keys_4"),
    (lambda a: a.update(keys_3=np.concatenate([a["keys_3"], a["keys_3"][:1]]),
                        continuations_3=np.concatenate([a["continuations_3"], a["continuations_3"][:1]]),
                        counts_3=np.concatenate([a["counts_3"], a["counts_3"][:1]])), "keys_3"),
])
def test_a_bad_index_is_one_error_naming_the_file_and_array(tmp_path, change, field):
    arrays = StaticNgramIndex.from_answers(_answers(4), sizes=(4, 3, 2), depth=6).arrays()
    change(arrays)
    path = tmp_path / STATIC_FILE
    _write(path, **arrays)
    with pytest.raises(DFlashError) as e:
        load_static_index(path, vocab_size=6)
    assert str(path) in str(e.value) and field in str(e.value)


def test_an_object_array_or_a_truncated_file_is_refused_never_unpickled(tmp_path):
    path = tmp_path / STATIC_FILE
    arrays = StaticNgramIndex.from_answers(_answers(5), sizes=(2,), depth=3).arrays()
    arrays["keys_2"] = np.asarray([object()], dtype=object)
    _write(path, **arrays)
    with pytest.raises(DFlashError, match="static_ngrams|keys_2"):
        load_static_index(path, vocab_size=6)
    store_static_index(tmp_path, StaticNgramIndex.from_answers(_answers(5), sizes=(2,), depth=3), 1, 1)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DFlashError, match="unreadable static n-gram index"):
        load_static_index(path, vocab_size=6)


def test_an_array_header_declaring_more_than_the_file_holds_is_refused_before_any_allocation(tmp_path):
    """A doctored .npy header inside the archive (a shape of 10^11 rows): one error naming the file, not numpy
    allocating hundreds of GiB (a MemoryError) before it finds the data missing."""
    import io
    import zipfile

    from numpy.lib import format as npy

    good, path = tmp_path / "good.npz", tmp_path / STATIC_FILE
    StaticNgramIndex.from_answers(_answers(6), sizes=(2,), depth=3).save(good)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == "keys_2.npy":
                header = io.BytesIO()
                npy.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (10**11, 2)})
                data = header.getvalue() + data[len(header.getvalue()):]
            zout.writestr(info, data)
    with pytest.raises(DFlashError, match="unreadable static n-gram index") as e:
        load_static_index(path, vocab_size=6)
    assert str(path) in str(e.value) and "static_ngrams" in str(e.value)
    # a lone .npy in the archive's place, its header declaring as much: refused as no archive, never read
    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (10**11, 2)})
    path.write_bytes(header.getvalue() + bytes(64))
    with pytest.raises(DFlashError, match="unreadable static n-gram index") as e:
        load_static_index(path, vocab_size=6)
    assert str(path) in str(e.value) and "static_ngrams" in str(e.value)


def test_static_nodes_join_the_tree_and_their_acceptance_counts_apart():
    """A static continuation shares the trie with the context's: a prefix both propose is one node, proposed by
    both; accepted drafts count per source, and alone where only that source proposed them."""
    tree = build_tree(9, None, [[1, 2, 3]], top_k=0, max_nodes=10, static=[[1, 2, 7, 8]])
    paths = {tuple(tree.tokens[j] for j in tree.path(i)[1:]): tree.proposed_by(i) for i in range(1, len(tree))}
    assert paths == {(1,): {"lookup", "static"}, (1, 2): {"lookup", "static"}, (1, 2, 3): {"lookup"},
                     (1, 2, 7): {"static"}, (1, 2, 7, 8): {"static"}}
    target_next = np.zeros(len(tree), np.int64)
    for i in range(len(tree)):  # the target continues 1 2 7 5
        target_next[i] = {(): 1, (1,): 2, (1, 2): 7, (1, 2, 7): 5}.get(
            tuple(tree.tokens[j] for j in tree.path(i)[1:]), 0)
    path, emitted = greedy_accept(tree, target_next)
    assert emitted == [1, 2, 7, 5]
    by, only = accepted_by_source(tree, path)
    assert by == {"drafter": 0, "context": 2, "static": 3} and only == {"drafter": 0, "context": 0, "static": 1}


def test_build_stores_the_index_of_the_target_s_own_answers_and_greedy_decoding_is_unchanged(tmp_path):
    """`build` with decoding.static_ngrams indexes the target's greedy answers to its training prompts (the answers
    transformers' own forward gives: the reference's ar_generate), records the file with its sha256, and a greedy
    run merging it decodes exactly as plain decoding (a sampled one as plain sampling, seed for seed); a changed
    file is one error naming it, at load."""
    import json

    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.recipes import load_recipe
    from dflash_export.runtime.single import DFlashRuntime
    from dflash_export.train.data import synthetic_prompt_ids

    y = tmp_path / "r.yaml"
    y.write_text("name: r\ntarget: tiny:llama/target\ndrafter: tiny:llama/drafter\nmax_seq_len: 256\n"
                 "train: {prompts: synthetic, max_new_tokens: 24, max_prompt_tokens: 64}\n"
                 "decoding: {proposer: tree+lookup, static_ngrams: true, static_prompts: 32, static_entries: 5000}\n")
    recipe = load_recipe(y)
    out = build_onnxruntime(recipe, tmp_path / "engine", threads=1)
    manifest = read_manifest(out)
    static = manifest.raw["static_ngrams"]
    assert static["file"] == STATIC_FILE and static["sha256"] == manifest.files[STATIC_FILE]
    assert static["answers"] == 32 and 0 < static["entries"] <= 5000

    eng = load_engine(out, threads=1)
    # The index holds the target's own greedy answers to the training prompts: plain decoding on the engine.
    rt = DFlashRuntime(eng)
    plain = [rt.generate(p, SamplingParams(max_new_tokens=24), mode="ar").tokens
             for _, p in synthetic_prompt_ids(eng.info.vocab_size, 32, 0, 2)]
    want = StaticNgramIndex.from_answers(plain, max_entries=5000)
    assert eng.info.static_index.table == want.table
    assert rt.static_index is eng.info.static_index
    rng = np.random.default_rng(0)
    counted = Counter()
    for prompt in [list(rng.integers(0, 200, 12)) for _ in range(4)] + [plain[0][:10], plain[1][:6]]:
        sp = SamplingParams(max_new_tokens=40)
        got = rt.generate(prompt, sp)
        assert_as_plain(eng, prompt, got.tokens, rt.generate(prompt, sp, mode="ar").tokens)
        counted.update(got.accepted_by)
    assert counted["static"] > 0  # the answers' continuations were proposed and accepted
    for seed, prompt in enumerate([plain[2][:8], plain[3][:5]]):  # sampled: walked, plain sampling draw for draw
        sp = SamplingParams(max_new_tokens=32, temperature=0.7, top_k=20, seed=seed)
        assert_as_plain(eng, prompt, rt.generate(prompt, sp).tokens, rt.generate(prompt, sp, mode="ar").tokens, sp)
    assert DFlashRuntime(eng, static_ngrams=False).static_index is None
    eng.info.static_index = None  # an engine built without an index
    with pytest.raises(DFlashError, match="static_ngrams"):
        DFlashRuntime(eng, static_ngrams=True)

    (out / STATIC_FILE).write_bytes((out / STATIC_FILE).read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(DFlashError) as e:
        load_engine(out, threads=1)
    assert STATIC_FILE in str(e.value)
    raw = json.loads((out / "manifest.json").read_text())
    raw["static_ngrams"]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="static_ngrams.sha256"):
        read_manifest(out, verify_files=False)
