"""Whether verify rows are bit-identical to plain steps on *this* CPU, checked by running the engine's own kernels.

DFlash is lossless against plain decoding on the same engine only if the logits (and K/V rows) a verify block computes
at each position are the very ones a one-token step computes there. Whether they are is a property of the kernels
ONNX Runtime dispatches to, and so of the processor: MatMulNBits int4 at accuracy level 4 gives a one-row product
that differs in the last bits from the same row in a many-row product on AVX2 (measured under an emulated AMD EPYC
with AVX2/FMA/F16C and no AVX-512), but not on AVX-512 VNNI; GroupQueryAttention's one-row path differs from its
many-row path on both. So the engine does not take a claim from the machine that built it: at build and at every
load it runs a fixed probe (a prompt, then a block verified at every row count 1..block_size against the same tokens
decoded one at a time) and picks the *row floor* -- the fewest rows any target step and any LM-head call runs as,
padding with copies of the last row -- for which every logit and K/V row agrees bit for bit. Padding rows sit past the
committed length and are overwritten by the next step, so they change nothing but the kernel shape. Where the target
graph can pad its attention (and, where the build's CPU needed it, its products) alone (engines/row_pad.py: the norms
between them then run one row, which saves a thread-pool hand-off per norm), each floor is tried that way first and
the whole step padded on the host only where that does not agree (a kernel the graph leaves at one row whose one-row
path differs too).

If no floor up to `MAX_ROW_FLOOR` agrees, the engine says so ("lossless within kernel numerics on this CPU", with the
measured max difference) instead of claiming bit-identity; `run`, `validate` and the served model report the verdict.

Imports numpy only (the served engine needs no torch).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# Row floors tried, smallest first; a floor costs (floor - 1) extra rows on every one-token step.
MAX_ROW_FLOOR = 4
# Row counts a verify may take and the probe checks: 1..max(block_size, PROBE_ROWS) (lookup branches and draft trees
# can be longer than a block); the runtime verifies no more rows than were probed (Numerics.max_rows). A sliding-window
# target's row window is widened by as many (export/graph.py WINDOW_TREE_ROWS; trees are verified there only where
# the graph's widening covers these rows, engines/onnxruntime.py `_trees_fit_windows`).
PROBE_ROWS = 16
PROBE_PROMPT_TOKENS = 7
PROBE_SEED = 20261202
# The instruction-set features that decide which kernels ONNX Runtime's MLAS dispatches to on x86 (numpy's names).
ISA_FEATURES = ("SSE41", "AVX", "AVX2", "FMA3", "F16C", "AVX512F", "AVX512BW", "AVX512VL", "AVX512VNNI",
                "AVX512BF16", "AVX512FP16", "AVXVNNI", "AMX_TILE", "AMX_INT8", "AMX_BF16", "ASIMD", "ASIMDDP", "SVE")
# Those numpy's CPUID probe does not report (numpy 2 has no key for them; MLAS dispatches on them: AVX-VNNI's
# integer kernels on AVX2 machines, AMX's int8 GEMM), by the kernel's /proc/cpuinfo flag; and the flags by which
# /proc/cpuinfo is checked against CPUID first (under an emulator it describes the host, not the emulated CPU).
CPUINFO_ONLY = {"AVXVNNI": "avx_vnni", "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16"}
CPUINFO_AGREES = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512VNNI": "avx512_vnni", "AVX512FP16": "avx512_fp16"}


def cpu_features() -> dict:
    """{"model": the processor's name, "isa": the dispatch-relevant features it reports through CPUID}.

    The features come from numpy's own CPUID probe rather than /proc/cpuinfo: under an emulator (qemu-user with
    -cpu EPYC-Rome) /proc/cpuinfo still shows the host, while CPUID, which ONNX Runtime reads too, shows the
    emulated processor."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as feats
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and flags is None:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {"model": model, "machine": platform.machine(), "isa": isa_features(feats, flags)}


def isa_features(cpuid: dict, flags: set[str] | None) -> list[str]:
    """ISA_FEATURES this CPU has: numpy's CPUID probe (`cpuid`), and for the features it has no key for
    (CPUINFO_ONLY) the kernel's flags (`flags`, /proc/cpuinfo), counted only where the flags agree with CPUID on the
    features both report (CPUINFO_AGREES): an emulated CPU's flags are the host's."""
    trusted = flags is not None and all(bool(cpuid.get(k)) == (v in flags) for k, v in CPUINFO_AGREES.items())

    def has(f: str) -> bool:
        if f in CPUINFO_ONLY and f not in cpuid:
            return trusted and CPUINFO_ONLY[f] in flags
        return bool(cpuid.get(f))

    return [f for f in ISA_FEATURES if has(f)]


def isa_label(isa: list[str]) -> str:
    """A short name for the widest vector ISA in `isa`: what a figure or a guarantee should be labelled with."""
    s = set(isa)
    if "AVX512F" in s:
        return "AVX-512" + (" VNNI" if "AVX512VNNI" in s else "")
    if "AVX2" in s:
        return "AVX2" + ("+FMA" if "FMA3" in s else "") + (" AVX-VNNI" if "AVXVNNI" in s else "")
    if "ASIMD" in s:
        return "NEON" + (" dotprod" if "ASIMDDP" in s else "")
    return "baseline"


# The most whole-tree rows may differ from plain steps in the logits for sampled steps to walk whole trees: the
# tolerance an fp32 export is held to against the PyTorch model by default (recipes.Thresholds.logits_atol). Measured
# on SmolLM2-135M, AVX-512 VNNI: fp32 5.5e-5 (walks over whole trees 8/8 plain sampling's draws on 8 held-out prompts
# x 128 at T 0.7), int4 1.17 (6/8: the walks take best paths there).
TREE_WALK_ATOL = 1e-4


@dataclass
class Numerics:
    """The probe's verdict for one engine on one CPU."""

    row_floor: int                 # fewest rows a target step / LM-head call runs as
    bit_identical: bool            # verify rows == plain steps, every logit and K/V value, at that floor
    max_abs_diff: float            # largest |verify - plain| over logits and K/V at that floor (0.0 when identical)
    cpu: dict = field(default_factory=dict)
    max_rows: int = 0              # verify row counts 1..max_rows were probed (the runtime verifies no more)
    onnxruntime: str = ""
    threads: int = 0
    tried: list = field(default_factory=list)  # [[floor, bit_identical, max_abs_diff], ...] in the order probed
    # Draft trees verified whole (runtime tree_mode "full"): a node off the tree's first path attends past masked
    # keys, which the attention kernel may round differently from a plain step. None: not probed (no tree inputs).
    tree_bit_identical: bool | None = None
    tree_max_abs_diff: float | None = None
    # Where a step shorter than the floor is padded: "graph" (the operators the graph pads, engines/row_pad.py) or
    # "host" (the whole step, copies of its last token).
    row_pad: str = "host"

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def trees_walkable(self) -> bool:
        """Whether sampled steps may walk whole trees (decoding.sampled_tree_mode "full"): the probe found every node
        bit-identical to plain steps, or within TREE_WALK_ATOL of them in the logits, so a walk's draws are plain
        sampling's but where a uniform falls within that much of a boundary between two tokens."""
        return bool(self.tree_bit_identical) or (
            self.tree_max_abs_diff is not None and self.tree_max_abs_diff <= TREE_WALK_ATOL)

    @property
    def tree_statement(self) -> str:
        """One line on whole-tree verification (tree_mode "full")."""
        if self.tree_bit_identical is None:
            return "this engine verifies chains only (no tree inputs)"
        if self.tree_bit_identical:
            return "whole draft trees: every node bit-identical to plain steps on this CPU"
        return (f"whole draft trees: lossless within kernel numerics on this CPU (nodes off the first path differ "
                f"from plain steps by up to {self.tree_max_abs_diff:.3g} in the logits); the default tree mode "
                "'spine' verifies one path and stays bit-identical")

    @property
    def statement(self) -> str:
        """One line for logs and reports."""
        where = f"{isa_label(self.cpu.get('isa', []))} ({self.cpu.get('model', '?')}), onnxruntime {self.onnxruntime}"
        if self.bit_identical:
            how = " padded in the graph" if self.row_pad == "graph" and self.row_floor > 1 else ""
            return (f"verify rows bit-identical to plain steps on this CPU (row floor {self.row_floor}{how}; probed "
                    f"on {where}): DFlash output equals this engine's plain decoding")
        return (f"lossless within kernel numerics on this CPU: no row floor up to {MAX_ROW_FLOOR} makes verify rows "
                f"bit-identical to plain steps (max |difference| {self.max_abs_diff:.3g} at row floor "
                f"{self.row_floor}; probed on {where}); greedy output can differ from plain decoding at near-ties")


def walks_whole_trees(engine) -> bool:
    """Whether sampled steps on `engine` may walk whole draft trees (runtime/single.py and runtime/batching.py take
    best paths elsewhere): it verifies trees, and its probe found their rows bit-identical to plain steps, or within
    TREE_WALK_ATOL of them where the target's products take float activations. A quantized target's products round
    their activations to int8 (MatMulNBits accuracy level 4), and the last bits a tree pass leaves in the K/V rows of
    its accepted path flip that rounding steps later: tiny LLaMA int8, 7e-7 off in the probe, was 0.017 off a plain
    step's logits 45 tokens into a walk and 0.65 at the next row (another draw than plain sampling's)."""
    numerics = getattr(engine, "numerics", None)
    if not getattr(engine, "tree_verify", False) or numerics is None:
        return False
    return bool(numerics.tree_bit_identical) or (numerics.trees_walkable
                                                  and not getattr(engine, "quantized_activations", False))


def _probe_tokens(vocab: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(PROBE_SEED)
    return rng.integers(0, vocab, PROBE_PROMPT_TOKENS), rng.integers(0, vocab, bs)


def probe_rows(engine) -> int:
    """The most rows a verify of this engine may take: what the probe checks."""
    return min(max(engine.info.block_size, PROBE_ROWS), engine.info.max_seq_len - PROBE_PROMPT_TOKENS - MAX_ROW_FLOOR)


def probe_floor(engine, floor: int, rows=None, pad: str = "host") -> tuple[bool, float]:
    """Run the probe with `engine.row_floor = floor` and `engine.row_pad = pad`: (bit-identical?, max |verify -
    plain|) over verifies of every row count 1..probe_rows(engine), or of the row counts `rows`.

    `engine` is an OrtEngine (or anything with its `_run_target` / `_logits` / `decode` and K/V buffers `t_kv`)."""
    bs = probe_rows(engine)
    rows = sorted(set(rows)) if rows else range(1, bs + 1)
    prompt, block = _probe_tokens(engine.info.vocab_size, bs)
    engine.row_floor, engine.row_pad = floor, pad
    seq = engine.new_sequence(PROBE_PROMPT_TOKENS + 2 * bs + floor)
    engine.prefill(seq, prompt)
    start = seq.length
    verified = []
    for m in rows:  # every row count a verify step may take; nothing is committed
        hidden, _ = engine._run_target(seq, block[:m], m)
        verified.append((m, engine._logits(hidden), [kv[:, :, start:start + m].copy() for kv in seq.t_kv]))
    plain = np.stack([engine.decode(seq, int(t)) for t in block[:max(rows)]])
    plain_kv = [kv[:, :, start:start + max(rows)] for kv in seq.t_kv]
    worst = 0.0
    for m, logits, kv in verified:
        worst = max(worst, float(np.max(np.abs(logits - plain[:m]))))
        for got, want in zip(kv, plain_kv):
            worst = max(worst, float(np.max(np.abs(got - want[:, :, :m]))))
    return worst == 0.0, worst


PROBE_VERSION = 2  # bump when the probe changes: cached verdicts of older probes are then not reused
PROBE_TREE_BRANCHES = ([5, 6, 7], [5, 9], [11, 12, 13])  # a branch, a sibling under it, a sibling of the root


def probe_tree(engine) -> tuple[bool, float]:
    """One pass over a fixed draft tree against plain decoding along each node's path: (bit-identical?, max |diff|
    of the logits). Engines whose target graph has no tree inputs are not probed: (None, None)."""
    if not getattr(engine, "tree_verify", False):
        return None, None
    from dflash_export.decoding.tree import build_tree

    prompt, _ = _probe_tokens(engine.info.vocab_size, engine.info.block_size)
    vocab = engine.info.vocab_size
    branches = [[t % vocab for t in b] for b in PROBE_TREE_BRANCHES]
    tree = build_tree(int(prompt[-1]), None, branches, top_k=0, max_nodes=sum(map(len, branches)))
    seq = engine.new_sequence(PROBE_PROMPT_TOKENS + len(tree) + engine.row_floor)
    engine.prefill(seq, prompt[:-1])
    hidden, _ = engine._run_target(seq, np.asarray(tree.tokens, np.int64), len(tree), tree=tree)
    tree_logits = engine._logits(hidden)
    worst = 0.0
    leaves = [i for i in range(len(tree)) if not tree.children(i)]
    for leaf in leaves:  # plain decoding along each root-to-leaf path covers every node
        plain = engine.new_sequence(PROBE_PROMPT_TOKENS + len(tree) + engine.row_floor)
        engine.prefill(plain, prompt[:-1])
        for node in tree.path(leaf):
            worst = max(worst, float(np.max(np.abs(engine.decode(plain, tree.tokens[node]) - tree_logits[node]))))
    return worst == 0.0, worst


def _cache_path(engine, cpu: dict, threads: int, top: int, first: int):
    """Where this process's verdict for this engine on this CPU is kept (None: no engine identity to key it on, or no
    cache directory to keep it in: the load probes as if nothing were cached)."""
    import hashlib

    import onnxruntime

    from dflash_export.errors import DFlashError
    from dflash_export.files import cache_dir

    manifest = getattr(engine, "engine_dir", None)
    try:
        digest = hashlib.sha256((Path(manifest) / "manifest.json").read_bytes()).hexdigest()
        root = cache_dir()
    except (OSError, TypeError, DFlashError):
        return None
    key = json.dumps([digest, cpu, onnxruntime.__version__, threads, top, first, PROBE_VERSION], sort_keys=True)
    return root / "numerics" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v)) and v >= 0


def _pads(engine) -> tuple[str, ...]:
    """Where this engine can pad a short step, cheapest first."""
    return ("graph", "host") if getattr(engine, "graph_pads", False) else ("host",)


def _candidates(engine, first: int, first_pad: str) -> list[tuple[int, str]]:
    """(floor, pad) pairs to probe: the recorded one, then the others smallest floor first, graph before host."""
    pads = _pads(engine)
    rest = [(f, p) for f in range(1, min(MAX_ROW_FLOOR, engine.info.block_size) + 1)
            for p in (pads if f > 1 else ("host",))]
    first_pad = first_pad if first_pad in pads and first > 1 else "host"
    return [(first, first_pad)] + [c for c in rest if c != (first, first_pad)]


def _cached(path, cpu: dict, top: int, bs: int, pads=("host",)) -> Numerics | None:
    """A verdict this machine cached, when every field has its type and range and it is about this CPU and probe
    (a floor in 1..min(MAX_ROW_FLOOR, block_size), booleans, finite non-negative differences, 0.0 when identical,
    the probed row count); None otherwise (missing, unreadable, corrupt or forged: the caller probes afresh)."""
    from dflash_export.files import read_cache_json

    data = read_cache_json(path, max_bytes=1 << 16)  # a verdict is a few hundred bytes
    fields = set(Numerics.__dataclass_fields__)
    if not isinstance(data, dict) or not set(data) <= fields:
        return None
    floor, same, diff = data.get("row_floor"), data.get("bit_identical"), data.get("max_abs_diff")
    ok = (isinstance(floor, int) and not isinstance(floor, bool) and 1 <= floor <= min(MAX_ROW_FLOOR, bs)
          and isinstance(same, bool) and _number(diff) and (diff == 0 or not same)
          and data.get("cpu") == cpu and data.get("max_rows") == top
          and isinstance(data.get("onnxruntime"), str)
          and isinstance(data.get("threads"), int) and not isinstance(data.get("threads"), bool)
          and isinstance(data.get("tried", []), list)
          and all(isinstance(t, list) and len(t) in (3, 4) and isinstance(t[0], int) and isinstance(t[1], bool)
                  and _number(t[2]) and (len(t) == 3 or t[3] in ("host", "graph")) for t in data.get("tried", []))
          and data.get("row_pad", "host") in pads
          and data.get("tree_bit_identical") in (None, True, False)
          and (data.get("tree_max_abs_diff") is None or _number(data.get("tree_max_abs_diff"))))
    return Numerics(**data) if ok else None


def _cached_recheck_rows(floor: int, bs: int, top: int) -> list[int]:
    """What a cached verdict is re-checked at, before a load uses it: where a floor that does not hold shows first
    (two rows, the rows just past the floor, a whole block). Fewer than `_recheck_rows`: a restarting server's load
    (its plain steps go to the largest row count checked; 8 here against 16 on SmolLM2)."""
    return sorted(r for r in {2, 3, floor + 1, bs} if 1 <= r <= top)


def _recheck_rows(first: int, bs: int, top: int) -> list[int]:
    """The row counts where kernels change paths: what a load re-checks of a verdict reached before on this CPU."""
    return sorted(r for r in {1, 2, 3, first, bs - 1, bs, bs + 1, top} if 1 <= r <= top)


def choose_row_floor(engine, first: int = 1, threads: int = 0, recorded: dict | None = None) -> Numerics:
    """Probe floors starting with `first` (the floor a build recorded), then the others smallest first; the first
    bit-identical one wins, else the one with the smallest difference. Leaves `engine.row_floor` set to it.

    `recorded`: the build's own verdict (manifest `numerics`). When it was probed in full on a CPU with the same
    instruction sets, the same ONNX Runtime and thread count, and found the floor bit-identical, a load re-checks the
    row counts where kernels change paths (1, 2, 3, the floor, block_size - 1, block_size, block_size + 1, the most
    probed) and keeps the recorded tree verdict: the kernels this process runs, at a fraction of the cost. Anything
    else is probed in full."""
    import onnxruntime

    cpu, bs, top = cpu_features(), engine.info.block_size, probe_rows(engine)
    # A verdict this machine already reached for these very engine files (same manifest hash, CPU, ONNX Runtime,
    # threads): a server restarting after a crash loads its models again with a short re-check, not a full probe.
    cache = _cache_path(engine, cpu, threads, top, first) if recorded is not None else None
    hit = _cached(cache, cpu, top, bs, _pads(engine)) if cache is not None else None
    if hit is not None and hit.bit_identical:
        # Re-checked, never trusted: the cached floor must still make verify rows equal plain steps here, at the row
        # counts where kernels change paths; a stale or forged verdict falls through to a full probe (and is
        # replaced).
        same, diff = probe_floor(engine, hit.row_floor, _cached_recheck_rows(hit.row_floor, bs, top), hit.row_pad)
        if same:
            engine.row_floor, engine.row_pad = hit.row_floor, hit.row_pad
            try:
                os.utime(cache)  # used now: what _prune_verdicts keeps by
            except OSError:
                pass
            return hit
    if cache is not None and cache.exists():
        try:  # unusable: gone, so that only a fresh probe's verdict is ever read again
            cache.unlink()
        except OSError:
            pass
    recorded = recorded if isinstance(recorded, dict) else {}
    order = _candidates(engine, first, recorded.get("row_pad", "graph"))
    same_host = recorded.get("bit_identical") is True and recorded.get("row_floor") == first \
        and recorded.get("row_pad", "host") == order[0][1] \
        and isinstance(recorded.get("cpu"), dict) and recorded["cpu"].get("isa") == cpu["isa"] \
        and recorded.get("onnxruntime") == onnxruntime.__version__ \
        and recorded.get("threads") == threads and recorded.get("max_rows") == top
    rows = _recheck_rows(first, bs, top) if same_host else None
    tried = []
    for floor, pad in order:
        same, diff = probe_floor(engine, floor, rows, pad)
        tried.append([floor, same, diff, pad])
        if same:
            break
        rows = None  # the recorded floor failed here: a full probe from now on
    best = next((t for t in tried if t[1]), None) or min(tried, key=lambda t: t[2])
    engine.row_floor, engine.row_pad = best[0], best[3]
    if rows is not None and "tree_bit_identical" in recorded and recorded["tree_bit_identical"] in (None, True, False) \
            and (recorded.get("tree_max_abs_diff") is None or _number(recorded.get("tree_max_abs_diff"))):
        tree_same, tree_diff = recorded["tree_bit_identical"], recorded.get("tree_max_abs_diff")
    else:
        tree_same, tree_diff = probe_tree(engine)
    result = Numerics(row_floor=best[0], max_rows=top, bit_identical=best[1], max_abs_diff=best[2], cpu=cpu,
                      onnxruntime=onnxruntime.__version__, threads=threads, tried=tried,
                      tree_bit_identical=tree_same, tree_max_abs_diff=tree_diff, row_pad=best[3])
    if cache is not None and result.bit_identical:
        try:
            from dflash_export.files import atomic_file

            cache.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(cache) as f:
                f.write(json.dumps(result.to_json()))
        except OSError:
            pass  # a read-only cache costs a probe at the next load, nothing else
        else:
            _prune_verdicts(cache.parent)
    return result


KEPT_VERDICTS = 512  # ~0.4 KB each; every rebuilt engine (a new manifest hash) adds one


def _prune_verdicts(root: Path) -> None:
    """Remove the cached verdicts in `root` past the KEPT_VERDICTS most recently used or written: a pruned one costs
    its engine one full probe at its next load, nothing else."""
    import re

    kept = []
    try:
        for e in os.scandir(root):
            if re.fullmatch(r"[0-9a-f]{24}\.json", e.name) and e.is_file(follow_symlinks=False):
                kept.append((e.stat(follow_symlinks=False).st_mtime, e.path))
    except OSError:
        return
    for _, path in sorted(kept, reverse=True)[KEPT_VERDICTS:]:
        try:
            os.unlink(path)
        except OSError:
            pass
