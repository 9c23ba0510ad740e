"""Whole draft trees on targets with sliding-window layers, against transformers' own models as the oracle: a tiny
windowed Qwen3 (its last 4 of 6 layers with an 8-token window) and a tiny gpt-oss (8-token windows on alternate
layers, sinks). A tree node sits at K/V row length + index but at position length + depth, so GroupQueryAttention's
row window alone would hide keys of its positions' window wherever the tree branches; the graph's window_bias_W input
hides keys by position instead (export/graph.py `_gqa_attention`), over a row window widened by the most rows a
verify takes. Prompts run past the window and trees branch past its edge."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from target_support import assert_as_plain, assert_transformers_greedy, engine_and_transformers, prompts

pytest.importorskip("onnxruntime")
NEW = 48
WINDOW = 8


@pytest.fixture(scope="module", params=["tiny-qwen3-swa", "tiny-gpt-oss"])
def windowed(tmp_path_factory, request):
    recipe, engine_dir, engine, hf = engine_and_transformers(request.param, tmp_path_factory.mktemp("win"))
    yield recipe, engine_dir, engine, hf
    engine.close()


def _hidden_by_row_window(length: int, index: int, depth: int) -> bool:
    """Whether a node at row length + index and position length + depth loses a committed key of its window to a
    row window of WINDOW rows (keys at positions length + depth - WINDOW + 1 .. length + index - WINDOW)."""
    return index > depth and length + index - WINDOW >= max(0, length + depth - WINDOW + 1)


def _edge_tree(prompt: list[int]):
    """Three branches under the prompt's last token (6, 6 and 3 nodes: 16 rows, the most a verify takes)."""
    from dflash_export.decoding.tree import build_tree

    branches = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26], [31, 32, 33]]
    return build_tree(prompt[-1], None, branches, top_k=0, max_nodes=sum(map(len, branches)))


def _deep_tree(root: int):
    """A branch of 5 nodes, then one of 10 (deeper than the window) under `root`: the deep branch's last nodes sit 5
    rows past their positions, and their first ancestors lie outside their window by position, not by row."""
    from dflash_export.decoding.tree import DraftTree

    tokens = [root, 41, 42, 43, 44, 45] + list(range(51, 61))
    parents = [-1, 0, 1, 2, 3, 4, 0] + list(range(6, 15))
    depths = [0, 1, 2, 3, 4, 5] + list(range(1, 11))
    return DraftTree(tokens, parents, depths)


def _path_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def _tree_row_gaps(engine, hf, prompt: list[int], tree) -> list[float]:
    """Per node of `tree` (its root the prompt's last token), |engine logits - transformers' logits| of its path, the
    tree verified in one target pass after the prompt's other tokens."""
    seq = engine.new_sequence(len(prompt) + len(tree) + engine.row_floor)
    engine.prefill(seq, np.asarray(prompt[:-1], np.int64))
    hidden, _ = engine._run_target(seq, np.asarray(tree.tokens, np.int64), len(tree), tree=tree)
    logits = engine._logits(hidden)
    return [float(np.abs(logits[node] - _path_logits(hf, prompt[:-1] + [tree.tokens[n] for n in tree.path(node)]))
                  .max()) for node in range(len(tree))]


def test_tree_rows_past_the_window_edge_are_transformers_logits(windowed):
    """Every node of a tree that branches past the window's edge, and of one deeper than the window: transformers'
    logits for its path."""
    _, _, engine, hf = windowed
    prompt = prompts()[3]  # 30 tokens
    tree = _edge_tree(prompt)
    assert engine.tree_verify and set(engine.window_inputs.values()) == {WINDOW}
    assert any(_hidden_by_row_window(len(prompt) - 1, i, d) for i, d in enumerate(tree.depths))
    assert max(_tree_row_gaps(engine, hf, prompt, tree)) <= 1e-4
    assert max(_tree_row_gaps(engine, hf, prompt, _deep_tree(prompt[-1]))) <= 1e-4


def test_batched_tree_deeper_than_the_window_gives_transformers_logits(windowed):
    """target_batch, two sequences in one call, one verifying a tree deeper than the window (its window masks keys by
    their positions, not their slots) and the other a chain: transformers' logits for every row."""
    from dflash_export.engines.registry import batched_engine

    _, _, engine, hf = windowed
    batch = batched_engine(engine, 2)
    seqs = [batch.add(64), batch.add(64)]
    deep, plain = prompts()[3], prompts()[2]
    batch.prefill(seqs, [deep[:-1], plain[:-1]])
    tree, chain = _deep_tree(deep[-1]), [plain[-1], 7, 8, 9]
    assert batch.verifies_trees(2)
    got = batch.target_step(seqs, [tree.tokens, chain], [tree, None])
    for node in range(len(tree)):
        want = _path_logits(hf, deep[:-1] + [tree.tokens[n] for n in tree.path(node)])
        assert np.abs(got[0][node] - want).max() <= 1e-4, node
    for row in range(len(chain)):
        assert np.abs(got[1][row] - _path_logits(hf, plain[:-1] + chain[:row + 1])).max() <= 1e-4, row


def _without_window_bias(engine_dir, out):
    """A copy of the engine as built before window_bias: its sliding layers' GroupQueryAttention take attention_bias
    and a row window of the window's own size, and the graph has no window_bias input (manifest hashes follow)."""
    import onnx

    shutil.copytree(engine_dir, out)
    path = out / "target.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention" and len(n.input) > 10 and n.input[10].startswith("window_bias_"):
            n.input[10] = "attention_bias"
            next(a for a in n.attribute if a.name == "local_window_size").i = WINDOW
    kept = [i for i in model.graph.input if not i.name.startswith("window_bias_")]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    onnx.save(model, str(path))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["target.onnx"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest["numerics"].update(tree_bit_identical=None, tree_max_abs_diff=None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_an_engine_without_window_bias_verifies_best_paths(windowed, tmp_path):
    """Built before window_bias: the engine loads, verifies best paths only, and gives plain decoding's tokens under
    tree_mode "full"; its row window alone gives a node past the window's edge other logits than transformers'."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    _, engine_dir, engine, hf = windowed
    old = load_engine(_without_window_bias(engine_dir, tmp_path / "old"), threads=1)
    try:
        assert not old.tree_verify and old.window_inputs == {}
        prompt = prompts()[3]
        tree = _edge_tree(prompt)
        gaps = _tree_row_gaps(old, hf, prompt, tree)
        past = [g for i, (g, d) in enumerate(zip(gaps, tree.depths)) if _hidden_by_row_window(len(prompt) - 1, i, d)]
        assert max(past) > 1e-3, gaps
        sp = SamplingParams(max_new_tokens=24)
        ids = prompts()[2]
        plain = DFlashRuntime(old).generate(ids, sp, "ar").tokens
        got = DFlashRuntime(old, adaptive=False, proposer="tree", tree_mode="full").generate(ids, sp).tokens
        assert_as_plain(old, ids, got, plain)
        assert DFlashRuntime(engine).generate(ids, sp, "ar").tokens == plain
    finally:
        old.close()


def test_whole_draft_trees_give_transformers_greedy_tokens(windowed):
    """tree_mode "full": every step's tree verified in one pass, branching past the window's edge, gives
    transformers' greedy tokens and plain decoding's."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, hf = windowed
    sp = SamplingParams(max_new_tokens=NEW)
    seen = []
    verify_tree = engine.verify_tree

    def spy(seq, tree, accept=None):
        seen.append((seq.length, tree))
        return verify_tree(seq, tree, accept)

    engine.verify_tree = spy
    try:
        for ids in prompts():
            plain = DFlashRuntime(engine).generate(ids, sp, "ar").tokens
            for proposer in ("tree", "tree+lookup"):
                got = DFlashRuntime(engine, adaptive=False, proposer=proposer, tree_mode="full").generate(ids, sp)
                assert_transformers_greedy(hf, ids, got.tokens, engine.info.stop_token_ids[0], NEW)
                assert_as_plain(engine, ids, got.tokens, plain)
    finally:
        del engine.verify_tree
    crossing = [t for length, t in seen
                if any(_hidden_by_row_window(length, i, d) for i, d in enumerate(t.depths))]
    assert len(crossing) >= 10, len(crossing)


def test_batched_whole_trees_give_each_request_its_lone_tokens(windowed):
    """The batching runtime verifies whole trees of several sequences in one target_batch call (its window masks keys
    by position too) and gives each request the single-stream runtime's plain tokens."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, _ = windowed
    sp = SamplingParams(max_new_tokens=32)
    rt = BatchingRuntime(engine, max_batch=4, proposer="tree+lookup", tree_mode="full", adaptive=False)
    assert rt.batch.verifies_trees(4)
    calls = []
    target_step = rt.batch.target_step

    def spy(seqs, blocks, trees=None, greedy=None):
        calls.append(sum(t is not None and not t.is_chain for t in trees or []))
        return target_step(seqs, blocks, trees, greedy)

    rt.batch.target_step = spy
    together = rt.generate_many(prompts()[:4], sp)
    alone = [DFlashRuntime(engine).generate(p, sp, "ar").tokens for p in prompts()[:4]]
    assert len(together) == len(alone)
    for p, s, want in zip(prompts()[:4], together, alone):
        assert_as_plain(engine, p, s.tokens, want)
    assert rt.trees_verified > 0 and max(calls) >= 2


def test_sampled_walks_of_whole_trees_past_the_window_are_plain_sampling_draw_for_draw(windowed, monkeypatch):
    """Sampled requests walk whole trees (the target's draw at each node picks the child carrying it) and give plain
    sampling's tokens for the same seed. The tiny drafter is random, so the context's lookups are replaced by plain
    sampling's continuation, one branch with a wrong token at a random depth and one that leaves it: walks run
    deeper than the window and trees branch past its edge."""
    from dflash_export.decoding import prompt_lookup
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.numerics import walks_whole_trees
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, _ = windowed
    assert walks_whole_trees(engine)
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    want = {}

    def oracle_branches(self, max_tokens, with_sizes=False):
        prompt = next(p for p in want if tuple(self.tokens[:len(p)]) == p)
        cont = list(want[prompt][len(self.tokens) - len(prompt):][:max_tokens])
        if not cont:
            return []
        wrong, leaves = list(cont), list(cont)
        wrong[int(rng.integers(0, len(cont)))] += 1
        leaves[int(rng.integers(0, len(cont)))] += 2
        out = [(3, [t % vocab for t in wrong]), (2, [t % vocab for t in leaves])]
        return out if with_sizes else [b for _, b in out]

    walked = []
    verify_tree = engine.verify_tree

    def spy(seq, tree, accept=None):
        walked.append((seq.length, tree, accept is not None))
        return verify_tree(seq, tree, accept)

    monkeypatch.setattr(engine, "verify_tree", spy)
    deepest = 0
    for i, kw in enumerate([dict(temperature=0.7), dict(temperature=1.0, top_k=30, top_p=0.8)]):
        for ids in prompts()[2:4]:
            sp = SamplingParams(max_new_tokens=NEW, seed=i, **kw)
            plain = DFlashRuntime(engine).generate(ids, sp, "ar").tokens
            want[tuple(ids)] = plain
            with monkeypatch.context() as m:
                m.setattr(prompt_lookup.ContextIndex, "branches", oracle_branches)
                got = DFlashRuntime(engine, adaptive=False, proposer="tree+lookup", tree_mode="full").generate(ids, sp)
            assert_as_plain(engine, ids, got.tokens, plain, sp)
            deepest = max(deepest, *got.acceptance_lengths)
            del want[tuple(ids)]
    crossing = [t for length, t, sampled in walked if sampled
                and any(_hidden_by_row_window(length, i, d) for i, d in enumerate(t.depths))]
    assert deepest > WINDOW and len(crossing) >= 10, (deepest, len(crossing))
