"""Qwen3 targets with use_sliding_window, against transformers' own model as the oracle: its config marks the layers
from max_window_layers on "sliding_attention" and its attention masks keys older than the window there (Qwen3-MoE
windows every layer once the window is set). A tiny random Qwen3 (6 layers, the last 4 with an 8-token window) is
built from its config class; prompts plus new tokens run far past the window, so an engine that ignored it would
diverge."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from target_support import (
    check_batched_tokens_equal_alone,
    check_greedy_tokens_against_transformers,
    engine_and_transformers,
    prompts,
    worst_logit_gap,
)

pytest.importorskip("onnxruntime")
NEW = 48


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    recipe, engine_dir, engine, hf = engine_and_transformers("tiny-qwen3-swa", tmp_path_factory.mktemp("swa"))
    yield recipe, engine_dir, engine, hf
    engine.close()


def test_the_windows_are_transformers_own(swa):
    from transformers import Qwen3MoeConfig

    from dflash_export.models.arch import ARCHS, sliding_windows

    _, _, _, hf = swa
    assert hf.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 4
    assert sliding_windows(ARCHS["qwen3"], hf.config) == [None, None, 8, 8, 8, 8]
    moe = Qwen3MoeConfig(num_hidden_layers=3, use_sliding_window=True, sliding_window=16)
    assert sliding_windows(ARCHS["qwen3_moe"], moe) == [16, 16, 16]
    assert sliding_windows(ARCHS["qwen3_moe"], Qwen3MoeConfig(num_hidden_layers=3, sliding_window=16)) == [None] * 3


def test_the_window_changes_the_answer(swa):
    """The oracle's own check that the window matters here: the same weights without it give other logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _, _, _, hf = swa
    settings = {**hf.config.to_dict(), "use_sliding_window": False, "sliding_window": None, "layer_types": None}
    full = Qwen3ForCausalLM(Qwen3Config(**settings)).eval()
    full.load_state_dict(hf.state_dict())
    ids = torch.tensor([prompts()[3] + prompts()[2]])  # 47 tokens, past the 8-token window
    with torch.inference_mode():
        gap = (hf(ids, use_cache=False).logits[0, -1] - full(ids, use_cache=False).logits[0, -1]).abs().max()
    assert gap > 1e-3


def test_engine_greedy_tokens_equal_transformers_generate(swa):
    _, _, engine, hf = swa
    check_greedy_tokens_against_transformers(engine, hf, NEW)


def test_each_steps_logits_match_transformers_forward(swa):
    _, _, engine, hf = swa
    assert worst_logit_gap(engine, hf, prompts()[3], steps=24) <= 1e-4


def test_batched_engine_gives_each_request_its_lone_tokens(swa):
    _, _, engine, _ = swa
    alone = check_batched_tokens_equal_alone(engine, "dflash")
    assert all(len(t) for t in alone) and np.mean([len(p) for p in prompts()[:4]]) + 32 > 8


# Whole draft trees on this target: tests/test_sliding_trees.py
