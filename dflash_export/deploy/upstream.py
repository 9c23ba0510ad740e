"""The front's upstream: the authenticated call to tritonserver and the relay of its answers.

It holds the header name and value that tritonserver's restricted APIs require of every caller (`SECRET_HEADER`, the
per-start secret `Front.secret`; `RESTRICTED_APIS` lists what it guards), the request parameter that carries a
request's cancel token to the model (`CANCEL_PARAMETER`), and `Upstream`, the part of the front that forwards a
checked request over loopback (or the namespace bridge's Unix socket) once one of its `max_upstream_calls` call
slots is free, races it against its client leaving and the request timeout (cancelling it either way), maps an
unreachable or dying tritonserver to 503 with Retry-After (the client retries), relays a generate_stream answer event
by event, and records generation figures in the metrics.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import struct

import h11

from dflash_export.deploy import openai_api as oa
from dflash_export.deploy.connection import ClientGone, Connection, Refused, answer

SECRET_HEADER = "dflash-front"
CANCEL_PARAMETER = "dflash_cancel"   # request parameter carrying the cancel token to the model
# Triton APIs that require the secret header (every category its --http-restricted-api knows).
RESTRICTED_APIS = ("health,metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging")
# How long a request whose tritonserver connection broke waits to learn that its model's stub died: the health poll
# runs every 0.5 s (`TritonServer.wait`), plus a busy machine's delay.
STUB_DEATH_GRACE_S = 2.0
_BINARY_FORMATS = {"INT32": "<i", "INT64": "<q", "UINT64": "<Q", "FP32": "<f", "FP64": "<d"}  # Triton's binary tensors
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host", SECRET_HEADER}


class Upstream:
    """The front's upstream side. Uses the front's `secret`, `upstream_port`, `upstream_uds`, `limits`, `health`,
    `counts`, `metrics`, its cancellation registry (`cancel`, `_why`, `_model_of`, `_model_on`, `_group`),
    `_client_left`, `_refuse_if_drained` and `_upstream_error` (deploy/routing.py)."""

    def _open_client(self) -> None:
        import httpx

        # calls to tritonserver left to finish (`_abandon`) -> the model each runs on
        self._abandoned: dict[asyncio.Future, str | None] = {}
        # At most `max_upstream_calls` calls open to tritonserver at once (`_send_in_turn`); the calls still waiting
        # for a slot, which have sent nothing.
        self._call_slots = asyncio.Semaphore(self.limits.max_upstream_calls)
        self._waiting_calls: set[asyncio.Future] = set()
        # No kept-alive upstream connections: tritonserver's shutdown waits for every open HTTP connection. Each open
        # connection is a call holding a slot, so the pool needs no bound of its own (one would be lost for good to a
        # connection httpcore leaves open when a call is cancelled part-way, see `_abandon`).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        transport = httpx.AsyncHTTPTransport(uds=str(self.upstream_uds), limits=limits) if self.upstream_uds else None
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False, limits=limits,
                                         transport=transport)

    def _upstream_headers(self, headers: dict, n: int | None) -> dict:
        out = {k: v for k, v in headers.items() if k not in _HOP}
        out[SECRET_HEADER] = self.secret
        if n is not None:
            out["content-length"] = str(n)
        return out

    async def _race(self, conn: Connection, aw, token: str | None, timeout: float):
        """Await `aw` while watching the client: ClientGone (request cancelled) if it leaves first, 504 (request
        cancelled) if `timeout` passes first, 503 with Retry-After if a stub of the request's model dies first (or
        had died: `Front.fail_model`). `conn` is what is watched (its `watching()`): the client's connection, or a
        watch that also ends when the request gives the call up (routing's `_ChoiceWatch`)."""
        failed, why = self._model_failure(token)
        if why is not None:  # its model's stub died before this call: nothing is sent to the dead model
            if asyncio.iscoroutine(aw):
                aw.close()
            elif asyncio.isfuture(aw):
                aw.cancel()
            raise retry_soon(why)
        task = asyncio.ensure_future(aw)
        watcher = conn.watching()
        dead = asyncio.ensure_future(failed.wait()) if failed is not None else None
        try:
            done, _ = await asyncio.wait({task, watcher} | ({dead} if dead else set()), timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            if dead is not None:
                dead.cancel()
        if task in done and not (dead in done and task.exception() is not None):
            return task.result()
        if dead is not None and dead in done:
            # Its model's stub died: a dead stub never answers, so the request is answered here, at once.
            task.cancel()
            _, why = self._model_failure(token)
            raise retry_soon(why or "its model stub died")
        if watcher in done:
            if token is not None:
                self._client_left(token)
            self._abandon(task, token)
            raise ClientGone
        self._timed_out(token)
        self._abandon(task, token)
        raise Refused(504, f"the engine did not answer within {self.limits.request_timeout_s:g} s "
                           "(--request-timeout); the request was cancelled")

    def _timed_out(self, token: str | None) -> None:
        """A call got no answer within the request timeout: its request is cancelled, and with it every request
        answering the same client request (an OpenAI request's choices, `Front._begin_group`: the client request
        fails with it), counted once however many of its calls time out."""
        why = f"no answer from the engine within {self.limits.request_timeout_s:g} s"
        if token is None or any([self.cancel(t, why) for t in self._group(token)]):  # a list: every one cancelled
            self.counts["timed_out"] += 1

    def _abandon(self, task: asyncio.Future, token: str | None) -> None:
        """Stop waiting for `task`, a call to tritonserver whose request was cancelled through its cancel file (the
        model answers it at its next step, or drops it from the queue): the call runs to that answer, which is then
        closed. Cancelling an httpx call part-way can leave its connection in the pool for good (httpcore 1.0: a
        call cancelled between taking a new connection and sending on it leaves that connection open and unused; 2
        of 200 clients leaving within 10 ms of sending did). A call with no cancel file to stop it is cancelled, and
        so is one whose model's stub dies before it ends (`_drop_abandoned`): a dead stub never answers, and one still
        waiting for a call slot (it has sent nothing, and its slot goes to the next call)."""
        if token is None or task.done() or task in self._waiting_calls:
            task.cancel()
            return
        with self._lock:
            self._abandoned[task] = self._model_of.get(token)

        def close(t: asyncio.Future) -> None:
            self._abandoned.pop(t, None)
            if not t.cancelled() and t.exception() is None and hasattr(t.result(), "aclose"):
                closing = asyncio.ensure_future(t.result().aclose())
                self._abandoned[closing] = None
                closing.add_done_callback(lambda c: self._abandoned.pop(c, None))

        task.add_done_callback(close)

    def _drop_abandoned(self, model: str) -> None:
        """Cancel the calls left to finish on `model`, whose stub died: their answers never come, and each would
        hold its connection to tritonserver until the front closes. Called on the front's loop."""
        for task in [t for t, m in self._abandoned.items() if m == model]:
            task.cancel()

    async def _send_upstream(self, conn: Connection, method: str, target: str, headers: dict, body: bytes,
                             token: str | None):
        import httpx

        url = f"http://127.0.0.1:{self.upstream_port}{target}"
        req = self._client.build_request(method, url, content=body if method == "POST" else None,
                                         headers=self._upstream_headers(headers, len(body) if method == "POST"
                                                                        else None))
        call = asyncio.ensure_future(self._send_in_turn(req, token))
        self._waiting_calls.add(call)
        self.metrics.upstream_waiting.set(len(self._waiting_calls))
        call.add_done_callback(self._stop_waiting)
        try:
            return await self._race(conn, call, token, self.limits.request_timeout_s)
        except httpx.ConnectError:
            raise retry_soon("tritonserver is not answering (it is being restarted)") from None
        except (httpx.TransportError, OSError):
            raise await self._dropped(token, "tritonserver dropped the request (a model stub or the server "
                                             "died)") from None

    def _stop_waiting(self, call: asyncio.Future) -> None:
        """`call` waits for a call slot no longer (it took one, or ended): the waiting calls' gauge follows."""
        self._waiting_calls.discard(call)
        self.metrics.upstream_waiting.set(len(self._waiting_calls))

    async def _send_in_turn(self, req, token: str | None):
        """`req` sent once one of the `max_upstream_calls` call slots is free (calls wait for one in arrival order,
        within the request timeout: `_send_upstream` races the wait too); its answer holds the slot until it is
        closed (read to its end, or closed early). A request the drain cancelled while it waited is answered 503
        without being sent."""
        await self._call_slots.acquire()
        self._stop_waiting(asyncio.current_task())
        try:
            self._refuse_if_drained(token)
            resp = await self._client.send(req, stream=True)
        except BaseException:
            self._call_slots.release()
            raise
        resp.stream = _slot_stream_type()(resp.stream, self._call_slots.release)
        return resp

    async def _read_upstream(self, conn: Connection, resp, token: str | None) -> bytes:
        import httpx

        try:
            return await self._race(conn, resp.aread(), token, self.limits.request_timeout_s)
        except (httpx.TransportError, OSError):
            raise await self._dropped(token, "tritonserver stopped answering mid-request (a model stub or the "
                                             "server died)") from None
        finally:
            await resp.aclose()

    async def _dropped(self, token: str | None, otherwise: str) -> Refused:
        """The 503 for a request whose connection to tritonserver broke. A stub's death can break it before `serve`'s
        health poll (every 0.5 s) has seen the death: so wait up to STUB_DEATH_GRACE_S for the request's model to be
        failed, and name the death when it is; `otherwise` when it is not (the server itself went)."""
        failed, why = self._model_failure(token)
        if failed is not None and why is None:
            try:
                await asyncio.wait_for(failed.wait(), STUB_DEATH_GRACE_S)
            except asyncio.TimeoutError:
                pass
            _, why = self._model_failure(token)
        return retry_soon(why or otherwise)

    async def _forward(self, conn: Connection, method: str, target: str, headers: dict, body: bytes, token: str | None,
                       streaming: bool, head_only: bool, generation: str | None = None) -> int:
        """`generation`: the endpoint (generate, generate_stream, infer) of a request whose answer is a generation,
        recorded in the metrics."""
        resp = await self._send_upstream(conn, method, target, headers, body, token)
        if streaming:
            return await self._relay_stream(conn, resp, token)
        payload = await self._read_upstream(conn, resp, token)
        self._refuse_if_drained(token)
        if resp.status_code != 200 and ((sick := self._sick(token)) or (sick := instance_died(payload))):
            raise retry_soon(sick)
        if generation and resp.status_code == 200:
            self._observe(payload if generation != "infer" else
                          infer_outputs(payload, resp.headers.get("inference-header-content-length")),
                          self._model_on(token))
        self.counts["forwarded"] += 1
        ctype = resp.headers.get("content-type", "application/json")
        extra = {k: v for k, v in resp.headers.items()
                 if k.lower() not in _HOP | {"content-type", "content-encoding", "server"}}
        await conn.send(*answer(resp.status_code, payload, ctype=ctype, head_only=head_only, extra=extra))
        return resp.status_code

    def _observe(self, payload: bytes | dict | None, model: str | None = None) -> None:
        """Record a finished generation's answer (`payload`, its last event for a stream) on Triton model `model` in
        the metrics."""
        if payload is None:
            return
        try:
            obj = json.loads(payload) if isinstance(payload, bytes) else payload
            stats = obj.get("step_stats")
            stats = json.loads(stats) if isinstance(stats, str) and stats else {}
            self.metrics.observe_generation(obj.get("completion_tokens", 0), obj.get("prompt_tokens", 0),
                                            {**stats, "drafted_tokens": obj.get("drafted_tokens", 0),
                                             "accepted_tokens": obj.get("accepted_tokens", 0)}, model)
        except (ValueError, TypeError, AttributeError, RecursionError):
            pass

    async def _upstream_events(self, conn: Connection, resp, token: str | None):
        """The JSON events of a generate_stream answer (server-sent events), as they arrive."""
        import httpx

        buf = b""
        it = resp.aiter_raw().__aiter__()
        try:
            while True:
                try:
                    chunk = await self._race(conn, it.__anext__(), token, self.limits.request_timeout_s)
                except StopAsyncIteration:
                    break
                except Refused as e:  # mid-stream: the answer's head is sent, so an error event
                    if e.status != 503:
                        raise
                    yield {"error": e.message}
                    return
                except (httpx.TransportError, OSError):
                    e = await self._dropped(token, "tritonserver stopped answering mid-stream (a model stub or the "
                                                   "server died)")
                    yield {"error": e.message}
                    return
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            try:
                                yield json.loads(line[5:])
                            except ValueError:
                                yield {"error": "tritonserver sent an event that is not JSON"}
                                return
        finally:
            await resp.aclose()

    async def _relay_stream(self, conn: Connection, resp, token: str | None) -> int:
        """generate_stream, relayed event by event (re-framed: the front's own chunked encoding). Returns the status
        the request is counted under: tritonserver's, or for a stream that ended with an error event (the answer's
        head said 200 before it came) that error's, as an OpenAI stream would report it (`_upstream_error`; 503 for a
        request the front cancelled)."""
        if resp.status_code != 200:
            payload = await self._read_upstream(conn, resp, token)
            self._refuse_if_drained(token)  # cancelled while queued, by the drain
            await conn.send(*answer(resp.status_code, payload, ctype=resp.headers.get("content-type",
                                                                                       "application/json")))
            return resp.status_code
        status = 200
        try:
            await conn.send(h11.Response(status_code=200, headers=[("Content-Type", "text/event-stream"),
                                                                   ("Cache-Control", "no-cache")]))
            async for ev in self._upstream_events(conn, resp, token):
                why = self._why(token) if "error" in ev else None
                if why is not None and "shutting down" in why:
                    ev = {"error": f"cancelled: {why}"}
                if "error" in ev:
                    status = 503 if why is not None else self._upstream_error(500, ev["error"], token).status
                await conn.send(h11.Data(data=oa.sse(ev)))
                if ev.get("finish_reason"):
                    self._observe(ev, self._model_on(token))
        except (ConnectionError, OSError, asyncio.TimeoutError):
            if token is not None:  # the cancel file first, stamped before tritonserver sees the stream closed
                self._client_left(token)
            raise
        finally:  # now, also when the client left mid-stream: tritonserver's shutdown waits for the connection
            await resp.aclose()
        self.counts["forwarded"] += 1
        await conn.send(h11.EndOfMessage())
        return status


@functools.cache
def _slot_stream_type() -> type:
    """The body of an answer from tritonserver that gives its call slot back (`release`) once, when it is closed (an
    httpx stream type: httpx is imported only where the front runs)."""
    import httpx

    class SlotStream(httpx.AsyncByteStream):
        def __init__(self, stream, release):
            self._stream, self._release = stream, release

        def __aiter__(self):
            return self._stream.__aiter__()

        async def aclose(self) -> None:
            release, self._release = self._release, None
            try:
                await self._stream.aclose()
            finally:
                if release is not None:
                    release()

    return SlotStream


def retry_soon(why: str) -> Refused:
    """The server's own fault, passing (a stub or tritonserver died, or is being restarted): 503 with Retry-After."""
    return Refused(503, f"{why}; retry shortly", headers={"Retry-After": "2"})


def infer_outputs(payload: bytes, json_len: str | None) -> dict | None:
    """The first value of each output of a KServe v2 infer answer, by name (a generation's fields, as the generate
    protocol gives them): from its JSON `data`, or from the binary tensors after the JSON part (its length in
    Inference-Header-Content-Length; each output's `binary_data_size` bytes in order, a BYTES element as a 4-byte
    little-endian length and its bytes). None for an answer that is not one."""
    try:
        n = len(payload) if json_len is None else int(json_len)
        out, at = {}, n
        for t in json.loads(payload[:n])["outputs"]:
            size = (t.get("parameters") or {}).get("binary_data_size")
            if size is None:
                out[t["name"]] = (t.get("data") or [None])[0]
                continue
            raw, at = payload[at:at + size], at + size
            if t["datatype"] == "BYTES":
                out[t["name"]] = raw[4:4 + int.from_bytes(raw[:4], "little")].decode("utf-8", "replace")
            elif t["datatype"] in _BINARY_FORMATS:
                out[t["name"]] = struct.unpack_from(_BINARY_FORMATS[t["datatype"]], raw)[0]
        return out
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, struct.error):
        return None


def instance_died(text: bytes | str) -> str | None:
    """The python backend's answer from a model instance whose stub died ("Stub process '<instance>' is not
    healthy."), whatever `serve`'s health check has seen yet: the server's fault, so a 503, never the client's 400."""
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    m = re.search(r"Stub process '([^']{1,80})' is not healthy", text)
    return f"model instance {m.group(1)} died (its model reloads)" if m else None

