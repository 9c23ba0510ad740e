"""What a sliding layer's GroupQueryAttention costs with each way of hiding keys outside its window, and whether they
agree bit for bit: the choice behind the target graph's `window_bias_W` input (export/graph.py `_gqa_attention`).

    python benchmarks/window_attention.py                 # gpt-oss-20b's shapes, window 128, 1 thread
    python benchmarks/window_attention.py --contexts 1024,4096 --rows 1,16

One GroupQueryAttention node (--heads query heads, --kv-heads K/V heads of --head-dim, per-head sinks) over a K/V
buffer holding --contexts committed keys, for 1 and 16 new rows, three ways: a row window of the window's size and a
zero bias (engines built before window_bias), no row window and a bias hiding keys by position, and a row window
widened by 15 rows with that bias (what the graph builds). Prints each variant's time per call (the best of 3
batches) and its largest difference from the first variant's output.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def gqa_session(heads: int, kv_heads: int, dim: int, capacity: int, window: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=dim ** -0.5, do_rotary=0)
    if window:
        attrs["local_window_size"] = window
    names = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", "", "", "", "bias", "sink"]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
                            **attrs)
    f, cache = TensorProto.FLOAT, [1, kv_heads, capacity, dim]
    inputs = [helper.make_tensor_value_info("q", f, [1, "s", heads * dim]),
              helper.make_tensor_value_info("k", f, [1, "s", kv_heads * dim]),
              helper.make_tensor_value_info("v", f, [1, "s", kv_heads * dim]),
              helper.make_tensor_value_info("past_k", f, cache), helper.make_tensor_value_info("past_v", f, cache),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, []),
              helper.make_tensor_value_info("bias", f, [1, 1, "s", "t"]),
              helper.make_tensor_value_info("sink", f, [heads])]
    outputs = [helper.make_tensor_value_info("out", f, [1, "s", heads * dim]),
               helper.make_tensor_value_info("present_k", f, cache),
               helper.make_tensor_value_info("present_v", f, cache)]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--contexts", default="1024,4096,16384,32752")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    contexts, row_counts = [int(x) for x in a.contexts.split(",")], [int(x) for x in a.rows.split(",")]
    capacity = max(contexts) + max(row_counts)
    rng = np.random.default_rng(0)
    past_k = rng.standard_normal((1, a.kv_heads, capacity, a.head_dim)).astype(np.float32)
    past_v = rng.standard_normal((1, a.kv_heads, capacity, a.head_dim)).astype(np.float32)
    sink = rng.standard_normal(a.heads).astype(np.float32)
    variants = {"row window, zero bias": (a.window, False), "no row window, position bias": (0, True),
                f"row window {a.window + 15}, position bias": (a.window + 15, True)}
    sessions = {name: (gqa_session(a.heads, a.kv_heads, a.head_dim, capacity, w, a.threads), by_position)
                for name, (w, by_position) in variants.items()}
    for rows in row_counts:
        q = rng.standard_normal((1, rows, a.heads * a.head_dim)).astype(np.float32)
        k = rng.standard_normal((1, rows, a.kv_heads * a.head_dim)).astype(np.float32)
        v = rng.standard_normal((1, rows, a.kv_heads * a.head_dim)).astype(np.float32)
        for length in contexts:
            total = length + rows
            near = np.arange(total)[None] > (length + np.arange(rows))[:, None] - a.window
            position_bias = np.where(near, 0.0, -np.inf).astype(np.float32)[None, None]
            times, outs = {}, {}
            for name, (sess, by_position) in sessions.items():
                io = sess.io_binding()
                feeds = {"q": q, "k": k, "v": v, "seqlens_k": np.array([total - 1], np.int32),
                         "total": np.array(total, np.int32), "sink": sink,
                         "bias": position_bias if by_position else np.zeros_like(position_bias)}
                for n, x in feeds.items():
                    io.bind_cpu_input(n, x)
                for n, buf in (("k", past_k), ("v", past_v)):  # in place, as the engines bind them
                    io.bind_cpu_input(f"past_{n}", buf)
                    io.bind_output(f"present_{n}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
                io.bind_output("out", "cpu")
                sess.run_with_iobinding(io)
                calls = max(3, int(2e8 // (total * a.heads * a.head_dim * rows * 4)))
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(calls):
                        sess.run_with_iobinding(io)
                    best = min(best, (time.perf_counter() - t) / calls)
                times[name], outs[name] = best * 1e3, io.get_outputs()[0].numpy().copy()
            first = outs[next(iter(outs))]
            print(f"rows {rows:2d} context {length:6d}: " + "; ".join(
                f"{n}: {t:.3f} ms (max diff {np.abs(outs[n] - first).max():.1e})" for n, t in times.items()),
                flush=True)


if __name__ == "__main__":
    main()
