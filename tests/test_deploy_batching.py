"""Triton with a shared continuous batch per instance (`deploy --max-batch N`): concurrent clients, streamed or not,
get the text of the same request run alone; a full queue is HTTP 503; bad requests are still named errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from deploy_support import (  # noqa: F401, I001 - the tests' helpers and fixtures
    PROMPTS,
    concurrent_infer,
    direct,
    engine_dir,
    exact_on_this_cpu,
    make_engine_dir,
    post_json,
    run_direct,
    stream_equals_direct,
)

from dflash_export.deploy.metrics import FrontMetrics
from dflash_export.deploy.repository import write_repository
from dflash_export.deploy.server import free_loopback_ports as free_ports
from dflash_export.deploy.upstream import Upstream
from dflash_export.errors import DFlashError

KV_TOKENS = 384  # the served batch's K/V bound: 6 short requests at once, and one of 400 new tokens is too large


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    from dflash_export.deploy.server import TritonServer

    repo = write_repository(engine_dir, tmp_path_factory.mktemp("triton") / "repo", instances=1, max_queue_size=256,
                            max_batch=8, max_queued_tokens=4096, max_kv_tokens=KV_TOKENS)
    assert 'string_value: "8"' in (repo / "dflash" / "config.pbtxt").read_text()
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(repo, http, grpc, metrics, ready_timeout_s=240)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_deploy_refuses_bad_batch_options(tmp_path, engine_dir):
    for kwargs, field in (({"max_batch": 0}, "--max-batch"), ({"max_queued_tokens": 0}, "--max-queued-tokens")):
        with pytest.raises(DFlashError) as e:
            write_repository(engine_dir, tmp_path / "r", **kwargs)
        assert e.value.field == field
    with pytest.raises(DFlashError) as e:
        write_repository(engine_dir, tmp_path / "r", max_batch=2, max_kv_tokens=-1)
    assert e.value.field == "--max-kv-tokens"


def test_the_kv_bound_reaches_every_models_config_and_the_marker(tmp_path, engine_dir):
    """deploy --max-kv-tokens is a parameter of each model's config (what the model stub reads) and recorded in the
    marker (what serve's note reads); the repository with it passes serve's check. Without it: 0, decided at load."""
    import re

    from dflash_export.deploy.repository import MARKER, check_repository

    for kwargs, want in (({"max_kv_tokens": 777}, "777"), ({}, "0")):
        repo = write_repository(engine_dir, tmp_path / want, max_batch=4, **kwargs)
        for model in ("dflash", "dflash_stream"):
            text = (repo / model / "config.pbtxt").read_text()
            got = re.search(r'key: "max_kv_tokens"\s*value \{\s*string_value: "(\d+)"', text)
            assert got and got.group(1) == want, text
        assert json.loads((repo / MARKER).read_text())["max_kv_tokens"] == int(want)
        check_repository(repo)


def test_serve_engine_caches_one_repository_per_kv_bound(tmp_path, engine_dir, monkeypatch):
    """`serve --engine --max-kv-tokens T` serves a cached repository whose models' config carries T; another bound is
    another repository, the same one is the same."""
    import re

    from dflash_export.deploy.repository import cached_repository

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    bounded, _ = cached_repository(engine_dir, max_batch=4, max_kv_tokens=500)
    text = (bounded / "dflash" / "config.pbtxt").read_text()
    assert re.search(r'key: "max_kv_tokens"\s*value \{\s*string_value: "500"', text), text
    assert cached_repository(engine_dir, max_batch=4, max_kv_tokens=500)[0] == bounded
    assert cached_repository(engine_dir, max_batch=4)[0] != bounded


def _stub_config(repo, model: str) -> dict:
    """A model's config.pbtxt as tritonserver hands it to the model stub (`args["model_config"]`, JSON)."""
    from dflash_export.deploy.pbtxt import parse_pbtxt

    path = repo / model / "config.pbtxt"
    cfg = parse_pbtxt(path.read_text(), path)
    params = cfg["parameters"] if isinstance(cfg["parameters"], list) else [cfg["parameters"]]
    groups = cfg["instance_group"] if isinstance(cfg["instance_group"], list) else [cfg["instance_group"]]
    return {"parameters": {p["key"]: p["value"] for p in params}, "instance_group": groups}


@pytest.mark.parametrize("stream", [True, False])
def test_every_served_instance_of_every_model_shares_half_the_memory_by_default(tmp_path, engine_dir, monkeypatch,
                                                                                stream):
    """By default the shared batches of every instance of the deployment, `dflash`'s and `dflash_stream`'s alike,
    may hold together at most half the memory available (docs/serving.md): each model stub's bound, from the config
    deploy wrote, is its share of that half; deploy's note says the bound each instance takes and over how many."""
    from click.testing import CliRunner
    from deploy_support import model_triton_py

    from dflash_export import environment
    from dflash_export.cli import main
    from dflash_export.deploy import repository
    from dflash_export.deploy.kv_memory import kv_bytes_per_token
    from dflash_export.deploy.repository import kv_memory_note
    from dflash_export.engines.manifest import read_manifest

    per_token = kv_bytes_per_token(read_manifest(engine_dir, verify_files=False))
    available = 4000 * per_token + 5  # each stub loads on this machine and sees the same memory
    monkeypatch.setattr(environment, "available_memory_bytes", lambda: available)
    stub = model_triton_py(monkeypatch)
    repo = write_repository(engine_dir, tmp_path / "repo", instances=2, max_batch=4,
                            decoupled=None if stream else False)
    models = ["dflash", "dflash_stream"] if stream else ["dflash"]
    bounds = []
    for model in models:
        config = _stub_config(repo, model)
        count = sum(int(g.get("count", 1)) for g in config["instance_group"])
        assert count == 2
        bounds += [stub._kv_bound(config, str(repo / "dflash" / "engine"), count, 4) for _ in range(count)]
    assert len(bounds) == 2 * len(models) and len(set(bounds)) == 1
    assert sum(bounds) * per_token <= available / 2 < (sum(bounds) + len(bounds)) * per_token  # half, all of it
    assert bounds[0] == 4000 // 2 // len(bounds)  # 500 with both models, 1000 with one (< a full batch)

    monkeypatch.setattr(repository, "available_memory_bytes", lambda: available)
    r = CliRunner().invoke(main, ["deploy", "--engine", str(engine_dir), "--repo", str(tmp_path / "cli"),
                                  "--instances", "2", "--max-batch", "4", *([] if stream else ["--no-stream"])])
    assert r.exit_code == 0, r.output
    assert f"note: each instance's shared batch holds at most {bounds[0]} K/V tokens" in r.output, r.output
    assert ("shared by the 4 instances of 2 models" if stream else "shared by 2 instance(s)") in r.output, r.output
    assert "Warning" not in r.output
    # A bound given: the warning counts every model's instances (4 x 1500 tokens pass 4000 tokens' bytes, 2 x 1500 do
    # not)
    note = kv_memory_note(repo / "dflash" / "engine", 2, 4, len(models), available=available, max_kv_tokens=1500)
    assert ("Warning: the 4 instances of 2 models" in note) if stream else ("Warning" not in note), note


@pytest.mark.server
def test_16_concurrent_clients_share_one_batch_and_get_lone_outputs(server, direct):

    requests = [(PROMPTS[i % len(PROMPTS)] + str(i).encode(), 8 + (i * 5) % 25) for i in range(20)]
    alone = {r: run_direct(direct, text_input=r[0], max_tokens=np.array([r[1]], np.int32)) for r in requests}
    results = concurrent_infer(server, requests, clients=16, per_client=4, network_timeout=180, join_timeout=300)
    assert len(results) == 64
    exact = exact_on_this_cpu(direct)  # else a batched answer may part from the lone one at a near-tie
    for r, out in results.values():  # the tokens; acceptance statistics follow the batch's own scheduling
        want = alone[r]
        assert (out["text"], out["finish_reason"], out["completion_tokens"]) == (
            want.text, want.finish_reason, want.completion_tokens) or not exact, r
        assert 0 < out["completion_tokens"] <= r[1]


@pytest.mark.server
def test_stream_and_errors_through_the_shared_batch(server, direct):
    stream_equals_direct(server, direct, "stream me", 20, exact=exact_on_this_cpu(direct))
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "hi", "temperature": -1})
    assert status == 400 and "temperature" in str(body)
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "x" * 2000})
    assert status == 400 and "text_input" in str(body)
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "Hi", "max_tokens": 5})
    assert status == 200 and body["completion_tokens"] == 5
    # K/V for more tokens than the batch's bound: refused, naming it, and the batch goes on
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "Hi", "max_tokens": 400})
    assert status == 400 and "max_kv_tokens" in str(body) and str(KV_TOKENS) in str(body), body
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "Hi", "max_tokens": 5})
    assert status == 200 and body["completion_tokens"] == 5


@pytest.mark.server
def test_metrics_get_tau_draft_and_verify_time_from_the_shared_batch(server):
    """What /metrics sums comes from each generation's step_stats: through a shared batch they hold every step's
    committed tokens (adding up to the answer's tokens after the prefill's) and the request's share of the drafter's
    and the target's time, so tau, draft and verify seconds are not 0 there; and the batch's K/V bound and the
    request's wait to join it."""
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate",
                             {"text_input": "Count with me: one two three four", "max_tokens": 24})
    assert status == 200
    stats = json.loads(body["step_stats"])
    lengths = stats["acceptance_lengths"]
    assert sum(lengths) == body["completion_tokens"] - 1 and lengths
    assert stats["draft_s"] > 0 and stats["verify_s"] > 0  # a lone greedy request drafts at its first step
    assert stats["kv_token_limit"] == KV_TOKENS and 0 <= stats["admission_wait_s"] < 30

    class Front(Upstream):  # the front's recording of an upstream answer, without its connections
        metrics = FrontMetrics()

    Front()._observe(body, "dflash")
    figures = {ln.split()[0]: float(ln.split()[-1]) for ln in Front.metrics.render().decode().splitlines()
               if ln and not ln.startswith("#")}
    assert figures["dflash_draft_seconds_total"] == pytest.approx(stats["draft_s"])
    assert figures["dflash_verify_seconds_total"] == pytest.approx(stats["verify_s"])
    assert figures["dflash_steps_total"] == len(lengths)
    assert figures["dflash_tau"] == pytest.approx(sum(lengths) / len(lengths)) and figures["dflash_tau"] >= 1
    assert figures['dflash_kv_token_limit{model="dflash"}'] == KV_TOKENS
    assert figures["dflash_admission_wait_seconds_count"] == 1
    assert figures["dflash_admission_wait_seconds_sum"] == pytest.approx(stats["admission_wait_s"])


@pytest.mark.server
def test_served_metrics_count_each_models_batch_apart_and_reach_the_block_and_timeout(server, engine_dir):
    """The front `serve` starts sizes /metrics from the repository: dflash_batch_occupancy has one series per model
    (dflash and dflash_stream each decode 1 instance x --max-batch 8 sequences at once) and none without the label;
    the acceptance-length buckets reach the engine's block (16 at least) and the admission-wait buckets the request
    timeout."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from dflash_export.deploy.handler import engine_block_size

    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=30) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    occupancy = {tuple(s.labels.items()): s.value for s in families["dflash_batch_occupancy"].samples}
    assert occupancy == {(("model", "dflash"),): 0, (("model", "dflash_stream"),): 0}
    assert server.front.metrics.capacity == 8

    def top_bucket(name):
        return max(float(s.labels["le"]) for s in families[name].samples
                   if s.name.endswith("_bucket") and s.labels["le"] != "+Inf")

    block = json.loads((engine_dir / "manifest.json").read_text())["block_size"]
    assert engine_block_size(server.repo / "dflash" / "engine") == block
    assert engine_block_size(engine_dir.parent) is None  # no manifest: not known
    assert top_bucket("dflash_acceptance_length") == max(16, block)
    assert top_bucket("dflash_admission_wait_seconds") >= server.front.limits.request_timeout_s
