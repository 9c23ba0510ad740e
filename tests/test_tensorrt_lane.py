"""The backend against NVIDIA's real TensorRT Python layer (tests/trt_lane.py): each lane installs one TensorRT
bindings wheel (and, where named, numpy < 2.4) into a side directory and runs its checks in a subprocess, so this
process never imports tensorrt. Skipped when pip cannot fetch the wheels; the stand-in library under the bindings
returns NULL from every factory, so nothing here runs on a GPU."""

import functools
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import trt_lane  # noqa: E402


@functools.cache
def _lane_report(lane) -> dict:
    """One subprocess run per lane, shared by the tests below."""
    try:
        return trt_lane.run_lane(lane)
    except trt_lane.LaneUnavailable as e:
        return {"unavailable": str(e)}


def _report(lane) -> dict:
    report = _lane_report(lane)
    if "unavailable" in report:
        pytest.skip(f"{lane.name}: lane unavailable ({report['unavailable']})")
    return report


CHECKED_LANES = [ln for ln in trt_lane.LANES if ln.expect == "ok"]


@pytest.mark.parametrize("lane", trt_lane.LANES, ids=lambda ln: ln.name)
def test_backend_meets_the_real_tensorrt_python_layer(lane):
    """Every trt.* attribute the backend reads exists (or is read behind a guard); register_plugins is accepted by
    the real decorators; the real creator makes AOT and JIT plugins in build and runtime phases whose output dtypes,
    type combinations and tactics are the declared ones for float32 / float16 / bfloat16; the precision each recipe
    dtype resolves to names only flags this version has. A refused pair is refused with the MissingDependency line,
    and (for numpy) NVIDIA's code does fail without the refusal."""
    report = _report(lane)
    assert report["passed"], json.dumps(report, indent=1)[:4000]
    assert "tensorrt" not in sys.modules  # the main process stays without TensorRT


@pytest.mark.parametrize("lane", CHECKED_LANES, ids=lambda ln: ln.name)
def test_aot_kernel_entry_matches_what_tensorrt_passes(lane):
    """NVIDIA's AOT plugin object driven as the builder drives it (get_output_shapes, get_launch_params calling this
    package's aot_impl, get_kernel): for both plugins, every float type and attention tactic, the PTX .entry
    TensorRT receives declares exactly its inputs (64-bit pointers), the extra arguments (32-bit, as NVIDIA's
    SymExprImpl declares them) and its outputs (64-bit pointers); extra-argument values and grid as intended."""
    report = _report(lane)
    assert report["passed"], json.dumps(report, indent=1)[:4000]
    abi = report["aot_abi"]
    assert len(abi) == 9 and {k: v["params"] for k, v in abi.items() if "FusedVerify" in k} == {
        f"FusedVerify/{d}/tactic0": 9 for d in ("float32", "float16", "bfloat16")}
    assert all(v["params"] == 11 for k, v in abi.items() if "KVInjectedBlockAttention" in k)


@pytest.mark.parametrize("lane", CHECKED_LANES, ids=lambda ln: ln.name)
def test_serialized_plugin_fields_hold_the_node_attributes(lane):
    """The two faults of NVIDIA's get_fields_to_serialize and the project's replacement (keep_serialized_fields):
    on an AOT plugin NVIDIA's raises AttributeError, the replacement returns the node's attributes; on a JIT
    plugin NVIDIA's fields point at freed arrays, the replacement's read back right after memory churn, and a plugin
    re-created from them in the runtime phase holds the node's attributes."""
    report = _report(lane)
    assert report["passed"], json.dumps(report, indent=1)[:4000]
    attrs = {"KVInjectedBlockAttention": {"num_heads": 4, "num_kv_heads": 2, "scale": 0.125},
             "FusedVerify": {"temperature": 0.0}}
    assert report["aot_fields"] == attrs and report["jit_fields"] == attrs
    assert all("AttributeError" in v for v in report["aot_fields_nvidia"].values())


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
