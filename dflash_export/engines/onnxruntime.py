"""The ONNX Runtime engine: the embedded default backend (CPU). Its build step is `engines/ort_build.py`.

Serving imports numpy, onnxruntime and tokenizers only (no torch): `OrtEngine` runs the two graphs written by
`dflash_export.export`; `ort_build.build_onnxruntime` (which does import torch, to export) writes an engine directory.

Engine directory (graphs are the export's "ort" flavor, optimized by ORT at build time and saved):
  target.onnx (+ .data)     target decoder: embeddings in; final-normed hidden rows, ctx, K/V out. GroupQueryAttention
                            writes K/V in place into a preallocated buffer (past and present bound to the same memory)
  drafter.onnx (+ .data)    drafter: block embeddings + new context in; hidden rows of slots 1..bs-1 out
  lm_head.onnx              LM head, used by target and drafter: the head matrix prepacked once, in one session
  shared_weights.bin        embedding (+ untied LM head): the LM head session loads it; the engine reads embedding
                            rows from it on demand (pread), so the table itself never becomes resident
  tokenizer.json + tokenizer_config.json, or codec.json (tiny pairs); manifest.json

Why the embedding / LM head live this way: a Gemm over a shared user-supplied initializer cannot be prepacked, and
an unpacked 49152x576 Gemm costs ~1.6x more for 8-16 rows (measured), which is the verify step's whole margin; so
exactly one session owns the head matrix (prepacked, one copy), and no graph holds the embedding at all.

Acceptance runs on the host with `sampling.verify_block` (argmax + prefix match: microseconds) rather than through the
FusedVerify node: ORT runs every node of a graph on every call and its ArgMax is ~5x slower than numpy's, so an
in-graph verify would cost the LM-head session a millisecond per call. FusedVerify stays in target_verify.onnx for
the backends with a fused kernel (TensorRT plugin).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

from dflash_export.decoding.sampling import (
    probs_from_logits,
    sample_from,
    select_candidates,
    top_probability,
    verify_block,
)
from dflash_export.decoding.tree import DraftTree, greedy_accept
from dflash_export.engines.base import Engine, SamplingParams, Sequence, load_codec
from dflash_export.engines.greedy_head import greedy_draft_head, greedy_head_for
from dflash_export.engines.manifest import Manifest, rebuild_advice
from dflash_export.engines.numerics import PROBE_SEED, choose_row_floor, probe_rows
from dflash_export.engines.row_pad import ROW_INDEX
from dflash_export.environment import env_switch
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.files import MatrixRows, UnreadableArrays, dir_identity, native_path, read_npy
from dflash_export.models.config import DFlashSpec

TARGET = "target.onnx"
DRAFTER = "drafter.onnx"
HEAD = "lm_head.onnx"
DRAFT_HEAD = "draft_head.onnx"
# The target graph's bias input of its sliding layers of W tokens, window_bias_W (export/graph.py
# window_bias_input, not imported: serving imports nothing of the export).
WINDOW_BIAS = "window_bias_"
TARGET_BATCH = "target_batch.onnx"  # B sequences verifying blocks over their own pasts (engines/ort_batch.py)
SHARED = "shared_weights.bin"
SELECTOR_FILES = ("selector_predecessor.npy", "selector_successor.npy")  # DFlash 2's codebooks [V, R] float32
# 3: target_batch's attention places a block's keys at their slots in the buffer before attending (rows independent of
# how tokens were split into calls); 4: target_batch takes its rows packed (inputs_embeds [1, rows, H], grid_rows,
# cells; hidden / ctx out packed), so a call costs the rows its sequences verify. An engine of an older format is
# rebuilt, not reused (engines/build.py).
ENGINE_FORMAT = 4
# A hybrid target's prefill runs in chunks of this many rows: each call returns every row's conv input and state
# update, and its Scan's intermediates grow with the rows, so a chunk bounds that memory whatever the prompt's length.
HYBRID_PREFILL_ROWS = 64
# A hybrid target call's outputs per Gated DeltaNet layer i (export/linear_attention.py), each named f"{name}_{i}".
LINEAR_OUTPUTS = ("conv_window", "recurrent_last", "row_keys", "row_decays", "row_deltas")
# What each engine file must be: the exported graph's own name (its `dflash.graph` metadata). Graphs swapped between
# files then fail the load by name instead of as an ONNX Runtime input error at the first request.
GRAPH_ROLES = {TARGET: "target_verify_ort.onnx", DRAFTER: "drafter_ort.onnx", HEAD: "lm_head_ort.onnx",
               DRAFT_HEAD: "draft_head_ort.onnx", TARGET_BATCH: "target_batch_ort.onnx"}


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise MissingDependency("onnxruntime is not installed (pip install 'dflash-export[runtime]')") from None
    return onnxruntime


def check_ort_manifest(manifest: Manifest) -> None:
    """What an ONNX Runtime engine needs of its manifest beyond `validate_manifest`: its backend, this format and
    the graphs it loads among its files (`run` and `deploy` apply it through the registry before loading any weight;
    the engine applies it again)."""
    if manifest.backend != "onnxruntime":
        raise DFlashError(f"not an onnxruntime engine ({manifest.backend!r})", path=manifest.path, field="backend")
    if manifest.require("engine_format") != ENGINE_FORMAT:
        raise DFlashError(f"engine format {manifest.engine_format!r} is not {ENGINE_FORMAT}: rebuild the engine",
                          path=manifest.path, field="engine_format")
    draft_vocab = manifest.flags.draft_vocab
    for fname in (HEAD, DRAFTER, TARGET) + ((DRAFT_HEAD,) if draft_vocab else ()):
        if fname not in manifest.files:  # read_manifest has checked that every listed file is there
            advice = rebuild_advice(Path(manifest.path).parent, manifest)
            if fname == DRAFT_HEAD:
                raise DFlashError(f"{draft_vocab}: drafting among the first {draft_vocab} ids needs {DRAFT_HEAD}, "
                                  f"which the engine's files do not hold; {advice}", path=manifest.path,
                                  field="flags.draft_vocab")
            raise DFlashError(f"{fname}, a graph every ONNX Runtime engine loads, is not among them; {advice}",
                              path=manifest.path, field="files")


def default_threads() -> int:
    """Intra-op threads = the cores this process may use (one per core; never more threads than cores, since a
    batch-1 step is a few hundred small ops and every oversubscribed wake-up costs more than the op)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, n)


def linear_outputs(conv: np.ndarray, rec: np.ndarray, s: int) -> tuple[np.ndarray, ...]:
    """Empty arrays for one Gated DeltaNet layer's LINEAR_OUTPUTS of a call of `s` rows over the committed conv
    window [B, C, K-1] and recurrent state [B, Hv, Dk, Dv] (the graph writes into them: no copy out of ONNX Runtime)."""
    b, c, k = conv.shape
    hv, dk, dv = rec.shape[1:]
    return (np.empty((b, c, k + s), np.float32), np.empty(rec.shape, np.float32), np.empty((b, s, hv, dk), np.float32),
            np.empty((b, s, hv), np.float32), np.empty((s, b, hv, 1, dv), np.float32))


def committed_linear(conv: np.ndarray, rec: np.ndarray, outs: tuple, b: int, row: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's (conv window [C, K-1], recurrent state [Hv, Dk, Dv]) after row `row` of a call whose
    LINEAR_OUTPUTS are `outs`, from its committed ones before the call (conv, rec: [C, K-1], [Hv, Dk, Dv]). The
    state after the last row is the graph's own (a view of it); an earlier row's applies rows 0..row's updates to
    `rec` in place, S = S * decay + key (x) delta, in the scan body's order and float32 operations (the same bits),
    a head at a time (no state-sized temporary)."""
    window, last, keys, decays, deltas = outs
    k = conv.shape[-1]
    new_conv = window[b, :, row + 1: row + 1 + k]
    if row == keys.shape[1] - 1:
        return new_conv, last[b]
    for t in range(row + 1):
        rec *= decays[b, t][:, None, None]
        key, delta = keys[b, t], deltas[t, b, :, 0]
        for h in range(rec.shape[0]):
            rec[h] += np.multiply.outer(key[h], delta[h])
    return new_conv, rec


class _PlainStep:
    """What a one-token plain step of one sequence binds (OrtEngine._plain_hidden): its input arrays, written in place
    before each step and bound as OrtValues over the same memory, and its output arrays, bound by address. Bound once
    instead of made and bound afresh at every step, they halved the host share of an int4 plain step (0.39-0.46 ->
    0.19-0.25 ms of a 7-11 ms step: benchmarks/ortgenai_peer/step_profile.py, 2-core AVX-512 VNNI EPYC)."""

    def __init__(self, e: OrtEngine, rows: int):
        ort = _ort()
        self.rows = rows
        self.embeds = np.zeros((1, 1, e._embed.shape[1]), np.float32)
        self.seqlens = np.zeros(1, np.int32)
        self.total = np.zeros((), np.int32)
        self.hidden = np.empty((1, 1, e._out_widths[0]), np.float32)
        self.ctx = np.empty((1, 1, e._out_widths[1]), np.float32)
        inputs = {"inputs_embeds": self.embeds, "num_logits": np.ones((), np.int64), "seqlens_k": self.seqlens,
                  "total_seq_len": self.total}
        if e.graph_pads:  # the one row, gathered `rows` times inside the graph
            inputs[ROW_INDEX] = np.zeros(rows, np.int64)
        # Positions length .. length + rows - 1 and an all-zero bias over the past and the new rows (tree_inputs for
        # no tree); the bias is a view of one zero buffer as long as the longest step, its shape set per step.
        self.pos = self.steps = self._zeros = None
        if e._position_inputs:
            self.pos = np.zeros((1, rows), np.int64)
            self.steps = np.arange(rows, dtype=np.int64)
            inputs["position_ids"] = self.pos
            self._zeros = np.zeros(rows * (e.info.max_seq_len + rows), np.float32)
        # Sliding layers' biases (window_bias): per window a buffer as long as the longest step, rewritten per step.
        self._windows = {name: (w, np.empty(rows * (e.info.max_seq_len + rows), np.float32))
                         for name, w in e.window_inputs.items()}
        self._values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in inputs.items()}
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy

    def bind(self, io) -> None:
        for name, value in self._values.items():
            io.bind_ortvalue_input(name, value)
        io.bind_output("hidden", "cpu", 0, np.float32, self.hidden.shape, self.hidden.ctypes.data)
        io.bind_output("ctx", "cpu", 0, np.float32, self.ctx.shape, self.ctx.ctypes.data)

    def bias_value(self, total: int):
        """attention_bias [1, 1, rows, total], all zeros, over the buffer's memory."""
        return self._ortvalue(self._zeros[: self.rows * total].reshape(1, 1, self.rows, total))

    def bind_windows(self, io, length: int, total: int) -> None:
        """Bind each window_bias_W input of a step at positions `self.pos` after `length` committed tokens (`total`
        keys), written into its own buffer."""
        for name, (w, buf) in self._windows.items():
            view = buf[: self.rows * total].reshape(1, 1, self.rows, total)
            view.fill(0.0)
            io.bind_ortvalue_input(name, self._ortvalue(window_bias(view, length, self.pos[0], w, out=view)))


class _OrtSeq(Sequence):
    def __init__(self, engine: OrtEngine, max_tokens: int | None = None):
        super().__init__()
        e = engine
        # Target K/V: one buffer [1, KVH, capacity, D] per layer and kind, written in place by GroupQueryAttention
        # (past and present bound to the same memory), so decode steps allocate nothing. Capacity is the request's
        # whole length when the runtime says it (one allocation, no slack: the peak RSS target counts every MB);
        # otherwise it starts at 256 and doubles up to max_seq_len when a step would pass it.
        self.capacity = 0
        self.t_kv: list[np.ndarray] = []
        self.io = None  # the target session's IOBinding for these buffers
        self.plain: _PlainStep | None = None  # one-token plain steps' buffers (OrtEngine._plain_hidden)
        self.plain_bound = False  # whether `io` holds them now (every other target call rebinds its own)
        # Hybrid targets' Gated DeltaNet layers (export/linear_attention.py): the committed conv window [1, C, K-1]
        # and recurrent state [1, Hv, Dk, Dv] per linear layer, and what the last target call would commit.
        self.linear = {i: (np.zeros(conv, np.float32), np.zeros(rec, np.float32))
                       for i, (conv, rec) in e.linear_layers.items()}
        self.linear_pending: dict[int, tuple[np.ndarray, ...]] = {}
        # (+ the padding rows a last one-token step takes when the engine has a row floor above 1: numerics.py)
        self.reserve(e, min(e.info.max_seq_len, max_tokens + e.row_floor - 1 if max_tokens else 256))
        # Drafter context K/V: grows by the accepted tokens each step (small: drafter layers only).
        dshape = (1, e.d_kv_heads, 0, e.d_head_dim)
        self.d_kv = [np.zeros(dshape, np.float32) for _ in range(2 * e.d_layers)]
        self.ctx: np.ndarray | None = None        # pending context features [1, n, H_drafter]
        self.ctx_pos: np.ndarray | None = None    # their positions [1, n]

    def reserve(self, e: OrtEngine, need: int) -> bool:
        """Grow the K/V buffers to hold `need` tokens; True when they were reallocated (bindings must follow)."""
        if need <= self.capacity:
            return False
        cap = max(need, min(e.info.max_seq_len, 2 * self.capacity))
        bufs = []
        for old in self.t_kv or [None] * (2 * len(e.kv_layers)):
            buf = np.zeros((1, e.t_kv_heads, cap, e.t_head_dim), np.float32)
            if old is not None:
                buf[:, :, : self.length] = old[:, :, : self.length]
            bufs.append(buf)
        self.t_kv, self.capacity = bufs, cap
        return True

    def commit_linear(self, row: int) -> None:
        """Commit the Gated DeltaNet states after row `row` of the last target call (rows past it leave no trace);
        a no-op when nothing is pending."""
        for i, outs in self.linear_pending.items():
            conv, rec = committed_linear(self.linear[i][0][0], self.linear[i][1][0], outs, 0, row)
            self.linear[i] = (np.ascontiguousarray(conv)[None], rec[None])
        self.linear_pending = {}


class OrtEngine(Engine):
    """Runs an engine directory written by `build_onnxruntime`.

    kwargs: `threads` (intra-op threads, default: the usable cores); `probe_full` (probe the kernels' numerics in full
    even where the build probed this CPU: engines/numerics.py); `spin` (let idle ORT workers spin; default off,
    or DFLASH_ORT_SPIN=1: on a shared 2-core machine spinning made steps 2.5x slower, measured); `release_pages`
    (default on: see `_release_weight_pages`; off only to measure what it saves); `greedy_head` (default on: greedy
    rows of a large fp32 LM head screened by an int8 copy and computed exactly, engines/greedy_head.py; off: the whole
    fp32 head, to measure what it saves); `greedy_drafts` (default on: greedy drafts from an int8 copy of a large fp32
    draft head, engines/greedy_head.py "Drafting"; off: the fp32 draft head, to measure what it saves).
    """

    accumulates_context = True
    host_accept = True  # verify / verify_tree take the caller's acceptance (`accept=`): sampled walks

    def __init__(self, engine_dir: Path, manifest: Manifest, threads: int | None = None, spin: bool | None = None,
                 release_pages: bool = True, probe_full: bool = False, greedy_head: bool = True,
                 greedy_drafts: bool = True, **_):
        ort = _ort()
        self.engine_dir = Path(engine_dir)
        self._dir_identity = dir_identity(self.engine_dir)  # what a graph loaded later must still come from
        mpath = manifest.path
        check_ort_manifest(manifest)
        shapes = manifest.require("shapes")
        self.t_layers, self.t_kv_heads, self.t_head_dim = (
            shapes.target_layers, shapes.target_kv_heads, shapes.target_head_dim)
        self.d_layers, self.d_kv_heads, self.d_head_dim = (
            shapes.drafter_layers, shapes.drafter_kv_heads, shapes.drafter_head_dim)
        self.info = manifest.engine_info()
        self.codec = load_codec(self.engine_dir)

        so = ort.SessionOptions()
        # Graphs were optimized at build time and saved; optimizing again at every load would only cost start-up.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if manifest.optimized \
            else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads or default_threads()
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._ort, self._session_options, self._providers = ort, so, ["CPUExecutionProvider"]
        if spin is None:
            spin = env_switch("DFLASH_ORT_SPIN")
        if not spin:  # spinning workers steal a shared 2-core machine from the others: steps 2.5x slower under load
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._embed = embedding_rows(self.engine_dir, manifest)
        self._release_pages = release_pages
        self.released_bytes = 0  # resident file pages of the weights given back after loading (bytes)
        providers = ["CPUExecutionProvider"]
        # The LM head first: loading it briefly holds the read matrix and its prepacked copy (2 x 113 MB for SmolLM2),
        # a transient that then lands on an almost empty process instead of on top of the target's weights.
        self.head = self._session(ort, HEAD, so, providers)
        self.drafter = self._session(ort, DRAFTER, so, providers)
        self.target = self._session(ort, TARGET, so, providers)
        # Hybrid targets: the layers with K/V, and per Gated DeltaNet layer its state shapes, read from the graph.
        t_inputs = {i.name: i.shape for i in self.target.get_inputs()}
        self.kv_layers = [i for i in range(self.t_layers) if f"past_key_{i}" in t_inputs]
        self.linear_layers = {i: ((1, *t_inputs[f"conv_state_{i}"][1:]), (1, *t_inputs[f"recurrent_state_{i}"][1:]))
                              for i in range(self.t_layers) if f"conv_state_{i}" in t_inputs}
        t_outputs = {o.name for o in self.target.get_outputs()}
        for i in self.linear_layers:
            if f"recurrent_last_{i}" not in t_outputs:
                raise DFlashError("exported with per-row recurrent states (an earlier form of the Gated DeltaNet "
                                  "graph): rebuild the engine", path=self.engine_dir / TARGET)
        # Optional draft vocabulary: the drafter proposes only among the first `draft_vocab` ids (an LM head a
        # fraction of the full one). Lossless all the same: the target verifies every token; only tau can drop.
        self.draft_vocab = manifest.flags.draft_vocab
        self.draft_head = self._session(ort, DRAFT_HEAD, so, providers) if self.draft_vocab else self.head
        self._check_graph_metadata(mpath)
        self._draft_multiplier, self._draft_softcap = draft_logit_scaling(
            self.drafter.get_modelmeta().custom_metadata_map, self.engine_dir / DRAFTER)
        self._selector = _selector_tables(self.engine_dir, manifest, self.info.vocab_size)
        mask = self.info.mask_token_id
        if not 0 <= mask < self._embed.shape[0]:
            raise DFlashError(f"mask token {mask} outside the embedding", path=mpath, field="mask_token_id")
        self._mask_row = self._embed.rows([mask])[0]
        # Drafters exported with a key bias (unmasked ones) take B padded sequences per call
        # (engines/ort_batch.py); a batch of one feeds zeros, which leaves every bit as without it.
        self.drafter_batches = any(i.name == "key_bias" for i in self.drafter.get_inputs())
        self._target_batch = None  # target_batch.onnx's session, loaded by batch_target_session()
        # Engines built with the tree inputs verify draft trees (decoding/tree.py); older ones verify chains only.
        # Hybrids verify chains only: a tree would need each node's conv window and state gathered from its ancestors.
        # So do targets with sliding-window layers built before their window_bias inputs: GroupQueryAttention counts
        # its window in K/V rows, not in position_ids, and a node's row lies past its position (length + depth)
        # wherever the tree branches, so the window would hide keys that plain decoding shows it.
        # Engines built with window_bias_W inputs give those layers a bias that hides keys by position (and a row
        # window wide enough for every tree row: checked here); they verify trees like any other.
        self._position_inputs = {"position_ids", "attention_bias"} <= {i.name for i in self.target.get_inputs()}
        self.window_inputs = {name: int(name[len(WINDOW_BIAS):]) for name in t_inputs
                              if name.startswith(WINDOW_BIAS) and name[len(WINDOW_BIAS):].isdigit()}
        self.tree_verify = self._position_inputs and not self.linear_layers \
            and _trees_fit_windows(self.engine_dir / TARGET, self.window_inputs, probe_rows(self))
        # Whether verify rows equal plain steps bit for bit is a property of this CPU's kernels: probed here, at
        # every load, starting from the row floor the build found (engines/numerics.py); old engines: their flag.
        # Targets rewritten by engines/row_pad.py can pad their attention (and products) alone (`row_index`).
        self.graph_pads = ROW_INDEX in {i.name for i in self.target.get_inputs()}
        # hidden [1, num_logits, W] and ctx [1, S, W_ctx]: bound to arrays made here when their widths are fixed, so
        # a step reads no outputs back (get_outputs() wraps every K/V output too: ~0.3 ms a step, a tenth of an int4
        # step's host time).
        widths = {o.name: o.shape[-1] for o in self.target.get_outputs() if o.name in ("hidden", "ctx")}
        self._out_widths = (widths["hidden"], widths["ctx"]) \
            if all(isinstance(widths.get(k), int) for k in ("hidden", "ctx")) else None
        self.row_pad = "host"
        self.row_floor = manifest.flags.plain_step_rows
        # The LM head runs one row at a time wherever its one-row product is every many-row product's row on this
        # CPU (fp32's GEMM on AVX2; not int4's MatMulNBits): a floor the target's attention needs then costs the head
        # nothing. Checked before the probe, so the probe checks the steps as they will run (and again for any other
        # head session put in its place).
        self._head_checked = None
        self._head_floor_free()
        # int8 / int4 targets (and LM heads) are MatMulNBits at accuracy level 4: their products round the
        # activations to int8, which turns last-bit differences into visible ones (numerics.walks_whole_trees).
        self.quantized_activations = any((manifest.precision or {}).get(role, "fp32") != "fp32"
                                         for role in ("target", "lm_head"))
        self.numerics = choose_row_floor(self, first=self.row_floor, threads=so.intra_op_num_threads,
                                         recorded=manifest.raw.get("numerics") if probe_full is False else None)
        # Greedy rows of a large fp32 head: the token found by an int8 screen and the candidates' exact logits
        # (engines/greedy_head.py), the same token on every path that asks for one; None: the whole head.
        release = _release_weight_pages if release_pages else None
        self.greedy_head = greedy_head_for(self.head, self.engine_dir / HEAD, self.engine_dir, ort, so, providers,
                                           release=release) if greedy_head else None
        # Greedy drafts (and the argmax / top-K trees grow from) from an int8 copy of an fp32 draft head: the target
        # verifies them, so only tau can move (engines/greedy_head.py, "Drafting"). The greedy screen is that copy
        # where the drafter drafts over the whole vocabulary. None: the draft head drafts.
        self.greedy_draft_head = None
        if greedy_drafts and self.draft_vocab:
            self.greedy_draft_head = greedy_draft_head(self.engine_dir / DRAFT_HEAD, self.engine_dir, ort, so,
                                                       providers, release)
        elif greedy_drafts and self.greedy_head is not None:
            self.greedy_draft_head = self.greedy_head.screen
        if release_pages:  # what the probe read of the weight files goes back too
            self.released_bytes += _release_weight_pages(self.engine_dir)
        if not self.numerics.bit_identical and not probe_full:  # a build's probe: `build` says it of the final dir
            logging.getLogger("dflash_export").warning("%s: %s", self.engine_dir, self.numerics.statement)

    def _session(self, ort, fname, so, providers):
        path = self.engine_dir / fname
        try:
            with native_path(path) as name:
                sess = ort.InferenceSession(name, so, providers=providers)
        except DFlashError:
            raise
        except Exception as e:  # ORT raises its own Fail / InvalidGraph types
            raise DFlashError(f"ONNX Runtime cannot load the graph ({str(e).splitlines()[0][:300]})",
                              path=path) from None
        if getattr(self, "_release_pages", False):  # after each graph: its leftovers never sit under the next load
            self.released_bytes += _release_weight_pages(self.engine_dir)
        return sess

    def batch_target_session(self):
        """The target graph for B sequences verifying blocks in one call (target_batch.onnx), loaded on first use
        (it holds a second copy of the target's weights); None for engines built without it."""
        if self._target_batch is None and (self.engine_dir / TARGET_BATCH).is_file():
            if dir_identity(self.engine_dir) != self._dir_identity:
                raise DFlashError("replaced (rebuilt) since this process loaded it, so its batch graph would come "
                                  "from another engine: start again to load the new one", path=self.engine_dir)
            sess = self._session(self._ort, TARGET_BATCH, self._session_options, self._providers)
            meta = sess.get_modelmeta().custom_metadata_map
            if meta.get("dflash.graph") != GRAPH_ROLES[TARGET_BATCH] or meta.get("dflash.max_seq_len") != str(
                    self.info.max_seq_len):
                raise DFlashError(f"holds the graph {meta.get('dflash.graph')!r}, expected "
                                  f"{GRAPH_ROLES[TARGET_BATCH]!r} of this engine: rebuild the engine",
                                  path=self.engine_dir / TARGET_BATCH)
            self._target_batch = sess
        return self._target_batch

    def _check_graph_metadata(self, mpath: Path) -> None:
        """The graphs describe themselves (export metadata); refuse a manifest that disagrees with them."""
        info = self.info
        want = DFlashSpec(info.block_size, info.mask_token_id, tuple(info.target_layer_ids)).contract_metadata(
            info.max_seq_len)
        graphs = [(self.target, TARGET), (self.drafter, DRAFTER), (self.head, HEAD)]
        if self.draft_vocab:
            graphs.append((self.draft_head, DRAFT_HEAD))
        for sess, fname in graphs:
            meta = sess.get_modelmeta().custom_metadata_map
            if meta.get("dflash.graph") != GRAPH_ROLES[fname]:
                raise DFlashError(f"holds the graph {meta.get('dflash.graph')!r}, expected {GRAPH_ROLES[fname]!r} "
                                  "(graphs swapped or replaced): rebuild the engine", path=self.engine_dir / fname)
        for sess, fname in graphs[:3]:
            meta = sess.get_modelmeta().custom_metadata_map
            for k, v in want.items():
                if meta.get(k) != v:
                    raise DFlashError(f"manifest says {v!r} but {fname} was exported with {meta.get(k)!r}",
                                      path=mpath, field=k.split(".", 1)[1])
        # The KV caches are sized from `shapes`: they must be the graphs' own cache inputs.
        for sess, fname, prefix, layers, heads, dim, names in (
                (self.target, TARGET, "past_key_", self.t_layers, self.t_kv_heads, self.t_head_dim,
                 ("target_layers", "target_kv_heads", "target_head_dim")),
                (self.drafter, DRAFTER, "past_ctx_key_", self.d_layers, self.d_kv_heads, self.d_head_dim,
                 ("drafter_layers", "drafter_kv_heads", "drafter_head_dim"))):
            caches = [i for i in sess.get_inputs() if i.name.startswith(prefix)]
            shape = caches[0].shape if caches else [None] * 4
            linear = len(self.linear_layers) if sess is self.target else 0  # hybrids: layers without K/V
            have = (len(caches) + linear, shape[1], shape[3])
            for name, want_v, got in zip(names, (layers, heads, dim), have):
                if got != want_v:
                    raise DFlashError(f"manifest says {want_v} but {fname} has {got}", path=mpath,
                                      field=f"shapes.{name}")

    # The Engine contract -------------------------------------------------------------------------------------------

    def new_sequence(self, max_tokens: int | None = None) -> Sequence:
        return _OrtSeq(self, max_tokens)

    def _embeds(self, ids: np.ndarray) -> np.ndarray:
        return self._embed.rows(ids)[None]

    def _run_target(self, seq: _OrtSeq, ids: np.ndarray, num_logits: int, tree: DraftTree | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """ids [S] at positions seq.length.. (or, for a draft `tree` whose tokens they are, at seq.length + depth,
        each row seeing the past and its ancestors only); K/V rows written into seq.t_kv in place at seq.length +
        row. Returns hidden rows, ctx."""
        s = len(ids)
        total = seq.length + s
        self.info.check_room(total)
        floor = self.row_floor
        rows = s  # the rows attention and the products run (> s: padded inside the graph)
        pad = s < floor and num_logits == s and tree is None and seq.length + floor <= self.info.max_seq_len
        # A step of fewer rows than the row floor runs its kernels as `floor` rows: the kernels then take the same
        # path for a one-token step as for a verify block, so plain decoding and DFlash agree bit for bit on this CPU
        # (the floor, and where the padding goes, is what engines/numerics.py found to make them agree). The padding
        # rows are copies of the last token; their K/V rows lie past the committed length (overwritten by the next
        # step).
        if pad and self.row_pad == "graph":  # attention (and products) alone (engines/row_pad.py)
            rows, total = floor, seq.length + floor
        elif pad:  # the whole step
            ids = np.asarray(ids, np.int64)
            padded = np.concatenate([ids, np.repeat(ids[-1:], floor - s)])
            hidden, ctx = self._run_target(seq, padded, floor)
            return hidden[:, :s], ctx[:, :s]
        io = self._kv_io(seq, total)
        seq.plain_bound = False
        if self._out_widths is not None:  # this call's shapes, known before it runs (ORT checks them)
            hidden = np.empty((1, num_logits, self._out_widths[0]), np.float32)
            ctx = np.empty((1, s, self._out_widths[1]), np.float32)
            io.bind_output("hidden", "cpu", 0, np.float32, hidden.shape, hidden.ctypes.data)
            io.bind_output("ctx", "cpu", 0, np.float32, ctx.shape, ctx.ctypes.data)
        else:
            io.bind_output("hidden", "cpu")  # rebound unallocated: their shapes change from call to call
            io.bind_output("ctx", "cpu")
        io.bind_cpu_input("inputs_embeds", self._embeds(ids))
        io.bind_cpu_input("num_logits", np.array(num_logits, np.int64))
        io.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        io.bind_cpu_input("total_seq_len", np.array(total, np.int32))
        if self.graph_pads:
            io.bind_cpu_input(ROW_INDEX, np.minimum(np.arange(rows, dtype=np.int64), s - 1))
        if self._position_inputs:
            pos, bias = tree_inputs(seq.length, rows, tree)
            io.bind_cpu_input("position_ids", pos)
            io.bind_cpu_input("attention_bias", bias)
            for name, w in self.window_inputs.items():
                io.bind_cpu_input(name, window_bias(bias, seq.length, pos[0], w))
        pending = {}
        for i in self.linear_layers:  # read from the committed state; the new states come back per row
            conv, rec = seq.linear[i]
            io.bind_cpu_input(f"conv_state_{i}", conv)
            io.bind_cpu_input(f"recurrent_state_{i}", rec)
            pending[i] = linear_outputs(conv, rec, s)
            for name, out in zip(LINEAR_OUTPUTS, pending[i]):
                io.bind_output(f"{name}_{i}", "cpu", 0, np.float32, out.shape, out.ctypes.data)
        self.target.run_with_iobinding(io)
        seq.linear_pending = pending
        if self._out_widths is not None:
            return hidden, ctx
        outs = io.get_outputs()  # OrtValues; copy_outputs_to_cpu would also copy every K/V buffer
        return outs[0].numpy(), outs[1].numpy()

    def _kv_io(self, seq: _OrtSeq, total: int):
        """The target session's IOBinding of `seq`, its K/V buffers grown to hold `total` tokens. K/V are bound once
        per buffer set: the same memory serves as past and present on every step."""
        if seq.reserve(self, total) or seq.io is None:
            io = self.target.io_binding()
            io.bind_output("hidden", "cpu")  # first: get_outputs() lists outputs in binding order
            io.bind_output("ctx", "cpu")
            for n, i in enumerate(self.kv_layers):
                for j, kind in enumerate(("key", "value")):
                    buf = seq.t_kv[2 * n + j]
                    io.bind_cpu_input(f"past_{kind}_{i}", buf)
                    io.bind_output(f"present_{kind}_{i}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
            seq.io, seq.plain_bound = io, False
        return seq.io

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """LM head over hidden rows [1, n, H] -> logits [n, V] float32; fewer rows than the row floor run padded
        with copies of the last (the int4 head's one-row kernel differs from its many-row one on AVX2), unless the
        head's rows agree at any row count on this CPU (`head_floor_free`)."""
        n = hidden.shape[1]
        floor = 1 if self._head_floor_free() else self.row_floor
        if n < floor:
            hidden = np.concatenate([hidden, np.repeat(hidden[:, -1:], floor - n, axis=1)], axis=1)
        return self.head.run(["logits"], {"hidden": hidden})[0][0][:n]

    def greedy_logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits [n, V] of hidden rows [1, n, H] for a greedy choice only: argmax reads them as full logits;
        where `greedy_head` is on, its candidates hold exact values and the rest a screen's proxy below the best
        (engines/greedy_head.py). Never for sampling."""
        if self.greedy_head is None:
            return self._logits(hidden)
        return self.greedy_head.logits(hidden)

    def _head_floor_free(self) -> bool:
        """Whether this head session's one-row calls give its many-row rows (checked once per session)."""
        if self._head_checked is not self.head:
            self.head_floor_free = _head_rows_agree(self.head, probe_rows(self), self._mask_row.shape[0])
            self._head_checked = self.head
        return self.head_floor_free

    def prefill(self, seq: _OrtSeq, input_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(input_ids, np.int64)
        n = len(ids)
        if not self.linear_layers:
            hidden, ctx = self._run_target(seq, ids, 1)
        else:  # hybrids: in chunks, so the per-row states a call returns stay bounded whatever the prompt's length
            ctxs = []
            for a in range(0, n, HYBRID_PREFILL_ROWS):
                part = ids[a:a + HYBRID_PREFILL_ROWS]
                hidden, c = self._run_target(seq, part, 1)
                seq.commit_linear(len(part) - 1)
                seq.length += len(part)
                ctxs.append(c)
            ctx = np.concatenate(ctxs, axis=1)
        seq.commit_linear(n - 1)
        seq.ctx, seq.ctx_pos = ctx, np.arange(n, dtype=np.int64)[None]
        seq.length = n
        return self._logits(hidden)[-1]

    def _plain_hidden(self, seq: _OrtSeq, token: int) -> np.ndarray | None:
        """The hidden row [1, 1, W] of a one-token plain step run through buffers bound once per K/V binding
        (`_PlainStep`): the token's embedding, its positions and the step's lengths are written into arrays the
        binding already holds, and only the attention bias (its width grows with the sequence) is bound per step.
        The same inputs `_run_target` gives the same graph (the same row floor and in-graph padding), so the same
        bits. The row returned is a buffer of `seq` that the next plain step overwrites. None where this path does
        not apply: hybrids (their per-row states), outputs of unknown width, padding on the host, or a last step
        with no room left for the padding rows (the caller takes `_run_target`)."""
        floor = self.row_floor
        if self.linear_layers or self._out_widths is None or (floor > 1 and self.row_pad != "graph"):
            return None
        total = seq.length + floor
        if total > self.info.max_seq_len:
            return None
        io = self._kv_io(seq, total)
        plain = seq.plain
        if plain is None or plain.rows != floor:
            plain = seq.plain = _PlainStep(self, floor)
            seq.plain_bound = False
        if not seq.plain_bound:
            plain.bind(io)
            seq.plain_bound = True
        self._embed.rows((token,), plain.embeds[0])
        plain.seqlens[0] = total - 1
        plain.total[()] = total
        if plain.pos is not None:
            np.add(plain.steps, seq.length, out=plain.pos[0])
            io.bind_ortvalue_input("attention_bias", plain.bias_value(total))
            plain.bind_windows(io, seq.length, total)
        self.target.run_with_iobinding(io)
        return plain.hidden

    def decode(self, seq: _OrtSeq, token: int, greedy: bool = False) -> np.ndarray:
        hidden = self._plain_hidden(seq, token)
        if hidden is None:
            hidden, _ = self._run_target(seq, np.array([token], np.int64), 1)
        seq.commit_linear(0)
        seq.length += 1
        return (self.greedy_logits(hidden) if greedy else self._logits(hidden))[-1]

    def draft(self, seq: _OrtSeq, anchor: int, sp: SamplingParams, uniforms, block_len: int | None = None):
        if seq.ctx is None:
            raise DFlashError("draft() needs new context: call prefill() or verify() first", field="sequence")
        bs = min(block_len or self.info.block_size, self.info.block_size)
        block = np.empty((1, bs, self._mask_row.shape[0]), np.float32)
        block[0, 0] = self._embed.rows([anchor])[0]
        block[0, 1:] = self._mask_row
        feeds = {"ctx": seq.ctx, "ctx_positions": seq.ctx_pos, "block_embeds": block,
                 "block_positions": np.arange(seq.length, seq.length + bs, dtype=np.int64)[None]}
        for i in range(self.d_layers):
            feeds[f"past_ctx_key_{i}"] = seq.d_kv[2 * i]
            feeds[f"past_ctx_value_{i}"] = seq.d_kv[2 * i + 1]
        if self.drafter_batches:
            feeds["key_bias"] = np.zeros((1, seq.d_kv[0].shape[2] + seq.ctx.shape[1] + bs), np.float32)
        extra = ["selector_hidden"] if self._selector else []
        names = ["hidden"] + extra + [f"present_ctx_{k}_{i}" for i in range(self.d_layers) for k in ("key", "value")]
        res = self.drafter.run(names, feeds)
        seq.d_kv = res[1 + len(extra):]
        seq.ctx = seq.ctx_pos = None
        logits = self.draft_logits(res[0], sp.greedy)
        return self.drafts_from_logits(seq, logits, res[1][0] if extra else None, anchor, sp, uniforms)

    def draft_logits(self, hidden: np.ndarray, greedy: bool) -> np.ndarray:
        """The drafter's hidden rows [1, n, H] -> draft logits [n, V_draft]: from the draft head's int8 copy for
        greedy drafts where there is one (`greedy_draft_head`), else from the draft head."""
        head = self.greedy_draft_head if greedy and self.greedy_draft_head is not None else self.draft_head
        return head.run(["logits"], {"hidden": hidden})[0][0]

    def drafts_from_logits(self, seq: Sequence, logits: np.ndarray, selector_hidden, anchor: int,
                           sp: SamplingParams, uniforms):
        """Draft head logits [n, V_draft] of one block -> (tokens [n], draft probs [n, V] or None); sets
        seq.draft_confidence when greedy. Shared by `draft` and the batched engine (engines/ort_batch.py)."""
        return drafts_from_logits(seq, logits, selector_hidden, anchor, sp, uniforms, self._draft_multiplier,
                                  self._draft_softcap, self._selector, self.info.vocab_size)

    def verify(self, seq: _OrtSeq, block: np.ndarray, draft_probs, sp: SamplingParams, uniforms, accept=None):
        """`Engine.verify`; `accept(logits) -> (path, emitted)` (host_accept): the caller's acceptance over the
        block's logits [bs, V] instead of `verify_block` (decoding/acceptance.py's sampled walk)."""
        block = np.asarray(block, np.int64)
        bs = len(block)
        hidden, ctx = self._run_target(seq, block, bs)
        logits = self.greedy_logits(hidden) if sp.greedy and accept is None else self._logits(hidden)
        if accept is not None:
            path, emitted = accept(logits)
            accept = len(path) - 1
        else:
            probs = None
            if not sp.greedy:
                probs = probs_from_logits(logits.astype(np.float64), sp.temperature, sp.top_k, sp.top_p)
            accept, emitted = verify_block(probs, logits, block[1:], draft_probs, uniforms, sp.greedy)
        new_ctx = ctx[:, : accept + 1]
        new_pos = np.arange(seq.length, seq.length + accept + 1, dtype=np.int64)[None]
        if seq.ctx is not None:  # no draft consumed the previous step's features: keep them, in order
            new_ctx = np.concatenate([seq.ctx, new_ctx], axis=1)
            new_pos = np.concatenate([seq.ctx_pos, new_pos], axis=1)
        seq.ctx, seq.ctx_pos = new_ctx, new_pos
        # Committing = advancing the length: K/V rows past it are stale and get overwritten by the next step; a
        # hybrid's Gated DeltaNet layers take their state after the last accepted row.
        seq.commit_linear(accept)
        seq.length += accept + 1
        return accept, emitted

    def verify_tree(self, seq: _OrtSeq, tree: DraftTree, accept=None) -> tuple[int, list[int], list[int]]:
        """Score every node of `tree` (root = the anchor at seq.length) in one target pass, accept the longest root
        path whose every token is the target's argmax at its parent (or what `accept(logits) -> (path, emitted)`
        accepts: decoding/acceptance.py's sampled walk), and commit it. The accepted rows'
        K/V move down to consecutive cache rows (their RoPE positions, length + depth, are already those rows'), and
        their context features become pending for the next draft. Returns (drafts accepted, tokens emitted, the
        accepted path's node indices)."""
        if not self.tree_verify:
            raise DFlashError("this engine's target graph has no tree inputs (position_ids, attention_bias): rebuild "
                              "it to verify draft trees", path=self.engine_dir / TARGET)
        ids = np.asarray(tree.tokens, np.int64)
        hidden, ctx = self._run_target(seq, ids, len(ids), tree=tree)
        logits = self._logits(hidden) if accept is not None else self.greedy_logits(hidden)
        path, emitted = accept(logits) if accept is not None else greedy_accept(tree, np.argmax(logits, axis=-1))
        start = seq.length
        for row, node in enumerate(path):
            if node != row:  # node > row along a path, so no source is overwritten before it is read
                for buf in seq.t_kv:
                    buf[:, :, start + row] = buf[:, :, start + node]
        new_ctx = ctx[:, path]
        new_pos = np.arange(start, start + len(path), dtype=np.int64)[None]
        if seq.ctx is not None:
            new_ctx = np.concatenate([seq.ctx, new_ctx], axis=1)
            new_pos = np.concatenate([seq.ctx_pos, new_pos], axis=1)
        seq.ctx, seq.ctx_pos = new_ctx, new_pos
        seq.length += len(path)
        return len(path) - 1, emitted, path

    def close(self) -> None:
        self.target = self.drafter = self.head = self.draft_head = self._target_batch = None
        self.greedy_head = self.greedy_draft_head = None
        self._embed.close()


def _head_rows_agree(head, rows: int, hidden_size: int) -> bool:
    """Whether the LM head session's one-row output is bit for bit each row of its outputs over 2..`rows` rows, on
    fixed random hidden rows: then a one-row head call gives the logits a verify's many-row call gives there. Stops at
    the first row that differs (int4 on AVX2: at two rows)."""
    x = np.random.default_rng(PROBE_SEED).standard_normal((1, rows, hidden_size)).astype(np.float32)
    one: list[np.ndarray] = []
    for m in range(2, rows + 1):
        out = head.run(["logits"], {"hidden": x[:, :m]})[0][0]
        while len(one) < m:
            one.append(head.run(["logits"], {"hidden": x[:, len(one):len(one) + 1]})[0][0][0])
        if not all(np.array_equal(out[i], one[i]) for i in range(m)):
            return False
    return True


def _trees_fit_windows(graph: Path, window_inputs: dict[str, int], rows: int) -> bool:
    """Whether every GroupQueryAttention of the graph at `graph` with a sliding window (local_window_size > 0) can
    verify draft trees of up to `rows` rows: it takes a window_bias_W input as its attention bias (keys hidden by
    position) and its row window reaches W + rows - 1 rows back, so that a node at row length + i and position
    length + depth still has every key of its positions' window inside it. True for graphs without windows."""
    import onnx

    for n in onnx.load(str(graph), load_external_data=False).graph.node:
        size = next((a.i for a in n.attribute if a.name == "local_window_size"), 0)
        if n.op_type != "GroupQueryAttention" or size <= 0:
            continue
        bias = n.input[10] if len(n.input) > 10 else ""
        if bias not in window_inputs or size < window_inputs[bias] + rows - 1:
            return False
    return True


def tree_inputs(length: int, rows: int, tree: DraftTree | None = None) -> tuple[np.ndarray, np.ndarray]:
    """position_ids [1, rows] and attention_bias [1, 1, rows, length + rows] of the target graph for `rows` new
    rows after `length` committed ones: consecutive positions and no bias (GroupQueryAttention's causal mask does the
    rest), or, for a draft tree, positions length + depth and -inf on every new row that is not an ancestor. Rows
    past the tree (padding to the row floor) continue its last position and see what GQA's causal mask lets them."""
    bias = np.zeros((1, 1, rows, length + rows), np.float32)
    if tree is None:
        return np.arange(length, length + rows, dtype=np.int64)[None], bias
    n = len(tree)
    pos = np.empty(rows, np.int64)
    pos[:n] = length + np.asarray(tree.depths, np.int64)
    pos[n:] = pos[n - 1] + 1 + np.arange(rows - n)
    bias[0, 0, :n, length:length + n] = np.where(tree.ancestor_mask(), 0.0, -np.inf)
    return pos[None], bias


def window_bias(bias: np.ndarray, length: int, pos: np.ndarray, window: int, out: np.ndarray | None = None
                ) -> np.ndarray:
    """window_bias_W [1, 1, rows, total] of the target graph's sliding layers of `window` tokens: `bias` (the call's
    attention_bias) plus -inf on every key at a position `window` or more below its row's (transformers' sliding
    window: a row at position p sees keys at positions > p - window). Committed key k sits at position k, the new
    rows' keys at `pos` [rows] (length + depth in a draft tree); keys past the new rows (another sequence's longer
    call) are left to the causal mask. Written into `out` (which may be `bias`) when given."""
    if out is None:
        out = bias.copy()
    elif out is not bias:
        np.copyto(out, bias)
    rows = out.shape[2]
    edge = np.minimum(pos - (window - 1), length)  # each row's committed keys [0, edge) lie outside its window
    for r in np.flatnonzero(edge > 0):
        out[0, 0, r, :edge[r]] = -np.inf
    far = pos[None, :] <= pos[:, None] - window  # among the new rows' keys (a tree deeper than the window)
    if far.any():
        out[0, 0, :, length:length + rows][far] = -np.inf
    return out


def _release_weight_pages(engine_dir: Path) -> int:
    """Give back the resident pages of the engine's weight files (*.data) that ONNX Runtime keeps mapped but no
    longer reads; returns the resident bytes released. Linux only (elsewhere a no-op).

    ORT maps each external initializer of a graph. Weights it prepacks into its own buffers are unmapped, but on x86
    MatMulNBits copies its block scales into the packed weight and still reports them unpacked, so ORT keeps them
    mapped -- and resident, since packing read them: 19 MiB for SmolLM2 at int4 or int8 (4 bytes per block of 32
    weights), 20 % of an int4 engine's weights, for data that the kernel never reads again (measured: 1.9 of those
    19 MiB come back while decoding, tensors that are read at every step). MADV_DONTNEED on a private file mapping
    only drops pages from this process; any later read faults them back in from the file, so it changes no result. A
    mapping this process has written to (a present page that is not a file page, per /proc/self/pagemap: a
    copy-on-write copy) is left alone: dropping it would lose the writes. Costs a read of /proc/self/maps and of the
    pagemap entries of the engine's mappings (milliseconds; /proc/self/smaps would walk every mapping).
    """
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    try:
        # Paths as bytes, decoded as the engine's own path is: whatever the locale (a python backend stub runs in
        # ASCII), a mapped file under a non-ASCII path decodes.
        maps = os.fsdecode(Path("/proc/self/maps").read_bytes()).splitlines()
        pagemap = open("/proc/self/pagemap", "rb")
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    root = str(Path(engine_dir).resolve()) + os.sep
    released = 0
    with pagemap:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[1].endswith("p") or not parts[5].startswith(root) \
                    or not parts[5].endswith(".data"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            pagemap.seek(start // page * 8)
            entries = np.frombuffer(pagemap.read((end - start) // page * 8), np.uint64)
            present = (entries >> np.uint64(63)) & np.uint64(1)
            file_page = (entries >> np.uint64(61)) & np.uint64(1)
            if not present.any() or (present & (file_page ^ np.uint64(1))).any():
                continue
            if madvise(start, end - start, 4) == 0:  # MADV_DONTNEED
                released += int(present.sum()) * page
    return released


def drafts_from_logits(seq: Sequence, logits: np.ndarray, selector_hidden, anchor: int, sp: SamplingParams, uniforms,
                       multiplier: float, softcap: float | None, selector, vocab_size: int):
    """Draft head logits [n, V_draft] of one block -> (tokens [n], draft probs [n, V] or None), after the drafter's
    logit scaling (`draft_logit_scaling`); sets seq.draft_confidence when greedy. `selector`: DFlash 2's
    `_selector_tables` or None. What every host-side drafting path (ONNX Runtime, TensorRT's batched engine) runs."""
    if multiplier != 1.0:  # z-lab's compute_logits: multiplier, then soft cap
        logits = logits * np.float32(multiplier)
    if softcap:
        logits = np.tanh(logits / np.float32(softcap)) * np.float32(softcap)
    if selector:  # DFlash 2: the candidate selector's walk (no draft confidences: full blocks verified)
        top_k, predecessor, successor = selector
        return select_candidates(logits, selector_hidden, predecessor, successor, anchor, top_k,
                                 0.0 if sp.greedy else sp.temperature, uniforms)
    if sp.greedy:
        seq.draft_confidence = top_probability(logits)
        seq.draft_logits = logits  # what a draft tree is grown from (decoding/tree.py)
        return np.argmax(logits, axis=-1).astype(np.int64), None
    probs = probs_from_logits(logits.astype(np.float64), sp.temperature, sp.top_k, sp.top_p)
    tokens = np.array([sample_from(p, u) for p, u in zip(probs, uniforms)], dtype=np.int64)
    if probs.shape[-1] < vocab_size:  # ids past the draft vocabulary have draft probability 0
        probs = np.pad(probs, ((0, 0), (0, vocab_size - probs.shape[-1])))
    return tokens, probs


def _selector_tables(engine_dir: Path, manifest: Manifest, vocab: int):
    """(top_k, predecessor [V, R], successor [V, R]) of a DFlash 2 engine, checked against the manifest; None for
    DFlash."""
    if manifest.selector is None:
        return None
    top_k, rank = manifest.selector.top_k, manifest.selector.rank
    tables = []
    for fname in SELECTOR_FILES:
        try:
            table = read_npy(engine_dir / fname)
        except UnreadableArrays as e:
            raise DFlashError(f"unreadable DFlash 2 codebook ({e})", path=engine_dir / fname) from None
        if table.shape != (vocab, rank) or table.dtype != np.float32:
            raise DFlashError(f"shape {table.shape} {table.dtype} != ({vocab}, {rank}) float32",
                              path=engine_dir / fname)
        tables.append(table)
    return top_k, tables[0], tables[1]


def draft_logit_scaling(meta, path: Path) -> tuple[float, float | None]:
    """(output_multiplier, final_logit_softcapping or None) from the drafter graph's metadata `meta` (a mapping; export
    writes them; graphs exported before they existed carry neither and mean 1 and none)."""
    try:
        mult = float(meta.get("dflash.output_multiplier", "1.0"))
        cap = json.loads(meta.get("dflash.final_logit_softcapping", "null"))
        cap = None if cap is None or float(cap) <= 0 else float(cap)
    except (TypeError, ValueError):
        raise DFlashError("unreadable drafter logit scaling metadata", path=path,
                          field="dflash.output_multiplier") from None
    return mult, cap


def embedding_rows(weights_dir: Path, manifest: Manifest) -> MatrixRows:
    """The embedding table of `weights_dir`/shared_weights.bin (layout from the manifest), checked against the file's
    size. `weights_dir`: the engine directory (ONNX Runtime) or its onnx/ (TensorRT's batched engine)."""
    path = Path(weights_dir) / SHARED
    e = manifest.shared_tensors.get("shared.embed_tokens")
    if e is None:
        raise DFlashError("missing or without shared.embed_tokens", path=manifest.path, field="shared_tensors")
    off, length, shape = e.offset, e.length, e.shape
    if len(shape) != 2 or length != 4 * shape[0] * shape[1] or not path.is_file() \
            or off + length > path.stat().st_size:
        raise DFlashError("embedding does not fit the file", path=path, field="shared_tensors.shared.embed_tokens")
    if manifest.vocab_size is not None and shape[0] != manifest.vocab_size:
        raise DFlashError(f"manifest says {manifest.vocab_size} but the embedding table has {shape[0]} rows",
                          path=manifest.path, field="vocab_size")
    return MatrixRows(path, off, shape, what="embedding")


# ----------------------------------------------------------------------------------------------------------------------
# Build


# Quantization ---------------------------------------------------------------------------------------------------------


