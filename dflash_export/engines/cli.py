"""CLI for `build`, `run` and `bench` (thin: parse and call)."""

from __future__ import annotations

import sys

import click

from dflash_export.bench import run_bench, run_concurrency_bench
from dflash_export.clitypes import (
    MAX_NEW_TOKENS,
    SEED,
    UTF8_TEXT,
    FiniteFloat,
    decoding_options,
    engine_option,
    recipe_options,
)
from dflash_export.engines.base import SamplingParams
from dflash_export.engines.build import build_engine
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe, recipe_from_options
from dflash_export.runtime import DFlashRuntime, RunStats


@click.command()
@recipe_options
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "tensorrt-llm"]), default="onnxruntime",
              show_default=True)
@click.option("--out", default="engines", show_default=True, help="Root of engine directories.")
@click.option("--force", is_flag=True, help="Rebuild even when the inputs are unchanged.")
@click.option("--precision", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="onnxruntime: weight precision of the target and LM head (default: the recipe's, else fp32); "
                   "int8 / int4 = block-wise MatMulNBits, lossless against plain decoding on the same engine.")
@click.option("--drafter-precision", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="onnxruntime: the drafter's and draft head's weight precision (default: --precision).")
@click.option("--fp32-heads", is_flag=True, help="onnxruntime: keep the LM head and draft head fp32 when the graphs "
                                                 "are quantized.")
@click.option("--max-batch", type=click.IntRange(1), default=None,
              help="tensorrt: the most sequences per call the continuous-batching engines' profiles take (default 8; "
                   "deploy --max-batch may not pass it).")
def build(recipe, target, drafter, backend, out, force, precision, drafter_precision, fp32_heads, max_batch):
    """Build engines/<recipe>/<backend>[-<precision>]/ (reused when every input hash matches)."""
    from rich.console import Console

    import time

    from dflash_export.engines import ort_build

    r = recipe_from_options(recipe, target, drafter)
    console = Console(stderr=True, highlight=False)
    t0 = time.monotonic()
    with console.status(f"building {r.name} ({backend})") as status:
        def stage(text, new=True):
            if new:
                console.log(f"[{time.monotonic() - t0:5.1f} s] {text}")
            status.update(f"{text} ...")

        ort_build.report_stages(stage if console.is_terminal else None)
        try:
            res = build_engine(r, backend, out, force, precision, drafter_precision, False if fp32_heads else None,
                               max_batch)
        finally:
            ort_build.report_stages(None)
    from dflash_export.engines.manifest import read_manifest

    m = read_manifest(res.engine_dir)
    weights = ""
    if m.precision:
        p = m.precision
        weights = f"{p['target']} weights" + (f" (drafter {p['drafter']})" if p["drafter"] != p["target"] else "")
        if r.dtype != "float32":
            weights += f", from a {r.dtype} checkpoint"
        weights += "; "
    Console(highlight=False, soft_wrap=True).print(  # one line, whatever the path length
        f"{'reused' if res.reused else 'built'} {res.engine_dir} "
        f"({weights}{'inputs unchanged' if res.reused else f'{len(res.inputs)} input files hashed'})")


@click.command()
@engine_option("A built engine directory [default with --recipe: engines/<recipe>/onnxruntime].")
@click.option("--recipe", default=None, metavar="NAME",
              help="Run this recipe's engine (engines/<recipe>/onnxruntime, or its one quantized build) instead of "
                   "giving --engine.")
@click.argument("prompt", type=UTF8_TEXT)
@click.option("--max-new-tokens", default=MAX_NEW_TOKENS, show_default=True, type=click.IntRange(1, 100000))
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(0.0))
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(0.0, 1.0, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0))
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--ar", is_flag=True, help="Plain autoregressive decoding on the same engine (the baseline).")
@click.option("--no-chat", is_flag=True, help="Send the prompt as raw text (no chat template).")
@click.option("--full-blocks", is_flag=True,
              help="Verify every drafted token (default, greedy: only the drafts the drafter's confidence says are "
                   "worth their verification cost; same output).")
@decoding_options
def run(engine_dir, recipe, prompt, max_new_tokens, temperature, top_p, top_k, seed, ar, no_chat, full_blocks,
        proposer, tree_mode, tree_top_k, tree_nodes):
    """Generate for PROMPT with a built engine, streaming; prints τ (tokens per target pass) and tok/s at the end.

    The engine: --engine DIR, or --recipe NAME for the one `build --recipe NAME` wrote."""
    if engine_dir is None and recipe is None:
        raise DFlashError("give --engine DIR (a built engine) or --recipe NAME (its built engine)", field="--engine")
    if engine_dir is None:
        from dflash_export.validate.command import default_engine_dir

        engine_dir = default_engine_dir(load_recipe(recipe).name)
    elif recipe is not None:
        raise DFlashError("give --engine DIR or --recipe NAME, not both", field="--recipe")
    engine = load_engine(engine_dir)
    rt = DFlashRuntime(engine, adaptive=not full_blocks, proposer=proposer, tree_mode=tree_mode,
                       tree_top_k=tree_top_k, tree_nodes=tree_nodes)
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    stats = RunStats()
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
@engine_option("A built engine directory [default: engines/<recipe>/onnxruntime, built if absent].")
@click.option("--suite", default=None, help="Prompt suite (default: the recipe's).")
@click.option("--num-prompts", default=20, show_default=True, type=click.IntRange(1))
@click.option("--max-new-tokens", default=MAX_NEW_TOKENS, show_default=True, type=click.IntRange(1, 100000))
@click.option("--modes", default="dflash,dflash-full,ar,hf,reference", show_default=True,
              help="Comma list of: dflash (engine, its recipe's decoding), dflash-full (engine, chain, every draft "
                   "verified), chain / tree / lookup / tree+lookup / tree+lookup-full (engine, that proposer; -full: "
                   "whole trees verified), ar (same engine), hf (transformers generate), reference (PyTorch "
                   "spec_generate).")
@click.option("--out", "out_json", default=None, help="Write every figure to this JSON file.")
@click.option("--concurrency", default=None,
              help="Comma list of concurrency levels (e.g. 1,4,8,16): continuous batching on the engine instead, "
                   "DFlash and plain decoding (modes dflash / ar of --modes; default both) at each level.")
@click.option("--reps", default=1, show_default=True, type=click.IntRange(1),
              help="With --concurrency: interleaved passes per level and mode; the fastest counts (the DFlash / plain "
                   "ratio is also printed pass by pass).")
def bench(recipe, target, drafter, engine_dir, suite, num_prompts, max_new_tokens, modes, out_json, concurrency,
          reps):
    """Benchmark DFlash vs AR on the engine, HF generate and the PyTorch reference (medians after warm-up)."""
    recipe = recipe_from_options(recipe, target, drafter)
    mode_list = [m.strip() for m in modes.split(",")]
    if concurrency is not None:
        try:
            levels = [int(x) for x in concurrency.split(",") if x.strip()]
        except ValueError:
            raise DFlashError(f"expected a comma list of integers, got {concurrency!r}",
                              field="--concurrency") from None
        run_concurrency_bench(recipe, engine_dir, suite, num_prompts, max_new_tokens, levels, mode_list, out_json,
                              reps)
        return
    run_bench(recipe, engine_dir, suite, num_prompts, max_new_tokens, mode_list, out_json)
