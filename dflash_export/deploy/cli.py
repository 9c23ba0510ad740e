"""`dflash-export deploy` and `dflash-export serve`: parse options, call the deploy modules (imported lazily so the
rest of the CLI starts without them)."""

from __future__ import annotations

import sys

import click

from dflash_export.deploy.front import Limits
from dflash_export.deploy.repository import MARKER, check_repository, write_repository
from dflash_export.deploy.server import serve as run_server


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(file_okay=False),
              help="Built engine directory (engines/<recipe>/<backend>).")
@click.option("--repo", "repo_dir", required=True, type=click.Path(),
              help="Model repository to write (replaced atomically if it is an earlier deploy).")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Model instances (processes) per model; each holds its own copy of the engine.")
@click.option("--max-queue-size", default=64, show_default=True, type=click.IntRange(0),
              help="Requests waiting per model before Triton rejects new ones (0 = unbounded).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0),
              help="Intra-op threads per instance (0: the server's cores divided by --instances).")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Also write the decoupled streaming model dflash_stream (for generate_stream).")
@click.option("--llmapi-model-py", type=click.Path(dir_okay=False), default=None,
              help="TensorRT-LLM bundles only: TensorRT-LLM's llmapi model.py to place next to model.yaml.")
@click.option("--max-request-bytes", default=1 << 20, show_default=True, type=click.IntRange(1, 1 << 30),
              help="Largest HTTP request body `serve` lets through to tritonserver (larger: HTTP 413).")
@click.option("--max-json-depth", default=32, show_default=True, type=click.IntRange(2, 256),
              help="Deepest JSON nesting `serve` lets through (deeper: HTTP 400).")
@click.option("--max-batch", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Sequences one instance decodes together: > 1 feeds its concurrent requests into one shared "
                   "continuous batch (onnxruntime engines); 1 runs one request at a time.")
@click.option("--max-queued-tokens", default=65536, show_default=True, type=click.IntRange(1),
              help="With --max-batch > 1: prompt tokens that may wait to join the batch (more: HTTP 503).")
def deploy(engine_dir, repo_dir, instances, max_queue_size, threads, stream, llmapi_model_py, max_request_bytes,
           max_json_depth, max_batch, max_queued_tokens):
    """Write a Triton model repository serving ENGINE (python backend running the DFlash runtime)."""
    repo = write_repository(engine_dir, repo_dir, instances=instances, max_queue_size=max_queue_size,
                            decoupled=None if stream else False, threads=threads, llmapi_model_py=llmapi_model_py,
                            max_body_bytes=max_request_bytes, max_json_depth=max_json_depth, max_batch=max_batch,
                            max_queued_tokens=max_queued_tokens)
    import json

    models = json.loads((repo / MARKER).read_text())["models"]
    click.echo(f"wrote {repo} (models: {', '.join(models)})")
    click.echo(f"serve it with: dflash-export serve --repo {repo}")


@click.command()
@click.option("--repo", "repo_dir", required=True, type=click.Path(file_okay=False), help="Model repository.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535))
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(1, 65535))
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="Write tritonserver's log here (default: a new dflash-tritonserver-*.log in the temp directory).")
@click.option("--max-request-bytes", default=None, type=click.IntRange(1, 1 << 30),
              help="Largest HTTP request body let through (larger: 413). Default: the value deploy recorded.")
@click.option("--max-json-depth", default=None, type=click.IntRange(2, 256),
              help="Deepest JSON nesting let through (deeper: 400). Default: the value deploy recorded.")
@click.option("--restart-on-crash/--no-restart-on-crash", default=True, show_default=True,
              help="Restart tritonserver behind the same HTTP port if it dies (at most 5 times in 10 minutes).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(0, 3600),
              help="On Ctrl-C / SIGTERM: seconds running requests get to finish; the rest are cancelled (503) "
                   "and serve exits 1.")
def serve(repo_dir, host, http_port, grpc_port, metrics_port, log_file, max_request_bytes, max_json_depth,
          restart_on_crash, drain_timeout):
    """Run tritonserver (from nvidia-pytriton) on a model repository until Ctrl-C.

    HTTP goes through a front on --host:--http-port that bounds and checks every request before tritonserver sees
    it; gRPC listens on 127.0.0.1 only."""
    limits = None
    if max_request_bytes is not None or max_json_depth is not None:
        marker = check_repository(repo_dir)
        recorded = marker.get("limits") if isinstance(marker.get("limits"), dict) else {}
        limits = Limits(max_body_bytes=max_request_bytes or recorded.get("max_body_bytes", Limits.max_body_bytes),
                        max_json_depth=max_json_depth or recorded.get("max_json_depth", Limits.max_json_depth))
    sys.exit(run_server(repo_dir, http_port, grpc_port, metrics_port, host, log_path=log_file, limits=limits,
                        restart_on_crash=restart_on_crash, drain_timeout_s=drain_timeout))
