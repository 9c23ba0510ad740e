"""`dflash-export export --recipe R --out DIR`: write the two ONNX graphs of a recipe's pair (parse and call only)."""

from __future__ import annotations

import click

from dflash_export.clitypes import recipe_options
from dflash_export.export import export_recipe
from dflash_export.recipes import recipe_from_options


@click.command()
@recipe_options
@click.option("--out", "out_dir", required=True, type=click.Path(),
              help="Output directory (new, empty, or an earlier export).")
def export(recipe, target, drafter, out_dir):
    """Export target_verify.onnx + drafter.onnx (custom ops carried as ONNX functions) and check them."""
    res = export_recipe(recipe_from_options(recipe, target, drafter), out_dir)
    for name, size in res.file_sizes.items():
        click.echo(f"{name:28s} {size / 1e6:10.2f} MB")
    click.echo(f"exported {res.metadata['dflash.recipe']} to {res.out_dir} in {res.seconds:.1f} s")
