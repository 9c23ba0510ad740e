"""The HTTP front `serve` puts before tritonserver: bounded, checked requests in; the server itself only on loopback.

The bundled tritonserver (nvidia-pytriton 0.7) has no request size limit and parses JSON recursively: a 6 MB body or
100 000 nested `[` crash it (signal 11). So its HTTP port is never exposed. This front listens on `--host`:`--http-port`
and, before anything reaches Triton's parser:

- refuses a body over `max_body_bytes` (413), without a Content-Length (411), or whose JSON (the header part of a
  binary-tensor request) is invalid or nested deeper than `max_json_depth` (400, naming the limit);
- checks generate / generate_stream bodies field by field (`handler.check_generate_body`: unknown fields, JSON types,
  64-bit ranges, lone surrogates -> 400 naming the field);
- forwards only the inference protocol's read-only and inference routes (health, metadata, config, stats, infer,
  generate, generate_stream), with a per-start secret header that Triton's `--http-restricted-api` demands, so
  Triton's own port answers nothing to anyone else even on loopback;
- watches each client while its request runs: when the client goes away, it writes the request's cancel file, which
  the model checks between DFlash steps (Triton's HTTP endpoint has no cancellation of its own, only gRPC has);
- drains on shutdown: new requests get 503, in-flight ones finish; those still running at the deadline are cancelled
  and answered 503 "shutting down" instead of a reset connection.

Plain threads and http.client: one thread per client connection, bounded by `max_connections`.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dflash_export.deploy.handler import check_generate_body
from dflash_export.errors import DFlashError

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_JSON_DEPTH = 32
DISCARD_MAX = 64 << 20  # an over-limit body up to this size is read and dropped before the 413
SECRET_HEADER = "dflash-front"
CANCEL_PARAMETER = "dflash_cancel"   # request parameter carrying the cancel token to the model
CANCEL_DIR_ENV = "DFLASH_CANCEL_DIR"  # where the model looks for cancel files (set in the server's environment)
# Triton APIs that require the secret header (every category its --http-restricted-api knows).
RESTRICTED_APIS = ("health,metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging")

_MODEL = r"/v2/models/[A-Za-z0-9_.\-]+(?:/versions/[0-9]+)?"
_GET_ROUTES = re.compile(rf"^(?:/v2|/v2/health/(?:live|ready)|{_MODEL}(?:/ready|/config|/stats)?)$")
_POST_ROUTES = re.compile(rf"^{_MODEL}/(infer|generate|generate_stream)$")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host", SECRET_HEADER}


@dataclass
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_connections: int = 256

    def check(self) -> "Limits":
        if not 1 <= self.max_body_bytes <= 1 << 30:
            raise DFlashError(f"must be in 1..{1 << 30}, got {self.max_body_bytes}", field="--max-request-bytes")
        if not 2 <= self.max_json_depth <= 256:
            raise DFlashError(f"must be in 2..256, got {self.max_json_depth}", field="--max-json-depth")
        return self


class Refused(Exception):
    """A request the front answers itself: HTTP status + message (sent as {"error": message})."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.close = status, message, close


def parse_json_bounded(data: bytes, max_depth: int, what: str = "request body"):
    """Decode JSON bytes, refusing (400) invalid UTF-8 / JSON and nesting deeper than `max_depth`."""
    # Cheap upper bound first: a body cannot nest deeper than it has brackets; scanning for real depth only when
    # it might exceed the limit keeps deep inputs from ever reaching a recursive decoder.
    if data.count(b"[") + data.count(b"{") > max_depth and _bracket_depth(data) > max_depth:
        raise Refused(400, f"{what}: JSON nested deeper than {max_depth} levels (the limit, --max-json-depth)")
    try:
        return json.loads(data)
    except UnicodeDecodeError as e:
        raise Refused(400, f"{what}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise Refused(400, f"{what}: not valid JSON ({e.msg} at offset {e.pos})") from None
    except RecursionError:  # unreachable after the depth scan; kept so no input can become a 500
        raise Refused(400, f"{what}: JSON nested deeper than {max_depth} levels (the limit, --max-json-depth)"
                      ) from None


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


class Front:
    """The front server: `start()` binds host:port (serving 503 until `set_upstream`), `drain()` then `close()`."""

    def __init__(self, host: str, port: int, limits: Limits | None = None, cancel_dir: Path | None = None):
        self.host, self.port = host, port
        self.limits = (limits or Limits()).check()
        self.secret = secrets.token_hex(16)
        self.cancel_dir = Path(cancel_dir) if cancel_dir else None
        self.upstream_port: int | None = None
        self.draining = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, str | None] = {}  # cancel token -> why it was cancelled (None: running)
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.counts = {"forwarded": 0, "refused": 0, "client_gone": 0, "cancelled_at_shutdown": 0}

    # Lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> "Front":
        front = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128
            allow_reuse_address = True

            def process_request(self, request, client_address):
                if not front._slots.acquire(blocking=False):
                    _reply_raw(request, 503, f"too many connections (the front's limit is "
                                             f"{front.limits.max_connections})")
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    front._slots.release()

        try:
            self._httpd = Server((self.host, self.port), _handler_class(self))
        except OSError as e:
            raise DFlashError(f"cannot listen on {self.host}:{self.port} ({e.strerror or e})",
                              field="--http-port") from None
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="dflash-front", daemon=True)
        self._thread.start()
        return self

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
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

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
                tmp.write_text(why)
                os.replace(tmp, self.cancel_dir / token)
            except OSError:
                pass
        return True

    def _begin(self) -> str:
        token = secrets.token_hex(12)
        with self._lock:
            self._in_flight[token] = None
        return token

    def _end(self, token: str) -> str | None:
        with self._lock:
            why = self._in_flight.pop(token, None)
            self._idle.notify_all()
        if why is not None and self.cancel_dir is not None:
            try:
                (self.cancel_dir / token).unlink()
            except OSError:
                pass
        return why


def _reply_raw(sock, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {http.client.responses.get(status, '')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.sendall(head + body)
    except OSError:
        pass


def _watch_client(sock: socket.socket, done: threading.Event, on_gone) -> None:
    """Call `on_gone` if the client closes its connection before `done` is set (EOF or reset while we wait)."""
    while not done.is_set():
        try:
            readable, _, _ = select.select([sock], [], [], 0.05)
        except (OSError, ValueError):
            on_gone()
            return
        if not readable:
            continue
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if not data:
            on_gone()
        return  # gone, or the client sent more (a pipelined request): either way nothing more to watch


class _FrontHandler(BaseHTTPRequestHandler):
    """One client connection of a Front (`front`, set by `_handler_class`): route, bound and check the request, then
    forward it to tritonserver and relay the answer."""

    front: Front
    protocol_version = "HTTP/1.1"
    server_version = "dflash-front"
    timeout = 60  # a client has this long for each read of its request (no slow-loris holding a thread)

    def log_message(self, *args):  # the front is quiet; tritonserver's log tells what was served
        pass

    def do_GET(self):
        self._serve(has_body=False)

    def do_POST(self):
        self._serve(has_body=True)

    def do_PUT(self):
        self._send_error(Refused(405, f"method {self.command} not allowed"))

    do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_PUT

    # Answers of the front itself ---------------------------------------------------------------------------------
    def _send_json(self, status: int, payload: dict, close: bool = False, extra: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _send_error(self, e: Refused) -> None:
        self.front.counts["refused"] += 1
        extra = {"Retry-After": "1"} if e.status == 503 else None
        self._send_json(e.status, {"error": e.message}, close=e.close, extra=extra)

    # Route, read and check ---------------------------------------------------------------------------------------
    def _serve(self, has_body: bool) -> None:
        front = self.front
        path = self.path.split("?", 1)[0]
        try:
            routes = _POST_ROUTES if has_body else _GET_ROUTES
            m = routes.match(path)
            if not m:
                raise Refused(404 if not (_GET_ROUTES.match(path) or _POST_ROUTES.match(path)) else 405,
                              f"{self.command} {path[:100]}: not served (the front forwards health, metadata, "
                              "infer, generate and generate_stream)", close=has_body)
            body = self._read_body() if has_body else b""
            if front.draining:
                raise Refused(503, "the server is shutting down", close=True)
            if front.upstream_port is None:
                raise Refused(503, "tritonserver is (re)starting; retry shortly")
            token = None
            if has_body:
                body, token = self._check_body(m.group(1), body)
        except Refused as e:
            self._send_error(e)
            return
        self._forward(body, token, streaming=has_body and m.group(1) == "generate_stream")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise Refused(411, "send the body with a Content-Length (chunked request bodies are not accepted)",
                          close=True)
        length = self.headers.get("Content-Length")
        if length is None:
            raise Refused(411, "Content-Length required", close=True)
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            raise Refused(400, f"Content-Length: not a byte count ({length[:40]!r})", close=True) from None
        limit = self.front.limits.max_body_bytes
        if n > limit:
            # Read (and drop) a moderately large body so the client sees the 413 rather than a reset while it
            # is still sending; beyond DISCARD_MAX just close.
            if n <= DISCARD_MAX:
                self._discard_body(n)
            raise Refused(413, f"request body is {n} bytes; the limit is {limit} (--max-request-bytes)",
                          close=True)
        try:
            body = self.rfile.read(n)
        except (OSError, socket.timeout):
            raise Refused(400, "request body: the client stopped sending", close=True) from None
        if len(body) != n:
            raise Refused(400, f"request body: {len(body)} of {n} bytes received", close=True)
        return body

    def _discard_body(self, n: int) -> None:
        """Read and drop up to `n` body bytes (until the client stops sending)."""
        left = n
        try:
            while left > 0:
                got = self.rfile.read(min(left, 1 << 16))
                if not got:
                    break
                left -= len(got)
        except (OSError, socket.timeout):
            pass

    def _check_body(self, endpoint: str, body: bytes) -> tuple[bytes, str]:
        """The body with its JSON part checked and tagged with a new cancel token, and that token."""
        header_len = self.headers.get("Inference-Header-Content-Length")
        json_len = self._json_length(header_len, body)
        obj = parse_json_bounded(body[:json_len], self.front.limits.max_json_depth)
        if endpoint in ("generate", "generate_stream"):
            obj, token = self._tag_generate_body(obj)
        else:
            obj, token = self._tag_infer_body(obj)
        head = json.dumps(obj, ensure_ascii=False).encode()
        if header_len is not None:
            self._header_len = len(head)
        return head + body[json_len:], token

    @staticmethod
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
            raise Refused(400, f"Inference-Header-Content-Length: {header_len[:40]!r} is not a length "
                               f"within the {len(body)}-byte body") from None
        return json_len

    def _tag_generate_body(self, obj) -> tuple[dict, str]:
        try:
            obj = check_generate_body(obj)
        except DFlashError as e:
            raise Refused(400, str(e)) from None
        if "messages" in obj:  # its JSON text is parsed again by the model: the same depth limit applies
            parse_json_bounded(obj["messages"].encode(), self.front.limits.max_json_depth, "messages")
        token = self.front._begin()
        # The generate extension passes fields that are not inputs as request parameters.
        obj[CANCEL_PARAMETER] = token
        return obj, token

    def _tag_infer_body(self, obj) -> tuple[dict, str]:
        if not isinstance(obj, dict):
            raise Refused(400, "request body: expected a JSON object")
        params = obj.get("parameters", {})
        if not isinstance(params, dict):
            raise Refused(400, "parameters: expected a JSON object")
        token = self.front._begin()
        obj["parameters"] = {**params, CANCEL_PARAMETER: token}
        return obj, token

    # Forward and relay -------------------------------------------------------------------------------------------
    def _forward(self, body: bytes, token: str | None, streaming: bool) -> None:
        front = self.front
        done = threading.Event()
        started = False
        conn = http.client.HTTPConnection("127.0.0.1", front.upstream_port, timeout=None)
        if token is not None:
            self._watch_while_running(token, done)
        try:
            resp = self._request_upstream(conn, body)
            # Whole responses are read whole (however tritonserver frames them), so a request cancelled by the
            # shutdown can still be answered 503; only generate_stream is relayed as it comes.
            if not streaming:
                payload = resp.read()
                done.set()  # the model has answered: a client leaving now cancels nothing
                why = front._in_flight.get(token) if token else None
                if why is not None and "shutting down" in why:
                    raise Refused(503, f"cancelled: {why}", close=True)
                started = True
                self._relay_whole(resp, payload)
            else:
                started = True
                self._relay_stream(resp, done)
            front.counts["forwarded"] += 1
        except Refused as e:
            if not started:
                self._send_error(e)
            else:
                self.close_connection = True
        except (OSError, http.client.HTTPException):
            # The client went away mid-response (or tritonserver died mid-stream): nothing more to say to it.
            self.close_connection = True
            if token is not None and not done.is_set() and front.cancel(token, "the client went away"):
                front.counts["client_gone"] += 1
        finally:
            done.set()
            conn.close()
            if token is not None:
                front._end(token)

    def _watch_while_running(self, token: str, done: threading.Event) -> None:
        """Cancel the request if its client goes away before `done` is set."""
        front = self.front

        def gone():
            if not done.is_set() and front.cancel(token, "the client went away"):
                front.counts["client_gone"] += 1

        threading.Thread(target=_watch_client, args=(self.connection, done, gone), daemon=True).start()

    def _request_upstream(self, conn: http.client.HTTPConnection, body: bytes) -> http.client.HTTPResponse:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        headers[SECRET_HEADER] = self.front.secret
        if body or self.command == "POST":
            headers["Content-Length"] = str(len(body))
        if getattr(self, "_header_len", None) is not None:
            headers["Inference-Header-Content-Length"] = str(self._header_len)
            self._header_len = None
        try:
            conn.request(self.command, self.path, body=body if self.command == "POST" else None,
                         headers=headers)
            return conn.getresponse()
        except (ConnectionError, OSError, http.client.HTTPException):
            raise Refused(503, "tritonserver is not answering (it is being restarted); retry shortly")

    def _send_upstream_head(self, resp: http.client.HTTPResponse) -> None:
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)

    def _relay_whole(self, resp: http.client.HTTPResponse, payload: bytes) -> None:
        self._send_upstream_head(resp)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def _relay_stream(self, resp: http.client.HTTPResponse, done: threading.Event) -> None:
        self._send_upstream_head(resp)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                done.set()
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _handler_class(front: Front) -> type[_FrontHandler]:
    """The request handler class of one Front (http.server makes a handler per connection from the class)."""
    return type("Handler", (_FrontHandler,), {"front": front})


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
