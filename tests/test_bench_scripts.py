"""The measuring scripts' command lines (benchmarks/, recipes/smollm2-135m/measure_tau.py, scripts/zlab_pair.py): a
count of 0 or less, a missing engine directory or an unknown kind is one `error:` line naming what is wrong, exit code
2, no traceback, before any work; and the scripts that time steps through benchmarks/engine_costs.py's `measure` run
on a tiny engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from script_support import BENCHMARKS

ROOT = BENCHMARKS.parent
NOWHERE = "/nonexistent/engine"


def _run(script: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(r: subprocess.CompletedProcess, starts: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(starts), r.stderr[-2000:]


# The engine named is missing too: the count is refused before the engine is looked for.
BAD_COUNTS = [
    ("proposers.py", ["--engine", NOWHERE, "--prompts", "0"], "--prompts"),
    ("proposers.py", ["--engine", NOWHERE, "--max-new-tokens", "-1"], "--max-new-tokens"),
    ("batch_trees.py", ["--engine", NOWHERE, "--reps", "0"], "--reps"),
    ("batch_trees.py", ["--engine", NOWHERE, "--concurrency", "1,0"], "--concurrency"),
    ("batch_costs.py", ["--engine", NOWHERE, "--batches", "0"], "--batches"),
    ("kv_rows.py", ["--engine", NOWHERE, "--steps", "2"], "--steps"),
    ("batch_companions.py", [NOWHERE, "--steps", "0"], "--steps"),
    ("drafter_precision.py", ["--engines", NOWHERE, "--prompts", "-1"], "--prompts"),
    ("engine_costs.py", ["--engine", NOWHERE, "--reps", "0"], "--reps"),
    ("engine_memory.py", ["--engine", NOWHERE, "--rounds", "0"], "--rounds"),
    ("greedy_head.py", ["--engine", NOWHERE, "--rounds", "0"], "--rounds"),
    ("hybrid_costs.py", ["--layer", "--reps", "0"], "--reps"),
    ("lookup_calibration.py", ["--prompts", "0"], "--prompts"),
    ("matmulnbits_rows.py", ["--reps", "0"], "--reps"),
    ("moe_costs.py", ["--shape", "tiny", "--rounds", "0"], "--rounds"),
    ("row_padding.py", ["--engine", NOWHERE, "--steps", "0"], "--steps"),
    ("sampling_power.py", ["--seeds", "0"], "--seeds"),
    ("sampling_power.py", ["--faults", "none,bogus"], "--faults"),
    ("soak.py", ["--engine", NOWHERE, "--clients", "0"], "--clients"),
    ("triton_bench.py", ["--engine", NOWHERE, "--requests-per-level", "0"], "--requests-per-level"),
    ("llamacpp_peer/run.py", ["--rounds", "0"], "--rounds"),
    ("ortgenai_peer/run.py", ["--num-prompts", "0"], "--num-prompts"),
    ("ortgenai_peer/step_profile.py", ["--engine", NOWHERE, "--steps", "0"], "--steps"),
    ("../recipes/smollm2-135m/measure_tau.py", ["--prompts", "1", "--block-sizes", "8,1"], "--block-sizes"),
]


@pytest.mark.parametrize("script, args, option", BAD_COUNTS, ids=[f"{s}:{o}" for s, _, o in BAD_COUNTS])
def test_a_count_below_one_is_one_error_line_before_any_work(script, args, option):
    _one_error_line(_run(BENCHMARKS / script, *args), f"error: {option}: ")


MISSING_ENGINE = [
    ("proposers.py", ["--engine", NOWHERE, "--prompts", "1"]),
    ("batch_trees.py", ["--engine", NOWHERE]),
    ("batch_costs.py", ["--engine", NOWHERE]),
    ("kv_rows.py", ["--engine", NOWHERE]),
    ("batch_companions.py", [NOWHERE]),
    ("drafter_precision.py", ["--engines", NOWHERE]),
    ("engine_costs.py", ["--engine", NOWHERE]),
    ("engine_memory.py", ["--engine", NOWHERE]),
    ("greedy_head.py", ["--engine", NOWHERE]),
    ("row_padding.py", ["--engine", NOWHERE]),
    ("hybrid_costs.py", ["--engine", NOWHERE, "--dense"]),
]


@pytest.mark.parametrize("script, args", MISSING_ENGINE, ids=[s for s, _ in MISSING_ENGINE])
def test_a_missing_engine_directory_is_one_error_line(script, args):
    r = _run(BENCHMARKS / script, *args)
    _one_error_line(r, f"error: {NOWHERE}")
    assert "engine directory not found" in r.stderr


def test_triton_bench_vs_plain_says_why_serve_did_not_start():
    r = _run(BENCHMARKS / "triton_bench.py", "--vs-plain", "--engine", NOWHERE)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "serve exited with 2: error: " in r.stderr and "engine directory not found" in r.stderr, r.stderr[-2000:]


def test_step_profile_refuses_a_missing_engine_before_installing_ort_genai():
    _one_error_line(_run(BENCHMARKS / "ortgenai_peer" / "step_profile.py", "--engine", NOWHERE), "error: --engine: ")


def test_zlab_pair_help_and_bad_kinds_write_nothing(tmp_path):
    script = ROOT / "scripts" / "zlab_pair.py"
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "OUT_DIR" in r.stdout and list(tmp_path.iterdir()) == [], r.stderr[-2000:]
    r = _run(script)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "OUT_DIR" in r.stderr, r.stderr[-2000:]
    _one_error_line(_run(script, str(tmp_path / "pair"), "bogus"), "error: KIND: unknown 'bogus'")
    assert not (tmp_path / "pair").exists()


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.recipes import load_recipe

    return build_onnxruntime(load_recipe("tiny-qwen3"), tmp_path_factory.mktemp("tiny-qwen3") / "onnxruntime",
                             threads=1)


def test_drafter_precision_runs_and_times_the_draft_pass(tiny_engine):
    r = _run(BENCHMARKS / "drafter_precision.py", "--engines", str(tiny_engine), "--prompts", "1",
             "--max-new-tokens", "4", "--threads", "1", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"{tiny_engine}: DFlash / plain"))
    assert "identical 1/1" in line and "plain steps" in line


def test_hybrid_costs_measures_an_engine_given(tiny_engine):
    r = _run(BENCHMARKS / "hybrid_costs.py", "--engine", str(tiny_engine), "--dense", "--reps", "2", "--context",
             "20", "--threads", "1", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for key in ("step_1_ms", "verify_8_ms", "ratio_verify_16"):
        assert key in r.stdout


def test_batch_costs_prints_a_line_per_call_at_each_batch_size(tiny_engine):
    r = _run(BENCHMARKS / "batch_costs.py", "--engine", str(tiny_engine), "--batches", "1,2", "--reps", "1",
             "--context", "8", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "target B= 1 S=1" in r.stdout and "target B= 2 S=1" in r.stdout and "ragged" in r.stdout, r.stdout


def test_kv_rows_times_a_batch_allowed_few_tokens_and_allowed_max_seq_len(tiny_engine):
    """Both allowances hold buffers of the rows the sequences reached: the same rows, whatever they may reach."""
    r = _run(BENCHMARKS / "kv_rows.py", "--engine", str(tiny_engine), "--suite", "tiny-random", "--batch", "2",
             "--steps", "4", "--reps", "1", "--max-new-tokens", "8", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("pass 1")]
    assert len(lines) == 4 and len({ln.rsplit("buffers of ", 1)[1] for ln in lines}) == 1, r.stdout
