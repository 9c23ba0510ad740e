"""CLI for `bench` (thin: parse and call)."""

from __future__ import annotations

import click

from dflash_export.bench.suite import run_bench, run_concurrency_bench
from dflash_export.clitypes import (
    RequestField,
    engine_option,
    max_new_tokens_option,
    recipe_options,
    top_p_top_k_options,
)
from dflash_export.errors import DFlashError
from dflash_export.recipes import recipe_from_options


@click.command()
@recipe_options
@engine_option("A built engine directory [default: the recipe's onnxruntime engine at its precision, "
               "engines/<recipe>/onnxruntime[-int8|-int4], built if absent].")
@click.option("--suite", default=None, help="Prompt suite (default: the recipe's).")
@click.option("--num-prompts", default=20, show_default=True, type=click.IntRange(1))
@max_new_tokens_option
@click.option("--modes", default="dflash,dflash-full,ar,hf,reference", show_default=True,
              help="Comma list of: dflash (engine, its recipe's decoding), dflash-full (engine, chain, every draft "
                   "verified), chain / tree / lookup / tree+lookup / tree+lookup-full (engine, that proposer; -full: "
                   "whole trees verified), lookup+static / tree+lookup+static (those proposers with the engine's "
                   "static n-gram index of the target's past answers), ar (same engine), hf (transformers generate), "
                   "reference (PyTorch spec_generate).")
@click.option("--out", "out_json", default=None, help="Write every figure to this JSON file.")
@click.option("--concurrency", default=None,
              help="Comma list of concurrency levels (e.g. 1,4,8,16): continuous batching on the engine instead, "
                   "DFlash and plain decoding (modes dflash / ar of --modes; default both) at each level.")
@click.option("--reps", default=1, show_default=True, type=click.IntRange(1),
              help="Passes over the prompts, the modes interleaved (single stream: prompt by prompt, medians over "
                   "every pass; with --concurrency: per level, the fastest pass counts); the DFlash / plain ratio is "
                   "also printed pass by pass.")
@click.option("--temperature", default=0.0, show_default=True, type=RequestField("temperature"),
              help="Sample at this temperature (0: greedy); prompt i is seeded with i, the same in every mode.")
@top_p_top_k_options
def bench(recipe, target, drafter, engine_dir, suite, num_prompts, max_new_tokens, modes, out_json, concurrency,
          reps, temperature, top_p, top_k):
    """Benchmark DFlash vs AR on the engine, HF generate and the PyTorch reference (medians after warm-up)."""
    if out_json == "":
        raise DFlashError("empty path: name the JSON file to write", field="--out")
    recipe = recipe_from_options(recipe, target, drafter)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    mode_list = [m.strip() for m in modes.split(",")]
    if concurrency is not None:
        # Decimal ASCII digits only: "1,,2" (an empty item) is a typo, and int() alone would read "1_0" as 10
        items = [x.strip() for x in concurrency.split(",")]
        try:
            if not all(x.isascii() and x.isdigit() for x in items):
                raise ValueError
            levels = [int(x) for x in items]  # ValueError past int()'s digit limit too
        except ValueError:
            shown = concurrency if len(concurrency) <= 60 else concurrency[:40] + "..."
            raise DFlashError(f"expected a comma list of positive integers, got {shown!r}",
                              field="--concurrency") from None
        run_concurrency_bench(recipe, engine_dir, suite, num_prompts, max_new_tokens, levels, mode_list, out_json,
                              reps, sampling)
        return
    run_bench(recipe, engine_dir, suite, num_prompts, max_new_tokens, mode_list, out_json, sampling, reps)
