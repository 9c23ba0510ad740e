"""Running the TensorRT engines: the DFlash runtime drives them through graph_engine.GraphEngine, as ONNX Runtime's
CPU twin. `TensorRTRunner` holds one execution context per engine and the K/V in preallocated device buffers;
`TensorRTEngine` is what the backend registry opens. Needs tensorrt, torch and an NVIDIA GPU, imported lazily.
"""

import threading
from collections.abc import Mapping
from pathlib import Path

from dflash_export.decoding.options import resolve_options
from dflash_export.engines import tensorrt_plugins as plugins
from dflash_export.engines.base import EngineInfo, load_codec
from dflash_export.engines.graph_engine import (
    DECODE,
    FIRST_BLOCK,
    PREFILL,
    STEP,
    VERIFY,
    GraphEngine,
    GraphRunner,
    KVCache,
)
from dflash_export.engines.manifest import Manifest
from dflash_export.engines.tensorrt_plugins import BACKEND, DRAFTER_ENGINE, TARGET_ENGINE
from dflash_export.errors import DFlashError


def tensorrt_engine_info(manifest: Manifest) -> EngineInfo:
    """The EngineInfo of a TensorRT engine directory, from its manifest (no tensorrt needed)."""
    if manifest.backend != BACKEND:
        raise DFlashError(f"not a tensorrt engine ({manifest.backend!r})", path=manifest.path, field="backend")
    return manifest.engine_info("rebuild the engine: older builds did not record it")


# engine file -> (graph, the profiles the engine logic selects by name)
RUN_ENGINES = {TARGET_ENGINE: ("target_verify", (PREFILL, VERIFY, DECODE)),
               DRAFTER_ENGINE: ("drafter", (FIRST_BLOCK, STEP))}


def engine_profiles(manifest: Manifest) -> dict[str, list[str]]:
    """{engine file: its optimization profile names, by index} of the two engines a TensorRT engine directory runs
    (no tensorrt needed: what `deploy` checks and the runner opens). One DFlashError naming the manifest and the field
    when an engine is not among the files the manifest lists or lacks a profile the engine logic selects."""
    out = {}
    for fname, (_, needed) in RUN_ENGINES.items():
        names = (manifest.engines.get(fname) or {}).get("profiles") or []
        if not set(needed) <= set(names):
            raise DFlashError(f"{fname} profiles {names} lack {sorted(set(needed) - set(names))}",
                              path=manifest.path, field="engines")
        if fname not in manifest.files:
            raise DFlashError(f"{fname} is not among the files the manifest lists", path=manifest.path,
                              field="files")
        out[fname] = list(names)
    return out


def tensorrt_decoding(recorded: Mapping | None) -> dict[str, str]:
    """What a TensorRT engine runs of its recipe's decoding options (the manifest's `decoding`, decoding/options.py).

    The engines verify fixed blocks of block_size through FusedVerify, with no draft-tree inputs (the portable target
    graph): a step proposes the drafter's chain ("chain"), and a sampled step draws the drafter's chain and accepts each
    draft with min(1, p/q) on the host ("chain" sampling: exact, the PyTorch reference's stream draw for draw). A
    recipe's tree or lookup proposer becomes the chain, said in "proposer_note", and its walk becomes chain sampling,
    said in "sampling_note", and its static n-gram index (which only trees and lookups read) is neither built nor
    used, said in "static_ngrams_note": the recipe stays buildable on both backends and the manifest says what runs.
    """
    options = resolve_options(dict(recorded or {}))
    plan = {"proposer": "chain", "sampling": "chain"}
    if options.proposer != "chain":
        plan["proposer_note"] = (f"the recipe's {options.proposer} needs draft trees or lookup branches; these "
                                 "engines verify fixed blocks of block_size with no draft-tree inputs, so steps "
                                 "propose the drafter's chain (build --backend onnxruntime runs it)")
    if options.static_ngrams:
        plan["static_ngrams_note"] = ("the recipe's static n-gram index feeds trees and lookups, which these engines "
                                      "do not run: none is built (build --backend onnxruntime builds and runs it)")
    if options.sampling == "walk":
        plan["sampling_note"] = ("sampled requests draw the drafter's chain and accept with min(1, p/q) (the "
                                 "recipe's walk needs host acceptance over any block length, which fixed blocks do "
                                 "not give)")
    return plan


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
            if n.startswith("past_") and len(self.engine.get_tensor_shape(n)) == 4:  # not a batch graph's past_bias
                _, kvh, _, d = tuple(self.engine.get_tensor_shape(n))
                self.kv_layout[n[len("past_"):]] = (int(kvh), int(d), self.dtypes[n])

    def use_profile(self, profile: str, stream_handle) -> None:
        """Switch the context to optimization profile `profile` (enqueued on the stream) unless it is active; one
        DFlashError naming the engine file for a profile it was not built with."""
        if profile not in self.profiles:
            raise DFlashError(f"engine has no optimization profile {profile!r} (has {', '.join(self.profiles)})",
                              path=self.path)
        if self.active != self.profiles[profile]:
            if not self.context.set_optimization_profile_async(self.profiles[profile], stream_handle):
                raise DFlashError(f"TensorRT refused profile {profile!r}", path=self.path)
            self.active = self.profiles[profile]

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
        trt = plugins.require_tensorrt()
        import torch

        # engines whose plugins fell back to the Python impl need them at deserialization
        plugins.register_plugins()
        self.trt, self.torch = trt, torch
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.max_seq_len = manifest.require("max_seq_len")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.graphs: dict[str, _TrtGraph] = {}
        for fname, names in engine_profiles(manifest).items():
            with torch.cuda.device(self.device):
                self.graphs[RUN_ENGINES[fname][0]] = _TrtGraph(trt, torch, self._runtime, Path(engine_dir) / fname,
                                                               names)
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

    def _bind_host_input(self, g: _TrtGraph, name: str, value) -> None:
        """A shape-tensor input (num_logits): copied into its persistent host buffer, which is what is bound."""
        host = g.host_inputs[name]
        host.copy_(self.torch.as_tensor(value).reshape(host.shape))
        self._bind(g, name, host.data_ptr())

    def _bind_input(self, g: _TrtGraph, name: str, tensor, profile: str) -> None:
        """A device input: its shape set (one error naming it when the active profile does not take it), its address
        bound."""
        if name in g.dynamic and not g.context.set_input_shape(name, tuple(tensor.shape)):
            raise DFlashError(f"shape {tuple(tensor.shape)} of {name} is outside profile {profile!r}", path=g.path,
                              field=name)
        self._bind(g, name, self._address(tensor))

    @staticmethod
    def _infer_shapes(g: _TrtGraph) -> None:
        missing = g.context.infer_shapes()
        if missing:
            raise DFlashError(f"TensorRT cannot infer output shapes: {', '.join(missing)} unset", path=g.path)

    def _run(self, graph, profile, feeds, fetch, cache):
        torch = self.torch
        g = self.graphs[graph]
        ctx, handle = g.context, self.stream.cuda_stream
        keep = []  # device copies of the inputs must outlive the enqueue
        with torch.cuda.stream(self.stream):
            g.use_profile(profile, handle)
            for name in g.inputs:
                if name.startswith("past_"):
                    tensor = cache.past(name[len("past_"):])
                elif name in g.host_inputs:
                    self._bind_host_input(g, name, feeds[name])
                    continue
                else:
                    tensor = torch.as_tensor(feeds[name]).to(self.device, g.dtypes[name]).contiguous()
                    keep.append(tensor)
                self._bind_input(g, name, tensor, profile)
            self._infer_shapes(g)
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
        # first: without TensorRT or a GPU the answer is the install line, not a manifest detail
        plugins.require_tensorrt()
        engine_dir = Path(engine_dir)
        info = tensorrt_engine_info(manifest)
        self.decoding = tensorrt_decoding(info.decoding)  # what it runs of the recipe's decoding
        super().__init__(TensorRTRunner(engine_dir, manifest, device), info, load_codec(engine_dir))
        self.engine_dir, self.manifest = engine_dir, manifest
        self._batch = None  # the batch engines, loaded on first use by engines/tensorrt_batch.py `batch_graphs`

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        super().close()
