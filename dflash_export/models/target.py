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

from dflash_export.errors import DFlashError
from dflash_export.files import read_json_object
from dflash_export.models.arch import ARCHS, REFUSED, text_settings
from dflash_export.models.gguf import hf_dir_from_gguf
from dflash_export.models.hfutil import quiet_transformers, stop_token_ids_of
from dflash_export.models.sources import resolve_source
from dflash_export.models.weights import has_safetensors, weight_files


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


def read_target_config(path) -> tuple[dict[str, Any], Path]:
    """The target's config.json as a dict, plus `stop_token_ids` from its generation config / eos. A composite
    (vision + text) checkpoint's decoder settings come from its `text_config` (arch.text_settings)."""
    d = resolve_target_dir(path)
    cfg_path = d / "config.json"
    cfg = text_settings(read_json_object(cfg_path))
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", "model_type"):
        if f not in cfg:
            raise DFlashError("missing required field", path=cfg_path, field=f)
    for f in ("num_hidden_layers", "hidden_size", "vocab_size"):
        v = cfg[f]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise DFlashError(f"expected a positive integer, got {v!r}", path=cfg_path, field=f)
    if not isinstance(cfg["model_type"], str):
        raise DFlashError(f"expected a string, got {cfg['model_type']!r}", path=cfg_path, field="model_type")
    if cfg["model_type"] in REFUSED:
        raise DFlashError(f"{cfg['model_type']!r}: {REFUSED[cfg['model_type']]} (supported: {', '.join(ARCHS)})",
                          path=cfg_path, field="model_type")
    if cfg["model_type"] not in ARCHS:
        raise DFlashError(f"unsupported model_type {cfg['model_type']!r} (supported: {', '.join(ARCHS)})",
                          path=cfg_path, field="model_type")
    cfg["stop_token_ids"] = stop_token_ids_of(d, cfg)
    return cfg, cfg_path


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
    config, _ = read_target_config(model_dir)
    if has_safetensors(model_dir):
        weight_files(model_dir)  # headers bounds-checked: a truncated or missing shard is named before transformers
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=False,
                                                  attn_implementation=ARCHS[config["model_type"]].attn_implementation)
    except Exception as e:  # OSError, safetensors' own errors, shape mismatches from a config that lies
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DFlashError(f"cannot load target weights ({first})", path=model_dir) from None
    return TargetModel(hf, model_dir, config)
