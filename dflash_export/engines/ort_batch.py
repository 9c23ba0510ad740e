"""B sequences per call on the ONNX Runtime engine: the target step (prefill, verify, plain step) and the drafter.

`BatchedOrtEngine` drives the same sessions as `OrtEngine` (it wraps one), so a batch of one computes what the
single-sequence path computes; `dflash_export.runtime.batching` schedules it. Imports neither torch nor anything beyond
numpy and onnxruntime.

The bookkeeping (slots, dense slot moves, context chunks, padding, the bias inputs) is `BatchedEngine`, apart from
what executes the graphs: a `BatchGraphs` runs the batch graphs (target_batch, drafter with key_bias, LM head, draft
head) on host arrays, the K/V buffers where its `kv_store` keeps them (`HostKV`: host arrays). `OrtBatchGraphs` runs
an `OrtEngine`'s sessions; the TensorRT backend runs engines compiled from the same graphs, its K/V on the device
(engines/tensorrt_batch.py). `engines.registry.batched_engine` picks the one for an engine's backend.

How B sequences of different lengths share one call:
- Target (GroupQueryAttention over a K/V buffer shared by past and present): every layer's cache is one buffer
  [slots, KVH, capacity, D], a sequence owning one slot. A call runs a contiguous range of slots with S rows each
  (S = the longest block in the call); a sequence with n < S real rows is padded at its end. Its `seqlens_k` says
  length + S - 1, so GQA puts the new rows at length .. length + S - 1: the real rows attend exactly to the cache
  and to each other (causal), the padding rows come after every real row and are never seen, and their K/V rows lie
  past the committed length, overwritten by the next step -- as the quantized engines' two-row plain step already
  does. Prefills run in their own calls (an empty cache per sequence, the prompt right-padded).
- Drafter (context K/V outside the graph, `key_bias` input): each sequence's cached context, its new context
  features and its block are padded to the call's longest, and key_bias (-inf) hides every padding key from every
  query. With no padding (a batch of one) the bias is all zeros and the drafts are the unbatched graph's, bit for bit.
  Drafters with causal / sliding-window layers (no key_bias) draft one sequence per call inside a batched step.
- LM head and draft head: one call over the rows every sequence needs (the head is row-wise).

Slots are kept dense (0..n-1, in join order): a leaving sequence's slot takes the last slot's rows, so every step
is one contiguous range and K/V memory is slots x the longest request's length, grown on demand and released when the
batch empties.

Exactness: every real row sees the same keys with the same values as when the sequence runs alone; what padding
changes is the shape of the kernels (GEMMs with more rows, GQA's many-row path instead of its one-row path for a
plain step). fp32 rows can then differ from the unbatched ones in the last bits (as DFlash's verify rows already
differ from plain decoding's one-row steps), which can flip a greedy token only at an exact near-tie; the tests and
`bench --concurrency` compare every output with the sequence run alone and report any such flip.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from dflash_export.engines.base import EngineInfo, SamplingParams, Sequence
from dflash_export.engines.onnxruntime import OrtEngine
from dflash_export.errors import DFlashError


class BatchSeq(Sequence):
    """One sequence of a batch. `length`: committed tokens (the next anchor sits there); `slot`: its K/V slot."""

    def __init__(self, max_tokens: int):
        super().__init__()
        self.slot = -1
        self.max_tokens = max_tokens
        self.d_len = 0                            # drafter context K/V rows cached
        # Context features not yet in the drafter's cache, as chunks (a commit appends one: no copying of what is
        # already pending, however long a sequence goes without drafting); their positions are d_len, d_len + 1, ...
        self.ctx_parts: list[np.ndarray] = []
        self.keep_context = True                  # False: plain decoding only, features dropped
        self._step_ctx: np.ndarray | None = None  # features of the last target step's rows, until `commit`

    def pending_context(self) -> np.ndarray:
        """The pending features as one array [n, H_drafter] (kept as one chunk from then on)."""
        if len(self.ctx_parts) > 1:
            self.ctx_parts = [np.concatenate(self.ctx_parts)]
        return self.ctx_parts[0]


@dataclass
class _Buffers:
    """Per-layer K/V buffers [slots, KVH, capacity, D] (target) or [slots, KVH, capacity, D] (drafter context), held
    as the graphs' `kv_store` keeps them (host arrays: `HostKV`)."""

    t_kv: list[np.ndarray] = field(default_factory=list)
    d_kv: list[np.ndarray] = field(default_factory=list)
    slots: int = 0
    t_cap: int = 0
    d_cap: int = 0


class HostKV:
    """Where the batch's K/V buffers [slots, KVH, capacity, D] live: host numpy arrays (ONNX Runtime binds them by
    address). The operations `BatchedEngine` performs on them, so a backend can keep them elsewhere (TensorRT: torch
    tensors on its device, engines/tensorrt_batch.py `DeviceKV`). `graph` is "target" or "drafter"."""

    def zeros(self, shape: tuple, graph: str) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def nbytes(self, buf) -> int:
        return buf.nbytes

    def copy_prefix(self, new, old, m: int, old_cap: int) -> None:
        """A grown buffer takes the old one's first `m` slots (all of its rows)."""
        new[:m, :, :old_cap] = old[:m]

    def slot_range(self, bufs: list, a: int, z: int) -> list:
        """Views of slots a..z-1 of each buffer (what a target call reads as its past)."""
        return [buf[a:z] for buf in bufs]

    def write_rows(self, bufs: list, news: list, rows: list[tuple[int, int, int, int, int]]) -> None:
        """New K/V rows into the buffers: per (i, slot, at, src, n), rows src..src+n-1 of sequence i of each output
        go to rows at..at+n-1 of `slot`."""
        for buf, new in zip(bufs, news):
            for i, slot, at, src, n in rows:
                buf[slot, :, at: at + n] = new[i, :, src: src + n]

    def move(self, bufs: list, dst: int, src: int, n: int) -> None:
        """The first `n` rows of slot `src` into slot `dst`."""
        for buf in bufs:
            buf[dst, :, :n] = buf[src, :, :n]

    def gather(self, bufs: list, slots: list[int], t: int) -> list:
        """Rows 0..t-1 of `slots` (any order) of each buffer, as new dense [len(slots), KVH, t, D] arrays."""
        idx = np.array(slots)
        return [buf[idx, :, :t] for buf in bufs]


class BatchGraphs(ABC):
    """Executes the batch graphs on host arrays (the K/V as its `kv_store` holds them); what `BatchedEngine` needs of a
    backend besides its bookkeeping.

    Graph protocol (the export's "ort" flavor graphs; TensorRT compiles plain-op copies of the same graphs):
      target_batch  in:  inputs_embeds [B,S,H] f32, num_logits [] i64 (= S), position_ids [B,S] i64,
                         past_bias [B,P] f32 (0 visible, -inf past the sequence's length), past_key_i / past_value_i
                         [B,KVH,P,D] f32 (the K/V buffers' slot range, read only)
                    out: hidden [B,S,H], ctx [B,S,H_drafter], new_key_i / new_value_i [B,KVH,S,D]
      drafter       in:  ctx [B,C,H_drafter], ctx_positions [B,C] i64, block_embeds [B,bs,H], block_positions [B,bs]
                         i64, key_bias [B,T+C+bs] f32 (drafters that batch), past_ctx_key_i / value_i [B,KVH,T,D]
                    out: hidden [B,bs-1,H] (+ selector_hidden), present_ctx_key_i / value_i [B,KVH,T+C,D]
      lm_head / draft_head  hidden [1,N,H] -> logits [1,N,V]
    """

    info: EngineInfo
    codec: object
    t_layers: int
    t_kv_heads: int
    t_head_dim: int
    d_layers: int
    d_kv_heads: int
    d_head_dim: int
    drafter_batches: bool   # the drafter takes key_bias: B padded sequences per call
    has_selector: bool      # DFlash 2: the drafter also returns selector_hidden
    mask_row: np.ndarray    # the mask token's embedding row [H]

    def kv_store(self) -> HostKV:
        """Where the batch's K/V buffers live (host arrays unless a backend keeps them on its device)."""
        return HostKV()

    @abstractmethod
    def embed_rows(self, ids) -> np.ndarray:
        """Embedding rows of `ids` as a fresh [n, H] float32 array."""

    @abstractmethod
    def target_batch(self, feeds: dict[str, np.ndarray], past: list[np.ndarray]) -> list[np.ndarray]:
        """Run target_batch: `feeds` are the non-K/V inputs, `past` the per-layer key, value buffers (key_0, value_0,
        key_1, ...), as `kv_store` holds them. Returns [hidden, ctx, new_key_0, new_value_0, ...]: hidden and ctx
        host arrays, the new K/V rows as `kv_store` takes them."""

    @abstractmethod
    def drafter(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run the drafter; returns the outputs `names`, in order (past_ctx_* feeds and present_ctx_* outputs as
        `kv_store` holds them, the others host arrays)."""

    @abstractmethod
    def lm_head(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [1, N, H] -> logits [N, V]."""

    @abstractmethod
    def draft_head(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [1, N, H] -> draft logits [N, V_draft]."""

    @abstractmethod
    def drafts_from_logits(self, seq: Sequence, logits: np.ndarray, selector_hidden, anchor: int,
                           sp: SamplingParams, uniforms):
        """One block's draft-head logits -> (drafts, draft probs or None), as the single-sequence engine drafts."""


class OrtBatchGraphs(BatchGraphs):
    """`BatchGraphs` over an `OrtEngine`'s sessions (target_batch.onnx loaded on first use)."""

    def __init__(self, engine: OrtEngine):
        e = engine
        self.engine, self.info, self.codec = e, e.info, e.codec
        self.t_layers, self.t_kv_heads, self.t_head_dim = e.t_layers, e.t_kv_heads, e.t_head_dim
        self.d_layers, self.d_kv_heads, self.d_head_dim = e.d_layers, e.d_kv_heads, e.d_head_dim
        self.drafter_batches = e.drafter_batches
        self.has_selector = bool(e._selector)
        self.mask_row = e._mask_row

    def embed_rows(self, ids) -> np.ndarray:
        return self.engine._embed.rows(ids)

    def target_batch(self, feeds, past):
        sess = self.engine.batch_target_session()
        io = sess.io_binding()
        io.bind_output("hidden", "cpu")
        io.bind_output("ctx", "cpu")
        for i in range(self.t_layers):
            for j, kind in enumerate(("key", "value")):
                io.bind_cpu_input(f"past_{kind}_{i}", past[2 * i + j])
                io.bind_output(f"new_{kind}_{i}", "cpu")
        for name, value in feeds.items():
            io.bind_cpu_input(name, value)
        sess.run_with_iobinding(io)
        return [o.numpy() for o in io.get_outputs()]

    def drafter(self, names, feeds):
        return self.engine.drafter.run(names, feeds)

    def lm_head(self, hidden):
        return self.engine._logits(hidden)  # padded to the engine's row floor, as its single-sequence steps

    def draft_head(self, hidden):
        return self.engine.draft_head.run(["logits"], {"hidden": hidden})[0][0]

    def drafts_from_logits(self, seq, logits, selector_hidden, anchor, sp, uniforms):
        return self.engine.drafts_from_logits(seq, logits, selector_hidden, anchor, sp, uniforms)


class BatchedEngine:
    """B sequences per call over a `BatchGraphs`: the slots, K/V buffers and context bookkeeping. Not thread-safe:
    one scheduler drives it. Every target call runs target_batch (prefills included: an empty past, all masked).

    Call order per sequence: `add`, `prefill` (in a group of new sequences), then steps of `draft` (optional, for
    the sequences that speculate) and `target_step` + `commit` (all active sequences), `remove` when done.
    """

    def __init__(self, graphs: BatchGraphs, max_batch: int = 16):
        if max_batch < 1:
            raise DFlashError(f"must be >= 1, got {max_batch}", field="max_batch")
        self.graphs = graphs
        self.info = graphs.info
        self.codec = graphs.codec
        self.max_batch = max_batch
        self.seqs: list[BatchSeq] = []  # by slot
        self._buf = _Buffers()
        self._kv = graphs.kv_store()
        # Called with (bytes, slots, target capacity) whenever the K/V buffers are reallocated or released: the
        # served model logs it, so memory growth under load can be told apart from K/V growth (benchmarks/soak.py).
        self.on_resize = None
        # True: the buffers outlive an emptied batch (reused by the next requests, freed by `release`) -- a server
        # whose batch empties and refills every few seconds would otherwise free and reallocate hundreds of MB each
        # time, and the freed heap pages stay in its RSS.
        self.keep_buffers = False
        g = graphs
        self._t_shape = (g.t_kv_heads, g.t_head_dim)
        self._d_shape = (g.d_kv_heads, g.d_head_dim)

    def preload(self) -> None:
        """Load every graph a step may need now (a served model's memory is all there once it reports ready, and no
        request pays for a load). Backends that load their batch graphs when the batch is made need nothing here."""

    # Slots and memory -----------------------------------------------------------------------------------------------

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the batch's K/V buffers now."""
        return sum(self._kv.nbytes(b) for b in self._buf.t_kv + self._buf.d_kv)

    def add(self, max_tokens: int) -> BatchSeq:
        """A new sequence in the next free slot; `max_tokens`: how long it may grow (prompt + new tokens + a block)."""
        if len(self.seqs) >= self.max_batch:
            raise DFlashError(f"the batch is full ({self.max_batch} sequences)", field="max_batch")
        if max_tokens > self.info.max_seq_len:
            raise DFlashError(f"{max_tokens} tokens exceed the engine's max_seq_len {self.info.max_seq_len}",
                              field="max_tokens")
        seq = BatchSeq(max_tokens)
        seq.slot = len(self.seqs)
        self.seqs.append(seq)
        self._reserve(len(self.seqs), max(s.max_tokens for s in self.seqs))
        return seq

    def remove(self, seq: BatchSeq) -> None:
        """Free `seq`'s slot: the last slot's committed rows move into it (slots stay dense). Call it between
        steps, after every `commit` of the step (rows of an uncommitted step would not move)."""
        if seq.slot < 0 or seq.slot >= len(self.seqs) or self.seqs[seq.slot] is not seq:
            raise DFlashError("sequence is not in this batch", field="sequence")
        hole, last = seq.slot, len(self.seqs) - 1
        if hole != last:
            mover = self.seqs[last]
            self._kv.move(self._buf.t_kv, hole, last, mover.length)
            self._kv.move(self._buf.d_kv, hole, last, mover.d_len)
            mover.slot = hole
            self.seqs[hole] = mover
        self.seqs.pop()
        seq.slot = -1
        if not self.seqs and not self.keep_buffers:  # an idle engine holds no K/V
            self.release()

    def release(self) -> None:
        """Free the K/V buffers if no sequence is active (a server calls it once the batch has been idle a while)."""
        if self.seqs or not self._buf.slots:
            return
        self._buf = _Buffers()
        if self.on_resize is not None:
            self.on_resize(0, 0, 0)

    def _reserve(self, slots: int, t_need: int, d_need: int = 0) -> None:
        b = self._buf
        if slots <= b.slots and t_need <= b.t_cap and d_need <= b.d_cap:
            return
        # Grow by doubling (bounded by the batch bound and max_seq_len) so joins and long contexts rarely copy.
        new_slots = max(slots, min(self.max_batch, 2 * b.slots)) if slots > b.slots else b.slots
        t_cap = max(t_need, min(self.info.max_seq_len, 2 * b.t_cap)) if t_need > b.t_cap else b.t_cap
        d_cap = max(d_need, 2 * b.d_cap, 64) if d_need > b.d_cap else b.d_cap
        n = len(self.seqs)
        e = self.graphs

        def grow(old: list, layers: int, shape, cap, old_cap, graph: str):
            out = []
            for i in range(2 * layers):
                buf = self._kv.zeros((new_slots, shape[0], cap, shape[1]), graph)
                if old:
                    m = min(n, old[i].shape[0])
                    self._kv.copy_prefix(buf, old[i], m, old_cap)
                out.append(buf)
            return out

        t_kv = b.t_kv if (new_slots, t_cap) == (b.slots, b.t_cap) else grow(b.t_kv, e.t_layers, self._t_shape,
                                                                             t_cap, b.t_cap, "target")
        d_kv = b.d_kv if (new_slots, d_cap) == (b.slots, b.d_cap) else grow(b.d_kv, e.d_layers, self._d_shape,
                                                                             d_cap, b.d_cap, "drafter")
        self._buf = _Buffers(t_kv, d_kv, new_slots, t_cap, d_cap)
        if self.on_resize is not None:
            self.on_resize(self.kv_bytes, new_slots, t_cap)

    def _range(self, seqs: list[BatchSeq]) -> tuple[int, int]:
        slots = [s.slot for s in seqs]
        if not seqs or slots != list(range(slots[0], slots[0] + len(seqs))) or slots[0] < 0 \
                or slots[-1] >= len(self.seqs):
            raise DFlashError("a batched target call takes a contiguous range of slots, in slot order")
        return slots[0], slots[-1] + 1

    # Target -------------------------------------------------------------------------------------------------------

    def _run_target_batch(self, seqs: list[BatchSeq], blocks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Blocks of B sequences over their pasts in one call of target_batch (attention in plain ops: it reads
        the K/V buffer and returns the new rows, written back here for the real rows only)."""
        a, z = self._range(seqs)
        s = max(len(x) for x in blocks)
        cap = self._buf.t_cap
        embeds = np.empty((len(seqs), s, self.graphs.mask_row.shape[0]), np.float32)
        pos = np.empty((len(seqs), s), np.int64)
        bias = np.zeros((len(seqs), cap), np.float32)
        for i, (seq, blk) in enumerate(zip(seqs, blocks)):
            if len(blk) == 0:
                raise DFlashError("empty block", field="input_ids")
            if seq.length + s > min(self.info.max_seq_len, cap):
                raise DFlashError(f"sequence would reach {seq.length + s} tokens, over its room", field="max_tokens")
            embeds[i, : len(blk)] = self.graphs.embed_rows(blk)
            embeds[i, len(blk):] = embeds[i, len(blk) - 1]
            pos[i] = np.arange(seq.length, seq.length + s)
            bias[i, seq.length:] = -np.inf
        past = self._kv.slot_range(self._buf.t_kv, a, z)
        feeds = {"inputs_embeds": embeds, "num_logits": np.array(s, np.int64), "position_ids": pos, "past_bias": bias}
        outs = self.graphs.target_batch(feeds, past)
        self._kv.write_rows(self._buf.t_kv, outs[2:],
                            [(i, seq.slot, seq.length, 0, len(blk)) for i, (seq, blk) in enumerate(zip(seqs, blocks))])
        return outs[0], outs[1]

    def _prefill_rows(self, seqs: list[BatchSeq], ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Hidden [B, S, H] and ctx [B, S, H_d] of new sequences' prompts (right-padded to the longest)."""
        for seq in seqs:
            if seq.length:
                raise DFlashError("prefill runs once, on a new sequence")
        return self._run_target_batch(seqs, ids)

    def _step_rows(self, seqs: list[BatchSeq], blocks: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each sequence's (hidden [n_b, H], ctx [n_b, H_d]) for its block at positions length.."""
        hidden, ctx = self._run_target_batch(seqs, blocks)
        return [(hidden[i, : len(b)], ctx[i, : len(b)]) for i, b in enumerate(blocks)]

    def _head(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """LM head over each sequence's hidden rows [n_b, H], in one call -> logits [n_b, V] each."""
        cat = np.concatenate(rows, axis=0)[None]
        logits = self.graphs.lm_head(cat)
        return np.split(logits, np.cumsum([len(r) for r in rows])[:-1])

    def prefill(self, seqs: list[BatchSeq], prompts: list) -> list[np.ndarray]:
        """Prompts [S_b] int64 of new sequences (a contiguous slot range) -> each one's last-position logits [V]."""
        ids = [np.asarray(p, np.int64) for p in prompts]
        hidden, ctx = self._prefill_rows(seqs, ids)
        for i, (seq, p) in enumerate(zip(seqs, ids)):
            n = len(p)
            if seq.keep_context:
                seq.ctx_parts = [ctx[i, :n].copy()]
            seq.length = n
        return [row[-1] for row in self._head([hidden[i, len(p) - 1: len(p)] for i, p in enumerate(ids)])]

    def target_step(self, seqs: list[BatchSeq], blocks: list) -> list[np.ndarray]:
        """One target forward for every sequence: block [n_b] = anchor + drafts to verify (n_b = 1: a plain step).
        Returns logits [n_b, V] per sequence. Nothing is committed until `commit`."""
        blocks = [np.asarray(b, np.int64) for b in blocks]
        rows = self._step_rows(seqs, blocks)
        for seq, (_, c) in zip(seqs, rows):
            seq._step_ctx = c if seq.keep_context else None
        return self._head([h for h, _ in rows])

    def commit(self, seq: BatchSeq, accept: int) -> None:
        """Commit the anchor + `accept` drafts of the last `target_step`: their context features join the pending
        ones (in order), the rows past them are stale and get overwritten by the next step."""
        if seq._step_ctx is not None:
            seq.ctx_parts.append(seq._step_ctx[: accept + 1].copy())
        seq._step_ctx = None
        seq.length += accept + 1

    # Drafter ------------------------------------------------------------------------------------------------------

    def draft(self, seqs: list[BatchSeq], anchors: list[int], sps: list[SamplingParams], uniforms: list,
              block_lens: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Draft one block per sequence (any subset of the batch, each with pending context features).

        block_lens[b] <= block_size: sequence b's block (anchor + masks). Returns per sequence (drafts
        [block_len - 1] int64, draft probs [block_len - 1, V] when sampling else None); greedy sets
        seq.draft_confidence, as OrtEngine.draft does."""
        g = self.graphs
        for seq in seqs:
            if not seq.ctx_parts:
                raise DFlashError("draft() needs new context: prefill or a step first", field="sequence")
        groups = [list(range(len(seqs)))] if g.drafter_batches else [[i] for i in range(len(seqs))]
        out: list = [None] * len(seqs)
        for group in groups:
            g_seqs = [seqs[i] for i in group]
            hidden, sel = self._run_drafter(g_seqs, [anchors[i] for i in group], [block_lens[i] for i in group])
            logits = g.draft_head(np.concatenate([hidden[j, : block_lens[i] - 1] for j, i in enumerate(group)])[None])
            parts = np.split(logits, np.cumsum([block_lens[i] - 1 for i in group])[:-1])
            for j, i in enumerate(group):
                seqs[i].draft_confidence = None
                out[i] = g.drafts_from_logits(seqs[i], parts[j], None if sel is None else sel[j, : block_lens[i] - 1],
                                              anchors[i], sps[i], uniforms[i])
        return out

    def _run_drafter(self, seqs: list[BatchSeq], anchors: list[int], block_lens: list[int]):
        g = self.graphs
        nb = len(seqs)
        pend = [s.pending_context() for s in seqs]
        t_pad = max(s.d_len for s in seqs)
        c_pad = max(len(c) for c in pend)
        b_pad = max(block_lens)
        self._reserve(len(self.seqs), self._buf.t_cap, max(s.d_len + len(c) for s, c in zip(seqs, pend)))
        h_d = pend[0].shape[1]
        ctx = np.zeros((nb, c_pad, h_d), np.float32)
        ctx_pos = np.zeros((nb, c_pad), np.int64)
        block = np.empty((nb, b_pad, g.mask_row.shape[0]), np.float32)
        block[:] = g.mask_row
        block_pos = np.empty((nb, b_pad), np.int64)
        bias = np.zeros((nb, t_pad + c_pad + b_pad), np.float32)
        anchor_rows = g.embed_rows(anchors)
        for i, s in enumerate(seqs):
            c = len(pend[i])
            ctx[i, :c], ctx_pos[i, :c] = pend[i], np.arange(s.d_len, s.d_len + c)
            block[i, 0] = anchor_rows[i]
            block_pos[i] = np.arange(s.length, s.length + b_pad)
            bias[i, s.d_len: t_pad] = -np.inf
            bias[i, t_pad + c: t_pad + c_pad] = -np.inf
            bias[i, t_pad + c_pad + block_lens[i]:] = -np.inf
        if b_pad > self.info.block_size or int(block_pos.max()) >= self.info.max_seq_len:
            raise DFlashError(f"a block at {int(block_pos.max())} passes the engine's max_seq_len", field="max_tokens")
        feeds = {"ctx": ctx, "ctx_positions": ctx_pos, "block_embeds": block, "block_positions": block_pos}
        if g.drafter_batches:
            feeds["key_bias"] = bias
        past = self._kv.gather(self._buf.d_kv, [s.slot for s in seqs], t_pad)
        for i in range(g.d_layers):
            for j, kind in enumerate(("key", "value")):
                feeds[f"past_ctx_{kind}_{i}"] = past[2 * i + j]
        extra = ["selector_hidden"] if g.has_selector else []
        names = ["hidden"] + extra + [f"present_ctx_{k}_{i}" for i in range(g.d_layers) for k in ("key", "value")]
        res = g.drafter(names, feeds)
        # the new context rows join each sequence's cache
        self._kv.write_rows(self._buf.d_kv, res[1 + len(extra):],
                            [(i, s.slot, s.d_len, t_pad, len(pend[i])) for i, s in enumerate(seqs)])
        for i, s in enumerate(seqs):
            s.d_len += len(pend[i])
            s.ctx_parts = []
        return res[0], (res[1] if extra else None)


class BatchedOrtEngine(BatchedEngine):
    """`BatchedEngine` over an `OrtEngine`'s sessions. Prefills and the steps GroupQueryAttention takes (one sequence;
    one-row steps of fp32 engines) run the engine's in-place GQA graph over the batch's buffers; many-row steps of
    several sequences run target_batch.onnx."""

    def __init__(self, engine: OrtEngine, max_batch: int = 16):
        if not isinstance(engine, OrtEngine):
            raise DFlashError(f"batched decoding runs on the onnxruntime backend (got {engine.info.backend})",
                              field="backend")
        super().__init__(OrtBatchGraphs(engine), max_batch)
        self.engine = engine

    def _run_target(self, seqs: list[BatchSeq], blocks: list[np.ndarray], prefill: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's ids [n_b] at positions length..; returns hidden [B, S, H] and ctx [B, S, H_d]."""
        e = self.engine
        a, z = self._range(seqs)
        s = max(len(x) for x in blocks)
        if s < e.row_floor and all(q.length + e.row_floor <= min(self.info.max_seq_len, self._buf.t_cap)
                                   for q in seqs):
            s = e.row_floor  # steps shorter than the engine's row floor run padded, as OrtEngine's (numerics.py)
        for seq, blk in zip(seqs, blocks):
            if len(blk) == 0:
                raise DFlashError("empty block", field="input_ids")
            if prefill and seq.length:
                raise DFlashError("prefill runs once, on a new sequence")
            if seq.length + s > self.info.max_seq_len or seq.length + s > self._buf.t_cap:
                raise DFlashError(f"sequence would reach {seq.length + s} tokens, over its room "
                                  f"({min(self.info.max_seq_len, self._buf.t_cap)})", field="max_tokens")
        embeds = np.empty((len(seqs), s, e._mask_row.shape[0]), np.float32)
        for i, blk in enumerate(blocks):
            embeds[i, : len(blk)] = e._embed.rows(blk)
            embeds[i, len(blk):] = embeds[i, len(blk) - 1]  # padding rows: finite values nobody attends to
        lengths = np.array([q.length for q in seqs], np.int64)
        # Prefill: GQA's first-prompt form (total_seq_len == S), each row sees the rows before it; steps: each
        # sequence's past is its committed length (seqlens_k = length + S - 1).
        seqlens = (lengths + s - 1).astype(np.int32)
        total = int(seqlens.max()) + 1
        io = e.target.io_binding()
        io.bind_output("hidden", "cpu")
        io.bind_output("ctx", "cpu")
        for i in range(e.t_layers):
            for j, kind in enumerate(("key", "value")):
                view = self._buf.t_kv[2 * i + j][a:z]
                io.bind_cpu_input(f"past_{kind}_{i}", view)
                io.bind_output(f"present_{kind}_{i}", "cpu", 0, np.float32, view.shape, view.ctypes.data)
        io.bind_cpu_input("inputs_embeds", embeds)
        io.bind_cpu_input("num_logits", np.array(s, np.int64))
        io.bind_cpu_input("seqlens_k", seqlens)
        io.bind_cpu_input("total_seq_len", np.array(total, np.int32))
        if e.graph_pads:  # padded here on the host already: every region runs the call's own rows (row_pad.py)
            io.bind_cpu_input("row_index", np.arange(s, dtype=np.int64))
        if e.tree_verify:  # the graph's draft-tree inputs: consecutive positions, no bias (chains only here)
            io.bind_cpu_input("position_ids", (lengths[:, None] + np.arange(s)).astype(np.int64))
            io.bind_cpu_input("attention_bias", np.zeros((len(seqs), 1, s, total), np.float32))
        e.target.run_with_iobinding(io)
        outs = io.get_outputs()
        return outs[0].numpy(), outs[1].numpy()

    def preload(self) -> None:
        self.engine.batch_target_session()  # target_batch.onnx: a second copy of the target's weights

    def _prefill_rows(self, seqs, ids):
        return self._run_target(seqs, ids, prefill=True)

    def _step_rows(self, seqs, blocks):
        # GQA's in-place graph for one sequence and for one-row steps of engines whose row floor is 1 (others run
        # one-token steps padded to their floor, which GQA takes for one sequence a call only).
        if len(seqs) == 1 or (max(len(b) for b in blocks) == 1 and self.engine.row_floor == 1):
            hidden, ctx = self._run_target(seqs, blocks, prefill=False)
            return [(hidden[i, : len(b)], ctx[i, : len(b)]) for i, b in enumerate(blocks)]
        if self.engine.batch_target_session() is not None:
            return super()._step_rows(seqs, blocks)
        # engines built before target_batch.onnx: GQA (CPU) takes many rows over a past one sequence a call
        rows = []
        for seq, blk in zip(seqs, blocks):
            hidden, ctx = self._run_target([seq], [blk], prefill=False)
            rows.append((hidden[0, : len(blk)], ctx[0, : len(blk)]))
        return rows
