"""click parameter types shared by the stage commands."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import click

from dflash_export.decoding.request import check_field
from dflash_export.errors import DFlashError


class FiniteFloat(click.FloatRange):
    """A float range that also refuses nan and ±inf (click's FloatRange lets nan through: every comparison with it
    is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


class RequestField(click.ParamType):
    """A request's decoding field given as an option (`run`, `bench`, `reference`): read as a number, then held to
    the field's one rule (decoding/request.py's `check_field`, the rule the served API applies); the error names the
    option."""

    def __init__(self, field: str):
        self.field = field
        self.integer = field in ("max_tokens", "top_k", "seed")
        self.name = "integer" if self.integer else "float"

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            try:
                # ASCII and no digit separators: int() and float() alone would read "1_0" as 10 and "٢" as 2
                if not value.isascii() or "_" in value:
                    raise ValueError
                value = int(value) if self.integer else float(value)
            except ValueError:
                self.fail(f"{value!r} is not a valid {'integer' if self.integer else 'number'}", param, ctx)
        try:
            return check_field(self.field, value)
        except DFlashError as e:
            self.fail(e.message, param, ctx)

# The request fields (decoding/request.py) and decoding options (decoding/options.py) that the runtime's errors name
# (runtime/single.py: `check_request`, DFlashRuntime), as the options of the commands that generate spell them.
OPTION_OF_FIELD = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "top_k": "--top-k", "seed": "--seed", "proposer": "--proposer", "tree_mode": "--tree-mode",
                   "tree_top_k": "--tree-top-k", "tree_nodes": "--tree-nodes", "sampling": "--sampling",
                   "static_ngrams": "--static-ngrams"}


@contextmanager
def fields_as_options(prompt: str):
    """Re-raise an error of the runtime that names a request field (`max_tokens`, as the served API spells it)
    naming the option instead (`--max-new-tokens`); the prompt's fields (`text_input`, `input_ids`) as `prompt`, the
    command's name for it. Errors naming a file are left as they are."""
    try:
        yield
    except DFlashError as e:
        field = prompt if e.field in ("text_input", "input_ids") else OPTION_OF_FIELD.get(e.field)
        if e.path is not None or field is None:
            raise
        raise type(e)(e.message, field=field) from None


# One default for every command that generates (run, bench, validate, reference, demo).
MAX_NEW_TOKENS = 128


def top_p_top_k_options(f):
    """--top-p and --top-k, as `run` and `bench` take them (the served API's rules, RequestField)."""
    f = click.option("--top-k", default=0, show_default=True, type=RequestField("top_k"),
                     help="Sampling: keep the K most likely tokens (0: every token).")(f)
    return click.option("--top-p", default=1.0, show_default=True, type=RequestField("top_p"),
                        help="Sampling: keep the fewest most likely tokens whose probabilities sum to this, in "
                             "(0, 1].")(f)


def engine_option(help_text: str, required: bool = False):
    """--engine DIR: a built engine directory, the same type and metavar in every command that takes one."""
    return click.option("--engine", "engine_dir", required=required, default=None, metavar="DIR",
                        type=click.Path(file_okay=False), help=help_text)


class Utf8Text(click.ParamType):
    """Text that must be valid UTF-8: a command-line argument in another encoding reaches Python as surrogate escapes
    (os.fsdecode), which no tokenizer can encode; refuse it naming the byte instead of failing inside the run."""

    name = "text"

    def convert(self, value, param, ctx):
        if isinstance(value, bytes):
            value = value.decode("utf-8", "surrogateescape")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # Under a locale that is not UTF-8 (LC_ALL=C) every non-ASCII byte is escaped: the argument's own bytes
            # are read as UTF-8, and only bytes that are not UTF-8 either are refused.
            raw = os.fsencode(value)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                at = len(raw[:e.start].decode("utf-8", "surrogateescape"))
                self.fail(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at character {at})", param, ctx)
        return value


UTF8_TEXT = Utf8Text()


def decoding_options(command):
    """--proposer / --tree-mode / --tree-top-k / --tree-nodes / --sampling / --static-ngrams: how DFlash steps
    propose and accept drafts (dflash_export/decoding/options.py); unset, the engine's recipe decides (its
    manifest's `decoding`)."""
    from dflash_export.decoding.options import PROPOSERS, SAMPLERS, TREE_MODES

    for opt in reversed([
            click.option("--proposer", type=click.Choice(PROPOSERS), default=None,
                         help="chain: the drafter's block; tree: a tree from its per-slot top-K; lookup: the "
                              "context's n-gram continuations; tree+lookup: both in one tree. Default: the engine's "
                              "recipe (decoding.proposer)."),
            click.option("--tree-mode", type=click.Choice(TREE_MODES), default=None,
                         help="spine: verify the tree's best path as a chain (bit-identical where chains are); "
                              "full: every node in one pass (lossless within kernel numerics, see run's report)."),
            click.option("--tree-top-k", type=click.IntRange(1, 8), default=None, help="Drafter children per node."),
            click.option("--tree-nodes", type=click.IntRange(1, 64), default=None,
                         help="Drafted nodes per step at most (the cost model may verify fewer)."),
            click.option("--sampling", type=click.Choice(SAMPLERS), default=None,
                         help="T > 0: walk: the target's own draw at each node (any proposer; the output is plain "
                              "sampling's with the same seed); chain: the drafter's sampled chain with min(1, p/q) "
                              "(the PyTorch reference's stream). Default: the engine's recipe (decoding.sampling)."),
            click.option("--static-ngrams/--no-static-ngrams", default=None,
                         help="Merge the engine's static n-gram index of the target's own past answers into trees "
                              "and lookups. Default: the engine's recipe (decoding.static_ngrams).")]):
        command = opt(command)
    return command


def recipe_options(command):
    """--recipe / --target / --drafter: a recipe, or a pair without writing YAML (dflash_export.recipes
    .recipe_from_options turns the three into one Recipe)."""
    for opt in reversed([
            click.option("--recipe", default=None, metavar="NAME",
                         help="Recipe name (recipes/NAME.yaml) or a YAML path; or give the pair with --target and "
                              "--drafter."),
            click.option("--target", "target", default=None,
                         help="Target: HF directory, .gguf file, Hugging Face id in the local cache (Qwen/Qwen3-8B) "
                              "or tiny:NAME/target; replaces the recipe's."),
            click.option("--drafter", "drafter", default=None,
                         help="DFlash drafter: directory, Hugging Face id in the local cache or tiny:NAME/drafter; "
                              "replaces the recipe's.")]):
        command = opt(command)
    return command
