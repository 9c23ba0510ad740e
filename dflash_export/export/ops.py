"""The DFlash custom ops as ONNX model-local functions (domain `dflash`), holding the reference math.

KVInjectedBlockAttention (every block query sees all context and block keys), its masked variant
MaskedKVInjectedBlockAttention (causal and/or sliding-window layers, as z-lab's release 0.1.0 builds them), and
FusedVerify. BiasedKVInjectedBlockAttention (an additive key bias, for B padded sequences per drafter call) appears
only in the ONNX Runtime engine's drafter graph; no TensorRT plugin implements it (a TensorRT batch contract would).

A graph carries each op as a node of domain `dflash` *and* the function that defines it, so plain ONNX Runtime inlines
the function (no custom-op library) while TensorRT's parser maps the node onto a plugin found by op type; the nodes
carry `plugin_namespace` / `plugin_version` for that lookup. The names and attributes here are the plugin contract
shared with `engines/tensorrt_plugins.py` and `kernels/`: keep them stable.

Hand-written with onnx.helper because no exporter (optimum, torch.onnx) emits custom-domain nodes backed by functions.

DFlash 2 (z-lab's DFlash2DraftModel) adds no op here, decided from its math:
- GroupedDynamicCausalConv is plain ONNX (export/graph.py `block_conv`): slot t of the block is
  sum_o (base[o, c] + dynamic[t, o, g]) * x[t - o, c] over K taps (zeros before the anchor), i.e. K shifted copies, an
  Add and a Mul each. Element-wise and a few taps wide: every runtime fuses it; a plugin would buy nothing.
- CandidateSelector is not a graph op: it is a walk along the block (slot i's scores depend on the token chosen at
  slot i-1) over the top-k candidates, O(slots x k x rank) multiply-adds. The drafter graph outputs its per-slot
  projection `selector_hidden` [B, n, rank]; the engine walks on the host (`sampling.select_candidates`), as it
  accepts blocks on the host. Host contract: draft logits [n, V] (after output_multiplier / soft cap),
  selector_hidden [n, R], the two codebooks [V, R], the anchor token, top_k, temperature, uniforms [n] -> tokens [n]
  (argmax walk when greedy) and, when sampling, q [n, V] = softmax(scores / T) on the candidates (descending-logit
  order, ties by id), 0 elsewhere -- what speculative sampling verifies against. A GPU backend would need it as a
  third op (CandidateSelect); none is implemented.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

DOMAIN = "dflash"
DOMAIN_VERSION = 1
ONNX_OPSET = 17
PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
KV_ATTENTION = "KVInjectedBlockAttention"
MASKED_KV_ATTENTION = "MaskedKVInjectedBlockAttention"
BIASED_KV_ATTENTION = "BiasedKVInjectedBlockAttention"
FUSED_VERIFY = "FusedVerify"
EMIT_PAD = -1  # emitted_tokens past n_emitted (kernels/reference.py uses the same value)

# Read by TensorRT's ONNX parser on a plugin node: 1 asks for the AOT implementation, 0 for the JIT one. Optional on
# a node (graphs written before it carry none), declared by every op's function.
AOT_ATTR = "aot"
# Attributes each op node must carry (checked by `export.check`).
REQUIRED_ATTRS = {
    KV_ATTENTION: ("num_heads", "num_kv_heads", "scale", "plugin_namespace", "plugin_version"),
    MASKED_KV_ATTENTION: ("num_heads", "num_kv_heads", "scale", "causal", "window", "plugin_namespace",
                          "plugin_version"),
    BIASED_KV_ATTENTION: ("num_heads", "num_kv_heads", "scale", "plugin_namespace", "plugin_version"),
    FUSED_VERIFY: ("temperature", "plugin_namespace", "plugin_version"),
}


def _ref(name: str, ref: str, typ) -> AttributeProto:
    a = AttributeProto()
    a.name, a.ref_attr_name, a.type = name, ref, typ
    return a


def _const_node(out: str, value) -> onnx.NodeProto:
    arr = np.asarray(value)
    return helper.make_node("Constant", [], [out], value=onnx.numpy_helper.from_array(arr, out + "_v"))


def kv_injected_block_attention_function() -> onnx.FunctionProto:
    """q [B,H,S,D]; k_ctx, v_ctx [B,KVH,T,D]; k_blk, v_blk [B,KVH,S,D] -> out [B,H,S,D].

    Every block query sees all T context keys and all S block keys (no mask); GQA groups = H / KVH (read from shapes,
    so the body needs only `scale`). Scores and softmax in fp32, as models.drafter.block_attention.
    """
    n = helper.make_node
    nodes = [
        n("Concat", ["k_ctx", "k_blk"], ["k"], axis=2),
        n("Concat", ["v_ctx", "v_blk"], ["v"], axis=2),
        n("Shape", ["q"], ["q_shape"]),
        n("Shape", ["k"], ["k_shape"]),
        _const_node("i0", np.array([0], np.int64)), _const_node("i1", np.array([1], np.int64)),
        _const_node("i2", np.array([2], np.int64)), _const_node("i3", np.array([3], np.int64)),
        _const_node("i4", np.array([4], np.int64)), _const_node("neg1", np.array([-1], np.int64)),
        n("Slice", ["q_shape", "i0", "i1"], ["b"]),
        n("Slice", ["q_shape", "i1", "i2"], ["h"]),
        n("Slice", ["q_shape", "i2", "i3"], ["s"]),
        n("Slice", ["q_shape", "i3", "i4"], ["d"]),
        n("Slice", ["k_shape", "i1", "i2"], ["kvh"]),
        n("Div", ["h", "kvh"], ["g"]),
        # [B,H,S,D] -> [B,KVH,G,S,D]: query head h uses kv head h // G (repeat_interleave order).
        n("Concat", ["b", "kvh", "g", "s", "d"], ["q5_shape"], axis=0),
        n("Reshape", ["q", "q5_shape"], ["q5"]),
        n("Unsqueeze", ["k", "i2"], ["k5"]),
        n("Unsqueeze", ["v", "i2"], ["v5"]),
        n("Transpose", ["k5"], ["k5t"], perm=[0, 1, 2, 4, 3]),
        n("MatMul", ["q5", "k5t"], ["scores_raw"]),
        _scale_constant(),
        n("Mul", ["scores_raw", "scale_c"], ["scores"]),
        n("Softmax", ["scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v5"], ["out5"]),
        n("Concat", ["b", "h", "s", "d"], ["out_shape"], axis=0),
        n("Reshape", ["out5", "out_shape"], ["out"]),
    ]
    return helper.make_function(
        DOMAIN, KV_ATTENTION, ["q", "k_ctx", "v_ctx", "k_blk", "v_blk"], ["out"], nodes,
        [helper.make_opsetid("", ONNX_OPSET)], attributes=function_attrs(KV_ATTENTION),
    )


def masked_kv_injected_block_attention_function() -> onnx.FunctionProto:
    """KVInjectedBlockAttention with a mask, for drafters whose layers are causal or sliding-window.

    Inputs as KVInjectedBlockAttention, plus q_positions [B,S] and k_positions [B,T+S] int64 (absolute positions of
    the block queries and of every key: context keys first, then the block's). Attributes causal (int, 0/1) and window
    (int, 0 = none). Query i sees key j iff (not causal or k_j <= q_i) and (window == 0 or q_i - k_j < window) and
    (causal or window == 0 or k_j - q_i < window): z-lab's `_attention_mask`. Every block query sees at least its own
    key, so no row is empty.
    """
    n = helper.make_node

    def ref_int(out: str, attr: str) -> onnx.NodeProto:
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(_ref("value_int", attr, AttributeProto.INT))
        return node

    body = kv_injected_block_attention_function().node
    # Everything up to the scaled scores is KVInjectedBlockAttention's; the mask goes in before the softmax.
    head = [nd for nd in body if nd.op_type != "Softmax" and "out5" not in nd.output and "out_shape" not in nd.output
            and "out" not in nd.output]
    nodes = [
        *head,
        ref_int("causal_c", "causal"), ref_int("window_c", "window"),
        _const_node("zero_i", np.array(0, np.int64)),
        _const_node("zero_f", np.array(0.0, np.float32)), _const_node("ninf_f", np.array(-np.inf, np.float32)),
        _const_node("ax2", np.array([2], np.int64)), _const_node("ax1", np.array([1], np.int64)),
        _const_node("ax12", np.array([1, 2], np.int64)),
        n("Unsqueeze", ["q_positions", "ax2"], ["qp3"]),
        n("Unsqueeze", ["k_positions", "ax1"], ["kp3"]),
        n("Sub", ["qp3", "kp3"], ["delta"]),                     # [B,S,T+S] query minus key position
        n("Cast", ["causal_c"], ["causal_b"], to=TensorProto.BOOL),
        n("Equal", ["window_c", "zero_i"], ["no_window"]),
        n("Not", ["causal_b"], ["bidirectional"]),
        n("GreaterOrEqual", ["delta", "zero_i"], ["behind"]),
        n("Or", ["bidirectional", "behind"], ["causal_ok"]),
        n("Less", ["delta", "window_c"], ["near_behind"]),
        n("Or", ["no_window", "near_behind"], ["window_ok"]),
        n("Neg", ["delta"], ["neg_delta"]),
        n("Less", ["neg_delta", "window_c"], ["near_ahead"]),
        n("Or", ["no_window", "causal_b"], ["ahead_free"]),
        n("Or", ["ahead_free", "near_ahead"], ["ahead_ok"]),
        n("And", ["causal_ok", "window_ok"], ["vis1"]),
        n("And", ["vis1", "ahead_ok"], ["visible"]),
        n("Where", ["visible", "zero_f", "ninf_f"], ["bias3"]),
        n("Unsqueeze", ["bias3", "ax12"], ["bias5"]),             # [B,1,1,S,T+S] against scores [B,KVH,G,S,T+S]
        n("Add", ["scores", "bias5"], ["masked_scores"]),
        n("Softmax", ["masked_scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v5"], ["out5"]),
        n("Concat", ["b", "h", "s", "d"], ["out_shape"], axis=0),
        n("Reshape", ["out5", "out_shape"], ["out"]),
    ]
    return helper.make_function(
        DOMAIN, MASKED_KV_ATTENTION, ["q", "k_ctx", "v_ctx", "k_blk", "v_blk", "q_positions", "k_positions"], ["out"],
        nodes, [helper.make_opsetid("", ONNX_OPSET)], attributes=function_attrs(MASKED_KV_ATTENTION),
    )


def biased_kv_injected_block_attention_function() -> onnx.FunctionProto:
    """KVInjectedBlockAttention plus key_bias [B, T+S] float, added to every query's scores before the softmax
    (0 = visible, -inf = a padding key): what lets one drafter call carry B sequences whose context lengths and
    block lengths differ (engines/ort_batch.py pads each to the batch's longest and masks the padding).

    With an all-zero bias the result is KVInjectedBlockAttention's bit for bit (x + 0 == x), so a batch of one
    drafts exactly as the unbatched op. Used by the ONNX Runtime flavor only (no TensorRT plugin).
    """
    n = helper.make_node
    body = kv_injected_block_attention_function().node
    head = [nd for nd in body if nd.op_type != "Softmax" and "out5" not in nd.output and "out_shape" not in nd.output
            and "out" not in nd.output]
    nodes = [
        *head,
        _const_node("ax123", np.array([1, 2, 3], np.int64)),
        n("Unsqueeze", ["key_bias", "ax123"], ["bias5"]),          # [B,1,1,1,T+S] against scores [B,KVH,G,S,T+S]
        n("Add", ["scores", "bias5"], ["biased_scores"]),
        n("Softmax", ["biased_scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v5"], ["out5"]),
        n("Concat", ["b", "h", "s", "d"], ["out_shape"], axis=0),
        n("Reshape", ["out5", "out_shape"], ["out"]),
    ]
    return helper.make_function(
        DOMAIN, BIASED_KV_ATTENTION, ["q", "k_ctx", "v_ctx", "k_blk", "v_blk", "key_bias"], ["out"], nodes,
        [helper.make_opsetid("", ONNX_OPSET)], attributes=function_attrs(BIASED_KV_ATTENTION),
    )


def _scale_constant() -> onnx.NodeProto:
    node = helper.make_node("Constant", [], ["scale_c"])
    node.attribute.append(_ref("value_float", "scale", AttributeProto.FLOAT))
    return node


def _i64(name: str, v) -> onnx.NodeProto:
    return _const_node(name, np.array(v, np.int64))


def _leading_accepts(prefix: str, accepted: str) -> list[onnx.NodeProto]:
    """accept_len = number of leading trues: count positions where no rejection happened so far."""
    n = helper.make_node
    return [
        n("Not", [accepted], [f"{prefix}rej"]),
        n("Cast", [f"{prefix}rej"], [f"{prefix}rej_i"], to=TensorProto.INT64),
        n("CumSum", [f"{prefix}rej_i", f"{prefix}ax1"], [f"{prefix}cs"]),
        n("Equal", [f"{prefix}cs", f"{prefix}zero"], [f"{prefix}ok"]),
        n("Cast", [f"{prefix}ok"], [f"{prefix}ok_i"], to=TensorProto.INT64),
        n("ReduceSum", [f"{prefix}ok_i", f"{prefix}ax1v"], [f"{prefix}acc"], keepdims=0),
    ]


def _verify_greedy_branch() -> onnx.GraphProto:
    """FusedVerify's greedy branch (temperature <= 0): outputs acc [B], last [B,1]."""
    n, i64 = helper.make_node, _i64
    g = "g_"
    greedy_nodes = [
        i64(g + "ax1", 1), i64(g + "ax1v", [1]), i64(g + "zero", 0),
        n("ArgMax", ["target_logits"], [g + "next"], axis=-1, keepdims=0),
        n("Slice", [g + "next", "c_zero1", "n1", "c_one1"], [g + "next_head"]),
        n("Equal", ["draft_tokens", g + "next_head"], [g + "match"]),
        *_leading_accepts(g, g + "match"),
        n("Unsqueeze", [g + "acc", "c_one1"], [g + "acc2"]),
        n("GatherElements", [g + "next", g + "acc2"], [g + "last"], axis=1),
    ]
    return helper.make_graph(greedy_nodes, "greedy", [], [
        helper.make_tensor_value_info(g + "acc", TensorProto.INT64, None),
        helper.make_tensor_value_info(g + "last", TensorProto.INT64, None)])


def _verify_sampling_branch() -> onnx.GraphProto:
    """FusedVerify's sampling branch: rejection sampling in float64, then the residual (or bonus) token drawn by
    inverse CDF; outputs acc [B], last [B,1]."""
    n, i64 = helper.make_node, _i64
    s = "s_"
    sampling_nodes = [
        i64(s + "ax1", 1), i64(s + "ax1v", [1]), i64(s + "zero", 0), i64(s + "ax2", [2]),
        n("Cast", ["target_logits"], [s + "logits"], to=TensorProto.DOUBLE),
        n("Cast", ["temperature_c"], [s + "t"], to=TensorProto.DOUBLE),
        n("Div", [s + "logits", s + "t"], [s + "scaled"]),
        n("Softmax", [s + "scaled"], [s + "p"], axis=-1),
        n("Cast", ["draft_probs"], [s + "q"], to=TensorProto.DOUBLE),
        n("Cast", ["uniforms"], [s + "u"], to=TensorProto.DOUBLE),
        n("Slice", [s + "p", "c_zero1", "n1", "c_one1"], [s + "p_head"]),
        n("Unsqueeze", ["draft_tokens", "c_m1"], [s + "tok3"]),
        n("GatherElements", [s + "p_head", s + "tok3"], [s + "p_tok3"], axis=2),
        n("GatherElements", [s + "q", s + "tok3"], [s + "q_tok3"], axis=2),
        n("Squeeze", [s + "p_tok3", "c_m1"], [s + "p_tok"]),
        n("Squeeze", [s + "q_tok3", "c_m1"], [s + "q_tok"]),
        n("Slice", [s + "u", "c_zero1", "n1", "c_one1"], [s + "u_head"]),
        n("Mul", [s + "u_head", s + "q_tok"], [s + "uq"]),
        n("Less", [s + "uq", s + "p_tok"], [s + "accepted"]),
        *_leading_accepts(s, s + "accepted"),
        # Residual at the stopping slot; q padded with a zero row so the all-accepted case yields p[n] (the bonus).
        n("Shape", [s + "q"], [s + "q_shape"]),
        n("ScatterElements", [s + "q_shape", "c_one1", "c_one1"], [s + "pad_shape"], axis=0),
        n("ConstantOfShape", [s + "pad_shape"], [s + "q_pad"],
          value=onnx.numpy_helper.from_array(np.array([0.0], np.float64))),
        n("Concat", [s + "q", s + "q_pad"], [s + "q_ext"], axis=1),
        n("Shape", [s + "p"], [s + "p_shape"]),
        n("ScatterElements", [s + "p_shape", "c_one1", "c_one1"], [s + "row_shape"], axis=0),
        n("Unsqueeze", [s + "acc", "c_one2"], [s + "acc3"]),
        n("Expand", [s + "acc3", s + "row_shape"], [s + "acc_idx"]),
        n("GatherElements", [s + "p", s + "acc_idx"], [s + "pa"], axis=1),
        n("GatherElements", [s + "q_ext", s + "acc_idx"], [s + "qa"], axis=1),
        n("Sub", [s + "pa", s + "qa"], [s + "diff"]),
        _const_node(s + "zf", np.array(0.0, np.float64)),
        n("Max", [s + "diff", s + "zf"], [s + "resid"]),
        n("ReduceSum", [s + "resid", s + "ax2"], [s + "rsum"], keepdims=1),
        n("LessOrEqual", [s + "rsum", s + "zf"], [s + "degenerate"]),
        n("Where", [s + "degenerate", s + "pa", s + "resid"], [s + "w"]),
        # Inverse CDF as sampling.sample_from: index = #(cdf <= u * total), clamped to V-1.
        n("CumSum", [s + "w", "c_m1_scalar"], [s + "cdf"]),
        n("Slice", [s + "cdf", "c_m1", "c_big", "c_two1"], [s + "total"]),
        n("Slice", [s + "u", "n1", "c_big", "c_one1"], [s + "u_last2"]),
        n("Unsqueeze", [s + "u_last2", "c_m1"], [s + "u_last"]),
        n("Mul", [s + "u_last", s + "total"], [s + "x"]),
        n("LessOrEqual", [s + "cdf", s + "x"], [s + "below"]),
        n("Cast", [s + "below"], [s + "below_i"], to=TensorProto.INT64),
        n("ReduceSum", [s + "below_i", s + "ax2"], [s + "idx3"], keepdims=0),
        n("Shape", [s + "p"], [s + "p_shape2"]),
        n("Slice", [s + "p_shape2", "c_m1", "c_big"], [s + "v1"]),
        n("Sub", [s + "v1", "c_one1"], [s + "vmax"]),
        n("Min", [s + "idx3", s + "vmax"], [s + "last"]),
    ]
    return helper.make_graph(sampling_nodes, "sampling", [], [
        helper.make_tensor_value_info(s + "acc", TensorProto.INT64, None),
        helper.make_tensor_value_info(s + "last", TensorProto.INT64, None)])


def fused_verify_function() -> onnx.FunctionProto:
    """target_logits [B,bs,V] float; draft_tokens [B,n] int64 (n = rows of logits - 1); draft_probs [B,n,V] float;
    uniforms [B,bs] float -> accept_len [B], emitted_tokens [B,bs] (EMIT_PAD past n_emitted), n_emitted [B] (int64).

    Semantics of sampling.verify_block: temperature <= 0 greedy (longest prefix where draft == argmax, then the target's
    argmax); otherwise rejection sampling in float64 (accept draft i iff u[i]*q < p; on rejection draw from
    normalize(max(p-q, 0)) — p itself when that is all zero — else the bonus from the last slot's p, both by inverse
    CDF with u[bs-1]). draft_probs / uniforms are read only when sampling (greedy callers may pass any small array).
    """
    n, i64 = helper.make_node, _i64
    temp = helper.make_node("Constant", [], ["temperature_c"])
    temp.attribute.append(_ref("value_float", "temperature", AttributeProto.FLOAT))
    greedy, sampling = _verify_greedy_branch(), _verify_sampling_branch()

    nodes = [
        temp,
        i64("c_zero1", [0]), i64("c_one1", [1]), i64("c_two1", [2]), i64("c_one2", [1, 2]), i64("c_m1", [-1]),
        i64("c_m1_scalar", -1), i64("c_big", [np.iinfo(np.int64).max]),
        _const_node("c_zero_f", np.array(0.0, np.float32)),
        n("Shape", ["draft_tokens"], ["dshape"]),
        n("Slice", ["dshape", "c_one1", "c_two1"], ["n1"]),
        n("LessOrEqual", ["temperature_c", "c_zero_f"], ["is_greedy"]),
        n("If", ["is_greedy"], ["acc", "last"], then_branch=greedy, else_branch=sampling),
        # emitted = drafts[:acc] + [last] + EMIT_PAD...
        n("Shape", ["target_logits"], ["lshape"]),
        n("Slice", ["lshape", "c_one1", "c_two1"], ["bs1"]),
        n("Squeeze", ["bs1", "c_zero1"], ["bs"]),
        i64("c_zero", 0), i64("c_one", 1),
        n("Range", ["c_zero", "bs", "c_one"], ["slots"]),
        n("Unsqueeze", ["acc", "c_one1"], ["acc2"]),
        n("Less", ["slots", "acc2"], ["is_draft"]),
        n("Equal", ["slots", "acc2"], ["is_last"]),
        n("Shape", ["draft_tokens"], ["dshape2"]),
        n("ScatterElements", ["dshape2", "c_one1", "c_one1"], ["pad_shape"], axis=0),
        n("ConstantOfShape", ["pad_shape"], ["dpad"], value=onnx.numpy_helper.from_array(np.array([0], np.int64))),
        n("Concat", ["draft_tokens", "dpad"], ["draft_ext"], axis=1),
        i64("c_pad", EMIT_PAD),
        n("Where", ["is_last", "last", "c_pad"], ["tail"]),
        n("Where", ["is_draft", "draft_ext", "tail"], ["emitted_tokens"]),
        n("Identity", ["acc"], ["accept_len"]),
        n("Add", ["acc", "c_one"], ["n_emitted"]),
    ]
    return helper.make_function(
        DOMAIN, FUSED_VERIFY, ["target_logits", "draft_tokens", "draft_probs", "uniforms"],
        ["accept_len", "emitted_tokens", "n_emitted"], nodes, [helper.make_opsetid("", ONNX_OPSET)],
        attributes=function_attrs(FUSED_VERIFY),
    )


def function_attrs(op: str) -> list[str]:
    """The attributes an op's function declares: the required ones and `aot`."""
    return list(REQUIRED_ATTRS[op]) + [AOT_ATTR]


def plugin_attrs() -> dict:
    """What every dflash node carries for TensorRT: the plugin lookup, and `aot` = 1, the Triton kernel compiled
    ahead of time (TensorRT's parser turns 1 / 0 into a strict AOT / JIT plugin request; a build asking for the JIT
    impl rewrites it to 0 in the graph it parses). ONNX Runtime inlines the function and ignores it."""
    return {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION, AOT_ATTR: 1}


def fused_verify_model(temperature: float, vocab_size: int | None = None) -> onnx.ModelProto:
    """A model holding one FusedVerify node (inputs/outputs as the op): the op alone, for tests and plugin checks."""
    node = helper.make_node(FUSED_VERIFY, ["target_logits", "draft_tokens", "draft_probs", "uniforms"],
                            ["accept_len", "emitted_tokens", "n_emitted"], domain=DOMAIN,
                            temperature=float(temperature), **plugin_attrs())
    f = TensorProto.FLOAT
    graph = helper.make_graph([node], "fused_verify", [
        helper.make_tensor_value_info("target_logits", f, ["B", "bs", vocab_size or "V"]),
        helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["B", "n"]),
        helper.make_tensor_value_info("draft_probs", f, ["B", "n_or_1", "V_or_1"]),
        helper.make_tensor_value_info("uniforms", f, ["B", "bs_or_1"]),
    ], [
        helper.make_tensor_value_info("accept_len", TensorProto.INT64, ["B"]),
        helper.make_tensor_value_info("emitted_tokens", TensorProto.INT64, ["B", "bs"]),
        helper.make_tensor_value_info("n_emitted", TensorProto.INT64, ["B"]),
    ])
    return make_model(graph, [fused_verify_function()])


def make_model(graph: onnx.GraphProto, functions: list[onnx.FunctionProto]) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET),
                                                    helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
                              functions=functions, producer_name="dflash-export")
    model.ir_version = 8  # IR 8 = opset 17 era with model-local functions; readable by ORT >= 1.12 and TensorRT 10
    return model
