"""engines/tensorrt_ptx.py: the AOT kernel's PTX .entry against the arguments TensorRT's AOT launch passes, on
hand-written PTX in the three shapes Triton releases emit (no trailing parameter; one, global scratch; two, global
and profile scratch). The real compiled kernels, assembled by ptxas, are checked in tests/test_tensorrt_lane.py."""

from types import SimpleNamespace

import pytest

from dflash_export.engines.tensorrt_ptx import launchable_ptx, parse_entry, signature_widths
from dflash_export.errors import DFlashError

# TensorRT passes: 2 input pointers, 1 int32 extra argument, 1 output pointer
WIDTHS = [64, 64, 32, 64]


def _ptx(trailing: int, read: tuple[int, ...] = (0, 1, 2, 3)) -> str:
    params = [".param .u64 .ptr .global .align 1 k_param_0", ".param .u64 .ptr .global .align 1 k_param_1",
              ".param .u32 k_param_2", ".param .u64 .ptr .global .align 1 k_param_3"]
    params += [f".param .u64 .ptr .global .align 1 k_param_{4 + i}" for i in range(trailing)]
    loads = "\n".join(f"\tld.param.b{32 if i == 2 else 64} \t%rd{i}, [k_param_{i}];" for i in read)
    return (".version 8.7\n.target sm_90a\n.address_size 64\n\n.visible .entry k(\n\t" + ",\n\t".join(params)
            + "\n)\n.reqntid 128\n{\n\t.reg .b64 \t%rd<16>;\n" + loads + "\n\tret;\n}\n")


def _meta(**fields):
    base = {"global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1, "launch_cooperative_grid": False,
            "launch_pdl": False, "tensordesc_meta": []}
    base.update(fields)
    return SimpleNamespace(**base)


def _body(ptx: str) -> str:
    return ptx[ptx.index(")"):]


@pytest.mark.parametrize("trailing", [1, 2])
def test_unused_trailing_scratch_pointers_leave_the_entry(trailing):
    ptx = _ptx(trailing)
    assert len(parse_entry(ptx, "k").params) == 4 + trailing
    out, entry = launchable_ptx(ptx, "k", _meta(), WIDTHS)
    assert [p.bits for p in entry.params] == WIDTHS
    assert [p.name for p in parse_entry(out, "k").params] == [f"k_param_{i}" for i in range(4)]
    assert _body(out) == _body(ptx)  # only the parameter list changed
    assert out.split(".visible")[0] == ptx.split(".visible")[0]


def test_a_kernel_without_trailing_parameters_is_left_as_it_is():
    """Triton 3.2 appends nothing and its metadata has no scratch fields."""
    ptx = _ptx(0)
    out, entry = launchable_ptx(ptx, "k", SimpleNamespace(num_ctas=1), WIDTHS)
    assert out == ptx and len(entry.params) == 4


def test_a_trailing_parameter_the_kernel_reads_is_refused_by_name():
    ptx = _ptx(2, read=(0, 1, 2, 3, 5))
    with pytest.raises(DFlashError, match=r"k_param_5.*used 1 time"):
        launchable_ptx(ptx, "k", _meta(), WIDTHS)


@pytest.mark.parametrize("field,value", [("global_scratch_size", 256), ("profile_scratch_size", 1024),
                                         ("num_ctas", 2), ("launch_cooperative_grid", True), ("launch_pdl", True),
                                         ("tensordesc_meta", [{"block_shape": [16, 16]}])])
def test_a_kernel_needing_what_tensorrt_does_not_give_is_refused_by_name(field, value):
    with pytest.raises(DFlashError) as err:
        launchable_ptx(_ptx(2), "k", _meta(**{field: value}), WIDTHS)
    assert err.value.field == field and "AOT kernel k" in str(err.value)


def test_leading_parameters_must_have_the_widths_tensorrt_passes():
    with pytest.raises(DFlashError, match=r"parameter 2 \(k_param_2\) is u32, TensorRT passes 64 bits"):
        launchable_ptx(_ptx(2), "k", _meta(), [64, 64, 64, 64])
    with pytest.raises(DFlashError, match="declares 6 parameters, TensorRT passes 7"):
        launchable_ptx(_ptx(2), "k", _meta(), WIDTHS + [32, 32, 32])
    with pytest.raises(DFlashError, match="trailing parameter k_param_4 \\(u32\\)"):
        launchable_ptx(_ptx(0).replace(".param .u64 .ptr .global .align 1 k_param_3",
                                       ".param .u64 .ptr .global .align 1 k_param_3,\n\t.param .u32 k_param_4"),
                       "k", _meta(), WIDTHS)


def test_entry_parsing_names_what_it_cannot_read():
    with pytest.raises(DFlashError, match="0 .entry declarations"):
        parse_entry(_ptx(0), "other")
    aggregate = _ptx(0).replace(".param .u32 k_param_2", ".param .align 8 .b8 k_param_2[16]")
    with pytest.raises(DFlashError, match="parameter 2 is not a scalar or pointer"):
        parse_entry(aggregate, "k")


def test_signature_widths_follow_triton_types():
    sig = {"a": "*fp32", "b": "*bf16", "n": "i32", "m": "i64", "x": "fp32", "h": "bf16", "C": "constexpr"}
    assert signature_widths(sig) == [64, 64, 32, 64, 32, 16]
