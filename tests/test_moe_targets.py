"""Mixture-of-experts targets through every CPU stage, against transformers' own model classes as the oracle, on tiny
random models built from their config classes: Qwen3-MoE (the paper's Qwen3-Coder-30B-A3B family: 8 experts, 2 per
token, renormalized; one dense layer among them) and gpt-oss (biased attention with sinks, alternating 8-token
sliding-window and full layers, YaRN RoPE, clamped SwiGLU experts with biases, softmax over the top-k logits)."""

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
    check_batched_tokens_equal_alone,
    check_greedy_tokens_against_transformers,
    engine_and_transformers,
    inspect_pair,
    prompts,
    validate_sampled,
    worst_logit_gap,
)

from dflash_export.engines.base import SamplingParams
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("onnxruntime")
NEW = 64


FAMILIES = {"tiny-qwen3-moe": "Qwen3MoeForCausalLM", "tiny-gpt-oss": "GptOssForCausalLM"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(tmp_path_factory, request):
    recipe, engine_dir, engine, hf = engine_and_transformers(request.param, tmp_path_factory.mktemp("moe"))
    yield recipe, engine_dir, engine, hf
    engine.close()


def test_the_family_is_known_and_its_moe_layers_are_read_from_the_config(moe):
    recipe, _, engine, hf = moe
    from dflash_export.models.arch import ARCHS, sliding_windows

    arch = ARCHS[hf.config.model_type]
    if recipe.name == "tiny-qwen3-moe":
        assert arch.moe.layers(hf.config) == [True, True, False, True, True, True]
    else:
        assert arch.moe.layers(hf.config) == [True] * 4
        assert sliding_windows(arch, hf.config) == [8, None, 8, None]


def test_engine_greedy_tokens_equal_transformers_generate(moe):
    """5 prompts x 64 tokens: plain decoding and DFlash on the ONNX Runtime engine both give transformers' own
    greedy tokens (routing is per token, so a verify block routes each row as a plain step does)."""
    _, _, engine, hf = moe
    check_greedy_tokens_against_transformers(engine, hf, NEW)


def test_each_steps_logits_match_transformers_forward(moe):
    _, _, engine, hf = moe
    worst = worst_logit_gap(engine, hf, prompts()[2], steps=16)
    assert worst <= 1e-4, worst


def test_batched_engine_gives_each_request_its_lone_tokens(moe):
    _, _, engine, _ = moe
    check_batched_tokens_equal_alone(engine, "ar")


@pytest.mark.parametrize("recipe_name", list(FAMILIES))
def test_inspect_reads_the_pair_with_no_finding(recipe_name):
    recipe = load_recipe(recipe_name)
    out = inspect_pair(recipe)
    assert out["ok"] and out["findings"] == [] and out["summary"]["target architecture"] == FAMILIES[recipe_name]


def test_sampled_output_keeps_the_target_distribution(moe, tmp_path):
    """validate's G-test at T = 0.7 on the MoE engine (DFlash sampling against the engine's own conditionals)."""
    recipe, engine_dir, _, _ = moe
    dist, stdout, exact = validate_sampled(recipe, engine_dir, tmp_path / "rep")
    assert dist["distribution_p_value"]["passed"], stdout
    assert dist["identical_fraction"]["value"] == 1.0 or not exact, stdout


@pytest.mark.slow
def test_the_published_moe_recipe_builds_through_export_on_a_stand_in(tmp_path):
    """`build --recipe qwen3-coder-30b-a3b` with local paths: a tiny stand-in with the real checkpoint's config keys
    (Qwen3MoeForCausalLM: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    decoder_sparse_step, mlp_only_layers), stored in bfloat16 as published."""
    from test_sources import _to_bf16

    target, drafter = tmp_path / "Qwen3-Coder-30B-A3B-Instruct", tmp_path / "Qwen3-Coder-30B-A3B-DFlash"
    _to_bf16(resolve_source("tiny:qwen3-moe/target"), target, max_position_embeddings=262144,
             rope_theta=10000000.0)
    _to_bf16(resolve_source("tiny:qwen3-moe/drafter"), drafter)
    r = subprocess.run([sys.executable, "-m", "dflash_export", "build", "--recipe", "qwen3-coder-30b-a3b",
                        "--precision", "int4", "--out", str(tmp_path / "engines")], capture_output=True, text=True,
                       cwd=ROOT, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                   "QWEN3_CODER_30B_A3B": str(target),
                                                   "QWEN3_CODER_30B_A3B_DFLASH": str(drafter)})
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "engines" / "qwen3-coder-30b-a3b" / "onnxruntime-int4" / "manifest.json").read_text())
    assert m["precision"]["target"] == "int4" and m["dtypes"]["checkpoint"] == "bfloat16"


# The sparse expert path (export/moe.py) against transformers' own MoE blocks --------------------------------------

def _hf_target(name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_source(f"tiny:{name}/target")), dtype=torch.float32).eval()


def _moe_session(hf, layer: int, sparse: bool, quantize: tuple[int, int] | None = None):
    """One MoE MLP as an ONNX graph [B,S,H] -> [B,S,H], exported by export/moe.py from the layer's weights."""
    import onnxruntime as ort

    from dflash_export.export.builder import F32, GraphBuilder, finish
    from dflash_export.export.graph import np_state
    from dflash_export.export.moe import moe_mlp, quantize_moe_experts
    from dflash_export.models.arch import ARCHS

    arch = ARCHS[hf.config.model_type]
    g = GraphBuilder("moe")
    x = g.input("x", F32, ["batch", "seq", hf.config.hidden_size])
    y = moe_mlp(g, x, np_state(hf), f"model.layers.{layer}.mlp.", arch.moe, hf.config, sparse)
    g.op("Identity", [y], outputs=["y"])
    g.output("y", F32, ["batch", "seq", hf.config.hidden_size])
    model, inits = finish(g, [], True)
    from onnx import numpy_helper

    model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in inits.items())
    report = quantize_moe_experts(model, *quantize) if quantize else None
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), model, report


def _hf_moe(hf, layer: int, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out = hf.model.layers[layer].mlp(torch.from_numpy(x))
    return (out[0] if isinstance(out, tuple) else out).numpy()


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_moe_mlp_equals_transformers_moe_block(name, sparse):
    """Both forms (com.microsoft.MoE for ONNX Runtime, plain ops for the portable graph) give transformers' MoE block
    on 2 x 7 random rows: Qwen3-MoE's renormalized softmax top-k, gpt-oss's softmax over the top-k logits, clamped
    SwiGLU with alpha 1.702 and up + 1, and biases."""
    hf = _hf_target(name)
    x = np.random.default_rng(3).standard_normal((2, 7, hf.config.hidden_size)).astype(np.float32)
    sess, model, _ = _moe_session(hf, 0, sparse)
    ops = {n.op_type for n in model.graph.node}
    assert ("MoE" in ops) == sparse
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _hf_moe(hf, 0, x), atol=2e-5, rtol=1e-4)


def test_a_rows_sparse_output_is_bit_identical_whichever_rows_share_its_experts():
    """The kernel groups rows by expert; a row's output must not depend on the rows beside it (a verify block routes
    each row as a plain step does): row 0 alone and among 1..16 other rows, bit for bit, fp32."""
    hf = _hf_target("qwen3-moe")
    sess, _, _ = _moe_session(hf, 0, True)
    x = np.random.default_rng(4).standard_normal((1, 17, hf.config.hidden_size)).astype(np.float32)
    alone = sess.run(None, {"x": x[:, :1]})[0][0, 0]
    for n in range(2, 18):
        assert np.array_equal(sess.run(None, {"x": x[:, :n]})[0][0, 0], alone), n


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
@pytest.mark.parametrize("bits,level,atol", [(4, 0, 2e-5), (4, 4, 5e-2), (8, 4, 5e-2)])
def test_quantized_experts_equal_transformers_with_the_dequantized_weights(name, bits, level, atol):
    """QMoE (int4 / int8 blocks of 32 along K, symmetric) against transformers' MoE block whose expert weights are
    replaced by the dequantized blocks, (q - 2^(bits-1)) * scale, computed here in numpy. Accuracy level 0 keeps
    fp32 activations (equal to rounding); level 4 and int8 quantize the activations to int8 (a looser bound)."""
    from onnx import numpy_helper

    hf = _hf_target(name)
    sess, model, report = _moe_session(hf, 0, True, (bits, 32, level))
    assert report == {"moe_quantized": 1, "moe_total": 1}
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "QMoE")

    def dequant(packed, scales):
        q = packed.astype(np.int32)
        if bits == 4:
            q = np.stack([q & 0xF, q >> 4], axis=-1).reshape(q.shape[0], q.shape[1], -1)
        q = (q - 2 ** (bits - 1)).astype(np.float32).reshape(*scales.shape, -1)
        return (q * scales[..., None]).reshape(q.shape[0], q.shape[1], -1)

    fc1 = dequant(arrays[node.input[2]], arrays[node.input[3]])   # [E, 2I, H], gate / up interleaved
    fc2 = dequant(arrays[node.input[5]], arrays[node.input[6]])   # [E, H, I]
    experts = hf.model.layers[0].mlp.experts
    with torch.no_grad():
        if name == "gpt-oss":  # gate_up [E, H, 2I] interleaved; down [E, I, H]
            experts.gate_up_proj.copy_(torch.from_numpy(fc1.transpose(0, 2, 1)))
            experts.down_proj.copy_(torch.from_numpy(fc2.transpose(0, 2, 1)))
        else:                  # gate_up [E, 2I, H] gate rows first; down [E, H, I]
            experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([fc1[:, 0::2], fc1[:, 1::2]], axis=1)))
            experts.down_proj.copy_(torch.from_numpy(fc2))
    x = np.random.default_rng(5).standard_normal((2, 7, hf.config.hidden_size)).astype(np.float32)
    want = _hf_moe(hf, 0, x)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, atol=atol * float(np.abs(want).max()))


@pytest.fixture(scope="module", params=["tiny-qwen3-moe:int4", "tiny-gpt-oss:int8"])
def quantized_moe(tmp_path_factory, request):
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine

    name, precision = request.param.split(":")
    engine_dir = build_onnxruntime(load_recipe(name), tmp_path_factory.mktemp("qmoe") / "onnxruntime", threads=1,
                                   precision=precision)
    engine = load_engine(engine_dir, threads=1)
    yield engine_dir, engine
    engine.close()


def test_quantized_moe_engine_decodes_dflash_identical_to_its_plain_decoding(quantized_moe):
    """int4 / int8 experts (QMoE) in the built engine, the router fp32; on the CPU where its numerics probe finds
    verify rows bit-identical to plain steps, DFlash gives the engine's own plain tokens, single and batched;
    elsewhere the engine says so and they are plain decoding's up to near-ties (target_support.assert_as_plain)."""
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    engine_dir, engine = quantized_moe
    m = json.loads((engine_dir / "manifest.json").read_text())
    q = m["quantization"]["target"]
    assert q["moe_op"] == "com.microsoft.QMoE" and q["moe_quantized"] == q["moe_total"] > 0
    rt = DFlashRuntime(engine)
    sp = SamplingParams(max_new_tokens=32)
    batched = BatchingRuntime(engine, max_batch=3).generate_many(prompts()[:3], sp)
    for p, s in zip(prompts()[:3], batched):
        plain = rt.generate(p, sp, "ar").tokens
        assert_as_plain(engine, p, rt.generate(p, sp, "dflash").tokens, plain)
        assert_as_plain(engine, p, s.tokens, plain)


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_moe_nodes_rewritten_in_standard_ops_equal_transformers_moe_block(name):
    """TensorRT's copy of the batch graph needs standard ops only: every MoE node rewritten as the dense form over
    its own weights gives transformers' MoE block, and no com.microsoft node is left."""
    import onnxruntime as ort

    from dflash_export.export.moe import moe_nodes_as_plain_ops

    hf = _hf_target(name)
    _, model, _ = _moe_session(hf, 0, True)
    assert moe_nodes_as_plain_ops(model) == 1
    assert {n.domain for n in model.graph.node} <= {""}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(6).standard_normal((2, 7, hf.config.hidden_size)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _hf_moe(hf, 0, x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_tensorrt_copy_of_the_batch_graph_has_standard_ops_and_computes_the_sparse_graph(name, tmp_path):
    """TensorRT's batched engine parses a plain-op copy of the exported batch graph (engines/tensorrt_batch.py): with
    the sparse experts that copy holds the dense form, standard ops only, and equals the ONNX Runtime graph it was
    made from on 3 sequences of 4 rows over a 7-row past."""
    import onnx
    import onnxruntime as ort

    from dflash_export.engines.tensorrt_batch import plain_op_graph
    from dflash_export.export import export_models
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter

    recipe = load_recipe(name)
    target, drafter = load_target(recipe.target, torch.float32), load_drafter(recipe.drafter, torch.float32)
    export_models(target, drafter, tmp_path, block_size=recipe.block_size, max_len=64, ort_flavor=True)
    src, dst = tmp_path / "target_batch_ort.onnx", tmp_path / "target_batch_trt.onnx"
    assert any(n.op_type == "MoE" for n in onnx.load(str(src), load_external_data=False).graph.node)
    counts = plain_op_graph(src, dst)
    assert counts["MoE"] == sum(ARCH_MOE_LAYERS[name])
    model = onnx.load(str(dst), load_external_data=False)
    assert all(onnx.defs.has(n.op_type, n.domain) for n in model.graph.node)
    rng = np.random.default_rng(0)
    a, b = (ort.InferenceSession(str(f), providers=["CPUExecutionProvider"]) for f in (src, dst))
    dims = {"batch": 3, "seq": 4, "past": 11, "rows": 12}  # 7 committed keys, room for the block's 4
    feeds = {}
    for i in a.get_inputs():
        shape = [dims[d] if isinstance(d, str) else d for d in i.shape]
        if i.name in ("grid_rows", "cells"):  # every cell a row
            feeds[i.name] = np.arange(12, dtype=np.int64).reshape(shape)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(7 + np.arange(4), shape).astype(np.int64).copy()
        elif i.name == "past_bias":
            feeds[i.name] = np.where(np.arange(shape[-1]) < 7, 0.0, -np.inf).astype(np.float32) + np.zeros(shape,
                                                                                                       np.float32)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
        np.testing.assert_allclose(y, x, atol=2e-5, rtol=1e-5)


ARCH_MOE_LAYERS = {"tiny-qwen3-moe": [True, True, False, True, True, True], "tiny-gpt-oss": [True] * 4}
