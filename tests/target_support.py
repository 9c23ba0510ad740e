"""What the target-family tests share (test_moe_targets.py, test_hybrid_targets.py): a recipe's tiny pair built as an
ONNX Runtime engine beside the same target loaded by transformers, the prompts they decode and transformers' greedy
answer to them, and the `inspect` / `validate` runs they check the pair with. Also what every test of an engine's
speculative output against its plain decoding holds it to (`assert_as_plain`, `assert_rows_as_plain`): what the
engine's load-time numerics probe states for this CPU (engines/numerics.py)."""

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


# Where the target's products round their activations to int8 (MatMulNBits accuracy level 4), a last-bit difference
# in a K/V row can flip that rounding steps later and move a logit by ~1e-2 to ~1 (engines/numerics.py
# walks_whole_trees: 0.65 measured on the tiny LLaMA int8 target): the near-tie such an engine's numerics allow.
QUANTIZED_NEAR_TIE = 1.0
# How far the difference a probe measured may grow as later steps read the K/V rows it left behind (float targets).
GROWTH = 100.0


def near_tie(engine) -> float:
    """How close two logits of `engine` may lie for its kernel numerics to pick either: nothing where its probe
    found verify rows bit-identical to plain steps on this CPU; else the difference it measured, grown by GROWTH
    (QUANTIZED_NEAR_TIE on int8-rounded activations), never below TIE."""
    num = getattr(engine, "numerics", None)
    if num is None or num.bit_identical:
        return 0.0
    if getattr(engine, "quantized_activations", False):
        return QUANTIZED_NEAR_TIE
    return max(TIE, GROWTH * max(num.max_abs_diff, num.tree_max_abs_diff or 0.0))


def assert_not_bit_identical_stated(engine) -> None:
    """The engine says it is lossless within kernel numerics only, with the difference its probe measured."""
    num = engine.numerics
    assert not num.bit_identical and "lossless within kernel numerics on this CPU" in num.statement, num.statement
    assert "greedy output can differ from plain decoding at near-ties" in num.statement, num.statement


def exact_on_this_cpu(engine) -> bool:
    """Whether every path of `engine` -- DFlash alone or in a batch, plain decoding -- must give the same tokens on
    this CPU: its numerics probe found verify rows bit-identical to plain steps (an engine without a probe counts as
    exact). Where it did not, the engine says so, and counts of identical outputs may fall short at near-ties."""
    num = getattr(engine, "numerics", None)
    if num is not None and not num.bit_identical:
        assert_not_bit_identical_stated(engine)
        return False
    return True


def report_exact_on_this_cpu(report: dict) -> bool:
    """`exact_on_this_cpu` of the engine a `validate` run judged, from its report.json: where the probe found no
    bit-identical floor, the report says so in the probe's own words."""
    num = report["greedy"]["numerics"]
    if not num["bit_identical"]:
        assert "lossless within kernel numerics on this CPU" in num["statement"], num
    return num["bit_identical"]


def assert_as_plain(engine, prompt, got: list[int], want: list[int], sp=None) -> None:
    """`got`, a speculative or batched run's tokens for `prompt` (DFlash, trees, lookups; alone or in a batch),
    against `want`, plain decoding's for the same request (`sp`: its SamplingParams, None for greedy; on the same
    engine, or the reference's where a test holds the engine's to them), as the engine's load-time numerics probe
    states for this CPU: equal where it found verify rows bit-identical to plain steps (the only case DFlash promises
    plain decoding's tokens; engines without a probe, e.g. the PyTorch one, too). Elsewhere the engine must say so,
    and every token of `got` must be one plain decoding on the engine could emit after the tokens before it up to a
    near-tie: greedy, within `near_tie(engine)` of the best logit; sampled, a token of nonzero probability once its
    logit is raised by that much (top-k / top-p cut at a near-tie)."""
    num = getattr(engine, "numerics", None)
    if num is None or num.bit_identical:
        assert got == want, (prompt, got, want)
        return
    assert_not_bit_identical_stated(engine)
    if got == want:
        return
    assert got and want, (prompt, got, want)
    from dflash_export.decoding.sampling import probs_from_logits

    tie = near_tie(engine)
    seq = engine.new_sequence(len(prompt) + len(got) + engine.info.block_size)
    logits = engine.prefill(seq, np.asarray(prompt, np.int64))
    for i, tok in enumerate(got):
        lg = np.asarray(logits, np.float64).reshape(-1).copy()
        lg[tok] += tie
        if sp is None or sp.greedy:
            ok = lg[tok] >= lg.max()
        else:
            ok = probs_from_logits(lg, sp.temperature, sp.top_k, sp.top_p)[tok] > 0
        assert ok, (f"token {i} ({tok}) is not plain decoding's within {tie:g}", prompt, got, want, num.statement)
        if i + 1 < len(got):
            logits = engine.decode(seq, int(tok))


def assert_rows_as_plain(engine, got: np.ndarray, want: np.ndarray) -> None:
    """Logits (or K/V rows) a speculative path computed against the ones plain steps compute: bit for bit where the
    engine's numerics probe found verify rows bit-identical to plain steps on this CPU; elsewhere the engine says so
    and they agree within `near_tie(engine)`."""
    num = getattr(engine, "numerics", None)
    if num is None or num.bit_identical:
        np.testing.assert_array_equal(got, want)
        return
    assert_not_bit_identical_stated(engine)
    np.testing.assert_allclose(got, want, rtol=0, atol=near_tie(engine))


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
    """On every prompt, plain decoding on the engine gives transformers' greedy tokens and DFlash gives plain's (as the
    engine's numerics probe states for this CPU: `assert_as_plain`)."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.single import DFlashRuntime

    rt = DFlashRuntime(engine)
    for ids in prompts():
        sp = SamplingParams(max_new_tokens=new)
        ar = rt.generate(ids, sp, "ar").tokens
        assert_transformers_greedy(hf, ids, ar, engine.info.stop_token_ids[0], new)
        assert_as_plain(engine, ids, rt.generate(ids, sp, "dflash").tokens, ar)


def check_batched_tokens_equal_alone(engine, mode: str, new: int = 32, n: int = 4) -> list[list[int]]:
    """The batched runtime gives each of the first `n` prompts, decoded together, the tokens the single-stream runtime
    gives it alone (`mode`: "ar" or "dflash"), as the engine's numerics probe states for this CPU (`assert_as_plain`);
    returns those tokens."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.batching import BatchingRuntime
    from dflash_export.runtime.single import DFlashRuntime

    sp = SamplingParams(max_new_tokens=new)
    alone = [DFlashRuntime(engine).generate(p, sp, mode).tokens for p in prompts()[:n]]
    together = BatchingRuntime(engine, max_batch=n).generate_many(prompts()[:n], sp)
    assert len(together) == len(alone)
    for p, s, want in zip(prompts()[:n], together, alone):
        assert_as_plain(engine, p, s.tokens, want)
    return alone


def _cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_export", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def inspect_pair(recipe) -> dict:
    """`inspect DRAFTER --target TARGET --json` of a recipe's pair, which must exit 0."""
    r = _cli("inspect", recipe.drafter, "--target", recipe.target, "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def validate_sampled(recipe, engine_dir, report_dir) -> tuple[dict, str, bool]:
    """validate's G-test at T = 0.7 on an engine (DFlash sampling against the engine's own conditionals): the
    report's thresholds by name, the run's stdout, and whether the run's numerics probe found verify rows
    bit-identical to plain steps on this CPU (greedy DFlash then owes plain decoding's tokens; where it did not, the
    report says so in the probe's words)."""
    r = _cli("validate", "--recipe", recipe.name, "--engine", str(engine_dir), "--num-prompts", "2",
             "--max-new-tokens", "16", "--dist-samples", "60", "--temperature", "0.7", "--no-progress", "--report",
             str(report_dir), timeout=900)
    rep = json.loads((Path(report_dir) / "report.json").read_text())
    exact = report_exact_on_this_cpu(rep)
    if not exact:
        assert rep["greedy"]["numerics"]["statement"] in (Path(report_dir) / "report.md").read_text()
    return {t["name"]: t for t in rep["thresholds"]}, r.stdout, exact
