import os

import pytest
import torch

# Two cores: keep each test process to one intra-op thread so parallel helpers / xdist do not thrash.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter

    return load_target("tiny:qwen3/target"), load_drafter("tiny:qwen3/drafter")


@pytest.fixture(scope="session")
def tiny_llama():
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter

    return load_target("tiny:llama/target"), load_drafter("tiny:llama/drafter")


@pytest.fixture(scope="session", params=["tiny-qwen3", "tiny-llama"])
def ort_pair(request, tmp_path_factory):
    """(recipe, engine dir, loaded ONNX Runtime engine, TorchEngine) of each tiny recipe, built once per session for
    every test module that drives a built engine (engine, batching, bench)."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.engines.torch_ref import TorchEngine
    from dflash_export.recipes import load_recipe

    recipe = load_recipe(request.param)
    out = build_onnxruntime(recipe, tmp_path_factory.mktemp(request.param) / "onnxruntime", threads=1)
    return recipe, out, load_engine(out, threads=1), TorchEngine.from_recipe(recipe)


@pytest.fixture(scope="session", autouse=True)
def _private_tmpdir(tmp_path_factory):
    """Temporary files of the code under test (server logs and work dirs, saved tracebacks; also in the CLI
    subprocesses, through TMPDIR) go under pytest's own base directory, which pytest prunes, instead of
    accumulating in /tmp."""
    import tempfile

    d = tmp_path_factory.mktemp("tmp")
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(d), str(d)
    yield
    tempfile.tempdir = old_dir
    if old_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old_env


def pytest_collection_modifyitems(items):
    """A test that uses the module's running tritonserver (the `server` fixture) is a server test, marked or not, so
    `./dev test --fast` (-m "not slow and not server") never starts one."""
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)
