"""`dflash-export`: one thin click command per stage. Commands parse and call; the logic lives in the stage modules.

Every DFlashError becomes one `error: <file>: <field>: <message>` line and its exit code (2 for bad input, 1 for a
failed check), never a traceback.
"""

from __future__ import annotations

import sys

import click

from dflash_export import __version__
from dflash_export.errors import DFlashError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DFlashError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dflash-export")
def main():
    """Export, compile, validate and deploy DFlash speculative decoding engines."""


@main.command()
@click.argument("drafter")
@click.option("--target", required=True, help="Target: HF directory, .gguf file, or tiny:NAME/target.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings and summary as JSON.")
def inspect(drafter, target, as_json):
    """Lint a DRAFTER checkpoint against its TARGET and print a summary (exit 2 on any error)."""
    from dflash_export.inspect_cmd import run_inspect

    sys.exit(run_inspect(drafter, target, as_json))


@main.command()
@click.option("--recipe", required=True, help="Recipe name (recipes/NAME.yaml) or a YAML path.")
@click.option("--prompt", default=None, help="Prompt text (chat template applied when the tokenizer has one).")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1, 100000))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0))
@click.option("--seed", default=0, show_default=True, type=int)
def reference(recipe, prompt, max_new_tokens, temperature, seed):
    """Run the PyTorch reference (spec and AR) on a recipe's pair and compare them."""
    from dflash_export.reference_cmd import run_reference

    run_reference(recipe, prompt, max_new_tokens, temperature, seed)


@main.command()
@click.option("--recipe", default="smollm2-135m", show_default=True, help="The pair to demonstrate.")
@click.option("--prompt", default="Write a short poem about the sea.", show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1))
def demo(recipe, prompt, max_new_tokens):
    """The main job end to end: lint the pair, build the ONNX Runtime engine (reused when unchanged), and generate
    with DFlash and with plain AR decoding on the same engine."""
    from dflash_export.demo import run_demo

    run_demo(recipe, prompt, max_new_tokens)


def _register_optional(name: str, module: str, attr: str) -> None:
    """Stage commands live in their own modules; a stage whose module is absent is simply not listed."""
    import importlib

    try:
        cmd = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("dflash_export"):
            return
        raise
    main.add_command(cmd, name)


for _name, _module, _attr in [
    ("train", "dflash_export.train_cmd", "train"),
    ("export", "dflash_export.export.cli", "export"),
    ("build", "dflash_export.engines.cli", "build"),
    ("run", "dflash_export.engines.cli", "run"),
    ("bench", "dflash_export.engines.cli", "bench"),
    ("validate", "dflash_export.validate.cli", "validate"),
    ("deploy", "dflash_export.deploy.cli", "deploy"),
    ("serve", "dflash_export.deploy.cli", "serve"),
]:
    _register_optional(_name, _module, _attr)


if __name__ == "__main__":
    main()
