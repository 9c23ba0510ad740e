"""The correctness sections of the one-shot GPU check (`gpu_check.py`): losslessness through the kernels, every dtype,
and the TensorRT plugin layers where TensorRT exists. Torch (+ triton) only, like gpu_check; TensorRT and onnx are
used when importable and the section says so when they are not.

  lossless_greedy    random-weight Qwen3-style targets (a tiny one and a mid-size one) in fp32 and bf16: DFlash
                     (block verify through the target + the FusedVerify kernel + cache rewind) against plain one-token
                     decoding of the same model at the same precision, >= 128 tokens. Drafts are the AR continuation
                     with one slot corrupted at random, so every accept length 0..bs-1 occurs.
  lossless_sampling  FusedVerify at T > 0 on a Markov-chain target and drafter over a 6-token vocabulary, 20k
                     sequences in one launch: every emitted token, grouped by position and previous token, against the
                     closed-form target conditional (Pearson chi-square), fp32 / fp16 / bf16 logits; the same with
                     draft probabilities from the wrong slot must fail (the check's power, on the real kernel).
  plugin_layers      where TensorRT (+ onnx) is installed: build one-op engines of both dflash plugins (fp32 and fp16
                     inputs), each alone on the AOT path first (TensorRT launching the Triton PTX), then each on the
                     JIT path (the Python impl); record the path asked for and the one TensorRT used, check the
                     plugin layers with the engine inspector, and run them against the torch reference.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from dflash_export.kernels import fused_verify, fused_verify_ref, kv_injected_block_attention_ref
from dflash_export.kernels.synthetic import Qwen3Layers, _rope_tables, target_step

# ----------------------------------------------------------------------------------------------------------------------
# Greedy losslessness through a random-weight target


def _target_logits(model, embed: torch.Tensor, ids: torch.Tensor, caches: list, past: int, target_step) -> torch.Tensor:
    t = ids.shape[1]
    x = embed[ids]
    cos, sin = _rope_tables(torch.arange(past, past + t, device=ids.device), model.s.head_dim, x.dtype)
    mask = None
    if t > 1:  # causal over the block, full view of the cache
        mask = torch.ones(t, past + t, dtype=torch.bool, device=ids.device).tril(diagonal=past)
    return target_step(model, x, caches, past, cos, sin, mask)[0].float()


def greedy_lossless(shapes, device, dtype, new_tokens: int = 128, prompt_len: int = 12, seed: int = 0,
                    backend: str = "auto") -> dict:
    """DFlash greedy output vs AR greedy output of the same random-weight target; see the module docstring."""

    model = Qwen3Layers(shapes, shapes.target_layers, device, dtype, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    embed = (torch.randn(shapes.vocab, shapes.hidden, generator=g) * 0.5).to(device, dtype)
    prompt = torch.randint(0, shapes.vocab, (1, prompt_len), generator=g).to(device)
    bs = shapes.block
    cap = prompt_len + new_tokens + bs + 1

    def new_caches():
        return [(torch.zeros(1, shapes.kv_heads, cap, shapes.head_dim, device=device, dtype=dtype),
                 torch.zeros(1, shapes.kv_heads, cap, shapes.head_dim, device=device, dtype=dtype))
                for _ in model.layers]

    # AR: prefill, then one token per forward
    caches = new_caches()
    logits = _target_logits(model, embed, prompt, caches, 0, target_step)[-1]
    ar, margins = [int(logits.argmax())], [_margin(logits)]
    past = prompt_len
    while len(ar) < new_tokens:
        logits = _target_logits(model, embed, torch.tensor([[ar[-1]]], device=device), caches, past, target_step)[-1]
        ar.append(int(logits.argmax()))
        margins.append(_margin(logits))
        past += 1

    # DFlash: block verify of [anchor, drafts], FusedVerify (greedy), commit anchor + accepted, rewind the rest
    caches = new_caches()
    logits = _target_logits(model, embed, prompt, caches, 0, target_step)[-1]
    out = [int(logits.argmax())]
    past, accepts, steps = prompt_len, [], 0
    while len(out) < new_tokens:
        done = len(out)
        drafts = [ar[min(done + j, len(ar) - 1)] for j in range(bs - 1)]
        k = int(torch.randint(0, bs, (1,), generator=g))  # corrupt slot k (k == bs - 1: none)
        if k < bs - 1:
            drafts[k] = (drafts[k] + 1 + int(torch.randint(0, shapes.vocab - 1, (1,), generator=g))) % shapes.vocab
        block = torch.tensor([[out[-1]] + drafts], device=device)
        block_logits = _target_logits(model, embed, block, caches, past, target_step)
        accept, emitted, n_emitted = fused_verify(block_logits[None], block[:, 1:], temperature=0.0, backend=backend)
        accept, n = int(accept[0]), int(n_emitted[0])
        out += emitted[0, :n].tolist()
        accepts.append(accept)
        past += accept + 1  # the anchor and the accepted drafts are cached; stale rows are overwritten next step
        steps += 1
    out = out[:new_tokens]
    first = next((i for i, (a, b) in enumerate(zip(out, ar)) if a != b), None)
    return {"dtype": str(dtype).replace("torch.", ""), "tokens": new_tokens, "identical": first is None,
            "first_divergence": first, "ar_margin_at_divergence": None if first is None else margins[first],
            "min_ar_margin": min(margins), "steps": steps, "accept_lengths_seen": sorted(set(accepts)),
            "mean_accept": sum(accepts) / max(1, len(accepts))}


def _margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def lossless_greedy(pairs: dict, device, backend: str, new_tokens: int = 128) -> dict:
    """fp32 must be identical; a bf16 divergence is accepted only at a near-tie of the AR logits (the two kernel
    shapes of verify and decode round differently; README "GPU status")."""
    rows = []
    for name, shapes in pairs.items():
        for dtype in (torch.float32, torch.bfloat16):
            row = {"pair": name, **greedy_lossless(shapes, device, dtype, new_tokens, backend=backend)}
            tie = row["ar_margin_at_divergence"] is not None and row["ar_margin_at_divergence"] < 0.125
            row["ok"] = row["identical"] or (dtype == torch.bfloat16 and tie)
            rows.append(row)
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


# ----------------------------------------------------------------------------------------------------------------------
# Sampled losslessness of FusedVerify on a Markov chain (closed-form conditionals)

def _chi2_sf(stat: float, df: int) -> float:
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _pearson(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson X2 of counts [k] vs n * probs [k], cells below min_expected pooled (least likely first)."""
    n = float(counts.sum())
    if n == 0:
        return 0.0, 0
    order = torch.argsort(probs, descending=True)
    obs, exp, po, pe = [], [], 0.0, 0.0
    for i in order.tolist():
        e, o = n * float(probs[i]), float(counts[i])
        if e <= 0:
            continue
        if e >= min_expected:
            obs.append(o)
            exp.append(e)
        else:
            po, pe = po + o, pe + e
            if pe >= min_expected:
                obs.append(po)
                exp.append(pe)
                po = pe = 0.0
    if pe > 0:
        if exp:
            obs[-1], exp[-1] = obs[-1] + po, exp[-1] + pe
        else:
            obs.append(po)
            exp.append(pe)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(obs) - 1


def markov_sampling(device, dtype, n_seq: int, backend: str, temperature: float = 0.8, vocab: int = 6, bs: int = 5,
                    seed: int = 0, wrong_slot: bool = False) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(vocab, vocab, generator=g) * 1.5                    # target logits given the previous token
    w_used = w.to(dtype).float()                                         # what the kernel reads
    q = torch.softmax((w + torch.randn(vocab, vocab, generator=g) * 0.8) / temperature, -1)  # drafter, near target
    p = torch.softmax(w_used / temperature, -1)
    anchor = 0
    block = torch.empty(n_seq, bs, dtype=torch.long)
    block[:, 0] = anchor
    for j in range(1, bs):  # drafts d_j ~ q(. | d_{j-1}), independent across sequences
        block[:, j] = torch.multinomial(q[block[:, j - 1]], 1, generator=g)[:, 0]
    logits = w[block].to(dtype)                                          # [N, bs, V]
    draft_probs = q[block[:, :-1]]                                       # [N, bs-1, V]: q of slot j+1 given slot j
    if wrong_slot:
        draft_probs = torch.roll(draft_probs, 1, dims=1)
    uniforms = torch.rand(n_seq, bs, generator=g)
    accept, emitted, n_emitted = fused_verify(logits.to(device), block[:, 1:].to(device), draft_probs.to(device),
                                              uniforms.to(device), temperature, backend=backend)
    emitted, n_emitted = emitted.cpu(), n_emitted.cpu()
    stat, df, tested = 0.0, 0, 0
    for j in range(bs):
        live = n_emitted > j
        prev = torch.full((n_seq,), anchor) if j == 0 else emitted[:, j - 1]
        for a in range(vocab):
            sel = live & (prev == a)
            if not bool(sel.any()):
                continue
            counts = torch.bincount(emitted[sel, j], minlength=vocab).double()
            s, d = _pearson(counts, p[a].double())
            stat, df, tested = stat + s, df + d, tested + int(sel.sum())
    return {"dtype": str(dtype).replace("torch.", ""), "sequences": n_seq, "tested_tokens": tested, "chi2": stat,
            "df": df, "p_value": _chi2_sf(stat, df), "mean_accept": float(accept.float().mean()),
            "wrong_slot_fault": wrong_slot}


def lossless_sampling(device, backend: str, n_seq: int) -> dict:
    rows = [markov_sampling(device, dt, n_seq, backend, seed=i)
            for i, dt in enumerate((torch.float32, torch.float16, torch.bfloat16))]
    fault = markov_sampling(device, torch.float32, n_seq, backend, seed=7, wrong_slot=True)
    ok = all(r["p_value"] >= 1e-3 for r in rows) and fault["p_value"] < 1e-3
    return {"rows": rows, "planted_fault": fault, "alpha": 1e-3, "ok": ok}


# ----------------------------------------------------------------------------------------------------------------------
# TensorRT plugin layers (only where TensorRT and onnx are installed)

def _attention_onnx(heads: int, kv_heads: int, head_dim: int, scale: float, elem):
    from onnx import helper

    from dflash_export.export import ops

    node = helper.make_node(ops.KV_ATTENTION, ["q", "k_ctx", "v_ctx", "k_blk", "v_blk"], ["out"], name="attention",
                            domain=ops.DOMAIN, num_heads=heads, num_kv_heads=kv_heads, scale=scale,
                            **ops.plugin_attrs())
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info("q", elem, ["B", heads, "S", head_dim]),
        *[helper.make_tensor_value_info(n, elem, ["B", kv_heads, "T", head_dim]) for n in ("k_ctx", "v_ctx")],
        *[helper.make_tensor_value_info(n, elem, ["B", kv_heads, "S", head_dim]) for n in ("k_blk", "v_blk")],
    ], [helper.make_tensor_value_info("out", elem, ["B", heads, "S", head_dim])])
    return ops.make_model(graph, [ops.kv_injected_block_attention_function()])


def _run_engine(trt, data: bytes, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run a one-profile engine on CUDA tensors (outputs allocated from the inferred shapes)."""
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        raise RuntimeError("TensorRT could not deserialize the engine it just built (see the log above)")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
              trt.int64: torch.int64, trt.int32: torch.int32}
    keep = {}
    for n in names:
        if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT:
            t = feeds[n].to("cuda", dtypes[engine.get_tensor_dtype(n)]).contiguous()
            keep[n] = t
            context.set_input_shape(n, tuple(t.shape))
            context.set_tensor_address(n, t.data_ptr())
    outs = {}
    for n in names:
        if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT:
            outs[n] = torch.empty(tuple(context.get_tensor_shape(n)), dtype=dtypes[engine.get_tensor_dtype(n)],
                                  device="cuda")
            context.set_tensor_address(n, outs[n].data_ptr())
    # the inputs were copied on the current stream; a side stream does not wait for it unless told to
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("execute_async_v3 failed")
    stream.synchronize()
    return outs


def plugin_layers(tmp_dir) -> dict:
    """See the module docstring. Engines are built with build_engine_file itself (so its inspector check and
    implementation record are what run here): every plugin alone on the AOT path first (the Triton PTX TensorRT
    launches itself), then every plugin alone on the JIT path (the Python impl), each against the torch
    reference. Each case records the path the build asked for and the one TensorRT used."""
    from pathlib import Path

    for mod in ("tensorrt", "onnx", "triton"):  # triton: both plugin paths run its kernels (AOT PTX, JIT launch)
        if importlib.util.find_spec(mod) is None:
            return {"ran": False, "reason": f"{mod} is not installed", "ok": True}
    import onnx
    from onnx import TensorProto

    from dflash_export.engines import tensorrt as trt_backend  # imports onnx: only here, the kernels run without it
    from dflash_export.export import ops

    trt = trt_backend.require_tensorrt()
    tmp = Path(tmp_dir)
    out: dict = {"ran": True, "tensorrt": trt.__version__, "aot_supported": None, "cases": []}
    import tensorrt.plugin as trtp

    out["aot_supported"] = trt_backend.aot_plugins_supported(trt, trtp)
    g = torch.Generator(device="cpu").manual_seed(3)

    def attention_case(path, elem, tdtype, dname):
        H, KVH, D, S, T = 8, 2, 64, 16, 40
        model = _attention_onnx(H, KVH, D, 0.125, elem)
        onnx_path, engine = tmp / f"attention_{dname}_{path}.onnx", tmp / f"attention_{dname}_{path}.engine"
        onnx.save(model, str(onnx_path))
        prof = trt_backend.Profile("p", {"B": (1, 1, 2), "S": (1, 16, 16), "T": (0, 40, 64)})
        facts = trt_backend.build_engine_file(onnx_path, engine, [prof], "float32", implementation=path)
        feeds = {"q": torch.randn(1, H, S, D, generator=g), "k_ctx": torch.randn(1, KVH, T, D, generator=g),
                 "v_ctx": torch.randn(1, KVH, T, D, generator=g), "k_blk": torch.randn(1, KVH, S, D, generator=g),
                 "v_blk": torch.randn(1, KVH, S, D, generator=g)}
        feeds = {k: v.to(tdtype) for k, v in feeds.items()}
        got = _run_engine(trt, engine.read_bytes(), feeds)["out"].float().cpu()
        ref = kv_injected_block_attention_ref(*[feeds[k].float() for k in ("q", "k_ctx", "v_ctx", "k_blk",
                                                                           "v_blk")], scale=0.125)
        diff = float((got - ref).abs().max())
        tol = 1e-3 if tdtype == torch.float32 else 2e-2
        return {"op": "KVInjectedBlockAttention", "dtype": dname, **_facts(facts), "max_abs_diff": diff,
                "ok": diff <= tol and _built_as_asked(facts, path)}

    def verify_case(path, temperature: float):
        model = ops.fused_verify_model(temperature, vocab_size=50)
        onnx_path, engine = tmp / f"verify_{temperature}_{path}.onnx", tmp / f"verify_{temperature}_{path}.engine"
        onnx.save(model, str(onnx_path))
        prof = trt_backend.Profile("p", {"B": (1, 2, 4), "bs": (1, 5, 70), "n": (0, 4, 69), "n_or_1": (1, 4, 69),
                                         "V_or_1": (1, 50, 50), "bs_or_1": (1, 5, 70)})
        facts = trt_backend.build_engine_file(onnx_path, engine, [prof], "float32", implementation=path)
        rows = []
        for BS in (5, 70):  # 70 rows: past any one emitted tile
            logits = torch.randn(2, BS, 50, generator=g) * 3
            drafts = logits[:, :-1].argmax(-1) if temperature == 0 else torch.randint(0, 50, (2, BS - 1), generator=g)
            probs = torch.softmax(torch.randn(2, BS - 1, 50, generator=g), -1)
            unif = torch.rand(2, BS, generator=g)
            got = _run_engine(trt, engine.read_bytes(), {"target_logits": logits, "draft_tokens": drafts,
                                                         "draft_probs": probs, "uniforms": unif})
            ref = fused_verify_ref(logits, drafts, probs, unif, temperature)
            same = all(torch.equal(got[k].cpu(), r) for k, r in zip(("accept_len", "emitted_tokens", "n_emitted"),
                                                                     ref))
            rows.append({"rows": BS, "identical": same})
        return {"op": "FusedVerify", "temperature": temperature, **_facts(facts), "runs": rows,
                "ok": all(r["identical"] for r in rows) and _built_as_asked(facts, path)}

    for path in (trt_backend.IMPL_AOT, trt_backend.IMPL_JIT):
        if path == trt_backend.IMPL_AOT and not out["aot_supported"]:
            out["cases"].append({"case": "aot", "ran": False, "reason": "this TensorRT builds no AOT Python plugins",
                                 "ok": False})
            continue
        cases: list[tuple[str, Callable]] = [
            ("attention_float32", lambda p=path: attention_case(p, TensorProto.FLOAT, torch.float32, "float32")),
            ("attention_float16", lambda p=path: attention_case(p, TensorProto.FLOAT16, torch.float16, "float16")),
            ("verify_greedy", lambda p=path: verify_case(p, 0.0)),
            ("verify_sampling", lambda p=path: verify_case(p, 0.8))]
        for name, fn in cases:
            try:
                out["cases"].append({"case": f"{path}/{name}", **fn()})
            except Exception as e:  # one case failing must not hide the others
                out["cases"].append({"case": f"{path}/{name}", "requested": path,
                                     "error": f"{type(e).__name__}: {e}", "ok": False})
    out["ok"] = all(c.get("ok") for c in out["cases"])
    return out


def _built_as_asked(facts: dict, path: str) -> bool:
    return facts.get("requested") == path and set((facts.get("implementation") or {}).values()) == {path}


def _facts(facts: dict) -> dict:
    return {"requested": facts.get("requested"), "implementation": facts.get("implementation"),
            "plugin_layers": facts.get("plugin_layers"), "graph_nodes": facts.get("plugins")}


def jit_views(device) -> dict:
    """The JIT plugin impl's tensor views (engines/tensorrt.cuda_tensor_view) over real CUDA buffers, every dtype
    the plugins take, contiguous and strided: equal to the tensors they view, with no copy."""
    if device.type != "cuda":
        return {"ran": False, "reason": "needs CUDA", "ok": True}
    from dflash_export.engines.tensorrt_plugins import cuda_tensor_view

    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32):
        base = (torch.randn(6, 10, device=device) * 100).to(dtype)
        for t in (base, base.t()):
            view = cuda_tensor_view(t.data_ptr(), t.shape, t.stride(), str(dtype).replace("torch.", ""))
            rows.append({"dtype": str(dtype).replace("torch.", ""), "contiguous": t.is_contiguous(),
                         "equal": bool(torch.equal(view, t)), "same_memory": view.data_ptr() == t.data_ptr()})
    return {"ran": True, "rows": rows, "ok": all(r["equal"] and r["same_memory"] for r in rows)}

