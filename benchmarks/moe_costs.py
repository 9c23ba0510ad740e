"""What a mixture-of-experts target's step costs on ONNX Runtime (CPU), at the real per-layer shapes of Qwen3-30B-A3B
and gpt-oss-20b, against the yardsticks that say whether the sparse expert path reads only what a token needs:

- the same layers with the experts in the dense form (every expert for every row; fp32, as export/moe.py writes it
  for the portable graph);
- a dense model with the same attention projections and an MLP of the MoE's active width (k x expert width), at the
  same precision (the speed its active parameters allow);
- the bytes a step must read (attention projections, router, k experts) at this machine's measured read bandwidth
  (a one-row fp32 MatMul over a 1 GiB weight, same threads, timed in the same rounds).

    python benchmarks/moe_costs.py --shape qwen3-30b-a3b --layers 2
    python benchmarks/moe_costs.py --shape gpt-oss-20b --layers 2 --no-dense-experts

Each layer is RMSNorm -> q/k/v projection -> o projection (the attention's scores over a cache are left out: the same
in every model here, and small next to the weights at short contexts) -> RMSNorm -> MLP, with residuals; random
weights (routing on random rows is close to uniform: an upper bound on how many experts a block touches). Rows: 1
(a lone row), 2 (a plain step as the engine runs it: the row and its copy, engines/numerics.py's row floor), 8 and 16
(verify blocks of distinct rows). The models are built once under --cache (fp32 ~2.4 GB a layer for Qwen3-30B-A3B,
3.2 GB for gpt-oss-20b; int8 / int4 derived from them). Sessions run interleaved, round by round, in one process;
times are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    # hidden, experts, expert width, experts per token, q heads, kv heads, head dim
    "qwen3-30b-a3b": {"family": "qwen3_moe", "hidden": 2048, "experts": 128, "width": 768, "top_k": 8,
                      "heads": 32, "kv_heads": 4, "head_dim": 128},
    "gpt-oss-20b": {"family": "gpt_oss", "hidden": 2880, "experts": 32, "width": 2880, "top_k": 4, "heads": 64,
                    "kv_heads": 8, "head_dim": 64},
    # a smoke-test shape (tests/test_bench.py)
    "tiny": {"family": "qwen3_moe", "hidden": 64, "experts": 8, "width": 32, "top_k": 2, "heads": 4, "kv_heads": 2,
             "head_dim": 16},
}
BYTES_PER_WEIGHT = {"fp32": 4.0, "int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}   # blocks of 32, one fp32 scale each
ROWS = (1, 2, 8, 16)
BLOCK = 32
ACCURACY_LEVEL = 4


def _layer_weights(shape: dict, layer: int, moe: bool) -> dict[str, np.ndarray]:
    """Random weights of one layer in transformers' layout (the MoE's experts or a dense MLP of the active width)."""
    from dflash_export.models.arch import ARCHS

    rng = np.random.default_rng(1000 + layer)
    h, e, w, k = shape["hidden"], shape["experts"], shape["width"], shape["top_k"]
    q_out = shape["heads"] * shape["head_dim"]
    kv_out = shape["kv_heads"] * shape["head_dim"]

    def rand(*dims, scale=0.02):
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float32, copy=False)

    sd = {"input_layernorm": np.ones(h, np.float32), "post_attention_layernorm": np.ones(h, np.float32),
          "qkv": rand(q_out + 2 * kv_out, h), "o": rand(h, q_out)}
    spec = ARCHS[shape["family"]].moe
    if not moe:
        sd.update({"mlp.gate_proj.weight": rand(k * w, h), "mlp.up_proj.weight": rand(k * w, h),
                   "mlp.down_proj.weight": rand(h, k * w)})
        return sd
    sd[f"mlp.{spec.router}.weight"] = router_weight(shape, layer)
    if spec.interleaved_transposed:
        sd["mlp.experts.gate_up_proj"] = rand(e, h, 2 * w)
        sd["mlp.experts.down_proj"] = rand(e, w, h)
        sd[f"mlp.{spec.router}.bias"] = rand(e)
        sd["mlp.experts.gate_up_proj_bias"] = rand(e, 2 * w)
        sd["mlp.experts.down_proj_bias"] = rand(e, h)
    else:
        sd["mlp.experts.gate_up_proj"] = rand(e, 2 * w, h)
        sd["mlp.experts.down_proj"] = rand(e, h, w)
    return sd


def router_weight(shape: dict, layer: int) -> np.ndarray:
    """The layer's router [E, H], from its own random stream (expert_union reads it without the experts)."""
    rng = np.random.default_rng(2000 + layer)
    return rng.standard_normal((shape["experts"], shape["hidden"]), dtype=np.float32)


def _config(shape: dict) -> SimpleNamespace:
    return SimpleNamespace(num_experts_per_tok=shape["top_k"], norm_topk_prob=True, swiglu_limit=7.0)


def build_fp32(shape_name: str, form: str, layers: int, out: Path) -> Path:
    """Write model.onnx (+ weights.bin) for `form`: "sparse" (com.microsoft.MoE), "dense" (every expert, plain ops)
    or "active" (a dense MLP of the active width)."""
    import onnx

    from dflash_export.export.builder import F32, GraphBuilder, WeightStore, finish
    from dflash_export.export.moe import moe_mlp
    from dflash_export.models.arch import ARCHS

    out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[shape_name]
    spec = ARCHS[shape["family"]].moe
    store = WeightStore(out / "weights.bin")
    g = GraphBuilder(f"{shape_name}-{form}", store)
    x = g.input("x", F32, [1, "rows", shape["hidden"]])
    q_out = shape["heads"] * shape["head_dim"]
    for i in range(layers):
        sd = _layer_weights(shape, i, moe=form != "active")
        p = f"layers.{i}."
        xn = g.rms_norm(x, g.weight(p + "ln1", sd["input_layernorm"]), 1e-6, True)
        qkv = g.linear(xn, sd["qkv"], p + "qkv")
        q = g.op("Slice", [qkv, g.const([0]), g.const([q_out]), g.const([-1])])
        x = g.op("Add", [x, g.linear(q, sd["o"], p + "o")])
        xn2 = g.rms_norm(x, g.weight(p + "ln2", sd["post_attention_layernorm"]), 1e-6, True)
        if form == "active":
            m = g.mlp_fused(xn2, {p + "mlp." + k[4:]: v for k, v in sd.items() if k.startswith("mlp.")}, p + "mlp.")
        else:
            m = moe_mlp(g, xn2, {p + k: v for k, v in sd.items()}, p + "mlp.", spec, _config(shape),
                        sparse=form == "sparse")
        x = g.op("Add", [x, m])
        del sd
    g.op("Identity", [x], outputs=["y"])
    g.output("y", F32, [1, "rows", shape["hidden"]])
    model, inits = finish(g, [], True)
    from onnx import numpy_helper

    for name, arr in inits.items():
        model.graph.initializer.append(arr if isinstance(arr, onnx.TensorProto) else numpy_helper.from_array(arr, name))
    store.close()
    onnx.save_model(model, str(out / "model.onnx"))
    return out / "model.onnx"


def quantize(src: Path, precision: str, out: Path) -> Path:
    """The fp32 model at `src` with every constant-weight MatMul as MatMulNBits and every MoE as QMoE (blocks of 32,
    symmetric, accuracy level 4: the engine build's settings); new weights in weights_<precision>.bin beside it."""
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    from dflash_export.export.builder import MS, WeightStore
    from dflash_export.export.moe import quantize_moe_experts

    bits = 4 if precision == "int4" else 8
    model = onnx.load(str(src), load_external_data=False)
    store = WeightStore(out / f"weights_{precision}.bin")
    quantize_moe_experts(model, bits, BLOCK, ACCURACY_LEVEL, base_dir=str(src.parent), store=store)
    inits = {t.name: t for t in model.graph.initializer}
    for node in list(model.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits or len(inits[node.input[1]].dims) != 2:
            continue
        w = numpy_helper.to_array(inits[node.input[1]], str(src.parent))   # [K, N]
        k, n = w.shape
        kb = k // BLOCK
        packed = np.zeros((n, kb, BLOCK * bits // 8), np.uint8)
        scales = np.zeros(n * kb, np.float32)
        (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(
            packed, np.ascontiguousarray(w), scales, np.zeros(n * kb, np.uint8), BLOCK, n, k, True)
        b = node.input[1]
        model.graph.initializer.extend([store.put(b + "_q", packed), store.put(b + "_scales", scales)])
        model.graph.initializer.remove(inits.pop(b))
        idx = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        model.graph.node.insert(idx, helper.make_node("MatMulNBits", [node.input[0], b + "_q", b + "_scales"],
                                                      list(node.output), domain=MS, K=k, N=n, bits=bits,
                                                      block_size=BLOCK, accuracy_level=ACCURACY_LEVEL))
    store.close()
    path = out / f"model_{precision}.onnx"
    onnx.save_model(model, str(path))
    return path


def model_path(cache: Path, shape: str, form: str, layers: int, precision: str) -> Path:
    d = cache / f"{shape}-L{layers}-{form}"
    fp32 = d / "model.onnx"
    if not fp32.is_file():
        print(f"building {d.name} (fp32)", file=sys.stderr, flush=True)
        build_fp32(shape, form, layers, d)
    if precision == "fp32":
        return fp32
    q = d / f"model_{precision}.onnx"
    if not q.is_file():
        print(f"quantizing {d.name} to {precision}", file=sys.stderr, flush=True)
        quantize(fp32, precision, d)
    return q


def session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def bandwidth_probe(threads: int, mib: int = 1024):
    """A session computing a one-row MatMul over a constant `mib` MiB fp32 weight (prepacked by ONNX Runtime as every
    model weight here is), its feed and the weight's bytes: timed within every round, it gives the rate a
    weight-bound step can reach on this machine under the load of that moment."""
    import tempfile

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    k, n = 8192, mib * 32
    w = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "bw",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(w, "w")])
    nbytes = w.nbytes
    del w
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bw.onnx"
        onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                        save_as_external_data=True, location="bw.bin")
        del g
        s = session(path, threads)
    return s, {"a": np.ones((1, k), np.float32)}, nbytes


def active_bytes(shape: dict, layers: int, precision: str) -> float:
    """Weight bytes one token's step reads: attention projections and k experts at `precision`, router fp32."""
    h, w, k, e = shape["hidden"], shape["width"], shape["top_k"], shape["experts"]
    q_out, kv_out = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    per_layer = ((q_out + 2 * kv_out) * h + q_out * h + k * 3 * h * w) * BYTES_PER_WEIGHT[precision] + e * h * 4
    return per_layer * layers


def expert_union(shape_name: str, trials: int = 50) -> dict[int, float]:
    """Mean number of distinct experts the rows of a block choose (layer 0's router on random normalized rows)."""
    shape = SHAPES[shape_name]
    router = router_weight(shape, 0)
    rng = np.random.default_rng(9)
    out = {}
    for n in ROWS[1:] + (4,):
        sizes = []
        for _ in range(trials):
            x = rng.standard_normal((n, shape["hidden"]), dtype=np.float32)
            x /= np.sqrt((x * x).mean(-1, keepdims=True))
            top = np.argsort(-(x @ router.T), axis=-1)[:, : shape["top_k"]]
            sizes.append(len(np.unique(top)))
        out[n] = float(np.mean(sizes))
    return dict(sorted(out.items()))


def time_sessions(sessions: dict, hidden: int, rounds: int, reps: int, probe) -> tuple[dict, float]:
    """Median seconds per call, per session and row count, sessions interleaved within every round; and the median
    read bandwidth (bytes / s) the probe (`bandwidth_probe`) measured in the same rounds."""
    rng = np.random.default_rng(11)
    inputs = {}
    for rows in ROWS:
        x = rng.standard_normal((1, rows, hidden), dtype=np.float32)
        if rows == 2:
            x[:, 1] = x[:, 0]   # a plain step at the row floor: the row and its copy
        inputs[rows] = x
    for s in sessions.values():          # warm-up
        for x in inputs.values():
            s.run(None, {"x": x})
    samples = {name: {rows: [] for rows in ROWS} for name in sessions}
    probe_sess, probe_feed, probe_bytes = probe
    probe_sess.run(None, probe_feed)
    rates = []
    for _ in range(rounds):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            probe_sess.run(None, probe_feed)
            best = min(best, time.perf_counter() - t0)
        rates.append(probe_bytes / best)
        for name, s in sessions.items():
            for rows, x in inputs.items():
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    s.run(None, {"x": x})
                    best = min(best, time.perf_counter() - t0)
                samples[name][rows].append(best)
    return ({name: {rows: statistics.median(v) for rows, v in per.items()} for name, per in samples.items()},
            statistics.median(rates))


def main(argv=None) -> int:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="calls per round and row count (the fastest is kept)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the engine's, all cores)")
    ap.add_argument("--no-dense-experts", dest="dense_experts", action="store_false",
                    help="leave out the dense-experts form (fp32; as large as the sparse model)")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the bandwidth probe's weight")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dflash-export" / "moe_costs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    at_least(args, 1, "--layers", "--rounds", "--reps", "--bandwidth-mib")
    at_least(args, 0, "--threads")

    from dflash_export.engines.numerics import cpu_features, isa_label
    from dflash_export.engines.onnxruntime import default_threads

    threads = args.threads or default_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    shape = SHAPES[args.shape]
    cpu = cpu_features()
    probe = bandwidth_probe(threads, args.bandwidth_mib)
    report = {"shape": args.shape, **shape, "layers": args.layers, "threads": threads, "cpu": cpu,
              "expert_union": expert_union(args.shape), "precisions": {}}
    print(f"{args.shape} x {args.layers} layers; {cpu['model']} ({isa_label(cpu['isa'])}), {threads} threads")
    print("distinct experts per layer for a block of n rows (random routing): "
          + ", ".join(f"n={n}: {u:.1f}" for n, u in report["expert_union"].items()))
    for precision in args.precisions.split(","):
        forms = ["sparse", "active"] + (["dense"] if args.dense_experts and precision == "fp32" else [])
        sessions = {form: session(model_path(args.cache, args.shape, form, args.layers, precision), threads)
                    for form in forms}
        t, bandwidth = time_sessions(sessions, shape["hidden"], args.rounds, args.reps, probe)
        del sessions
        bound = active_bytes(shape, args.layers, precision) / bandwidth
        sp, act = t["sparse"], t["active"]
        row = {"ms": {f: {r: v * 1e3 for r, v in per.items()} for f, per in t.items()}, "bound_ms": bound * 1e3,
               "read_bandwidth_gbs": bandwidth / 1e9,
               "sparse_speed_vs_active": act[2] / sp[2], "step_vs_bound": sp[2] / bound,
               "verify8_over_step": sp[8] / sp[2], "verify16_over_step": sp[16] / sp[2],
               # the runtime's rule: verifying n drafts (n + 1 rows) costs 1 + n * verify_token_cost plain steps
               "verify_token_cost": (sp[16] / sp[2] - 1) / 15,
               "active_verify_token_cost": (act[16] / act[2] - 1) / 15}
        if "dense" in t:
            row["sparse_speed_vs_dense_experts"] = t["dense"][2] / sp[2]
        report["precisions"][precision] = row
        print(f"\n{precision}: ms per call (1 / 2 / 8 / 16 rows); read bandwidth {bandwidth / 1e9:.1f} GB/s, "
              f"active-bytes bound {bound * 1e3:.1f} ms")
        for form, per in t.items():
            print(f"  {form:7s} " + " / ".join(f"{per[r] * 1e3:8.1f}" for r in ROWS))
        print(f"  plain step (2 rows): sparse {sp[2] * 1e3:.1f} ms = {row['step_vs_bound']:.2f}x the bound; "
              f"dense-active / sparse = {row['sparse_speed_vs_active']:.2f}"
              + (f"; dense-experts / sparse = {row['sparse_speed_vs_dense_experts']:.1f}" if "dense" in t else ""))
        print(f"  verify(8) = {row['verify8_over_step']:.2f} steps, verify(16) = {row['verify16_over_step']:.2f} "
              f"steps; verify_token_cost {row['verify_token_cost']:.3f} (dense-active "
              f"{row['active_verify_token_cost']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
