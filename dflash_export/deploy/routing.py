"""The front's routing: which answer a parsed request gets.

`Routing` is the part of the front that maps a path to its handler: `/health` and `/v2/health/ready` (ready only when
tritonserver and the model's stub are), `/metrics`, the OpenAI-compatible routes (deploy/openai_api.py translates the
body; the answer is mapped back to OpenAI's shapes, errors included), and Triton's read-only and inference routes,
forwarded after their bodies are checked (deploy/handler.py) and tagged with a cancel token; wrong methods get 405,
unknown paths 404, a draining or restarting server 503. It also maps the engine's refusals to status codes (400 for a
bad field, 503 for a dead stub or a full queue).

An OpenAI request for `n` choices is `n` generate calls to the model (`_Choices`), each a request of its own in the
engine's queue and batch (so `n` counts `n` times against their bounds), answered together: one response with the
choices in order, or one stream of their chunks as they come, each naming its choice. A call that fails before the
stream starts fails the whole request with its error (the others are cancelled); once it has started, the stream ends
with that error event, as a stream of one choice does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import h11

from dflash_export.deploy import openai_api as oa
from dflash_export.deploy.connection import Connection, Refused, answer, parse_json_bounded
from dflash_export.deploy.handler import INPUT_TYPES, check_generate_body, check_infer_body, check_prompt_chars
from dflash_export.deploy.metrics import CONTENT_TYPE_LATEST
from dflash_export.deploy.upstream import CANCEL_PARAMETER, instance_died
from dflash_export.errors import DFlashError

# A model name is never `.` or `..`: forwarded, the URL would be normalized to another Triton route than the one
# matched here.
_MODEL = r"/v2/models/(?!\.\.?(?:/|$))([A-Za-z0-9_.\-]+)(?:/versions/[0-9]+)?"
_GET_ROUTES = re.compile(rf"^(?:/v2|/v2/health/live|{_MODEL}(?:/ready|/config|/stats)?)$")
_POST_ROUTES = re.compile(rf"^{_MODEL}/(infer|generate|generate_stream)$")
_FRONT_ROUTES = ("/health", "/metrics", "/v1/models", "/v2/health/ready")
_OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class Routing:
    """The front's routing side. Uses the front's `limits`, `model_id`, `models`, `created`, `draining`,
    `upstream_port`, `health`, `model_health`, `prompt_char_limit`, `model_inputs`, `metrics`, `counts`, its
    cancellation registry (`_begin`, `_begin_group`, `_group`, `_end`, `_why`, `_model_on`) and its upstream calls
    (deploy/upstream.py)."""

    @staticmethod
    def _route_label(path: str) -> str:
        """The route a request is counted under in the metrics: one of a fixed few (a label per URL a client makes
        up would grow /metrics without bound)."""
        if path in _FRONT_ROUTES or path in _OPENAI_ROUTES:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        return "/v1/other" if path.startswith("/v1/") else "triton"

    async def _route(self, conn: Connection, method: str, target: str, path: str, headers: dict, body: bytes,
                     head_only: bool) -> int:
        if method in ("GET", "HEAD"):
            if path == "/metrics":
                return await self._reply(conn, 200, self.metrics.render(), CONTENT_TYPE_LATEST, head_only)
            if path in ("/health", "/v2/health/ready"):
                why = self._not_ready()
                if why is not None:
                    raise Refused(503, why)
                return await self._reply(conn, 200, b"" if path != "/health" else b'{"status": "ok"}\n',
                                         "application/json", head_only)
            if path == "/v1/models" or path.startswith("/v1/models/"):
                # Listed once tritonserver serves (a client polling /v1/models for readiness, as with vLLM, whose
                # server listens only then, must not get a 200 before its first request would be answered); a
                # model reloading alone stays listed.
                if self.draining or self.upstream_port is None:
                    self._check_serving()
            if path == "/v1/models":
                return await self._json(conn, 200, oa.models_list(self.model_id, self.created), head_only)
            if path.startswith("/v1/models/"):
                if path[len("/v1/models/"):] != self.model_id:
                    raise oa.OpenAIError(404, f"model {path[len('/v1/models/'):][:80]!r} is not served here",
                                         param="model", code="model_not_found")
                return await self._json(conn, 200, oa.model_card(self.model_id, self.created), head_only)
            if gm := _GET_ROUTES.match(path):
                # A route of no model (/v2, /v2/health/live) asks after tritonserver itself (model ""): a model
                # reloading after its stub died, the others serving meanwhile, leaves it live.
                self._check_serving(gm.group(1) or "")
                return await self._forward(conn, method, target, headers, b"", None, False, head_only)
            if _POST_ROUTES.match(path) or path in ("/v1/chat/completions", "/v1/completions"):
                raise Refused(405, f"{method} {path[:100]}: use POST")
            raise Refused(404, f"{method} {path[:100]}: not served (see /v1/models, /health, /metrics, and the "
                               "Triton routes /v2/models/<model>/generate|generate_stream|infer)")
        if path in ("/v1/chat/completions", "/v1/completions"):
            obj = parse_json_bounded(body, self.limits.max_json_depth)
            self._check_serving(self._openai_model(isinstance(obj, dict) and obj.get("stream") is True))
            return await self._openai(conn, path, obj)
        m = _POST_ROUTES.match(path)
        if not m:
            if _GET_ROUTES.match(path) or path in _FRONT_ROUTES:
                raise Refused(405, f"POST {path[:100]}: use GET")
            raise Refused(404, f"POST {path[:100]}: not served (the front forwards infer, generate and "
                               "generate_stream, and serves /v1/chat/completions and /v1/completions)")
        self._check_serving(m.group(1))
        body, token = self._check_body(m.group(2), headers, body, m.group(1))
        try:
            return await self._forward(conn, "POST", target, headers, body, token, m.group(2) == "generate_stream",
                                       False, generation=m.group(2))
        except (ConnectionError, OSError, asyncio.TimeoutError):
            self._client_left(token)
            raise
        finally:
            self._end(token)

    def _client_left(self, token: str) -> None:
        """The answer could not be written (the client went away, or stopped reading past the write timeout): the
        request is cancelled, as when the watch sees the client leave, and with it every request answering the same
        client request (an OpenAI request's choices: `Front._begin_group`), counted once."""
        if any([self.cancel(t, "the client went away") for t in self._group(token)]):  # a list: every one cancelled
            self.counts["client_gone"] += 1
            self.metrics.client_gone.inc()

    def _not_ready(self, model: str | None = None) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.upstream_port is None:
            return "tritonserver is (re)starting"
        if model is not None and self.model_health is not None:
            return self.model_health(model)
        if self.health is not None:
            return self.health()
        return None

    def _openai_model(self, stream: bool) -> str:
        """The Triton model an OpenAI request goes to: the streaming one for `"stream": true` when deployed."""
        return "dflash_stream" if stream and "dflash_stream" in self.models else self.models[0]

    def _sick(self, token: str | None) -> str | None:
        """Why the model this request runs on cannot serve now (None: it can); the server's health when the request
        names no model."""
        model = self._model_on(token)
        if model is not None and self.model_health is not None:
            return self.model_health(model)
        return self.health() if self.health is not None else None

    def _check_serving(self, model: str | None = None) -> None:
        why = self._not_ready(model)
        if why is not None:
            raise Refused(503, why if self.draining else f"{why}; retry shortly", close=self.draining)

    def _refuse_if_drained(self, token: str | None) -> None:
        """503 "shutting down" for a request the drain cancelled (its client gets that, not the engine's error)."""
        why = self._why(token)
        if why is not None and "shutting down" in why:
            raise Refused(503, f"cancelled: {why}", close=True)

    async def _reply(self, conn: Connection, status: int, body: bytes, ctype: str, head_only: bool = False) -> int:
        await conn.send(*answer(status, body, ctype=ctype, head_only=head_only))
        return status

    async def _json(self, conn: Connection, status: int, payload, head_only: bool = False) -> int:
        await conn.send(*answer(status, payload, head_only=head_only))
        return status

    # Checking Triton bodies --------------------------------------------------------------------------------------
    def _check_body(self, endpoint: str, headers: dict, body: bytes, model: str | None = None) -> tuple[bytes, str]:
        """The body with its JSON part checked and tagged with a new cancel token (of a request on `model`), and
        that token."""
        header_len = headers.get("inference-header-content-length")
        if header_len is not None and endpoint != "infer":
            raise Refused(400, f"Inference-Header-Content-Length: binary tensors are for /infer, not {endpoint}")
        json_len = _json_length(header_len, body)
        obj = parse_json_bounded(body[:json_len], self.limits.max_json_depth)
        try:
            if endpoint == "infer":
                obj = check_infer_body(obj, len(body) - json_len)
                self._check_model_inputs(model, [t["name"] for t in obj["inputs"]])
                self._check_prompt_size({t["name"]: t["data"][0] for t in obj["inputs"]
                                         if t["name"] in ("text_input", "messages") and t.get("data")})
            else:
                obj = check_generate_body(obj)
                self._check_model_inputs(model, obj)
                if "messages" in obj:  # its JSON text is parsed again by the model: the same depth limit applies
                    parse_json_bounded(obj["messages"].encode(), self.limits.max_json_depth, "messages")
                self._check_prompt_size(obj)
        except DFlashError as e:
            raise Refused(400, str(e)) from None
        token = self._begin(model)
        if endpoint == "infer":
            obj["parameters"] = {**obj.get("parameters", {}), CANCEL_PARAMETER: token}
        else:  # the generate extension passes fields that are not inputs as request parameters
            obj[CANCEL_PARAMETER] = token
        head = json.dumps(obj, ensure_ascii=False).encode()
        if header_len is not None:
            headers["inference-header-content-length"] = str(len(head))
        return head + body[json_len:], token

    def _check_model_inputs(self, model: str | None, fields) -> None:
        """DFlashError naming the first of `fields` (a request's input names) that `model`'s config.pbtxt declares no
        input for: a repository deployed before that input existed (input_ids, the prompt as token ids). Refused
        here: tritonserver's own answer would be a 400 that does not say why."""
        inputs = (self.model_inputs or {}).get(model) if model is not None else None
        if inputs is None:
            return
        for name in fields:
            if name in INPUT_TYPES and name not in inputs:
                if name == "input_ids":
                    raise DFlashError("this model repository was deployed without token-id input (input_ids); "
                                      "redeploy it with `dflash-export deploy` to get it, or send the prompt as text",
                                      field=name)
                raise DFlashError(f"this model repository was deployed without the input {name!r}; redeploy it with "
                                  "`dflash-export deploy` to get it", field=name)

    def _check_prompt_size(self, gen: dict) -> None:
        """DFlashError when the prompt's text cannot fit the engine (see `prompt_char_limit`)."""
        if self.prompt_char_limit is None:
            return
        if isinstance(gen.get("text_input"), str):
            check_prompt_chars(gen["text_input"], self.prompt_char_limit)
        if isinstance(gen.get("messages"), str):
            try:
                messages = json.loads(gen["messages"])
            except (ValueError, RecursionError):
                return  # the model refuses it, naming why
            if isinstance(messages, list):
                check_prompt_chars(messages, self.prompt_char_limit)

    # OpenAI ------------------------------------------------------------------------------------------------------
    async def _openai(self, conn: Connection, path: str, obj) -> int:
        chat = path == "/v1/chat/completions"
        try:
            # A checked generate body (openai_api applies the fields' rules); what is left is the engine's bound.
            if chat:
                gen, stream, usage = oa.chat_request(obj, self.model_id)
                prompts = [("messages", gen)]
            else:  # one generate body a prompt, each with the field it was sent as: a completion may send a batch
                prompts, stream, usage = oa.completion_request(obj, self.model_id)
            model = self._openai_model(stream)
            for field, gen in prompts:
                try:
                    self._check_model_inputs(model, gen)
                    self._check_prompt_size(gen)
                except DFlashError as e:
                    raise oa.as_sent(oa.from_dflash_error(e), chat, prompt=field) from None
        except DFlashError as e:
            raise oa.as_sent(oa.from_dflash_error(e), chat) from None
        rid, created = oa.new_id("chatcmpl" if chat else "cmpl"), oa.now()
        per_prompt = oa.choice_count(obj)  # choice j of prompt k is answer k x n + j
        gens = [g for _, gen in prompts for g in oa.choice_bodies(gen, per_prompt)]
        fields = [field for field, _ in prompts for _ in range(per_prompt)]
        tokens = self._begin_group(model, len(gens))
        bodies = [json.dumps({**g, CANCEL_PARAMETER: t}, ensure_ascii=False).encode() for g, t in zip(gens, tokens)]
        use_stream_model = model == "dflash_stream"
        target = f"/v2/models/{model}/{'generate_stream' if use_stream_model else 'generate'}"
        choices = _Choices(self, conn, target, bodies, tokens, use_stream_model, fields)
        try:
            if not stream:
                answers: list = [None] * len(bodies)
                while (item := await choices.next()) is not None:
                    if isinstance(item[1], Exception):
                        raise choices.as_sent(item, chat)
                    answers[item[0]] = item[1]
                for answer in answers:  # a stream records each choice's last event (`_openai_stream`)
                    self._observe(answer, model)
                answers = [_answer(a) for a in answers]
                out = (oa.chat_response if chat else oa.completion_response)(rid, self.model_id, created, answers,
                                                                             per_prompt)
                return await self._json(conn, 200, out)
            first = await choices.next()
            if first is not None and isinstance(first[1], Exception):
                raise choices.as_sent(first, chat)  # before any choice has an event: the request's error response
            return await self._openai_stream(conn, chat, rid, created, usage, choices, first, per_prompt)
        except oa.OpenAIError as e:
            raise oa.as_sent(e, chat, obj) from None
        except (ConnectionError, OSError, asyncio.TimeoutError):
            self._client_left(tokens[0])
            raise
        finally:
            await choices.stop("another choice of the request failed")

    def _answer_of(self, status: int, payload: bytes, token: str | None) -> dict:
        """The model's answer (its generate body), or its refusal raised in OpenAI's shape."""
        self._refuse_if_drained(token)
        try:
            obj = json.loads(_first_event(payload))
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            obj = {"error": payload[:200].decode("utf-8", "replace")}
        if status != 200 or "error" in obj:
            raise self._upstream_error(status, obj.get("error"), token)
        return obj

    def _upstream_error(self, status: int, message, token: str | None = None) -> oa.OpenAIError:
        message = str(message or "the engine refused the request")
        sick = self._sick(token) or instance_died(message)
        if status != 200 and sick:
            return oa.OpenAIError(503, f"{sick}; retry shortly", kind="server_error")
        if status == 400 or "INVALID_ARG" in message:
            field = message.split(":", 1)[0] if ":" in message else None
            return oa.OpenAIError(400, message, param=field)
        if status in (429, 503) or "queue" in message.lower():
            return oa.OpenAIError(503, message, kind="server_error")
        return oa.OpenAIError(status if status >= 400 else 500, message, kind="server_error")

    async def _openai_stream(self, conn: Connection, chat: bool, rid: str, created: int, usage: str | None,
                             choices: _Choices, item: tuple | None, per_prompt: int = 1) -> int:
        """An OpenAI stream of the choices' events (`per_prompt` choices of each prompt, in order), `item` the
        first (index, event) of any (None: there are none), each chunk naming its choice; `usage`
        (openai_api._usage): None, a last chunk of its own with the usage of every choice ("final"), or that and the
        usage so far on every chunk ("continuous": each prompt once and the tokens every choice has so far). It ends
        once every choice has finished, or at the first error. Returns the status the request is counted under: 200,
        or the status of the error it ended with (the answer's head said 200 before the error came)."""
        await conn.send(h11.Response(status_code=200, headers=[("Content-Type", "text/event-stream"),
                                                               ("Cache-Control", "no-cache")]))
        mk = oa.chat_chunk if chat else oa.completion_chunk
        n = len(choices.tokens)
        started, finished, completion = [False] * n, [False] * n, [0] * n
        prompt = [0] * (n // per_prompt)  # each prompt's tokens, as its choices report them
        status = 200
        while item is not None:
            i, ev = item
            if isinstance(ev, Exception) or "error" in ev:
                err = self._stream_error(ev, choices.tokens[i], chat, choices.fields[i])
                await conn.send(h11.Data(data=oa.sse(err.body())))
                status = err.status
                break
            text, reason = ev.get("text_output", ""), ev.get("finish_reason") or None
            k = i // per_prompt
            prompt[k] = int(ev.get("prompt_tokens", prompt[k]) or prompt[k])
            prompt_tokens, before = sum(prompt), sum(completion)
            completion[i] = int(ev.get("completion_tokens", completion[i]) or completion[i])
            so_far = oa.usage(prompt_tokens, sum(completion)) if usage == "continuous" else None
            if chat and not started[i]:
                await conn.send(h11.Data(data=oa.sse(mk(rid, self.model_id, created, {"role": "assistant",
                                                                                    "content": ""}, None,
                                                        oa.usage(prompt_tokens, before) if so_far else None,
                                                        index=i))))
            started[i] = True
            if text or reason:
                delta = ({"content": text} if text else {}) if chat else text
                await conn.send(h11.Data(data=oa.sse(mk(rid, self.model_id, created, delta, reason, so_far,
                                                        index=i))))
            if reason:
                self._observe(ev, self._model_on(choices.tokens[i]))
                finished[i] = True
                if all(finished):
                    if usage:
                        await conn.send(h11.Data(data=oa.sse(mk(rid, self.model_id, created, {} if chat else "",
                                                                None, oa.usage(prompt_tokens, sum(completion)),
                                                                choices=False))))
                    break
            item = await choices.next()
        await conn.send(h11.Data(data=oa.sse(b"[DONE]")), h11.EndOfMessage())
        self.counts["forwarded"] += 1
        return status

    def _stream_error(self, ev: dict | Exception, token: str, chat: bool, field: str) -> oa.OpenAIError:
        """The error event a started stream ends with: a choice's error event, or the refusal of a choice's call (a
        choice other than the first to answer), naming its prompt as `field`; any other failure is raised (the
        connection closes)."""
        if isinstance(ev, oa.OpenAIError):
            return oa.as_sent(ev, chat, prompt=field)
        if isinstance(ev, Refused):  # 503 (the server's state) or 504 (no answer within the request timeout)
            return oa.OpenAIError(ev.status, ev.message, kind="server_error")
        if isinstance(ev, Exception):
            raise ev
        why = self._why(token)
        return oa.OpenAIError(503, f"cancelled: {why}", kind="server_error") if why else \
            oa.as_sent(self._upstream_error(500, ev["error"], token), chat, prompt=field)


class _Choices:
    """The generate calls of one OpenAI request, one a choice, run together: `next` gives each call's events (a
    generate answer is one event) tagged with its choice's index, in the order they arrive, and a call's failure as
    its exception; `stop` ends them. The calls watch a `_ChoiceWatch` in place of the connection, so that `stop` can
    give up waiting for those still running. `fields`: the field each call's prompt was sent as (`prompt[k]` for
    prompt k of a batch), which its refusal names."""

    def __init__(self, front: Routing, conn: Connection, target: str, bodies: list[bytes], tokens: list[str],
                 streamed: bool, fields: list[str]):
        self.front, self.tokens, self.fields = front, tokens, fields
        self.watch = _ChoiceWatch(conn)
        self.ended = [False] * len(bodies)  # the call has given its last event, or failed
        # Set when `next` has given out the call's latest event: a streamed call reads its next event from
        # tritonserver only then, so a client that reads slowly holds up the engine's answers, not the front's memory.
        self._taken = [asyncio.Event() for _ in bodies]
        self._left = len(bodies)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._responses: list = []
        self._tasks = [asyncio.ensure_future(self._call(i, target, body, streamed)) for i, body in enumerate(bodies)]

    async def _call(self, i: int, target: str, body: bytes, streamed: bool) -> None:
        front, token = self.front, self.tokens[i]
        try:
            resp = await front._send_upstream(self.watch, "POST", target, {"content-type": "application/json"}, body,
                                              token)
            self._responses.append(resp)
            if resp.status_code != 200 or not streamed:
                payload = await front._read_upstream(self.watch, resp, token)
                self._put(i, front._answer_of(resp.status_code, payload, token), last=True)
                return
            async with contextlib.aclosing(front._upstream_events(self.watch, resp, token)) as events:
                async for ev in events:
                    last = "error" in ev or bool(ev.get("finish_reason"))
                    self._put(i, ev, last)
                    if last:
                        break
                    await self._until_taken(i)
        except Exception as e:  # noqa: BLE001 - the reader raises it, or reports it on a stream
            self._put(i, e, last=True)
        finally:
            self.ended[i] = True
            self._queue.put_nowait((i, None))

    async def _until_taken(self, i: int) -> None:
        """Until `next` has given out call `i`'s latest event, the client has left, or the request gave its calls up
        (the call then reads on and ends as its watch says)."""
        taken = asyncio.ensure_future(self._taken[i].wait())
        try:
            await asyncio.wait({taken, self.watch.watching()}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            taken.cancel()
        self._taken[i].clear()

    def _put(self, i: int, item, last: bool) -> None:
        self.ended[i] = self.ended[i] or last
        self._queue.put_nowait((i, item))

    def as_sent(self, item: tuple[int, Exception], chat: bool) -> Exception:
        """Call `item[0]`'s failure, a refusal naming its prompt as the client sent it (`oa.as_sent`)."""
        i, e = item
        return oa.as_sent(e, chat, prompt=self.fields[i]) if isinstance(e, oa.OpenAIError) else e

    async def next(self) -> tuple[int, dict | Exception] | None:
        """The next (choice index, event or exception) of any call; None once every call has ended."""
        while self._left:
            i, item = await self._queue.get()
            if item is not None:
                self._taken[i].set()
                return i, item
            self._left -= 1
        return None

    async def stop(self, why: str) -> None:
        """The request is answered (or failed): when a call has not given its last event, every call's request is
        cancelled (`why`; its model stops at its next step or leaves the queue) and no longer waited for (its answer
        is closed when it comes: `Upstream._abandon`); then every call's request leaves the registry and its
        connection to tritonserver is closed."""
        if not all(self.ended):
            for token in self.tokens:
                self.front.cancel(token, why)
            self.watch.give_up()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.watch.close()
        for token in self.tokens:
            self.front._end(token)
        for resp in self._responses:  # now, also for a stream left mid-way: tritonserver's shutdown waits for it
            await resp.aclose()


class _ChoiceWatch:
    """What the calls of an OpenAI request's choices watch while they wait (`Upstream._race` takes it for the
    connection): the client leaving, as the connection's own watch sees it, or the request giving them up
    (`give_up`), which ends their waits as the client's leaving would."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._given_up = asyncio.Event()
        self._task: asyncio.Task | None = None

    def watching(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.ensure_future(self._either())
        return self._task

    async def _either(self) -> None:
        given_up = asyncio.ensure_future(self._given_up.wait())
        try:
            await asyncio.wait({self.conn.watching(), given_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up.cancel()

    def give_up(self) -> None:
        self._given_up.set()

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _answer(obj: dict) -> dict:
    """A generate answer's fields as OpenAI's responses take them."""
    return {"text": obj.get("text_output", ""), "finish_reason": obj.get("finish_reason") or "stop",
            "prompt_tokens": int(obj.get("prompt_tokens", 0)),
            "completion_tokens": int(obj.get("completion_tokens", 0))}


def _first_event(payload: bytes) -> bytes:
    """The JSON of an answer: a generate_stream answer's first event (tritonserver answers a stream whose first
    response is an error with that status and the error as one `data:` event), any other answer whole."""
    if payload.startswith(b"data:"):
        return payload[5:].split(b"\n", 1)[0]
    return payload


def _json_length(header_len: str | None, body: bytes) -> int:
    """Bytes of JSON at the start of the body: all of it, or Inference-Header-Content-Length's (binary tensors
    follow)."""
    if header_len is None:
        return len(body)
    try:
        json_len = int(header_len)
        if not 0 <= json_len <= len(body):
            raise ValueError
    except ValueError:
        raise Refused(400, f"Inference-Header-Content-Length: {header_len[:40]!r} is not a length within the "
                           f"{len(body)}-byte body") from None
    return json_len

