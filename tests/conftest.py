import os

import numpy as np
import pytest
import torch

# Two cores: keep each test process to one intra-op thread so parallel helpers / xdist do not thrash.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Set to run the suite as on a CPU where no row floor makes verify rows bit-identical to plain steps (an engine's
# `numerics.bit_identical` False), e.g. `DFLASH_TEST_NO_BIT_IDENTICAL_FLOOR=1 python -m pytest tests/test_tree.py`.
NO_BIT_IDENTICAL_FLOOR = "DFLASH_TEST_NO_BIT_IDENTICAL_FLOOR"


def _no_bit_identical_floor() -> None:
    """Make every engine this process loads probe its kernels (engines/numerics.py) as on a CPU with no bit-identical
    row floor: floor 1 with the whole step on the host is measured as ever (its one-row attention rounds differently
    from the many-row path here, so the engine then runs with kernels that really differ) and reported not
    bit-identical whatever it measures; any higher floor is reported not bit-identical, with a difference larger than
    any measured, unprobed. So each load settles on floor 1 and says "lossless within kernel numerics"; it caches no
    verdict, and a cached one fails its re-check and goes. Engines loaded by subprocesses (CLI runs, servers, benchmark
    workers) probe as ever: tests that compare with them go by the verdict of the engine in this process."""
    from dflash_export.engines import numerics

    real = numerics.probe_floor
    worse = float(np.finfo(np.float32).max)

    def probe_floor(engine, floor, rows=None, pad="host"):
        if floor > 1:
            engine.row_floor, engine.row_pad = floor, pad
            return False, worse
        return False, real(engine, 1, rows, "host")[1]

    numerics.probe_floor = probe_floor


if os.environ.get(NO_BIT_IDENTICAL_FLOOR):
    _no_bit_identical_floor()


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
