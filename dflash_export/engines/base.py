"""The backend-agnostic engine contract: what an engine reports, its per-sequence state, and the sampling
parameters it decodes with (`SamplingParams`, checked when made: decoding/request.py).

An engine owns the compiled graphs and the per-sequence state (KV caches, pending context features); the runtime
(`dflash_export.runtime.single`) owns the loop, sampling randomness, stop handling and streaming. Keeping the two apart
is what lets one loop drive ONNX Runtime, TensorRT and the PyTorch reference alike.

This module imports neither torch nor onnxruntime: a served ORT engine needs only numpy, onnxruntime and tokenizers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_export.decoding.request import (
    SamplingParams,  # noqa: F401 - the contract's request settings
    is_int,
)
from dflash_export.errors import DFlashError, json_kind
from dflash_export.files import read_json_object
from dflash_export.models.tokenization import TextCodec, compiled_template, default_template


@dataclass
class EngineInfo:
    backend: str
    recipe: str
    block_size: int
    mask_token_id: int
    vocab_size: int
    stop_token_ids: list[int]
    max_seq_len: int
    target_layer_ids: list[int] = field(default_factory=list)
    # Cost of verifying one more draft, in plain steps (verify of n drafts ~ 1 + n * this); None = the runtime's
    # default. Quantized ONNX Runtime engines record theirs (their int8 kernels grow with the rows, fp32's barely).
    verify_token_cost: float | None = None
    draft_cost: float | None = None
    decoding: dict = field(default_factory=dict)  # the recipe's decoding options (decoding/options.py)
    static_index: Any = None  # the static n-gram index the engine stores (decoding/static_ngrams.py), None if none

    def check_room(self, total: int) -> None:
        """Refuse a step that would take a sequence to `total` tokens, past max_seq_len (every engine's caches and
        profiles end there)."""
        if total > self.max_seq_len:
            raise DFlashError(f"sequence would reach {total} tokens, over the engine's max_seq_len {self.max_seq_len}",
                              field="max_tokens")


class Sequence:
    """Per-request state. `length` = committed tokens in the target cache; the next anchor sits at `length`."""

    def __init__(self):
        self.length = 0
        # Set by `draft` in greedy mode on backends that can: the drafter's probability of each greedy draft [bs-1].
        # Lets the runtime verify only the drafts worth their verification cost (see DFlashRuntime).
        self.draft_confidence = None
        # Set with draft_confidence: the drafter's logits of the block's slots [n, V_draft] (draft trees grow from
        # them).
        self.draft_logits = None


class Engine(ABC):
    """What a compiled backend provides to the runtime. Arrays are numpy; batch size 1.

    Call order per request: `prefill` once, then either AR `decode` steps or DFlash steps of `draft` + `verify`.
    """

    info: EngineInfo
    codec: Any  # dflash_export.models.tokenization.TextCodec
    # True when `verify` appends its context features to those still pending (a verify with no draft before it,
    # e.g. a one-token block) instead of replacing them: then the runtime may skip drafting for a few steps.
    accumulates_context: bool = False
    # True when the graphs take blocks of exactly block_size (TensorRT profiles): then the runtime never shortens the
    # last block (z-lab does), which leaves the tokens unchanged and only the last step's acceptance length may differ.
    fixed_block: bool = False

    @abstractmethod
    def new_sequence(self, max_tokens: int | None = None) -> Sequence:
        """A fresh sequence. `max_tokens`: how long it may grow (prompt + new tokens + a block), a hint that lets
        an engine size its caches once instead of growing them."""

    @abstractmethod
    def prefill(self, seq: Sequence, input_ids: np.ndarray) -> np.ndarray:
        """Run the prompt [S] int64 through the target; keep its context features pending for the drafter.

        Returns the logits of the last prompt position [V] float32. Afterwards seq.length == S.
        """

    @abstractmethod
    def decode(self, seq: Sequence, token: int, greedy: bool = False) -> np.ndarray:
        """AR step: commit `token` at position seq.length and return the next-token logits [V] float32. `greedy`:
        the caller takes their argmax only (an engine may then return exact values only where the argmax can be,
        lower stand-ins elsewhere: engines/greedy_head.py); never set when sampling."""

    @abstractmethod
    def draft(self, seq: Sequence, anchor: int, sp: SamplingParams, uniforms: np.ndarray | None,
              block_len: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Draft block slots 1..n-1 after `anchor` (at position seq.length), consuming the pending context.

        `block_len` n (2..bs, default bs): the drafter runs over a block of n slots; the runtime shortens the last
        block to what the request still needs, as z-lab's release does (a shorter block changes what a bidirectional
        drafter proposes, not what is emitted). An engine with fixed block shapes may draft the full block.
        Returns draft tokens [>= n-1] int64 and, when sampling, their draft distributions [>= n-1, V] (float64, after
        temperature / top-k / top-p). `uniforms` [bs-1] drive the inverse-CDF draws when sampling.
        """

    @abstractmethod
    def verify(self, seq: Sequence, block: np.ndarray, draft_probs: np.ndarray | None, sp: SamplingParams,
               uniforms: np.ndarray | None) -> tuple[int, list[int]]:
        """Score `block` [bs] (anchor + drafts) with the target, accept, and commit.

        Returns (accept_len, emitted) as `sampling.verify_block`. Afterwards the target cache holds anchor + accepted
        drafts (seq.length += accept_len + 1) and their context features are pending for the next draft (appended to
        those still pending when the engine `accumulates_context`).
        """

    def close(self) -> None:
        """Release sessions / device memory."""


# ----------------------------------------------------------------------------------------------------------------------
# Engine directories (the manifest: engines/manifest.py)


def load_codec(engine_dir):
    """The engine's TextCodec, with its files checked first (`check_codec_files`)."""
    check_codec_files(engine_dir)
    return TextCodec.from_dir(Path(engine_dir))


def check_codec_files(engine_dir) -> None:
    """The codec files of an engine (or tokenizer) directory, without loading the tokenizer: a malformed
    tokenizer_config.json, codec.json or chat template (neither a string nor a list of named templates with a
    "default" one, or not compiling: bad syntax, an unknown filter or test) is one DFlashError naming the file and
    field, at load (`run`, `deploy`, `serve`'s check), not a traceback or a nameless error when the first prompt is
    encoded."""
    d = Path(engine_dir)
    if (d / "tokenizer.json").is_file():
        for template, src, field in _chat_templates(d, named=False):
            _check_compiles(template, src, field)
    elif (d / "codec.json").is_file():
        cfg_path = d / "codec.json"
        cfg = read_json_object(cfg_path)
        v = cfg.get("vocab_size", 256)
        if not is_int(v) or v < 1:
            raise DFlashError(f"expected a positive integer, got {v!r}", path=cfg_path, field="vocab_size")
        r = cfg.get("reserved", [])
        if not isinstance(r, list) or not all(is_int(x) and x >= 0 for x in r):
            raise DFlashError(f"expected a list of non-negative integers, got {r!r}", path=cfg_path, field="reserved")


def check_transformers_tokenizer_files(model_dir) -> None:
    """The tokenizer files of a checkpoint that another program loads with transformers (a TensorRT-LLM bundle's
    target, which TensorRT-LLM serves), without loading it: a tokenizer_config.json that is not a JSON object, a
    special token that is neither a string nor an object with a string 'content' (transformers refuses both when
    it loads) or a chat template of the wrong type is one DFlashError naming the file and field. What transformers
    takes stands: a list of named templates ({"name", "template"}), and templates are not compiled here, since
    transformers compiles them in its own environment (its `{% generation %}` tag is not this project's)."""
    if (Path(model_dir) / "tokenizer_config.json").is_file():
        _chat_templates(Path(model_dir), named=True)


def _chat_templates(d: Path, named: bool) -> list[tuple[str, Path, str | None]]:
    """(template, file, field) of each chat template of tokenizer directory `d`, its tokenizer_config.json's types
    checked: chat_template.jinja, which transformers prefers to the config's entry, else tokenizer_config.json
    `chat_template` (one string, or transformers' list of {"name", "template"} objects: `named`, every one; else the
    one named "default", which TextCodec renders)."""
    cfg_path = d / "tokenizer_config.json"
    cfg = read_json_object(cfg_path) if cfg_path.is_file() else {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(key)
        if v is not None and not isinstance(v, str) and not (isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise DFlashError(f"expected a string or an object with a string 'content', got {json_kind(v)}",
                              path=cfg_path, field=key)
    src = d / "chat_template.jinja"
    if src.is_file():
        try:
            template = src.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DFlashError(f"not UTF-8 text (byte {e.start})", path=src) from None
        return [(template, src, None)] if template else []
    template = cfg.get("chat_template")
    if isinstance(template, list):
        for i, t in enumerate(template):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise DFlashError("expected an object with a string 'name' and a string 'template', "
                                  f"got {json_kind(t)}", path=cfg_path, field=f"chat_template[{i}]")
        if named:
            return [(t["template"], cfg_path, f"chat_template[{i}]") for i, t in enumerate(template)]
        found = default_template(template)
        if found is None:
            raise DFlashError("no template named 'default' among the named templates (prompts render with the "
                              "default one)", path=cfg_path, field="chat_template")
        return [(found[1], cfg_path, f"chat_template[{found[0]}]")] if found[1] else []
    if template is not None and not isinstance(template, str):
        raise DFlashError(f"expected a string or a list of named templates, got {json_kind(template)}", path=cfg_path,
                          field="chat_template")
    return [(template, cfg_path, "chat_template")] if template else []


def _check_compiles(template: str, src: Path, field: str | None) -> None:
    """`template` compiled as tokenization.TextCodec renders it (sandboxed): bad syntax, unknown filters or tests are
    one DFlashError naming `src` and `field`."""
    import jinja2

    try:
        compiled_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise DFlashError(f"invalid chat template (line {e.lineno}: {e.message})", path=src, field=field) from None
    except RecursionError:
        raise DFlashError("invalid chat template (nested deeper than Python's recursion limit)", path=src,
                          field=field) from None
