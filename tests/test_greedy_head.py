"""Greedy tokens from a screened fp32 LM head (engines/greedy_head.py): always the argmax of the exactly computed
logits, whichever screen found the candidates, whichever rows shared the call -- checked against math.fsum (an
exactly rounded sum, independent of the code under test) and against the whole fp32 head, on heads built to have
near ties, exact ties and outlier activations; then through an engine, where greedy decoding, DFlash and continuous
batching give the tokens the whole head gives."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, save_model
from target_support import assert_as_plain, assert_transformers_greedy

from dflash_export.engines import greedy_head as gh
from dflash_export.engines.base import SamplingParams
from dflash_export.files import MatrixRows

V, H = 3000, 64


def _session_options():
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return so


def _head_files(tmp_path, w: np.ndarray):
    """An fp32 head graph as the ONNX Runtime engine writes one: Gemm(hidden, W, transB=1) over W in a weights file
    beside it."""
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64 + np.ascontiguousarray(w, np.float32).tobytes())
    init = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=list(w.shape),
                       data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "weights.bin"), ("offset", "64"), ("length", str(w.size * 4))):
        init.external_data.add(key=k, value=v)
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["hidden", "shape"], ["rows"]),
         helper.make_node("Gemm", ["rows", "W"], ["logits2"], transB=1),
         helper.make_node("Reshape", ["logits2", "out_shape"], ["logits"])], "head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "n", w.shape[1]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "n", w.shape[0]])],
        [init, helper.make_tensor("shape", TensorProto.INT64, [2], [-1, w.shape[1]]),
         helper.make_tensor("out_shape", TensorProto.INT64, [3], [1, -1, w.shape[0]])])
    path = tmp_path / "lm_head.onnx"
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path, ort.InferenceSession(str(path), _session_options(), providers=["CPUExecutionProvider"])


def _weights(seed: int = 0) -> np.ndarray:
    """A head with hard cases: pairs of rows equal but for one element's last bit (ties after float32 sums), exact
    duplicate rows (exact ties), rows dominating a few hidden dimensions (outliers)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((V, H)) * 0.05).astype(np.float32)
    for a in range(0, 200, 2):
        w[a + 1] = w[a]
        w[a + 1, a % H] = np.nextafter(w[a, a % H], np.float32(1))
    w[2500:2510] = w[2490]
    return w


def _hidden(rng, n: int, w: np.ndarray) -> np.ndarray:
    """Hidden rows whose best tokens are the near-tied and tied rows above (plus noise), some with outliers."""
    x = (rng.standard_normal((n, H)) * 0.3).astype(np.float32)
    for i in range(n):
        target = (0, 2, 50, 2490, 2505, 7)[i % 6]
        x[i] += 8 * w[target] / np.linalg.norm(w[target])
    x[::5, 3] = 30.0   # an outlier dimension: a coarse int8 activation block
    return x


def _oracle(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """argmax_j of float32(exactly rounded sum of the exact products): math.fsum, lowest index on ties."""
    best = []
    for row in x.astype(np.float64):
        vals = np.array([math.fsum(row * wj) for wj in w.astype(np.float64)], np.float64).astype(np.float32)
        best.append(int(np.argmax(vals)))
    return np.asarray(best)


@pytest.fixture(autouse=True)
def _small_heads(monkeypatch):
    """Every test here screens heads far under MIN_PARAMS. Lifted per test, not for the module: the session's tiny
    pairs (conftest `ort_pair`), shared with other modules, may first load while a test here runs, and must load
    with the floor as it is (their draft heads' int8 copies would draft otherwise)."""
    monkeypatch.setattr(gh, "MIN_PARAMS", 0)


@pytest.fixture(scope="module")
def head(tmp_path_factory, monkeypatch_module):
    tmp = tmp_path_factory.mktemp("head")
    w = _weights()
    path, sess = _head_files(tmp, w)
    monkeypatch_module.setenv("DFLASH_CACHE", str(tmp / "cache"))
    with pytest.MonkeyPatch.context() as mp:  # module fixtures are made before `_small_heads`
        mp.setattr(gh, "MIN_PARAMS", 0)
        g = gh.greedy_head_for(sess, path, tmp, ort, _session_options(), ["CPUExecutionProvider"])
    return w, sess, g


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_screened_argmax_is_the_exact_logits_argmax_on_near_and_exact_ties(head):
    w, sess, g = head
    assert g is not None and g.screen is not None  # the int8 copy passed its load-time check
    rng = np.random.default_rng(1)
    x = _hidden(rng, 36, w)
    want = _oracle(w, x)
    for limit in (0, 99):  # the fp32 head screening, then the int8 copy
        g_rows = gh.INT8_MAX_ROWS
        gh.INT8_MAX_ROWS = limit
        try:
            got = np.argmax(g.logits(x[None]), axis=1)
            alone = [int(np.argmax(g.logits(x[i:i + 1]))) for i in range(len(x))]
        finally:
            gh.INT8_MAX_ROWS = g_rows
        assert got.tolist() == want.tolist()
        assert alone == want.tolist()  # a row alone or among others: the same token
    # exact ties resolve to the lowest id, as numpy's argmax over full logits does
    assert 2490 in want.tolist() and not any(2490 < t < 2510 for t in want.tolist())
    # and where the whole fp32 head is not within a float32 rounding of a tie, it agrees too
    full = sess.run(["logits"], {"hidden": x[None]})[0][0]
    clear = np.sort(full, axis=1)[:, -1] - np.sort(full, axis=1)[:, -2] > 1e-3
    assert (np.argmax(full, axis=1)[clear] == want[clear]).all()


def test_exact_logits_do_not_depend_on_the_candidates_beside_them(head):
    w, _, g = head
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids = np.array([0, 1, 17, 2490, 2505])
    together = g.exact(x[[0, 0, 1, 3, 4]], ids)
    alone = np.array([g.exact(x[r], np.array([j]))[0] for r, j in zip([0, 0, 1, 3, 4], ids)])
    assert np.array_equal(together, alone)
    fsum = np.array([math.fsum(x[r].astype(np.float64) * w[j].astype(np.float64))
                     for r, j in zip([0, 0, 1, 3, 4], ids)], np.float64)
    assert np.allclose(together, fsum, rtol=1e-6, atol=1e-6)


def test_the_int8_bound_holds_on_real_rows_and_a_looser_screen_is_refused(head, tmp_path):
    w, sess, g = head
    x = _hidden(np.random.default_rng(3), 12, w)
    p = g.screen.run(["logits"], {"hidden": x})[0].astype(np.float64)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    ax = np.abs(x)
    assert np.all(np.abs(p - exact) <= g._bound(ax, ax.sum(1, dtype=np.float64)))
    # A screen further from the head than the bound allows (weights off by more than int8's rounding) is not used:
    # the fp32 head screens, and the tokens stay the exact ones.
    noisy = w + np.float32(0.004) * np.sign(np.random.default_rng(4).standard_normal(w.shape)).astype(np.float32)
    path, _ = _head_files(tmp_path, noisy)
    bad_screen = ort.InferenceSession(str(_cached_screen(tmp_path, noisy)), _session_options(),
                                      providers=["CPUExecutionProvider"])
    checked = gh.GreedyHead(sess, g.matrix, bad_screen, g.tables)
    assert checked.screen is None
    assert np.argmax(checked.logits(x[None]), axis=1).tolist() == _oracle(w, x).tolist()


def _cached_screen(tmp_path, w):
    """The int8 copy of another matrix `w`, written as greedy_head_for writes its own."""
    m = MatrixRows(tmp_path / "weights.bin", 64, w.shape)
    out = tmp_path / "screen"
    out.mkdir()
    gh.ScreenTables.of(m, out=out)
    gh._screen_graph(out / gh.GRAPH, *w.shape)
    return out / gh.GRAPH


def _doctored_header(npz: bytes, member: str) -> bytes:
    """The archive `npz` with `member`'s .npy header declaring 10^11 x 2 float32 (745 GiB) over its own data."""
    import io
    import zipfile

    from numpy.lib import format as npy

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(npz)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == member:
                header = io.BytesIO()
                npy.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 2)})
                data = header.getvalue() + data[len(header.getvalue()):]
            zout.writestr(info, data)
    return out.getvalue()


def test_a_damaged_cache_is_rebuilt_and_other_heads_are_not_screened(head, tmp_path, monkeypatch):
    """Cached tables that are not an archive, fail a member's CRC, or declare an array larger than the file (numpy
    would try to allocate it) are made again, and the head is screened with them."""
    w, sess, g = head
    d = gh.screen_dir(g.matrix.path.parent, g.matrix)
    good = (d / gh.TABLES).read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF  # inside the l1 table's data: its CRC no longer matches
    for damaged in (b"not an npz", bytes(flipped), _doctored_header(good, "l1.npy")):
        (d / gh.TABLES).write_bytes(damaged)
        again = gh.greedy_head_for(sess, g.matrix.path.parent / "lm_head.onnx", g.matrix.path.parent, ort,
                                   _session_options(), ["CPUExecutionProvider"])
        assert again.screen is not None and np.array_equal(again.tables.l1, g.tables.l1)
        assert gh.ScreenTables.load(d / gh.TABLES, g.matrix.shape) is not None  # rebuilt, not worked around
    # a FIFO in the tables' place: refused without waiting for a writer, and made again
    import threading

    (d / gh.TABLES).unlink()
    os.mkfifo(d / gh.TABLES)
    done = []
    loader = threading.Thread(target=lambda: done.append(gh.greedy_head_for(
        sess, g.matrix.path.parent / "lm_head.onnx", g.matrix.path.parent, ort, _session_options(),
        ["CPUExecutionProvider"])), daemon=True)
    loader.start()
    loader.join(120)
    assert done and done[0].screen is not None and (d / gh.TABLES).is_file()
    # a scaled head (alpha != 1), a head without its matrix file: the whole head, no screen
    path, _ = _head_files(tmp_path, w)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    next(n for n in model.graph.node if n.op_type == "Gemm").attribute.append(helper.make_attribute("alpha", 2.0))
    onnx.save_model(model, str(path))
    assert gh.head_matrix(path) is None
    (tmp_path / "weights.bin").unlink()
    assert gh.head_matrix(tmp_path / "lm_head.onnx") is None


@pytest.mark.parametrize("damage", ["truncated", "a page zeroed", "graph overwritten", "data a link elsewhere"])
def test_an_int8_copy_changed_after_it_was_written_is_made_again(head, tmp_path, damage):
    """The cached int8 copy's graph or codes changed on disk (cut short, a page lost, overwritten, replaced by a link
    to something else): the next load writes the copy again, byte for byte what it was, and screens with it --
    rather than loading it, or leaving the screen off at every later load."""
    w, sess, g = head
    d = gh.screen_dir(g.matrix.path.parent, g.matrix)
    data, graph = (d / gh.DATA).read_bytes(), (d / gh.GRAPH).read_bytes()
    if damage == "truncated":
        (d / gh.DATA).write_bytes(data[: len(data) // 2])
    elif damage == "a page zeroed":
        (d / gh.DATA).write_bytes(data[:4096] + bytes(4096) + data[8192:])
    elif damage == "graph overwritten":
        (d / gh.GRAPH).write_bytes(b"not a graph")
    else:
        (tmp_path / "elsewhere").write_bytes(bytes(len(data)))
        (d / gh.DATA).unlink()
        (d / gh.DATA).symlink_to(tmp_path / "elsewhere")
    again = gh.greedy_head_for(sess, g.matrix.path.parent / "lm_head.onnx", g.matrix.path.parent, ort,
                               _session_options(), ["CPUExecutionProvider"])
    assert again.screen is not None
    assert not (d / gh.DATA).is_symlink()
    assert (d / gh.DATA).read_bytes() == data and (d / gh.GRAPH).read_bytes() == graph
    x = _hidden(np.random.default_rng(6), 6, w)
    assert np.argmax(again.logits(x[None]), axis=1).tolist() == _oracle(w, x).tolist()


def test_an_engine_whose_manifest_changes_but_not_its_head_reuses_the_int8_copy(tmp_path, monkeypatch):
    """A build probes its engine before the manifest records the verdict, and a rebuild with unchanged weights
    writes another manifest: neither leaves another copy of the same head in the cache; other weights get their
    own."""
    w = _weights(7)
    path, sess = _head_files(tmp_path, w)
    monkeypatch.setattr(gh, "MIN_PARAMS", 0)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    from dflash_export.files import sha256_file

    def load(extra: dict):
        files = {"weights.bin": sha256_file(tmp_path / "weights.bin"), "lm_head.onnx": sha256_file(path)}
        (tmp_path / "manifest.json").write_text(json.dumps({"files": files, **extra}))
        return gh.greedy_head_for(sess, path, tmp_path, ort, _session_options(), ["CPUExecutionProvider"])

    def copies():
        return sorted(p.name for p in (tmp_path / "cache" / "greedy-head").iterdir())

    assert load({}).screen is not None
    first = copies()
    assert load({"numerics": {"row_floor": 2}}).screen is not None and load({"export_seconds": 3.5}).screen is not None
    assert copies() == first and len(first) == 1
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64 + np.ascontiguousarray(w * 2, np.float32).tobytes())
    load({})
    assert len(copies()) == 2


def test_the_cache_keeps_the_most_recently_loaded_int8_copies_and_removes_dead_writers_leftovers(tmp_path,
                                                                                                 monkeypatch):
    """Heads of KEPT + 2 different weights loaded one after another, the first loaded again before the last: the
    cache then holds KEPT copies, the first and the newest among them, the second and third gone; a temporary
    directory of a writer that is gone is removed, one of a live writer kept. A removed copy is made again (and
    screens exactly) when its engine loads next."""
    import subprocess

    from dflash_export.files import sha256_file

    monkeypatch.setattr(gh, "MIN_PARAMS", 0)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "greedy-head"

    def load(seed: int):
        d = tmp_path / f"engine-{seed}"
        d.mkdir(exist_ok=True)
        w = _weights(seed)
        path, sess = _head_files(d, w)
        (d / "manifest.json").write_text(json.dumps({"files": {"weights.bin": sha256_file(d / "weights.bin")}}))
        g = gh.greedy_head_for(sess, path, d, ort, _session_options(), ["CPUExecutionProvider"])
        assert g.screen is not None
        return g, w, gh.screen_dir(d, gh.head_matrix(path)).name

    names = [load(0)[2]]
    dead = subprocess.Popen(["true"])
    dead.wait()
    (root / f".{names[0]}.tmp-{dead.pid}-x").mkdir()
    (root / f".{names[0]}.tmp-{os.getpid()}-y").mkdir()
    for seed in range(1, gh.KEPT + 1):
        names.append(load(seed)[2])
        os.utime(root / names[0] / gh.TABLES, (0, 0)) if seed < gh.KEPT else load(0)
    names.append(load(gh.KEPT + 1)[2])
    left = {p.name for p in root.iterdir()}
    assert len(set(names)) == gh.KEPT + 2
    assert left == set(names) - {names[1], names[2]} | {f".{names[0]}.tmp-{os.getpid()}-y"}, left
    g, w, name = load(1)
    assert name == names[1] and (root / name).is_dir()
    x = _hidden(np.random.default_rng(1), gh.INT8_MAX_ROWS, w)  # rows the int8 copy screens
    assert np.argmax(g.logits(x[None]), axis=1).tolist() == _oracle(w, x).tolist()


@pytest.fixture(scope="module")
def screened(ort_pair):
    """The tiny pair's engine loaded twice: with its head screened (the size floor lifted) and whole."""
    from dflash_export.engines.registry import load_engine

    recipe, out, _, _ = ort_pair
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gh, "MIN_PARAMS", 0)
        on = load_engine(out, threads=1)
    off = load_engine(out, threads=1, greedy_head=False)
    assert on.greedy_head is not None and on.greedy_head.screen is not None and off.greedy_head is None
    return recipe, on, off


def test_greedy_decoding_through_a_screened_head_is_the_whole_head_s(screened):
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    recipe, on, off = screened
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, on.info.vocab_size, size=n).tolist() for n in (5, 9, 14)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    rt_on, rt_off = DFlashRuntime(on), DFlashRuntime(off)
    for p in prompts:
        want = rt_off.generate(p, sp, "ar").tokens
        assert rt_on.generate(p, sp, "ar").tokens == want
        assert_as_plain(on, p, rt_on.generate(p, sp, "dflash").tokens, want)
    batched = BatchingRuntime(on, max_batch=4).generate_many(prompts, [sp] * len(prompts))
    for p, s in zip(prompts, batched):
        assert_as_plain(on, p, s.tokens, rt_off.generate(p, sp, "ar").tokens)
    assert on.greedy_head.calls > 0


def _int8_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|int8 copy's logit - exact logit| may reach this (closed form, from the documented quantization alone):
    symmetric int8 per block of 32 for both factors, sum_b max|x_b| / 127 ||w'_jb||_1 + ||x||_1 max|w_j - w'_j|,
    plus float32 rounding."""
    wb = w.astype(np.float64).reshape(len(w), -1, 32)
    scale = np.abs(wb).max(-1, keepdims=True) / 127
    deq = np.rint(wb / np.where(scale == 0, 1, scale)) * scale
    steps = np.abs(x).reshape(len(x), -1, 32).max(-1) / 127
    bound = steps @ np.abs(deq).sum(-1).T + np.abs(x).sum(1, keepdims=True) * np.abs(wb - deq).max((1, 2))
    return bound + 1e-4 * (1 + np.abs(x).sum(1, keepdims=True))


def test_greedy_drafts_read_the_draft_heads_int8_copy_and_stay_lossless(tmp_path, monkeypatch):
    """An engine with a draft vocabulary drafts greedily from an int8 copy of its draft head (the size floor lifted):
    the copy's logits within the int8 bound of the exact products, greedy DFlash (single and batched) still the
    PyTorch target's own greedy tokens, and the drafter's sampled chain still reading the fp32 draft head, whose
    probabilities its acceptance test divides by."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.models import load_target
    from dflash_export.recipes import load_recipe
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    monkeypatch.setattr(gh, "MIN_PARAMS", 0)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe("tiny-llama")
    out = build_onnxruntime(recipe, tmp_path / "eng", threads=1, draft_vocab=100)
    eng = load_engine(out, threads=1)
    assert eng.draft_vocab == 100 and eng.greedy_draft_head is not None
    assert load_engine(out, threads=1, greedy_drafts=False).greedy_draft_head is None

    w = gh.head_matrix(out / "draft_head.onnx").range(0, 100)
    x = np.random.default_rng(2).standard_normal((1, 15, w.shape[1])).astype(np.float32)
    x[0, ::4, 5] = 25.0
    got = eng.draft_logits(x, greedy=True).astype(np.float64)
    exact = x[0].astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (15, 100) and np.all(np.abs(got - exact) <= _int8_bound(w, x[0]))
    assert np.array_equal(eng.draft_logits(x, greedy=False), eng.draft_head.run(["logits"], {"hidden": x})[0][0])

    target = load_target(recipe.target_path)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, eng.info.vocab_size - 2, size=n).tolist() for n in (6, 11)]
    sp = SamplingParams(max_new_tokens=32)
    rt = DFlashRuntime(eng)
    want = [rt.generate(p, sp, "ar").tokens for p in prompts]
    for p, tokens in zip(prompts, want):  # the target's greedy tokens, near-ties within TIE either way
        assert_transformers_greedy(target.hf, p, tokens, eng.info.stop_token_ids, 32)
    for p, s, tokens in zip(prompts, BatchingRuntime(eng, max_batch=2).generate_many(prompts, [sp] * 2), want):
        assert_as_plain(eng, p, rt.generate(p, sp).tokens, tokens)
        assert_as_plain(eng, p, s.tokens, tokens)

    calls = []
    int8 = eng.greedy_draft_head

    class Spy:
        def run(self, names, feeds):
            calls.append(feeds["hidden"].shape)
            return int8.run(names, feeds)

    eng.greedy_draft_head = Spy()
    seq = eng.new_sequence()
    eng.prefill(seq, np.array(prompts[0]))
    eng.draft(seq, 5, SamplingParams(temperature=1.0), np.full(eng.info.block_size - 1, 0.5))
    assert calls == []  # the sampled chain: the fp32 draft head
    seq = eng.new_sequence()
    eng.prefill(seq, np.array(prompts[0]))
    eng.draft(seq, 5, SamplingParams(), None)
    assert calls == [(1, eng.info.block_size - 1, w.shape[1])]


def test_the_benchmark_prints_both_ways_and_their_agreement(ort_pair, monkeypatch_module, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "greedy_head_bench", Path(__file__).resolve().parent.parent / "benchmarks" / "greedy_head.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--engine", str(ort_pair[1]), "--prompts", "2", "--max-new-tokens", "6", "--rounds", "1",
                "--threads", "1", "--min-params", "0"])
    out = capsys.readouterr().out
    assert "int8 screen on" in out
    assert out.count("identical 2/2") == 2
    assert "head call, ms" in out and out.strip().splitlines()[-1].startswith("  16 | ")
    bench.main(["--engine", str(ort_pair[1]), "--prompts", "2", "--max-new-tokens", "6", "--rounds", "1",
                "--threads", "1", "--min-params", "0", "--drafts"])
    out = capsys.readouterr().out
    assert "greedy drafts from the int8 copy" in out and "identical 2/2" in out
    assert "draft head call, ms" in out and out.strip().splitlines()[-1].startswith(" 120 | ")


_EMULATED = """
import json, os, sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, sys.argv[2])
import test_greedy_head as t
from dflash_export.engines import greedy_head as gh

tmp = Path(sys.argv[1])
os.environ["DFLASH_CACHE"] = str(tmp / "cache")
gh.MIN_PARAMS = 0
w = t._weights()
path, sess = t._head_files(tmp, w)
g = gh.greedy_head_for(sess, path, tmp, ort, t._session_options(), ["CPUExecutionProvider"])
x = t._hidden(np.random.default_rng(1), 24, w)
got = np.argmax(g.logits(x[None]), axis=1).tolist()
print("RESULT " + json.dumps({"screen": g.screen is not None, "same": got == t._oracle(w, x).tolist()}))
"""


def test_on_an_avx2_cpu_the_screen_s_tokens_are_the_exact_ones(tmp_path):
    """The bound is a property of the int8 kernel, checked at load on the CPU that runs it: under qemu's AVX2-only
    EPYC-Rome (MLAS's AVX2 kernels) the tokens are the exact ones whether or not the screen passes its check."""
    import platform
    from pathlib import Path

    from test_numerics import EMULATED_CPU, QEMU, _run_emulated

    if platform.machine() != "x86_64" or QEMU is None:
        pytest.skip("needs x86-64 and qemu-user (./dev installs Debian's qemu-user when it runs as root)")
    assert EMULATED_CPU == "EPYC-Rome"
    here = str(Path(__file__).resolve().parent)
    script = _EMULATED.replace("sys.argv[2]", repr(here))
    got = _run_emulated(script, tmp_path, tmp_path, timeout=600)
    assert got["same"], got
