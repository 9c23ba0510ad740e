"""The OpenAI-compatible API of the front, as pure functions: an OpenAI request body -> the `generate` body the
`dflash` models take (deploy/handler.py), and the models' answers -> OpenAI's response, stream chunk and error
shapes. The engine-side protocol stays Triton's; nothing here touches a socket.

Served: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` with `stream` (server-sent events ending
in `data: [DONE]`, `stream_options.include_usage` and vLLM's `continuous_usage_stats`: usage so far on every chunk),
`usage`, `max_tokens` / `max_completion_tokens`, `stop`, `seed`, `temperature`, `top_p`, vLLM's `top_k`, `n` choices
(the front makes one generate call per choice, `choice_bodies`), completion prompts of token ids and batches of
completion prompts (all strings or all token-id lists; n choices of each; MAX_CHOICES answers in all).
Refused with a 400 naming the field: what this server cannot honour (tools, logprobs, penalties, logit_bias, `echo`,
`suffix`, `best_of` > 1, a non-text `response_format`), fields OpenAI does not define, and a `prompt` list mixing
strings, token ids and lists (`prompt[k]`, its first element of another kind). A field that changes
nothing here (`user`, `metadata`, `store`, `parallel_tool_calls` without tools, `service_tier`) is accepted and
ignored, as OpenAI's own server does for them.
"""

from __future__ import annotations

import json
import math
import secrets
import time

from dflash_export.decoding.request import UINT64_MAX, as_fp32, check_field, choice_seed, shown
from dflash_export.decoding.request import check_unicode as _check_unicode
from dflash_export.errors import DFlashError, json_kind

_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier")
_COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", *_IGNORED)
CHAT_FIELDS = (*_COMMON, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
               "function_call", "response_format", "modalities", "audio", "prediction", "reasoning_effort")
COMPLETION_FIELDS = (*_COMMON, "prompt", "echo", "suffix", "best_of")
ROLES = ("system", "user", "assistant", "developer")


class OpenAIError(Exception):
    """A request refused in OpenAI's error shape: HTTP status, message, the offending field (`param`), type."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# OpenAI's max_tokens for a completion that sets none (a chat completion without one gets what fits).
COMPLETION_MAX_TOKENS = 16
# The most choices (`n`) one request may ask for: each is a generation of its own in the engine's batch and queue,
# and 16 covers the sampled answers evaluation harnesses ask for (pass@k with n = 4..16) while keeping one request
# from filling a shared batch (`--max-batch` 16 is a usual size) by itself.
MAX_CHOICES = 16


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


def _number(body: dict, key: str, lo: float, hi: float):
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(key, f"expected a number, got {json_kind(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(key, f"must be a finite number, got {v}")
    if not lo <= v <= hi:  # an integer compared as it is: JSON's may be too large for a float
        raise _bad(key, f"must be in [{lo:g}, {hi:g}], got {shown(v)}")
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int):
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(key, f"expected an integer, got {json_kind(v)}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be in {lo}..{hi}, got {shown(v)}")
    return v


def _refuse_unsupported(body: dict) -> None:
    """Fields this server cannot honour get a 400 naming them (never silently ignored)."""
    _integer(body, "n", 1, MAX_CHOICES)
    if _integer(body, "best_of", 1, 128) not in (None, 1):
        raise _bad("best_of", "only best_of = 1 is supported (choosing the best of several answers needs their log "
                              "probabilities, which this server does not return; ask for `n` answers instead)")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, -2.0, 2.0) not in (None, 0.0):
            raise _bad(key, "penalties are not supported (they would change the target's distribution, and "
                            "DFlash's output is the target's own)")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _bad("logit_bias", f"expected an object, got {json_kind(bias)}")
    if bias:
        raise _bad("logit_bias", "not supported")
    if body.get("logprobs") is not None and body["logprobs"] is not False:  # 0 is no boolean (chat) and still
        raise _bad("logprobs", "log probabilities are not returned by this server")  # asks (completions)
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or top != 0):
        raise _bad("top_logprobs", "log probabilities are not returned by this server")
    for key in ("tools", "functions"):
        if body.get(key):
            raise _bad(key, "tool calling is not supported")
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none", "auto"):
            raise _bad(key, "tool calling is not supported")
    if body.get("echo") not in (None, False):
        raise _bad("echo", "not supported")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "not supported")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _bad("response_format", "only {\"type\": \"text\"} is supported")
    for key in ("modalities", "audio", "prediction", "reasoning_effort"):
        if body.get(key) not in (None, ["text"]):
            raise _bad(key, "not supported")


def _common(body: dict, known: tuple[str, ...], model_id: str, max_tokens_keys: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body: expected a JSON object")
    for key in body:
        _check_unicode(key, "request body")
        if key not in known:
            raise _bad(key[:60], "unknown field")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", f"required: the model id (this server serves {model_id!r}), got {json_kind(model)}")
    if model != model_id:
        raise OpenAIError(404, f"model {model[:80]!r} is not served here (this server serves {model_id!r})",
                          param="model", code="model_not_found")
    _refuse_unsupported(body)
    if not isinstance(body.get("stream", False), bool):
        raise _bad("stream", f"expected a boolean, got {json_kind(body['stream'])}")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "expected {\"include_usage\": true|false}")
        if not body.get("stream"):
            raise _bad("stream_options", "only allowed with stream: true")
        for key in ("include_usage", "continuous_usage_stats"):
            if key in so and not isinstance(so[key], bool):
                raise _bad(f"stream_options.{key}", f"expected true or false, got {json_kind(so[key])}")
    given = [k for k in max_tokens_keys if body.get(k) is not None]
    if len(given) > 1 and body[given[0]] != body[given[1]]:
        raise _bad(given[1], f"disagrees with {given[0]}: give one")
    # OpenAI's spellings of the decoding fields, translated; their values then obey the fields' one rule
    # (decoding/request.py), which names the field the client sent.
    fields = {"max_tokens": (body[given[0]], given[0])} if given else {}
    for key in ("temperature", "top_p", "top_k", "seed", "stop"):
        if body.get(key) is not None:
            fields[key] = (body[key], key)
    if "top_k" in fields and fields["top_k"][0] == -1 and type(fields["top_k"][0]) is int:
        fields["top_k"] = (0, "top_k")  # vLLM: -1 (and 0) mean no top-k
    if "seed" in fields:
        # OpenAI's seed is a signed 64-bit integer; the engine's is unsigned: negatives map two's-complement.
        seed = _integer(body, "seed", -(1 << 63), UINT64_MAX)
        fields["seed"] = (seed & UINT64_MAX, "seed")
    try:
        out = {key: check_field(key, value, field) for key, (value, field) in fields.items()}
    except DFlashError as e:
        raise from_dflash_error(e) from None
    if out.get("temperature", 0.0) > 2.0:  # OpenAI's own bound, narrower than the engine's
        raise _bad("temperature", f"must be in [0, 2], got {shown(body['temperature'])}")
    out = {key: as_fp32(key, value) for key, value in out.items()}
    if "stop" in out:
        out["stop"] = [s for s in out["stop"] if s]
        if not out["stop"]:
            del out["stop"]
    return out


def chat_request(body, model_id: str) -> tuple[dict, bool, str | None]:
    """(generate body, stream, usage: `_usage`) for a /v1/chat/completions body; OpenAIError naming the field."""
    out = _common(body, CHAT_FIELDS, model_id, ("max_completion_tokens", "max_tokens"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty list of messages")
    converted = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "expected an object with a string \"role\"")
        role = m["role"]
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"{role[:40]!r} is not supported (supported: {', '.join(ROLES)})")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise _bad(f"messages[{i}].{extra[0][:40]}", "not supported")
        converted.append({"role": "system" if role == "developer" else role,
                          "content": _content(m.get("content"), f"messages[{i}].content")})
    out["messages"] = json.dumps(converted, ensure_ascii=False)  # the generate body's form: checked, as JSON text
    return out, bool(body.get("stream")), _usage(body)


def _content(c, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); other part types are refused."""
    if isinstance(c, str):
        return _check_unicode(c, where)
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise _bad(f"{where}[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(_check_unicode(p["text"], where))
        return "".join(parts)
    raise _bad(where, f"expected a string or a list of text parts, got {json_kind(c)}")


def completion_request(body, model_id: str) -> tuple[list[tuple[str, dict]], bool, str | None]:
    """(prompts: each the field the client sent it as and its generate body; stream; usage: `_usage`) for a
    /v1/completions body: each prompt as raw text, no chat template, or as token ids (`input_ids`). `prompt` is one
    prompt (a string, a list of token ids), sent as `prompt`, or a batch of them (a list of strings, a list of
    token-id lists), prompt k sent as `prompt[k]`, answered as OpenAI does: choice j of prompt k is choice k x n + j,
    each prompt's tokens counted once."""
    out = _common(body, COMPLETION_FIELDS, model_id, ("max_tokens",))
    if body.get("logprobs") is not None:  # a completion's logprobs 0 still asks for the chosen tokens' own
        raise _bad("logprobs", "log probabilities are not returned by this server")
    if "max_tokens" not in out:
        out["max_tokens"] = COMPLETION_MAX_TOKENS
    prompts = _completion_prompts(body.get("prompt"))
    if len(prompts) * choice_count(body) > MAX_CHOICES:
        raise _bad("prompt", f"{len(prompts)} prompts x n = {choice_count(body)} choices: a request may ask for at "
                             f"most {MAX_CHOICES} answers in all")
    return [(field, {**out, **_completion_prompt(p, field)}) for field, p in prompts], bool(body.get("stream")), \
        _usage(body)


# The kinds of element a list `prompt` may hold, one kind throughout: OpenAI's prompt is a string, a list of strings,
# a list of token ids or a list of token-id lists.
_PROMPT_ELEMENTS = {str: "strings", int: "token ids", list: "token-id lists"}


def _completion_prompts(prompt) -> list[tuple[str, object]]:
    """A completion's `prompt` as its prompts, each with the field it was sent as: one prompt (a string, a list of
    token ids) is `prompt`, prompt k of a batch (a list of strings, a list of token-id lists) `prompt[k]`. A list
    mixing strings, token ids and lists gets a 400 naming its first element of another kind than its first."""
    if not isinstance(prompt, list) or not prompt or type(prompt[0]) not in _PROMPT_ELEMENTS:
        return [("prompt", prompt)]  # one prompt (or none): `_completion_prompt` refuses what it is not
    kind = type(prompt[0])
    for k, p in enumerate(prompt):
        if type(p) is not kind:  # a boolean is no token id
            raise _bad(f"prompt[{k}]", f"{json_kind(p)} among {_PROMPT_ELEMENTS[kind]}: a prompt is a string, a "
                                       "list of strings, a list of token ids or a list of token-id lists, one kind "
                                       "throughout")
    return [("prompt", prompt)] if kind is int else [(f"prompt[{k}]", p) for k, p in enumerate(prompt)]


def _completion_prompt(prompt, where: str) -> dict:
    """The generate fields of one completion prompt: raw text (no chat template) or token ids."""
    if not prompt and isinstance(prompt, (str, list)):
        raise _bad(where, "empty prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return {"input_ids": prompt}  # token ids: the engine checks them against its vocabulary and context
    if isinstance(prompt, str):
        return {"text_input": _check_unicode(prompt, where), "apply_chat_template": False}
    raise _bad(where, "expected a string or a list of token ids (or a list of those: a batch of prompts)")


def choice_count(body: dict) -> int:
    """How many choices (`n`) a request that `chat_request` or `completion_request` accepted asks for."""
    return 1 if body.get("n") is None else body["n"]


def choice_bodies(gen: dict, n: int) -> list[dict]:
    """The generate bodies of a request's `n` choices, one generation each: `gen` for every one, its `seed` (when
    the request set one) replaced by choice i's own (decoding/request.py's `choice_seed`: choice 0 keeps the request's
    seed, so it is the answer the request with n = 1 gets). Without a seed each generation draws its own."""
    if "seed" not in gen:
        return [dict(gen) for _ in range(n)]
    return [{**gen, "seed": choice_seed(gen["seed"], i)} for i in range(n)]


def _usage(body: dict) -> str | None:
    """Where a stream carries usage: None, "final" (a last chunk of its own: include_usage) or "continuous"
    (also on every chunk, the tokens so far: vLLM's continuous_usage_stats, which asks include_usage too)."""
    so = body.get("stream_options") or {}
    if not so.get("include_usage"):
        return None
    return "continuous" if so.get("continuous_usage_stats") else "final"


# Responses --------------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "eos": "stop"}.get(reason or "", "stop" if reason else None)


def answers_usage(answers: list[dict], per_prompt: int = 1) -> dict:
    """The usage of a request's answers (`per_prompt` choices of each prompt, in order): each prompt's tokens
    counted once, as OpenAI counts them, and every choice's completion tokens."""
    return usage(sum(a["prompt_tokens"] for a in answers[::per_prompt]), sum(a["completion_tokens"] for a in answers))


def chat_response(rid: str, model_id: str, created: int, answers: list[dict], per_prompt: int = 1) -> dict:
    """A chat completion of `answers` (`per_prompt` choices of its one prompt), choice i the i-th."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{"index": i, "message": {"role": "assistant", "content": a["text"]},
                         "logprobs": None, "finish_reason": finish_reason(a["finish_reason"])}
                        for i, a in enumerate(answers)],
            "usage": answers_usage(answers, per_prompt)}


def completion_response(rid: str, model_id: str, created: int, answers: list[dict], per_prompt: int = 1) -> dict:
    """A completion of `answers` (`per_prompt` choices of each prompt, in order), choice i the i-th."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
            "choices": [{"index": i, "text": a["text"], "logprobs": None,
                         "finish_reason": finish_reason(a["finish_reason"])} for i, a in enumerate(answers)],
            "usage": answers_usage(answers, per_prompt)}


def chat_chunk(rid: str, model_id: str, created: int, delta: dict, reason: str | None, usage_: dict | None = None,
               choices: bool = True, index: int = 0) -> dict:
    """A chat stream chunk of choice `index` (`choices` False: the usage chunk, no choice)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason)}]
            if choices else [], **({"usage": usage_} if usage_ is not None else {})}


def completion_chunk(rid: str, model_id: str, created: int, text: str, reason: str | None,
                     usage_: dict | None = None, choices: bool = True, index: int = 0) -> dict:
    """A completion stream chunk of choice `index` (`choices` False: the usage chunk, no choice)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}]
            if choices else [], **({"usage": usage_} if usage_ is not None else {})}


def models_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dflash-export"}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()) + b"\n\n"


def now() -> int:
    return int(time.time())


def from_dflash_error(e: DFlashError) -> OpenAIError:
    """A request the model refused (its message starts with the input it is about)."""
    return OpenAIError(400, str(e), param=getattr(e, "field", None))


def as_sent(e: OpenAIError, chat: bool, body=None, prompt: str = "prompt") -> OpenAIError:
    """`e` naming the field the client sent: a completion's prompt reaches the model as its `text_input` (or
    `input_ids`), and was sent as `prompt` (`prompt[k]` for prompt k of a batch: `completion_request`); a max_tokens
    the client did not send (`body`: the request) is said to be the completions default."""
    if not chat and e.param == "max_tokens" and isinstance(body, dict) and body.get("max_tokens") is None:
        return OpenAIError(e.status, f"{e.message} (the request set no max_tokens; /v1/completions then takes "
                           f"{COMPLETION_MAX_TOKENS}, as OpenAI's does: set a smaller one)", param=e.param,
                           kind=e.kind, code=e.code)
    if chat or e.param not in ("text_input", "input_ids"):
        return e
    message = prompt + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return OpenAIError(e.status, message, param=prompt, kind=e.kind, code=e.code)
