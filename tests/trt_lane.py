"""The CPU test lane against NVIDIA's real TensorRT Python layer (not the emulation in tests/tensorrt_emulation.py).

PyPI's `tensorrt-cu12-bindings` wheels hold the compiled `tensorrt` pybind module and the `tensorrt.plugin` Python
package; the runtime libraries they link against (libnvinfer, libnvinfer_plugin, libnvonnxparser) come from another
index and need a GPU. This lane installs the bindings of each version in LANES into a side directory under
~/.cache/dflash-export/trt-lane/, compiles tests/trt_lane_standin.c into those three sonames (a loader stand-in whose
nine factories return NULL: nothing runs on a GPU, no engine is built, no figure comes from it), and runs `--check`
in a subprocess with that directory first on PYTHONPATH. The main test process never imports tensorrt, so
`HAS_TENSORRT` stays false there.

What runs for real in the subprocess: NVIDIA's bindings (enums, flags, PluginField / PluginFieldCollection,
PluginTensorDesc), NVIDIA's `tensorrt.plugin` decorators with their signature validation, its plugin creator and
plugin classes (create_plugin in build and runtime phases for AOT and JIT, output dtypes, type/format combinations,
tactics, field serialisation and re-creation from the serialised fields), and this package's `register_plugins`,
precision resolution and error lines. What is replaced: the plugin registry (the stand-in returns none, so a
dictionary takes the creators) and anything that needs the runtime library (builder, parser, engine, the shape
expression builder, the kernels).

    python tests/trt_lane.py                # every lane; exit 0 when each matches its expectation
    python tests/trt_lane.py --only 11.4.0.106
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DFLASH_TRT_LANE", Path.home() / ".cache" / "dflash-export" / "trt-lane"))
STANDIN = Path(__file__).with_name("trt_lane_standin.c")
STANDIN_LIBS = ("libnvinfer", "libnvinfer_plugin", "libnvonnxparser")
OLD_NUMPY = "2.3.5"  # the newest numpy below 2.4
POLYGRAPHY = "0.49.26"


@dataclasses.dataclass(frozen=True)
class Lane:
    tensorrt: str
    numpy: str | None  # None: the main environment's numpy
    expect: str  # "ok" | "refused: <substring of the MissingDependency line>"

    @property
    def name(self) -> str:
        return f"tensorrt-{self.tensorrt}+numpy-{self.numpy or 'main'}"


LANES = (
    Lane("10.11.0.33", OLD_NUMPY, "refused: older than 10.12"),      # below the checked floor (a policy line)
    Lane("10.12.0.36", OLD_NUMPY, "ok"),                             # oldest with AOT Python plugins
    Lane("10.13.3.9", OLD_NUMPY, "ok"),
    Lane("10.14.1.48.post1", OLD_NUMPY, "ok"),
    Lane("10.16.1.11", OLD_NUMPY, "ok"),                             # newest 10.x
    Lane("10.16.1.11", None, "refused: numpy"),                      # int(f.data) on numpy >= 2.4
    Lane("11.1.0.106", None, "refused: numpy"),
    Lane("11.2.1.2", None, "ok"),                                    # first release with the int(f.data) fix
    Lane("11.4.0.106", None, "ok"),                                  # newest 11.x
    Lane("11.4.0.106", OLD_NUMPY, "ok"),
)


# ----------------------------------------------------------------------------------------------------------------------
# Side environment (driver side: never imports tensorrt)

class LaneUnavailable(RuntimeError):
    """pip could not fetch a wheel, or no C compiler builds the stand-in: the caller skips, it does not fail."""


_UNREACHABLE: list[str] = []  # the first failure; later lanes skip at once instead of waiting on pip again


def _pip_target(target: Path, *requirements: str) -> None:
    if (target / ".complete").is_file():
        return
    if _UNREACHABLE:
        raise LaneUnavailable(_UNREACHABLE[0])
    if target.exists():
        shutil.rmtree(target)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "20", "--target", str(target), *requirements]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        _UNREACHABLE.append(f"pip install {' '.join(requirements)} failed: {res.stderr.strip()[-400:]}")
        raise LaneUnavailable(_UNREACHABLE[0])
    (target / ".complete").write_text(" ".join(requirements) + "\n")


def _standin_libs(major: str) -> Path:
    libdir = CACHE / f"standin-{major}"
    if all((libdir / f"{n}.so.{major}").is_file() for n in STANDIN_LIBS):
        return libdir
    libdir.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise LaneUnavailable("no C compiler (cc / gcc) for the loader stand-in")
    for n in STANDIN_LIBS:
        so = f"{n}.so.{major}"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{so}", "-o", str(libdir / so), str(STANDIN)],
                       check=True)
    return libdir


def prepare(lane: Lane) -> dict[str, str]:
    """Install the lane's wheels (cached) and return the environment its `--check` subprocess runs in."""
    site = CACHE / f"bindings-{lane.tensorrt}"
    _pip_target(site, f"tensorrt-cu12-bindings=={lane.tensorrt}")
    alias = site / "tensorrt" / "__init__.py"
    if not alias.is_file():  # the bindings install `tensorrt_bindings`; a real install imports it as `tensorrt`
        alias.parent.mkdir(exist_ok=True)
        alias.write_text("import sys\nimport tensorrt_bindings\nsys.modules[__name__] = tensorrt_bindings\n")
    poly = CACHE / f"polygraphy-{POLYGRAPHY}"
    _pip_target(poly, f"polygraphy=={POLYGRAPHY}")
    path = [str(ROOT), str(site), str(poly)]
    if lane.numpy:
        np_dir = CACHE / f"numpy-{lane.numpy}"
        _pip_target(np_dir, f"numpy=={lane.numpy}")
        path.insert(1, str(np_dir))
    libdir = _standin_libs(lane.tensorrt.split(".")[0])
    # the AOT launch checks compile real PTX: never under the interpreter another test module may have switched on
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libdir)] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env["DFLASH_TRT_LANE_EXPECT"] = lane.expect
    return env


def run_lane(lane: Lane, timeout: float = 600) -> dict:
    """Prepare the lane and run its checks in a subprocess; returns the report (with "passed")."""
    env = prepare(lane)
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--check"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"lane": lane.name, "passed": False, "error": (res.stdout + res.stderr)[-3000:]}
    report = json.loads(lines[-1])
    report["lane"] = lane.name
    return report


# ----------------------------------------------------------------------------------------------------------------------
# Checks (subprocess side: imports the real tensorrt)

BACKEND_FILES = ("tensorrt_build.py", "tensorrt_plugins.py", "tensorrt_runtime.py", "tensorrt.py", "tensorrt_batch.py")
# Local names the backend gives TensorRT objects, and the class each is an instance of.
OBJECT_CLASSES = {"builder": "Builder", "config": "IBuilderConfig", "network": "INetworkDefinition",
                  "parser": "OnnxParser", "profile": "IOptimizationProfile", "engine": "ICudaEngine",
                  "inspector": "EngineInspector", "runtime": "Runtime", "context": "IExecutionContext",
                  "tensor": "ITensor", "layer": "ILayer"}
# Attributes the backend reads only behind hasattr / a version test, so their absence is handled.
OPTIONAL = {"BuilderFlag.FP16", "BuilderFlag.BF16", "BuilderFlag.TF32", "BuilderFlag.OBEY_PRECISION_CONSTRAINTS",
            "NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS", "ILayer.precision", "ILayer.set_output_type"}


# Functions / classes whose locals named as in OBJECT_CLASSES are TensorRT objects (elsewhere such names may be a
# recipe's config or an inspector's JSON record).
OBJECT_SCOPES = {"tensorrt_build.py": {"build_engine_file", "pin_fp32_island", "inspect_plugin_layers"},
                 "tensorrt_runtime.py": {"_TrtGraph"}}


def _chain(node):
    chain, cur = [], node
    while isinstance(cur, ast.Attribute):
        chain.append(cur.attr)
        cur = cur.value
    chain.reverse()
    root = cur.id if isinstance(cur, ast.Name) else None
    if root == "self" and chain and chain[0] in ("trt",) + tuple(OBJECT_CLASSES):
        root, chain = chain[0], chain[1:]
    return root, chain


def backend_attributes() -> set[str]:
    """Every `trt.A.B...` chain in the backend's code, and `<object>.member` of the TensorRT objects it holds
    (locals named as in OBJECT_CLASSES inside OBJECT_SCOPES)."""
    found: set[str] = set()
    for name in BACKEND_FILES:
        tree = ast.parse((ROOT / "dflash_export" / "engines" / name).read_text())
        scoped = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                  and n.name in OBJECT_SCOPES.get(name, ())]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                root, chain = _chain(node)
                if root == "trt" and chain and not chain[0].startswith("_"):
                    found.add(".".join(chain))
        for scope in scoped:
            for node in ast.walk(scope):
                if isinstance(node, ast.Attribute):
                    root, chain = _chain(node)
                    if root in OBJECT_CLASSES and chain:
                        found.add(f"{OBJECT_CLASSES[root]}.{chain[0]}")
    # keep only the longest chains (a chain's prefixes exist when it does)
    return {a for a in found if not any(b != a and b.startswith(a + ".") for b in found)}


def _resolve(trt, dotted: str) -> bool:
    obj = trt
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


class _Registry:
    """Stands in for TensorRT's plugin registry (the stand-in library has none): keeps the creators
    `tensorrt.plugin` registers, keyed as the real registry keys them."""

    def __init__(self):
        self.creators = {}

    def register_creator(self, creator, namespace):
        self.creators[(creator.name, creator.plugin_version, namespace)] = creator
        return True

    def get_creator(self, name, version, namespace):
        return self.creators.get((name, version, namespace))


_KEEP: list = []


def _fields(trt, np, attrs: dict):
    """A PluginFieldCollection carrying `attrs` as TensorRT's ONNX parser hands node attributes to a
    tensorrt.plugin creator (ints as INT64 / floats as FLOAT64 one-element arrays, the types the decorators
    declare)."""
    kinds = {int: (np.int64, trt.PluginFieldType.INT64), float: (np.float64, trt.PluginFieldType.FLOAT64)}
    fields = [trt.PluginField(k, np.array([v], dtype=kinds[type(v)][0]), kinds[type(v)][1]) for k, v in attrs.items()]
    fc = trt.PluginFieldCollection(fields)
    _KEEP.append(fields)  # a PluginFieldCollection does not keep its fields' arrays alive
    return fc


def _field_values(np, fc) -> dict:
    out = {}
    for f in fc:
        data = np.asarray(f.data)
        out[f.name] = data.reshape(-1)[0].item() if data.size == 1 else data.tolist()
    return out


def _dyn_desc(trt, dtype, dims):
    d = trt.DynamicPluginTensorDesc()
    d.desc.type = dtype
    d.desc.format = trt.TensorFormat.LINEAR
    d.desc.dims = trt.Dims(dims)
    d.min, d.opt, d.max = trt.Dims(dims), trt.Dims(dims), trt.Dims(dims)
    return d


def _churn(np) -> list:
    """Allocate and free small arrays, so memory a freed field array occupied is reused (as it would be while
    TensorRT serializes an engine)."""
    import gc

    gc.collect()
    return [np.full(1, 987654321, dtype=np.int64) for _ in range(256)]


def _field_checks(trt, np, creator, op, attrs, requests, report) -> None:
    """The fields a plugin object hands TensorRT to serialize, NVIDIA's method against the project's
    (`keep_serialized_fields`): for JIT and AOT plugin objects, the collection read back after memory churn holds
    the node's attributes, and a plugin re-created from that very collection in the runtime phase (what
    deserializing a JIT engine does) holds them too. NVIDIA's own method is recorded: on an AOT plugin it must still
    raise AttributeError (else the replacement may no longer be needed); on a JIT plugin what it reads back."""
    from dflash_export.engines import tensorrt_plugins as P

    trtp = sys.modules["tensorrt.plugin"]
    base = sys.modules[trtp.__name__ + "._plugin_class"]._TemplatePluginBase
    original = getattr(base.get_fields_to_serialize, "_dflash_original", None)
    assert original is not None, f"{op}: register_plugins did not replace get_fields_to_serialize"
    for kind in ("jit", "aot"):
        plugin = creator.create_plugin(op, P.PLUGIN_NAMESPACE, _fields(trt, np, attrs), trt.TensorRTPhase.BUILD,
                                       requests[kind])
        assert plugin.attrs == attrs, f"{op} {kind}: created plugin holds {plugin.attrs}, the node has {attrs}"
        try:
            nvidia = original(plugin)
            junk = _churn(np)
            report[f"{kind}_fields_nvidia"][op] = _field_values(np, nvidia)
            del junk
        except AttributeError as e:
            report[f"{kind}_fields_nvidia"][op] = f"raises AttributeError: {e}"
        saved = plugin.get_fields_to_serialize()
        junk = _churn(np)
        got = _field_values(np, saved)
        del junk
        assert got == attrs, f"{op} {kind}: serialized fields read back {got}, the node has {attrs}"
        again = creator.create_plugin(op, P.PLUGIN_NAMESPACE, saved, trt.TensorRTPhase.RUNTIME, requests[kind])
        assert again.attrs == attrs, f"{op} {kind}: re-created from its own fields it holds {again.attrs}"
        report[f"{kind}_fields"][op] = got
    aot_nvidia = report["aot_fields_nvidia"][op]
    assert isinstance(aot_nvidia, str) and "AttributeError" in aot_nvidia, \
        f"{op}: NVIDIA's AOT get_fields_to_serialize no longer raises ({aot_nvidia}): recheck the replacement"


def _plugin_checks(trt, np, registry, report) -> None:
    """Drive NVIDIA's plugin creator and plugin objects the way TensorRT's builder and runtime would."""
    from dflash_export.engines import tensorrt_plugins as P

    dtypes = {"float32": trt.float32, "float16": trt.float16, "bfloat16": trt.bfloat16}
    cases = {
        P.KV_ATTENTION: ({"num_heads": 4, "num_kv_heads": 2, "scale": 0.125},
                         lambda f: [f] * 5, [[1, 4, 16, 32], [1, 2, 40, 32], [1, 2, 40, 32], [1, 2, 16, 32],
                                             [1, 2, 16, 32]]),
        P.FUSED_VERIFY: ({"temperature": 0.0},
                         lambda f: [f, trt.int64, trt.float32, trt.float32], [[1, 16, 64], [1, 15], [1, 1, 1],
                                                                               [1, 15]]),
    }
    requests = {"aot": trt.QuickPluginCreationRequest.STRICT_AOT, "jit": trt.QuickPluginCreationRequest.STRICT_JIT,
                "prefer_aot": trt.QuickPluginCreationRequest.PREFER_AOT}
    for op, (attrs, in_types, in_dims) in cases.items():
        creator = registry.get_creator(op, P.PLUGIN_VERSION, P.PLUGIN_NAMESPACE)
        assert creator is not None, f"{op}: no creator registered"
        declared = {f.name for f in creator.field_names}
        assert declared == set(attrs), f"{op}: creator declares fields {sorted(declared)}, the ONNX node has " \
                                       f"{sorted(attrs)}"
        for kind, req in requests.items():
            for phase in (trt.TensorRTPhase.BUILD, trt.TensorRTPhase.RUNTIME):
                plugin = creator.create_plugin(op, P.PLUGIN_NAMESPACE, _fields(trt, np, attrs), phase, req)
                cls = type(plugin).__name__
                want = "AOT" if kind != "jit" else "JIT"
                assert want in cls, f"{op} {kind}: creator returned {cls}"
                report["created"].append(f"{op}/{kind}/{phase.name}")
        _field_checks(trt, np, creator, op, attrs, requests, report)
        for dname, dt in dtypes.items():
            types = in_types(dt)
            plugin = creator.create_plugin(op, P.PLUGIN_NAMESPACE, _fields(trt, np, attrs), trt.TensorRTPhase.BUILD,
                                           requests["aot"])
            out_types = plugin.get_output_data_types(types, [len(d) for d in in_dims])
            want = [dt] if op == P.KV_ATTENTION else [trt.int64] * 3
            assert list(out_types) == want, f"{op} {dname}: output dtypes {list(out_types)} != {want}"
            # the autotune declaration: which type combinations (and tactics) TensorRT may pick
            out_dims = [in_dims[0]] if op == P.KV_ATTENTION else [[1], [1, 16], [1]]
            in_out = [_dyn_desc(trt, t, d) for t, d in zip(types, in_dims)] + \
                     [_dyn_desc(trt, t, d) for t, d in zip(want, out_dims)]
            # get_output_shapes needs the runtime's IExprBuilder; what it leaves on the plugin (input / output
            # descriptors from our register function) is set here with rank-only shapes, as get_output_data_types
            # makes them
            trtp = sys.modules["tensorrt.plugin"]
            plugin.input_descs = []
            for t, d in zip(types, in_dims):
                td = trtp.TensorDesc()
                td.dtype, td.shape_expr = t, trtp.ShapeExprs(len(d), _is_dummy=True)
                td._immutable = True
                plugin.input_descs.append(td)
            outs = plugin.register_function(*plugin.input_descs, **plugin.attrs)
            plugin.output_descs = outs if isinstance(outs, tuple) else (outs,)
            ranks = [len(o.shape_expr) for o in plugin.output_descs]
            assert ranks == [len(d) for d in out_dims], f"{op} {dname}: output ranks {ranks}"
            combos = plugin.get_supported_format_combinations(in_out, len(types))
            n_io = len(in_out)
            rows = [[c.type for c in combos[i:i + n_io]] for i in range(0, len(combos), n_io)]
            assert types + want in rows, f"{op} {dname}: {types + want} not among the declared combinations"
            plugin.configure_plugin(in_out[:len(types)], in_out[len(types):])
            tactics = sorted(plugin.get_valid_tactics())
            if op == P.KV_ATTENTION:
                assert tactics == sorted(P.ATTENTION_TACTICS), f"{op} {dname}: tactics {tactics}"
            report["combinations"][f"{op}/{dname}"] = {"rows": len(rows), "tactics": tactics}
        # the JIT enqueue path binds the registered impl: the descriptor TensorRT dispatches to is ours
        desc = sys.modules["tensorrt.plugin._lib"].QDP_REGISTRY[f"{P.PLUGIN_NAMESPACE}::{op}"]
        for attr in ("impl_func", "aot_impl_func", "autotune_func", "register_func"):
            fn = getattr(desc, attr, None)
            assert fn is not None and fn.__module__ == P.__name__, f"{op}: {attr} is {fn!r}, not this package's"


# ----------------------------------------------------------------------------------------------------------------------
# The AOT launch: what TensorRT passes the kernel, against the kernel's PTX .entry

AOT_ARCH = 90  # the PTX each lane's aot_impl compiles (Triton needs a target without a GPU)


def _dim_class(trt):
    """The class of the dimension expressions a stand-in expression builder hands out: a value and whether it is a
    build-time constant. It passes tensorrt.plugin's `isinstance(x, trt.IDimensionExpr)` checks (through
    `__class__`), so NVIDIA's shape-expression code wraps it as it wraps the runtime's own."""

    class Dim:
        def __init__(self, value: int, constant: bool):
            self.value, self.constant = int(value), bool(constant)

        @property
        def __class__(self):
            return trt.IDimensionExpr

        def is_constant(self):
            return self.constant

        def get_constant_value(self):
            assert self.constant, "a dynamic dimension was read as a build-time constant"
            return self.value

    return Dim


def _expr_builder(trt, Dim):
    """Stands in for TensorRT's IExprBuilder: constants, and the dimension operations tensorrt.plugin builds
    (evaluated on the profile's values; constant when both operands are)."""
    ops = {trt.DimensionOperation.SUM: lambda a, b: a + b, trt.DimensionOperation.SUB: lambda a, b: a - b,
           trt.DimensionOperation.PROD: lambda a, b: a * b, trt.DimensionOperation.FLOOR_DIV: lambda a, b: a // b,
           trt.DimensionOperation.CEIL_DIV: lambda a, b: -(-a // b), trt.DimensionOperation.MAX: max,
           trt.DimensionOperation.MIN: min, trt.DimensionOperation.EQUAL: lambda a, b: int(a == b),
           trt.DimensionOperation.LESS: lambda a, b: int(a < b)}

    class Builder:
        def constant(self, value):
            return Dim(value, True)

        def operation(self, op, a, b):
            return Dim(ops[op](a.value, b.value), a.constant and b.constant)

    return Builder()


class _Recorder:
    """Stands in for what TensorRT hands get_launch_params to fill: the launch dimensions and the extra-argument
    list (`nbSymExprs`, then one entry per argument)."""

    def __init__(self):
        self.nbSymExprs = 0
        self.items = {}

    def __setitem__(self, i, value):
        self.items[i] = value


_ARG_BITS = {"INT32": 32, "INT16": 16, "INT8": 8}


def aot_launch(trt, np, creator, op, attrs, in_types, dims, tactic) -> dict:
    """Drive NVIDIA's AOT plugin object the way TensorRT's builder does for one plugin layer: create it (strict
    AOT), get_output_data_types, get_output_shapes over symbolic input dimensions, set_tactic, get_launch_params
    (which calls this package's aot_impl, compiling the Triton kernel for sm_90), get_kernel. Returns what TensorRT
    would launch: the kernel name and PTX, the width of every argument it passes (one 64-bit pointer per input, the
    extra arguments at the widths NVIDIA's SymExprImpl declares, one pointer per output), the extra arguments' and
    launch dimensions' values.

    `dims`: per input, a list of (value, build-time constant). The runtime library's expression builder and the
    C++ side of ISymExpr / DimsExprs are not in the stand-in: Python objects take their place (see _dim_class,
    _expr_builder, _Recorder), and SymExprImpl's `expr` (a C++ pointer field) is kept as a Python attribute."""
    from dflash_export.engines import tensorrt_plugins as P

    trtp = sys.modules["tensorrt.plugin"]
    tensor_mod = sys.modules[type(trtp.SymInt32(1)).__module__]
    Dim = _dim_class(trt)
    builder = _expr_builder(trt, Dim)

    class LaneSymExpr(tensor_mod.SymExprImpl):
        # Python attributes here: the C++ fields are write-only, and `expr` takes a capsule of a runtime expression
        type = dtype = expr = None

    saved = (tensor_mod.SymExprImpl, trt.DimsExprs)
    tensor_mod.SymExprImpl, trt.DimsExprs = LaneSymExpr, (lambda n: [None] * n)
    try:
        plugin = creator.create_plugin(op, P.PLUGIN_NAMESPACE, _fields(trt, np, attrs), trt.TensorRTPhase.BUILD,
                                       trt.QuickPluginCreationRequest.STRICT_AOT)
        out_types = list(plugin.get_output_data_types(in_types, [len(d) for d in dims]))
        out_exprs = plugin.get_output_shapes([[Dim(v, c) for v, c in d] for d in dims], [], builder)
        out_dims = [[(e.value, e.constant) for e in exprs] for exprs in out_exprs]
        in_out = [_dyn_desc(trt, t, [v for v, _ in d]) for t, d in zip(in_types, dims)] + \
                 [_dyn_desc(trt, t, [v for v, _ in d]) for t, d in zip(out_types, out_dims)]
        plugin.set_tactic(tactic)
        launch, args = _Recorder(), _Recorder()
        plugin.get_launch_params(None, in_out, len(in_types), launch, args, builder)
        name, ptx = plugin.get_kernel([d.desc for d in in_out[:len(in_types)]],
                                      [d.desc for d in in_out[len(in_types):]])
    finally:
        tensor_mod.SymExprImpl, trt.DimsExprs = saved
    extra = [args.items[i] for i in range(args.nbSymExprs)]
    assert all(a.type == trt.PluginArgType.INT for a in extra), f"{op}: a non-integer extra argument"
    widths = [64] * len(in_types) + [_ARG_BITS[a.dtype.name] for a in extra] + [64] * len(out_types)
    return {"kernel": name.decode() if isinstance(name, bytes) else name,
            "ptx": ptx.decode() if isinstance(ptx, bytes) else ptx, "widths": widths,
            "extra": [a.expr.value for a in extra], "output_dims": [[v for v, _ in d] for d in out_dims],
            "launch": {k: getattr(launch, k).expr.value for k in ("grid_x", "grid_y", "grid_z", "block_x",
                                                                  "shared_mem")}}


def _aot_abi_checks(trt, np, registry, report) -> None:
    """For both plugins, each float type and (attention) each tactic: the PTX .entry TensorRT gets declares exactly
    the arguments TensorRT passes, in count and width; the extra arguments and launch grid are the intended ones."""
    from triton.backends.compiler import GPUTarget

    from dflash_export.engines import tensorrt_plugins as P
    from dflash_export.engines.tensorrt_ptx import parse_entry

    compile_ = P._compile
    P._compile = lambda fn, sig, cx, target=None: compile_(fn, sig, cx, target or GPUTarget("cuda", AOT_ARCH, 32))
    try:
        # B = 1 and S / T dynamic (profile values 16 / 40), heads and head_dim build-time constants
        attention_dims = [[(1, False), (4, True), (16, False), (32, True)]] + \
                         [[(1, False), (2, True), (40, False), (32, True)]] * 2 + \
                         [[(1, False), (2, True), (16, False), (32, True)]] * 2
        verify_dims = [[(1, False), (16, False), (64, True)], [(1, False), (15, False)], [(1, False), (1, True),
                                                                                             (1, True)],
                       [(1, False), (15, False)]]
        cases = []
        for dname in ("float32", "float16", "bfloat16"):
            f = getattr(trt, dname)
            for tactic in sorted(P.ATTENTION_TACTICS):
                cases.append((P.KV_ATTENTION, {"num_heads": 4, "num_kv_heads": 2, "scale": 0.125}, [f] * 5,
                              attention_dims, tactic, dname))
            cases.append((P.FUSED_VERIFY, {"temperature": 0.0 if dname == "float32" else 0.7},
                          [f, trt.int64, trt.float32, trt.float32], verify_dims, 0, dname))
        for op, attrs, types, dims, tactic, dname in cases:
            creator = registry.get_creator(op, P.PLUGIN_VERSION, P.PLUGIN_NAMESPACE)
            got = aot_launch(trt, np, creator, op, attrs, types, dims, tactic)
            declared = [p.bits for p in parse_entry(got["ptx"], got["kernel"]).params]
            key = f"{op}/{dname}/tactic{tactic}"
            assert declared == got["widths"], f"{key}: .entry declares {declared}, TensorRT passes {got['widths']}"
            if op == P.KV_ATTENTION:
                assert got["extra"] == [4, 2, 16, 40, 32], f"{key}: extra args {got['extra']} != H, KVH, S, T, D"
                assert got["launch"]["grid_x"] == 4 and got["launch"]["grid_y"] == 1, f"{key}: {got['launch']}"
                assert got["output_dims"] == [[1, 4, 16, 32]], f"{key}: output dims {got['output_dims']}"
            else:
                assert got["extra"] == [16, 64], f"{key}: extra args {got['extra']} != BS, V"
                assert got["launch"]["grid_x"] == 1, f"{key}: {got['launch']}"
                assert got["output_dims"] == [[1], [1, 16], [1]], f"{key}: output dims {got['output_dims']}"
            report["aot_abi"][key] = {"params": len(declared), "extra": got["extra"], "launch": got["launch"]}
    finally:
        P._compile = compile_


# ----------------------------------------------------------------------------------------------------------------------
# The shipped PTX through NVIDIA's assembler (no TensorRT needed; runs once, not per lane)

ASSEMBLE_ARCHS = (80, 90, 100)


@dataclasses.dataclass(frozen=True)
class TritonLane:
    triton: str | None  # None: the main environment's Triton
    archs: tuple[int, ...] = ASSEMBLE_ARCHS

    @property
    def name(self) -> str:
        return f"triton-{self.triton or 'main'}"


# One Triton per shape of the .entry: 3.2 appends no parameter, 3.3 / 3.4 the global scratch pointer, 3.5 on the
# profile scratch pointer too; these assemble for sm_90 (the layout does not depend on the arch; 3.2's compiler
# aborts on compute capability 100). The main environment's Triton, what aot_impl runs, assembles all three.
TRITON_LANES = (TritonLane("3.2.0", (90,)), TritonLane("3.3.1", (90,)), TritonLane("3.5.1", (90,)), TritonLane(None))


def triton_appends(version: str) -> int:
    """How many trailing pointer parameters this Triton release adds to every kernel's .entry."""
    v = tuple(int(x) for x in version.split(".")[:2])
    return 0 if v < (3, 3) else 1 if v < (3, 5) else 2


def run_assemble(lane: TritonLane, timeout: float = 900) -> dict:
    """Install the lane's Triton (cached; the main environment's for None) and run `--assemble` in a subprocess."""
    path = [str(ROOT)]
    if lane.triton:
        site = CACHE / f"triton-{lane.triton}"
        _pip_target(site, f"triton=={lane.triton}")
        path.append(str(site))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    res = subprocess.run([sys.executable, "-W", "ignore", str(Path(__file__).resolve()), "--assemble",
                          ",".join(str(a) for a in lane.archs)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"lane": lane.name, "passed": False, "error": (res.stdout + res.stderr)[-3000:]}
    report = json.loads(lines[-1])
    appends = triton_appends(report["triton"])
    report["lane"] = lane.name
    report["passed"] = len(report["kernels"]) == 4 * len(lane.archs) and all(
        k["sizes"] == k["want"] and k["removed"] == appends for k in report["kernels"].values())
    return report


def _nvidia_tools(arch: int) -> tuple[str, str]:
    """(ptxas, cuobjdump) that Triton's wheel carries, as Triton picks ptxas for `arch`."""
    import inspect

    from triton.backends.nvidia import compiler as nv

    if not hasattr(nv, "get_ptxas"):
        ptxas = nv._path_to_binary("ptxas")[0]  # 3.2
    else:  # 3.3: get_ptxas(arch) -> (path, version); 3.5: get_ptxas() -> tool; 3.9: get_ptxas(arch) -> tool
        tool = nv.get_ptxas(arch) if inspect.signature(nv.get_ptxas).parameters else nv.get_ptxas()
        ptxas = tool[0] if isinstance(tool, tuple) else tool.path
    return str(ptxas), str(Path(ptxas).with_name("cuobjdump"))


def _cubin_params(cuobjdump: str, cubin: Path) -> dict[int, int]:
    """{ordinal: size in bytes} of the kernel parameters recorded in a cubin (EIATTR_KPARAM_INFO)."""
    import re

    out = subprocess.run([cuobjdump, "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {int(o, 16): int(z, 16) for o, z in re.findall(r"Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*0x[0-9a-f]+\s+"
                                                          r"Size\s*:\s*(0x[0-9a-f]+)", out)}


def assemble_shipped_ptx(archs=ASSEMBLE_ARCHS) -> dict:
    """Compile both plugin kernels (attention float32 / bfloat16, verify greedy float32 / sampled bfloat16) for each
    arch as aot_impl does, assemble the PTX TensorRT would get with Triton's ptxas, and read the parameter layout
    the assembler recorded in the cubin. Returns {"<arch>/<kernel>/<dtype>": {"sizes": [...], "want": [...]}} and
    the Triton version; raises when ptxas rejects the PTX."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    from dflash_export.engines import tensorrt_plugins as P

    want = {"kv_injected_block_attention_aot_kernel": [8] * 5 + [4] * 5 + [8],
            "fused_verify_aot_kernel": [8] * 4 + [4] * 2 + [8] * 3}
    out = {"triton": triton.__version__, "kernels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            target = GPUTarget("cuda", arch, 32)
            ptxas, cuobjdump = _nvidia_tools(arch)
            kernels = {"float32": P.compile_attention_aot("float32", 0.125, 32, 64, target),
                       "bfloat16": P.compile_attention_aot("bfloat16", 0.125, 128, 32, target),
                       "float32/greedy": P.compile_verify_aot("float32", 0.0, target=target),
                       "bfloat16/sampled": P.compile_verify_aot("bfloat16", 0.7, target=target)}
            for dname, k in kernels.items():
                gpu = next(ln.split()[1] for ln in k.ptx.splitlines() if ln.startswith(".target"))
                src, cubin = Path(tmp) / f"{k.name}.ptx", Path(tmp) / f"{k.name}.cubin"
                src.write_text(k.ptx)
                res = subprocess.run([ptxas, f"--gpu-name={gpu}", str(src), "-o", str(cubin)], capture_output=True,
                                     text=True, check=False)
                if res.returncode != 0:
                    raise RuntimeError(f"ptxas {gpu} rejected {k.name} ({dname}): {res.stderr[-1500:]}")
                params = _cubin_params(cuobjdump, cubin)
                sizes = [params[i] for i in sorted(params)]
                out["kernels"][f"sm_{arch}/{k.name}/{dname}"] = {"target": gpu, "sizes": sizes,
                                                                 "want": want[k.name], "removed": k.appended}
    return out


def _manifest_checks(report) -> None:
    """build_tensorrt on tiny-qwen3 under the real bindings, with only what needs the runtime library or a GPU
    replaced (the engine compilations, the CUDA device queries): the manifest it writes passes validation and records
    the recipe's `decoding` and what the engines run of it; a recipe asking for draft trees builds, its manifest
    saying the engines propose the drafter's chain."""
    import tempfile
    from unittest import mock

    import torch

    from dflash_export.decoding.options import DecodingOptions
    from dflash_export.engines import tensorrt_build as B
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.tensorrt_runtime import tensorrt_decoding
    from dflash_export.recipes import load_recipe

    recipe = load_recipe("tiny-qwen3")
    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "get_device_name", lambda *_: "none (lane stand-in)"), \
            mock.patch.object(B, "build_tensorrt_engines", lambda *a, **k: {}), \
            mock.patch.object(B, "build_batch_engines", lambda *a, **k: {}):
        out = B.build_tensorrt(recipe, Path(tmp) / "engine")
        manifest = read_manifest(out)
        assert manifest.raw["decoding"] == dataclasses.asdict(recipe.decoding), manifest.raw.get("decoding")
        assert manifest.engine_info().decoding == manifest.raw["decoding"]
        runs = manifest.raw["tensorrt_decoding"]
        assert runs == tensorrt_decoding(dataclasses.asdict(recipe.decoding)) and runs["proposer"] == "chain", runs
        trees = dataclasses.replace(recipe, decoding=DecodingOptions(proposer="tree"))
        tree_runs = read_manifest(B.build_tensorrt(trees, Path(tmp) / "trees")).raw["tensorrt_decoding"]
        assert tree_runs["proposer"] == "chain" and "proposer_note" in tree_runs, tree_runs
    report["manifest_decoding"] = runs


def _without_refusal(trt, np, registry) -> str:
    """What the refused pair does when the version check is skipped: the error NVIDIA's code raises."""
    from dflash_export.engines import tensorrt_plugins as P

    P.check_versions = lambda *a: None
    try:
        P.register_plugins()
        creator = registry.get_creator(P.FUSED_VERIFY, P.PLUGIN_VERSION, P.PLUGIN_NAMESPACE)
        creator.create_plugin(P.FUSED_VERIFY, P.PLUGIN_NAMESPACE, _fields(trt, np, {"temperature": 0.0}),
                              trt.TensorRTPhase.BUILD, trt.QuickPluginCreationRequest.STRICT_AOT)
    except Exception as e:  # noqa: BLE001 -- the point is to record whatever it raises
        return f"{type(e).__name__}: {e}"
    return "no error"


def check() -> dict:
    """Runs inside the lane's subprocess. Returns the report; raises on a failed check."""
    import numpy as np
    import tensorrt as trt

    from dflash_export.engines import tensorrt_build as B
    from dflash_export.engines import tensorrt_plugins as P
    from dflash_export.errors import MissingDependency

    report = {"tensorrt": trt.__version__, "numpy": np.__version__, "created": [], "combinations": {},
              "precision": {}, "aot_fields": {}, "jit_fields": {}, "aot_fields_nvidia": {}, "jit_fields_nvidia": {},
              "aot_abi": {}}
    attrs = backend_attributes()
    missing = sorted(a for a in attrs if not _resolve(trt, a))
    report["attributes"] = len(attrs)
    report["optional_absent"] = [a for a in missing if a in OPTIONAL]
    required_missing = [a for a in missing if a not in OPTIONAL]
    assert not required_missing, f"tensorrt {trt.__version__} lacks {required_missing}"
    for dtype in ("float32", "float16", "bfloat16"):
        try:
            prec = B.resolve_precision(trt, dtype)
        except MissingDependency as e:
            report["precision"][dtype] = f"refused: {e}"
            continue
        for flag in prec.set_flags + prec.clear_flags:
            assert hasattr(trt.BuilderFlag, flag), f"{dtype}: BuilderFlag.{flag} absent"
        B._network_flags(trt, prec.strongly_typed)  # every creation flag it names exists
        report["precision"][dtype] = dataclasses.asdict(prec)
    # polygraphy: the names the backend's ONNX-Runtime-vs-TensorRT comparison imports (engines/tensorrt.py)
    import polygraphy
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx  # noqa: F401
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner  # noqa: F401
    from polygraphy.comparator import Comparator, CompareFunc  # noqa: F401
    report["polygraphy"] = polygraphy.__version__
    registry = _Registry()
    trt.get_plugin_registry = lambda: registry
    try:
        P.register_plugins()
    except MissingDependency as e:
        report["refused"] = str(e)
        report["without_refusal"] = _without_refusal(trt, np, registry)
        return report
    assert P.aot_plugins_supported(trt, sys.modules["tensorrt.plugin"]), "AOT plugins not supported"
    _plugin_checks(trt, np, registry, report)
    _aot_abi_checks(trt, np, registry, report)
    _manifest_checks(report)
    return report


def _check_main() -> int:
    expect = os.environ.get("DFLASH_TRT_LANE_EXPECT", "ok")
    report = check()
    refused = report.get("refused")
    if expect == "ok":
        report["passed"] = refused is None
    else:
        # refused with our line; a numpy refusal must also be needed (without it NVIDIA's code fails)
        needed = "numpy" not in expect or report.get("without_refusal", "no error") != "no error"
        report["passed"] = refused is not None and expect.split(": ", 1)[1] in refused and needed
    print(json.dumps(report))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="run the checks in this process (inside a lane)")
    ap.add_argument("--only", action="append", help="TensorRT version(s) to run (default: every lane)")
    ap.add_argument("--assemble", type=lambda t: [int(a) for a in t.split(",")], metavar="ARCHS",
                    help="assemble the shipped PTX for these archs (e.g. 80,90,100) with Triton's ptxas and print "
                    "the parameter layout per kernel")
    args = ap.parse_args(argv)
    if args.check:
        return _check_main()
    if args.assemble:
        print(json.dumps(assemble_shipped_ptx(args.assemble)))
        return 0
    lanes = [ln for ln in LANES if not args.only or ln.tensorrt in args.only]
    ok = True
    for lane in lanes:
        report = run_lane(lane)
        ok &= report["passed"]
        print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
