"""Engines that share one target and differ in their drafter (its precision, its head), side by side: each engine's
default DFlash decoding against plain decoding on the same engine, every engine run on the same prompt before the next
prompt (interleaved: the machine's load drifts, the ratios stay fair), with τ, tokens/s, outputs identical to plain
decoding, and the median draft pass (drafter graph + draft head + host) against the median plain step, as
benchmarks/engine_costs.py times them.

    dflash-export build --recipe smollm2-135m --precision fp32 --drafter-precision int8
    python benchmarks/drafter_precision.py --engines engines/smollm2-135m/onnxruntime,\
engines/smollm2-135m/onnxruntime-fp32-drafter-int8 --prompts 16 --max-new-tokens 128

A cheaper draft pass lets the cost model draft more often; a coarser drafter proposes worse blocks. Which wins is
what this prints. Prompts: validate/sharegpt-heldout.jsonl rows --skip.. (never trained on). Not a test: minutes on
2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True, help="comma list of engine directories with the same target")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="sample (prompt i seeded with i everywhere)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    at_least(args, 1, "--prompts", "--max-new-tokens")
    at_least(args, 0, "--skip", "--threads")

    from engine_costs import measure

    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.numerics import cpu_features, isa_label
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime
    from dflash_export.validate.suites import load_suite

    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    engines = {n: load_engine(n, threads=args.threads) for n in names}
    # Plain and DFlash on separate runtimes: what one learns about costs and acceptance never steers the other.
    runtimes = {n: (DFlashRuntime(e), DFlashRuntime(e)) for n, e in engines.items()}
    _, rows = load_suite("sharegpt-heldout", args.prompts, skip=args.skip)
    sums = {n: {"plain_s": 0.0, "dflash_s": 0.0, "tokens": 0, "steps": 0, "identical": 0} for n in names}
    t0 = time.time()
    for i, row in enumerate(rows):
        ids = runtimes[names[0]][0].encode(row.text)
        for n in names:
            plain_rt, dflash_rt = runtimes[n]
            sp = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=i)
            plain = plain_rt.generate(ids, SamplingParams(**sp), "ar")
            dflash = dflash_rt.generate(ids, SamplingParams(**sp), "dflash")
            s = sums[n]
            s["plain_s"] += plain.total_s
            s["dflash_s"] += dflash.total_s
            s["tokens"] += len(dflash.tokens)
            s["steps"] += len(dflash.acceptance_lengths)
            s["identical"] += plain.tokens == dflash.tokens
        print(f"\r{i + 1}/{len(rows)} prompts, {time.time() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    cpu = cpu_features()
    how = "greedy" if args.temperature <= 0 else f"T {args.temperature:g} top-k {args.top_k} top-p {args.top_p:g}"
    print(f"{len(rows)} prompts (sharegpt-heldout rows {args.skip}-{args.skip + len(rows) - 1}) x "
          f"{args.max_new_tokens} new tokens, {how}; CPU {cpu['model']} ({isa_label(cpu['isa'])})")
    for n in names:
        s = sums[n]
        # The step costs as engine_costs.py times them by default (its own load of the engine, 128 tokens of held-out
        # text as context, wall time).
        costs = measure(Path(n), argparse.Namespace(threads=args.threads, context=128, reps=30, cpu_time=False,
                                                    random_ids=False))
        draft_ms, plain_ms = costs[f"draft_{engines[n].info.block_size}_ms"], costs["step_1_ms"]
        precision = json.loads((Path(n) / "manifest.json").read_text()).get("precision", {})
        print(f"{n}: DFlash / plain {s['plain_s'] / s['dflash_s']:.3f}x  tau {s['tokens'] / max(1, s['steps']):.2f}  "
              f"plain {s['tokens'] / s['plain_s']:.1f} tok/s  DFlash {s['tokens'] / s['dflash_s']:.1f} tok/s  "
              f"identical {s['identical']}/{len(rows)}  draft pass {draft_ms:.2f} ms = "
              f"{draft_ms / plain_ms:.3f} plain steps ({plain_ms:.2f} ms)  precision {precision}")


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
