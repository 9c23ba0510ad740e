"""What a many-row quantized step costs on this CPU, and whether its rows equal one-row products bit for bit, for each
MatMulNBits choice a quantized engine could make (bits, block size, accuracy level).

    python benchmarks/matmulnbits_rows.py                     # SmolLM2-135M's MLP shapes, 8 layers, 2 threads
    python benchmarks/matmulnbits_rows.py --reps 30 --configs 4:32:4,8:32:4

A stack of `--layers` MLP pairs (H -> I -> H, SmolLM2's 576 / 1536 by default) with random weights, quantized by ONNX
Runtime's own MatMulNBitsQuantizer (symmetric, as the engines) at each --configs BITS:BLOCK:ACCURACY_LEVEL, plus the
fp32 MatMul. For each: whether M = 2, 8, 16 rows give each row the bits of that row run alone (M = 1), whether rows
agree among M >= 2 (2 vs 8, 8 vs 16: what a row floor of 2 relies on), and the CPU time of M = 1, 2, 8, 16 rows
relative to M = 1 and to M = 2 (a plain step padded to a floor of 2). Process CPU time (spinning off), round-robin over
configurations and row counts, medians: a shared machine's load moves these ratios far less than wall times.
Accuracy level 4 = int8 activations with integer dot products, 1 = fp32 activations, 0 = the kernel's default.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np


def stack_model(hidden: int, inner: int, layers: int, seed: int = 0):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        for j, (k, n) in enumerate(((hidden, inner), (inner, hidden))):
            w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
            inits.append(numpy_helper.from_array(w, f"w{i}_{j}"))
            nodes.append(helper.make_node("MatMul", [x, f"w{i}_{j}"], [f"y{i}_{j}"]))
            x = f"y{i}_{j}"
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=onnx.IR_VERSION)


def session(model, threads: int, config: tuple[int, int, int] | None):
    import onnx
    import onnxruntime as ort

    if config is not None:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )

        bits, block, acc = config
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        q = MatMulNBitsQuantizer(copy, algo_config=DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=True, accuracy_level=acc, bits=bits))
        q.process()
        model = q.model.model
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def parse_configs(spec: str) -> list[tuple[int, int, int]]:
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            bits, block, acc = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not BITS:BLOCK:ACCURACY_LEVEL (e.g. 4:32:4)") from None
        if bits not in (4, 8) or block not in (16, 32, 64, 128, 256) or acc not in (0, 1, 2, 3, 4):
            raise SystemExit(f"--configs: {item!r}: bits 4 or 8, block 16..256 (a power of 2), accuracy level 0..4")
        out.append((bits, block, acc))
    return out


def attention_rows(threads: int, head_dim: int = 64, group: int = 3) -> list[tuple[str, int, bool]]:
    """Attention's second product, probabilities [M, T] x V [T, D] with both factors computed at run time (as
    GroupQueryAttention multiplies them: one GEMM per head, M = the call's rows, alpha 1): is a row computed alone
    (M = 1) equal to the same row among two? For a plain MatMul, for FusedMatMul taking the probabilities transposed
    (transA = 1), and for the rows of a query group stacked over a batch of kv heads (M = group x rows, as the
    batched graph's attention, export/graph.py). MLAS sends a GEMM with M = 1, A not transposed and alpha 1 to a
    dedicated one-row kernel (`KernelM1Routine`; AVX multiplies and adds, no FMA) and every other one to the general
    kernel, so the first disagrees at one row and the other two do not. -> (form, T, equal alone)."""
    from onnx import TensorProto, helper

    def sess(op: str, **attrs):
        node = helper.make_node(op, ["a", "b"], ["y"], domain="com.microsoft" if op == "FusedMatMul" else "",
                                **attrs)
        graph = helper.make_graph([node], "pv", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                 for n in ("a", "b")],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        return session(model, threads, None)

    plain, fused = sess("MatMul"), sess("FusedMatMul", transA=1)
    rng = np.random.default_rng(2)
    out = []
    for t in (50, 150, 300, 600):
        p = rng.random((2 * group, t), dtype=np.float32)
        p /= p.sum(1, keepdims=True)
        v = rng.standard_normal((t, head_dim)).astype(np.float32)

        def run(s, a):
            return s.run(None, {"a": np.ascontiguousarray(a), "b": v})[0]
        out.append(("MatMul", t, bool(np.array_equal(run(plain, p[:1]), run(plain, p[:2])[:1]))))
        out.append(("FusedMatMul transA", t, bool(np.array_equal(run(fused, p[:1].T), run(fused, p[:2].T)[:1]))))
        # [kv heads, group x rows, T] x [kv heads, T, D]: a batch of GEMMs, which MLAS never splits across threads
        # (a single GEMM it splits by its size, and the split moves the sums: rows alone and among more then differ
        # for some T even with M >= 2)
        pk = rng.random((group, 2 * group, t), dtype=np.float32)
        vk = rng.standard_normal((group, t, head_dim)).astype(np.float32)
        one = plain.run(None, {"a": np.ascontiguousarray(pk[:, :group]), "b": vk})[0]
        two = plain.run(None, {"a": pk, "b": vk})[0]
        out.append((f"MatMul, {group} query heads a row, {group} kv heads", t,
                    bool(np.array_equal(one, two[:, :group]))))
    return out


def main() -> int:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inner", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="4:32:4,4:64:4,4:128:4,4:32:1,4:32:0,8:32:4,8:32:1")
    args = ap.parse_args()
    at_least(args, 1, "--hidden", "--inner", "--layers", "--threads", "--reps")
    logging.disable(logging.INFO)  # the quantizer logs one record per node
    model = stack_model(args.hidden, args.inner, args.layers)
    configs = [None] + parse_configs(args.configs)
    sessions = {c: session(model, args.threads, c) for c in configs}
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, args.hidden)).astype(np.float32)
    rows = (1, 2, 8, 16)
    same = {}
    for c, s in sessions.items():
        def run(a, s=s):
            return s.run(None, {"x": np.ascontiguousarray(a)})[0]
        alone = np.stack([run(x[i:i + 1])[0] for i in range(16)])
        same[c] = {f"M={m} vs alone": bool(np.array_equal(run(x[:m]), alone[:m])) for m in (2, 8, 16)}
        same[c]["2 vs 8"] = bool(np.array_equal(run(x[:8])[:2], run(x[:2])))
        same[c]["8 vs 16"] = bool(np.array_equal(run(x[:16])[:8], run(x[:8])))
    times = {(c, m): [] for c in configs for m in rows}
    for r in range(args.reps + 2):
        for c, s in sessions.items():
            for m in rows:
                a = x[:m].copy()
                t0 = time.process_time()
                s.run(None, {"x": a})
                if r >= 2:
                    times[(c, m)].append(time.process_time() - t0)
    print(f"{args.layers} x ({args.hidden}->{args.inner}->{args.hidden}), {args.threads} threads, process CPU time, "
          f"medians of {args.reps}\n")
    print("| weights | block | accuracy level | M=1 CPU ms | M=2 / M=1 | M=8 / M=2 | M=16 / M=2 | rows equal alone "
          "(M=2, 8, 16) | rows equal among M>=2 |\n|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        med = {m: 1000 * statistics.median(times[(c, m)]) for m in rows}
        name, block, acc = ("fp32", "—", "—") if c is None else (f"int{c[0]}", c[1], c[2])
        eq = same[c]
        alone = "/".join("yes" if eq[f"M={m} vs alone"] else "no" for m in (2, 8, 16))
        among = "yes" if eq["2 vs 8"] and eq["8 vs 16"] else "no"
        print(f"| {name} | {block} | {acc} | {med[1]:.2f} | {med[2] / med[1]:.2f} | {med[8] / med[2]:.2f} | "
              f"{med[16] / med[2]:.2f} | {alone} | {among} |")
    print("\nattention's probabilities x V, both computed at run time: a row alone equal to it among two\n\n"
          "| product | T | row alone equal |\n|---|---|---|")
    for form, t, equal in attention_rows(args.threads):
        print(f"| {form} | {t} | {'yes' if equal else 'no'} |")
    return 0


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
