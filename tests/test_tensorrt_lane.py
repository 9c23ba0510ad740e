"""The backend against NVIDIA's real TensorRT Python layer (tests/trt_lane.py): each lane installs one TensorRT
bindings wheel (and, where named, numpy < 2.4) into a side directory and runs its checks in a subprocess, so this
process never imports tensorrt. Skipped when pip cannot fetch the wheels; the stand-in library under the bindings
returns NULL from every factory, so nothing here runs on a GPU."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import trt_lane  # noqa: E402


@pytest.mark.parametrize("lane", trt_lane.LANES, ids=lambda ln: ln.name)
def test_backend_meets_the_real_tensorrt_python_layer(lane):
    """Every trt.* attribute the backend reads exists (or is read behind a guard); register_plugins is accepted by
    the real decorators; the real creator makes AOT and JIT plugins in build and runtime phases whose output dtypes,
    type combinations and tactics are the declared ones for float32 / float16 / bfloat16; the precision each recipe
    dtype resolves to names only flags this version has. A refused pair is refused with the MissingDependency line,
    and (for numpy) NVIDIA's code does fail without the refusal."""
    try:
        report = trt_lane.run_lane(lane)
    except trt_lane.LaneUnavailable as e:
        pytest.skip(f"{lane.name}: lane unavailable ({e})")
    assert report["passed"], json.dumps(report, indent=1)[:4000]
    assert "tensorrt" not in sys.modules  # the main process stays without TensorRT


@pytest.mark.parametrize("lane", trt_lane.TRITON_LANES, ids=lambda ln: ln.name)
def test_shipped_ptx_assembles_with_the_parameters_tensorrt_passes(lane):
    """Both plugin kernels, compiled by this Triton as aot_impl compiles them for sm_80 / sm_90 / sm_100 and
    assembled by the ptxas its wheel carries (it runs on a CPU): the parameter layout the assembler records in each
    cubin (cuobjdump's EIATTR_KPARAM_INFO) is exactly TensorRT's AOT launch -- 8-byte input pointers, 4-byte extra
    arguments, 8-byte output pointers, nothing after -- and the trailing parameters removed are the ones this
    Triton release appends (0, 1 or 2)."""
    if lane.triton is None:
        pytest.importorskip("triton")
    try:
        report = trt_lane.run_assemble(lane)
    except trt_lane.LaneUnavailable as e:
        pytest.skip(f"{lane.name}: lane unavailable ({e})")
    assert report["passed"], json.dumps(report, indent=1)[:4000]
