"""What a batch's target calls cost when its requests may run long: the continuous batching runtime over `--batch`
prompts of a suite, sampled, each request allowed `--max-new-tokens` (48) against allowed to fill the engine's
max_seq_len (what a chat request without max_tokens is allowed), for `--steps` steps. Every call's attention runs over
the K/V buffers' whole length, so they should hold the rows the sequences reached, whatever they may reach.

    python benchmarks/kv_rows.py [--engine engines/smollm2-135m/onnxruntime] [--batch 16] [--steps 40] [--reps 2]

Prints, per pass (the two allowances interleaved, plain decoding and DFlash), the median and mean target call after the
first two steps and the most rows the buffers held.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.registry import load_engine
from dflash_export.runtime.batching import BatchingRuntime


def one_pass(engine, prompts: list[list[int]], allowed: int, steps: int, mode: str) -> tuple[float, float, int]:
    """(median and mean target call in ms, the most rows the target buffers held) over `steps` steps of every
    prompt in one batch, each request allowed `allowed` new tokens."""
    rt = BatchingRuntime(engine, max_batch=len(prompts))
    batch, calls, rows = rt.batch, [], [0]
    batch.on_resize = lambda nbytes, slots, cap: rows.append(cap)
    step = batch.target_step

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = step(*args, **kwargs)
        calls.append(time.perf_counter() - t)
        return out

    batch.target_step = timed
    reqs = [rt.submit(p, SamplingParams(max_new_tokens=allowed, seed=i, temperature=0.7, top_p=0.95, top_k=20), mode)
            for i, p in enumerate(prompts)]
    for _ in range(steps):
        rt.step()
    held = max(rows)
    for r in reqs:
        rt.cancel(r)
    rt.step()
    return 1e3 * statistics.median(calls[2:]), 1e3 * statistics.fmean(calls[2:]), held


def main() -> None:
    from dflash_export.bench.script_args import at_least
    from dflash_export.validate.suites import encode_prompt, load_suite

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="engines/smollm2-135m/onnxruntime")
    ap.add_argument("--suite", default="sharegpt-heldout")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    at_least(args, 1, "--batch", "--max-new-tokens", "--reps")
    at_least(args, 3, "--steps")
    engine = load_engine(args.engine)
    path, rows = load_suite(args.suite, args.batch)
    prompts = [encode_prompt(r, engine.codec, True, engine.info.vocab_size, path) for r in rows]
    bs, top = engine.info.block_size, engine.info.max_seq_len
    fill = top - bs - max(len(p) for p in prompts)  # every request allowed up to max_seq_len
    print(f"{args.engine}: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.steps} steps, T 0.7 top-p 0.95 top-k 20; max_seq_len {top}")
    for mode in ("ar", "dflash"):  # warm-up
        one_pass(engine, prompts, args.max_new_tokens, 3, mode)
    for rep in range(args.reps):
        for mode in ("ar", "dflash"):
            for allowed in (args.max_new_tokens, fill):
                ms, mean, rows = one_pass(engine, prompts, allowed, args.steps, mode)
                print(f"pass {rep + 1} {mode:6s} allowed {allowed:5d} new tokens: {ms:7.1f} ms a target call "
                      f"(mean {mean:.1f}), buffers of {rows} rows at most", flush=True)


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
