"""One-shot GPU check of the kernels and of the block-vs-token latency claims DFlash rests on.

Needs only torch (+ triton for the kernels): no transformers, no onnxruntime, no TensorRT, no package install, so it
runs from a plain copy of the repository (`PYTHONPATH=. python3 -m dflash_export.validate.gpu_check`). Sections:

  kernels            Triton vs torch reference, natively: attention max |diff| (fp32, bf16), FusedVerify tokens
  drafter_latency    one DFlash drafter pass over a 16-token block vs 16 sequential single-token drafter steps,
                     Qwen3-8B-DFlash shapes (5 layers, hidden 4096, 32/8 heads, head_dim 128), random bf16 weights
  target_verify      target forward of 16 tokens vs 1 token over a KV cache, Qwen3-8B layer shapes, random bf16
                     weights, a few layers only (the ratio is per layer; absolute times scale with 36/layers)
  attention_vs_sdpa  the KVInjectedBlockAttention kernel vs torch SDPA on the concatenated K/V
  lossless_greedy, lossless_sampling, jit_views, plugin_layers
                     correctness through the kernels (gpu_lossless.py): DFlash == AR over 128 tokens on a tiny and a
                     mid-size random target (fp32, bf16); FusedVerify's sampled output against closed-form conditionals
                     (fp32 / fp16 / bf16) and a planted fault it must catch; the TensorRT JIT impl's bf16-safe tensor
                     views; the TensorRT plugin layers where TensorRT is installed (skipped, and said so, otherwise)

Each section records its own error instead of aborting the run; plugin_layers (TensorRT in this process) runs in a
child process, so a crash or a CUDA fault there is recorded as that section's error and leaves the later sections
their own CUDA context. `--cpu` runs every code path at tiny shapes on the CPU (for CI); the kernels then go through
the Triton interpreter when TRITON_INTERPRET=1, else the torch reference. Without a CUDA device (and no `--cpu`)
every section says it did not run and the exit code is 2.
Writes gpu_check.json under $OUT (or --out) before each section (`in_progress` names it) and after it, and prints a
summary. SIGTERM (the script's time limit) records the running section as cut short and the rest as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dflash_export.kernels import fused_verify, kv_injected_block_attention, triton_available
from dflash_export.kernels.reference import fused_verify_ref, kv_injected_block_attention_ref
from dflash_export.kernels.synthetic import Qwen3Layers, Shapes, _rope_tables, drafter_step, target_step
from dflash_export.validate import gpu_lossless

TINY = Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=96, drafter_layers=2,
              target_layers=2, block=4, context=8, sdpa_contexts=(8, 24), dtype="float32", iters=2, warmup=1)
# The random pairs of the losslessness section: a tiny one, and a mid-size one (~0.2B parameters with the embedding)
LOSSLESS_PAIRS = {"tiny": Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                                 target_layers=2, block=4),
                  "mid": Shapes(hidden=1024, heads=16, kv_heads=8, head_dim=64, intermediate=3072, vocab=32000,
                                target_layers=8, block=16)}
LOSSLESS_PAIRS_CPU = {"tiny": LOSSLESS_PAIRS["tiny"],
                      "mid": Shapes(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512,
                                    target_layers=2, block=8)}
# The kernels, then the real TensorRT builder on one one-op engine per plugin and dtype and on the tiny pair's
# engines against their ONNX Runtime twin (what the CPU lane, tests/trt_lane.py, cannot run: it has no runtime
# library), then losslessness, then the latency claims. Each section's result is written as it finishes, so a run
# cut short still leaves the builder's verdict.
ALL_SECTIONS = ("kernels", "plugin_layers", "tiny_engine", "lossless_greedy", "lossless_sampling", "jit_views",
                "drafter_latency", "target_verify", "attention_vs_sdpa")
TINY_ENGINE_TEST = ("tests/test_tensorrt_engine.py::"
                    "test_on_gpu_tensorrt_engine_is_lossless_and_follows_its_onnx_runtime_twin")
# Sections run in a child process: TensorRT and its Python plugins in this process could crash it or leave a sticky
# CUDA error behind, which would lose every later section.
ISOLATED = ("plugin_layers",)
# What `build --backend tensorrt` of tiny-qwen3 and its GPU test import besides torch
TINY_ENGINE_NEEDS = ("tensorrt", "triton", "onnx", "onnxruntime", "transformers", "safetensors", "yaml", "pytest")
REPO = Path(__file__).resolve().parents[2]


class TimeLimit(BaseException):
    """SIGTERM while a section runs: the script's time limit (`timeout` in scripts/gpu_check.sh)."""


def _raise_time_limit(signum, frame):
    raise TimeLimit()


def tiny_engine(cpu: bool, timeout_s: int = 300) -> dict:
    """`build --backend tensorrt` of tiny-qwen3 and its tokens against the ONNX Runtime twin (the repository's GPU
    test, run by pytest in a subprocess): where every module of TINY_ENGINE_NEEDS is importable, on a GPU. Reports
    ran / ok and the test's last lines."""
    import importlib.util

    if cpu:
        return {"ran": False, "reason": "needs a GPU", "ok": True}
    for mod in TINY_ENGINE_NEEDS:
        if importlib.util.find_spec(mod) is None:
            return {"ran": False, "reason": f"{mod} is not installed", "ok": True}
    if not (REPO / TINY_ENGINE_TEST.split("::")[0]).is_file():
        return {"ran": False, "reason": "the tests are not in this checkout", "ok": True}
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", TINY_ENGINE_TEST],
                             cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ran": True, "ok": False, "error": f"the tiny engine test ran over {timeout_s} s"}
    out = {"ran": True, "ok": res.returncode == 0 and "1 passed" in res.stdout, "returncode": res.returncode,
           "output_tail": (res.stdout + res.stderr)[-3000:]}
    if out["ok"]:  # the test asserts manifest.plugins: requested == every op's implementation == aot
        out["path"] = "aot"
    elif "1 skipped" in res.stdout:
        out["error"] = "the tiny engine test skipped itself (see output_tail for its reason)"
    else:
        out["error"] = "the tiny engine test failed (see output_tail)"
    return out


def _child_env() -> dict[str, str]:
    """The environment of a child process: this one's, with the repository first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def in_child(name: str, cpu: bool, timeout_s: int = 300) -> dict:
    """Run one section in a child process (this module with `--sections name`) and return its result: what the
    child wrote to its gpu_check.json, or an error saying how the child ended when it left no result (a signal, an
    exit code, the time limit) with the end of its output."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_child_") as tmp:
        cmd = [sys.executable, "-m", "dflash_export.validate.gpu_check", "--sections", name, "--out", tmp,
               "--in-process"]
        try:
            res = subprocess.run(cmd + (["--cpu"] if cpu else []), cwd=REPO, env=_child_env(), capture_output=True,
                                 text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"the section's process ran over {timeout_s} s", "isolated": True}
        path = Path(tmp) / "gpu_check.json"
        try:
            child = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            child = {}
    result = child.get(name)
    if isinstance(result, dict) and child.get("in_progress") != name:
        result.pop("seconds", None)
        return {**result, "isolated": True}
    rc = res.returncode
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() else f"exit code {rc}"
    return {"error": f"the section's process ended ({how}) before the section finished", "isolated": True,
            "output_tail": (res.stdout + res.stderr)[-3000:]}


# ----------------------------------------------------------------------------------------------------------------------
# Timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int, repeat: int = 1,
            cuda_graph: bool = False) -> dict:
    """Median wall time (ms) of `repeat` back-to-back calls of fn, after warm-up, clock read after a device sync.

    cuda_graph: capture one call in a CUDA graph and replay it (removes Python / launch overhead, which otherwise
    dominates single-token steps and flatters the block).
    """
    run = fn
    if cuda_graph and device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    for _ in range(warmup):
        for _ in range(repeat):
            run()
    _sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(repeat):
            run()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "iters": iters,
            "cuda_graph": bool(cuda_graph and device.type == "cuda")}


# ----------------------------------------------------------------------------------------------------------------------
# Sections

def check_kernels(s: Shapes, device, backend: str) -> dict:
    """Triton (or the dispatcher's choice) vs the torch reference on the same device."""
    out: dict = {"backend": backend, "attention": [], "verify": []}
    g = torch.Generator(device="cpu").manual_seed(0)
    # bf16 tl.dot is not emulated faithfully by the CPU interpreter (garbage out): bf16 attention is a GPU-only row
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float32,
                                                                                          torch.float16)
    out["attention_dtypes_skipped"] = [] if device.type == "cuda" else ["bfloat16 (CPU interpreter)"]
    for dtype in dtypes:
        for ctx in sorted({0, s.context, 3 * s.context + 5}):
            shapes = [(2, s.heads, s.block, s.head_dim), (2, s.kv_heads, ctx, s.head_dim),
                      (2, s.kv_heads, ctx, s.head_dim), (2, s.kv_heads, s.block, s.head_dim),
                      (2, s.kv_heads, s.block, s.head_dim)]
            t = [torch.randn(*sh, generator=g).to(device=device, dtype=dtype) for sh in shapes]
            got = kv_injected_block_attention(*t, backend=backend)
            ref = kv_injected_block_attention_ref(*[x.float() for x in t])
            diff = (got.float() - ref).abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            out["attention"].append({"dtype": str(dtype).replace("torch.", ""), "context": ctx,
                                     "max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol})
    for temperature, logit_dtype, block in ((0.0, torch.float32, s.block), (1.0, torch.float32, s.block),
                                            (0.8, torch.float16, s.block), (0.8, torch.bfloat16, s.block),
                                            (0.0, torch.float32, 70), (0.8, torch.bfloat16, 70)):
        B = 4
        logits = (torch.randn(B, block, s.vocab, generator=g) * 4).to(device, logit_dtype)
        own = torch.softmax(logits[:, :-1].float() / max(temperature, 1.0), -1)
        draft_probs = 0.9 * own + 0.1 * torch.softmax(torch.randn(B, block - 1, s.vocab, generator=g).to(device), -1)
        if temperature == 0:
            drafts = logits[:, :-1].argmax(-1)
            drafts[1, block // 2] = (drafts[1, block // 2] + 1) % s.vocab
            drafts[2, 0] = (drafts[2, 0] + 1) % s.vocab
        else:
            drafts = torch.multinomial(draft_probs.reshape(-1, s.vocab).cpu(), 1, generator=g).reshape(
                B, block - 1).to(device)
        uniforms = torch.rand(B, block, generator=g).to(device)
        got = fused_verify(logits, drafts, draft_probs, uniforms, temperature, backend=backend)
        ref = fused_verify_ref(logits, drafts, draft_probs, uniforms, temperature)
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref))
        out["verify"].append({"temperature": temperature, "logits_dtype": str(logit_dtype).replace("torch.", ""),
                              "vocab": s.vocab, "block": block, "batch": B, "tokens_identical": same,
                              "accept_len": got[0].tolist()})
    out["ok"] = all(a["ok"] for a in out["attention"]) and all(v["tokens_identical"] for v in out["verify"])
    return out


def _sdpa_attention(q, k_ctx, v_ctx, k_blk, v_blk):
    return F.scaled_dot_product_attention(q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2),
                                          enable_gqa=True)


def drafter_latency(s: Shapes, device, backend: str) -> dict:
    dtype = getattr(torch, s.dtype)
    model = Qwen3Layers(s, s.drafter_layers, device, dtype, seed=1)
    g = torch.Generator(device="cpu").manual_seed(2)
    ctx_kv = [(torch.randn(1, s.kv_heads, s.context, s.head_dim, generator=g).to(device, dtype),
               torch.randn(1, s.kv_heads, s.context, s.head_dim, generator=g).to(device, dtype))
              for _ in model.layers]
    block = torch.randn(1, s.block, s.hidden, generator=g).to(device, dtype)
    one = block[:, :1].contiguous()
    cos_b, sin_b = _rope_tables(torch.arange(s.context, s.context + s.block, device=device), s.head_dim, dtype)
    cos_1, sin_1 = cos_b[:, :, :1].contiguous(), sin_b[:, :, :1].contiguous()

    def kernel_attention(*a):
        return kv_injected_block_attention(*a, backend=backend)

    result = {"shapes": {"layers": s.drafter_layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
                         "head_dim": s.head_dim, "block": s.block, "context": s.context, "dtype": s.dtype},
              "note": "random weights; includes the LM head (15 rows for the block, 1 per single-token step); "
                      "context K/V precomputed (same cost for both)"}
    for name, attention in (("kernel", kernel_attention), ("sdpa", _sdpa_attention)):
        for graph in ((False, True) if device.type == "cuda" else (False,)):
            key = f"{name}{'_cuda_graph' if graph else '_eager'}"
            try:
                blk = time_ms(lambda: drafter_step(model, block, ctx_kv, cos_b, sin_b, attention), device,
                              s.iters, s.warmup, cuda_graph=graph)
                seq = time_ms(lambda: drafter_step(model, one, ctx_kv, cos_1, sin_1, attention), device,
                              s.iters, s.warmup, repeat=s.block, cuda_graph=graph)
                result[key] = {"block_forward_ms": blk["median_ms"], f"{s.block}_single_steps_ms": seq["median_ms"],
                               "speedup_block_vs_sequential": seq["median_ms"] / blk["median_ms"]}
            except Exception as e:  # one variant failing (e.g. graph capture) must not lose the others
                result[key] = {"error": f"{type(e).__name__}: {e}"}
    return result


def target_verify_latency(s: Shapes, device) -> dict:
    dtype = getattr(torch, s.dtype)
    model = Qwen3Layers(s, s.target_layers, device, dtype, seed=3)
    g = torch.Generator(device="cpu").manual_seed(4)
    total = s.context + s.block
    caches = [(torch.randn(1, s.kv_heads, total, s.head_dim, generator=g).to(device, dtype),
               torch.randn(1, s.kv_heads, total, s.head_dim, generator=g).to(device, dtype)) for _ in model.layers]
    xs = torch.randn(1, s.block, s.hidden, generator=g).to(device, dtype)
    pos = torch.arange(s.context, total, device=device)
    cos_b, sin_b = _rope_tables(pos, s.head_dim, dtype)
    # block tokens see the whole cache and the block causally
    mask = torch.ones(s.block, total, dtype=torch.bool, device=device).tril(diagonal=s.context)
    one = xs[:, :1].contiguous()
    cos_1, sin_1 = cos_b[:, :, :1].contiguous(), sin_b[:, :, :1].contiguous()
    result = {"shapes": {"layers_run": s.target_layers, "layers_qwen3_8b": 36, "hidden": s.hidden, "heads": s.heads,
                         "kv_heads": s.kv_heads, "head_dim": s.head_dim, "intermediate": s.intermediate,
                         "vocab": s.vocab, "context": s.context, "dtype": s.dtype},
              "note": f"random weights, {s.target_layers} of 36 layers + LM head on every position; SDPA attention "
                      "over a static KV cache"}
    for graph in ((False, True) if device.type == "cuda" else (False,)):
        key = "cuda_graph" if graph else "eager"
        try:
            many = time_ms(lambda: target_step(model, xs, caches, s.context, cos_b, sin_b, mask), device, s.iters,
                           s.warmup, cuda_graph=graph)
            single = time_ms(lambda: target_step(model, one, caches, s.context, cos_1, sin_1, None), device, s.iters,
                             s.warmup, cuda_graph=graph)
            result[key] = {f"verify_{s.block}_tokens_ms": many["median_ms"], "decode_1_token_ms": single["median_ms"],
                           "ratio": many["median_ms"] / single["median_ms"]}
        except Exception as e:
            result[key] = {"error": f"{type(e).__name__}: {e}"}
    return result


def attention_vs_sdpa(s: Shapes, device, backend: str) -> dict:
    dtype = getattr(torch, s.dtype)
    g = torch.Generator(device="cpu").manual_seed(5)
    rows = []
    for ctx in s.sdpa_contexts:
        t = [torch.randn(1, s.heads, s.block, s.head_dim, generator=g),
             torch.randn(1, s.kv_heads, ctx, s.head_dim, generator=g),
             torch.randn(1, s.kv_heads, ctx, s.head_dim, generator=g),
             torch.randn(1, s.kv_heads, s.block, s.head_dim, generator=g),
             torch.randn(1, s.kv_heads, s.block, s.head_dim, generator=g)]
        t = [x.to(device, dtype) for x in t]
        kern = time_ms(lambda: kv_injected_block_attention(*t, backend=backend), device, s.iters * 5, s.warmup)
        sdpa = time_ms(lambda: _sdpa_attention(*t), device, s.iters * 5, s.warmup)
        diff = (kv_injected_block_attention(*t, backend=backend).float() - _sdpa_attention(*t).float()).abs().max()
        rows.append({"context": ctx, "kernel_us": kern["median_ms"] * 1e3, "sdpa_concat_us": sdpa["median_ms"] * 1e3,
                     "kernel_speedup": sdpa["median_ms"] / kern["median_ms"], "max_abs_diff_vs_sdpa": diff.item()})
    return {"backend": backend, "batch": 1, "block": s.block, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "dtype": s.dtype, "rows": rows}


# ----------------------------------------------------------------------------------------------------------------------

def environment(device: torch.device | None) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "device": str(device), "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device is not None and device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    env["cuda_driver"] = cuda_driver_version()
    return env


def cuda_driver_version() -> str | None:
    """The CUDA version the installed driver supports ("13.0"), or None without a driver. TensorRT's AOT plugins
    hand the driver Triton's PTX, whose ISA version follows Triton's ptxas, not the driver."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _in_tmp(fn):
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        return fn(tmp)


NO_GPU = "no CUDA device visible (use --cpu for the CI code-path check)"


def run(cpu: bool, sections: list[str], on_section: Callable[[dict], None] | None = None,
        isolate: tuple[str, ...] = ISOLATED) -> dict:
    """Run `sections` in order; `on_section(report)` after each and before each (with `in_progress` naming it).
    A TimeLimit (SIGTERM, see main) records the running section as cut short and the rest under `not_run`.
    Sections named in `isolate` run in a child process (`in_child`)."""
    if not cpu and not torch.cuda.is_available():
        reason = "no CUDA device visible"
        return {"error": NO_GPU, "mode": "gpu", "environment": environment(None),
                **{name: {"ran": False, "reason": reason} for name in sections}}
    device = torch.device("cpu" if cpu else "cuda")
    shapes = TINY if cpu else Shapes()
    if cpu:
        backend = "triton" if triton_available() and os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    else:
        backend = "triton" if triton_available() else "torch"
    report = {"mode": "cpu-dry-run" if cpu else "gpu", "environment": environment(device), "shapes": asdict(shapes),
              "kernel_backend": backend}
    pairs = LOSSLESS_PAIRS_CPU if cpu else LOSSLESS_PAIRS
    jobs = {"kernels": lambda: check_kernels(shapes, device, backend),
            # the CPU dry run checks the code path at small sizes (the interpreter runs every program in Python)
            "lossless_greedy": lambda: gpu_lossless.lossless_greedy(pairs, device, backend,
                                                                    new_tokens=24 if cpu else 128),
            "lossless_sampling": lambda: gpu_lossless.lossless_sampling(device, backend, 120 if cpu else 20000),
            "jit_views": lambda: gpu_lossless.jit_views(device),
            "plugin_layers": lambda: _in_tmp(gpu_lossless.plugin_layers),
            "tiny_engine": lambda: tiny_engine(cpu),
            "drafter_latency": lambda: drafter_latency(shapes, device, backend),
            "target_verify": lambda: target_verify_latency(shapes, device),
            "attention_vs_sdpa": lambda: attention_vs_sdpa(shapes, device, backend)}
    for name in isolate:
        if name in jobs:
            jobs[name] = lambda name=name: in_child(name, cpu)

    def record() -> None:
        if on_section is not None:  # a run cut short by its time limit still leaves the finished sections
            on_section(report)

    name, start = None, time.perf_counter()
    try:
        for name in sections:
            report["in_progress"] = name
            record()
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    report[name] = jobs[name]()
            except Exception as e:
                report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            report[name]["seconds"] = round(time.perf_counter() - start, 2)
            del report["in_progress"]
            print(f"[gpu_check] {name}: {report[name]['seconds']} s", file=sys.stderr, flush=True)
            record()
    except TimeLimit:
        report.pop("in_progress", None)
        done = name is not None and name in report
        running = None if done else name
        if running is not None:
            report[running] = {"error": f"cut short by the time limit after {time.perf_counter() - start:.1f} s",
                               "seconds": round(time.perf_counter() - start, 2)}
        later = sections[sections.index(name) + 1:] if name is not None else list(sections)
        report["cut_short"] = {"section": running, "not_run": later}
        record()
    return report


def _summary(report: dict) -> str:
    lines = [f"mode={report.get('mode')} backend={report.get('kernel_backend')} "
             f"{report.get('environment', {}).get('gpu', '')}"]
    k = report.get("kernels", {})
    if "attention" in k:
        lines.append("kernels: attention max diff " + ", ".join(
            f"{a['dtype']}/T={a['context']}: {a['max_abs_diff']:.2e}" for a in k["attention"])
            + "; verify tokens identical " + ", ".join(str(v["tokens_identical"]) for v in k["verify"]))
    for row in report.get("lossless_greedy", {}).get("rows", []):
        lines.append(f"lossless greedy {row['pair']}/{row['dtype']}: identical={row['identical']} over "
                     f"{row['tokens']} tokens (first divergence {row['first_divergence']}), accept lengths "
                     f"{row['accept_lengths_seen']}")
    ls = report.get("lossless_sampling", {})
    for row in ls.get("rows", []):
        lines.append(f"lossless sampling {row['dtype']}: chi2 {row['chi2']:.1f} on {row['df']} df, p = "
                     f"{row['p_value']:.3g} ({row['tested_tokens']} tokens)")
    if "planted_fault" in ls:
        lines.append(f"planted wrong-slot fault: p = {ls['planted_fault']['p_value']:.3g} (must be < 1e-3)")
    if "cut_short" in report:
        cut = report["cut_short"]
        lines.append(f"cut short by the time limit: running {cut['section']}, not run {', '.join(cut['not_run'])}")
    for name in ("jit_views", "plugin_layers", "tiny_engine"):
        if name in report:
            lines.append(f"{name}: ok={report[name].get('ok')} {report[name].get('reason', '')}")
    for case in report.get("plugin_layers", {}).get("cases", []):
        # which path each one-op engine was built with: asked for, and what TensorRT used per op
        lines.append(f"  {case.get('case')}: asked {case.get('requested')}, built {case.get('implementation')}, "
                     f"ok={case.get('ok')}" + (f" ({case['error']})" if "error" in case else ""))
    if report.get("tiny_engine", {}).get("ok") and report["tiny_engine"].get("ran"):
        lines.append(f"  tiny_engine built with the {report['tiny_engine']['path']} path (manifest.plugins)")
    for name in ("drafter_latency", "target_verify"):
        for key, val in report.get(name, {}).items():
            if isinstance(val, dict) and ("ratio" in val or "speedup_block_vs_sequential" in val or "error" in val):
                lines.append(f"{name}.{key}: " + ", ".join(
                    f"{a}={b:.3f}" if isinstance(b, float) else f"{a}={b}" for a, b in val.items()))
    for row in report.get("attention_vs_sdpa", {}).get("rows", []):
        lines.append(f"attention T={row['context']}: kernel {row['kernel_us']:.1f} us, sdpa {row['sdpa_concat_us']:.1f}"
                     f" us, speedup {row['kernel_speedup']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                        help="tiny shapes on the CPU: checks the code paths, measures nothing meaningful")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.json (default $OUT)")
    parser.add_argument("--sections", default=",".join(ALL_SECTIONS))
    parser.add_argument("--in-process", action="store_true",
                        help=f"run every section in this process (by default {', '.join(ISOLATED)} runs in a child)")
    args = parser.parse_args(argv)
    sections = [x for x in args.sections.split(",") if x]
    known = set(ALL_SECTIONS)
    if set(sections) - known:
        parser.error(f"unknown sections {sorted(set(sections) - known)} (known: {', '.join(sorted(known))})")

    def write(report: dict) -> None:
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / ".gpu_check.json.tmp"
            tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
            tmp.replace(out / "gpu_check.json")

    previous = signal.signal(signal.SIGTERM, _raise_time_limit)
    try:
        try:
            report = run(args.cpu, sections, on_section=write, isolate=() if args.in_process else ISOLATED)
        except TimeLimit:  # before the first section started
            report = {"error": "cut short by the time limit before the first section ran"}
        write(report)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(_summary(report) if "error" not in report else report["error"])
    if "error" in report:
        return 2
    if "cut_short" in report:
        return 124
    failed = [n for n in sections if "error" in report.get(n, {})]
    checks_ok = all(report.get(n, {}).get("ok", True) for n in ("kernels", "lossless_greedy", "lossless_sampling",
                                                                    "jit_views", "plugin_layers"))
    return 1 if failed or not checks_ok else 0


if __name__ == "__main__":
    sys.exit(main())
