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


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    from dflash_export.deploy.server import TritonServer

    repo = write_repository(engine_dir, tmp_path_factory.mktemp("triton") / "repo", instances=1, max_queue_size=256,
                            max_batch=8, max_queued_tokens=4096)
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


@pytest.mark.server
def test_16_concurrent_clients_share_one_batch_and_get_lone_outputs(server, direct):

    requests = [(PROMPTS[i % len(PROMPTS)] + str(i).encode(), 8 + (i * 5) % 25) for i in range(20)]
    alone = {r: run_direct(direct, text_input=r[0], max_tokens=np.array([r[1]], np.int32)) for r in requests}
    results = concurrent_infer(server, requests, clients=16, per_client=4, network_timeout=180, join_timeout=300)
    assert len(results) == 64
    for r, out in results.values():  # the tokens; acceptance statistics follow the batch's own scheduling
        want = alone[r]
        assert (out["text"], out["finish_reason"], out["completion_tokens"]) == (
            want.text, want.finish_reason, want.completion_tokens), r


@pytest.mark.server
def test_stream_and_errors_through_the_shared_batch(server, direct):
    stream_equals_direct(server, direct, "stream me", 20)
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "hi", "temperature": -1})
    assert status == 400 and "temperature" in str(body)
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "x" * 2000})
    assert status == 400 and "text_input" in str(body)
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate", {"text_input": "Hi", "max_tokens": 5})
    assert status == 200 and body["completion_tokens"] == 5


@pytest.mark.server
def test_metrics_get_tau_draft_and_verify_time_from_the_shared_batch(server):
    """What /metrics sums comes from each generation's step_stats: through a shared batch they hold every step's
    committed tokens (adding up to the answer's tokens after the prefill's) and the request's share of the drafter's
    and the target's time, so tau, draft and verify seconds are not 0 there."""
    status, body = post_json(f"{server.http_url}/v2/models/dflash/generate",
                             {"text_input": "Count with me: one two three four", "max_tokens": 24})
    assert status == 200
    stats = json.loads(body["step_stats"])
    lengths = stats["acceptance_lengths"]
    assert sum(lengths) == body["completion_tokens"] - 1 and lengths
    assert stats["draft_s"] > 0 and stats["verify_s"] > 0  # a lone greedy request drafts at its first step

    class Front(Upstream):  # the front's recording of an upstream answer, without its connections
        metrics = FrontMetrics()

    Front()._observe(body)
    figures = {ln.split()[0]: float(ln.split()[-1]) for ln in Front.metrics.render().decode().splitlines()
               if ln and not ln.startswith("#")}
    assert figures["dflash_draft_seconds_total"] == pytest.approx(stats["draft_s"])
    assert figures["dflash_verify_seconds_total"] == pytest.approx(stats["verify_s"])
    assert figures["dflash_steps_total"] == len(lengths)
    assert figures["dflash_tau"] == pytest.approx(sum(lengths) / len(lengths)) and figures["dflash_tau"] >= 1
