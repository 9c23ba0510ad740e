"""Start the `tritonserver` binary shipped in the `nvidia-pytriton` wheel on a model repository, on loopback by default.

The wheel carries the server, the python backend and one python-backend stub per CPython minor version; the stub has to
match the interpreter whose packages the models import, and it links `libpython3.X.so`. Three things make that work:

- a private backend directory whose `python/` holds the backend library plus the stub for *this* Python (the backend
  looks for `triton_python_backend_stub` next to its own library);
- `LD_LIBRARY_PATH` with this interpreter's own lib directory first (a system libpython of the same version otherwise
  wins and brings a foreign standard library), then the wheel's bundled libraries;
- this environment's site-packages and the project root on the stub's `sys.path`: the stub's embedded interpreter
  ignores PYTHONPATH, takes its prefix from `python3` on PATH, and imports numpy before any model code runs; so PATH
  starts with a throw-away venv (`make_stub_env`) whose site-packages leads to the right packages.

The stubs in nvidia-pytriton 0.7 were compiled against numpy 1 (pybind11 without numpy-2 support): under numpy 2 they
misread every tensor buffer (BYTES inputs crash the stub, outputs come back with wrong sizes). When this environment
has numpy >= 2, the stub gets a private numpy 1 directory (exactly STUB_NUMPY) first on its path (installed once
with pip into `stub_site_dir()`, by `./dev setup`); onnxruntime, torch and tokenizers built for numpy 2 run on numpy
1.26 (numpy's ABI is backward compatible at run time), and the served outputs are checked against direct engine calls
in tests/test_deploy.py.
"""

from __future__ import annotations

import collections
import errno
import ipaddress
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_export.deploy.repository import check_repository, stub_python_path
from dflash_export.errors import DFlashError, MissingDependency


class ServerError(DFlashError):
    """tritonserver failed to start or died (exit code 1: not a problem with the user's input)."""

    exit_code = 1


class ModelRefused(ServerError):
    """tritonserver exited because a model refused its input at load (a DFlashError inside the model: e.g. a manifest
    that disagrees with its graphs). Bad input, so exit code 2, like the checks `serve` makes before starting."""

    exit_code = 2


# How the python backend reports an exception raised by a model's initialize: "<Type>: <message>".
_INPUT_ERROR = re.compile(r"(?:Internal: )?\b(?:DFlashError|MissingDependency): ")


@dataclass
class TritonInstall:
    """Where the pieces of the wheel's tritonserver live."""

    binary: Path
    python_backend: Path        # directory holding libtriton_python.so + triton_python_backend_utils.py
    stub: Path                  # triton_python_backend_stub built for this interpreter's minor version
    lib_dirs: list[Path]        # bundled shared libraries the binary and the stub need


def find_triton() -> TritonInstall:
    """Locate tritonserver in the installed `nvidia-pytriton` wheel; MissingDependency naming what is absent."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("the tritonserver binary comes with nvidia-pytriton: pip install --no-deps "
                                "nvidia-pytriton", field="nvidia-pytriton")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        lib_dirs=[d for d in (root / "lib", root.parent.parent / "nvidia_pytriton.libs") if d.is_dir()],
    )
    for path in (install.binary, install.python_backend / "libtriton_python.so", install.stub):
        if not path.is_file():
            raise MissingDependency(f"not found in the nvidia-pytriton wheel (Python {version} supported?)",
                                    path=path)
    return install


def python_lib_dir() -> Path:
    """The directory holding this interpreter's own libpython (a venv points back at its base installation)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if not libdir or not (Path(libdir) / ldlib).exists():
        raise MissingDependency(f"this Python ({sys.executable}) has no shared libpython ({ldlib or '?'}) for the "
                                "python backend stub to link; use a Python built with --enable-shared",
                                field="libpython")
    return Path(libdir)


STUB_SITE_ENV = "DFLASH_TRITON_STUB_SITE"
STUB_NUMPY = "numpy==1.26.4"  # exactly this one: the last numpy 1 with wheels for every Python the stubs support
STUB_MARKER = "DFLASH_STUB_NUMPY"  # model.py accepts a numpy other than the deployed one only from a marked directory


def stub_site_dir() -> Path:
    """Where the stub's numpy < 2 lives: $DFLASH_TRITON_STUB_SITE or a per-Python cache directory."""
    if os.environ.get(STUB_SITE_ENV):
        return Path(os.environ[STUB_SITE_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dflash-export" / f"triton-stub-py{sys.version_info.major}.{sys.version_info.minor}"


def _numpy_major(where: Path | None = None) -> int | None:
    if where is None:
        from importlib import metadata

        try:
            return int(metadata.version("numpy").split(".")[0])
        except metadata.PackageNotFoundError:
            return None
    found = sorted(where.glob("numpy-*.dist-info"))
    return int(found[-1].name.split("-")[1].split(".")[0]) if found else None


def ensure_stub_site(install: bool = True) -> Path | None:
    """Return the numpy < 2 directory the stub needs (None when this environment's numpy is already < 2).

    Installs exactly STUB_NUMPY there with pip when absent and `install` is true (`./dev setup` does it once, so
    `serve` normally finds it); MissingDependency otherwise.
    """
    if (_numpy_major() or 0) < 2:
        return None
    site_dir = stub_site_dir()
    if (_numpy_major(site_dir) or 2) < 2:
        (site_dir / STUB_MARKER).touch()
        return site_dir
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:", "--target",
           str(site_dir), STUB_NUMPY]
    if not install:
        raise MissingDependency("the python backend stub needs numpy 1 (it was built against numpy 1); run: "
                                + " ".join(cmd), field="numpy")
    print(f"the python backend stub needs {STUB_NUMPY}: installing it once into {site_dir}", file=sys.stderr,
          flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or (_numpy_major(site_dir) or 2) >= 2:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise MissingDependency(f"could not install {STUB_NUMPY} for the python backend stub ({tail})", path=site_dir)
    (site_dir / STUB_MARKER).touch()
    return site_dir


def make_backend_dir(install: TritonInstall, into: Path) -> Path:
    """Build `<into>/python/` = the wheel's python backend + the stub for this Python. Returns `into`."""
    py = into / "python"
    py.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (py / name).symlink_to(install.python_backend / name)
    # A copy, not a link: its $ORIGIN-relative rpath then points nowhere whatever ld.so makes of symlinks, so
    # LD_LIBRARY_PATH alone decides its libraries: the interpreter's own libpython first, then the wheel's.
    shutil.copy2(install.stub, py / "triton_python_backend_stub")
    return into


def make_stub_env(into: Path, stub_site: Path | None) -> Path:
    """A minimal virtual environment for the stub; returns its bin directory (to put first on PATH).

    The stub's embedded interpreter ignores PYTHONPATH and finds its prefix from `python3` on PATH, so a venv there
    decides its `sys.path`: its site-packages holds numpy < 2 (when needed) ahead of everything, then a .pth adds the
    project root and this environment's site-packages (with their own .pth files, e.g. editable installs).
    """
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    (into / "bin").mkdir(parents=True, exist_ok=True)
    (into / "bin" / "python3").symlink_to(base)
    (into / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                     f"version = {platform.python_version()}\n")
    sp = into / "lib" / f"python{ver}" / "site-packages"
    sp.mkdir(parents=True, exist_ok=True)
    if stub_site is not None:
        for entry in stub_site.iterdir():
            if entry.name.startswith("numpy"):
                (sp / entry.name).symlink_to(entry)
    # Plain lines are appended to sys.path; `import` lines run (addsitedir also processes that dir's .pth files).
    lines = [p if not p.endswith("site-packages") else f"import site; site.addsitedir({p!r})"
             for p in stub_python_path()]
    (sp / "dflash_serving.pth").write_text("\n".join(lines) + "\n")
    return into / "bin"


def server_env(install: TritonInstall, stub_site: Path | None, stub_bin: Path,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver (and through it every stub) runs with."""
    env = dict(os.environ if base is None else base)
    libs = [str(python_lib_dir())] + [str(d) for d in install.lib_dirs]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    # The stubs ignore PYTHONPATH (their paths come from the stub venv); this is for anything else they spawn.
    pypath = ([str(stub_site)] if stub_site else []) + stub_python_path()
    env["PATH"] = str(stub_bin) + os.pathsep + env.get("PATH", "")
    if env.get("PYTHONPATH"):
        pypath.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = ":".join(pypath)
    # Each stub is a separate process per model instance; one BLAS/OpenMP thread each keeps N instances from
    # oversubscribing the cores (a user who wants more sets it explicitly).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONHOME", None)
    return env


def _http_ok(url: str, timeout: float = 1.0, headers: dict | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


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

    `ports` maps option names (--http-port, ...) to ports; `host` is an IPv4 address (see `resolve_host`).
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
                    raise DFlashError(f"port {port} is already in use on {host}", field=name) from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise DFlashError(f"{host} is not an address of this machine", field="--host") from None
                if e.errno == errno.EACCES:
                    raise DFlashError(f"port {port} on {host}: permission denied (ports below 1024 need privileges)",
                                      field=name) from None
                raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror or e})", field=name) from None


def _die_with_parent():
    """A preexec_fn asking Linux to SIGTERM the child when this process dies, however it dies (even SIGKILL).

    The server runs in its own session (so a Ctrl-C meant for the CLI reaches it only through `stop`), which also
    means nothing else would ever stop it if the CLI were killed. None where prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _shorten(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


# ----------------------------------------------------------------------------------------------------------------------
# What a dead server leaves behind

SHM_DIR = Path("/dev/shm")
OWNER_FILE = "owner.json"  # in each work dir: the pid of the process that made it, and the python_env dirs it caused


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _python_env_dirs() -> set[str]:
    """The python backend makes a /tmp/python_env_XXXXXX directory per server and removes it only on a clean exit."""
    return {str(p) for p in Path("/tmp").glob("python_env_*") if p.is_dir()}


def shm_prefix(pid: int, http_port: int) -> str:
    return f"dflash{pid}_{http_port}_"


def remove_shm(prefix: str) -> int:
    n = 0
    for p in SHM_DIR.glob(prefix + "*") if SHM_DIR.is_dir() else []:
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def clean_stale_leftovers(tmp_root: Path | None = None) -> list[str]:
    """Remove what servers started by dead processes left: their work dirs (dflash-triton-* with an owner.json naming
    a pid no longer alive), the python_env_* dirs recorded there, and /dev/shm segments named after a dead pid.
    Returns what was removed. Nothing of a live process is touched."""
    removed = []
    root = Path(tmp_root or tempfile.gettempdir())
    for d in root.glob("dflash-triton-*"):
        try:
            owner = json.loads((d / OWNER_FILE).read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge (no owner record)
        if _pid_alive(pid):
            continue
        for env_dir in owner.get("python_env", []):
            if isinstance(env_dir, str) and env_dir.startswith("/tmp/python_env_"):
                shutil.rmtree(env_dir, ignore_errors=True)
                removed.append(env_dir)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    for p in SHM_DIR.glob("dflash*_*_*") if SHM_DIR.is_dir() else []:
        m = re.match(r"dflash(\d+)_\d+_", p.name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(str(p))
            except OSError:
                pass
    return removed


def free_loopback_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (all held open together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class TritonServer:
    """A tritonserver process on a model repository, behind the HTTP front (deploy/front.py); a context manager that
    starts both and waits for readiness.

    `http_port` is the front's (on `host`); tritonserver's own HTTP port is a free loopback port that answers only
    requests carrying the front's secret header; gRPC listens on loopback only (it has no front). The server's
    output is kept in memory (its most telling line comes with any ServerError); `log_path` also writes all of it
    to that file (named in the error), `echo=True` copies it to stderr as it arrives. The server runs in its own
    process session and is sent SIGTERM if the process that started it dies (Linux; the starting thread must outlive
    the server). `restart()` replaces a dead tritonserver behind the same front.
    """

    def __init__(self, repo, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 host: str = "127.0.0.1", ready_timeout_s: float = 180.0, echo: bool = False,
                 log_verbose: int = 0, extra_args: list[str] | None = None, log_path=None, limits=None,
                 exit_timeout_s: int = 10):
        from dflash_export.deploy.front import Limits

        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise DFlashError("model repository not found", path=self.repo)
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.ready_timeout_s = ready_timeout_s
        self.echo = echo
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args or [])
        self.limits = (limits or Limits()).check()
        self.exit_timeout_s = exit_timeout_s
        self.proc: subprocess.Popen | None = None
        self.front = None
        self.triton_http_port: int | None = None
        self._workdir: Path | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.log_path = Path(log_path) if log_path is not None else None
        self._log_file = None
        self._shm_prefix = shm_prefix(os.getpid(), http_port)
        self._python_envs: set[str] = set()
        self.restarts = 0

    # URLs -------------------------------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def log_text(self) -> str:
        return "".join(self._log)

    # Lifecycle --------------------------------------------------------------------------------------------------------
    def command(self, backend_dir: Path) -> list[str]:
        from dflash_export.deploy.front import RESTRICTED_APIS, SECRET_HEADER

        install = find_triton()
        cmd = [
            str(install.binary),
            f"--model-repository={self.repo}",
            f"--backend-directory={backend_dir}",
            # Triton's own HTTP parser must never see a request the front did not check (see deploy/front.py):
            # loopback only, and every API behind the front's per-start secret header.
            "--http-address=127.0.0.1", f"--http-port={self.triton_http_port}",
            f"--http-restricted-api={RESTRICTED_APIS}:{SECRET_HEADER}={self.front.secret}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            # The written config.pbtxt is the contract; never let the server rewrite it.
            "--disable-auto-complete-config",
            "--exit-on-error=true",
            "--strict-readiness=true",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            # Unique shared-memory names: several servers (tests, other users) may run on one machine; the pid in
            # the name lets a later start remove what a killed one left (clean_stale_leftovers).
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            *self.extra_args,
        ]
        return cmd

    def start(self) -> "TritonServer":
        """Start the front (once) and tritonserver behind it; block until Triton's `/v2/health/ready` answers 200.
        ServerError (with the log tail) if it dies first."""
        from dflash_export.deploy.front import CANCEL_DIR_ENV, Front, new_cancel_dir

        install = find_triton()
        stub_site = ensure_stub_site()
        try:
            if self._workdir is None:
                clean_stale_leftovers()
                self._workdir = Path(tempfile.mkdtemp(prefix="dflash-triton-"))
                self._write_owner()
                make_backend_dir(install, self._workdir / "backends")
                make_stub_env(self._workdir / "stubenv", stub_site)
            cancel_dir = new_cancel_dir(self._workdir)
            if self.front is None:
                self.front = Front(self.host, self.http_port, self.limits, cancel_dir).start()
            self.triton_http_port = free_loopback_ports(1)[0]
            cmd = self.command(self._workdir / "backends")
            env = server_env(install, stub_site, self._workdir / "stubenv" / "bin")
            env[CANCEL_DIR_ENV] = str(cancel_dir)
            if self.log_path is not None and self._log_file is None:
                try:
                    self._log_file = open(self.log_path, "a" if self.restarts else "w", encoding="utf-8",
                                          errors="replace")
                except OSError as e:
                    raise DFlashError(f"cannot write the server log ({e.strerror})", path=self.log_path) from None
            self._stopping = False
            envs_before = _python_env_dirs()
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, errors="replace",
                                         start_new_session=True, preexec_fn=_die_with_parent())
            self._reader = threading.Thread(target=self._pump, daemon=True)
            self._reader.start()
            self._wait_ready()
            self._python_envs |= _python_env_dirs() - envs_before
            self._write_owner()
            self.front.set_upstream(self.triton_http_port)
        except BaseException:
            self.stop(drain_timeout_s=0)
            raise
        return self

    def _write_owner(self) -> None:
        if self._workdir is not None:
            (self._workdir / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(),
                                                                "python_env": sorted(self._python_envs)}))

    def restart(self) -> "TritonServer":
        """After tritonserver died on its own: clear what it left, start a new one behind the same front."""
        self.front.set_upstream(None)
        self._reap()
        self.restarts += 1
        self._log.append(f"[dflash-export] tritonserver restarted ({self.restarts})\n")
        return self.start()

    def _pump(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            self._log.append(line)
            if self._log_file is not None:
                try:
                    self._log_file.write(line)
                    self._log_file.flush()
                except (OSError, ValueError):  # disk full, or closed by stop(): the in-memory tail remains
                    pass
            if self.echo:
                sys.stderr.write(line)
                sys.stderr.flush()

    def _wait_ready(self) -> None:
        from dflash_export.deploy.front import SECRET_HEADER

        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://127.0.0.1:{self.triton_http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._death_error()
            if _http_ok(url, headers={SECRET_HEADER: self.front.secret}):
                return
            time.sleep(0.2)
        raise ServerError(f"tritonserver not ready after {self.ready_timeout_s:.0f} s ({_shorten(self._last_error())})"
                          + self._log_note(), path=self.repo)

    def _log_note(self) -> str:
        return f"; full log: {self.log_path}" if self.log_path is not None else ""

    def _last_error(self) -> str:
        """The most telling log line: the first model load failure, else the first error line, else the last line."""
        lines = [ln.strip() for ln in self._log if ln.strip() and not ln.startswith("[dflash-export]")]
        for pick, which in ((lambda ln: ln.startswith("E") and "failed to load '" in ln, 0),
                            (lambda ln: ln.startswith("E") and "CudaDriverHelper" not in ln, 0),
                            (lambda ln: "error" in ln.lower(), 0),
                            (lambda ln: True, -1)):
            found = [ln for ln in lines if pick(ln)]
            if found:
                # Triton's lines carry a Python traceback with escaped newlines; its first line says it all.
                line = re.sub(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ", "", found[which])
                return line.split("\\n")[0].strip('"')
        return "(no output)"

    def _death_error(self) -> ServerError:
        """One line for a server that exited on its own: its most telling log line (shortened) and where the log is.

        ModelRefused (exit 2) when that line is a model refusing its input, ServerError (exit 1) otherwise.
        """
        if self._reader is not None:
            self._reader.join(timeout=2)
        line = self._last_error()
        cls = ModelRefused if _INPUT_ERROR.search(line) else ServerError
        line = _INPUT_ERROR.sub("", line, count=1)
        rc = self.proc.returncode
        code = f"signal {-rc}" if rc is not None and rc < 0 else f"code {rc}"
        return cls(f"tritonserver exited ({code}: {_shorten(line)})" + self._log_note(), path=self.repo)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """Block until the server exits on its own; ServerError when that exit was not requested."""
        assert self.proc is not None
        rc = self.proc.wait()
        if not self._stopping:
            raise self._death_error()
        return rc

    def _reap(self, timeout_s: float = 0.0) -> int | None:
        """End tritonserver (SIGTERM to it alone, so its stubs finish their requests and exit with it; SIGKILL to
        the whole group after `timeout_s`) and remove its shared memory segments. Returns its exit code."""
        proc = self.proc
        rc = None
        if proc is not None:
            try:
                pgid = os.getpgid(proc.pid)
            except ProcessLookupError:
                pgid = None
            if proc.poll() is None and timeout_s > 0:
                try:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=timeout_s)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    pass
            if pgid is not None:
                # Stubs live in the same group; make sure none outlives the server.
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            rc = proc.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)
        remove_shm(self._shm_prefix)
        return rc

    def stop(self, timeout_s: float = 20.0, drain_timeout_s: float = 10.0) -> bool:
        """Drain the front (new requests 503, running ones finish for up to `drain_timeout_s`, then are cancelled
        and answered 503), SIGTERM tritonserver (it finishes gRPC requests for up to its --exit-timeout-secs),
        SIGKILL what is left after `timeout_s`, and remove the work dir, shared memory and python_env dirs.

        Returns True when every request finished by itself (the drain completed) and tritonserver exited cleanly.
        """
        self._stopping = True
        drained = True
        if self.front is not None and self.proc is not None and self.proc.poll() is None:
            drained = self.front.drain(drain_timeout_s)
        rc = self._reap(timeout_s)
        if self.front is not None:
            self.front.close()
            self.front = None
        if self._log_file is not None:
            try:
                self._log_file.close()
            except OSError:
                pass
            self._log_file = None
        for env_dir in self._python_envs:
            shutil.rmtree(env_dir, ignore_errors=True)
        self._python_envs = set()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return drained and rc in (0, None, -signal.SIGTERM)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def default_log_path() -> Path:
    """Where `serve` writes the server's log: a new file in the temp directory (the repository may be read-only)."""
    fd, name = tempfile.mkstemp(prefix="dflash-tritonserver-", suffix=".log")
    os.close(fd)
    return Path(name)


_STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
MAX_RESTARTS = 5            # within RESTART_WINDOW_S: beyond that, something is wrong that a restart will not fix
RESTART_WINDOW_S = 600.0


class DrainIncomplete(ServerError):
    """`serve` stopped with requests still running after the drain time (they were cancelled): exit code 1."""


def serve(repo, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002, host: str = "127.0.0.1",
          ready_timeout_s: float = 600.0, log_path=None, limits=None, restart_on_crash: bool = True,
          drain_timeout_s: float = 30.0) -> int:
    """Run tritonserver behind the front in the foreground until Ctrl-C / SIGTERM / SIGHUP; prints the URLs once
    ready.

    Before starting: the repository must be an unchanged `dflash-export deploy` output and the host and three
    distinct ports must be free to listen on (DFlashError, exit 2, otherwise). `limits` (front.Limits): the request
    size and JSON depth limits (default: those recorded by deploy). The server's log goes to `log_path` (default: a
    new dflash-tritonserver-*.log in the temp directory; printed with the URLs, named in any error, kept afterwards).

    If tritonserver dies on its own after it was ready, and `restart_on_crash`, it is restarted behind the same
    front (the front answers 503 meanwhile), at most MAX_RESTARTS times in RESTART_WINDOW_S. Otherwise (or past that)
    one line with the log's most telling line and the log's path: ModelRefused (exit 2) when a model refused its
    input at load, ServerError (exit 1) otherwise. A stop request drains: new requests get 503, running ones have
    `drain_timeout_s` to finish; returns 0 when all did, raises DrainIncomplete (exit 1) naming how many were
    cancelled otherwise. The server is stopped on every way out of this function, and by the kernel if this process
    is killed outright (see `_die_with_parent`); what a killed one left is removed by the next start.
    """
    from dflash_export.deploy.front import Limits

    repo = Path(repo).expanduser().resolve()
    marker = check_repository(repo)
    if limits is None:
        recorded = marker.get("limits") if isinstance(marker.get("limits"), dict) else {}
        limits = Limits(**{k: v for k, v in recorded.items() if k in ("max_body_bytes", "max_json_depth")
                           and isinstance(v, int)})
    limits.check()
    if drain_timeout_s < 0:
        raise DFlashError(f"must be >= 0, got {drain_timeout_s}", field="--drain-timeout")
    bind = resolve_host(host)
    check_listen(bind, {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port})
    check_listen("127.0.0.1", {"--grpc-port": grpc_port})
    if log_path is not None:
        log_path = Path(log_path).expanduser().resolve()
        if log_path.is_dir():
            raise DFlashError("is a directory; expected a file name", path=log_path, field="--log-file")
        if not log_path.parent.is_dir():
            raise DFlashError(f"cannot create it: {log_path.parent} is not a directory", path=log_path,
                              field="--log-file")
    else:
        log_path = default_log_path()
    server = TritonServer(repo, http_port, grpc_port, metrics_port, bind, ready_timeout_s, log_path=log_path,
                          limits=limits, exit_timeout_s=max(1, int(drain_timeout_s)))

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # A signal the caller ignores stays ignored (`nohup`, a background job's SIGINT): it is not a stop request.
    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
    stopped = False
    try:
        server.start()
        print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}", flush=True)
        print(f"  tritonserver log: {log_path}", flush=True)
        print(f"  limits: request body {limits.max_body_bytes} bytes, JSON depth {limits.max_json_depth}; "
              f"restart on crash: {'yes' if restart_on_crash else 'no'}; drain: {drain_timeout_s:g} s", flush=True)
        print(f"  curl -s {server.http_url}/v2/models/dflash/generate -d '{{\"text_input\": \"Hello\", "
              f"\"max_tokens\": 32}}'", flush=True)
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
        print(f"stopping: draining requests (up to {drain_timeout_s:g} s)", file=sys.stderr, flush=True)
        # A second Ctrl-C / SIGTERM must not cut the drain short and leave the server behind.
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
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
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        try:
            if not stopped:
                server.stop(drain_timeout_s=0)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
