"""Continuous batching on the TensorRT backend: the batch graphs compiled to TensorRT engines, driven by the same
bookkeeping as ONNX Runtime's batched engine (engines/ort_batch.py `BatchedEngine`).

What is built (`build --backend tensorrt`, tensorrt_build.build_batch_engines): the export's "ort" flavor batch graphs
-- target_batch (attention in plain ops over the K/V buffer, `past_bias`, new K/V rows out), the drafter with
`key_bias`, the LM head -- hold ONNX Runtime's fused normalizations (SimplifiedLayerNormalization,
com.microsoft SkipSimplifiedLayerNormalization) and the drafter's dflash BiasedKVInjectedBlockAttention function, none
of which TensorRT's parser or plugins know. `plain_op_graph` rewrites the norms as the standard ops of the portable
flavor's RMSNorm and inlines the function, and refuses any node left outside the standard ONNX domain; the plain
copies (onnx/*_trt.onnx, weights shared by file with the other graphs) are compiled with profiles whose batch axis runs
1..max_batch (graph_engine.batch_profiles) and recorded in the manifest (engines.<file>.profiles / max_batch, the
embedding's place in shared_tensors).

What runs: `TrtBatchGraphs` executes the three engines through the TensorRTRunner's context, stream and lock;
`BatchedTensorRTEngine` is `BatchedEngine` over it (every target call, prefills included, runs target_batch). The
batch's K/V (target and drafter context) live on the device (`DeviceKV`: torch tensors [slots, KVH, capacity, D],
grown, moved and written there): target_batch reads its slot range by address, the new rows are copied into the
buffers on the device, the drafter's past context is gathered there. A step copies only its small inputs
(embeddings, positions, biases, context features) to the device and its hidden rows / logits back.

What is tested, and how: on CPU only, against the EMULATION of the TensorRT API (tests/tensorrt_emulation.py: each
engine's ONNX graph run by ONNX Runtime behind TensorRT's engine / context calls, shapes outside the active profile
refused): greedy tokens through `BatchingRuntime` equal the PyTorch reference and the ONNX Runtime batched engine,
B > max_batch is refused, a directory built without the batch engines fails with one DFlashError
(tests/test_tensorrt_batch.py). What cannot be checked without a GPU: that TensorRT's parser takes the plain batch
graphs and builds them under these profiles (-inf biases, empty past_ctx, the Range / Where of the causal bias),
the device-side K/V work under a real CUDA stream (the emulation's torch device is the CPU, its stream a no-op), and
speed.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from dflash_export.engines.graph_engine import (
    BATCH,
    BATCH_PREFILL,
    BATCH_STEP,
    DRAFTER_BATCH,
    LM_HEAD,
    TARGET_BATCH,
)
from dflash_export.engines.ort_batch import BatchedEngine, BatchGraphs, HostKV
from dflash_export.errors import DFlashError
from dflash_export.export.builder import FP32_ISLAND
from dflash_export.files import native_path

# graph -> (the export's "ort" flavor graph, its plain-op copy TensorRT parses, the engine file)
BATCH_FILES = {
    TARGET_BATCH: ("target_batch_ort.onnx", "target_batch_trt.onnx", "target_batch.engine"),
    DRAFTER_BATCH: ("drafter_ort.onnx", "drafter_batch_trt.onnx", "drafter_batch.engine"),
    LM_HEAD: ("lm_head_ort.onnx", "lm_head_trt.onnx", "lm_head.engine"),
}
BATCH_PROFILE_NAMES = {TARGET_BATCH: (BATCH_PREFILL, BATCH_STEP), DRAFTER_BATCH: (BATCH,), LM_HEAD: (BATCH,)}
DEFAULT_MAX_BATCH = 8
EMBED = "shared.embed_tokens"
_REBUILD = "rebuild the engine with `build --backend tensorrt` (this engine predates continuous batching on TensorRT)"


# ----------------------------------------------------------------------------------------------------------------------
# Plain-op copies of the batch graphs (no tensorrt needed)

def plain_op_graph(src: Path, dst: Path) -> dict[str, int]:
    """Write `dst` (same directory as `src`: the external weights stay shared): `src` with ONNX Runtime's fused
    RMSNorms as standard ops and every local function inlined. Returns {rewritten op: count}. Raises DFlashError
    naming `src` and the op for any node left outside the standard ONNX domain (TensorRT could not parse it)."""
    import onnx
    import onnx.inliner
    from onnx import TensorProto, helper

    from dflash_export.export.moe import moe_nodes_as_plain_ops

    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise DFlashError("exported batch graph not found (export with the ort flavor)", path=src)
    if src.parent.resolve() != dst.parent.resolve():
        raise DFlashError("the plain-op copy must sit next to its source (they share the external weights)", path=dst)
    model = onnx.load(str(src), load_external_data=False)
    inlined = len(model.functions)
    if inlined:
        model = onnx.inliner.inline_local_functions(model)
    moe = moe_nodes_as_plain_ops(model)  # the sparse experts' com.microsoft.MoE as the dense form in standard ops
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    consumed = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    counts: collections.Counter[str] = collections.Counter()
    if moe:
        counts["MoE"] = moe
    fresh = (f"plain_rms_{i}" for i in range(1 << 30))
    nodes = []

    def rms(x: str, scale: str, eps: float, out: str) -> None:
        # the portable flavor's RMSNorm (export/builder.py): x * 1/sqrt(mean(x^2, -1) + eps) * scale, its statistics
        # named as the builder's float32 island (kept float32 in a half-precision build)
        p = next(fresh)

        def add(op, inputs, output, **attrs):
            nodes.append(helper.make_node(op, inputs, [output], name=FP32_ISLAND + output, **attrs))

        add("Mul", [x, x], p + "_sq")
        if opset >= 18:
            add("Constant", [], p + "_axes", value=helper.make_tensor(p + "_axes", TensorProto.INT64, [1], [-1]))
            add("ReduceMean", [p + "_sq", p + "_axes"], p + "_ms", keepdims=1)
        else:
            add("ReduceMean", [p + "_sq"], p + "_ms", axes=[-1], keepdims=1)
        add("Constant", [], p + "_eps", value=helper.make_tensor(p + "_eps", TensorProto.FLOAT, [], [eps]))
        add("Add", [p + "_ms", p + "_eps"], p + "_var")
        add("Sqrt", [p + "_var"], p + "_std")
        add("Reciprocal", [p + "_std"], p + "_inv")
        add("Mul", [x, p + "_inv"], p + "_xn")
        nodes.append(helper.make_node("Mul", [p + "_xn", scale], [out], name=p + "_scaled"))

    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        eps = float(attrs.get("epsilon", 1e-5))
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "com.microsoft"):
            if int(attrs.get("axis", -1)) != -1:
                raise DFlashError(f"node {node.name!r}: SimplifiedLayerNormalization over axis {attrs['axis']}, only "
                                  "the last axis has a plain-op form here", path=src, field=node.op_type)
            _unused_outputs(node, 1, consumed, src)
            rms(node.input[0], node.input[1], eps, node.output[0])
        elif node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == "com.microsoft":
            _unused_outputs(node, 1, consumed, src, keep=(3,))
            total = node.output[3] if len(node.output) > 3 and node.output[3] else next(fresh) + "_sum"
            if len(node.input) > 3 and node.input[3]:  # the optional bias joins the sum
                nodes.append(helper.make_node("Add", [node.input[0], node.input[1]], [total + "_nobias"]))
                nodes.append(helper.make_node("Add", [total + "_nobias", node.input[3]], [total]))
            else:
                nodes.append(helper.make_node("Add", [node.input[0], node.input[1]], [total]))
            rms(total, node.input[2], eps, node.output[0])
        else:
            nodes.append(node)
            continue
        counts[node.op_type] += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {n.domain for n in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    for node in model.graph.node:
        if not onnx.defs.has(node.op_type, node.domain or ""):
            raise DFlashError(f"node {node.name!r} ({node.domain or 'ai.onnx'}::{node.op_type}) is not a standard ONNX "
                              "op: TensorRT's parser has no importer for it", path=src, field=node.op_type)
    meta = {p.key: p.value for p in model.metadata_props}
    meta.update({"dflash.graph": dst.name, "dflash.flavor": "trt_batch", "dflash.plain_of": src.name})
    onnx.helper.set_model_props(model, meta)
    onnx.save_model(model, str(dst))
    with native_path(dst) as name:
        onnx.checker.check_model(name)  # by path: the external weights resolve next to it
    if inlined:
        counts["inlined_functions"] = inlined
    return dict(counts)


def _unused_outputs(node, first: int, consumed: set[str], src: Path, keep: tuple[int, ...] = ()) -> None:
    """The node's outputs from `first` on (but `keep`) must be unread: the plain form does not compute them."""
    for i, name in enumerate(node.output):
        if i >= first and i not in keep and name and name in consumed:
            raise DFlashError(f"node {node.name!r}: output {i} ({name}) of {node.op_type} is read, the plain-op form "
                              "does not compute it", path=src, field=node.op_type)


def write_plain_batch_graphs(onnx_dir: Path) -> dict[str, dict[str, int]]:
    """The plain-op copy of each batch graph in `onnx_dir` (an export with the ort flavor). Returns, per graph, the
    ops rewritten."""
    onnx_dir = Path(onnx_dir)
    return {graph: plain_op_graph(onnx_dir / src, onnx_dir / plain) for graph, (src, plain, _) in BATCH_FILES.items()}


def batch_engine_entry(graph: str, block_size: int, max_seq_len: int, max_batch: int) -> dict:
    """The manifest's record of one batch engine: its profile names (by index, as built), the batch bound, the ONNX
    graph it came from (relative to the engine directory)."""
    from dflash_export.engines.graph_engine import batch_profiles

    return {"profiles": [p.name for p in batch_profiles(graph, block_size, max_seq_len, max_batch)],
            "max_batch": max_batch, "onnx": f"onnx/{BATCH_FILES[graph][1]}"}


def embedding_layout(onnx_dir: Path) -> dict[str, dict]:
    """The manifest's shared_tensors entry of the embedding table inside onnx/shared_weights.bin (from the portable
    target graph's external-data record): the batched engine reads embedding rows from it on the host."""
    from dflash_export.engines.ort_build import _shared_layout

    layout = _shared_layout(Path(onnx_dir) / "target_verify.onnx")
    if EMBED not in layout:
        raise DFlashError(f"no {EMBED} in the shared weights", path=Path(onnx_dir) / "target_verify.onnx",
                          field="shared_tensors")
    return {EMBED: layout[EMBED]}


# ----------------------------------------------------------------------------------------------------------------------
# Runtime

def check_batch_manifest(manifest) -> int:
    """The batch bound a TensorRT engine directory's batch engines were built for; one DFlashError naming the manifest
    and the field when they were not built (or not recorded)."""
    bounds = []
    for graph, (_, _, fname) in BATCH_FILES.items():
        entry = manifest.engines.get(fname)
        if not isinstance(entry, dict):
            raise DFlashError(f"no batched engine {fname}: {_REBUILD}", path=manifest.path, field=f"engines.{fname}")
        names = entry.get("profiles")
        if not isinstance(names, list) or not set(BATCH_PROFILE_NAMES[graph]) <= set(names):
            raise DFlashError(f"{fname} profiles {names} lack {list(BATCH_PROFILE_NAMES[graph])}: {_REBUILD}",
                              path=manifest.path, field=f"engines.{fname}.profiles")
        bound = entry.get("max_batch")
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
            raise DFlashError(f"{fname} records no batch bound ({bound!r}): {_REBUILD}", path=manifest.path,
                              field=f"engines.{fname}.max_batch")
        bounds.append(bound)
    if EMBED not in manifest.shared_tensors:
        raise DFlashError(f"no {EMBED} (the batched engine reads embedding rows from it): {_REBUILD}",
                          path=manifest.path, field="shared_tensors")
    return min(bounds)


class DeviceKV(HostKV):
    """The batch's K/V buffers as torch tensors on the engines' device (`HostKV`'s operations, each one device work
    queued on the runner's stream): target_batch reads a slot range of them by address, its new rows and the drafter's
    new context rows are copied into them on the device. Nothing of them crosses to the host."""

    def __init__(self, torch, device, stream, dtypes: dict):
        self.torch, self.device, self.stream = torch, device, stream
        self.dtypes = dtypes  # graph -> the engine's K/V dtype

    def zeros(self, shape, graph):
        with self.torch.cuda.stream(self.stream):
            return self.torch.zeros(shape, dtype=self.dtypes[graph], device=self.device)

    def nbytes(self, buf):
        return buf.numel() * buf.element_size()

    def copy_prefix(self, new, old, m, old_cap):
        with self.torch.cuda.stream(self.stream):
            new[:m, :, :old_cap].copy_(old[:m])

    def slot_range(self, bufs, a, z):
        return [buf[a:z] for buf in bufs]  # a slot range of a dense buffer is dense: bound by address as it is

    def write_rows(self, bufs, news, rows):
        # one gather + one scatter per buffer, whatever the number of sequences: every (slot, row) pair is distinct
        torch = self.torch
        idx = np.array([(i, slot, at + k, src + k) for i, slot, at, src, n in rows for k in range(n)], np.int64)
        if not len(idx):
            return
        with torch.cuda.stream(self.stream):
            seq, slot, at, src = torch.as_tensor(idx.T.copy()).to(self.device)
            for buf, new in zip(bufs, news):
                buf[slot, :, at] = new[seq, :, src].to(buf.dtype)

    def move(self, bufs, dst, src, n):
        with self.torch.cuda.stream(self.stream):
            for buf in bufs:
                buf[dst, :, :n].copy_(buf[src, :, :n])

    def move_rows(self, bufs, slot, at, nodes):
        torch = self.torch
        with torch.cuda.stream(self.stream):
            idx = torch.as_tensor(np.asarray(nodes, np.int64) + at).to(self.device)
            for buf in bufs:
                buf[slot, :, at: at + len(nodes)] = buf[slot, :, :].index_select(1, idx)

    def gather(self, bufs, slots, t):
        torch = self.torch
        with torch.cuda.stream(self.stream):
            idx = torch.as_tensor(slots, dtype=torch.int64).to(self.device)
            return [buf[:, :, :t].index_select(0, idx) for buf in bufs]


class TrtBatchGraphs(BatchGraphs):
    """`BatchGraphs` over the three batch engines of a TensorRT engine directory, run through `runner`'s (a
    TensorRTRunner) runtime, device, stream and lock. The K/V are the batch's device buffers (`kv_store`: `DeviceKV`),
    bound by address: past K/V in, new K/V rows out stay on the device. The other inputs are host arrays copied to
    the device per call; the other outputs come back as host arrays once the stream is synchronized."""

    def __init__(self, runner, engine_dir, manifest, info, codec):
        from dflash_export.engines.onnxruntime import draft_logit_scaling, embedding_rows
        from dflash_export.engines.tensorrt_runtime import _TrtGraph

        self.max_batch = check_batch_manifest(manifest)
        self.manifest_path = manifest.path
        self.runner, self.info, self.codec = runner, info, codec
        engine_dir = Path(engine_dir)
        torch = runner.torch
        self.graphs = {}
        for graph, (_, _, fname) in BATCH_FILES.items():
            with torch.cuda.device(runner.device):
                self.graphs[graph] = _TrtGraph(runner.trt, torch, runner._runtime, engine_dir / fname,
                                               list(manifest.engines[fname]["profiles"]))
        (self.t_layers, self.t_kv_heads, self.t_head_dim) = _kv_geometry(self.graphs[TARGET_BATCH], "key_")
        (self.d_layers, self.d_kv_heads, self.d_head_dim) = _kv_geometry(self.graphs[DRAFTER_BATCH], "ctx_key_")
        self.drafter_batches = "key_bias" in self.graphs[DRAFTER_BATCH].inputs
        self.target_trees = "block_bias" in self.graphs[TARGET_BATCH].inputs
        if not self.drafter_batches:
            raise DFlashError("the drafter batch engine takes no key_bias (masked drafters draft one sequence a call, "
                              "which the TensorRT backend does not build)", path=engine_dir / BATCH_FILES[
                                  DRAFTER_BATCH][2], field="key_bias")
        self.has_selector = False  # DFlash 2 drafters are refused by the TensorRT build
        self._embed = embedding_rows(engine_dir / "onnx", manifest)
        if not 0 <= info.mask_token_id < self._embed.shape[0]:
            raise DFlashError(f"mask token {info.mask_token_id} outside the embedding", path=manifest.path,
                              field="mask_token_id")
        self.mask_row = self._embed.rows([info.mask_token_id])[0]
        self._multiplier, self._softcap = draft_logit_scaling(*_graph_metadata(engine_dir, DRAFTER_BATCH))

    # BatchGraphs ---------------------------------------------------------------------------------------------------

    def kv_store(self) -> DeviceKV:
        r = self.runner
        return DeviceKV(r.torch, r.device, r.stream, {"target": self.graphs[TARGET_BATCH].kv_layout["key_0"][2],
                                                      "drafter": self.graphs[DRAFTER_BATCH].kv_layout["ctx_key_0"][2]})

    def embed_rows(self, ids) -> np.ndarray:
        return self._embed.rows(ids)

    def target_batch(self, feeds, past):
        g = self.graphs[TARGET_BATCH]
        feeds = dict(feeds)
        for i in range(self.t_layers):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = past[2 * i], past[2 * i + 1]
        profile = BATCH_STEP if feeds["position_ids"].shape[1] <= self.info.block_size else BATCH_PREFILL
        names = ["hidden", "ctx"] + [f"new_{k}_{i}" for i in range(self.t_layers) for k in ("key", "value")]
        return self._run(g, profile, feeds, names, on_device=set(names[2:]))

    def drafter(self, names, feeds):
        return self._run(self.graphs[DRAFTER_BATCH], BATCH, feeds, names,
                         on_device={n for n in names if n.startswith("present_ctx_")})

    def lm_head(self, hidden):
        return self._run(self.graphs[LM_HEAD], BATCH, {"hidden": hidden}, ["logits"])[0][0]

    def draft_head(self, hidden, greedy=False):
        return self.lm_head(hidden)  # the TensorRT build has no draft vocabulary: the LM head drafts

    def drafts_from_logits(self, seq, logits, selector_hidden, anchor, sp, uniforms):
        from dflash_export.engines.onnxruntime import drafts_from_logits

        return drafts_from_logits(seq, logits, selector_hidden, anchor, sp, uniforms, self._multiplier,
                                  self._softcap, None, self.info.vocab_size)

    # Execution -----------------------------------------------------------------------------------------------------

    def _upload(self, name: str, value, dtype):
        """A host input on the device (the only host -> device copies of a call; the tests watch them)."""
        return self.runner.torch.as_tensor(np.ascontiguousarray(value)).to(self.runner.device, dtype)

    def _run(self, g, profile: str, feeds: dict, fetch: list[str], on_device: set[str] = frozenset()) -> list:
        """Run engine `g` under `profile` on `feeds` (host arrays, copied to the device, or tensors already on it, bound
        as they are); the outputs `fetch`, in order: host copies, but those named in `on_device`, left there."""
        r = self.runner
        torch = r.torch
        with r._lock:  # one context per engine, shared with nothing else, but the stream is the runner's
            ctx, handle = g.context, r.stream.cuda_stream
            keep = []  # device copies of the inputs must outlive the enqueue
            with torch.cuda.stream(r.stream):
                g.use_profile(profile, handle)
                for name in g.inputs:
                    if name not in feeds:
                        raise DFlashError(f"no feed for engine input {name}", path=g.path, field=name)
                    if name in g.host_inputs:
                        r._bind_host_input(g, name, np.asarray(feeds[name]))
                        continue
                    value = feeds[name]
                    if isinstance(value, torch.Tensor):  # the batch's K/V, already on the device: bound as it is
                        tensor = value.to(r.device, g.dtypes[name]).contiguous()
                    else:
                        tensor = self._upload(name, value, g.dtypes[name])
                    keep.append(tensor)
                    r._bind_input(g, name, tensor, profile)
                r._infer_shapes(g)
                outputs = {}
                for name in g.outputs:
                    tensor = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=g.dtypes[name], device=r.device)
                    outputs[name] = tensor
                    r._bind(g, name, r._address(tensor))
                if not ctx.execute_async_v3(handle):
                    raise DFlashError("TensorRT execution failed (see the log above)", path=g.path)
                out = [outputs[name] if name in on_device else outputs[name].to("cpu", non_blocking=True)
                       for name in fetch]
            r.stream.synchronize()
            del keep
            return [t if name in on_device else t.numpy() for name, t in zip(fetch, out)]

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs = {}
        self._embed.close()


def _kv_geometry(g, prefix: str) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of an engine's K/V inputs past_<prefix>i [B, KVH, P, D]."""
    keys = [x for x in g.kv_layout if x.startswith(prefix) and x[len(prefix):].isdigit()]
    if not keys:
        raise DFlashError(f"engine has no past_{prefix}* inputs", path=g.path)
    kvh, d, _ = g.kv_layout[keys[0]]
    return len(keys), kvh, d


def _graph_metadata(engine_dir: Path, graph: str) -> tuple[dict[str, str], Path]:
    """(metadata, path) of a batch engine's ONNX graph in the engine directory's onnx/."""
    import onnx

    path = engine_dir / "onnx" / BATCH_FILES[graph][1]
    if not path.is_file():
        raise DFlashError(f"the batch engine's ONNX graph is missing: {_REBUILD}", path=path)
    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}, path


def batch_graphs(engine) -> TrtBatchGraphs:
    """A `TensorRTEngine`'s batch engines (`TrtBatchGraphs`), loaded on first use and kept on the engine (closed with
    it): a single-request engine never holds them. DFlashError naming the manifest field for a directory built
    without them. (Here rather than a method of the engine: this module sits above tensorrt_runtime.)"""
    if engine._batch is None:
        engine._batch = TrtBatchGraphs(engine.runner, engine.engine_dir, engine.manifest, engine.info, engine.codec)
    return engine._batch


class BatchedTensorRTEngine(BatchedEngine):
    """`BatchedEngine` over a `TensorRTEngine`'s batch engines (loaded when the batch is made, by `batch_graphs`).
    `max_batch` may not pass the bound the engines' profiles were built for."""

    def __init__(self, engine, max_batch: int = DEFAULT_MAX_BATCH):
        graphs = batch_graphs(engine)
        if max_batch > graphs.max_batch:
            raise DFlashError(f"{max_batch} sequences per call exceed the batch engines' profiles (built for at most "
                              f"{graphs.max_batch}; rebuild with a larger max_batch)", path=graphs.manifest_path,
                              field="max_batch")
        super().__init__(graphs, max_batch)
        self.engine = engine
