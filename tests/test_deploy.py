"""`deploy` writes a checked Triton repository; `serve` runs the real tritonserver on it, on loopback.

The server tests (marker `server`) deploy the tiny ONNX Runtime engine (or, only if ONNX Runtime cannot build it, a
PyTorch engine directory), start tritonserver from nvidia-pytriton on free ports and compare every served output with
the same request run directly on the engine in this process. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
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

from dflash_export.deploy.repository import (INPUTS, MARKER, OUTPUTS, ModelConfig, check_config_text, render_config,
                                             write_repository)
from dflash_export.engines.base import write_manifest
from dflash_export.errors import DFlashError

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


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
        from dflash_export.engines.onnxruntime import build_onnxruntime
        from dflash_export.recipes import load_recipe

        return build_onnxruntime(load_recipe("tiny-qwen3"), d / "onnxruntime")
    except ImportError as e:  # pragma: no cover - environment without onnxruntime / onnx
        print(f"ONNX Runtime engine unavailable ({e}); serving the PyTorch engine instead")
        return make_torch_engine_dir(d / "pytorch")


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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


# ----------------------------------------------------------------------------------------------------------------------
# config.pbtxt checker and repository writer (no server)


def test_rendered_config_parses_back_with_every_tensor():
    text = render_config(ModelConfig("dflash", INPUTS, OUTPUTS, instances=3, decoupled=True, max_queue_size=7,
                                     parameters={"engine_dir": "../x \"y\"/é"}))
    cfg = check_config_text(text, expect_name="dflash")
    assert [t["name"] for t in cfg["input"]] == [t.name for t in INPUTS]
    assert [t["data_type"] for t in cfg["output"]] == [t.data_type for t in OUTPUTS]
    assert all(t["optional"] is True for t in cfg["input"])  # generate works with text_input alone
    assert cfg["instance_group"][0]["count"] == 3
    assert cfg["model_transaction_policy"]["decoupled"] is True
    assert cfg["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 7
    assert cfg["parameters"]["value"]["string_value"] == "../x \"y\"/é"


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.replace('name: "dflash"', 'name: "9bad name"'), "name"),
    (lambda t: t.replace("TYPE_INT32", "TYPE_INT33", 1), "max_tokens.data_type"),
    (lambda t: t.replace("dims: [ 1 ]", "dims: [ 0 ]", 1), "text_input.dims"),
    (lambda t: t.replace("dims: [ 1 ]", "dims: [ ]", 1), "text_input.dims"),
    (lambda t: t.replace('name: "messages"', 'name: "text_input"'), "name"),
    (lambda t: t.replace('name: "text_output"', 'name: "text output"'), "name"),
    (lambda t: t.replace("data_type: TYPE_FP32\n    dims: [ 1 ]\n  }\n]",
                         "data_type: TYPE_FP32\n    dims: [ 1 ]\n    optional: true\n  }\n]"), "optional"),
    (lambda t: t.replace("count: 1", "count: 0"), "instance_group.count"),
    (lambda t: t.replace("max_queue_size: 64", "max_queue_size: -1"), "max_queue_size"),
    (lambda t: t.replace("input [", "input [ {", 1), "config.pbtxt"),
])
def test_config_checker_rejects_bad_config_naming_the_field(edit, field):
    good = render_config(ModelConfig("dflash", INPUTS, OUTPUTS, max_queue_size=64))
    check_config_text(good, expect_name="dflash")
    with pytest.raises(DFlashError) as e:
        check_config_text(edit(good), "repo/dflash/config.pbtxt", expect_name="dflash")
    assert field in str(e.value) and "repo/dflash/config.pbtxt" in str(e.value)


def test_config_checker_wants_the_directory_name():
    with pytest.raises(DFlashError, match="directory name"):
        check_config_text(render_config(ModelConfig("other", INPUTS, OUTPUTS)), expect_name="dflash")


def test_write_repository_layout_and_redeploy(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo", instances=3, max_queue_size=5)
    marker = json.loads((repo / MARKER).read_text())
    assert marker["models"] == ["dflash", "dflash_stream"]
    for name, decoupled in (("dflash", False), ("dflash_stream", True)):
        cfg = check_config_text((repo / name / "config.pbtxt").read_text(), expect_name=name)
        assert cfg["model_transaction_policy"]["decoupled"] is decoupled
        assert cfg["instance_group"][0]["count"] == 3
        assert cfg["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 5
        params = {p["key"]: p["value"]["string_value"] for p in cfg["parameters"]}
        assert (repo / name / params["engine_dir"] / "manifest.json").is_file()  # relative: the repo can move
        assert str(ROOT) in json.loads(params["sys_path"])
        assert (repo / name / "1" / "model.py").read_text().startswith('"""Triton python-backend model')
    assert (repo / "dflash" / "engine" / "manifest.json").read_bytes() == (engine / "manifest.json").read_bytes()
    # Deploying again replaces the earlier repository; a foreign directory is never overwritten.
    write_repository(engine, repo, instances=1, decoupled=False)
    assert json.loads((repo / MARKER).read_text())["models"] == ["dflash"]
    assert not (repo / "dflash_stream").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(DFlashError, match="not written by"):
        write_repository(engine, foreign)
    assert (foreign / "keep.txt").is_file()
    with pytest.raises(DFlashError, match="--instances"):
        write_repository(engine, tmp_path / "r2", instances=0)


def test_deploy_cli_writes_repository_and_bad_engine_is_one_line_error(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "engine")
    r = subprocess.run([sys.executable, "-m", "dflash_export", "deploy", "--engine", str(engine), "--repo",
                        str(tmp_path / "ok"), "--instances", "2", "--max-queue-size", "9", "--no-stream"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "dflash-export serve --repo" in r.stdout
    cfg = check_config_text((tmp_path / "ok" / "dflash" / "config.pbtxt").read_text(), expect_name="dflash")
    assert cfg["instance_group"][0]["count"] == 2 and not (tmp_path / "ok" / "dflash_stream").exists()
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "dflash_export", "deploy", "--engine", str(tmp_path / "empty"),
                        "--repo", str(tmp_path / "repo")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "manifest.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "repo").exists()


def test_llmapi_repository_for_a_tensorrt_llm_bundle(tmp_path):
    from dflash_export.engines.tensorrt_llm import write_trtllm_bundle
    from dflash_export.recipes import load_recipe

    bundle = write_trtllm_bundle(load_recipe("tiny-qwen3"), tmp_path / "bundle")
    repo = write_repository(bundle, tmp_path / "repo")
    model = repo / "tensorrt_llm"
    cfg = check_config_text((model / "config.pbtxt").read_text(), expect_name="tensorrt_llm")
    assert cfg["backend"] == "python"
    # Batching, decoupling and instances are model.yaml's triton_config to set, so config.pbtxt leaves them out.
    assert "max_batch_size" not in cfg and "model_transaction_policy" not in cfg and "instance_group" not in cfg
    assert {t["name"] for t in cfg["input"]} >= {"text_input", "sampling_param_max_tokens", "streaming"}
    assert {t["name"] for t in cfg["output"]} >= {"text_output", "total_accepted_draft_tokens"}
    yaml_src = bundle / "triton" / "tensorrt_llm" / "1" / "model.yaml"
    assert (model / "1" / "model.yaml").read_bytes() == yaml_src.read_bytes()
    assert "decoding_type: DFlash" in (model / "1" / "model.yaml").read_text()
    assert "model.py" in (model / "README.txt").read_text()
    fake_py = tmp_path / "llmapi" / "model.py"
    fake_py.parent.mkdir()
    fake_py.write_text("# TensorRT-LLM's llmapi model.py would be here\n")
    write_repository(bundle, repo, llmapi_model_py=fake_py)
    assert (model / "1" / "model.py").read_text() == fake_py.read_text()


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


# ----------------------------------------------------------------------------------------------------------------------
# Request contract in-process (the same code the Triton model runs)


def _getter(**inputs):
    arrays = {k: (v if isinstance(v, np.ndarray) else np.array([v], dtype=np.object_ if isinstance(v, bytes)
                                                                 else None)) for k, v in inputs.items()}
    return arrays.get


@pytest.mark.parametrize("inputs, field", [
    ({}, "text_input"),
    ({"text_input": b""}, "text_input: empty prompt"),
    ({"text_input": b"\xff\xfehi"}, "text_input: invalid UTF-8"),
    ({"text_input": b"hi", "max_tokens": np.array([0], np.int32)}, "max_tokens"),
    ({"text_input": b"hi", "max_tokens": np.array([1.0], np.float32)}, "max_tokens: expected an integer"),
    ({"text_input": b"hi", "temperature": np.array([-0.1], np.float32)}, "temperature"),
    ({"text_input": b"hi", "temperature": np.array([np.nan], np.float32)}, "temperature: must be a finite"),
    ({"text_input": b"hi", "top_p": np.array([0.0], np.float32)}, "top_p"),
    ({"messages": b"[{\"role\": \"user\"}]"}, "messages"),
    ({"messages": b"{"}, "messages: not valid JSON"),
    ({"text_input": b"a", "messages": b"[]"}, "messages"),
])
def test_parse_request_names_the_bad_input(inputs, field):
    from dflash_export.deploy.handler import parse_request

    with pytest.raises(DFlashError) as e:
        parse_request(_getter(**inputs))
    assert str(e.value).startswith(field.split(":")[0]) and field in str(e.value)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return make_engine_dir(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def direct(engine_dir):
    """The engine in this process, behind the same request runner the Triton model uses."""
    from dflash_export.deploy.handler import RequestRunner
    from dflash_export.engines.base import load_engine
    from dflash_export.runtime import DFlashRuntime

    return RequestRunner(DFlashRuntime(load_engine(engine_dir, threads=1)))


def run_direct(direct, **inputs):
    from dflash_export.deploy.handler import generate_text, parse_request

    return generate_text(direct, parse_request(_getter(**inputs)))


def test_stop_string_ends_output_before_it(direct):
    full = run_direct(direct, text_input=b"Hello there", max_tokens=np.array([24], np.int32))
    # A stop string taken from the middle of the greedy output must cut exactly there.
    visible = [i for i, c in enumerate(full.text) if c.isprintable() and c != "\ufffd" and i > 2]
    if not visible:
        pytest.skip("tiny output has no printable character to stop at")
    cut = visible[0]
    stop = full.text[cut]
    out = run_direct(direct, text_input=b"Hello there", max_tokens=np.array([24], np.int32),
                     stop=np.array([stop.encode()], dtype=np.object_))
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index(stop)]


def test_streamed_chunks_join_to_the_whole_output(direct):
    from dflash_export.deploy.handler import parse_request

    req = parse_request(_getter(text_input=b"stream me", max_tokens=np.array([20], np.int32)))
    chunks = list(direct.run(req))
    whole = run_direct(direct, text_input=b"stream me", max_tokens=np.array([20], np.int32))
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == whole.finish_reason and chunks[-1].completion_tokens == 20


# ----------------------------------------------------------------------------------------------------------------------
# Against a real tritonserver


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
            "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BYTES": np.object_}[dtype])
        add(name, arr, dtype)
    res = client.infer(model, inputs)
    return {"text": res.as_numpy("text_output")[0].decode(), "finish_reason": res.as_numpy("finish_reason")[0].decode(),
            "completion_tokens": int(res.as_numpy("completion_tokens")[0]),
            "accepted_tokens": int(res.as_numpy("accepted_tokens")[0]),
            "drafted_tokens": int(res.as_numpy("drafted_tokens")[0]),
            "acceptance_length": float(res.as_numpy("acceptance_length")[0])}


def as_dict(chunk):
    return {"text": chunk.text, "finish_reason": chunk.finish_reason, "completion_tokens": chunk.completion_tokens,
            "accepted_tokens": chunk.accepted_tokens, "drafted_tokens": chunk.drafted_tokens,
            "acceptance_length": pytest.approx(chunk.acceptance_length, rel=1e-6)}


@pytest.fixture(scope="module")
def client(server):
    import tritonclient.http as th

    return th.InferenceServerClient(server.http_url.removeprefix("http://"), concurrency=16, network_timeout=120)


PROMPTS = [b"Hello", b"The quick brown fox", b"DFlash drafts a whole block", "caf\u00e9 \u2615".encode(), b"1 2 3 4 5"]


@pytest.mark.server
@pytest.mark.parametrize("prompt", PROMPTS)
def test_tritonclient_output_equals_direct_engine_greedy(server, client, direct, prompt):
    served = infer(client, prompt, max_tokens=(32, "INT32"))
    assert served == as_dict(run_direct(direct, text_input=prompt, max_tokens=np.array([32], np.int32)))


@pytest.mark.server
def test_sampled_request_is_reproducible_and_equals_direct(server, client, direct):
    extra = dict(max_tokens=(24, "INT32"), temperature=(0.8, "FP32"), top_p=(0.9, "FP32"), seed=(7, "UINT64"))
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
    status, body = post_json(f"{server.http_url}/v2/models/dflash_stream/generate_stream",
                             {"text_input": "stream me", "max_tokens": 20})
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == run_direct(
        direct, text_input=b"stream me", max_tokens=np.array([20], np.int32)).text
    assert [e["finish_reason"] for e in events[:-1]] == [""] * (len(events) - 1)
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 20
    status, body = post_json(f"{server.http_url}/v2/models/dflash_stream/generate_stream", {"text_input": ""})
    assert "text_input: empty prompt" in str(body)


@pytest.mark.server
def test_16_concurrent_clients_get_the_outputs_of_lone_requests(server, client):
    import tritonclient.http as th

    requests = [(PROMPTS[i % len(PROMPTS)] + str(i).encode(), 8 + (i * 5) % 25) for i in range(20)]
    alone = {r: infer(client, r[0], max_tokens=(r[1], "INT32")) for r in requests}
    results: dict[tuple[int, int], dict] = {}
    errors: list[BaseException] = []

    def worker(c: int):
        cli = th.InferenceServerClient(server.http_url.removeprefix("http://"), network_timeout=120)
        try:
            for k in range(10):
                r = requests[(c * 3 + k) % len(requests)]
                results[(c, k)] = (r, infer(cli, r[0], max_tokens=(r[1], "INT32")))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            cli.close()

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors[:3]
    assert len(results) == 160
    for r, out in results.values():
        assert out == alone[r]


# (request, what the error must name). Each is followed by a good request on the same server.
BAD_JSON = [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": ""}, "text_input: empty prompt"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens: must be >= 1"),
    ({"text_input": "hi", "max_tokens": 2_000_000_000}, "max_tokens"),
    ({"text_input": "hi", "temperature": -0.5}, "temperature: must be >= 0"),
    ({"text_input": "x" * 2000}, "text_input: prompt is 2000 tokens"),
    ({"messages": "[{\"role\": 1}]"}, "messages"),
]


@pytest.mark.server
@pytest.mark.parametrize("body, named", BAD_JSON, ids=[n.split(":")[0] + str(i) for i, (_, n) in enumerate(BAD_JSON)])
def test_bad_json_request_gets_named_error_and_server_keeps_serving(server, body, named):
    status, resp = post_json(f"{server.http_url}/v2/models/dflash/generate", body)
    assert status >= 400 and named in resp["error"], resp
    status, resp = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "ok", "max_tokens": 4})
    assert status == 200 and resp["completion_tokens"] == 4


@pytest.mark.server
def test_bad_tensor_requests_get_named_errors_and_server_keeps_serving(server, client):
    from tritonclient.utils import InferenceServerException

    cases = [
        (dict(text=b"\xff\xfe bad"), "text_input: invalid UTF-8"),
        (dict(max_tokens=(8.0, "FP32")), "max_tokens"),                  # wrong dtype: refused by Triton itself
        (dict(text=None, max_tokens=(8, "INT32")), "text_input"),       # missing input
        (dict(max_tokens=(np.array([1, 2], np.int32), "INT32")), "max_tokens"),  # wrong shape
        (dict(temperature=(-1.0, "FP32")), "temperature"),
        (dict(stop=(np.array([b"\xc3"], dtype=np.object_), "BYTES")), "stop: invalid UTF-8"),
    ]
    for kwargs, named in cases:
        text = kwargs.pop("text", b"hello")
        with pytest.raises(InferenceServerException) as e:
            infer(client, text, **kwargs)
        assert named in str(e.value), (named, str(e.value))
        assert infer(client, b"still serving", max_tokens=(3, "INT32"))["completion_tokens"] == 3


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


@pytest.mark.server
def test_serve_cli_prints_urls_and_stops_cleanly_on_sigterm(tmp_path, engine_dir):
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line.startswith("ready:"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("ready:") and f"http://127.0.0.1:{http}" in line, line
        status, body = post_json(f"http://127.0.0.1:{http}/v2/models/dflash/generate",
                                 {"text_input": "hi", "max_tokens": 2})
        assert status == 200 and body["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pids_mentioning(str(repo)) == [], "serve left tritonserver or a stub running"


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
