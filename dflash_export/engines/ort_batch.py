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
- Target, many rows over several pasts (target_batch: attention in plain ops over the K/V buffer, which GQA on CPU
  refuses for B > 1): the call's rows go in packed, each sequence's block after the previous one's, with no padding
  (`grid_rows`, `cells`); norms, projections and the MLP run on those rows alone, and only attention (and a hybrid's
  Gated DeltaNet) runs on the [B, S] grid of blocks padded to the longest. So a call costs the rows its sequences
  verify, not B x S: one sequence's long block costs the others nothing. A call of fewer rows than the engine's row
  floor runs its whole grid, padded, as its one-row product kernels would otherwise round differently.
- Draft trees (`target_step`'s `trees`): a sequence's block may be a whole tree, its rows the nodes, at positions
  length + depth, each seeing only its ancestors among the new rows (GQA's `attention_bias` for one sequence a
  call, target_batch's `block_bias` [B,S,S] for several; the other sequences of the call keep causal blocks).
  Sliding-window layers hide keys by position: GQA's `window_bias_W` per sequence (`onnxruntime.window_bias`),
  target_batch's window mask over each key's position (a committed key's slot, a block key's position_ids).
  `commit` with the accepted path moves those nodes' K/V rows down to consecutive rows of the slot (their RoPE
  positions are already those rows') and keeps their context features: the tree's other rows become stale.
- Drafter (context K/V outside the graph, `key_bias` input): each sequence's cached context, its new context
  features and its block are padded to the call's longest, and key_bias (-inf) hides every padding key from every
  query. With no padding (a batch of one) the bias is all zeros and the drafts are the unbatched graph's, bit for bit.
  Drafters with causal / sliding-window layers (no key_bias) draft one sequence per call inside a batched step.
- LM head and draft head: one call over the rows every sequence needs (the head is row-wise).

- Hybrid targets' Gated DeltaNet layers (export/linear_attention.py): each slot holds its sequence's committed conv
  window [C, K-1] and recurrent state [Hv, Dk, Dv] per linear layer; a call reads its slot range's and returns
  every row's conv input and state update, and `commit` makes, per sequence, the ones after its last accepted row
  its slot's (`engines.onnxruntime.committed_linear`; padding rows come after every real row, so they change no
  real row's state). Prompts prefill one sequence a call in chunks of HYBRID_PREFILL_ROWS, as the
  single-sequence engine's.

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

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from dflash_export.engines.base import EngineInfo, SamplingParams, Sequence
from dflash_export.engines.onnxruntime import (
    HYBRID_PREFILL_ROWS,
    LINEAR_OUTPUTS,
    OrtEngine,
    committed_linear,
    linear_outputs,
    window_bias,
)
from dflash_export.errors import DFlashError


def _unpack(packed, cells: np.ndarray, b: int, s: int) -> np.ndarray:
    """Packed rows [1, T, C] -> the grid [B, S, C], cell cells[r] holding row r."""
    packed = np.asarray(packed)[0]
    grid = np.zeros((b * s, packed.shape[-1]), np.float32)
    grid[cells] = packed
    return grid.reshape(b, s, -1)


def tree_rows(length: int, rows: int, tree) -> tuple[np.ndarray, np.ndarray]:
    """position_ids [rows] and block_bias [rows, rows] of a draft tree's block after `length` committed tokens:
    nodes at length + depth, each seeing only its ancestors among the new rows (the graph's causal mask hides the
    later rows); rows past the tree (padding) continue its last position and nobody attends to them."""
    n = len(tree)
    pos = np.empty(rows, np.int64)
    pos[:n] = length + np.asarray(tree.depths, np.int64)
    pos[n:] = pos[n - 1] + 1 + np.arange(rows - n)
    bias = np.zeros((rows, rows), np.float32)
    bias[:n, :n] = np.where(tree.ancestor_mask(), 0.0, -np.inf)
    return pos, bias


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
        self._step_tree = None                    # the draft tree (decoding/tree.DraftTree) the step verifies, if any
        # Hybrids: the last target call's Gated DeltaNet outputs ({layer: its LINEAR_OUTPUTS}, this sequence's
        # index in that call), until `commit`
        self._step_linear: tuple[dict, int] | None = None

    def pending_context(self) -> np.ndarray:
        """The pending features as one array [n, H_drafter] (kept as one chunk from then on)."""
        if len(self.ctx_parts) > 1:
            self.ctx_parts = [np.concatenate(self.ctx_parts)]
        return self.ctx_parts[0]


# The target buffers' rows grow and shrink in steps of this many (and of key_align): every batched call's attention
# runs over all of them, and a resize copies the buffers about as one call copies its past into the scores' keys, so
# a resize every ROW_STEP rows costs less than attending over rows no sequence has reached (benchmarks/kv_rows.py)
ROW_STEP = 64


@dataclass
class _Buffers:
    """Per-layer K/V buffers [slots, KVH, capacity, D] (target) or [slots, KVH, capacity, D] (drafter context), held
    as the graphs' `kv_store` keeps them (host arrays: `HostKV`)."""

    t_kv: list[np.ndarray] = field(default_factory=list)
    d_kv: list[np.ndarray] = field(default_factory=list)
    # hybrids: per Gated DeltaNet layer its committed (conv window [slots, C, K-1], recurrent state [slots, Hv, Dk,
    # Dv]), host arrays
    linear: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
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

    def move_rows(self, bufs: list, slot: int, at: int, nodes: list[int]) -> None:
        """Rows at + nodes[r] of `slot` into rows at + r (a draft tree's accepted path, kept in place: node indices
        grow along a path, so no row is overwritten before it is read; the gather copies first anyway)."""
        idx = at + np.asarray(nodes, np.int64)
        for buf in bufs:
            buf[slot, :, at: at + len(nodes)] = buf[slot][:, idx]  # (buf[slot, :, idx] would put idx's axis first)

    def gather(self, bufs: list, slots: list[int], t: int) -> list:
        """Rows 0..t-1 of `slots` (any order) of each buffer, as new dense [len(slots), KVH, t, D] arrays."""
        idx = np.array(slots)
        return [buf[idx, :, :t] for buf in bufs]


class BatchGraphs(ABC):
    """Executes the batch graphs on host arrays (the K/V as its `kv_store` holds them); what `BatchedEngine` needs of a
    backend besides its bookkeeping.

    Graph protocol (the export's "ort" flavor graphs; TensorRT compiles plain-op copies of the same graphs):
      target_batch  in:  inputs_embeds [B,S,H] f32, num_logits [] i64 (= S), position_ids [B,S] i64,
                         past_bias [B,P] f32 (0 visible, -inf past the sequence's length), block_bias [B,S,S] f32
                         (graphs with `target_trees`: 0 / -inf over the new rows, on top of the causal mask; a draft
                         tree hides every row that is not an ancestor), past_key_i / past_value_i [B,KVH,P,D] f32 (the
                         K/V buffers' slot range, read only)
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
    target_trees: bool = False  # target_batch takes block_bias: each sequence's block may be a draft tree
    # Hybrid targets: per Gated DeltaNet layer the shapes of one sequence's (conv window [C, K-1], recurrent state
    # [Hv, Dk, Dv]); those layers have no K/V. target_batch then also takes conv_state_i [B,C,K-1] /
    # recurrent_state_i [B,Hv,Dk,Dv] and returns each layer's LINEAR_OUTPUTS (engines/onnxruntime.py).
    linear_layers: dict[int, tuple] = {}  # noqa: RUF012 - read only; a backend with hybrids sets its own
    has_selector: bool      # DFlash 2: the drafter also returns selector_hidden
    mask_row: np.ndarray    # the mask token's embedding row [H]

    def kv_store(self) -> HostKV:
        """Where the batch's K/V buffers live (host arrays unless a backend keeps them on its device)."""
        return HostKV()

    def kv_layers(self) -> list[int]:
        """The target layers with K/V (every layer but a hybrid's Gated DeltaNet ones)."""
        return [i for i in range(self.t_layers) if i not in self.linear_layers]

    @abstractmethod
    def embed_rows(self, ids) -> np.ndarray:
        """Embedding rows of `ids` as a fresh [n, H] float32 array."""

    @abstractmethod
    def target_batch(self, feeds: dict[str, np.ndarray], past: list[np.ndarray]) -> list[np.ndarray]:
        """Run target_batch: `feeds` are the non-K/V inputs, `past` the per-layer key, value buffers (key_0, value_0,
        key_1, ...; K/V layers only), as `kv_store` holds them. Returns [hidden, ctx, new_key_0, new_value_0, ...]:
        hidden and ctx host arrays, the new K/V rows as `kv_store` takes them; hybrids then the LINEAR_OUTPUTS of
        each Gated DeltaNet layer in layer order (host arrays)."""

    @abstractmethod
    def drafter(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run the drafter; returns the outputs `names`, in order (past_ctx_* feeds and present_ctx_* outputs as
        `kv_store` holds them, the others host arrays)."""

    @abstractmethod
    def lm_head(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [1, N, H] -> logits [N, V]."""

    @property
    def greedy_head(self):
        """The engine's exact greedy head (engines/greedy_head.py) where it has one: greedy rows take their token
        from it, as the single-sequence engine's greedy steps do."""
        return None

    @abstractmethod
    def draft_head(self, hidden: np.ndarray, greedy: bool = False) -> np.ndarray:
        """hidden [1, N, H] -> draft logits [N, V_draft]; `greedy`: every row drafts greedily (an engine may read a
        cheaper copy of the head then, as the single-sequence engine's greedy drafts do)."""

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
        self.linear_layers = {i: (conv[1:], rec[1:]) for i, (conv, rec) in e.linear_layers.items()}
        self.has_selector = bool(e._selector)
        self.mask_row = e._mask_row

    @property
    def target_trees(self) -> bool:
        sess = self.engine.batch_target_session()
        return sess is not None and any(i.name == "block_bias" for i in sess.get_inputs())

    def embed_rows(self, ids) -> np.ndarray:
        return self.engine._embed.rows(ids)

    def target_batch(self, feeds, past):
        sess = self.engine.batch_target_session()
        io = sess.io_binding()
        io.bind_output("hidden", "cpu")
        io.bind_output("ctx", "cpu")
        for n, i in enumerate(self.kv_layers()):
            for j, kind in enumerate(("key", "value")):
                io.bind_cpu_input(f"past_{kind}_{i}", past[2 * n + j])
                io.bind_output(f"new_{kind}_{i}", "cpu")
        for i in self.linear_layers:
            for name in LINEAR_OUTPUTS:
                io.bind_output(f"{name}_{i}", "cpu")
        for name, value in feeds.items():
            io.bind_cpu_input(name, value)
        sess.run_with_iobinding(io)
        return [o.numpy() for o in io.get_outputs()]

    def drafter(self, names, feeds):
        return self.engine.drafter.run(names, feeds)

    def lm_head(self, hidden):
        return self.engine._logits(hidden)  # padded to the engine's row floor, as its single-sequence steps

    @property
    def greedy_head(self):
        return self.engine.greedy_head

    def draft_head(self, hidden, greedy=False):
        return self.engine.draft_logits(hidden, greedy)

    def drafts_from_logits(self, seq, logits, selector_hidden, anchor, sp, uniforms):
        return self.engine.drafts_from_logits(seq, logits, selector_hidden, anchor, sp, uniforms)


class BatchedEngine:
    """B sequences per call over a `BatchGraphs`: the slots, K/V buffers and context bookkeeping. Not thread-safe:
    one scheduler drives it. Every target call runs target_batch (prefills included: an empty past, all masked).

    The target K/V buffers' length (the padded key length every batched attention runs over) is a multiple of
    `key_align` (64 on ONNX Runtime): its softmax sums a row in vector lanes, so a block's own keys, which the graph
    appends after the buffer, land in lanes set by the buffer's length; were that length to move with the batch's
    other requests, so would a request's logits in the last bits (int4's int8-quantized activations amplify that to
    ~0.9 on SmolLM2: docs/numerics.md). 64 covers every lane width up to AVX-512's 16 floats x 4.

    Call order per sequence: `add`, `prefill` (in a group of new sequences), then steps of `draft` (optional, for
    the sequences that speculate) and `target_step` + `commit` (all active sequences), `remove` when done.
    """

    key_align = 1
    row_floor = 1  # the fewest rows a target call runs (engines/numerics.py)

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
        # At most this many K/V token cells (slots x target rows) once the buffers grow (None: unbounded): growth
        # that would take them past it allocates the most rows within it instead. The runtime admits
        # sequences only while `kv_cells` stays within it (runtime/batching.py `max_kv_tokens`).
        self.kv_token_limit: int | None = None
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
        states = sum(a.nbytes + b.nbytes for a, b in self._buf.linear.values())
        return sum(self._kv.nbytes(b) for b in self._buf.t_kv + self._buf.d_kv) + states

    def kv_cells(self, extra: int = 0) -> int:
        """The K/V token cells (slots x rows) the target buffers need for the batch's sequences and, `extra` > 0, one
        more of `extra` tokens: every slot as long as the longest sequence's `max_tokens`, rounded up to key_align.
        The drafter's context buffers hold at most as many rows (`_reserve`)."""
        lens = [s.max_tokens for s in self.seqs] + ([extra] if extra > 0 else [])
        return len(lens) * self.aligned(max(lens, default=0))

    def aligned(self, tokens: int) -> int:
        """`tokens` K/V rows rounded up to key_align: what a slot holding them takes."""
        return -(-tokens // self.key_align) * self.key_align

    def _rows(self, tokens: int) -> int:
        """The target buffers' length that holds `tokens` rows: a whole number of ROW_STEP and key_align, or the
        engine's max_seq_len (aligned) where that is less."""
        step = math.lcm(ROW_STEP, self.key_align)
        return max(self.aligned(tokens), min(-(-tokens // step) * step, self.aligned(self.info.max_seq_len)))

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
        # A slot now; its rows as the sequence grows (`_run_target_batch`): every call's attention runs over the
        # buffers' whole length, so reserving each request's `max_tokens` up front made every call of the batch pay
        # for the longest one's -- a chat request without max_tokens reserves max_seq_len.
        self._reserve(len(self.seqs), 0)
        for conv, rec in self._buf.linear.values():  # a reused slot's state is a past sequence's
            conv[seq.slot] = 0.0
            rec[seq.slot] = 0.0
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
            for conv, rec in self._buf.linear.values():
                conv[hole], rec[hole] = conv[last], rec[last]
            mover.slot = hole
            self.seqs[hole] = mover
        self.seqs.pop()
        seq.slot = -1
        if not self.seqs and not self.keep_buffers:  # an idle engine holds no K/V
            self.release()
        else:
            self._fit_rows()

    def _fit_rows(self) -> None:
        """Shorten the target buffers to what the longest sequence left needs (its rows and a block) once that gives
        up two ROW_STEPs or more: the longest sequence has left, and the rest (or the next requests, where the buffers
        outlive an empty batch) would otherwise attend over its rows."""
        b = self._buf
        need = max((s.length for s in self.seqs), default=0) + self.info.block_size
        rows = self._rows(need)
        if b.slots and rows + 2 * ROW_STEP <= b.t_cap:
            self._resize(b.slots, rows, min(b.d_cap, rows))

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
        # Slots grow by doubling (bounded by the batch bound) so joins rarely copy: a call runs over its slot range
        # only. Rows grow by ROW_STEP to what the call needs: every call's attention runs over all of them.
        new_slots = max(slots, min(self.max_batch, 2 * b.slots)) if slots > b.slots else b.slots
        t_cap = self._rows(t_need) if t_need > b.t_cap else b.t_cap  # may pass max_seq_len: those rows stay masked
        limit = self.kv_token_limit
        if limit is not None and (new_slots, t_cap) != (b.slots, b.t_cap) and new_slots * t_cap > limit:
            # Doubled slots, or the rows kept for a longer sequence that has left, would pass the bound: the buffers
            # take the most rows within it, never fewer than the call needs (admission keeps every sequence's
            # `max_tokens` within it), and fewer than before where that sequence's are given back
            new_slots = slots
            t_cap = max(self.aligned(t_need), min(t_cap, limit // slots // self.key_align * self.key_align))
        d_cap = max(d_need, 2 * b.d_cap, 64) if d_need > b.d_cap else b.d_cap
        # The drafter's context rows never pass the target's (a sequence's context is its committed tokens, within its
        # target rows): the drafter's cells stay within the target's, as deploy/kv_memory.py counts them
        d_cap = max(d_need, min(d_cap, t_cap))
        self._resize(new_slots, t_cap, d_cap)

    def _resize(self, slots: int, t_cap: int, d_cap: int) -> None:
        """New buffers of `slots` x `t_cap` target rows and `d_cap` drafter context rows (those whose shape changes),
        holding the active sequences' rows: fewer than before only where none of them needs the rows given up."""
        b, n, e = self._buf, len(self.seqs), self.graphs

        def fresh(old: list, layers: int, shape, cap, old_cap, graph: str):
            out = []
            for i in range(2 * layers):
                buf = self._kv.zeros((slots, shape[0], cap, shape[1]), graph)
                if old:
                    m, rows = min(n, old[i].shape[0]), min(cap, old_cap)
                    self._kv.copy_prefix(buf, old[i][:, :, :rows], m, rows)
                out.append(buf)
            return out

        t_kv = b.t_kv if (slots, t_cap) == (b.slots, b.t_cap) else fresh(b.t_kv, len(e.kv_layers()),
                                                                         self._t_shape, t_cap, b.t_cap, "target")
        d_kv = b.d_kv if (slots, d_cap) == (b.slots, b.d_cap) else fresh(b.d_kv, e.d_layers, self._d_shape,
                                                                         d_cap, b.d_cap, "drafter")
        linear = b.linear
        if slots != b.slots:
            linear = {}
            for i, shapes in e.linear_layers.items():
                pair = tuple(np.zeros((slots, *shape), np.float32) for shape in shapes)
                for new, old in zip(pair, b.linear.get(i, ())):
                    m = min(n, old.shape[0])
                    new[:m] = old[:m]
                linear[i] = pair
        self._buf = _Buffers(t_kv, d_kv, linear, slots, t_cap, d_cap)
        if self.on_resize is not None:
            self.on_resize(self.kv_bytes, slots, t_cap)

    def _range(self, seqs: list[BatchSeq]) -> tuple[int, int]:
        slots = [s.slot for s in seqs]
        if not seqs or slots != list(range(slots[0], slots[0] + len(seqs))) or slots[0] < 0 \
                or slots[-1] >= len(self.seqs):
            raise DFlashError("a batched target call takes a contiguous range of slots, in slot order")
        return slots[0], slots[-1] + 1

    # Target -------------------------------------------------------------------------------------------------------

    def _run_target_batch(self, seqs: list[BatchSeq], blocks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Blocks of B sequences over their pasts in one call of target_batch (attention in plain ops: it reads
        the K/V buffer and returns the new rows, written back here for the real rows only). The graph takes the
        blocks' rows packed, so a call costs the rows its sequences verify, not B x the longest block; only the
        attention runs on the [B, S] grid. Returns hidden [B, S, H] and ctx [B, S, H_d] (rows past a block: 0)."""
        a, z = self._range(seqs)
        s = max(len(x) for x in blocks)
        lens = [len(x) for x in blocks]
        floor = -(-self.row_floor // len(seqs))  # fewer packed rows than the engine's row floor: the whole grid,
        padded = sum(lens) < self.row_floor     # padded as before packing (the product kernels' one-row path)
        # a call's rows may pass a sequence's own reservation (another sequence's tree sets S): grow the buffers, by
        # the padding rows too (a step the buffers' end leaves unpadded would run other kernels)
        grid = max(s, floor) if padded else s
        self._reserve(len(self.seqs), min(self.info.max_seq_len, max(q.length for q in seqs) + grid))
        cap = self._buf.t_cap
        if padded and s < floor and all(q.length + floor <= min(self.info.max_seq_len, cap) for q in seqs):
            s = floor
        pos = np.empty((len(seqs), s), np.int64)
        bias = np.zeros((len(seqs), cap), np.float32)
        grid_rows = np.empty((len(seqs), s), np.int64)
        cells, rows, t = [], [], 0
        for i, (seq, blk) in enumerate(zip(seqs, blocks)):
            if len(blk) == 0:
                raise DFlashError("empty block", field="input_ids")
            if seq.length + s > min(self.info.max_seq_len, cap):
                raise DFlashError(f"sequence would reach {seq.length + s} tokens, over its room", field="max_tokens")
            n = s if padded else len(blk)
            grid_rows[i, :n] = t + np.arange(n)
            grid_rows[i, n:] = t + n - 1  # padding cells read the block's last row: finite, unattended
            cells.extend(i * s + np.arange(n))
            t += n
            rows.append(blk if n == len(blk) else np.concatenate([blk, np.repeat(blk[-1:], n - len(blk))]))
            pos[i] = np.arange(seq.length, seq.length + s)
            bias[i, seq.length:] = -np.inf
        embeds = self.graphs.embed_rows(np.concatenate(rows))[None]
        feeds = {"inputs_embeds": np.ascontiguousarray(embeds, np.float32), "grid_rows": grid_rows,
                 "cells": np.asarray(cells, np.int64), "position_ids": pos, "past_bias": bias}
        trees = [seq._step_tree for seq in seqs]
        if any(t is not None for t in trees) and not self.graphs.target_trees:
            raise DFlashError("this engine's batched target graph has no block_bias input: rebuild the engine to "
                              "verify draft trees in a batch", field="tree_mode")
        if self.graphs.target_trees:
            feeds["block_bias"] = np.zeros((len(seqs), s, s), np.float32)
            for i, (seq, tree) in enumerate(zip(seqs, trees)):
                if tree is not None:
                    pos[i], feeds["block_bias"][i] = tree_rows(seq.length, s, tree)
        feeds.update(self._linear_feeds(a, z))
        past = self._kv.slot_range(self._buf.t_kv, a, z)
        outs = self.graphs.target_batch(feeds, past)
        n_kv = len(self._buf.t_kv)
        self._kv.write_rows(self._buf.t_kv, outs[2:2 + n_kv],
                            [(i, seq.slot, seq.length, 0, len(blk)) for i, (seq, blk) in enumerate(zip(seqs, blocks))])
        lin, w = outs[2 + n_kv:], len(LINEAR_OUTPUTS)
        self._hold_linear(seqs, {i: tuple(lin[w * n: w * n + w]) for n, i in enumerate(self.graphs.linear_layers)})
        return _unpack(outs[0], feeds["cells"], len(seqs), s), _unpack(outs[1], feeds["cells"], len(seqs), s)

    def _linear_feeds(self, a: int, z: int) -> dict[str, np.ndarray]:
        """Hybrids: the committed Gated DeltaNet state of slots a..z-1 (views: a slot range is contiguous)."""
        feeds = {}
        for i, (conv, rec) in self._buf.linear.items():
            feeds[f"conv_state_{i}"], feeds[f"recurrent_state_{i}"] = conv[a:z], rec[a:z]
        return feeds

    def _hold_linear(self, seqs: list[BatchSeq], outs: dict) -> None:
        """Keep a target call's per-row Gated DeltaNet outputs with each of its sequences until `commit`."""
        for b, seq in enumerate(seqs):
            seq._step_linear = (outs, b) if outs else None

    def _commit_linear(self, seq: BatchSeq, row: int) -> None:
        """Sequence `seq`'s Gated DeltaNet state after row `row` of its last target call becomes its slot's."""
        if seq._step_linear is None:
            return
        outs, b = seq._step_linear
        for i, layer_outs in outs.items():
            conv, rec = self._buf.linear[i]
            state = rec[seq.slot]  # updated in place unless the last row's state is the graph's
            conv[seq.slot], new = committed_linear(conv[seq.slot], state, layer_outs, b, row)
            if new is not state:
                state[...] = new
        seq._step_linear = None

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

    def _head(self, rows: list[np.ndarray], greedy: list[bool] | None = None) -> list[np.ndarray]:
        """LM head over each sequence's hidden rows [n_b, H], in one call -> logits [n_b, V] each. Sequences marked
        `greedy` take their rows from the engine's exact greedy head where it has one (for an argmax only), the same
        token their single-sequence steps would take."""
        gh = self.graphs.greedy_head
        cat = np.concatenate(rows, axis=0)[None]
        cuts = np.cumsum([len(r) for r in rows])[:-1]
        if gh is not None and greedy is not None and all(greedy):  # one screen over every row
            return np.split(gh.logits(cat), cuts)
        logits = np.split(self.graphs.lm_head(cat), cuts)
        if gh is None or greedy is None:
            return logits
        return [gh.logits(r, full=lg) if g else lg for r, lg, g in zip(rows, logits, greedy)]

    def prefill(self, seqs: list[BatchSeq], prompts: list) -> list[np.ndarray]:
        """Prompts [S_b] int64 of new sequences (a contiguous slot range) -> each one's last-position logits [V]."""
        ids = [np.asarray(p, np.int64) for p in prompts]
        hidden, ctx = self._prefill_rows(seqs, ids)
        for i, (seq, p) in enumerate(zip(seqs, ids)):
            n = len(p)
            self._commit_linear(seq, n - 1 - seq.length)  # chunked prefills have committed all but the last chunk
            if seq.keep_context:
                seq.ctx_parts = [ctx[i, :n].copy()]
            seq.length = n
        return [row[-1] for row in self._head([hidden[i, len(p) - 1: len(p)] for i, p in enumerate(ids)])]

    def verifies_trees(self, n_seqs: int) -> bool:
        """Whether a target call over `n_seqs` sequences may verify draft trees (`target_step`'s `trees`)."""
        return self.graphs.target_trees

    @property
    def max_step_rows(self) -> int:
        """The most rows per sequence a step's target call takes (a block: the TensorRT batch profiles' bound)."""
        return self.info.block_size

    def target_step(self, seqs: list[BatchSeq], blocks: list, trees: list | None = None,
                    greedy: list[bool] | None = None) -> list[np.ndarray]:
        """One target forward for every sequence: block [n_b] = anchor + drafts to verify (n_b = 1: a plain step),
        or, where `trees[b]` is a draft tree (decoding/tree.DraftTree, its tokens the block), every node at position
        length + depth seeing only its ancestors among the new rows. Returns logits [n_b, V] per sequence (`greedy[b]`:
        for an argmax only, `_head`). Nothing is committed until `commit`."""
        blocks = [np.asarray(b, np.int64) for b in blocks]
        for i, seq in enumerate(seqs):
            tree = None if trees is None else trees[i]
            if tree is not None and len(tree) != len(blocks[i]):
                raise DFlashError(f"a tree of {len(tree)} nodes verifies a block of {len(blocks[i])} rows",
                                  field="trees")
            seq._step_tree = None if tree is None or tree.is_chain else tree  # a chain is a causal block
        try:
            rows = self._step_rows(seqs, blocks)
        finally:
            for seq in seqs:
                seq._step_tree = None
        for seq, (_, c) in zip(seqs, rows):
            seq._step_ctx = c if seq.keep_context else None
        return self._head([h for h, _ in rows], greedy)

    def commit(self, seq: BatchSeq, accept: int, path: list[int] | None = None) -> None:
        """Commit the anchor + `accept` drafts of the last `target_step`: their context features join the pending
        ones (in order), the rows past them are stale and get overwritten by the next step. A verified tree commits
        its accepted `path` (node indices from the root, accept + 1 of them): those nodes' K/V rows move down to
        consecutive rows of the cache (their RoPE positions, length + depth, are already those rows') and their
        features become pending."""
        if path is not None and list(path) != list(range(len(path))):
            if len(path) != accept + 1:
                raise DFlashError("an accepted path holds accept + 1 nodes", field="path")
            self._kv.move_rows(self._buf.t_kv, seq.slot, seq.length, list(path))
            if seq._step_ctx is not None:
                seq.ctx_parts.append(seq._step_ctx[np.asarray(path)].copy())
        elif seq._step_ctx is not None:
            seq.ctx_parts.append(seq._step_ctx[: accept + 1].copy())
        seq._step_ctx = None
        self._commit_linear(seq, accept)
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
            logits = g.draft_head(np.concatenate([hidden[j, : block_lens[i] - 1] for j, i in enumerate(group)])[None],
                                  all(sps[i].greedy for i in group))
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

    key_align = 64  # see BatchedEngine

    def __init__(self, engine: OrtEngine, max_batch: int = 16):
        if not isinstance(engine, OrtEngine):
            raise DFlashError(f"batched decoding runs on the onnxruntime backend (got {engine.info.backend})",
                              field="backend")
        super().__init__(OrtBatchGraphs(engine), max_batch)
        self.engine = engine

    @property
    def row_floor(self) -> int:
        return self.engine.row_floor

    def _run_target(self, seqs: list[BatchSeq], blocks: list[np.ndarray], prefill: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's ids [n_b] at positions length..; returns hidden [B, S, H] and ctx [B, S, H_d]."""
        e = self.engine
        a, z = self._range(seqs)
        s = max(len(x) for x in blocks)
        rows = max(s, e.row_floor)  # with the padding rows (see above)
        self._reserve(len(self.seqs), min(self.info.max_seq_len, max(q.length for q in seqs) + rows))
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
        for n, i in enumerate(e.kv_layers):
            for j, kind in enumerate(("key", "value")):
                view = self._buf.t_kv[2 * n + j][a:z]
                io.bind_cpu_input(f"past_{kind}_{i}", view)
                io.bind_output(f"present_{kind}_{i}", "cpu", 0, np.float32, view.shape, view.ctypes.data)
        linear = {}
        for name, value in self._linear_feeds(a, z).items():
            io.bind_cpu_input(name, value)
        for i, (conv, rec) in self._buf.linear.items():  # written by the graph straight into these arrays
            linear[i] = linear_outputs(conv[a:z], rec[a:z], s)
            for name, out in zip(LINEAR_OUTPUTS, linear[i]):
                io.bind_output(f"{name}_{i}", "cpu", 0, np.float32, out.shape, out.ctypes.data)
        io.bind_cpu_input("inputs_embeds", embeds)
        io.bind_cpu_input("num_logits", np.array(s, np.int64))
        io.bind_cpu_input("seqlens_k", seqlens)
        io.bind_cpu_input("total_seq_len", np.array(total, np.int32))
        if e.graph_pads:  # padded here on the host already: every region runs the call's own rows (row_pad.py)
            io.bind_cpu_input("row_index", np.arange(s, dtype=np.int64))
        trees = [q._step_tree for q in seqs]
        if any(t is not None for t in trees) and (prefill or not e.tree_verify):
            raise DFlashError("this engine's target graph has no tree inputs: rebuild it to verify draft trees",
                              field="tree_mode")
        if e._position_inputs:  # the graph's draft-tree inputs: consecutive positions and no bias for chains
            pos = (lengths[:, None] + np.arange(s)).astype(np.int64)
            att = np.zeros((len(seqs), 1, s, total), np.float32)
            for i, (q, tree) in enumerate(zip(seqs, trees)):
                if tree is not None:
                    pos[i], att[i, 0, :, q.length: q.length + s] = tree_rows(q.length, s, tree)
            io.bind_cpu_input("position_ids", pos)
            io.bind_cpu_input("attention_bias", att)
            for name, w in e.window_inputs.items():  # sliding layers: each sequence's keys hidden by position
                io.bind_cpu_input(name, np.concatenate([window_bias(att[i:i + 1], int(q.length), pos[i], w)
                                                        for i, q in enumerate(seqs)]))
        e.target.run_with_iobinding(io)
        outs = io.get_outputs()
        self._hold_linear(seqs, linear)
        return outs[0].numpy(), outs[1].numpy()

    def preload(self) -> None:
        self.engine.batch_target_session()  # target_batch.onnx: a second copy of the target's weights

    @property
    def max_step_rows(self) -> int:
        return self.info.max_seq_len  # ONNX Runtime's graphs take any number of rows

    def verifies_trees(self, n_seqs: int) -> bool:
        # one sequence (or engines without target_batch: one sequence a call) runs the in-place GQA graph
        if not self.engine.tree_verify:
            return False
        return n_seqs == 1 or self.engine.batch_target_session() is None or self.graphs.target_trees

    def _prefill_rows(self, seqs, ids):
        if not self.graphs.linear_layers:
            return self._run_target(seqs, ids, prefill=True)
        # Hybrids: one sequence a call, in chunks (each row's state comes back: a chunk bounds that memory), every
        # chunk but the last committed here; `prefill` commits the last.
        s = max(len(p) for p in ids)
        hidden = np.zeros((len(seqs), s, self.graphs.mask_row.shape[0]), np.float32)
        ctx = None
        for b, (seq, p) in enumerate(zip(seqs, ids)):
            if seq.length:
                raise DFlashError("prefill runs once, on a new sequence")
            for at in range(0, len(p), HYBRID_PREFILL_ROWS):
                if at:
                    self._commit_linear(seq, HYBRID_PREFILL_ROWS - 1)
                    seq.length = at
                part = p[at: at + HYBRID_PREFILL_ROWS]
                h, c = self._run_target([seq], [part], prefill=not at)
                if ctx is None:
                    ctx = np.zeros((len(seqs), s, c.shape[2]), np.float32)
                hidden[b, at: at + len(part)], ctx[b, at: at + len(part)] = h[0, : len(part)], c[0, : len(part)]
        return hidden, ctx

    def _step_rows(self, seqs, blocks):
        # GQA's in-place graph for one-row steps of engines whose row floor is 1 (others run one-token steps padded
        # to their floor, which GQA takes for one sequence a call only), and for one sequence where target_batch
        # cannot take its step. Every other step runs target_batch, one sequence included: GQA's and target_batch's
        # rows differ in the last bits (RoPE and attention are other kernels), which int4's int8 activations amplify
        # to flipped tokens, so a request whose steps switched graphs as others joined and left would decode
        # differently by when they came (docs/numerics.md). Its cost for one sequence is GQA's (SmolLM2 int4).
        batch_graph = self.engine.batch_target_session() is not None
        trees = any(q._step_tree is not None for q in seqs) and not self.graphs.target_trees
        if (max(len(b) for b in blocks) == 1 and self.engine.row_floor == 1) or \
                (len(seqs) == 1 and (not batch_graph or trees)):
            hidden, ctx = self._run_target(seqs, blocks, prefill=False)
            return [(hidden[i, : len(b)], ctx[i, : len(b)]) for i, b in enumerate(blocks)]
        if batch_graph:
            return super()._step_rows(seqs, blocks)
        # engines built before target_batch.onnx: GQA (CPU) takes many rows over a past one sequence a call
        rows = []
        for seq, blk in zip(seqs, blocks):
            hidden, ctx = self._run_target([seq], [blk], prefill=False)
            rows.append((hidden[0, : len(blk)], ctx[0, : len(blk)]))
        return rows
