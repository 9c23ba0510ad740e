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

from dataclasses import dataclass, field

import numpy as np
import onnx

from dflash_export.errors import DFlashError
from dflash_export.export import linear_attention as lin
from dflash_export.export import ops
from dflash_export.export.builder import F32, I32, I64, MS, GraphBuilder, WeightStore, finish
from dflash_export.export.moe import SPARSE_FLAVORS, moe_mlp
from dflash_export.models.arch import sliding_windows

# The most rows a verify of the ort target graph takes, or its block when longer: what the numerics probe checks and
# the runtime verifies no more than (engines/numerics.py PROBE_ROWS). A sliding layer's row window is widened by it.
WINDOW_TREE_ROWS = 16


def window_bias_input(window: int) -> str:
    """The ort target graph's bias input for its sliding layers of `window` tokens (engines/onnxruntime.py reads the
    window back from the name: WINDOW_BIAS there, which serving keeps free of this module's imports)."""
    return f"window_bias_{window}"


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
    cos, sin = cos[0].float().numpy(), sin[0].float().numpy()
    d = target_spec(target).head_dim
    if cos.shape[-1] == d // 2:  # gpt-oss's rotary module gives the half-width table (rotate-half layout)
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    return cos, sin


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
    position_ids [B,S] int64 and attention_bias [B,1,S,total] float (draft trees; see the inputs below); targets with
    sliding-window layers: window_bias_W [B,1,S,total] per window W (the windowed layers' bias); per layer
    past_key_i / past_value_i [B,KVH,capacity,D], bound to the same memory as present_key_i / present_value_i
    (GroupQueryAttention writes the new rows in place). Outputs: hidden [B,num_logits,H] (final-normed
    rows for the LM-head session), ctx, presents.
    ort_batch — inputs: inputs_embeds [1,rows,H] (the call's rows packed, block after block), grid_rows [B,S] and
    cells [rows] (where each packed row sits in the [B,S] grid attention runs on), position_ids [B,S], past_bias
    [B,P], block_bias [B,S,S], per layer past_key_i / past_value_i [B,KVH,P,D] (read only). Outputs: hidden and ctx
    [1,rows,*] packed, new_key_i / new_value_i [B,KVH,S,D] on the grid (engines/ort_batch.py writes them back).
    Returns the model, its own weights (arrays, or TensorProtos already in `store`) and the shared tensors it uses.
    """
    b = _target_setup(target, drafter, max_len, flavor, store)
    ids = _target_inputs(b)
    _target_positions(b, ids)
    x = ids if b.ort else b.g.op("Gather", [SHARED_EMBED, ids], axis=0)  # embedding (ort: the engine gathers rows)
    residual_pending = None  # ort: the MLP output not yet added (fused into the next SkipSimplifiedLayerNorm)
    for i in range(b.t.num_layers):
        x, residual_pending = _target_layer(b, i, x, residual_pending)
    normed = _final_norm(b, x, residual_pending)
    _tap_features(b, drafter)
    shared = shared_tensors(target)
    _target_logits(b, normed, shared, drafter.config.hidden_size)
    _target_cache_outputs(b)
    return (*finish(b.g, [] if b.ort else [ops.fused_verify_function()], b.ort), shared)


@dataclass
class _TargetGraph:
    """What every block of the target graph reads: the builder, the weights, the flavor, each layer's kind; and, once
    _target_positions has run, the RoPE tables and masks the attention blocks use."""

    g: GraphBuilder
    t: TargetSpec
    sd: dict
    dsd: dict
    flavor: str
    hybrid: object
    kinds: list
    windows: list
    sinks: bool
    moe: object
    hf_cfg: object
    moe_layers: list
    tap_ids: list
    rope: tuple
    block_size: int
    lin_shapes: dict | None = None
    rot: int = 0
    taps: dict = field(default_factory=dict)
    pos: str | None = None
    cos: str | None = None
    sin: str | None = None
    cos_c: str | None = None
    sin_c: str | None = None
    keys: "_BatchKeys | None" = None
    mask: str | None = None
    kpos: str | None = None

    @property
    def batch(self) -> bool:
        return self.flavor == "ort_batch"

    @property
    def ort(self) -> bool:
        return self.flavor in ("ort", "ort_batch")


def check_batched_windows(target, block_size: int) -> None:
    """The batched graph (ort_batch) masks sliding windows over the past only: every window of the target must be
    wider than a draft block. A DFlashError naming the target's config.json and sliding_window otherwise."""
    from pathlib import Path

    windows = [w for w in sliding_windows(target.arch, target.hf.config) if w is not None]
    if windows and min(windows) <= block_size:
        raise DFlashError(f"a sliding window of {min(windows)} tokens is not wider than a draft block ({block_size}): "
                          f"the batched graph masks windows over the past only",
                          path=Path(target.model_dir) / "config.json", field="sliding_window")


def _target_setup(target, drafter, max_len: int, flavor: str, store) -> _TargetGraph:
    """The weights and per-layer facts; refuses what the flavor cannot build."""
    # "ort_batch": the ort flavor for B sequences verifying blocks over their own pasts, which GroupQueryAttention
    # (CPU) refuses (batch > 1 with many rows and a past): attention in plain ops reads the K/V buffer and returns
    # only the new rows (engines/ort_batch.py writes them back).
    batch = flavor == "ort_batch"
    t = target_spec(target)
    sd = np_state(target.hf)
    # Hybrid targets (export/linear_attention.py): per layer its kind; Gated DeltaNet layers carry a conv window and
    # a recurrent state instead of K/V (inputs conv_state_i / recurrent_state_i, outputs conv_window_i /
    # recurrent_last_i and row_keys_i / row_decays_i / row_deltas_i), full-attention layers a gated query and partial
    # RoPE.
    hybrid = target.arch.hybrid
    kinds = hybrid.layer_kinds(target.hf.config) if hybrid else ["full_attention"] * t.num_layers
    lin_shapes, rot = None, 0
    if hybrid:
        sd = lin.fold_norms(sd)
        lin_shapes = hybrid.linear_shapes(target.hf.config)
        rot_cos, rot_sin = lin.rope_tables(target, max_len)
        rot = rot_cos.shape[-1]
    moe = target.arch.moe
    hf_cfg = target.hf.config
    windows = sliding_windows(target.arch, hf_cfg)
    if batch:
        check_batched_windows(target, drafter.config.block_size)
    moe_layers = moe.layers(hf_cfg) if moe is not None else [False] * t.num_layers
    rope = (rot_cos, rot_sin) if hybrid else target_rope_tables(target, max_len)
    return _TargetGraph(GraphBuilder("dflash_target_verify", store), t, sd, np_state(drafter), flavor, hybrid, kinds,
                        windows, target.arch.attention_sinks, moe, hf_cfg, moe_layers,
                        list(drafter.config.target_layer_ids), rope, drafter.config.block_size, lin_shapes, rot)


def _target_inputs(b: _TargetGraph) -> str:
    """The graph inputs ahead of the per-layer caches; returns the token input (ids, or embeddings for ort)."""
    g, t, ort, batch = b.g, b.t, b.ort, b.batch
    if batch:
        # Packed rows: only the sequences' real rows, one after another (a call's blocks differ in length). Every
        # row-wise op (norms, projections, MLP) runs on them; the token mixers run on the [B, S] grid of blocks
        # padded to the longest (grid_rows: the packed row each grid cell reads; cells: each packed row's cell).
        ids = g.input("inputs_embeds", F32, [1, "rows", t.hidden_size])
        g.input("grid_rows", I64, ["batch", "seq"])
        g.input("cells", I64, ["rows"])
    elif ort:
        # The engine reads embedding rows itself (from the shared file, on demand: the table never becomes
        # resident) and runs the LM head in its own session, so this graph holds no vocabulary-sized tensor.
        ids = g.input("inputs_embeds", F32, ["batch", "seq", t.hidden_size])
    else:
        ids = g.input("input_ids", I64, ["batch", "seq"])
    if not batch:
        g.input("num_logits", I64, [])
    if not ort:
        g.input("draft_tokens", I64, ["batch", "n_draft"])
        g.input("draft_probs", F32, ["batch", "n_draft_or_1", "vocab_or_1"])
        g.input("uniforms", F32, ["batch", "n_uniforms"])
    if batch:
        b.pos = g.input("position_ids", I64, ["batch", "seq"])
        g.input("past_bias", F32, ["batch", "past"])
        # Draft trees: per sequence an additive bias [B,S,S] over its new rows (0 visible, -inf hidden) on top of the
        # causal mask, leaving each row only its tree ancestors; chains feed zeros.
        g.input("block_bias", F32, ["batch", "seq", "seq"])
    elif ort:
        g.input("seqlens_k", I32, ["batch"])
        g.input("total_seq_len", I32, [])
        # Draft trees (decoding/tree.py): each row's absolute position (committed length + depth in the tree) and an
        # additive bias [B,1,S,T] (0 visible, -inf hidden) that leaves a row only its tree ancestors among the new
        # rows; GroupQueryAttention applies its causal mask as well. A chain feeds consecutive positions and zeros.
        g.input("position_ids", I64, ["batch", "seq"])
        g.input("attention_bias", F32, ["batch", 1, "seq", "total"])
        # Sliding-window layers: attention_bias plus -inf on every key `window` or more positions before the row's
        # (a tree node's K/V row lies past its position, so GroupQueryAttention's row window alone cannot say it).
        for w in sorted({w for w in b.windows if w} if not b.hybrid else ()):
            g.input(window_bias_input(w), F32, ["batch", 1, "seq", "total"])
    else:
        b.pos = g.input("position_ids", I64, ["batch", "seq"])
    return ids


def _target_positions(b: _TargetGraph, ids: str) -> None:
    """RoPE tables at the rows' positions and the flavor's attention masks (set on `b`)."""
    g, pos, (cos_t, sin_t), D = b.g, b.pos, b.rope, b.t.head_dim
    if b.batch:
        b.cos, b.sin = g.rope_tables(pos, g.weight("rope_cos", cos_t), g.weight("rope_sin", sin_t))
        b.keys = _batched_keys(g, pos, b.t.num_heads // b.t.num_kv_heads, any(b.windows))
    elif b.ort and b.hybrid:  # partial RoPE outside attention (GroupQueryAttention's rotary would turn every channel)
        b.cos, b.sin = g.rope_tables("position_ids", g.weight("rope_cos", cos_t), g.weight("rope_sin", sin_t))
    elif b.ort:
        # GQA applies RoPE itself from half-width tables (rotate-half layout), positions from seqlens_k.
        b.cos_c = g.weight("rope_cos_half", cos_t[:, : D // 2])
        b.sin_c = g.weight("rope_sin_half", sin_t[:, : D // 2])
    else:
        b.cos, b.sin = g.rope_tables(pos, g.weight("rope_cos", cos_t), g.weight("rope_sin", sin_t))
        # Causal mask over the cache: key k (absolute position k) is visible to a query at position p iff k <= p.
        past_len = g.op("Shape", [f"past_key_{b.kinds.index('full_attention')}"], start=2, end=3)
        seq_len = g.op("Shape", [ids], start=1, end=2)
        total = g.op("Squeeze", [g.op("Add", [past_len, seq_len]), g.const([0])])
        b.kpos = g.op("Range", [g.const(0), total, g.const(1)])
        visible = g.op("LessOrEqual", [b.kpos, g.op("Unsqueeze", [pos, g.const([2])])])  # [B,S,T]
        mask = g.op("Where", [visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32)])
        b.mask = g.op("Unsqueeze", [mask, g.const([1, 2])])  # [B,1,1,S,T] against scores [B,KVH,G,S,T]


def _target_layer(b: _TargetGraph, i: int, x: str, residual_pending: str | None) -> tuple[str, str | None]:
    """Decoder layer i: norm, attention, norm, MoE or MLP, residuals; returns the residual stream (and, ort, the MLP
    output still to add)."""
    g, t, sd, ort = b.g, b.t, b.sd, b.ort
    p = f"model.layers.{i}."
    ln1 = g.weight(p + "input_layernorm", sd[p + "input_layernorm.weight"])
    if ort and residual_pending is not None:
        xn, _, _, x = g.op("SkipSimplifiedLayerNormalization", [x, residual_pending, ln1], n_out=4, domain=MS,
                           epsilon=t.rms_eps)
    else:
        xn = g.rms_norm(x, ln1, t.rms_eps, ort)
    attn = _attention(b, i, xn)
    ln2 = g.weight(p + "post_attention_layernorm", sd[p + "post_attention_layernorm.weight"])
    if ort:
        xn2, _, _, x = g.op("SkipSimplifiedLayerNormalization", [x, attn, ln2], n_out=4, domain=MS,
                            epsilon=t.rms_eps)
    else:
        x = g.op("Add", [x, attn])
        xn2 = g.rms_norm(x, ln2, t.rms_eps, False)
    m = _mlp_block(b, i, xn2)
    if ort:
        residual_pending = m
        if i in b.tap_ids or i == t.num_layers - 1:
            x = g.op("Add", [x, m])
            residual_pending = None
    else:
        x = g.op("Add", [x, m])
    if i in b.tap_ids:
        b.taps[i] = x
    return x, residual_pending


def _attention(b: _TargetGraph, i: int, xn: str) -> str:
    """Layer i's token mixer by layer kind and flavor, output projection included."""
    g, sd = b.g, b.sd
    a = f"model.layers.{i}.self_attn."
    bias = lambda n: sd.get(a + n + ".bias")  # noqa: E731
    gate = None
    if b.batch and b.hybrid:  # the token mixer runs on the grid of blocks, its output projection on packed rows
        xn = _to_grid(g, xn)
    if b.kinds[i] == "linear_attention":
        out = lin.gated_delta_net(g, xn, sd, f"model.layers.{i}.linear_attn.", b.hybrid, b.lin_shapes, b.t.rms_eps,
                                  i)
        return _to_rows(g, out) if b.batch else out
    if b.hybrid and b.batch:  # the Gated DeltaNet layers' state is per sequence already (batch axis first)
        qh, kh, vh, gate = lin.gated_attention_inputs(g, xn, sd, a, b.t, b.cos, b.sin, b.rot, b.t.rms_eps)
        attn = _batched_block_attention(g, xn, sd, a, b.t, i, b.cos, b.sin, b.keys, bias, heads=(qh, kh, vh))
    elif b.hybrid and b.ort:
        attn, gate = _gated_gqa_attention(b, i, xn, a)
    elif b.batch:
        attn = _batched_block_attention(g, xn, sd, a, b.t, i, b.cos, b.sin, b.keys, bias, b.windows[i],
                                        sd[a + "sinks"] if b.sinks else None, b.pos, packed=True)
    elif b.ort:
        attn = _gqa_attention(b, i, xn, a, bias)
    else:
        qh, kh, vh, gate = _portable_qkv(b, xn, a, bias)
        attn = _portable_attention(b, i, a, qh, kh, vh)
    if gate is not None:
        attn = lin.output_gate(g, attn, gate)
    if b.batch:
        attn = _to_rows(g, attn)
    return g.linear(attn, sd[a + "o_proj.weight"], a + "o_proj", bias("o_proj"))


def _to_grid(g: GraphBuilder, x: str) -> str:
    """Packed rows [1, T, C] -> the grid [B, S, C] (ort_batch: each cell reads the packed row grid_rows names)."""
    return g.op("Gather", [g.op("Squeeze", [x, g.const([0])]), "grid_rows"], axis=0)


def _to_rows(g: GraphBuilder, y: str) -> str:
    """The grid [B, S, C] -> packed rows [1, T, C] (ort_batch: packed row r is grid cell cells[r])."""
    return g.op("Unsqueeze", [g.op("Gather", [g.op("Flatten", [y], axis=2), "cells"], axis=0), g.const([0])])


def _gated_gqa_attention(b: _TargetGraph, i: int, xn: str, a: str) -> tuple[str, str]:
    """ort, hybrid full-attention layer: gated query, partial RoPE applied before GroupQueryAttention."""
    g, t = b.g, b.t
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
    qh, kh, vh, gate = lin.gated_attention_inputs(g, xn, b.sd, a, t, b.cos, b.sin, b.rot, t.rms_eps)
    flat = lambda x: g.op("Reshape", [g.op("Transpose", [x], perm=[0, 2, 1, 3]), g.const([0, 0, -1])])  # noqa
    past_k = g.input(f"past_key_{i}", F32, ["batch", KVH, "max_len", D])
    past_v = g.input(f"past_value_{i}", F32, ["batch", KVH, "max_len", D])
    attn, _, _ = g.op("GroupQueryAttention", [flat(qh), flat(kh), flat(vh), past_k, past_v, "seqlens_k",
                                              "total_seq_len", "", "", "", "attention_bias"],
                      n_out=3, domain=MS, outputs=[g.fresh("attn"), f"present_key_{i}", f"present_value_{i}"],
                      num_heads=H, kv_num_heads=KVH, scale=float(D ** -0.5), do_rotary=0)
    return attn, gate


def _gqa_attention(b: _TargetGraph, i: int, xn: str, a: str, bias) -> str:
    """ort: GroupQueryAttention over the fixed-size K/V buffer (RoPE, sinks and sliding window inside the op)."""
    g, t, sd = b.g, b.t, b.sd
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
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
    # gpt-oss: its per-head sinks join GQA's softmax denominator (head_sink). A sliding layer sees the keys of its
    # window (transformers' mask: positions > p - window; checked against transformers, tests/test_moe_targets.py,
    # tests/test_sliding_trees.py) through its own bias input, window_bias_W: GroupQueryAttention counts
    # local_window_size in K/V rows, and a draft tree's node sits at row length + index but at position
    # length + depth. The row window, widened by the most rows a verify takes less one, still holds every key the bias
    # shows, and the kernel's softmax still skips the keys behind it (its two products run over every key either way:
    # without a row window the op took up to 9 % longer on 16 rows at 4-32k keys, gpt-oss-20b's shapes; widened, no
    # longer than with the window alone).
    extra = [g.weight(a + "sinks", sd[a + "sinks"])] if b.sinks else []
    window = {"local_window_size": b.windows[i] + max(WINDOW_TREE_ROWS, b.block_size) - 1} if b.windows[i] else {}
    mask = window_bias_input(b.windows[i]) if b.windows[i] else "attention_bias"
    attn, _, _ = g.op("GroupQueryAttention", [*qkv_inputs, past_k, past_v, "seqlens_k", "total_seq_len",
                                              b.cos_c, b.sin_c, "position_ids", mask, *extra],
                      n_out=3, domain=MS,
                      outputs=[g.fresh("attn"), f"present_key_{i}", f"present_value_{i}"],
                      num_heads=H, kv_num_heads=KVH, scale=float(D ** -0.5), do_rotary=1,
                      rotary_interleaved=0, **window)
    return attn


def _portable_qkv(b: _TargetGraph, xn: str, a: str, bias) -> tuple[str, str, str, str | None]:
    """portable: per-head q, k, v after q/k norm and RoPE (hybrids: gated query, partial RoPE) and the gate."""
    g, t, sd = b.g, b.t, b.sd
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
    if b.hybrid:
        return lin.gated_attention_inputs(g, xn, sd, a, t, b.cos, b.sin, b.rot, t.rms_eps)
    q = g.linear(xn, sd[a + "q_proj.weight"], a + "q_proj", bias("q_proj"))
    k = g.linear(xn, sd[a + "k_proj.weight"], a + "k_proj", bias("k_proj"))
    v = g.linear(xn, sd[a + "v_proj.weight"], a + "v_proj", bias("v_proj"))
    qh, kh, vh = g.heads(q, H, D), g.heads(k, KVH, D), g.heads(v, KVH, D)
    if t.qk_norm:
        qh = g.rms_norm(qh, g.weight(a + "q_norm", sd[a + "q_norm.weight"]), t.rms_eps, False)
        kh = g.rms_norm(kh, g.weight(a + "k_norm", sd[a + "k_norm.weight"]), t.rms_eps, False)
    qh, kh = g.rope(qh, b.cos, b.sin, D), g.rope(kh, b.cos, b.sin, D)
    return qh, kh, vh, None


def _portable_attention(b: _TargetGraph, i: int, a: str, qh: str, kh: str, vh: str) -> str:
    """portable: attention over past ++ new K/V (present_key_i / present_value_i out), causal and window masks,
    sinks."""
    g, t, pos, mask, kpos = b.g, b.t, b.pos, b.mask, b.kpos
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
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
    layer_mask = mask
    if b.windows[i]:  # key k visible to a query at position p also needs k > p - window
        near = g.op("Greater", [kpos, g.op("Sub", [g.op("Unsqueeze", [pos, g.const([2])]),
                                                   g.const(b.windows[i])])])
        layer_mask = g.op("Add", [mask, g.op("Unsqueeze", [g.op("Where", [
            near, g.const(0.0, np.float32), g.const(-np.inf, np.float32)]), g.const([1, 2])])])
    scores = g.op("Add", [scores, layer_mask])
    if b.sinks:  # one more logit per head in the softmax, dropped after it
        sink = g.weight(a + "sinks", b.sd[a + "sinks"].reshape(1, KVH, H // KVH, 1, 1))
        col = g.op("Expand", [sink, g.op("Concat", [g.op("Shape", [scores], end=4), g.const([1])], axis=0)])
        full = g.op("Softmax", [g.op("Concat", [scores, col], axis=-1)], axis=-1)
        probs = g.op("Slice", [full, g.const([0]), g.const([-1]), g.const([-1])])
    else:
        probs = g.op("Softmax", [scores], axis=-1)
    o5 = g.op("MatMul", [probs, v5])
    return g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [o5, g.const([0, H, -1, D])])],
                                 perm=[0, 2, 1, 3]), g.const([0, 0, H * D])])


def _mlp_block(b: _TargetGraph, i: int, xn2: str) -> str:
    """Layer i's MoE (sparse experts in the ort flavors; hybrids add a shared expert) or dense MLP."""
    g, sd, p = b.g, b.sd, f"model.layers.{i}."
    if b.moe_layers[i]:
        m = moe_mlp(g, xn2, sd, p + "mlp.", b.moe, b.hf_cfg, sparse=b.flavor in SPARSE_FLAVORS)
        if b.hybrid and b.hybrid.shared_expert:
            m = g.op("Add", [m, lin.shared_expert(g, xn2, sd, p + "mlp.")])
        return m
    return g.mlp_fused(xn2, sd, p + "mlp.") if b.ort else g.mlp(xn2, sd, p + "mlp.")


def _final_norm(b: _TargetGraph, x: str, residual_pending: str | None) -> str:
    g, t = b.g, b.t
    if residual_pending is not None:
        x = g.op("Add", [x, residual_pending])
    normed = g.rms_norm(x, g.weight("model.norm", b.sd["model.norm.weight"]), t.rms_eps, b.ort)
    if t.num_layers - 1 in b.tap_ids:
        b.taps[t.num_layers - 1] = normed  # HF's hidden_states[N] is the final-normed output (the +1 convention)
    return normed


def _tap_features(b: _TargetGraph, drafter) -> None:
    """Output ctx = hidden_norm(fc(concat(taps))) for every position, so taps never leave the graph."""
    g, taps, tap_ids, dsd = b.g, b.taps, b.tap_ids, b.dsd
    # float32 in half-precision builds (FP32_ISLAND): the taps are the raw residual stream (|x| > 2e4 in Qwen3-8B),
    # so fc's sums and hidden_norm's squares overflow fp16.
    with g.fp32_island():
        cat = g.op("Concat", [taps[i] for i in tap_ids], axis=-1) if len(tap_ids) > 1 else taps[tap_ids[0]]
        fc = g.linear(cat, dsd["fc.weight"], "drafter.fc")
        g.op("Identity", [g.rms_norm(fc, g.weight("drafter.hidden_norm", dsd["hidden_norm.weight"]),
                                     drafter.config.rms_norm_eps, b.ort)], outputs=["ctx"])


def _target_logits(b: _TargetGraph, normed: str, shared: dict, ctx_size: int) -> None:
    """LM head only on the rows asked for (prefill: the last; verify: the block): logits + FusedVerify (portable), or
    the normed rows for the engine's LM-head session (ort); declares those outputs and ctx."""
    g, t = b.g, b.t
    if b.batch:  # every packed row is a row of some sequence's block
        g.op("Identity", [normed], outputs=["hidden"])
        g.output("hidden", F32, [1, "rows", t.hidden_size])
        g.output("ctx", F32, [1, "rows", ctx_size])
        return
    neg = g.op("Neg", [g.op("Unsqueeze", ["num_logits", g.const([0])])])
    rows = g.op("Slice", [normed, neg, g.const([np.iinfo(np.int64).max]), g.const([1])])
    if b.ort:
        g.op("Identity", [rows], outputs=["hidden"])
        g.output("hidden", F32, ["batch", "num_logits", t.hidden_size])
        g.output("ctx", F32, ["batch", "seq", ctx_size])
    else:
        g.op("Identity", [g.lm_head(rows, head_name(shared), t.hidden_size)], outputs=["logits"])
        g.op(ops.FUSED_VERIFY, ["logits", "draft_tokens", "draft_probs", "uniforms"],
             outputs=["accept_len", "emitted_tokens", "n_emitted"], domain=ops.DOMAIN, temperature=0.0,
             **ops.plugin_attrs())
        g.output("logits", F32, ["batch", "num_logits", t.vocab_size])
        g.output("ctx", F32, ["batch", "seq", ctx_size])
        g.output("accept_len", I64, ["batch"])
        g.output("emitted_tokens", I64, ["batch", "num_logits"])
        g.output("n_emitted", I64, ["batch"])


def _target_cache_outputs(b: _TargetGraph) -> None:
    """Per layer: Gated DeltaNet state, the batched flavor's new K/V rows, or the present K/V."""
    g, D, KVH = b.g, b.t.head_dim, b.t.num_kv_heads
    for i in range(b.t.num_layers):
        if b.kinds[i] == "linear_attention":
            lin.declare_state_outputs(g, i, b.lin_shapes)
            continue
        if b.batch:
            g.output(f"new_key_{i}", F32, ["batch", KVH, "seq", D])
            g.output(f"new_value_{i}", F32, ["batch", KVH, "seq", D])
            continue
        kv_len = "max_len" if b.ort else "total"
        g.output(f"present_key_{i}", F32, ["batch", KVH, kv_len, D])
        g.output(f"present_value_{i}", F32, ["batch", KVH, kv_len, D])


@dataclass
class _BatchKeys:
    """Where a batched call's keys go and what each row sees, the same in every attention layer (built once)."""

    slots: str  # [B,1,S,1] int64: the buffer slot of the block's key j, length_b + j (ScatterElements indices)
    bias: str   # [B,G*S,P] float: 0 visible, -inf hidden (query rows group-major)
    kpos: str | None  # [B,P] int64: each slot's key position (graphs with sliding windows; None elsewhere)


def _batched_keys(g: GraphBuilder, x: str, groups: int, windowed: bool = False) -> _BatchKeys:
    """The block's keys are placed in (a copy of) the K/V buffer at their slots and every row attends over that one
    buffer: a key sits at the same place in the score row, the softmax sum and the P.V product whether an earlier
    call committed it or it comes with this one, so a row's bits do not depend on how the tokens before it were
    split into calls (a chain verified at once equals the same tokens stepped one by one: DFlash equals plain
    decoding). With the past and the block apart, a key moved from one sum to the other once committed, which
    int4's int8 activations turned into other tokens. Key p of sequence b: committed (p < length_b, read from
    past_bias, whose visible keys are a prefix), visible to every row; the block's key length_b + j, visible to row r
    as the causal mask (j <= r % S) and block_bias[b, r % S, j] say; the rest of the buffer hidden. `x`: any [B, S]
    input of the call's grid (position_ids), for S and, `windowed`, the block's key positions."""
    length = g.op("ReduceSum", [g.op("Cast", [g.op("Equal", ["past_bias", g.const(0.0, np.float32)])], to=I64),
                                g.const([1])], keepdims=0)                                # [B]
    s_len = g.op("Shape", [x], start=1, end=2)
    s = g.op("Squeeze", [s_len, g.const([0])])
    j = g.op("Range", [g.const(0), s, g.const(1)])                                        # [S]
    slots = g.op("Add", [g.op("Unsqueeze", [length, g.const([1])]), g.op("Unsqueeze", [j, g.const([0])])])  # [B,S]
    p_len = g.op("Shape", ["past_bias"], start=1, end=2)
    p = g.op("Range", [g.const(0), g.op("Squeeze", [p_len, g.const([0])]), g.const(1)])   # [P]
    rel = g.op("Sub", [g.op("Unsqueeze", [p, g.const([0])]), g.op("Unsqueeze", [length, g.const([1])])])  # [B,P]
    rows = g.op("Range", [g.const(0), g.op("Mul", [s, g.const(groups)]), g.const(1)])
    qi = g.op("Unsqueeze", [g.op("Mod", [rows, s]), g.const([1])])                       # [G*S, 1]
    causal = g.op("Where", [g.op("LessOrEqual", [g.op("Unsqueeze", [j, g.const([0])]), qi]),
                            g.const(0.0, np.float32), g.const(-np.inf, np.float32)])     # [G*S, S]
    block = g.op("Add", [g.op("Unsqueeze", [causal, g.const([0])]),
                         g.op("Tile", ["block_bias", g.const([1, groups, 1])])])          # [B,G*S,S]
    pick = g.op("Expand", [g.op("Unsqueeze", [g.op("Clip", [rel, g.const(0), g.op("Sub", [s, g.const(1)])]),
                                              g.const([1])]),
                           g.op("Concat", [g.op("Shape", [block], end=2), p_len], axis=0)])  # [B,G*S,P]
    in_block = g.op("Where", [g.op("Unsqueeze", [g.op("Less", [rel, s_len]), g.const([1])]),
                              g.op("GatherElements", [block, pick], axis=2), g.const(-np.inf, np.float32)])
    bias = g.op("Where", [g.op("Unsqueeze", [g.op("Less", [rel, g.const(0)]), g.const([1])]),
                          g.const(0.0, np.float32), in_block])                               # [B,G*S,P]
    if not windowed:
        return _BatchKeys(g.op("Unsqueeze", [slots, g.const([1, 3])]), bias, None)
    # Key positions for sliding windows: a committed key's is its slot; the block's key j's is position_ids[b, j]
    # (a draft tree's node sits at slot length + j but position length + depth). Slots past the block: hidden above.
    block_pos = g.op("GatherElements", [x, g.op("Clip", [rel, g.const(0), g.op("Sub", [s, g.const(1)])])], axis=1)
    committed = g.op("Expand", [g.op("Unsqueeze", [p, g.const([0])]), g.op("Shape", [rel])])
    kpos = g.op("Where", [g.op("Less", [rel, g.const(0)]), committed, block_pos])           # [B,P]
    return _BatchKeys(g.op("Unsqueeze", [slots, g.const([1, 3])]), bias, kpos)


def _batched_block_attention(g: GraphBuilder, xn: str, sd: dict, a: str, t: "TargetSpec", i: int, cos: str,
                             sin: str, keys: _BatchKeys, bias, window: int | None = None,
                             sinks: np.ndarray | None = None, pos: str | None = None,
                             heads: tuple[str, str, str] | None = None, packed: bool = False) -> str:
    """The ort_batch flavor's attention for layer i: queries [B,S] over past_key_i / past_value_i [B,KVH,P,D] (the
    engine's K/V buffer, read only; past_bias [B,P] hides the rows past each sequence's length) with the block's
    own keys placed at their slots (`_batched_keys`). Outputs new_key_i / new_value_i [B,KVH,S,D] (keys after k_norm
    and RoPE, as GroupQueryAttention caches them). Scores and softmax in fp32. `heads`: (q, k, v) [B,h,S,D] already
    projected, normed and turned (hybrids' gated attention, export/linear_attention.py) instead of this layer's own.
    `packed`: xn is the call's packed rows [1,T,H]; q, k and v are projected on them and then placed on the grid."""
    D, H, KVH = t.head_dim, t.num_heads, t.num_kv_heads
    if heads is None:
        wqkv = np.concatenate([sd[a + n + "_proj.weight"] for n in "qkv"], axis=0)
        bqkv = None
        if bias("q_proj") is not None:
            bqkv = np.concatenate([bias(n + "_proj") for n in "qkv"], axis=0)
        qkv = g.linear(xn, wqkv, a + "qkv_proj", bqkv)
        if packed:
            qkv = _to_grid(g, qkv)
        q, k, v = g.op("Split", [qkv, g.const([H * D, KVH * D, KVH * D])], n_out=3, axis=-1)
        qh, kh, vh = g.heads(q, H, D), g.heads(k, KVH, D), g.heads(v, KVH, D)
        if t.qk_norm:
            qh = g.rms_norm(qh, g.weight(a + "q_norm", sd[a + "q_norm.weight"]), t.rms_eps, True)
            kh = g.rms_norm(kh, g.weight(a + "k_norm", sd[a + "k_norm.weight"]), t.rms_eps, True)
        qh, kh = g.rope(qh, cos, sin, D), g.rope(kh, cos, sin, D)
    else:
        qh, kh, vh = heads
    g.op("Identity", [kh], outputs=[f"new_key_{i}"])
    g.op("Identity", [vh], outputs=[f"new_value_{i}"])
    past_k = g.input(f"past_key_{i}", F32, ["batch", KVH, "past", D])
    past_v = g.input(f"past_value_{i}", F32, ["batch", KVH, "past", D])
    where = g.op("Expand", [keys.slots, g.op("Shape", [vh])])                            # [B,KVH,S,D]
    full_k = g.op("ScatterElements", [past_k, where, f"new_key_{i}"], axis=2)
    full_v = g.op("ScatterElements", [past_v, where, f"new_value_{i}"], axis=2)
    # GQA without repeating K/V: query head h = kvh * G + g, so [B,H,S,D] is [B,KVH,G*S,D] (group-major rows).
    q4 = g.op("Reshape", [qh, g.const([0, KVH, -1, D])])
    scale = g.const(D ** -0.5, np.float32)
    scores = g.op("Mul", [g.op("MatMul", [q4, g.op("Transpose", [full_k], perm=[0, 1, 3, 2])]), scale])
    scores = g.op("Add", [scores, g.op("Unsqueeze", [keys.bias, g.const([1])])])          # [B,KVH,G*S,P]
    if window:  # a key at position k visible to a query at position p iff k > p - window
        near = g.op("Greater", [g.op("Unsqueeze", [keys.kpos, g.const([1])]),
                                g.op("Unsqueeze", [g.op("Sub", [pos, g.const(window)]), g.const([2])])])  # [B,S,P]
        wmask = g.op("Unsqueeze", [g.op("Where", [near, g.const(0.0, np.float32), g.const(-np.inf, np.float32)]),
                                   g.const([1])])                                        # [B,1,S,P]
        scores = g.op("Add", [scores, g.op("Tile", [wmask, g.const([1, 1, H // KVH, 1])])])
    if sinks is not None:  # one more logit per head (rows group-major: head kvh*G + g), dropped after the softmax
        sink = g.weight(a + "sinks", sinks.reshape(1, KVH, H // KVH, 1))
        s_len = g.op("Shape", [vh], start=2, end=3)
        col = g.op("Reshape", [g.op("Expand", [sink, g.op("Concat", [g.const([1, KVH, H // KVH]), s_len], axis=0)]),
                               g.const([1, KVH, -1, 1])])
        col = g.op("Expand", [col, g.op("Concat", [g.op("Shape", [scores], end=3), g.const([1])], axis=0)])
        probs = g.op("Softmax", [g.op("Concat", [scores, col], axis=-1)], axis=-1)
        p_len = g.op("Shape", [past_k], start=2, end=3)
        probs = g.op("Split", [probs, g.op("Concat", [p_len, g.const([1])], axis=0)], n_out=2, axis=-1)[0]
    else:
        probs = g.op("Softmax", [scores], axis=-1)
    o4 = g.op("MatMul", [probs, full_v])                                                  # [B,KVH,G*S,D]
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
    ops.biased_kv_injected_block_attention_function), so B sequences of different lengths draft in one call; and the
    output is hidden [B,bs-1,H] (normed, for the engine's LM head session) instead of tokens/logits; the engine applies
    the logit multiplier and soft cap (graph metadata) to the head's output.
    Block embeddings are scaled by `input_embedding_scale` inside the graph (both flavors). Causal / sliding-window
    layers use MaskedKVInjectedBlockAttention; the block may be shorter than block_size (the last one of a request).
    """
    d = _DrafterGraph(GraphBuilder("dflash_drafter", store), drafter.config, target_spec(target), np_state(drafter),
                      flavor == "ort")
    x = _drafter_inputs(d, drafter, max_len)
    functions = _drafter_key_inputs(d)
    for i in range(d.c.num_hidden_layers):
        x = _drafter_layer(d, i, x)
    shared = shared_tensors(target)
    _drafter_head(d, x, shared)
    _drafter_cache_outputs(d)
    return (*finish(d.g, functions, False), shared)


@dataclass
class _DrafterGraph:
    """What every block of the drafter graph reads; _drafter_inputs and _drafter_key_inputs set the rest."""

    g: GraphBuilder
    c: object
    t: TargetSpec
    sd: dict
    ort: bool
    ctx: str | None = None
    pos: str | None = None
    cos: str | None = None
    sin: str | None = None
    ccos: str | None = None
    csin: str | None = None
    k_pos: str | None = None

    @property
    def batched(self) -> bool:
        # ort flavor, unmasked layers: a key bias [B, T+C+bs] (0 / -inf) lets one call carry sequences of different
        # context and block lengths, padded (engines/ort_batch.py). Masked drafters keep their positional mask and are
        # drafted one sequence per call.
        return self.ort and not self.c.masked


def _drafter_inputs(d: _DrafterGraph, drafter, max_len: int) -> str:
    """Context and block inputs, RoPE at both sets of positions; returns the scaled block embeddings."""
    g, c, t, ort = d.g, d.c, d.t, d.ort
    d.ctx = g.input("ctx", F32, ["batch", "n_ctx", c.hidden_size])
    ctx_pos = g.input("ctx_positions", I64, ["batch", "n_ctx"])
    if ort:
        ids = g.input("block_embeds", F32, ["batch", "block", t.hidden_size])
    else:
        ids = g.input("block_ids", I64, ["batch", "block"])
    d.pos = g.input("block_positions", I64, ["batch", "block"])
    cos_t, sin_t = drafter_rope_tables(drafter, max_len)
    cos_tab, sin_tab = g.weight("drafter.rope_cos", cos_t), g.weight("drafter.rope_sin", sin_t)
    d.cos, d.sin = g.rope_tables(d.pos, cos_tab, sin_tab)
    d.ccos, d.csin = g.rope_tables(ctx_pos, cos_tab, sin_tab)
    x = ids if ort else g.op("Gather", [SHARED_EMBED, ids], axis=0)
    if c.input_embedding_scale != 1.0:
        x = g.op("Mul", [x, g.const(c.input_embedding_scale, np.float32)])
    return x


def _drafter_key_inputs(d: _DrafterGraph) -> list:
    """Key positions (masked drafters) or the key_bias input (batched); returns the attention functions used."""
    g, c = d.g, d.c
    if c.masked:
        # Key positions for the masked layers: context keys sit at 0..T-1 (every engine feeds the context in order
        # from position 0), then the block's own positions.
        t_ctx = g.op("Add", [g.op("Shape", ["past_ctx_key_0"], start=2, end=3), g.op("Shape", [d.ctx], start=1,
                                                                                       end=2)])
        ctx_kpos = g.op("Range", [g.const(0), g.op("Squeeze", [t_ctx, g.const([0])]), g.const(1)])
        batch = g.op("Shape", [d.pos], start=0, end=1)
        ctx_kpos = g.op("Expand", [g.op("Unsqueeze", [ctx_kpos, g.const([0])]), g.op("Concat", [batch, t_ctx],
                                                                                     axis=0)])
        d.k_pos = g.op("Concat", [ctx_kpos, d.pos], axis=1)
    if d.batched:
        g.input("key_bias", F32, ["batch", "n_keys"])
    functions = [ops.biased_kv_injected_block_attention_function() if d.batched
                 else ops.kv_injected_block_attention_function()]
    if c.masked:
        functions.append(ops.masked_kv_injected_block_attention_function())
    return functions


def _drafter_layer(d: _DrafterGraph, i: int, x: str) -> str:
    """Drafter layer i: context K/V, norm, block attention, norm, MLP (DFlash 2: each wrapped in its convolution)."""
    g, c, sd, ort = d.g, d.c, d.sd, d.ort
    p = f"layers.{i}."
    a = p + "self_attn."
    kn = g.weight("drafter." + a + "k_norm", sd[a + "k_norm.weight"])
    qn = g.weight("drafter." + a + "q_norm", sd[a + "q_norm.weight"])
    k_ctx, v_ctx = _drafter_context_kv(d, i, kn)
    xn = g.rms_norm(x, g.weight("drafter." + p + "input_layernorm", sd[p + "input_layernorm.weight"]),
                    c.rms_norm_eps, ort)
    if c.is_dflash2:
        xn, attn_dyn = g.block_conv_prepare(xn, sd, "drafter." + p + "attention_conv", p + "attention_conv.", c)
    att = _drafter_attention(d, i, xn, qn, kn, k_ctx, v_ctx)
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
    return g.op("Add", [x, m])


def _drafter_bias(sd: dict, a: str):
    return lambda n: sd.get(a + n + ".bias")


def _drafter_context_kv(d: _DrafterGraph, i: int, kn: str) -> tuple[str, str]:
    """Layer i's context K/V: the cached past ++ the new context rows (present_ctx_key_i / present_ctx_value_i)."""
    g, c, sd, ctx = d.g, d.c, d.sd, d.ctx
    D, KVH = c.head_dim, c.num_key_value_heads
    a = f"layers.{i}.self_attn."
    bias = _drafter_bias(sd, a)
    # New context K/V: k_norm on context keys too, RoPE at their own positions.
    ck = g.rope(g.rms_norm(g.heads(g.linear(ctx, sd[a + "k_proj.weight"], "drafter." + a + "k_proj",
                                            bias("k_proj")), KVH, D), kn, c.rms_norm_eps, False),
                d.ccos, d.csin, D)
    cv = g.heads(g.linear(ctx, sd[a + "v_proj.weight"], "drafter." + a + "v_proj", bias("v_proj")), KVH, D)
    past_k = g.input(f"past_ctx_key_{i}", F32, ["batch", KVH, "past_ctx", D])
    past_v = g.input(f"past_ctx_value_{i}", F32, ["batch", KVH, "past_ctx", D])
    k_ctx = g.op("Concat", [past_k, ck], axis=2, outputs=[f"present_ctx_key_{i}"])
    v_ctx = g.op("Concat", [past_v, cv], axis=2, outputs=[f"present_ctx_value_{i}"])
    return k_ctx, v_ctx


def _drafter_attention(d: _DrafterGraph, i: int, xn: str, qn: str, kn: str, k_ctx: str, v_ctx: str) -> str:
    """The block's queries over context ++ block keys (the dflash custom ops), output projection included."""
    g, c, sd = d.g, d.c, d.sd
    D, H, KVH = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    a = f"layers.{i}.self_attn."
    bias = _drafter_bias(sd, a)
    cos, sin, pos = d.cos, d.sin, d.pos
    q = g.rope(g.rms_norm(g.heads(g.linear(xn, sd[a + "q_proj.weight"], "drafter." + a + "q_proj",
                                           bias("q_proj")), H, D), qn, c.rms_norm_eps, False), cos, sin, D)
    kb = g.rope(g.rms_norm(g.heads(g.linear(xn, sd[a + "k_proj.weight"], "drafter." + a + "k_proj",
                                            bias("k_proj")), KVH, D), kn, c.rms_norm_eps, False), cos, sin, D)
    vb = g.heads(g.linear(xn, sd[a + "v_proj.weight"], "drafter." + a + "v_proj", bias("v_proj")), KVH, D)
    if c.layer_causal(i) or c.layer_window(i) is not None:
        att = g.op(ops.MASKED_KV_ATTENTION, [q, k_ctx, v_ctx, kb, vb, pos, d.k_pos], domain=ops.DOMAIN, num_heads=H,
                   num_kv_heads=KVH, scale=float(D ** -0.5), causal=int(c.layer_causal(i)),
                   window=int(c.layer_window(i) or 0), **ops.plugin_attrs())
    elif d.batched:
        att = g.op(ops.BIASED_KV_ATTENTION, [q, k_ctx, v_ctx, kb, vb, "key_bias"], domain=ops.DOMAIN,
                   num_heads=H, num_kv_heads=KVH, scale=float(D ** -0.5), **ops.plugin_attrs())
    else:
        att = g.op(ops.KV_ATTENTION, [q, k_ctx, v_ctx, kb, vb], domain=ops.DOMAIN, num_heads=H,
                   num_kv_heads=KVH, scale=float(D ** -0.5), **ops.plugin_attrs())
    att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), g.const([0, 0, H * D])])
    return g.linear(att, sd[a + "o_proj.weight"], "drafter." + a + "o_proj", bias("o_proj"))


def _drafter_head(d: _DrafterGraph, x: str, shared: dict) -> None:
    """Final norm, the draft rows (the anchor slot drafts nothing): logits / argmax (after the drafter's logit
    multiplier and soft cap), or the normed rows for the engine's LM-head session (ort); DFlash 2's selector rows."""
    g, c, t, sd, ort = d.g, d.c, d.t, d.sd, d.ort
    h = g.rms_norm(x, g.weight("drafter.norm", sd["norm.weight"]), c.rms_norm_eps, ort)
    rows = g.op("Slice", [h, g.const([1]), g.const([np.iinfo(np.int64).max]), g.const([1])])  # anchor slot: nothing
    if c.is_dflash2:  # the candidate selector's projection of each slot; its walk runs on the host (ops.py)
        g.op("Identity", [g.linear(rows, sd["candidate_selector.hidden_projection.weight"],
                                   "drafter.candidate_selector.hidden_projection")], outputs=["selector_hidden"])
        g.output("selector_hidden", F32, ["batch", "n_draft", c.selector_rank])
    if ort:
        g.op("Identity", [rows], outputs=["hidden"])
        g.output("hidden", F32, ["batch", "n_draft", t.hidden_size])
        return
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


def _drafter_cache_outputs(d: _DrafterGraph) -> None:
    D, KVH = d.c.head_dim, d.c.num_key_value_heads
    for i in range(d.c.num_hidden_layers):
        d.g.output(f"present_ctx_key_{i}", F32, ["batch", KVH, "total_ctx", D])
        d.g.output(f"present_ctx_value_{i}", F32, ["batch", KVH, "total_ctx", D])


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
