"""One generation request as the Triton model sees it: named input arrays in, text chunks + acceptance stats out.

Kept free of `triton_python_backend_utils` so the request contract (validation, stop strings, streaming deltas) runs
and is tested in-process; `triton_model.py` only adapts it to Triton's tensors and responses. Every bad request raises
DFlashError whose message starts with the input it is about.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from dflash_export.decoding.request import (
    DEFAULT_MAX_TOKENS,
    FIELDS,
    FP32_MAX,
    INT64_MAX,
    UINT64_MAX,
    SamplingParams,
    as_fp32,
    check_field,
    check_unicode,
    is_int,
    shown,
)
from dflash_export.errors import DFlashError, json_kind
from dflash_export.models.tokenization import max_token_chars, prompt_chars
from dflash_export.runtime.single import DFlashRuntime, RequestStopped, RunStats

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES_DEPTH = 8      # a list of {"role", "content"} objects is 2 deep


class RequestCancelled(Exception):
    """The request's client went away (or the server is shutting down): generation stopped between DFlash steps."""


# The typed inputs of the `dflash` models (deploy/repository.py writes them into config.pbtxt): name -> (Triton data
# type, dims). Every one is optional, so the generate endpoint works with {"text_input": "..."} alone.
INPUT_TYPES: dict[str, tuple[str, tuple[int, ...]]] = {
    "text_input": ("BYTES", (1,)),
    "messages": ("BYTES", (1,)),             # JSON list of {"role", "content"}
    "max_tokens": ("INT64", (1,)),           # 64-bit: no wrap of large values
    "temperature": ("FP32", (1,)),
    "top_p": ("FP32", (1,)),
    "top_k": ("INT64", (1,)),
    "seed": ("UINT64", (1,)),
    "stop": ("BYTES", (-1,)),
    "apply_chat_template": ("BOOL", (1,)),   # text_input through the chat template (default) or as raw text
    "input_ids": ("INT64", (-1,)),           # the prompt as token ids, instead of text_input / messages
}
# The most token ids an input_ids prompt may hold before the engine's own bound (its max_seq_len) is known.
MAX_PROMPT_IDS = 1 << 20


@dataclass
class GenerateRequest:
    prompt: str | list[dict]
    sp: SamplingParams
    stop: list[str] = field(default_factory=list)
    max_tokens_given: bool = True
    chat: bool = True
    ids: list[int] | None = None  # the prompt as token ids (input_ids): `prompt` is then ""


@dataclass
class Chunk:
    """Text produced since the previous chunk, plus running totals. The last chunk has `finish_reason` set."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    accepted_tokens: int
    drafted_tokens: int
    acceptance_length: float
    prompt_tokens: int = 0
    # the last chunk: per-step acceptance lengths, draft and verify seconds, the seconds it waited to join a shared
    # batch and that batch's K/V token bound (0: none)
    step_stats: dict | None = None


def _scalar(get: Callable[[str], np.ndarray | None], name: str, kind: str):
    arr = get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise DFlashError(f"expected one value, got shape {list(arr.shape)}", field=name)
    if kind == "bytes" and arr.dtype != np.object_ and arr.dtype.kind not in "SU":
        raise DFlashError(f"expected BYTES, got {arr.dtype}", field=name)
    if kind == "int" and arr.dtype.kind not in "iu":
        raise DFlashError(f"expected an integer, got {arr.dtype}", field=name)
    if kind == "bool" and arr.dtype.kind != "b":
        raise DFlashError(f"expected a boolean, got {arr.dtype}", field=name)
    if kind == "float" and arr.dtype.kind not in "fiu":
        raise DFlashError(f"expected a number, got {arr.dtype}", field=name)
    return arr.reshape(-1)[0]


def _text(value, name: str) -> str:
    if isinstance(value, str):
        return check_unicode(value, name)
    data = bytes(value)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DFlashError(f"invalid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})", field=name) from None


def _messages(text: str | list) -> list[dict]:
    """The message list, from its JSON text (or already decoded): a non-empty list of {"role", "content"} objects,
    roles among ROLES, no other keys."""
    if isinstance(text, str):
        try:
            msgs = json.loads(text)
        except json.JSONDecodeError as e:
            raise DFlashError(f"not valid JSON ({e.msg} at offset {e.pos})", field="messages") from None
        except ValueError:  # an integer literal past Python's int_max_str_digits
            raise DFlashError(f"a number with more than {sys.get_int_max_str_digits()} digits", field="messages"
                              ) from None
        except RecursionError:
            raise DFlashError("JSON nested too deeply", field="messages") from None
    else:
        msgs = text
    if not isinstance(msgs, list) or not msgs:
        raise DFlashError("expected a non-empty JSON list of {\"role\", \"content\"} objects", field="messages")
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DFlashError(f"item {i} is not an object with string \"role\" and \"content\"", field="messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise DFlashError(f"item {i}: unknown key {extra[0]!r} (a message has only \"role\" and \"content\")",
                              field="messages")
        if m["role"] not in ROLES:
            raise DFlashError(f"item {i}: unknown role {m['role'][:40]!r} (known: {', '.join(ROLES)})",
                              field="messages")
        check_unicode(m["role"], "messages")
        check_unicode(m["content"], "messages")
    return msgs


def check_generate_body(body) -> dict:
    """Check a JSON body for the generate / generate_stream endpoints before Triton sees it.

    Every field must be one of the model's inputs; the decoding fields obey their one rule (decoding/request.py's
    `check_field`: max_tokens an integer in 1..2^63-1, seed in 0..2^64-1, which Triton would otherwise wrap or
    misread); strings must be valid Unicode. Returns the body with `messages` as JSON text (a list given as such is
    accepted and encoded). Raises DFlashError naming the field.
    """
    if not isinstance(body, dict):
        raise DFlashError("expected a JSON object of named inputs", field="request body")
    known = tuple(INPUT_TYPES)
    for key in body:
        if key not in known:
            raise DFlashError(f"unknown field (known: {', '.join(known)})", field=check_unicode(key, "request body")
                              [:60])
    out = dict(body)
    for key in ("text_input",):
        if key in body and not isinstance(body[key], str):
            raise DFlashError(f"expected a string, got {json_kind(body[key])}", field=key)
        if key in body:
            check_unicode(body[key], key)
    if "input_ids" in body:
        ids = body["input_ids"]
        if not (isinstance(ids, list) and ids and all(is_int(t) for t in ids)):
            raise DFlashError(f"expected a non-empty list of token ids (integers), got {json_kind(ids)}"
                              + (" holding other values" if isinstance(ids, list) and ids else ""), field="input_ids")
        _check_ids(ids)
        if max(ids) > INT64_MAX:
            raise DFlashError(f"{shown(max(ids))} is out of INT64's range", field="input_ids")
        if "text_input" in body or "messages" in body:
            raise DFlashError("send one prompt: input_ids, text_input or messages", field="input_ids")
    if "messages" in body:
        if not isinstance(body["messages"], (str, list)):
            raise DFlashError(f"expected a list of {{\"role\", \"content\"}} objects (or its JSON text), got "
                              f"{json_kind(body['messages'])}", field="messages")
        out["messages"] = json.dumps(_messages(body["messages"]), ensure_ascii=False)
    if "apply_chat_template" in body and not isinstance(body["apply_chat_template"], bool):
        raise DFlashError(f"expected true or false, got {json_kind(body['apply_chat_template'])}",
                          field="apply_chat_template")
    for key in FIELDS:
        if key in body:
            checked = check_field(key, body[key])
            if (sent := as_fp32(key, checked)) != checked:
                out[key] = sent
    return out


def _check_ids(ids) -> None:
    """A prompt's token ids: at most MAX_PROMPT_IDS of them, none negative (the engine checks its vocabulary)."""
    if len(ids) > MAX_PROMPT_IDS:
        raise DFlashError(f"{len(ids)} token ids; a prompt takes at most {MAX_PROMPT_IDS}", field="input_ids")
    if min(int(t) for t in ids) < 0:
        raise DFlashError("a token id is negative", field="input_ids")


def parse_request(get: Callable[[str], np.ndarray | None]) -> GenerateRequest:
    """Read and type-check the inputs (`get(name)` returns the array or None when absent)."""
    text = _scalar(get, "text_input", "bytes")
    messages = _scalar(get, "messages", "bytes")
    ids_arr = get("input_ids")
    ids = None
    if ids_arr is not None:
        ids_arr = np.asarray(ids_arr).reshape(-1)
        if ids_arr.dtype.kind not in "iu":
            raise DFlashError(f"expected integers, got {ids_arr.dtype}", field="input_ids")
        if ids_arr.size == 0:
            raise DFlashError("empty prompt", field="input_ids")
        _check_ids(ids_arr)
        ids = [int(t) for t in ids_arr]
    if sum(x is not None for x in (text, messages, ids)) > 1:
        raise DFlashError("send one prompt: input_ids, text_input or messages", field="messages" if ids is None
                          else "input_ids")
    if text is None and messages is None and ids is None:
        raise DFlashError("missing input: send text_input (or messages as JSON, or input_ids)", field="text_input")
    if messages is not None:
        prompt: str | list[dict] = _messages(_text(messages, "messages"))
    elif ids is not None:
        prompt = ""
    else:
        prompt = _text(text, "text_input")
        if not prompt:
            raise DFlashError("empty prompt", field="text_input")

    # The tensors' types are Triton's (checked here); their values obey the fields' rules, applied when the
    # SamplingParams is made.
    given = {name: v for name, kind in (("max_tokens", "int"), ("temperature", "float"), ("top_p", "float"),
                                        ("top_k", "int"), ("seed", "int"))
             if (v := _scalar(get, name, kind)) is not None}
    max_tokens = given.pop("max_tokens", None)
    temperature = float(given.pop("temperature", 0.0))
    seed = given.pop("seed", None)
    if seed is None and temperature > 0:  # as OpenAI's API: without a seed every sampled answer is a fresh draw
        seed = secrets.randbits(63)
    sp = SamplingParams(max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens),
                        temperature=temperature, seed=0 if seed is None else int(seed),
                        **{k: (int if k == "top_k" else float)(v) for k, v in given.items()})
    chat = _scalar(get, "apply_chat_template", "bool")

    stop: list[str] = []
    stop_arr = get("stop")
    if stop_arr is not None:
        items = np.asarray(stop_arr).reshape(-1)
        if items.dtype != np.object_ and items.dtype.kind not in "SU":
            raise DFlashError(f"expected BYTES, got {items.dtype}", field="stop")
        stop = [s for s in check_field("stop", [_text(x, "stop") for x in items]) if s]
    return GenerateRequest(prompt, sp, stop, max_tokens is not None, True if chat is None else bool(chat), ids)


def prompt_char_limit(engine_dir) -> int | None:
    """The most characters of prompt text the engine in `engine_dir` can take: its room in tokens (max_seq_len minus
    one draft block and one new token) times the most characters one token covers (tokenization.max_token_chars).
    A longer prompt is refused before it is tokenized (tokenizing a megabyte takes seconds). None: no bound known."""
    from dflash_export.engines.manifest import read_manifest

    try:
        m = read_manifest(engine_dir, verify_files=False)
    except DFlashError:
        return None
    per_token = max_token_chars(engine_dir)
    if not m.max_seq_len or not per_token:
        return None
    return max(1, m.max_seq_len - m.block_size - 1) * per_token


def engine_block_size(engine_dir) -> int | None:
    """The block of the engine in `engine_dir`: the most tokens one DFlash step adds (None: no manifest read)."""
    from dflash_export.engines.manifest import read_manifest

    try:
        return read_manifest(engine_dir, verify_files=False).block_size
    except DFlashError:
        return None


def check_prompt_chars(prompt: str | list[dict], limit: int | None) -> None:
    """DFlashError naming the input when the prompt's text is over `limit` characters (see prompt_char_limit)."""
    n = prompt_chars(prompt)
    if limit is not None and n > limit:
        raise DFlashError(f"prompt text is {n} characters; this engine's context holds at most {limit} (its length "
                          "in tokens times the longest token's characters)",
                          field="messages" if isinstance(prompt, list) else "text_input")


class RequestRunner:
    """Runs parsed requests on one engine (one request at a time: an engine sequence is single-threaded)."""

    def __init__(self, runtime: DFlashRuntime, mode: str = "dflash", engine_dir=None):
        self.runtime = runtime
        self.mode = mode  # "ar": plain decoding on the same engine (deploy --plain)
        self.char_limit = prompt_char_limit(engine_dir) if engine_dir is not None else None

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.ids is not None:
            ids = list(req.ids)
        else:
            check_prompt_chars(req.prompt, self.char_limit)  # before the tokenizer spends seconds on it
            ids = self.runtime.encode(req.prompt, chat=req.chat)
        info = self.runtime.engine.info
        room = info.max_seq_len - info.block_size - 1
        if not ids:
            raise DFlashError("empty prompt (no tokens after encoding)", field="text_input")
        if len(ids) > room:
            raise DFlashError(f"prompt is {len(ids)} tokens; this engine takes at most {room} (max_seq_len "
                              f"{info.max_seq_len} minus one draft block of {info.block_size} and one new token)",
                              field="input_ids" if req.ids is not None else
                              "messages" if isinstance(req.prompt, list) else "text_input")
        if not req.max_tokens_given:
            # Without an explicit max_tokens, generate as much as fits rather than refuse a long prompt.
            room = max(1, min(req.sp.max_new_tokens, info.max_seq_len - info.block_size - len(ids)))
            req.sp = dataclasses.replace(req.sp, max_new_tokens=room)
        return ids

    def run(self, req: GenerateRequest, cancelled: Callable[[], str | None] | None = None,
            stats: RunStats | None = None, stopped: Callable[[], bool] | None = None) -> Iterator[Chunk]:
        """Yield text deltas step by step; the last chunk carries `finish_reason` ("stop" / "length").

        Validation errors surface (as DFlashError) before the first chunk. Stop strings end the output *before* the
        stop string; text that might begin one is held back until it is decided. `cancelled()` is asked before the
        prompt and after every DFlash step; a reason (not None) stops the generation there with RequestCancelled, so
        a client that went away holds its instance for at most one more step. Behind a shared batch
        (`BatchingService`) it is also asked, as `cancelled(queued=True)`, while the request waits to join: a client
        that leaves then costs no prefill. `stats`: the RunStats the runtime fills for this request (a new one if
        None), e.g. for `cancelled` to count the steps the runtime ran. `stopped`: a cheap check that the request is
        cancelled, which a shared batch makes on its own thread before each step (True: the request leaves the
        batch there, however many of its events this thread has yet to read; then `cancelled()` says why).
        """
        if cancelled is not None and (why := cancelled()):
            raise RequestCancelled(why)
        ids = self.prompt_ids(req)
        self.runtime.check_request(ids, req.sp)
        codec = self.runtime.engine.codec
        stats = stats if stats is not None else RunStats()
        tokens: list[int] = []
        # Tokens each step added to the answer, from the events this request consumed (the first is the prefill's
        # token, no step's): accepted drafts + the target's token, the last step cut where the answer ends, so they
        # add up to the answer's tokens after the first, as `run` and `bench` count tau. Not `stats`, which a shared
        # batch fills on its own thread: it may already hold a step past the stop string, or not yet the last one.
        lengths: list[int] = []
        events = 0
        shown = 0
        hold = max((len(s) for s in req.stop), default=1) - 1
        while_queued: list[str] = []

        def ask_queued():
            why = cancelled(queued=True)
            if why is not None:
                while_queued.append(why)
            return why

        polls = cancelled is not None and getattr(self.runtime, "polls_cancel_while_queued", False)
        stops = stopped is not None and getattr(self.runtime, "stops_between_steps", False)
        for ev in _stopped_as_cancelled(self.runtime.stream(ids, req.sp, self.mode, stats=stats,
                                                            **({"cancelled": ask_queued} if polls else {}),
                                                            **({"stopped": stopped} if stops else {})), cancelled):
            if cancelled is not None and not ev.finished and (why := cancelled()):
                raise RequestCancelled(why)
            before = len(tokens)
            tokens.extend(ev.tokens)
            events += 1
            if events > 1:
                lengths.append(len(ev.tokens))
            text = codec.decode(tokens)
            reason = ev.finish_reason if ev.finished else None
            kept = len(tokens)
            start = max(0, shown - hold)
            cut = _first_stop(text, req.stop, start)
            if cut is not None:
                # Stop where steps of one token would have: at the first token that completes a stop string. A DFlash
                # step commits several, and neither the text (stop strings may overlap) nor the count of tokens may
                # depend on where the steps ended.
                for kept in range(before + 1, len(tokens) + 1):
                    upto = codec.decode(tokens[:kept]) if kept < len(tokens) else text
                    if (cut := _first_stop(upto, req.stop, start)) is not None:
                        break
                text, reason = upto[:cut], "stop"
                if events > 1:  # the step's tokens past the one completing the stop string are not in the answer
                    lengths[-1] = kept - before
            if reason is None:
                # Never split a multi-byte character or a possible stop string across chunks: the stop string may
                # begin in the last `hold` characters of the complete text (an incomplete UTF-8 tail decodes as
                # U+FFFD, which is no character of the answer yet).
                safe = len(text.rstrip("\ufffd")) - hold
                if safe <= shown:
                    continue
                delta, shown = text[shown:safe], safe
            else:
                if reason == "length":  # cut mid-character by max_tokens: its incomplete UTF-8 tail never shows
                    text = text.rstrip("\ufffd") if len(text.rstrip("\ufffd")) >= shown else text
                delta, shown = text[shown:], len(text)
            final = {"acceptance_lengths": list(lengths), "draft_s": round(stats.draft_s, 6),
                     "verify_s": round(stats.verify_s, 6), "admission_wait_s": round(stats.admission_wait_s, 6),
                     "kv_token_limit": stats.kv_token_limit} if reason is not None else None
            tau = sum(lengths) / len(lengths) if lengths else 1.0
            yield Chunk(delta, reason, kept, sum(lengths) - len(lengths), stats.drafted_tokens, tau, len(ids), final)
            if reason is not None:
                return
        if while_queued:  # the stream ended before the request joined the batch
            raise RequestCancelled(while_queued[0])


def _stopped_as_cancelled(events: Iterator, cancelled: Callable[[], str | None] | None) -> Iterator:
    """`events`, a shared batch's RequestStopped (its stop check dropped the request) raised as RequestCancelled
    saying why the request was cancelled."""
    try:
        yield from events
    except RequestStopped:
        why = cancelled() if cancelled is not None else None
        raise RequestCancelled(why or "cancelled") from None


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def generate_text(runner: RequestRunner, req: GenerateRequest,
                  cancelled: Callable[[], str | None] | None = None, stats: RunStats | None = None,
                  stopped: Callable[[], bool] | None = None) -> Chunk:
    """The whole output as one chunk (the non-streaming model's response)."""
    parts: list[str] = []
    last = None
    for chunk in runner.run(req, cancelled, stats, stopped):
        parts.append(chunk.text)
        last = chunk
    assert last is not None
    return Chunk("".join(parts), last.finish_reason, last.completion_tokens, last.accepted_tokens,
                 last.drafted_tokens, last.acceptance_length, last.prompt_tokens, last.step_stats)


_JSON_TYPES = {"BYTES": "a string", "BOOL": "a boolean", "INT64": "an integer", "UINT64": "an integer",
               "FP32": "a number"}
_RANGES = {"INT64": (-(1 << 63), INT64_MAX), "UINT64": (0, UINT64_MAX)}
MAX_INFER_ELEMENTS = 64


def check_infer_body(body, binary_bytes: int = 0) -> dict:
    """Check an /infer (KServe v2) body input by input before Triton decodes it: only the model's inputs, each with
    its own data type, a shape that fits its dims, and `data` whose JSON values have that type and range (Triton
    answers 500 to an INT64 1.5, a "x" or a 2^63, and wraps a UINT64 -1); binary tensors must account for exactly
    the bytes after the JSON. Returns the body; DFlashError naming the input otherwise."""
    if not isinstance(body, dict):
        raise DFlashError("expected a JSON object", field="request body")
    for key in body:
        if key not in ("id", "inputs", "outputs", "parameters"):
            raise DFlashError("unknown field (known: id, inputs, outputs, parameters)", field=str(key)[:60])
    if "id" in body and not isinstance(body["id"], str):
        raise DFlashError(f"expected a string, got {json_kind(body['id'])}", field="id")
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise DFlashError("expected a JSON object", field="parameters")
    inputs = body.get("inputs")
    if not isinstance(inputs, list):
        raise DFlashError("expected a list of input tensors", field="inputs")
    seen, binary = set(), 0
    for i, t in enumerate(inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise DFlashError("expected an object with a string \"name\"", field=f"inputs[{i}]")
        name = t["name"]
        if name not in INPUT_TYPES:
            raise DFlashError(f"unknown input (known: {', '.join(INPUT_TYPES)})", field=f"inputs[{i}].name")
        if name in seen:
            raise DFlashError("given twice", field=name)
        seen.add(name)
        extra = sorted(set(t) - {"name", "datatype", "shape", "data", "parameters"})
        if extra:
            raise DFlashError(f"unknown key {extra[0][:40]!r}", field=name)
        dtype, dims = INPUT_TYPES[name]
        if t.get("datatype") != dtype:
            raise DFlashError(f"datatype must be {dtype}, got {str(t.get('datatype'))[:20]!r}", field=name)
        shape = t.get("shape")
        if not (isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape) and len(shape) in (1, 2)):
            raise DFlashError("shape: expected a list of one or two non-negative integers", field=name)
        n = 1
        for d in shape:
            n *= d
        most = MAX_PROMPT_IDS if name == "input_ids" else MAX_INFER_ELEMENTS
        if n > most or (dims != (-1,) and n != 1):
            takes = "one value" if dims != (-1,) else f"at most {most} values"
            raise DFlashError(f"shape {shape}: this input takes {takes}", field=name)
        tp = t.get("parameters", {})
        if not isinstance(tp, dict):
            raise DFlashError("parameters: expected a JSON object", field=name)
        if "binary_data_size" in tp:
            size = tp["binary_data_size"]
            if not is_int(size) or size < 0 or "data" in t:
                raise DFlashError("binary_data_size: a byte count, and no \"data\" beside it", field=name)
            if dtype != "BYTES" and size != n * {"BOOL": 1, "INT64": 8, "UINT64": 8, "FP32": 4}[dtype]:
                raise DFlashError(f"binary_data_size {size} does not fit shape {shape} of {dtype}", field=name)
            binary += size
            continue
        data = t.get("data")
        flat = _flatten(data, name, most)
        if len(flat) != n:
            raise DFlashError(f"data holds {len(flat)} values, shape {shape} needs {n}", field=name)
        for v in flat:
            ok = {"BYTES": isinstance(v, str), "BOOL": isinstance(v, bool),
                  "FP32": isinstance(v, (int, float)) and not isinstance(v, bool)
                  and (isinstance(v, int) or math.isfinite(v)),  # an integer is checked against the range below
                  }.get(dtype, is_int(v))
            if not ok:
                raise DFlashError(f"expected {_JSON_TYPES[dtype]} ({dtype}), got {json_kind(v)}", field=name)
            if dtype in _RANGES and not _RANGES[dtype][0] <= v <= _RANGES[dtype][1] or \
                    dtype == "FP32" and not -FP32_MAX <= v <= FP32_MAX:
                raise DFlashError(f"{shown(v)} is out of {dtype}'s range", field=name)
            if isinstance(v, str):
                check_unicode(v, name)
        if name in FIELDS:  # the decoding fields obey their rules before the request is queued
            checked = check_field(name, flat if name == "stop" else flat[0])
            if (sent := as_fp32(name, checked)) != checked:
                t["data"] = [sent]
    if binary != binary_bytes:
        raise DFlashError(f"binary tensors declare {binary} bytes, the body carries {binary_bytes} after the JSON",
                          field="Inference-Header-Content-Length")
    outputs = body.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise DFlashError("expected a list of {\"name\": ...} objects", field="outputs")
    return body


def _flatten(data, name: str, most: int) -> list:
    """An /infer input's `data` as a flat list, read no further than `most` + 1 values."""
    if not isinstance(data, list):
        raise DFlashError(f"data: expected a list, got {json_kind(data)}", field=name)
    out, stack = [], [data]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(reversed(v))
        else:
            out.append(v)
        if len(out) > most:
            break
    return out
