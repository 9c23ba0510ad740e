"""CLI for `run`, `demo` and `reference`: the loops over a built engine and the PyTorch yardstick (thin)."""

from __future__ import annotations

import sys

import click

from dflash_export.clitypes import (
    UTF8_TEXT,
    RequestField,
    decoding_options,
    engine_option,
    fields_as_options,
    max_new_tokens_option,
    recipe_options,
    top_p_top_k_options,
)
from dflash_export.engines.base import SamplingParams
from dflash_export.engines.build import default_engine_dir
from dflash_export.engines.manifest import check_engine_recipe
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe
from dflash_export.runtime.compare import run_reference
from dflash_export.runtime.demo import run_demo
from dflash_export.runtime.single import DFlashRuntime, RunStats


@click.command()
@engine_option("A built engine directory [default with --recipe: engines/<recipe>/onnxruntime].")
@click.option("--recipe", default=None, metavar="NAME",
              help="Run this recipe's engine (engines/<recipe>/onnxruntime, or its one quantized build) instead of "
                   "giving --engine.")
@click.argument("prompt", type=UTF8_TEXT)
@max_new_tokens_option
@click.option("--temperature", default=0.0, show_default=True, type=RequestField("temperature"),
              help="0: greedy; > 0: sample (--sampling walk: DFlash draws plain sampling's tokens for the same seed).")
@top_p_top_k_options
@click.option("--seed", default=0, show_default=True, type=RequestField("seed"),
              help="Sampling: the random stream's seed, 0..2^64-1; the same seed draws the same text.")
@click.option("--ar", is_flag=True, help="Plain autoregressive decoding on the same engine (the baseline).")
@click.option("--no-chat", is_flag=True, help="Send the prompt as raw text (no chat template).")
@click.option("--full-blocks", is_flag=True,
              help="Verify every drafted token (default, greedy: only the drafts the drafter's confidence says are "
                   "worth their verification cost; same output).")
@decoding_options
def run(engine_dir, recipe, prompt, max_new_tokens, temperature, top_p, top_k, seed, ar, no_chat, full_blocks,
        proposer, tree_mode, tree_top_k, tree_nodes, sampling, static_ngrams):
    """Generate for PROMPT with a built engine, streaming; prints τ (tokens per target pass) and tok/s at the end.

    The engine: --engine DIR, or --recipe NAME for the one `build --recipe NAME` wrote."""
    if engine_dir is None and recipe is None:
        raise DFlashError("give --engine DIR (a built engine) or --recipe NAME (its built engine)", field="--engine")
    if not prompt:
        raise DFlashError("the prompt is empty", field="prompt")
    manifest = None
    if engine_dir is None:
        loaded = load_recipe(recipe)
        engine_dir = default_engine_dir(loaded.name)
        manifest = check_engine_recipe(engine_dir, loaded)  # as validate and bench do: another recipe's engine misleads
    elif recipe is not None:
        raise DFlashError("give --engine DIR or --recipe NAME, not both", field="--recipe")
    engine = load_engine(engine_dir, manifest)
    if recipe is not None:  # which of the recipe's builds runs (fp32, or the one quantized build there is)
        click.echo(f"[engine] {engine_dir}", err=True)
    stats = RunStats()
    with fields_as_options("prompt"):
        rt = DFlashRuntime(engine, adaptive=not full_blocks, proposer=proposer, tree_mode=tree_mode,
                           tree_top_k=tree_top_k, tree_nodes=tree_nodes, sampling=sampling,
                           static_ngrams=static_ngrams)
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
        for delta in rt.stream_text(prompt, sp, "ar" if ar else "dflash", chat=not no_chat, stats=stats):
            sys.stdout.write(delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    drafted = (f", {stats.drafted_tokens / max(1, len(stats.acceptance_lengths)):.1f} drafts verified/step"
               if not ar else "")
    mode = "AR" if ar else f"DFlash {rt.describe(temperature)}"
    tau = "" if ar else f", τ {stats.tau:.2f} tokens per target pass ({rt.tau_counts(temperature)})"
    click.echo(f"[{mode}] {len(stats.tokens)} tokens{tau}{drafted}, "
               f"{stats.tokens_per_s:.1f} tok/s, TTFT {stats.ttft_s * 1000:.0f} ms, finish: {stats.finish_reason}",
               err=True)
    if not ar and getattr(engine, "numerics", None) is not None:
        click.echo(f"[numerics] {engine.numerics.statement}", err=True)
        if rt.proposer != "chain" and rt.tree_mode == "full" and temperature == 0:
            click.echo(f"[numerics] {engine.numerics.tree_statement}", err=True)


@click.command()
@recipe_options
@click.option("--prompt", default=None, type=UTF8_TEXT,
              help="Prompt text (the chat template applied when the recipe asks for it and the tokenizer has one; "
                   "a tiny pair's characters become ids). Default: the token ids 3..18.")
@max_new_tokens_option
@click.option("--temperature", default=0.0, show_default=True, type=RequestField("temperature"),
              help="Sampling temperature of both decodings (0: greedy, where DFlash must equal plain decoding).")
@click.option("--seed", default=0, show_default=True, type=RequestField("seed"),
              help="Seed of the sampling (with --temperature above 0).")
def reference(recipe, target, drafter, prompt, max_new_tokens, temperature, seed):
    """Run the PyTorch reference (DFlash and plain decoding) on a recipe's pair and compare them."""
    from dflash_export.recipes import recipe_from_options

    run_reference(recipe_from_options(recipe, target, drafter), prompt, max_new_tokens, temperature, seed)


@click.command()
@click.option("--recipe", default="smollm2-135m", show_default=True, help="The pair to demonstrate.")
@click.option("--prompt", default="Write a short poem about the sea.", show_default=True, type=UTF8_TEXT)
@max_new_tokens_option
def demo(recipe, prompt, max_new_tokens):
    """The main job end to end: lint the pair, build the ONNX Runtime engine (reused when unchanged), and generate
    with DFlash and with plain decoding on the same engine."""
    if not prompt:  # before the build, which can take minutes
        raise DFlashError("the prompt is empty", field="--prompt")
    with fields_as_options("--prompt"):
        run_demo(recipe, prompt, max_new_tokens)
