"""The ONNX graph builder every exported graph is written with, and the external-data weight files they share.

`GraphBuilder` collects nodes and initializers (`op` returns output names, so a graph reads like the PyTorch forward it
mirrors); `WeightStore` writes each large weight once, 64-byte aligned, and returns the external-data reference every
graph that uses the weight points to; `place_weights` attaches a finished graph's weights; `finish` makes the model.
Hand-written with onnx.helper (see graph.py for why not optimum's exporter).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash_export.errors import DFlashError
from dflash_export.export import ops

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64
I32 = TensorProto.INT32
MS = "com.microsoft"
# Node-name prefix of the ops that must compute in float32 in a half-precision build: the tap fusion (drafter fc +
# hidden_norm, whose inputs are the target's raw residual stream) and every RMSNorm's statistics (x*x of a
# |x| > 256 value already exceeds fp16's 65504). export/half.py keeps these nodes float32 in an fp16 graph;
# tensorrt_build pins the layers TensorRT's parser names after them to float32 in a weakly typed build.
FP32_ISLAND = "fp32_island/"


class GraphBuilder:
    """Collects nodes and initializers; `op` returns the output name(s)."""

    def __init__(self, name: str, store: "WeightStore | None" = None):
        self.name = name
        self.store = store  # large weights go to disk as soon as they are made: export memory stays ~ the model's
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray | onnx.TensorProto] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}
        self._island = 0

    def fp32_island(self):
        """Context in which every node made is named with FP32_ISLAND (kept float32 by a half-precision build)."""
        import contextlib

        @contextlib.contextmanager
        def island():
            self._island += 1
            try:
                yield
            finally:
                self._island -= 1

        return island()

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op_type: str, inputs, n_out: int = 1, name: str | None = None, domain: str = "",
           outputs: list[str] | None = None, **attrs):
        outs = outputs or [self.fresh(name or op_type.lower()) for _ in range(n_out)]
        prefix = FP32_ISLAND if self._island else ""
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(prefix + "n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def weight(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        self.inits[name] = self.store.put(name, arr) if self.store and arr.nbytes > self.store.small_bytes else arr
        return name

    def const(self, value, dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(self.fresh("const"), arr)
        return self._consts[key]

    def input(self, name, elem, shape):
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name, elem, shape):
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    # Common blocks ----------------------------------------------------------------------------------------------------

    def linear(self, x: str, w: np.ndarray, wname: str, b: np.ndarray | None = None) -> str:
        """x [..., in] @ W^T (W [out, in] as torch stores it, transposed once at export)."""
        y = self.op("MatMul", [x, self.weight(wname, np.ascontiguousarray(w.T))])
        if b is not None:
            y = self.op("Add", [y, self.weight(wname + "_bias", b)])
        return y

    def rms_norm(self, x: str, w: str, eps: float, ort: bool) -> str:
        if ort:
            with self.fp32_island():
                return self.op("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=float(eps))
        # fp32 RMSNorm as the reference: x * rsqrt(mean(x^2) + eps) * w; the statistics stay float32 in half builds
        with self.fp32_island():
            sq = self.op("Mul", [x, x])
            ms = self.op("ReduceMean", [sq], axes=[-1], keepdims=1)
            inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.const(eps, np.float32)])])])
            normed = self.op("Mul", [x, inv])
        return self.op("Mul", [normed, w])

    def heads(self, x: str, n: int, d: int) -> str:
        """[B,S,n*d] -> [B,n,S,d]"""
        return self.op("Transpose", [self.op("Reshape", [x, self.const([0, 0, n, d])])], perm=[0, 2, 1, 3])

    def rope(self, x: str, cos: str, sin: str, d: int) -> str:
        """x [B,h,S,D]; cos/sin [B,1,S,D]; rotate-half as HF."""
        x1, x2 = self.op("Split", [x, self.const([d // 2, d // 2])], n_out=2, axis=-1)
        rot = self.op("Concat", [self.op("Neg", [x2]), x1], axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])])

    def rope_tables(self, positions: str, cos_table: str, sin_table: str) -> tuple[str, str]:
        """positions [B,S] -> cos/sin [B,1,S,D] gathered from [max_len, D] tables."""
        one = self.const([1])
        cos = self.op("Unsqueeze", [self.op("Gather", [cos_table, positions], axis=0), one])
        sin = self.op("Unsqueeze", [self.op("Gather", [sin_table, positions], axis=0), one])
        return cos, sin

    def mlp(self, x: str, sd: dict, p: str, wprefix: str = "") -> str:
        gate = self.linear(x, sd[p + "gate_proj.weight"], wprefix + p + "gate_proj")
        up = self.linear(x, sd[p + "up_proj.weight"], wprefix + p + "up_proj")
        act = self.op("Mul", [gate, self.op("Sigmoid", [gate])])  # SiLU
        return self.linear(self.op("Mul", [act, up]), sd[p + "down_proj.weight"], wprefix + p + "down_proj")

    def mlp_fused(self, x: str, sd: dict, p: str) -> str:
        """As `mlp`, with gate and up in one MatMul (same input, one dispatch), split afterwards."""
        w = np.concatenate([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]], axis=0)
        inter = sd[p + "gate_proj.weight"].shape[0]
        gate, up = self.op("Split", [self.linear(x, w, p + "gate_up_proj"), self.const([inter, inter])], n_out=2,
                           axis=-1)
        act = self.op("Mul", [gate, self.op("Sigmoid", [gate])])
        return self.linear(self.op("Mul", [act, up]), sd[p + "down_proj.weight"], p + "down_proj")

    def block_conv(self, x: str, dynamic: str, base: np.ndarray, wname: str, c) -> str:
        """DFlash 2's grouped dynamic causal convolution along the block: x [B,L,H], dynamic [B,L,K,G], base [K,H]
        -> sum_o (base[o] + dynamic[:, :, o]) * x shifted o slots later (zeros before the anchor), per group.
        Plain ONNX: K shifted copies (Pad then Slice back to L, so a block shorter than K stays exact)."""
        k, gs = c.conv_kernel_size, c.conv_group_size
        groups = c.hidden_size // gs
        blocks = self.op("Reshape", [x, self.const([0, 0, groups, gs])])
        length = self.op("Shape", [x], start=1, end=2)
        dyn = self.op("Split", [dynamic, self.const([1] * k)], n_out=k, axis=2) if k > 1 else [dynamic]
        out = None
        for o in range(k):
            shifted = blocks
            if o:
                padded = self.op("Pad", [blocks, self.const([0, o, 0, 0, 0, 0, 0, 0])])
                shifted = self.op("Slice", [padded, self.const([0]), length, self.const([1])])
            dyn_o = self.op("Transpose", [dyn[o]], perm=[0, 1, 3, 2])  # [B,L,1,G] -> [B,L,G,1]
            base_o = self.weight(f"{wname}.{o}", base[o].reshape(1, 1, groups, gs).astype(np.float32))
            term = self.op("Mul", [self.op("Add", [base_o, dyn_o]), shifted])
            out = term if out is None else self.op("Add", [out, term])
        return self.op("Reshape", [out, self.const([0, 0, c.hidden_size])])

    def block_conv_prepare(self, x: str, sd: dict, wname: str, p: str, c) -> tuple[str, str]:
        """DFlash 2's `prepare`: the kernel projection of x [B,L,H] -> [B,L,2,K,G]; x convolved with base_kernel[0]
        and the first half; returns (convolved x, the second half [B,L,K,G] for `finish`)."""
        k, groups = c.conv_kernel_size, c.hidden_size // c.conv_group_size
        dyn = self.op("Reshape", [self.linear(x, sd[p + "kernel_projection.weight"], wname + ".kernel_projection"),
                                  self.const([0, 0, 2, k, groups])])
        first, second = (self.op("Squeeze", [half, self.const([2])])
                         for half in self.op("Split", [dyn, self.const([1, 1])], n_out=2, axis=2))
        return self.block_conv(x, first, sd[p + "base_kernel"][0], wname + ".base0", c), second

    def lm_head(self, hidden: str, head: str, hidden_size: int) -> str:
        """hidden [B,n,H] -> logits [B,n,V] with Gemm(transB) on the [V,H] table itself, so the embedding and a tied
        LM head stay one tensor (a MatMul would need a transposed copy)."""
        shape = self.op("Shape", [hidden])
        bn = self.op("Slice", [shape, self.const([0]), self.const([2])])
        flat = self.op("Reshape", [hidden, self.const([-1, hidden_size])])
        logits2 = self.op("Gemm", [flat, head], transB=1)
        v = self.op("Shape", [head])
        v0 = self.op("Slice", [v, self.const([0]), self.const([1])])
        return self.op("Reshape", [logits2, self.op("Concat", [bn, v0], axis=0)])


def finish(g: GraphBuilder, functions, ort: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Graph + functions; initializers are attached later by `place_weights` (external data)."""
    graph = helper.make_graph(g.nodes, g.name, g.inputs, g.outputs)
    model = ops.make_model(graph, functions)
    if ort:
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return model, g.inits


ALIGN = 64  # external-data offsets aligned so ORT can map / read tensors without realigning


class WeightStore:
    """One external-data file; a name written once is referenced by every graph that uses it (same bytes on disk,
    same offsets), so graphs built from the same weights share their data file."""

    def __init__(self, path, small_bytes: int = 1024):
        self.path = path
        self.location = path.name
        self.small_bytes = small_bytes
        self.f = open(path, "wb")
        self.protos: dict[str, onnx.TensorProto] = {}

    def put(self, name: str, arr: np.ndarray) -> onnx.TensorProto:
        if name in self.protos:
            if list(self.protos[name].dims) != list(arr.shape):
                raise DFlashError(f"weight {name!r} stored twice with different shapes", path=self.path)
            return self.protos[name]
        pos = self.f.tell()
        pad = (-pos) % ALIGN
        if pad:
            self.f.write(b"\0" * pad)
            pos += pad
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)  # written as it is: no second copy in memory
        self.f.write(data)
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", self.location), ("offset", str(pos)), ("length", str(len(data)))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.protos[name] = t
        return t

    def close(self):
        self.f.close()


def place_weights(model: onnx.ModelProto, inits: dict, store: WeightStore, shared: WeightStore,
                  shared_arrays: dict) -> None:
    """Attach the model's weights: small ones inline, large ones in `store`, the embedding / LM head in `shared`
    (written once, referenced by both graphs)."""
    for name, arr in inits.items():
        if isinstance(arr, onnx.TensorProto):  # already written by the builder
            model.graph.initializer.append(arr)
        elif arr.nbytes <= store.small_bytes:
            model.graph.initializer.append(numpy_helper.from_array(arr, name))
        else:
            model.graph.initializer.append(store.put(name, arr))
    used = {i for n in model.graph.node for i in n.input}
    for name, arr in shared_arrays.items():
        if name in used:
            model.graph.initializer.append(shared.put(name, arr))
