"""`serve`: run tritonserver on a model repository behind the HTTP front, in the foreground, on loopback by default.

The entry point of the deploy's server side (deploy/cli.py imports `serve`; every public name of the two modules
below can also be reached here), imported one way (this module -> triton_process -> triton_install):
- `triton_install`: the tritonserver binary and python backend stub of the `nvidia-pytriton` wheel, and the
  environment they run with (this interpreter's libpython, numpy 1 for the stub, the stub's venv);
- `triton_process`: `TritonServer`, one tritonserver process behind the front (start, readiness, log, restart,
  stop), and the removal of what servers started by dead processes left.
This module holds what `serve` checks before starting anything (the repository, `resolve_host`, `check_listen`, the
log file) and its foreground loop: stop signals, restarts after a crash, the drain on stop.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from dflash_export.deploy.connection import Limits
from dflash_export.deploy.repository import (
    check_repository,
    kv_memory_note,
    recorded_limits,
    shared_batch_note,
    upstream_call_bound,
)
from dflash_export.deploy.triton_install import (
    STUB_MARKER,
    STUB_NUMPY,
    STUB_SITE_ENV,
    TritonInstall,
    ensure_stub_site,
    find_triton,
    make_backend_dir,
    make_stub_env,
    python_lib_dir,
    server_env,
    stub_site_dir,
)
from dflash_export.deploy.triton_process import (
    LOG_MAX_BYTES,
    OWNER_FILE,
    SHM_DIR,
    ModelRefused,
    ServerError,
    TritonServer,
    clean_stale_leftovers,
    free_loopback_ports,
    remove_shm,
    shm_prefix,
)
from dflash_export.errors import EXIT_CHECK_FAILED, STOP_SIGNALS, DFlashError, Terminated

__all__ = [
    # triton_install
    "STUB_MARKER", "STUB_NUMPY", "STUB_SITE_ENV", "TritonInstall", "ensure_stub_site", "find_triton",
    "make_backend_dir", "make_stub_env", "python_lib_dir", "server_env", "stub_site_dir",
    # triton_process
    "LOG_MAX_BYTES", "OWNER_FILE", "SHM_DIR", "ModelRefused", "ServerError", "TritonServer", "clean_stale_leftovers",
    "free_loopback_ports", "remove_shm", "shm_prefix",
    # here
    "resolve_host", "check_listen", "default_log_path", "MAX_RESTARTS", "RESTART_WINDOW_S", "READY_PROGRESS_S",
    "DrainIncomplete", "serve", "serve_limits",
]


def resolve_host(host: str) -> str:
    """The IPv4 address to bind for `--host` (an address as given, a name resolved); DFlashError when neither.

    IPv6 is refused up front: the server joins address and port as `host:port`, which an IPv6 address breaks.
    """
    if not isinstance(host, str) or not host.strip() or host != host.strip():
        raise DFlashError(f"expected an IPv4 address or host name, got {host!r}", field="--host")
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None or ":" in host:
        if addr is None or addr.version != 4:
            raise DFlashError(f"{host!r}: tritonserver listens on IPv4 addresses only (e.g. 127.0.0.1, 0.0.0.0)",
                              field="--host")
        return str(addr)
    if re.fullmatch(r"[0-9.]+", host):
        # Never send a malformed address (999.1.1.1, 1.2.3) to the resolver: it is not a name either.
        raise DFlashError(f"not a valid IPv4 address: {host!r}", field="--host")
    try:
        infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise DFlashError(f"cannot resolve {host!r} to an IPv4 address ({getattr(e, 'strerror', None) or e})",
                          field="--host") from None
    return infos[0][4][0]


def check_listen(host: str, ports: dict[str, int]) -> None:
    """Refuse ports out of range, one port given twice, and an address or port this machine cannot listen on.

    `ports` maps option names (--port, ...) to ports; `host` is an IPv4 address (see `resolve_host`).
    """
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise DFlashError(f"must be in 1..65535, got {port!r}", field=name)
        if port in seen:
            raise DFlashError(f"{port} is also {seen[port]}: HTTP, gRPC and metrics each need their own port",
                              field=name)
        seen[port] = name
    for name, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As a server binds: a port left in TIME_WAIT by an earlier run is free, a listening one is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DFlashError(f"port {port} is already in use on {host}: give a free one", field=name) from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise DFlashError(f"{host} is not an address of this machine", field="--host") from None
                if e.errno == errno.EACCES:
                    raise DFlashError(f"port {port} on {host}: permission denied (ports below 1024 need privileges)",
                                      field=name) from None
                raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror or e})", field=name) from None


def default_log_path() -> Path:
    """Where `serve` writes the server's log: a new file in the temp directory (the repository may be read-only)."""
    fd, name = tempfile.mkstemp(prefix="dflash-tritonserver-", suffix=".log")
    os.close(fd)
    return Path(name)


MAX_RESTARTS = 5            # within RESTART_WINDOW_S: beyond that, something is wrong that a restart will not fix
RESTART_WINDOW_S = 600.0
READY_PROGRESS_S = 30.0     # while the models load: a line this often saying what the start waits for


class DrainIncomplete(ServerError):
    """`serve` stopped with requests still running after the drain time (they were cancelled): exit code 1, the
    check that every running request finishes failed."""

    exit_code = EXIT_CHECK_FAILED


# `--model-name`: the id clients send as "model" and see in every answer, printed in the ready lines.
MODEL_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}")


def _check_serve_args(repo, http_port: int, grpc_port: int | None, metrics_port: int | None, host: str, log_path,
                      limits, drain_timeout_s: float, grpc: bool = False, model_id: str | None = None,
                      ready_timeout_s: float = 600.0, marker: dict | None = None):
    """What `serve` checks before starting anything, in this order: the repository (`check_repository`, which hashes
    its engine's files: once per start; `marker`: what that check returned for it moments ago, in this process), the
    limits (`serve_limits`), the drain and ready times, the model name, the
    host and ports, that tritonserver is installed, the log file (default: `default_log_path()`). Returns
    (repository, its marker, address to bind, limits, log path)."""
    repo = Path(repo).expanduser().resolve()
    if marker is None:
        marker = check_repository(repo)
    limits = serve_limits(limits, marker).check()
    if drain_timeout_s < 0:
        raise DFlashError(f"must be >= 0, got {drain_timeout_s}", field="--drain-timeout")
    if not ready_timeout_s > 0:
        raise DFlashError(f"must be > 0, got {ready_timeout_s}", field="--ready-timeout")
    if model_id is not None and not MODEL_ID_PATTERN.fullmatch(model_id):
        raise DFlashError(f"expected letters, digits and . _ : @ + / - (at most 128, starting with a letter or a "
                          f"digit), got {model_id[:80]!r}", field="--model-name")
    bind = resolve_host(host)
    ports = {"--port": http_port, **({"--metrics-port": metrics_port} if metrics_port is not None else {}),
             **({"--grpc-port": grpc_port} if grpc and grpc_port is not None else {})}
    check_listen(bind, ports)
    if grpc and grpc_port is not None:
        check_listen("127.0.0.1", {"--grpc-port": grpc_port})
    find_triton()  # MissingDependency before a log file is made for a server that cannot start
    if log_path is not None:
        # A file by its own path, links resolved (rotation renames the file, not a link to it); a pipe or terminal
        # named through a link (/dev/stderr, a shell's >(...) as /dev/fd/N) resolves to no file's path: kept as given.
        given = Path(os.path.abspath(Path(log_path).expanduser()))
        real = given.resolve()
        log_path = given if given.exists() and not real.is_file() else real
        if log_path.is_dir():
            raise DFlashError("is a directory; expected a file name", path=log_path, field="--log-file")
        if not log_path.parent.is_dir():
            raise DFlashError(f"cannot create it: {log_path.parent} is not a directory", path=log_path,
                              field="--log-file")
    else:
        log_path = default_log_path()
    return repo, marker, bind, limits, log_path


_REPOSITORY_LIMITS = ("max_body_bytes", "max_json_depth", "max_upstream_calls")


def serve_limits(limits: Limits | None, marker: dict) -> Limits:
    """The front's limits for a repository with this marker: `limits`, where its max_body_bytes, max_json_depth or
    max_upstream_calls is None (all of them when `limits` is None) the repository's: the request size and JSON depth
    limits deploy recorded (`recorded_limits`), as many calls to tritonserver at once as the models hold
    (`upstream_call_bound`)."""
    recorded = {**recorded_limits(marker), "max_upstream_calls": upstream_call_bound(marker)}
    if limits is None:
        return Limits(**recorded)
    return dataclasses.replace(limits, **{k: recorded[k] for k in _REPOSITORY_LIMITS if getattr(limits, k) is None})


def serve(repo, http_port: int = 8000, grpc_port: int | None = None, metrics_port: int | None = None,
          host: str = "127.0.0.1",
          ready_timeout_s: float = 600.0, log_path=None, limits=None, restart_on_crash: bool = True,
          drain_timeout_s: float = 30.0, grpc: bool = False, model_id: str | None = None,
          log_max_bytes: int = LOG_MAX_BYTES, marker: dict | None = None) -> int:
    """Run tritonserver behind the front in the foreground until Ctrl-C / SIGTERM / SIGHUP; prints the URLs once
    ready.

    Before starting: the repository must be an unchanged `dflash-export deploy` output (`check_repository`, run once per
    start, here, unless `marker` is what it returned for `repo` in this process: `cached_repository`'s) and the host and
    the ports given must be distinct and free to listen on (DFlashError, exit 2, otherwise); tritonserver's own gRPC and
    metrics ports are picked free when not given (the metrics one is then not exposed). `limits` (front.Limits): the
    front's limits; its request size, JSON depth and upstream-call limits left None, or no `limits`, are the
    repository's (`serve_limits`: the request size and JSON depth limits deploy recorded, and as many calls to
    tritonserver at once as the models hold). The server's log goes to `log_path` (default: a new
    dflash-tritonserver-*.log in the temp directory; printed with the URLs, named in any error, kept afterwards); once
    it holds `log_max_bytes` (0: never; nor a pipe or terminal) it becomes `<log>.1`, replacing the one before, and a
    new log begins. The models must load within `ready_timeout_s` (a line every READY_PROGRESS_S on stderr says what the
    start waits for: the model loading and what its stubs are doing; past it ServerError says the same).

    A model stub that dies has its model reloaded alone (`TritonServer.reload_models`; the model's requests get 503
    meanwhile, the other models serve). If tritonserver dies on its own after it was ready, or a reload fails, and
    `restart_on_crash`, it is restarted behind the same front (the front answers 503 meanwhile), at most MAX_RESTARTS
    times in RESTART_WINDOW_S. Otherwise (or past that)
    one line with the log's most telling line and the log's path: ModelRefused (exit 2) when a model refused its
    input or its environment at load, ServerError (exit 3) otherwise. A stop request once ready drains: new requests
    get 503, running ones have `drain_timeout_s` to finish; returns 0 when all did, raises DrainIncomplete (exit 1)
    naming how many were cancelled otherwise. A stop signal before the ready line interrupts the start: what it
    started is stopped, its work dir and default log removed, and KeyboardInterrupt (SIGINT) or errors.Terminated
    (SIGTERM, SIGHUP) raised, which the CLI exits 130 or 128 + the signal number on. A second stop signal never cuts
    either stop short. The server is stopped on every way out of this function, and by the kernel if this process is
    killed outright (see `triton_process._die_with_parent`); what a killed one left is removed by the next start.
    """
    made_log = log_path is None
    server: TritonServer | None = None
    ready = stopped = False

    def on_signal(signum, frame):
        # From here on the stop this signal begins (the drain, or the end of an unfinished start) runs to its end.
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt if ready or signum == signal.SIGINT else Terminated(signum)

    # A signal the caller ignores stays ignored (`nohup`, a background job's SIGINT): it is not a stop request.
    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
    try:
        repo, marker, bind, limits, log_path = _check_serve_args(repo, http_port, grpc_port, metrics_port, host,
                                                                 log_path, limits, drain_timeout_s, grpc, model_id,
                                                                 ready_timeout_s, marker)
        instances, max_batch = int(marker.get("instances", 1)), int(marker.get("max_batch", 1))
        for note in (shared_batch_note(marker.get("precision"), max_batch),
                     kv_memory_note(repo / marker["models"][0] / "engine", instances, max_batch, len(marker["models"]),
                                    max_kv_tokens=int(marker.get("max_kv_tokens", 0)))):
            if note:
                print(note, file=sys.stderr, flush=True)
        server = TritonServer(repo, http_port, grpc_port, metrics_port, bind, ready_timeout_s, log_path=log_path,
                              limits=limits, exit_timeout_s=max(1, int(drain_timeout_s)), grpc=grpc,
                              progress_s=READY_PROGRESS_S, log_max_bytes=log_max_bytes)
        server.model_id = model_id
        plain = marker.get("plain") is True
        server.start()
        ready = True
        grpc_part = f"  gRPC {server.grpc_url}" if server.grpc_url else ""
        triton_metrics = f"  tritonserver metrics {server.metrics_url}" if server.metrics_url else ""
        print(f"ready: HTTP {server.http_url}{grpc_part}  metrics {server.http_url}/metrics{triton_metrics}",
              flush=True)
        print(f"  model: {server.front.model_id} (OpenAI API at {server.http_url}/v1), "
              f"{'plain decoding (--plain)' if plain else 'DFlash decoding'}", flush=True)
        rotated = (f" (kept under {log_max_bytes / 2**20:g} MiB, the one before as {log_path}.1)"
                   if log_max_bytes and server.log_rotates else "")
        print(f"  tritonserver log: {log_path}{rotated}", flush=True)
        print(f"  tritonserver runs in {server.isolation}", flush=True)
        print(f"  limits: request body {limits.max_body_bytes} bytes, JSON depth {limits.max_json_depth}, request "
              f"timeout {limits.request_timeout_s:g} s, {limits.max_upstream_calls} calls to tritonserver at once; "
              f"restart on crash: {'yes' if restart_on_crash else 'no'}; drain: {drain_timeout_s:g} s", flush=True)
        print(f"  curl -s {server.http_url}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{server.front.model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"Hello\"}}], \"max_tokens\": 32}}'", flush=True)
        crashes: list[float] = []
        while True:
            try:
                server.wait()
                return 0
            except ServerError as e:
                now = time.monotonic()
                crashes = [t for t in crashes if now - t < RESTART_WINDOW_S] + [now]
                if not restart_on_crash or len(crashes) > MAX_RESTARTS:
                    raise
                print(f"tritonserver died ({e}); restarting it ({len(crashes)} in the last "
                      f"{RESTART_WINDOW_S:.0f} s)", file=sys.stderr, flush=True)
                server.restart()
                print(f"ready again: HTTP {server.http_url}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        if not ready:  # the start interrupted: stopped below, the interrupt goes on to the caller
            if server is not None:
                server.stop(drain_timeout_s=0)
                stopped = True
            if made_log and log_path is not None:  # named nowhere yet
                Path(log_path).unlink(missing_ok=True)
            raise
        print(f"stopping: draining requests (up to {drain_timeout_s:g} s)", file=sys.stderr, flush=True)
        front = server.front
        cancelled = front.counts["cancelled_at_shutdown"] if front else 0
        clean = server.stop(drain_timeout_s=drain_timeout_s)
        stopped = True
        cancelled = (front.counts["cancelled_at_shutdown"] if front else 0) - cancelled
        if not clean:
            raise DrainIncomplete(f"the drain did not complete: {cancelled} request(s) still running after "
                                  f"{drain_timeout_s:g} s were cancelled (answered 503)" if cancelled else
                                  "tritonserver did not stop cleanly" + server._log_note(), path=repo) from None
        return 0
    finally:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        try:
            if server is not None and not stopped:
                server.stop(drain_timeout_s=0)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
