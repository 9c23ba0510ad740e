"""Mixture-of-experts MLPs in the exported graphs: a sparse form for ONNX Runtime, a dense form for every backend.

- "sparse" (the ONNX Runtime flavors): ONNX Runtime's `com.microsoft.MoE` (fp32) -- routing, each row's top-k experts
  only, the gated activation and the weighted sum in one CPU kernel; `quantize_moe_experts` turns it into `QMoE`
  (int8 / int4 expert weights, blocks along K) in a quantized build. Checked against transformers' own MoE modules
  (tests/test_moe_targets.py) for both routings (softmax then top-k, optionally renormalized; top-k of the logits then
  a softmax over those k, which is the renormalized form) and gpt-oss's clamped SwiGLU with biases.
- "dense" (the portable graph that TensorRT parses): every expert computed for every token and weighted by a dense
  [.., E] vector with zeros for the experts not chosen; standard ops only, experts / top-k times the sparse FLOPs.

Exactness per row: the MoE kernel groups the rows routed to one expert into one GEMM, and on x86 MLAS's one-row GEMM
rounds differently from its many-row GEMM. The sparse form therefore feeds the kernel every row twice, so no expert
ever runs a one-row GEMM and a row's output does not depend on which other rows share its experts (measured bit-exact
from 1 to 40 rows, fp32, AVX2+FMA); the cost is a second copy of each row's activations, not of the weights a step
reads. QMoE has a further dependence on the other rows (its work partition), so a quantized MoE engine's verify rows
may differ from plain steps in the last bits: the numerics probe measures it and says so (engines/numerics.py).
"""

from __future__ import annotations

import numpy as np

from dflash_export.export.builder import MS, GraphBuilder

# Forms of the expert MLP, by graph flavor: ONNX Runtime's flavors take the sparse contrib op, the portable graph
# (TensorRT's parser, any ONNX runtime) keeps standard ops.
SPARSE_FLAVORS = ("ort", "ort_batch")


def moe_mlp(g: GraphBuilder, x: str, sd: dict, p: str, spec, config, sparse: bool) -> str:
    """The mixture-of-experts MLP of the layer whose weights sit under `p` (e.g. "model.layers.3.mlp.") on x [B,S,H]
    -> [B,S,H]. `spec`: models.arch.MoeSpec; `config`: the target's HF config (top-k, renormalization, SwiGLU limit)."""
    top_k = int(getattr(config, spec.top_k))
    norm = bool(getattr(config, spec.norm_topk_prob, False)) if spec.norm_topk_prob else False
    norm = norm or spec.always_normalized  # Qwen3.5-MoE's router renormalizes whatever the config says
    limit = getattr(config, spec.swiglu_limit, None) if spec.swiglu_limit else None
    limit = float(limit) if limit is not None else None
    w = expert_weights(sd, p, spec)
    if sparse:
        return _sparse(g, x, w, p, spec, top_k, norm, limit)
    return _dense(g, x, w, p, spec, top_k, norm, limit)


def expert_weights(sd: dict, p: str, spec) -> dict[str, np.ndarray | None]:
    """The layer's experts in one layout: gate [E,I,H], up [E,I,H], down [E,H,I] (torch's [out, in] per expert), their
    biases gate_bias / up_bias [E,I] and down_bias [E,H] (or None), router [E,H] and router_bias [E] (or None)."""
    gate_up, down = sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"]
    gb = ub = db = None
    if spec.interleaved_transposed:   # gpt-oss: gate_up [E,H,2I] gate / up in even / odd columns, down [E,I,H]
        gate = gate_up[:, :, 0::2].transpose(0, 2, 1)
        up = gate_up[:, :, 1::2].transpose(0, 2, 1)
        down = down.transpose(0, 2, 1)
    else:                             # Qwen3-MoE: gate_up [E,2I,H] gate rows first, down [E,H,I]
        inter = gate_up.shape[1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if spec.expert_bias:
        gub = sd[p + "experts.gate_up_proj_bias"]
        gb, ub = (gub[:, 0::2], gub[:, 1::2]) if spec.interleaved_transposed else np.split(gub, 2, axis=1)
        db = sd[p + "experts.down_proj_bias"]
    return {"gate": gate, "up": up, "down": down, "gate_bias": gb, "up_bias": ub, "down_bias": db,
            "router": sd[p + spec.router + ".weight"], "router_bias": sd.get(p + spec.router + ".bias")}


def interleave(gate: np.ndarray, up: np.ndarray, axis: int = 1) -> np.ndarray:
    """[g0, u0, g1, u1, ...] along `axis`: the fused gate / up layout ONNX Runtime's CPU MoE kernels read."""
    out = np.empty(gate.shape[:axis] + (2 * gate.shape[axis],) + gate.shape[axis + 1:], dtype=np.float32)
    idx = [slice(None)] * gate.ndim
    idx[axis] = slice(0, None, 2)
    out[tuple(idx)] = gate
    idx[axis] = slice(1, None, 2)
    out[tuple(idx)] = up
    return out


def _sparse(g: GraphBuilder, x: str, w: dict, p: str, spec, top_k: int, norm: bool, limit: float | None) -> str:
    """com.microsoft.MoE over the rows of x, each row fed twice (see the module docstring) and the first copies
    kept. The router is a Gemm so that a weight-only quantization pass (MatMulNBits, MatMul nodes only) keeps it fp32:
    top-k choices are what a few bits of router error flip."""
    hidden = w["router"].shape[1]
    flat = g.op("Reshape", [x, g.const([-1, hidden])])
    router = [flat, g.weight(p + spec.router + ".expert_rows", w["router"])]   # [E,H]: the dense form's transposed
    if w["router_bias"] is not None:
        router.append(g.weight(p + spec.router + "_bias", w["router_bias"]))
    logits = g.op("Gemm", router, transB=1)                                            # [N, E]
    twice = g.op("Concat", [flat, flat], axis=0)
    logits2 = g.op("Concat", [logits, logits], axis=0)
    fc1 = g.weight(p + "experts.fc1", interleave(w["gate"], w["up"]))                 # [E, 2I, H]
    fc2 = g.weight(p + "experts.fc2", np.ascontiguousarray(w["down"]))                # [E, H, I]
    b1 = b2 = ""
    if w["gate_bias"] is not None:
        b1 = g.weight(p + "experts.fc1_bias", interleave(w["gate_bias"], w["up_bias"]))
        b2 = g.weight(p + "experts.fc2_bias", np.ascontiguousarray(w["down_bias"]))
    attrs = {"k": top_k, "activation_type": "swiglu", "swiglu_fusion": 1,
             # top-k of the logits then a softmax over those k (gpt-oss) is the renormalized top-k of the softmax
             "normalize_routing_weights": int(norm or spec.softmax_after_topk),
             "activation_alpha": float(spec.swiglu_alpha), "activation_beta": 1.0 if spec.up_plus_one else 0.0}
    if limit is not None:
        attrs["swiglu_limit"] = limit
    y2 = g.op("MoE", [twice, logits2, fc1, b1, fc2, b2], domain=MS, name="moe", **attrs)
    rows = g.op("Shape", [flat], start=0, end=1)
    y = g.op("Slice", [y2, g.const([0]), rows, g.const([0])])
    return g.op("Reshape", [y, g.op("Shape", [x])])


def _dense(g: GraphBuilder, x: str, w: dict, p: str, spec, top_k: int, norm: bool, limit: float | None) -> str:
    """Every expert for every row, weighted by a dense [.., E] vector (zeros for the experts not chosen)."""
    logits = g.linear(x, w["router"], p + spec.router, w["router_bias"])                # [B,S,E]
    if spec.softmax_after_topk:
        top, idx = g.op("TopK", [logits, g.const([top_k])], n_out=2, axis=-1, largest=1, sorted=1)
        top = g.op("Softmax", [top], axis=-1)
        base = logits
    else:
        probs = g.op("Softmax", [logits], axis=-1)
        top, idx = g.op("TopK", [probs, g.const([top_k])], n_out=2, axis=-1, largest=1, sorted=1)
        if norm:
            top = g.op("Div", [top, g.op("ReduceSum", [top, g.const([-1])], keepdims=1)])
        base = probs
    weights = g.op("ScatterElements", [g.op("Mul", [base, g.const(0.0, np.float32)]), idx, top], axis=-1)
    gate_up = np.concatenate([w["gate"], w["up"]], axis=1)                              # [E, 2I, H]
    num_e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    # every expert's gate and up rows in one MatMul: [B,S,H] x [H, E*2I] -> [B,S,E,2I]
    gu = g.op("MatMul", [x, g.weight(p + "experts.gate_up_proj", np.ascontiguousarray(
        gate_up.reshape(num_e * two_i, hidden).T))])
    if w["gate_bias"] is not None:
        gu = g.op("Add", [gu, g.weight(p + "experts.gate_up_proj_bias", np.concatenate(
            [w["gate_bias"], w["up_bias"]], axis=1).reshape(-1))])
    gu = g.op("Reshape", [gu, g.const([0, 0, num_e, two_i])])
    gt, u = g.op("Split", [gu, g.const([inter, inter])], n_out=2, axis=-1)
    if limit is not None:
        gt = g.op("Min", [gt, g.const(limit, np.float32)])
        u = g.op("Clip", [u, g.const(-limit, np.float32), g.const(limit, np.float32)])
    gs = gt if spec.swiglu_alpha == 1.0 else g.op("Mul", [gt, g.const(spec.swiglu_alpha, np.float32)])
    glu = g.op("Mul", [gt, g.op("Sigmoid", [gs])])
    if spec.up_plus_one:
        u = g.op("Add", [u, g.const(1.0, np.float32)])
    act = g.op("Mul", [glu, u])                                                         # [B,S,E,I]
    # per expert: [B,S,E,1,I] x [E,I,H] -> [B,S,E,1,H]
    out = g.op("MatMul", [g.op("Unsqueeze", [act, g.const([3])]),
                          g.weight(p + "experts.down_proj", np.ascontiguousarray(w["down"].transpose(0, 2, 1)))])
    out = g.op("Squeeze", [out, g.const([3])])                                          # [B,S,E,H]
    if w["down_bias"] is not None:
        out = g.op("Add", [out, g.weight(p + "experts.down_proj_bias", w["down_bias"])])
    mixed = g.op("Mul", [out, g.op("Unsqueeze", [weights, g.const([-1])])])
    return g.op("ReduceSum", [mixed, g.const([2])], keepdims=0)                         # [B,S,H]


# Expert quantization ------------------------------------------------------------------------------------------------

def quantize_expert_stack(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """[E, N, K] float32 -> (packed uint8 [E, N, K*bits/8], scales float32 [E, N, K/block]): symmetric blocks of
    `block` along K, zero point 2^(bits-1) (QMoE's default), by ONNX Runtime's own MatMulNBits quantizer kernels."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    num_e, n, k = w.shape
    kb = k // block
    packed = np.zeros((num_e, n, kb, block * bits // 8), np.uint8)
    scales = np.zeros((num_e, n * kb), np.float32)
    zero = np.zeros(n * kb, np.uint8)   # written for asymmetric blocks only
    for e in range(num_e):
        fn(packed[e], np.ascontiguousarray(w[e].T, dtype=np.float32), scales[e], zero, block, n, k, True)
    return packed.reshape(num_e, n, -1), scales.reshape(num_e, n, kb)


def quantize_moe_experts(model, bits: int, block: int, accuracy_level: int, base_dir: str | None = None,
                         store=None) -> dict:
    """Turn every com.microsoft.MoE node of `model` (onnx.ModelProto; external weights read from `base_dir`) into
    QMoE with `bits`-bit expert weights (block-wise along K, symmetric); the router and biases stay fp32. The new
    tensors go inline, or to `store` (builder.WeightStore) when given. A layer whose hidden or expert width is not a
    multiple of `block` keeps its fp32 experts. Returns {"moe_quantized": n, "moe_total": m}."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    done, nodes = 0, [n for n in graph.node if n.op_type == "MoE" and n.domain == MS]
    for node in nodes:
        fc1 = numpy_helper.to_array(inits[node.input[2]], base_dir or "")
        fc2 = numpy_helper.to_array(inits[node.input[4]], base_dir or "")
        if fc1.shape[2] % block or fc2.shape[2] % block:
            continue
        q1, s1 = quantize_expert_stack(fc1, bits, block)
        del fc1
        q2, s2 = quantize_expert_stack(fc2, bits, block)
        del fc2
        names = []
        for arr, suffix, src in ((q1, "_q", node.input[2]), (s1, "_scales", node.input[2]),
                                 (q2, "_q", node.input[4]), (s2, "_scales", node.input[4])):
            name = src + suffix
            graph.initializer.append(store.put(name, arr) if store else numpy_helper.from_array(arr, name))
            names.append(src + suffix)
        for src in (node.input[2], node.input[4]):
            graph.initializer.remove(inits.pop(src))
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
        bias = list(node.input[3:6:2]) + [""] * 2
        qnode = helper.make_node("QMoE", [node.input[0], node.input[1], names[0], names[1], bias[0], names[2],
                                          names[3], bias[1]], list(node.output), name=node.name + "_q", domain=MS,
                                 expert_weight_bits=bits, block_size=block, accuracy_level=accuracy_level, **attrs)
        idx = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(idx, qnode)
        done += 1
    return {"moe_quantized": done, "moe_total": len(nodes)}


def moe_nodes_as_plain_ops(model) -> int:
    """Rewrite every fp32 com.microsoft.MoE node of `model` (onnx.ModelProto; weights may stay external) as the
    dense form in standard ops over the node's own weights, for a backend that parses only standard ONNX (TensorRT's
    copy of the batch graph): softmax, top-k, the renormalized weights scattered to [N, E], every expert's SwiGLU,
    the weighted sum. Same routing and activation attributes as the kernel. Returns the number of nodes rewritten."""
    from onnx import TensorProto, helper

    graph = model.graph
    done = 0
    for node in [n for n in graph.node if n.op_type == "MoE" and n.domain == MS]:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        g = _NodeList(node.output[0] + "/plain/")
        op, const, nodes = g.op, g.const, g.nodes
        x, logits, fc1, b1, fc2, b2 = (list(node.input) + [""] * 6)[:6]
        k = int(a["k"])
        probs = op("Softmax", [logits], axis=-1)
        top, idx = op("TopK", [probs, const([k])], n_out=2, axis=-1, largest=1, sorted=1)
        if int(a.get("normalize_routing_weights", 0)):
            top = op("Div", [top, op("ReduceSum", [top, const([-1])], keepdims=1)])
        weights = op("ScatterElements", [op("Mul", [probs, const(0.0, TensorProto.FLOAT)]), idx, top], axis=-1)
        shape1 = op("Shape", [fc1])                                                       # [E, 2I, H]
        e_2i_h = op("Split", [shape1, const([1, 1, 1])], n_out=3, axis=0)
        rows = op("Mul", [e_2i_h[0], e_2i_h[1]])
        w1 = op("Transpose", [op("Reshape", [fc1, op("Concat", [rows, e_2i_h[2]], axis=0)])], perm=[1, 0])
        gu = op("MatMul", [x, w1])                                                        # [N, E*2I]
        if b1:
            gu = op("Add", [gu, op("Reshape", [b1, const([-1])])])
        n_rows = op("Shape", [x], start=0, end=1)
        gu = op("Reshape", [gu, op("Concat", [n_rows, e_2i_h[0], const([-1, 2])], axis=0)])   # [N, E, I, 2]
        gate, up = (op("Squeeze", [h, const([3])]) for h in op("Split", [gu, const([1, 1])], n_out=2, axis=3))
        limit = a.get("swiglu_limit")
        if limit is not None:
            gate = op("Min", [gate, const(float(limit), TensorProto.FLOAT)])
            up = op("Clip", [up, const(-float(limit), TensorProto.FLOAT), const(float(limit), TensorProto.FLOAT)])
        alpha, beta = float(a.get("activation_alpha", 1.0)), float(a.get("activation_beta", 0.0))
        act = op("Mul", [gate, op("Sigmoid", [op("Mul", [gate, const(alpha, TensorProto.FLOAT)])])])
        act = op("Mul", [act, op("Add", [up, const(beta, TensorProto.FLOAT)])])           # [N, E, I]
        out = op("MatMul", [op("Unsqueeze", [act, const([2])]), op("Transpose", [fc2], perm=[0, 2, 1])])
        out = op("Squeeze", [out, const([2])])                                           # [N, E, H]
        if b2:
            out = op("Add", [out, b2])
        mixed = op("Mul", [out, op("Unsqueeze", [weights, const([-1])])])
        nodes.append(helper.make_node("ReduceSum", [mixed, const([1])], list(node.output), name=g.prefix + "sum",
                                      keepdims=0))
        idx_node = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, n in enumerate(nodes):
            graph.node.insert(idx_node + offset, n)
        done += 1
    return done


class _NodeList:
    """Nodes made for one rewritten node, named under `prefix` (unique in the graph: the node's output name)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list = []

    def op(self, op_type: str, inputs, n_out: int = 1, **attrs):
        from onnx import helper

        outs = [f"{self.prefix}{op_type.lower()}_{len(self.nodes)}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0], **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype: int = 7) -> str:   # 7: TensorProto.INT64
        from onnx import helper

        arr = np.asarray(value)
        name = f"{self.prefix}const_{len(self.nodes)}"
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=helper.make_tensor(
            name, dtype, list(arr.shape), arr.reshape(-1).tolist())))
        return name
