"""One tritonserver process behind the HTTP front (deploy/front.py): `TritonServer` builds its command line, starts
it and waits for readiness, keeps its log and turns its death into one line (`ServerError` / `ModelRefused`),
restarts it, and stops it (drain, SIGTERM, SIGKILL, clean-up); and what a server started by a dead process left
behind (work dirs, python_env dirs, /dev/shm segments), removed by the next start. Where the binary and its python
stub come from, and the environment they run with: `triton_install`. `serve` (deploy/server.py) runs one in the
foreground.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from stat import S_ISDIR

from dflash_export.deploy.connection import Limits
from dflash_export.deploy.front import CANCEL_DIR_ENV, Front, new_cancel_dir
from dflash_export.deploy.handler import engine_block_size, prompt_char_limit
from dflash_export.deploy.repository import check_repository, model_inputs, served_copy
from dflash_export.deploy.triton_install import (
    ensure_stub_site,
    find_triton,
    make_backend_dir,
    make_stub_env,
    server_env,
)
from dflash_export.deploy.upstream import RESTRICTED_APIS, SECRET_HEADER
from dflash_export.environment import memory_note, size_text
from dflash_export.errors import EXIT_INTERNAL, DFlashError
from dflash_export.files import UNIX_PATH_MAX, directory_fd, path_through_fd


class ServerError(DFlashError):
    """tritonserver failed to start or died (exit code 3: neither the user's input nor a failed check)."""

    exit_code = EXIT_INTERNAL


class ModelRefused(ServerError):
    """tritonserver exited because a model refused its input or its environment at load (a DFlashError or
    MissingDependency inside the model: a manifest that disagrees with its graphs, a file it cannot read, a library
    the stub cannot import or that differs from the deployed one; see triton_model.py). Bad input, so exit code 2,
    like the checks `serve` makes before starting."""

    exit_code = 2


# How the python backend reports an exception raised by a model's initialize: "<Type>: <message>".
_INPUT_ERROR = re.compile(r"(?:Internal: )?\b(?:DFlashError|MissingDependency): ")
# tritonserver's own log lines at error level ("E1130 07:37:27.791032 21828 file.cc:642] ..."), and its complaints
# about its command line (printed around its usage text, which is not an error however its lines begin).
_TRITON_LINE = re.compile(r"[IWE]\d{4} ")
_TRITON_ERROR = re.compile(r"E\d{4} ")
_OPTION_ERROR = re.compile(r"unrecognized option|invalid option|requires an argument|^Bad option|^[Ii]nvalid ")
_HEAD_LINES = 40
# The log file's size at which it is renamed to <log>.1 and begun anew (serve --log-max-mb).
LOG_MAX_BYTES = 64 << 20
# The dynamic loader's words for a shared library it cannot load (`ld.so`: the program never ran), as a stub that
# cannot start prints them.
_LOADER_ERROR = re.compile(r"error while loading shared libraries|cannot open shared object file|symbol lookup error|"
                           r"undefined symbol|version `[^']+' not found")
# How the python backend fails a model load whose stub died after it reported (while its model initialized).
_STUB_UNHEALTHY = re.compile(r"Stub process (?:'[^']*' )?is not healthy")
# tritonserver's python backend starts each model's stub with `bash -c` and a command line holding, unquoted, the
# stub's path, the model's path and the backend's directory: a space, quote or `$` in any of them splits or expands,
# and the model never loads. The paths `TritonServer` hands it hold only these characters.
_SHELL_UNSAFE = re.compile(r"[^\w./+,:@%=-]", re.ASCII)


def served_dir(workdir: Path, repo: Path) -> Path:
    """Where tritonserver loads `repo`'s served copy: under `workdir`, at the repository's own path (so `ps` still
    names it), with each character a shell would split on or expand (_SHELL_UNSAFE) replaced by `_`."""
    return workdir / "served" / _SHELL_UNSAFE.sub("_", str(repo.relative_to(repo.anchor)))


def _http_ok(url: str, timeout: float = 1.0, headers: dict | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


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
        os.umask(0o077)  # files the server creates without an explicit mode: owner-only
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


# The python backend makes a /tmp/python_env_XXXXXX directory per server (a fixed path: TMPDIR is not read) as it
# initializes, before it starts any stub, and removes it only on a clean exit.
PYTHON_ENV_ROOT = Path("/tmp")


# This user's `serve`s take turns from listing the python_env dirs (before tritonserver starts) to taking the one it
# made (`_claim_python_env`): two tritonservers started within that window would each see both new dirs, and
# neither could tell its own. The turn is an exclusive flock on a file beside the dirs (their glob never matches
# it); a start that cannot have it within PYTHON_ENV_LOCK_WAIT_S (another one stuck before its first stub) goes on
# without it, and then takes no dir that another server may have made.
PYTHON_ENV_LOCK_WAIT_S = 30.0


def python_env_lock_path() -> Path:
    return PYTHON_ENV_ROOT / f".dflash-python-env-{os.getuid()}.lock"


def lock_python_env_turn(wait_s: float = PYTHON_ENV_LOCK_WAIT_S) -> int | None:
    """An open descriptor holding this user's python_env lock (closing it releases the lock); None when it could not
    be had within `wait_s`, or its file is not this user's (another user's file at that path) or cannot be opened."""
    try:
        # No symlink followed (a world-writable /tmp); not inherited by tritonserver, which would hold it for its life.
        fd = os.open(python_env_lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    deadline, held = time.monotonic() + wait_s, False
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
    except OSError:
        return None
    finally:
        if not held:  # also when interrupted while waiting
            os.close(fd)


def _python_env_dirs() -> set[str]:
    """This user's python_env_* directories under PYTHON_ENV_ROOT."""
    out = set()
    for p in PYTHON_ENV_ROOT.glob("python_env_*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        if S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            out.add(str(p))
    return out


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
            owner = json.loads((d / OWNER_FILE).read_text(encoding="utf-8"))
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge (no owner record)
        if _pid_alive(pid):
            continue
        for env_dir in owner.get("python_env", []):
            if isinstance(env_dir, str) and env_dir.startswith(str(PYTHON_ENV_ROOT / "python_env_")):
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


def _proc_stat(pid: int | str) -> tuple[bytes, list[bytes]] | None:
    """(command name, the fields after it, the state first) of /proc/<pid>/stat; None when there is no such process.
    The name is what the last ")" closes: it may hold spaces and parentheses itself."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    head, _, rest = stat.rpartition(b")")
    fields = rest.split()
    return (head[head.index(b"(") + 1:], fields) if b"(" in head and len(fields) > 2 else None


def _group_stats(pgid: int, comm_prefix: str = ""):
    """(pid, stat fields) of each process of process group `pgid` whose command name starts with `comm_prefix`,
    exited ones not reaped yet (zombies) included."""
    prefix = comm_prefix.encode()
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        stat = _proc_stat(d.name) if d.name.isdigit() else None
        if stat is not None and stat[0].startswith(prefix) and stat[1][2] == str(pgid).encode():
            yield int(d.name), stat[1]


def _state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, T, Z, ...), None when there is no such process."""
    stat = _proc_stat(pid)
    return stat[1][0].decode() if stat is not None else None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


_STATE_WORDS = {"R": "running", "S": "sleeping", "D": "waiting on I/O", "T": "stopped", "t": "stopped by a tracer",
                "Z": "exited"}


def proc_usage(pid: int) -> str | None:
    """What a process is doing, from /proc: "sleeping, 0.4 s CPU in 61 s" (its state, the CPU time it used and how
    long it has run); None when there is no such process."""
    stat = _proc_stat(pid)
    if stat is None:
        return None
    fields = stat[1]
    try:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        state = fields[0].decode()
        tick = os.sysconf("SC_CLK_TCK")
        # stat(5) fields 14 and 15 (utime, stime) and 22 (starttime), counted here from field 3 (state)
        cpu, age = (int(fields[11]) + int(fields[12])) / tick, uptime - int(fields[19]) / tick
    except (OSError, IndexError, ValueError):
        return None
    return f"{_STATE_WORDS.get(state, state)}, {cpu:.1f} s CPU in {max(0.0, age):.0f} s"


def stub_model(pid: int) -> str | None:
    """The model a python stub runs: its command line names the model's `<model>/<version>/model.py` (None for the
    backend's trial run of the stub, which has no arguments, or a process gone)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [a for a in args[1:] if a.endswith(b"model.py")]
    return Path(os.fsdecode(found[0])).parent.parent.name if found else None


def group_members(pgid: int, comm_prefix: str = "", exited: bool = False) -> list[int]:
    """Live processes of process group `pgid` (whose command name starts with `comm_prefix`); `exited`: also those
    exited and not reaped yet (zombies)."""
    return [pid for pid, fields in _group_stats(pgid, comm_prefix) if exited or fields[0] not in (b"Z", b"X")]


STUB_ZOMBIE_S = 1.0  # a stub exited and unreaped this long while the models load: it is not coming back


def stubs_of(pgid: int) -> dict[int, str | None]:
    """pid -> how it ended ("exit code N" / "signal N"; None: still running) of process group `pgid`'s python stubs,
    those that have exited but are not reaped yet (zombies) included. tritonserver's python backend checks a stub it
    started with kill(pid, 0), which a zombie passes: a stub that exits before it reports to the backend (it cannot
    start) leaves its model loading forever."""
    out: dict[int, str | None] = {}
    for pid, fields in _group_stats(pgid, "triton_python_b"):
        if fields[0] != b"Z":
            out[pid] = None
            continue
        try:
            status = int(fields[49]) if len(fields) > 49 else None  # field 52, exit_code: the wait status
        except ValueError:
            status = None
        out[pid] = ("exit status unknown" if status is None else f"signal {status & 0x7F}"
                    if status & 0x7F else f"exit code {status >> 8}")
    return out


def peak_rss_bytes(pid: int) -> int | None:
    """The most memory a process has held resident (/proc/<pid>/status VmHWM); None for one gone or exited (a zombie
    has no memory left to count)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot (/proc/vmstat oom_kill, machine
    wide); None where unreadable."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def pids_with_arg(text: str) -> list[int]:
    """Live processes one of whose command-line arguments contains `text`."""
    needle = text.encode()
    out = []
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "cmdline").read_bytes() and _running(int(d.name)):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _read_marker(repo: Path) -> dict:
    try:
        obj = json.loads((repo / "dflash_repository.json").read_text(encoding="utf-8"))
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


BRIDGE = Path(__file__).with_name("netns_bridge.py")
_private_network: list[str | None] = []  # the probe's answer, once per process: None (available) or why not


def private_network_unavailable() -> str | None:
    """Why tritonserver cannot run in a network namespace of its own here (None: it can; see netns_bridge.py).
    User namespaces may be disabled (kernel setting, a container's seccomp profile, AppArmor)."""
    if not _private_network:
        try:
            r = subprocess.run([sys.executable, "-I", str(BRIDGE), "--probe"], capture_output=True, text=True,
                               timeout=30)
            _private_network.append(None if r.returncode == 0 else (r.stdout.strip() or f"exit {r.returncode}"))
        except (OSError, subprocess.SubprocessError) as e:
            _private_network.append(str(e))
    return _private_network[0]


UDS_NAME = "tritonserver.sock"


def unix_address(path: Path, dir_fd: int | None) -> str:
    """Where to connect to the Unix socket `path`: the path itself when it fits sun_path, else the same file reached
    through `dir_fd`, a descriptor this process holds on its directory (`path_through_fd`), so a long TMPDIR still
    works."""
    if len(os.fsencode(str(path))) <= UNIX_PATH_MAX or dir_fd is None:
        return str(path)
    return path_through_fd(dir_fd, path.name)


def _uds_ok(path: Path | str, route: str, timeout: float = 1.0) -> bool:
    """GET `route` from an HTTP server behind the Unix socket `path`; True on 200."""
    import http.client

    class Conn(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(str(path))

    conn = Conn("tritonserver", timeout=timeout)
    try:
        conn.request("GET", route)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


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


MAX_RELOADS, RELOAD_WINDOW_S = 5, 600.0  # stub deaths reloaded alone before the whole server is restarted


class TritonServer:
    """A tritonserver process on a model repository, behind the HTTP front (deploy/front.py); a context manager that
    starts both and waits for readiness.

    `http_port` is the front's (on `host`). tritonserver runs in a network namespace of its own (netns_bridge.py)
    where the machine allows unprivileged user namespaces: no other process can connect to its ports, the front
    reaches its HTTP port through a Unix socket in the server's 0700 work dir, and the metrics (and gRPC) ports asked
    for are relayed from sockets bound here. Elsewhere its HTTP port is a free loopback port answering only requests
    carrying the front's per-start header, which then stands on its command line (`isolation` says which; `serve`
    prints it). gRPC listens on loopback only (it has no front). The server's
    output is kept in memory (its most telling line comes with any ServerError); `log_path` also writes all of it
    to that file (named in the error), which is renamed to `<log_path>.1` (replacing the one before) once it holds
    `log_max_bytes` (0: never; nor a pipe, FIFO or terminal: `log_rotates`) and begun anew, so at most twice that
    is kept however long the server runs; `echo=True` copies it to stderr as it arrives. The server runs in its own
    process session and is sent SIGTERM if the process that started it dies (Linux; the starting thread must outlive
    the server). `restart()` replaces a dead tritonserver behind the same front. While the start waits for the models
    to load, a line every `progress_s` seconds (None: none) on stderr says what it waits for; the error at
    `ready_timeout_s` says it too.
    """

    def __init__(self, repo, http_port: int = 8000, grpc_port: int | None = None, metrics_port: int | None = None,
                 host: str = "127.0.0.1", ready_timeout_s: float = 180.0, echo: bool = False,
                 log_verbose: int = 0, extra_args: list[str] | None = None, log_path=None, limits=None,
                 exit_timeout_s: int = 10, grpc: bool = False, progress_s: float | None = None,
                 log_max_bytes: int = LOG_MAX_BYTES):
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise DFlashError("model repository not found", path=self.repo)
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.ready_timeout_s = ready_timeout_s
        self.progress_s = progress_s
        self.echo = echo
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args or [])
        self.limits = (limits or Limits()).check()
        self.exit_timeout_s = exit_timeout_s
        self.proc: subprocess.Popen | None = None
        self.front = None
        self.triton_http_port: int | None = None
        self._workdir: Path | None = None
        self._workdir_fd: int | None = None  # a descriptor on the work dir: the socket's address under a long TMPDIR
        self._served: Path | None = None  # the copy of the checked repository tritonserver loads (served_copy)
        self._log: collections.deque[str] = collections.deque(maxlen=400)
        # The first lines of the current run, kept apart from the tail: tritonserver names a rejected option on the
        # line before its 402-line usage text, which pushes that line out of the tail.
        self._head: list[str] = []
        self._run_lines = 0
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.log_path = Path(log_path) if log_path is not None else None
        self.log_max_bytes = log_max_bytes
        self._log_file = None
        self._log_bytes = 0  # what the log file holds (its size when opened, then what _pump wrote)
        self.log_rotates = False  # whether the open log is a regular file, which rotation may rename
        self._log_lock = threading.Lock()  # _pump writes and renames the file; stop() closes it
        self._shm_prefix = shm_prefix(os.getpid(), http_port)
        self._python_envs: set[str] = set()
        # python_env dirs before this run's tritonserver started, until its own is told apart (`_claim_python_env`)
        self._envs_before: set[str] | None = None
        self._env_lock: int | None = None  # this user's python_env lock, held until then (`lock_python_env_turn`)
        self.restarts = 0
        self.grpc = grpc
        self.model_id: str | None = None  # the OpenAI API's model name (default: the repository's recipe)
        self._pgid: int | None = None
        # tritonserver's own pid: self.proc's, or, in a private network namespace, the child of the bridge that
        # self.proc runs, which outlives it by up to one bridge poll (its stubs die with it at once)
        self._server_pid: int | None = None
        self._stubs: dict[int, str] = {}  # the running server's model stubs: pid -> model, counted once it is ready
        self.stub_death: str | None = None
        self._dead_models: set[str] = set()
        self.reloads = 0  # models reloaded alone after a stub death (explicit model control)
        self._stranded = 0  # model versions a dead stub left unable to unload (reset by a restart)
        self._stranded_calls = 0  # HTTP requests in flight on a dead stub, which tritonserver never ends (likewise)
        self.stranded_at_exit = False  # the last stop ended tritonserver once only stranded versions were left
        self.reload_timeout_s = min(ready_timeout_s, 120.0)  # a reload slower than this restarts the server
        self._reload_times: list[float] = []  # more than MAX_RELOADS in RELOAD_WINDOW_S: the server is restarted
        self._exited_stubs: dict[int, str] = {}  # stubs exited while the models loaded, STUB_ZOMBIE_S unreaped
        self._zombies_seen: dict[int, float] = {}  # when each of those was first seen exited
        # While the models load: each stub seen running (pid -> its model, None for the backend's trial run, and the
        # most it held resident), how each seen exited ended (`stubs_of`), and the machine's out-of-memory kills
        # before the start: what a stub's death during the load is reported with (`_stub_failure`).
        self._stub_models: dict[int, str | None] = {}
        self._stub_peaks: dict[int, int] = {}
        self._stub_ends: dict[int, str] = {}
        self._oom_kills_before: int | None = None
        self.private = private_network_unavailable() is None
        self.isolation = ("a network namespace of its own (only the front reaches it, through a 0600 Unix socket)"
                          if self.private else "loopback behind a header on its command line, readable by local "
                          f"users (no private network namespace here: {private_network_unavailable()})")
        self._listeners: list[socket.socket] = []  # metrics / gRPC ports bound here, relayed into the namespace
        # tritonserver's own ports sit behind the front: picked free unless given (two `serve`s on one machine, or
        # one where 8001 / 8002 are taken, just work). Its metrics are exposed only on a port asked for; inside its
        # namespace any port is free.
        if self.grpc and self.grpc_port is None:
            self.grpc_port = free_loopback_ports(1)[0]
        self._inner_metrics_port = self.metrics_port or (8002 if self.private else free_loopback_ports(1)[0])

    # URLs -------------------------------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str | None:
        return f"127.0.0.1:{self.grpc_port}" if self.grpc else None

    @property
    def metrics_url(self) -> str | None:
        """tritonserver's own Prometheus endpoint (None: not exposed; the front's /metrics has DFlash's figures)."""
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else None

    def log_text(self) -> str:
        return "".join(self._log)

    # Lifecycle --------------------------------------------------------------------------------------------------------
    def command(self, backend_dir: Path) -> list[str]:
        install = find_triton()
        # In its own network namespace nobody but the front reaches tritonserver's HTTP port, so no secret goes on
        # its command line (/proc shows it to every local user); gRPC's restricted protocols (gRPC is relayed to
        # this machine's loopback) then get a key no gRPC client can send: a header value cannot hold a line feed.
        secret = self.front.secret if not self.private else None
        grpc_key = secret or secrets.token_hex(8) + "\n"
        cmd = [
            str(install.binary),
            f"--model-repository={self._served}",
            f"--backend-directory={backend_dir}",
            # Triton's own HTTP parser must never see a request the front did not check (see deploy/front.py):
            # loopback only, and every API behind the front's per-start secret header.
            "--http-address=127.0.0.1", f"--http-port={self.triton_http_port}",
            *([f"--http-restricted-api={RESTRICTED_APIS}:{SECRET_HEADER}={secret}"] if secret else []),
            # gRPC has no front: off unless asked for; then loopback only, and everything but inference and health
            # (shared-memory registration above all) behind a key.
            *(["--allow-grpc=true", "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
               "--grpc-restricted-protocol=shared-memory,model-repository,statistics,trace,logging,model-config:"
               f"{SECRET_HEADER}={grpc_key}"] if self.grpc else ["--allow-grpc=false"]),
            f"--metrics-address={'127.0.0.1' if self.private or not self.metrics_port else self.host}",
            f"--metrics-port={self._inner_metrics_port}",
            "--allow-gpu-metrics=false",
            # The written config.pbtxt is the contract; never let the server rewrite it.
            "--disable-auto-complete-config",
            # Every model at start, then load through the repository API only: a model whose stub died is reloaded
            # alone while the others keep serving (`reload_models`).
            "--model-control-mode=explicit", "--load-model=*",
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
        install = find_triton()
        stub_site = ensure_stub_site()
        try:
            if self._workdir is None:
                clean_stale_leftovers()
                tmp = tempfile.gettempdir()
                if _SHELL_UNSAFE.search(tmp):
                    raise DFlashError("tritonserver's python backend starts its models through a shell command line "
                                      "that does not quote paths, and this one has spaces, quotes or other shell "
                                      "characters; set TMPDIR to a directory whose path has none", path=tmp,
                                      field="TMPDIR")
                self._workdir = Path(tempfile.mkdtemp(prefix="dflash-triton-"))
                self._workdir_fd = directory_fd(self._workdir)
                self._write_owner()
                make_backend_dir(install, self._workdir / "backends")
                make_stub_env(self._workdir / "stubenv", stub_site)
            cancel_dir = new_cancel_dir(self._workdir)
            uds = self._workdir / UDS_NAME
            # The checked files tritonserver loads, under the repository's own path (so `ps` still names it).
            self._served = served_copy(self.repo, served_dir(self._workdir, self.repo))
            if self.front is None:
                marker = _read_marker(self.repo)
                models = tuple(marker.get("models") or ("dflash",))
                engine = self.repo / models[0] / "engine"
                self.front = Front(self.host, self.http_port, self.limits, cancel_dir,
                                   model_id=self.model_id or str(marker.get("recipe") or "dflash"), models=models,
                                   capacity=int(marker.get("instances", 1)) * int(marker.get("max_batch", 1)),
                                   prompt_char_limit=prompt_char_limit(engine), block_size=engine_block_size(engine),
                                   upstream_uds=self._uds_address() if self.private else None).start()
                self.front.health = self.health
                self.front.model_health = self.health
            # What the models loaded now take (read at every start: a restart loads the repository's configs anew).
            self.front.model_inputs = model_inputs(self._served)
            self.triton_http_port = free_loopback_ports(1)[0]
            cmd = self.command(self._workdir / "backends")
            env = server_env(install, stub_site, self._workdir / "stubenv" / "bin")
            env[CANCEL_DIR_ENV] = str(cancel_dir)
            if self.log_path is not None and self._log_file is None:
                try:
                    with self._log_lock:
                        self._open_log(append=bool(self.restarts))
                except OSError as e:
                    why = ("a FIFO no process reads: its writer would wait for one" if e.errno == errno.ENXIO
                           else e.strerror)
                    raise DFlashError(f"cannot write the server log ({why})", path=self.log_path,
                                      field="--log-file") from None
            self._stopping = False
            self._release_python_env_lock()  # a start that failed before its claim still held it
            self._env_lock = lock_python_env_turn()
            self._envs_before = _python_env_dirs()
            self._stub_models, self._stub_peaks, self._stub_ends = {}, {}, {}
            self._oom_kills_before = oom_kills()
            self.stub_death = None
            pass_fds: tuple[int, ...] = ()
            if self.private:
                if not self._listeners:
                    self._listeners = self._bind_relayed_ports()
                relayed = [port for _, port in self._relayed_ports()]
                pass_fds = tuple(s.fileno() for s in self._listeners)
                uds.unlink(missing_ok=True)
                cmd = [sys.executable, "-I", str(BRIDGE), "--uds", str(uds), "--port", str(self.triton_http_port),
                       *[f"--forward={fd}:{port}" for fd, port in zip(pass_fds, relayed)], "--", *cmd]
            self._head, self._run_lines = [], 0
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, errors="replace",
                                         start_new_session=True, preexec_fn=_die_with_parent(), pass_fds=pass_fds)
            self._pgid = self.proc.pid  # its own session: the group id is its pid, still valid after it is reaped
            self._reader = threading.Thread(target=self._pump, daemon=True)
            self._reader.start()
            self._wait_ready()
            self._server_pid = self._find_server_pid()
            self._protect_shm()
            self._stubs = self._count_stubs()
            self._claim_python_env()
            self._release_python_env_lock()  # claimed, or (no stub seen) never to be: the next start need not wait
            self._write_owner()
            for model in self.front.models:  # a reload that failed left its model refused; this server has it
                self.front.model_back(model)
            self.front.set_upstream(self.triton_http_port)
        except BaseException:
            self._claim_python_env()  # the dir of a server that never got ready, killed below
            self.stop(drain_timeout_s=0)
            raise
        return self

    def _uds_address(self) -> str:
        """The address the front connects to tritonserver's Unix socket at (`unix_address`)."""
        return unix_address(self._workdir / UDS_NAME, self._workdir_fd)

    def _relayed_ports(self) -> list[tuple[str, int]]:
        return ([(self.host, self.metrics_port)] if self.metrics_port else []) + \
            ([("127.0.0.1", self.grpc_port)] if self.grpc else [])

    def _bind_relayed_ports(self) -> list[socket.socket]:
        """The metrics port (on `host`) and the gRPC port (loopback) bound and listening here, handed to the bridge
        (netns_bridge.py), which relays them to tritonserver inside its namespace."""
        out = []
        for host, port in self._relayed_ports():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                s.listen(128)
            except OSError as e:
                s.close()
                for o in out:
                    o.close()
                raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror or e})",
                                  field="--metrics-port" if port == self.metrics_port else "--grpc-port") from None
            out.append(s)
        return out

    def _write_owner(self) -> None:
        if self._workdir is not None:
            owner = {"pid": os.getpid(), "python_env": sorted(self._python_envs)}
            (self._workdir / OWNER_FILE).write_text(json.dumps(owner), encoding="utf-8")

    def restart(self) -> "TritonServer":
        """After tritonserver died on its own: clear what it left, start a new one behind the same front (on the
        repository checked again: a model started anew reads its files anew)."""
        self.front.set_upstream(None)
        self._reap()
        check_repository(self.repo)
        self.restarts += 1
        self._stranded = self._stranded_calls = 0
        self._log.append(f"[dflash-export] tritonserver restarted ({self.restarts})\n")
        return self.start()

    def _open_log(self, append: bool) -> None:
        """Open the log file (owner-only, like the default log: it carries what the models print about requests)."""
        # Non-blocking: a FIFO with no reader fails (ENXIO) instead of holding the start forever; writes then block.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK
                     | (os.O_APPEND if append else os.O_TRUNC), 0o600)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        self._log_file = open(fd, "a" if append else "w", encoding="utf-8", errors="replace")
        st = os.fstat(fd)
        self._log_bytes = st.st_size
        self.log_rotates = stat.S_ISREG(st.st_mode)  # a pipe, FIFO or terminal is never renamed away

    def _write_log(self, line: str) -> None:
        with self._log_lock:
            if self._log_file is None:
                return
            try:
                self._log_file.write(line)
                self._log_file.flush()
                self._log_bytes += len(line.encode("utf-8", "replace"))
                if self.log_max_bytes and self.log_rotates and self._log_bytes >= self.log_max_bytes:
                    # The full log becomes <log>.1 (the one before goes) and a new one begins; where it cannot be
                    # renamed, it goes on.
                    self._log_file.close()
                    self._log_file = None
                    try:
                        os.replace(self.log_path, f"{self.log_path}.1")
                        renamed = True
                    except OSError:
                        renamed = False
                    self._open_log(append=not renamed)
            except (OSError, ValueError):  # disk full, or closed by stop(): the in-memory tail remains
                pass

    def _pump(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            self._log.append(line)
            self._run_lines += 1
            if len(self._head) < _HEAD_LINES:
                self._head.append(line)
            self._write_log(line)
            if self.echo:
                sys.stderr.write(line)
                sys.stderr.flush()

    def _wait_ready(self) -> None:
        start = time.monotonic()
        deadline = start + self.ready_timeout_s
        url = f"http://127.0.0.1:{self.triton_http_port}/v2/health/ready"
        uds = self._uds_address()
        self._zombies_seen = {}
        next_note = start + self.progress_s if self.progress_s else None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._death_error()
            if self._stub_exited_while_loading():
                raise self._stub_death_error()
            self._claim_python_env()
            if (_uds_ok(uds, "/v2/health/ready") if self.private else
                    _http_ok(url, headers={SECRET_HEADER: self.front.secret})):
                self._stub_ends = {}  # loaded: a later death is a running model's (`health`), not the load's
                return
            if next_note is not None and time.monotonic() >= next_note:
                print(f"waiting for tritonserver to be ready ({time.monotonic() - start:.0f} s of "
                      f"{self.ready_timeout_s:g} s): {self._load_stage()}", file=sys.stderr, flush=True)
                next_note += self.progress_s
            time.sleep(0.2)
        raise ServerError(f"tritonserver not ready after {self.ready_timeout_s:g} s: {self._load_stage()} (log: "
                          f"{_shorten(self._last_error())}); `serve --ready-timeout` sets the wait" + self._log_note(),
                          path=self.repo)

    def _loading_models(self) -> tuple[list[str], list[str]]:
        """(the models this run's log shows begun loading, those of them not loaded yet)."""
        lines = self._run_log()
        begun = [m.group(1) for m in (re.search(r'"loading: (.+):\d+"', ln) for ln in lines) if m]
        loaded = {m.group(1) for m in (re.search(r"successfully loaded '([^']+)'", ln) for ln in lines) if m}
        return begun, [m for m in dict.fromkeys(begun) if m not in loaded]

    def _load_stage(self) -> str:
        """What the start waits for, from this run's log and /proc: tritonserver not loading models yet; or the models
        loading (begun, not yet loaded), each with its stubs' pids and what they are doing (`proc_usage`); or every
        model loaded and the server not ready yet."""
        begun, loading = self._loading_models()
        if not begun:
            return "tritonserver has not begun loading the models"
        if not loading:
            return "every model loaded, tritonserver not ready yet"
        stubs = []
        for pid in sorted(group_members(self._pgid, "triton_python_b")) if self._pgid is not None else []:
            model, usage = stub_model(pid), proc_usage(pid)
            if usage is not None and model in (*loading, None):
                stubs.append(f"pid {pid}" + (f" ({model})" if model else " (the backend's trial run)") + f" {usage}")
        return f"loading {', '.join(loading)}, " + (f"model stub {'; '.join(stubs)}" if stubs else
                                                    "no model stub running")

    def _claim_python_env(self) -> None:
        """Take this run's python_env dir into those `stop` removes (and the owner record) once it is certain to be
        this server's: the python backend makes it before it starts a stub, and removes it only as tritonserver exits.
        So with a stub of this server seen, then the dirs listed, then tritonserver seen still running, this server's
        dir is among those made since it started; it is taken when it is the only one. Another `serve` of this user
        waits for its turn (the python_env lock, held from before the dirs were first listed until now) before it
        lists the dirs and starts its tritonserver, so its dir is never among them. A second one made meanwhile (a
        tritonserver started some other way, or a `serve` that went on without the lock): then neither is taken
        (this one's is left, empty, rather than risk removing the other's)."""
        if self._envs_before is None or self._pgid is None or not group_members(self._pgid, "triton_python_b",
                                                                                exited=True):
            return
        made = _python_env_dirs() - self._envs_before
        if not group_members(self._pgid, "tritonserver"):
            return
        self._envs_before = None
        self._release_python_env_lock()
        if len(made) == 1:
            self._python_envs |= made
            try:
                self._write_owner()  # a `serve` killed from here on leaves it to the next start to remove
            except OSError:
                pass

    def _release_python_env_lock(self) -> None:
        if self._env_lock is not None:
            os.close(self._env_lock)
            self._env_lock = None

    def _stub_exited_while_loading(self) -> bool:
        """Whether a model stub exited before the server was ready and has stayed unreaped for STUB_ZOMBIE_S (one
        tritonserver ends and reaps itself is not counted), tritonserver still waiting on it. Notes on the way what
        `_stub_failure` reports: each running stub's model and peak RSS, and how each exited one ended (a stub that
        dies once it has reported is seen exited for the moment before tritonserver fails its load and exits)."""
        now = time.monotonic()
        stubs = stubs_of(self._pgid) if self._pgid is not None else {}
        for pid in (pid for pid, how in stubs.items() if how is None):
            if pid not in self._stub_models:
                self._stub_models[pid] = stub_model(pid)
            peak = peak_rss_bytes(pid)
            if peak is not None:
                self._stub_peaks[pid] = max(peak, self._stub_peaks.get(pid, 0))
        exited = {pid: how for pid, how in stubs.items() if how is not None}
        # the backend's trial run of the stub (no model) exits 0 as it should
        self._stub_ends.update({pid: how for pid, how in exited.items() if how != "exit code 0"})
        self._zombies_seen = {pid: self._zombies_seen.get(pid, now) for pid in exited}
        self._exited_stubs = {pid: how for pid, how in exited.items() if now - self._zombies_seen[pid] >= STUB_ZOMBIE_S}
        return bool(self._exited_stubs) and self.proc.poll() is None

    def _stub_death_error(self) -> ServerError:
        """One line for a model stub that exited while its model loaded, tritonserver left waiting on it
        (`_stub_failure`)."""
        return self._stub_failure(self._exited_stubs)

    def _stub_said(self) -> str | None:
        """The last line of this run's log that a model stub printed itself (not tritonserver's log lines, option
        table or last words, nor the model's own dflash-* notes); None when there is none."""
        for ln in reversed(self._run_log()):
            if not (_TRITON_LINE.match(ln) or ln.startswith(("+", "|", "dflash-", "error: creating server"))
                    or "CudaDriverHelper" in ln):
                return ln
        return None

    def _stub_failure(self, ended: dict[int, str]) -> ServerError:
        """One line for the model stubs `ended` (pid -> how, `stubs_of`) that exited while the models loaded: the
        model, how the first ended, and why as far as it can be told. The environment's doing, exit 2 (ModelRefused,
        like a model refusing its environment at load): a stub that cannot start (exit code 127 or 126, the shell's
        "not found" and "cannot execute", which the dynamic loader also gives for a shared library missing, or such a
        loader error in what it printed: its line is given), and one killed by SIGKILL (what the kernel's
        out-of-memory killer sends; its peak RSS and the memory available are given). Anything else (a crash: another
        signal, another exit code) is a bug, exit 3, with the stub's last line."""
        pid = min(ended, key=lambda p: (ended[p] == "exit code 0", p))  # a failed one first (not a trial run's)
        more = f" and {len(ended) - 1} more" if len(ended) > 1 else ""
        how = ended[pid]
        model = self._stub_models.get(pid) or ", ".join(self._loading_models()[1]) or "a model"
        said = self._stub_said()
        if how == "signal 9":
            peak = f", peak RSS {size_text(self._stub_peaks[pid])}" if pid in self._stub_peaks else ""
            kills = oom_kills()
            oom = (" (the kernel's out-of-memory killer ran meanwhile)" if None not in (kills, self._oom_kills_before)
                   and kills > self._oom_kills_before else "")
            note = memory_note()
            return ModelRefused(f"a model stub was killed by signal 9 while loading {model} (pid {pid}{more}{peak}): "
                                f"likely out of memory{oom}" + (f"; {note} now" if note else "") + self._log_note(),
                                path=self.repo)
        if how in ("exit code 127", "exit code 126") or (said and _LOADER_ERROR.search(said)):
            why = said or ("the stub or a library it needs was not found" if how == "exit code 127" else
                           "the stub cannot be executed")
            why = re.sub(r"^\S*/triton_python_backend_stub: ", "", why)  # the loader names the binary first
            return ModelRefused(f"the model stub of {model} cannot start (pid {pid}{more}, {how}: {_shorten(why)})"
                                + self._log_note(), path=self.repo)
        detail = f": {_shorten(said)}" if said else ""
        return ServerError(f"a model stub exited while its model loaded ({model}, pid {pid}{more}, {how}{detail})"
                           + self._log_note(), path=self.repo)

    def _log_note(self) -> str:
        return f"; full log: {self.log_path}" if self.log_path is not None else ""

    def _run_log(self) -> list[str]:
        """This run's log lines, stripped, without blank ones and this object's own notes: an earlier run's lines say
        nothing about this one."""
        log = list(self._log)
        marks = [i for i, ln in enumerate(log) if ln.startswith("[dflash-export] tritonserver restarted")]
        run = log[marks[-1] + 1 if marks else 0:]
        # Lines of this run the tail no longer holds (its own notes are not counted): taken from the head.
        lost = self._run_lines - sum(not ln.startswith("[dflash-export]") for ln in run)
        return [ln.strip() for ln in self._head[:max(0, lost)] + run
                if ln.strip() and not ln.startswith("[dflash-export]")]

    def _last_error(self, last_line: bool = True) -> str | None:
        """The most telling log line: tritonserver refusing its command line, else the first model load failure, else
        the first error line, else the last line (with `last_line`; None without it)."""
        lines = self._run_log()
        options = [ln for ln in lines if _OPTION_ERROR.search(ln) and not _TRITON_LINE.match(ln)]
        if options:  # "<path>/tritonserver: unrecognized option ..." or "Bad option: ..." + "invalid value ..."
            return " ".join(re.sub(r"^\S*/tritonserver:", "tritonserver:", ln) for ln in options[:2])
        for pick, which in ((lambda ln: _TRITON_ERROR.match(ln) and "failed to load '" in ln, 0),
                            (lambda ln: _TRITON_ERROR.match(ln) and "CudaDriverHelper" not in ln, 0),
                            (lambda ln: "error" in ln.lower(), 0),
                            (lambda ln: last_line, -1)):
            found = [ln for ln in lines if pick(ln)]
            if found:
                # Triton's lines carry a Python traceback with escaped newlines; its first line says it all.
                line = re.sub(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ", "", found[which])
                return line.split("\\n")[0].strip('"')
        return "(no output)" if last_line else None

    def _death_error(self) -> ServerError:
        """One line for a server that exited on its own: its most telling log line (shortened) and where the log is.

        ModelRefused (exit 2) when that line is a model refusing its input, ServerError (exit 3) otherwise.
        """
        if self._reader is not None:
            self._reader.join(timeout=2)
        rc = self.proc.returncode
        killed = rc is not None and rc < 0
        line = self._last_error(last_line=not killed)
        if line is None:  # a signal, and nothing in the log says why: its last line would be whatever came last
            name = signal.Signals(-rc).name if -rc in signal.valid_signals() else "unknown"
            return ServerError(f"tritonserver exited (signal {-rc}, {name}; no error in its log)" + self._log_note(),
                               path=self.repo)
        if _STUB_UNHEALTHY.search(line) and self._stub_ends:  # a stub that died loading: how it ended says why
            return self._stub_failure(self._stub_ends)
        cls = ModelRefused if _INPUT_ERROR.search(line) else ServerError
        line = _INPUT_ERROR.sub("", line, count=1)
        code = f"signal {-rc}" if killed else f"code {rc}"
        return cls(f"tritonserver exited ({code}: {_shorten(line)})" + self._log_note(), path=self.repo)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _find_server_pid(self) -> int | None:
        if not self.private:
            return self.proc.pid
        found = group_members(self._pgid, "tritonserver")
        return found[0] if len(found) == 1 else None

    def _server_gone(self) -> bool:
        """tritonserver itself has exited, though the bridge (self.proc) may not have noticed yet."""
        return (self.proc is None or self.proc.poll() is not None
                or (self._server_pid is not None and not _running(self._server_pid)))

    def _await_death(self, timeout_s: float = 5.0) -> None:
        """Once tritonserver is gone, give the bridge the moment it takes to reap it and exit with its status (what
        `_death_error` reports)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def _protect_shm(self) -> None:
        """Owner-only (0600) shared-memory regions: the python backend creates them 0644 whatever the umask (it sets
        the mode itself), and they carry prompts and outputs. Run once the server is ready (before any request) and
        again at every health poll (a region added later is closed within one poll)."""
        for p in SHM_DIR.glob(self._shm_prefix + "*") if SHM_DIR.is_dir() else []:
            try:
                if p.stat().st_mode & 0o077:
                    os.chmod(p, 0o600)
            except OSError:
                pass

    def _count_stubs(self) -> dict[int, str]:
        """pid -> model of the server's python stubs (each names its model's model.py on its command line)."""
        return {pid: stub_model(pid) or "?" for pid in group_members(self._pgid, "triton_python_b")}

    def health(self, model: str | None = None) -> str | None:
        """Why the server cannot serve now (None: it can): tritonserver gone or stopped, or a model stub dead (of
        `model`, when one is named; "" names none: only tritonserver's own state)."""
        if self.stub_death is None:
            # tritonserver's death kills its stubs with it: seen before the bridge exits, that is no stub death
            if self._server_gone():
                return "tritonserver is not running"
            dead = {p: m for p, m in self._stubs.items() if not _running(p)}
            if dead:
                more = f" and {len(dead) - 1} more" if len(dead) > 1 else ""
                models = sorted(set(dead.values()))
                self._dead_models = set(models)
                self.stub_death = (f"a model stub of {', '.join(models)} died (pid {min(dead)}{more}; the model "
                                   "reloads)")
        if self.stub_death is not None and (model is None or model in self._dead_models):
            return self.stub_death
        if self.proc is None or self.proc.poll() is not None:
            return "tritonserver is not running"
        if "T" in (_state(p) for p in [self.proc.pid, *group_members(self._pgid or self.proc.pid, "tritonserver")]):
            return "tritonserver is stopped (SIGSTOP)"
        return None

    def wait(self, poll_s: float = 0.5) -> int:
        """Block until the server exits; ServerError when that was not requested. A dead model stub never comes
        back by itself (Triton keeps answering "not healthy" and its readiness stays 200): its model is reloaded
        alone here (`reload_models`), ServerError when that fails (`serve` then restarts the server)."""
        assert self.proc is not None
        while True:
            try:
                rc = self.proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                pass
            if self._stopping:
                continue
            self._protect_shm()
            if self.health() is not None and self.stub_death is not None:
                self.reload_models()
        if not self._stopping:
            raise self._death_error()
        return rc

    def _call(self, method: str, route: str, timeout_s: float, body: bytes = b"{}") -> tuple[int, bytes]:
        """A request to tritonserver's own API, the front's way in; (status, body), status 0 when it did not answer
        within `timeout_s`."""
        import http.client

        uds = self._uds_address() if self._workdir is not None else None

        class UnixConnection(http.client.HTTPConnection):
            def connect(self):
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout_s)
                self.sock.connect(str(uds))

        conn = (UnixConnection("tritonserver", timeout=timeout_s) if self.private else
                http.client.HTTPConnection("127.0.0.1", self.triton_http_port, timeout=timeout_s))
        headers = {"Content-Type": "application/json", **({} if self.private else {SECRET_HEADER: self.front.secret})}
        try:
            conn.request(method, route, body=body if method == "POST" else None, headers=headers)
            r = conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException) as e:
            return 0, str(e).encode()
        finally:
            conn.close()

    def reload_models(self) -> None:
        """Reload the models whose stubs died, the others serving meanwhile; ServerError when that fails.

        A stub's death strands what it held: Triton never releases the requests in flight on it, so that model
        version can never finish unloading (and tritonserver's exit waits for it). So: the front answers every
        request in flight on the model 503 now and refuses new ones; the model's other stubs (their requests just
        failed) are killed, freeing their memory and cores at once; then an unload and a load through the
        repository API start a new version with new stubs, and the front sends the model requests again.
        """
        models = sorted(self._dead_models)
        why = self.stub_death or "a model stub died"
        t0 = time.monotonic()
        self._reload_times = [t for t in self._reload_times if t0 - t < RELOAD_WINDOW_S] + [t0]
        if len(self._reload_times) > MAX_RELOADS:  # stubs that keep dying: a reload is not fixing it
            raise ServerError(f"{why.split(';')[0]}, the {len(self._reload_times)}th stub death in "
                              f"{RELOAD_WINDOW_S:.0f} s" + self._log_note(), path=self.repo)
        failed = sum(self.front.fail_model(m, why.replace("; the model reloads", "; its model reloads"))
                     for m in models) if self.front is not None else 0
        old = {p for p, m in self._stubs.items() if m in models}
        for pid in old:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.append(f"[dflash-export] reloading {', '.join(models)}: {why}\n")
        print(f"reloading {', '.join(models)} ({why}; {failed} request(s) in flight answered 503)",
              file=sys.stderr, flush=True)
        check_repository(self.repo)  # the reload reads the model's files again: they must still be deploy's
        for model in models:
            # Unload first: a load of a loaded model whose files did not change since it was last loaded is a no-op
            # (its dead stub stays dead; so is a load carrying the same configuration), while a load of an
            # unloaded one always starts new stubs. The unload returns at once; the old version is left behind.
            status, body = self._call("POST", f"/v2/repository/models/{model}/unload", self.reload_timeout_s)
            if status == 200:
                status, body = self._call("POST", f"/v2/repository/models/{model}/load", self.reload_timeout_s)
            if status != 200:
                if self.proc is not None and self._server_gone():  # the server itself died meanwhile
                    self._await_death()
                    raise self._death_error()
                detail = _shorten(body.decode("utf-8", "replace")) if status else \
                    f"no answer within {self.reload_timeout_s:g} s" if body == b"timed out" else \
                    f"no answer: {_shorten(body.decode('utf-8', 'replace'))}"
                raise ServerError(f"{why.split(';')[0]}; reloading {model} failed (HTTP {status}: {detail})"
                                  + self._log_note(), path=self.repo)
        self._protect_shm()
        stubs = {p: m for p, m in self._count_stubs().items() if p not in old}
        missing = [m for m in models if m not in stubs.values()]
        if missing:  # a load that started no stub would leave the model's requests waiting on nothing
            raise ServerError(f"{why.split(';')[0]}; reloading {', '.join(missing)} started no model stub"
                              + self._log_note(), path=self.repo)
        self._stubs = stubs
        self.stub_death, self._dead_models = None, set()
        self.reloads += 1
        self._stranded += len(models)
        self._stranded_calls += failed
        for model in models:
            self.front.model_back(model) if self.front is not None else None
        print(f"reloaded {', '.join(models)} in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)

    def _reap(self, timeout_s: float = 0.0) -> int | None:
        """End tritonserver (SIGTERM to it alone, so its stubs finish their requests and exit with it; SIGKILL to
        the whole group after `timeout_s`) and remove its shared memory segments. Returns its exit code."""
        proc = self.proc
        rc = None
        self.stranded_at_exit = False
        if proc is not None:
            pgid = self._pgid
            if proc.poll() is None and timeout_s > 0:
                try:
                    proc.send_signal(signal.SIGTERM)
                    end = time.monotonic() + timeout_s
                    while proc.poll() is None and time.monotonic() < end:
                        try:
                            proc.wait(timeout=0.2)
                        except subprocess.TimeoutExpired:
                            pass
                        if (self._stranded or self._stranded_calls) and self._only_stranded_left():
                            # What is left can never unload (a dead stub's version): the exit is done but for
                            # tritonserver's whole exit timeout, so it is ended now (SIGKILL, below).
                            self.stranded_at_exit = True
                            break
                except ProcessLookupError:
                    pass
            if pgid is not None:
                # Stubs live in the same group; make sure none outlives the server. The group outlives its leader
                # (tritonserver may already be reaped by `wait`), so it is killed by the id recorded at start.
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            # A stub that left the group still names this server's shared memory on its command line.
            for pid in pids_with_arg(self._shm_prefix):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            rc = proc.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)
        remove_shm(self._shm_prefix)
        return rc

    def _only_stranded_left(self) -> bool:
        """Whether tritonserver's shutdown is down to what dead stubs stranded: the model versions they left (while
        exiting it logs "Found N live models and M in-flight non-inference requests" every second), or, before
        that, the HTTP requests that were in flight on them ("Found N HTTP service connections" every second: it
        never ends those, and the front, closed by then, holds none of its own)."""
        for line in reversed(list(self._log)[-30:]):
            m = re.search(r"Found (\d+) live models and (\d+) in-flight non-inference requests", line)
            if m:
                return int(m.group(1)) <= self._stranded and int(m.group(2)) == 0
            m = re.search(r"Found (\d+) HTTP service connections", line)
            if m:
                return self.front is None and int(m.group(1)) <= self._stranded_calls
        return False

    def stop(self, timeout_s: float = 20.0, drain_timeout_s: float = 10.0) -> bool:
        """Drain the front (new requests 503, running ones finish for up to `drain_timeout_s`, then are cancelled
        and answered 503) and close it, SIGTERM tritonserver (it finishes gRPC requests for up to its
        --exit-timeout-secs), SIGKILL what is left after `timeout_s` (at once when only what dead stubs stranded is
        left), and remove the work dir, shared memory and python_env dirs.

        Returns True when every request finished by itself (the drain completed) and tritonserver exited cleanly.
        """
        self._stopping = True
        self._release_python_env_lock()
        drained = True
        if self.front is not None and self.proc is not None and self.proc.poll() is None:
            drained = self.front.drain(drain_timeout_s)
        if self.front is not None:
            # Closed before tritonserver is asked to exit, which waits for every open HTTP connection: a call given up
            # part-way when its stub died can leave its connection open (httpcore), and held tritonserver's exit
            # until the SIGKILL below.
            self.front.close()
            self.front = None
        rc = self._reap(timeout_s)
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        with self._log_lock:
            if self._log_file is not None:
                try:
                    self._log_file.close()
                except OSError:
                    pass
                self._log_file = None
        for env_dir in self._python_envs:
            shutil.rmtree(env_dir, ignore_errors=True)
        self._python_envs = set()
        if self._workdir_fd is not None:
            os.close(self._workdir_fd)
            self._workdir_fd = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return drained and (rc in (0, None, -signal.SIGTERM) or self.stranded_at_exit)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
