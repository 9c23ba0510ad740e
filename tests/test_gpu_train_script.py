"""scripts/gpu_train.py on the CPU at tiny shapes: the code path the GPU run takes (answers, features, batches laid out
by forked workers, training, the kept drafter in shards) end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_train_script_runs_on_the_tiny_pair_and_keeps_a_loadable_drafter(tmp_path):
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.tiny import tiny_pair_path

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_train.py"), "run", str(tmp_path), "--tiny", "--cpu",
                        "--out", str(tmp_path / "out"), "--seconds", "30", "--answer-seconds", "5", "--workers", "2",
                        "--batch", "4", "--blocks-per-seq", "8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    curve = json.loads((tmp_path / "out" / "curve.json").read_text())
    steps = [c["step"] for c in curve["curve"]]
    assert steps[0] == 0 and steps[-1] > 0 and curve["train_sequences"] > 0 and curve["heldout"] >= 2
    kept = tmp_path / "out" / "drafter"
    assert all(p.stat().st_size <= 12 << 20 for p in kept.glob("*.safetensors"))
    drafter = load_drafter(kept)
    shipped = load_drafter(tiny_pair_path("llama/drafter"))
    assert next(drafter.parameters()).dtype == torch.float16
    assert {k: v.shape for k, v in drafter.state_dict().items()} == \
        {k: v.shape for k, v in shipped.state_dict().items()}


def test_gpu_train_run_without_prepared_prompts_is_one_usage_error_and_makes_nothing(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_train.py"), "run", str(tmp_path / "none"),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "prompts.pt: not found: run `prepare" in r.stderr and not out.exists(), r.stderr[-2000:]
