"""The `validate` click command: parse options and call `validate.command.run_validate` (heavy imports inside)."""

from __future__ import annotations

import click

from dflash_export.clitypes import (
    RequestField,
    decoding_options,
    engine_option,
    max_new_tokens_option,
    recipe_options,
)
from dflash_export.errors import DFlashError
from dflash_export.validate.command import run_validate


@click.command()
@recipe_options
@engine_option("A built engine directory [default: engines/<recipe>/onnxruntime, or the recipe's one "
               "quantized engine when only that was built].")
@click.option("--suite", default=None,
              help="Named suite (validate/NAME.jsonl) or a .jsonl file [default: the recipe's].")
@click.option("--num-prompts", default=None, type=click.IntRange(1),
              help="Use the first N prompts of the suite [default: 10; --full: all].")
@click.option("--full", is_flag=True,
              help="The whole suite and the full sampled check (300 seeds per prompt, the power calculation's); "
                   "the defaults are a quick check that finishes in minutes.")
@max_new_tokens_option
@click.option("--temperature", default=0.7, show_default=True, type=RequestField("temperature"),
              help="Temperature of the sampled losslessness check (0 skips it).")
@click.option("--top-k", default=0, show_default=True, type=RequestField("top_k"), help="top-k of the sampled check.")
@click.option("--top-p", default=0.9, show_default=True, type=RequestField("top_p"),
              help="top-p of the sampled check.")
@click.option("--dist-samples", default=None, type=click.IntRange(0),
              help="Seeds per prompt for the sampled check [default: 40, a quick check of low power; --full: 300, "
                   "from the power calculation in docs/stages.md].")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1),
              help="Timed runs per prompt (medians reported; >1 also checks the outputs repeat exactly).")
@click.option("--report", "report_dir", default=None, type=click.Path(),
              help="Report directory [default: reports/validate/<recipe>/<backend>[-<precision>], the engine "
                   "directory's name as build writes it].")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@decoding_options
def validate(recipe, target, drafter, engine_dir, suite, num_prompts, full, max_new_tokens, temperature, top_k, top_p,
             dist_samples, repeats, report_dir, no_progress, proposer, tree_mode, tree_top_k, tree_nodes,
             sampling, static_ngrams):
    """Prove an engine lossless and fast against the PyTorch reference; write report.json, report.md and plots.

    Exit 0 when every recipe threshold holds, 1 when one fails (after the report is written), 2 on bad input or a
    missing library (before any work), 3 on a bug. Fewer than 10 prompts or 300 seeds: a warning says what the run
    cannot detect.
    """
    if report_dir == "":
        raise DFlashError("empty path: name the report directory", field="--report")
    if num_prompts is None and not full:
        num_prompts = 10
    if dist_samples is None:
        dist_samples = 300 if full else 40
    from dflash_export.recipes import recipe_from_options

    run_validate(recipe_from_options(recipe, target, drafter), engine_dir, suite, num_prompts, max_new_tokens,
                 temperature, report_dir, dist_samples, repeats=repeats, top_k=top_k, top_p=top_p,
                 show_progress=not no_progress, echo=click.echo,
                 decoding={k: v for k, v in (("proposer", proposer), ("tree_mode", tree_mode),
                                             ("tree_top_k", tree_top_k), ("tree_nodes", tree_nodes),
                                             ("sampling", sampling), ("static_ngrams", static_ngrams))
                                   if v is not None})
