"""How often the context's lookup branches are right, by the length of the n-gram match that found them.

A draft tree scores every lookup node by one running survival rate per depth (decoding/tree.LookupStats), whatever
the match that found it: an 8-token match and a 2-token match get the same chance. This replays the target's own
greedy answers to held-out prompts: at every answer position the context index (prompt_lookup.ContextIndex, the
tree's n-gram sizes) gives its branches, each credited to the longest n that found it, and each branch's tokens are
checked against the answer's next tokens. Printed per n and pooled: how many branches, P(depth 1 right) and
P(depth d right | depth d-1 right) -- what a per-match-length calibration of those chances would use.

    python benchmarks/lookup_calibration.py --prompts 16 --max-new-tokens 256

The answers are the PyTorch fp32 target's greedy continuations (batched, left-padded: equal to unbatched decoding up
to near-ties), not an engine's; the rates are a property of the text, not of the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def answers(recipe_name: str, num_prompts: int, max_new: int, batch: int) -> list[tuple[list[int], list[int]]]:
    from dflash_export.models.target import load_target
    from dflash_export.recipes import load_recipe
    from dflash_export.train.data import chat_prompt_ids, cut_at_stop, left_padded
    from dflash_export.validate.suites import load_suite

    target = load_target(load_recipe(recipe_name).target)
    _, prompts = load_suite("sharegpt-heldout", num_prompts)
    ids = [chat_prompt_ids(target.tokenizer, p.text) if p.text is not None else
           list(target.tokenizer.apply_chat_template(p.messages, add_generation_prompt=True)) for p in prompts]
    stop = set(target.stop_token_ids)
    pad = next(iter(target.stop_token_ids), 0)
    out = []
    with torch.inference_mode():
        for b0 in range(0, len(ids), batch):
            rows = ids[b0:b0 + batch]
            x, attn = left_padded(rows, pad)
            gen = target.hf.generate(input_ids=x, attention_mask=attn, max_new_tokens=max_new, do_sample=False,
                                     eos_token_id=sorted(stop) or None, pad_token_id=pad, temperature=None,
                                     top_p=None, top_k=None)
            out += [(p, cut_at_stop(gen[r, x.shape[1]:].tolist(), stop)) for r, p in enumerate(rows)]
    return out


def replay(pairs, max_depth: int) -> dict:
    """{n: [branches, right at depth 1, right at depth 2, ...]}, each branch credited to the longest n that found it
    (ContextIndex.branches, as the runtimes call it)."""
    from dflash_export.decoding.prompt_lookup import TREE_NGRAM_SIZES, ContextIndex

    counts = {n: [0] * (max_depth + 1) for n in TREE_NGRAM_SIZES}
    for prompt, answer in pairs:
        index = ContextIndex(prompt + answer[:1])
        for t in range(1, len(answer)):
            if t + max_depth > len(answer):  # too little answer left to judge a whole branch
                break
            for n, branch in index.branches(max_depth, with_sizes=True):
                row = counts[n]
                row[0] += 1
                for d, tok in enumerate(branch):
                    if tok != answer[t + d]:
                        break
                    row[d + 1] += 1
            index.extend([answer[t]])
    return counts


def table(counts: dict, max_depth: int) -> list[dict]:
    rows = []
    pooled = [sum(c[i] for c in counts.values()) for i in range(max_depth + 1)]
    for n, c in [*counts.items(), ("all", pooled)]:
        if not c[0]:
            continue
        cond = [c[1] / c[0]] + [c[d] / c[d - 1] if c[d - 1] else float("nan") for d in range(2, max_depth + 1)]
        rows.append({"n": n, "branches": c[0], "p_depth": [round(x, 3) for x in cond]})
    return rows


def main(argv=None) -> int:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    at_least(args, 1, "--prompts", "--max-new-tokens", "--batch", "--depth")
    pairs = answers(args.recipe, args.prompts, args.max_new_tokens, args.batch)
    rows = table(replay(pairs, args.depth), args.depth)
    print(f"{len(pairs)} held-out answers, {sum(len(a) for _, a in pairs)} tokens")
    print("| match n | branches | " + " | ".join(f"P(d{d}{'|d' + str(d - 1) if d > 1 else ''})"
                                                for d in range(1, args.depth + 1)) + " |")
    print("|---|---:|" + "---:|" * args.depth)
    for r in rows:
        print(f"| {r['n']} | {r['branches']} | " + " | ".join(f"{x:.2f}" for x in r["p_depth"]) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
