"""The HTTP front `serve` puts before tritonserver: the only port a client reaches; tritonserver itself listens on
loopback behind a per-start secret header.

Why a front: the bundled tritonserver (nvidia-pytriton 0.7) has no request size limit and parses JSON recursively (a
6 MB body or 100 000 nested `[` crash it), its HTTP endpoint cannot cancel a request whose client left, and it speaks
only the KServe protocol. The front is an asyncio server: one coroutine per connection, HTTP/1.1 parsed and framed
by `h11` (python-hyper's strict, sans-I/O HTTP/1.1 state machine), upstream calls through `httpx`. Chosen over a
full ASGI server (uvicorn + starlette) because the limits below are about connections before a request exists
(whole-head deadlines, evicting trickling connections), which those servers do not let an application set, and
over the thread-per-connection `http.server` it replaces, whose threads a trickle of slow clients could exhaust.

What it guarantees, before anything reaches Triton's parser:
- framing: one Content-Length (conflicting ones, Content-Length with Transfer-Encoding, or a transfer coding other
  than chunked: 400/501, connection closed); a body on any method but POST is refused (400); HEAD answers without a
  body; a request line over `max_url_bytes` gets 414, a head over `max_header_bytes` 431; every answer is framed
  by h11, so a request hidden in a body is never answered;
- deadlines: a request's whole head must arrive within `header_timeout_s` of the connection becoming ready for it,
  its whole body within `body_timeout_s`; an engine that does not answer within `request_timeout_s` gets the
  request cancelled and the client a 504;
- connections: at most `max_connections` in all and `max_connections_per_client` per client address; when full, the
  oldest connection that has not delivered a request head is dropped to make room (a trickle cannot hold the door);
  only when every connection is busy with a request does a new one get 503;
- bodies: over `max_body_bytes` 413; JSON invalid, nested deeper than `max_json_depth`, or carrying a lone surrogate
  400; generate bodies checked field by field and /infer bodies input by input (deploy/handler.py), so no value
  reaches Triton's typed decoding that it would answer with a 500;
- cancellation: while a request runs, the client's socket is read for end-of-file (bytes it sends meanwhile are kept
  for its next request, never mistaken for a disconnect); when it goes away, the request's cancel file is written
  and the model stops at its next DFlash step;
- health: `/health` and `/v2/health/ready` say 200 only when tritonserver answers and every model stub is alive
  (`health` callback, set by `TritonServer`); in-flight requests of a dead stub get 503 with Retry-After;
- drain: on shutdown new requests get 503; running ones finish or, past the drain time, are cancelled and answered
  503 "shutting down" (an error event on a stream).

Routes: the OpenAI-compatible API (deploy/openai_api.py), `/health`, `/metrics` (deploy/metrics.py), and Triton's
read-only and inference routes (health, metadata, config, stats, infer, generate, generate_stream), forwarded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h11

from dflash_export.deploy import openai_api as oa
from dflash_export.deploy.handler import check_generate_body, check_infer_body, check_prompt_chars
from dflash_export.deploy.metrics import CONTENT_TYPE_LATEST, FrontMetrics
from dflash_export.errors import DFlashError

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_JSON_DEPTH = 32
DISCARD_MAX = 64 << 20  # an over-limit body up to this size is read and dropped before the 413
PENDING_MAX = 64 << 10  # bytes a client may send ahead while its request runs (pipelining); more closes it after
WRITE_TIMEOUT_S = 60.0  # a client that does not read its answer for this long is dropped
CANCEL_FILE_TTL_S = 60.0  # how long a cancel file outlives its request's answer (the model may still be mid-step)
SECRET_HEADER = "dflash-front"
CANCEL_PARAMETER = "dflash_cancel"   # request parameter carrying the cancel token to the model
CANCEL_DIR_ENV = "DFLASH_CANCEL_DIR"  # where the model looks for cancel files (set in the server's environment)
# Triton APIs that require the secret header (every category its --http-restricted-api knows).
RESTRICTED_APIS = ("health,metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging")

_MODEL = r"/v2/models/([A-Za-z0-9_.\-]+)(?:/versions/[0-9]+)?"
_GET_ROUTES = re.compile(rf"^(?:/v2|/v2/health/live|{_MODEL}(?:/ready|/config|/stats)?)$")
_POST_ROUTES = re.compile(rf"^{_MODEL}/(infer|generate|generate_stream)$")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host", SECRET_HEADER}
_FRONT_ROUTES = ("/health", "/metrics", "/v1/models", "/v2/health/ready")


@dataclass
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_connections: int = 1024
    max_connections_per_client: int = 256
    max_header_bytes: int = 16 << 10
    max_url_bytes: int = 8 << 10
    header_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    request_timeout_s: float = 600.0

    def check(self) -> "Limits":
        if not 1 <= self.max_body_bytes <= 1 << 30:
            raise DFlashError(f"must be in 1..{1 << 30}, got {self.max_body_bytes}", field="--max-request-bytes")
        if not 2 <= self.max_json_depth <= 256:
            raise DFlashError(f"must be in 2..256, got {self.max_json_depth}", field="--max-json-depth")
        if not 1 <= self.max_connections_per_client <= self.max_connections <= 65536:
            raise DFlashError(f"need 1 <= per client ({self.max_connections_per_client}) <= total "
                              f"({self.max_connections}) <= 65536", field="--max-connections")
        if not 0 < self.request_timeout_s <= 86400:
            raise DFlashError(f"must be in (0, 86400] seconds, got {self.request_timeout_s}",
                              field="--request-timeout")
        if not (0 < self.header_timeout_s <= 3600 and 0 < self.body_timeout_s <= 3600):
            raise DFlashError("header and body timeouts must be in (0, 3600] seconds", field="--header-timeout")
        if not 256 <= self.max_url_bytes <= self.max_header_bytes <= 1 << 20:
            raise DFlashError("need 256 <= URL limit <= header limit <= 1 MiB", field="--max-header-bytes")
        return self


class Refused(Exception):
    """A request the front answers itself: HTTP status + message (sent as {"error": message}, or in OpenAI's
    error shape on /v1 routes)."""

    def __init__(self, status: int, message: str, close: bool = False, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.close, self.headers = status, message, close, headers or {}


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


def parse_json_bounded(data: bytes, max_depth: int, what: str = "request body"):
    """Decode JSON bytes, refusing (400) invalid UTF-8 / JSON, nesting deeper than `max_depth`, and lone surrogates
    (which JSON's \\ud800 escapes can carry and no UTF-8 encoder downstream accepts)."""
    # Cheap upper bound first: a body cannot nest deeper than it has brackets; scanning for real depth only when
    # it might exceed the limit keeps deep inputs from ever reaching a recursive decoder.
    if data.count(b"[") + data.count(b"{") > max_depth and _bracket_depth(data) > max_depth:
        raise Refused(400, f"{what}: JSON nested deeper than {max_depth} levels (the limit, --max-json-depth)")
    try:
        obj = json.loads(data)
    except UnicodeDecodeError as e:
        raise Refused(400, f"{what}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise Refused(400, f"{what}: not valid JSON ({e.msg} at offset {e.pos})") from None
    except RecursionError:  # unreachable after the depth scan; kept so no input can become a 500
        raise Refused(400, f"{what}: JSON nested deeper than {max_depth} levels (the limit, --max-json-depth)"
                      ) from None
    if b"\\u" in data or b"\\U" in data:  # only an escape can carry a surrogate past the UTF-8 decoder
        _check_surrogates(obj, what)
    return obj


def _check_surrogates(obj, what: str) -> None:
    """Refuse (400) a lone surrogate anywhere in decoded JSON, naming where: `field.sub[2]` from the top."""
    stack = [(obj, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                where = (path or what)[:80]
                raise Refused(400, f"{where}: lone surrogate \\u{ord(v[e.start]):04x} at character {e.start} (not "
                                   "valid Unicode text)") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, path or what))
                stack.append((x, f"{path}.{k}" if path else str(k)))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def _bracket_depth(data: bytes) -> int:
    """Maximum bracket nesting of JSON text, strings skipped (no recursion, linear time)."""
    text = _STRING.sub(b'""', data)
    depth = best = 0
    for m in re.finditer(rb"[\[\]{}]", text):
        if m.group() in (b"[", b"{"):
            depth += 1
            best = max(best, depth)
        else:
            depth -= 1
    return best


class _Conn:
    """One client connection: its h11 state machine, its socket streams, and what the front knows of it."""

    def __init__(self, front: "Front", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.front, self.reader, self.writer = front, reader, writer
        self.h = h11.Connection(h11.SERVER, max_incomplete_event_size=front.limits.max_header_bytes)
        peer = writer.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) and peer else "?"
        self.busy = False           # a request head has arrived and its answer is not finished
        self.since = time.monotonic()
        self.pending = bytearray()  # bytes the client sent while its request ran
        self.overflow = False
        self.head = bytearray()     # the bytes of the head being read (to tell 414 from 431)
        self.watcher: asyncio.Task | None = None
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True
        self.writer.transport.abort()

    async def _read(self, deadline: float) -> bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(self.reader.read(65536), remaining)

    async def next_event(self, deadline: float, in_head: bool = False):
        while True:
            ev = self.h.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            if self.pending:
                data, self.pending = bytes(self.pending), bytearray()
            else:
                try:
                    data = await self._read(deadline)
                except asyncio.TimeoutError:  # an OSError too since Python 3.11: the deadline, not a disconnect
                    raise
                except (ConnectionError, OSError):
                    data = b""
            if in_head and len(self.head) <= self.front.limits.max_header_bytes:
                self.head += data[: self.front.limits.max_header_bytes + 1 - len(self.head)]
            self.h.receive_data(data)

    async def watch(self) -> None:
        """Return when the client closes its connection. Bytes it sends meanwhile are kept for its next request
        (a pipelined request is not a disconnect); past PENDING_MAX the connection is closed after this answer."""
        while True:
            try:
                data = await self.reader.read(65536)
            except (ConnectionError, OSError):
                return
            if not data:
                return
            if len(self.pending) + len(data) <= PENDING_MAX:
                self.pending += data
            else:
                self.overflow = True

    def watching(self) -> asyncio.Task:
        """The task watching for the client to leave, started once per request (`stop_watching` ends it)."""
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self.watch())
        return self.watcher

    async def stop_watching(self) -> None:
        w, self.watcher = self.watcher, None
        if w is not None and not w.done():
            w.cancel()
            await asyncio.gather(w, return_exceptions=True)

    async def send(self, *events) -> None:
        data = b"".join(self.h.send(e) or b"" for e in events)
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), WRITE_TIMEOUT_S)

    async def send_raw(self, status: int, message: str, extra: dict | None = None) -> None:
        """An answer outside h11's state machine (no request was parsed: refused connection, bad or late head)."""
        body = (json.dumps({"error": message}) + "\n").encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in (extra or {}).items())
        reason = _REASONS.get(status, "")
        self.writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: "
                          f"{len(body)}\r\n{head}Connection: close\r\n\r\n".encode() + body)
        try:
            await asyncio.wait_for(self.writer.drain(), 5)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass


class Front:
    """The front server: `start()` binds host:port (serving 503 until `set_upstream`), `drain()` then `close()`.

    `model_id`: the name the OpenAI API serves the model under; `models`: the Triton models of the repository
    (the streaming one is used for `"stream": true` when present); `capacity`: sequences the deployment decodes at
    once (for the batch-occupancy gauge); `health`: returns why the server is not ready, or None;
    `prompt_char_limit`: prompt text longer than this many characters cannot fit the engine and gets its 400 here,
    before it is queued or tokenized (handler.prompt_char_limit).
    """

    def __init__(self, host: str, port: int, limits: Limits | None = None, cancel_dir: Path | None = None,
                 model_id: str = "dflash", models: tuple[str, ...] = ("dflash", "dflash_stream"), capacity: int = 1,
                 prompt_char_limit: int | None = None, upstream_uds: Path | None = None):
        self.host, self.port = host, port
        self.upstream_uds = upstream_uds  # tritonserver's HTTP port through this Unix socket (its own namespace)
        self.prompt_char_limit = prompt_char_limit
        self.limits = (limits or Limits()).check()
        self.secret = secrets.token_hex(16)
        self.cancel_dir = Path(cancel_dir) if cancel_dir else None
        self.upstream_port: int | None = None
        self.model_id, self.models = model_id, tuple(models)
        self.health: Callable[[], str | None] | None = None
        # Why one model cannot serve (its stub died), the others serving meanwhile; None: `health` decides.
        self.model_health: Callable[[str], str | None] | None = None
        self.created = oa.now()
        self.draining = False
        self.metrics = FrontMetrics(capacity=capacity)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, str | None] = {}  # cancel token -> why it was cancelled (None: running)
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._client = None
        self.counts = {"forwarded": 0, "refused": 0, "client_gone": 0, "cancelled_at_shutdown": 0, "evicted": 0,
                       "timed_out": 0}

    # Lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> "Front":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            raise DFlashError(f"cannot listen on {self.host}:{self.port} ({e.strerror or e})",
                              field="--http-port") from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dflash-front", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(sock), self._loop).result(timeout=30)
        return self

    async def _open(self, sock: socket.socket) -> None:
        import httpx

        # No kept-alive upstream connections: tritonserver's shutdown waits for every open HTTP connection.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        transport = httpx.AsyncHTTPTransport(uds=str(self.upstream_uds), limits=limits) if self.upstream_uds else None
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False, limits=limits,
                                         transport=transport)
        self._server = await asyncio.start_server(self._on_connection, sock=sock, limit=1 << 16)

    def set_upstream(self, port: int | None) -> None:
        """Forward to tritonserver's HTTP port on loopback (None: answer 503 "restarting" meanwhile)."""
        self.upstream_port = port

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def drain(self, timeout_s: float, grace_s: float = 10.0) -> bool:
        """Stop taking requests (503) and wait up to `timeout_s` for those in flight. True if all finished; else
        cancel the rest (their clients get 503 "shutting down", or an error event on a stream), wait up to `grace_s`
        for them to answer, and return False."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._in_flight and time.monotonic() < deadline:
                self._idle.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            if not self._in_flight:
                return True
            tokens = list(self._in_flight)
        for token in tokens:
            self.cancel(token, f"the server is shutting down (requests still running after the {timeout_s:g} s "
                               "drain)")
            self.counts["cancelled_at_shutdown"] += 1
        end = time.monotonic() + grace_s
        with self._lock:
            while self._in_flight and time.monotonic() < end:
                self._idle.wait(timeout=0.2)
        return False

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._loop = None
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.evict()
        if self._client is not None:
            await self._client.aclose()

    # Cancellation ------------------------------------------------------------------------------------------------
    def cancel(self, token: str, why: str) -> bool:
        """Mark a running request cancelled (the model sees it at its next step). False if it is not running."""
        with self._lock:
            if token not in self._in_flight or self._in_flight[token] is not None:
                return False
            self._in_flight[token] = why
        if self.cancel_dir is not None:
            try:  # written aside and renamed: the model must never read a created but still empty file
                tmp = self.cancel_dir / f".{token}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(why)
                os.replace(tmp, self.cancel_dir / token)
            except OSError:
                pass
        return True

    def _begin(self) -> str:
        token = secrets.token_hex(12)
        with self._lock:
            self._in_flight[token] = None
            n = len(self._in_flight)
        self.metrics.set_in_flight(n)
        return token

    def _end(self, token: str) -> str | None:
        with self._lock:
            why = self._in_flight.pop(token, None)
            n = len(self._in_flight)
            self._idle.notify_all()
        self.metrics.set_in_flight(n)
        if why is not None and self.cancel_dir is not None:
            # The model reads the file between steps, possibly after its client's answer was given up on: it stays
            # for CANCEL_FILE_TTL_S, then goes.
            path = self.cancel_dir / token
            loop = self._loop
            if loop is not None and loop.is_running():
                loop.call_soon_threadsafe(loop.call_later, CANCEL_FILE_TTL_S, _unlink, path)
            else:
                _unlink(path)
        return why

    def _why(self, token: str | None) -> str | None:
        with self._lock:
            return self._in_flight.get(token) if token else None

    # Connections -------------------------------------------------------------------------------------------------
    def _admit(self, conn: _Conn) -> bool:
        """Room for a new connection: under both caps, or made by dropping the oldest connection that has not
        delivered a request head (of this client when its own cap is what is full)."""
        lim = self.limits
        mine = [c for c in self._conns if c.peer == conn.peer]
        for pool, cap in ((mine, lim.max_connections_per_client), (list(self._conns), lim.max_connections)):
            if len(pool) < cap:
                continue
            idle = [c for c in pool if not c.busy]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.since)
            victim.evict()
            self._conns.discard(victim)
            self.counts["evicted"] += 1
            if pool is mine:
                mine.remove(victim)
        return True

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(self, reader, writer)
        if not self._admit(conn):
            await conn.send_raw(503, f"too many connections busy with requests (the front's limit is "
                                     f"{self.limits.max_connections}, {self.limits.max_connections_per_client} per "
                                     "client)", {"Retry-After": "1"})
            writer.close()
            return
        self._conns.add(conn)
        try:
            await self._serve_connection(conn)
        except (ConnectionError, OSError, asyncio.TimeoutError, h11.LocalProtocolError):
            pass
        finally:
            self._conns.discard(conn)
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    async def _serve_connection(self, conn: _Conn) -> None:
        lim = self.limits
        while True:
            conn.busy, conn.since, conn.head = False, time.monotonic(), bytearray()
            try:
                ev = await conn.next_event(conn.since + lim.header_timeout_s, in_head=True)
            except asyncio.TimeoutError:
                if conn.head:
                    self.counts["timed_out"] += 1
                    await conn.send_raw(408, f"request head not received within {lim.header_timeout_s:g} s")
                return
            except h11.RemoteProtocolError as e:
                if not conn.evicted and "peer unexpectedly closed" not in str(e):  # nobody left to answer
                    await self._protocol_error(conn, e)
                return
            if isinstance(ev, h11.ConnectionClosed):
                return
            if not isinstance(ev, h11.Request):
                return
            conn.busy = True
            keep = await self._request(conn, ev)
            if not keep or conn.overflow or conn.h.our_state is not h11.DONE or conn.h.their_state is not h11.DONE:
                return
            try:
                conn.h.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _protocol_error(self, conn: _Conn, e: h11.RemoteProtocolError) -> None:
        status = e.error_status_hint or 400
        lim = self.limits
        first_line_end = bytes(conn.head).find(b"\r\n")
        if status == 431 and (first_line_end < 0 or first_line_end > lim.max_url_bytes):
            status, message = 414, f"request line longer than {lim.max_url_bytes} bytes"
        elif status == 431:
            message = f"request head larger than {lim.max_header_bytes} bytes"
        else:
            message = f"malformed HTTP request ({e})"
        self.counts["refused"] += 1
        self.metrics.observe_request("protocol", status)
        await conn.send_raw(status, message)

    # One request -------------------------------------------------------------------------------------------------
    async def _request(self, conn: _Conn, req: h11.Request) -> bool:
        """Answer one request; False when the connection must close afterwards."""
        method = req.method.decode("ascii", "replace")
        target = req.target.decode("ascii", "replace")
        path = target.split("?", 1)[0]
        openai = path.startswith("/v1/")
        route = path if path in _FRONT_ROUTES or openai else "triton"
        head_only = method == "HEAD"
        try:
            if len(req.target) > self.limits.max_url_bytes:
                raise Refused(414, f"URL longer than {self.limits.max_url_bytes} bytes", close=True)
            # h11 bounds a head that arrives in pieces; one that arrives whole is measured here.
            head_len = len(req.method) + len(req.target) + 12 + sum(len(k) + len(v) + 4 for k, v in req.headers)
            if head_len > self.limits.max_header_bytes:
                raise Refused(431, f"request head larger than {self.limits.max_header_bytes} bytes", close=True)
            headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in req.headers]
            names = [k for k, _ in headers]
            if "transfer-encoding" in names and "content-length" in names:
                raise Refused(400, "both Content-Length and Transfer-Encoding: send one", close=True)
            has_body = "transfer-encoding" in names or any(k == "content-length" and v.strip() != "0"
                                                           for k, v in headers)
            if method not in ("GET", "HEAD", "POST"):
                raise Refused(405, f"method {method[:20]} not allowed", close=True)
            if method != "POST" and has_body:
                raise Refused(400, f"{method} takes no request body", close=True)
            body = await self._read_body(conn, headers) if method == "POST" else b""
            status = await self._route(conn, method, target, path, dict(headers), body, head_only)
            self.metrics.observe_request(route, status)
            return True
        except Refused as e:
            self.counts["refused"] += 1
            self.metrics.observe_request(route, e.status)
            if conn.h.our_state is h11.SEND_RESPONSE:
                payload = oa.OpenAIError(e.status, e.message).body() if openai else {"error": e.message}
                extra = dict(e.headers)
                if e.status == 503:
                    extra.setdefault("Retry-After", "1")
                await conn.send(*_answer(e.status, payload, close=e.close, extra=extra, head_only=head_only))
                return not e.close
            return False
        except oa.OpenAIError as e:
            self.counts["refused"] += 1
            self.metrics.observe_request(route, e.status)
            if conn.h.our_state is h11.SEND_RESPONSE:
                await conn.send(*_answer(e.status, e.body(), head_only=head_only))
                return True
            return False
        except ClientGone:
            return False
        finally:
            await conn.stop_watching()

    async def _read_body(self, conn: _Conn, headers: list[tuple[str, str]]) -> bytes:
        lim = self.limits
        declared = next((v for k, v in headers if k == "content-length"), None)
        chunked = any(k == "transfer-encoding" for k, _ in headers)
        if declared is None and not chunked:
            raise Refused(411, "Content-Length required", close=True)
        deadline = time.monotonic() + lim.body_timeout_s
        if declared is not None and int(declared) > lim.max_body_bytes:
            n = int(declared)
            if conn.h.they_are_waiting_for_100_continue:  # it has not sent the body: answer before it does
                raise Refused(413, f"request body is {n} bytes; the limit is {lim.max_body_bytes} "
                                   "(--max-request-bytes)", close=True)
            # Read (and drop) a moderately large body so the client sees the 413 rather than a reset while it is
            # still sending; beyond DISCARD_MAX just close.
            if n <= DISCARD_MAX:
                await self._discard(conn, deadline)
            raise Refused(413, f"request body is {n} bytes; the limit is {lim.max_body_bytes} (--max-request-bytes)",
                          close=True)
        if conn.h.they_are_waiting_for_100_continue:  # `Expect: 100-continue`: the client waits for this to send
            await conn.send(h11.InformationalResponse(status_code=100, headers=[]))
        parts, size = [], 0
        while True:
            try:
                ev = await conn.next_event(deadline)
            except asyncio.TimeoutError:
                raise Refused(408, f"request body not received within {lim.body_timeout_s:g} s", close=True) \
                    from None
            except h11.RemoteProtocolError as e:
                raise Refused(400, f"request body: {e}", close=True) from None
            if isinstance(ev, h11.Data):
                size += len(ev.data)
                if size > lim.max_body_bytes:
                    # A chunked body has no declared length: drop the rest of it (up to DISCARD_MAX, within the
                    # body deadline) so the 413 reaches a client still sending, instead of a reset.
                    await self._discard(conn, deadline, DISCARD_MAX - size)
                    raise Refused(413, f"request body is over {lim.max_body_bytes} bytes (--max-request-bytes)",
                                  close=True)
                parts.append(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                return b"".join(parts)
            else:
                raise ClientGone

    async def _discard(self, conn: _Conn, deadline: float, limit: int = DISCARD_MAX) -> None:
        try:
            while limit > 0:
                ev = await conn.next_event(deadline)
                if not isinstance(ev, h11.Data):
                    return
                limit -= len(ev.data)
        except (asyncio.TimeoutError, h11.RemoteProtocolError, ConnectionError, OSError):
            return

    async def _route(self, conn: _Conn, method: str, target: str, path: str, headers: dict, body: bytes,
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
            if path == "/v1/models":
                return await self._json(conn, 200, oa.models_list(self.model_id, self.created), head_only)
            if path.startswith("/v1/models/"):
                if path[len("/v1/models/"):] != self.model_id:
                    raise oa.OpenAIError(404, f"model {path[len('/v1/models/'):][:80]!r} is not served here",
                                         param="model", code="model_not_found")
                return await self._json(conn, 200, oa.model_card(self.model_id, self.created), head_only)
            if gm := _GET_ROUTES.match(path):
                self._check_serving(gm.group(1))
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
        body, token = self._check_body(m.group(2), headers, body)
        try:
            return await self._forward(conn, "POST", target, headers, body, token, m.group(2) == "generate_stream",
                                       False, generation=m.group(2) != "infer")
        finally:
            self._end(token)

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

    def _check_serving(self, model: str | None = None) -> None:
        why = self._not_ready(model)
        if why is not None:
            raise Refused(503, why if self.draining else f"{why}; retry shortly", close=self.draining)

    def _refuse_if_drained(self, token: str | None) -> None:
        """503 "shutting down" for a request the drain cancelled (its client gets that, not the engine's error)."""
        why = self._why(token)
        if why is not None and "shutting down" in why:
            raise Refused(503, f"cancelled: {why}", close=True)

    async def _reply(self, conn: _Conn, status: int, body: bytes, ctype: str, head_only: bool = False) -> int:
        await conn.send(*_answer(status, body, ctype=ctype, head_only=head_only))
        return status

    async def _json(self, conn: _Conn, status: int, payload, head_only: bool = False) -> int:
        await conn.send(*_answer(status, payload, head_only=head_only))
        return status

    # Checking Triton bodies --------------------------------------------------------------------------------------
    def _check_body(self, endpoint: str, headers: dict, body: bytes) -> tuple[bytes, str]:
        """The body with its JSON part checked and tagged with a new cancel token, and that token."""
        header_len = headers.get("inference-header-content-length")
        if header_len is not None and endpoint != "infer":
            raise Refused(400, f"Inference-Header-Content-Length: binary tensors are for /infer, not {endpoint}")
        json_len = _json_length(header_len, body)
        obj = parse_json_bounded(body[:json_len], self.limits.max_json_depth)
        try:
            if endpoint == "infer":
                obj = check_infer_body(obj, len(body) - json_len)
                self._check_prompt_size({t["name"]: t["data"][0] for t in obj["inputs"]
                                         if t["name"] in ("text_input", "messages") and t.get("data")})
            else:
                obj = check_generate_body(obj)
                if "messages" in obj:  # its JSON text is parsed again by the model: the same depth limit applies
                    parse_json_bounded(obj["messages"].encode(), self.limits.max_json_depth, "messages")
                self._check_prompt_size(obj)
        except DFlashError as e:
            raise Refused(400, str(e)) from None
        token = self._begin()
        if endpoint == "infer":
            obj["parameters"] = {**obj.get("parameters", {}), CANCEL_PARAMETER: token}
        else:  # the generate extension passes fields that are not inputs as request parameters
            obj[CANCEL_PARAMETER] = token
        head = json.dumps(obj, ensure_ascii=False).encode()
        if header_len is not None:
            headers["inference-header-content-length"] = str(len(head))
        return head + body[json_len:], token

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

    # Upstream ----------------------------------------------------------------------------------------------------
    def _upstream_headers(self, headers: dict, n: int | None) -> dict:
        out = {k: v for k, v in headers.items() if k not in _HOP}
        out[SECRET_HEADER] = self.secret
        if n is not None:
            out["content-length"] = str(n)
        return out

    async def _race(self, conn: _Conn, aw, token: str | None, timeout: float):
        """Await `aw` while watching the client: ClientGone (request cancelled) if it leaves first, 504 (request
        cancelled) if `timeout` passes first."""
        task = asyncio.ensure_future(aw)
        watcher = conn.watching()
        try:
            done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        if watcher in done:
            if token is not None and self.cancel(token, "the client went away"):
                self.counts["client_gone"] += 1
            raise ClientGone
        if token is not None:
            self.cancel(token, f"no answer from the engine within {self.limits.request_timeout_s:g} s")
        self.counts["timed_out"] += 1
        raise Refused(504, f"the engine did not answer within {self.limits.request_timeout_s:g} s "
                           "(--request-timeout); the request was cancelled")

    async def _send_upstream(self, conn: _Conn, method: str, target: str, headers: dict, body: bytes,
                             token: str | None):
        import httpx

        url = f"http://127.0.0.1:{self.upstream_port}{target}"
        req = self._client.build_request(method, url, content=body if method == "POST" else None,
                                         headers=self._upstream_headers(headers, len(body) if method == "POST"
                                                                        else None))
        try:
            return await self._race(conn, self._client.send(req, stream=True), token, self.limits.request_timeout_s)
        except (httpx.TransportError, OSError):
            raise Refused(503, "tritonserver is not answering (it is being restarted); retry shortly",
                          headers={"Retry-After": "2"}) from None

    async def _read_upstream(self, conn: _Conn, resp, token: str | None) -> bytes:
        import httpx

        try:
            return await self._race(conn, resp.aread(), token, self.limits.request_timeout_s)
        except (httpx.TransportError, OSError):
            raise Refused(503, "tritonserver stopped answering mid-request (a model stub or the server died); "
                               "retry shortly", headers={"Retry-After": "2"}) from None
        finally:
            await resp.aclose()

    async def _forward(self, conn: _Conn, method: str, target: str, headers: dict, body: bytes, token: str | None,
                       streaming: bool, head_only: bool, generation: bool = False) -> int:
        resp = await self._send_upstream(conn, method, target, headers, body, token)
        if streaming:
            return await self._relay_stream(conn, resp, token)
        payload = await self._read_upstream(conn, resp, token)
        self._refuse_if_drained(token)
        if resp.status_code != 200 and ((self.health is not None and (sick := self.health()))
                                        or (sick := _instance_died(payload))):
            raise Refused(503, f"{sick}; retry shortly", headers={"Retry-After": "2"})
        if generation and resp.status_code == 200:
            self._observe(payload)
        self.counts["forwarded"] += 1
        ctype = resp.headers.get("content-type", "application/json")
        extra = {k: v for k, v in resp.headers.items()
                 if k.lower() not in _HOP | {"content-type", "content-encoding", "server"}}
        await conn.send(*_answer(resp.status_code, payload, ctype=ctype, head_only=head_only, extra=extra))
        return resp.status_code

    def _observe(self, payload: bytes | dict) -> None:
        try:
            obj = json.loads(payload) if isinstance(payload, bytes) else payload
            stats = obj.get("step_stats")
            stats = json.loads(stats) if isinstance(stats, str) and stats else {}
            self.metrics.observe_generation(int(obj.get("completion_tokens", 0)), int(obj.get("prompt_tokens", 0)),
                                            {**stats, "drafted_tokens": obj.get("drafted_tokens", 0),
                                             "accepted_tokens": obj.get("accepted_tokens", 0)})
        except (ValueError, TypeError, AttributeError):
            pass

    async def _upstream_events(self, conn: _Conn, resp, token: str | None):
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
                except (httpx.TransportError, OSError):
                    yield {"error": "tritonserver stopped answering mid-stream (a model stub or the server died)"}
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

    async def _relay_stream(self, conn: _Conn, resp, token: str | None) -> int:
        """generate_stream, relayed event by event (re-framed: the front's own chunked encoding)."""
        if resp.status_code != 200:
            payload = await self._read_upstream(conn, resp, token)
            self._refuse_if_drained(token)  # cancelled while queued, by the drain
            await conn.send(*_answer(resp.status_code, payload, ctype=resp.headers.get("content-type",
                                                                                       "application/json")))
            return resp.status_code
        await conn.send(h11.Response(status_code=200, headers=[("Content-Type", "text/event-stream"),
                                                               ("Cache-Control", "no-cache")]))
        async for ev in self._upstream_events(conn, resp, token):
            why = self._why(token) if "error" in ev else None
            if why is not None and "shutting down" in why:
                ev = {"error": f"cancelled: {why}"}
            await conn.send(h11.Data(data=oa.sse(ev)))
            if ev.get("finish_reason"):
                self._observe(ev)
        self.counts["forwarded"] += 1
        await conn.send(h11.EndOfMessage())
        return 200

    # OpenAI ------------------------------------------------------------------------------------------------------
    async def _openai(self, conn: _Conn, path: str, obj) -> int:
        chat = path == "/v1/chat/completions"
        try:
            gen, stream, include_usage = (oa.chat_request if chat else oa.completion_request)(obj, self.model_id)
            gen = check_generate_body(gen)
            self._check_prompt_size(gen)
        except DFlashError as e:
            raise oa.from_dflash_error(e) from None
        rid, created = oa.new_id("chatcmpl" if chat else "cmpl"), oa.now()
        token = self._begin()
        gen[CANCEL_PARAMETER] = token
        body = json.dumps(gen, ensure_ascii=False).encode()
        headers = {"content-type": "application/json"}
        model = self._openai_model(stream)
        use_stream_model = model == "dflash_stream"
        target = f"/v2/models/{model}/{'generate_stream' if use_stream_model else 'generate'}"
        try:
            resp = await self._send_upstream(conn, "POST", target, headers, body, token)
            if resp.status_code != 200 or not use_stream_model:
                payload = await self._read_upstream(conn, resp, token)
                answer = self._answer_of(resp.status_code, payload, token)
                self._observe(answer["raw"])
                if not stream:
                    out = (oa.chat_response if chat else oa.completion_response)(rid, self.model_id, created, answer)
                    return await self._json(conn, 200, out)
                events = _one_event(answer["raw"])
            else:
                events = self._upstream_events(conn, resp, token)
            return await self._openai_stream(conn, chat, rid, created, include_usage, events, token)
        finally:
            self._end(token)

    def _answer_of(self, status: int, payload: bytes, token: str | None) -> dict:
        self._refuse_if_drained(token)
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = {"error": payload[:200].decode("utf-8", "replace")}
        if status != 200 or "error" in obj:
            raise self._upstream_error(status, obj.get("error"))
        return {"text": obj.get("text_output", ""), "finish_reason": obj.get("finish_reason") or "stop",
                "prompt_tokens": int(obj.get("prompt_tokens", 0)),
                "completion_tokens": int(obj.get("completion_tokens", 0)), "raw": obj}

    def _upstream_error(self, status: int, message) -> oa.OpenAIError:
        message = str(message or "the engine refused the request")
        sick = (self.health() if self.health is not None else None) or _instance_died(message)
        if status != 200 and sick:
            return oa.OpenAIError(503, f"{sick}; retry shortly", kind="server_error")
        if status == 400 or "INVALID_ARG" in message:
            field = message.split(":", 1)[0] if ":" in message else None
            return oa.OpenAIError(400, message, param=field)
        if status in (429, 503) or "queue" in message.lower():
            return oa.OpenAIError(503, message, kind="server_error")
        return oa.OpenAIError(status if status >= 400 else 500, message, kind="server_error")

    async def _openai_stream(self, conn: _Conn, chat: bool, rid: str, created: int, include_usage: bool, events,
                             token: str | None) -> int:
        await conn.send(h11.Response(status_code=200, headers=[("Content-Type", "text/event-stream"),
                                                               ("Cache-Control", "no-cache")]))
        mk = oa.chat_chunk if chat else oa.completion_chunk
        first = True
        prompt_tokens = completion_tokens = 0
        async for ev in events:
            if "error" in ev:
                why = self._why(token)
                err = oa.OpenAIError(503, f"cancelled: {why}", kind="server_error") if why else \
                    self._upstream_error(500, ev["error"])
                await conn.send(h11.Data(data=oa.sse(err.body())))
                break
            text, reason = ev.get("text_output", ""), ev.get("finish_reason") or None
            prompt_tokens = int(ev.get("prompt_tokens", prompt_tokens) or prompt_tokens)
            completion_tokens = int(ev.get("completion_tokens", completion_tokens) or completion_tokens)
            if chat and first:
                await conn.send(h11.Data(data=oa.sse(mk(rid, self.model_id, created, {"role": "assistant",
                                                                                    "content": ""}, None))))
            first = False
            if text or reason:
                delta = ({"content": text} if text else {}) if chat else text
                await conn.send(h11.Data(data=oa.sse(mk(rid, self.model_id, created, delta, reason))))
            if reason:
                self._observe(ev)
                if include_usage:
                    await conn.send(h11.Data(data=oa.sse(mk(rid, self.model_id, created, {} if chat else "", None,
                                                            oa.usage(prompt_tokens, completion_tokens),
                                                            choices=False))))
                break
        await conn.send(h11.Data(data=oa.sse(b"[DONE]")), h11.EndOfMessage())
        self.counts["forwarded"] += 1
        return 200


def _instance_died(text: bytes | str) -> str | None:
    """The python backend's answer from a model instance whose stub died ("Stub process '<instance>' is not
    healthy."), whatever `serve`'s health check has seen yet: the server's fault, so a 503, never the client's 400."""
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    m = re.search(r"Stub process '([^']{1,80})' is not healthy", text)
    return f"model instance {m.group(1)} died (the server restarts)" if m else None


async def _one_event(obj: dict):
    yield obj


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


_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large", 414: "URI Too Long",
            431: "Request Header Fields Too Large", 501: "Not Implemented", 503: "Service Unavailable"}


def _answer(status: int, payload, ctype: str = "application/json", close: bool = False, extra: dict | None = None,
            head_only: bool = False) -> list:
    """The h11 events of a whole answer: JSON (a dict) or bytes, with its length; no body bytes for HEAD."""
    body = payload if isinstance(payload, bytes) else (json.dumps(payload) + "\n").encode()
    headers = [("Content-Type", ctype), ("Content-Length", str(len(body)))]
    headers += [(k, v) for k, v in (extra or {}).items()]
    if close:
        headers.append(("Connection", "close"))
    events = [h11.Response(status_code=status, headers=headers)]
    if not head_only and body:
        events.append(h11.Data(data=body))
    events.append(h11.EndOfMessage())
    return events


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def new_cancel_dir(parent: Path) -> Path:
    d = Path(parent) / "cancel"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def cancel_reason(token: str | None) -> str | None:
    """Inside the model: why the request with this cancel token was cancelled (None: it was not)."""
    d = os.environ.get(CANCEL_DIR_ENV)
    if not d or not token or not re.fullmatch(r"[0-9a-f]{8,64}", token):
        return None
    try:
        with open(os.path.join(d, token), encoding="utf-8") as f:
            return f.read(200) or "cancelled"
    except OSError:
        return None
