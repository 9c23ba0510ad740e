"""ONNX graphs for the target (prefill + block verify, feature-fused) and the drafter, built op by op from the weights.

Hand-written with onnx.helper rather than optimum's exporter: optimum traces HF's forward, which cannot emit the tapped
layers folded through the drafter's fc/hidden_norm, the dflash custom-op nodes with their functions, a logits slice
(LM head on the last `num_logits` rows only), nor weights shared by file between two graphs. Building from the weights
is also seconds instead of a trace, and the same code emits ONNX Runtime's fused contrib ops (`flavor="ort"`).

Two flavors of the target graph, same weights and outputs:
- "portable": standard opset-17 ops; past K/V in, present K/V (= past ++ new) out. What TensorRT and any runtime read.
- "ort": com.microsoft GroupQueryAttention / SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization over a
  fixed-size K/V buffer shared by past and present (no per-step concat), for the ONNX Runtime engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash_export.errors import DFlashError
from dflash_export.export import ops

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64
I32 = TensorProto.INT32
MS = "com.microsoft"


class GraphBuilder:
    """Collects nodes and initializers; `op` returns the output name(s)."""

    def __init__(self, name: str, store: "WeightStore | None" = None):
        self.name = name
        self.store = store  # large weights go to disk as soon as they are made: export memory stays ~ the model's
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray | onnx.TensorProto] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op_type: str, inputs, n_out: int = 1, name: str | None = None, domain: str = "",
           outputs: list[str] | None = None, **attrs):
        outs = outputs or [self.fresh(name or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh("n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def weight(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        self.inits[name] = self.store.put(name, arr) if self.store and arr.nbytes > self.store.small_bytes else arr
        return name

    def const(self, value, dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(self.fresh("const"), arr)
        return self._consts[key]

    def input(self, name, elem, shape):
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name, elem, shape):
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    # Common blocks ----------------------------------------------------------------------------------------------------

    def linear(self, x: str, w: np.ndarray, wname: str, b: np.ndarray | None = None) -> str:
        """x [..., in] @ W^T (W [out, in] as torch stores it, transposed once at export)."""
        y = self.op("MatMul", [x, self.weight(wname, np.ascontiguousarray(w.T))])
        if b is not None:
            y = self.op("Add", [y, self.weight(wname + "_bias", b)])
        return y

    def rms_norm(self, x: str, w: str, eps: float, ort: bool) -> str:
        if ort:
            return self.op("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=float(eps))
        # fp32 RMSNorm as the reference: x * rsqrt(mean(x^2) + eps) * w
        sq = self.op("Mul", [x, x])
        ms = self.op("ReduceMean", [sq], axes=[-1], keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.const(eps, np.float32)])])])
        return self.op("Mul", [self.op("Mul", [x, inv]), w])

    def heads(self, x: str, n: int, d: int) -> str:
        """[B,S,n*d] -> [B,n,S,d]"""
        return self.op("Transpose", [self.op("Reshape", [x, self.const([0, 0, n, d])])], perm=[0, 2, 1, 3])

    def rope(self, x: str, cos: str, sin: str, d: int) -> str:
        """x [B,h,S,D]; cos/sin [B,1,S,D]; rotate-half as HF."""
        x1, x2 = self.op("Split", [x, self.const([d // 2, d // 2])], n_out=2, axis=-1)
        rot = self.op("Concat", [self.op("Neg", [x2]), x1], axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])])

    def rope_tables(self, positions: str, cos_table: str, sin_table: str) -> tuple[str, str]:
        """positions [B,S] -> cos/sin [B,1,S,D] gathered from [max_len, D] tables."""
        one = self.const([1])
        cos = self.op("Unsqueeze", [self.op("Gather", [cos_table, positions], axis=0), one])
        sin = self.op("Unsqueeze", [self.op("Gather", [sin_table, positions], axis=0), one])
        return cos, sin

    def mlp(self, x: str, sd: dict, p: str, wprefix: str = "") -> str:
        gate = self.linear(x, sd[p + "gate_proj.weight"], wprefix + p + "gate_proj")
        up = self.linear(x, sd[p + "up_proj.weight"], wprefix + p + "up_proj")
        act = self.op("Mul", [gate, self.op("Sigmoid", [gate])])  # SiLU
        return self.linear(self.op("Mul", [act, up]), sd[p + "down_proj.weight"], wprefix + p + "down_proj")

    def mlp_fused(self, x: str, sd: dict, p: str) -> str:
        """As `mlp`, with gate and up in one MatMul (same input, one dispatch), split afterwards."""
        w = np.concatenate([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]], axis=0)
        inter = sd[p + "gate_proj.weight"].shape[0]
        gate, up = self.op("Split", [self.linear(x, w, p + "gate_up_proj"), self.const([inter, inter])], n_out=2,
                           axis=-1)
        act = self.op("Mul", [gate, self.op("Sigmoid", [gate])])
        return self.linear(self.op("Mul", [act, up]), sd[p + "down_proj.weight"], p + "down_proj")

    def block_conv(self, x: str, dynamic: str, base: np.ndarray, wname: str, c) -> str:
        """DFlash 2's grouped dynamic causal convolution along the block: x [B,L,H], dynamic [B,L,K,G], base [K,H]
        -> sum_o (base[o] + dynamic[:, :, o]) * x shifted o slots later (zeros before the anchor), per group.
        Plain ONNX: K shifted copies (Pad then Slice back to L, so a block shorter than K stays exact)."""
        k, gs = c.conv_kernel_size, c.conv_group_size
        groups = c.hidden_size // gs
        blocks = self.op("Reshape", [x, self.const([0, 0, groups, gs])])
        length = self.op("Shape", [x], start=1, end=2)
        dyn = self.op("Split", [dynamic, self.const([1] * k)], n_out=k, axis=2) if k > 1 else [dynamic]
        out = None
        for o in range(k):
            shifted = blocks
            if o:
                padded = self.op("Pad", [blocks, self.const([0, o, 0, 0, 0, 0, 0, 0])])
                shifted = self.op("Slice", [padded, self.const([0]), length, self.const([1])])
            dyn_o = self.op("Transpose", [dyn[o]], perm=[0, 1, 3, 2])  # [B,L,1,G] -> [B,L,G,1]
            base_o = self.weight(f"{wname}.{o}", base[o].reshape(1, 1, groups, gs).astype(np.float32))
            term = self.op("Mul", [self.op("Add", [base_o, dyn_o]), shifted])
            out = term if out is None else self.op("Add", [out, term])
        return self.op("Reshape", [out, self.const([0, 0, c.hidden_size])])

    def block_conv_prepare(self, x: str, sd: dict, wname: str, p: str, c) -> tuple[str, str]:
        """DFlash 2's `prepare`: the kernel projection of x [B,L,H] -> [B,L,2,K,G]; x convolved with base_kernel[0]
        and the first half; returns (convolved x, the second half [B,L,K,G] for `finish`)."""
        k, groups = c.conv_kernel_size, c.hidden_size // c.conv_group_size
        dyn = self.op("Reshape", [self.linear(x, sd[p + "kernel_projection.weight"], wname + ".kernel_projection"),
                                  self.const([0, 0, 2, k, groups])])
        first, second = (self.op("Squeeze", [half, self.const([2])])
                         for half in self.op("Split", [dyn, self.const([1, 1])], n_out=2, axis=2))
        return self.block_conv(x, first, sd[p + "base_kernel"][0], wname + ".base0", c), second

    def lm_head(self, hidden: str, head: str, hidden_size: int) -> str:
        """hidden [B,n,H] -> logits [B,n,V] with Gemm(transB) on the [V,H] table itself, so the embedding and a tied
        LM head stay one tensor (a MatMul would need a transposed copy)."""
        shape = self.op("Shape", [hidden])
        bn = self.op("Slice", [shape, self.const([0]), self.const([2])])
        flat = self.op("Reshape", [hidden, self.const([-1, hidden_size])])
        logits2 = self.op("Gemm", [flat, head], transB=1)
        v = self.op("Shape", [head])
        v0 = self.op("Slice", [v, self.const([0]), self.const([1])])
        return self.op("Reshape", [logits2, self.op("Concat", [bn, v0], axis=0)])


@dataclass
class TargetSpec:
    """What the graphs need from the target and drafter configs."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    qk_norm: bool
    tied: bool


def target_spec(target) -> TargetSpec:
    c = target.hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return TargetSpec(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim,
                      c.vocab_size, float(c.rms_norm_eps), target.arch.qk_norm,
                      bool(getattr(c, "tie_word_embeddings", False)))


def np_state(module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().cpu().numpy() for k, v in module.state_dict().items()}


def target_rope_tables(target, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_len, D] from the HF model's own rotary module (every rope_scaling transformers supports)."""
    import torch

    rot = target.hf.model.rotary_emb
    pos = torch.arange(max_len)[None]
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].float().numpy(), sin[0].float().numpy()


def drafter_rope_tables(drafter, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    with torch.no_grad():
        cos, sin = drafter.rotary(torch.arange(max_len)[None], torch.float32)
    return cos[0].numpy(), sin[0].numpy()


SHARED_EMBED = "shared.embed_tokens"
SHARED_HEAD = "shared.lm_head"


def shared_tensors(target) -> dict[str, np.ndarray]:
    """The target's embedding and LM head (one tensor when tied): stored once, used by both graphs."""
    sd = target.hf.state_dict()
    embed = sd["model.embed_tokens.weight"].detach().float().numpy()
    out = {SHARED_EMBED: embed}
    head = sd.get("lm_head.weight")
    if head is not None and not (head.data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
                                 or np.array_equal(head.detach().float().numpy(), embed)):
        out[SHARED_HEAD] = head.detach().float().numpy()
    return out


def head_name(shared: dict) -> str:
    return SHARED_HEAD if SHARED_HEAD in shared else SHARED_EMBED


def build_target_graph(target, drafter, max_len: int, flavor: str = "portable", store: "WeightStore | None" = None
                       ) -> tuple[onnx.ModelProto, dict, dict]:
    """Target decoder + folded fc/hidden_norm (+ FusedVerify in the portable flavor).

    portable — inputs: input_ids [B,S] int64; position_ids [B,S] int64 (absolute; the cache holds positions below);
    num_logits [] int64 (LM head on the last num_logits rows); draft_tokens [B,num_logits-1] int64; draft_probs,
    uniforms (FusedVerify's, read only when sampling); per layer past_key_i / past_value_i [B,KVH,P,D].
    Outputs: logits [B,num_logits,V], ctx [B,S,H_drafter], accept_len / emitted_tokens / n_emitted (greedy verify of
    the logits rows against draft_tokens), present_key_i / present_value_i [B,KVH,P+S,D].
    ort — inputs: inputs_embeds [B,S,H]; num_logits; seqlens_k [B] int32 (total length - 1); total_seq_len [] int32;
    per layer past_key_i / past_value_i [B,KVH,capacity,D], bound to the same memory as present_key_i /
    present_value_i (GroupQueryAttention writes the new rows in place). Outputs: hidden [B,num_logits,H] (final-normed
    rows for the LM-head session), ctx, presents.
    Returns the model, its own weights (arrays, or TensorProtos already in `store`) and the shared tensors it uses.
    """
    # "ort_batch": the ort flavor for B sequences verifying blocks over their own pasts, which GroupQueryAttention
    # (CPU) refuses (batch > 1 with many rows and a past): attention in plain ops reads the K/V buffer and returns
    # only the new rows (engines/ort_batch.py writes them back).
    batch = flavor == "ort_batch"
    ort = flavor in ("ort", "ort_batch")
    t = target_spec(target)
    sd = np_state(target.hf)
    dsd = np_state(drafter)
    shared = shared_tensors(target)
    g = GraphBuilder("dflash_target_verify", store)
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads

    if ort:
        # The engine reads embedding rows itself (from the shared file, on demand: the table never becomes
        # resident) and runs the LM head in its own session, so this graph holds no vocabulary-sized tensor.
        ids = g.input("inputs_embeds", F32, ["batch", "seq", t.hidden_size])
    else:
        ids = g.input("input_ids", I64, ["batch", "seq"])
    g.input("num_logits", I64, [])
    if not ort:
        g.input("draft_tokens", I64, ["batch", "n_draft"])
        g.input("draft_probs", F32, ["batch", "n_draft_or_1", "vocab_or_1"])
        g.input("uniforms", F32, ["batch", "n_uniforms"])
    if batch:
        pos = g.input("position_ids", I64, ["batch", "seq"])
        g.input("past_bias", F32, ["batch", "past"])
    elif ort:
        g.input("seqlens_k", I32, ["batch"])
        g.input("total_seq_len", I32, [])
    else:
        pos = g.input("position_ids", I64, ["batch", "seq"])

    cos_t, sin_t = target_rope_tables(target, max_len)
    if batch:
        cos, sin = g.rope_tables(pos, g.weight("rope_cos", cos_t), g.weight("rope_sin", sin_t))
        causal = _block_causal_bias(g, ids, H // KVH)
    elif ort:
        # GQA applies RoPE itself from half-width tables (rotate-half layout), positions from seqlens_k.
        cos_c = g.weight("rope_cos_half", cos_t[:, : D // 2])
        sin_c = g.weight("rope_sin_half", sin_t[:, : D // 2])
    else:
        cos, sin = g.rope_tables(pos, g.weight("rope_cos", cos_t), g.weight("rope_sin", sin_t))
        # Causal mask over the cache: key k (absolute position k) is visible to a query at position p iff k <= p.
        past_len = g.op("Shape", ["past_key_0"], start=2, end=3)
        seq_len = g.op("Shape", [ids], start=1, end=2)
        total = g.op("Squeeze", [g.op("Add", [past_len, seq_len]), g.const([0])])
        kpos = g.op("Range", [g.const(0), total, g.const(1)])
        visible = g.op("LessOrEqual", [kpos, g.op("Unsqueeze", [pos, g.const([2])])])  # [B,S,T]
        mask = g.op("Where", [visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32)])
        mask = g.op("Unsqueeze", [mask, g.const([1, 2])])  # [B,1,1,S,T] against scores [B,KVH,G,S,T]

    x = ids if ort else g.op("Gather", [SHARED_EMBED, ids], axis=0)
    taps: dict[int, str] = {}
    tap_ids = list(drafter.config.target_layer_ids)
    residual_pending = None  # ort: the MLP output not yet added (fused into the next SkipSimplifiedLayerNorm)
    for i in range(t.num_layers):
        p = f"model.layers.{i}."
        ln1 = g.weight(p + "input_layernorm", sd[p + "input_layernorm.weight"])
        if ort and residual_pending is not None:
            xn, _, _, x = g.op("SkipSimplifiedLayerNormalization", [x, residual_pending, ln1], n_out=4, domain=MS,
                               epsilon=t.rms_eps)
        else:
            xn = g.rms_norm(x, ln1, t.rms_eps, ort)
        a = p + "self_attn."
        bias = lambda n: sd.get(a + n + ".bias")  # noqa: E731
        if batch:
            attn = _batched_block_attention(g, xn, sd, a, t, i, cos, sin, causal, bias)
        elif ort:
            # One MatMul for q, k and v (same input): a third of the op dispatches, one pass over the activations.
            wqkv = np.concatenate([sd[a + n + "_proj.weight"] for n in "qkv"], axis=0)
            bqkv = None
            if bias("q_proj") is not None:
                bqkv = np.concatenate([bias(n + "_proj") for n in "qkv"], axis=0)
            qkv = g.linear(xn, wqkv, a + "qkv_proj", bqkv)
            past_k = g.input(f"past_key_{i}", F32, ["batch", KVH, "max_len", D])
            past_v = g.input(f"past_value_{i}", F32, ["batch", KVH, "max_len", D])
            if t.qk_norm:  # per-head RMSNorm before GQA's rotary: normalize over a [B,S,h,D] view
                q, k, v = g.op("Split", [qkv, g.const([H * D, KVH * D, KVH * D])], n_out=3, axis=-1)
                qn = g.weight(a + "q_norm", sd[a + "q_norm.weight"])
                kn = g.weight(a + "k_norm", sd[a + "k_norm.weight"])
                q4 = g.op("Reshape", [q, g.const([0, 0, H, D])])
                k4 = g.op("Reshape", [k, g.const([0, 0, KVH, D])])
                q = g.op("Reshape", [g.op("SimplifiedLayerNormalization", [q4, qn], axis=-1, epsilon=t.rms_eps),
                                     g.const([0, 0, H * D])])
                k = g.op("Reshape", [g.op("SimplifiedLayerNormalization", [k4, kn], axis=-1, epsilon=t.rms_eps),
                                     g.const([0, 0, KVH * D])])
                qkv_inputs = [q, k, v]
            else:  # GQA takes the packed [B,S,(H+2KVH)*D] projection directly (key/value inputs left empty)
                qkv_inputs = [qkv, "", ""]
            attn, _, _ = g.op("GroupQueryAttention", [*qkv_inputs, past_k, past_v, "seqlens_k", "total_seq_len",
                                                      cos_c, sin_c], n_out=3, domain=MS,
                              outputs=[g.fresh("attn"), f"present_key_{i}", f"present_value_{i}"],
                              num_heads=H, kv_num_heads=KVH, scale=float(D ** -0.5), do_rotary=1,
                              rotary_interleaved=0)
        else:
            q = g.linear(xn, sd[a + "q_proj.weight"], a + "q_proj", bias("q_proj"))
            k = g.linear(xn, sd[a + "k_proj.weight"], a + "k_proj", bias("k_proj"))
            v = g.linear(xn, sd[a + "v_proj.weight"], a + "v_proj", bias("v_proj"))
            qh, kh, vh = g.heads(q, H, D), g.heads(k, KVH, D), g.heads(v, KVH, D)
            if t.qk_norm:
                qh = g.rms_norm(qh, g.weight(a + "q_norm", sd[a + "q_norm.weight"]), t.rms_eps, False)
                kh = g.rms_norm(kh, g.weight(a + "k_norm", sd[a + "k_norm.weight"]), t.rms_eps, False)
            qh, kh = g.rope(qh, cos, sin, D), g.rope(kh, cos, sin, D)
            past_k = g.input(f"past_key_{i}", F32, ["batch", KVH, "past", D])
            past_v = g.input(f"past_value_{i}", F32, ["batch", KVH, "past", D])
            kall = g.op("Concat", [past_k, kh], axis=2, outputs=[f"present_key_{i}"])
            vall = g.op("Concat", [past_v, vh], axis=2, outputs=[f"present_value_{i}"])
            # GQA as [B,KVH,G,S,D] x [B,KVH,1,D,T]: query head h reads kv head h // G, no repeated K/V.
            q5 = g.op("Reshape", [qh, g.const([0, KVH, H // KVH, -1, D])])
            k5 = g.op("Unsqueeze", [kall, g.const([2])])
            v5 = g.op("Unsqueeze", [vall, g.const([2])])
            scores = g.op("Mul", [g.op("MatMul", [q5, g.op("Transpose", [k5], perm=[0, 1, 2, 4, 3])]),
                                  g.const(D ** -0.5, np.float32)])
            probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
            o5 = g.op("MatMul", [probs, v5])
            attn = g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [o5, g.const([0, H, -1, D])])],
                                         perm=[0, 2, 1, 3]), g.const([0, 0, H * D])])
        attn = g.linear(attn, sd[a + "o_proj.weight"], a + "o_proj", bias("o_proj"))
        ln2 = g.weight(p + "post_attention_layernorm", sd[p + "post_attention_layernorm.weight"])
        if ort:
            xn2, _, _, x = g.op("SkipSimplifiedLayerNormalization", [x, attn, ln2], n_out=4, domain=MS,
                                epsilon=t.rms_eps)
        else:
            x = g.op("Add", [x, attn])
            xn2 = g.rms_norm(x, ln2, t.rms_eps, False)
        m = g.mlp_fused(xn2, sd, p + "mlp.") if ort else g.mlp(xn2, sd, p + "mlp.")
        if ort:
            residual_pending = m
            if i in tap_ids or i == t.num_layers - 1:
                x = g.op("Add", [x, m])
                residual_pending = None
        else:
            x = g.op("Add", [x, m])
        if i in tap_ids:
            taps[i] = x
    if residual_pending is not None:
        x = g.op("Add", [x, residual_pending])
    normed = g.rms_norm(x, g.weight("model.norm", sd["model.norm.weight"]), t.rms_eps, ort)
    if t.num_layers - 1 in tap_ids:
        taps[t.num_layers - 1] = normed  # HF's hidden_states[N] is the final-normed output (the +1 convention)

    # Feature fusion: ctx = hidden_norm(fc(concat(taps))) for every position, so taps never leave the graph.
    cat = g.op("Concat", [taps[i] for i in tap_ids], axis=-1) if len(tap_ids) > 1 else taps[tap_ids[0]]
    fc = g.linear(cat, dsd["fc.weight"], "drafter.fc")
    g.op("Identity", [g.rms_norm(fc, g.weight("drafter.hidden_norm", dsd["hidden_norm.weight"]),
                                 drafter.config.rms_norm_eps, ort)], outputs=["ctx"])

    # LM head only on the rows asked for (prefill: the last; verify: the block).
    neg = g.op("Neg", [g.op("Unsqueeze", ["num_logits", g.const([0])])])
    rows = g.op("Slice", [normed, neg, g.const([np.iinfo(np.int64).max]), g.const([1])])
    if ort:
        g.op("Identity", [rows], outputs=["hidden"])
        g.output("hidden", F32, ["batch", "num_logits", t.hidden_size])
        g.output("ctx", F32, ["batch", "seq", drafter.config.hidden_size])
    else:
        g.op("Identity", [g.lm_head(rows, head_name(shared), t.hidden_size)], outputs=["logits"])
        g.op(ops.FUSED_VERIFY, ["logits", "draft_tokens", "draft_probs", "uniforms"],
             outputs=["accept_len", "emitted_tokens", "n_emitted"], domain=ops.DOMAIN, temperature=0.0,
             **ops.plugin_attrs())
        g.output("logits", F32, ["batch", "num_logits", t.vocab_size])
        g.output("ctx", F32, ["batch", "seq", drafter.config.hidden_size])
        g.output("accept_len", I64, ["batch"])
        g.output("emitted_tokens", I64, ["batch", "num_logits"])
        g.output("n_emitted", I64, ["batch"])
    for i in range(t.num_layers):
        if batch:
            g.output(f"new_key_{i}", F32, ["batch", KVH, "seq", D])
            g.output(f"new_value_{i}", F32, ["batch", KVH, "seq", D])
            continue
        kv_len = "max_len" if ort else "total"
        g.output(f"present_key_{i}", F32, ["batch", KVH, kv_len, D])
        g.output(f"present_value_{i}", F32, ["batch", KVH, kv_len, D])
    return (*finish(g, [] if ort else [ops.fused_verify_function()], ort), shared)


def _block_causal_bias(g: GraphBuilder, x: str, groups: int) -> str:
    """[G*S, S] float: 0 where block key j <= query row r % S, -inf elsewhere (queries laid out group-major)."""
    s = g.op("Squeeze", [g.op("Shape", [x], start=1, end=2), g.const([0])])
    rows = g.op("Range", [g.const(0), g.op("Mul", [s, g.const(groups)]), g.const(1)])
    qi = g.op("Unsqueeze", [g.op("Mod", [rows, s]), g.const([1])])                     # [G*S, 1]
    kj = g.op("Unsqueeze", [g.op("Range", [g.const(0), s, g.const(1)]), g.const([0])])  # [1, S]
    return g.op("Where", [g.op("LessOrEqual", [kj, qi]), g.const(0.0, np.float32), g.const(-np.inf, np.float32)])


def _batched_block_attention(g: GraphBuilder, xn: str, sd: dict, a: str, t: "TargetSpec", i: int, cos: str,
                             sin: str, causal: str, bias) -> str:
    """The ort_batch flavor's attention for layer i: queries [B,S] over past_key_i / past_value_i [B,KVH,P,D] (the
    engine's K/V buffer, read only; past_bias [B,P] hides the rows past each sequence's length) and over the
    block's own keys (causal). Outputs new_key_i / new_value_i [B,KVH,S,D] (keys after k_norm and RoPE, as
    GroupQueryAttention caches them). Scores and softmax in fp32."""
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
    wqkv = np.concatenate([sd[a + n + "_proj.weight"] for n in "qkv"], axis=0)
    bqkv = None
    if bias("q_proj") is not None:
        bqkv = np.concatenate([bias(n + "_proj") for n in "qkv"], axis=0)
    q, k, v = g.op("Split", [g.linear(xn, wqkv, a + "qkv_proj", bqkv), g.const([H * D, KVH * D, KVH * D])],
                   n_out=3, axis=-1)
    qh, kh, vh = g.heads(q, H, D), g.heads(k, KVH, D), g.heads(v, KVH, D)
    if t.qk_norm:
        qh = g.rms_norm(qh, g.weight(a + "q_norm", sd[a + "q_norm.weight"]), t.rms_eps, True)
        kh = g.rms_norm(kh, g.weight(a + "k_norm", sd[a + "k_norm.weight"]), t.rms_eps, True)
    qh = g.rope(qh, cos, sin, D)
    g.op("Identity", [g.rope(kh, cos, sin, D)], outputs=[f"new_key_{i}"])
    g.op("Identity", [vh], outputs=[f"new_value_{i}"])
    past_k = g.input(f"past_key_{i}", F32, ["batch", KVH, "past", D])
    past_v = g.input(f"past_value_{i}", F32, ["batch", KVH, "past", D])
    # GQA without repeating K/V: query head h = kvh * G + g, so [B,H,S,D] is [B,KVH,G*S,D] (group-major rows).
    q4 = g.op("Reshape", [qh, g.const([0, KVH, -1, D])])
    scale = g.const(D ** -0.5, np.float32)
    s_past = g.op("Mul", [g.op("MatMul", [q4, g.op("Transpose", [past_k], perm=[0, 1, 3, 2])]), scale])
    s_past = g.op("Add", [s_past, g.op("Unsqueeze", ["past_bias", g.const([1, 2])])])  # [B,KVH,G*S,P]
    s_new = g.op("Mul", [g.op("MatMul", [q4, g.op("Transpose", [f"new_key_{i}"], perm=[0, 1, 3, 2])]), scale])
    s_new = g.op("Add", [s_new, causal])                                                 # [B,KVH,G*S,S]
    probs = g.op("Softmax", [g.op("Concat", [s_past, s_new], axis=-1)], axis=-1)
    p_len = g.op("Shape", [past_k], start=2, end=3)
    s_len = g.op("Shape", [vh], start=2, end=3)
    p_past, p_new = g.op("Split", [probs, g.op("Concat", [p_len, s_len], axis=0)], n_out=2, axis=-1)
    o4 = g.op("Add", [g.op("MatMul", [p_past, past_v]), g.op("MatMul", [p_new, vh])])   # [B,KVH,G*S,D]
    return g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [o4, g.const([0, H, -1, D])])], perm=[0, 2, 1, 3]),
                            g.const([0, 0, H * D])])


def build_drafter_graph(target, drafter, max_len: int, flavor: str = "portable", store: "WeightStore | None" = None
                        ) -> tuple[onnx.ModelProto, dict, dict]:
    """One bidirectional drafter pass over a block, with the context K/V cache outside the graph.

    Inputs: ctx [B,C,H] (features of context tokens not yet cached, C >= 0), ctx_positions [B,C] int64,
    block_ids [B,bs] int64 (anchor + masks), block_positions [B,bs] int64, per layer past_ctx_key_i / past_ctx_value_i
    [B,KVH,T,D] (after k_norm + RoPE).
    Outputs: draft_tokens [B,bs-1] int64 (argmax), draft_logits [B,bs-1,V] float32 (after `output_multiplier` and
    `final_logit_softcapping`; the engine turns them into draft probabilities with temperature / top-k / top-p when
    sampling), present_ctx_key_i / present_ctx_value_i [B,KVH,T+C,D].
    flavor "ort" (the ONNX Runtime engine's): block_embeds [B,bs,H] (embedding rows, gathered by the engine) replaces
    block_ids; unmasked drafters also take key_bias [B,T+C+bs] float (0 visible, -inf padding; see
    ops.biased_kv_injected_block_attention_function), so B sequences of different lengths draft in one call; and the output is hidden [B,bs-1,H] (normed, for the engine's LM head session) instead of tokens/logits;
    the engine applies the logit multiplier and soft cap (graph metadata) to the head's output.
    Block embeddings are scaled by `input_embedding_scale` inside the graph (both flavors). Causal / sliding-window
    layers use MaskedKVInjectedBlockAttention; the block may be shorter than block_size (the last one of a request).
    """
    ort = flavor == "ort"
    c = drafter.config
    t = target_spec(target)
    sd = np_state(drafter)
    shared = shared_tensors(target)
    g = GraphBuilder("dflash_drafter", store)
    D, H, KVH = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    ctx = g.input("ctx", F32, ["batch", "n_ctx", c.hidden_size])
    ctx_pos = g.input("ctx_positions", I64, ["batch", "n_ctx"])
    if ort:
        ids = g.input("block_embeds", F32, ["batch", "block", t.hidden_size])
    else:
        ids = g.input("block_ids", I64, ["batch", "block"])
    pos = g.input("block_positions", I64, ["batch", "block"])
    cos_t, sin_t = drafter_rope_tables(drafter, max_len)
    cos_tab, sin_tab = g.weight("drafter.rope_cos", cos_t), g.weight("drafter.rope_sin", sin_t)
    cos, sin = g.rope_tables(pos, cos_tab, sin_tab)
    ccos, csin = g.rope_tables(ctx_pos, cos_tab, sin_tab)
    x = ids if ort else g.op("Gather", [SHARED_EMBED, ids], axis=0)
    if c.input_embedding_scale != 1.0:
        x = g.op("Mul", [x, g.const(c.input_embedding_scale, np.float32)])
    k_pos = None
    if c.masked:
        # Key positions for the masked layers: context keys sit at 0..T-1 (every engine feeds the context in order
        # from position 0), then the block's own positions.
        t_ctx = g.op("Add", [g.op("Shape", ["past_ctx_key_0"], start=2, end=3), g.op("Shape", [ctx], start=1, end=2)])
        ctx_kpos = g.op("Range", [g.const(0), g.op("Squeeze", [t_ctx, g.const([0])]), g.const(1)])
        batch = g.op("Shape", [pos], start=0, end=1)
        ctx_kpos = g.op("Expand", [g.op("Unsqueeze", [ctx_kpos, g.const([0])]), g.op("Concat", [batch, t_ctx],
                                                                                     axis=0)])
        k_pos = g.op("Concat", [ctx_kpos, pos], axis=1)
    # ort flavor, unmasked layers: a key bias [B, T+C+bs] (0 / -inf) lets one call carry sequences of different
    # context and block lengths, padded (engines/ort_batch.py). Masked drafters keep their positional mask and are
    # drafted one sequence per call.
    batched = ort and not c.masked
    if batched:
        g.input("key_bias", F32, ["batch", "n_keys"])
    functions = [ops.biased_kv_injected_block_attention_function() if batched
                 else ops.kv_injected_block_attention_function()]
    if c.masked:
        functions.append(ops.masked_kv_injected_block_attention_function())
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        bias = lambda n: sd.get(a + n + ".bias")  # noqa: E731
        kn = g.weight("drafter." + a + "k_norm", sd[a + "k_norm.weight"])
        qn = g.weight("drafter." + a + "q_norm", sd[a + "q_norm.weight"])
        # New context K/V: k_norm on context keys too, RoPE at their own positions.
        ck = g.rope(g.rms_norm(g.heads(g.linear(ctx, sd[a + "k_proj.weight"], "drafter." + a + "k_proj",
                                                bias("k_proj")), KVH, D), kn, c.rms_norm_eps, False),
                    ccos, csin, D)
        cv = g.heads(g.linear(ctx, sd[a + "v_proj.weight"], "drafter." + a + "v_proj", bias("v_proj")), KVH, D)
        past_k = g.input(f"past_ctx_key_{i}", F32, ["batch", KVH, "past_ctx", D])
        past_v = g.input(f"past_ctx_value_{i}", F32, ["batch", KVH, "past_ctx", D])
        k_ctx = g.op("Concat", [past_k, ck], axis=2, outputs=[f"present_ctx_key_{i}"])
        v_ctx = g.op("Concat", [past_v, cv], axis=2, outputs=[f"present_ctx_value_{i}"])
        xn = g.rms_norm(x, g.weight("drafter." + p + "input_layernorm", sd[p + "input_layernorm.weight"]),
                        c.rms_norm_eps, ort)
        if c.is_dflash2:
            xn, attn_dyn = g.block_conv_prepare(xn, sd, "drafter." + p + "attention_conv", p + "attention_conv.", c)
        q = g.rope(g.rms_norm(g.heads(g.linear(xn, sd[a + "q_proj.weight"], "drafter." + a + "q_proj",
                                               bias("q_proj")), H, D), qn, c.rms_norm_eps, False), cos, sin, D)
        kb = g.rope(g.rms_norm(g.heads(g.linear(xn, sd[a + "k_proj.weight"], "drafter." + a + "k_proj",
                                                bias("k_proj")), KVH, D), kn, c.rms_norm_eps, False), cos, sin, D)
        vb = g.heads(g.linear(xn, sd[a + "v_proj.weight"], "drafter." + a + "v_proj", bias("v_proj")), KVH, D)
        if c.layer_causal(i) or c.layer_window(i) is not None:
            att = g.op(ops.MASKED_KV_ATTENTION, [q, k_ctx, v_ctx, kb, vb, pos, k_pos], domain=ops.DOMAIN, num_heads=H,
                       num_kv_heads=KVH, scale=float(D ** -0.5), causal=int(c.layer_causal(i)),
                       window=int(c.layer_window(i) or 0), **ops.plugin_attrs())
        elif batched:
            att = g.op(ops.BIASED_KV_ATTENTION, [q, k_ctx, v_ctx, kb, vb, "key_bias"], domain=ops.DOMAIN,
                       num_heads=H, num_kv_heads=KVH, scale=float(D ** -0.5), **ops.plugin_attrs())
        else:
            att = g.op(ops.KV_ATTENTION, [q, k_ctx, v_ctx, kb, vb], domain=ops.DOMAIN, num_heads=H,
                       num_kv_heads=KVH, scale=float(D ** -0.5), **ops.plugin_attrs())
        att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), g.const([0, 0, H * D])])
        att = g.linear(att, sd[a + "o_proj.weight"], "drafter." + a + "o_proj", bias("o_proj"))
        if c.is_dflash2:
            att = g.block_conv(att, attn_dyn, sd[p + "attention_conv.base_kernel"][1], "drafter." + p +
                               "attention_conv.base1", c)
        x = g.op("Add", [x, att])
        xn2 = g.rms_norm(x, g.weight("drafter." + p + "post_attention_layernorm",
                                     sd[p + "post_attention_layernorm.weight"]), c.rms_norm_eps, ort)
        if c.is_dflash2:
            xn2, mlp_dyn = g.block_conv_prepare(xn2, sd, "drafter." + p + "mlp_conv", p + "mlp_conv.", c)
            m = g.block_conv(g.mlp(xn2, sd, p + "mlp.", "drafter."), mlp_dyn, sd[p + "mlp_conv.base_kernel"][1],
                             "drafter." + p + "mlp_conv.base1", c)
        else:
            m = g.mlp(xn2, sd, p + "mlp.", "drafter.")
        x = g.op("Add", [x, m])
    h = g.rms_norm(x, g.weight("drafter.norm", sd["norm.weight"]), c.rms_norm_eps, ort)
    rows = g.op("Slice", [h, g.const([1]), g.const([np.iinfo(np.int64).max]), g.const([1])])  # anchor slot: nothing
    if c.is_dflash2:  # the candidate selector's projection of each slot; its walk runs on the host (ops.py)
        g.op("Identity", [g.linear(rows, sd["candidate_selector.hidden_projection.weight"],
                                   "drafter.candidate_selector.hidden_projection")], outputs=["selector_hidden"])
        g.output("selector_hidden", F32, ["batch", "n_draft", c.selector_rank])
    if ort:
        g.op("Identity", [rows], outputs=["hidden"])
        g.output("hidden", F32, ["batch", "n_draft", t.hidden_size])
    else:
        logits = g.lm_head(rows, head_name(shared), t.hidden_size)
        if c.output_multiplier != 1.0:
            logits = g.op("Mul", [logits, g.const(c.output_multiplier, np.float32)])
        if c.final_logit_softcapping and c.final_logit_softcapping > 0:
            cap = g.const(c.final_logit_softcapping, np.float32)
            logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
        logits = g.op("Identity", [logits], outputs=["draft_logits"])
        g.op("ArgMax", [logits], axis=-1, keepdims=0, outputs=["draft_tokens"])
        g.output("draft_tokens", I64, ["batch", "n_draft"])
        g.output("draft_logits", F32, ["batch", "n_draft", t.vocab_size])
    for i in range(c.num_hidden_layers):
        g.output(f"present_ctx_key_{i}", F32, ["batch", KVH, "total_ctx", D])
        g.output(f"present_ctx_value_{i}", F32, ["batch", KVH, "total_ctx", D])
    return (*finish(g, functions, False), shared)


def build_head_graph(target, rows: int | None = None, store: "WeightStore | None" = None
                     ) -> tuple[onnx.ModelProto, dict, dict]:
    """The ONNX Runtime engine's LM head, shared by target and drafter (one prepacked copy of the head matrix).

    `rows`: a draft head over the first `rows` token ids only (its own copy of those rows), logits [B,n,rows].

    Input hidden [B,n,H] (final-normed rows) -> logits [B,n,V]. Nothing else: argmax and acceptance run on the host,
    because ORT's ArgMax over a 49152-wide row is ~5x slower than numpy's (0.67 vs 0.14 ms for 16 rows, measured) and
    every node of a graph runs on every call whichever outputs are asked for.
    """
    t = target_spec(target)
    shared = shared_tensors(target)
    g = GraphBuilder("dflash_lm_head", store)
    hidden = g.input("hidden", F32, ["batch", "rows", t.hidden_size])
    head = head_name(shared)
    if rows:
        head = g.weight("draft_head", shared[head][:rows])
        shared = {}
    g.op("Identity", [g.lm_head(hidden, head, t.hidden_size)], outputs=["logits"])
    g.output("logits", F32, ["batch", "rows", rows or t.vocab_size])
    return (*finish(g, [], False), shared)


def finish(g: GraphBuilder, functions, ort: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Graph + functions; initializers are attached later by `place_weights` (external data)."""
    graph = helper.make_graph(g.nodes, g.name, g.inputs, g.outputs)
    model = ops.make_model(graph, functions)
    if ort:
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return model, g.inits


ALIGN = 64  # external-data offsets aligned so ORT can map / read tensors without realigning


class WeightStore:
    """One external-data file; a name written once is referenced by every graph that uses it (same bytes on disk,
    same offsets), so graphs built from the same weights share their data file."""

    def __init__(self, path, small_bytes: int = 1024):
        self.path = path
        self.location = path.name
        self.small_bytes = small_bytes
        self.f = open(path, "wb")
        self.protos: dict[str, onnx.TensorProto] = {}

    def put(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        if name in self.protos:
            if list(self.protos[name].dims) != list(arr.shape):
                raise DFlashError(f"weight {name!r} stored twice with different shapes", path=self.path)
            return self.protos[name]
        pos = self.f.tell()
        pad = (-pos) % ALIGN
        if pad:
            self.f.write(b"\0" * pad)
            pos += pad
        data = np.ascontiguousarray(arr).tobytes()
        self.f.write(data)
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", self.location), ("offset", str(pos)), ("length", str(len(data)))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.protos[name] = t
        return t

    def close(self):
        self.f.close()


def place_weights(model: onnx.ModelProto, inits: dict, store: WeightStore, shared: WeightStore,
                  shared_arrays: dict) -> None:
    """Attach the model's weights: small ones inline, large ones in `store`, the embedding / LM head in `shared`
    (written once, referenced by both graphs)."""
    for name, arr in inits.items():
        if isinstance(arr, onnx.TensorProto):  # already written by the builder
            model.graph.initializer.append(arr)
        elif arr.nbytes <= store.small_bytes:
            model.graph.initializer.append(numpy_helper.from_array(arr, name))
        else:
            model.graph.initializer.append(store.put(name, arr))
    used = {i for n in model.graph.node for i in n.input}
    for name, arr in shared_arrays.items():
        if name in used:
            model.graph.initializer.append(shared.put(name, arr))
