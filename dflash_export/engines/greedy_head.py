"""Greedy tokens from an fp32 LM head without running the whole fp32 head: screened by an int8 copy, then exact.

A greedy step needs one thing from the LM head: the token whose logit is largest. The fp32 head reads its whole
matrix for that (SmolLM2: 49152 x 576, 113 MB, ~3.5 ms of a ~20 ms plain step on 2 cores). This module finds the
token, exactly, from a quarter of the bytes:

1. **Screen.** An int8 copy of the head (`MatMulNBits`, 8 bits, blocks of 32, symmetric, accuracy level 4: int8
   activations) gives proxy logits p_j. Their distance from the real logits l_j = h . w_j is bounded row by row:
       |p_j - l_j| <= B_j = sum_b a_b(h) ||w'_jb||_1 + ||h||_1 e_j
   where w'_j is the int8 copy's dequantized row (||w'_jb||_1 over block b of 32 weights), e_j its largest weight
   error, and a_b(h) = max |h_i| over block b / 127: what quantizing that block of activations to int8 moves an
   element by, at most, rounded or truncated (ONNX Runtime's int8 kernels scale each block of the weights' block
   length on its own). No other term enters: products of int8 codes are summed in int32 exactly.
2. **Candidates.** With floor = max_j (p_j - B_j) (the least the best token's real logit can be), a token with
   p_j + B_j < floor - 2 eps cannot be the argmax: its real logit is more than 2 eps below the best one's. eps
   (`_slack`) covers float32 sums (the kernels' and this module's comparisons) and the rounding of step 3, with room
   to spare. What is left is a handful: ~20 per row on held-out SmolLM2 chat.
3. **Exact.** The candidates' logits are computed again from the fp32 rows, read from the weights file (the matrix is
   never held here): float64 products of the float32 factors (exact), summed by numpy row by row, rounded to
   float32. That value, l*_j, depends on the hidden row and w_j alone -- not on the candidate set, the rows beside
   it in the call or the kernel that screened it.

The greedy token is argmax_j l*_j over the whole vocabulary, ties to the lowest id (numpy's argmax): no excluded
token's l* can reach the best one's. So every path that asks for a greedy token gets the same one for the same hidden
row: plain steps and verify rows, trees, one sequence or a batch. A row with a single candidate has its token without
step 3. `logits` returns [n, V] float32 rows holding l* on the candidates of rows with several and the proxy
elsewhere (every excluded proxy logit lies below the best l*): argmax and greedy acceptance read them as full logits;
sampling must not, and only greedy paths ask for them. Against the whole fp32 head's argmax, the token differs only
where two logits lie within the fp32 GEMM's own rounding (~1e-5 here) of each other.

Above INT8_MAX_ROWS rows the int8 copy costs more than the fp32 head (its kernel grows with the rows, the fp32 GEMM
hardly), and the fp32 head screens: B_j = 0, its own float32 error inside eps (a sum of H products is within
H u sum |h_i w_ij| of the real one in any order, u = 2^-24; eps takes 4 H u ||h||_1 max|w|). The same l*, the same
token.

On (`greedy_head_for`): fp32 heads that are one Gemm(hidden, W, transB=1, alpha=1) over a matrix in a file beside the
graph, of at least MIN_PARAMS weights. The int8 copy is written once to the cache (which keeps the KEPT most recently
loaded copies, keyed by the head's weights file) and loaded like an engine graph (ONNX Runtime maps and packs it). At
every load it is checked against the fp32 head on fixed random rows, outliers among them: a proxy further from the
head than B allows (a kernel quantizing activations more coarsely) is not used, and the fp32 head screens -- the same
tokens at the whole head's cost.

**Drafting.** A greedy draft needs no exactness at all: the target verifies every drafted token, so drafts from the
int8 copy change only how many are accepted, never the output. Greedy drafting (and the drafter's argmax / top-K that
trees and sampled walks grow from) reads the int8 copy of the draft head (`greedy_draft_head`) -- the copy above
itself where the drafter drafts over the whole vocabulary, its own copy of draft_head.onnx's rows otherwise
(SmolLM2's 16384 x 576: 1.40 against 0.60 ms for a block of 15 rows on 2 cores). Only the drafter's own sampled chain
reads the fp32 draft head: its acceptance test divides by the draft probabilities, which stay the reference's.

Written by hand: no library finds an exact argmax from a quantized screen.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dflash_export.files import MatrixRows, UnreadableArrays, native_path, read_npz

BLOCK = 32                 # int8 blocks along the hidden size (MatMulNBits block_size)
MIN_PARAMS = 8_000_000     # heads smaller than this are cheap enough whole (and tiny test models keep them)
INT8_MAX_ROWS = 6          # the int8 screen up to this many rows, the fp32 head above (measured below)
CHUNK = 4096               # head rows quantized at a time at load (a bounded transient)
PROBE_SEED = 20260         # the load-time check's random rows
FORMAT = 3                 # of the cached int8 copy (screen_dir; 2: any rank of hidden rows; 3: tables hold digests)
GRAPH, DATA, TABLES = "screen.onnx", "screen.data", "tables.npz"
# int8 copies the cache keeps, the most recently loaded (one per head: 32 MB for SmolLM2-135M, ~0.6 GB for an 8B
# target's); a copy past them is made again when its engine loads next
KEPT = 8


def head_matrix(head_graph: Path) -> MatrixRows | None:
    """The matrix of an LM head graph that is one Gemm(hidden, W, transB=1, alpha=1) over an external fp32
    initializer (the ONNX Runtime engine's lm_head.onnx), or None for any other head (quantized, scaled, capped,
    with a bias): those are screened by nobody and run whole."""
    import onnx

    try:
        model = onnx.load(str(head_graph), load_external_data=False)
    except Exception:  # an unreadable graph is the session's error to report, not this optional path's
        return None
    ops = [n for n in model.graph.node if n.op_type not in ("Shape", "Slice", "Concat", "Reshape")]
    if len(ops) != 1 or ops[0].op_type != "Gemm" or len(ops[0].input) != 2:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ops[0].attribute}
    if attrs.get("transB") != 1 or attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0:
        return None
    init = {i.name: i for i in model.graph.initializer}.get(ops[0].input[1])
    if init is None or init.data_type != onnx.TensorProto.FLOAT or len(init.dims) != 2 \
            or init.data_location != onnx.TensorProto.EXTERNAL:
        return None
    ext = {e.key: e.value for e in init.external_data}
    loc = ext.get("location", "")
    if not loc or Path(loc).name != loc:  # a file beside the graph, nothing else
        return None
    v, h = int(init.dims[0]), int(init.dims[1])
    path, offset = Path(head_graph).parent / loc, int(ext.get("offset", 0))
    try:
        fits = int(ext.get("length", 4 * v * h)) == 4 * v * h and offset + 4 * v * h <= path.stat().st_size
        return MatrixRows(path, offset, (v, h), what="LM head") if fits else None
    except OSError:
        return None


def _slack(k: int, l1: np.ndarray, wmax: float, top: np.ndarray) -> np.ndarray:
    """eps per row: what float32 sums of k products (the fp32 head's GEMM: within k u sum|h_i w_ij|, u = 2^-24, in any
    order; the int8 kernel's per-block sums, fewer terms) and the rounding of l* to float32 can move a logit by, with
    room to spare: 4 k u ||h||_1 max|w| + 1e-5 (1 + |the logits compared|)."""
    return 4 * k * 2.0 ** -24 * l1 * wmax + 1e-5 * (1.0 + np.abs(top))


class ScreenTables:
    """What bounds the int8 copy's distance from the fp32 head: `l1` [H / BLOCK, V] (block b, token j: the sum of
    |w'_ji| over the block), `werr` [V] (max |w_j - w'_j|), `wmax` (max |w|); `digests`: the sha256 of the int8
    copy's graph and data files they were made with (`_copy_digests`), () when not recorded."""

    def __init__(self, l1: np.ndarray, werr: np.ndarray, wmax: float, digests: tuple[str, ...] = ()):
        self.l1, self.werr, self.wmax, self.digests = l1, werr, float(wmax), tuple(digests)

    @classmethod
    def of(cls, matrix: MatrixRows, out: Path) -> ScreenTables:
        """Read the matrix in chunks and quantize it (symmetric, blocks of BLOCK, scale max|w| / 127) into
        `out`/screen.data (codes + 128 as uint8 [V, H / BLOCK, BLOCK], then the scales [V, H / BLOCK] float32)."""
        v, h = matrix.shape
        nb = h // BLOCK
        l1 = np.zeros((nb, v), np.float32)
        werr = np.zeros(v, np.float32)
        wmax = 0.0
        scales = np.empty((v, nb), np.float32)
        with open(out / DATA, "wb") as codes:
            for a in range(0, v, CHUNK):
                w = matrix.range(a, min(v, a + CHUNK))
                wmax = max(wmax, float(np.abs(w).max(initial=0.0)))
                wb = w.reshape(len(w), nb, BLOCK)
                sc = np.abs(wb).max(-1) / np.float32(127)
                sc[sc == 0] = 1
                q = np.clip(np.rint(wb / sc[..., None]), -127, 127)
                deq = q * sc[..., None]
                codes.write((q + 128).astype(np.uint8).tobytes())
                scales[a:a + len(w)] = sc
                l1[:, a:a + len(w)] = np.abs(deq).sum(2).T
                werr[a:a + len(w)] = np.abs(wb - deq).max((1, 2))
            codes.write(scales.tobytes())
        return cls(l1, werr, wmax)

    @classmethod
    def without_screen(cls, matrix: MatrixRows) -> ScreenTables:
        """max |w| alone, for a head screened by its fp32 self (no int8 copy to bound)."""
        v, h = matrix.shape
        wmax = max(float(np.abs(matrix.range(a, min(v, a + CHUNK))).max(initial=0.0)) for a in range(0, v, CHUNK))
        return cls(np.zeros((0, v), np.float32), np.zeros(v, np.float32), wmax)

    def save(self, path: Path) -> None:
        np.savez(path, l1=self.l1, werr=self.werr, wmax=np.float64(self.wmax), digests=np.array(self.digests, "U64"))

    @classmethod
    def load(cls, path: Path, shape: tuple[int, int]) -> ScreenTables | None:
        """The tables at `path`, or None (rebuild them) for a missing, unreadable or damaged file (files.read_npz):
        an .npz is a zip archive whose members carry CRC-32s, so a flipped byte fails here instead of loosening a
        bound, and a header declaring more than the file holds is refused before numpy allocates it."""
        try:
            z = read_npz(path)
            t = cls(z["l1"], z["werr"], float(z["wmax"]), tuple(str(d) for d in z["digests"].tolist()))
        except (UnreadableArrays, KeyError, TypeError, ValueError):
            return None
        v, h = shape
        if t.l1.shape != (h // BLOCK, v) or t.werr.shape != (v,) or t.l1.dtype != np.float32 \
                or t.werr.dtype != np.float32 or not np.isfinite(t.wmax):
            return None
        return t


class GreedyHead:
    """Exact greedy rows of an fp32 LM head (module docstring). `head`: the fp32 head session (hidden [1, n, H] ->
    logits [1, n, V]); `matrix`: its weights (`head_matrix`); `screen`: the int8 copy's session and `tables` its
    bound tables (`ScreenTables`), or None: the fp32 head screens every call (tests; heads whose int8 check
    failed)."""

    def __init__(self, head, matrix: MatrixRows, screen=None, tables: ScreenTables | None = None):
        self.head, self.matrix = head, matrix
        self.vocab, self.hidden = matrix.shape
        self.tables = tables if tables is not None else ScreenTables.without_screen(matrix)
        self.wmax = self.tables.wmax
        self.l1 = self.tables.l1
        self._werr = self.tables.werr if np.any(self.tables.werr) else None  # None: the int8 copy is exact
        self.screen = screen if tables is not None else None
        if self.screen is not None and not self._screen_within_bound():
            self.screen = None
        self.calls = self.candidates = self.exact_rows = 0  # rows screened, their candidates, rows with several

    def logits(self, hidden: np.ndarray, full: np.ndarray | None = None) -> np.ndarray:
        """hidden rows [1, n, H] (or [n, H]) -> [n, V] float32 for an argmax only: l* on the candidates of rows with
        several, the screen's proxy elsewhere (module docstring). `full`: the fp32 head's logits of these rows when
        the caller has them already (they screen then, left unchanged)."""
        x = np.ascontiguousarray(np.asarray(hidden, np.float32).reshape(-1, self.hidden))
        n = len(x)
        int8 = full is None and self.screen is not None and n <= INT8_MAX_ROWS
        if full is not None:
            p = np.asarray(full, np.float32).reshape(n, self.vocab)
        elif int8:
            p = self.screen.run(["logits"], {"hidden": x})[0]
        else:
            p = self.head.run(["logits"], {"hidden": x[None]})[0][0]
        ax = np.abs(x)
        l1h = ax.sum(1, dtype=np.float64)
        if int8:
            bound = self._bound(ax, l1h)
            floor = (p - bound).max(1, keepdims=True)
        else:
            floor = p.max(1, keepdims=True)
        # eps on both sides of each comparison: what decides is near the floor, whose size sets float32's rounding
        eps = (2 * _slack(self.hidden, l1h[:, None], self.wmax, floor.astype(np.float64))).astype(np.float32)
        # flatnonzero: numpy's 2-D nonzero took 1.3 ms over 16 x 49152 flags, the flat one 0.08
        rows, cols = np.divmod(np.flatnonzero((p + bound if int8 else p) >= floor - eps), self.vocab)
        # A row with one candidate has its token already (every other proxy logit lies below it); the others get
        # l* on their candidates. Off the candidates the proxy stays: below the best l* (module docstring).
        tied = np.bincount(rows, minlength=n)[rows] > 1
        out = p if full is None else np.array(p)
        out[rows[tied], cols[tied]] = self.exact(x[rows[tied]], cols[tied])
        self.candidates += len(cols)
        self.exact_rows += len(np.unique(rows[tied]))
        self.calls += n
        return out

    def _bound(self, ax: np.ndarray, l1h: np.ndarray) -> np.ndarray:
        """B for rows of |h| [n, H] (module docstring): sum_b a_b(h) ||w'_jb||_1 + ||h||_1 e_j, float32 [n, V]."""
        steps = ax.reshape(len(ax), -1, BLOCK).max(2) / np.float32(127)
        # einsum's own loop, not BLAS: OpenBLAS's threads spin after a call and slowed the next target call by ~2 ms
        bound = np.einsum("bj,rb->rj", self.l1, steps)
        if self._werr is not None:
            bound += l1h.astype(np.float32)[:, None] * self._werr
        return bound

    def exact(self, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """l* of tokens `ids` [m] for hidden rows `h` [m, H] (or one row [H] for every id): float64 products of the
        float32 factors (exact), summed by numpy row by row (pairwise, the same order whatever else is summed beside
        them), rounded to float32."""
        w = self.matrix.rows(ids).astype(np.float64)
        return (w * np.asarray(h, np.float64)).sum(1).astype(np.float32)

    def _screen_within_bound(self) -> bool:
        """The int8 screen against the fp32 head on fixed random rows (and their scaled copies): every proxy logit
        within its bound of the head's (the head's own slack added). False: the screen is not used."""
        rng = np.random.default_rng(PROBE_SEED)
        x = rng.standard_normal((4, self.hidden)).astype(np.float32)
        x[1] *= 8
        x[2, rng.integers(0, self.hidden, 4)] = 40  # outliers: a coarse activation scale
        x[3] = np.abs(x[3])
        p = self.screen.run(["logits"], {"hidden": x})[0].astype(np.float64)
        f = self.head.run(["logits"], {"hidden": x[None]})[0][0].astype(np.float64)
        ax = np.abs(x)
        l1h = ax.sum(1, dtype=np.float64)
        eps = 2 * _slack(self.hidden, l1h, self.wmax, np.abs(f).max(1))[:, None]
        return bool(np.all(np.abs(p - f) <= self._bound(ax, l1h) + eps))


def _screen_graph(path: Path, v: int, h: int) -> None:
    """The int8 copy's graph at `path`, its weights and scales in DATA beside it (`ScreenTables.of`): one MatMulNBits
    (8 bits, blocks of BLOCK, accuracy level 4), hidden [..., H] -> logits [..., V] (rows [n, H] when it screens,
    the draft head's [1, n, H] when it drafts)."""
    import onnx
    from onnx import TensorProto, helper

    nb = h // BLOCK

    def external(name, dtype, dims, offset, length):
        t = TensorProto(name=name, data_type=dtype, dims=dims, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", DATA), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=key, value=value)
        return t

    codes = v * nb * BLOCK
    node = helper.make_node("MatMulNBits", ["hidden", "weights", "scales"], ["logits"], domain="com.microsoft",
                            K=h, N=v, bits=8, block_size=BLOCK, accuracy_level=4)
    graph = helper.make_graph(
        [node], "greedy_head_screen", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [external("weights", TensorProto.UINT8, [v, nb, BLOCK], 0, codes),
         external("scales", TensorProto.FLOAT, [v * nb], codes, 4 * v * nb)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)
    path.write_bytes(model.SerializeToString())


def screen_dir(engine_dir: Path, matrix: MatrixRows) -> Path:
    """Where the int8 copy of this engine's head is kept: the cache, keyed by the hash the engine's manifest records
    for the matrix's file (its weights), the matrix's place in that file and this module's format."""
    import hashlib
    import json

    from dflash_export.files import cache_dir

    # The hash the manifest records for the matrix's file, not the manifest's own: a build probes its engine before
    # the manifest gains the probe's verdict, and a rebuilt engine differs in its manifest alone; both then use the
    # copy already made instead of leaving one more behind. The whole manifest where it records no such hash.
    raw = (Path(engine_dir) / "manifest.json").read_bytes()
    try:
        digest = json.loads(raw)["files"][matrix.path.name]
        if not isinstance(digest, str):
            raise TypeError(digest)
    except (ValueError, KeyError, TypeError):
        digest = hashlib.sha256(raw).hexdigest()
    key = json.dumps([digest, matrix.path.name, matrix.offset, list(matrix.shape), BLOCK, FORMAT])
    return cache_dir() / "greedy-head" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _copy_digests(d: Path, shape: tuple[int, int]) -> tuple[str, ...]:
    """The sha256 of the int8 copy's graph and data files in `d`, () when either is not a regular file of the size
    it is written at (a data file of V x H codes and V x H / BLOCK scales; a graph of a few hundred bytes): what the
    tables record, so that a copy changed after it was written (truncated, overwritten, a page lost) is made again
    instead of being loaded (a screen the load-time check refuses would be left unused at every later load)."""
    import stat

    from dflash_export.files import sha256_file

    v, h = shape
    sizes = {GRAPH: range(1, 1 << 16), DATA: range(v * h + 4 * v * (h // BLOCK), v * h + 4 * v * (h // BLOCK) + 1)}
    try:
        for name, size in sizes.items():
            st = os.stat(d / name)
            if not stat.S_ISREG(st.st_mode) or st.st_size not in size:
                return ()
        return tuple(sha256_file(d / name) for name in sizes)
    except OSError:
        return ()


def _mark_used(d: Path) -> None:
    """Record that the copy in `d` is loaded now (its tables' modification time, what `_prune_copies` keeps by)."""
    try:
        os.utime(d / TABLES)
    except OSError:  # a read-only cache: nothing is pruned there either
        pass


def _prune_copies(root: Path) -> None:
    """Remove the int8 copies in `root` past the KEPT most recently loaded or written, and the temporary directories
    of writers that are gone. A copy is removed only once KEPT others were used after it: a process loading it then
    falls back to screening with the fp32 head (exact, slower) for that load."""
    import re
    import shutil

    from dflash_export.files import remove_stale_temps

    try:
        entries = list(root.iterdir())
    except OSError:
        return
    used = []
    for e in entries:
        m = re.match(r"^\.([0-9a-f]{24})\.(?:tmp|old)-", e.name)
        if m:
            remove_stale_temps(root / m.group(1))
        elif re.fullmatch(r"[0-9a-f]{24}", e.name) and e.is_dir() and not e.is_symlink():
            try:
                used.append(((e / TABLES).stat().st_mtime if (e / TABLES).is_file() else e.stat().st_mtime, e))
            except OSError:
                continue
    for _, e in sorted(used, reverse=True)[KEPT:]:
        shutil.rmtree(e, ignore_errors=True)


def int8_copy(matrix: MatrixRows, engine_dir: Path, ort, so, providers, release=None):
    """(session, tables) of the int8 copy of an fp32 head `matrix` (`_screen_graph`, hidden [..., H] -> logits
    [..., V]), written to the cache once (`screen_dir`) and loaded like an engine graph: ONNX Runtime maps its weights
    and packs them; `release(dir)` gives back the mapped pages it no longer reads. None: rows that are not whole
    blocks of BLOCK, no cache to write, or an onnxruntime without 8-bit MatMulNBits."""
    from dflash_export.files import atomic_dir

    v, h = matrix.shape
    if h % BLOCK:
        return None
    try:
        d = screen_dir(engine_dir, matrix)
        tables = ScreenTables.load(d / TABLES, matrix.shape) if (d / GRAPH).is_file() else None
        if tables is None or not tables.digests or tables.digests != _copy_digests(d, matrix.shape):
            with atomic_dir(d) as tmp:
                tables = ScreenTables.of(matrix, out=tmp)
                _screen_graph(tmp / GRAPH, v, h)
                tables.digests = _copy_digests(tmp, matrix.shape)
                tables.save(tmp / TABLES)
            _prune_copies(d.parent)
        else:
            _mark_used(d)
        with native_path(d / GRAPH) as name:
            session = ort.InferenceSession(name, so, providers=providers)
    except Exception:
        return None
    if release is not None:
        release(d)
    return session, tables


def _large_head(head_graph: Path) -> MatrixRows | None:
    """`head_matrix` of a head of at least MIN_PARAMS weights, else None (it runs whole: cheap enough)."""
    matrix = head_matrix(head_graph)
    return matrix if matrix is not None and matrix.shape[0] * matrix.shape[1] >= MIN_PARAMS else None


def greedy_head_for(head, head_graph: Path, engine_dir: Path, ort, so, providers, release=None) -> GreedyHead | None:
    """The greedy head of an engine's fp32 LM head session, or None where it does not apply (module docstring); its
    int8 copy from `int8_copy`, or the fp32 head screening where there is none."""
    matrix = _large_head(head_graph)
    if matrix is None:
        return None
    copy = int8_copy(matrix, engine_dir, ort, so, providers, release)
    if copy is None:
        return GreedyHead(head, matrix)
    return GreedyHead(head, matrix, *copy)


def greedy_draft_head(head_graph: Path, engine_dir: Path, ort, so, providers, release=None):
    """The int8 copy of an fp32 draft head (the engine's draft_head.onnx) as a session taking the draft head's
    [1, n, H] -> [1, n, V_draft], for greedy drafting only (module docstring, "Drafting"); None where the head is
    not one `head_matrix` reads, is smaller than MIN_PARAMS, or no copy could be made."""
    matrix = _large_head(head_graph)
    if matrix is None:
        return None
    copy = int8_copy(matrix, engine_dir, ort, so, providers, release)
    return None if copy is None else copy[0]
