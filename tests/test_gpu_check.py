"""How the one-shot GPU check (scripts/gpu_check.sh, validate/gpu_check.py) degrades where it cannot run everything:
no CUDA device, no triton beside TensorRT, a section's process that crashes, the time limit, a python that never
writes a report. All on the CPU; the sections themselves are covered by tests/test_kernels.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dflash_export.validate import gpu_check, gpu_lossless

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _report(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def _pretend_installed(monkeypatch, present: set[str], absent: set[str]) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *a):
        top = name.split(".")[0]
        if top in absent:
            return None
        return object() if top in present else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_without_a_cuda_device_every_section_says_it_did_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path), "--sections", "kernels,plugin_layers,attention_vs_sdpa"]) == 2
    report = _report(tmp_path)
    assert "no CUDA device" in report["error"] and "no CUDA device" in capsys.readouterr().out
    for name in ("kernels", "plugin_layers", "attention_vs_sdpa"):
        assert report[name]["ran"] is False and "no CUDA device" in report[name]["reason"], report[name]
    env = report["environment"]
    assert env["torch"] == torch.__version__ and "torch_cuda" in env and "cuda_driver" in env


def test_plugin_layers_with_tensorrt_but_no_triton_says_triton_is_missing(tmp_path, monkeypatch):
    _pretend_installed(monkeypatch, {"tensorrt", "onnx"}, {"triton"})
    out = gpu_lossless.plugin_layers(tmp_path)
    assert out == {"ran": False, "reason": "triton is not installed", "ok": True}
    assert list(tmp_path.iterdir()) == []  # nothing built


def test_tiny_engine_with_tensorrt_but_no_triton_says_triton_is_missing(monkeypatch):
    _pretend_installed(monkeypatch, set(gpu_check.TINY_ENGINE_NEEDS) - {"triton"}, {"triton"})
    started = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: started.append(a) or pytest.fail("ran pytest"))
    assert gpu_check.tiny_engine(cpu=False) == {"ran": False, "reason": "triton is not installed", "ok": True}
    assert started == []


def test_a_section_whose_process_crashes_loses_no_other_section(tmp_path, monkeypatch):
    """plugin_layers runs in a child: here its child is killed (as a TensorRT crash would end it); the sections
    before and after it still run and the report names the signal."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, signal\nfrom dflash_export.validate import gpu_lossless\n"
        "gpu_lossless.plugin_layers = lambda tmp: os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(site))  # children only: this process has already started
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "out"
    rc = gpu_check.main(["--cpu", "--out", str(out), "--sections", "tiny_engine,plugin_layers,kernels"])
    report = _report(out)
    assert rc == 1
    assert "SIGKILL" in report["plugin_layers"]["error"] and report["plugin_layers"]["isolated"]
    assert report["tiny_engine"]["reason"] == "needs a GPU" and report["kernels"]["ok"]
    assert "in_progress" not in report


_CUT_SHORT = """
import os, signal, sys, time
from dflash_export.validate import gpu_check

def slow(*a, **k):  # the time limit arrives while this section runs
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

gpu_check.check_kernels = slow
sys.exit(gpu_check.main(["--cpu", "--in-process", "--out", sys.argv[1],
                         "--sections", "tiny_engine,kernels,jit_views,plugin_layers"]))
"""


def test_the_time_limit_keeps_finished_sections_and_names_the_cut_and_the_unrun_ones(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", _CUT_SHORT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 124, res.stdout + res.stderr
    report = _report(tmp_path)
    assert report["tiny_engine"]["reason"] == "needs a GPU"
    assert "cut short by the time limit" in report["kernels"]["error"]
    assert report["cut_short"] == {"section": "kernels", "not_run": ["jit_views", "plugin_layers"]}
    assert "jit_views" not in report and "in_progress" not in report
    assert "cut short by the time limit: running kernels" in res.stdout


def test_the_report_names_the_section_in_progress_while_it_runs(tmp_path, monkeypatch):
    seen = []

    def kernels(*a, **k):
        seen.append(_report(tmp_path).get("in_progress"))
        return {"ok": True}

    monkeypatch.setattr(gpu_check, "check_kernels", kernels)
    assert gpu_check.main(["--cpu", "--in-process", "--out", str(tmp_path), "--sections", "kernels"]) == 0
    assert seen == ["kernels"] and "in_progress" not in _report(tmp_path)


@pytest.mark.parametrize("python", ["false", "/nonexistent/python3"])
def test_the_script_writes_a_report_when_python_writes_none(tmp_path, python):
    for how in (["--out", str(tmp_path / "a")], [f"--out={tmp_path / 'b'}"]):
        env = dict(os.environ, PYTHON=python)
        env.pop("OUT", None)
        res = subprocess.run(["bash", str(SCRIPT), "--cpu", *how], env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode != 0
        out = Path(how[-1].split("=", 1)[-1])
        report = _report(out)
        assert report["exit_code"] == res.returncode and "before writing a report" in report["error"]


def _logger(level):
    return None


_logger.WARNING = 0


class _Stream:
    """A CUDA stream of the fake torch below: it records what it was told to wait for."""

    def __init__(self, log, name):
        self.log, self.name, self.cuda_stream = log, name, name

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def synchronize(self):
        self.log.append(("sync", self.name))


class _Tensor:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype

    def to(self, device, dtype):
        return self

    def contiguous(self):
        return self

    def data_ptr(self):
        return id(self)


def test_one_op_engines_run_after_their_inputs_reach_the_device(monkeypatch):
    """gpu_lossless._run_engine copies the inputs on the current stream and runs the engine on a side stream: the
    side stream must wait for the current one before TensorRT reads the inputs."""
    log = []
    current = _Stream(log, "current")
    fake_torch = types.SimpleNamespace(
        float32="f32", float16="f16", bfloat16="bf16", int64="i64", int32="i32",
        empty=lambda shape, dtype, device: _Tensor(shape, dtype),
        cuda=types.SimpleNamespace(Stream=lambda: _Stream(log, "side"), current_stream=lambda: current))
    monkeypatch.setattr(gpu_lossless, "torch", fake_torch)

    class Context:
        def set_input_shape(self, name, shape):
            return True

        def set_tensor_address(self, name, ptr):
            return True

        def get_tensor_shape(self, name):
            return (1,)

        def execute_async_v3(self, handle):
            log.append(("execute", handle))
            return True

    class Engine:
        num_io_tensors = 2

        def get_tensor_name(self, i):
            return ["x", "y"][i]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name == "x" else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return trt.float32

        def create_execution_context(self):
            return Context()

    trt = types.SimpleNamespace(
        float32="F32", float16="F16", bfloat16="BF16", int64="I64", int32="I32",
        TensorIOMode=types.SimpleNamespace(INPUT="in", OUTPUT="out"), Logger=_logger,
        Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda data: Engine()))
    out = gpu_lossless._run_engine(trt, b"engine", {"x": _Tensor((1,), "f32")})
    assert set(out) == {"y"}
    execute = log.index(("execute", "side"))
    assert ("wait", "side", "current") in log[:execute], log


def test_an_engine_that_does_not_deserialize_is_one_clear_error(monkeypatch):
    trt = types.SimpleNamespace(Logger=_logger,
                                Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda d: None))
    with pytest.raises(RuntimeError, match="could not deserialize"):
        gpu_lossless._run_engine(trt, b"junk", {})


def test_sigterm_handler_is_restored_after_a_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "check_kernels", lambda *a, **k: {"ok": True})
    before = signal.getsignal(signal.SIGTERM)
    gpu_check.main(["--cpu", "--in-process", "--out", str(tmp_path), "--sections", "kernels"])
    assert signal.getsignal(signal.SIGTERM) is before
