"""What a verify block costs against a plain step on a hybrid target (Gated DeltaNet + gated attention), at the width
of Qwen3.5-4B's layers: one layer of each kind, random weights (the cost depends on the shapes, not the weights).

    python benchmarks/hybrid_costs.py [--reps 20] [--threads N] [--precision fp32|int8|int4]
    python benchmarks/hybrid_costs.py --dense     # the yardstick: two Qwen3 layers of the same width

Layer sizes (Qwen3.5-4B's, from its published description): hidden 2560, MLP 9216, gated attention 16 query / 4
key-value heads of 256 with RoPE on 64 channels, Gated DeltaNet 16 key / 32 value heads of 128 with a 4-tap conv.
Vocabulary 4096 instead of 248320, so the LM head (whose cost per row is the same for any target) does not hide the
layers' own ratio. The drafter: one layer of the same width. Measured by engine_costs.measure: plain step, verify
of 8 and 16 rows, draft, interleaved round by round, medians (random blocks: each verify accepts row 0); then the
host's commit of a 16-row verify per Gated DeltaNet layer by accepted row (`commit_row_r_ms`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB = 4096
WIDTH = dict(hidden_size=2560, intermediate_size=9216, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4)


def build(args, work: Path) -> Path:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.models.config import DrafterConfig
    from dflash_export.models.drafter import DFlashDrafter, save_drafter
    from dflash_export.recipes import load_recipe

    torch.manual_seed(0)
    if args.dense:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        dense = {k: v for k, v in WIDTH.items() if not k.startswith("linear_")}
        Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, num_hidden_layers=2, rope_theta=10000000.0,
                                     max_position_embeddings=4096, eos_token_id=2, bos_token_id=1, **dense)
                         ).save_pretrained(str(work / "target"))
    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25},
                            max_position_embeddings=4096, eos_token_id=2, bos_token_id=1, **WIDTH)
    if not args.dense:
        Qwen3_5ForCausalLM(cfg).save_pretrained(str(work / "target"))
    dc = DrafterConfig(hidden_size=2560, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=9216, rms_norm_eps=1e-6, block_size=16, mask_token_id=VOCAB - 1,
                       target_layer_ids=[0, 1], num_target_layers=2, vocab_size=VOCAB, target_hidden_size=2560,
                       rope_theta=10000000.0, max_position_embeddings=4096)
    save_drafter(DFlashDrafter(dc), work / "drafter")
    (work / "recipe.yaml").write_text(json.dumps({
        "name": "hybrid-costs", "target": str(work / "target"), "drafter": str(work / "drafter"),
        "dtype": "float32", "max_seq_len": 1024, "chat_template": False}))
    t0 = time.perf_counter()
    out = build_onnxruntime(load_recipe(work / "recipe.yaml"), work / "engine", threads=args.threads,
                            precision=args.precision)
    print(f"build: {time.perf_counter() - t0:.1f} s, {out}")
    return out


def commit_costs(reps: int) -> dict:
    """What committing a verify of 16 rows costs on the host per Gated DeltaNet layer at Qwen3.5-4B's sizes, by the
    accepted row: the last row's state is the graph's own; an earlier row applies rows 0..r's updates
    (engines.onnxruntime.committed_linear). The least of `reps` (a host loop of small numpy calls: on a shared
    machine its median measures the other jobs' preemptions)."""
    import numpy as np

    from dflash_export.engines.onnxruntime import committed_linear

    hv, dk, dv, c, s = WIDTH["linear_num_value_heads"], 128, 128, 2 * 16 * 128 + 32 * 128, 16
    rng = np.random.default_rng(0)
    conv, rec = rng.standard_normal((c, 3), np.float32), rng.standard_normal((hv, dk, dv), np.float32)
    outs = (rng.standard_normal((1, c, 3 + s), np.float32), rng.standard_normal((1, hv, dk, dv), np.float32),
            rng.standard_normal((1, s, hv, dk), np.float32), rng.random((1, s, hv), np.float32),
            rng.standard_normal((s, 1, hv, 1, dv), np.float32))
    res = {}
    for row in (0, 3, 7, 14, 15):
        times = []
        for _ in range(reps):
            state = rec.copy()  # updated in place
            t0 = time.perf_counter()
            committed_linear(conv, state, outs, 0, row)
            times.append(time.perf_counter() - t0)
        res[f"commit_row_{row}_ms"] = 1000 * min(times)
    return res


FORMS = ("scan", "chunked")


def layer_costs(reps: int, threads: int | None, context_rows: int = 128) -> dict:
    """One Gated DeltaNet layer alone at Qwen3.5-4B's shape in each block form (export/linear_attention.BLOCK_FORM),
    random weights, over a random committed state: ms per call of 1, 8 and 16 rows, interleaved (form by form, size
    by size, within each round), medians; then one profiled pass per form (ONNX Runtime's profiler) summing node
    time by op type at 16 rows, and how far each form's outputs are from the scan's (max |difference| / max |scan|)."""
    import json as _json
    import os
    import statistics
    import types

    import numpy as np
    import onnxruntime as ort

    from dflash_export.export import linear_attention as lin

    hk, hv, dk, dv, k = 16, 32, 128, 128, 4
    h, c = WIDTH["hidden_size"], 2 * hk * dk + hv * dv
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(np.float32)
    p = "l."
    sd = {p + "in_proj_qkv.weight": w(c, h), p + "in_proj_z.weight": w(hv * dv, h), p + "in_proj_b.weight": w(hv, h),
          p + "in_proj_a.weight": w(hv, h), p + "conv1d.weight": w(c, 1, k), p + "A_log": w(hv) * 4,
          p + "dt_bias": w(hv), p + "norm.weight": 1 + 0.1 * w(dv), p + "out_proj.weight": w(h, hv * dv)}
    shapes = {"key_heads": hk, "value_heads": hv, "key_dim": dk, "value_dim": dv, "conv_kernel": k,
              "conv_channels": c}
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or min(2, os.cpu_count() or 1)
    so.inter_op_num_threads = 1
    models = {f: lin.gated_delta_net_model(sd, p, types.SimpleNamespace(fused_projections=False), shapes, 1e-6, h, f)
              .SerializeToString() for f in FORMS}
    sess = {f: ort.InferenceSession(m, so) for f, m in models.items()}
    conv, rec = rng.standard_normal((1, c, k - 1), np.float32), 0.1 * rng.standard_normal((1, hv, dk, dv), np.float32)
    feeds = {s: {"x": rng.standard_normal((1, s, h), np.float32), "conv_state_0": conv, "recurrent_state_0": rec}
             for s in (1, 8, 16)}
    times = {(f, s): [] for f in FORMS for s in feeds}
    for r in range(reps + 2):
        for f in FORMS:
            for s, fd in feeds.items():
                t0 = time.perf_counter()
                sess[f].run(None, fd)
                if r >= 2:
                    times[(f, s)].append(time.perf_counter() - t0)
    res = {f"layer_{f}_{s}_ms": 1000 * statistics.median(v) for (f, s), v in times.items()}
    ref = sess["scan"].run(None, feeds[16])
    for f in FORMS:
        res[f"layer_{f}_v16_over_1"] = res[f"layer_{f}_16_ms"] / res[f"layer_{f}_1_ms"]
        out = sess[f].run(None, feeds[16])
        res[f"layer_{f}_rel_diff_16"] = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(ref, out))
        pso = ort.SessionOptions()
        pso.intra_op_num_threads, pso.inter_op_num_threads = so.intra_op_num_threads, 1
        pso.enable_profiling = True
        pso.profile_file_prefix = tempfile.mkdtemp(prefix="gdn-profile-") + "/p"
        ps = ort.InferenceSession(models[f], pso)
        for _ in range(reps):
            ps.run(None, feeds[16])
        by_op: dict[str, float] = {}
        for ev in _json.loads(Path(ps.end_profiling()).read_text()):
            if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
                op = ev["args"]["op_name"]
                by_op[op] = by_op.get(op, 0.0) + ev["dur"] / 1000 / reps
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:6]
        print(f"{f} form, 16 rows, ms per call by op type: " + ", ".join(f"{op} {ms:.1f}" for op, ms in top))
    return res


def core_costs(reps: int, threads: int | None) -> dict:
    """The recurrence alone (after the conv, norms and gates; no projections) at Qwen3.5-4B's Gated DeltaNet shape,
    three ways: the Scan and the chunked form of export/linear_attention.py, and ONNX Runtime's own
    com.microsoft.GatedDeltaNet contrib op (its CPU kernel; update_rule gated_delta, q / k L2-normalized inside).
    ms per call of 1, 8 and 16 rows, interleaved, medians; whether each form's block rows are its one-row steps'
    bits (the exactness DFlash needs); each form's output against the Scan's (max |difference| / max |Scan|)."""
    import os
    import statistics

    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dflash_export.export import linear_attention as lin
    from dflash_export.export.builder import F32, GraphBuilder, finish

    hk, hv, dk, dv, s = 16, 32, 128, 128, 16
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or min(2, os.cpu_count() or 1)
    so.inter_op_num_threads = 1

    def ours(form: str):
        g = GraphBuilder("recurrence")
        q, k = g.input("q", F32, ["B", "S", hv, dk]), g.input("k", F32, ["B", "S", hv, dk])
        v, gate = g.input("v", F32, ["B", "S", hv, dv]), g.input("gate", F32, ["B", "S", hv])
        beta, state = g.input("beta_in", F32, ["B", "S", hv]), g.input("state", F32, ["B", hv, dk, dv])
        if form == "chunked":
            out = lin._chunked_delta_rule(g, q, k, v, gate, beta, state, 0)
        else:
            pair = g.op("Concat", [g.op("Unsqueeze", [q, g.const([3])]), g.op("Unsqueeze", [k, g.const([3])])], axis=3)
            steps = lambda x, perm: g.op("Transpose", [x], perm=perm)
            _, rows, _ = g.op("Scan", [state, steps(pair, [1, 0, 2, 3, 4]),
                                       steps(g.op("Unsqueeze", [v, g.const([3])]), [1, 0, 2, 3, 4]),
                                       steps(g.op("Exp", [gate]), [1, 0, 2]), steps(beta, [1, 0, 2])],
                              n_out=3, outputs=["recurrent_last_0", "rows", "row_deltas_0"],
                              body=lin._scan_body(hv, dk, dv), num_scan_inputs=4)
            out = g.op("Transpose", [g.op("Squeeze", [rows, g.const([3])])], perm=[1, 0, 2, 3])
        g.op("Identity", [out], outputs=["y"])
        for name in ("y", "recurrent_last_0", "row_deltas_0"):
            g.output(name, F32, None)
        model, inits = finish(g, [], ort=False)
        model.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), n) for n, a in inits.items())
        return ort.InferenceSession(model.SerializeToString(), so)

    def contrib():
        f = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
        node = helper.make_node("GatedDeltaNet", ["q", "k", "v", "", "decay", "beta", "state"], ["y", "last"],
                                domain="com.microsoft", update_rule="gated_delta", gate_activation="none",
                                beta_activation="none", qk_l2_norm=1)
        graph = helper.make_graph([node], "recurrence", [
            f("q", ["B", "S", hk, dk]), f("k", ["B", "S", hk, dk]), f("v", ["B", "S", hv, dv]),
            f("decay", ["B", "S", hv]), f("beta", ["B", "S", hv]), f("state", ["B", hv, dv, dk])],
            [f("y", None), f("last", None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 8
        return ort.InferenceSession(model.SerializeToString(), so)

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, s, hk, dk), np.float32)
    v = rng.standard_normal((1, s, hv, dv), np.float32)
    gate = (-0.3 * np.abs(rng.standard_normal((1, s, hv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((1, s, hv))))).astype(np.float32)
    state_vk = (0.1 * rng.standard_normal((1, hv, dv, dk))).astype(np.float32)  # the contrib op's V-major state
    norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(lin.L2_EPS))
    heads = lambda x: np.repeat(x, hv // hk, axis=2).astype(np.float32)
    ours_feeds = {"q": heads(norm(q) * np.float32(dk ** -0.5)), "k": heads(norm(k)), "v": v, "gate": gate,
                  "beta_in": beta, "state": np.ascontiguousarray(state_vk.transpose(0, 1, 3, 2))}
    op_feeds = {"q": q, "k": k, "v": v, "decay": gate, "beta": beta, "state": state_vk}
    forms = {"scan": (ours("scan"), ours_feeds), "chunked": (ours("chunked"), ours_feeds),
             "contrib": (contrib(), op_feeds)}

    def rows(feeds, a, b):
        return {n: (x[:, a:b] if x.ndim > 2 and n != "state" else x) for n, x in feeds.items()}

    res, ref = {}, forms["scan"][0].run(None, ours_feeds)[0]
    for name, (sess, feeds) in forms.items():
        block = sess.run(None, feeds)[0]
        state_name = "state"
        steps, fd = [], dict(feeds)
        for t in range(s):
            fd = {**rows(feeds, t, t + 1), state_name: fd[state_name]}
            y, last = sess.run(None, fd)[:2]
            steps.append(y)
            fd[state_name] = last
        res[f"core_{name}_rows_are_steps_bits"] = float(np.array_equal(np.concatenate(steps, 1), block))
        res[f"core_{name}_rel_diff_to_scan"] = float(np.abs(block - ref).max() / np.abs(ref).max())
    times = {(name, n): [] for name in forms for n in (1, 8, 16)}
    for r in range(reps + 2):
        for (name, n), bucket in times.items():
            sess, feeds = forms[name]
            fd = rows(feeds, 0, n)
            t0 = time.perf_counter()
            sess.run(None, fd)
            if r >= 2:
                bucket.append(time.perf_counter() - t0)
    res.update({f"core_{name}_{n}_ms": 1000 * statistics.median(b) for (name, n), b in times.items()})
    return res


def main():
    from engine_costs import measure

    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None, help="measure an engine this script built before")
    ap.add_argument("--keep", action="store_true", help="keep the engine built in a temporary directory (~3 GB; "
                    "its path is printed) for a later --engine; by default it is removed at the end")
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache while measuring")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--precision", choices=["fp32", "int8", "int4"], default="fp32")
    ap.add_argument("--cpu-time", action="store_true", help="time calls in process CPU seconds, not wall time")
    ap.add_argument("--dense", action="store_true", help="two Qwen3 layers of the same width instead (yardstick)")
    ap.add_argument("--form", choices=FORMS, default="scan",
                    help="the Gated DeltaNet block form the built engine uses (export/linear_attention.BLOCK_FORM)")
    ap.add_argument("--layer", action="store_true",
                    help="only the Gated DeltaNet alone, every block form side by side: the recurrence "
                         "(core_costs, with ONNX Runtime's GatedDeltaNet contrib op) and one whole layer (layer_costs)")
    args = ap.parse_args()
    at_least(args, 1, "--context", "--reps")
    at_least(args, 0, "--threads")
    args.random_ids = True  # engine_costs.measure's context and blocks: random ids (random weights, no tokenizer)
    if args.layer:
        for k, v in {**core_costs(args.reps, args.threads), **layer_costs(args.reps, args.threads)}.items():
            print(f"{k:28s} {v:10.3g}")
        return
    from dflash_export.export import linear_attention

    linear_attention.BLOCK_FORM = args.form
    work = None
    if args.engine is None:
        work = Path(tempfile.mkdtemp(prefix="hybrid-costs-"))
        args.engine = build(args, work)
    try:
        res = measure(args.engine, args)
        if not args.dense:
            res.update(commit_costs(args.reps))
    finally:
        if work is not None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for k, v in res.items():
        mark = "  (target <= 1.5)" if k == "ratio_verify_16" else ""
        print(f"{k:22s} {v:9.2f}{mark}" if isinstance(v, (int, float)) else f"{k:22s} {v}")


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
