"""The hybrid targets' layer kinds in plain ONNX ops: Gated DeltaNet (linear attention) and gated full attention
(Qwen3.5 / 3.6, Qwen3-Next; arch.HybridSpec), the per-sequence state they carry, and the shared expert of their MoE.

Gated DeltaNet, per token t and value head h (transformers' `torch_recurrent_gated_delta_rule`, the math of record):
  x = silu(depthwise causal conv over the last K inputs of in_proj_qkv) -> q, k, v; q, k L2-normalized per head,
  q scaled by Dk^-0.5, key heads repeated to the value heads; beta = sigmoid(in_proj_b), g = -exp(A_log) *
  softplus(in_proj_a + dt_bias);
  S = S * exp(g); S += k (x) ((v - k.S) * beta); out = q.S;  then an RMSNorm per head times silu(in_proj_z), out_proj
(the scan body computes the same in an order that reads the state twice per position: `_scan_body`).
The recurrence runs as an ONNX Scan over the block's positions, one position per iteration, so row r of a verify
block computes exactly what a one-token step after the same prefix computes (the same ops on the same shapes):
a block's rows are exact per token, as the K/V rows of attention layers are.

State, per linear layer i (engine state next to the K/V cache):
  inputs  conv_state_i       [B, C, K-1]        the last K-1 conv inputs (C = 2 Hk Dk + Hv Dv channels)
          recurrent_state_i  [B, Hv, Dk, Dv]
  outputs conv_window_i      [B, C, K-1+S]      the conv inputs of the past window and of the S new rows
          recurrent_last_i   [B, Hv, Dk, Dv]    the state after the last row
          row_keys_i         [B, S, Hv, Dk]     each row's key, decay and delta: the state's update
          row_decays_i       [B, S, Hv]           S' = decay S + key (x) delta
          row_deltas_i       [S, B, Hv, 1, Dv]
After verifying a block and accepting rows 0..r, the engine commits conv_window_i[:, :, r+1 : r+K] and the state
after row r: recurrent_last_i when r is the last row, else the committed state with rows 0..r's updates applied on
the host in the scan body's order (`engines.onnxruntime.recurrent_state_after`, the same float32 operations, so
the same bits). A rejected draft leaves no trace. Rows' updates instead of each row's state: a block of S rows
writes S x (Dk + Dv + 1) floats per head instead of S x Dk x Dv (16 x 2 MiB per layer at Qwen3.5's sizes).

Every RMSNorm of these families except the Gated DeltaNet's output norm scales by (1 + weight): `fold_norms` adds the
one at export (the same float32 sum transformers computes).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from dflash_export.errors import DFlashError
from dflash_export.export.builder import F32, GraphBuilder, finish

OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight")
L2_EPS = 1e-6  # transformers' l2norm (use_qk_l2norm_in_kernel)
SOFTPLUS_LANES = 16  # the widest vector of floats (AVX-512) a CPU kernel takes a tensor's elements by
# How a block of rows runs the delta rule: "scan" (one position per iteration, every row the one-token step's bits)
# or "chunked" (the whole block at once; cheaper per row, rows within rounding of plain steps). benchmarks/
# hybrid_costs.py --form measures either.
BLOCK_FORM = "scan"


def fold_norms(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state dict with 1 added to every (1 + weight) RMSNorm weight: decoder norms, q/k norms and the final norm."""
    out = dict(sd)
    for k, v in sd.items():
        if k.endswith(OFFSET_NORMS) or k == "model.norm.weight":
            out[k] = (v.astype(np.float32) + np.float32(1.0)).astype(np.float32)
    return out


def projections(sd: dict, p: str, hybrid, shapes: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(W_qkv [C, H] in the conv's channel order q, k, v; W_z [Hv Dv, H]; W_b [Hv, H]; W_a [Hv, H]) of the Gated
    DeltaNet under prefix `p`. Qwen3-Next groups its fused projections per key head ([q k v z] and [b a] of each
    group in turn); Qwen3.5 stores the four apart."""
    if not hybrid.fused_projections:
        return (sd[p + "in_proj_qkv.weight"], sd[p + "in_proj_z.weight"], sd[p + "in_proj_b.weight"],
                sd[p + "in_proj_a.weight"])
    hk, hv, dk, dv = shapes["key_heads"], shapes["value_heads"], shapes["key_dim"], shapes["value_dim"]
    r = hv // hk
    qkvz = sd[p + "in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    ba = sd[p + "in_proj_ba.weight"].reshape(hk, 2 * r, -1)
    b, a = ba[:, :r], ba[:, r:]
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    return (np.concatenate([flat(q), flat(k), flat(v)], axis=0), flat(z), flat(b), flat(a))


def _scan_body(hv: int, dk: int, dv: int):
    """One position of the gated delta rule, reading the state [B,Hv,Dk,Dv] twice (once for q.S and k.S together,
    once to decay it) and writing it once: with d = exp(g), kS = k.S, delta = (v - d kS) beta,
      out = q.(d S + k delta) = d q.S + (q.k) delta;  S' = d S + k (x) delta.
    Inputs (state, qk_t [B,Hv,2,Dk] (q then k), v_t [B,Hv,1,Dv], decay_t [B,Hv], beta_t [B,Hv]) -> (state, out_t
    [B,Hv,1,Dv], delta_t [B,Hv,1,Dv])."""
    f = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)  # noqa: E731
    axis = lambda n, v: helper.make_node("Constant", [], [n], value=helper.make_tensor(  # noqa: E731
        n, TensorProto.INT64, [len(v)], v))
    nodes = [
        axis("ax_23", [2, 3]), axis("one_one", [1, 1]),
        helper.make_node("MatMul", ["qk_t", "state_in"], ["qkS"]),                      # [B,Hv,2,Dv]
        helper.make_node("Split", ["qkS", "one_one"], ["qS", "kS"], axis=2),
        helper.make_node("Split", ["qk_t", "one_one"], ["q_row", "k_row"], axis=2),     # [B,Hv,1,Dk]
        helper.make_node("Unsqueeze", ["decay_t", "ax_23"], ["d"]),                     # [B,Hv,1,1]
        helper.make_node("Unsqueeze", ["beta_t", "ax_23"], ["beta"]),
        helper.make_node("Mul", ["kS", "d"], ["kS_d"]),
        helper.make_node("Sub", ["v_t", "kS_d"], ["v_err"]),
        helper.make_node("Mul", ["v_err", "beta"], ["delta"]),                          # [B,Hv,1,Dv]
        helper.make_node("Transpose", ["k_row"], ["k_col"], perm=[0, 1, 3, 2]),         # [B,Hv,Dk,1]
        helper.make_node("MatMul", ["q_row", "k_col"], ["qk"]),                         # [B,Hv,1,1]
        helper.make_node("Mul", ["qS", "d"], ["qS_d"]),
        helper.make_node("Mul", ["qk", "delta"], ["qk_delta"]),
        helper.make_node("Add", ["qS_d", "qk_delta"], ["out_t"]),
        helper.make_node("Mul", ["state_in", "d"], ["s_decayed"]),
        helper.make_node("MatMul", ["k_col", "delta"], ["update"]),                     # [B,Hv,Dk,Dv]
        helper.make_node("Add", ["s_decayed", "update"], ["state_out"]),
        helper.make_node("Identity", ["delta"], ["delta_t"]),
    ]
    inputs = [f("state_in", ["batch", hv, dk, dv]), f("qk_t", ["batch", hv, 2, dk]), f("v_t", ["batch", hv, 1, dv]),
              f("decay_t", ["batch", hv]), f("beta_t", ["batch", hv])]
    outputs = [f("state_out", ["batch", hv, dk, dv]), f("out_t", ["batch", hv, 1, dv]),
               f("delta_t", ["batch", hv, 1, dv])]
    return helper.make_graph(nodes, "gated_delta_rule_step", inputs, outputs)


def _chunked_delta_rule(g: GraphBuilder, q: str, k: str, v: str, gate: str, beta: str, rstate: str, i: int) -> str:
    """The gated delta rule over a whole block at once (the WY / UT-transform form), reading the state twice per
    call instead of three times per row. Per value head, with G = cumsum(g) over the block, D[t,j] = exp(G_t - G_j)
    for j <= t, T = I + diag(beta) (D o K K^T)_strictly-lower:
      deltas = T^-1 diag(beta) (V - exp(G) o K S0);  out = exp(G) o Q S0 + (D o Q K^T) deltas;
      S_last = exp(G_last) S0 + (exp(G_last - G) o K)^T deltas.
    T^-1 = (I - N)(I + N^2)(I + N^4)...(I + N^32) with N = T - I nilpotent: exact in exact arithmetic up to 64 rows
    (the prefill chunk). The same row updates (key, decay, delta) as the Scan's go out for the host's commit.
    Not the one-token step's arithmetic: a verify row differs from a plain step by rounding (measured, not bits).
    q, k [B,S,Hv,Dk], v [B,S,Hv,Dv], gate (log decay), beta [B,S,Hv], rstate [B,Hv,Dk,Dv] -> out [B,S,Hv,Dv]."""
    heads = lambda x: g.op("Transpose", [x], perm=[0, 2, 1, 3])  # [B,S,Hv,D] -> [B,Hv,S,D]
    col = lambda x: g.op("Unsqueeze", [x, g.const([-1])])
    qh, kh, vh = heads(q), heads(k), heads(v)
    cum = g.op("CumSum", [g.op("Transpose", [gate], perm=[0, 2, 1]), g.const(2)])       # G [B,Hv,S]
    bh = col(g.op("Transpose", [beta], perm=[0, 2, 1]))                                # [B,Hv,S,1]
    diff = g.op("Sub", [col(cum), g.op("Unsqueeze", [cum, g.const([-2])])])             # G_t - G_j [B,Hv,S,S]
    n = g.op("Shape", [cum], start=2)                                                   # [S]
    idx = g.op("Range", [g.const(0), g.op("Squeeze", [n, g.const([0])]), g.const(1)])
    below = g.op("Cast", [g.op("Greater", [col(idx), idx])], to=TensorProto.FLOAT)     # t > j  [S,S]
    on_below = g.op("Cast", [g.op("GreaterOrEqual", [col(idx), idx])], to=TensorProto.FLOAT)
    dmat = g.op("Exp", [g.op("Min", [diff, g.const(0.0, np.float32)])])                # the upper half masked below
    kt = g.op("Transpose", [kh], perm=[0, 1, 3, 2])                                     # [B,Hv,Dk,S]
    nmat = g.op("Mul", [g.op("Mul", [g.op("Mul", [g.op("MatMul", [kh, kt]), dmat]), below]), bh])
    qk_s0 = g.op("MatMul", [g.op("Concat", [qh, kh], axis=2), rstate])                  # [B,Hv,2S,Dv]
    q_s0, k_s0 = g.op("Split", [qk_s0, g.op("Concat", [n, n], axis=0)], n_out=2, axis=2)
    eg = col(g.op("Exp", [cum]))                                                        # [B,Hv,S,1]
    x = g.op("Mul", [g.op("Sub", [vh, g.op("Mul", [eg, k_s0])]), bh])                  # diag(beta)(V - e^G K S0)
    x = g.op("Sub", [x, g.op("MatMul", [nmat, x])])                                     # (I - N) x
    power = nmat
    for _ in range(5):                                                                  # (I + N^2) ... (I + N^32)
        power = g.op("MatMul", [power, power])
        x = g.op("Add", [x, g.op("MatMul", [power, x])])
    deltas = x                                                                          # [B,Hv,S,Dv]
    g.op("Unsqueeze", [g.op("Transpose", [deltas], perm=[2, 0, 1, 3]), g.const([3])],
         outputs=[f"row_deltas_{i}"])                                                   # [S,B,Hv,1,Dv]
    attn = g.op("Mul", [g.op("MatMul", [qh, kt]), g.op("Mul", [dmat, on_below])])      # [B,Hv,S,S]
    out = g.op("Add", [g.op("Mul", [eg, q_s0]), g.op("MatMul", [attn, deltas])])       # [B,Hv,S,Dv]
    last = g.op("Gather", [cum, g.op("Sub", [n, g.const([1])])], axis=2)                # G_last [B,Hv,1]
    tail = g.op("Exp", [g.op("Sub", [last, cum])])                                      # [B,Hv,S]
    update = g.op("MatMul", [g.op("Transpose", [g.op("Mul", [kh, col(tail)])], perm=[0, 1, 3, 2]), deltas])
    g.op("Add", [g.op("Mul", [rstate, col(g.op("Exp", [last]))]), update], outputs=[f"recurrent_last_{i}"])
    return heads(out)


def _heads(g: GraphBuilder, x: str, n: int, d: int) -> str:
    """[B,S,n*d] -> [B,S,n,d]"""
    return g.op("Reshape", [x, g.const([0, 0, n, d])])


def _softplus(g: GraphBuilder, x: str, n: int) -> str:
    """Softplus of x [B,S,n], its last axis zero-padded to a multiple of SOFTPLUS_LANES for the op and sliced back:
    ONNX Runtime's CPU Softplus computes the elements of a tensor's last partial vector differently from the others,
    so without the padding a row's value would depend on how many rows share the tensor (a verify block's row would
    differ from the one-token step's whenever B x S x n is not a multiple of the vector width)."""
    pad = -n % SOFTPLUS_LANES
    if not pad:
        return g.op("Softplus", [x])
    y = g.op("Softplus", [g.op("Pad", [x, g.const([0, 0, 0, 0, 0, pad])])])
    return g.op("Slice", [y, g.const([0]), g.const([n]), g.const([-1])])


def _l2norm(g: GraphBuilder, x: str) -> str:
    with g.fp32_island():
        ss = g.op("ReduceSum", [g.op("Mul", [x, x]), g.const([-1])], keepdims=1)
        return g.op("Mul", [x, g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ss, g.const(L2_EPS, np.float32)])])])])


def gated_delta_net(g: GraphBuilder, xn: str, sd: dict, p: str, hybrid, shapes: dict, eps: float, i: int,
                    form: str | None = None) -> str:
    """Layer i's Gated DeltaNet over xn [B,S,H] (prefix `p` = "model.layers.{i}.linear_attn."), with its state
    inputs and outputs (module docstring); `form`: BLOCK_FORM's choices (default BLOCK_FORM). Returns the out_proj
    output [B,S,H]."""
    hk, hv, dk, dv = shapes["key_heads"], shapes["value_heads"], shapes["key_dim"], shapes["value_dim"]
    kernel, channels = shapes["conv_kernel"], shapes["conv_channels"]
    if hv % hk:
        raise DFlashError(f"{hv} value heads are not a multiple of {hk} key heads", field="linear_num_value_heads")
    w_qkv, w_z, w_b, w_a = projections(sd, p, hybrid, shapes)
    mixed = g.linear(xn, w_qkv, p + "in_proj_qkv")                                   # [B,S,C]
    z = g.linear(xn, w_z, p + "in_proj_z")
    b = g.linear(xn, w_b, p + "in_proj_b")
    a = g.linear(xn, w_a, p + "in_proj_a")

    # Depthwise causal conv over [past K-1 inputs ; S new]: K shifted slices times their tap, summed in tap order
    # (elementwise: row r sums the same products in the same order whatever S is).
    state = g.input(f"conv_state_{i}", F32, ["batch", channels, kernel - 1])
    window = g.op("Concat", [state, g.op("Transpose", [mixed], perm=[0, 2, 1])], axis=2,
                  outputs=[f"conv_window_{i}"])                                      # [B,C,K-1+S]
    taps = sd[p + "conv1d.weight"].reshape(channels, kernel)
    conv = None
    for k in range(kernel):
        back = kernel - 1 - k
        part = g.op("Slice", [window, g.const([k]), g.const([-back if back else np.iinfo(np.int64).max]),
                              g.const([2])])
        term = g.op("Mul", [part, g.weight(f"{p}conv1d.tap{k}", np.ascontiguousarray(taps[:, k:k + 1]))])
        conv = term if conv is None else g.op("Add", [conv, term])
    if sd.get(p + "conv1d.bias") is not None:
        conv = g.op("Add", [conv, g.weight(p + "conv1d.bias", sd[p + "conv1d.bias"].reshape(channels, 1))])
    conv = g.op("Transpose", [g.op("Mul", [conv, g.op("Sigmoid", [conv])])], perm=[0, 2, 1])  # SiLU, [B,S,C]
    q, k, v = g.op("Split", [conv, g.const([hk * dk, hk * dk, hv * dv])], n_out=3, axis=-1)

    def to_value_heads(x: str) -> str:  # [B,S,Hk,Dk] -> [B,S,Hv,Dk]: value head j reads key head j // (Hv/Hk)
        if hv == hk:
            return x
        x = g.op("Expand", [g.op("Unsqueeze", [x, g.const([3])]), g.const([1, 1, 1, hv // hk, 1])])
        return g.op("Reshape", [x, g.const([0, 0, hv, dk])])

    q = to_value_heads(g.op("Mul", [_l2norm(g, _heads(g, q, hk, dk)), g.const(dk ** -0.5, np.float32)]))
    k = to_value_heads(_l2norm(g, _heads(g, k, hk, dk)))
    v = _heads(g, v, hv, dv)
    beta = g.op("Sigmoid", [b])                                                          # [B,S,Hv]
    neg_a = -np.exp(sd[p + "A_log"].astype(np.float32))
    gate = g.op("Mul", [_softplus(g, g.op("Add", [a, g.weight(p + "dt_bias", sd[p + "dt_bias"])]), hv),
                        g.weight(p + "neg_A", neg_a.astype(np.float32))])

    rstate = g.input(f"recurrent_state_{i}", F32, ["batch", hv, dk, dv])
    decay = g.op("Exp", [gate], outputs=[f"row_decays_{i}"])                             # [B,S,Hv]
    g.op("Identity", [k], outputs=[f"row_keys_{i}"])
    if (form or BLOCK_FORM) == "chunked":
        core = _chunked_delta_rule(g, q, k, v, gate, beta, rstate, i)
    else:
        qk = g.op("Concat", [g.op("Unsqueeze", [q, g.const([3])]), g.op("Unsqueeze", [k, g.const([3])])],
                  axis=3)                                                                # [B,S,Hv,2,Dk]
        _, outs, _ = g.op("Scan", [rstate, g.op("Transpose", [qk], perm=[1, 0, 2, 3, 4]),
                                   g.op("Transpose", [g.op("Unsqueeze", [v, g.const([3])])], perm=[1, 0, 2, 3, 4]),
                                   g.op("Transpose", [decay], perm=[1, 0, 2]),
                                   g.op("Transpose", [beta], perm=[1, 0, 2])],
                          n_out=3, outputs=[f"recurrent_last_{i}", g.fresh("gdn_out"), f"row_deltas_{i}"],
                          body=_scan_body(hv, dk, dv), num_scan_inputs=4)
        outs = g.op("Squeeze", [outs, g.const([3])])                                    # [S,B,Hv,Dv]
        core = g.op("Transpose", [outs], perm=[1, 0, 2, 3])                             # [B,S,Hv,Dv]
    normed = g.rms_norm(core, g.weight(p + "norm", sd[p + "norm.weight"]), eps, False)
    zh = _heads(g, z, hv, dv)
    gated = g.op("Mul", [normed, g.op("Mul", [zh, g.op("Sigmoid", [zh])])])
    flat = g.op("Reshape", [gated, g.const([0, 0, hv * dv])])
    return g.linear(flat, sd[p + "out_proj.weight"], p + "out_proj")


def declare_state_outputs(g: GraphBuilder, i: int, shapes: dict) -> None:
    hv, dk, dv = shapes["value_heads"], shapes["key_dim"], shapes["value_dim"]
    g.output(f"conv_window_{i}", F32, ["batch", shapes["conv_channels"], "window"])
    g.output(f"recurrent_last_{i}", F32, ["batch", hv, dk, dv])
    g.output(f"row_keys_{i}", F32, ["batch", "seq", hv, dk])
    g.output(f"row_decays_{i}", F32, ["batch", "seq", hv])
    g.output(f"row_deltas_{i}", F32, ["seq", "batch", hv, 1, dv])


def gated_delta_net_model(sd: dict, p: str, hybrid, shapes: dict, eps: float, hidden: int, form: str):
    """One Gated DeltaNet layer as a model of its own (input `x` [B,S,hidden], output `y`, the state inputs and
    outputs of layer 0): what tests and benchmarks/hybrid_costs.py compare the block forms on."""
    g = GraphBuilder("gated_delta_net")
    x = g.input("x", F32, ["batch", "seq", hidden])
    g.op("Identity", [gated_delta_net(g, x, sd, p, hybrid, shapes, eps, 0, form)], outputs=["y"])
    g.output("y", F32, ["batch", "seq", hidden])
    declare_state_outputs(g, 0, shapes)
    model, inits = finish(g, [], ort=False)
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items())
    return model


def split_gated_query(w: np.ndarray, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """q_proj [H*2D, hidden] of gated attention (per head: D query rows, then D gate rows) -> (W_q, W_gate)."""
    w = w.reshape(heads, 2, head_dim, -1)
    return w[:, 0].reshape(heads * head_dim, -1), w[:, 1].reshape(heads * head_dim, -1)


def partial_rope(g: GraphBuilder, x: str, cos: str, sin: str, rot: int, d: int) -> str:
    """RoPE (rotate-half) on the first `rot` channels of each head of x [..., D]; the rest pass through."""
    if rot == d:
        return g.rope(x, cos, sin, d)
    head, tail = g.op("Split", [x, g.const([rot, d - rot])], n_out=2, axis=-1)
    return g.op("Concat", [g.rope(head, cos, sin, rot), tail], axis=-1)


def rope_tables(target, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [max_len, rotary dim] from the target's own rotary module (Qwen3.5's multimodal RoPE, fed text
    positions, is plain RoPE; the partial rotary factor sets the width)."""
    import torch

    with torch.no_grad():
        cos, sin = target.hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(max_len)[None])
    return cos[0].float().numpy(), sin[0].float().numpy()


def gated_attention_inputs(g: GraphBuilder, xn: str, sd: dict, a: str, t, cos: str, sin: str, rot: int, eps: float
                           ) -> tuple[str, str, str, str]:
    """Gated full attention's (q [B,H,S,D], k [B,KVH,S,D], v [B,KVH,S,D], gate [B,S,H*D]): q/k normed per head,
    partial RoPE applied (cos / sin [B,1,S,rot])."""
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
    wq, wgate = split_gated_query(sd[a + "q_proj.weight"], H, D)
    q = g.linear(xn, wq, a + "q_proj")
    gate = g.linear(xn, wgate, a + "q_gate_proj")
    k = g.linear(xn, sd[a + "k_proj.weight"], a + "k_proj")
    v = g.linear(xn, sd[a + "v_proj.weight"], a + "v_proj")
    qh = g.rms_norm(g.heads(q, H, D), g.weight(a + "q_norm", sd[a + "q_norm.weight"]), eps, False)
    kh = g.rms_norm(g.heads(k, KVH, D), g.weight(a + "k_norm", sd[a + "k_norm.weight"]), eps, False)
    return partial_rope(g, qh, cos, sin, rot, D), partial_rope(g, kh, cos, sin, rot, D), g.heads(v, KVH, D), gate


def output_gate(g: GraphBuilder, attn: str, gate: str) -> str:
    """attn [B,S,H*D] * sigmoid(gate), before o_proj."""
    return g.op("Mul", [attn, g.op("Sigmoid", [gate])])


def shared_expert(g: GraphBuilder, x: str, sd: dict, p: str) -> str:
    """The MoE block's shared expert: sigmoid(shared_expert_gate(x)) * SwiGLU MLP(x) (p = "...mlp.")."""
    m = g.mlp(x, sd, p + "shared_expert.")
    gate = g.linear(x, sd[p + "shared_expert_gate.weight"], p + "shared_expert_gate")
    return g.op("Mul", [g.op("Sigmoid", [gate]), m])
