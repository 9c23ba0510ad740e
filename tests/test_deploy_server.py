"""`serve` runs the real tritonserver on a deployed repository, on loopback, behind the project's HTTP front.

The server tests (marker `server`) deploy the tiny ONNX Runtime engine (or, only if ONNX Runtime cannot build it, a
PyTorch engine directory), start tritonserver from nvidia-pytriton on free ports and compare every served output with
the same request run directly on the engine in this process. Nothing is mocked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from deploy_support import (
    PROMPTS,
    ROOT,
    as_dict,
    assert_one_line,
    cli,
    concurrent_infer,
    direct,  # noqa: F401 - a fixture
    drop_input,
    edit_manifest,
    engine_dir,  # noqa: F401 - a fixture
    group_pids,
    infer,
    long_engine,  # noqa: F401 - a fixture
    model_triton_py,
    pids_mentioning,
    post_json,
    post_raw,
    ready_line,
    run_direct,
    send_and_drop,
    serve_cli,
    serve_until_sigterm,
    small_repo,  # noqa: F401 - a fixture
    stream_equals_direct,
    tritonserver_pid,
    wait_all_busy,
)

from dflash_export.deploy.repository import MARKER, write_repository
from dflash_export.deploy.server import free_loopback_ports as free_ports
from dflash_export.errors import DFlashError


def test_stub_environment_finds_project_numpy1_and_own_libpython(tmp_path):
    """What the stub gets: this interpreter's libpython first, numpy < 2 (the stub is built against numpy 1), the
    project and this environment's packages (checked with an isolated interpreter, as the stub runs one)."""
    import sysconfig

    from dflash_export.deploy.server import ensure_stub_site, find_triton, make_stub_env, server_env

    install = find_triton()
    stub_site = ensure_stub_site()
    stub_bin = make_stub_env(tmp_path / "stubenv", stub_site)
    env = server_env(install, stub_site, stub_bin, base={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/usr/lib"})
    assert env["LD_LIBRARY_PATH"].split(":")[0] == sysconfig.get_config_var("LIBDIR")
    assert env["LD_LIBRARY_PATH"].endswith(":/usr/lib") and env["PATH"].startswith(str(stub_bin))
    probe = ("import numpy, onnxruntime, dflash_export, sys; "
             "print(numpy.__version__, onnxruntime.__version__, dflash_export.__file__, sys.prefix)")
    r = subprocess.run([str(stub_bin / "python3"), "-I", "-c", probe], capture_output=True, text=True,
                       env={"PATH": env["PATH"], "LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})
    assert r.returncode == 0, r.stderr
    np_version, ort_version, pkg, prefix = r.stdout.split()
    assert int(np_version.split(".")[0]) < 2 and Path(pkg).parent.parent == ROOT
    from importlib import metadata

    assert ort_version == metadata.version("onnxruntime") and prefix == str(tmp_path / "stubenv")
    ldd = subprocess.run(["ldd", str(install.stub)], capture_output=True, text=True,
                         env={"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]}).stdout
    assert f"{sysconfig.get_config_var('LIBDIR')}/libpython" in ldd


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    from dflash_export.deploy.server import TritonServer

    repo = write_repository(engine_dir, tmp_path_factory.mktemp("triton") / "repo", instances=2, max_queue_size=256)
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(repo, http, grpc, metrics, ready_timeout_s=240)
    srv.start()
    pgid = os.getpgid(srv.proc.pid)
    try:
        yield srv
    finally:
        srv.stop()
        assert srv.proc.poll() is not None
        assert group_pids(pgid) == [] and pids_mentioning(str(repo)) == [], "a server process outlived stop()"


@pytest.fixture(scope="module")
def client(server):
    import tritonclient.http as th

    return th.InferenceServerClient(server.http_url.removeprefix("http://"), concurrency=16, network_timeout=120)


@pytest.mark.server
@pytest.mark.parametrize("prompt", PROMPTS)
def test_tritonclient_output_equals_direct_engine_greedy(server, client, direct, prompt):
    served = infer(client, prompt, max_tokens=(32, "INT64"))
    assert served == as_dict(run_direct(direct, text_input=prompt, max_tokens=np.array([32], np.int32)))


@pytest.mark.server
def test_sampled_request_is_reproducible_and_equals_direct(server, client, direct):
    extra = dict(max_tokens=(24, "INT64"), temperature=(0.8, "FP32"), top_p=(0.9, "FP32"), seed=(7, "UINT64"))
    a, b = infer(client, b"sample", **extra), infer(client, b"sample", **extra)
    assert a == b == as_dict(run_direct(direct, text_input=b"sample", max_tokens=np.array([24], np.int32),
                                        temperature=np.array([0.8], np.float32), top_p=np.array([0.9], np.float32),
                                        seed=np.array([7], np.uint64)))


@pytest.mark.server
def test_generate_endpoint_plain_json(server, direct):
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate",
                             {"text_input": "The quick brown fox", "max_tokens": 32})
    assert status == 200, body
    want = run_direct(direct, text_input=b"The quick brown fox", max_tokens=np.array([32], np.int32))
    assert body["text_output"] == want.text and body["finish_reason"] == want.finish_reason
    assert body["completion_tokens"] == 32 and body["accepted_tokens"] == want.accepted_tokens
    # Only text_input: every other input is optional.
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "Hi"})
    assert status == 200 and body["finish_reason"] in ("stop", "length")
    # messages as JSON text.
    msgs = json.dumps([{"role": "user", "content": "hey"}])
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"messages": msgs, "max_tokens": 8})
    assert status == 200 and body["text_output"] == run_direct(
        direct, messages=msgs.encode(), max_tokens=np.array([8], np.int32)).text


@pytest.mark.server
def test_generate_stream_deltas_join_to_direct_output(server, direct):
    events = stream_equals_direct(server, direct, "stream me", 20)
    assert [e["finish_reason"] for e in events[:-1]] == [""] * (len(events) - 1)
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 20
    status, body = post_json(f"{server.http_url}/v2/models/dflash_stream/generate_stream", {"text_input": ""})
    assert "text_input: empty prompt" in str(body)


@pytest.mark.server
def test_16_concurrent_clients_get_the_outputs_of_lone_requests(server, client):

    requests = [(PROMPTS[i % len(PROMPTS)] + str(i).encode(), 8 + (i * 5) % 25) for i in range(20)]
    alone = {r: infer(client, r[0], max_tokens=(r[1], "INT64")) for r in requests}
    results = concurrent_infer(server, requests, clients=16, per_client=10, network_timeout=120, join_timeout=180)
    assert len(results) == 160
    for r, out in results.values():
        assert out == alone[r]


# (request, what the error must name). Each is followed by a good request on the same server.
BAD_JSON = [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": ""}, "text_input: empty prompt"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens: must be in 1.."),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens: must be in 1.."),
    ({"text_input": "hi", "max_tokens": 2_000_000_000}, "max_tokens"),
    ({"text_input": "hi", "temperature": -0.5}, "temperature: must be >= 0"),
    ({"text_input": "x" * 700}, "text_input: prompt is 700 tokens"),  # tokenized, then refused
    ({"text_input": "x" * 2000}, "text_input: prompt text is 2000 characters"),  # refused before tokenizing
    ({"messages": "[{\"role\": 1}]"}, "messages"),
]


@pytest.mark.server
@pytest.mark.parametrize("body, named", BAD_JSON, ids=[n.split(":")[0] + str(i) for i, (_, n) in enumerate(BAD_JSON)])
def test_bad_json_request_gets_named_error_and_server_keeps_serving(server, body, named):
    status, resp = post_json(f"{server.http_url}/v2/models/dflash/generate", body)
    assert status == 400 and named in resp["error"], (status, resp)
    status, resp = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "ok", "max_tokens": 4})
    assert status == 200 and resp["completion_tokens"] == 4


@pytest.mark.server
def test_bad_tensor_requests_get_named_errors_and_server_keeps_serving(server, client):
    from tritonclient.utils import InferenceServerException

    cases = [
        (dict(text=b"\xff\xfe bad"), "text_input: invalid UTF-8"),
        (dict(max_tokens=(8.0, "FP32")), "max_tokens"),                  # wrong dtype: refused by Triton itself
        (dict(text=None, max_tokens=(8, "INT64")), "text_input"),       # missing input
        (dict(max_tokens=(np.array([1, 2], np.int64), "INT64")), "max_tokens"),  # wrong shape
        (dict(temperature=(-1.0, "FP32")), "temperature"),
        (dict(stop=(np.array([b"\xc3"], dtype=np.object_), "BYTES")), "stop: invalid UTF-8"),
    ]
    for kwargs, named in cases:
        text = kwargs.pop("text", b"hello")
        with pytest.raises(InferenceServerException) as e:
            infer(client, text, **kwargs)
        assert named in str(e.value), (named, str(e.value))
        assert infer(client, b"still serving", max_tokens=(3, "INT64"))["completion_tokens"] == 3


@pytest.mark.server
def test_dead_server_raises_one_line_naming_the_cause_and_leaves_nothing(tmp_path, engine_dir):
    from dflash_export.deploy.server import ServerError, TritonServer

    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    # Corrupt the copied engine: the model must refuse to load, the server exit, and the error say why.
    victim = next(p for p in sorted((repo / "dflash" / "engine").iterdir()) if p.name != "manifest.json")
    victim.unlink()
    victim.write_bytes(b"truncated")
    srv = TritonServer(repo, *free_ports(3), ready_timeout_s=120)
    with pytest.raises(ServerError) as e:
        srv.start()
    assert "\n" not in str(e.value) and "manifest hash" in str(e.value), str(e.value)
    assert srv.proc.poll() is not None and pids_mentioning(str(repo)) == []


def _stand_in_stub(monkeypatch, script: str) -> None:
    """Servers started from here on run `script` (sh) as their python backend stub."""
    import dflash_export.deploy.triton_process as tp

    made = tp.make_backend_dir

    def stand_in(install, into):
        out = made(install, into)
        stub = into / "python" / "triton_python_backend_stub"
        stub.unlink()
        stub.write_text("#!/bin/sh\n" + script)
        stub.chmod(0o700)
        return out

    monkeypatch.setattr(tp, "make_backend_dir", stand_in)


def _stubs_of(pgid: int) -> list[int]:
    """Processes of group `pgid` running the python backend stub, exited ones not yet reaped too."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and "(triton_python_b" in stat and int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
            out.append(int(entry.name))
    return out


# What the dynamic loader prints, exit code 127, when a library the stub binary needs cannot be found.
_NO_LIBPYTHON = ('echo "$0: error while loading shared libraries: libpython_gone.so: cannot open shared object file: '
                 'No such file or directory" >&2\nexit 127\n')


@pytest.mark.server
@pytest.mark.parametrize("script, code, needles", [
    # a library the stub needs is missing: the environment, exit 2, with the loader's line
    (_NO_LIBPYTHON, 2, ("the model stub of dflash cannot start (pid ", "exit code 127: error while loading shared "
                        "libraries: libpython_gone.so: cannot open shared object file")),
    # the stub cannot be executed, and says nothing
    ('[ "$#" -eq 0 ] && exit 0\nexit 126\n', 2, ("the model stub of dflash cannot start (pid ",
                                                 "exit code 126: the stub cannot be executed)")),
    # a crash (a bug): exit 3, with what it printed last
    ('[ "$#" -eq 0 ] && exit 0\necho "Fatal Python error: Segmentation fault" >&2\nkill -SEGV $$\n', 3,
     ("a model stub exited while its model loaded (dflash, pid ", "signal 11: Fatal Python error: Segmentation fault")),
    ('echo "cannot open shared object file: libpython_gone.so" >&2\nexit 7\n', 2,
     ("the model stub of dflash cannot start (pid ", "exit code 7: cannot open shared object file: libpython_gone.so")),
    ('[ "$#" -eq 0 ] && exit 0\necho "something else went wrong" >&2\nexit 7\n', 3,
     ("a model stub exited while its model loaded (dflash, pid ", "exit code 7: something else went wrong)")),
], ids=["no-libpython", "cannot-execute", "crash", "loader-error", "other-exit"])
def test_a_model_stub_that_cannot_start_fails_the_start_within_seconds(tmp_path, small_repo, monkeypatch, script,
                                                                       code, needles):
    """A stub that exits before it reports to the python backend (a broken libpython or interpreter, a missing
    library) leaves tritonserver waiting on its model for ever: the start must fail at once with the model, how the
    stub exited and what it printed, and leave no process, work dir or python_env dir behind. The environment's
    doing (exit code 127 or 126, a loader error in what it printed) is exit 2, like a model refusing its environment;
    a crash is a bug, exit 3."""
    from dflash_export.deploy.server import ModelRefused, ServerError, TritonServer

    _stand_in_stub(monkeypatch, script)
    envs_before = set(Path("/tmp").glob("python_env_*"))
    srv = TritonServer(small_repo, *free_ports(3), ready_timeout_s=90)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        srv.start()
    took = time.monotonic() - t0
    msg = str(e.value)
    assert took < 30 and type(e.value) is (ModelRefused if code == 2 else ServerError), (took, msg)
    assert e.value.exit_code == code and "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert group_pids(srv._pgid) == [] and srv._workdir is None
    assert set(Path("/tmp").glob("python_env_*")) <= envs_before  # the killed server's own dir removed too


@pytest.mark.server
def test_serve_exits_2_with_one_line_when_the_model_stub_cannot_start(tmp_path, small_repo, monkeypatch):
    """`serve` itself: a stub that cannot start here (a shared library missing) is one `error:` line naming the model
    and the loader's words, exit 2, no traceback, nothing left running."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    _stand_in_stub(monkeypatch, _NO_LIBPYTHON)
    http, grpc, metrics = free_ports(3)
    r = CliRunner().invoke(main, ["serve", "--repo", str(small_repo), "--http-port", http, "--grpc-port", grpc,
                                  "--metrics-port", metrics, "--log-file", str(tmp_path / "triton.log")])
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (r.exit_code, r.stderr)
    assert errors[0].startswith(f"error: {small_repo}: the model stub of dflash cannot start (pid "), errors
    assert "libpython_gone.so: cannot open shared object file" in errors[0], errors
    assert errors[0].endswith(f"; full log: {tmp_path / 'triton.log'}"), errors
    assert pids_mentioning(str(small_repo)) == []


def _start_refused(srv) -> str:
    """`srv.start()` fails with one line, exit 2 (ModelRefused: the environment, not a bug), and leaves no process,
    work dir or python_env dir behind; the line."""
    from dflash_export.deploy.server import ModelRefused

    envs_before = set(Path("/tmp").glob("python_env_*"))
    with pytest.raises(ModelRefused) as e:
        srv.start()
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg, msg
    assert group_pids(srv._pgid) == [] and srv._workdir is None
    assert set(Path("/tmp").glob("python_env_*")) <= envs_before
    return msg


@pytest.mark.server
def test_a_model_stub_killed_while_loading_is_named_as_out_of_memory(small_repo, monkeypatch):
    """A stub the kernel ends with SIGKILL while its model loads (what the out-of-memory killer does) before it
    reported: exit 2 (the machine has too little memory for the model, as a MemoryError in the load is), one line
    naming the signal, the model, the stub's peak RSS and the memory the machine has."""
    from dflash_export.deploy.server import TritonServer

    # ~60 MB held by the shell (its variable), long enough for the start's checks to see it, then SIGKILL
    _stand_in_stub(monkeypatch, '[ "$#" -eq 0 ] && exit 0\nx=$(head -c 60000000 /dev/zero | tr "\\0" a)\nsleep 1.5\n'
                                'kill -9 $$\n')
    msg = _start_refused(TritonServer(small_repo, *free_ports(3), ready_timeout_s=90))
    found = re.search(r"a model stub was killed by signal 9 while loading dflash \(pid \d+, peak RSS (\d+) MiB\): "
                      r"likely out of memory.*; [\d.]+ [MG]iB of [\d.]+ [MG]iB available now$", msg)
    assert found and int(found.group(1)) >= 50, msg


def _load_hook(monkeypatch, code: str) -> None:
    """Servers started from here on run `code` in each model stub as its interpreter starts (a module the stub
    environment's site-packages imports through a .pth file): a stand-in for what the real load meets."""
    import dflash_export.deploy.triton_process as tp

    made = tp.make_stub_env

    def with_hook(into, stub_site):
        out = made(into, stub_site)
        site_packages = next(into.glob("lib/python*/site-packages"))
        (site_packages / "dflash_test_hook.py").write_text(code)
        (site_packages / "zz_dflash_test_hook.pth").write_text("import dflash_test_hook\n")
        return out

    monkeypatch.setattr(tp, "make_stub_env", with_hook)


@pytest.mark.server
def test_a_model_stub_killed_as_its_model_initializes_is_named_as_out_of_memory(small_repo, monkeypatch):
    """The real stub killed outright (SIGKILL, as by the out-of-memory killer) while its model's initialize runs: the
    python backend fails the load ("Stub process is not healthy") and tritonserver exits; the error says instead how
    the stub ended and that memory likely ran out, exit 2."""
    import dflash_export.deploy.triton_process as tp
    from dflash_export.deploy.server import TritonServer

    _load_hook(monkeypatch, "import time\nimport dflash_export.engines.registry as registry\n"
                            "real = registry.load_engine\n"
                            "registry.load_engine = lambda *a, **k: time.sleep(6) or real(*a, **k)\n")
    srv = TritonServer(small_repo, *free_ports(3), ready_timeout_s=90)
    killed = []

    def kill_the_loading_stub():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            stubs = [p for p in _stubs_of(srv._pgid) if tp.stub_model(p) == "dflash"] if srv._pgid else []
            if stubs:
                time.sleep(3)  # the model's initialize is under way (the hook holds it 6 s)
                os.kill(stubs[0], signal.SIGKILL)
                killed.append(stubs[0])
            time.sleep(0.1)

    thread = threading.Thread(target=kill_the_loading_stub, daemon=True)
    thread.start()
    msg = _start_refused(srv)
    thread.join(timeout=10)
    assert killed, msg
    assert re.search(rf"a model stub was killed by signal 9 while loading dflash \(pid {killed[0]}, peak RSS "
                     r"\d+ MiB\): likely out of memory", msg), msg


@pytest.mark.server
def test_a_model_load_that_runs_out_of_memory_fails_the_start_as_an_environment_error(small_repo, monkeypatch):
    """A MemoryError in the model's load (here numpy's, for an allocation no machine has) is the machine's limit, not
    a bug: exit 2, one line naming the model, that memory ran out and how much the machine has available."""
    from dflash_export.deploy.server import TritonServer

    _load_hook(monkeypatch, "import numpy as np\nimport dflash_export.engines.registry as registry\n"
                            "registry.load_engine = lambda *a, **k: np.empty(1 << 52, dtype=np.uint8)\n")
    msg = _start_refused(TritonServer(small_repo, *free_ports(3), ready_timeout_s=90))
    assert re.search(r"failed to load 'dflash' version 1: out of memory while loading the model \([\d.]+ [MG]iB of "
                     r"[\d.]+ [MG]iB available\): MemoryError: Unable to allocate 4.00 PiB", msg), msg


@pytest.mark.server
def test_a_model_stub_that_never_reports_fails_at_the_ready_timeout_naming_it(small_repo, monkeypatch, capsys):
    """A stub that starts and never reports (a load that hangs) keeps its model loading: the python backend waits on it
    for ever. The start waits `ready_timeout_s` (`serve --ready-timeout`), saying meanwhile and then in one error line
    which model it waits for and what that model's stub is doing."""
    from dflash_export.deploy.server import ServerError, TritonServer

    # The backend first runs the stub without arguments (a check that it starts): that run passes.
    _stand_in_stub(monkeypatch, '[ "$#" -eq 0 ] && exit 0\nsleep 300\n')
    srv = TritonServer(small_repo, *free_ports(3), ready_timeout_s=6, progress_s=2)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        srv.start()
    took, msg = time.monotonic() - t0, str(e.value)
    assert took < 30 and type(e.value) is ServerError and e.value.exit_code == 3 and "\n" not in msg, (took, msg)
    found = re.search(r"not ready after 6 s: loading dflash, model stub pid (\d+) \(dflash\) sleeping, \d+\.\d s CPU "
                      r"in \d+ s \(log: .+\); `serve --ready-timeout` sets the wait", msg)
    assert found, msg
    notes = re.findall(r"waiting for tritonserver to be ready \(\d+ s of 6 s\): loading dflash, model stub pid (\d+) "
                       r"\(dflash\) sleeping", capsys.readouterr().err)
    assert notes and set(notes) == {found.group(1)}, notes
    assert group_pids(srv._pgid) == [] and srv._workdir is None


@pytest.mark.server
def test_a_failed_start_removes_its_own_python_env_dir_and_not_another_servers(small_repo, monkeypatch):
    """The python backend's /tmp/python_env_* dir names no owner. Another `serve` starting while this one fails makes
    its own: this one's failed start must remove only the dir its own server made."""
    import dflash_export.deploy.triton_process as tp
    from dflash_export.deploy.server import ServerError, TritonServer

    _stand_in_stub(monkeypatch, '[ "$#" -eq 0 ] && exit 0\nexit 7\n')
    monkeypatch.setattr(tp, "STUB_ZOMBIE_S", 4.0)  # the start fails 4 s after the stub exited: time for the other
    envs_before = set(Path("/tmp").glob("python_env_*"))
    srv = TritonServer(small_repo, *free_ports(3), ready_timeout_s=90)
    other: list[Path] = []

    def another_server_starts():
        deadline, seen = time.monotonic() + 60, None
        while time.monotonic() < deadline and not other:
            if seen is None and srv._pgid is not None and _stubs_of(srv._pgid):
                seen = time.monotonic()
            if srv._python_envs or (seen is not None and time.monotonic() - seen > 2):
                other.append(Path(tempfile.mkdtemp(prefix="python_env_", dir="/tmp")))
            time.sleep(0.05)

    thread = threading.Thread(target=another_server_starts, daemon=True)
    thread.start()
    try:
        with pytest.raises(ServerError) as e:
            srv.start()
        thread.join(timeout=10)
        assert "a model stub exited while its model loaded" in str(e.value) and "exit code 7" in str(e.value)
        assert other and other[0].is_dir(), "the other server's python_env dir was removed"
        assert set(Path("/tmp").glob("python_env_*")) - envs_before == {other[0]}  # this server's own removed
    finally:
        for d in other:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.server
def test_two_servers_starting_together_each_remove_their_own_python_env_dir(small_repo, monkeypatch):
    """Two `serve`s started at the same moment (here two servers in threads 0.1 s apart, each failing its start when
    its stub exits): each python backend makes its own /tmp/python_env_* dir; each server must tell its own apart
    and remove it, leaving none behind."""
    from dflash_export.deploy.server import ServerError, TritonServer

    _stand_in_stub(monkeypatch, '[ "$#" -eq 0 ] && exit 0\nexit 7\n')
    envs_before = set(Path("/tmp").glob("python_env_*"))
    taken: dict[int, set[str]] = {}
    stop = TritonServer.stop

    def noting_stop(self, *args, **kwargs):  # the dirs each server removes, as it stops
        taken.setdefault(id(self), set()).update(self._python_envs)
        return stop(self, *args, **kwargs)

    monkeypatch.setattr(TritonServer, "stop", noting_stop)
    servers = [TritonServer(small_repo, *free_ports(3), ready_timeout_s=90) for _ in range(2)]
    errors: list[BaseException] = []

    def start(srv):
        try:
            srv.start()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(srv,), daemon=True) for srv in servers]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=120)
    assert len(errors) == 2 and all(type(e) is ServerError and "exit code 7" in str(e) for e in errors), errors
    mine = [taken.get(id(srv), set()) for srv in servers]
    assert all(len(dirs) == 1 for dirs in mine) and mine[0] != mine[1], mine
    assert not any(Path(d).exists() for dirs in mine for d in dirs)
    assert set(Path("/tmp").glob("python_env_*")) <= envs_before
    assert all(group_pids(srv._pgid) == [] and srv._workdir is None for srv in servers)


def test_the_python_env_lock_is_one_holder_at_a_time(tmp_path, monkeypatch):
    """The turn two starting servers take: a second holder waits while the first holds it (not past its wait), has it
    once the first lets go; a lock file that is a link (someone else's trap in /tmp) is never opened."""
    import dflash_export.deploy.triton_process as tp

    monkeypatch.setattr(tp, "PYTHON_ENV_ROOT", tmp_path)
    first = tp.lock_python_env_turn(0)
    assert first is not None
    t0 = time.monotonic()
    assert tp.lock_python_env_turn(0.3) is None and time.monotonic() - t0 >= 0.3
    threading.Timer(0.3, os.close, (first,)).start()
    second = tp.lock_python_env_turn(10)
    assert second is not None and time.monotonic() - t0 < 5
    os.close(second)
    tp.python_env_lock_path().unlink()
    tp.python_env_lock_path().symlink_to(tmp_path / "elsewhere")
    assert tp.lock_python_env_turn(0) is None and not (tmp_path / "elsewhere").exists()


def test_the_python_env_dir_taken_is_the_one_this_server_made(tmp_path, monkeypatch):
    """Which python_env dir `stop` removes: one made since this server started, once a stub of this server shows the
    backend has made its own, while tritonserver still runs (it removes its dir as it exits), and only when it is the
    only such dir; never one made before, after, or beside another one made at the same time."""
    import dflash_export.deploy.triton_process as tp

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tp, "PYTHON_ENV_ROOT", root)
    for name in ("tritonserver", "triton_python_backend_stub"):  # stand-ins: what /proc shows is their name
        shutil.copy(shutil.which("sleep"), tmp_path / name)

    def env_dir() -> str:
        return tempfile.mkdtemp(prefix="python_env_", dir=root)

    def server_from(pgid: int) -> "tp.TritonServer":
        srv = tp.TritonServer(tmp_path)
        srv._pgid, srv._envs_before = pgid, tp._python_env_dirs()
        return srv

    before = env_dir()
    server = subprocess.Popen([tmp_path / "tritonserver", "60"], process_group=0)
    procs = [server]
    try:
        srv = server_from(server.pid)
        ours = env_dir()
        srv._claim_python_env()
        assert srv._python_envs == set()  # no stub yet: the dir may be another server's
        procs.append(subprocess.Popen([tmp_path / "triton_python_backend_stub", "60"], process_group=server.pid))
        srv._claim_python_env()
        assert srv._python_envs == {ours}
        after = env_dir()
        srv._claim_python_env()
        assert srv._python_envs == {ours}

        both = server_from(server.pid)
        same_moment = {env_dir(), env_dir()}
        both._claim_python_env()
        assert both._python_envs == set()

        gone = server_from(server.pid)
        server.kill()
        server.wait()
        new_one = env_dir()
        gone._claim_python_env()
        assert gone._python_envs == set()  # tritonserver gone: the one made since may be another's
        srv.stop()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not Path(ours).exists()
    assert all(Path(d).is_dir() for d in (before, after, *same_moment, new_one))


def test_serve_ready_timeout_reaches_the_server_and_is_checked(small_repo, monkeypatch):
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.deploy import server

    got = {}
    monkeypatch.setattr(server, "serve", lambda *a, **k: got.update(k) or 0)
    r = CliRunner().invoke(main, ["serve", "--repo", str(small_repo), "--ready-timeout", "45"])
    assert r.exit_code == 0 and got["ready_timeout_s"] == 45.0, r.output
    r = CliRunner().invoke(main, ["serve", "--repo", str(small_repo), "--ready-timeout", "0"])
    assert r.exit_code == 2 and "--ready-timeout" in r.output, r.output


def test_serve_bounds_the_front_s_calls_to_tritonserver_as_told_or_by_what_the_models_hold(small_repo, monkeypatch):
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.deploy import server

    got = {}
    monkeypatch.setattr(server, "serve", lambda *a, **k: got.update(k) or 0)

    def upstream_calls() -> int:  # the bound `serve` starts the front with, the repository's where none was given
        return server._check_serve_args(small_repo, free_ports(1)[0], None, None, "127.0.0.1", None, got["limits"],
                                        30.0)[3].max_upstream_calls

    r = CliRunner().invoke(main, ["serve", "--repo", str(small_repo), "--max-upstream-calls", "7"])
    assert r.exit_code == 0 and upstream_calls() == 7, r.output
    r = CliRunner().invoke(main, ["serve", "--repo", str(small_repo)])
    assert r.exit_code == 0 and upstream_calls() == 256, r.output  # 1 model x (1 + 64), at least 256
    r = CliRunner().invoke(main, ["serve", "--repo", str(small_repo), "--max-upstream-calls", "0"])
    assert r.exit_code == 2 and "--max-upstream-calls" in r.output, r.output


@pytest.mark.parametrize("given", ["--repo", "--engine"])
def test_serve_hashes_the_repository_s_engine_once_per_start(tmp_path, engine_dir, monkeypatch, given):
    """`serve` checks the repository (every engine file hashed against its manifest) once before it starts, not once
    in the command and again in the server: each file is read for its hash one time. With --engine, the start that
    reuses the repository cached by the one before is counted."""
    from collections import Counter

    from click.testing import CliRunner

    from dflash_export import files
    from dflash_export.cli import main
    from dflash_export.deploy import repository, server, triton_process
    from dflash_export.engines import manifest
    from dflash_export.errors import MissingDependency

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(repository, "_held_locks", [])
    args = ["serve", given, str(engine_dir), "--max-batch", "1", "--port", str(free_ports(1)[0])]
    if given == "--repo":
        args[2] = str(write_repository(engine_dir, tmp_path / "repo", decoupled=False))
    hashed: Counter = Counter()

    def counted(path, *a, **k):
        hashed[Path(path)] += 1
        return files.sha256_file(path, *a, **k)

    def missing():  # the start stops here, after the checks
        raise MissingDependency("no tritonserver here", field="nvidia-pytriton")

    monkeypatch.setattr(server, "find_triton", missing)
    monkeypatch.setattr(triton_process, "find_triton", missing)
    if given == "--engine":  # the first start writes the repository the second reuses
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "no tritonserver here" in r.output, r.output
    for module in (manifest, repository):
        monkeypatch.setattr(module, "sha256_file", counted)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "no tritonserver here" in r.output, r.output
    repo = Path(args[2]) if given == "--repo" else next((tmp_path / "cache" / "repos").iterdir())
    engine = repo / "dflash" / "engine"
    engine_files = set(json.loads((engine / "manifest.json").read_text())["files"]) | {"manifest.json"}
    assert len(engine_files) > 1, "an engine with files to hash"
    assert {p.relative_to(engine).as_posix() for p in hashed if p.is_relative_to(engine)} == engine_files, hashed
    # each file once, and no other: the repository's copy is what is served (the engine given was checked when the
    # repository was written from it)
    assert set(hashed.values()) == {1} and all(p.is_relative_to(engine) for p in hashed), hashed
    for held in repository._held_locks:
        held.close()


def test_find_triton_refuses_a_binary_it_cannot_run(tmp_path, monkeypatch):
    """A tritonserver file without execute permission fails `serve`'s checks (exit 2), not its start."""
    import importlib.util
    import types

    from dflash_export.deploy.triton_install import find_triton
    from dflash_export.errors import MissingDependency

    root = tmp_path / "pytriton"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for rel, mode in (("tritonserver/bin/tritonserver", 0o644), ("tritonserver/backends/python/libtriton_python.so",
                      0o644), (f"tritonserver/python_backend_stubs/{version}/triton_python_backend_stub", 0o755)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
        (root / rel).chmod(mode)
    spec = types.SimpleNamespace(submodule_search_locations=[str(root)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "pytriton" else None)
    with pytest.raises(MissingDependency) as e:
        find_triton()
    assert e.value.exit_code == 2 and "not executable" in str(e.value), str(e.value)
    assert str(root / "tritonserver" / "bin" / "tritonserver") in str(e.value)
    (root / "tritonserver" / "bin" / "tritonserver").chmod(0o755)
    assert find_triton().binary == root / "tritonserver" / "bin" / "tritonserver"


@pytest.mark.server
@pytest.mark.parametrize("arg, named", [
    ("--no-such-option=1", "tritonserver: unrecognized option '--no-such-option=1'"),
    ("--log-info=perhaps", 'Bad option: "--log-info". invalid value for bool option: perhaps'),
    ("--http-thread-count=many", 'Bad option: "--http-thread-count". Invalid option value. Got many'),
])
def test_server_refusing_its_command_line_names_the_option(tmp_path, small_repo, arg, named):
    """tritonserver prints 402 lines of usage around the line naming a rejected option (before the usage for an
    unknown option, after it for a bad value); the death message must carry that line, not a line of the usage."""
    from dflash_export.deploy.server import ServerError, TritonServer

    srv = TritonServer(small_repo, *free_ports(3), extra_args=[arg], ready_timeout_s=60)
    with pytest.raises(ServerError) as e:
        srv.start()
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert srv._run_lines > 400  # the usage text did overflow the tail


@pytest.mark.server
@pytest.mark.parametrize("plain", [False, True])
def test_serve_cli_prints_urls_and_stops_cleanly_on_sigterm(tmp_path, engine_dir, plain):
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False, plain=plain)
    http, grpc, metrics = free_ports(3)
    with serve_until_sigterm(repo, http, grpc, metrics) as proc:
        model = proc.stdout.readline()  # the line after ready: says what decodes
        assert model.startswith("  model: ") and model.rstrip().endswith(
            "plain decoding (--plain)" if plain else "DFlash decoding"), model
        status, body = post_json(f"http://127.0.0.1:{http}/v2/models/dflash/generate",
                                 {"text_input": "hi", "max_tokens": 2})
        assert status == 200 and body["completion_tokens"] == 2


@pytest.mark.server
def test_a_repository_deployed_without_input_ids_refuses_token_id_prompts_in_the_front(tmp_path, small_repo):
    """`serve --repo` on a repository deployed before token-id prompts existed (its config.pbtxt declares no
    input_ids): a completion prompt of token ids gets the front's one 400 naming `prompt` (never tritonserver's
    own), a text prompt is answered, and the server stops cleanly."""
    repo = drop_input(small_repo, "input_ids")
    http, grpc, metrics = free_ports(3)
    with serve_until_sigterm(repo, http, grpc, metrics, 180):
        url = f"http://127.0.0.1:{http}"
        status, body = post_json(f"{url}/v1/completions", {"model": "tiny-qwen3", "prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == "prompt", body
        assert body["error"]["message"].startswith("prompt: this model repository was deployed without token-id "
                                                   "input (input_ids); redeploy it with `dflash-export deploy`"), body
        status, body = post_json(f"{url}/v2/models/dflash/generate", {"input_ids": [1, 2, 3], "max_tokens": 2})
        assert status == 400 and body["error"].startswith("input_ids: this model repository was deployed"), body
        status, body = post_json(f"{url}/v1/completions", {"model": "tiny-qwen3", "prompt": "Hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body


@pytest.mark.server
def test_max_queue_size_rejects_overflow_and_keeps_serving(tmp_path, engine_dir):
    from dflash_export.deploy.server import TritonServer

    repo = write_repository(engine_dir, tmp_path / "repo", instances=1, max_queue_size=1, decoupled=False)
    with TritonServer(repo, *free_ports(3), ready_timeout_s=120) as srv:
        url = f"{srv.http_url}/v2/models/dflash/generate"
        results: list = []
        barrier = threading.Barrier(8)

        def go():
            barrier.wait()
            results.append(post_json(url, {"text_input": "queue", "max_tokens": 400}))

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        codes = sorted(code for code, _ in results)
        assert codes.count(200) >= 1 and any(code == 503 and "queue" in body["error"] for code, body in results)
        assert post_json(url, {"text_input": "after", "max_tokens": 2})[0] == 200
    assert pids_mentioning(str(repo)) == []


def test_serve_refuses_bad_host_and_ports_before_starting(small_repo):
    from dflash_export.deploy.server import serve

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    a, b, c = free_ports(3)
    cases = [
        (dict(http_port=a, grpc_port=a, metrics_port=c, grpc=True), "--grpc-port: "),
        (dict(http_port=a, grpc_port=b, metrics_port=a), "--metrics-port: "),
        (dict(http_port=0, grpc_port=b, metrics_port=c), "--port: must be in 1..65535"),
        (dict(http_port=a, grpc_port=70000, metrics_port=c, grpc=True), "--grpc-port: must be in 1..65535"),
        (dict(http_port=busy, grpc_port=b, metrics_port=c),
         f"--port: port {busy} is already in use on 127.0.0.1: give a free one"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="999.1.1.1"), "--host: not a valid IPv4 address"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="::1"), "--host: "),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="no-such-host.invalid"), "--host: cannot resolve"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="192.0.2.1"), "--host: 192.0.2.1 is not an address"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, ready_timeout_s=0), "--ready-timeout: must be > 0"),
    ]
    try:
        for kwargs, msg in cases:
            with pytest.raises(DFlashError) as e:
                serve(small_repo, **kwargs)
            assert msg in str(e.value) and e.value.exit_code == 2, (kwargs, str(e.value))
    finally:
        held.close()
    assert pids_mentioning(str(small_repo)) == []


@pytest.mark.parametrize("name", ["", "two words", "line\nbreak", "-dash-first", "x" * 129, "naïve"])
def test_serve_refuses_a_model_name_clients_could_not_send_back(small_repo, name):
    from dflash_export.deploy.server import serve

    with socket.socket() as held, pytest.raises(DFlashError, match="--model-name: expected letters") as e:
        held.bind(("127.0.0.1", 0))  # checked before the ports: a name let through would stop at this busy one
        held.listen()
        serve(small_repo, http_port=held.getsockname()[1], model_id=name)
    assert e.value.exit_code == 2
    assert pids_mentioning(str(small_repo)) == []


def test_serve_without_tritonserver_is_one_line_and_leaves_no_log(tmp_path, small_repo, monkeypatch):
    from dflash_export.deploy import server
    from dflash_export.errors import MissingDependency

    def missing():
        raise MissingDependency("the tritonserver binary comes with nvidia-pytriton", field="nvidia-pytriton")

    from dflash_export.deploy import triton_process

    monkeypatch.setattr(server, "find_triton", missing)
    monkeypatch.setattr(triton_process, "find_triton", missing)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(MissingDependency, match="nvidia-pytriton"):
        server.serve(small_repo, http_port=free_ports(1)[0])
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.server
def test_a_log_file_that_is_a_fifo_no_process_reads_is_one_line_not_a_hang(tmp_path, small_repo, monkeypatch):
    from dflash_export.deploy import server

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    os.mkfifo(tmp_path / "log")
    port = free_ports(1)[0]
    start = time.monotonic()
    with pytest.raises(DFlashError) as e:
        server.serve(small_repo, http_port=port, log_path=tmp_path / "log")
    assert time.monotonic() - start < 30
    assert str(e.value).startswith(f"{tmp_path / 'log'}: --log-file: cannot write the server log (a FIFO no process "
                                   "reads") and e.value.exit_code == 2, str(e.value)
    assert list((tmp_path / "tmp").iterdir()) == [] and pids_mentioning(str(small_repo)) == []
    with socket.socket() as s:  # the front it had started is closed
        s.bind(("127.0.0.1", port))


@pytest.mark.server
def test_a_log_file_named_through_dev_fd_is_written_there_not_at_the_pipe_s_name(small_repo):
    """`--log-file /dev/stderr` or a shell's `>(...)` (/dev/fd/N): the path is kept as given, never resolved to
    /proc/<pid>/fd/pipe:[...], which names no file."""
    from dflash_export.deploy.server import _check_serve_args

    r, w = os.pipe()
    try:
        *_, log_path = _check_serve_args(small_repo, free_ports(1)[0], None, None, "127.0.0.1", f"/dev/fd/{w}", None,
                                         30.0)
        assert log_path == Path(f"/dev/fd/{w}")
        with open(log_path, "w") as f:
            f.write("x\n")
        assert os.read(r, 2) == b"x\n"
    finally:
        os.close(r)
        os.close(w)


def test_the_model_stub_writes_no_bytecode_into_the_repository(tmp_path):
    from dflash_export.deploy.server import make_stub_env

    make_stub_env(tmp_path / "env", None)
    pth = next((tmp_path / "env").glob("lib/python*/site-packages/dflash_serving.pth")).read_text()
    assert pth.splitlines()[-1] == "import sys; sys.dont_write_bytecode = True"


@pytest.mark.server
def test_files_changed_after_the_check_are_not_what_tritonserver_loads(tmp_path, engine_dir, direct):
    """`serve` checks the repository, then starts tritonserver: a model.py swapped in between is never imported (a
    planted one would write a file), and a config.pbtxt changed in between is refused, not loaded."""
    import tritonclient.http as th

    from dflash_export.deploy.repository import check_repository
    from dflash_export.deploy.server import TritonServer

    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    check_repository(repo)
    planted = tmp_path / "planted-model-ran"
    model_py = repo / "dflash" / "1" / "model.py"
    model_py.write_text(f"open({str(planted)!r}, 'w').close()\n" + model_py.read_text())
    srv = TritonServer(repo, *free_ports(3), ready_timeout_s=240)
    try:
        srv.start()
        client = th.InferenceServerClient(srv.http_url.removeprefix("http://"), network_timeout=120)
        served = infer(client, b"Hello", max_tokens=(16, "INT64"))
        assert served == as_dict(run_direct(direct, text_input=b"Hello", max_tokens=np.array([16], np.int32)))
    finally:
        srv.stop()
    assert not planted.exists()

    cfg = repo / "dflash" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('string_value: "engine"', f'string_value: "{engine_dir}"'))
    srv = TritonServer(repo, *free_ports(3), ready_timeout_s=240)
    with pytest.raises(DFlashError) as e:
        srv.start()
    assert "config.pbtxt: parameters.engine_dir: must name the repository's own engine" in str(e.value)
    assert srv.proc is None and pids_mentioning(str(repo)) == []


def test_serve_cli_names_the_port_option_the_docs_use_when_it_is_busy(small_repo):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        r = cli("serve", "--repo", small_repo, "--port", busy)
    assert_one_line(r, f"--port: port {busy} is already in use on 127.0.0.1: give a free one")
    assert pids_mentioning(str(small_repo)) == []


def test_serve_cli_names_the_option_an_engine_or_a_repository_given_to_the_other_one_needs(small_repo):
    engine = small_repo.parent / "engine"  # the fixture's engine, beside its repository
    assert (engine / "manifest.json").is_file()
    assert_one_line(cli("serve", "--repo", engine), "--repo: a built engine, not a model repository: serve it with "
                                                    "--engine")
    assert_one_line(cli("serve", "--engine", small_repo), "--engine: a model repository written by `deploy`, not an "
                                                          "engine: serve it with --repo")
    assert pids_mentioning(str(small_repo)) == []


def test_serve_cli_refuses_a_directory_deploy_did_not_write(tmp_path):
    (tmp_path / "empty").mkdir()
    r = cli("serve", "--repo", tmp_path / "empty")
    assert_one_line(r, f"{tmp_path / 'empty'}: --repo: not a model repository")
    r = cli("serve", "--repo", tmp_path / "empty", "--http-port", 18000, "--grpc-port", 18000, "--metrics-port", 18000)
    assert_one_line(r)  # the repository is checked first; either way one line, nothing started
    assert pids_mentioning(str(tmp_path / "empty")) == []


def test_the_server_log_is_kept_under_its_size_cap_with_the_previous_one_beside_it(tmp_path):
    """tritonserver's output as the server's reader writes it to the log: 2 MB of lines through a 64 KiB cap leave
    the log and `<log>.1`, each at most the cap (plus the line that reached it), owner-only, holding together the last
    lines written, in order."""
    import types

    from dflash_export.deploy.server import TritonServer

    log = tmp_path / "triton.log"
    srv = TritonServer(tmp_path, log_path=log, log_max_bytes=64 << 10)
    lines = [f"dflash-cancel: the client went away; noticed {i} ms after it, mid-generation, last step 5 ms, 1 step "
             f"after it\n" for i in range(20_000)]
    with srv._log_lock:
        srv._open_log(append=False)
    srv.proc = types.SimpleNamespace(stdout=iter(lines))
    srv._pump()
    srv.proc = None  # its output ended: stop() closes the log
    srv.stop()
    longest = max(len(line) for line in lines)
    kept = []
    for path in (tmp_path / "triton.log.1", log):
        assert path.stat().st_size <= (64 << 10) + longest and path.stat().st_mode & 0o077 == 0
        kept += path.read_text().splitlines(keepends=True)
    assert sorted(os.listdir(tmp_path)) == ["triton.log", "triton.log.1"]
    assert len(kept) > 500 and kept == lines[-len(kept):]


def test_a_log_that_is_a_pipe_is_never_renamed_away_at_its_size_cap(tmp_path):
    """A FIFO (or a pipe or terminal named through /dev/stderr): renaming it to `<log>.1` and creating a regular file
    in its place would cut off the process reading it (and, as root, move /dev/stderr itself)."""
    import stat
    import types

    from dflash_export.deploy.server import TritonServer

    log = tmp_path / "fifo"
    os.mkfifo(log)
    # the reading end open before the log opens the FIFO (without a reader its non-blocking open fails, as it
    # should); read in a thread once the writer is there, to the end of what it writes
    rfd = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(rfd, True)
    got = []
    srv = TritonServer(tmp_path, log_path=log, log_max_bytes=1 << 10)
    lines = [f"line {i} of tritonserver's output\n" for i in range(500)]
    with srv._log_lock:
        srv._open_log(append=False)
    reader = threading.Thread(target=lambda: got.append(os.fdopen(rfd, "rb").read()), daemon=True)
    reader.start()
    srv.proc = types.SimpleNamespace(stdout=iter(lines))
    srv._pump()
    srv.proc = None
    srv.stop()
    reader.join(30)
    assert sorted(os.listdir(tmp_path)) == ["fifo"] and stat.S_ISFIFO(os.lstat(log).st_mode)
    assert got == ["".join(lines).encode()]


@pytest.mark.server
def test_a_log_file_named_through_a_link_is_rotated_where_the_link_points(tmp_path, small_repo):
    """`--log-file` a symbolic link to a file: the log is that file, so rotation renames it and leaves the link."""
    from dflash_export.deploy.server import _check_serve_args

    (tmp_path / "logs").mkdir()
    (tmp_path / "log").symlink_to(tmp_path / "logs" / "serve.log")
    *_, log_path = _check_serve_args(small_repo, free_ports(1)[0], None, None, "127.0.0.1", tmp_path / "log", None,
                                     30.0)
    assert log_path == tmp_path / "logs" / "serve.log"


def test_a_stop_ends_tritonserver_once_only_what_dead_stubs_stranded_holds_it(tmp_path):
    """tritonserver's exit waits for every open HTTP connection, and for every model version to unload; requests in
    flight on a stub that died, and the version it left, never end. Once the front is closed and its exit log counts
    no more than those (its own lines, as 2.x writes them each second), the stop need not wait out its timeout."""
    from dflash_export.deploy.server import TritonServer

    srv = TritonServer(tmp_path, log_path=tmp_path / "triton.log")
    srv._stranded_calls, srv.front = 11, None
    srv._log.extend(["Signal (15) received.\n",
                     'I1207 20:40:17.3 28841 http_server.cc:248] "Timeout 30: Found 11 HTTP service connections"\n'])
    assert srv._only_stranded_left()
    srv._log.append('I1207 20:40:18.3 28841 http_server.cc:248] "Timeout 29: Found 12 HTTP service connections"\n')
    assert not srv._only_stranded_left()  # one more than the dead stubs held: a live request
    srv.front = object()
    srv._log.append('I1207 20:40:19.3 28841 http_server.cc:248] "Timeout 28: Found 3 HTTP service connections"\n')
    assert not srv._only_stranded_left()  # the front still open: connections of its own may be among them
    srv._stranded, srv.front = 1, None
    srv._log.append('I1207 20:40:20.3 28841 server.cc:1] "Timeout 27: Found 1 live models and 0 in-flight '
                    'non-inference requests"\n')
    assert srv._only_stranded_left()


def test_server_death_is_one_line_with_the_log_path(tmp_path):
    """The message a dead server gives: the first telling log line, shortened, and where the full log is; a model
    refusing its input (DFlashError at load) is exit 2, anything else exit 1."""
    from dflash_export.deploy.server import ModelRefused, ServerError, TritonServer

    srv = TritonServer(tmp_path, log_path=tmp_path / "triton.log")

    class Done:
        returncode = 1

    srv.proc = Done()
    prefix = "E1130 07:37:27.791032 21828 model_lifecycle.cc:642] "
    srv._log.extend([
        "I1130 07:37:26.000000 21828 server.cc:1] starting\n",
        'E1130 07:37:27.011144 21828 server.cc:241] "CudaDriverHelper has not been initialized."\n',
        prefix + "\"failed to load 'dflash' version 1: Internal: DFlashError: /r/manifest.json: max_seq_len: "
                 "disagrees" + "x" * 400 + "\\n\\nAt:\\n  trace\"\n",
        prefix + "\"failed to load 'dflash_stream' version 1: Internal: DFlashError: later\"\n",
    ])
    e = srv._death_error()
    assert isinstance(e, ModelRefused) and e.exit_code == 2
    msg = str(e)
    assert msg.startswith(f"{tmp_path}: tritonserver exited (code 1: failed to load 'dflash' version 1: /r/manifest")
    assert msg.endswith(f"); full log: {tmp_path / 'triton.log'}") and "\n" not in msg
    assert len(msg.split(" (", 1)[1].split("); full log")[0]) <= 250  # shortened
    assert "DFlashError" not in msg and "At:" not in msg and "later" not in msg
    srv._log.clear()
    srv._log.extend(['E1130 07:37:27.1 1 server.cc:1] "failed to start HTTP service: address in use"\n'])
    e = srv._death_error()
    assert type(e) is ServerError and e.exit_code == 3 and "failed to start HTTP service" in str(e)
    # killed by a signal with no error in its log: the signal named, not whatever line the log happened to end on
    srv._log.clear()
    srv._log.extend(["I1130 07:37:26.0 1 server.cc:1] starting\n", "dflash-cancel: the client went away\n"])
    Done.returncode = -9
    e = srv._death_error()
    assert type(e) is ServerError and "tritonserver exited (signal 9, SIGKILL; no error in its log)" in str(e)
    assert "dflash-cancel" not in str(e)


def test_a_model_load_the_environment_fails_is_an_input_error_and_a_bug_is_not(tmp_path, monkeypatch):
    """What the model's initialize raises, as the python backend reports it ("<class name>: <message>") and `serve`
    reads the name: the environment to blame (a library that differs from the deployed one, a file it cannot read, an
    optional library it cannot import, the project itself) is MissingDependency / DFlashError, exit 2, the model's
    own line; anything else is raised as it is: a bug, exit 3."""
    from importlib import metadata

    from dflash_export.deploy.server import ModelRefused, ServerError, TritonServer
    from dflash_export.errors import MissingDependency

    model_py = model_triton_py(monkeypatch)
    with pytest.raises(MissingDependency, match="onnxruntime .* loaded, but the repository was deployed with "
                                                "onnxruntime 0.0.1"):
        model_py._check_versions({"onnxruntime": "0.0.1"})
    with pytest.raises(MissingDependency, match="no-such-dist 1.0 was recorded at deploy time but is not importable"):
        model_py._check_versions({"no-such-dist": "1.0"})
    if not metadata.version("numpy").startswith("0.1"):  # this numpy is not the stub's marked one
        with pytest.raises(MissingDependency, match="start the server with `dflash-export serve`"):
            model_py._check_versions({"numpy": "0.1"})

    def load_fails_with(exc):
        model = model_py.TritonPythonModel()
        monkeypatch.setattr(model, "_initialize", lambda args: (_ for _ in ()).throw(exc))
        with pytest.raises(Exception) as e:
            model.initialize({})
        return e.value

    unreadable = tmp_path / "engine" / "target.onnx"
    e = load_fails_with(PermissionError(13, "Permission denied", str(unreadable)))
    assert type(e).__name__ == "DFlashError" and str(e) == f"{unreadable}: cannot read it (Permission denied)"
    e = load_fails_with(ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime"))
    assert type(e) is MissingDependency and "pip install 'dflash-export[runtime]'" in str(e), str(e)
    e = load_fails_with(ModuleNotFoundError("No module named 'dflash_export'", name="dflash_export"))
    assert type(e) is MissingDependency and "the project is not importable in the model stub" in str(e), str(e)
    for bug in (ValueError("a bug"), ModuleNotFoundError("x", name="not_a_library_of_ours"),
                ImportError("cannot import name 'gone'", name="dflash_export.runtime.single")):
        assert load_fails_with(bug) is bug
    # an allocation that failed: numpy's MemoryError, a C++ std::bad_alloc (pybind11 makes it a MemoryError), ONNX
    # Runtime's own message, an OSError ENOMEM: the machine's memory, one line saying so and how much is available
    for oom, what in ((MemoryError("Unable to allocate 8.00 GiB for an array"), "MemoryError: Unable to allocate"),
                      (MemoryError("std::bad_alloc"), "MemoryError: std::bad_alloc"),
                      (RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for "
                                    "requested buffer of size 123"), "RuntimeError: [ONNXRuntimeError]"),
                      (OSError(12, "Cannot allocate memory"), "[Errno 12] Cannot allocate memory")):
        e = load_fails_with(oom)
        assert type(e) is MissingDependency and "\n" not in str(e), str(e)
        assert re.match(r"out of memory while loading the model \([\d.]+ [MG]iB of [\d.]+ [MG]iB available\): ",
                        str(e)) and what in str(e), str(e)

    srv = TritonServer(tmp_path)

    class Done:
        returncode = 1

    srv.proc = Done()
    for kind, cls, code in (("MissingDependency", ModelRefused, 2), ("DFlashError", ModelRefused, 2),
                            ("RuntimeError", ServerError, 3)):
        srv._log.clear()
        srv._log.append("E1130 07:37:27.791032 21828 model_lifecycle.cc:642] \"failed to load 'dflash' version 1: "
                        f"Internal: {kind}: numpy 1.26.4, deployed with 2.4.6\\n\\nAt:\\n  trace\"\n")
        e = srv._death_error()
        assert type(e) is cls and e.exit_code == code, (kind, str(e))
        assert ("failed to load 'dflash' version 1: numpy 1.26.4" in str(e)) == (code == 2), str(e)


@pytest.mark.server
def test_a_model_stub_whose_environment_is_wrong_fails_the_start_as_an_input_error(tmp_path, small_repo,
                                                                                   monkeypatch):
    """A model that cannot load in its stub's environment (here: a numpy neither the deployed one nor from the
    directory `serve` marks for the stub) fails the start with the model's own line, exit 2 like a refused input."""
    import dflash_export.deploy.triton_process as tp
    from dflash_export.deploy.server import STUB_MARKER, ModelRefused, TritonServer, ensure_stub_site

    site = ensure_stub_site()
    if site is None:
        pytest.skip("numpy < 2 here: the stub imports this environment's own numpy")

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    unmarked = tmp_path / "stub-site"
    shutil.copytree(site, unmarked, copy_function=link, ignore=shutil.ignore_patterns(STUB_MARKER))
    monkeypatch.setattr(tp, "ensure_stub_site", lambda: unmarked)
    srv = TritonServer(small_repo, *free_ports(3), ready_timeout_s=90)
    with pytest.raises(ModelRefused) as e:
        srv.start()
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg, msg
    assert "failed to load 'dflash' version 1: numpy 1." in msg and "Error:" not in msg, msg
    assert group_pids(srv._pgid) == [] and srv._workdir is None


def test_server_child_dies_with_its_parent_even_on_sigkill(tmp_path):
    """`serve` starts tritonserver in its own session; the kernel must still stop it when the CLI is killed."""
    code = ("import subprocess, sys, time\n"
            "from dflash_export.deploy.triton_process import _die_with_parent\n"
            "p = subprocess.Popen(['sleep', '300'], start_new_session=True, preexec_fn=_die_with_parent())\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(parent.stdout.readline())
    try:
        os.kill(child, 0)  # running
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{child}").exists() and \
                Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.05)
        alive = Path(f"/proc/{child}").exists() and \
            Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive, "the child outlived its SIGKILLed parent"
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.server
def test_serve_model_refusing_its_engine_is_one_line_exit_2(tmp_path, engine_dir):
    """A manifest edited to disagree with its graphs passes every pre-check but the model's own load: the server
    exits, and `serve` says why in one line, names the full log, and leaves nothing running."""
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    m = repo / "dflash" / "engine" / "manifest.json"
    manifest = json.loads(m.read_text())
    if manifest["backend"] != "onnxruntime":
        pytest.skip("needs the ONNX Runtime engine (graph metadata)")
    edit_manifest(repo / "dflash" / "engine", max_seq_len=manifest["max_seq_len"] // 2)
    marker = json.loads((repo / MARKER).read_text())  # as deploy would record an engine built this way
    marker["engine_manifest_sha256"] = hashlib.sha256(m.read_bytes()).hexdigest()
    (repo / MARKER).write_text(json.dumps(marker))
    log = tmp_path / "triton.log"
    r = cli("serve", "--repo", repo, "--log-file", log, *sum(([f"--{n}-port", p] for n, p in
                                                             zip(("http", "grpc", "metrics"), free_ports(3))), []))
    assert_one_line(r, f"error: {repo}: tritonserver exited (", "max_seq_len", f"; full log: {log}")
    assert "failed to load 'dflash'" in log.read_text()
    assert pids_mentioning(str(repo)) == []


@pytest.mark.server
def test_serve_cli_killed_outright_takes_the_server_with_it(tmp_path, engine_dir):
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    http, grpc, metrics = free_ports(3)
    proc = serve_cli(repo, http, grpc, metrics)
    try:
        line = ready_line(proc)
        assert line.startswith("ready:"), line
        assert pids_mentioning(str(repo)) != []
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pids_mentioning(str(repo)):
        time.sleep(0.2)
    assert pids_mentioning(str(repo)) == [], "tritonserver outlived the killed serve"


@pytest.mark.server
@pytest.mark.parametrize("body, status, named", [
    (b'{"text_input": "' + b"x" * 6_000_000 + b'"}', 413, "the limit is 1048576 (--max-request-bytes)"),
    (b"[" * 100_000, 400, "request body: JSON nested deeper than 32 levels (the limit, --max-json-depth)"),
    (b'{"text_input": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested deeper than 32"),
    (b'{"text_input": "hi", ', 400, "request body: not valid JSON"),
    (b'{"text_input": "\xff\xfe"}', 400, "request body: not UTF-8 (byte 0xff"),
], ids=["6MB", "100k-nested", "nested-field", "invalid-json", "invalid-utf8"])
def test_hostile_bodies_are_refused_before_tritonserver_parses_them(server, body, status, named):
    got, resp = post_raw(f"{server.http_url}/v2/models/dflash/generate", body)
    assert got == status and named in resp["error"], (got, resp)
    assert server.alive(), "tritonserver died"
    assert post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "ok", "max_tokens": 2})[0] == 200


@pytest.mark.server
@pytest.mark.parametrize("body, named", [
    ({"text_input": "hi", "max_tokens": 4294967304}, "max_tokens: prompt (2 tokens) + 4294967304 new tokens"),
    ({"text_input": "hi", "max_tokens": 2 ** 31}, "max_tokens: prompt (2 tokens) + 2147483648 new tokens"),
    ({"text_input": "hi", "max_tokens": 2 ** 63}, "max_tokens: must be in 1..9223372036854775807"),
    ({"text_input": 123}, "text_input: expected a string, got an integer"),
    ({"text_input": "hi", "max_tokens": "8"}, "max_tokens: expected an integer, got a string"),
    ({"text_input": "hi", "max_tokens": 8.0}, "max_tokens: expected an integer, got a number"),
    ({"text_input": "hi", "temperature": "hot"}, "temperature: expected a number"),
    ({"text_input": "hi", "seed": -1}, "seed: must be in 0..18446744073709551615, got -1"),
    ({"text_input": "hi", "seed": 2 ** 64}, "seed: must be in 0..18446744073709551615"),
    ({"text_input": "hi", "max_tokns": 8}, "max_tokns: unknown field"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages: expected a list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages: item 0: unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages: item 0: unknown key 'name'"),
    ({"messages": json.dumps([{"role": "root", "content": "hi"}])}, "messages: item 0: unknown role 'root'"),
    ({"text_input": "a\ud800b"}, "text_input: lone surrogate \\ud800 at character 1"),
    ({"text_input": "hi", "stop": [1]}, "stop: expected a string or a list of strings"),
    ([{"text_input": "hi"}], "request body: expected a JSON object"),
])
def test_request_fields_are_type_and_range_checked_400_naming_the_field(server, body, named):
    status, resp = post_json(f"{server.http_url}/v2/models/dflash/generate", body)
    assert status == 400 and resp["error"].startswith(named.split(":")[0] + ":") and named in resp["error"], resp
    status, resp = post_json(f"{server.http_url}/v2/models/dflash_stream/generate_stream", body)
    assert status == 400 and named in (resp["error"] if isinstance(resp, dict) else resp), (status, resp)


@pytest.mark.server
def test_messages_as_a_json_list_equal_messages_as_json_text(server, direct):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hey"}]
    a = post_json(f"{server.http_url}/v2/models/dflash/generate", {"messages": msgs, "max_tokens": 6})
    b = post_json(f"{server.http_url}/v2/models/dflash/generate", {"messages": json.dumps(msgs), "max_tokens": 6})
    assert a[0] == b[0] == 200 and a[1]["text_output"] == b[1]["text_output"] == run_direct(
        direct, messages=json.dumps(msgs).encode(), max_tokens=np.array([6], np.int64)).text


@pytest.mark.server
def test_only_the_front_reaches_tritonserver(server):
    """Triton's own HTTP port (loopback) answers nothing without the front's per-start secret; the front forwards
    only the inference protocol's routes."""
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{server.triton_http_port}/v2/health/ready", timeout=10)
        raise AssertionError("tritonserver answered without the front's header")
    except urllib.error.HTTPError as e:
        assert e.code == 403 and not server.private
    except urllib.error.URLError as e:  # in its own network namespace: nothing listens on this machine's loopback
        assert isinstance(e.reason, ConnectionRefusedError) and server.private
    status, body = post_json(f"{server.http_url}/v2/repository/index", {})
    assert status == 404 and "not served" in body["error"]
    assert urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10).status == 200


@pytest.mark.server
@pytest.mark.parametrize("model, endpoint", [("dflash", "generate"), ("dflash_stream", "generate_stream")])
def test_a_client_that_goes_away_frees_its_instance_within_a_step(tmp_path, long_engine, model, endpoint):
    """One instance. A 3000-token request whose client leaves mid-generation must stop at its next DFlash step: the
    request sent right after it waits far less than the whole 3000-token generation takes on this server."""
    from dflash_export.deploy.server import TritonServer

    repo = write_repository(long_engine, tmp_path / "repo", instances=1)
    path = f"/v2/models/{model}/{endpoint}"
    long_body = {"text_input": "go on", "max_tokens": 3000}
    with TritonServer(repo, *free_ports(3), ready_timeout_s=120) as srv:
        t0 = time.monotonic()
        assert post_json(srv.http_url + path, long_body)[0] == 200
        whole = time.monotonic() - t0
        # Leave once the request is surely running (on a loaded machine 0.5 s can still find it queued).
        send_and_drop(srv.http_port, path, long_body, max(0.5, 0.1 * whole),
                       after_first_bytes=model == "dflash_stream")
        t0 = time.monotonic()
        status, body = post_json(srv.http_url + path, {"text_input": "next", "max_tokens": 8})
        waited = time.monotonic() - t0
        assert status == 200, (body, srv.log_text()[-3000:])
        assert waited < 0.25 * whole, f"waited {waited:.2f} s behind a dropped client (whole run {whole:.2f} s)"
        deadline = time.monotonic() + 10
        while "dflash-cancel: the client" not in srv.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        # The front's cancel file ("the client went away") or Triton's own cancellation, whichever the model saw first;
        # the runtime ran one DFlash step after the cancel became visible at most (the step it was in).
        seen = re.search(r"dflash-cancel: the client (went away|cancelled the request); noticed -?\d+ ms after it, "
                         r"mid-generation, last step \d+ ms, (\d+) steps? after it", srv.log_text())
        assert seen and int(seen.group(2)) <= 1, srv.log_text()[-2000:]


@pytest.mark.server
def test_serve_restarts_a_crashed_tritonserver_and_clears_what_it_left(tmp_path, engine_dir):
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{http}/v2/models/dflash/generate"
    try:
        assert ready_line(proc).startswith("ready:")
        first = tritonserver_pid(repo)
        shm_before = {p.name for p in Path("/dev/shm").glob(f"dflash{proc.pid}_*")}
        assert shm_before, "the python backend's shared memory is expected under /dev/shm"
        os.kill(first, signal.SIGKILL)  # a crash (the 6 MB body made it segfault before the front existed)
        deadline, status = time.monotonic() + 180, None
        while time.monotonic() < deadline:
            status, body = post_json(url, {"text_input": "again", "max_tokens": 3})
            if status == 200:
                break
            assert status == 503, (status, body)  # restarting: the front answers, never a reset
            time.sleep(0.5)
        assert status == 200 and proc.poll() is None
        assert tritonserver_pid(repo) != first
        assert not shm_before & {p.name for p in Path("/dev/shm").glob(f"dflash{proc.pid}_*")}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "tritonserver died (" in err and "signal 9" in err and "restarting it" in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pids_mentioning(str(repo)) == [] and not list(Path("/dev/shm").glob(f"dflash{proc.pid}_*"))


@pytest.mark.server
def test_tritonserver_dead_before_its_bridge_exits_is_a_restart_not_a_stub_reload(tmp_path, engine_dir):
    """In a private network namespace `serve` runs tritonserver under a bridge process that exits with it, up to a
    poll later; tritonserver's stubs die with tritonserver. A health poll landing in between saw dead stubs and a
    live server, reloaded the model through a server that was gone and reported a failed reload. Here the bridge is
    held (SIGSTOP) while tritonserver and its stubs are killed, so that moment lasts 3 s: `serve` must wait for the
    server's exit and restart it for that reason, with no reload."""
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    http, metrics = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--metrics-port", str(metrics)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{http}/v2/models/dflash/generate"
    bridge = None
    try:
        assert ready_line(proc).startswith("ready:")
        server = tritonserver_pid(repo)
        bridge = int(Path(f"/proc/{server}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        if bridge == proc.pid:
            pytest.skip("no private network namespace here: tritonserver runs without a bridge")
        stubs = [p for p in pids_mentioning(str(repo)) if b"triton_python_backend_stub" in
                 Path(f"/proc/{p}/cmdline").read_bytes()]
        assert stubs
        os.kill(bridge, signal.SIGSTOP)
        for pid in [server, *stubs]:
            os.kill(pid, signal.SIGKILL)
        time.sleep(3.0)  # six health polls with the stubs dead and the bridge alive
        os.kill(bridge, signal.SIGCONT)
        deadline, status = time.monotonic() + 180, None
        while time.monotonic() < deadline:
            status, body = post_json(url, {"text_input": "again", "max_tokens": 3})
            if status == 200:
                break
            assert status == 503, (status, body)
            time.sleep(0.5)
        assert status == 200 and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "tritonserver died (" in err and ": tritonserver exited (signal 9" in err and "reload" not in err, err
    finally:
        if bridge is not None:
            try:
                os.kill(bridge, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pids_mentioning(str(repo)) == []


@pytest.mark.server
def test_a_killed_stub_fails_its_requests_at_once_and_its_model_reloads_alone(tmp_path, long_engine):
    """kill -9 of one `dflash` stub while both its instances run long requests: those requests get 503 with
    Retry-After within seconds (not after their whole run), the streaming model answers correctly while `dflash`
    reloads, `dflash` answers the text of the request run alone once reloaded, tritonserver is the same process
    throughout, and `serve` still stops cleanly (exit 0, nothing left). How fast it recovers is a figure of
    benchmarks/soak.py, not asserted here."""
    from dflash_export.deploy.handler import RequestRunner
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    alone = RequestRunner(DFlashRuntime(load_engine(long_engine, threads=1)))
    want = run_direct(alone, text_input=b"again", max_tokens=np.array([12])).text
    want_stream = run_direct(alone, text_input=b"meanwhile", max_tokens=np.array([12])).text
    repo = write_repository(long_engine, tmp_path / "repo", instances=2)
    http, metrics = free_ports(2)
    log = tmp_path / "serve.log"  # tritonserver's own log: why it was restarted, when an assertion says so
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--metrics-port", str(metrics), "--log-file", str(log)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{http}/v2/models"
    long_body = {"text_input": "go on", "max_tokens": 3000}

    def server_said():
        return (log.read_text(errors="replace") if log.exists() else "").splitlines()[-12:]

    try:
        assert ready_line(proc).startswith("ready:")
        server = tritonserver_pid(repo)
        for _ in range(2):  # the first request pays the sessions' warm-up; the second is timed
            t0 = time.monotonic()
            assert post_json(f"{base}/dflash/generate", long_body, timeout=300)[0] == 200
            whole = time.monotonic() - t0
        answers: list[tuple[int, object, float]] = []

        def long_request():
            # Four times the timed request: the one on the stub left alive must still be running when the death is
            # seen (a pair of 3000-token requests once let it finish first, a whole-suite run answering it 200).
            status, body = post_json(f"{base}/dflash/generate", {**long_body, "max_tokens": 12000}, timeout=300)
            answers.append((status, body, time.monotonic()))

        stubs = [p for p in pids_mentioning(str(repo)) if b"/dflash/1/model.py" in
                 Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(stubs) == 2, stubs
        # Kill once both stubs are seen computing (one request each), not after a guessed sleep: on a fast machine
        # a timed sleep outlasted the requests themselves. Once in a whole-suite run one request was answered before
        # both stubs were seen busy (the two ran one after the other): then the pair is sent again.
        for _ in range(3):
            answers.clear()
            threads = [threading.Thread(target=long_request) for _ in range(2)]
            for t in threads:
                t.start()
            if wait_all_busy(stubs, give_up=lambda: bool(answers)) and not answers:
                break
            for t in threads:
                t.join(timeout=300)
        assert not answers, answers
        os.kill(stubs[0], signal.SIGKILL)
        killed = time.monotonic()
        status, events = post_json(f"{base}/dflash_stream/generate_stream", {"text_input": "meanwhile",
                                                                             "max_tokens": 12})
        assert status == 200, (events, server_said())  # the other model serves while dflash reloads
        assert "".join(json.loads(line[5:]).get("text_output", "") for line in events.splitlines()
                       if line.startswith("data:")) == want_stream, events
        for t in threads:
            t.join(timeout=60)
        assert len(answers) == 2
        for status, body, at in answers:
            assert status == 503 and "died" in body["error"], (status, body)
            # answered at the next watch poll (0.5 s), not left to run its course
            assert at - killed < max(3.0, 0.5 * whole), (at - killed, whole)
        while time.monotonic() - killed < 110:
            status, body = post_json(f"{base}/dflash/generate", {"text_input": "again", "max_tokens": 12})
            if status == 200:
                break
            assert status == 503, (status, body)
            time.sleep(0.25)
        assert status == 200 and body["text_output"] == want, (status, body)
        status, body = post_json(f"{base}/dflash/generate", {"text_input": "again", "max_tokens": 12})
        assert status == 200 and body["text_output"] == want
        assert tritonserver_pid(repo) == server, server_said()
        assert not set(stubs) & set(pids_mentioning(str(repo)))
        # The reloaded model's stubs are watched too: a second death reloads it again (its files unchanged).
        stubs = [p for p in pids_mentioning(str(repo)) if b"/dflash/1/model.py" in
                 Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(stubs) == 2, stubs
        # Started while tritonserver serves, they hold none of its sockets (its connections, the reload's own
        # among them, would stay open in CLOSE_WAIT behind a copy in the stub).
        held = {p: [(fd, os.readlink(f"/proc/{p}/fd/{fd}")) for fd in os.listdir(f"/proc/{p}/fd")] for p in stubs}
        assert not any(link.startswith("socket:") for fds in held.values() for _, link in fds), held
        os.kill(stubs[1], signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 110:
            status, body = post_json(f"{base}/dflash/generate", {"text_input": "again", "max_tokens": 12})
            if status == 200 and not set(stubs) & set(pids_mentioning(str(repo))):
                break
            time.sleep(0.25)
        assert status == 200 and body["text_output"] == want, (status, body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert err.count("reloaded dflash") == 2 and "tritonserver died" not in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pids_mentioning(str(repo)) == []


@pytest.mark.server
@pytest.mark.parametrize("drain_s, code", [(1, 1), (60, 0)])
def test_sigterm_drains_and_exits_nonzero_when_requests_had_to_be_cancelled(tmp_path, long_engine, drain_s, code):
    repo = write_repository(long_engine, tmp_path / "repo", instances=2, decoupled=False)
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--drain-timeout",
                             str(drain_s)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{http}/v2/models/dflash/generate"
    results: dict[str, tuple] = {}
    # the long request outlasts a 1 s drain by far (3000 tokens once finished in it on an idle machine) and fits a
    # 60 s one
    long_tokens = 30000 if code else 3000
    try:
        assert ready_line(proc).startswith("ready:")
        workers = [threading.Thread(target=lambda k=k, n=n: results.__setitem__(k, post_json(url, {
            "text_input": k, "max_tokens": n}, timeout=120))) for k, n in (("long", long_tokens), ("short", 40))]
        for w in workers:
            w.start()
        time.sleep(0.5)  # both running (two instances)
        proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.join(timeout=120)
        assert proc.wait(timeout=120) == code, proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert results["short"][0] == 200 and results["short"][1]["completion_tokens"] == 40, results["short"]
    if code == 0:
        assert results["long"][0] == 200 and results["long"][1]["completion_tokens"] == 3000
    else:
        status, body = results["long"]
        assert status == 503 and "shutting down" in body["error"], results["long"]
        assert "the drain did not complete: 1 request(s)" in proc.stderr.read()
    assert pids_mentioning(str(repo)) == []


# `dflash-export serve ...` whose model stubs hold each model's load 60 s (a slow load): a start that is not ready.
_SERVE_WITH_A_SLOW_LOAD = """
import runpy, sys
import dflash_export.deploy.triton_process as tp
made = tp.make_stub_env
def with_hook(into, stub_site):
    out = made(into, stub_site)
    site_packages = next(into.glob("lib/python*/site-packages"))
    (site_packages / "dflash_test_hook.py").write_text(
        "import time\\nimport dflash_export.engines.registry as registry\\nreal = registry.load_engine\\n"
        "registry.load_engine = lambda *a, **k: time.sleep(60) or real(*a, **k)\\n")
    (site_packages / "zz_dflash_test_hook.pth").write_text("import dflash_test_hook\\n")
    return out
tp.make_stub_env = with_hook
sys.argv = ["dflash-export", *sys.argv[1:]]
runpy.run_module("dflash_export", run_name="__main__")
"""


@pytest.mark.server
@pytest.mark.parametrize("sig, code, says", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_stop_signal_before_ready_ends_the_start_non_zero_leaving_nothing(tmp_path, small_repo, sig, code, says):
    """Ctrl-C (or SIGTERM) while the models load: no ready line, exit 130 (143), the CLI's one line, and tritonserver,
    its stubs, the front's port, the work dir and the default log all gone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = free_ports(1)[0]
    # Ctrl-C's default action in the child, as in a terminal (a background shell hands its children SIGINT ignored).
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_WITH_A_SLOW_LOAD, "serve", "--repo", str(small_repo),
                             "--port", str(port)], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp),
                                                                  "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not any(
                b"model.py" in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids_mentioning(str(small_repo))):
            time.sleep(0.1)  # until a model stub runs: its model is loading
        assert proc.poll() is None, proc.communicate()
        time.sleep(1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, (proc.returncode, out, err)
    assert "ready:" not in out and "Traceback" not in err and err.strip().splitlines()[-1] == says, (out, err)
    assert pids_mentioning(str(small_repo)) == []
    assert [p.name for p in tmp.iterdir() if p.name.startswith("dflash")] == []
    with socket.socket() as s:  # the front it had started is closed
        s.bind(("127.0.0.1", port))


def test_what_a_killed_server_left_is_removed_by_the_next_start(tmp_path):
    from dflash_export.deploy.server import OWNER_FILE, clean_stale_leftovers

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    env_dir = Path(tempfile.mkdtemp(prefix="python_env_", dir="/tmp"))
    work = tmp_path / "dflash-triton-dead"
    (work / "backends").mkdir(parents=True)
    (work / OWNER_FILE).write_text(json.dumps({"pid": dead, "python_env": [str(env_dir)]}))
    live = tmp_path / "dflash-triton-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "python_env": []}))
    shm_dead = Path("/dev/shm") / f"dflash{dead}_1234_test"
    shm_live = Path("/dev/shm") / f"dflash{os.getpid()}_1234_test"
    try:
        shm_dead.write_bytes(b"x")
        shm_live.write_bytes(b"x")
        removed = clean_stale_leftovers(tmp_path)
        assert not work.exists() and not env_dir.exists() and not shm_dead.exists()
        assert live.exists() and shm_live.exists()
        assert str(shm_dead) in removed and str(work) in removed
    finally:
        for p in (shm_dead, shm_live):
            p.unlink(missing_ok=True)
        shutil.rmtree(env_dir, ignore_errors=True)


@pytest.mark.server
@pytest.mark.slow
def test_short_soak_meets_every_target(tmp_path):
    """benchmarks/soak.py --short: 4 clients for 40 s of good, hostile and dropped requests, a slowloris trickle and
    a kill -9 of a model stub and of tritonserver against `serve` on the tiny engine: every served output equals its
    direct run, every bad request gets its 4xx, no 5xx outside a fault, recovery within 20 s of a stub's death and
    30 s of tritonserver's, no orphans."""
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["requests"] > 50 and res["by_kind"].get("bad", 0) > 0 and res["drops"] > 0
    assert res["wrong_outputs"] == res["unexpected_statuses"] == res["http_5xx"] == res["orphans_after_exit"] == 0
    # Dropped clients' requests seen mid-generation, each run for at most the step it was in after its cancel
    assert res["cancels_mid_generation"] > 0 and res["cancel_steps_after_max"] <= 1, res["cancel_steps_after"]
    kills = [f["killed"] for f in res["faults"]]
    # A stub's death is a reload of its model; a restart only for tritonserver's own death. tritonserver has been seen
    # (once in a fresh-clone run) to exit by itself as a stub was killed: that stub's model then came back through
    # the restart, which is `serve`'s contract for a server that dies. A reload that failed never counts.
    reasons = res["restart_reasons"]
    own_exits = sum("tritonserver exited" in r and "reloading" not in r for r in reasons)
    assert len(reasons) == res["server_restarts"] and own_exits == len(reasons), reasons
    extra = res["server_restarts"] - kills.count("tritonserver")
    assert 0 <= extra and res["model_reloads"] + extra == kills.count("stub") > 0, (res["model_reloads"], reasons)
    assert all(f["answered_correctly_after_s"] is not None
               and f["answered_correctly_after_s"] <= (20 if f["killed"] == "stub" else 30) for f in res["faults"])
    assert res["slowloris_connections"].get("dropped_by_front", 0) > 0
