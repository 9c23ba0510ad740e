"""What the target-family tests share (test_moe_targets.py, test_hybrid_targets.py): a recipe's tiny pair built as an
ONNX Runtime engine beside the same target loaded by transformers, the prompts they decode and transformers' greedy
answer to them, and the `inspect` / `validate` runs they check the pair with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from dflash_export.models.sources import resolve_source
from dflash_export.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def engine_and_transformers(recipe_name: str, out_dir):
    """(recipe, engine_dir, engine, transformers model) for a tiny recipe; the caller closes the engine."""
    from transformers import AutoModelForCausalLM

    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine

    recipe = load_recipe(recipe_name)
    engine_dir = build_onnxruntime(recipe, out_dir / "onnxruntime", threads=1)
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_source(recipe.target)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return recipe, engine_dir, load_engine(engine_dir, threads=1), hf


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [list(map(int, rng.integers(1, 250, size=n))) for n in (3, 8, 17, 30, 5)]


# An engine's logits are transformers' up to float rounding (worst_logit_gap: at most 1e-4 in these tests), and the
# rounding differs from CPU to CPU: where transformers' best two logits lie closer than twice that, either token is
# its greedy choice (the tiny qwen3-next target has such a step, 7e-6 apart, on the third prompt; the tiny llama
# target one 1.4e-4 apart, its 52nd token after the prompt [7]). The PyTorch reference's own verify blocks and
# one-token steps differ by such rounding too (up to 3e-6 on the tiny targets, 7e-5 on SmolLM2).
TIE = 2e-4


def assert_transformers_greedy(hf, ids: list[int], got: list[int], stop: int | Collection[int], new: int) -> None:
    """`got` is transformers' greedy continuation of `ids`: every token the argmax of transformers' logits after the
    tokens before it (a near-tie within TIE either way), `new` tokens or ended by its first stop token (`stop`: one
    id, or several; none: `new` tokens)."""
    stops = {stop} if isinstance(stop, int) else set(stop)
    assert got and (len(got) == new or got[-1] in stops) and not stops.intersection(got[:-1]), got
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1:]
    short = logits.max(-1).values - logits[torch.arange(len(got)), torch.tensor(got)]
    assert float(short.max()) <= TIE, (int(short.argmax()), float(short.max()), got)


def worst_logit_gap(engine, hf, ids: list[int], steps: int = 16) -> float:
    """Largest |engine logit - transformers logit| over a prefill and `steps` greedy one-token steps."""
    seq = engine.new_sequence(len(ids) + steps + 8 + engine.info.block_size)
    logits = engine.prefill(seq, np.asarray(ids, np.int64))
    tokens, worst = list(ids), 0.0
    for _ in range(steps):
        with torch.inference_mode():
            ref = hf(torch.tensor([tokens])).logits[0, -1].numpy()
        worst = max(worst, float(np.abs(np.asarray(logits).reshape(-1) - ref).max()))
        nxt = int(np.argmax(ref))
        tokens.append(nxt)
        logits = engine.decode(seq, nxt)
    return worst


def check_greedy_tokens_against_transformers(engine, hf, new: int) -> None:
    """On every prompt, plain decoding on the engine gives transformers' greedy tokens and DFlash gives plain's."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.single import DFlashRuntime

    rt = DFlashRuntime(engine)
    for ids in prompts():
        sp = SamplingParams(max_new_tokens=new)
        ar = rt.generate(ids, sp, "ar").tokens
        assert_transformers_greedy(hf, ids, ar, engine.info.stop_token_ids[0], new)
        assert rt.generate(ids, sp, "dflash").tokens == ar


def check_batched_tokens_equal_alone(engine, mode: str, new: int = 32, n: int = 4) -> list[list[int]]:
    """The batched runtime gives each of the first `n` prompts, decoded together, the tokens the single-stream runtime
    gives it alone (`mode`: "ar" or "dflash"); returns those tokens."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    sp = SamplingParams(max_new_tokens=new)
    alone = [DFlashRuntime(engine).generate(p, sp, mode).tokens for p in prompts()[:n]]
    together = BatchingRuntime(engine, max_batch=n).generate_many(prompts()[:n], sp)
    assert [s.tokens for s in together] == alone
    return alone


def _cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_export", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def inspect_pair(recipe) -> dict:
    """`inspect DRAFTER --target TARGET --json` of a recipe's pair, which must exit 0."""
    r = _cli("inspect", recipe.drafter, "--target", recipe.target, "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def validate_sampled(recipe, engine_dir, report_dir) -> tuple[dict, str]:
    """validate's G-test at T = 0.7 on an engine (DFlash sampling against the engine's own conditionals): the
    report's thresholds by name, and the run's stdout."""
    r = _cli("validate", "--recipe", recipe.name, "--engine", str(engine_dir), "--num-prompts", "2",
             "--max-new-tokens", "16", "--dist-samples", "60", "--temperature", "0.7", "--no-progress", "--report",
             str(report_dir), timeout=900)
    rep = json.loads((Path(report_dir) / "report.json").read_text())
    return {t["name"]: t for t in rep["thresholds"]}, r.stdout
