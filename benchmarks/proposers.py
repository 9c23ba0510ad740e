"""What each way of proposing drafts buys on one engine: τ, tok/s and the ratio against plain decoding on the same
engine, with every mode run on the same prompt before the next prompt, the mode that goes first rotating from one
prompt to the next (interleaved: the machine's load drifts and a mode run first is colder, the ratios stay fair), each
checked token for token against plain decoding, next to the prompt-lookup yardstick.

    python benchmarks/proposers.py --engine engines/smollm2-135m/onnxruntime --prompts 50 --max-new-tokens 256

    python benchmarks/proposers.py --engine ENGINE --temperature 0.7 --top-k 20 --top-p 0.95   # sampled

Modes: ar (plain decoding), chain (the drafter's block), lookup (the context's n-gram continuations), tree (a tree
from the drafter's per-slot top-K), tree+lookup (both; its best path verified as a chain), tree+lookup-full (every
node verified in one pass), tree+lookup-unfitted (tree+lookup steered by the engine's recorded or the runtime's
fallback costs, not by the costs it fits on this machine), chain-sampled (T > 0: the drafter's sampled chain, min(1,
p/q)); lookup+static and tree+lookup+static merge the engine's static n-gram index of the target's own past answers
(the other modes leave it out), and every mode prints its accepted drafts per source (drafter / context / static;
alone in brackets).
Sampled, every mode draws prompt i with seed i; a walked mode's output equals plain sampling's ("identical"). Prompts:
validate/sharegpt-heldout.jsonl rows --skip.. (never trained on; rows 0-19 chose the shipped drafter's checkpoint).
Not a test: minutes to hours on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OFF = {"static_ngrams": False}
MODES = {"ar": None, "chain": {"proposer": "chain", **OFF}, "lookup": {"proposer": "lookup", **OFF},
         "tree": {"proposer": "tree", **OFF}, "tree+lookup": {"proposer": "tree+lookup", "tree_mode": "spine", **OFF},
         "tree+lookup-full": {"proposer": "tree+lookup", "tree_mode": "full", **OFF},
         # T > 0: the default walk over the tree's best path only (the breadth a draw off that path could use lost)
         "tree+lookup-sampled-spine": {"proposer": "tree+lookup", "tree_mode": "spine", "sampled_tree_mode": "spine",
                                       **OFF},
         # the default with the runtime's fallback costs fixed instead of fitted on this machine (runtime/costs.py)
         "tree+lookup-unfitted": {"proposer": "tree+lookup", "tree_mode": "spine", "fit_costs": False, **OFF},
         # T > 0: the drafter's own sampled chain with min(1, p/q) (the reference's stream) instead of the walk
         "chain-sampled": {"proposer": "chain", "sampling": "chain", **OFF},
         "lookup+static": {"proposer": "lookup", "static_ngrams": True},
         "tree+lookup+static": {"proposer": "tree+lookup", "tree_mode": "spine", "static_ngrams": True}}


def main() -> None:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--modes", default=",".join(m for m in MODES if "static" not in m))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="sample (prompt i seeded with i in every mode)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--grid", action="store_true",
                    help="instead of --modes: the curve of whole-tree verification without the cost model, drafter "
                         "top-K 1, 2, 4 x node budget 4, 8, 15 (tree+lookup, every node verified; 15 nodes + the root "
                         "are the rows the numerics probe checks)")
    args = ap.parse_args()
    at_least(args, 1, "--prompts", "--max-new-tokens")
    at_least(args, 0, "--skip", "--threads")
    for k in (1, 2, 4):  # the grid's modes, also by name in --modes (e.g. K4-N4)
        for n in (4, 8, 15):
            MODES[f"K{k}-N{n}"] = {"proposer": "tree+lookup", "tree_mode": "full", "adaptive": False,
                                    "tree_top_k": k, "tree_nodes": n, **OFF}
    if args.grid:
        args.modes = ",".join(m for m in MODES if m.startswith("K"))
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime
    from dflash_export.validate.suites import load_suite

    modes = [m.strip() for m in args.modes.split(",")]
    if "ar" not in modes:
        modes.insert(0, "ar")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown} (known: {', '.join(MODES)})")
    engine = load_engine(args.engine, threads=args.threads)
    runtimes = {m: DFlashRuntime(engine, **(MODES[m] or {})) for m in modes}
    _, rows = load_suite("sharegpt-heldout", args.prompts, skip=args.skip)
    sums = {m: {"s": 0.0, "tokens": 0, "steps": 0, "committed": 0, "verified": 0, "identical": 0, "by": {}, "only": {}}
            for m in modes}
    pairs = []
    t0 = time.time()
    for i, row in enumerate(rows):
        ids = runtimes["ar"].encode(row.text)
        outs = {}
        for m in modes[i % len(modes):] + modes[:i % len(modes)]:  # no mode always first: the first runs colder
            sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=i)
            st = runtimes[m].generate(ids, sp, "ar" if m == "ar" else "dflash")
            outs[m] = st.tokens
            s = sums[m]
            s["s"] += st.total_s
            s["tokens"] += len(st.tokens)
            s["steps"] += len(st.acceptance_lengths)
            s["committed"] += sum(st.acceptance_lengths)
            s["verified"] += st.drafted_tokens
            for key, counts in (("by", st.accepted_by), ("only", st.accepted_only)):
                for name, n in counts.items():
                    s[key][name] = s[key].get(name, 0) + n
        for m in modes:
            sums[m]["identical"] += outs[m] == outs["ar"]
        pairs.append((ids, outs["ar"]))
        print(f"\r{i + 1}/{len(rows)} prompts, {time.time() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        if args.json_out:  # the prompts done so far: a run cut short on a loaded machine still leaves its figures
            summarize(args, engine, modes, sums, pairs, rows[:i + 1], quiet=True)
    print(file=sys.stderr)
    summarize(args, engine, modes, sums, pairs, rows)


def summarize(args, engine, modes, sums, pairs, rows, quiet: bool = False) -> None:
    """Print (unless `quiet`) and write (--json) every mode's figures over `rows`, the prompts done."""
    from dflash_export.decoding.prompt_lookup import prompt_lookup_tau
    from dflash_export.engines.numerics import cpu_features, isa_label

    cpu = cpu_features()
    how = "greedy" if args.temperature <= 0 else f"T {args.temperature:g} top-k {args.top_k} top-p {args.top_p:g}"
    yard = prompt_lookup_tau(pairs, engine.info.block_size)
    say = (lambda *a, **k: None) if quiet else print
    say(f"{args.engine}: {len(rows)} prompts (sharegpt-heldout rows {args.skip}-{args.skip + len(rows) - 1}) x "
        f"{args.max_new_tokens} new tokens, {how}; {cpu['model']}, {isa_label(cpu['isa'])}, threads "
        f"{args.threads or 'all'}; prompt-lookup tau on the plain output (block {engine.info.block_size}): "
        f"{yard:.3f}")
    ar_rate = sums["ar"]["tokens"] / sums["ar"]["s"]
    report = {"engine": args.engine, "prompts": len(rows), "max_new_tokens": args.max_new_tokens, "cpu": cpu,
              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "tau_prompt_lookup": yard, "modes": {}}
    say(f"{'mode':18s} {'tau':>6s} {'tok/s':>7s} {'vs AR':>6s} {'verified/step':>14s} {'identical':>10s}")
    for m in modes:
        s = sums[m]
        rate = s["tokens"] / s["s"]
        tau = s["committed"] / max(1, s["steps"])
        report["modes"][m] = {"tau": tau, "tok_s": rate, "vs_ar": rate / ar_rate,
                              "verified_per_step": s["verified"] / max(1, s["steps"]),
                              "identical": f"{s['identical']}/{len(rows)}", "accepted_by": s["by"],
                              "accepted_only": s["only"]}
        by = ", ".join(f"{k} {v} ({s['only'].get(k, 0)})" for k, v in s["by"].items()) if m != "ar" else ""
        say(f"{m:18s} {tau:6.3f} {rate:7.1f} {rate / ar_rate:5.2f}x {s['verified'] / max(1, s['steps']):14.2f} "
            f"{s['identical']:>6d}/{len(rows)}  {by}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
