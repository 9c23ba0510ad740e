"""Training sequences: generated and teacher-forced data, cached shard by shard, and the prompt sources."""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_file, cache_dir
from dflash_export.models.target import tap_hidden_states
from dflash_export.train.sharegpt import sharegpt_prompts

SHARD_SIZE = 32
_DATA_VERSION = 2  # 2: generated data from own_answers (long answers, taps captured while decoding)


@dataclass
class TrainSequence:
    """One cached training example. S = prompt + response length, R = S - prompt_len."""

    ids: torch.Tensor         # [S] int64: prompt then the target's greedy response (stop token included if hit)
    prompt_len: int
    taps: torch.Tensor        # [S, n*H_target] float16: target tap features of every position
    top_ids: torch.Tensor     # [R, K] int64: target's top-k ids for response token r (predicted at position P+r-1)
    top_logp: torch.Tensor    # [R, K] float32: their log-probabilities under the full vocabulary
    index: int                # the prompt's record index (ShareGPT) or synthetic index
    # False: the response is the target's own greedy continuation, so x[a+k] is the label of block slot k.
    # True: the response is the dataset's text (teacher forcing, one forward instead of a generation -- ~30x cheaper
    # per token). Then the label of slot k is the target's argmax top_ids[., 0], and slot k is only trained while the
    # text's tokens a+1 .. a+k-1 agree with those argmaxes, i.e. while the block still lies on the target's greedy path
    # from anchor a -- exactly the blocks inference would verify.
    teacher_forced: bool = False

    def to_dict(self) -> dict:
        return {"ids": self.ids, "prompt_len": self.prompt_len, "taps": self.taps, "top_ids": self.top_ids,
                "top_logp": self.top_logp, "index": self.index, "teacher_forced": self.teacher_forced}


def left_padded(prompts: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, W] left-padded with `pad` to the longest prompt, and the attention mask (1 = a prompt token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    return ids, attn


def cut_at_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """A generated continuation up to and including its first stop token."""
    for j, t in enumerate(tokens):
        if t in stop:
            return tokens[: j + 1]
    return tokens


@torch.inference_mode()
def generate_sequences(target, prompts: Sequence[tuple[int, list[int]]], tap_ids: Sequence[int], max_new_tokens: int,
                       batch_size: int = 16, topk: int = 4) -> list[TrainSequence]:
    """Greedy target responses to `prompts` ((index, token ids)), batched with left padding, then one causal forward
    per sequence batch for the taps and top-k soft targets. Returns one TrainSequence per prompt, in input order."""
    hf = target.hf
    stop = set(target.stop_token_ids)
    pad = next(iter(target.stop_token_ids), 0)
    out: dict[int, TrainSequence] = {}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))  # similar lengths share a batch
    for b0 in range(0, len(order), batch_size):
        batch = [prompts[i] for i in order[b0:b0 + batch_size]]
        ids, attn = left_padded([p for _, p in batch], pad)
        gen = hf.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=sorted(stop) or None, pad_token_id=pad, temperature=None, top_p=None,
                          top_k=None)
        full = [p + cut_at_stop(gen[r, ids.shape[1]:].tolist(), stop) for r, (_, p) in enumerate(batch)]
        # Taps and soft targets from an unpadded-left causal pass (right padding cannot affect earlier positions).
        s_max = max(len(f) for f in full)
        ids2 = torch.full((len(full), s_max), pad, dtype=torch.long)
        for r, f in enumerate(full):
            ids2[r, : len(f)] = torch.tensor(f)
        res = hf(input_ids=ids2, output_hidden_states=True, use_cache=False)
        taps = tap_hidden_states(res.hidden_states, tap_ids)
        for r, ((index, p), f) in enumerate(zip(batch, full)):
            n_p, s = len(p), len(f)
            logp = torch.log_softmax(res.logits[r, n_p - 1: s - 1].float(), dim=-1)
            top_logp, top_ids = logp.topk(topk, dim=-1)
            seq = TrainSequence(torch.tensor(f), n_p, taps[r, :s].to(torch.float16).clone(), top_ids.clone(),
                                top_logp.clone(), index)
            out[order[b0 + r]] = seq
    return [out[i] for i in range(len(prompts))]


@torch.inference_mode()
def teacher_forced_sequences(target, items: Sequence[tuple[int, list[int], int]], tap_ids: Sequence[int],
                             batch_size: int = 16, topk: int = 4) -> list[TrainSequence]:
    """`items` = (index, prompt + reply ids, prompt length): one causal forward per batch (right padding cannot affect
    earlier positions) gives the taps of every position and the target's top-k for every reply token."""
    hf = target.hf
    pad = next(iter(target.stop_token_ids), 0)
    out: dict[int, TrainSequence] = {}
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]))  # similar lengths share a batch
    for b0 in range(0, len(order), batch_size):
        batch = [items[i] for i in order[b0:b0 + batch_size]]
        s_max = max(len(ids) for _, ids, _ in batch)
        ids = torch.full((len(batch), s_max), pad, dtype=torch.long)
        for r, (_, f, _) in enumerate(batch):
            ids[r, : len(f)] = torch.tensor(f)
        res = hf(input_ids=ids, output_hidden_states=True, use_cache=False)
        taps = tap_hidden_states(res.hidden_states, tap_ids)
        for r, (index, f, n_p) in enumerate(batch):
            logp = torch.log_softmax(res.logits[r, n_p - 1: len(f) - 1].float(), dim=-1)
            top_logp, top_ids = logp.topk(topk, dim=-1)
            out[order[b0 + r]] = TrainSequence(torch.tensor(f), n_p, taps[r, : len(f)].to(torch.float16).clone(),
                                               top_ids.clone(), top_logp.clone(), index, teacher_forced=True)
    return [out[i] for i in range(len(items))]


_KEYED_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".jinja", ".txt")  # weights, tokenizer, templates
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


def target_files_key(target) -> str:
    """A digest of the target directory's weight, tokenizer and config files (names, sizes, and each file's bytes --
    whole for small files, 16 evenly spaced 64 KiB samples for large ones, enough to tell other weights of the same
    shapes apart without reading gigabytes): cached data and checkpoints made for other weights at the same path, or
    with the same config, never match it. A `train` run asks for it once per data directory and once for its
    checkpoints: it is read again only when a file's size, inode or times changed."""
    model_dir = Path(target.model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _KEYED_SUFFIXES and p.is_file()) \
        if model_dir.is_dir() else []
    stats = [(p, p.stat()) for p in files]
    return _files_digest(tuple((str(p), st.st_size, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)) for p, st in stats))


@functools.lru_cache(maxsize=16)
def _files_digest(files: tuple[tuple[str, int, tuple], ...]) -> str:
    """target_files_key's digest of (path, size, identity) files; the identity (inode and times) only keys this
    cache."""
    import hashlib

    h = hashlib.sha256()
    for name, size, _ in files:
        path = Path(name)
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= _SAMPLES * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _cached_data_dir(prefix: str, key: dict, target) -> Path:
    """`cache_dir()/train-data/<prefix>-<hash of key and the target's files>`. A directory written when the key held
    the target's path and config alone (same key, no files digest) is adopted once under the new name: regenerating
    it would cost hours for a real target, and what it was made from was never recorded."""
    import hashlib

    def named(fields: dict) -> Path:
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cache_dir() / "train-data" / f"{prefix}-{digest}"

    directory, earlier = named({**key, "files": target_files_key(target)}), named(key)
    if not directory.exists() and earlier.is_dir():
        try:
            earlier.rename(directory)
        except OSError:
            return earlier
    return directory


def data_dir(target, tap_ids: Sequence[int], max_prompt_tokens: int, max_new_tokens: int, topk: int,
             source: str) -> Path:
    """Where generated data for this (target and its files, taps, lengths, prompt source) is cached."""
    return _cached_data_dir(source, {"v": _DATA_VERSION, "target": str(target.model_dir), "config": target.config,
                                     "taps": list(tap_ids), "p": max_prompt_tokens, "r": max_new_tokens, "k": topk,
                                     "src": source}, target)


def answers_dir(target, max_prompt_tokens: int, max_new_tokens: int, source: str) -> Path:
    """Where pass 1's answer tokens for this (target and its files, lengths, prompt source) are cached: no taps in
    the key, so a new tap choice reuses them (own_answers.feature_shards)."""
    return _cached_data_dir(f"{source}-answers", {"v": 1, "target": str(target.model_dir), "config": target.config,
                                                  "p": max_prompt_tokens, "r": max_new_tokens, "src": source}, target)


def sharegpt_source(seed: int, chat_template: bool = True) -> str:
    """The name ShareGPT-prompted data is cached under (data_dir, answers_dir; `-heldout-s`, `-tf-s` in place of
    `-s` for the held-out and teacher-forced sets): `sharegpt-s<seed>` for chat-templated prompts, the name they have
    always had; `sharegpt-untemplated-s<seed>` for the same prompts as plain text (a recipe's `chat_template:
    false`), other token sequences that are never found under the templated ones' name."""
    return f"sharegpt-s{seed}" if chat_template else f"sharegpt-untemplated-s{seed}"


def check_prompt_source(recipe, target_dir: Path) -> None:
    """ShareGPT prompts (`train.prompts: sharegpt`, the default) are text, tokenized with the target's tokenizer: a
    target without one (a tiny random pair) takes synthetic prompts. One error naming the recipe's field, before any
    work that needs the prompts (`train`'s data, `build`'s static n-gram index)."""
    if recipe.train.prompts == "sharegpt" and not (Path(target_dir) / "tokenizer_config.json").is_file():
        raise DFlashError(f"ShareGPT prompts need the target's tokenizer, and {target_dir} has none (no "
                          "tokenizer_config.json); use `prompts: synthetic` for a tokenizer-less target",
                          path=recipe.path, field="train.prompts")


def shard_paths(directory: Path) -> list[Path]:
    """The data shards of `directory`, in order (each is written atomically; only a short last shard of a smaller
    run is ever written again, whole: shard_done)."""
    return sorted(directory.glob("shard-*.pt"))


def supervised(s: TrainSequence) -> bool:
    """Whether training learns anything from `s`: a block's anchor is an answer position with the next token after it
    as its label (blocks.sample_anchors), so an answer of fewer than 2 tokens -- the target stopped at once --
    supervises no position."""
    return len(s.ids) - s.prompt_len >= 2


class ShardLoader:
    """A loader of the first n sequences of each (directory, n) source, less those that supervise nothing
    (`supervised`; `skipped` counts them), for a trainer that calls it at every checkpoint (data generation may be
    running alongside) and once more for the prompt list. They are read again only when a shard has appeared or been
    written again (a short one made whole): they hold several GB of context features for the SmolLM2 recipe. A shard
    none of whose sequences supervises a position is refused by `load_shards`."""

    def __init__(self, sources: Sequence[tuple[Path, int]], vocab_size: int | None = None,
                 tap_width: int | None = None, topk: int | None = None):
        self.sources, self.checks = list(sources), (vocab_size, tap_width, topk)
        self.skipped = 0  # sequences of the last load that supervise no position
        self._paths: list | None = None
        self._seqs: list[TrainSequence] = []

    def __call__(self) -> list[TrainSequence]:
        paths = [(p, _written(p)) for d, _ in self.sources if d.is_dir() for p in shard_paths(d)]
        if self._paths != paths:
            self._paths = paths
            made = [s for d, n in self.sources if d.is_dir() for s in load_shards(d, *self.checks)[:n]]
            self._seqs = [s for s in made if supervised(s)]
            self.skipped = len(made) - len(self._seqs)
        return self._seqs


def _written(path: Path) -> int | None:
    """When the file at `path` was last written (None: it has gone since it was listed)."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class UnreadableTensors(ValueError):
    """A tensor file that is not one this project wrote, or that claims more than it holds: the reason, for its
    reader's one-line error (`short_reason`)."""


def short_reason(e: BaseException) -> str:
    """`Type: first sentence` of an exception, for a one-line error (torch's own messages run to paragraphs); an
    UnreadableTensors' reason as it is."""
    if isinstance(e, UnreadableTensors):
        return str(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". ")[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_tensors(path: Path, mmap: bool = False):
    """torch.load of a file this project wrote, with weights_only=True (nothing in the file is executed) and torch's
    warnings about foreign pickle protocols silenced: a file that is not one is the caller's one-line error. `mmap`:
    tensors mapped, not read (what a caller that only counts rows needs).

    Nothing loaded can claim more memory than the file holds: the file must be torch.save's zip archive with every
    record stored, not compressed (a deflated record of zeros inflates a few MB into GBs), and every tensor in it a
    dense CPU tensor whose elements the bytes behind it hold (a doctored shape or stride -- a stride of 0 -- could
    make one stored number 10^12 elements, which the first copy of it would allocate; a meta or sparse tensor
    declares a shape and holds no data; a mapped tensor whose record is shorter than the pickle declares would read
    the records after it), all of them together no more bytes than the file. UnreadableTensors saying what is
    wrong otherwise. The file is the same one before its checks and after its load (device, inode, size and
    modification time), or read again: a shard written again while it is read (atomically, by data generation
    running alongside) must not be checked as one file and loaded as the other."""
    for _ in range(_READ_TRIES):
        before = _identity(path)
        try:
            held = _load_checked(path, mmap)
        except Exception:  # what the file checked or read says, unless it was not the file the other one was
            if _identity(path) == before:
                raise
            continue
        if _identity(path) == before:
            return held
    raise UnreadableTensors(f"replaced while it was read, {_READ_TRIES} times running")


_READ_TRIES = 3


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _load_checked(path: Path, mmap: bool):
    import warnings

    size, records = _check_archive(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            held = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
        except RuntimeError:  # torch reads no record shorter than its tensor: mapped, that tensor is named
            if not mmap:
                _load_checked(path, mmap=True)
            raise
    problem = _tensors_problem(held, size, records if mmap else None)
    if problem:
        raise UnreadableTensors(problem)
    return held


def _check_archive(path: Path) -> tuple[int, dict[int, int]]:
    """The size of the file at `path`, refused (UnreadableTensors) unless it is a zip archive of stored records
    (torch.save's format), and where each tensor data record (`<archive>/data/<key>`) starts in the file and how
    many bytes it holds ({offset: size}). Only its directory and the records' local headers are read."""
    import re
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
    except zipfile.BadZipFile:
        raise UnreadableTensors("not a whole zip archive, the format torch.save writes") from None
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.compress_size != m.file_size:
            raise UnreadableTensors(f"its record {m.filename} is compressed; torch.save stores every record as it is")
    size = Path(path).stat().st_size
    if sum(m.file_size for m in members) > size:
        raise UnreadableTensors(f"its records declare more bytes than the file's {size}")
    records = {}
    with open(path, "rb") as f:
        for m in members:
            if re.fullmatch(r"[^/]+/data/[^/]+", m.filename):
                f.seek(m.header_offset)
                header = f.read(30)  # a local file header: its name's and extra field's lengths at 26 and 28
                if len(header) < 30 or header[:4] != b"PK\x03\x04":
                    raise UnreadableTensors(f"its record {m.filename} has no local header")
                start = m.header_offset + 30 + int.from_bytes(header[26:28], "little") \
                    + int.from_bytes(header[28:30], "little")
                records[start] = m.file_size
    return size, records


def _tensors_problem(obj, size: int, records: dict[int, int] | None = None) -> str | None:
    """What makes the tensors inside `obj` (lists, tuples and dicts of them) unusable, or None: one that is not a
    dense CPU tensor, or has more elements than the bytes behind it hold (named by where it lies: `[0]['taps']`), or
    all of them together more bytes than the file's `size` (views of one stored tensor, or one tensor many times).
    The bytes behind a tensor read are its storage's (torch.load reads a record into it only when the record holds
    all of the bytes the pickle declares); behind a mapped one (`records`, _check_archive's), the record's in the
    file that its storage is mapped on."""
    tensors = _tensors_in(obj)
    for where, t in tensors:  # in the file's order: the first bad tensor is named
        problem = _layout_problem(t)
        if problem:
            return f"the tensor at {where} {problem}"
    backing = None if records is None else _mapped_records(tensors, records)
    if isinstance(backing, str):
        return backing
    total = 0
    for where, t in tensors:
        storage = t.untyped_storage()
        held = (storage.nbytes() if backing is None else backing[storage.data_ptr()]) // t.element_size()
        if t.numel() > held:
            return f"the tensor at {where} claims {t.numel()} elements {tuple(t.shape)} and holds {held}"
        total += t.numel() * t.element_size()
    if total > size:
        return f"its tensors claim {total} bytes, more than the file's {size}"
    return None


def _tensors_in(obj) -> list[tuple[str, torch.Tensor]]:
    """The tensors inside `obj` (lists, tuples and dicts of them), each with where it lies (`[0]['taps']`), in the
    file's order."""
    import collections

    todo, seen, found = collections.deque([("", obj)]), set(), []
    while todo:
        where, x = todo.popleft()
        if isinstance(x, torch.Tensor):
            found.append((where or "the top", x))
        elif isinstance(x, (dict, list, tuple)) and id(x) not in seen:
            seen.add(id(x))
            items = x.items() if isinstance(x, dict) else enumerate(x)
            todo.extend((f"{where}[{k!r}]", v) for k, v in items if isinstance(v, (torch.Tensor, dict, list, tuple)))
    return found


def _layout_problem(t: torch.Tensor) -> str | None:
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_nested or t.is_quantized:
        return f"is not a dense CPU tensor ({t.device.type}, {t.layout}{', nested' if t.is_nested else ''})"
    return None


def _mapped_records(tensors: list[tuple[str, torch.Tensor]], records: dict[int, int]) -> dict[int, int] | str:
    """The bytes of the record behind each mapped tensor's storage, by the storage's address. torch.load maps a
    storage from its record's first byte for as many bytes as the pickle declares, whatever the record holds; and
    torch.save writes one record per storage, so in address order the storages are the data records in file order,
    each as far from the first as its record is. A file whose storages are not so is refused."""
    starts = sorted({t.untyped_storage().data_ptr() for _, t in tensors})
    offsets = sorted(records)
    if len(starts) != len(offsets) or len({a - o for a, o in zip(starts, offsets)}) > 1:
        return (f"its tensors use {len(starts)} storages that are not its {len(offsets)} data records, one each, "
                "as torch.save writes them")
    return {a: records[o] for a, o in zip(starts, offsets)}


def shard_done(path: Path, rows: int) -> bool:
    """Whether the shard at `path` exists and holds at least `rows` rows. The last shard of a run asked for fewer
    prompts holds fewer: it is not done, and is made again whole (written atomically over it) rather than trusted
    as this run's. Its tensors are mapped, not read; a file torch cannot read is one error naming it."""
    if not path.is_file():
        return False
    try:
        held = load_tensors(path, mmap=True)
        if not isinstance(held, list):
            raise UnreadableTensors("not a list of rows")
    except Exception as e:  # a corrupt shard is never trained on, nor silently replaced
        raise DFlashError(f"unreadable data shard ({short_reason(e)}); delete it to regenerate",
                          path=path) from None
    return len(held) >= rows


def load_shards(directory: Path, vocab_size: int | None = None, tap_width: int | None = None,
                topk: int | None = None) -> list[TrainSequence]:
    """The sequences of `directory`'s shards; with `vocab_size` / `tap_width` / `topk`, each checked against the
    target and the recipe (ids in its vocabulary, taps of its width, `topk` soft targets per answer token) so that a
    shard made for another target is named, not trained on. A shard of 2 or more sequences none of which supervises
    a position (`supervised`) is refused too: a target's greedy answers to that many prompts never all stop at once
    unless its stop tokens or prompts are wrong, or the shard was cut. One short answer among others, or alone in a
    short last shard, is kept: a trainer skips it (ShardLoader)."""
    seqs = []
    for p in shard_paths(directory):
        try:
            rows = load_tensors(p)
            new = [TrainSequence(**r) for r in rows]
        except Exception as e:  # a corrupt shard is never trained on
            raise DFlashError(f"unreadable data shard ({short_reason(e)}); delete it to regenerate",
                              path=p) from None
        for i, s in enumerate(new):
            problem = sequence_problem(s, vocab_size, tap_width, topk)
            if problem:
                raise DFlashError(f"invalid data shard (sequence {i}: {problem}); delete it to regenerate", path=p)
        if len(new) > 1 and not any(supervised(s) for s in new):
            raise DFlashError(f"invalid data shard (none of its {len(new)} answers is 2 or more tokens long, so it "
                              "supervises no position: the target stopped at once for every prompt); check the "
                              "target's stop tokens and the recipe's prompts (chat_template), or delete it to "
                              "regenerate", path=p)
        seqs.extend(new)
    return seqs


def sequence_problem(s: TrainSequence, vocab_size: int | None = None, tap_width: int | None = None,
                     topk: int | None = None) -> str | None:
    """What makes `s` unusable for training (shapes and dtypes other than the data step writes, ids outside
    `vocab_size`, taps not `tap_width` wide, other than `topk` soft targets per answer token), or None."""
    tensors = {"ids": s.ids, "taps": s.taps, "top_ids": s.top_ids, "top_logp": s.top_logp}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
    if s.ids.dim() != 1 or s.ids.dtype != torch.long or len(s.ids) < 2:
        return f"ids must be a 1-D int64 tensor of 2 or more tokens, got {s.ids.dtype} {tuple(s.ids.shape)}"
    n = len(s.ids)
    if not is_int(s.prompt_len) or not 1 <= s.prompt_len <= n:
        return f"prompt_len {s.prompt_len!r} outside 1..{n}"
    if not is_int(s.index) or not isinstance(s.teacher_forced, bool):
        return "index must be an integer and teacher_forced a bool"
    if s.taps.dim() != 2 or s.taps.dtype != torch.float16 or len(s.taps) != n \
            or (tap_width is not None and s.taps.shape[1] != tap_width):
        want = f"[{n}, {tap_width if tap_width is not None else 'width'}]"
        return f"taps must be a float16 tensor {want}, got {s.taps.dtype} {tuple(s.taps.shape)}"
    r = n - s.prompt_len
    if s.top_ids.dim() != 2 or s.top_ids.dtype != torch.long or s.top_ids.shape[0] != r or s.top_ids.shape[1] < 1 \
            or (topk is not None and s.top_ids.shape[1] != topk):
        return f"top_ids must be an int64 tensor [{r}, {topk or 'k'}], got {s.top_ids.dtype} {tuple(s.top_ids.shape)}"
    if s.top_logp.shape != s.top_ids.shape or s.top_logp.dtype != torch.float32 \
            or not bool((s.top_logp <= 0).all()):
        return (f"top_logp must be float32 log-probabilities (<= 0, no NaN) shaped like top_ids "
                f"{tuple(s.top_ids.shape)}")
    no_finite = (~torch.isfinite(s.top_logp).any(dim=1)).nonzero()
    if len(no_finite):  # every top-k entry -inf: no distribution, and the soft loss's softmax of it is NaN
        return f"top_logp row {int(no_finite[0])} holds no finite log-probability (all -inf)"
    if vocab_size is not None:
        for name, t in (("ids", s.ids), ("top_ids", s.top_ids)):
            if t.numel() and not (0 <= int(t.min()) and int(t.max()) < vocab_size):
                return f"{name} outside the target vocabulary (0..{vocab_size - 1})"
    return None


def generate_shards(target, prompt_source: Callable[[], list], directory: Path,
                    tap_ids: Sequence[int], max_new_tokens: int, num_prompts: int, batch_size: int, topk: int,
                    deadline: float | None = None, progress: Callable[[int, int, float], None] | None = None,
                    teacher_forced: bool = False) -> int:
    """Fill `directory` with shards of SHARD_SIZE sequences until `num_prompts` prompts are covered (or `deadline`).

    Shard i always holds prompts [i*SHARD_SIZE, (i+1)*SHARD_SIZE) of `prompt_source()`'s fixed order, so an interrupted
    run resumes where it stopped and two runs agree. Each shard is written atomically. Returns sequences on disk.
    `teacher_forced`: the source yields (index, prompt + reply ids, prompt length) and no generation happens."""
    prompts = prompt_source()[:num_prompts]
    if not prompts:
        raise DFlashError("the prompt set is empty", field="prompts")
    done = 0
    tokens = 0
    t0 = time.perf_counter()
    for i, s0 in enumerate(range(0, len(prompts), SHARD_SIZE)):
        path = directory / f"shard-{i:05d}.pt"
        chunk = prompts[s0:s0 + SHARD_SIZE]
        if not shard_done(path, len(chunk)):
            if deadline is not None and time.time() > deadline:
                break
            if teacher_forced:
                # 8 rows per forward: measured 446 tok/s vs 299 at 32 (less padding, smaller [B, S, V] logits)
                seqs = teacher_forced_sequences(target, chunk, tap_ids, min(batch_size, 8), topk)
            else:
                seqs = generate_sequences(target, chunk, tap_ids, max_new_tokens, batch_size, topk)
            tokens += sum(len(s.ids) - s.prompt_len for s in seqs)
            try:
                with atomic_file(path, "wb") as f:
                    torch.save([s.to_dict() for s in seqs], f)
            except OSError as e:
                raise DFlashError(f"cannot write training data ({e.strerror or e})", path=path) from None
        done += len(chunk)
        if progress is not None:
            progress(done, len(prompts), tokens / max(1e-9, time.perf_counter() - t0))
    return done


MAX_CHARS_PER_TOKEN = 6  # more characters than any prompt's tokens ever span: longer text is skipped untokenized


def chat_prompt_ids(tokenizer, text: str, use_template: bool = True) -> list[int]:
    return chat_ids(tokenizer, [("user", text)], use_template)


def chat_ids(tokenizer, messages, use_template: bool = True) -> list[int]:
    """`messages` ((role, text), ending with a user turn) chat-templated for the assistant's answer; without a
    template (`use_template` False: a recipe's `chat_template: false`, or a tokenizer without one), their texts one
    per line, tokenized as they are: no special token added (the runtime's TextCodec.encode_prompt, which `run`,
    `bench` and the server encode prompts with)."""
    if use_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                            add_generation_prompt=True,
                                            return_dict=False)  # transformers 5 returns a BatchEncoding otherwise
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer("\n".join(t for _, t in messages), add_special_tokens=False)["input_ids"])


def sharegpt_prompt_ids(target, split: str, max_prompt_tokens: int, seed: int, shuffle: bool = True,
                        limit: int | None = None, chat_template: bool = True) -> list[tuple[int, list[int]]]:
    """ShareGPT first-turn prompts of `split`, chat-templated (`chat_template`, the recipe's: else the text as it
    is, `chat_ids`), at most `max_prompt_tokens` tokens, in a seeded order; with `limit`, the first `limit` of them
    (the same as the whole list's first `limit`): chat-templating and tokenizing stop there, which for a few hundred
    prompts of the SmolLM2 recipe's train split takes a second instead of the ~50 s the whole split's 7 500 first
    turns took on a shared 2-core EPYC."""
    return _seeded_fitting(sharegpt_prompts(split), seed if shuffle else None, limit,
                           lambda p: _fitting_prompt_ids(target.tokenizer, p.text, max_prompt_tokens, chat_template))


def sharegpt_conversation_ids(target, split: str, max_prompt_tokens: int, seed: int,
                              limit: int | None = None) -> list[tuple[int, list[int]]]:
    """Every user turn of `split` with as much of the conversation before it as fits `max_prompt_tokens` (whole
    user / assistant pairs, the oldest dropped first), chat-templated, in a seeded order: (record index, ids). A turn
    whose own message does not fit is skipped. Later turns are most of ShareGPT's user messages (a record holds ~3),
    and their answers lean on the conversation: more prompts, and more of the copying a drafter must learn, than
    first turns alone."""
    from dflash_export.train.sharegpt import sharegpt_conversations

    return _seeded_fitting(sharegpt_conversations(split), seed, limit,
                           lambda c: _fitting_conversation_ids(target.tokenizer, c.messages, max_prompt_tokens))


def _seeded_fitting(items: list, seed: int | None, limit: int | None, ids_of) -> list[tuple[int, list[int]]]:
    """(item.index, ids_of(item)) for the items whose ids fit (not None), in the order `seed` shuffles them to (None:
    as given), stopping once `limit` are found: tokenizing stops there too."""
    import random

    if seed is not None:
        random.Random(seed).shuffle(items)
    out = []
    for item in items:
        if limit is not None and len(out) >= limit:
            break
        ids = ids_of(item)
        if ids is not None:
            out.append((item.index, ids))
    return out


def _fitting_conversation_ids(tokenizer, messages, max_prompt_tokens: int, chat_template: bool = True
                              ) -> list[int] | None:
    budget = MAX_CHARS_PER_TOKEN * max_prompt_tokens  # text longer than this cannot fit: not tokenized
    if len(messages[-1][1]) > budget:
        return None
    start = len(messages) - 1
    while start >= 2 and sum(len(t) for _, t in messages[start - 2:]) <= budget:
        start -= 2
    for s in range(start, len(messages), 2):
        ids = chat_ids(tokenizer, messages[s:], chat_template)
        if len(ids) <= max_prompt_tokens:
            return ids
    return None


def _fitting_prompt_ids(tokenizer, text: str, max_prompt_tokens: int, chat_template: bool = True) -> list[int] | None:
    """The prompt, chat-templated or not (`chat_ids`), or None when it is longer than `max_prompt_tokens`."""
    return _fitting_conversation_ids(tokenizer, [("user", text)], max_prompt_tokens, chat_template)


def sharegpt_reply_ids(target, split: str, max_prompt_tokens: int, max_reply_tokens: int, seed: int,
                       chat_template: bool = True) -> list[tuple[int, list[int], int]]:
    """ShareGPT first turns with the dataset's own first answer, for teacher-forced data: (index, prompt (templated
    or not as `sharegpt_prompt_ids`) + answer tokens, prompt length), the answer cut at `max_reply_tokens` (an uncut
    one ends with the stop token, as a generated one would), in a seeded order. The order is not the prompt-only
    source's, so the two sets overlap only partly and together cover more distinct prompts."""
    import random

    prompts = [p for p in sharegpt_prompts(split) if p.reply]
    random.Random(seed + 7919).shuffle(prompts)
    tok = target.tokenizer
    stop = next(iter(target.stop_token_ids), None)
    out = []
    for p in prompts:
        ids = _fitting_prompt_ids(tok, p.text, max_prompt_tokens, chat_template)
        if ids is None:
            continue
        reply = tok(p.reply[: 8 * max_reply_tokens], add_special_tokens=False)["input_ids"]
        if len(reply) < max_reply_tokens and stop is not None:
            reply = reply + [stop]
        reply = reply[:max_reply_tokens]
        if len(reply) >= 2:
            out.append((p.index, ids + reply, len(ids)))
    return out


def synthetic_prompt_ids(vocab_size: int, n: int, seed: int, reserved: int = 2) -> list[tuple[int, list[int]]]:
    """Random token prompts for tokenizer-less tiny targets (the top `reserved` ids -- eos, mask -- excluded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 17, (1,), generator=g))
        out.append((i, torch.randint(1, vocab_size - reserved, (length,), generator=g).tolist()))
    return out
