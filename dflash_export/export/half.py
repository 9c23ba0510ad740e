"""Half-precision copies of exported graphs, for builders that take the precision from the graph itself (TensorRT 11
builds only strongly typed networks: no BuilderFlag.FP16 lowering of a float32 graph).

`half_graph` makes every float32 tensor of the main graph float16 (or bfloat16) except around the float32 island:
the FP32_ISLAND nodes (tap fusion, RMSNorm statistics; see builder.py) and the dflash plugin nodes compute in float32,
with a Cast at each border. Graph inputs and outputs keep float32 (casts inside), so an engine built from the copy
has the same I/O as one built from the original. Model-local functions (the plugins' reference bodies) are left as
they are: only float32 plugin nodes call them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash_export.errors import DFlashError
from dflash_export.export import ops
from dflash_export.export.builder import FP32_ISLAND
from dflash_export.files import native_path

F32 = TensorProto.FLOAT
HALF_DTYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def island_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the main graph's nodes that stay float32: FP32_ISLAND nodes and the dflash plugin nodes."""
    return [n.name for n in model.graph.node if n.name.startswith(FP32_ISLAND) or n.domain == ops.DOMAIN]


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    typed = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    typed.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:  # Constant outputs inference may leave untyped
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            typed.setdefault(node.output[0], node.attribute[0].t.data_type)
    produced = {o for n in g.node for o in n.output if o}
    unknown = sorted(o for o in produced if o not in typed)
    if unknown:
        raise DFlashError(f"cannot tell the element type of {len(unknown)} tensor(s) (e.g. {unknown[0]}) for a "
                          "half-precision copy", field="value_info")
    return {name for name, t in typed.items() if t == F32}


def _half_array(arr: np.ndarray, elem: int) -> np.ndarray:
    if elem == TensorProto.FLOAT16:
        return arr.astype(np.float16)
    import ml_dtypes  # for bfloat16 arrays; a dependency of onnx >= 1.19 and of onnx-ir (the onnx extra)

    return arr.astype(ml_dtypes.bfloat16)


def _half_tensor(t: onnx.TensorProto, elem: int) -> onnx.TensorProto:
    return numpy_helper.from_array(_half_array(numpy_helper.to_array(t), elem), t.name)


def _to_half_attributes(node: onnx.NodeProto, elem: int) -> None:
    """A half node's attributes that name float32 as a type or hold a float32 tensor."""
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to" and a.i == F32:
            a.i = elem
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F32:
            a.t.CopyFrom(_half_tensor(a.t, elem))


def half_graph(model: onnx.ModelProto, dtype: str = "float16", fp32_island: bool = True) -> onnx.ModelProto:
    """A copy of `model` (weights loaded) computing in `dtype` outside the float32 island; see the module docstring.
    `fp32_island=False` keeps only the plugin nodes float32 (what a plain conversion does; for comparison)."""
    if dtype not in HALF_DTYPES:
        raise DFlashError(f"no {dtype} graph conversion (only {', '.join(HALF_DTYPES)})", field="dtype")
    half_elem = HALF_DTYPES[dtype]
    floats = _float_tensors(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    island = set(island_nodes(out)) if fp32_island else {n.name for n in g.node if n.domain == ops.DOMAIN}
    graph_outputs = {o.name for o in g.output}
    # where each float tensor lives: float16 when a float16 node makes it, float32 when an island node, a graph
    # input or an initializer read only by island nodes does
    half: set[str] = set()
    for node in g.node:
        if node.name not in island:
            half.update(o for o in node.output if o in floats)
    readers: dict[str, set[bool]] = {}
    for node in g.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name in island)
    inits = {t.name: t for t in g.initializer}
    for name, t in inits.items():
        if t.data_type == F32 and False in readers.get(name, ()):
            if True in readers[name]:  # read on both sides: the island keeps a float32 copy
                keep = onnx.TensorProto()
                keep.CopyFrom(t)
                keep.name = FP32_ISLAND + name
                g.initializer.append(keep)
                for node in g.node:
                    if node.name in island:
                        node.input[:] = [FP32_ISLAND + i if i == name else i for i in node.input]
            t.CopyFrom(_half_tensor(t, half_elem))
            half.add(name)

    casts: dict[tuple[str, int], str] = {}
    nodes: list[onnx.NodeProto] = []

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}__{'f32' if to == F32 else 'half'}"
            nodes.append(helper.make_node("Cast", [name], [casts[key]], name=f"cast/{casts[key]}", to=to))
        return casts[key]

    renamed = {o: o + "__half" for o in graph_outputs if o in half}
    for node in g.node:
        is_half = node.name not in island
        for i, orig in enumerate(node.input):
            name = renamed.get(orig, orig)
            if orig in floats and is_half != (orig in half):
                name = cast(name, half_elem if is_half else F32)
            node.input[i] = name
        if is_half:
            _to_half_attributes(node, half_elem)
        node.output[:] = [renamed.get(o, o) for o in node.output]
        nodes.append(node)
    for name, half_name in renamed.items():
        nodes.append(helper.make_node("Cast", [half_name], [name], name=f"cast/{name}", to=F32))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]  # float32 types recorded for tensors that are now float16
    return out


def write_half_graph(onnx_path: Path, dtype: str = "float16") -> Path:
    """Write `<stem>.<dtype>.onnx` next to `onnx_path` and return its path (weights external when large)."""
    onnx_path = Path(onnx_path)
    with native_path(onnx_path) as name:
        half = half_graph(onnx.load(name), dtype)
    out = onnx_path.with_name(f"{onnx_path.stem}.{dtype}.onnx")
    weights = sum(len(t.raw_data) for t in half.graph.initializer)
    with native_path(out) as name:
        onnx.save(half, name, save_as_external_data=weights > (1 << 30), location=out.name + ".data")
    return out
