"""The engine's kernel-numerics probe (engines/numerics.py): it finds the row floor that makes verify rows equal plain
steps on the CPU it runs on, says so when none does, and holds on another instruction set than this machine's (an
AVX2-only AMD EPYC under qemu-user's CPU emulation, where ONNX Runtime's int4 kernels take other paths).

Tests that plant a kernel on top of this CPU's own need a floor at which this CPU's own kernels agree (the engine's
load-time verdict, `engine.numerics.bit_identical`); where none does, they check what the probe states instead: no
floor agrees, the engine says so, and no verdict is cached."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dflash_export.engines.numerics import choose_row_floor, cpu_features, isa_label, probe_floor


class _RowDependentHead:
    """An LM-head session whose results depend on the other rows of the call, as kernels do on some CPUs:
    `bias(hidden)` is added to every logit of a call on `hidden` [1, n, H] (0 = the real head's numbers)."""

    def __init__(self, real, bias):
        self.real, self.bias = real, bias

    def run(self, names, feeds):
        out = self.real.run(names, feeds)
        return [out[0] + np.float32(self.bias(feeds["hidden"]))]


@pytest.fixture()
def engine(ort_pair):
    eng = ort_pair[2]
    head, floor = eng.head, eng.row_floor
    yield eng
    eng.head, eng.row_floor = head, floor


def _says_no_floor_agrees(num) -> None:
    assert not num.bit_identical and not any(t[1] for t in num.tried) and num.max_abs_diff > 0, num.tried
    assert "lossless within kernel numerics on this CPU" in num.statement


def test_probe_picks_the_floor_that_hides_a_one_row_kernel(engine):
    """A head whose one-row calls round differently (AVX2 int4's case): floor 1 is caught, floor 2 agrees."""
    engine.head = _RowDependentHead(engine.head, lambda h: 2.0 ** -20 if h.shape[1] == 1 else 0.0)
    num = choose_row_floor(engine, first=1)
    if not engine.numerics.bit_identical:  # no floor hides this CPU's own kernels: none hides the planted one either
        _says_no_floor_agrees(num)
        return
    assert [t[:2] for t in num.tried] == [[1, False], [2, True]]
    assert num.tried[0][2] >= 2.0 ** -21  # at least the planted bias (the target's own one-row path may add)
    assert num.row_floor == engine.row_floor == 2 and num.bit_identical and num.max_abs_diff == 0.0
    # The target pads its products and attention alone (engines/row_pad.py), tried before the whole step.
    assert engine.graph_pads and num.tried[1][3] == num.row_pad == engine.row_pad == "graph"
    assert "bit-identical" in num.statement and isa_label(num.cpu["isa"]) in num.statement


class _PerRowHead:
    """An LM head that computes each row alone (a vector-matrix product per row): its rows agree at any row count by
    construction; records the row count of every call."""

    def __init__(self, weight, calls):
        self.weight, self.calls = weight, calls

    def run(self, names, feeds):
        h = feeds["hidden"]
        self.calls.append(h.shape[1])
        return [np.stack([h[0, i] @ self.weight for i in range(h.shape[1])])[None]]


def test_head_runs_one_row_only_where_its_rows_agree(engine):
    """At a row floor of 2, a head whose rows agree at any row count is called with one row; one whose one-row
    calls round differently is padded to the floor, and its logits are the many-row call's."""
    hidden_size = engine._mask_row.shape[0]
    weight = np.random.default_rng(0).standard_normal((hidden_size, 64)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((1, 1, hidden_size)).astype(np.float32)
    engine.row_floor, calls = 2, []
    engine.head = _PerRowHead(weight, calls)
    assert engine._head_floor_free()
    calls.clear()
    np.testing.assert_array_equal(engine._logits(x), (x[0, 0] @ weight)[None])
    assert calls == [1]
    biased = _RowDependentHead(_PerRowHead(weight, calls), lambda h: 2.0 ** -20 if h.shape[1] == 1 else 0.0)
    engine.head = biased
    assert not engine._head_floor_free()
    calls.clear()
    np.testing.assert_array_equal(engine._logits(x), (x[0, 0] @ weight)[None])  # no bias: a two-row call
    assert calls == [2]


def test_no_floor_agrees_then_the_engine_says_so(engine):
    """Results that depend on the other rows' values (distinct rows in a verify block, copies in a padded step): no
    floor can help; the verdict says so, with the measured difference."""
    engine.head = _RowDependentHead(engine.head, lambda h: len(np.unique(h[0], axis=0)) * 2.0 ** -18)
    num = choose_row_floor(engine, first=2)
    assert not num.bit_identical and num.max_abs_diff > 0
    every = [(1, "host")] + [(f, p) for f in range(2, min(4, engine.info.block_size) + 1) for p in ("graph", "host")]
    assert [tuple(t[0::3]) for t in num.tried] == [(2, "graph")] + [c for c in every if c != (2, "graph")]
    assert not any(t[1] for t in num.tried)
    assert num.row_floor == min(num.tried, key=lambda t: t[2])[0]
    assert "lossless within kernel numerics on this CPU" in num.statement


@pytest.mark.parametrize("pad", ["graph", "host"])
def test_padding_rows_change_no_committed_row(engine, pad):
    """The floor only changes the kernels' shape: a one-token step padded in the graph (products and attention) or
    on the host (the whole step) commits what a verify row computes."""
    same, diff = probe_floor(engine, max(2, engine.row_floor), pad=pad)
    if engine.numerics.bit_identical:
        assert same and diff == 0.0
    else:  # no floor agrees on this CPU (the load probed this one too)
        assert not same and diff > 0


def test_the_padding_comes_off_as_it_went_on(ort_pair, tmp_path):
    """Unpadding a padded target gives back the exported graph node for node, whichever operators were padded; a
    graph padding attention alone gathers no product's rows, one padding the products too gathers them all."""
    import onnx

    from dflash_export.engines.row_pad import pad_in_graph, padded_ops, unpad_graph

    path = tmp_path / "target.onnx"
    shutil.copy(ort_pair[1] / "target.onnx", path)  # the graph only: its weights stay external, unread
    assert unpad_graph(path) and not unpad_graph(path) and padded_ops(path) == []
    exported = onnx.load(str(path), load_external_data=False).graph
    products = sorted({n.op_type for n in exported.node if n.op_type in ("MatMul", "MatMulNBits")})
    for with_products, ops in ((False, ["GroupQueryAttention"]), (True, sorted(["GroupQueryAttention", *products]))):
        assert pad_in_graph(path, products=with_products) and padded_ops(path) == ops
        assert unpad_graph(path)
        again = onnx.load(str(path), load_external_data=False).graph
        assert [(n.op_type, list(n.input), list(n.output)) for n in again.node] == \
            [(n.op_type, list(n.input), list(n.output)) for n in exported.node]
        assert [i.name for i in again.input] == [i.name for i in exported.input]


def _plant_one_row_norm(engine_dir: Path) -> None:
    """Make the target's first norm take, at one row only, an input 2**-10 off: a row-wise kernel whose one-row path
    rounds differently, which padding the products and attention alone does not hide."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = engine_dir / "target.onnx"
    model = onnx.load(str(path), load_external_data=False)
    nodes = list(model.graph.node)
    k = next(i for i, n in enumerate(nodes) if n.op_type.endswith("LayerNormalization"))
    x = nodes[k].input[0]
    model.graph.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), "plant_one"),
                                    numpy_helper.from_array(np.array(2.0 ** -10, np.float32), "plant_eps")])
    planted = [helper.make_node("Shape", [x], ["plant_rows"], start=1, end=2),
               helper.make_node("Equal", ["plant_rows", "plant_one"], ["plant_is_one"]),
               helper.make_node("Cast", ["plant_is_one"], ["plant_flag"], to=TensorProto.FLOAT),
               helper.make_node("Mul", ["plant_flag", "plant_eps"], ["plant_bias"]),
               helper.make_node("Add", [x, "plant_bias"], ["plant_x"])]
    nodes[k].input[0] = "plant_x"
    model.graph.ClearField("node")
    model.graph.node.extend(nodes[:k] + planted + nodes[k:])
    onnx.save(model, str(path))


def test_a_one_row_norm_sends_the_padding_back_to_the_host(ort_pair, tmp_path):
    """Padding in the graph keeps the norms at one row: where a norm's one-row path differs, the probe sees it and
    pads the whole step on the host, which agrees."""
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.onnxruntime import OrtEngine

    engine_dir = tmp_path / "engine"
    shutil.copytree(ort_pair[1], engine_dir)
    _plant_one_row_norm(engine_dir)
    eng = OrtEngine(engine_dir, read_manifest(engine_dir, verify_files=False), threads=1, probe_full=True)
    try:
        num = eng.numerics
        assert eng.graph_pads
        if not ort_pair[2].numerics.bit_identical:  # no floor agrees on this CPU without the planted norm either
            _says_no_floor_agrees(num)
            return
        verdicts = {(t[0], t[3]): t[1] for t in num.tried}
        assert verdicts == {(1, "host"): False, (2, "graph"): False, (2, "host"): True}
        assert all(t[2] > 0 for t in num.tried if not t[1])
        assert num.row_floor == eng.row_floor == 2 and num.row_pad == eng.row_pad == "host" and num.bit_identical
        # and what the verdict promises holds: plain decoding equals a verify block's rows, bit for bit
        assert probe_floor(eng, 2, pad="host") == (True, 0.0)
    finally:
        eng.close()


def test_cpu_features_come_from_cpuid():
    cpu = cpu_features()
    assert cpu["model"] and cpu["machine"] == platform.machine()
    if platform.machine() in ("x86_64", "AMD64"):
        assert "SSE41" in cpu["isa"]
        flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
        if flags:  # numpy's CPUID probe and the kernel's flags agree on the wide vector units
            assert ("AVX512F" in cpu["isa"]) == ("avx512f" in flags) and ("AVX2" in cpu["isa"]) == ("avx2" in flags)


def test_features_numpy_cannot_see_are_read_from_the_kernels_flags_unless_an_emulator_answers_cpuid():
    from dflash_export.engines.numerics import isa_features

    cpuid = {"SSE41": True, "AVX": True, "AVX2": True, "FMA3": True, "F16C": True, "AVX512F": True,
             "AVX512VNNI": True, "AVX512FP16": True}
    host = {"sse4_1", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_tile",
            "amx_int8", "amx_bf16"}
    # numpy 2 has no key for AVX-VNNI or AMX: the kernel's flags say them when they agree with CPUID elsewhere
    assert isa_features(cpuid, host)[-4:] == ["AVXVNNI", "AMX_TILE", "AMX_INT8", "AMX_BF16"]
    assert "AMX_TILE" not in isa_features(cpuid, host - {"amx_tile"})
    assert "AMX_TILE" not in isa_features(cpuid, None)  # no /proc/cpuinfo
    # qemu-user emulating an AVX2-only CPU on this host: CPUID says no AVX-512, the flags are the host's; not read
    emulated = {k: v for k, v in cpuid.items() if not k.startswith("AVX512")}
    assert isa_features(emulated, host) == ["SSE41", "AVX", "AVX2", "FMA3", "F16C"]
    # where numpy does report a feature, CPUID decides, whatever the flags say
    assert "AVXVNNI" in isa_features({**cpuid, "AVXVNNI": True}, set())


# An instruction set this machine may not have: qemu-user translating x86-64 for a CPU model without AVX-512
# (AMD EPYC Rome: AVX2, FMA, F16C). ONNX Runtime reads CPUID, which qemu answers for the emulated model, so its MLAS
# dispatches to the AVX2 kernels -- the ones whose int4 one-row product differs from many-row products.
EMULATED_CPU = "EPYC-Rome"
QEMU = shutil.which("qemu-x86_64")

_EMULATED = textwrap.dedent("""
    import json, sys
    import numpy as np
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.numerics import probe_floor
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    eng = load_engine(sys.argv[1], threads=1)
    num = eng.numerics
    floor = eng.row_floor
    one_row_head = probe_floor(eng, 1)  # what the engine would give without a floor, for the record
    eng.row_floor = floor
    rng = np.random.default_rng(1)
    prompt, block = rng.integers(3, 200, 23), rng.integers(3, 200, eng.info.block_size)
    s2 = eng.new_sequence(); eng.prefill(s2, prompt)
    plain = np.stack([eng.decode(s2, int(t)) for t in block])
    worst = 0.0
    for m in range(1, len(block) + 1):
        s1 = eng.new_sequence(); eng.prefill(s1, prompt)
        hidden, _ = eng._run_target(s1, block[:m], m)
        worst = max(worst, float(np.abs(eng._logits(hidden) - plain[:m]).max()))
    rt = DFlashRuntime(eng)
    same = []
    for p in ([1, 2, 3, 4, 5], list(range(10, 41)), [200, 13, 13, 13, 99, 5, 64, 65]):
        sp = SamplingParams(max_new_tokens=24)
        same.append(rt.generate(p, sp, "dflash").tokens == rt.generate(p, sp, "ar").tokens)
    print("RESULT " + json.dumps({"isa": num.cpu["isa"], "bit_identical": num.bit_identical, "tried": num.tried,
                                  "worst": worst, "same": same, "floor_1": one_row_head}))
""")


def _run_emulated(script_text: str, engine_dir: Path, tmp_path: Path, timeout: int = 600) -> dict:
    """Run `script_text` on `engine_dir` under qemu's emulated AVX2 CPU; the JSON of its "RESULT " line."""
    script = tmp_path / "emulated.py"
    script.write_text(script_text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([QEMU, "-cpu", EMULATED_CPU, sys.executable, str(script), str(engine_dir)],
                          capture_output=True, text=True, timeout=timeout, env=env, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def int4_engine(tmp_path_factory):
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    return build_onnxruntime(load_recipe("tiny-qwen3"), tmp_path_factory.mktemp("isa") / "int4", threads=1,
                             precision="int4")


@pytest.mark.skipif(platform.machine() != "x86_64" or QEMU is None,
                    reason="needs x86-64 and qemu-user (./dev installs Debian's qemu-user when it runs as root)")
def test_int4_engine_is_lossless_on_an_emulated_avx2_cpu(int4_engine, tmp_path):
    """The engine built on this machine, loaded on an AVX2-only CPU: its probe runs there, and what it states holds
    there -- verify rows equal plain steps at every row count, DFlash equals the engine's own plain decoding."""
    res = _run_emulated(_EMULATED, int4_engine, tmp_path)
    assert "AVX2" in res["isa"] and "AVX512F" not in res["isa"], res  # the emulated CPU, not this one
    assert res["bit_identical"], res
    assert res["worst"] == 0.0 and all(res["same"]), res


_REPAD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from dflash_export.engines.manifest import read_manifest, write_manifest
    from dflash_export.engines.ort_build import choose_graph_padding
    from dflash_export.engines.row_pad import pad_in_graph, padded_ops, unpad_graph

    d = Path(sys.argv[1])
    unpad_graph(d / "target.onnx")  # the target as the build exports it, padded as a build pads it first
    pad_in_graph(d / "target.onnx", products=False)
    manifest = json.loads((d / "manifest.json").read_text())
    write_manifest(d, manifest)  # the files as they now are
    choose_graph_padding(d, manifest, threads=1)
    m = read_manifest(d)
    print("RESULT " + json.dumps({"ops": padded_ops(d / "target.onnx"), "flags": m.raw["flags"]["row_pad_ops"],
                                  "numerics": m.raw["numerics"]}))
""")


def _one_row_int4_products_agree() -> bool:
    """Whether this CPU's int4 MatMulNBits (block 32, accuracy level 4: the engines' choice) gives a row run alone
    the bits it gets among other rows -- ONNX Runtime's kernels asked directly, not through the engine."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(3)
    w = helper.make_tensor("w", TensorProto.FLOAT, (64, 96), rng.standard_normal((64, 96)).astype(np.float32).ravel())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 96])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    q = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4)
    q.process()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(q.model.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((8, 64)).astype(np.float32)
    many = sess.run(None, {"x": x})[0]
    return all(np.array_equal(sess.run(None, {"x": x[i:i + 1]})[0][0], many[i]) for i in range(8))


def test_the_build_pads_attention_alone_where_the_products_rows_agree(int4_engine):
    """A build tries padding attention alone first and keeps it where the probe finds it bit-identical; so an int4
    engine's graph pads its products too exactly where this CPU's MatMulNBits one-row product differs (asked of
    ONNX Runtime directly), and its plain steps equal verify rows either way."""
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.row_pad import padded_ops

    m = read_manifest(int4_engine)
    ops = padded_ops(int4_engine / "target.onnx")
    assert m.raw["flags"]["row_pad_ops"] == ops
    if not m.raw["numerics"]["bit_identical"]:  # no floor agreed on this CPU: the build records so, with the difference
        assert m.raw["numerics"]["max_abs_diff"] > 0 and m.flags.plain_step_rows == m.raw["numerics"]["row_floor"]
        return
    if m.raw["numerics"]["row_floor"] > 1:
        assert m.raw["numerics"]["row_pad"] == "graph"
        expected = ["GroupQueryAttention"] if _one_row_int4_products_agree() else \
            ["GroupQueryAttention", "MatMulNBits"]
        assert ops == expected


@pytest.mark.skipif(platform.machine() != "x86_64" or QEMU is None,
                    reason="needs x86-64 and qemu-user (./dev installs Debian's qemu-user when it runs as root)")
def test_a_build_on_an_avx2_cpu_pads_the_int4_products_in_the_graph(int4_engine, tmp_path):
    """On an AVX2-only CPU (emulated), where int4 MatMulNBits' one-row product differs from its many-row rows,
    padding attention alone is not bit-identical: the build's choice pads the products too, in the graph, and the
    probe then finds plain steps equal to verify rows there."""
    engine = tmp_path / "engine"
    shutil.copytree(int4_engine, engine)
    res = _run_emulated(_REPAD, engine, tmp_path, timeout=900)
    num = res["numerics"]
    assert "AVX2" in num["cpu"]["isa"] and "AVX512F" not in num["cpu"]["isa"], num
    assert res["ops"] == res["flags"] == ["GroupQueryAttention", "MatMulNBits"], res
    assert num["bit_identical"] is True and num["row_floor"] == 2 and num["row_pad"] == "graph", num


def _forge(engine, monkeypatch, tmp_path, content) -> Path:
    """Write `content` where this engine's cached verdict for this CPU lives (a cache in tmp_path)."""
    from dflash_export.engines import numerics

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    path = numerics._cache_path(engine, cpu_features(), 0, numerics.probe_rows(engine), 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _one_row_differs(engine):
    """This CPU as one where one-row calls round differently (floor 1 is not bit-identical, floor 2 is)."""
    engine.head = _RowDependentHead(engine.head, lambda h: 2.0 ** -20 if h.shape[1] == 1 else 0.0)


@pytest.mark.parametrize("forged", [
    {"row_floor": 1, "bit_identical": True},   # bit-identical claimed where floor 1 is not
    {"row_floor": 0}, {"row_floor": -3}, {"row_floor": 64}, {"row_floor": "x"}, {"row_floor": True},
    {"bit_identical": "yes"}, {"max_abs_diff": -1.0}, {"max_abs_diff": 0.5},  # a difference with "identical"
    {"cpu": {"model": "elsewhere", "machine": "x86_64", "isa": ["AVX512F"]}}, {"max_rows": 3},
    {"tried": [["1", True, 0.0]]}, {"tree_bit_identical": "no"}, {"unknown_field": 1},
    "{not json", "[1, 2]", "", "\xff\xfe",
])
def test_a_forged_or_corrupt_cached_verdict_is_replaced_by_a_fresh_probe(engine, monkeypatch, tmp_path, forged):
    """The verdict cache is read, never trusted: a verdict of the wrong type or range, about another CPU or probe,
    or claiming bit-identity where the floor is not, gives way to the probe's own answer (floor 2 on this CPU with
    one-row calls rounded differently), the run goes on, and the file left behind is the fresh verdict."""
    from dflash_export.engines import numerics

    _one_row_differs(engine)
    if isinstance(forged, dict):
        good = {"row_floor": 2, "bit_identical": True, "max_abs_diff": 0.0, "cpu": cpu_features(),
                "max_rows": numerics.probe_rows(engine), "onnxruntime": "1", "threads": 0, "tried": [[2, True, 0.0]]}
        forged = {**good, **forged}
        if forged == good | {"row_floor": 1}:
            forged["tried"] = [[1, True, 0.0]]
    path = _forge(engine, monkeypatch, tmp_path, forged)
    num = choose_row_floor(engine, first=1, threads=0, recorded={})
    if not engine.numerics.bit_identical:  # no floor agrees on this CPU: probed afresh, and nothing cached
        _says_no_floor_agrees(num)
        assert num.tried[0][:2] == [1, False] and not path.exists()
        return
    assert num.row_floor == engine.row_floor == 2 and num.bit_identical
    assert [t[:2] for t in num.tried] == [[1, False], [2, True]]  # probed afresh, not read
    cached = json.loads(path.read_text())
    assert cached["row_floor"] == 2 and cached["bit_identical"] is True and cached["tried"] == num.tried


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "sparse terabyte"])
def test_a_cached_verdict_that_is_no_small_file_is_probed_afresh_without_waiting_on_it(engine, monkeypatch, tmp_path,
                                                                                       kind):
    """In the verdict's place a FIFO (whose open waits for a writer that never comes) or a file of a terabyte: the
    load neither waits on it nor reads it, probes afresh, and leaves the fresh verdict there."""
    from wait_support import fails_after

    _one_row_differs(engine)
    path = _forge(engine, monkeypatch, tmp_path, "")
    path.unlink()
    if kind == "sparse terabyte":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    else:
        fifo = path if kind == "fifo" else tmp_path / "fifo"
        os.mkfifo(fifo)
        if fifo != path:
            path.symlink_to(fifo)
    with fails_after(10, "the load waited on the cached verdict"):
        num = choose_row_floor(engine, first=1, threads=0, recorded={})
    if not engine.numerics.bit_identical:  # no floor agrees on this CPU: probed afresh, and nothing left there
        _says_no_floor_agrees(num)
        assert num.tried[0][:2] == [1, False] and not path.exists() and not path.is_symlink()
        return
    assert num.row_floor == engine.row_floor == 2 and [t[:2] for t in num.tried] == [[1, False], [2, True]]
    assert path.is_file() and not path.is_symlink() and json.loads(path.read_text())["tried"] == num.tried


def test_a_sound_cached_verdict_is_rechecked_at_its_floor_then_used(engine, monkeypatch, tmp_path):
    """A valid cached verdict costs a re-check at the row counts where kernels change paths, not a full probe (where
    no floor agrees on this CPU, the verdict is not bit-identical, and such a verdict is never used: a full probe)."""
    from dflash_export.engines import numerics

    _one_row_differs(engine)
    fresh = choose_row_floor(engine, first=1, threads=0)
    _forge(engine, monkeypatch, tmp_path, fresh.to_json())
    calls = []
    real = numerics.probe_floor
    monkeypatch.setattr(numerics, "probe_floor", lambda e, floor, rows=None, pad="host":
                        calls.append((floor, rows)) or real(e, floor, rows, pad))
    num = choose_row_floor(engine, first=1, threads=0, recorded={})
    if not engine.numerics.bit_identical:
        _says_no_floor_agrees(num)
        assert len(calls) == len(num.tried) and all(rows is None for _, rows in calls)
        return
    assert num.row_floor == engine.row_floor == 2 and num.tried == fresh.tried
    assert len(calls) == 1 and calls[0][0] == 2 and calls[0][1] is not None
    assert len(calls[0][1]) < numerics.probe_rows(engine)


def test_cached_verdicts_are_bounded_and_the_most_recently_used_kept(engine, monkeypatch, tmp_path):
    """Every rebuilt engine leaves a verdict; past KEPT_VERDICTS the least recently used go, a verdict just re-used
    stays, and files that are not verdicts are left alone."""
    from dflash_export.engines import numerics

    monkeypatch.setattr(numerics, "KEPT_VERDICTS", 3)
    path = _forge(engine, monkeypatch, tmp_path, "")
    path.unlink()
    root = path.parent
    old = [root / f"{i:024x}.json" for i in range(5)]
    for i, p in enumerate(old):
        p.write_text("{}")
        os.utime(p, (1000 + i, 1000 + i))
    (root / "notes.txt").write_text("x")
    os.utime(old[0], (5000, 5000))  # the oldest written, used last
    choose_row_floor(engine, first=1, threads=0, recorded={})  # probes, writes this engine's verdict, prunes
    if not engine.numerics.bit_identical:  # no floor agrees on this CPU: no verdict written, so none pruned by it
        assert sorted(p.name for p in root.iterdir()) == sorted([p.name for p in old] + ["notes.txt"])
        numerics._prune_verdicts(root)
        assert sorted(p.name for p in root.iterdir()) == sorted([old[0].name, old[4].name, old[3].name, "notes.txt"])
        return
    assert sorted(p.name for p in root.iterdir()) == sorted([path.name, old[0].name, old[4].name, "notes.txt"])
    # a hit marks its verdict used: two newer verdicts later, it is still there and old[0] is not
    choose_row_floor(engine, first=1, threads=0, recorded={})
    for i in (5, 6):
        (root / f"{i:024x}.json").write_text("{}")
    numerics._prune_verdicts(root)
    assert path.exists() and not old[0].exists()
