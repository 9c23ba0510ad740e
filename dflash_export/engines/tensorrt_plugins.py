"""The TensorRT backend's plugins: the contract a `dflash` ONNX node must meet, the Triton AOT compilation of the
plugin kernels, and their registration with TensorRT; also what the backend's modules share (file names, install
line, `require_tensorrt`). The base of the backend: it imports none of `tensorrt`, `tensorrt_build`,
`tensorrt_runtime`, which all import it.

Plugins (`tensorrt.plugin`; TensorRT >= 10.12, see MIN_TENSORRT): `dflash::KVInjectedBlockAttention` and
`dflash::FusedVerify`, version "1" — TensorRT's ONNX parser finds them by the node's op type plus its
`plugin_namespace` / `plugin_version` attributes. Each has a shape/dtype registration, an autotune declaration
(type combinations; tactics = key-tile sizes for the attention), an `aot_impl` returning the Triton kernel compiled
to PTX (so engines run without Python), and a JIT `impl` fallback that launches the same kernels through torch.

The other backend modules call `require_tensorrt` and `register_plugins` through this module
(`plugins.require_tensorrt()`), so replacing them here (as the tests' emulated TensorRT does) replaces them for
every caller.
"""

# No `from __future__ import annotations` here: tensorrt.plugin reads the plugin functions' annotations at
# registration, so they must be real types, not strings.
import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import Any, List, Tuple, Union

from dflash_export.engines.manifest import PLUGIN_PATHS
from dflash_export.engines.tensorrt_ptx import launchable_ptx, parse_entry, signature_widths
from dflash_export.errors import DFlashError, MissingDependency

BACKEND = "tensorrt"
PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
KV_ATTENTION = "KVInjectedBlockAttention"
FUSED_VERIFY = "FusedVerify"
INSTALL_HINT = ("pip install 'dflash-export[tensorrt]' (TensorRT >= 10.12 with numpy < 2.4, or TensorRT >= 11.2; "
                "+ polygraphy) on a machine with an NVIDIA GPU")
# The oldest TensorRT whose Python plugin layer (tensorrt.plugin, AOT kernels) tests/trt_lane.py checked.
MIN_TENSORRT = (10, 12)
# TensorRT's plugin creator before this release reads scalar attributes with `int(array)` on 1-element arrays,
# which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars").
NUMPY_24_FIX = (11, 2)
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
# The two paths a plugin layer can be built with (engines/manifest.py PLUGIN_PATHS): the Triton kernel as PTX in the
# engine, or the Python impl. An ONNX node picks one with its `aot` attribute (1 / 0), which TensorRT's parser reads
# before the network's PREFER_AOT / PREFER_JIT flag and turns into a strict AOT / JIT creation request.
IMPL_AOT, IMPL_JIT = PLUGIN_PATHS
AOT_ATTRIBUTE = "aot"


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
    attributes with the right types, and its arity; an `aot` attribute, where present, is 1 or 0. `onnx_model` is
    a ModelProto or a path (external data not loaded).
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
        if AOT_ATTRIBUTE in attrs and (not isinstance(attrs[AOT_ATTRIBUTE], int) or attrs[AOT_ATTRIBUTE] not in (0, 1)):
            raise DFlashError(f"{label}: expected the integer 1 (AOT kernel) or 0 (JIT impl), got "
                              f"{attrs[AOT_ATTRIBUTE]!r}", path=path, field=AOT_ATTRIBUTE)
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
# Triton AOT compilation of the plugin kernels (triton only; PTX, no GPU needed when `target` is given)

@dataclasses.dataclass
class AotKernel:
    """A compiled plugin kernel as TensorRT takes it: entry name, PTX whose `.entry` declares exactly the
    `params` arguments TensorRT passes, launch width and dynamic shared memory; `appended` counts the unused
    trailing parameters Triton had added and that were removed (0, 1 or 2 by release)."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    params: int
    appended: int = 0


_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}


def _compile(fn, signature: dict[str, str], constexprs: dict[str, Any], target=None) -> AotKernel:
    if importlib.util.find_spec("triton") is None:
        raise MissingDependency("triton is not installed (pip install 'dflash-export[kernels]')")
    import triton

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    # Triton 3.2 names the compile-time constants `constants`, later releases `constexprs` (both keyed by name)
    key = "constexprs" if "constexprs" in inspect.signature(triton.compiler.ASTSource).parameters else "constants"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, **{key: constexprs})
    compiled = triton.compile(src, target=target) if target is not None else triton.compile(src)
    meta = compiled.metadata
    # TensorRT passes exactly the signature's run-time arguments (inputs, extra args, outputs, in that order):
    # Triton's trailing scratch pointers leave the .entry, or the kernel is refused by name.
    widths = signature_widths(signature)
    ptx, entry = launchable_ptx(compiled.asm["ptx"], meta.name, meta, widths)
    appended = len(parse_entry(compiled.asm["ptx"], meta.name).params) - len(widths)
    return AotKernel(meta.name, ptx, meta.num_warps, meta.shared, len(entry.params), appended)


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


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_versions(tensorrt_version: str, numpy_version: str) -> None:
    """The TensorRT / numpy pairs the plugins work with, or MissingDependency saying which pair is installed and
    what works (checked against the real wheels by tests/trt_lane.py)."""
    trt_v, np_v = _version(tensorrt_version), _version(numpy_version)
    if trt_v < MIN_TENSORRT:
        raise _missing(f"TensorRT {tensorrt_version} is older than 10.12, the oldest whose Python plugin layer this "
                       "backend was checked with")
    if trt_v < NUMPY_24_FIX and np_v >= (2, 4):
        raise _missing(f"TensorRT {tensorrt_version} cannot create Python plugins under numpy {numpy_version} "
                       "(pip install 'numpy<2.4', or TensorRT >= 11.2)")


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
# times or runs a JIT one. tensorrt_build.build_engine_file resets it per engine and records what was actually
# used.
_BUILD_CALLS: dict[str, set[str]] = {}


def _record_call(op: str, impl: str) -> None:
    _BUILD_CALLS.setdefault(op, set()).add(impl)


def register_plugins() -> None:
    """Register both dflash plugins with TensorRT's plugin registry (idempotent). Must run before parsing an ONNX
    graph with dflash nodes, and before deserializing an engine built with the JIT `impl` fallback."""
    global _REGISTERED
    if _REGISTERED:
        return
    import numpy

    trt = require_tensorrt(gpu=False)
    check_versions(trt.__version__, numpy.__version__)
    try:
        import tensorrt.plugin as trtp
    except ModuleNotFoundError:
        raise _missing(f"TensorRT {trt.__version__} has no tensorrt.plugin module") from None

    has_aot = aot_plugins_supported(trt, trtp)
    _register_attention(trt, trtp, has_aot)
    _register_verify(trt, trtp, has_aot)
    keep_serialized_fields(trt, trtp)
    _REGISTERED = True


def _dflash_fields(trt, plugin):
    """The attributes a dflash plugin object hands TensorRT to serialize, as a PluginFieldCollection whose arrays,
    fields and collection are held by the plugin object itself, so they outlive the call (TensorRT reads them after
    it returns). AOT plugins get the same fields as JIT ones (the attributes aot_impl takes)."""
    import numpy as np

    names = getattr(plugin, "impl_attr_names", None)
    if names is None:
        names = getattr(plugin, "aot_impl_attr_names", None) or ()
    arrays, fields = [], []
    for name in names:
        value = plugin.attrs[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DFlashError(f"{plugin.plugin_name}: attribute {name} is a {type(value).__name__}; the dflash "
                              "plugins take integers and floats", field=name)
        kind = (np.int64, trt.PluginFieldType.INT64) if isinstance(value, int) else \
            (np.float64, trt.PluginFieldType.FLOAT64)
        arrays.append(np.array([value], dtype=kind[0]))
        fields.append(trt.PluginField(name, arrays[-1], kind[1]))
    collection = trt.PluginFieldCollection(fields)
    plugin._dflash_serialized = (arrays, fields, collection)
    return collection


def keep_serialized_fields(trt, trtp) -> bool:
    """Make tensorrt.plugin's plugin objects of namespace dflash serialize their attributes safely; returns whether
    the installed tensorrt.plugin needed it (its plugin base class is where the method lives in 10.12 .. 11.4).

    NVIDIA's `get_fields_to_serialize` (tests/trt_lane.py shows both in every checked release) raises
    AttributeError on an AOT plugin (it reads `impl_attr_names`, which only JIT plugins have) and, on a JIT plugin,
    builds each scalar field on a temporary numpy array that is freed when it returns, so TensorRT would read freed
    memory (read back, num_kv_heads shows num_heads' value). For dflash plugins the method is replaced by
    `_dflash_fields`; other namespaces keep NVIDIA's."""
    import importlib

    try:
        base = importlib.import_module(trtp.__name__ + "._plugin_class")._TemplatePluginBase
    except (ImportError, AttributeError):
        return False
    original = base.get_fields_to_serialize
    if getattr(original, "_dflash_wrapped", False):
        return True

    def get_fields_to_serialize(self):
        if getattr(self, "plugin_namespace", None) == PLUGIN_NAMESPACE:
            return _dflash_fields(trt, self)
        return original(self)

    get_fields_to_serialize._dflash_wrapped = True
    get_fields_to_serialize._dflash_original = original
    base.get_fields_to_serialize = get_fields_to_serialize
    return True


_FLOAT_TYPES = "FP32|FP16|BF16"


def _register_attention(trt, trtp, has_aot: bool) -> None:
    """KVInjectedBlockAttention: shape, autotune (tactics = key-tile sizes), the AOT kernel when this TensorRT can
    build one, and the JIT impl."""
    float_types = _FLOAT_TYPES

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


def _register_verify(trt, trtp, has_aot: bool) -> None:
    """FusedVerify: shape (accept_len, emitted_tokens, n_emitted), autotune, the AOT kernel when this TensorRT can
    build one, and the JIT impl."""
    float_types = _FLOAT_TYPES

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
