"""`dflash-export deploy` and `dflash-export serve`: parse options, call the deploy modules (imported lazily so the
rest of the CLI starts without them)."""

from __future__ import annotations

import sys

import click


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
def deploy(engine_dir, repo_dir, instances, max_queue_size, threads, stream, llmapi_model_py):
    """Write a Triton model repository serving ENGINE (python backend running the DFlash runtime)."""
    from dflash_export.deploy.repository import MARKER, write_repository

    repo = write_repository(engine_dir, repo_dir, instances=instances, max_queue_size=max_queue_size,
                            decoupled=None if stream else False, threads=threads, llmapi_model_py=llmapi_model_py)
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
def serve(repo_dir, host, http_port, grpc_port, metrics_port, log_file):
    """Run tritonserver (from nvidia-pytriton) on a model repository until Ctrl-C."""
    from dflash_export.deploy.server import serve as run_server

    sys.exit(run_server(repo_dir, http_port, grpc_port, metrics_port, host, log_path=log_file))
