"""Continuous batching with whole draft trees against the trees' best paths and plain batched decoding, same engine,
same run, greedy:

    python benchmarks/batch_trees.py --engine engines/smollm2-135m/onnxruntime --concurrency 1,8 --prompts 8 \
        --max-new-tokens 64 --reps 2

Modes: `plain` (every request plain decoding, batched), `spine` (the engine's proposer, each sequence verifying its
tree's best path: tree_mode spine) and `trees` (each sequence's whole tree in the batched target call: tree_mode
full). At each level N, N requests are in flight until every prompt ran once (closed loop, as `bench --concurrency`);
the modes run interleaved `reps` times and the fastest pass of each counts, the DFlash / plain ratios are also given
pass by pass (adjacent in time). Every output is compared with plain decoding's. Prompts: validate/
sharegpt-heldout.jsonl rows --skip.. (never trained on), encoded with the engine's chat template.
"""

from __future__ import annotations

import argparse
import time

from dflash_export.engines.base import SamplingParams
from dflash_export.runtime.batching import BatchingRuntime
from dflash_export.validate.suites import load_suite

MODES = {"plain": ("ar", {}), "spine": ("dflash", {"tree_mode": "spine"}), "trees": ("dflash", {"tree_mode": "full"})}


def run(engine, prompts, max_new: int, n: int, mode: str) -> dict:
    how, kwargs = MODES[mode]
    rt = BatchingRuntime(engine, max_batch=n, **kwargs)
    pending, running, done = list(enumerate(prompts)), {}, {}
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < n:
            i, p = pending.pop(0)
            running[i] = rt.submit(p, SamplingParams(max_new_tokens=max_new), how)
        rt.step()
        for i in [i for i, r in running.items() if r.done]:
            done[i] = running.pop(i)
    wall = time.perf_counter() - t0
    reqs = [done[i] for i in range(len(prompts))]
    steps = sum(len(r.stats.acceptance_lengths) for r in reqs)
    return {"tok_s": sum(len(r.stats.tokens) for r in reqs) / wall,
            "tau": sum(sum(r.stats.acceptance_lengths) for r in reqs) / max(1, steps),
            "target_rows": rt.target_rows, "steps": rt.steps, "trees": getattr(rt, "trees_verified", 0),
            "outputs": [r.stats.tokens for r in reqs]}


def main() -> None:
    from dflash_export.bench.script_args import at_least, counts

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="engines/smollm2-135m/onnxruntime")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    at_least(args, 1, "--prompts", "--max-new-tokens", "--reps")
    at_least(args, 0, "--skip", "--threads")
    levels = counts(args.concurrency, "--concurrency")
    from dflash_export.engines.numerics import cpu_features, isa_label
    from dflash_export.engines.registry import load_engine

    engine = load_engine(args.engine, threads=args.threads)
    _, rows = load_suite("sharegpt-heldout", args.prompts, skip=args.skip)
    prompts = [engine.codec.encode_prompt(r.text, True) for r in rows]
    run(engine, prompts[:2], 8, 2, "trees")  # warm-up: first calls allocate and initialize both target graphs
    cpu = cpu_features()
    print(f"{args.engine}: {len(prompts)} prompts (sharegpt-heldout rows {args.skip}-{args.skip + len(prompts) - 1})"
          f" x {args.max_new_tokens} new tokens, greedy; {cpu['model']}, {isa_label(cpu['isa'])}")
    print("concurrency | mode | tok/s (best pass) | x plain | x plain pass by pass | tau | target rows | "
          "tree steps | same as plain")
    for n in levels:
        runs = {m: [] for m in MODES}
        for _ in range(args.reps):
            for m in MODES:
                runs[m].append(run(engine, prompts, args.max_new_tokens, n, m))
        plain = max(runs["plain"], key=lambda r: r["tok_s"])
        for m in MODES:
            best = max(runs[m], key=lambda r: r["tok_s"])
            pairs = [r["tok_s"] / p["tok_s"] for r, p in zip(runs[m], runs["plain"])]
            same = sum(a == b for a, b in zip(best["outputs"], plain["outputs"]))
            print(f"{n} | {m} | {best['tok_s']:.1f} | {best['tok_s'] / plain['tok_s']:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in pairs)} | {best['tau']:.2f} | {best['target_rows']} | "
                  f"{best['trees']} | {same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
