"""Quantized ONNX Runtime engines (int8 / int4 MatMulNBits): lossless against their own plain decoding, and their
logits those of the target with the dequantized weights (numpy dequantization of the stored blocks, run through the
PyTorch reference model: independent of ONNX Runtime's kernels)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from target_support import assert_as_plain, assert_not_bit_identical_stated, assert_rows_as_plain

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.manifest import read_manifest
from dflash_export.engines.registry import load_engine
from dflash_export.runtime.single import DFlashRuntime

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65]]


@pytest.fixture(scope="module", params=[("tiny-qwen3", "int4"), ("tiny-llama", "int8"), ("tiny-llama", "int4")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def built(request, tmp_path_factory):
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    name, precision = request.param
    recipe = load_recipe(name)
    out = build_onnxruntime(recipe, tmp_path_factory.mktemp(name) / f"onnxruntime-{precision}", threads=1,
                            precision=precision)
    return recipe, precision, out, load_engine(out, threads=1)


def test_manifest_records_precision_quantizer_and_every_file(built):
    import onnx

    _, precision, out, _ = built
    m = read_manifest(out)
    assert m.precision == {"target": precision, "drafter": precision, "lm_head": precision,
                              "draft_head": precision}
    bits = {"int8": 8, "int4": 4}[precision]
    for role in ("target", "drafter", "lm_head"):
        q = m.raw["quantization"][role]
        assert q["quantizer"] == "onnxruntime.quantization.MatMulNBitsQuantizer"
        assert (q["bits"], q["block_size"], q["accuracy_level"]) == (bits, 32, 4) and q["matmuls_quantized"] >= 1
    num = m.raw["numerics"]  # the build's probe on this CPU: the row floor it found and its features
    assert m.flags.plain_step_rows == num["row_floor"] >= 1 and num["cpu"]["isa"] and num["onnxruntime"]
    assert "onnxruntime" in m.raw["libraries"]
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(m.files) == on_disk
    for fname in ("target.onnx", "lm_head.onnx"):
        model = onnx.load(str(out / fname), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert nodes and not [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
        for n in nodes:
            attrs = {a.name: a.i for a in n.attribute}
            assert attrs["bits"] == bits and attrs["accuracy_level"] == 4 and attrs["block_size"] == 32


def test_greedy_dflash_equals_the_engine_s_own_ar(built):
    _, _, _, eng = built
    for adaptive in (True, False):
        rt = DFlashRuntime(eng, adaptive=adaptive)
        for prompt in PROMPTS:
            sp = SamplingParams(max_new_tokens=40)
            assert_as_plain(eng, prompt, rt.generate(prompt, sp, "dflash").tokens, rt.generate(prompt, sp, "ar").tokens)


def test_accepting_blocks_commit_what_plain_decoding_would(built):
    """The tiny drafter is random, so drafts here are the engine's own AR continuation with one token corrupted at a
    random slot: every accept length, and the K/V rows a verify leaves behind, meet the plain decoding's tokens."""
    _, _, _, eng = built
    bs = eng.info.block_size
    rt = DFlashRuntime(eng, adaptive=False)
    rng = np.random.default_rng(0)
    for prompt in PROMPTS[:2]:
        ar = rt.generate(prompt, SamplingParams(max_new_tokens=60), "ar").tokens
        true_draft = eng.draft

        def oracle_draft(seq, anchor, sp, uniforms, block_len=None, ar=ar, n=len(prompt)):
            true_draft(seq, anchor, sp, uniforms, block_len=block_len)  # keeps the drafter's context cache in step
            done = seq.length - n + 1  # tokens committed so far (the anchor is the last of them)
            n_draft = (block_len or bs) - 1  # the last block is shortened to what the request still needs
            cont = list(ar[done:done + n_draft]) + [0] * bs
            d = np.array(cont[:n_draft], np.int64)
            k = int(rng.integers(0, n_draft + 1))
            if k < n_draft:
                d[k] = (d[k] + 1) % eng.info.vocab_size
            return d, None

        eng.draft = oracle_draft
        try:
            got = rt.generate(prompt, SamplingParams(max_new_tokens=60), "dflash")
        finally:
            del eng.draft
        assert_as_plain(eng, prompt, got.tokens, ar)
        assert max(got.acceptance_lengths) > 2, prompt


def test_verify_rows_agree_with_plain_steps_as_the_engine_states_for_this_cpu(built):
    """What makes the engine lossless at T>0 too: the logits a verify block gives each position are the very logits
    plain decoding computes there, bit for bit -- on this CPU, as the engine's load-time probe states (a prompt and
    a block the probe never saw; every row count a verify step takes)."""
    _, _, _, eng = built
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 200, 23)
    block = rng.integers(3, 200, eng.info.block_size)
    s2 = eng.new_sequence()
    eng.prefill(s2, prompt)
    plain = np.stack([eng.decode(s2, int(t)) for t in block])
    worst = 0.0
    for m in range(1, len(block) + 1):
        s1 = eng.new_sequence()
        eng.prefill(s1, prompt)
        hidden, _ = eng._run_target(s1, block[:m], m)
        worst = max(worst, float(np.abs(eng._logits(hidden) - plain[:m]).max()))
    num = eng.numerics
    assert num.cpu["isa"] and num.row_floor == read_manifest(built[2]).flags.plain_step_rows
    if num.bit_identical:
        assert worst == 0.0, num.statement
    else:  # the engine must not claim what this CPU does not give
        assert "lossless within kernel numerics" in num.statement and num.max_abs_diff > 0


def _resident_weight_kb(engine_dir) -> int:
    """kB of this process's resident pages that belong to mappings of the engine's *.data files (from smaps)."""
    from pathlib import Path

    root = str(Path(engine_dir).resolve())
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
            ours = len(head) >= 6 and head[5].startswith(root) and head[5].endswith(".data")
        elif ours and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_weight_file_pages_are_given_back_and_change_no_output(built):
    """ONNX Runtime keeps MatMulNBits' block scales mapped (and resident) after packing them into its own buffer; the
    engine gives those file pages back at load (20 MB of SmolLM2's 94 MB at int4) -- and decodes exactly as an engine
    that keeps them: the same logits bit for bit, the same DFlash tokens."""
    _, _, out, _ = built
    sp = SamplingParams(max_new_tokens=24)

    def outputs(engine):
        res = []
        for prompt in PROMPTS[:2]:
            seq = engine.new_sequence()
            res.append(engine.prefill(seq, np.array(prompt)))
            res.extend(engine.decode(seq, t) for t in (5, 9, 11))
            res.append(np.array(DFlashRuntime(engine).generate(prompt, sp, "dflash").tokens))
        return res

    kept = load_engine(out, threads=1, release_pages=False)
    assert kept.released_bytes == 0 and _resident_weight_kb(out) > 0  # what ORT leaves resident by itself
    want = outputs(kept)  # before anything is released
    eng = load_engine(out, threads=1)
    assert eng.released_bytes > 0 and _resident_weight_kb(out) == 0
    for w, g in zip(want, outputs(eng), strict=True):
        np.testing.assert_array_equal(w, g)


def _dequantize(model, name_prefix: str, base_dir) -> np.ndarray:
    """W [K, N] float64 from a MatMulNBits node's blocks, per the com.microsoft.MatMulNBits contract: B [N, K/bs,
    bs*bits/8] uint8 (low nibble first for 4 bits), scales [N * K/bs], zero points packed likewise
    (default 2^(bits-1))."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1] == name_prefix)
    attrs = {a.name: a.i for a in node.attribute}
    K, N, bits, bsz = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    nb = -(-K // bsz)
    B = numpy_helper.to_array(inits[node.input[1]], base_dir=base_dir).reshape(N, nb, -1)
    scales = numpy_helper.to_array(inits[node.input[2]], base_dir=base_dir).astype(np.float64).reshape(N, nb)
    if bits == 4:
        q = np.stack([B & 0x0F, B >> 4], axis=-1).reshape(N, nb, bsz)
    else:
        q = B.reshape(N, nb, bsz)
    zp = np.full((N, nb), 2 ** (bits - 1), np.float64)
    if len(node.input) > 3 and node.input[3]:
        z = numpy_helper.to_array(inits[node.input[3]], base_dir=base_dir).reshape(N, -1)
        zp = (np.stack([z & 0x0F, z >> 4], axis=-1).reshape(N, -1)[:, :nb] if bits == 4 else z[:, :nb]).astype(
            np.float64)
    w = (q.astype(np.float64) - zp[..., None]) * scales[..., None]
    return w.reshape(N, nb * bsz)[:, :K].T


def test_logits_match_the_dequantized_weights_in_the_pytorch_reference(built):
    """Put the numpy-dequantized weights of target.onnx / lm_head.onnx into the PyTorch reference target: the engine's
    logits are those (up to its int8 activations), much closer than to the fp32 weights' logits."""
    import onnx
    import torch

    from dflash_export.models import load_target

    recipe, precision, out, eng = built
    target = load_target(recipe.target_path, torch.float32)
    tmodel = onnx.load(str(out / "target.onnx"), load_external_data=False)
    hmodel = onnx.load(str(out / "lm_head.onnx"), load_external_data=False)
    sd = target.hf.state_dict()
    new = {}
    for i in range(target.hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = _dequantize(tmodel, p + "self_attn.qkv_proj_Q" + precision[-1], str(out)).T
        q_out = sd[p + "self_attn.q_proj.weight"].shape[0]
        kv_out = sd[p + "self_attn.k_proj.weight"].shape[0]
        new[p + "self_attn.q_proj.weight"] = qkv[:q_out]
        new[p + "self_attn.k_proj.weight"] = qkv[q_out:q_out + kv_out]
        new[p + "self_attn.v_proj.weight"] = qkv[q_out + kv_out:]
        new[p + "self_attn.o_proj.weight"] = _dequantize(tmodel, p + "self_attn.o_proj_Q" + precision[-1],
                                                         str(out)).T
        gu = _dequantize(tmodel, p + "mlp.gate_up_proj_Q" + precision[-1], str(out)).T
        inter = gu.shape[0] // 2
        new[p + "mlp.gate_proj.weight"], new[p + "mlp.up_proj.weight"] = gu[:inter], gu[inter:]
        new[p + "mlp.down_proj.weight"] = _dequantize(tmodel, p + "mlp.down_proj_Q" + precision[-1], str(out)).T
    head = _dequantize(hmodel, "lm_head_weight_Q" + precision[-1], str(out)).T  # [V, H]
    prompt = list(range(10, 41))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        fp32_logits = target.hf(ids).logits[0, -1].double().numpy()
        for k, v in new.items():
            sd[k].copy_(torch.from_numpy(v).float())
        hidden = target.hf.model(ids).last_hidden_state[0, -1].double().numpy()
    ref = head @ hidden
    got = eng.prefill(eng.new_sequence(), np.array(prompt)).astype(np.float64)
    err, err_fp32 = np.abs(got - ref).max(), np.abs(got - fp32_logits).max()
    scale = np.abs(ref).max()
    assert err <= 0.05 * scale, (err, scale)
    assert err < (0.5 if precision == "int4" else 0.8) * err_fp32, (err, err_fp32)  # int8 weights: near fp32
    assert json.loads((out / "manifest.json").read_text())["precision"]["lm_head"] == precision


def test_whole_trees_in_a_batch_equal_plain_decoding(built):
    """Quantized engines, tree_mode "full" under continuous batching (every node verified, trees of several
    sequences in one call, walked sampled requests beside greedy and plain ones): each request's tokens are plain
    decoding's of the request alone (greedy: the engine's own `ar`; sampled: plain sampling with the same seed)
    where the build's numerics probe found tree rows bit-identical to plain steps on this CPU. Where it did not (a
    tree row attends past masked keys; int8 activations turn last-bit differences into ~1e-2 on the logits), a
    greedy request that parts from plain decoding parts as the single-stream runtime's whole trees do: the flip is
    the engine's tree numerics, not batching. Where the probe found no verify rows bit-identical either, every
    request is held to what the engine states (target_support.assert_as_plain)."""
    from dflash_export.runtime.batching import BatchingRuntime

    _, _, _, eng = built
    single = DFlashRuntime(eng)
    full = DFlashRuntime(eng, proposer="tree+lookup", tree_mode="full", adaptive=False)
    jobs = [(p, SamplingParams(max_new_tokens=40), "dflash") for p in PROMPTS]
    jobs[1] = (PROMPTS[1], SamplingParams(max_new_tokens=40), "ar")
    jobs.append((PROMPTS[3], SamplingParams(max_new_tokens=32, temperature=0.7, top_k=20, top_p=0.95, seed=4),
                 "dflash"))
    rt = BatchingRuntime(eng, max_batch=3, proposer="tree+lookup", tree_mode="full", adaptive=False)
    reqs = [rt.submit(p, sp, m) for p, sp, m in jobs]
    while not rt.idle:
        rt.step()
    assert rt.trees_verified > 0
    exact = eng.numerics.tree_bit_identical
    flips = 0
    for req, (p, sp, _) in zip(reqs, jobs):
        want = single.generate(p, sp, "ar").tokens
        if exact or not sp.greedy or req.stats.tokens == want or not eng.numerics.bit_identical:
            assert_as_plain(eng, p, req.stats.tokens, want, sp)
            continue
        flips += 1
        assert full.generate(p, sp).tokens != want, (p, "only the batched trees part from plain decoding")
    assert flips <= 1


def _drafting_the_answers(eng, answers: list[list[int]]) -> None:
    """Make the drafter propose the continuation of whichever of `answers` (prompt + its plain answer) the sequence
    is on: that token on top of every slot, but on every third one second to another (a sibling a walk must take off
    the tree's first path). Its logits stay the drafter's elsewhere; the target still decides every token."""
    inner = eng.drafts_from_logits

    def drafts_from_logits(seq, logits, selector_hidden, anchor, sp, uniforms):
        logits = np.array(logits, np.float32)
        full = next((f for f in answers if seq.length + 1 < len(f) and f[seq.length] == anchor), None)
        for d in range(logits.shape[0] if full is not None else 0):
            if seq.length + 1 + d < len(full):
                top, rival = float(logits[d].max()), int(np.argsort(-logits[d])[0])
                if (seq.length + d) % 3 == 0 and rival != full[seq.length + 1 + d]:
                    logits[d, rival] = top + 3.0
                logits[d, full[seq.length + 1 + d]] = top + 2.5
        return inner(seq, logits, selector_hidden, anchor, sp, uniforms)

    eng.drafts_from_logits = drafts_from_logits


def test_sampled_walks_on_a_quantized_target_take_best_paths_and_draw_plain_sampling_s_tokens(built):
    """A quantized target's products round their activations to int8, and the last bits a whole-tree pass leaves in
    the K/V rows of its accepted path flip that rounding steps later, however close the probe found the tree's rows
    (7e-7 on these engines, then 1e-2 and more forty tokens into a walk: other draws than plain sampling's on 5-9 of
    96 walks, and 3-8 of 192 batched requests). So sampled walks verify best paths here, alone and in a batch with
    tree_mode "full" beside greedy requests that verify whole trees, with a drafter that proposes each request's own
    answer so that walks run deep: every sampled request draws plain sampling's tokens (alone: the engine's plain
    sampling; batched: plain batched sampling of the request alone)."""
    from dflash_export.runtime.batching import BatchingRuntime

    _, _, _, eng = built
    rng = np.random.default_rng(3)
    prompts = PROMPTS + [[int(t) for t in rng.integers(1, 250, 9)] for _ in range(2)]
    sps = [SamplingParams(max_new_tokens=40, temperature=t, top_k=k, top_p=p, seed=i)
           for i, (t, k, p) in enumerate([(0.7, 0, 1.0), (1.0, 20, 0.95), (0.7, 2, 1.0), (1.0, 0, 1.0),
                                          (0.7, 20, 0.95), (0.7, 0, 1.0)])]
    alone = [DFlashRuntime(eng).generate(p, sp, "ar").tokens for p, sp in zip(prompts, sps)]
    batched = [BatchingRuntime(eng, max_batch=1).generate_many([p], [sp], "ar")[0].tokens
               for p, sp in zip(prompts, sps)]
    greedy, looped = SamplingParams(max_new_tokens=40), [5, 6, 7, 8] * 6
    answer = DFlashRuntime(eng).generate(looped, greedy, "ar").tokens
    trees, accepted = [], 0
    exact = eng.numerics.bit_identical  # else a walk parts from its answer at a near-tie, and its drafts miss after
    real_verify_tree = eng.verify_tree
    try:
        _drafting_the_answers(eng, [p + a for p, a in zip(prompts, alone)])
        eng.verify_tree = lambda *a, **k: trees.append(1) or real_verify_tree(*a, **k)
        rt = DFlashRuntime(eng, proposer="tree+lookup", adaptive=False)
        for p, sp, want in zip(prompts, sps, alone):
            got = rt.generate(p, sp)
            assert_as_plain(eng, p, got.tokens, want, sp)
            accepted += got.accepted_tokens
        assert rt.sampled_tree_mode == "spine" and not trees and accepted > (100 if exact else 10)
        del eng.verify_tree, eng.drafts_from_logits

        _drafting_the_answers(eng, [p + a for p, a in zip(prompts, batched)] + [looped + answer])
        rt = BatchingRuntime(eng, max_batch=4, proposer="tree+lookup", tree_mode="full", adaptive=False)
        target_step = rt.batch.target_step

        def spy(seqs, blocks, trees_=None, greedy_=None):
            trees.extend(g for t, g in zip(trees_, greedy_) if t is not None and not t.is_chain)
            return target_step(seqs, blocks, trees_, greedy_)

        rt.batch.target_step = spy
        reqs = [rt.submit(p, sp) for p, sp in zip(prompts, sps)] + [rt.submit(looped, greedy)]
        while not rt.idle:
            rt.step()
        for r, p, sp, want in zip(reqs, prompts, sps, batched):
            assert_as_plain(eng, p, r.stats.tokens, want, sp)
        assert trees and all(trees)  # whole trees for the greedy request only
        assert sum(r.stats.accepted_tokens for r in reqs[:-1]) > (10 if exact else 0)
    finally:
        eng.__dict__.pop("verify_tree", None)
        eng.__dict__.pop("drafts_from_logits", None)


def test_a_request_s_batched_logits_do_not_depend_on_the_requests_beside_it(built):
    """The same request decoded in two batches whose other requests differ (prompts, slots, the K/V room they reserve,
    blocks of several rows beside its one-row steps) and in a batch of its own gets bit-identical logits at every
    step, so identical tokens. Before the batched buffers' length was kept to a multiple of 64 the room other
    requests reserved moved the lanes of the softmax's sum (1e-6 on these logits, 0.6-1.0 on SmolLM2 int4's), and a
    sequence alone ran the GQA graph (docs/numerics.md)."""
    from dflash_export.engines.ort_batch import BatchedOrtEngine

    _, _, _, eng = built
    x = PROMPTS[1]

    def decode(companions: list[tuple[list[int], int, int]], at: int) -> tuple[list[int], np.ndarray]:
        batch = BatchedOrtEngine(eng, max_batch=8)
        jobs = list(companions)
        jobs.insert(at, (x, 100, 1))
        seqs = [batch.add(room) for _, room, _ in jobs]
        last = [int(np.argmax(lg)) for lg in batch.prefill(seqs, [p for p, _, _ in jobs])]
        tokens, rows = [last[at]], []
        for step in range(16):
            blocks = [[last[i]] + [(7 * step + i) % 50 + 3] * (n - 1) for i, (_, _, n) in enumerate(jobs)]
            logits = batch.target_step(seqs, blocks)
            for i, seq in enumerate(seqs):
                batch.commit(seq, 0)
                last[i] = int(np.argmax(logits[i][0]))
            tokens.append(last[at])
            rows.append(logits[at][0])
        return tokens, np.stack(rows)

    a_tokens, a_logits = decode([(PROMPTS[0], 100, 1)], 0)
    b_tokens, b_logits = decode([(PROMPTS[2], 133, 4), (PROMPTS[3], 150, 1), (PROMPTS[0], 90, 6)], 2)
    alone_tokens, alone_logits = decode([], 0)
    if eng.numerics.bit_identical:
        assert b_tokens == a_tokens == alone_tokens
    else:  # rows agree as the engine states, up to the step whose near-tie (if any) sends the tokens apart
        assert_not_bit_identical_stated(eng)
    for tokens, logits in ((b_tokens, b_logits), (alone_tokens, alone_logits)):
        same = next((i for i, (x, y) in enumerate(zip(tokens, a_tokens)) if x != y), len(tokens))
        assert same > 0  # the prefill's token
        assert_rows_as_plain(eng, logits[:same], a_logits[:same])


def test_a_chain_verified_in_one_batched_call_gets_the_rows_of_one_token_steps(built):
    """A sequence's logits are a function of its tokens, not of how they were split into target calls: a block of
    four tokens verified in one batched call and committed gives, row for row, bit for bit, what the same tokens
    give stepped one at a time (plain decoding), with another sequence of another length in the same calls. Greedy
    DFlash under continuous batching equals plain decoding only so. Before the block's keys were placed in the
    buffer at their slots, the key of a committed token moved from the block's softmax sum to the past's, and the
    rows differed in their last bits (tokens on SmolLM2 int4)."""
    from dflash_export.engines.ort_batch import BatchedOrtEngine

    _, _, _, eng = built
    x, other = PROMPTS[1], PROMPTS[3]
    chain = [11, 23, 5, 42]

    def rows(split: list[int]) -> np.ndarray:
        batch = BatchedOrtEngine(eng, max_batch=4)
        seqs = [batch.add(100), batch.add(120)]
        batch.prefill(seqs, [x, other])
        out, at = [], 0
        for n in split:
            logits = batch.target_step(seqs, [chain[at:at + n], [7 + at] * n])
            for seq in seqs:
                batch.commit(seq, n - 1)
            out.append(logits[0][:n])
            at += n
        return np.concatenate(out)

    whole, steps, halves = rows([4]), rows([1, 1, 1, 1]), rows([2, 2])
    assert_rows_as_plain(eng, whole, steps)  # bit for bit where the engine's probe found its verify rows so
    assert_rows_as_plain(eng, halves, steps)


def test_deploying_a_quantized_engine_in_a_shared_batch_says_its_answers_can_differ_from_run(built, tmp_path):
    """A shared batch decodes through the batched graph, whose attention rounds differently from `run`'s in the last
    bits; int8-quantized activations turn that into other tokens on real models (docs/serving.md). `deploy` says so
    where a batch is shared, and not for one request at a time, which answers as `run` does; the repository's marker
    records the precision, from which `serve` says it again at every start."""
    from deploy_support import cli

    from dflash_export.deploy.repository import MARKER, shared_batch_note

    _, precision, out, _ = built
    shared, alone = (cli("deploy", "--engine", out, "--repo", tmp_path / f"repo-{b}", "--max-batch", b, timeout=300)
                     for b in (4, 1))
    assert shared.returncode == 0 and alone.returncode == 0, (shared.stderr, alone.stderr)
    assert f"this {precision} engine" in shared.stdout and "--max-batch 1 answers as run does" in shared.stdout
    assert "note:" not in alone.stdout
    marker = json.loads((tmp_path / "repo-4" / MARKER).read_text())
    assert shared_batch_note(marker["precision"], marker["max_batch"]) in shared.stdout
