"""Mixture-of-experts targets through every CPU stage, against transformers' own model classes as the oracle, on tiny
random models built from their config classes: Qwen3-MoE (the paper's Qwen3-Coder-30B-A3B family: 8 experts, 2 per
token, renormalized; one dense layer among them) and gpt-oss (biased attention with sinks, alternating 8-token
sliding-window and full layers, YaRN RoPE, clamped SwiGLU experts with biases, softmax over the top-k logits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_export.engines.base import SamplingParams
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("onnxruntime")
NEW = 64


FAMILIES = {"tiny-qwen3-moe": "Qwen3MoeForCausalLM", "tiny-gpt-oss": "GptOssForCausalLM"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(tmp_path_factory, request):
    from transformers import AutoModelForCausalLM

    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine

    recipe = load_recipe(request.param)
    engine_dir = build_onnxruntime(recipe, tmp_path_factory.mktemp("moe") / "onnxruntime", threads=1)
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_source(recipe.target)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = load_engine(engine_dir, threads=1)
    yield recipe, engine_dir, engine, hf
    engine.close()


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [list(map(int, rng.integers(1, 250, size=n))) for n in (3, 8, 17, 30, 5)]


def hf_greedy(hf, ids: list[int], n: int, stop: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_the_family_is_known_and_its_moe_layers_are_read_from_the_config(moe):
    recipe, _, engine, hf = moe
    from dflash_export.models.arch import ARCHS, sliding_windows

    arch = ARCHS[hf.config.model_type]
    if recipe.name == "tiny-qwen3-moe":
        assert arch.moe.layers(hf.config) == [True, True, False, True, True, True]
    else:
        assert arch.moe.layers(hf.config) == [True] * 4
        assert sliding_windows(arch, hf.config) == [8, None, 8, None]


def test_engine_greedy_tokens_equal_transformers_generate(moe):
    """5 prompts x 64 tokens: plain decoding and DFlash on the ONNX Runtime engine both give transformers' own
    greedy tokens (routing is per token, so a verify block routes each row as a plain step does)."""
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, hf = moe
    rt = DFlashRuntime(engine)
    stop = engine.info.stop_token_ids[0]
    for ids in prompts():
        want = hf_greedy(hf, ids, NEW, stop)
        sp = SamplingParams(max_new_tokens=NEW)
        ar = rt.generate(ids, sp, "ar").tokens
        assert ar == want[:len(ar)] and (len(ar) == len(want) or ar[-1] == stop)
        assert rt.generate(ids, sp, "dflash").tokens == ar


def test_each_steps_logits_match_transformers_forward(moe):
    _, _, engine, hf = moe
    ids = prompts()[2]
    seq = engine.new_sequence(len(ids) + 24 + engine.info.block_size)
    logits = engine.prefill(seq, np.asarray(ids, np.int64))
    tokens = list(ids)
    worst = 0.0
    for _ in range(16):
        with torch.inference_mode():
            ref = hf(torch.tensor([tokens])).logits[0, -1].numpy()
        worst = max(worst, float(np.abs(np.asarray(logits).reshape(-1) - ref).max()))
        nxt = int(np.argmax(ref))
        tokens.append(nxt)
        logits = engine.decode(seq, nxt)
    assert worst <= 1e-4, worst


def test_batched_engine_gives_each_request_its_lone_tokens(moe):
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    _, _, engine, _ = moe
    sp = SamplingParams(max_new_tokens=32)
    alone = [DFlashRuntime(engine).generate(p, sp, "ar").tokens for p in prompts()[:4]]
    together = BatchingRuntime(engine, max_batch=4).generate_many(prompts()[:4], sp)
    assert [s.tokens for s in together] == alone


@pytest.mark.parametrize("recipe_name", list(FAMILIES))
def test_inspect_reads_the_pair_with_no_finding(recipe_name):
    recipe = load_recipe(recipe_name)
    r = subprocess.run([sys.executable, "-m", "dflash_export", "inspect", recipe.drafter, "--target", recipe.target,
                        "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["findings"] == [] and out["summary"]["target architecture"] == FAMILIES[recipe_name]


def test_sampled_output_keeps_the_target_distribution(moe, tmp_path):
    """validate's G-test at T = 0.7 on the MoE engine (DFlash sampling against the engine's own conditionals)."""
    recipe, engine_dir, _, _ = moe
    r = subprocess.run([sys.executable, "-m", "dflash_export", "validate", "--recipe", recipe.name, "--engine",
                        str(engine_dir), "--num-prompts", "2", "--max-new-tokens", "16", "--dist-samples", "60",
                        "--temperature", "0.7", "--no-progress", "--report", str(tmp_path / "rep")],
                       capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    dist = {t["name"]: t for t in rep["thresholds"]}
    assert dist["distribution_p_value"]["passed"] and dist["identical_fraction"]["value"] == 1.0, r.stdout


@pytest.mark.slow
def test_the_published_moe_recipe_builds_through_export_on_a_stand_in(tmp_path):
    """`build --recipe qwen3-coder-30b-a3b` with local paths: a tiny stand-in with the real checkpoint's config keys
    (Qwen3MoeForCausalLM: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    decoder_sparse_step, mlp_only_layers), stored in bfloat16 as published."""
    from test_sources import _to_bf16

    target, drafter = tmp_path / "Qwen3-Coder-30B-A3B-Instruct", tmp_path / "Qwen3-Coder-30B-A3B-DFlash"
    _to_bf16(resolve_source("tiny:qwen3-moe/target"), target, max_position_embeddings=262144,
             rope_theta=10000000.0)
    _to_bf16(resolve_source("tiny:qwen3-moe/drafter"), drafter)
    r = subprocess.run([sys.executable, "-m", "dflash_export", "build", "--recipe", "qwen3-coder-30b-a3b",
                        "--precision", "int4", "--out", str(tmp_path / "engines")], capture_output=True, text=True,
                       cwd=ROOT, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                   "QWEN3_CODER_30B_A3B": str(target),
                                                   "QWEN3_CODER_30B_A3B_DFLASH": str(drafter)})
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "engines" / "qwen3-coder-30b-a3b" / "onnxruntime-int4" / "manifest.json").read_text())
    assert m["precision"]["target"] == "int4" and m["dtypes"]["checkpoint"] == "bfloat16"
