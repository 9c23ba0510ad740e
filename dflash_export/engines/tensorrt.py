"""The TensorRT backend: the exported ONNX graphs compiled to TensorRT engines, the two custom ops as plugins.

Bounded on purpose. Everything that needs `tensorrt` (plugin registration, engine build, the polygraphy comparison)
imports it inside a function and is reached only through `register_plugins`, `build_tensorrt_engines`,
`build_tensorrt` and `compare_onnxruntime_tensorrt`; without it they raise MissingDependency naming the extra.
What does not need it is plain Python and tested everywhere: the plugin contract check on ONNX models
(`check_plugin_attributes`), the optimization-profile tables (`profile_shapes`), example feeds, and the Triton AOT
compilation of the plugin kernels (`compile_*_aot`, triton only).

Plugins (`tensorrt.plugin`, TensorRT >= 10.8; AOT needs >= 10.12): `dflash::KVInjectedBlockAttention` and
`dflash::FusedVerify`, version "1" — TensorRT's ONNX parser finds them by the node's op type plus its
`plugin_namespace` / `plugin_version` attributes. Each has a shape/dtype registration, an autotune declaration
(type combinations; tactics = key-tile sizes for the attention), an `aot_impl` returning the Triton kernel compiled
to PTX (so engines run without Python), and a JIT `impl` fallback that launches the same kernels through torch.
"""

# No `from __future__ import annotations` here: tensorrt.plugin reads the plugin functions' annotations at
# registration, so they must be real types, not strings.
import dataclasses
import importlib.util
import threading
from pathlib import Path
from typing import Any, List, Tuple, Union

from dflash_export.engines.base import EngineInfo
from dflash_export.engines.graph_engine import (
    DECODE,
    FIRST_BLOCK,
    PREFILL,
    STEP,
    VERIFY,
    GraphEngine,
    GraphRunner,
    KVCache,
    Profile,
    graph_profiles,
    profile_shapes,
    vocab_size_of,
)
from dflash_export.engines.manifest import Manifest
from dflash_export.errors import DFlashError, MissingDependency

BACKEND = "tensorrt"
PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
KV_ATTENTION = "KVInjectedBlockAttention"
FUSED_VERIFY = "FusedVerify"
INSTALL_HINT = "pip install 'dflash-export[tensorrt]' (TensorRT >= 10.8 + polygraphy) on a machine with an NVIDIA GPU"
TARGET_ONNX, DRAFTER_ONNX = "target_verify.onnx", "drafter.onnx"
TARGET_ENGINE, DRAFTER_ENGINE = "target_verify.engine", "drafter.engine"


@dataclasses.dataclass(frozen=True)
class PluginSpec:
    """What a dflash node must look like for its plugin: arity and typed attributes (besides plugin_*)."""

    n_inputs: int
    n_outputs: int
    attributes: dict[str, type]


PLUGINS: dict[str, PluginSpec] = {
    KV_ATTENTION: PluginSpec(5, 1, {"num_heads": int, "num_kv_heads": int, "scale": float}),
    FUSED_VERIFY: PluginSpec(4, 3, {"temperature": float}),
}

# Autotune tactics of the attention plugin: the key-tile size (BLOCK_N) its kernel streams context keys with.
ATTENTION_TACTICS = {1: 64, 2: 32}
ATTENTION_BLOCK_M = 16   # one query tile covers a 16-token block; larger blocks take more tiles
VERIFY_BLOCK_V = 1024
# FusedVerify writes emitted_tokens in tiles of this many slots, looping over the block's rows at run time: the row
# count (num_logits) differs between optimization profiles, so it is never a build-time constant and no block size
# is cut to a tile.
VERIFY_BLOCK_BS = 16
IMPL_AOT, IMPL_JIT = "aot (triton ptx)", "jit (python impl)"


def _missing(what: str) -> MissingDependency:
    return MissingDependency(f"{what}: {INSTALL_HINT}", field="--backend tensorrt")


# ----------------------------------------------------------------------------------------------------------------------
# The plugin contract on ONNX models (onnx only)

def _attr_value(attr):
    from onnx import helper

    return helper.get_attribute_value(attr)


def _dflash_nodes(model):
    """(where, node) for every node of domain dflash: the main graph, subgraphs, and model-local function bodies
    other than the ops' own definitions."""
    from onnx import AttributeProto

    def walk(graph, where):
        for node in graph.node:
            yield where, node
            for a in node.attribute:
                if a.type == AttributeProto.GRAPH:
                    yield from walk(a.g, f"{where}/{node.name or node.op_type}")
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        yield from walk(g, f"{where}/{node.name or node.op_type}")

    for where, node in walk(model.graph, "graph"):
        if node.domain == PLUGIN_NAMESPACE:
            yield where, node
    for f in model.functions:
        if f.domain == PLUGIN_NAMESPACE and f.name in PLUGINS:
            continue  # the reference definition of an op, not a use of it
        for node in f.node:
            if node.domain == PLUGIN_NAMESPACE:
                yield f"function {f.name}", node


def check_plugin_attributes(onnx_model) -> dict[str, int]:
    """Check that every `dflash` node maps onto a registered plugin; return {op_type: count}.

    Each node needs a known op type (= plugin name), plugin_namespace == "dflash", plugin_version == "1", the plugin's
    attributes with the right types, and its arity. `onnx_model` is a ModelProto or a path (external data not loaded).
    Raises DFlashError naming the node and attribute otherwise.
    """
    import onnx

    path = None
    if not isinstance(onnx_model, onnx.ModelProto):
        path = Path(onnx_model)
        if not path.is_file():
            raise DFlashError("ONNX model not found", path=path)
        try:
            onnx_model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # protobuf raises its own DecodeError
            raise DFlashError(f"cannot read ONNX model ({e})", path=path) from None
    counts: dict[str, int] = {}
    for where, node in _dflash_nodes(onnx_model):
        label = f"{where}: node {node.name or '?'} ({node.op_type})"
        spec = PLUGINS.get(node.op_type)
        if spec is None:
            raise DFlashError(f"{label}: no plugin registered under this op type (known: {', '.join(PLUGINS)})",
                              path=path, field="op_type")
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        for name, expected in (("plugin_namespace", PLUGIN_NAMESPACE), ("plugin_version", PLUGIN_VERSION)):
            value = attrs.get(name)
            if isinstance(value, bytes):
                value = value.decode()
            if value is None:
                raise DFlashError(f"{label}: missing attribute", path=path, field=name)
            if value != expected:
                raise DFlashError(f"{label}: {value!r} does not match the registered plugin's {expected!r}",
                                  path=path, field=name)
        for name, typ in spec.attributes.items():
            if name not in attrs:
                raise DFlashError(f"{label}: missing attribute", path=path, field=name)
            value = attrs[name]
            if not isinstance(value, typ) or isinstance(value, bool):
                raise DFlashError(f"{label}: expected {typ.__name__}, got {type(value).__name__}", path=path,
                                  field=name)
        if node.op_type == KV_ATTENTION:
            if attrs["num_heads"] < 1 or attrs["num_kv_heads"] < 1 or attrs["num_heads"] % attrs["num_kv_heads"]:
                raise DFlashError(f"{label}: num_heads {attrs['num_heads']} is not a positive multiple of "
                                  f"num_kv_heads {attrs['num_kv_heads']}", path=path, field="num_heads")
        if len(node.input) != spec.n_inputs or len(node.output) != spec.n_outputs:
            raise DFlashError(f"{label}: {len(node.input)} inputs / {len(node.output)} outputs, the plugin takes "
                              f"{spec.n_inputs} / {spec.n_outputs}", path=path, field="inputs")
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    if counts and not any(o.domain == PLUGIN_NAMESPACE for o in onnx_model.opset_import):
        raise DFlashError(f"dflash nodes present but no opset_import for domain {PLUGIN_NAMESPACE!r}", path=path,
                          field="opset_import")
    return counts


# ----------------------------------------------------------------------------------------------------------------------
# Optimization profiles (pure Python: named ONNX dims -> min / opt / max)


def example_feeds(model, profile: Profile, seed: int = 0, vocab_size: int | None = None) -> dict[str, Any]:
    """Concrete inputs at the profile's opt shapes (valid token ids, consistent positions): for comparing runtimes.
    Token ids are drawn below `vocab_size` (default: the graph's logits width)."""
    import numpy as np
    from onnx import TensorProto

    rng = np.random.default_rng(seed)
    shapes = {k: v[1] for k, v in profile_shapes(model, profile).items()}
    vocab = vocab_size or vocab_size_of(model)
    past = profile.dims.get("past", profile.dims.get("past_ctx", (0, 0, 0)))[1]
    feeds: dict[str, Any] = {}
    for inp in model.graph.input:
        name, shape = inp.name, shapes[inp.name]
        elem = inp.type.tensor_type.elem_type
        if name in profile.values:
            feeds[name] = np.array(shape[0], dtype=np.int64)
        elif name in ("position_ids", "block_positions", "ctx_positions"):
            start = past + (shapes["ctx"][1] if name == "block_positions" and "ctx" in shapes else 0)
            feeds[name] = np.broadcast_to(start + np.arange(shape[-1], dtype=np.int64), shape).copy()
        elif elem in (TensorProto.INT64, TensorProto.INT32):
            dtype = np.int64 if elem == TensorProto.INT64 else np.int32
            feeds[name] = rng.integers(0, vocab, size=shape).astype(dtype)
        elif name == "draft_probs":
            p = rng.random(shape).astype(np.float32) + 1e-3
            feeds[name] = p / p.sum(-1, keepdims=True)
        elif name == "uniforms":
            feeds[name] = rng.random(shape).astype(np.float32)
        else:
            feeds[name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    return feeds


# ----------------------------------------------------------------------------------------------------------------------
# Triton AOT compilation of the plugin kernels (triton only; PTX, no GPU needed when `target` is given)

@dataclasses.dataclass
class AotKernel:
    name: str
    ptx: str
    num_warps: int
    shared_mem: int


_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}


def _compile(fn, signature: dict[str, str], constexprs: dict[str, Any], target=None) -> AotKernel:
    if importlib.util.find_spec("triton") is None:
        raise MissingDependency("triton is not installed (pip install 'dflash-export[kernels]')")
    import triton

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=target) if target is not None else triton.compile(src)
    return AotKernel(compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.num_warps,
                     compiled.metadata.shared)


def compile_attention_aot(dtype: str, scale: float, head_dim: int, block_n: int = 64, target=None) -> AotKernel:
    """PTX of `kv_injected_block_attention_aot_kernel` for one dtype ("float32" | "float16" | "bfloat16"), with
    scale and tile sizes compiled in. Arguments: 5 input pointers, (H, KVH, S, T, D) int32, output pointer."""
    from dflash_export.kernels.triton_attention import kv_injected_block_attention_aot_kernel

    t = "*" + _TRITON_TYPES[dtype]
    signature = {"q_ptr": t, "kc_ptr": t, "vc_ptr": t, "kb_ptr": t, "vb_ptr": t, "H": "i32", "KVH": "i32",
                 "S": "i32", "T": "i32", "D": "i32", "o_ptr": t}
    block_d = max(16, 1 << (int(head_dim) - 1).bit_length())
    constexprs = {"QK_SCALE": float(scale) * 1.4426950408889634, "BLOCK_M": ATTENTION_BLOCK_M, "BLOCK_N": block_n,
                  "BLOCK_D": block_d, "PRECISION": "ieee" if dtype == "float32" else None}
    return _compile(kv_injected_block_attention_aot_kernel, signature, constexprs, target)


def verify_aot_constexprs(temperature: float) -> dict[str, Any]:
    """The compile-time constants of the FusedVerify AOT kernel: nothing in them depends on the block's row count
    (BS and V are run-time int32 arguments), so one kernel serves every optimization profile and any block size."""
    from dflash_export.kernels.reference import EMIT_PAD

    return {"INV_TEMP": 1.0 / temperature if temperature > 0 else 1.0, "GREEDY": temperature <= 0,
            "BLOCK_V": VERIFY_BLOCK_V, "BLOCK_BS": VERIFY_BLOCK_BS, "PAD": EMIT_PAD}


def compile_verify_aot(logits_dtype: str, temperature: float, block_size: int | None = None,
                       token_dtype: str = "int64", probs_dtype: str = "float32", uniforms_dtype: str = "float32",
                       target=None) -> AotKernel:
    """PTX of `fused_verify_aot_kernel` (greedy when temperature <= 0). Arguments: logits, draft tokens, draft probs,
    uniforms pointers, (BS, V) int32, accept_len / emitted_tokens / n_emitted int64 pointers. `block_size` is not
    compiled in (kept for callers that pass it): the kernel loops over the rows it is given."""
    from dflash_export.kernels.triton_verify import fused_verify_aot_kernel

    signature = {"logits_ptr": "*" + _TRITON_TYPES[logits_dtype], "draft_tok_ptr": "*" + _TRITON_TYPES[token_dtype],
                 "draft_prob_ptr": "*" + _TRITON_TYPES[probs_dtype], "unif_ptr": "*" + _TRITON_TYPES[uniforms_dtype],
                 "BS": "i32", "V": "i32", "accept_ptr": "*i64", "emitted_ptr": "*i64", "n_emitted_ptr": "*i64"}
    return _compile(fused_verify_aot_kernel, signature, verify_aot_constexprs(temperature), target)


# ----------------------------------------------------------------------------------------------------------------------
# TensorRT: plugin registration (needs tensorrt)

_REGISTERED = False


def tensorrt_available() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def require_tensorrt(gpu: bool = True):
    """Import tensorrt (and check for a CUDA device) or raise MissingDependency with the install line."""
    if not tensorrt_available():
        raise _missing("tensorrt is not installed")
    import tensorrt as trt

    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise _missing("no CUDA device visible")
    return trt


def _dtype_name(trt, dtype) -> str:
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16", trt.int64: "int64",
             trt.int32: "int32"}
    if dtype not in names:
        raise DFlashError(f"unsupported plugin tensor dtype {dtype}", field="dtype")
    return names[dtype]


def _static_dim(expr, what: str) -> int:
    """Build-time value of a plugin shape expression; a DFlashError naming `what` when TensorRT cannot give one (a
    dynamic dim, or a "fake" expression outside shape calculation): the AOT kernel compiles the value in, so a guess
    would compute the wrong thing for some shapes."""
    try:
        if expr.is_constant:
            return int(expr.constant_value())
    except (RuntimeError, AttributeError):
        pass
    raise DFlashError(f"{what} is not a build-time constant of this graph ({expr!r}); the AOT plugin kernel compiles "
                      "it in", field=what)


def aot_plugins_supported(trt, trtp) -> bool:
    """Whether this TensorRT can build AOT Python plugins. `tensorrt.plugin` always exports `aot_impl`, but
    `KernelLaunchParams` (which an aot_impl returns) exists only where TensorRT has quick-plugin creation requests
    (`trt.QuickPluginCreationRequest`, TensorRT >= 10.12); with both impl and aot_impl registered the network must also
    say which to prefer (`PREFER_AOT_PYTHON_PLUGINS`), or plugin creation fails."""
    flags = getattr(trt, "NetworkDefinitionCreationFlag", None)
    return (hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams") and hasattr(trtp, "SymIntExprs")
            and hasattr(trt, "QuickPluginCreationRequest") and hasattr(flags, "PREFER_AOT_PYTHON_PLUGINS"))


# __cuda_array_interface__ type strings; bf16 has none (numpy has no bfloat16), so it travels as int16 and is
# reinterpreted by torch (same width, no copy). TensorRT's own Tensor.__cuda_array_interface__ raises for bf16.
_ARRAY_TYPES = {"float32": ("<f4", None), "float16": ("<f2", None), "bfloat16": ("<i2", "bfloat16"),
                "int64": ("<i8", None), "int32": ("<i4", None)}


def array_interface(data_ptr: int, shape, strides, dtype: str) -> tuple[dict[str, Any], str | None]:
    """(interface dict, dtype to reinterpret as) describing `shape` elements of `dtype` at `data_ptr` with `strides`
    in elements: the keys of __cuda_array_interface__ (and numpy's __array_interface__), version 2 (no stream: the
    plugin's impl already runs on TensorRT's stream)."""
    if dtype not in _ARRAY_TYPES:
        raise DFlashError(f"plugin tensor dtype {dtype} has no array interface here", field="dtype")
    typestr, view_as = _ARRAY_TYPES[dtype]
    itemsize = int(typestr[2:])
    desc = {"shape": tuple(int(d) for d in shape), "typestr": typestr, "data": (int(data_ptr), False),
            "strides": tuple(int(st) * itemsize for st in strides), "version": 2}
    return desc, view_as


class _CudaArray:
    def __init__(self, desc):
        self.__cuda_array_interface__ = desc


def cuda_tensor_view(data_ptr: int, shape, strides, dtype: str):
    """A torch CUDA tensor over TensorRT's buffer (no copy), bf16 included."""
    import torch

    desc, view_as = array_interface(data_ptr, shape, strides, dtype)
    if 0 in desc["shape"]:  # an empty tensor (no context yet) may come with a null pointer: nothing to view
        return torch.empty(desc["shape"], dtype=getattr(torch, dtype), device="cuda")
    out = torch.as_tensor(_CudaArray(desc), device="cuda")
    return out.view(getattr(torch, view_as)) if view_as else out


def _torch_view(trt, t):
    """torch view of a `tensorrt.plugin.Tensor` (data_ptr, shape, strides in elements, dtype)."""
    return cuda_tensor_view(t.data_ptr, tuple(t.shape), tuple(t.strides), _dtype_name(trt, t.dtype))


# Which implementation TensorRT asked for while building: aot_impl runs when it compiles an AOT plugin, impl when it
# times or runs a JIT one. build_engine_file resets it per engine and records what was actually used.
_BUILD_CALLS: dict[str, set[str]] = {}


def _record_call(op: str, impl: str) -> None:
    _BUILD_CALLS.setdefault(op, set()).add(impl)


def register_plugins() -> None:
    """Register both dflash plugins with TensorRT's plugin registry (idempotent). Must run before parsing an ONNX
    graph with dflash nodes, and before deserializing an engine built with the JIT `impl` fallback."""
    global _REGISTERED
    if _REGISTERED:
        return
    trt = require_tensorrt(gpu=False)
    import tensorrt.plugin as trtp

    float_types = "FP32|FP16|BF16"
    has_aot = aot_plugins_supported(trt, trtp)

    @trtp.register(f"{PLUGIN_NAMESPACE}::{KV_ATTENTION}")
    def _attention_desc(q: trtp.TensorDesc, k_ctx: trtp.TensorDesc, v_ctx: trtp.TensorDesc, k_blk: trtp.TensorDesc,
                        v_blk: trtp.TensorDesc, num_heads: int, num_kv_heads: int, scale: float) -> trtp.TensorDesc:
        return q.like()  # [B, H, S, D] in q's dtype

    @trtp.autotune(f"{PLUGIN_NAMESPACE}::{KV_ATTENTION}")
    def _attention_autotune(q: trtp.TensorDesc, k_ctx: trtp.TensorDesc, v_ctx: trtp.TensorDesc,
                            k_blk: trtp.TensorDesc, v_blk: trtp.TensorDesc, num_heads: int, num_kv_heads: int,
                            scale: float, outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        combo = trtp.AutoTuneCombination(", ".join([float_types] * 6))  # 5 inputs + output share one type
        combo.tactics(list(ATTENTION_TACTICS))
        return [combo]

    if has_aot:  # TensorRT >= 10.12: the compiled kernel goes into the engine, no Python at run time
        @trtp.aot_impl(f"{PLUGIN_NAMESPACE}::{KV_ATTENTION}")
        def _attention_aot(q: trtp.TensorDesc, k_ctx: trtp.TensorDesc, v_ctx: trtp.TensorDesc,
                           k_blk: trtp.TensorDesc, v_blk: trtp.TensorDesc, num_heads: int, num_kv_heads: int,
                           scale: float, outputs: Tuple[trtp.TensorDesc], tactic: int
                           ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
            _record_call(KV_ATTENTION, IMPL_AOT)
            B, H, S, D = q.shape_expr
            head_dim = _static_dim(D, "head_dim")
            kernel = compile_attention_aot(_dtype_name(trt, q.dtype), scale, head_dim,
                                           ATTENTION_TACTICS.get(tactic, 64))
            launch = trtp.KernelLaunchParams()
            launch.grid_x = B * H
            launch.grid_y = trtp.cdiv(S, ATTENTION_BLOCK_M)
            launch.block_x = kernel.num_warps * 32
            launch.shared_mem = kernel.shared_mem
            extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (H, k_ctx.shape_expr[1], S,
                                                                             k_ctx.shape_expr[2], D)])
            return kernel.name.encode(), kernel.ptx.encode(), launch, extra

    @trtp.impl(f"{PLUGIN_NAMESPACE}::{KV_ATTENTION}")
    def _attention_impl(q: trtp.Tensor, k_ctx: trtp.Tensor, v_ctx: trtp.Tensor, k_blk: trtp.Tensor,
                        v_blk: trtp.Tensor, num_heads: int, num_kv_heads: int, scale: float,
                        outputs: Tuple[trtp.Tensor], stream: int, tactic: int) -> None:
        import torch

        from dflash_export.kernels.triton_attention import kv_injected_block_attention_triton

        _record_call(KV_ATTENTION, IMPL_JIT)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [_torch_view(trt, t) for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
            out = _torch_view(trt, outputs[0])
            out.copy_(kv_injected_block_attention_triton(*args, scale=scale, block_n=ATTENTION_TACTICS.get(tactic)))

    @trtp.register(f"{PLUGIN_NAMESPACE}::{FUSED_VERIFY}")
    def _verify_desc(target_logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
                     uniforms: trtp.TensorDesc, temperature: float
                     ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        B, BS = target_logits.shape_expr[0], target_logits.shape_expr[1]
        return (trtp.from_shape_expr((B,), dtype=trt.int64),        # accept_len
                trtp.from_shape_expr((B, BS), dtype=trt.int64),     # emitted_tokens (EMIT_PAD-padded)
                trtp.from_shape_expr((B,), dtype=trt.int64))        # n_emitted

    @trtp.autotune(f"{PLUGIN_NAMESPACE}::{FUSED_VERIFY}")
    def _verify_autotune(target_logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
                         uniforms: trtp.TensorDesc, temperature: float,
                         outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]
                         ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(f"{float_types}, INT64, FP32, FP32, INT64, INT64, INT64")]

    if has_aot:
        @trtp.aot_impl(f"{PLUGIN_NAMESPACE}::{FUSED_VERIFY}")
        def _verify_aot(target_logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                        draft_probs: trtp.TensorDesc, uniforms: trtp.TensorDesc, temperature: float,
                        outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc], tactic: int
                        ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
            _record_call(FUSED_VERIFY, IMPL_AOT)
            B, BS, V = target_logits.shape_expr  # BS (num_logits) differs per profile: a run-time argument
            kernel = compile_verify_aot(_dtype_name(trt, target_logits.dtype), temperature, None,
                                        _dtype_name(trt, draft_tokens.dtype), _dtype_name(trt, draft_probs.dtype),
                                        _dtype_name(trt, uniforms.dtype))
            launch = trtp.KernelLaunchParams()
            launch.grid_x = B
            launch.block_x = kernel.num_warps * 32
            launch.shared_mem = kernel.shared_mem
            extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(BS), trtp.SymInt32(V)])
            return kernel.name.encode(), kernel.ptx.encode(), launch, extra

    @trtp.impl(f"{PLUGIN_NAMESPACE}::{FUSED_VERIFY}")
    def _verify_impl(target_logits: trtp.Tensor, draft_tokens: trtp.Tensor, draft_probs: trtp.Tensor,
                     uniforms: trtp.Tensor, temperature: float,
                     outputs: Tuple[trtp.Tensor, trtp.Tensor, trtp.Tensor], stream: int) -> None:
        import torch

        from dflash_export.kernels.triton_verify import fused_verify_triton

        _record_call(FUSED_VERIFY, IMPL_JIT)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            ins = [_torch_view(trt, t) for t in (target_logits, draft_tokens, draft_probs, uniforms)]
            results = fused_verify_triton(*ins, temperature=float(temperature))
            for dst, src in zip(outputs, results):
                _torch_view(trt, dst).copy_(src)

    _REGISTERED = True


# ----------------------------------------------------------------------------------------------------------------------
# Engine build (needs tensorrt + GPU)

def _network_flags(trt, strongly_typed: bool) -> int:
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    # Both impl and aot_impl are registered: ask for the AOT kernels (engines then run without Python).
    if hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    return flags


def build_engine_file(onnx_path: Path, engine_path: Path, profiles: list[Profile], dtype: str,
                      workspace_gib: float = 8.0) -> dict[str, Any]:
    """Parse one ONNX graph and write its serialized TensorRT engine. fp32 recipes build strongly typed networks
    (the graph's own types are the precision); fp16 / bf16 recipes let TensorRT lower the fp32 graph through the
    matching builder flag (a typed low-precision export is the export stage's job). Returns build facts."""
    import onnx

    trt = require_tensorrt()
    register_plugins()
    model = onnx.load(str(onnx_path), load_external_data=False)
    counts = check_plugin_attributes(model)
    shapes = [profile_shapes(model, p) for p in profiles]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = dtype == "float32"
    network = builder.create_network(_network_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise DFlashError(f"TensorRT could not parse the graph: {errors}", path=onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    # Per-layer details (type, plugin name) in the engine, for the plugin-layer check below
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if not strongly_typed:
        config.set_flag(trt.BuilderFlag.BF16 if dtype == "bfloat16" else trt.BuilderFlag.FP16)
    elif hasattr(trt.BuilderFlag, "TF32"):
        # TF32 is on by default: an fp32 recipe asks for fp32 matmuls (what its ONNX Runtime twin computes)
        config.clear_flag(trt.BuilderFlag.TF32)
    for shape in shapes:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            lo, opt, hi = shape[tensor.name]
            if tensor.is_shape_tensor:
                profile.set_shape_input(tensor.name, lo, opt, hi)
            else:
                profile.set_shape(tensor.name, lo, opt, hi)
        config.add_optimization_profile(profile)
    _BUILD_CALLS.clear()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise DFlashError("TensorRT failed to build the engine (see the log above)", path=onnx_path)
    data = bytes(serialized)
    implementations = build_implementations(counts, _BUILD_CALLS)
    layers = inspect_plugin_layers(trt, data, engine_path)
    check_plugin_layers(counts, layers, engine_path)
    engine_path.write_bytes(data)
    return {"profiles": [p.name for p in profiles], "strongly_typed": strongly_typed, "plugins": counts,
            "plugin_layers": layers, "implementation": implementations, "bytes": engine_path.stat().st_size}


def build_implementations(counts: dict[str, int], calls: dict[str, set[str]]) -> dict[str, str]:
    """Per plugin op in the graph, the implementation TensorRT used: AOT when it called our aot_impl during the
    build (it compiles an AOT plugin by asking for the kernel), else the JIT Python impl (which then must be
    registered wherever the engine is deserialized)."""
    return {op: IMPL_AOT if IMPL_AOT in calls.get(op, ()) else IMPL_JIT for op in counts}


def plugin_layer_counts(engine_information: str) -> dict[str, int] | None:
    """{plugin op: layers} from an engine inspector's JSON (`get_engine_information(LayerInformationFormat.JSON)`),
    or None when the engine carries no per-layer details (built without ProfilingVerbosity.DETAILED). A layer counts
    when its "LayerType" names a plugin and its details name one of our ops ("PluginType", or anywhere in the layer's
    record, so a renamed key still counts)."""
    import json

    info = json.loads(engine_information)
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    if layers and not all(isinstance(layer, dict) for layer in layers):
        return None
    counts: dict[str, int] = {}
    for layer in layers:
        if "plugin" not in str(layer.get("LayerType", "")).lower():
            continue
        named = str(layer.get("PluginType", "")) or json.dumps(layer)
        for op in PLUGINS:
            if op in named:
                counts[op] = counts.get(op, 0) + 1
                break
    return counts


def inspect_plugin_layers(trt, data: bytes, engine_path: Path) -> dict[str, int]:
    """Deserialize the just-built engine and count its dflash plugin layers with TensorRT's engine inspector."""
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        raise DFlashError("TensorRT could not deserialize the engine it just built (see the log above)",
                          path=engine_path)
    inspector = engine.create_engine_inspector()
    counts = plugin_layer_counts(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    if counts is None:
        raise DFlashError("the engine inspector reports no per-layer details, so the plugin layers cannot be "
                          "checked (ProfilingVerbosity.DETAILED not honoured)", path=engine_path,
                          field="plugin_layers")
    return counts


def check_plugin_layers(graph_counts: dict[str, int], engine_counts: dict[str, int], engine_path: Path) -> None:
    """The built engine must hold one plugin layer per dflash node of the graph: a parser that silently swapped a
    node for something else (or a fallback to the function's inlined body) would otherwise go unnoticed."""
    for op, want in graph_counts.items():
        got = engine_counts.get(op, 0)
        if got != want:
            raise DFlashError(f"built engine holds {got} {PLUGIN_NAMESPACE}::{op} plugin layer(s), the graph has "
                              f"{want} node(s)", path=engine_path, field="plugin_layers")


def _export_facts(onnx_path: Path) -> dict[str, str]:
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def build_tensorrt_engines(export_dir, out_dir, recipe, max_batch: int = 1) -> dict[str, Any]:
    """Build `target_verify.engine` and `drafter.engine` in `out_dir` from the exported graphs in `export_dir`.

    Profiles: target_verify = prefill / verify (block_size tokens) / decode (1 token); drafter = first block after
    prefill / steady-state step (see `graph_profiles`). Returns the per-engine build facts for the manifest.
    """
    import onnx

    require_tensorrt()
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    facts: dict[str, Any] = {}
    for onnx_name, engine_name, graph in ((TARGET_ONNX, TARGET_ENGINE, "target_verify"),
                                          (DRAFTER_ONNX, DRAFTER_ENGINE, "drafter")):
        onnx_path = export_dir / onnx_name
        if not onnx_path.is_file():
            raise DFlashError("exported graph not found (run the export first)", path=onnx_path)
        meta = _export_facts(onnx_path)
        block_size = int(meta.get("dflash.block_size", recipe.block_size or 0))
        if block_size < 2:
            raise DFlashError("graph metadata has no dflash.block_size", path=onnx_path, field="dflash.block_size")
        vocab = vocab_size_of(onnx.load(str(onnx_path), load_external_data=False))
        profiles = graph_profiles(graph, block_size, recipe.max_seq_len, vocab, max_batch)
        facts[engine_name] = build_engine_file(onnx_path, out_dir / engine_name, profiles, recipe.dtype)
        facts[engine_name]["block_size"] = block_size
    return facts


def plugin_implementations(facts: dict[str, Any]) -> dict[str, str]:
    """{op: implementation} over every engine's build facts; an op built both ways is recorded as both."""
    seen: dict[str, set[str]] = {}
    for engine in facts.values():
        for op, impl in engine.get("implementation", {}).items():
            seen.setdefault(op, set()).add(impl)
    return {op: " + ".join(sorted(impls)) for op, impls in seen.items()}
def refuse_masked_drafter(config, where) -> None:
    """Causal / sliding-window drafter layers (z-lab 0.1.0) export as MaskedKVInjectedBlockAttention, which has no
    TensorRT plugin or Triton kernel yet; DFlash 2's candidate selector has no host walk in the TensorRT engine yet.
    Both refused by name before anything is built (issue #17)."""
    if config.is_dflash2:
        raise DFlashError("DFlash 2 drafters: the TensorRT engine has no candidate selector yet; use --backend "
                          "onnxruntime", path=where, field="architectures")
    for i in range(config.num_hidden_layers):
        if config.layer_causal(i) or config.layer_window(i) is not None:
            raise DFlashError(f"layer {i} is causal or sliding-window (z-lab 0.1.0): the TensorRT backend has no "
                              "MaskedKVInjectedBlockAttention plugin yet; use --backend onnxruntime", path=where,
                              field="is_causal" if config.is_causal else "layer_types")


def build_tensorrt(recipe, out_dir) -> Path:
    """`build --backend tensorrt`: export the recipe's graphs, compile both to TensorRT engines with the dflash
    plugins, and write `out_dir` atomically (engines + the ONNX graphs they came from, kept for `validate`'s
    ONNX Runtime vs TensorRT comparison, + manifest.json). Needs tensorrt and an NVIDIA GPU (checked first)."""
    import torch

    from dflash_export.checkpoint import load_drafter
    from dflash_export.engines.manifest import write_manifest
    from dflash_export.export import export_recipe
    from dflash_export.files import atomic_dir

    drafter = load_drafter(recipe.drafter_path, torch.float32)
    refuse_masked_drafter(drafter.config, recipe.drafter_path)
    trt = require_tensorrt()
    if recipe.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise DFlashError("this GPU has no bfloat16 support", path=recipe.path, field="dtype")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        res = export_recipe(recipe, tmp / "onnx")
        serving = write_serving_files(recipe, drafter, tmp)
        facts = build_tensorrt_engines(tmp / "onnx", tmp, recipe)
        dspec = drafter.spec(recipe.block_size)
        write_manifest(tmp, {
            "backend": BACKEND, "recipe": recipe.name,
            "block_size": dspec.block_size, "mask_token_id": dspec.mask_token_id,
            "target_layer_ids": list(dspec.target_layer_ids), "max_seq_len": recipe.max_seq_len,
            "dtypes": {"precision": recipe.dtype, "graph": "float32"},
            "engines": facts, "plugins": {"namespace": PLUGIN_NAMESPACE, "version": PLUGIN_VERSION,
                                          "ops": list(PLUGINS), "implementation": plugin_implementations(facts)},
            "export": res.metadata, "tensorrt": trt.__version__, **serving,
            "gpu": torch.cuda.get_device_name(0),
        })
    return out_dir


def write_serving_files(recipe, drafter, dst: Path) -> dict[str, Any]:
    """What running an engine needs besides the engines: the target's tokenizer files (or the tiny pairs'
    codec.json) copied into `dst`; returns the manifest's stop_token_ids and vocab_size (read from the target's
    config, without loading its weights)."""
    from types import SimpleNamespace

    from dflash_export.engines.ort_build import _copy_tokenizer
    from dflash_export.models.target import read_target_config, resolve_target_dir

    cfg, _ = read_target_config(recipe.target_path)
    target = SimpleNamespace(model_dir=resolve_target_dir(recipe.target_path), vocab_size=int(cfg["vocab_size"]))
    _copy_tokenizer(target, drafter, Path(dst))
    return {"stop_token_ids": [int(x) for x in cfg["stop_token_ids"]], "vocab_size": int(cfg["vocab_size"])}


# ----------------------------------------------------------------------------------------------------------------------
# validate: ONNX Runtime vs TensorRT (polygraphy)

def compare_onnxruntime_tensorrt(engine_dir, atol: float = 1e-3, rtol: float = 1e-3, seed: int = 0
                                 ) -> dict[str, Any]:
    """Run each graph's ONNX model (ONNX Runtime, the plugins' reference functions inlined) and its TensorRT engine
    (plugins) on the same inputs at every profile's opt shapes; compare all outputs with polygraphy's Comparator.

    Returns {"ok": bool, "<engine>/<profile>": {"ok": bool, "max_abs_diff": {output: float}}}.
    """
    import numpy as np
    import onnx

    require_tensorrt()
    if importlib.util.find_spec("polygraphy") is None:
        raise _missing("polygraphy is not installed")
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, CompareFunc

    from dflash_export.engines.manifest import read_manifest

    register_plugins()  # an engine built with the JIT fallback needs the Python plugins at deserialization
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    report: dict[str, Any] = {}
    for onnx_name, engine_name, graph in ((TARGET_ONNX, TARGET_ENGINE, "target_verify"),
                                          (DRAFTER_ONNX, DRAFTER_ENGINE, "drafter")):
        onnx_path = engine_dir / "onnx" / onnx_name
        model = onnx.load(str(onnx_path), load_external_data=False)
        profiles = graph_profiles(graph, manifest.block_size, manifest.require("max_seq_len"),
                                  vocab_size_of(model))
        engine_bytes = (engine_dir / engine_name).read_bytes()
        for index, profile in enumerate(profiles):
            feeds = example_feeds(model, profile, seed)
            runners = [OnnxrtRunner(SessionFromOnnx(str(onnx_path))),
                       TrtRunner(EngineFromBytes(engine_bytes), optimization_profile=index)]
            results = Comparator.run(runners, data_loader=[feeds])
            accuracy = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=rtol))
            ort_out, trt_out = results[0][1][0], results[1][1][0]
            diffs = {name: float(np.max(np.abs(np.asarray(ort_out[name], np.float64)
                                               - np.asarray(trt_out[name], np.float64)), initial=0.0))
                     for name in ort_out.keys()}
            report[f"{graph}/{profile.name}"] = {"ok": bool(accuracy), "max_abs_diff": diffs}
    report["ok"] = all(v["ok"] for v in report.values())
    return report


# ----------------------------------------------------------------------------------------------------------------------
# Running the engines: the DFlash runtime drives them through graph_engine.GraphEngine, as ONNX Runtime's CPU twin

def tensorrt_engine_info(manifest: Manifest) -> EngineInfo:
    """The EngineInfo of a TensorRT engine directory, from its manifest (no tensorrt needed)."""
    if manifest.backend != BACKEND:
        raise DFlashError(f"not a tensorrt engine ({manifest.backend!r})", path=manifest.path, field="backend")
    return manifest.engine_info("rebuild the engine: older builds did not record it")


def _torch_dtype(trt, torch, dtype):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.int8: torch.int8, trt.bool: torch.bool}
    if dtype not in table:
        raise DFlashError(f"engine tensor dtype {dtype} has no torch equivalent", field="dtype")
    return table[dtype]


class _DeviceKVCache(KVCache):
    """One sequence's K/V of one graph on the GPU. Per `past_X`/`present_X` pair, two flat buffers of
    KVH * max_seq_len * D elements: the graph reads past from one and writes present (= past ++ new rows, a
    contiguous [1, KVH, T, D] prefix) into the other, then they swap. Allocated once per sequence: no step
    allocates, and a [1, KVH, T, D] tensor is always a prefix of its buffer, as TensorRT wants (linear, dense)."""

    def __init__(self, torch, layout: dict, capacity: int, device, stream):
        self.layout = layout            # X -> (KVH, D, torch dtype)
        self.capacity = capacity
        self.buffers = {x: [torch.empty(kvh * capacity * d, dtype=dt, device=device) for _ in range(2)]
                        for x, (kvh, d, dt) in layout.items()}
        self.current = 0                # which buffer of each pair holds the valid rows
        self.length = 0
        self.stream = stream            # the runner's stream: a truncation is ordered after the run that wrote

    def view(self, x: str, which: int, rows: int):
        kvh, d, _ = self.layout[x]
        return self.buffers[x][which][: kvh * rows * d].view(1, kvh, rows, d)

    def past(self, x: str):
        return self.view(x, self.current, self.length)

    def present(self, x: str, rows: int):
        if rows > self.capacity:
            raise DFlashError(f"{rows} cached rows exceed the buffers sized for max_seq_len {self.capacity}",
                              field="max_tokens")
        return self.view(x, 1 - self.current, rows)

    def commit(self, rows: int) -> None:
        self.current, self.length = 1 - self.current, rows

    def truncate(self, n: int) -> None:
        if n > self.length:
            raise DFlashError(f"cannot keep {n} of {self.length} cached rows")
        if n == self.length:
            return
        import torch

        # [1, KVH, n, D] is not a prefix of [1, KVH, length, D]: repack the kept rows into the other buffer.
        with torch.cuda.stream(self.stream):
            for x in self.layout:
                self.view(x, 1 - self.current, n).copy_(self.past(x)[:, :, :n])
        self.commit(n)


class _TrtGraph:
    """One deserialized engine, its execution context, and what is known about its I/O tensors."""

    def __init__(self, trt, torch, runtime, path: Path, profile_names: list[str]):
        if not path.is_file():
            raise DFlashError("engine file not found", path=path)
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise DFlashError("TensorRT could not deserialize the engine (built by another TensorRT version or for "
                              "another GPU? see the log above)", path=path)
        if self.engine.num_optimization_profiles != len(profile_names):
            raise DFlashError(f"engine has {self.engine.num_optimization_profiles} optimization profiles, the "
                              f"manifest names {len(profile_names)}", path=path, field="engines")
        self.path = path
        self.profiles = {name: i for i, name in enumerate(profile_names)}
        self.context = self.engine.create_execution_context()
        self.active = 0  # a new context starts on profile 0
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(trt, torch, self.engine.get_tensor_dtype(n)) for n in names}
        self.dynamic = {n for n in self.inputs if -1 in tuple(self.engine.get_tensor_shape(n))}
        # Shape-tensor inputs (num_logits) live in host memory, read by TensorRT when it infers shapes and
        # enqueues: one persistent host buffer each keeps the bound pointer valid.
        self.host_inputs = {n: torch.zeros(tuple(self.engine.get_tensor_shape(n)), dtype=self.dtypes[n])
                            for n in self.inputs if self.engine.get_tensor_location(n) == trt.TensorLocation.HOST}
        self.kv_layout = {}
        for n in self.inputs:
            if n.startswith("past_"):
                _, kvh, _, d = tuple(self.engine.get_tensor_shape(n))
                self.kv_layout[n[len("past_"):]] = (int(kvh), int(d), self.dtypes[n])

    def close(self) -> None:
        self.context = None  # a context must go before its engine
        self.engine = None


class TensorRTRunner(GraphRunner):
    """graph_engine.GraphRunner over `target_verify.engine` and `drafter.engine` (TensorRT >= 10, one CUDA device).

    One execution context per engine, switched to the profile the engine logic names (prefill / verify / decode,
    first_block / step); inputs are copied to the device on one torch stream, the K/V stay in preallocated device
    buffers (`_DeviceKVCache`, sized by max_seq_len), and the stream is synchronized before outputs are read.
    """

    def __init__(self, engine_dir, manifest: Manifest, device: int | str = 0):
        trt = require_tensorrt()
        import torch

        register_plugins()  # engines whose plugins fell back to the Python impl need them at deserialization
        self.trt, self.torch = trt, torch
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.max_seq_len = manifest.require("max_seq_len")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engines = manifest.engines
        self.graphs: dict[str, _TrtGraph] = {}
        for graph, fname, needed in (("target_verify", TARGET_ENGINE, (PREFILL, VERIFY, DECODE)),
                                     ("drafter", DRAFTER_ENGINE, (FIRST_BLOCK, STEP))):
            names = (engines.get(fname) or {}).get("profiles") or []
            if not set(needed) <= set(names):  # the engine logic selects these by name
                raise DFlashError(f"{fname} profiles {names} lack {sorted(set(needed) - set(names))}",
                                  path=manifest.path, field="engines")
            with torch.cuda.device(self.device):
                self.graphs[graph] = _TrtGraph(trt, torch, self._runtime, Path(engine_dir) / fname, list(names))
        # TensorRT wants a non-null address even for an empty tensor (an empty past, no drafts): one spare block
        self._empty = torch.zeros(64, dtype=torch.int64, device=self.device)
        # One context per engine serves every sequence: a run (shapes, addresses, enqueue, sync) must not interleave
        # with another thread's.
        self._lock = threading.Lock()

    def new_cache(self, graph: str):
        return _DeviceKVCache(self.torch, self.graphs[graph].kv_layout, self.max_seq_len, self.device, self.stream)

    def _address(self, tensor) -> int:
        return tensor.data_ptr() if tensor.numel() else self._empty.data_ptr()

    def run(self, graph, profile, feeds, fetch, cache):
        with self._lock:
            return self._run(graph, profile, feeds, fetch, cache)

    def _bind(self, g: _TrtGraph, name: str, address: int) -> None:
        if not g.context.set_tensor_address(name, address):
            raise DFlashError(f"TensorRT refused the address of {name}", path=g.path, field=name)

    def _run(self, graph, profile, feeds, fetch, cache):
        torch = self.torch
        g = self.graphs[graph]
        if profile not in g.profiles:
            raise DFlashError(f"{graph} engine has no optimization profile {profile!r} (has {', '.join(g.profiles)})")
        ctx, handle = g.context, self.stream.cuda_stream
        keep = []  # device copies of the inputs must outlive the enqueue
        with torch.cuda.stream(self.stream):
            if g.active != g.profiles[profile]:
                if not ctx.set_optimization_profile_async(g.profiles[profile], handle):
                    raise DFlashError(f"TensorRT refused profile {profile!r}", path=g.path)
                g.active = g.profiles[profile]
            for name in g.inputs:
                if name.startswith("past_"):
                    tensor = cache.past(name[len("past_"):])
                elif name in g.host_inputs:
                    host = g.host_inputs[name]
                    host.copy_(torch.as_tensor(feeds[name]).reshape(host.shape))
                    self._bind(g, name, host.data_ptr())
                    continue
                else:
                    tensor = torch.as_tensor(feeds[name]).to(self.device, g.dtypes[name]).contiguous()
                    keep.append(tensor)
                if name in g.dynamic and not ctx.set_input_shape(name, tuple(tensor.shape)):
                    raise DFlashError(f"shape {tuple(tensor.shape)} of {name} is outside profile {profile!r}",
                                      path=g.path, field=name)
                self._bind(g, name, self._address(tensor))
            missing = ctx.infer_shapes()
            if missing:
                raise DFlashError(f"TensorRT cannot infer output shapes: {', '.join(missing)} unset", path=g.path)
            outputs, new_rows = {}, None
            for name in g.outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if name.startswith("present_"):
                    new_rows = shape[2]
                    tensor = cache.present(name[len("present_"):], new_rows)
                else:
                    tensor = torch.empty(shape, dtype=g.dtypes[name], device=self.device)
                outputs[name] = tensor
                self._bind(g, name, self._address(tensor))
            if not ctx.execute_async_v3(handle):
                raise DFlashError("TensorRT execution failed (see the log above)", path=g.path)
            host = {name: outputs[name].to("cpu", non_blocking=True) for name in fetch}
        self.stream.synchronize()
        if new_rows is not None:
            cache.commit(new_rows)
        del keep
        return {name: t.numpy() for name, t in host.items()}

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs = {}


class TensorRTEngine(GraphEngine):
    """The DFlash Engine over a directory written by `build_tensorrt`: GraphEngine's logic (the same as ONNX
    Runtime's CPU twin over the directory's `onnx/` graphs) with a `TensorRTRunner`. Needs tensorrt, torch and an
    NVIDIA GPU; kwargs: `device` (CUDA index, or a torch device string such as "cuda:1")."""

    def __init__(self, engine_dir, manifest, device: int | str = 0, **_):
        from dflash_export.engines.base import load_codec

        require_tensorrt()  # first: without TensorRT or a GPU the answer is the install line, not a manifest detail
        engine_dir = Path(engine_dir)
        info = tensorrt_engine_info(manifest)
        super().__init__(TensorRTRunner(engine_dir, manifest, device), info, load_codec(engine_dir))
