"""The engine's kernel-numerics probe (engines/numerics.py): it finds the row floor that makes verify rows equal plain
steps on the CPU it runs on, says so when none does, and holds on another instruction set than this machine's (an
AVX2-only AMD EPYC under qemu-user's CPU emulation, where ONNX Runtime's int4 kernels take other paths)."""

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


def test_probe_picks_the_floor_that_hides_a_one_row_kernel(engine):
    """A head whose one-row calls round differently (AVX2 int4's case): floor 1 is caught, floor 2 agrees."""
    engine.head = _RowDependentHead(engine.head, lambda h: 2.0 ** -20 if h.shape[1] == 1 else 0.0)
    num = choose_row_floor(engine, first=1)
    assert [t[:2] for t in num.tried] == [[1, False], [2, True]]
    assert num.tried[0][2] >= 2.0 ** -21  # at least the planted bias (the target's own one-row path may add)
    assert num.row_floor == engine.row_floor == 2 and num.bit_identical and num.max_abs_diff == 0.0
    assert "bit-identical" in num.statement and isa_label(num.cpu["isa"]) in num.statement


def test_no_floor_agrees_then_the_engine_says_so(engine):
    """Results that depend on the other rows' values (distinct rows in a verify block, copies in a padded step): no
    floor can help; the verdict says so, with the measured difference."""
    engine.head = _RowDependentHead(engine.head, lambda h: len(np.unique(h[0], axis=0)) * 2.0 ** -18)
    num = choose_row_floor(engine, first=2)
    assert not num.bit_identical and num.max_abs_diff > 0
    assert len(num.tried) == min(4, engine.info.block_size) and not any(t[1] for t in num.tried)
    assert num.row_floor == min(num.tried, key=lambda t: t[2])[0]
    assert "lossless within kernel numerics on this CPU" in num.statement


def test_padding_rows_change_no_committed_row(engine):
    """The floor only changes the kernels' shape: a padded one-token step commits what a verify row computes."""
    same, diff = probe_floor(engine, max(2, engine.row_floor))
    assert same and diff == 0.0


def test_cpu_features_come_from_cpuid():
    cpu = cpu_features()
    assert cpu["model"] and cpu["machine"] == platform.machine()
    if platform.machine() in ("x86_64", "AMD64"):
        assert "SSE41" in cpu["isa"]
        flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
        if flags:  # numpy's CPUID probe and the kernel's flags agree on the wide vector units
            assert ("AVX512F" in cpu["isa"]) == ("avx512f" in flags) and ("AVX2" in cpu["isa"]) == ("avx2" in flags)


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
    script = tmp_path / "emulated.py"
    script.write_text(_EMULATED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([QEMU, "-cpu", EMULATED_CPU, sys.executable, str(script), str(int4_engine)],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert "AVX2" in res["isa"] and "AVX512F" not in res["isa"], res  # the emulated CPU, not this one
    assert res["bit_identical"], res
    assert res["worst"] == 0.0 and all(res["same"]), res
