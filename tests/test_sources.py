"""Any pair, any precision on the CPU backend: Hugging Face ids resolved through the local Hugging Face cache (a cache
the test writes, in huggingface_hub's layout), a bf16 recipe built as an int4 ONNX Runtime engine, `--target` /
`--drafter` without a recipe, and every unset environment variable of a recipe named at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_export.errors import DFlashError
from dflash_export.models.sources import hf_snapshot, resolve_source
from dflash_export.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def _to_bf16(src: Path, dst: Path, **config) -> None:
    """A copy of a tiny checkpoint stored as bfloat16, its config edited (the stand-in for a published one)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()},
              dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config, torch_dtype="bfloat16")
    (dst / "config.json").write_text(json.dumps(cfg))


def write_hf_cache(hub: Path, repo_id: str, src: Path, commit: str = "0123abcd", **config) -> Path:
    root = hub / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    _to_bf16(src, root / "snapshots" / commit, **config)
    return root / "snapshots" / commit


@pytest.fixture
def hub(tmp_path, monkeypatch):
    target, drafter = resolve_source("tiny:qwen3/target"), resolve_source("tiny:qwen3/drafter")
    hub = tmp_path / "hub"
    # Qwen3-8B's own config keys on the tiny weights: what the recipe's build reads of them.
    write_hf_cache(hub, "Qwen/Qwen3-8B", target, max_position_embeddings=40960, rope_theta=1000000.0)
    write_hf_cache(hub, "z-lab/Qwen3-8B-DFlash-b16", drafter, max_position_embeddings=40960,
                   rope_theta=1000000.0)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def test_hf_id_resolves_to_the_cached_snapshot_and_absent_ones_say_how_to_fetch(hub):
    assert hf_snapshot("Qwen/Qwen3-8B") == hub / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    assert resolve_source("Qwen/Qwen3-8B") == hf_snapshot("Qwen/Qwen3-8B")
    assert hf_snapshot("Qwen/Qwen3-8B@0123abcd").name == "0123abcd"
    with pytest.raises(DFlashError) as e:
        resolve_source("Qwen/Qwen3-32B")
    assert "not in the local Hugging Face cache" in str(e.value) and "hf download Qwen/Qwen3-32B" in str(e.value)


def test_a_model_id_given_as_a_recipe_says_how_to_build_it():
    with pytest.raises(DFlashError) as e:
        load_recipe("Qwen/Qwen3-8B")
    assert "--target Qwen/Qwen3-8B --drafter" in str(e.value) and e.value.field == "--recipe"


def test_every_unset_environment_variable_is_named_at_once(monkeypatch):
    monkeypatch.delenv("QWEN3_8B", raising=False)
    monkeypatch.delenv("QWEN3_8B_DFLASH", raising=False)
    with pytest.raises(DFlashError) as e:
        load_recipe("qwen3-8b").target_path
    assert "QWEN3_8B (target)" in str(e.value) and "QWEN3_8B_DFLASH (drafter)" in str(e.value)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dflash_export", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=900)


@pytest.mark.slow
def test_bf16_recipe_builds_int4_on_the_cpu_backend_from_hugging_face_ids(hub, tmp_path):
    """`build --recipe qwen3-8b --precision int4` with the recipe's environment variables naming Hugging Face ids:
    the bf16 checkpoints are widened to fp32 and quantized; the manifest and the build line say so."""
    r = _cli("build", "--recipe", "qwen3-8b", "--precision", "int4", "--out", tmp_path / "engines",
             env={"HF_HUB_CACHE": str(hub), "QWEN3_8B": "Qwen/Qwen3-8B",
                  "QWEN3_8B_DFLASH": "z-lab/Qwen3-8B-DFlash-b16"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "int4 weights, from a bfloat16 checkpoint" in r.stdout
    engine = tmp_path / "engines" / "qwen3-8b" / "onnxruntime-int4"
    m = json.loads((engine / "manifest.json").read_text())
    assert m["precision"]["target"] == "int4" and m["dtypes"]["checkpoint"] == "bfloat16"
    r = _cli("run", "--engine", engine, "hello", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]


def test_target_and_drafter_make_a_pair_without_a_recipe(tmp_path):
    r = _cli("build", "--target", "tiny:qwen3/target", "--drafter", "tiny:qwen3/drafter", "--out",
             tmp_path / "engines")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "engines" / "drafter" / "onnxruntime" / "manifest.json").is_file()
    r = _cli("build", "--target", "tiny:qwen3/target", "--out", tmp_path / "engines")
    assert r.returncode == 2 and "--recipe" in r.stderr and "Traceback" not in r.stderr


def test_a_cached_tiny_pair_damaged_since_is_made_again(tmp_path, monkeypatch):
    """A tiny pair part the cache holds that is no longer whole (weights cut short, config emptied) is made again,
    the same bytes as the first time (the pair is seeded), instead of being refused at every later load."""
    from dflash_export.models.tiny import tiny_pair_path

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    target, drafter = tiny_pair_path("llama/target"), tiny_pair_path("llama/drafter")
    first = {p: p.read_bytes() for d in (target, drafter) for p in sorted(d.iterdir())}
    weights = target / "model.safetensors"
    weights.write_bytes(first[weights][:-64])
    (drafter / "config.json").write_text("")
    assert tiny_pair_path("llama/target") == target and tiny_pair_path("llama/drafter") == drafter
    assert {p: p.read_bytes() for d in (target, drafter) for p in sorted(d.iterdir())} == first
