"""benchmarks/matmulnbits_rows.py: its configuration parsing (one clear error for a bad one) and a tiny run that prints
one table row per configuration, the fp32 MatMul first."""

from __future__ import annotations

import subprocess
import sys

import pytest
from script_support import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "matmulnbits_rows.py"


def _module():
    return load_script(SCRIPT, "matmulnbits_rows")


def test_configs_parse_and_bad_ones_name_the_option():
    mod = _module()
    assert mod.parse_configs("4:32:4, 8:64:1,") == [(4, 32, 4), (8, 64, 1)]
    for bad in ("4:32", "3:32:4", "4:48:4", "4:32:9", "x:32:4"):
        with pytest.raises(SystemExit, match="--configs"):
            mod.parse_configs(bad)


def test_tiny_run_prints_a_row_per_configuration():
    r = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "64", "--inner", "128", "--layers", "1", "--reps",
                        "1", "--threads", "1", "--configs", "4:32:4,8:32:4"], check=False, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    first, attention = r.stdout.split("attention's probabilities")
    rows = [ln for ln in first.splitlines() if ln.startswith("| ") and not ln.startswith("| weights")]
    assert [ln.split(" | ")[0] for ln in rows] == ["| fp32", "| int4", "| int8"]
    assert all(ln.count("|") == 10 for ln in rows)
    # the attention product's three forms at four lengths, each with the CPU's verdict: whether a row run alone gets
    # the bits it gets among others is a property of the kernels this processor takes (docs/figures.md), so only the
    # report's shape is asserted. No engine relies on the verdicts: the single-stream engine's numerics probe checks
    # its own steps when it loads (engines/numerics.py), and batched rows are compared with each request run alone
    # (tests/test_batching.py, `bench --concurrency`)
    rows = [ln.split(" | ") for ln in attention.splitlines() if ln.startswith("| ") and "product" not in ln]
    assert len(rows) == 12
    forms = [cells[0] for cells in rows]
    assert len(set(forms)) == 3 and all(forms.count(f) == 4 for f in forms)
    assert all(cells[-1] in ("yes |", "no |") for cells in rows)
