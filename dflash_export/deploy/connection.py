"""Connection handling of the HTTP front (deploy/front.py): everything between a client's socket and a parsed request.

It holds the front's `Limits`, the `Connection` (one client's h11 state machine, its streams, the watch for a client
that leaves while its request runs), and `ConnectionHandling`, the part of the front that admits connections under
the caps (evicting the oldest one that has not delivered a request head), reads heads and bodies within their
deadlines (414 / 431 / 408, `Expect: 100-continue`, chunked bodies, 413 past `max_body_bytes`), refuses bad framing,
and answers a refused request (`Refused`) in the shape of its route; `parse_json_bounded` decodes a body's JSON
within the depth limit. Nothing here knows a route or tritonserver: a parsed request goes to the front's `_route`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass

import h11

from dflash_export.deploy import openai_api as oa
from dflash_export.errors import DFlashError
from dflash_export.files import lone_surrogate

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_JSON_DEPTH = 32
DEFAULT_MAX_UPSTREAM_CALLS = 256  # calls the front has open to tritonserver at once (serve's default: at least this)
DISCARD_MAX = 64 << 20  # an over-limit body up to this size is read and dropped before the 413
PENDING_MAX = 64 << 10  # bytes a client may send ahead while its request runs (pipelining); more closes it after
WRITE_TIMEOUT_S = 60.0  # a client that does not read its answer for this long is dropped


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
    max_upstream_calls: int = DEFAULT_MAX_UPSTREAM_CALLS  # calls open to tritonserver at once; more wait their turn

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
        if not 1 <= self.max_upstream_calls <= 65536:
            raise DFlashError(f"must be in 1..65536, got {self.max_upstream_calls}", field="--max-upstream-calls")
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
    except ValueError:  # an integer literal past Python's int_max_str_digits (4300 digits by default)
        raise Refused(400, f"{what}: a number with more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # unreachable after the depth scan; kept so no input can become a 500
        raise Refused(400, f"{what}: JSON nested deeper than {max_depth} levels (the limit, --max-json-depth)"
                      ) from None
    # only an escape can carry a surrogate past the UTF-8 decoder
    if (b"\\u" in data or b"\\U" in data) and (bad := lone_surrogate(obj)):
        raise Refused(400, f"{(bad[0] or what)[:80]}: {bad[1]} (not valid Unicode text)")
    return obj


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


class Connection:
    """One client connection: its h11 state machine, its socket streams, and what the front knows of it."""

    def __init__(self, front: ConnectionHandling, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
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
        self.task: asyncio.Task | None = None  # the task serving this connection

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
        reason = REASONS.get(status, "")
        self.writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: "
                          f"{len(body)}\r\n{head}Connection: close\r\n\r\n".encode() + body)
        try:
            await asyncio.wait_for(self.writer.drain(), 5)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

class ConnectionHandling:
    """The front's connection side. Uses the front's `limits`, `counts`, `metrics` and `_conns`, and its `_route`
    (deploy/routing.py) for a request whose head and body were read."""

    def _admit(self, conn: Connection) -> bool:
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
        conn = Connection(self, reader, writer)
        conn.task = asyncio.current_task()
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

    async def _serve_connection(self, conn: Connection) -> None:
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

    async def _protocol_error(self, conn: Connection, e: h11.RemoteProtocolError) -> None:
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
    async def _request(self, conn: Connection, req: h11.Request) -> bool:
        """Answer one request; False when the connection must close afterwards."""
        method = req.method.decode("ascii", "replace")
        target = req.target.decode("ascii", "replace")
        path = target.split("?", 1)[0]
        openai = path.startswith("/v1/")
        route = self._route_label(path)
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
                payload = oa.OpenAIError(e.status, e.message, kind="server_error" if e.status >= 500 else
                                         "invalid_request_error").body() if openai else {"error": e.message}
                extra = dict(e.headers)
                if e.status == 503:
                    extra.setdefault("Retry-After", "1")
                await conn.send(*answer(e.status, payload, close=e.close, extra=extra, head_only=head_only))
                return not e.close
            return False
        except oa.OpenAIError as e:
            self.counts["refused"] += 1
            self.metrics.observe_request(route, e.status)
            if conn.h.our_state is h11.SEND_RESPONSE:
                extra = {"Retry-After": "1"} if e.status == 503 else None  # when to retry, as a Refused 503 says
                await conn.send(*answer(e.status, e.body(), head_only=head_only, extra=extra))
                return True
            return False
        except ClientGone:
            return False
        finally:
            await conn.stop_watching()

    async def _read_body(self, conn: Connection, headers: list[tuple[str, str]]) -> bytes:
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

    async def _discard(self, conn: Connection, deadline: float, limit: int = DISCARD_MAX) -> None:
        try:
            while limit > 0:
                ev = await conn.next_event(deadline)
                if not isinstance(ev, h11.Data):
                    return
                limit -= len(ev.data)
        except (asyncio.TimeoutError, h11.RemoteProtocolError, ConnectionError, OSError):
            return

REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large", 414: "URI Too Long",
            431: "Request Header Fields Too Large", 501: "Not Implemented", 503: "Service Unavailable"}


def answer(status: int, payload, ctype: str = "application/json", close: bool = False, extra: dict | None = None,
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

