"""The TensorRT backend: the exported ONNX graphs compiled to TensorRT engines, the two custom ops as plugins.

The backend's entry point: what the backend registry imports, and where every public name of the backend can be
reached. The work lives in three modules, imported one way (this module -> build / runtime -> plugins):
- `tensorrt_plugins`: the plugin contract on ONNX models (`check_plugin_attributes`), the Triton AOT compilation of
  the plugin kernels (`compile_*_aot`), plugin registration (`register_plugins`), `require_tensorrt`, and the
  backend's shared constants;
- `tensorrt_build`: `build --backend tensorrt` (`build_tensorrt`, `build_tensorrt_engines`, `build_engine_file`, the
  plugin-layer check);
- `tensorrt_runtime`: `TensorRTRunner` / `TensorRTEngine`, the DFlash runtime's GraphEngine over the built engines,
  and `tensorrt_decoding`, what they run of the recipe's `decoding` (the chain, saying what it
  runs instead of a tree or lookup proposer);
- `tensorrt_batch`: continuous batching. The build also compiles plain-op copies of the export's batch
  graphs (target_batch, the drafter with key_bias, the LM head; ONNX Runtime's fused norms rewritten, the dflash
  function inlined) with profiles for 1..max_batch sequences (default 8), recorded in the manifest;
  `BatchedTensorRTEngine` runs them under the bookkeeping ONNX Runtime's batched engine uses (ort_batch.BatchedEngine),
  which `BatchingRuntime` picks for a TensorRT engine. Tested on CPU only, against the emulated TensorRT API
  (tests/test_tensorrt_batch.py); the batch's K/V stay on the device (torch buffers bound by address, `DeviceKV`: a
  step copies only its small inputs and outputs). TensorRT parsing and building these graphs, the device-side K/V
  work under a real CUDA stream and speed are unchecked without a GPU.
This module holds `validate`'s ONNX Runtime vs TensorRT comparison (`compare_onnxruntime_tensorrt`) and the example
feeds it runs.

Bounded on purpose. Everything that needs `tensorrt` (plugin registration, engine build, the polygraphy comparison)
imports it inside a function and is reached only through `register_plugins`, `build_tensorrt_engines`,
`build_batch_engines`, `build_tensorrt` and `compare_onnxruntime_tensorrt`; without it they raise MissingDependency
naming the extra.
What does not need it is plain Python and tested everywhere: the plugin contract check on ONNX models
(`check_plugin_attributes`), the optimization-profile tables (`profile_shapes`), example feeds, and the Triton AOT
compilation of the plugin kernels (`compile_*_aot`, triton only).
"""

import importlib.util
from pathlib import Path
from typing import Any

from dflash_export.engines import tensorrt_plugins as plugins
from dflash_export.engines.graph_engine import Profile, graph_profiles, profile_shapes, vocab_size_of
from dflash_export.engines.manifest import read_manifest
from dflash_export.engines.tensorrt_batch import (
    BatchedTensorRTEngine,
    TrtBatchGraphs,
    check_batch_manifest,
    plain_op_graph,
)
from dflash_export.engines.tensorrt_build import (
    build_batch_engines,
    build_engine_file,
    build_implementations,
    build_tensorrt,
    build_tensorrt_engines,
    check_plugin_layers,
    inspect_plugin_layers,
    plugin_implementations,
    plugin_layer_counts,
    refuse_masked_drafter,
    write_serving_files,
)
from dflash_export.engines.tensorrt_plugins import (
    ATTENTION_BLOCK_M,
    ATTENTION_TACTICS,
    BACKEND,
    DRAFTER_ENGINE,
    DRAFTER_ONNX,
    FUSED_VERIFY,
    IMPL_AOT,
    IMPL_JIT,
    INSTALL_HINT,
    KV_ATTENTION,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    PLUGINS,
    TARGET_ENGINE,
    TARGET_ONNX,
    VERIFY_BLOCK_BS,
    VERIFY_BLOCK_V,
    AotKernel,
    PluginSpec,
    aot_plugins_supported,
    array_interface,
    check_plugin_attributes,
    compile_attention_aot,
    compile_verify_aot,
    cuda_tensor_view,
    register_plugins,
    require_tensorrt,
    tensorrt_available,
    verify_aot_constexprs,
)
from dflash_export.engines.tensorrt_runtime import (
    TensorRTEngine,
    TensorRTRunner,
    engine_profiles,
    tensorrt_decoding,
    tensorrt_engine_info,
)

__all__ = [
    # tensorrt_plugins
    "ATTENTION_BLOCK_M", "ATTENTION_TACTICS", "BACKEND", "DRAFTER_ENGINE", "DRAFTER_ONNX", "FUSED_VERIFY", "IMPL_AOT",
    "IMPL_JIT", "INSTALL_HINT", "KV_ATTENTION", "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "PLUGINS", "TARGET_ENGINE",
    "TARGET_ONNX", "VERIFY_BLOCK_BS", "VERIFY_BLOCK_V", "AotKernel", "PluginSpec", "aot_plugins_supported",
    "array_interface", "check_plugin_attributes", "compile_attention_aot", "compile_verify_aot", "cuda_tensor_view",
    "register_plugins", "require_tensorrt", "tensorrt_available", "verify_aot_constexprs",
    # tensorrt_build
    "build_batch_engines",
    "build_engine_file", "build_implementations", "build_tensorrt", "build_tensorrt_engines", "check_plugin_layers",
    "inspect_plugin_layers", "plugin_implementations", "plugin_layer_counts", "refuse_masked_drafter",
    "write_serving_files",
    # tensorrt_runtime
    "TensorRTEngine", "TensorRTRunner", "engine_profiles", "tensorrt_decoding", "tensorrt_engine_info",
    # tensorrt_batch
    "BatchedTensorRTEngine", "TrtBatchGraphs", "check_batch_manifest", "plain_op_graph",
    # graph_engine (the optimization-profile tables)
    "Profile", "graph_profiles", "profile_shapes", "vocab_size_of",
    # here
    "example_feeds", "compare_onnxruntime_tensorrt",
]


# ----------------------------------------------------------------------------------------------------------------------
# Example feeds (pure Python: a profile's opt shapes -> concrete inputs)

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
# validate: ONNX Runtime vs TensorRT (polygraphy)

def compare_onnxruntime_tensorrt(engine_dir, atol: float = 1e-3, rtol: float = 1e-3, seed: int = 0
                                 ) -> dict[str, Any]:
    """Run each graph's ONNX model (ONNX Runtime, the plugins' reference functions inlined) and its TensorRT engine
    (plugins) on the same inputs at every profile's opt shapes; compare all outputs with polygraphy's Comparator.

    Returns {"ok": bool, "<engine>/<profile>": {"ok": bool, "max_abs_diff": {output: float}}}.
    """
    import numpy as np
    import onnx

    plugins.require_tensorrt()
    if importlib.util.find_spec("polygraphy") is None:
        raise plugins._missing("polygraphy is not installed")
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, CompareFunc

    plugins.register_plugins()  # an engine built with the JIT fallback needs the Python plugins at deserialization
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
