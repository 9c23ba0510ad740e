"""Half-precision copies of exported graphs (export/half.py): the float32 island (tap fusion, RMSNorm statistics)
keeps a float16 graph finite and close to the float32 PyTorch reference when the target's hidden states are large.

The float16 graph runs under onnx's reference evaluator, which computes float16 ops in numpy float16 (so a product
past 65504 becomes inf, as on a GPU). ONNX Runtime's CPU provider is also run, for loading and parity only: it
computes many float16 ops in float32 (cast insertion for kernels it lacks), so it cannot show an overflow."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator

from dflash_export.export import export_models
from dflash_export.export.half import half_graph, island_nodes, write_half_graph

FP16_MAX = 65504.0


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Tiny Qwen3 pair whose embedding rows are scaled so the tapped residual stream reaches |x| ~ 2.6e4 (Qwen3-8B's
    taps exceed 2e4): representable in float16, but x*x and fc's sums are not."""
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter

    target, drafter = load_target("tiny:qwen3/target"), load_drafter("tiny:qwen3/drafter")
    emb = target.hf.get_input_embeddings().weight
    with torch.no_grad():
        emb.mul_(3.0e4 / float(emb.abs().max()))
    out = tmp_path_factory.mktemp("half")
    res = export_models(target, drafter, out, recipe_name="tiny-qwen3", max_len=64)
    ids = np.arange(3, 14, dtype=np.int64)
    n, cfg = len(ids), target.hf.config
    feeds = {"input_ids": ids[None], "position_ids": np.arange(n)[None], "num_logits": np.array(1, np.int64),
             "draft_tokens": ids[None, n:], "draft_probs": np.zeros((1, 1, 1), np.float32),
             "uniforms": np.zeros((1, 1), np.float32)}
    for i in range(cfg.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    with torch.inference_mode():
        ref = target.forward(torch.from_numpy(ids)[None], torch.arange(n)[None], target.new_cache(),
                             drafter.config.target_layer_ids)
        ctx = drafter.project_context(ref.taps).numpy()
        taps = torch.cat(list(ref.taps), -1) if isinstance(ref.taps, (list, tuple)) else ref.taps
    return res, feeds, ctx, ref.logits[0, -1].numpy(), taps.numpy()


def _run_fp16(model, feeds):
    names = [o.name for o in model.graph.output]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the overflow the island-less copy is expected to hit
        return dict(zip(names, ReferenceEvaluator(model).run(None, feeds)))


def test_planted_hidden_states_overflow_float16_in_tap_fusion(planted):
    _, _, _, _, taps = planted
    assert np.abs(taps).max() > 2e4
    assert (taps.astype(np.float64) ** 2).mean(-1).max() > FP16_MAX  # hidden_norm's / RMSNorm's statistic


def test_fp32_island_keeps_a_float16_graph_finite_and_on_the_reference(planted, tmp_path):
    res, feeds, ref_ctx, ref_logits, _ = planted
    path = write_half_graph(res.target_path)
    half = onnx.load(str(path))
    original = onnx.load(str(res.target_path), load_external_data=False)
    assert [(i.name, i.type.tensor_type.elem_type) for i in half.graph.input] == \
        [(i.name, i.type.tensor_type.elem_type) for i in original.graph.input]
    assert [(o.name, o.type.tensor_type.elem_type) for o in half.graph.output] == \
        [(o.name, o.type.tensor_type.elem_type) for o in original.graph.output]
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in half.graph.initializer)
    assert island_nodes(original)
    out = _run_fp16(half, feeds)
    assert np.isfinite(out["ctx"]).all() and np.isfinite(out["logits"]).all()
    np.testing.assert_allclose(out["ctx"], ref_ctx, atol=5e-3 * np.abs(ref_ctx).max(), rtol=0)
    assert out["logits"][0, -1].argmax() == ref_logits.argmax()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    np.testing.assert_allclose(got["ctx"], ref_ctx, atol=5e-3 * np.abs(ref_ctx).max(), rtol=0)


def test_without_the_island_the_float16_tap_fusion_collapses(planted):
    """The same conversion with only the plugin nodes kept float32: x*x overflows, every RMSNorm divides by inf,
    and ctx loses the reference (what the island prevents)."""
    res, feeds, ref_ctx, _, _ = planted
    out = _run_fp16(half_graph(onnx.load(str(res.target_path)), fp32_island=False), feeds)
    assert np.abs(out["ctx"] - ref_ctx).max() > 0.5 * np.abs(ref_ctx).max()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_copies_of_both_graphs_are_consistently_typed(planted, dtype):
    """Every node of the copy (target and drafter) agrees on its input types under onnx's strict type inference:
    the island's casts are where they must be. TensorRT 11 parses such copies strongly typed."""
    res, _, _, _, _ = planted
    for path in (res.target_path, res.drafter_path):
        half = half_graph(onnx.load(str(path)), dtype)
        onnx.shape_inference.infer_shapes(half, check_type=True, strict_mode=True)
        assert any(n.name.startswith("fp32_island/") for n in half.graph.node)


def test_bfloat16_copy_stays_on_the_reference(planted):
    """bfloat16 has float32's range, so nothing overflows; the copy must still compute the reference's context.
    The reference evaluator runs bfloat16 through ml_dtypes (some products come back float32), so this is a
    check of the graph, not of bfloat16 arithmetic."""
    res, feeds, ref_ctx, ref_logits, _ = planted
    out = _run_fp16(half_graph(onnx.load(str(res.target_path)), "bfloat16"), feeds)
    np.testing.assert_allclose(out["ctx"], ref_ctx, atol=1e-2 * np.abs(ref_ctx).max(), rtol=0)
    assert out["logits"][0, -1].argmax() == ref_logits.argmax()
