"""Recipes: one typed, validated YAML per target/drafter pair (recipes/*.yaml).

Unknown keys and wrong types are errors naming the file and the field; relative paths are relative to the recipe file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from dflash_export.decoding.options import DecodingOptions, decoding_problem
from dflash_export.errors import DFlashError, kind, kind_of_type
from dflash_export.models.config import MAX_SEQ_LEN
from dflash_export.models.sources import SourcePath, hf_snapshot, is_hf_id, split_pkg_spec
from dflash_export.models.tiny import split_tiny_spec

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
BACKENDS = ("onnxruntime", "tensorrt", "tensorrt-llm")
DTYPES = ("float32", "float16", "bfloat16")
PRECISIONS = ("fp32", "int8", "int4")  # ONNX Runtime engines: weight precision (activations stay fp32)
# Most prompts a train count may ask for (ShareGPT holds fewer than 20 000 records; synthetic prompts are made in
# memory all at once), as decoding.static_prompts
MAX_PROMPTS = 100_000
# Largest training seed (recipe train.seed, --seed): the per-step generators seed with seed * 1_000_003 + step, which
# must stay below 2**64
SEED_MAX = 2**32 - 1

# A value quoted in an error: a few elements and characters of it, never the whole of a large value (an alias of an
# alias in YAML makes a list of a billion elements from a few lines)
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict = 2, 4, 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


@dataclass
class Thresholds:
    """What `validate` must see before an engine ships."""

    min_identical_fraction: float = 1.0      # greedy engine DFlash output == reference AR, fraction of prompts
    min_tau: float = 1.0                     # mean accepted tokens per step
    min_speedup_vs_ar: float = 1.0           # engine DFlash tok/s over engine AR tok/s: DFlash no slower than plain
                                             # decoding on the same engine unless a recipe sets a lower floor
    min_speedup_vs_reference: float = 0.0    # engine DFlash tok/s over PyTorch reference spec_generate tok/s
    min_distribution_p_value: float = 1e-3   # T>0 chi-square test
    logits_atol: float = 1e-4                # export parity tolerance (fp32)
    ctx_atol: float = 1e-4


@dataclass
class TrtLlmOptions:
    max_batch_size: int = 8
    max_num_tokens: int = 8192
    kv_cache_free_gpu_memory_fraction: float = 0.85
    cuda_graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    tensor_parallel_size: int = 1


@dataclass
class TrainOptions:
    """How `dflash-export train` builds this recipe's drafter (dflash_export/train/ explains each choice)."""

    prompts: str = "sharegpt"                # "sharegpt" (first-turn prompts, index < 12000) | "synthetic" (tiny)
    num_prompts: int = 2000                  # training prompts to generate responses for
    heldout_prompts: int = 16                # held-out prompts (index >= 12000) for accuracy / implied τ
    max_prompt_tokens: int = 128             # longer prompts are skipped (compute)
    max_new_tokens: int = 128                # target response length cap
    teacher_forced_prompts: int = 0          # + conversations whose dataset answer is read (one forward, no generation)
    max_reply_tokens: int = 256              # dataset answer length cap for those
    gen_batch_size: int = 16
    soft_topk: int = 4                       # target top-k kept as soft targets
    draft_layers: int = 2
    block_size: int = 8
    mask_token_id: int | None = None         # a reserved special-token row of the target's embedding
    target_layer_ids: list[int] | None = None  # default: z-lab's rule for draft_layers
    gamma: float | None = None               # loss decay exp(-(k-1)/gamma); default by block size
    lr: float = 3e-4
    warmup_steps: int = 20
    lr_decay_steps: int | None = None        # cosine decay of lr to lr_min_ratio*lr by this (total) step; None = flat
    lr_min_ratio: float = 0.1
    batch_size: int = 4                      # sequences per step
    blocks_per_seq: int = 16                 # anchors per sequence per step
    soft_weight: float = 0.5                 # share of the soft (top-k) loss vs the hard greedy label
    steps: int = 1000
    seed: int = 0


@dataclass
class Recipe:
    name: str
    target: str                              # HF dir, .gguf, pkg:DIST:SUFFIX or tiny:NAME/target
    drafter: str                             # z-lab checkpoint dir or tiny:NAME/drafter
    description: str = ""
    upstream_target: str = ""                # documentation only: where users get the weights
    upstream_drafter: str = ""
    dtype: str = "float32"
    block_size: int | None = None            # override of the drafter's block_size
    max_seq_len: int = 2048
    backends: list[str] = field(default_factory=lambda: ["onnxruntime"])
    chat_template: bool = True               # text prompts chat-templated: run, bench, serve and train's
                                             # ShareGPT prompts alike
    draft_vocab: int | None = None           # engines: draft among the first N token ids only (cheaper draft LM head;
                                             # still lossless, the target verifies over the full vocabulary)
    precision: str = "fp32"                  # onnxruntime engines: target (+ LM head) weights fp32, int8 or int4
                                             # (block-wise MatMulNBits); lossless against plain decoding on the engine
    drafter_precision: str | None = None     # the drafter's (+ draft head's) weights; default: `precision`
    suite: str = "sharegpt-heldout"          # default validate suite
    thresholds: Thresholds = field(default_factory=Thresholds)
    trtllm: TrtLlmOptions = field(default_factory=TrtLlmOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    decoding: DecodingOptions = field(default_factory=DecodingOptions)
    path: Path | None = None                 # the YAML file it came from

    def resolve(self, value: str) -> str:
        """Paths relative to the recipe file; schemes (tiny:, pkg:), absolute paths and Hugging Face ids found in the
        local cache (`Qwen/Qwen3-8B`, see sources.hf_snapshot) as they are, a tiny: pair checked to exist. Every
        unset environment variable of the pair is named at once."""
        if value.startswith("tiny:") and not isinstance(value, SourcePath):
            split_tiny_spec(value, self.path, "target" if value == self.target else "drafter")
        if value.startswith(("tiny:", "pkg:")) or isinstance(value, SourcePath):
            return value
        missing = self.missing_environment()
        if missing:
            raise DFlashError("environment variable" + ("s " if len(missing) > 1 else " ") + ", ".join(
                f"{var} ({key})" for var, key in missing) + (" are" if len(missing) > 1 else " is") +
                " not set: point them at the local checkpoints (see the comment at the top of the recipe), or "
                "give --target / --drafter", path=self.path, field="target" if value == self.target else "drafter")
        v = os.path.expandvars(os.path.expanduser(value))
        base = self.path.parent if self.path is not None else Path.cwd()
        if is_hf_id(v) and not (base / v).exists():
            return SourcePath(hf_snapshot(v, field="target" if value == self.target else "drafter"))
        return SourcePath(v if os.path.isabs(v) else (base / v).resolve())

    def missing_environment(self) -> list[tuple[str, str]]:
        """(variable, key) for every ${VAR} / $VAR in target and drafter that is not set."""
        out = []
        for key in ("target", "drafter"):
            if isinstance(getattr(self, key), SourcePath):  # a path already: its `$` is a character of a name
                continue
            for m in re.finditer(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", getattr(self, key)):
                if m.group(1) not in os.environ:
                    out.append((m.group(1), key))
        return out

    def drafted_block(self, drafter_block_size: int) -> int:
        """The block this recipe's engines draft: `block_size` when set, else the drafter's own. One that does not fit
        max_seq_len (a block follows at least one context token) is a DFlashError naming the recipe's field."""
        block = self.block_size or drafter_block_size
        if block >= self.max_seq_len:
            whose = "" if self.block_size else " (the drafter's block_size)"
            raise DFlashError(f"a block of {block}{whose} does not fit max_seq_len {self.max_seq_len}", path=self.path,
                              field="block_size" if self.block_size else "max_seq_len")
        return block

    def check_new_tokens(self, max_new_tokens: int, block: int | None = None) -> None:
        """Refuse, before an engine is built or a model loaded for this recipe, a --max-new-tokens that leaves no room
        in max_seq_len for a prompt token and a block beside it: `block`, the drafted block where it is known
        (`drafted_block`), else the recipe's block_size (the exact check, with the prompt, comes where it is
        encoded)."""
        block = block or self.block_size
        if 1 + max_new_tokens + (block or 1) > self.max_seq_len:
            blocks = f"block ({block})" if block else "a block"
            raise DFlashError(f"a prompt + {max_new_tokens} new tokens + {blocks} exceeds the recipe's max_seq_len "
                              f"{self.max_seq_len}", field="--max-new-tokens")

    @property
    def target_path(self) -> str:
        return self.resolve(self.target)

    @property
    def drafter_path(self) -> str:
        return self.resolve(self.drafter)


def _quoted(value) -> str:
    """A value of the wrong type as an error names it: its kind, and the value itself cut short ("a string
    ('lots')"); null alone."""
    if value is None:
        return "null"
    shown = str(value).lower() if isinstance(value, bool) else _SHORT_REPR.repr(value)  # YAML's true / false
    return f"{kind(value)} ({shown})"


def _check(value, typ, path: Path, name: str):
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _check(value, inner, path, name)
    if origin is list:
        if not isinstance(value, list):
            raise DFlashError(f"expected a list, got {_quoted(value)}", path=path, field=name)
        return [_check(v, args[0], path, f"{name}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise DFlashError(f"expected a mapping, got {_quoted(value)}", path=path, field=name)
        return _build(typ, value, path, name + ".")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, float) and not math.isfinite(value):
        raise DFlashError(f"must be a finite number, got {value!r}", path=path, field=name)
    if typ is Path:
        return Path(value)
    if not isinstance(value, typ) or (typ in (int, float) and isinstance(value, bool)):
        hint = ""
        if typ is float and isinstance(value, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value.strip()):
            # YAML 1.1, which PyYAML reads, takes an exponent without a dot (1e-4) for text
            text = value.strip()
            hint = f"; YAML reads {text} as text, write it with a dot: {re.sub('[eE]', '.0e', text, count=1)}"
        raise DFlashError(f"expected {kind_of_type(typ)}, got {_quoted(value)}{hint}",
                          path=path, field=name)
    return value


def _build(cls, data: dict, path: Path, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)} - {"path"}
    for key in data:
        if key not in names:
            raise DFlashError(f"unknown key (known: {', '.join(sorted(names))})", path=path, field=prefix + str(key))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _check(data[f.name], hints[f.name], path, prefix + f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name != "path":
            raise DFlashError("missing required key", path=path, field=prefix + f.name)
    return cls(**kwargs)


def load_recipe(name_or_path=None, target: str | None = None, drafter: str | None = None) -> Recipe:
    """`smollm2-135m` (from recipes/) or a path to a YAML file; `target` / `drafter` (a path, a Hugging Face id in
    the local cache, tiny:, pkg:) replace the recipe's. Without a recipe, both make one with the defaults, named after
    the drafter (`build --target T --drafter D`: a pair without writing YAML)."""

    if isinstance(name_or_path, Recipe) and not (target or drafter):
        return name_or_path  # already made (by recipe_from_options)
    target, drafter = _cli_source(target), _cli_source(drafter)
    for option, value in (("--target", target), ("--drafter", drafter)):
        if value and value.startswith("tiny:"):  # the option named, not the recipe file whose value it replaces
            split_tiny_spec(value, None, option)
    if name_or_path is None:
        if not (target and drafter):
            raise DFlashError("give --recipe, or --target and --drafter for a pair without a recipe",
                              field="--recipe")
        name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", str(drafter).rstrip("/").split("/")[-1].split(":")[-1]) or "pair"
        recipe = Recipe(name=name.lower()[:60], target=target, drafter=drafter)  # path None: no recipe file
        _check_ranges(recipe, Path("--target/--drafter"))
        return recipe
    recipe = _load_recipe_file(name_or_path)
    if target:
        recipe.target = target
    if drafter:
        recipe.drafter = drafter
    return recipe


def recipe_from_options(recipe: str | None, target: str | None, drafter: str | None) -> Recipe:
    """The recipe `--recipe` / `--target` / `--drafter` name (see load_recipe), its target and drafter resolved now:
    every unset environment variable and every id absent from the Hugging Face cache is one error before any
    work."""
    r = load_recipe(recipe, target=target, drafter=drafter)
    r.target_path, r.drafter_path  # noqa: B018 -- resolved for their errors
    return r


def _cli_source(value: str | None) -> str | None:
    """A source given on the command line: a local path made absolute (relative to the working directory, not to a
    recipe file); schemes and Hugging Face ids as they are."""
    if not value or value.startswith(("tiny:", "pkg:")) or ("$" in value and not os.path.lexists(value)):
        return value  # $VARS: expanded by Recipe.resolve, which names any unset one
    v = os.path.expanduser(value)
    return v if is_hf_id(v) else SourcePath(Path(v).resolve())


def _recipe_loader():
    """PyYAML's safe loader (no tag constructs a Python object) that refuses a key given twice in one mapping: plain
    YAML keeps the last one silently, so a recipe would train with a value its reader did not see."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:  # before merges (<<) are flattened in: a merged key may be overridden
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark, f"duplicate key {key_node.value!r}",
                            key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return RecipeLoader


def _load_recipe_file(name_or_path) -> Recipe:
    import yaml

    p = Path(str(name_or_path))
    if not p.is_file() and p.suffix not in (".yaml", ".yml"):
        p = RECIPES_DIR / f"{name_or_path}.yaml"
        if not p.is_file() and is_hf_id(str(name_or_path)):
            raise DFlashError(f"{name_or_path!r} is a model id, not a recipe: build a pair with --target "
                              f"{name_or_path} --drafter ID_OR_DIR (ids resolve in the local Hugging Face cache)",
                              field="--recipe")
        if not p.is_file():
            names = list_recipes()
            close = difflib.get_close_matches(str(name_or_path), names, n=1, cutoff=0.5)
            guess = f"did you mean {close[0]!r}? " if close else ""
            raise DFlashError(f"unknown recipe {name_or_path!r}; {guess}(known: {', '.join(names)}; "
                              "`dflash-export recipes` lists them)", field="--recipe")
    if not p.is_file():
        raise DFlashError("recipe file not found", path=p)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DFlashError(f"not UTF-8 text (byte {e.start}): a recipe is YAML", path=p) from None
    try:
        data = yaml.load(text, Loader=_recipe_loader())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        raise DFlashError(f"invalid YAML ({getattr(e, 'problem', e)})", path=p, field=where) from None
    except RecursionError:
        raise DFlashError("invalid YAML (nested too deeply)", path=p, field="YAML") from None
    except ValueError as e:  # a scalar YAML types but Python cannot hold: a date 2024-13-01, a 5000-digit integer
        raise DFlashError(f"invalid YAML ({e})", path=p, field="YAML") from None
    if not isinstance(data, dict):
        raise DFlashError("expected a mapping at the top level", path=p)
    recipe = _build(Recipe, data, p)
    recipe.path = p.resolve()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", recipe.name):
        raise DFlashError(f"{recipe.name!r} cannot name a directory (engines go to OUT/<name>/): use letters, "
                          "digits, '_', '.' and '-', starting with a letter or digit", path=p, field="name")
    if recipe.dtype not in DTYPES:
        raise DFlashError(f"{recipe.dtype!r} is not one of {', '.join(DTYPES)}", path=p, field="dtype")
    for key in ("precision", "drafter_precision"):
        value = getattr(recipe, key)
        if value is not None and value not in PRECISIONS:
            raise DFlashError(f"{value!r} is not one of {', '.join(PRECISIONS)}", path=p, field=key)
    problem = decoding_problem(dataclasses.asdict(recipe.decoding))
    if problem is not None:
        raise DFlashError(problem[1], path=p, field=problem[0])
    for i, b in enumerate(recipe.backends):
        if b not in BACKENDS:
            raise DFlashError(f"{b!r} is not one of {', '.join(BACKENDS)}", path=p, field=f"backends[{i}]")
    _check_ranges(recipe, p)
    return recipe


# Numeric ranges, checked at load so that a bad value names its file and field before any work starts.
# (low, high, open_low): None = unbounded; open_low = the low end is excluded ("> low").
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    # top level
    "block_size": (2, None, False),                       # an anchor and at least one drafted token
    "draft_vocab": (2, None, False),
    "max_seq_len": (16, MAX_SEQ_LEN, False),              # the graphs hold cos/sin tables of max_seq_len rows
    # thresholds
    "thresholds.min_identical_fraction": (0, 1, False),
    "thresholds.min_tau": (0, None, False),
    "thresholds.min_speedup_vs_ar": (0, None, False),
    "thresholds.min_speedup_vs_reference": (0, None, False),
    "thresholds.min_distribution_p_value": (0, 1, False),
    "thresholds.logits_atol": (0, None, False),
    "thresholds.ctx_atol": (0, None, False),
    # trtllm
    "trtllm.max_batch_size": (1, None, False),
    "trtllm.max_num_tokens": (1, None, False),
    "trtllm.kv_cache_free_gpu_memory_fraction": (0, 1, True),
    "trtllm.cuda_graph_batch_sizes[]": (1, None, False),
    "trtllm.tensor_parallel_size": (1, None, False),
    # train
    "train.num_prompts": (0, MAX_PROMPTS, False),         # 0: teacher-forced data only (checked together below)
    "train.heldout_prompts": (1, MAX_PROMPTS, False),     # the best drafter is chosen (and exported) on these
    # a prompt and its answer are one sequence, which no engine holds beyond MAX_SEQ_LEN positions
    "train.max_prompt_tokens": (1, MAX_SEQ_LEN, False),
    "train.max_new_tokens": (2, MAX_SEQ_LEN, False),      # a training block needs an anchor and one label
    "train.teacher_forced_prompts": (0, MAX_PROMPTS, False),
    "train.max_reply_tokens": (2, MAX_SEQ_LEN, False),    # shorter replies are dropped (train.sharegpt_reply_ids)
    "train.gen_batch_size": (1, None, False),
    "train.soft_topk": (1, None, False),
    "train.draft_layers": (1, None, False),
    "train.block_size": (2, None, False),
    "train.mask_token_id": (0, None, False),
    "train.target_layer_ids[]": (0, None, False),
    "train.gamma": (0, None, True),
    "train.lr": (0, None, True),
    "train.warmup_steps": (0, None, False),
    "train.lr_decay_steps": (1, None, False),
    "train.lr_min_ratio": (0, 1, False),
    "train.batch_size": (1, None, False),
    "train.blocks_per_seq": (1, None, False),
    "train.soft_weight": (0, 1, False),
    "train.steps": (1, None, False),
    "train.seed": (0, SEED_MAX, False),
}


def _range_error(value, low, high, open_low: bool) -> str | None:
    """None when `value` lies in the range, else the message."""
    ok = (value > low if open_low else value >= low) and (high is None or value <= high)
    if ok:
        return None
    if high is None:
        want = f"> {low}" if open_low else f">= {low}"
    else:
        want = f"in {'(' if open_low else '['}{low}, {high}]"
    return f"must be {want}, got {value!r}"


def _check_ranges(recipe: Recipe, p: Path) -> None:
    """Every numeric field in its range, and the few rules between fields; DFlashError naming the first bad one."""
    for dotted, (low, high, open_low) in _RANGES.items():
        obj = recipe
        *parents, leaf = dotted.split(".")
        for part in parents:
            obj = getattr(obj, part)
        many = leaf.endswith("[]")
        value = getattr(obj, leaf.removesuffix("[]"))
        if value is None:  # an optional field left at its default
            continue
        items = enumerate(value) if many else [(None, value)]
        for i, v in items:
            msg = _range_error(v, low, high, open_low)
            if msg:
                name = dotted.removesuffix("[]") + (f"[{i}]" if many else "")
                raise DFlashError(msg, path=p, field=name)
    for name, block in (("block_size", recipe.block_size), ("train.block_size", recipe.train.block_size)):
        if block is not None and block >= recipe.max_seq_len:
            raise DFlashError(f"a block of {block} does not fit max_seq_len {recipe.max_seq_len}", path=p, field=name)
    for name in ("target", "drafter"):
        spec = getattr(recipe, name)
        if spec.startswith("pkg:"):
            split_pkg_spec(spec, p, name)
    t = recipe.train
    if t.prompts not in ("sharegpt", "synthetic"):
        raise DFlashError(f"unknown prompt source {t.prompts!r} (sharegpt, synthetic)", path=p, field="train.prompts")
    if t.num_prompts + t.teacher_forced_prompts < 1:
        raise DFlashError("the prompt set is empty: num_prompts and teacher_forced_prompts are both 0", path=p,
                          field="train.num_prompts")
    if t.target_layer_ids is not None:
        if not t.target_layer_ids:
            raise DFlashError("must not be empty (leave it out for the default taps)", path=p,
                              field="train.target_layer_ids")
        dup = sorted({x for x in t.target_layer_ids if t.target_layer_ids.count(x) > 1})
        if dup:
            raise DFlashError(f"duplicate layer ids {dup}", path=p, field="train.target_layer_ids")
    # learning_rate reaches train.lr at step warmup_steps - 1 (counting from 0): the last step of a run of
    # warmup_steps steps, never in a shorter one
    if t.warmup_steps > t.steps:
        raise DFlashError(f"must be <= train.steps ({t.steps}): the learning rate would never reach train.lr, got "
                          f"{t.warmup_steps}", path=p, field="train.warmup_steps")
    if t.lr_decay_steps is not None and t.lr_decay_steps <= t.warmup_steps:
        raise DFlashError(f"must be > train.warmup_steps ({t.warmup_steps}): the cosine decay starts after the "
                          f"warm-up, got {t.lr_decay_steps}", path=p, field="train.lr_decay_steps")


def list_recipes() -> list[str]:
    return sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))
