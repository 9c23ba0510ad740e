"""`dflash-export demo`: the README's main command on the embedded default pair."""

from __future__ import annotations

import sys

import click

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.build import build_engine
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe
from dflash_export.runtime.single import DFlashRuntime, RunStats


def run_demo(recipe_name: str, prompt: str, max_new_tokens: int) -> None:
    from dflash_export.models.checkpoint import lint_pair

    recipe = load_recipe(recipe_name)
    recipe.check_new_tokens(max_new_tokens)  # before the build, which can take minutes
    click.echo(f"[1/3] inspect {recipe.name}: {recipe.description}")
    findings, _ = lint_pair(recipe.drafter_path, recipe.target_path)
    for f in findings:
        click.echo("      " + f.line())
    if any(f.level == "error" for f in findings):
        raise DFlashError("the drafter does not fit the target (see above)", path=recipe.path)
    click.echo("[2/3] build the onnxruntime engine")
    res = build_engine(recipe, "onnxruntime")
    click.echo(f"      {'reused' if res.reused else 'built'} {res.engine_dir}")
    engine = load_engine(res.engine_dir)
    rt = DFlashRuntime(engine)
    chat = recipe.chat_template
    if recipe.target.startswith("tiny:"):
        click.echo("      (tiny random pair: the text below is noise; the point is DFlash == AR, token for token)")
    results = {}
    for mode in ("dflash", "ar"):
        click.echo(f"[3/3] {'DFlash, ' + rt.describe() if mode == 'dflash' else 'plain AR (same engine)'}: "
                   f"{prompt!r}")
        stats = RunStats()
        for delta in rt.stream_text(prompt, SamplingParams(max_new_tokens=max_new_tokens), mode, chat, stats):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        results[mode] = stats
        tau = f", τ {stats.tau:.2f} tokens per target pass ({rt.tau_counts()})" if mode == "dflash" else ""
        click.echo(f"      {len(stats.tokens)} tokens{tau}, {stats.tokens_per_s:.1f} tok/s")
    a, b = results["dflash"], results["ar"]
    click.echo(f"identical output: {a.tokens == b.tokens} | speedup {a.tokens_per_s / max(b.tokens_per_s, 1e-9):.2f}x "
               f"| τ {a.tau:.2f} on this prompt (tokens per target pass; plain decoding: 1)")
