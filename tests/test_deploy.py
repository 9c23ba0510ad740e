"""`deploy` writes a checked Triton repository; `serve` runs the real tritonserver on it, on loopback.

The server tests (marker `server`) deploy the tiny ONNX Runtime engine (or, only if ONNX Runtime cannot build it, a
PyTorch engine directory), start tritonserver from nvidia-pytriton on free ports and compare every served output with
the same request run directly on the engine in this process. Nothing is mocked.
"""

from __future__ import annotations

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

from dflash_export.deploy.pbtxt import ModelConfig, check_config_text, render_config
from dflash_export.deploy.repository import INPUTS, MARKER, OUTPUTS, write_repository
from dflash_export.deploy.server import free_loopback_ports as free_ports
from dflash_export.engines.manifest import write_manifest
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
    (lambda t: t.replace("TYPE_INT64", "TYPE_INT65", 1), "max_tokens.data_type"),
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
    from dflash_export.engines.registry import load_engine
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
            "INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "UINT64": np.uint64, "BYTES": np.object_}[dtype])
        add(name, arr, dtype)
    res = client.infer(model, inputs)
    return {"text": res.as_numpy("text_output")[0].decode(), "finish_reason": res.as_numpy("finish_reason")[0].decode(),
            "completion_tokens": int(res.as_numpy("completion_tokens")[0]),
            "accepted_tokens": int(res.as_numpy("accepted_tokens")[0]),
            "drafted_tokens": int(res.as_numpy("drafted_tokens")[0]),
            "acceptance_length": float(res.as_numpy("acceptance_length")[0])}


def stream_equals_direct(server, direct, text: str, max_tokens: int) -> list[dict]:
    """Stream `text` through `dflash_stream` and check the deltas join to the same request run directly; the events."""
    status, body = post_json(f"{server.http_url}/v2/models/dflash_stream/generate_stream",
                             {"text_input": text, "max_tokens": max_tokens})
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1 and all("error" not in e for e in events)
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


@pytest.fixture(scope="module")
def client(server):
    import tritonclient.http as th

    return th.InferenceServerClient(server.http_url.removeprefix("http://"), concurrency=16, network_timeout=120)


PROMPTS = [b"Hello", b"The quick brown fox", b"DFlash drafts a whole block", "caf\u00e9 \u2615".encode(), b"1 2 3 4 5"]


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
    ({"text_input": "x" * 2000}, "text_input: prompt is 2000 tokens"),
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


def _serve_cli(repo, http, grpc, metrics, **popen):
    """`dflash-export serve` in a subprocess, its stdout (the ready line) piped."""
    return subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **popen)


def _ready_line(proc, timeout_s: float = 120) -> str:
    """The first `ready:` line `serve` prints, or the last line read when it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and not line.startswith("ready:"):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    return line


@pytest.mark.server
def test_serve_cli_prints_urls_and_stops_cleanly_on_sigterm(tmp_path, engine_dir):
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    http, grpc, metrics = free_ports(3)
    proc = _serve_cli(repo, http, grpc, metrics, start_new_session=True)
    try:
        line = _ready_line(proc)
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


# ----------------------------------------------------------------------------------------------------------------------
# Bad input to `deploy` and `serve`: one line naming the file / option, exit 2, nothing written, nothing left running


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
    import shutil

    shutil.copytree(src, dst)  # real copies: editing them never touches `src`
    return dst


@pytest.mark.parametrize("fields, field", [
    ({"backend": "cuda"}, "backend"),
    ({"block_size": "four"}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"mask_token_id": -1}, "mask_token_id"),
    ({"mask_token_id": ...}, "mask_token_id"),
    ({"files": ["a"]}, "files"),
    ({"files": {"../../etc/passwd": "0" * 64}}, "files"),
    ({"recipe_path": "/nonexistent/recipe.yaml"}, "recipe_path"),
])
def test_deploy_validates_the_manifest_like_run(tmp_path, fields, field):
    engine = edit_manifest(make_torch_engine_dir(tmp_path / "engine"), **fields)
    with pytest.raises(DFlashError) as e:
        write_repository(engine, tmp_path / "repo")
    assert f"manifest.json: {field}" in str(e.value), str(e.value)
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("fields, field", [
    ({"engine_format": 1}, "engine_format"),
    ({"shapes": {"target_layers": 2}}, "shapes"),
    ({"vocab_size": "256"}, "vocab_size"),
    ({"stop_token_ids": "254"}, "stop_token_ids"),
    ({"max_seq_len": ...}, "max_seq_len"),
])
def test_deploy_validates_onnxruntime_manifest_fields(tmp_path, engine_dir, fields, field):
    if json.loads((engine_dir / "manifest.json").read_text())["backend"] != "onnxruntime":
        pytest.skip("no ONNX Runtime engine in this environment")
    engine = edit_manifest(copy_engine(engine_dir, tmp_path / "engine"), **fields)
    with pytest.raises(DFlashError) as e:
        write_repository(engine, tmp_path / "repo")
    assert f"manifest.json: {field}" in str(e.value), str(e.value)
    assert not (tmp_path / "repo").exists()


def test_deploy_cli_refuses_a_manifest_run_refuses(tmp_path):
    engine = edit_manifest(make_torch_engine_dir(tmp_path / "engine"), backend="cuda")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo")
    assert_one_line(r, f"{engine}/manifest.json: backend: unknown backend 'cuda'")
    edit_manifest(engine, backend="pytorch", block_size="four")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo")
    assert_one_line(r, "manifest.json: block_size:")
    assert not (tmp_path / "repo").exists()


def test_llmapi_model_py_only_for_tensorrt_llm_and_must_exist(tmp_path):
    from dflash_export.engines.tensorrt_llm import write_trtllm_bundle
    from dflash_export.recipes import load_recipe

    model_py = tmp_path / "model.py"
    model_py.write_text("# llmapi model\n")
    engine = make_torch_engine_dir(tmp_path / "engine")
    with pytest.raises(DFlashError, match="--llmapi-model-py: only used with a TensorRT-LLM bundle"):
        write_repository(engine, tmp_path / "repo", llmapi_model_py=model_py)
    bundle = write_trtllm_bundle(load_recipe("tiny-qwen3"), tmp_path / "bundle")
    for bad, msg in ((tmp_path / "missing.py", "file not found"), (tmp_path, "not a file"), ("", "empty path")):
        with pytest.raises(DFlashError, match=f"--llmapi-model-py: {msg}"):
            write_repository(bundle, tmp_path / "repo", llmapi_model_py=bad)
    assert not (tmp_path / "repo").exists()
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo", "--llmapi-model-py", model_py)
    assert_one_line(r, f"{model_py}: --llmapi-model-py:")
    assert not (tmp_path / "repo").exists()


def test_deploy_never_replaces_the_current_directory_or_its_parents(tmp_path, monkeypatch):
    engine = make_torch_engine_dir(tmp_path / "engine")
    # The worst case: the current directory is an earlier deploy, which deploy would otherwise replace.
    here = write_repository(engine, tmp_path / "work" / "repo")
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    for repo in ("", "  ", ".", "..", str(here), str(tmp_path)):
        with pytest.raises(DFlashError, match="--repo") as e:
            write_repository(engine, repo)
        assert "\n" not in str(e.value)
    assert (here / "notes.txt").read_text() == "mine" and Path.cwd() == here
    r = cli("deploy", "--engine", engine, "--repo", "", cwd=here)
    assert_one_line(r, "--repo: empty path")
    r = cli("deploy", "--engine", engine, "--repo", ".", cwd=here)
    assert_one_line(r, "--repo: is the current directory")
    assert (here / "notes.txt").read_text() == "mine"


def test_deploy_refuses_repo_inside_or_around_the_engine(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "a" / "engine")
    with pytest.raises(DFlashError, match="inside the engine directory"):
        write_repository(engine, engine / "repo")
    with pytest.raises(DFlashError, match="contains the engine directory"):
        write_repository(engine, tmp_path / "a")
    assert sorted(p.name for p in engine.iterdir()) == ["manifest.json"]


def test_deploy_repo_under_a_file_or_unwritable_is_one_line_up_front(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "engine")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DFlashError, match="afile is a file, not a directory"):
        write_repository(engine, tmp_path / "afile" / "sub" / "repo")
    with pytest.raises(DFlashError, match="--repo: exists and is not a directory"):
        write_repository(engine, tmp_path / "afile")
    # /proc refuses new directories even to root (for whom permission bits do not count).
    with pytest.raises(DFlashError, match="--repo: cannot write"):
        write_repository(engine, "/proc/dflash-nope/repo")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "afile" / "repo")
    assert_one_line(r, "--repo: cannot create it:")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(DFlashError, match="is not writable"):
            write_repository(engine, ro / "repo")
        assert list(ro.iterdir()) == []


def test_deploy_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    from dflash_export.deploy import repository

    engine = make_torch_engine_dir(tmp_path / "engine")

    def fail(engine_dir, repo, *a, **k):
        (repo / "dflash").mkdir()
        raise OSError(28, "No space left on device", str(repo / "dflash" / "config.pbtxt"))

    monkeypatch.setattr(repository, "_write_python_models", fail)
    with pytest.raises(DFlashError, match="--repo: cannot write the repository .No space left"):
        write_repository(engine, tmp_path / "new" / "deeper" / "repo")
    assert not (tmp_path / "new").exists()


@pytest.fixture
def small_repo(tmp_path):
    return write_repository(make_torch_engine_dir(tmp_path / "engine"), tmp_path / "repo", decoupled=False)


def test_check_repository_accepts_a_deploy_and_names_what_is_wrong(tmp_path, small_repo):
    from dflash_export.deploy.repository import check_repository

    assert check_repository(small_repo)["models"] == ["dflash"]
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "empty", "not a model repository written by `dflash-export deploy`"),
             (tmp_path / "nope", "model repository not found"),
             (tmp_path / "engine" / "manifest.json", "--repo: not a directory")]
    for repo, msg in cases:
        with pytest.raises(DFlashError, match=msg):
            check_repository(repo)

    def broken(edit):
        import shutil

        repo = tmp_path / f"broken{len(list(tmp_path.glob('broken*')))}"
        shutil.copytree(small_repo, repo)
        edit(repo)
        with pytest.raises(DFlashError) as e:
            check_repository(repo)
        return str(e.value)

    assert "extra: not one of the deployed models" in broken(lambda r: (r / "extra").mkdir())
    assert "dflash_repository.json: models" in broken(lambda r: (r / MARKER).write_text('{"models": []}'))
    assert "config.pbtxt: missing" in broken(lambda r: (r / "dflash" / "config.pbtxt").unlink())
    assert "model.py: missing" in broken(lambda r: (r / "dflash" / "1" / "model.py").unlink())
    msg = broken(lambda r: (r / "dflash" / "config.pbtxt").write_text(
        (r / "dflash" / "config.pbtxt").read_text().replace("TYPE_INT64", "TYPE_INT65", 1)))
    assert "config.pbtxt: input max_tokens.data_type" in msg

    def tamper(r):
        m = r / "dflash" / "engine" / "manifest.json"
        text = m.read_text().replace('"block_size": 4', '"block_size": "four"')
        m.unlink()
        m.write_text(text)

    assert "engine/manifest.json: block_size" in broken(tamper)

    def other_versions(r):
        cfg = r / "dflash" / "config.pbtxt"
        text = cfg.read_text()
        assert "tokenizers" in text
        cfg.write_text(re.sub(r'(\\"tokenizers\\": \\")[^\\\\]+', r"\g<1>0.0.1", text))

    assert "parameters.library_versions: deployed with tokenizers 0.0.1" in broken(other_versions)


def test_serve_refuses_bad_host_and_ports_before_starting(small_repo):
    from dflash_export.deploy.server import serve

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    a, b, c = free_ports(3)
    cases = [
        (dict(http_port=a, grpc_port=a, metrics_port=c), "--grpc-port: "),
        (dict(http_port=a, grpc_port=b, metrics_port=a), "--metrics-port: "),
        (dict(http_port=0, grpc_port=b, metrics_port=c), "--http-port: must be in 1..65535"),
        (dict(http_port=a, grpc_port=70000, metrics_port=c), "--grpc-port: must be in 1..65535"),
        (dict(http_port=busy, grpc_port=b, metrics_port=c), f"--http-port: port {busy} is already in use"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="999.1.1.1"), "--host: not a valid IPv4 address"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="::1"), "--host: "),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="no-such-host.invalid"), "--host: cannot resolve"),
        (dict(http_port=a, grpc_port=b, metrics_port=c, host="192.0.2.1"), "--host: 192.0.2.1 is not an address"),
    ]
    try:
        for kwargs, msg in cases:
            with pytest.raises(DFlashError) as e:
                serve(small_repo, **kwargs)
            assert msg in str(e.value) and e.value.exit_code == 2, (kwargs, str(e.value))
    finally:
        held.close()
    assert pids_mentioning(str(small_repo)) == []


def test_serve_cli_refuses_a_directory_deploy_did_not_write(tmp_path):
    (tmp_path / "empty").mkdir()
    r = cli("serve", "--repo", tmp_path / "empty")
    assert_one_line(r, f"{tmp_path / 'empty'}: --repo: not a model repository")
    r = cli("serve", "--repo", tmp_path / "empty", "--http-port", 18000, "--grpc-port", 18000, "--metrics-port", 18000)
    assert_one_line(r)  # the repository is checked first; either way one line, nothing started
    assert pids_mentioning(str(tmp_path / "empty")) == []


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
    assert type(e) is ServerError and e.exit_code == 1 and "failed to start HTTP service" in str(e)


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
    proc = _serve_cli(repo, http, grpc, metrics)
    try:
        line = _ready_line(proc)
        assert line.startswith("ready:"), line
        assert pids_mentioning(str(repo)) != []
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pids_mentioning(str(repo)):
        time.sleep(0.2)
    assert pids_mentioning(str(repo)) == [], "tritonserver outlived the killed serve"


# ----------------------------------------------------------------------------------------------------------------------
# Engine files: every file listed and hashed; graphs are what the manifest says


def _rehash(engine: Path) -> None:
    """Recompute every hash of the manifest (what an attacker who edits files would do)."""
    from dflash_export.files import sha256_file

    m = json.loads((engine / "manifest.json").read_text())
    m["files"] = {rel: sha256_file(engine / rel) for rel in m["files"]}
    edit_manifest(engine, files=m["files"])


def _ort_engine(engine_dir, dst):
    if json.loads((engine_dir / "manifest.json").read_text())["backend"] != "onnxruntime":
        pytest.skip("no ONNX Runtime engine in this environment")
    return copy_engine(engine_dir, dst)


def test_a_file_dropped_from_the_manifest_is_refused_not_trusted(tmp_path, engine_dir):
    engine = _ort_engine(engine_dir, tmp_path / "engine")
    files = json.loads((engine / "manifest.json").read_text())["files"]
    data = next(rel for rel in files if rel.startswith("target") and rel.endswith(".data"))
    edit_manifest(engine, files={k: v for k, v in files.items() if k != data})
    (engine / data).write_bytes(b"\0" * (engine / data).stat().st_size)
    r = cli("run", "--engine", engine, "--max-new-tokens", "4", "hello")
    assert_one_line(r, f"{engine / data}: files: not listed in the manifest")
    with pytest.raises(DFlashError, match="not listed in the manifest"):
        write_repository(engine, tmp_path / "repo")
    # An extra file next to the graphs (whatever its name) is refused the same way; so is a listed one removed.
    (engine / data).unlink()
    edit_manifest(engine, files=files)
    assert_one_line(cli("run", "--engine", engine, "hello"), f"{engine / data}: files: file listed in the manifest "
                                                              "is missing")


def test_edited_shapes_and_swapped_graphs_are_named_errors(tmp_path, engine_dir):
    engine = _ort_engine(engine_dir, tmp_path / "engine")
    shapes = json.loads((engine / "manifest.json").read_text())["shapes"]
    edit_manifest(engine, shapes={**shapes, "target_kv_heads": shapes["target_kv_heads"] + 1})
    assert_one_line(cli("run", "--engine", engine, "--max-new-tokens", "4", "hello"),
                    "manifest.json: shapes.target_kv_heads: manifest says")
    edit_manifest(engine, shapes={**shapes, "drafter_layers": shapes["drafter_layers"] + 1})
    assert_one_line(cli("run", "--engine", engine, "--max-new-tokens", "4", "hello"),
                    "manifest.json: shapes.drafter_layers: manifest says")
    edit_manifest(engine, shapes=shapes)
    # Swap the drafter and the LM head (and their external data), hashes recomputed.
    for a, b in (("drafter.onnx", "lm_head.onnx"),):
        (engine / a).rename(engine / "swap")
        (engine / b).rename(engine / a)
        (engine / "swap").rename(engine / b)
    _rehash(engine)
    r = cli("run", "--engine", engine, "--max-new-tokens", "4", "hello")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert "graphs swapped or replaced" in r.stderr or "cannot load the graph" in r.stderr, r.stderr


def test_deploy_copies_engine_files_never_hard_links(tmp_path, engine_dir):
    engine = copy_engine(engine_dir, tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo", decoupled=False)
    for f in engine.iterdir():
        served = repo / "dflash" / "engine" / f.name
        assert served.stat().st_ino != f.stat().st_ino and served.stat().st_nlink == 1, f
    victim = next(f for f in engine.iterdir() if f.name != "manifest.json")
    before = (repo / "dflash" / "engine" / victim.name).read_bytes()
    with open(victim, "r+b") as fh:  # edit in place, as an editor or a rebuild writing into the file would
        fh.write(b"\x00\x01\x02")
    assert (repo / "dflash" / "engine" / victim.name).read_bytes() == before


# ----------------------------------------------------------------------------------------------------------------------
# Hostile requests and faults: the front before tritonserver, cancellation, crashes, drain, leftovers


def post_raw(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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
    ({"text_input": "hi", "max_tokens": 4294967304}, "max_tokens: prompt (2 tokens) + max_tokens (4294967304)"),
    ({"text_input": "hi", "max_tokens": 2 ** 31}, "max_tokens: prompt (2 tokens) + max_tokens (2147483648)"),
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
        assert e.code == 403
    status, body = post_json(f"{server.http_url}/v2/repository/index", {})
    assert status == 404 and "not served" in body["error"]
    assert urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10).status == 200


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """The tiny pair with room for 4000 new tokens: a generation that lasts seconds, so a drop lands mid-way."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    d = tmp_path_factory.mktemp("long")
    text = (ROOT / "recipes" / "tiny-qwen3.yaml").read_text().replace("max_seq_len: 512", "max_seq_len: 4096")
    (d / "tiny-long.yaml").write_text(text.replace("name: tiny-qwen3", "name: tiny-long"))
    return build_onnxruntime(load_recipe(d / "tiny-long.yaml"), d / "engine")


def _send_and_drop(port: int, path: str, body: dict, after_s: float, after_first_bytes: bool = False) -> None:
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
        _send_and_drop(srv.http_port, path, long_body, max(0.5, 0.1 * whole),
                       after_first_bytes=model == "dflash_stream")
        t0 = time.monotonic()
        status, _ = post_json(srv.http_url + path, {"text_input": "next", "max_tokens": 8})
        waited = time.monotonic() - t0
        assert status == 200
        assert waited < 0.25 * whole, f"waited {waited:.2f} s behind a dropped client (whole run {whole:.2f} s)"
        deadline = time.monotonic() + 10
        while "dflash-cancel: the client" not in srv.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        # The front's cancel file ("the client went away") or Triton's own cancellation, whichever the model saw first.
        assert re.search(r"dflash-cancel: the client (went away|cancelled the request); noticed -?\d+ ms after it, "
                         r"mid-generation", srv.log_text()), srv.log_text()[-2000:]


def _tritonserver_pid(repo: Path) -> int:
    pids = [p for p in pids_mentioning(str(repo))
            if b"tritonserver" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0]]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.server
def test_serve_restarts_a_crashed_tritonserver_and_clears_what_it_left(tmp_path, engine_dir):
    repo = write_repository(engine_dir, tmp_path / "repo", decoupled=False)
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "serve", "--repo", str(repo), "--http-port",
                             str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{http}/v2/models/dflash/generate"
    try:
        assert _ready_line(proc).startswith("ready:")
        first = _tritonserver_pid(repo)
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
        assert _tritonserver_pid(repo) != first
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
    try:
        assert _ready_line(proc).startswith("ready:")
        workers = [threading.Thread(target=lambda k=k, n=n: results.__setitem__(k, post_json(url, {
            "text_input": k, "max_tokens": n}, timeout=120))) for k, n in (("long", 3000), ("short", 40))]
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
    assert results["short"][0] == 200 and results["short"][1]["completion_tokens"] == 40
    if code == 0:
        assert results["long"][0] == 200 and results["long"][1]["completion_tokens"] == 3000
    else:
        status, body = results["long"]
        assert status == 503 and "shutting down" in body["error"], results["long"]
        assert "the drain did not complete: 1 request(s)" in proc.stderr.read()
    assert pids_mentioning(str(repo)) == []


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
    """benchmarks/soak.py --short: 4 clients for 20 s of good, hostile and dropped requests against `serve` on the
    tiny engine; every served output equals its direct run, every bad request gets its 4xx, no crash, no 5xx."""
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["requests"] > 50 and res["by_kind"].get("bad", 0) > 0 and res["drops"] > 0
    assert res["wrong_outputs"] == res["unexpected_statuses"] == res["http_5xx"] == res["server_restarts"] == 0


def test_deploy_records_the_request_limits_serve_applies(tmp_path):
    from dflash_export.deploy.front import Limits, Refused, parse_json_bounded

    engine = make_torch_engine_dir(tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo", max_body_bytes=4096, max_json_depth=4)
    assert json.loads((repo / MARKER).read_text())["limits"] == {"max_body_bytes": 4096, "max_json_depth": 4}
    with pytest.raises(DFlashError, match="--max-json-depth: must be in 2..256"):
        write_repository(engine, tmp_path / "repo2", max_json_depth=1)
    assert not (tmp_path / "repo2").exists()
    assert Limits(4096, 4).check().max_json_depth == 4
    # The depth scan ignores brackets inside strings and counts objects and arrays alike.
    assert parse_json_bounded(b'{"a": "[[[[[[[[", "b": [[1]]}', 4) == {"a": "[[[[[[[[", "b": [[1]]}
    with pytest.raises(Refused, match="nested deeper than 4 levels"):
        parse_json_bounded(b'{"a": [{"b": [[1]]}]}', 4)
