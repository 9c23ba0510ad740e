"""The backend-agnostic loop reproduces the reference exactly (greedy and seeded sampling) and rejects bad requests."""

import pytest

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.torch_ref import TorchEngine
from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe
from dflash_export.reference import ar_generate, spec_generate
from dflash_export.runtime import DFlashRuntime, RunStats


@pytest.fixture(scope="module")
def rt():
    return DFlashRuntime(TorchEngine.from_recipe(load_recipe("tiny-qwen3")))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_runtime_equals_reference_token_for_token(rt, temperature):
    eng = rt.engine
    for seed, ids in enumerate([[5, 6, 7], list(range(3, 30)), [100]]):
        sp = SamplingParams(max_new_tokens=25, temperature=temperature, top_p=0.95, seed=seed)
        spec = spec_generate(eng.drafter, eng.target, ids, max_new_tokens=25, temperature=temperature, top_p=0.95,
                             seed=seed)
        ar = ar_generate(eng.target, ids, max_new_tokens=25, temperature=temperature, top_p=0.95, seed=seed)
        got = rt.generate(ids, sp)
        assert got.tokens == spec.tokens
        assert got.acceptance_lengths == spec.acceptance_lengths
        assert rt.generate(ids, sp, mode="ar").tokens == ar.tokens


def test_streaming_yields_the_same_tokens_and_stops(rt):
    ids = [9, 8, 7, 6]
    full = rt.generate(ids, SamplingParams(max_new_tokens=20))
    streamed = [t for ev in rt.stream(ids, SamplingParams(max_new_tokens=20)) for t in ev.tokens]
    assert streamed == full.tokens
    stop = full.tokens[5]
    cut = rt.generate(ids, SamplingParams(max_new_tokens=20, stop_token_ids=[stop]))
    assert cut.tokens == full.tokens[: full.tokens.index(stop) + 1] and cut.finish_reason == "stop"
    stats = RunStats()
    text = "".join(rt.stream_text("hi", SamplingParams(max_new_tokens=8), stats=stats))
    assert isinstance(text, str) and len(stats.tokens) == 8 and stats.finish_reason == "length"


@pytest.mark.parametrize("ids,sp,field", [
    ([], SamplingParams(), "text_input"),
    ([1, 2], SamplingParams(max_new_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(max_new_tokens=10**6), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 10**6], SamplingParams(), "input_ids"),
    (list(range(200)) * 3, SamplingParams(), "text_input"),
])
def test_bad_requests_are_named(rt, ids, sp, field):
    with pytest.raises(DFlashError, match=field):
        rt.generate(ids, sp)
