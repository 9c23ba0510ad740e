"""Hybrid targets (Gated DeltaNet linear attention between gated full attention) through every CPU stage built so far,
against transformers' own model classes as the oracle, on tiny random models built from their config classes:
Qwen3.5 (a composite vision + text checkpoint, as published), Qwen3.5-MoE (composite; experts + a shared expert) and
Qwen3-Next (text only; fused projections grouped per key head, experts + a shared expert, one dense layer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from target_support import (
    assert_as_plain,
    assert_transformers_greedy,
    check_greedy_tokens_against_transformers,
    engine_and_transformers,
    inspect_pair,
    prompts,
    validate_sampled,
    worst_logit_gap,
)
from test_batching import _oracle_drafts

from dflash_export.engines.base import SamplingParams
from dflash_export.errors import DFlashError
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("onnxruntime")
NEW = 64

FAMILIES = {"tiny-qwen3.5": "Qwen3_5ForCausalLM", "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM",
            "tiny-qwen3-next": "Qwen3NextForCausalLM"}
KINDS = ["linear_attention", "linear_attention", "full_attention"] * 2


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(tmp_path_factory, request):
    recipe, engine_dir, engine, hf = engine_and_transformers(request.param, tmp_path_factory.mktemp("hybrid"))
    yield recipe, engine_dir, engine, hf
    engine.close()


@pytest.mark.parametrize("recipe_name", list(FAMILIES))
def test_layer_kinds_and_linear_shapes_come_from_transformers_config_classes(recipe_name):
    """Both config forms: the composite checkpoints' settings under text_config (vision ignored) read as the
    text-only ones; the layer kinds and Gated DeltaNet sizes are what transformers' config class derived."""
    from dflash_export.models.arch import ARCHS
    from dflash_export.models.rope import hf_config
    from dflash_export.models.target import read_target_config

    target = resolve_source(load_recipe(recipe_name).target)
    raw = json.loads((target / "config.json").read_text())
    cfg, path = read_target_config(target)
    assert cfg["model_type"] == raw["model_type"] and cfg["num_hidden_layers"] == 6 and cfg["hidden_size"] == 64
    assert ("text_config" in raw) == (recipe_name != "tiny-qwen3-next") and "vision_config" not in cfg
    arch = ARCHS[cfg["model_type"]]
    hf_cfg = hf_config(cfg, path, cfg["model_type"])
    assert arch.hybrid.layer_kinds(hf_cfg) == KINDS
    assert arch.hybrid.linear_shapes(hf_cfg) == {"key_heads": 2, "value_heads": 4, "key_dim": 16, "value_dim": 8,
                                                 "conv_kernel": 4, "conv_channels": 2 * 2 * 16 + 4 * 8}
    assert hf_cfg.rope_parameters["partial_rotary_factor"] == 0.25
    assert cfg["stop_token_ids"] == [254]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_text_only_config_forms_are_read(tmp_path, model_type):
    from dflash_export.models.arch import ARCHS
    from dflash_export.models.rope import hf_config
    from dflash_export.models.target import read_target_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": model_type, "num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 64,
        "full_attention_interval": 2, "eos_token_id": 3}))
    cfg, path = read_target_config(tmp_path)
    kinds = ARCHS[model_type].hybrid.layer_kinds(hf_config(cfg, path, model_type))
    assert kinds == ["linear_attention", "full_attention"] * 2


def test_engine_greedy_tokens_equal_transformers_generate(hybrid):
    """5 prompts x 64 tokens (past the 4-tap conv window many times): plain decoding and DFlash on the ONNX Runtime
    engine both give transformers' own greedy tokens."""
    _, _, engine, hf = hybrid
    check_greedy_tokens_against_transformers(engine, hf, NEW)


def test_verify_blocks_with_rejections_commit_only_the_accepted_state(hybrid):
    """Blocks of plain decoding's next tokens (transformers' greedy ones) with one wrong token planted at a varying
    place: each verify accepts exactly the right prefix, and the tokens after every partial acceptance stay plain
    decoding's (the conv window and recurrent state of a rejected draft leave no trace) -- as the engine's numerics
    probe states for this CPU: where it found no bit-identical row floor, a verify may part from plain decoding at a
    near-tie (target_support.assert_as_plain), and the blocks end there."""
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, hf = hybrid
    ids = prompts()[3]
    want = DFlashRuntime(engine).generate(ids, SamplingParams(max_new_tokens=NEW), "ar").tokens
    assert_transformers_greedy(hf, ids, want, engine.info.stop_token_ids[0], NEW)
    bs = engine.info.block_size
    seq = engine.new_sequence(len(ids) + NEW + bs)
    out = [int(np.argmax(engine.prefill(seq, np.asarray(ids, np.int64))))]
    rng = np.random.default_rng(3)
    accepts = []
    while len(out) < len(want) - bs:
        drafts = list(want[len(out):len(out) + bs - 1])
        wrong = int(rng.integers(0, bs))  # bs - 1: every draft right
        if wrong < bs - 1:
            drafts[wrong] = (drafts[wrong] + 1) % 250
        accept, emitted = engine.verify(seq, np.asarray([out[-1]] + drafts, np.int64), None, SamplingParams(), None)
        if emitted != want[len(out):len(out) + len(emitted)]:
            assert_as_plain(engine, ids, out + emitted, want[:len(out) + len(emitted)])
            break
        assert accept == wrong, (accept, wrong)
        accepts.append(accept)
        out.extend(emitted)
    else:
        assert out == want[:len(out)] and len(set(accepts)) == bs and seq.length == len(ids) + len(out) - 1


def test_each_steps_logits_match_transformers_forward(hybrid):
    _, _, engine, hf = hybrid
    worst = worst_logit_gap(engine, hf, prompts()[2], steps=16)
    assert worst <= 1e-4, worst


def test_spine_trees_work_and_full_trees_are_refused_by_name(hybrid):
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, _ = hybrid
    sp = SamplingParams(max_new_tokens=24)
    ids = prompts()[1]
    plain = DFlashRuntime(engine).generate(ids, sp, "ar").tokens
    got = DFlashRuntime(engine, proposer="tree+lookup", tree_mode="spine").generate(ids, sp).tokens
    assert_as_plain(engine, ids, got, plain)
    assert not engine.tree_verify
    with pytest.raises(DFlashError) as e:
        DFlashRuntime(engine, proposer="tree", tree_mode="full")
    assert e.value.field == "tree_mode"


def test_the_state_after_an_accepted_row_is_the_scans_own_bit_for_bit():
    """The host's commit of row r (the committed state with rows 0..r's key / decay / delta updates applied) gives
    the bits ONNX Runtime's Scan of the gated delta rule gives when run over rows 0..r alone, for every r and for
    each sequence of a batch."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dflash_export.engines.onnxruntime import committed_linear
    from dflash_export.export.linear_attention import _scan_body

    b, s, hv, dk, dv = 2, 7, 3, 8, 5
    f = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)  # noqa: E731
    scan = helper.make_node("Scan", ["in_state", "in_qk", "in_v", "in_decay", "in_beta"],
                            ["res_last", "res_out", "res_delta"], body=_scan_body(hv, dk, dv), num_scan_inputs=4)
    graph = helper.make_graph([scan], "scan", [f("in_state", [b, hv, dk, dv]), f("in_qk", ["s", b, hv, 2, dk]),
                                               f("in_v", ["s", b, hv, 1, dv]), f("in_decay", ["s", b, hv]),
                                               f("in_beta", ["s", b, hv])],
                              [f("res_last", [b, hv, dk, dv]), f("res_out", ["s", b, hv, 1, dv]),
                               f("res_delta", ["s", b, hv, 1, dv])])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    feeds = {"in_state": rng.standard_normal((b, hv, dk, dv), np.float32),
             "in_qk": rng.standard_normal((s, b, hv, 2, dk), np.float32) / 3,
             "in_v": rng.standard_normal((s, b, hv, 1, dv), np.float32),
             "in_decay": rng.uniform(0.5, 1.0, (s, b, hv)).astype(np.float32),
             "in_beta": rng.uniform(0.0, 1.0, (s, b, hv)).astype(np.float32)}
    last, _, delta = sess.run(None, feeds)
    outs = (np.zeros((b, 4, 3 + s), np.float32), last, feeds["in_qk"][:, :, :, 1].transpose(1, 0, 2, 3).copy(),
            feeds["in_decay"].transpose(1, 0, 2).copy(), delta)
    for r in range(s):
        rows = {k: v[: r + 1] for k, v in feeds.items() if k != "in_state"}
        alone = sess.run(["res_last"], {**feeds, **rows})[0]
        for i in range(b):
            _, state = committed_linear(np.zeros((4, 3), np.float32), feeds["in_state"][i].copy(), outs, i, r)
            np.testing.assert_array_equal(state, alone[i])


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_batched_prefill_and_verify_rows_match_transformers_per_sequence(hybrid):
    """Prompts of 3..150 tokens (past two prefill chunks) prefilled in one batch, then three steps in which every
    sequence verifies a block of its own length (1..bs rows, transformers' continuation, often with a wrong draft)
    and commits its own accepted prefix: every real row's logits are transformers' at that position, so each slot's
    conv window and recurrent state are its own sequence's after exactly its accepted rows."""
    from dflash_export.engines.onnxruntime import HYBRID_PREFILL_ROWS
    from dflash_export.engines.ort_batch import BatchedOrtEngine

    _, _, engine, hf = hybrid
    bs = engine.info.block_size
    ps = prompts() + [list(map(int, np.random.default_rng(11).integers(1, 250, size=150)))]
    assert len(ps[-1]) > 2 * HYBRID_PREFILL_ROWS
    batch = BatchedOrtEngine(engine, max_batch=len(ps))
    seqs = [batch.add(len(p) + 4 * bs) for p in ps]
    worst = 0.0
    for p, row in zip(ps, batch.prefill(seqs, ps)):
        worst = max(worst, float(np.abs(row - _hf_logits(hf, p)[-1]).max()))
    done = [list(p) for p in ps]  # each sequence's committed tokens
    for step in range(3):
        blocks = []
        for i, d in enumerate(done):
            blk = []  # anchor + drafts: transformers' greedy continuation, one draft made wrong in two of three
            while len(blk) < 1 + (i + step) % bs:
                blk.append(int(np.argmax(_hf_logits(hf, d + blk)[-1])))
            if len(blk) > 1 and (i + step) % 3:
                wrong = 1 + (i + step) % (len(blk) - 1)
                blk[wrong] = (blk[wrong] + 1) % 250
            blocks.append(blk)
        got = batch.target_step(seqs, [np.asarray(b, np.int64) for b in blocks])
        for seq, d, blk, lg in zip(seqs, done, blocks, got):
            ref = _hf_logits(hf, d + blk)[len(d): len(d) + len(blk)]  # row r: the token after blk[r]
            worst = max(worst, float(np.abs(lg - ref).max()))
            accept = 0
            while accept + 1 < len(blk) and blk[accept + 1] == int(np.argmax(lg[accept])):
                accept += 1
            batch.commit(seq, accept)
            d.extend(blk[: accept + 1])
    assert worst <= 1e-4, worst


def test_continuous_batching_greedy_tokens_equal_transformers_and_plain_alone(hybrid):
    """Six requests (DFlash and plain, one prompt past two prefill chunks) through a batch of at most 3 that they
    join and leave between steps, verifying blocks with rejections at every length: each request's tokens are
    transformers' greedy ones and those of plain decoding of the request alone."""
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, hf = hybrid
    stop = engine.info.stop_token_ids[0]
    ps = prompts() + [list(map(int, np.random.default_rng(11).integers(1, 250, size=150)))]
    single = DFlashRuntime(engine)
    want = [single.generate(p, SamplingParams(max_new_tokens=32), "ar").tokens for p in ps]
    for p, w in zip(ps, want):
        assert_transformers_greedy(hf, p, w, stop, 32)
    rt = BatchingRuntime(engine, max_batch=3)
    conts, true_add, order = {}, rt.batch.add, iter(range(len(ps)))

    def add(max_tokens):
        seq = true_add(max_tokens)
        i = next(order)
        conts[id(seq)] = (want[i], len(ps[i]))
        return seq

    rt.batch.add = add
    _oracle_drafts(rt.batch, conts, np.random.default_rng(0))  # one wrong token at a random slot, confidently
    sps = [SamplingParams(max_new_tokens=32 - 5 * (i % 3)) for i in range(len(ps))]
    modes = ["dflash", "dflash", "ar"] * 2
    reqs = [rt.submit(p, sp, m) for p, sp, m in zip(ps, sps, modes)]
    widths = []
    while not rt.idle:
        rt.step()
        widths.append(len(rt.active))
    for req, p, sp in zip(reqs, ps, sps):
        assert_as_plain(engine, p, req.stats.tokens, single.generate(p, sp, "ar").tokens)
    lengths = {n for r, m in zip(reqs, modes) if m == "dflash" for n in r.stats.acceptance_lengths}
    assert max(widths) == 3 and len(lengths) > 2, lengths


@pytest.mark.parametrize("sampling", ["walk", "chain"])
def test_sampled_requests_in_a_hybrid_batch_are_plain_sampling_draw_for_draw(hybrid, sampling):
    """Sampled requests (T 0.7 and 1.0, with and without top-k / top-p) beside a greedy one in one batch: walked
    ones emit plain sampled decoding's tokens of the request alone with the same seed; the drafter's own sampled
    chain ("chain") emits the single-stream runtime's, draw for draw."""
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, _ = hybrid
    ps = prompts()
    settings = [(0.7, 0, 1.0), (1.0, 20, 0.95), (0.7, 20, 0.95), (1.0, 0, 1.0)]
    jobs = [(ps[i], SamplingParams(max_new_tokens=24, temperature=t, top_k=k, top_p=p, seed=i))
            for i, (t, k, p) in enumerate(settings)]
    jobs.append((ps[4], SamplingParams(max_new_tokens=24)))
    rt = BatchingRuntime(engine, max_batch=4, sampling=sampling)
    reqs = [rt.submit(p, sp) for p, sp in jobs]
    while not rt.idle:
        rt.step()
    single = DFlashRuntime(engine, sampling=sampling)
    for req, (p, sp) in zip(reqs, jobs):
        want = single.generate(p, sp, "ar" if sampling == "walk" else "dflash").tokens
        assert_as_plain(engine, p, req.stats.tokens, want, sp)


@pytest.mark.server
@pytest.mark.parametrize("hybrid", ["tiny-qwen3.5"], indirect=True)
def test_serve_batches_a_hybrid_engine_and_answers_as_run(hybrid, tmp_path):
    """The tiny Qwen3.5 engine deployed with a shared batch of 4 behind the real tritonserver: concurrent clients and
    a stream get the text of the same request run on the engine in this process."""
    from deploy_support import PROMPTS, concurrent_infer, exact_on_this_cpu, run_direct, stream_equals_direct

    from dflash_export.deploy.handler import RequestRunner
    from dflash_export.deploy.repository import write_repository
    from dflash_export.deploy.server import TritonServer, free_loopback_ports
    from dflash_export.runtime.single import DFlashRuntime

    _, engine_dir, engine, _ = hybrid
    repo = write_repository(engine_dir, tmp_path / "repo", instances=1, max_queue_size=64, max_batch=4,
                            max_queued_tokens=4096)
    direct = RequestRunner(DFlashRuntime(engine))
    requests = [(PROMPTS[i % len(PROMPTS)] + str(i).encode(), 8 + (i * 7) % 25) for i in range(8)]
    alone = {r: run_direct(direct, text_input=r[0], max_tokens=np.array([r[1]], np.int32)) for r in requests}
    srv = TritonServer(repo, *free_loopback_ports(3), ready_timeout_s=240)
    srv.start()
    try:
        results = concurrent_infer(srv, requests, clients=4, per_client=3, network_timeout=180, join_timeout=300)
        assert len(results) == 12
        exact = exact_on_this_cpu(direct)  # else a batched answer may part from the lone one at a near-tie
        for r, out in results.values():
            want = alone[r]
            assert (out["text"], out["finish_reason"], out["completion_tokens"]) == (
                want.text, want.finish_reason, want.completion_tokens) or not exact, r
        stream_equals_direct(srv, direct, "a hybrid streams", 20, exact=exact)
    finally:
        srv.stop()


@pytest.mark.parametrize("recipe_name", list(FAMILIES))
def test_inspect_reads_the_pair_with_no_finding(recipe_name):
    recipe = load_recipe(recipe_name)
    out = inspect_pair(recipe)
    assert out["ok"] and out["findings"] == [], out["findings"]


def test_pytorch_reference_rolls_a_hybrid_back_to_the_accepted_prefix(hybrid):
    """The yardstick's DFlash loop (reference.spec_generate) on a hybrid: transformers' Gated DeltaNet cache cannot
    be cropped, so each verify restores a snapshot and re-runs the accepted rows; its tokens are plain greedy's."""
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.target import load_target
    from dflash_export.runtime.reference import spec_generate

    recipe, _, engine, hf = hybrid
    target = load_target(recipe.target_path)
    drafter = load_drafter(recipe.drafter_path)
    ids = prompts()[0]
    got = spec_generate(drafter, target, ids, max_new_tokens=24).tokens
    assert_transformers_greedy(hf, ids, got, engine.info.stop_token_ids[0], 24)


def test_sampled_output_keeps_the_target_distribution(hybrid, tmp_path):
    """validate's G-test at T = 0.7 on the hybrid engine (DFlash sampling against the engine's own conditionals)."""
    recipe, engine_dir, _, _ = hybrid
    dist, stdout, exact = validate_sampled(recipe, engine_dir, tmp_path / "rep")
    assert dist["distribution_p_value"]["passed"], stdout
    assert dist["identical_fraction"]["value"] == 1.0 or not exact, stdout


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_hybrid_engine_decodes_dflash_as_plain(tmp_path, precision):
    """int8 / int4 weights (every MatMul of both layer kinds as MatMulNBits): where the numerics probe finds verify
    rows bit-identical to plain steps, DFlash's tokens are the same engine's plain decoding; elsewhere the engine
    says so and they are plain decoding's up to near-ties (target_support.assert_as_plain)."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    engine_dir = build_onnxruntime(load_recipe("tiny-qwen3.5"), tmp_path / "onnxruntime", threads=1,
                                   precision=precision)
    import onnx

    # target.onnx (the one-sequence graph): every MatMul quantized. (The manifest's record for the role "target" is
    # the last target graph quantized, target_batch.onnx, whose attention MatMuls multiply activations.)
    ops = [n.op_type for n in onnx.load(str(engine_dir / "target.onnx"), load_external_data=False).graph.node]
    assert "MatMul" not in ops and ops.count("MatMulNBits") > 40
    engine = load_engine(engine_dir, threads=1)
    try:
        rt = DFlashRuntime(engine)
        for ids in prompts()[:3]:
            sp = SamplingParams(max_new_tokens=NEW)
            assert_as_plain(engine, ids, rt.generate(ids, sp, "dflash").tokens, rt.generate(ids, sp, "ar").tokens)
    finally:
        engine.close()


def _stand_in(src: Path, dst: Path, text: dict, top: dict | None = None) -> None:
    """A bf16 copy of a tiny checkpoint with a published checkpoint's config keys (under text_config when the
    checkpoint is composite, as Qwen3.5 / 3.6 are published)."""
    from test_sources import _to_bf16

    _to_bf16(src, dst, **(top or {}))
    cfg = json.loads((dst / "config.json").read_text())
    (cfg["text_config"] if "text_config" in cfg else cfg).update(text)
    (dst / "config.json").write_text(json.dumps(cfg))


# Published keys of Qwen3.5-9B / Qwen3.6-35B-A3B's text settings that the tiny sizes keep (RoPE: theta 1e7, a quarter
# of each head rotated, the multimodal sections text positions ignore; MTP layers transformers does not load).
PUBLISHED_TEXT = {"max_position_embeddings": 262144, "full_attention_interval": 3, "mtp_num_hidden_layers": 1,
                  "mtp_use_dedicated_embeddings": False, "attn_output_gate": True,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                      "mrope_section": [11, 11, 10], "mrope_interleaved": True}}


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name,tiny,env", [
    ("qwen3.5-9b", "qwen3.5", ("QWEN3_5_9B", "QWEN3_5_9B_DFLASH")),
    ("qwen3.6-35b-a3b", "qwen3.5-moe", ("QWEN3_6_35B_A3B", "QWEN3_6_35B_A3B_DFLASH"))])
def test_the_published_hybrid_recipes_build_on_stand_ins(tmp_path, recipe_name, tiny, env):
    """`build --recipe qwen3.5-9b / qwen3.6-35b-a3b --precision int4` with local paths: composite bf16 stand-ins with
    the published text_config keys, and the drafters' RoPE base set to the targets' (z-lab's carry it)."""
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    _stand_in(resolve_source(f"tiny:{tiny}/target"), target, PUBLISHED_TEXT)
    _stand_in(resolve_source(f"tiny:{tiny}/drafter"), drafter, {"rope_theta": 10000000.0,
                                                                "max_position_embeddings": 262144})
    r = subprocess.run([sys.executable, "-m", "dflash_export", "build", "--recipe", recipe_name, "--precision", "int4",
                        "--out", str(tmp_path / "engines")], capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT), env[0]: str(target), env[1]: str(drafter)})
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "engines" / recipe_name / "onnxruntime-int4" / "manifest.json").read_text())
    assert m["precision"]["target"] == "int4" and m["dtypes"]["checkpoint"] == "bfloat16"
    r = subprocess.run([sys.executable, "-m", "dflash_export", "inspect", str(drafter), "--target", str(target),
                        "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and json.loads(r.stdout)["findings"] == [], r.stdout[-2000:] + r.stderr[-2000:]


def test_a_prompt_longer_than_a_prefill_chunk_decodes_as_transformers(hybrid):
    """A 150-token prompt runs in chunks of HYBRID_PREFILL_ROWS (each committing its last row's state): the tokens
    after it are transformers' greedy ones."""
    from dflash_export.engines.onnxruntime import HYBRID_PREFILL_ROWS
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, hf = hybrid
    ids = list(map(int, np.random.default_rng(11).integers(1, 250, size=150)))
    assert len(ids) > 2 * HYBRID_PREFILL_ROWS
    got = DFlashRuntime(engine).generate(ids, SamplingParams(max_new_tokens=16), "dflash").tokens
    assert_transformers_greedy(hf, ids, got, engine.info.stop_token_ids[0], 16)


@pytest.mark.parametrize("recipe_name", list(FAMILIES))
def test_portable_graph_matches_transformers_over_chunks_with_state_carried(tmp_path, recipe_name):
    """The portable target graph (what any ONNX runtime reads) over a prefill and three chunks, each chunk fed the
    previous one's K/V, conv window tail and last row's recurrent state: logits within 1e-4 of transformers."""
    import onnxruntime as ort

    from dflash_export.export import export_models
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.target import load_target

    recipe = load_recipe(recipe_name)
    target, drafter = load_target(recipe.target_path), load_drafter(recipe.drafter_path)
    export_models(target, drafter, tmp_path, max_len=256)
    sess = ort.InferenceSession(str(tmp_path / "target_verify.onnx"), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    state = {}
    for name, shape in shapes.items():
        if name.startswith(("past_", "conv_state_", "recurrent_state_")):
            dims = [1] + [0 if isinstance(d, str) else d for d in shape[1:]]
            state[name] = np.zeros(dims, np.float32)
    ids = np.random.default_rng(0).integers(1, 250, 20)
    with torch.inference_mode():
        ref = target.hf(torch.from_numpy(ids)[None]).logits[0].numpy()
    worst, pos = 0.0, 0
    for n in (9, 1, 6, 4):
        feeds = dict(state, input_ids=ids[None, pos:pos + n], position_ids=np.arange(pos, pos + n)[None],
                     num_logits=np.array(n), draft_tokens=np.zeros((1, n - 1), np.int64),
                     draft_probs=np.zeros((1, 1, 1), np.float32), uniforms=np.zeros((1, 1), np.float32))
        out = dict(zip(names, sess.run(None, feeds)))
        worst = max(worst, float(np.abs(out["logits"][0] - ref[pos:pos + n]).max()))
        for name in state:
            i = name.rsplit("_", 1)[1]
            if name.startswith("past_"):
                state[name] = out[name.replace("past_", "present_")]
            elif name.startswith("conv_state_"):
                state[name] = out[f"conv_window_{i}"][:, :, n:]
            else:
                state[name] = out[f"recurrent_last_{i}"]
        pos += n
    assert worst <= 1e-4, worst
