"""Run inside the lane's side environment (scripts/trt_lane/run.py): NVIDIA's real `tensorrt` Python bindings and
`tensorrt.plugin`, loaded over stub.c (runtime factories that return NULL: nothing here runs on a GPU). Checks what
this project asks of that layer and prints one JSON object. Plugin registration goes to a registry kept in Python
(the real one needs the runtime library); everything else is NVIDIA's code."""

from __future__ import annotations

import json
import re
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class Registry:
    """Stands in for the plugin registry getPluginRegistry() would return (the stub returns NULL)."""

    def __init__(self):
        self.creators = {}

    def register_creator(self, creator, namespace):
        self.creators[(creator.name, namespace)] = creator
        return True

    def get_creator(self, name, version, namespace):
        return self.creators[(name, namespace)]


def attributes_touched() -> set[str]:
    """`trt.X` / `trt.X.Y` the TensorRT backend names directly (getattr / hasattr guarded names excluded)."""
    names = set()
    for path in sorted((ROOT / "dflash_export" / "engines").glob("tensorrt*.py")):
        text = path.read_text()
        for m in re.finditer(r"\btrt\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Z_][A-Za-z0-9_]*))?", text):
            line = text[text.rfind("\n", 0, m.start()) + 1: text.find("\n", m.end())]
            if "hasattr(" in line or "getattr(" in line:
                continue
            names.add(m.group(1) + (f".{m.group(2)}" if m.group(2) else ""))
    return names


def resolve(trt, name: str) -> bool:
    obj = trt
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def main() -> int:
    out: dict = {"numpy": np.__version__, "checks": {}, "failures": []}

    def check(name, fn):
        try:
            out["checks"][name] = fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the others
            out["checks"][name] = f"FAILED: {type(e).__name__}: {e}"
            out["failures"].append(name)
            out.setdefault("tracebacks", {})[name] = traceback.format_exc()[-1500:]

    import tensorrt as trt

    out["tensorrt"] = trt.__version__
    from dflash_export.engines import tensorrt_build, tensorrt_plugins
    from dflash_export.errors import MissingDependency

    try:
        tensorrt_plugins.check_versions(trt.__version__, np.__version__)
        out["supported_pair"] = True
    except MissingDependency as e:
        out["supported_pair"] = False
        out["refusal"] = str(e)

    def attrs():
        missing = sorted(n for n in attributes_touched() if not resolve(trt, n))
        if missing:
            raise AssertionError(f"missing in TensorRT {trt.__version__}: {missing}")
        return f"{len(attributes_touched())} names resolve"

    check("attributes", attrs)

    def precision():
        plans = {}
        for dtype in ("float32", "float16", "bfloat16"):  # every dtype a recipe may name
            plan = tensorrt_build.precision_plan(trt, dtype)
            for flag in plan["set"] + plan["clear"]:
                assert hasattr(trt.BuilderFlag, flag), flag
            assert hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
            plans[dtype] = {k: plan[k] for k in ("strongly_typed", "set", "compute")}
        return plans

    check("precision_plan", precision)

    registry = Registry()
    trt.get_plugin_registry = lambda: registry
    import tensorrt.plugin as trtp

    if not out["supported_pair"]:
        # What the refusal protects from: NVIDIA's creator on this pair, without the project's version check.
        tensorrt_plugins.check_versions = lambda *a: None
    check("register_plugins", lambda: (tensorrt_plugins.register_plugins(),
                                       sorted(f"{ns}::{n}" for n, ns in registry.creators))[1])
    out["aot_supported"] = tensorrt_plugins.aot_plugins_supported(trt, trtp)
    if "register_plugins" not in out["failures"]:
        plugin_checks(trt, trtp, registry, check, out["aot_supported"])
    print(json.dumps(out))
    return 0


def fields_for(trt, name: str):
    f = trt.PluginField
    if name == "KVInjectedBlockAttention":
        return [f("num_heads", np.array([4], np.int32), trt.PluginFieldType.INT32),
                f("num_kv_heads", np.array([2], np.int32), trt.PluginFieldType.INT32),
                f("scale", np.array([0.25], np.float32), trt.PluginFieldType.FLOAT32)]
    return [f("temperature", np.array([0.0], np.float32), trt.PluginFieldType.FLOAT32)]


def io_for(trt, name: str, dtype):
    """(input types, ranks) of each plugin, as the exported graphs feed it."""
    if name == "KVInjectedBlockAttention":
        return [dtype] * 5, [4] * 5
    return [dtype, trt.int64, trt.float32, trt.float32], [3, 2, 3, 2]


def plugin_checks(trt, trtp, registry, check, aot: bool) -> None:
    from tensorrt.plugin._tensor import ShapeExprs, TensorDesc

    modes = [("jit", None)] + ([("aot", trt.QuickPluginCreationRequest.STRICT_AOT)] if aot else [])
    for name in ("KVInjectedBlockAttention", "FusedVerify"):
        creator = registry.get_creator(name, "1", "dflash")
        for mode, request in modes:
            for dtype_name in ("float32", "float16", "bfloat16"):
                dtype = getattr(trt, dtype_name)

                def run(name=name, creator=creator, request=request, dtype=dtype):
                    fc = trt.PluginFieldCollection(fields_for(trt, name))
                    args = (name, "dflash", fc, trt.TensorRTPhase.BUILD) + ((request,) if request else ())
                    plugin = creator.create_plugin(*args)
                    types, ranks = io_for(trt, name, dtype)
                    out_types = plugin.get_output_data_types(types, ranks)
                    # What TensorRT's build does next, with shape expressions it would supply (dummies here).
                    descs = []
                    for t, r in zip(types, ranks):
                        d = TensorDesc()
                        d.dtype, d.shape_expr = t, ShapeExprs(r, _is_dummy=True)
                        d._immutable = True
                        descs.append(d)
                    plugin.input_descs = descs
                    outs = plugin.register_function(*descs, **plugin.attrs)
                    plugin.output_descs = outs if isinstance(outs, tuple) else (outs,)
                    combos = [c for comb in plugin.autotune_function(*descs, *[plugin.attrs[k] for k in
                                                                              plugin.autotune_attr_names],
                                                                    plugin.output_descs)
                              for c in comb._get_combinations()]
                    ours = [c for c in combos if c.types[0] == dtype]
                    assert ours, f"no format combination for {dtype}"
                    tactics = sorted(t for c in ours for t in (c.tactics or []))
                    res = {"plugin": type(plugin).__name__, "outputs": [str(t) for t in out_types],
                           "tactics": tactics}
                    if request is None:
                        # A JIT plugin's fields are saved into the engine and read back at deserialization (the
                        # runtime phase). An AOT plugin's engine carries its kernel instead: TensorRT never asks
                        # it for fields (NVIDIA's AOT class has no field list to give).
                        saved = plugin.get_fields_to_serialize()
                        again = creator.create_plugin(name, "dflash", saved, trt.TensorRTPhase.RUNTIME)
                        res.update(fields=sorted(f.name for f in saved), reloaded=type(again).__name__)
                    return res

                check(f"{name}/{mode}/{dtype_name}", run)


if __name__ == "__main__":
    sys.exit(main())
