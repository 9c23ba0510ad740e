"""Targets (Qwen3, LLaMA, Qwen3-MoE, gpt-oss) through transformers, with DFlash's layer taps and a croppable cache.

Taps follow the +1 convention: `target_layer_ids` name a decoder layer's *output*, which is HF `hidden_states[id + 1]`
(index 0 is the embedding output). Getting this wrong silently lowers acceptance, so it lives in exactly one place:
`tap_hidden_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError
from dflash_export.files import read_json_object
from dflash_export.models.arch import ARCHS, REFUSED, text_settings
from dflash_export.models.gguf import hf_dir_from_gguf
from dflash_export.models.hfutil import config_dtype, quiet_transformers, stop_token_ids_of
from dflash_export.models.rope import hf_config
from dflash_export.models.sources import resolve_source
from dflash_export.models.weights import has_safetensors, tensor_headers


def tap_hidden_states(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of `layer_ids` (HF hidden_states[id + 1]) on the last axis -> [B, S, n*H]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def resolve_target_dir(path) -> Path:
    """An HF model directory for `path`: an HF directory as is, a `.gguf` file through the cached conversion."""
    p = resolve_source(path)
    if p.is_file() and p.suffix == ".gguf":
        return hf_dir_from_gguf(p)
    if not p.exists():
        raise DFlashError("target not found", path=p)
    if not (p / "config.json").is_file():
        raise DFlashError("not an HF model directory (no config.json) nor a .gguf file: a target directory holds "
                          "config.json, model.safetensors (or its index and shards) and the tokenizer files", path=p)
    return p


# Sizes transformers builds the layers from, checked when config.json gives them (its defaults stand otherwise).
OPTIONAL_SIZES = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "max_position_embeddings")


def read_target_config(path) -> tuple[dict[str, Any], Path]:
    """The target's config.json as a dict, plus `stop_token_ids` from its generation config / eos. A composite
    (vision + text) checkpoint's decoder settings come from its `text_config` (arch.text_settings)."""
    d = resolve_target_dir(path)
    cfg_path = d / "config.json"
    raw = read_json_object(cfg_path)
    cfg = text_settings(raw)
    text = raw["text_config"] if cfg is not raw else {}

    def where(f: str) -> str:  # the key as config.json spells it
        return f"text_config.{f}" if f in text else f

    for f in ("num_hidden_layers", "hidden_size", "vocab_size", "model_type"):
        if f not in cfg:
            raise DFlashError("missing required field", path=cfg_path, field=f)
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", *OPTIONAL_SIZES):
        v = cfg.get(f)
        if (v is not None or f not in OPTIONAL_SIZES) and (not is_int(v) or v < 1):
            raise DFlashError(f"expected a positive integer, got {v!r}", path=cfg_path, field=where(f))
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise DFlashError(f"{kv} does not divide num_attention_heads {heads} (grouped-query attention)",
                          path=cfg_path, field=where("num_key_value_heads"))
    if not isinstance(cfg["model_type"], str):
        raise DFlashError(f"expected a string, got {cfg['model_type']!r}", path=cfg_path, field="model_type")
    if cfg["model_type"] in REFUSED:
        raise DFlashError(f"{cfg['model_type']!r}: {REFUSED[cfg['model_type']]} (supported: {', '.join(ARCHS)})",
                          path=cfg_path, field="model_type")
    if cfg["model_type"] not in ARCHS:
        raise DFlashError(f"unsupported model_type {cfg['model_type']!r} (supported: {', '.join(ARCHS)})",
                          path=cfg_path, field="model_type")
    config_dtype(raw, cfg_path)
    if text:
        config_dtype(text, cfg_path, "text_config.")
    cfg["stop_token_ids"] = stop_token_ids_of(d, cfg)
    return cfg, cfg_path


def _ranges(ids) -> str:
    """Sorted layer indices as runs: [0, 1, 2, 5] -> "0..2, 5"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _embedding_name(tensors: dict) -> str | None:
    """The decoder's embedding table: `model.embed_tokens.weight`, or under a composite checkpoint's language model
    (`model.language_model.embed_tokens.weight`); the shortest such name when a checkpoint holds several."""
    names = [n for n in tensors if n.split(".")[-2:] == ["embed_tokens", "weight"] and not n.startswith("mtp.")]
    return min(names, key=lambda n: (n.count("."), n)) if names else None


def target_weight_problems(model_dir: Path, cfg: dict[str, Any], cfg_path: Path) -> list[DFlashError]:
    """config.json (`cfg`, from read_target_config) against the safetensors headers, no tensor data read: the
    embedding is [vocab_size, hidden_size], the LM head too unless tie_word_embeddings, decoder layers
    0..num_hidden_layers-1 are there and no other, and (families with plain attention in every layer) each layer's
    q/k/v/o projections have the shapes the head counts give. transformers would otherwise fail with its own text, or
    load a model the config does not describe (layers past num_hidden_layers dropped, a missing LM head drawn at
    random). One DFlashError per disagreement, at most one per tensor kind; [] when the weights fit."""
    tensors = tensor_headers(model_dir)
    vocab, hidden, n_layers = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    embed = _embedding_name(tensors)
    if embed is None:
        return [DFlashError("no embed_tokens.weight tensor (the decoder's embedding table)", path=model_dir,
                            field="embed_tokens.weight")]
    problems: list[DFlashError] = []

    def shape_problem(name: str, want: tuple[int, ...], spelled: str) -> bool:
        shape, _, f = tensors[name]
        if shape == want:
            return False
        problems.append(DFlashError(f"shape {list(shape)} != {spelled} = {list(want)} of {cfg_path.name}", path=f,
                                    field=name))
        return True

    shape_problem(embed, (vocab, hidden), "[vocab_size, hidden_size]")
    hf = hf_config(cfg, cfg_path, cfg["model_type"])
    if "lm_head.weight" in tensors:
        shape_problem("lm_head.weight", (vocab, hidden), "[vocab_size, hidden_size]")
    elif not getattr(hf, "tie_word_embeddings", False):
        problems.append(DFlashError("missing tensor: tie_word_embeddings is false, so the LM head is not the "
                                    "embedding table and transformers would draw it at random", path=model_dir,
                                    field="lm_head.weight"))
    prefix = embed[:-len("embed_tokens.weight")] + "layers."
    present = {int(n[len(prefix):].split(".")[0]) for n in tensors
               if n.startswith(prefix) and n[len(prefix):].split(".")[0].isdigit()}
    missing, extra = sorted(set(range(n_layers)) - present), sorted(present - set(range(n_layers)))
    if missing:
        problems.append(DFlashError(f"{n_layers}, but the weights hold no {prefix}N.* tensors for N = "
                                    f"{_ranges(missing)}", path=cfg_path, field="num_hidden_layers"))
    if extra:
        problems.append(DFlashError(f"{n_layers}, but the weights also hold {prefix}N.* for N = {_ranges(extra)} "
                                    f"(transformers would drop them)", path=cfg_path, field="num_hidden_layers"))
    if ARCHS[cfg["model_type"]].hybrid is None:
        heads = int(hf.num_attention_heads)
        kv = int(hf.num_key_value_heads or heads)
        head_dim = getattr(hf, "head_dim", None) or hidden // heads  # as transformers' attention modules take it
        want = {"q_proj": ((heads * head_dim, hidden), "[num_attention_heads x head_dim, hidden_size]"),
                "k_proj": ((kv * head_dim, hidden), "[num_key_value_heads x head_dim, hidden_size]"),
                "v_proj": ((kv * head_dim, hidden), "[num_key_value_heads x head_dim, hidden_size]"),
                "o_proj": ((hidden, heads * head_dim), "[hidden_size, num_attention_heads x head_dim]")}
        for proj, (shape, spelled) in want.items():
            for i in sorted(present & set(range(n_layers))):
                name = f"{prefix}{i}.self_attn.{proj}.weight"
                if name not in tensors:
                    problems.append(DFlashError("missing tensor", path=model_dir, field=name))
                    break
                if shape_problem(name, shape, spelled):
                    break
    return problems


def check_target_weights(model_dir: Path, cfg: dict[str, Any], cfg_path: Path) -> None:
    """target_weight_problems' first problem raised, for loaders; nothing for weights that fit their config."""
    problems = target_weight_problems(model_dir, cfg, cfg_path)
    if problems:
        raise problems[0]


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, S, V]
    taps: torch.Tensor | None  # [B, S, n*H] concatenated tapped layer outputs


class TargetModel:
    """A transformers causal LM plus what DFlash needs from it: embedding, LM head, taps, cache cropping."""

    def __init__(self, hf_model, model_dir: Path, config: dict[str, Any]):
        self.hf = hf_model.eval()
        self.model_dir = model_dir
        self.config = config
        self.arch = ARCHS[config["model_type"]]
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self.stop_token_ids: list[int] = list(config.get("stop_token_ids", []))
        self._tokenizer = None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            for name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
                if (self.model_dir / name).is_file():  # a corrupt one named here, not inside transformers
                    read_json_object(self.model_dir / name)
            # trust_remote_code=False: an `auto_map` in the tokenizer files never imports the directory's code
            # (left unset, transformers asks on stdin whether to run it when no built-in class matches).
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=False)
            except (ValueError, OSError, KeyError, ImportError) as e:
                first = " ".join(str(e).split())[:200] or type(e).__name__
                raise DFlashError(f"cannot load the tokenizer ({first})", path=self.model_dir) from None
        return self._tokenizer

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.get_output_embeddings()(hidden)

    def new_cache(self):
        from transformers import DynamicCache

        # Hybrids: transformers builds the per-layer kinds (K/V or conv + recurrent state) from the config.
        return DynamicCache(config=self.hf.config) if self.arch.hybrid else DynamicCache()

    @staticmethod
    def crop(cache, length: int) -> None:
        cache.crop(length)

    def snapshot(self, cache):
        """What `commit` needs to roll `cache` back after a verify: a copy for hybrids (transformers' Gated DeltaNet
        state cannot be cropped: it holds the state after the last row only), None for K/V caches (cropped)."""
        import copy

        return copy.deepcopy(cache) if self.arch.hybrid else None

    def commit(self, cache, length: int, snapshot, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the first `length` tokens of `cache` after a verify: crop a K/V cache; a hybrid's goes back to its
        `snapshot` (taken before the verify) and runs the accepted `rows` [1, n] at `positions` again."""
        if snapshot is None:
            cache.crop(length)
            return
        cache.__dict__.update(snapshot.__dict__)
        self.forward(rows, positions, cache)

    def keep_rows(self, cache, start: int, rows: Sequence[int]) -> None:
        """Keep the cache's first `start` rows and then the rows start + r for r in `rows`, in that order (a draft
        tree's accepted path, compacted behind the committed tokens)."""
        if self.arch.hybrid:
            raise DFlashError("draft trees are not verified on hybrid targets (Gated DeltaNet state)",
                              field="tree_mode")
        index = torch.tensor(list(range(start)) + [start + r for r in rows])
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, tap_ids: Sequence[int] | None = None,
                attention_mask: torch.Tensor | None = None) -> TargetOutput:
        """input_ids [B, S] at absolute `positions` [B, S]; appends to `cache`. Returns all logits and the taps.
        `attention_mask` [B, 1, S, past + S] bool (True = visible), when given, replaces the causal mask (a draft
        tree's ancestor-only mask); transformers takes a 4-D mask as it is."""
        out = self.hf(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=tap_ids is not None,
        )
        taps = tap_hidden_states(out.hidden_states, tap_ids) if tap_ids is not None else None
        return TargetOutput(out.logits, taps)


def load_target(path, dtype: torch.dtype = torch.float32) -> TargetModel:
    """Load a Qwen3 / LLaMA target from an HF directory or a GGUF file (converted once, cached)."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model_dir = resolve_target_dir(path)
    config, cfg_path = read_target_config(model_dir)
    if has_safetensors(model_dir):  # headers bounds-checked and held against the config before transformers reads them
        check_target_weights(model_dir, config, cfg_path)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=False,
                                                  attn_implementation=ARCHS[config["model_type"]].attn_implementation)
    except Exception as e:  # OSError, safetensors' own errors, shape mismatches from a config that lies
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"cannot load target weights ({first})", path=model_dir) from None
    return TargetModel(hf, model_dir, config)
