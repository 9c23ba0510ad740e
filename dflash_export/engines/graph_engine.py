"""The DFlash engine logic over the export's portable graphs, apart from what executes them.

`GraphEngine` is the `Engine` for any backend that runs `target_verify.onnx` / `drafter.onnx` as the export writes
them (or engines compiled from them): it owns positions, the pending context features, block construction, profile
choice, and turning FusedVerify's outputs into (accept_len, emitted). A `GraphRunner` owns only execution: run a
named graph under a named optimization profile with host inputs, hand back the outputs asked for, and keep each
sequence's K/V wherever the backend computes (host memory for ONNX Runtime, device buffers for TensorRT).

Graph protocol (dflash_export.export.graph, flavor "portable"):
  target_verify  in:  input_ids [1,S] i64, position_ids [1,S] i64, num_logits [] i64, draft_tokens [1,n_draft] i64,
                      draft_probs [1,a,b] f32, uniforms [1,u] f32 (read only by a sampling FusedVerify; the exported
                      one is greedy), past_key_i / past_value_i [1,KVH,P,D] f32
                 out: logits [1,num_logits,V] f32, ctx [1,S,H_drafter] f32, accept_len [1] i64,
                      emitted_tokens [1,num_logits] i64, n_emitted [1] i64,
                      present_key_i / present_value_i [1,KVH,P+S,D] f32
  drafter        in:  ctx [1,C,H_drafter] f32, ctx_positions [1,C] i64, block_ids [1,bs] i64, block_positions [1,bs]
                      i64, past_ctx_key_i / past_ctx_value_i [1,KVH,T,D] f32
                 out: draft_tokens [1,bs-1] i64, draft_logits [1,bs-1,V] f32, present_ctx_key_i / value_i [1,KVH,T+C,D]
Every `past_X` input pairs with the `present_X` output: the runner feeds the first `length` cached rows and stores
the present rows back. Profiles (`graph_profiles` below): target prefill / verify / decode, drafter first_block / step.

`OrtGraphRunner` runs the same files in ONNX Runtime (CPU): the CPU twin of a TensorRT engine directory's `onnx/`,
and what proves this engine logic in CI without a GPU.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence as Seq

import numpy as np

from dflash_export.decoding.sampling import probs_from_logits, sample_from, verify_block
from dflash_export.engines.base import Engine, EngineInfo, SamplingParams, Sequence
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.files import native_path

TARGET, DRAFTER = "target_verify", "drafter"
PREFILL, VERIFY, DECODE = "prefill", "verify", "decode"   # target profiles, by token count: S prompt / bs / 1
FIRST_BLOCK, STEP = "first_block", "step"                 # drafter profiles: empty context cache / cache present
PAST, PRESENT = "past_", "present_"


class KVCache(ABC):
    """One sequence's K/V for one graph: per `past_X`/`present_X` pair a [1, KVH, length, D] tensor held by the
    runner. `length` rows are valid; a run appends the graph's new rows."""

    length: int = 0

    @abstractmethod
    def truncate(self, n: int) -> None:
        """Keep the first `n` rows (n <= length): the rows past a rejected draft are dropped."""


class GraphRunner(ABC):
    """Executes the two portable graphs. Implementations: `OrtGraphRunner` (here), `TensorRTRunner` (tensorrt.py)."""

    @abstractmethod
    def new_cache(self, graph: str) -> KVCache:
        """An empty (length 0) K/V cache for `graph`."""

    @abstractmethod
    def run(self, graph: str, profile: str, feeds: dict[str, np.ndarray], fetch: Seq[str], cache: KVCache
            ) -> dict[str, np.ndarray]:
        """Run `graph` under optimization profile `profile`.

        `feeds`: every non-`past_*` input as a host array; the `past_*` inputs are `cache`'s first `cache.length` rows
        and the `present_*` outputs become its new contents (cache.length grows by the rows the graph appended).
        Returns host copies of the outputs named in `fetch`, finished (the device synchronized).
        """

    def close(self) -> None:
        """Release sessions / device memory."""


class _GraphSeq(Sequence):
    def __init__(self, runner: GraphRunner):
        super().__init__()
        self.t_kv = runner.new_cache(TARGET)
        self.d_kv = runner.new_cache(DRAFTER)
        self.ctx: np.ndarray | None = None      # pending context features [1, n, H_drafter]
        self.ctx_pos: np.ndarray | None = None  # their positions [1, n]


class GraphEngine(Engine):
    """The Engine contract over a `GraphRunner` (batch 1). `info.block_size`, `mask_token_id` and `max_seq_len`
    must be the ones the graphs were exported with."""

    fixed_block = True  # the TensorRT profiles take whole blocks (see Engine.fixed_block)

    def __init__(self, runner: GraphRunner, info: EngineInfo, codec):
        self.runner = runner
        self.info = info
        self.codec = codec
        # Placeholders for FusedVerify's sampling inputs: the exported op is greedy and never reads them.
        self._dummy_probs = np.zeros((1, 1, 1), np.float32)
        self._dummy_u = np.zeros((1, 1), np.float32)
        self._no_drafts = np.zeros((1, 0), np.int64)

    def new_sequence(self, max_tokens: int | None = None) -> Sequence:
        return _GraphSeq(self.runner)

    def _run_target(self, seq: _GraphSeq, ids: np.ndarray, profile: str, num_logits: int, drafts: np.ndarray,
                    fetch: list[str]) -> dict[str, np.ndarray]:
        """ids [S] at positions seq.length.. through the target; its K/V appended to seq.t_kv."""
        s = len(ids)
        total = seq.length + s
        self.info.check_room(total)
        if seq.t_kv.length != seq.length:  # the cache must hold exactly the committed tokens
            raise DFlashError(f"target cache holds {seq.t_kv.length} rows for {seq.length} committed tokens")
        feeds = {"input_ids": ids.reshape(1, s), "position_ids": np.arange(seq.length, total, dtype=np.int64)[None],
                 "num_logits": np.array(num_logits, np.int64), "draft_tokens": drafts.reshape(1, -1),
                 "draft_probs": self._dummy_probs, "uniforms": self._dummy_u}
        return self.runner.run(TARGET, profile, feeds, fetch, seq.t_kv)

    def prefill(self, seq: _GraphSeq, input_ids: np.ndarray) -> np.ndarray:
        if seq.length:  # the prefill profile is built for an empty cache
            raise DFlashError("prefill runs once, on a new sequence")
        ids = np.asarray(input_ids, np.int64)
        out = self._run_target(seq, ids, PREFILL, 1, self._no_drafts, ["logits", "ctx"])
        n = len(ids)
        seq.ctx, seq.ctx_pos = out["ctx"], np.arange(n, dtype=np.int64)[None]
        seq.length = n
        return out["logits"][0, -1]

    def decode(self, seq: _GraphSeq, token: int, greedy: bool = False) -> np.ndarray:
        out = self._run_target(seq, np.array([token], np.int64), DECODE, 1, self._no_drafts, ["logits"])
        seq.length += 1
        return out["logits"][0, -1]

    def draft(self, seq: _GraphSeq, anchor: int, sp: SamplingParams, uniforms, block_len: int | None = None):
        # Always the full block: the TensorRT profiles fix the drafter's block at block_size (see Engine.draft).
        if seq.ctx is None:
            raise DFlashError("draft needs the context features of a prefill or verify (none pending)")
        bs = self.info.block_size
        if seq.length + bs > self.info.max_seq_len:
            raise DFlashError(f"a block at {seq.length} passes the engine's max_seq_len {self.info.max_seq_len}",
                              field="max_tokens")
        block = np.full((1, bs), self.info.mask_token_id, np.int64)
        block[0, 0] = anchor
        feeds = {"ctx": seq.ctx, "ctx_positions": seq.ctx_pos, "block_ids": block,
                 "block_positions": np.arange(seq.length, seq.length + bs, dtype=np.int64)[None]}
        # The first block reads all prompt features into an empty cache; later ones add <= bs features.
        profile = FIRST_BLOCK if seq.d_kv.length == 0 else STEP
        name = "draft_tokens" if sp.greedy else "draft_logits"
        out = self.runner.run(DRAFTER, profile, feeds, [name], seq.d_kv)[name]
        seq.ctx = seq.ctx_pos = None
        if sp.greedy:
            return out[0].astype(np.int64, copy=False), None
        probs = probs_from_logits(out[0].astype(np.float64), sp.temperature, sp.top_k, sp.top_p)
        return np.array([sample_from(p, u) for p, u in zip(probs, uniforms)], dtype=np.int64), probs

    def verify(self, seq: _GraphSeq, block: np.ndarray, draft_probs, sp: SamplingParams, uniforms):
        block = np.asarray(block, np.int64)
        bs = len(block)
        if sp.greedy:  # the graph's FusedVerify (temperature 0) accepts the block next to the LM head
            out = self._run_target(seq, block, VERIFY, bs, block[1:], ["ctx", "accept_len", "emitted_tokens",
                                                                        "n_emitted"])
            accept = int(out["accept_len"][0])
            emitted = [int(t) for t in out["emitted_tokens"][0, : int(out["n_emitted"][0])]]
        else:  # top-k / top-p are not part of the op's contract: accept on the host with the same rule
            out = self._run_target(seq, block, VERIFY, bs, block[1:], ["ctx", "logits"])
            logits = out["logits"][0]
            probs = probs_from_logits(logits.astype(np.float64), sp.temperature, sp.top_k, sp.top_p)
            accept, emitted = verify_block(probs, logits, block[1:], draft_probs, uniforms, False)
        seq.ctx = out["ctx"][:, : accept + 1]
        seq.ctx_pos = np.arange(seq.length, seq.length + accept + 1, dtype=np.int64)[None]
        seq.length += accept + 1
        seq.t_kv.truncate(seq.length)  # rows of rejected drafts must not be attended to by the next step
        return accept, emitted

    def close(self) -> None:
        self.runner.close()


# ----------------------------------------------------------------------------------------------------------------------
# ONNX Runtime runner (CPU)


class _HostKVCache(KVCache):
    def __init__(self, empty: dict[str, np.ndarray]):
        self.rows = empty  # X -> [1, KVH, length, D] float32, C-contiguous
        self.length = 0

    def truncate(self, n: int) -> None:
        if n > self.length:
            raise DFlashError(f"cannot keep {n} of {self.length} cached rows")
        if n < self.length:
            self.rows = {k: np.ascontiguousarray(v[:, :, :n]) for k, v in self.rows.items()}
            self.length = n


class OrtGraphRunner(GraphRunner):
    """Runs `target_verify.onnx` and `drafter.onnx` from `onnx_dir` in ONNX Runtime on the CPU.

    `check_profiles=(block_size, max_seq_len)` makes every run also check its inputs against the TensorRT
    optimization profile it names (`graph_profiles`): a shape a TensorRT engine would refuse fails here.
    """

    def __init__(self, onnx_dir, threads: int = 1, check_profiles: tuple[int, int] | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise MissingDependency("onnxruntime is not installed (pip install 'dflash-export[runtime]')") from None
        self.onnx_dir = Path(onnx_dir)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.sessions, self._kv, self._profiles = {}, {}, {}
        for graph in (TARGET, DRAFTER):
            path = self.onnx_dir / f"{graph}.onnx"
            if not path.is_file():
                raise DFlashError("exported graph not found", path=path)
            with native_path(path) as name:
                sess = ort.InferenceSession(name, so, providers=["CPUExecutionProvider"])
            self.sessions[graph] = sess
            # X -> (KVH, D) of each past_X input: static dims of the portable graphs
            self._kv[graph] = {i.name[len(PAST):]: (int(i.shape[1]), int(i.shape[3])) for i in sess.get_inputs()
                               if i.name.startswith(PAST)}
            if check_profiles is not None:
                self._profiles[graph] = _profile_ranges(path, graph, *check_profiles)

    def new_cache(self, graph: str) -> KVCache:
        return _HostKVCache({x: np.zeros((1, kvh, 0, d), np.float32) for x, (kvh, d) in self._kv[graph].items()})

    def run(self, graph, profile, feeds, fetch, cache: _HostKVCache):
        feeds = dict(feeds)
        for x, rows in cache.rows.items():
            feeds[PAST + x] = rows
        if self._profiles:
            _check_profile(self._profiles[graph], graph, profile, feeds)
        kv_names = list(cache.rows)
        names = list(fetch) + [PRESENT + x for x in kv_names]
        res = self.sessions[graph].run(names, feeds)
        out = dict(zip(names, res))
        cache.rows = {x: out.pop(PRESENT + x) for x in kv_names}
        cache.length = next(iter(cache.rows.values())).shape[2]
        return out

    def close(self) -> None:
        self.sessions = {}


def _profile_ranges(path: Path, graph: str, block_size: int, max_seq_len: int) -> dict[str, dict]:
    """{profile name: {input: (min shape, max shape)}} of the TensorRT profiles for this exported graph."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {p.name: {k: (lo, hi) for k, (lo, _, hi) in profile_shapes(model, p).items()}
            for p in graph_profiles(graph, block_size, max_seq_len, vocab_size_of(model))}


def _check_profile(ranges: dict[str, dict], graph: str, profile: str, feeds: dict[str, np.ndarray]) -> None:
    if profile not in ranges:
        raise DFlashError(f"{graph} has no optimization profile {profile!r} (has {', '.join(ranges)})")
    for name, (lo, hi) in ranges[profile].items():
        arr = np.asarray(feeds[name])
        # scalar shape-tensor inputs (num_logits) are ranged by value, the others by shape
        got = (int(arr),) if arr.ndim == 0 else arr.shape
        if len(got) != len(lo) or not all(a <= g <= b for a, g, b in zip(lo, got, hi)):
            raise DFlashError(f"{graph} input {name} {tuple(got)} is outside profile {profile!r} "
                              f"[{tuple(lo)}, {tuple(hi)}]", field=name)


@dataclasses.dataclass
class Profile:
    """One optimization profile: a range per named ONNX dimension, and values for shape-tensor (scalar) inputs."""

    name: str
    dims: dict[str, tuple[int, int, int]]
    values: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)


def _fixed(n: int) -> tuple[int, int, int]:
    return (n, n, n)


def graph_profiles(graph: str, block_size: int, max_seq_len: int, vocab_size: int, max_batch: int = 1
                   ) -> list[Profile]:
    """The optimization profiles of `target_verify` (prefill, block verify, single-token decode) or `drafter`
    (first block after prefill: all prompt features at once; steady state: <= block_size new features).

    Dim names are the export's (dflash_export.export.graph); the runtime selects the profile by index.
    """
    bs, L = block_size, max_seq_len
    opt_past = min(512, L - bs)
    batch = (1, 1, max_batch)
    if graph == "target_verify":
        sampling = {"n_draft_or_1": (0, 1, max(1, bs - 1)), "vocab_or_1": (1, 1, vocab_size), "n_uniforms": (1, 1, bs)}
        return [
            Profile("prefill", {"batch": batch, "seq": (1, min(512, L), L), "past": _fixed(0), "n_draft": _fixed(0),
                                **sampling}, {"num_logits": _fixed(1)}),
            Profile("verify", {"batch": batch, "seq": _fixed(bs), "past": (0, opt_past, L - bs),
                               "n_draft": _fixed(bs - 1), **sampling}, {"num_logits": _fixed(bs)}),
            Profile("decode", {"batch": batch, "seq": _fixed(1), "past": (0, opt_past, L - 1), "n_draft": _fixed(0),
                               **sampling}, {"num_logits": _fixed(1)}),
        ]
    if graph == "drafter":
        # positions: context 0..past_ctx+n_ctx-1, then the block; all must stay below max_seq_len
        step_past = max(0, L - 2 * bs)
        return [
            Profile("first_block", {"batch": batch, "n_ctx": (1, min(512, L - bs), L - bs), "past_ctx": _fixed(0),
                                    "block": _fixed(bs)}),
            # past_ctx up to L-bs-1 (anchor at L-bs after one new feature): L-2bs refused the last steps of a
            # request the runtime admits (tests/test_tensorrt_engine.py runs one)
            Profile("step", {"batch": batch, "n_ctx": (0, bs, bs),
                             "past_ctx": (0, min(512, step_past), max(0, L - bs - 1)),
                             "block": _fixed(bs)}),
        ]
    if graph in BATCH_GRAPHS:
        return batch_profiles(graph, block_size, max_seq_len, max_batch)
    raise DFlashError(f"unknown graph {graph!r} (target_verify, drafter, {', '.join(BATCH_GRAPHS)})", field="graph")


# The batch graphs TensorRT compiles for continuous batching (engines/tensorrt_batch.py; the ONNX Runtime backend runs
# their "ort" flavor originals): B sequences per call, each padded to the call's longest.
TARGET_BATCH, DRAFTER_BATCH, LM_HEAD = "target_batch", "drafter_batch", "lm_head"
BATCH_GRAPHS = (TARGET_BATCH, DRAFTER_BATCH, LM_HEAD)
BATCH_PREFILL, BATCH_STEP, BATCH = "batch_prefill", "batch_step", "batch"


def batch_profiles(graph: str, block_size: int, max_seq_len: int, max_batch: int) -> list[Profile]:
    """The optimization profiles of a batch graph: what `BatchedEngine` feeds it for 1..max_batch sequences.

    target_batch: `past` is the K/V buffers' capacity (1..max_seq_len, the whole buffer is fed, past_bias hides what
    lies past each sequence), `seq` the call's longest block: prompts (batch_prefill) or <= block_size rows (batch_step;
    a prefill of short prompts fits it too), `rows` the call's packed rows (at most batch x seq). drafter_batch: cached
    context (past_ctx, 0 on the first block), pending context (n_ctx: a prompt's features, or the tokens committed since
    the last draft) and the block, padded to the longest of the call; n_keys = past_ctx + n_ctx + block. lm_head: the
    rows of one call (a block per sequence at most)."""
    bs, L, mb = block_size, max_seq_len, max_batch
    if mb < 1:
        raise DFlashError(f"must be >= 1, got {mb}", field="max_batch")
    opt_b, opt_past = max(1, mb // 2), min(512, L)
    batch = (1, opt_b, mb)
    if graph == TARGET_BATCH:
        return [
            Profile(BATCH_PREFILL, {"batch": batch, "seq": (1, min(512, L), L), "past": (1, opt_past, L),
                                    "rows": (1, min(512, L), mb * L)}),
            Profile(BATCH_STEP, {"batch": batch, "seq": (1, bs, bs), "past": (1, opt_past, L),
                                 "rows": (1, opt_b * bs, mb * bs)}),
        ]
    if graph == DRAFTER_BATCH:
        return [Profile(BATCH, {"batch": batch, "n_ctx": (1, bs, L), "past_ctx": (0, min(512, L - bs), L),
                                "block": (1, bs, bs), "n_keys": (1, min(512, L), 2 * L + bs)})]
    if graph == LM_HEAD:
        return [Profile(BATCH, {"batch": _fixed(1), "rows": (1, opt_b * bs, mb * bs)})]
    raise DFlashError(f"unknown batch graph {graph!r} ({', '.join(BATCH_GRAPHS)})", field="graph")


def profile_shapes(model, profile: Profile) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """min / opt / max shape of every graph input of `model` (ModelProto) under `profile`; scalar shape-tensor
    inputs map to their value ranges as 1-tuples. Raises DFlashError for a dynamic dim the profile does not name."""
    out = {}
    for inp in model.graph.input:
        dims = inp.type.tensor_type.shape.dim
        if not dims:
            if inp.name not in profile.values:
                raise DFlashError(f"scalar input {inp.name!r} has no value range in profile {profile.name!r}",
                                  field=inp.name)
            lo, opt, hi = profile.values[inp.name]
            out[inp.name] = ((lo,), (opt,), (hi,))
            continue
        lo, opt, hi = [], [], []
        for d in dims:
            if d.HasField("dim_value"):
                rng = _fixed(d.dim_value)
            elif d.dim_param in profile.dims:
                rng = profile.dims[d.dim_param]
            else:
                raise DFlashError(f"dynamic dim {d.dim_param!r} of input {inp.name!r} has no range in profile "
                                  f"{profile.name!r}", field=inp.name)
            lo.append(rng[0])
            opt.append(rng[1])
            hi.append(rng[2])
        out[inp.name] = (tuple(lo), tuple(opt), tuple(hi))
    return out


def vocab_size_of(model) -> int:
    """The vocabulary size: the static last dim of the graph's logits output."""
    for o in model.graph.output:
        if o.name.endswith("logits"):
            last = o.type.tensor_type.shape.dim[-1]
            if last.HasField("dim_value"):
                return int(last.dim_value)
    raise DFlashError("no logits output with a static vocabulary dim", field="outputs")
