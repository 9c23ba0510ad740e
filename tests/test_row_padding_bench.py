"""benchmarks/row_padding.py on a tiny built engine: its copy pads the other way (attention alone <-> the products
too), leaves the engine it copies untouched, and a tiny run prints the three variants' rows."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from script_support import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "row_padding.py"


def test_the_copy_pads_the_other_way_and_still_agrees_with_verify_rows(ort_pair, tmp_path):
    from dflash_export.engines.numerics import probe_floor
    from dflash_export.engines.registry import load_engine
    from dflash_export.engines.row_pad import padded_ops

    engine = ort_pair[1]
    before = padded_ops(engine / "target.onnx")
    mod = load_script(SCRIPT, "row_padding")
    out = tmp_path / "copy"
    out.mkdir()
    ops = mod.padded_the_other_way(engine, out)
    assert padded_ops(engine / "target.onnx") == before  # the original is not rewritten through a hard link
    assert ops == padded_ops(out / "target.onnx") and ops != before and "GroupQueryAttention" in ops
    eng = load_engine(out, threads=1)  # its files match the manifest written for them
    try:
        same, diff = probe_floor(eng, 2, pad="graph")
        if ort_pair[2].numerics.bit_identical:  # floor 2 agrees on this CPU, padding attention alone or the products
            assert (same, diff) == (True, 0.0)
        else:  # no floor agrees on this CPU: the probe answers all the same, consistently
            assert same == (diff == 0.0)
        rng = np.random.default_rng(0)
        ids = rng.integers(3, 200, 9)
        a, b = ort_pair[2].new_sequence(16), eng.new_sequence(16)
        np.testing.assert_array_equal(ort_pair[2].prefill(a, ids), eng.prefill(b, ids))
    finally:
        eng.close()


def test_tiny_run_prints_the_three_variants(ort_pair):
    r = subprocess.run([sys.executable, str(SCRIPT), "--engine", str(ort_pair[1]), "--rounds", "1", "--steps", "2",
                        "--context", "5", "--threads", "1"], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| plain")]
    assert [x.split(" (")[0] for x in rows] == ["| as built", "| padding GroupQueryAttention, MatMul",
                                                  "| one row, no floor"], r.stdout
