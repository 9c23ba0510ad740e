"""Half-precision copies of exported graphs, for builders that take the precision from the graph itself (TensorRT 11
builds only strongly typed networks: no BuilderFlag.FP16 lowering of a float32 graph).

`half_graph` converts every float32 tensor and op to float16 except the FP32_ISLAND nodes (tap fusion, RMSNorm
statistics; see builder.py) and the dflash plugin nodes, which keep float32 with casts at their borders; graph inputs
and outputs keep their float32 types (casts inside), so an engine built from the copy has the same I/O as one built
from the original. Conversion by onnxruntime's float16 converter (`onnxruntime.transformers.float16`).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.export import ops
from dflash_export.export.builder import FP32_ISLAND

HALF_DTYPES = ("float16",)


def island_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the main graph's nodes that must stay float32."""
    return [n.name for n in model.graph.node if n.name.startswith(FP32_ISLAND)]


def half_graph(model: onnx.ModelProto, dtype: str = "float16") -> onnx.ModelProto:
    """A copy of `model` (weights loaded) computing in `dtype` outside the float32 island; see the module docstring."""
    if dtype not in HALF_DTYPES:
        raise DFlashError(f"no {dtype} graph conversion (only {', '.join(HALF_DTYPES)})", field="dtype")
    try:
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    except ImportError:
        raise MissingDependency("onnxruntime is not installed (pip install 'dflash-export[onnx]')") from None
    plugin_ops = sorted({n.op_type for n in model.graph.node if n.domain == ops.DOMAIN})
    return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True,
                                    op_block_list=list(DEFAULT_OP_BLOCK_LIST) + plugin_ops,
                                    node_block_list=island_nodes(model))


def write_half_graph(onnx_path: Path, dtype: str = "float16") -> Path:
    """Write `<stem>.<dtype>.onnx` next to `onnx_path` (weights inline) and return its path."""
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path))
    out = onnx_path.with_name(f"{onnx_path.stem}.{dtype}.onnx")
    half = half_graph(model, dtype)
    weights = sum(len(t.raw_data) for t in half.graph.initializer)
    onnx.save(half, str(out), save_as_external_data=weights > (1 << 30), location=out.name + ".data")
    return out
