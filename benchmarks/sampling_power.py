"""Power of `validate`'s T>0 distribution check against the planted sampling faults (dflash_export/validate/faults.py),
and its false-alarm rate on the correct sampler: the measurement behind the default sample size.

    python benchmarks/sampling_power.py                          # defaults: validate --full's, 20 seeds
    python benchmarks/sampling_power.py --samples 100,200,400 --seeds 10 --faults residual_from_p
    python benchmarks/sampling_power.py --proposer tree+lookup --temperature 1.0 --top-k 20 --top-p 0.95 \
        --faults none,top_p_off_by_one,temperature_twice,walk_one_uniform,walk_parent_row,walk_argmax_child

Sampled steps walk the proposal (`--sampling walk`, the default): the chain faults (residual_from_p,
bonus_from_wrong_row, draft_probs_wrong_slot) then run the drafter's chain, where they live.

The pair is the one tests/test_validate.py trains (the tiny Qwen3 target + a drafter fitted to its greedy outputs,
cached on disk; a random drafter is almost never accepted, which would hide the faults that act on accepted blocks),
with the target's LM head scaled by 5 as the tests do (the random target is near-uniform otherwise; see SHARPEN there).
Each (fault, sample size, seed) runs the distribution check once with `dist_seed=seed`; prints, per row, the fraction
of seeds with p < alpha and the median p-value, then one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from dflash_export.bench.script_args import at_least, counts, refuse
    from dflash_export.validate.faults import FAULTS
    from dflash_export.validate.runner import ValidateOptions

    d = ValidateOptions()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", default=str(d.dist_samples), help="comma list of seeds per prompt")
    parser.add_argument("--seeds", type=int, default=20, help="independent repetitions per row")
    parser.add_argument("--faults", default="none," + ",".join(FAULTS))
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--top-p", type=float, default=d.top_p)
    parser.add_argument("--top-k", type=int, default=d.top_k)
    parser.add_argument("--proposer", default="chain",
                        help="what a step proposes (chain, tree, lookup, tree+lookup); sampled steps walk it")
    parser.add_argument("--sampling", default="walk", help="walk (the default) or chain (the drafter's chain)")
    parser.add_argument("--prompts", type=int, default=d.dist_prompts)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--sharpen", type=float, default=None,
                        help="scale of the target's LM head [default: tests/test_validate.py SHARPEN, 5]")
    args = parser.parse_args()
    at_least(args, 1, "--seeds", "--prompts")
    counts(args.samples, "--samples")
    unknown = [f for f in args.faults.split(",") if f not in ("none", *FAULTS)]
    if unknown:
        refuse("--faults", f"unknown {unknown[0]!r} (known: none, {', '.join(FAULTS)})")

    import torch

    torch.set_num_threads(1)
    import test_validate

    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.tiny import TINY
    from dflash_export.runtime.single import DFlashRuntime
    from dflash_export.validate.faults import faulty_engine
    from dflash_export.validate.runner import Reference, _distribution_check, _Progress

    drafter_dir = _drafter_dir(test_validate)
    scale = args.sharpen or test_validate.SHARPEN  # why the pair is sharpened: test_validate.py, above SHARPEN
    target = test_validate.sharpened_target(scale)
    drafter = load_drafter(drafter_dir)
    reference = Reference(test_validate.sharpened_target(scale), load_drafter(drafter_dir))
    spec = TINY["qwen3"]
    suite = test_validate._suite_ids(spec.vocab_size, spec.mask_token_id)
    prompts = [(f"p{i}", ids) for i, ids in enumerate(sorted(suite, key=len)[: args.prompts])]
    print(f"{'fault':24s} {'samples':>7s} {'detected':>9s} {'median p':>10s} {'s/run':>6s}")
    rows = []
    for fault in args.faults.split(","):
        engine = faulty_engine(None if fault == "none" else fault, target, drafter, "tiny-trained", 256)
        runtime = DFlashRuntime(engine, proposer=args.proposer, sampling=args.sampling)
        for n in [int(x) for x in args.samples.split(",")]:
            ps, secs = [], []
            for seed in range(args.seeds):
                opts = ValidateOptions(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, dist_samples=n,
                                       dist_prompts=args.prompts, dist_seed=seed)
                t0 = time.perf_counter()
                out = _distribution_check(runtime, reference, prompts, opts, engine.info.block_size,
                                          _Progress(False, 0))
                secs.append(time.perf_counter() - t0)
                ps.append(out["p_value"])
            det = sum(p < args.alpha for p in ps) / len(ps)
            row = {"fault": fault, "samples": n, "seeds": args.seeds, "alpha": args.alpha, "detected": det,
                   "median_p": statistics.median(ps), "max_p": max(ps), "min_p": min(ps),
                   "seconds_per_run": statistics.median(secs), "temperature": args.temperature, "top_p": args.top_p,
                   "top_k": args.top_k, "proposer": args.proposer, "sampling": args.sampling}
            rows.append(row)
            print(f"{fault:24s} {n:7d} {det:9.2f} {row['median_p']:10.2e} {row['seconds_per_run']:6.1f}", flush=True)
    for row in rows:
        print(json.dumps(row))


def _drafter_dir(test_validate) -> Path:
    """The trained drafter test_validate caches (trained here on first use, a few seconds)."""
    import hashlib

    from dflash_export.files import cache_dir

    suite = (ROOT / "validate" / "tiny-random.jsonl").read_bytes()
    key = hashlib.sha256(suite + f"v{test_validate._TRAIN_VERSION}".encode()).hexdigest()[:10]
    out = cache_dir() / "tests" / f"validate-trained-drafter-{key}"
    if not (out / "config.json").is_file():
        test_validate._train_drafter(out)
    return out


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
