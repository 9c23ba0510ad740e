"""`dflash-export deploy` and `dflash-export serve`: parse options, call the deploy modules (imported lazily so the
rest of the CLI starts without them)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_export.clitypes import engine_option
from dflash_export.deploy.connection import Limits
from dflash_export.deploy.repository import (
    MARKER,
    MAX_QUEUE_SIZE,
    MAX_THREADS,
    MAX_TOKEN_COUNT,
    cached_repository,
    kv_memory_note,
    shared_batch_note,
    write_repository,
)
from dflash_export.engines.registry import MAX_BATCH
from dflash_export.errors import DFlashError


@click.command()
@engine_option("A built engine directory (engines/<recipe>/<backend>).", required=True)
@click.option("--repo", "repo_dir", required=True, type=click.Path(),
              help="Model repository to write (replaced atomically if it is an earlier deploy).")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Model instances (processes) per model; each holds its own copy of the engine.")
@click.option("--max-queue-size", default=64, show_default=True, type=click.IntRange(0, MAX_QUEUE_SIZE),
              help="Requests waiting per model before Triton rejects new ones (0 = unbounded).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0, MAX_THREADS),
              help="Intra-op threads per instance (0: the server's cores divided by --instances).")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Also write the decoupled streaming model dflash_stream (for generate_stream).")
@click.option("--llmapi-model-py", type=click.Path(dir_okay=False), default=None,
              help="TensorRT-LLM bundles only: TensorRT-LLM's llmapi model.py to place next to model.yaml.")
@click.option("--max-request-bytes", default=1 << 20, show_default=True, type=click.IntRange(1, 1 << 30),
              help="Largest HTTP request body `serve` lets through to tritonserver (larger: HTTP 413).")
@click.option("--max-json-depth", default=32, show_default=True, type=click.IntRange(2, 256),
              help="Deepest JSON nesting `serve` lets through (deeper: HTTP 400).")
@click.option("--max-batch", default=1, show_default=True, type=click.IntRange(1, MAX_BATCH),
              help="Sequences one instance decodes together: > 1 feeds its concurrent requests into one shared "
                   "continuous batch (onnxruntime and tensorrt engines); 1 runs one request at a time.")
@click.option("--max-queued-tokens", default=65536, show_default=True,
              type=click.IntRange(1, MAX_TOKEN_COUNT),
              help="With --max-batch > 1: prompt tokens that may wait to join the batch (more: HTTP 503).")
@click.option("--max-kv-tokens", default=0, show_default=True, type=click.IntRange(0, MAX_TOKEN_COUNT),
              help="With --max-batch > 1: K/V tokens (slots x rows) each instance's shared batch may hold; a request "
                   "joins once its rows fit, in arrival order, and one needing more than the bound gets HTTP 400. "
                   "0: half the memory available when an instance loads, shared by every model's instances.")
@click.option("--plain", is_flag=True,
              help="Serve plain decoding on the same engine (no drafter): the yardstick a served speedup is "
                   "measured against.")
def deploy(engine_dir, repo_dir, instances, max_queue_size, threads, stream, llmapi_model_py, max_request_bytes,
           max_json_depth, max_batch, max_queued_tokens, max_kv_tokens, plain):
    """Write a Triton model repository serving the --engine directory (python backend running the DFlash runtime)."""
    repo = write_repository(engine_dir, repo_dir, instances=instances, max_queue_size=max_queue_size,
                            decoupled=None if stream else False, threads=threads, llmapi_model_py=llmapi_model_py,
                            max_body_bytes=max_request_bytes, max_json_depth=max_json_depth, max_batch=max_batch,
                            max_queued_tokens=max_queued_tokens, plain=plain, max_kv_tokens=max_kv_tokens)
    import json

    marker = json.loads((repo / MARKER).read_text(encoding="utf-8"))
    click.echo(f"wrote {repo} (models: {', '.join(marker['models'])})")
    if note := shared_batch_note(marker.get("precision"), marker.get("max_batch")):
        click.echo(note)
    if note := kv_memory_note(repo / marker["models"][0] / "engine", instances, max_batch, len(marker["models"]),
                              max_kv_tokens=max_kv_tokens):
        click.echo(note)
    import shlex

    click.echo(f"serve it with: dflash-export serve --repo {shlex.quote(str(repo))}")  # a line the shell takes whole


@click.command()
@engine_option("Serve this built engine directly (a model repository is made for it and cached).")
@click.option("--repo", "repo_dir", type=click.Path(file_okay=False), default=None,
              help="Serve a model repository written by `deploy` (instead of --engine).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", "--http-port", "http_port", default=8000, show_default=True, type=click.IntRange(1, 65535),
              help="HTTP port: the OpenAI API (/v1), Triton's routes (/v2), /health and /metrics.")
@click.option("--grpc/--no-grpc", default=False, show_default=True,
              help="Also open tritonserver's gRPC port (on 127.0.0.1 only; it has no request-size limit).")
@click.option("--grpc-port", default=None, type=click.IntRange(1, 65535),
              help="With --grpc: its port on 127.0.0.1 (default: a free one, printed when ready).")
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535),
              help="Expose tritonserver's own Prometheus counters on this port (default: not exposed; the DFlash "
                   "metrics are on the HTTP port's /metrics).")
@click.option("--model-name", default=None,
              help="The model id the OpenAI API serves (default: the engine's recipe name).")
@click.option("--max-batch", default=None, type=click.IntRange(1, MAX_BATCH),
              help="With --engine: sequences decoded together (default 8 for the engines that batch, onnxruntime "
                   "and tensorrt; else 1).")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1, 64),
              help="With --engine: model instances (processes).")
@click.option("--max-kv-tokens", default=None, type=click.IntRange(0, MAX_TOKEN_COUNT),
              help="With --engine: K/V tokens (slots x rows) each instance's shared batch may hold (a larger request: "
                   "HTTP 400; default 0: half the memory available when an instance loads, shared by every model's "
                   "instances).")
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="Write tritonserver's log here (default: a new dflash-tritonserver-*.log in the temp directory).")
@click.option("--log-max-mb", default=64, show_default=True, type=click.IntRange(0, 1 << 20),
              help="When the log reaches this many MiB it is renamed to LOG.1 (replacing the one before) and a new "
                   "one begins (a regular file: a pipe or terminal is never renamed); 0: it grows without bound.")
@click.option("--max-request-bytes", default=None, type=click.IntRange(1, 1 << 30),
              help="Largest HTTP request body let through (larger: 413). Default: the value deploy recorded.")
@click.option("--max-json-depth", default=None, type=click.IntRange(2, 256),
              help="Deepest JSON nesting let through (deeper: 400). Default: the value deploy recorded.")
@click.option("--request-timeout", default=600.0, show_default=True, type=click.FloatRange(1, 86400),
              help="Seconds a request may wait for the engine; then it is cancelled and answered 504.")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1, 65536),
              help="Open client connections in all (idle ones are dropped first when full).")
@click.option("--max-upstream-calls", default=None, type=click.IntRange(1, 65536),
              help="Calls open to tritonserver at once (each of a request's n choices and batch prompts is one); more "
                   "wait for a free one, first come first served, within --request-timeout. Default: what the "
                   "models hold at once (instances x max-batch + max-queue-size, per model), at least 256.")
@click.option("--restart-on-crash/--no-restart-on-crash", default=True, show_default=True,
              help="Restart tritonserver behind the same HTTP port if it dies, or if reloading the model of a "
                   "dead stub fails (at most 5 times in 10 minutes). A dead stub's model is reloaded alone.")
@click.option("--ready-timeout", default=600.0, show_default=True, type=click.FloatRange(1, 86400),
              help="Seconds the models get to load; past it serve fails, naming the model still loading and what its "
                   "stub is doing (a line every 30 s says it while waiting).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(0, 3600),
              help="On Ctrl-C / SIGTERM: seconds running requests get to finish; the rest are cancelled (503) "
                   "and serve exits 1.")
@click.option("--plain", is_flag=True,
              help="With --engine: serve plain decoding on the same engine (no drafter), the served yardstick.")
def serve(engine_dir, repo_dir, host, http_port, grpc, grpc_port, metrics_port, model_name, max_batch, instances,
          max_kv_tokens, log_file, log_max_mb, max_request_bytes, max_json_depth, request_timeout, max_connections,
          max_upstream_calls, restart_on_crash, ready_timeout, drain_timeout, plain):
    """Serve an engine (--engine DIR) or a model repository (--repo DIR) until Ctrl-C.

    One HTTP port speaks the OpenAI API (/v1/models, /v1/chat/completions, /v1/completions), Triton's generate and
    infer routes, /health and /metrics. tritonserver runs behind it on loopback; every request is bounded and
    checked before it sees it."""
    from dflash_export.deploy.server import serve as run_server  # the serve extra's libraries: before any work

    if plain and repo_dir is not None:
        raise DFlashError("--plain is a deploy choice: give it with --engine, or deploy the repository with --plain",
                          field="--plain")
    if max_kv_tokens is not None and repo_dir is not None:
        raise DFlashError("--max-kv-tokens is a deploy choice: give it with --engine, or deploy the repository with it",
                          field="--max-kv-tokens")
    if (engine_dir is None) == (repo_dir is None):
        raise DFlashError("give --engine DIR (a built engine) or --repo DIR (a deployed repository), one of them",
                          field="--engine")
    # The two directories mixed up: say which option takes the one given.
    if engine_dir is not None and (Path(engine_dir) / MARKER).is_file():
        raise DFlashError("a model repository written by `deploy`, not an engine: serve it with --repo",
                          path=engine_dir, field="--engine")
    if repo_dir is not None and (Path(repo_dir) / "manifest.json").is_file() \
            and not (Path(repo_dir) / MARKER).is_file():
        raise DFlashError("a built engine, not a model repository: serve it with --engine (or `deploy` it first)",
                          path=repo_dir, field="--repo")
    marker = None  # the repository's check: by cached_repository for --engine, else by `serve` itself
    if engine_dir is not None:
        repo_dir, marker = cached_repository(engine_dir, instances=instances, max_batch=max_batch, plain=plain,
                                             max_kv_tokens=max_kv_tokens or 0)
        click.echo(f"model repository: {repo_dir}", err=True)
    # The repository is checked (its engine's files hashed) once per start; its notes are printed and the limits left
    # None filled with what it records by `serve` itself: the one place every way of serving goes through.
    limits = Limits(max_body_bytes=max_request_bytes, max_json_depth=max_json_depth, max_connections=max_connections,
                    max_connections_per_client=min(max_connections, Limits.max_connections_per_client),
                    request_timeout_s=request_timeout, max_upstream_calls=max_upstream_calls)
    sys.exit(run_server(repo_dir, http_port, grpc_port, metrics_port, host, log_path=log_file, limits=limits,
                        restart_on_crash=restart_on_crash, drain_timeout_s=drain_timeout, grpc=grpc,
                        model_id=model_name, ready_timeout_s=ready_timeout, log_max_bytes=log_max_mb << 20,
                        marker=marker))
