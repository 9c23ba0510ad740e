"""An EMULATION of the slice of TensorRT's Python API that TensorRTRunner calls (not TensorRT), shared by the tests
that run the TensorRT runner on CPU (test_tensorrt_engine, test_engine_contract)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

# ----------------------------------------------------------------------------------------------------------------------
# TensorRTRunner against an EMULATED TensorRT: the runner's own code (profile switching, shapes, addresses, host
# shape tensors, the device K/V ping-pong and its repacking on truncation, output reads) executed on the CPU. The
# emulation follows the TensorRT 10 Python API the runner calls and runs each engine's ONNX graph in ONNX Runtime,
# reading inputs from and writing outputs to the raw addresses it is given; it refuses shapes outside the active
# profile as TensorRT does. Its limits, by construction: fp32 and int64 tensors only (no fp16 / bf16 engine), every
# call synchronous (no stream ordering, so a missing synchronize cannot show), shape-tensor scalars read from host
# memory as given, CPU addresses instead of device pointers, and no plugin (the graphs' dflash ops run as their
# inlined ONNX functions). It cannot vouch for TensorRT's or CUDA's own behaviour.


class _EmulatedTrt:
    """An emulation of the slice of the `tensorrt` module TensorRTRunner touches (not TensorRT)."""

    float32, float16, bfloat16, int64, int32, int8, bool = ("f32", "f16", "bf16", "i64", "i32", "i8", "b")

    class TensorIOMode:
        INPUT, OUTPUT = "input", "output"

    class TensorLocation:
        DEVICE, HOST = "device", "host"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data: bytes):
            spec = json.loads(data)
            return _EmulatedEngine(spec["onnx"], spec["graph"], spec["block_size"], spec["max_seq_len"],
                                   spec.get("max_batch", 1))


def _array_at(address: int, dtype, shape) -> np.ndarray:
    """A numpy view of `shape` elements of `dtype` at a raw (CPU) address."""
    import ctypes

    count = int(np.prod(shape))
    if count == 0:
        return np.zeros(shape, dtype)
    buf = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(address)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


class _EmulatedEngine:
    def __init__(self, onnx_path, graph, block_size, max_seq_len, max_batch=1):
        import onnx
        import onnxruntime as ort

        from dflash_export.engines import tensorrt as trt_backend

        self.session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        model = onnx.load(onnx_path, load_external_data=False)
        vocab = trt_backend.vocab_size_of(model) if graph in ("target_verify", "drafter") else 0
        self.profiles = [trt_backend.profile_shapes(model, p) for p in trt_backend.graph_profiles(
            graph, block_size, max_seq_len, vocab, max_batch)]
        self.io = [(i, _EmulatedTrt.TensorIOMode.INPUT) for i in self.session.get_inputs()] + [
            (o, _EmulatedTrt.TensorIOMode.OUTPUT) for o in self.session.get_outputs()]
        self.by_name = {v.name: (v, mode) for v, mode in self.io}
        self.num_io_tensors = len(self.io)
        self.num_optimization_profiles = len(self.profiles)

    def get_tensor_name(self, i):
        return self.io[i][0].name

    def get_tensor_mode(self, name):
        return self.by_name[name][1]

    def get_tensor_dtype(self, name):
        return {"tensor(float)": _EmulatedTrt.float32, "tensor(int64)": _EmulatedTrt.int64}[self.by_name[name][0].type]

    def get_tensor_shape(self, name):
        return tuple(d if isinstance(d, int) else -1 for d in self.by_name[name][0].shape)

    def get_tensor_location(self, name):
        # scalar shape-tensor inputs live on the host, as TensorRT places them
        location = _EmulatedTrt.TensorLocation
        return location.HOST if self.by_name[name][0].shape == [] else location.DEVICE

    def create_execution_context(self):
        return _EmulatedContext(self)


class _EmulatedContext:
    NP = {_EmulatedTrt.float32: np.float32, _EmulatedTrt.int64: np.int64}

    def __init__(self, engine: _EmulatedEngine):
        self.engine, self.profile, self.shapes, self.addresses, self.results = engine, 0, {}, {}, None
        self.profile_switches = 0

    def set_optimization_profile_async(self, index, stream):
        self.profile, self.profile_switches = index, self.profile_switches + 1
        self.shapes = {}  # TensorRT forgets input shapes on a profile switch
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.profiles[self.profile][name]
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        if not address:  # TensorRT refuses null addresses
            return False
        self.addresses[name] = address
        return True

    def _feeds(self):
        feeds = {}
        for v in self.engine.session.get_inputs():
            dtype = self.NP[self.engine.get_tensor_dtype(v.name)]
            shape = self.shapes.get(v.name, tuple(d for d in self.engine.get_tensor_shape(v.name)))
            feeds[v.name] = _array_at(self.addresses[v.name], dtype, shape).copy()
            if v.shape == []:
                lo, _, hi = self.engine.profiles[self.profile][v.name]
                assert lo[0] <= int(feeds[v.name]) <= hi[0], (v.name, int(feeds[v.name]))
        return feeds

    def infer_shapes(self):
        missing = [v.name for v in self.engine.session.get_inputs()
                   if (-1 in self.engine.get_tensor_shape(v.name) and v.name not in self.shapes)
                   or v.name not in self.addresses]
        if not missing:
            names = [o.name for o in self.engine.session.get_outputs()]
            self.results = dict(zip(names, self.engine.session.run(names, self._feeds())))
        return missing

    def get_tensor_shape(self, name):
        return self.results[name].shape if name in self.results else self.shapes[name]

    def execute_async_v3(self, stream):
        names = [o.name for o in self.engine.session.get_outputs()]
        results = dict(zip(names, self.engine.session.run(names, self._feeds())))  # inputs as they are now
        for name, value in results.items():
            assert value.shape == self.results[name].shape, name
            if value.size:
                _array_at(self.addresses[name], value.dtype, value.shape)[...] = value
        return True


def emulate_tensorrt(monkeypatch):
    """Replace TensorRT by the emulation and CUDA streams by no-ops (through `monkeypatch`, a pytest MonkeyPatch), so
    TensorRTRunner runs on CPU tensors. Returns the backend module."""
    import contextlib

    import torch

    from dflash_export.engines import tensorrt as trt_backend
    from dflash_export.engines import tensorrt_plugins as trt_plugins

    class Stream:
        cuda_stream = 0

        def __init__(self, *args, **kwargs):
            pass

        def synchronize(self):
            pass

    # patched where they are defined: the runtime (tensorrt_runtime) calls them through tensorrt_plugins
    monkeypatch.setattr(trt_plugins, "require_tensorrt", lambda gpu=True: _EmulatedTrt)
    monkeypatch.setattr(trt_plugins, "register_plugins", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return trt_backend


def emulated_engine_dir(root, recipe, max_batch: int | None = None):
    """A TensorRT engine directory as build_tensorrt lays it out, its .engine files naming the ONNX graph to emulate.

    `max_batch`: also continuous batching's engines, written by the build's own `build_batch_engines` (the plain-op
    graphs, profiles and manifest facts) with only the TensorRT compilation replaced by an engine file for the
    emulation; None: a directory as built before the batch engines existed."""
    from unittest import mock

    from dflash_export.engines import tensorrt as trt_backend
    from dflash_export.engines import tensorrt_build
    from dflash_export.engines.manifest import write_manifest
    from dflash_export.export import export_recipe
    from dflash_export.models.checkpoint import load_drafter

    drafter = load_drafter(recipe.drafter_path)
    out = root / "tensorrt"
    out.mkdir()
    export_recipe(recipe, out / "onnx", ort_flavor=max_batch is not None)
    bs = recipe.block_size or drafter.block_size
    engines = {}
    for graph, fname in (("target_verify", trt_backend.TARGET_ENGINE), ("drafter", trt_backend.DRAFTER_ENGINE)):
        (out / fname).write_text(json.dumps({"onnx": str(out / "onnx" / f"{graph}.onnx"), "graph": graph,
                                             "block_size": bs, "max_seq_len": recipe.max_seq_len}))
        engines[fname] = {"profiles": [p.name for p in trt_backend.graph_profiles(graph, bs, recipe.max_seq_len, 2)]}
    extra = {}
    if max_batch is not None:
        graph_of = {plain: graph for graph, (_, plain, _) in tensorrt_build.BATCH_FILES.items()}

        def compile_for_emulation(onnx_path, engine_path, profiles, dtype):
            (engine_path).write_text(json.dumps({"onnx": str(onnx_path), "graph": graph_of[onnx_path.name],
                                                 "block_size": bs, "max_seq_len": recipe.max_seq_len,
                                                 "max_batch": max_batch}))
            return {"profiles": [p.name for p in profiles], "strongly_typed": dtype == "float32"}

        with mock.patch.object(tensorrt_build, "build_engine_file", compile_for_emulation):
            engines.update(tensorrt_build.build_batch_engines(out / "onnx", out, bs, recipe.max_seq_len,
                                                              recipe.dtype, max_batch))
        extra["shared_tensors"] = tensorrt_build.embedding_layout(out / "onnx")
    c = drafter.config
    write_manifest(out, {"backend": "tensorrt", "recipe": recipe.name, "block_size": bs,
                         "mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                         "max_seq_len": recipe.max_seq_len, "engines": engines,
                         "decoding": dataclasses.asdict(recipe.decoding),
                         **trt_backend.write_serving_files(recipe, drafter, out), **extra})
    return out
