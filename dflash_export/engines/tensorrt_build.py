"""The TensorRT backend's build: `build --backend tensorrt` exports the recipe's graphs and compiles each to a
TensorRT engine with the dflash plugins and the graph's optimization profiles, checks the built engine holds one
plugin layer per dflash node, records which plugin implementation TensorRT used, and writes the engine directory
(engines, their ONNX graphs, tokenizer files, manifest.json). Needs tensorrt and an NVIDIA GPU, imported lazily;
the inspector-JSON and implementation bookkeeping is plain Python.
"""

import dataclasses
from pathlib import Path
from typing import Any

from dflash_export.engines import tensorrt_plugins as plugins
from dflash_export.engines.graph_engine import Profile, graph_profiles, profile_shapes, vocab_size_of
from dflash_export.engines.manifest import write_manifest
from dflash_export.engines.ort_build import copy_tokenizer
from dflash_export.engines.tensorrt_batch import (
    BATCH_FILES,
    DEFAULT_MAX_BATCH,
    batch_engine_entry,
    embedding_layout,
    write_plain_batch_graphs,
)
from dflash_export.engines.tensorrt_plugins import (
    AOT_ATTRIBUTE,
    BACKEND,
    DRAFTER_ENGINE,
    DRAFTER_ONNX,
    IMPL_AOT,
    IMPL_JIT,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    PLUGINS,
    TARGET_ENGINE,
    TARGET_ONNX,
    check_plugin_attributes,
)
from dflash_export.engines.tensorrt_runtime import tensorrt_decoding
from dflash_export.errors import DFlashError
from dflash_export.export import export_recipe
from dflash_export.export.builder import FP32_ISLAND
from dflash_export.files import atomic_dir, native_path


def _network_flags(trt, strongly_typed: bool) -> int:
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    # Both impl and aot_impl are registered: ask for the AOT kernels (engines then run without Python).
    if hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    return flags


@dataclasses.dataclass(frozen=True)
class BuildPrecision:
    """How one recipe dtype is built on one TensorRT: the network's typing, the float type of the ONNX graph
    TensorRT parses, the BuilderFlag names set / cleared, and whether the FP32_ISLAND layers are pinned to float32
    by precision constraints (weakly typed builds only; a strongly typed graph carries its own casts)."""

    strongly_typed: bool
    graph_dtype: str
    set_flags: tuple[str, ...]
    clear_flags: tuple[str, ...]
    pin_fp32_island: bool


def resolve_precision(trt, dtype: str) -> BuildPrecision:
    """float32: strongly typed, TF32 cleared (fp32 matmuls, what the ONNX Runtime twin computes). float16 / bfloat16
    on a TensorRT with BuilderFlag.FP16 / BF16 (10.x): a weakly typed float32 graph lowered by the flag, with the
    float32 island obeyed. On a TensorRT without them (11.x: every network strongly typed): the graph's float16 /
    bfloat16 copy (export/half.py), whose casts keep the island float32."""
    flags = trt.BuilderFlag
    if dtype == "float32":
        return BuildPrecision(True, "float32", (), ("TF32",) if hasattr(flags, "TF32") else (), False)
    if dtype not in ("float16", "bfloat16"):
        raise DFlashError(f"TensorRT builds float32, float16 or bfloat16 recipes, not {dtype}", field="dtype")
    flag = "BF16" if dtype == "bfloat16" else "FP16"
    if hasattr(flags, flag):
        obey = ("OBEY_PRECISION_CONSTRAINTS",) if hasattr(flags, "OBEY_PRECISION_CONSTRAINTS") else ()
        return BuildPrecision(False, "float32", (flag,) + obey, (), True)
    return BuildPrecision(True, dtype, (), (), False)


def pin_fp32_island(trt, network) -> int:
    """Weakly typed builds: ask float32 of every layer TensorRT's parser made from an FP32_ISLAND node (it names
    layers after their nodes) and of their float outputs. Returns the number of layers pinned."""
    floats = {trt.float32, trt.float16, trt.bfloat16}
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if FP32_ISLAND not in layer.name:
            continue
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            if layer.get_output(j).dtype in floats:
                layer.set_output_type(j, trt.float32)
        pinned += 1
    return pinned


def plugin_only_graph(onnx_path: Path, implementation: str = IMPL_AOT) -> Path:
    """Write `<stem>.trt.onnx` next to `onnx_path`: the same graph (weights still referenced, not copied) without
    the model-local functions that define the dflash ops, so TensorRT's parser can only import a dflash node as
    its plugin, never as the function's body (older onnx-tensorrt parsers expand a node that has a local
    function), and with every plugin node's `aot` attribute saying the `implementation` asked for (1: the AOT
    kernel, 0: the JIT impl; the parser makes it a strict request). Returns its path; the original, with the
    functions, stays what ONNX Runtime runs."""
    import onnx
    from onnx import helper

    if implementation not in (IMPL_AOT, IMPL_JIT):
        raise DFlashError(f"unknown plugin implementation {implementation!r} (expected {IMPL_AOT} or {IMPL_JIT})",
                          field="implementation")
    model = onnx.load(str(onnx_path), load_external_data=False)
    kept = [f for f in model.functions if not (f.domain == PLUGIN_NAMESPACE and f.name in PLUGINS)]
    del model.functions[:]
    model.functions.extend(kept)
    flag = helper.make_attribute(AOT_ATTRIBUTE, int(implementation == IMPL_AOT))
    for _, node in plugins._dflash_nodes(model):
        if node.op_type in PLUGINS:
            have = [a for a in node.attribute if a.name == AOT_ATTRIBUTE]
            if have:
                have[0].CopyFrom(flag)
            else:
                node.attribute.append(flag)
    out = Path(onnx_path).with_name(Path(onnx_path).stem + ".trt.onnx")
    onnx.save(model, str(out))
    return out


def default_implementation(trt) -> str:
    """The plugin path a build asks for unless told otherwise: the AOT kernel where this TensorRT builds AOT Python
    plugins (engines then run without Python), else the JIT impl."""
    import tensorrt.plugin as trtp

    return IMPL_AOT if plugins.aot_plugins_supported(trt, trtp) else IMPL_JIT


def build_engine_file(onnx_path: Path, engine_path: Path, profiles: list[Profile], dtype: str,
                      workspace_gib: float = 8.0, implementation: str | None = None) -> dict[str, Any]:
    """Parse one ONNX graph and write its serialized TensorRT engine, at the precision `resolve_precision` gives
    this TensorRT for `dtype` (a half-precision copy of the graph is written next to it when the build needs one),
    with every dflash plugin layer built the `implementation` way ("aot" | "jit"; default_implementation when
    None). Returns build facts, `requested` and the `implementation` TensorRT used per op among them."""
    import onnx

    trt = plugins.require_tensorrt()
    plugins.register_plugins()
    requested = implementation or default_implementation(trt)
    precision = resolve_precision(trt, dtype)
    if precision.graph_dtype != "float32":
        from dflash_export.export.half import write_half_graph

        onnx_path = write_half_graph(onnx_path, precision.graph_dtype)
    onnx_path = plugin_only_graph(onnx_path, requested)
    model = onnx.load(str(onnx_path), load_external_data=False)
    counts = check_plugin_attributes(model)
    shapes = [profile_shapes(model, p) for p in profiles]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = precision.strongly_typed
    network = builder.create_network(_network_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    with native_path(onnx_path) as name:  # external weights resolve beside it
        parsed = parser.parse_from_file(name)
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise DFlashError(f"TensorRT could not parse the graph: {errors}", path=onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    # Per-layer details (type, plugin name) in the engine, for the plugin-layer check below
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    for flag in precision.set_flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for flag in precision.clear_flags:
        config.clear_flag(getattr(trt.BuilderFlag, flag))
    pinned = pin_fp32_island(trt, network) if precision.pin_fp32_island else 0
    if precision.pin_fp32_island and pinned == 0 and any(n.name.startswith(FP32_ISLAND) for n in model.graph.node):
        # an fp16 / bf16 engine whose tap fusion and norms run in half precision can overflow to inf
        raise DFlashError(f"TensorRT's parser named no layer after the graph's {FP32_ISLAND} nodes, so they cannot "
                          "be kept in float32", path=onnx_path, field="fp32_island")
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
    plugins._BUILD_CALLS.clear()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise DFlashError("TensorRT failed to build the engine (see the log above)", path=onnx_path)
    data = bytes(serialized)
    implementations = build_implementations(counts, plugins._BUILD_CALLS)
    for op, used in implementations.items():
        if used != requested:
            raise DFlashError(f"TensorRT built the {op} plugin layer(s) as {used!r}, the build asked for "
                              f"{requested!r}", path=onnx_path, field="implementation")
    layers = inspect_plugin_layers(trt, data, engine_path)
    check_plugin_layers(counts, layers, engine_path)
    engine_path.write_bytes(data)
    return {"profiles": [p.name for p in profiles], "strongly_typed": strongly_typed,
            "graph_dtype": precision.graph_dtype, "fp32_layers_pinned": pinned, "plugins": counts,
            "plugin_layers": layers, "requested": requested, "implementation": implementations,
            "bytes": engine_path.stat().st_size}


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


def build_tensorrt_engines(export_dir, out_dir, recipe, max_batch: int = 1,
                           implementation: str | None = None) -> dict[str, Any]:
    """Build `target_verify.engine` and `drafter.engine` in `out_dir` from the exported graphs in `export_dir`.

    Profiles: target_verify = prefill / verify (block_size tokens) / decode (1 token); drafter = first block after
    prefill / steady-state step (see `graph_profiles`). Returns the per-engine build facts for the manifest.
    """
    import onnx

    plugins.require_tensorrt()
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
        facts[engine_name] = build_engine_file(onnx_path, out_dir / engine_name, profiles, recipe.dtype,
                                               implementation=implementation)
        facts[engine_name]["block_size"] = block_size
    return facts


def build_batch_engines(onnx_dir, out_dir, block_size: int, max_seq_len: int, dtype: str,
                        max_batch: int = DEFAULT_MAX_BATCH) -> dict[str, Any]:
    """Continuous batching's engines in `out_dir`: the plain-op copies of the export's batch graphs (written into
    `onnx_dir`, see tensorrt_batch.plain_op_graph) compiled with profiles for 1..max_batch sequences
    (graph_engine.batch_profiles). Returns the per-engine build facts for the manifest, each with what the runtime
    checks (`profiles`, `max_batch`, the `onnx` graph) and the ops the plain-op copy rewrote."""
    plugins.require_tensorrt()
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    rewritten = write_plain_batch_graphs(onnx_dir)
    facts: dict[str, Any] = {}
    for graph, (_, plain, engine_name) in BATCH_FILES.items():
        profiles = graph_profiles(graph, block_size, max_seq_len, 0, max_batch)  # batch profiles take no vocab range
        facts[engine_name] = build_engine_file(onnx_dir / plain, out_dir / engine_name, profiles, dtype)
        facts[engine_name].update(batch_engine_entry(graph, block_size, max_seq_len, max_batch),
                                  rewritten_ops=rewritten[graph])
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
    Both refused by name before anything is built."""
    if config.is_dflash2:
        raise DFlashError("DFlash 2 drafters: the TensorRT engine has no candidate selector yet; use --backend "
                          "onnxruntime", path=where, field="architectures")
    for i in range(config.num_hidden_layers):
        if config.layer_causal(i) or config.layer_window(i) is not None:
            raise DFlashError(f"layer {i} is causal or sliding-window (z-lab 0.1.0): the TensorRT backend has no "
                              "MaskedKVInjectedBlockAttention plugin yet; use --backend onnxruntime", path=where,
                              field="is_causal" if config.is_causal else "layer_types")


def refuse_hybrid_target(recipe) -> None:
    """Hybrid targets (Gated DeltaNet layers: a conv window and a recurrent state per sequence) have no TensorRT
    engine here: the engine-state bindings, the Scan over a block's rows and the per-row commit are written for
    ONNX Runtime only (engines/onnxruntime.py, engines/ort_batch.py). Refused by name before anything is built."""
    from dflash_export.models.arch import ARCHS
    from dflash_export.models.target import read_target_config

    tcfg, _ = read_target_config(recipe.target_path)
    arch = ARCHS.get(tcfg["model_type"])
    if arch is not None and arch.hybrid is not None:
        raise DFlashError(f"{tcfg['model_type']} is a hybrid target (Gated DeltaNet linear attention with a recurrent "
                          "state per sequence): the TensorRT backend has no engine for its state; use --backend "
                          "onnxruntime", path=recipe.path, field="model_type")


def build_tensorrt(recipe, out_dir, max_batch: int = DEFAULT_MAX_BATCH, implementation: str | None = None) -> Path:
    """`build --backend tensorrt`: export the recipe's graphs, compile both to TensorRT engines with the dflash
    plugins, and write `out_dir` atomically (engines + the ONNX graphs they came from, kept for `validate`'s
    ONNX Runtime vs TensorRT comparison, + manifest.json). Needs tensorrt and an NVIDIA GPU (checked first).

    Also continuous batching's engines (`build_batch_engines`: target_batch, drafter_batch, lm_head for 1..max_batch
    sequences a call), from the export's "ort" flavor graphs made plain-op; never built on a GPU yet (see
    engines/tensorrt_batch.py)."""
    import torch

    from dflash_export.models.checkpoint import load_drafter

    decoding = dataclasses.asdict(recipe.decoding)
    runs = tensorrt_decoding(decoding)  # the chain, with a note for what the recipe asks beyond it
    drafter = load_drafter(recipe.drafter_path, torch.float32)
    refuse_masked_drafter(drafter.config, recipe.drafter_path)
    refuse_hybrid_target(recipe)
    trt = plugins.require_tensorrt()
    precision = resolve_precision(trt, recipe.dtype)  # refuses what this TensorRT cannot build before any export
    plugins.register_plugins()
    implementation = implementation or default_implementation(trt)
    if recipe.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise DFlashError("this GPU has no bfloat16 support", path=recipe.path, field="dtype")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, what="the engine") as tmp:
        res = export_recipe(recipe, tmp / "onnx", ort_flavor=True)
        serving = write_serving_files(recipe, drafter, tmp)
        facts = build_tensorrt_engines(tmp / "onnx", tmp, recipe, implementation=implementation)
        dspec = drafter.spec(recipe.block_size)
        facts.update(build_batch_engines(tmp / "onnx", tmp, dspec.block_size, recipe.max_seq_len, recipe.dtype,
                                         max_batch))
        write_manifest(tmp, {
            "backend": BACKEND, "recipe": recipe.name,
            "block_size": dspec.block_size, "mask_token_id": dspec.mask_token_id,
            "target_layer_ids": list(dspec.target_layer_ids), "max_seq_len": recipe.max_seq_len,
            "dtypes": {"precision": recipe.dtype, "graph": precision.graph_dtype},
            "engines": facts, "plugins": {"namespace": PLUGIN_NAMESPACE, "version": PLUGIN_VERSION,
                                          "ops": list(PLUGINS), "requested": implementation,
                                          "implementation": plugin_implementations(facts)},
            "export": res.metadata, "tensorrt": trt.__version__, **serving,
            "shared_tensors": embedding_layout(tmp / "onnx"),
            "gpu": torch.cuda.get_device_name(0),
            "decoding": decoding, "tensorrt_decoding": runs,  # the recipe's options; what the engines run of them
        })
    return out_dir


def write_serving_files(recipe, drafter, dst: Path) -> dict[str, Any]:
    """What running an engine needs besides the engines: the target's tokenizer files (or the tiny pairs'
    codec.json) copied into `dst`; returns the manifest's stop_token_ids and vocab_size (read from the target's
    config, without loading its weights)."""
    from types import SimpleNamespace

    from dflash_export.models.target import read_target_config, resolve_target_dir

    cfg, _ = read_target_config(recipe.target_path)
    target = SimpleNamespace(model_dir=resolve_target_dir(recipe.target_path), vocab_size=int(cfg["vocab_size"]))
    copy_tokenizer(target, drafter, Path(dst))
    return {"stop_token_ids": [int(x) for x in cfg["stop_token_ids"]], "vocab_size": int(cfg["vocab_size"])}
