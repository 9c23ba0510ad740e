"""`dflash-export train`: generate the target's responses (cached), then train the recipe's drafter.

Only parsing and wiring here; the method lives in the modules beside this one (stage.py drives them). Heavy imports
stay inside the function so the CLI starts fast.
"""

from __future__ import annotations

import click

from dflash_export.clitypes import FiniteFloat
from dflash_export.recipes import MAX_PROMPTS, SEED_MAX


@click.command()
@click.option("--recipe", required=True, metavar="NAME", help="Recipe name (recipes/NAME.yaml) or a YAML path.")
@click.option("--steps", type=click.IntRange(0), default=None, help="Total optimizer steps (default: the recipe's).")
@click.option("--minutes", type=FiniteFloat(0.0, min_open=True), default=None,
              help="Stop training after this much wall time (this run).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Where the best drafter goes (default: the recipe's drafter directory).")
@click.option("--seed", type=click.IntRange(0, SEED_MAX), default=None,
              help="Seed of the batches and anchors drawn each step (default: the recipe's train.seed, which also "
                   "picks the prompts).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in the work directory.")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Checkpoints + training log (default: <cache>/train/<recipe>-seed<seed>).")
@click.option("--num-prompts", type=click.IntRange(0, MAX_PROMPTS), default=None,
              help="Training prompts (default: the recipe's).")
@click.option("--data-only", is_flag=True, help="Only generate (and cache) the training data, then stop.")
@click.option("--no-generate", is_flag=True,
              help="Train on the data already cached (e.g. while another process is still generating).")
@click.option("--checkpoint-minutes", type=FiniteFloat(0.0, min_open=True), default=5.0, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=None, help="torch intra-op threads.")
@click.option("--init-from", type=click.Path(file_okay=False), default=None,
              help="Start from this trained drafter instead of the target's layers; when the recipe asks for more "
                   "layers, they are appended as identities (zero output projections). A fresh run: step 0.")
@click.option("--data-part", default=None, metavar="I/N",
              help="With --data-only: generate only the training-data shards i with i % N == I (0 <= I < N), so N "
                   "processes can share the generation; each skips shards already on disk.")
def train(recipe, steps, minutes, out, seed, resume, work_dir, num_prompts, data_only, no_generate,
          checkpoint_minutes, threads, init_from, data_part):
    """Train the recipe's DFlash drafter on its target's own greedy responses."""
    from dflash_export.train.stage import run_train

    run_train(recipe, steps=steps, minutes=minutes, out=out, seed=seed, resume=resume, work_dir=work_dir,
              num_prompts=num_prompts, data_only=data_only, no_generate=no_generate,
              checkpoint_minutes=checkpoint_minutes, threads=threads, init_from=init_from, data_part=data_part)
