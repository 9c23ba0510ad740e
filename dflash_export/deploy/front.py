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
- upstream calls: at most `max_upstream_calls` open to tritonserver at once (each choice of an OpenAI request is one
  call); the others wait for a free one in arrival order, within the request timeout (504 past it), and one whose
  client leaves while it waits sends nothing and takes no call's place;
- bodies: over `max_body_bytes` 413; JSON invalid, nested deeper than `max_json_depth`, or carrying a lone surrogate
  400; generate bodies checked field by field and /infer bodies input by input (deploy/handler.py), so no value
  reaches Triton's typed decoding that it would answer with a 500;
- cancellation: while a request runs, the client's socket is read for end-of-file (bytes it sends meanwhile are kept
  for its next request, never mistaken for a disconnect); when it goes away, the request's cancel file is written
  and the model stops at its next DFlash step;
- health: `/health` and `/v2/health/ready` say 200 only when tritonserver answers and every model stub is alive
  (`health` callback, set by `TritonServer`; `/v2/health/live` asks only whether tritonserver runs and answers);
  when a model's stub dies, every request in flight on that model is answered 503 with Retry-After at once
  (`fail_model`, never left waiting on the dead stub) and new ones get 503 until the model is reloaded
  (`model_back`), the other models serving meanwhile;
- drain: on shutdown new requests get 503; running ones finish or, past the drain time, are cancelled and answered
  503 "shutting down" (an error event on a stream).

Routes: the OpenAI-compatible API (deploy/openai_api.py), `/health`, `/metrics` (deploy/metrics.py), and Triton's
read-only and inference routes (health, metadata, config, stats, infer, generate, generate_stream), forwarded.

This module is the wiring: `Front` joins the three sides of the server, each in its module (connection handling:
deploy/connection.py; routing: deploy/routing.py; the call to tritonserver: deploy/upstream.py), and holds what they
share: the event loop and its lifecycle (start, drain, close) and the registry of running requests and their cancel
files.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from dflash_export.deploy import openai_api as oa
from dflash_export.deploy.connection import Connection, ConnectionHandling, Limits
from dflash_export.deploy.metrics import FrontMetrics
from dflash_export.deploy.routing import Routing
from dflash_export.deploy.upstream import Upstream
from dflash_export.errors import DFlashError

CANCEL_FILE_TTL_S = 60.0  # how long a cancel file outlives its request's answer (the model may still be mid-step)
CANCEL_DIR_ENV = "DFLASH_CANCEL_DIR"  # where the model looks for cancel files (set in the server's environment)
CANCEL_TIME_MARK = "\n@"  # in a cancel file, between why the request was cancelled and when the file was visible
SHUTDOWN_WAIT_S = 3.0  # how long closing waits for the requests still running to end once their clients are cut


class Front(ConnectionHandling, Routing, Upstream):
    """The front server: `start()` binds host:port (serving 503 until `set_upstream`), `drain()` then `close()`.

    `model_id`: the name the OpenAI API serves the model under; `models`: the Triton models of the repository
    (the streaming one is used for `"stream": true` when present); `capacity`: sequences each of those models
    decodes at once, instances x max batch (each model batches apart: the batch-occupancy gauge is per model);
    `block_size`: the engine's block, the most tokens a step adds (None: not known; the acceptance-length histogram
    reaches it); `health`: returns why the server is not ready, or None;
    `prompt_char_limit`: prompt text longer than this many characters cannot fit the engine and gets its 400 here,
    before it is queued or tokenized (handler.prompt_char_limit).
    """

    def __init__(self, host: str, port: int, limits: Limits | None = None, cancel_dir: Path | None = None,
                 model_id: str = "dflash", models: tuple[str, ...] = ("dflash", "dflash_stream"), capacity: int = 1,
                 prompt_char_limit: int | None = None, upstream_uds: Path | None = None,
                 block_size: int | None = None):
        self.host, self.port = host, port
        self.upstream_uds = upstream_uds  # tritonserver's HTTP port through this Unix socket (its own namespace)
        self.prompt_char_limit = prompt_char_limit
        self.limits = (limits or Limits()).check()
        self.secret = secrets.token_hex(16)
        self.cancel_dir = Path(cancel_dir) if cancel_dir else None
        self.upstream_port: int | None = None
        self.model_id, self.models = model_id, tuple(models)
        # Triton model -> the input names its config.pbtxt declares (set by `TritonServer` from the configs it loads;
        # None: not known, every checked body is forwarded). A field the model declares no input for gets its 400
        # here, naming the field (`Routing._check_model_inputs`).
        self.model_inputs: dict[str, frozenset[str]] | None = None
        self.health: Callable[[], str | None] | None = None
        # Why one model cannot serve (its stub died), the others serving meanwhile; None: `health` decides.
        self.model_health: Callable[[str], str | None] | None = None
        self.created = oa.now()
        self.draining = False
        self.metrics = FrontMetrics(capacity=capacity, models=self.models, block_size=block_size,
                                    request_timeout_s=self.limits.request_timeout_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, str | None] = {}  # cancel token -> why it was cancelled (None: running)
        self._model_of: dict[str, str] = {}  # cancel token -> the Triton model it runs on
        self._group_of: dict[str, tuple[str, ...]] = {}  # cancel token -> the tokens answering its client's request
        self._failed: dict[str, asyncio.Event] = {}  # cancel token -> set when its model's stub died
        self._failed_models: dict[str, str] = {}  # model -> why its requests fail (its stub died; it reloads)
        self._conns: set[Connection] = set()
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
                              field="--port") from None
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_report_loop_error)
        self._thread = threading.Thread(target=self._loop.run_forever, name="dflash-front", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(sock), self._loop).result(timeout=30)
        return self

    async def _open(self, sock: socket.socket) -> None:
        self._open_client()
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
        counted: set[str] = set()
        for token in tokens:
            # Counted once a client request: the calls answering one client request (an OpenAI request's choices,
            # `_begin_group`) are one request answered 503.
            if self.cancel(token, f"the server is shutting down (requests still running after the {timeout_s:g} s "
                                  "drain)") and token not in counted:
                counted.update(self._group(token))
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
        handlers = [c.task for c in self._conns if c.task is not None]
        for c in list(self._conns):
            c.evict()
        if handlers:  # a request still running ends as when its client leaves (its calls given up)
            await asyncio.wait(handlers, timeout=SHUTDOWN_WAIT_S)
        for t in list(getattr(self, "_abandoned", ())):  # calls left to finish (Upstream._abandon)
            t.cancel()  # the client's close below closes their connections
        if self._client is not None:
            await self._client.aclose()
        # Whatever is still pending on the loop is cancelled and run to its end here: a task the closed loop never
        # finishes is destroyed pending.
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.wait(rest, timeout=SHUTDOWN_WAIT_S)

    # Cancellation ------------------------------------------------------------------------------------------------
    def cancel(self, token: str, why: str) -> bool:
        """Mark a running request cancelled (the model sees it at its next step). False if it is not running."""
        with self._lock:
            if token not in self._in_flight or self._in_flight[token] is not None:
                return False
            self._in_flight[token] = why
        if self.cancel_dir is not None:
            try:
                self._write_cancel_file(token, why)
                # Then the file again, with a time read once the model could see it: a step boundary the model
                # passed after that time without stopping is one that missed a visible cancel (the model counts
                # the steps it ran after it, see triton_model.py).
                self._write_cancel_file(token, f"{why}{CANCEL_TIME_MARK}{cancel_clock_ns()}")
            except OSError:
                pass
        return True

    def _write_cancel_file(self, token: str, text: str) -> None:
        """Written aside and renamed: the model never reads a created but still empty (or half-written) file."""
        tmp = self.cancel_dir / f".{token}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, self.cancel_dir / token)

    def fail_model(self, model: str, why: str) -> int:
        """A stub of `model` died: every request in flight on it is cancelled and answered 503 with Retry-After now
        (whichever instance holds it: a dead stub never answers, and the model is reloaded whole), and so is any
        request that starts on it before `model_back`; the calls left to finish on it for requests already answered
        (their client left, or their time ran out) are cancelled. Thread-safe; returns how many were in flight."""
        with self._lock:
            self._failed_models[model] = why
            tokens = [t for t, m in self._model_of.items() if m == model and self._in_flight.get(t, "") is None]
        for token in tokens:
            self.cancel(token, why)
        loop = self._loop
        if loop is not None and loop.is_running():
            for token in tokens:
                event = self._failed.get(token)
                if event is not None:
                    loop.call_soon_threadsafe(event.set)
            loop.call_soon_threadsafe(self._drop_abandoned, model)
        return len(tokens)

    def model_back(self, model: str) -> None:
        """`model` serves again (reloaded): its new requests are no longer failed."""
        with self._lock:
            self._failed_models.pop(model, None)

    def _begin(self, model: str | None = None) -> str:
        """A new running request (on Triton model `model`); its cancel token. Called on the front's loop."""
        token = secrets.token_hex(12)
        event = asyncio.Event()
        with self._lock:
            self._in_flight[token] = None
            if model is not None:
                self._model_of[token] = model
                self._failed[token] = event
                why = self._failed_models.get(model)
                if why is not None:  # its stub died between the health check and now
                    self._in_flight[token] = why
                    event.set()
            n, per_model = len(self._in_flight), collections.Counter(self._model_of.values())
        self.metrics.set_in_flight(n, per_model)
        return token

    def _begin_group(self, model: str | None, n: int) -> list[str]:
        """`n` new running requests that answer one client request together (an OpenAI request's choices); their
        cancel tokens. A client that leaves cancels them all at once (`Routing._client_left`)."""
        tokens = [self._begin(model) for _ in range(n)]
        if n > 1:
            with self._lock:
                for token in tokens:
                    self._group_of[token] = tuple(tokens)
        return tokens

    def _group(self, token: str) -> tuple[str, ...]:
        """The running requests that answer the same client request as `token` (itself included)."""
        with self._lock:
            return self._group_of.get(token, (token,))

    def _model_on(self, token: str | None) -> str | None:
        """The Triton model a running request is on (None: not known, or not running)."""
        with self._lock:
            return self._model_of.get(token) if token else None

    def _model_failure(self, token: str | None) -> tuple[asyncio.Event | None, str | None]:
        """The event set when this request's model stub dies, and why it did (None while it has not)."""
        with self._lock:
            event = self._failed.get(token) if token else None
            return event, (self._in_flight.get(token) if event is not None and event.is_set() else None)

    def _end(self, token: str) -> str | None:
        with self._lock:
            why = self._in_flight.pop(token, None)
            self._model_of.pop(token, None)
            self._failed.pop(token, None)
            self._group_of.pop(token, None)
            n, per_model = len(self._in_flight), collections.Counter(self._model_of.values())
            self._idle.notify_all()
        self.metrics.set_in_flight(n, per_model)
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


def _report_loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's report of an error no coroutine caught, less one that is none: a socket's readiness callback
    setting the result of a wait that ended earlier in the same pass of the loop (cancelled, or woken already).
    anyio's Unix socket streams (the upstream calls through the namespace bridge's socket) wait that way, and a
    client that leaves cancels its request's read of tritonserver's answer: that wait is over and nothing is lost."""
    callback = getattr(context.get("handle"), "_callback", None)
    waiter = getattr(callback, "__self__", None)
    if isinstance(context.get("exception"), asyncio.InvalidStateError) and isinstance(waiter, asyncio.Future) \
            and waiter.done() and getattr(callback, "__name__", None) == "set_result":
        return
    loop.default_exception_handler(context)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def new_cancel_dir(parent: Path) -> Path:
    d = Path(parent) / "cancel"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def cancel_clock_ns() -> int:
    """The clock cancel files are stamped with: CLOCK_MONOTONIC, one clock for every process of the machine (the
    front's and the model stubs'), which no change of the wall clock moves."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def cancel_path(token: str | None) -> str | None:
    """Inside the model: where the cancel file of the request with this cancel token appears (None: no cancel dir, or
    not a token the front makes)."""
    d = os.environ.get(CANCEL_DIR_ENV)
    if not d or not token or not re.fullmatch(r"[0-9a-f]{8,64}", token):
        return None
    return os.path.join(d, token)


def cancel_record(token: str | None) -> tuple[str, int | None] | None:
    """Inside the model: why the request with this cancel token was cancelled and the `cancel_clock_ns` time the front
    read once its cancel file could be seen (None while the front has not yet written it); None: not cancelled."""
    path = cancel_path(token)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(300)
    except OSError:
        return None
    why, mark, at = text.rpartition(CANCEL_TIME_MARK)
    why = why if mark else text
    return why or "cancelled", int(at) if mark and at.isdigit() else None


def cancel_reason(token: str | None) -> str | None:
    """Inside the model: why the request with this cancel token was cancelled (None: it was not)."""
    record = cancel_record(token)
    return record[0] if record is not None else None
