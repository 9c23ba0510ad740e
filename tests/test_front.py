"""The HTTP front (deploy/front.py) in-process, against a stand-in upstream that speaks Triton's generate protocol:
framing, limits, deadlines, connection caps, cancellation, the OpenAI shapes. No tritonserver: these run in seconds
(the same guarantees against the real server: tests/test_deploy_server.py, tests/test_openai_server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from dflash_export.deploy.connection import Limits
from dflash_export.deploy.front import Front
from dflash_export.deploy.upstream import CANCEL_PARAMETER, SECRET_HEADER


class Upstream:
    """Answers generate with the prompt reversed; `hold_s` makes it wait (polling the cancel file) first."""

    def __init__(self, cancel_dir: Path):
        self.cancel_dir = cancel_dir
        self.hold_s = 0.0
        self.refuse: dict[int, float] = {}  # seed -> seconds after which a call with it is refused (400)
        self.fail: dict[int, tuple[int, dict]] = {}  # seed -> (status, body) a call with it is answered at once
        self.stream_error: dict[int, str] = {}  # seed -> error event a streamed answer ends with, after its first
        self.seen: list[dict] = []
        self.cancelled: list[str] = []
        up = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _hold(self, token, hold_s=None):
                end = time.monotonic() + (up.hold_s if hold_s is None else hold_s)
                while time.monotonic() < end:
                    if (up.cancel_dir / token).exists():
                        up.cancelled.append(token)
                        return True
                    time.sleep(0.02)
                return False

            def do_POST(self):
                assert self.headers.get(SECRET_HEADER)
                data = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(data[:int(self.headers.get("Inference-Header-Content-Length") or len(data))])
                up.seen.append(body)
                token = body.get(CANCEL_PARAMETER) or body.get("parameters", {}).get(CANCEL_PARAMETER)
                if body.get("seed") in up.fail:
                    return self._send(*up.fail[body["seed"]])
                refused = body.get("seed") in up.refuse
                if self._hold(token, up.refuse[body["seed"]] if refused else None):
                    return self._send(400, {"error": "cancelled: the client went away"})
                if refused:
                    return self._send(400, {"error": "text_input: prompt is 9 tokens; this engine takes at most 4"})
                if self.path.endswith("/infer"):  # its text input (as JSON data) as a generate body's
                    body = {"text_input": next(t["data"][0] for t in body["inputs"] if t["name"] == "text_input")}
                text = (body.get("text_input") or json.dumps(body.get("messages")))[::-1][:body.get("max_tokens", 8)]
                out = {"text_output": text, "finish_reason": "length", "completion_tokens": len(text),
                       "prompt_tokens": 5, "accepted_tokens": 3, "drafted_tokens": 4, "acceptance_length": 2.0,
                       "step_stats": json.dumps({"acceptance_lengths": [2, 2], "draft_s": 0.01, "verify_s": 0.02,
                                                 "admission_wait_s": 0.3, "kv_token_limit": 384})}
                if self.path.endswith("/infer"):
                    return self._send_infer(out, body.get("parameters", {}).get("binary_data_output", False))
                if self.path.endswith("generate_stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i, ch in enumerate(text):
                        last = i == len(text) - 1
                        ev = {**out, "text_output": ch, "finish_reason": "length" if last else "",
                              "completion_tokens": i + 1, "step_stats": out["step_stats"] if last else ""}
                        if i == 1 and body.get("seed") in up.stream_error:
                            ev = {"error": up.stream_error[body["seed"]]}
                        data = b"data: " + json.dumps(ev).encode() + b"\n\n"
                        if "error" in ev:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self._send(200, out)

            def do_GET(self):
                self._send(200, {"name": "dflash"})

            def _send_infer(self, out, binary):
                """A KServe v2 infer answer of the model's outputs: JSON `data`, or binary tensors after the JSON
                (what tritonclient asks for by default)."""
                types = {"completion_tokens": "INT32", "prompt_tokens": "INT32", "accepted_tokens": "INT32",
                         "drafted_tokens": "INT32", "acceptance_length": "FP32"}
                outputs, tail = [], b""
                for name, value in out.items():
                    t = {"name": name, "datatype": types.get(name, "BYTES"), "shape": [1]}
                    if not binary:
                        outputs.append({**t, "data": [value]})
                        continue
                    raw = np.array([value], {"INT32": np.int32, "FP32": np.float32}[t["datatype"]]).tobytes() \
                        if name in types else len(value.encode()).to_bytes(4, "little") + value.encode()
                    outputs.append({**t, "parameters": {"binary_data_size": len(raw)}})
                    tail += raw
                head = json.dumps({"model_name": "dflash", "model_version": "1", "outputs": outputs}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream" if binary else "application/json")
                if binary:
                    self.send_header("Inference-Header-Content-Length", str(len(head)))
                self.send_header("Content-Length", str(len(head + tail)))
                self.end_headers()
                self.wfile.write(head + tail)

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _QuietServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.port = self.httpd.server_address[1]


class _QuietServer(ThreadingHTTPServer):
    """The stand-in upstream: a connection the front resets (a cancelled or refused request) is not an error here."""

    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def front(tmp_path):
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    f = Front("127.0.0.1", 0, Limits(max_body_bytes=4096, max_connections=16, max_connections_per_client=16,
                                     max_header_bytes=4096, max_url_bytes=1024, header_timeout_s=1.5,
                                     body_timeout_s=1.5, request_timeout_s=3.0), cancel_dir=cancel,
              model_id="tiny", models=("dflash", "dflash_stream"))
    f.start()
    f.port = f._server.sockets[0].getsockname()[1]
    f.set_upstream(up.port)
    f.up = up
    yield f
    f.close()
    up.httpd.shutdown()


def raw(front, data: bytes, timeout: float = 5.0, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", front.port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except socket.timeout:
            pass
        return out


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


def status_of(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1])


def test_generate_and_openai_chat_through_the_front(front):
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "abc", "max_tokens": 3}'))
    assert status_of(resp) == 200 and json.loads(resp.split(b"\r\n\r\n", 1)[1])["text_output"] == "cba"
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    resp = raw(front, post("/v1/chat/completions", body))
    out = json.loads(resp.split(b"\r\n\r\n", 1)[1])
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert front.up.seen[-1]["messages"] == '[{"role": "user", "content": "hi"}]'
    metrics = raw(front, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").decode()
    assert "dflash_acceptance_length_count 4.0" in metrics and "dflash_steps_total 4.0" in metrics
    assert 'dflash_kv_token_limit{model="dflash"} 384.0' in metrics
    assert "dflash_admission_wait_seconds_count 2.0" in metrics
    assert 'dflash_admission_wait_seconds_bucket{le="0.25"} 0.0' in metrics
    assert 'dflash_admission_wait_seconds_bucket{le="0.5"} 2.0' in metrics


def _figures(metrics) -> dict[str, float]:
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.render().decode().splitlines()
            if ln and not ln.startswith("#")}


def test_tau_and_step_means_have_no_value_while_no_step_finished_in_the_window(monkeypatch):
    """dflash_tau and dflash_step_seconds are means over the recent window's steps: with none (an idle server, or
    only generations of one token) they read NaN, Prometheus' no value, never a tau of 0; the token rate reads 0."""
    import math

    from dflash_export.deploy import metrics as metrics_module
    from dflash_export.deploy.metrics import FrontMetrics

    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    m = FrontMetrics(window_s=60)
    means = ("dflash_tau", 'dflash_step_seconds{phase="draft"}', 'dflash_step_seconds{phase="verify"}')
    got = _figures(m)
    assert all(math.isnan(got[k]) for k in means) and got["dflash_tokens_per_second"] == 0, got
    m.observe_generation(1, 3, {"acceptance_lengths": []})  # one token: the prefill's, no step
    assert all(math.isnan(_figures(m)[k]) for k in means)
    m.observe_generation(7, 3, {"acceptance_lengths": [4, 2], "draft_s": 0.5, "verify_s": 1.5})
    got = _figures(m)
    assert got["dflash_tau"] == 3 and got['dflash_step_seconds{phase="verify"}'] == 0.75, got
    clock[0] += 61  # the window passed: no step in it
    got = _figures(m)
    assert all(math.isnan(got[k]) for k in means) and got["dflash_tokens_per_second"] == 0, got


def test_metrics_show_the_kv_bound_and_admission_waits_and_skip_malformed_figures():
    """dflash_kv_token_limit is the bound the last generation on the model reported (0: unbounded; a generation
    that reports none leaves it); dflash_admission_wait_seconds holds each generation's wait. Figures of the wrong
    type, negative, not finite or too large are left out, the generation's other figures still counted, and /metrics
    renders."""
    from dflash_export.deploy.metrics import FrontMetrics
    from dflash_export.deploy.upstream import Upstream as Front

    m = FrontMetrics()
    KV_DFLASH = 'dflash_kv_token_limit{model="dflash"}'
    m.observe_generation(9, 5, {"acceptance_lengths": [3, 2], "admission_wait_s": 0.02, "kv_token_limit": 4096},
                         "dflash")
    m.observe_generation(4, 5, {"acceptance_lengths": [3], "admission_wait_s": 1.5, "kv_token_limit": 0}, "dflash")
    got = _figures(m)
    assert got[KV_DFLASH] == 0 and got["dflash_admission_wait_seconds_count"] == 2
    assert got["dflash_admission_wait_seconds_sum"] == pytest.approx(1.52)
    assert got['dflash_admission_wait_seconds_bucket{le="0.025"}'] == 1
    m.observe_generation(1, 1, {"acceptance_lengths": []}, "dflash")  # no wait, no bound reported: neither moves
    m.observe_generation(2, 1, {"kv_token_limit": 768, "admission_wait_s": 0}, "dflash")
    got = _figures(m)
    assert got[KV_DFLASH] == 768 and got["dflash_admission_wait_seconds_count"] == 3
    hostile = [{"admission_wait_s": w, "kv_token_limit": k, "draft_s": w, "verify_s": k, "drafted_tokens": k,
                "accepted_tokens": w, "acceptance_lengths": [k, True, -1, 2, "3", 1e400]}
               for w, k in [("1", "9"), (-1.0, -5), (float("nan"), True), (float("inf"), 10 ** 400),
                            (10 ** 400, 2.5), (None, [1]), ({}, {"a": 1})]]
    for stats in hostile:
        m.observe_generation(1, 10 ** 400, stats, "dflash")
    for stats in ({"acceptance_lengths": 7}, {"acceptance_lengths": "22"}, [1, 2], "x", None):
        m.observe_generation(1, 1, stats)
    after = _figures(m)
    assert after[KV_DFLASH] == 768 and after["dflash_admission_wait_seconds_count"] == 3
    assert after["dflash_draft_seconds_total"] == got["dflash_draft_seconds_total"]
    assert after["dflash_drafted_tokens_total"] == got["dflash_drafted_tokens_total"]
    assert after["dflash_steps_total"] == got["dflash_steps_total"] + len(hostile)  # each one's valid length 2
    assert after["dflash_generated_tokens_total"] == got["dflash_generated_tokens_total"] + len(hostile) + 5
    assert after["dflash_prompt_tokens_total"] == got["dflash_prompt_tokens_total"] + 5

    class Recording(Front):  # the front's recording of an upstream answer, without its connections
        metrics = m

    for answer in ({"completion_tokens": 1e400, "prompt_tokens": "7", "step_stats": '{"kv_token_limit": 1e400}'},
                   {"completion_tokens": 2, "step_stats": "[" * 100000}, {"step_stats": '{"kv_token_limit": 512}'}):
        Recording()._observe(json.dumps(answer).encode() if "step_stats" in answer else answer, "dflash")
    assert _figures(m)[KV_DFLASH] == 512


def _scrape(front) -> dict[str, float]:
    """/metrics as the Prometheus parser reads it: {sample name: value} of the unlabelled samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = raw(front, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").split(b"\r\n\r\n", 1)[1]
    return {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples if not s.labels}


def _series(front, name: str) -> dict[tuple, float]:
    """/metrics' samples of `name` as the Prometheus parser reads them: {sorted (label, value) pairs: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = raw(front, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").split(b"\r\n\r\n", 1)[1]
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == name}


def test_batch_occupancy_is_each_models_requests_over_its_own_batch(tmp_path):
    """dflash and dflash_stream batch apart, each in its own instances (instances x max batch sequences, here 2):
    dflash_batch_occupancy has one series per model, that model's requests in flight over its own 2, and no series
    without the label or for a model name a request made up (it counts in dflash_requests_in_flight alone). One
    generate on dflash, an OpenAI stream of 2 choices on dflash_stream and one generate on `made_up` in flight:
    dflash 1/2, dflash_stream 2/2, 4 in flight; all back to 0 once answered."""
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    up.hold_s = 2.0
    f = Front("127.0.0.1", 0, Limits(request_timeout_s=30.0), cancel_dir=cancel, model_id="tiny",
              models=("dflash", "dflash_stream"), capacity=2).start()
    f.port = f._server.sockets[0].getsockname()[1]
    f.set_upstream(up.port)
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
                       "stream": True}).encode()
    calls = [post("/v2/models/dflash/generate", b'{"text_input": "abc"}'), post("/v1/chat/completions", chat),
             post("/v2/models/made_up/generate", b'{"text_input": "abc"}')]
    threads = [threading.Thread(target=raw, args=(f, c)) for c in calls]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while _scrape(f).get("dflash_requests_in_flight") != 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _scrape(f)["dflash_requests_in_flight"] == 4
        assert _series(f, "dflash_batch_occupancy") == {(("model", "dflash"),): 0.5,
                                                        (("model", "dflash_stream"),): 1.0}
        for t in threads:
            t.join(timeout=10)
        assert _series(f, "dflash_batch_occupancy") == {(("model", "dflash"),): 0, (("model", "dflash_stream"),): 0}
        assert _scrape(f)["dflash_requests_in_flight"] == 0
    finally:
        f.close()
        up.httpd.shutdown()


def test_kv_token_limit_is_the_bound_of_the_model_that_answered(tmp_path):
    """Each model's instances work out their own K/V bound when they load (the memory then available):
    dflash_kv_token_limit is per model, the bound the last generation finished on that model reported, whichever
    route (generate, generate_stream, an OpenAI request on either model) relayed it; no series for a model none of
    whose generations has finished, nor without the label."""
    from dflash_export.deploy.metrics import FrontMetrics

    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    f = Front("127.0.0.1", 0, cancel_dir=cancel, model_id="tiny", models=("dflash", "dflash_stream")).start()
    f.port = f._server.sockets[0].getsockname()[1]
    f.set_upstream(up.port)
    try:
        assert _series(f, "dflash_kv_token_limit") == {}
        assert status_of(raw(f, post("/v2/models/dflash/generate", b'{"text_input": "abc"}'))) == 200
        assert _series(f, "dflash_kv_token_limit") == {(("model", "dflash"),): 384}
        assert status_of(raw(f, post("/v2/models/made_up/generate", b'{"text_input": "abc"}'))) == 200
        assert _series(f, "dflash_kv_token_limit") == {(("model", "dflash"),): 384}
        chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "stream": True}).encode()
        assert status_of(raw(f, post("/v1/chat/completions", chat))) == 200
        assert _series(f, "dflash_kv_token_limit") == {(("model", "dflash"),): 384,
                                                       (("model", "dflash_stream"),): 384}
    finally:
        f.close()
        up.httpd.shutdown()
    m = FrontMetrics(models=("dflash", "dflash_stream"))
    m.observe_generation(3, 2, {"acceptance_lengths": [2], "kv_token_limit": 4096}, "dflash")
    m.observe_generation(3, 2, {"acceptance_lengths": [2], "kv_token_limit": 1024}, "dflash_stream")
    m.observe_generation(3, 2, {"acceptance_lengths": [2], "kv_token_limit": 0}, "dflash")
    m.observe_generation(3, 2, {"acceptance_lengths": [2], "kv_token_limit": 7}, "made_up")
    m.observe_generation(3, 2, {"acceptance_lengths": [2], "kv_token_limit": 9})  # no model known: no series
    got = _figures(m)
    assert {k: v for k, v in got.items() if k.startswith("dflash_kv_token_limit")} == {
        'dflash_kv_token_limit{model="dflash"}': 0, 'dflash_kv_token_limit{model="dflash_stream"}': 1024}
    assert got["dflash_steps_total"] == 5  # every generation's other figures are counted


def test_histogram_buckets_reach_the_block_and_the_request_timeout():
    """A step adds at most a block of tokens and a request waits to join a batch at most the request timeout (it is
    answered 504 past it, its wait never observed): dflash_acceptance_length's buckets reach the engine's block (16
    at least, every length to 64, then doubling) and dflash_admission_wait_seconds' the timeout, so that no length
    or wait the deployment can report falls in +Inf alone. The front sizes them from its block and its timeout."""
    import math

    from dflash_export.deploy.metrics import FrontMetrics

    def bounds(m, name):
        return [float(k.split('le="')[1].rstrip('"}')) for k in _figures(m) if k.startswith(name + "_bucket")]

    m = FrontMetrics(block_size=32, request_timeout_s=600.0)
    m.observe_generation(40, 5, {"acceptance_lengths": [32, 7], "admission_wait_s": 450.0})
    got = _figures(m)
    assert got['dflash_acceptance_length_bucket{le="31.0"}'] == 1
    assert got['dflash_acceptance_length_bucket{le="32.0"}'] == 2
    assert got['dflash_admission_wait_seconds_bucket{le="300.0"}'] == 0
    assert got['dflash_admission_wait_seconds_bucket{le="600.0"}'] == 1
    assert bounds(m, "dflash_admission_wait_seconds")[-2:] == [600.0, math.inf]
    assert bounds(FrontMetrics(block_size=4), "dflash_acceptance_length") == [*range(1, 17), math.inf]
    assert bounds(FrontMetrics(block_size=300), "dflash_acceptance_length") == [*range(1, 65), 128, 256, 300,
                                                                                  math.inf]
    assert bounds(FrontMetrics(request_timeout_s=5.0), "dflash_admission_wait_seconds")[-2:] == [120.0, math.inf]
    assert bounds(FrontMetrics(request_timeout_s=86400.0), "dflash_admission_wait_seconds")[-2:] == [86400.0,
                                                                                                   math.inf]
    f = Front("127.0.0.1", 0, Limits(request_timeout_s=1000.0), block_size=20)  # not started: its metrics
    assert bounds(f.metrics, "dflash_acceptance_length")[-2:] == [20.0, math.inf]
    assert bounds(f.metrics, "dflash_admission_wait_seconds")[-2:] == [1800.0, math.inf]


@pytest.mark.parametrize("models", [("dflash", "dflash_stream"), ("dflash",)])
def test_every_generation_is_counted_once_whichever_route_and_model_answers_it(tmp_path, models):
    """Each generation the front relays is recorded once in /metrics: a streamed OpenAI answer also where no
    streaming model is deployed (deploy --no-stream: the front streams the whole answer as one event), and an /infer
    answer, its outputs as JSON or as the binary tensors tritonclient asks for. The stand-in's generations each take
    2 steps (acceptance lengths [2, 2])."""
    import tritonclient.http as th

    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    f = Front("127.0.0.1", 0, cancel_dir=cancel, model_id="tiny", models=models).start()
    f.port = f._server.sockets[0].getsockname()[1]
    f.set_upstream(up.port)
    try:
        tokens = 0
        for stream in (False, True):
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               "stream": stream, "stream_options": {"include_usage": True} if stream else None})
            resp = raw(f, post("/v1/chat/completions", body.replace(', "stream_options": null', "").encode()))
            assert status_of(resp) == 200
            tokens += 4
        cli = th.InferenceServerClient(f"127.0.0.1:{f.port}")
        try:
            text = th.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_), binary_data=False)
            binary = cli.infer("dflash", [text])  # outputs as binary tensors
            as_json = cli.infer("dflash", [text], outputs=[th.InferRequestedOutput(n, binary_data=False) for n in
                                                           ("text_output", "completion_tokens", "step_stats")])
        finally:
            cli.close()
        for res in (binary, as_json):
            assert res.as_numpy("text_output")[0] in (b"olleh", "olleh")  # binary: bytes; JSON: str
            tokens += int(res.as_numpy("completion_tokens")[0])
        got = _scrape(f)
        assert got["dflash_generated_tokens_total"] == tokens == 18
        assert got["dflash_steps_total"] == got["dflash_acceptance_length_count"] == 2 * 4
        assert got["dflash_acceptance_length_sum"] == 4 * 4 and got["dflash_tau"] == 2
    finally:
        f.close()
        up.httpd.shutdown()


def test_openai_stream_ends_with_done_and_usage(front):
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    resp = raw(front, post("/v1/completions", body))
    events = [ln[6:] for ln in resp.decode().split("\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "olleh"
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []
    assert front.up.seen[-1]["apply_chat_template"] is False  # completions are raw text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_tokens_so_far_on_every_chunk(front, path):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries the usage so far (the
    stand-in engine streams one character a token, 5 prompt tokens); the last chunk of its own, the total."""
    ask = {"model": "tiny", "max_tokens": 4, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ask |= {"prompt": "hello"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    resp = raw(front, post(path, json.dumps(ask).encode()))
    chunks = [json.loads(ln[6:]) for ln in resp.decode().split("\n") if ln.startswith("data: {")]
    text = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                   c["choices"][0].get("delta", {}).get("content"))]
    assert [c["usage"]["completion_tokens"] for c in text] == [1, 2, 3, 4]
    assert all(c["usage"]["prompt_tokens"] == 5 and "usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 9
    # without it, only the last chunk has usage
    ask["stream_options"] = {"include_usage": True}
    resp = raw(front, post(path, json.dumps(ask).encode()))
    chunks = [json.loads(ln[6:]) for ln in resp.decode().split("\n") if ln.startswith("data: {")]
    assert ["usage" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]


def _events(resp: bytes) -> list:
    """The JSON events of a server-sent-events answer, and "[DONE]"."""
    return [json.loads(ln[6:]) if ln != "data: [DONE]" else "[DONE]" for ln in resp.decode().split("\n")
            if ln.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_are_n_generate_calls_answered_together(front, path):
    """`n` choices: n generate calls (choice i with the seed derived from the request's: choice 0 its own), one
    answer with choices 0..n-1, the prompt counted once in its usage and every choice's tokens summed; each call's
    generation is counted in /metrics. Without a seed no call is given one (each draws its own)."""
    from dflash_export.decoding.request import choice_seed

    ask = {"model": "tiny", "max_tokens": 4, "n": 3, "seed": 11, "temperature": 0.7}
    ask |= {"prompt": "hello"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    before = _scrape(front).get("dflash_generated_tokens_total", 0)
    resp = raw(front, post(path, json.dumps(ask).encode()))
    assert status_of(resp) == 200
    out = json.loads(resp.split(b"\r\n\r\n", 1)[1])
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    texts = [c["message"]["content"] if "chat" in path else c["text"] for c in out["choices"]]
    assert len(set(texts)) == 1 and len(texts[0]) == 4  # the stand-in answers the reversed prompt
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert sorted(b["seed"] for b in front.up.seen) == sorted(choice_seed(11, i) for i in range(3))
    assert len({b[CANCEL_PARAMETER] for b in front.up.seen}) == 3
    assert _scrape(front)["dflash_generated_tokens_total"] == before + 12
    assert front.in_flight() == 0
    front.up.seen.clear()
    del ask["seed"]
    assert status_of(raw(front, post(path, json.dumps(ask).encode()))) == 200
    assert len(front.up.seen) == 3 and not any("seed" in b for b in front.up.seen)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_streamed_choices_interleave_and_end_with_one_usage_and_one_done(front, path):
    """A stream of n choices: every chunk names its choice, each choice's text joins to its answer and ends with its
    finish_reason; with continuous_usage_stats every chunk carries the usage so far (the prompt once, the tokens of
    every choice so far: never decreasing), and after the last choice finishes one usage chunk with the totals, then
    one [DONE]."""
    ask = {"model": "tiny", "max_tokens": 4, "n": 3, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ask |= {"prompt": "hello"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    events = _events(raw(front, post(path, json.dumps(ask).encode())))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12,
                                                                   "total_tokens": 17}
    assert sum(1 for c in chunks if not c["choices"]) == 1
    texts, reasons = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        piece = choice.get("text") if "chat" not in path else choice["delta"].get("content")
        texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1 and len(texts[0]) == 4
    assert reasons == {0: "length", 1: "length", 2: "length"}
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
    if "chat" in path:  # each choice opens with its role
        assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]
                      ) == [0, 1, 2]
    assert front.in_flight() == 0 and front.counts["forwarded"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_completion_prompts_answers_n_choices_of_each_in_order(front, stream):
    """A completion's `prompt` may be a batch (a list of strings or of token-id lists): choice j of prompt k is
    choice k x n + j, each its own generate call with the seed choice j of a one-prompt request gets; usage counts
    each prompt once (the stand-in reports 5 tokens a prompt) and every choice's tokens, streamed or not."""
    from dflash_export.decoding.request import choice_seed

    ask = {"model": "tiny", "prompt": ["hello", "abc"], "max_tokens": 4, "n": 2, "seed": 3, "stream": stream,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True} if stream else None}
    resp = raw(front, post("/v1/completions", json.dumps({k: v for k, v in ask.items() if v is not None}).encode()))
    assert status_of(resp) == 200
    want_usage = {"prompt_tokens": 10, "completion_tokens": 14, "total_tokens": 24}
    if stream:
        events = _events(resp)
        assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == want_usage
        texts = ["", "", "", ""]
        for c in events[:-2]:
            texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
        prompts_so_far = [c["usage"]["prompt_tokens"] for c in events[:-1]]
        assert prompts_so_far == sorted(prompts_so_far) and prompts_so_far[-1] == 10
    else:
        out = json.loads(resp.split(b"\r\n\r\n", 1)[1])
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and out["usage"] == want_usage
        texts = [c["text"] for c in out["choices"]]
    assert texts == ["olle", "olle", "cba", "cba"]  # the stand-in answers the reversed prompt
    seen = sorted((b["text_input"], b["seed"]) for b in front.up.seen)
    assert seen == sorted((p, choice_seed(3, j)) for p in ("hello", "abc") for j in range(2))
    assert front.in_flight() == 0


@pytest.mark.parametrize("prompt, n, param", [
    (["a"] * 17, 1, "prompt"),          # more answers than a request may ask for
    (["a"] * 5, 4, "prompt"),
    (["a", ""], 1, "prompt[1]"),       # an empty prompt in a batch is named by its place
    ([[1, 2], [3, "x"]], 1, "prompt[1]"),
    ([], 1, "prompt"),
])
def test_a_bad_batch_of_completion_prompts_gets_one_400_naming_it(front, prompt, n, param):
    resp = raw(front, post("/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "n": n}).encode()))
    assert status_of(resp) == 400
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["param"] == param and not front.up.seen


@pytest.mark.parametrize("prompt, param, says", [
    (["hi", [1, 2, 3]], "prompt[1]", "a list among strings"),
    ([[1, 2], "hi", [3]], "prompt[1]", "a string among token-id lists"),
    ([1, 2, "x"], "prompt[2]", "a string among token ids"),
    ([5, [6]], "prompt[1]", "a list among token ids"),
    ([5, True], "prompt[1]", "a boolean among token ids"),
    (["a", "b", 3], "prompt[2]", "an integer among strings"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_list_mixing_strings_token_ids_and_lists_gets_one_400_naming_its_first_odd_element(
        front, prompt, param, says, stream):
    """OpenAI's prompt is a string, a list of strings, a list of token ids or a list of token-id lists: a list
    mixing them is one 400 naming its first element of another kind than its first, and nothing reaches the
    engine."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream}
    resp = raw(front, post("/v1/completions", json.dumps(body).encode()))
    assert status_of(resp) == 400
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: {says}: "), err
    assert err["type"] == "invalid_request_error" and not front.up.seen


@pytest.mark.parametrize("stream", [False, True])
def test_a_dropped_n_choice_request_cancels_every_call(front, stream):
    """A client that leaves an n = 3 request (streamed or not) while its calls run has all 3 cancelled in the
    engine, counted as one client gone; while they run they are 3 requests in flight (3 units of the engine's work,
    as 3 requests of one choice would be)."""
    front.up.hold_s = 5.0
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3,
                       "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", front.port))
    s.sendall(post("/v1/chat/completions", body))
    t = time.monotonic()
    while len(front.up.seen) < 3 and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert len(front.up.seen) == 3 and front.in_flight() == 3
    s.close()
    t = time.monotonic()
    while len(front.up.cancelled) < 3 and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert sorted(front.up.cancelled) == sorted(b[CANCEL_PARAMETER] for b in front.up.seen)
    assert front.counts["client_gone"] == 1
    t = time.monotonic()
    while front.in_flight() and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert front.in_flight() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_one_refused_choice_is_the_request_s_one_error_and_cancels_the_others(front, stream):
    """A choice the model refuses before any choice has answered makes the whole request that error (one 400 naming
    the field, streamed or not), and the other calls, still running, are cancelled."""
    from dflash_export.decoding.request import choice_seed

    front.up.hold_s = 5.0
    front.up.refuse = {choice_seed(3, 1): 0.3}
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 3, "seed": 3, "stream": stream}).encode()
    t = time.monotonic()
    resp = raw(front, post("/v1/completions", body))
    assert status_of(resp) == 400 and time.monotonic() - t < 3
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["param"] == "prompt" and "9 tokens" in err["message"]
    t = time.monotonic()
    while len(front.up.cancelled) < 2 and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert len(front.up.cancelled) == 2 and front.in_flight() == 0 and front.counts["client_gone"] == 0


def test_a_choice_refused_after_the_stream_started_ends_it_with_one_error_event(front):
    """Once a stream has started (another choice answered first), a refused choice ends it with an error event in
    OpenAI's shape, as a stream of one choice reports an error, then [DONE]."""
    from dflash_export.decoding.request import choice_seed

    front.up.refuse = {choice_seed(5, 2): 0.5}
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 3, "seed": 5, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    resp = raw(front, post("/v1/completions", body))
    assert status_of(resp) == 200
    events = _events(resp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0] is events[-2] and errors[0]["error"]["param"] == "prompt"
    assert not any(e.get("usage") for e in events[:-1])  # no usage chunk: not every choice finished
    assert {c["choices"][0]["index"] for c in events[:-2]} <= {0, 1} and front.in_flight() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_drain_past_its_time_answers_an_n_choice_request_503_once_and_counts_it_once(front, stream):
    """Shutdown past the drain time with an n = 4 request running (streamed or not): its 4 calls are cancelled in
    the engine, its client gets one 503 "shutting down" in OpenAI's shape for a server error (with Retry-After), and
    it counts as one request cancelled at shutdown (what `serve` reports: requests answered 503), not 4."""
    front.up.hold_s = 5.0
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 4, "stream": stream}).encode()
    got = []
    client = threading.Thread(target=lambda: got.append(raw(front, post("/v1/completions", body), timeout=8)))
    client.start()
    t = time.monotonic()
    while len(front.up.seen) < 4 and time.monotonic() - t < 4:
        time.sleep(0.02)
    assert front.drain(0.1, grace_s=5.0) is False
    client.join(8)
    assert got and status_of(got[0]) == 503 and b"Retry-After" in got[0]
    err = json.loads(got[0].split(b"\r\n\r\n", 1)[1])["error"]
    assert "shutting down" in err["message"] and err["type"] == "server_error"
    t = time.monotonic()
    while (len(front.up.cancelled) < 4 or front.in_flight()) and time.monotonic() - t < 4:
        time.sleep(0.02)
    assert sorted(front.up.cancelled) == sorted(b[CANCEL_PARAMETER] for b in front.up.seen)
    assert front.in_flight() == 0 and front.counts["cancelled_at_shutdown"] == 1


@pytest.mark.parametrize("why", ["stub died", "stub not healthy", "queue full"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_the_server_cannot_serve_is_one_503_with_retry_after_and_the_others_are_cancelled(front, why,
                                                                                                    stream):
    """One choice of an n = 3 request that the server cannot serve now (its model's stub died: failed by `serve`'s
    health poll, or answered by tritonserver as an instance that is not healthy; the engine's queue is full) makes
    the request one 503 in OpenAI's shape for a server error, with Retry-After (the client retries), and the other
    calls are cancelled."""
    from dflash_export.decoding.request import choice_seed

    front.up.hold_s = 5.0
    if why == "stub not healthy":
        front.up.fail = {choice_seed(3, 1): (400, {"error": "Stub process 'dflash_0_0' is not healthy."})}
    elif why == "queue full":
        front.up.fail = {choice_seed(3, 1): (503, {"error": "Exceeds maximum queue size"})}
    else:
        timer = threading.Timer(0.3, front.fail_model, ("dflash_stream" if stream else "dflash",
                                                        "a model stub of dflash died (pid 4242; its model reloads)"))
        timer.start()
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 3, "seed": 3, "stream": stream}).encode()
    resp = raw(front, post("/v1/completions", body), timeout=8)
    assert status_of(resp) == 503 and b"Retry-After" in resp, resp
    assert json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "server_error"
    t = time.monotonic()
    while (front.in_flight() or (why != "stub died" and len(front.up.cancelled) < 2)) and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert front.in_flight() == 0 and front.counts["client_gone"] == 0
    assert why == "stub died" or len(front.up.cancelled) == 2


def test_a_choice_that_times_out_after_the_stream_started_ends_it_with_a_504_error_event(front):
    """A choice whose engine does not answer within the request timeout, once the other choices have started the
    stream: the stream ends with a 504 error event in OpenAI's shape and [DONE] (as a refused choice ends it), not a
    connection cut mid-stream; the late call is cancelled."""
    from dflash_export.decoding.request import choice_seed

    front.up.refuse = {choice_seed(5, 1): 6.0}  # longer than the 3 s request timeout: answered once cancelled
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 3, "seed": 5, "stream": True}).encode()
    resp = raw(front, post("/v1/completions", body), timeout=8)
    assert status_of(resp) == 200
    events = _events(resp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0] is events[-2]
    assert errors[0]["error"]["type"] == "server_error" and "request-timeout" in errors[0]["error"]["message"]
    assert {c["choices"][0]["index"] for c in events[:-2]} == {0, 2}
    t = time.monotonic()
    while (front.in_flight() or not front.up.cancelled) and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert front.in_flight() == 0 and len(front.up.cancelled) == 1 and front.counts["timed_out"] == 1


def _requests_counted(front) -> dict[tuple[str, str], float]:
    """dflash_requests_total as the Prometheus parser reads /metrics: {(route, code): count}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = raw(front, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").split(b"\r\n\r\n", 1)[1]
    return {(s.labels["route"], s.labels["code"]): s.value for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == "dflash_requests_total"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v2/models/dflash_stream/generate_stream"])
def test_a_stream_that_ends_with_an_error_event_is_counted_under_the_error_s_status(front, path):
    """A stream whose head (200) went out before it failed ends with an error event; /metrics counts the request
    under that error's status, not as a success: an OpenAI stream under the status of the error object it sent (a
    choice refused with 400 after another started the stream), a relayed generate_stream under the engine error's
    (500)."""
    from dflash_export.decoding.request import choice_seed

    if path.startswith("/v1/"):
        front.up.refuse = {choice_seed(5, 2): 0.5}
        body = {"model": "tiny", "prompt": "hello", "n": 3, "seed": 5, "stream": True}
        route, code = "/v1/completions", "400"
    else:
        front.up.stream_error = {5: "internal error: RuntimeError: the engine failed"}
        body = {"text_input": "hello", "max_tokens": 4, "seed": 5}
        route, code = "triton", "500"
    resp = raw(front, post(path, json.dumps(body).encode()))
    assert status_of(resp) == 200
    errors = [e for e in _events(resp) if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1
    counted = _requests_counted(front)
    assert counted.get((route, code)) == 1 and (route, "200") not in counted, counted


def test_a_prompt_of_a_batch_refused_for_its_size_is_named_by_its_place(front):
    front.prompt_char_limit = 100
    body = {"model": "tiny", "prompt": ["x", "y" * 101], "n": 2}
    resp = raw(front, post("/v1/completions", json.dumps(body).encode()))
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert status_of(resp) == 400 and err["param"] == "prompt[1]", err
    assert err["message"].startswith("prompt[1]: prompt text is 101 characters") and front.up.seen == []


@pytest.mark.parametrize("stream, refused_first", [(False, True), (True, True), (True, False)])
def test_the_engine_s_refusal_of_one_prompt_of_a_batch_names_it_by_its_place(front, stream, refused_first):
    """The engine refuses prompt 1 of a batch, text or token ids (too long for it): the refusal names `prompt[1]`,
    as the front's own checks of a batch's prompts do, whether it is the request's one 400 (it came before any
    choice answered) or the error event ending a stream that had started."""
    import io

    answer = front.up.httpd.RequestHandlerClass.do_POST

    def do_post(handler):
        data = handler.rfile.read(int(handler.headers["Content-Length"]))
        body = json.loads(data)
        refused = body.get("text_input") == "long" or body.get("input_ids") == [7, 7, 7]
        if refused != refused_first:
            time.sleep(0.5)
        if refused:
            field = "text_input" if "text_input" in body else "input_ids"
            return handler._send(400, {"error": f"{field}: prompt is 2100 tokens; this engine takes at most 2039"})
        handler.rfile = io.BytesIO(data)
        answer(handler)

    front.up.httpd.RequestHandlerClass.do_POST = do_post
    for prompt in (["short", "long"], [[1, 2], [7, 7, 7]]):
        body = {"model": "tiny", "prompt": prompt, "n": 2, "max_tokens": 4, "stream": stream}
        resp = raw(front, post("/v1/completions", json.dumps(body).encode()))
        if refused_first:
            assert status_of(resp) == 400, resp[:300]
            err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
        else:
            events = _events(resp)
            assert status_of(resp) == 200 and events[-1] == "[DONE]" and "error" in events[-2], events
            err = events[-2]["error"]
        assert err["param"] == "prompt[1]" and err["message"].startswith("prompt[1]: prompt is 2100 tokens"), err
    assert front.in_flight() == 0


def test_closing_with_an_n_choice_request_still_running_leaves_no_task_pending(tmp_path, caplog):
    """A front closed after a drain whose grace ran out, an n = 4 request still waiting on an engine that never
    answers: closing ends the request and every task it started before the loop closes (none is destroyed
    pending, which asyncio logs as an error)."""
    import gc

    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    stop = threading.Event()

    def do_post(handler):  # a stuck engine: reads the request and never answers
        up.seen.append(json.loads(handler.rfile.read(int(handler.headers["Content-Length"]))))
        stop.wait(30)

    up.httpd.RequestHandlerClass.do_POST = do_post
    f = _patient_front(cancel, up)
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 4}).encode()
    client = threading.Thread(target=raw, args=(f, post("/v1/completions", body), 8))
    client.start()
    try:
        t = time.monotonic()
        while len(up.seen) < 4 and time.monotonic() - t < 4:
            time.sleep(0.02)
        loop = f._loop
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            assert f.drain(0.1, grace_s=0.3) is False
            f.close()
            pending = [repr(t)[:200] for t in asyncio.all_tasks(loop)]
            gc.collect()
        assert pending == [] and [r.getMessage()[:300] for r in caplog.records if r.name == "asyncio"] == []
    finally:
        stop.set()
        client.join(10)
        f.close()
        up.httpd.shutdown()


@pytest.mark.parametrize("body, status, param", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2.5}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": "2"}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": True}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400, "bogus"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 10 ** 400}, 400,
     "presence_penalty"),
])
def test_openai_refusals_name_the_field_in_openai_error_shape(front, body, status, param):
    resp = raw(front, post("/v1/chat/completions", json.dumps(body).encode()))
    assert status_of(resp) == status
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]


@pytest.mark.parametrize("request_bytes, status", [
    # two different Content-Lengths
    (b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}", 400),
    # Content-Length with Transfer-Encoding
    (b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n"
     b"\r\n0\r\n\r\n", 400),
    # a body on GET (a request hidden in it must never be answered)
    (b"GET /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: 38\r\n\r\nGET /v2/models/dflash HTTP/1.1\r\n\r\n\r\n", 400),
    (b"PUT /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
    (b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 5000 + b"\r\n\r\n", 431),
    (b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\n\r\n", 411),
    (post("/v2/models/dflash/generate", b'{"text_input": "' + b"x" * 5000 + b'"}'), 413),
    (post("/v2/models/dflash/generate", b'{"id": "\\ud800", "text_input": "x"}'), 400),
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "max_tokens", "datatype": "INT64", "shape": [1], '
                                     b'"data": [1.5]}]}'), 400),
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "seed", "datatype": "UINT64", "shape": [1], '
                                     b'"data": [-1]}]}'), 400),
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "max_tokens", "datatype": "INT64", "shape": [1], '
                                     b'"data": [9223372036854775808]}]}'), 400),
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "stop", "datatype": "BYTES", "shape": [1], '
                                     b'"data": [5]}]}'), 400),
    # well-typed but out of a decoding field's range: refused at the edge, never queued
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "max_tokens", "datatype": "INT64", "shape": [1], '
                                     b'"data": [0]}]}'), 400),
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "top_p", "datatype": "FP32", "shape": [1], '
                                     b'"data": [0]}]}'), 400),
    (post("/v2/models/dflash/generate", b'{"text_input": "x", "temperature": -1}'), 400),
    # an integer too large for a float in an FP32 tensor
    (post("/v2/models/dflash/infer", b'{"inputs": [{"name": "temperature", "datatype": "FP32", "shape": [1], '
                                     b'"data": [1' + b"0" * 400 + b']}]}'), 400),
    (post("/v2/models/dflash/generate", b'{"text_input": "x"}trailing',
          "Inference-Header-Content-Length: 19\r\n"), 400),
])
def test_framing_and_typed_garbage_get_a_4xx_and_nothing_reaches_upstream(front, request_bytes, status):
    resp = raw(front, request_bytes)
    assert status_of(resp) == status, resp[:300]
    assert resp.count(b"HTTP/1.1 ") == 1  # one answer: nothing smuggled in a body was served
    assert front.up.seen == []


def test_head_gets_headers_without_a_body(front):
    resp = raw(front, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = resp.partition(b"\r\n\r\n")
    assert status_of(resp) == 200 and b"content-length: 17" in head.lower() and body == b""


def test_a_trickle_of_slow_clients_cannot_hold_the_door(front):
    # 16 connections (the front's whole cap) each send one byte of a request head and stall.
    slow = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(16)]
    for s in slow:
        s.sendall(b"G")
    time.sleep(0.3)
    t = time.monotonic()
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "ok"}'))
    assert status_of(resp) == 200 and time.monotonic() - t < 2  # the oldest trickle made room
    assert front.counts["evicted"] >= 1
    time.sleep(1.8)  # past the 1.5 s head deadline: every trickle is answered 408 or dropped
    for s in slow:
        s.settimeout(1)
        try:
            got = s.recv(1000)
        except OSError:
            got = b""
        assert got == b"" or got.startswith(b"HTTP/1.1 408")
        s.close()


def test_one_byte_after_the_request_does_not_defeat_cancellation(front):
    front.up.hold_s = 5.0
    s = socket.create_connection(("127.0.0.1", front.port))
    s.sendall(post("/v2/models/dflash/generate", b'{"text_input": "slow"}').replace(b"Connection: close\r\n", b""))
    time.sleep(0.3)
    s.sendall(b"x")  # the start of a pipelined request, then the client leaves
    time.sleep(0.1)
    t = time.monotonic()
    s.close()
    while not front.up.cancelled and time.monotonic() - t < 3:
        time.sleep(0.02)
    assert front.up.cancelled and time.monotonic() - t < 1.0
    assert front.counts["client_gone"] == 1
    # The cancel file outlives the answer the front gave up on (the model reads it at its next step).
    assert (Path(front.cancel_dir) / front.up.cancelled[0]).exists()


def test_many_dropped_streams_are_all_cancelled(front):
    front.up.hold_s = 5.0
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
    socks = []
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", front.port))
        s.sendall(post("/v1/chat/completions", body))
        socks.append(s)
    t = time.monotonic()
    while len(front.up.seen) < 12 and time.monotonic() - t < 4:  # every request reached the engine
        time.sleep(0.05)
    for s in socks:
        s.close()
    t = time.monotonic()
    while len(front.up.cancelled) < 12 and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert len(front.up.cancelled) == 12 and front.counts["client_gone"] == 12


def test_an_engine_that_does_not_answer_gets_504_and_is_cancelled(front):
    front.up.hold_s = 6.0  # longer than the 3 s request timeout
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "x"}'), timeout=8)
    assert status_of(resp) == 504 and b"request-timeout" in resp
    t = time.monotonic()
    while not front.up.cancelled and time.monotonic() - t < 2:
        time.sleep(0.02)
    assert front.up.cancelled


@pytest.mark.parametrize("stream", [False, True])
def test_an_n_choice_request_the_engine_does_not_answer_in_time_is_one_504_counted_once(front, stream):
    """An n = 4 request whose engine answers none of its calls within the request timeout (streamed or not): one 504
    in OpenAI's shape, its 4 calls cancelled in the engine, and one request timed out in the front's counts (as a
    request of one choice counts), not 4."""
    front.up.hold_s = 6.0  # longer than the 3 s request timeout
    body = json.dumps({"model": "tiny", "prompt": "hello", "n": 4, "stream": stream}).encode()
    resp = raw(front, post("/v1/completions", body), timeout=8)
    assert status_of(resp) == 504, resp[:300]
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert "request-timeout" in err["message"] and err["type"] == "server_error"
    t = time.monotonic()
    while (len(front.up.cancelled) < 4 or front.in_flight()) and time.monotonic() - t < 4:
        time.sleep(0.02)
    assert sorted(front.up.cancelled) == sorted(b[CANCEL_PARAMETER] for b in front.up.seen)
    assert len(front.up.seen) == 4 and front.counts["timed_out"] == 1 and front.in_flight() == 0
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "x"}'), timeout=8)
    assert status_of(resp) == 504 and front.counts["timed_out"] == 2


def test_unhealthy_server_answers_503_with_retry_after(front):
    front.health = lambda: "a model stub died (pid 1)"
    for req in (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                post("/v2/models/dflash/generate", b'{"text_input": "x"}')):
        resp = raw(front, req)
        assert status_of(resp) == 503 and b"retry-after" in resp.lower() and b"stub died" in resp


def test_liveness_is_tritonservers_own_while_a_model_reloads(front):
    """While a model reloads after its stub died (the other models serving), /health, /v2/health/ready and that
    model's ready route say 503, and /v2/health/live, which asks after tritonserver itself, 200; a stopped
    tritonserver is neither live nor ready."""
    stopped = []

    def health(model=None):  # as TritonServer.health says it: a stub of `dflash` died ("" names no model)
        if stopped:
            return "tritonserver is stopped (SIGSTOP)"
        return "a model stub of dflash died (pid 4242; the model reloads)" if model in (None, "dflash") else None

    front.health = front.model_health = health

    def get(path):
        return status_of(raw(front, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()))

    paths = ("/health", "/v2/health/ready", "/v2/models/dflash/ready", "/v2/models/dflash_stream/ready",
             "/v2/health/live")
    assert [get(p) for p in paths] == [503, 503, 503, 200, 200]
    assert get("/v1/models") == 200  # the model id is still served
    stopped.append(True)
    assert [get(p) for p in paths] == [503] * 5


def test_the_openai_model_list_waits_for_tritonserver(front):
    """Before tritonserver serves (a start or a restart) /v1/models says 503 with Retry-After, as a chat request
    would get then, so a client polling it for readiness starts when requests are answered."""
    def get(path):
        return raw(front, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())

    port = front.upstream_port
    front.set_upstream(None)
    for path in ("/v1/models", "/v1/models/tiny"):
        resp = get(path)
        assert status_of(resp) == 503 and b"retry-after" in resp.lower() and b"starting" in resp, resp
    front.set_upstream(port)
    assert [status_of(get(p)) for p in ("/v1/models", "/v1/models/tiny")] == [200, 200]


def test_cancel_files_are_owner_only(front):
    token = front._begin()
    front.cancel(token, "test")
    assert (Path(front.cancel_dir) / token).stat().st_mode & 0o077 == 0
    front._end(token)
    assert os.listdir(front.cancel_dir) == [token]  # removed later (CANCEL_FILE_TTL_S)


def cancel_record_of(front, token: str):
    from dflash_export.deploy import front as front_module

    before = os.environ.get(front_module.CANCEL_DIR_ENV)
    os.environ[front_module.CANCEL_DIR_ENV] = str(front.cancel_dir)  # as the model reads it
    try:
        return front_module.cancel_record(token)
    finally:
        if before is None:
            del os.environ[front_module.CANCEL_DIR_ENV]
        else:
            os.environ[front_module.CANCEL_DIR_ENV] = before


def test_a_cancel_file_carries_a_time_read_once_the_model_could_see_it(front, monkeypatch):
    """The time in a cancel file (what the model counts the steps it ran after the cancel from) is read from the
    machine's monotonic clock after the file with the reason was in place, and before `cancel` returns."""
    from dflash_export.deploy import front as front_module

    token = front._begin()
    path = Path(front.cancel_dir) / token
    seen = []
    clock = front_module.cancel_clock_ns
    monkeypatch.setattr(front_module, "cancel_clock_ns", lambda: seen.append(path.read_text()) or clock())
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    assert front.cancel(token, "the client went away")
    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    assert seen == ["the client went away"]
    why, at = cancel_record_of(front, token)
    assert why == "the client went away" and t0 <= at <= t1
    assert path.stat().st_mode & 0o077 == 0 and sorted(os.listdir(front.cancel_dir)) == [token]
    front._end(token)


def test_expect_100_continue_gets_its_interim_answer_before_the_body(front):
    """curl sends `Expect: 100-continue` for bodies over 1 KB and waits (1 s) for `100 Continue` before sending it;
    an over-limit body is refused at once instead, before it is sent."""
    body = b'{"text_input": "abc", "max_tokens": 3}'
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as s:
        s.sendall(f"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                  "Expect: 100-continue\r\nConnection: close\r\n\r\n".encode())
        interim = s.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        s.sendall(body)
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
    assert status_of(rest) == 200 and json.loads(rest.split(b"\r\n\r\n", 1)[1])["text_output"] == "cba"
    resp = raw(front, b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n"
                      b"Expect: 100-continue\r\n\r\n", timeout=3)
    assert status_of(resp) == 413 and b"100 Continue" not in resp


def test_a_chunked_body_over_the_limit_gets_413_not_a_reset(front):
    """A chunked body has no length to refuse up front: the front reads (and drops) the rest and answers 413 while
    the client is still sending, so the client reads the answer rather than a connection reset."""
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as s:
        s.sendall(b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1000
        for _ in range(20):  # 20 KB against the fixture's 4 KB limit
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        s.sendall(b"0\r\n\r\n")
        resp = b""
        while data := s.recv(65536):
            resp += data
    assert status_of(resp) == 413 and b"--max-request-bytes" in resp
    assert front.up.seen == []


def test_a_stalled_body_gets_408(front):
    """A client that sends the head and part of its body, then nothing: 408 at the body deadline (1.5 s here)."""
    t = time.monotonic()
    resp = raw(front, b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"te",
               timeout=10)
    assert status_of(resp) == 408 and b"not received within" in resp and time.monotonic() - t < 8


def test_a_stalled_head_gets_408(front):
    resp = raw(front, b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\n", timeout=10)
    assert status_of(resp) == 408


@pytest.mark.parametrize("body, param, says", [
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "true or false"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
])
def test_openai_field_messages_say_what_is_accepted(front, body, param, says):
    full = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body}
    resp = raw(front, post("/v1/chat/completions", json.dumps(full).encode()))
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert status_of(resp) == 400 and err["param"] == param and says in err["message"], err
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1, "stream": True,
          "stream_options": {"include_usage": False}}
    assert status_of(raw(front, post("/v1/chat/completions", json.dumps(ok).encode()))) == 200


def test_an_instance_whose_stub_died_is_a_503_even_before_health_sees_it(front, monkeypatch):
    """Triton's python backend answers 400 "Stub process '<instance>' is not healthy." for a dead stub: the server's
    fault, so the client gets 503 with Retry-After (a retry lands on the reloaded model), never a 400."""
    def do_post(handler):
        handler.rfile.read(int(handler.headers["Content-Length"]))
        handler._send(400, {"error": "Stub process 'dflash_0_0' is not healthy."})

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "abc"}'))
    assert status_of(resp) == 503 and b"Retry-After" in resp and b"dflash_0_0" in resp
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    resp = raw(front, post("/v1/chat/completions", body))
    assert status_of(resp) == 503 and b"server_error" in resp


def test_a_connection_dropped_by_a_dying_stub_is_answered_with_the_death(front, monkeypatch):
    """tritonserver can drop a request's connection the moment its model's stub dies, before `serve`'s health poll
    (every 0.5 s) has failed the model: the client still gets 503 with Retry-After naming the death, not "the server
    is being restarted". With no death reported, a dropped connection is a 503 that says the request was dropped."""
    def do_post(handler):
        handler.rfile.read(int(handler.headers["Content-Length"]))
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)  # no answer at all: what a killed stub can leave

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    why = "a model stub of dflash died (pid 4242; its model reloads)"
    timer = threading.Timer(0.6, front.fail_model, ("dflash", why))
    timer.start()
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "abc"}'), timeout=8)
    timer.join()
    assert status_of(resp) == 503 and b"Retry-After" in resp and b"pid 4242" in resp, resp
    front.model_back("dflash")
    resp = raw(front, post("/v2/models/dflash/generate", b'{"text_input": "abc"}'), timeout=8)
    assert status_of(resp) == 503 and b"Retry-After" in resp and b"dropped the request" in resp, resp


def _chat_answers(front) -> bool:
    """Another client's ordinary request is still answered, and answered right."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 40}).encode()
    resp = raw(front, post("/v1/chat/completions", body))
    out = json.loads(resp.split(b"\r\n\r\n", 1)[1])
    # the stand-in answers with its input reversed
    return status_of(resp) == 200 and out["choices"][0]["message"]["content"] == json.dumps(
        '[{"role": "user", "content": "ok"}]')[::-1][:40]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": '
                             + b"9" * 5000 + b"}"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": -' + b"1" * 5000 + b"}"),
    ("/v2/models/dflash/generate", b'{"text_input": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("/v2/models/dflash/infer", b'{"inputs": [{"name": "max_tokens", "datatype": "INT64", "shape": [1], "data": ['
                                + b"9" * 5000 + b"]}]}"),
    # the messages' own JSON text, parsed again
    ("/v2/models/dflash/generate", json.dumps({"messages": '[{"role": "user", "content": "x", "n": ' + "9" * 5000
                                                           + "}]"}).encode()),
])
def test_an_integer_too_long_to_read_gets_400_not_a_dropped_connection(front, path, body):
    front.limits.max_body_bytes = 1 << 16
    resp = raw(front, post(path, body))
    assert status_of(resp) == 400 and b"more than 4300 digits" in resp and b"Traceback" not in resp, resp[:300]
    assert front.up.seen == []
    assert _chat_answers(front)


def test_a_completion_prompt_refused_for_its_size_names_prompt(front, monkeypatch):
    """/v1/completions sends its prompt to the model as `text_input`: the refusals name the field the client sent,
    whether the front refuses the prompt (characters) or the model does (tokens)."""
    front.prompt_char_limit = 100
    resp = raw(front, post("/v1/completions", json.dumps({"model": "tiny", "prompt": "x" * 101}).encode()))
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert status_of(resp) == 400 and err["param"] == "prompt" and err["message"].startswith("prompt: prompt text is")
    assert front.up.seen == []

    def do_post(handler):
        handler.rfile.read(int(handler.headers["Content-Length"]))
        handler._send(400, {"error": "text_input: prompt is 2100 tokens; this engine takes at most 2039"})

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    resp = raw(front, post("/v1/completions", json.dumps({"model": "tiny", "prompt": "x" * 90}).encode()))
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert status_of(resp) == 400 and err["param"] == "prompt" and err["message"].startswith("prompt: prompt is 2100")
    monkeypatch.undo()
    assert _chat_answers(front)


def test_a_completion_refused_for_the_default_max_tokens_says_it_was_the_default(front, monkeypatch):
    """A completion without max_tokens asks the model for OpenAI's 16; when prompt + 16 does not fit, the refusal
    says the client set none (a client that set max_tokens gets the model's words alone)."""
    sent = []

    def do_post(handler):
        sent.append(json.loads(handler.rfile.read(int(handler.headers["Content-Length"]))))
        n = sent[-1]["max_tokens"]
        handler._send(400, {"error": f"max_tokens: prompt (2030 tokens) + {n} new tokens + block (8) exceeds "
                                     "the engine's max_seq_len 2048"})

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    for given in (None, 16):
        body = {"model": "tiny", "prompt": "x"} | ({"max_tokens": given} if given else {})
        resp = raw(front, post("/v1/completions", json.dumps(body).encode()))
        err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
        assert status_of(resp) == 400 and err["param"] == "max_tokens" and sent[-1]["max_tokens"] == 16
        assert err["message"].startswith("max_tokens: prompt (2030 tokens) + 16 new tokens")
        assert ("set no max_tokens" in err["message"]) == (given is None), err["message"]
    monkeypatch.undo()
    assert _chat_answers(front)


def test_a_stream_the_model_refuses_gets_400_naming_the_field(front, monkeypatch):
    """tritonserver answers a generate_stream whose first response is an error with 400 and the error as one
    server-sent event: an OpenAI stream request gets that 400 in OpenAI's shape, naming the field."""
    message = "max_tokens: prompt (9 tokens) + 5000 new tokens + block (8) exceeds the engine's max_seq_len 2048"

    def do_post(handler):
        handler.rfile.read(int(handler.headers["Content-Length"]))
        data = b"data: " + json.dumps({"error": message}).encode() + b"\n\n"
        handler.send_response(400)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000,
                       "stream": True}).encode()
    resp = raw(front, post("/v1/chat/completions", body))
    err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
    assert status_of(resp) == 400 and err == {"message": message, "type": "invalid_request_error",
                                              "param": "max_tokens", "code": None}
    monkeypatch.undo()
    assert _chat_answers(front)


@pytest.mark.parametrize("request_bytes", [
    b"GET /v2/models/../config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v2/models/.. HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v2/models/./stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v2/models/../versions/1/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    post("/v2/models/../generate", b'{"text_input": "x"}'),
    post("/v2/models/./infer", b'{"inputs": []}'),
])
def test_dot_segments_never_reach_another_triton_route(front, monkeypatch, request_bytes):
    """A model named `.` or `..` would be normalized on the way to tritonserver into a route the front never
    matched (/v2/config, /v2/models/stats, /v2/generate): 404, nothing forwarded."""
    got = []
    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_GET", lambda h: (got.append(h.path), h._send(200, {})))
    resp = raw(front, request_bytes)
    assert status_of(resp) == 404 and b"not served" in resp
    assert got == [] and front.up.seen == []
    resp = raw(front, b"GET /v2/models/dflash/config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(resp) == 200 and got == ["/v2/models/dflash/config"]
    assert _chat_answers(front)


def test_made_up_urls_do_not_grow_the_metrics(front):
    for i in range(40):
        assert status_of(raw(front, f"GET /v1/{i}{'a' * 500} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                    .encode())) == 404
        assert status_of(raw(front, f"GET /v1/models/m{i} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                    .encode())) == 404
    metrics = raw(front, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").decode()
    requests = [ln for ln in metrics.splitlines() if ln.startswith("dflash_requests_total{")]
    assert 'route="/v1/other"' in metrics and 'route="/v1/models/{model}"' in metrics
    assert "aaaa" not in metrics and "/v1/models/m1" not in metrics and len(requests) <= 4, requests
    assert _chat_answers(front)


def _write_40_mb(handler, after_each) -> None:
    """A stand-in engine's generate_stream answer: 200 events of 200 kB (40 MB, more than the sockets between the
    front and a client hold), `after_each()` called after each is written, until the front closes the stream."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    data = b"data: " + json.dumps({"text_output": "x" * 200_000, "finish_reason": ""}).encode() + b"\n\n"
    try:
        for _ in range(200):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            after_each()
    except OSError:
        pass


def test_a_client_that_stops_reading_its_stream_gets_its_request_cancelled(front, monkeypatch):
    """A stream whose client neither reads nor leaves: past the write timeout the front drops the connection and
    cancels the request, which would otherwise run on to max_tokens for nobody."""
    from dflash_export.deploy import connection

    monkeypatch.setattr(connection, "WRITE_TIMEOUT_S", 0.5)
    tokens = []

    def do_post(handler):
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        tokens.append(body[CANCEL_PARAMETER])
        _write_40_mb(handler, lambda: time.sleep(0.01))

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", front.port))
    try:
        s.sendall(post("/v1/chat/completions", body))
        t = time.monotonic()
        while not (tokens and (Path(front.cancel_dir) / tokens[0]).exists()) and time.monotonic() - t < 8:
            time.sleep(0.05)
        assert tokens and cancel_record_of(front, tokens[0])[0] == "the client went away"
        while front.in_flight() and time.monotonic() - t < 8:  # the call ends once it sees the client gone
            time.sleep(0.05)
        assert front.counts["client_gone"] == 1 and front.in_flight() == 0
    finally:
        s.close()
    monkeypatch.undo()
    assert _chat_answers(front)


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_read_slowly_is_read_from_the_engine_no_faster_than_its_client_reads(front, monkeypatch, n):
    """An OpenAI stream (of n choices) whose client has not read yet: the front reads each call's events from
    tritonserver as it sends them on, so what the engine has written past what the sockets hold waits in the engine
    rather than piling up in the front's memory (the stand-in writes 40 MB a call as fast as it is read)."""
    written = []

    def do_post(handler):
        handler.rfile.read(int(handler.headers["Content-Length"]))
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # no autotuned send buffer
        _write_40_mb(handler, lambda: written.append(1))

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    body = json.dumps({"model": "tiny", "prompt": "x", "n": n, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", front.port))
    try:
        s.sendall(post("/v1/completions", body))
        time.sleep(2.0)  # within the write timeout: the client is slow, not gone
        # Read all at once, the 40 MB a call would be in the front within the 2 s. What the kernel holds between the
        # stand-in, the front and the client is not the front's: on loopback TCP the front's receive buffer grows to
        # tcp_rmem's maximum (32 MB on some machines, 160 events), so no more than half the stream is asked for.
        assert len(written) < 100 * n, f"the front read {len(written)} of {200 * n} events nobody had read"
    finally:
        s.close()
    t = time.monotonic()
    while front.in_flight() and time.monotonic() - t < 4:
        time.sleep(0.05)
    assert front.in_flight() == 0


def test_a_read_cancelled_as_its_socket_wakes_is_no_error_in_the_log(front, tmp_path, caplog):
    """A client that leaves cancels its request's read of tritonserver's answer. Through the Unix socket `serve`
    reaches tritonserver by (anyio's socket streams under httpx), that socket may turn readable in the same pass of
    the event loop, and its readiness callback then finds the read's wait cancelled: no error, and none is logged.
    An error a callback does raise is still reported."""
    anyio = pytest.importorskip("anyio")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "up.sock"))
    listener.listen()

    async def leave_as_the_answer_arrives():
        loop = asyncio.get_running_loop()
        stream = await anyio.connect_unix(str(tmp_path / "up.sock"))
        peer = listener.accept()[0]
        read = asyncio.ensure_future(stream.receive())
        await asyncio.sleep(0.05)  # the read waits for the socket to turn readable

        def answer_and_leave():
            peer.send(b"data")  # readable at the loop's next poll ...
            loop.call_soon(read.cancel)  # ... and the read cancelled ahead of its readiness callback in that pass

        loop.call_soon(answer_and_leave)
        assert (await asyncio.gather(read, return_exceptions=True))[0].__class__ is asyncio.CancelledError
        await asyncio.sleep(0.05)
        await stream.aclose()
        peer.close()
        woken = loop.create_future()  # a wait that another readiness callback ended first in the same pass
        woken.set_result(None)
        loop.call_soon(woken.set_result, None)
        loop.call_soon(operator.truediv, 1, 0)
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run_coroutine_threadsafe(leave_as_the_answer_arrives(), front._loop).result(timeout=10)
    listener.close()
    errors = [r for r in caplog.records if r.name == "asyncio"]
    assert [r.exc_info[0] for r in errors] == [ZeroDivisionError], [r.getMessage() for r in errors]


def _patient_front(cancel: Path, up: Upstream, **limits) -> Front:
    """A started front relaying to `up`, whose requests may wait 30 s for an answer (or as `limits` say)."""
    f = Front("127.0.0.1", 0, Limits(**{"request_timeout_s": 30.0, **limits}), cancel_dir=cancel, model_id="tiny",
              models=("dflash", "dflash_stream")).start()
    f.port = f._server.sockets[0].getsockname()[1]
    f.set_upstream(up.port)
    return f


def _connections_to(psutil, port: int) -> int:
    """This process's open TCP connections to `port`."""
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)


def test_clients_leaving_right_after_sending_leave_no_connection_to_the_engine_open(tmp_path):
    """Clients that leave within a few milliseconds of sending: each request's call to tritonserver is left to end
    with the cancelled request's answer and then closed, never cancelled part-way (httpcore then kept 2-5 of 300
    connections open in its pool for good, in state NEW: sockets the server holds and its shutdown waits for)."""
    psutil = pytest.importorskip("psutil")
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    up.hold_s = 5.0  # as a queued request: answered once its cancel file is there
    f = _patient_front(cancel, up)

    def open_to_engine() -> int:
        return _connections_to(psutil, up.port)

    try:
        for i in range(300):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                    "stream": i % 2 == 1}
            with socket.create_connection(("127.0.0.1", f.port)) as s:
                s.sendall(post("/v1/chat/completions", json.dumps(body).encode()))
                time.sleep(0.0005 * (i % 20))
        t = time.monotonic()
        while (open_to_engine() or f.in_flight()) and time.monotonic() - t < 10:
            time.sleep(0.1)
        assert open_to_engine() == 0 and f.in_flight() == 0
        assert len(up.cancelled) > 200  # most reached the engine and were cancelled there
        # each request in /metrics once: answered (dflash_requests_total) or its client gone
        from prometheus_client.parser import text_string_to_metric_families

        text = raw(f, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").split(b"\r\n\r\n", 1)[1]
        samples = [s for fam in text_string_to_metric_families(text.decode()) for s in fam.samples]
        answered = sum(s.value for s in samples
                       if s.name == "dflash_requests_total" and s.labels.get("route") == "/v1/chat/completions")
        gone = next(s.value for s in samples if s.name == "dflash_requests_client_gone_total")
        assert gone > 200 and answered + gone == 300, (answered, gone)
    finally:
        f.close()
        up.httpd.shutdown()


def test_calls_left_to_finish_on_a_model_whose_stub_died_are_closed(tmp_path):
    """A request whose client left is left to finish (its answer comes once the model sees the cancel file), but a
    dead stub never answers: when its model is failed, those calls are cancelled and their connections to
    tritonserver closed, rather than held until the front closes (one more per request on the stub at its death)."""
    psutil = pytest.importorskip("psutil")
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    stop = threading.Event()

    def do_post(handler):  # the dead stub's model: reads the request and never answers
        handler.rfile.read(int(handler.headers["Content-Length"]))
        stop.wait(30)

    up.httpd.RequestHandlerClass.do_POST = do_post
    f = _patient_front(cancel, up)

    def open_to_engine() -> int:
        return _connections_to(psutil, up.port)

    def settle(want: int) -> int:
        t = time.monotonic()
        while open_to_engine() != want and time.monotonic() - t < 10:
            time.sleep(0.05)
        return open_to_engine()

    try:
        for path, body in [("/v2/models/dflash/generate", {"text_input": "x"}),
                           ("/v1/completions", {"model": "tiny", "prompt": "x"}),
                           ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})]:
            with socket.create_connection(("127.0.0.1", f.port)) as s:
                s.sendall(post(path, json.dumps(body).encode()))
                time.sleep(0.3)  # sent on to the engine, then the client leaves
        assert settle(3) == 3 and f.in_flight() == 0 and len(f._abandoned) == 3
        f.fail_model("dflash", "a model stub of dflash died (pid 4242; its model reloads)")
        assert settle(0) == 0 and len(f._abandoned) == 0
    finally:
        stop.set()
        f.close()
        up.httpd.shutdown()


@pytest.mark.parametrize("path, n", [("/v1/chat/completions", 1), ("/v1/completions", 1), ("/v1/completions", 3),
                                     ("/v2/models/dflash_stream/generate_stream", 1)])
def test_a_stream_whose_client_left_closes_its_connection_to_the_engine_at_once(front, monkeypatch, path, n):
    """A client that leaves mid-stream (the front's next write to it fails) has its request's connection to
    tritonserver closed at once, not whenever the garbage collector gets to it: tritonserver's shutdown waits for
    every open connection; a request for n choices has all n closed. The stand-in engine streams until its writes
    fail, which is when the front has closed."""
    import gc

    started, closed = [], []

    def do_post(handler):
        handler.rfile.read(int(handler.headers["Content-Length"]))
        started.append(1)
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        data = b"data: " + json.dumps({"text_output": "x", "finish_reason": ""}).encode() + b"\n\n"
        try:
            for _ in range(20_000):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                handler.wfile.flush()
                time.sleep(0.0002)
        except OSError:
            closed.append(1)

    monkeypatch.setattr(front.up.httpd.RequestHandlerClass, "do_POST", do_post)
    body = {"model": "tiny", "stream": True, **({"messages": [{"role": "user", "content": "x"}]}
                                                if path.endswith("chat/completions") else {"prompt": "x"})}
    if n > 1:
        body["n"] = n
    if path.endswith("generate_stream"):  # Triton's own streaming route, relayed event by event
        body = {"text_input": "x", "max_tokens": 8}
    gc.disable()  # only the front's own closing counts
    try:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", front.port)) as s:
                s.sendall(post(path, json.dumps(body).encode()))
                got = b""
                while got.count(b"data: ") < 3:
                    got += s.recv(65536)
        t = time.monotonic()
        while len(closed) < 20 * n and time.monotonic() - t < 3:
            time.sleep(0.05)
        assert len(started) == 20 * n and len(closed) == 20 * n, \
            f"{20 * n - len(closed)} connections to the engine still open"
        assert front.in_flight() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("whole_close", [True, False])
def test_the_bridge_closes_its_connection_to_tritonserver_when_the_front_closes(tmp_path, whole_close):
    """The namespace bridge's Unix socket (the front's way to tritonserver): when the front closes a connection whose
    answer never comes (a request on a model stub that died), the bridge closes its own connection to tritonserver
    too, not only half of it, so tritonserver's shutdown has no HTTP connection left to wait for. Its forwarded
    ports (a user's clients, which may half-close and still read) keep the half-close."""
    psutil = pytest.importorskip("psutil")
    from dflash_export.deploy.netns_bridge import _relay_to

    engine = socket.socket()  # tritonserver with a dead stub behind it: reads the request, never answers
    engine.bind(("127.0.0.1", 0))
    engine.listen()
    port = engine.getsockname()[1]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    uds = str(tmp_path / "bridge.sock")
    server = asyncio.run_coroutine_threadsafe(asyncio.start_unix_server(_relay_to(port, whole_close), path=uds),
                                              loop).result(timeout=10)

    def bridge_to_engine() -> int:
        return _connections_to(psutil, port)

    try:
        with socket.socket(socket.AF_UNIX) as front:
            front.connect(uds)
            front.sendall(b"POST /v2/models/dflash/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            conn = engine.accept()[0]
            assert conn.recv(4096).startswith(b"POST ")
        t = time.monotonic()
        while bridge_to_engine() and time.monotonic() - t < 3:
            time.sleep(0.05)
        assert conn.recv(4096) == b""  # the request's end either way
        assert bridge_to_engine() == (0 if whole_close else 1)
        conn.close()  # the half-closed relay ends once tritonserver closes
        while bridge_to_engine() and time.monotonic() - t < 6:
            time.sleep(0.05)
    finally:
        async def close():  # on the server's own loop: asyncio's Server is not thread-safe (a relay ending on the
            server.close()  # loop's thread while another thread closes it wakes its waiters twice)
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        engine.close()


def test_a_token_id_prompt_to_a_repository_deployed_without_input_ids_gets_one_clear_400(front, tmp_path):
    """A repository deployed before `input_ids` existed declares no such input (its config.pbtxt, which is what
    tritonserver loads): a prompt of token ids, on every route that takes one, gets one 400 naming the field the
    client sent and saying how to get the input, and nothing reaches tritonserver; text prompts keep working. The
    input names are the ones the served copy's configs declare (repository.model_inputs, as `serve` reads them)."""
    from deploy_support import drop_input, make_torch_engine_dir

    from dflash_export.deploy.repository import check_repository, model_inputs, served_copy, write_repository

    fresh = write_repository(make_torch_engine_dir(tmp_path / "engine"), tmp_path / "fresh")
    old = drop_input(write_repository(tmp_path / "engine", tmp_path / "old"), "input_ids")
    check_repository(old)  # still served
    front.model_inputs = model_inputs(served_copy(old, tmp_path / "served-old"))
    assert set(front.model_inputs) == {"dflash", "dflash_stream"}
    assert all("text_input" in v and "input_ids" not in v for v in front.model_inputs.values())

    for stream in (False, True):
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
        resp = raw(front, post("/v1/completions", json.dumps(body).encode()))
        err = json.loads(resp.split(b"\r\n\r\n", 1)[1])["error"]
        assert status_of(resp) == 400 and err["param"] == "prompt", resp[:400]
        assert err["message"].startswith("prompt: this model repository was deployed without token-id input")
        assert "`dflash-export deploy`" in err["message"], err["message"]
    resp = raw(front, post("/v2/models/dflash/generate", b'{"input_ids": [1, 2, 3], "max_tokens": 4}'))
    assert status_of(resp) == 400 and b"input_ids: this model repository was deployed without token-id" in resp
    infer = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}]}
    resp = raw(front, post("/v2/models/dflash/infer", json.dumps(infer).encode()))
    assert status_of(resp) == 400 and b"input_ids: this model repository was deployed without token-id" in resp
    assert front.up.seen == []

    resp = raw(front, post("/v1/completions", json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 4})
                           .encode()))
    assert status_of(resp) == 200 and front.up.seen[-1]["text_input"] == "abc"
    # A repository deployed with the input forwards the token ids.
    front.model_inputs = model_inputs(served_copy(fresh, tmp_path / "served-fresh"))
    resp = raw(front, post("/v1/completions", json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4,
                                                          "stream": True}).encode()))
    assert status_of(resp) == 200 and front.up.seen[-1]["input_ids"] == [1, 2, 3]


def _count_calls_at_once(up: Upstream) -> dict:
    """`up` counting the calls it holds at once: {"now": open now, "most": the most open at once}."""
    seen = {"now": 0, "most": 0}
    lock = threading.Lock()
    answer = up.httpd.RequestHandlerClass.do_POST

    def do_post(handler):
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            answer(handler)
        finally:
            with lock:
                seen["now"] -= 1

    up.httpd.RequestHandlerClass.do_POST = do_post
    return seen


def test_concurrent_choices_never_hold_more_calls_to_the_engine_than_the_bound(tmp_path):
    """8 clients at once asking for 3 choices each (streamed or not), a batch of 2 prompts x 2 and 2 generate
    calls: 30 calls against a bound of 4. The engine never holds more than 4 at once (and does hold 4: the bound is
    what limits), the calls past it wait their turn, and every client gets its whole answer."""
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    up.hold_s = 0.2  # each call takes 0.2 s
    at_once = _count_calls_at_once(up)
    f = _patient_front(cancel, up, max_upstream_calls=4)
    asks = [("/v1/completions", {"model": "tiny", "prompt": f"p{i}", "n": 3, "max_tokens": 4, "stream": i % 2 == 1})
            for i in range(8)]
    asks += [("/v1/completions", {"model": "tiny", "prompt": ["ab", "cd"], "n": 2, "max_tokens": 4}),
             ("/v2/models/dflash/generate", {"text_input": "xyz"}), ("/v2/models/dflash/generate", {"text_input": "q"})]
    got: dict[int, bytes] = {}

    def ask(i: int) -> None:
        got[i] = raw(f, post(asks[i][0], json.dumps(asks[i][1]).encode()), timeout=20)

    try:
        clients = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for c in clients:
            c.start()
        for c in clients:
            c.join(30)
        assert len(up.seen) == 30 and at_once["most"] == 4, at_once
        for i, (path, body) in enumerate(asks):
            assert status_of(got[i]) == 200, got[i][:300]
            if path.startswith("/v2"):
                assert json.loads(got[i].split(b"\r\n\r\n", 1)[1])["text_output"] == body["text_input"][::-1]
            elif body.get("stream"):
                events = _events(got[i])
                texts = ["", "", ""]
                for e in events[:-1]:
                    texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
                assert events[-1] == "[DONE]" and texts == [body["prompt"][::-1]] * 3
            else:
                out = json.loads(got[i].split(b"\r\n\r\n", 1)[1])
                want = [p[::-1] for p in body["prompt"] for _ in range(2)] if isinstance(body["prompt"], list) \
                    else [body["prompt"][::-1]] * 3
                assert [c["text"] for c in out["choices"]] == want
        assert f.in_flight() == 0
    finally:
        f.close()
        up.httpd.shutdown()


def test_a_call_waiting_for_its_turn_times_out_or_leaves_without_taking_a_turn(tmp_path, caplog):
    """With a bound of one call, a stream holding it for 3 s: a request waiting its turn past its 1.5 s request
    timeout gets the 504 (its wait counts against the timeout; /metrics counts its calls waiting meanwhile), one whose
    client leaves while it waits is counted gone; neither reaches the engine. Neither gives back a turn it never
    took, nor keeps one: once the stream ends, 3 requests at once are answered one call at a time. Nothing is logged
    as an error."""
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    streaming = threading.Event()
    answer = up.httpd.RequestHandlerClass.do_POST

    def do_post(handler):  # generate_stream: an event a second, each within the request timeout
        if not handler.path.endswith("generate_stream"):
            return answer(handler)
        handler.rfile.read(int(handler.headers["Content-Length"]))
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        streaming.set()
        for i in range(3):
            time.sleep(1.0)
            data = b"data: " + json.dumps({"text_output": "s", "finish_reason": "length" if i == 2 else ""}
                                          ).encode() + b"\n\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.write(b"0\r\n\r\n")

    up.httpd.RequestHandlerClass.do_POST = do_post
    at_once = _count_calls_at_once(up)
    f = _patient_front(cancel, up, max_upstream_calls=1, request_timeout_s=1.5)
    got: dict[str, bytes] = {}

    def ask(name: str, path: str, body: dict) -> None:
        got[name] = raw(f, post(path, json.dumps(body).encode()), timeout=10)

    try:
        holder = threading.Thread(target=ask, args=("stream", "/v2/models/dflash_stream/generate_stream",
                                                    {"text_input": "x"}))
        holder.start()
        assert streaming.wait(5)
        waiter = threading.Thread(target=ask, args=("late", "/v1/completions", {"model": "tiny", "prompt": "late",
                                                                                "n": 2}))
        waiter.start()

        def waiting() -> float:
            return f.metrics.registry.get_sample_value("dflash_upstream_calls_waiting")

        deadline = time.monotonic() + 5
        while waiting() < 2 and time.monotonic() < deadline:  # its two choices, on /metrics
            time.sleep(0.02)
        assert waiting() == 2
        with socket.create_connection(("127.0.0.1", f.port)) as s:
            s.sendall(post("/v1/chat/completions", json.dumps({"model": "tiny", "n": 2, "messages": [
                {"role": "user", "content": "gone"}]}).encode()))
            time.sleep(0.3)
        waiter.join(10)
        holder.join(10)
        assert waiting() == 0
        assert status_of(got["stream"]) == 200 and got["stream"].count(b"data: ") == 3
        assert status_of(got["late"]) == 504 and b"request-timeout" in got["late"], got["late"][:300]
        assert f.counts["client_gone"] == 1 and up.seen == []

        clients = [threading.Thread(target=ask, args=(f"after{i}", "/v2/models/dflash/generate",
                                                      {"text_input": f"a{i}"})) for i in range(3)]
        up.hold_s = 0.2
        for c in clients:
            c.start()
        for c in clients:
            c.join(10)
        assert [status_of(got[f"after{i}"]) for i in range(3)] == [200] * 3
        assert len(up.seen) == 3 and at_once["most"] == 1 and f.in_flight() == 0
    finally:
        f.close()
        up.httpd.shutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_call_the_drain_cancels_while_it_waits_for_its_turn_is_answered_503_and_never_sent(tmp_path):
    """A drain past its time with one call holding the only turn and one waiting for it: both clients get 503
    "shutting down" and only the first call ever reached the engine."""
    cancel = tmp_path / "cancel"
    cancel.mkdir()
    up = Upstream(cancel)
    up.hold_s = 10.0  # answered once cancelled
    f = _patient_front(cancel, up, max_upstream_calls=1)
    got: list[bytes] = []
    clients = [threading.Thread(target=lambda i=i: got.append(raw(f, post("/v2/models/dflash/generate", json.dumps(
        {"text_input": f"x{i}"}).encode()), timeout=10))) for i in range(2)]
    try:
        for c in clients:
            c.start()
        t = time.monotonic()
        while (len(up.seen) < 1 or f.in_flight() < 2) and time.monotonic() - t < 5:
            time.sleep(0.02)
        assert f.drain(0.1, grace_s=5.0) is False
        for c in clients:
            c.join(10)
        assert [status_of(r) for r in got] == [503, 503] and all(b"shutting down" in r for r in got)
        assert len(up.seen) == 1 and f.counts["cancelled_at_shutdown"] == 2
    finally:
        f.close()
        up.httpd.shutdown()
