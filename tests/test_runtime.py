"""The backend-agnostic loop reproduces the reference exactly (greedy and seeded sampling) and rejects bad requests."""

import numpy as np
import pytest

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.torch_ref import TorchEngine
from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe
from dflash_export.runtime.reference import ar_generate, spec_generate
from dflash_export.runtime.single import DFlashRuntime, RunStats


@pytest.fixture(scope="module")
def rt():
    return DFlashRuntime(TorchEngine.from_recipe(load_recipe("tiny-qwen3")))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_runtime_equals_reference_token_for_token(rt, temperature):
    """The drafter's sampled chain ("chain") is the reference's spec_generate draw for draw; the walk (the default
    at T > 0) is the reference's plain sampling draw for draw (every token the target's draw with the next uniform)."""
    eng = rt.engine
    full = DFlashRuntime(eng, adaptive=False, sampling="chain")
    for seed, ids in enumerate([[5, 6, 7], list(range(3, 30)), [100]]):
        sp = SamplingParams(max_new_tokens=25, temperature=temperature, top_p=0.95, seed=seed)
        spec = spec_generate(eng.drafter, eng.target, ids, max_new_tokens=25, temperature=temperature, top_p=0.95,
                             seed=seed)
        ar = ar_generate(eng.target, ids, max_new_tokens=25, temperature=temperature, top_p=0.95, seed=seed)
        got = full.generate(ids, sp)
        assert got.tokens == spec.tokens
        assert got.acceptance_lengths == spec.acceptance_lengths  # full blocks: the reference's steps exactly
        assert DFlashRuntime(eng, sampling="chain").generate(ids, sp).tokens == spec.tokens
        assert rt.generate(ids, sp).tokens == (spec.tokens if temperature == 0 else ar.tokens)
        assert rt.generate(ids, sp, mode="ar").tokens == ar.tokens


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("proposer, sampling", [("chain", "walk"), ("tree+lookup", "walk"), ("chain", "chain")])
def test_a_temperature_near_zero_decodes_as_greedy(rt, proposer, sampling):
    """T -> 0 is greedy decoding: sampled at T 1e-310 or 5e-324 (logits / T overflows float64), with top-k or
    top-p, DFlash and plain decoding give the reference's greedy tokens."""
    eng = rt.engine
    runtime = DFlashRuntime(eng, proposer=proposer, sampling=sampling)
    for seed, ids in enumerate([[5, 6, 7], list(range(3, 30)), [9, 9, 9, 9, 9, 9]]):
        want = ar_generate(eng.target, ids, max_new_tokens=20).tokens
        for temperature, top_k, top_p in [(1e-310, 0, 1.0), (5e-324, 20, 0.95)]:
            sp = SamplingParams(max_new_tokens=20, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            assert runtime.generate(ids, sp).tokens == want, (temperature, ids)
            assert runtime.generate(ids, sp, mode="ar").tokens == want, (temperature, ids)


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


def test_streamed_text_cut_by_max_new_tokens_is_the_served_answer(rt):
    """`run` prints stream_text: the tokenizer's decode of every token generated, less the incomplete UTF-8 tail a
    max_new_tokens cut can leave (never a U+FFFD at the end), and the same text the request handler answers."""
    from dflash_export.deploy.handler import GenerateRequest, RequestRunner, generate_text

    cut_in_char = 0
    for n in range(1, 30):
        sp = SamplingParams(max_new_tokens=n)
        stats = RunStats()
        text = "".join(rt.stream_text("café 🎉", sp, chat=False, stats=stats))
        full = rt.engine.codec.decode(stats.tokens)
        assert text == (full.rstrip("\ufffd") if stats.finish_reason == "length" else full), n
        assert text == generate_text(RequestRunner(rt), GenerateRequest("café 🎉", sp, chat=False)).text, n
        cut_in_char += stats.finish_reason == "length" and full.endswith("\ufffd")
    assert cut_in_char  # some cut fell inside a multi-byte character (else this proves nothing)


@pytest.mark.parametrize("ids,settings,field", [
    ([], {}, "text_input"),
    ([1, 2], {"max_new_tokens": 0}, "max_tokens"),
    ([1, 2], {"max_new_tokens": 10**6}, "max_tokens"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 10**6], {}, "input_ids"),
    (list(range(200)) * 3, {}, "text_input"),
])
def test_bad_requests_are_named(rt, ids, settings, field):
    """Through the Python API: settings out of range are refused when the SamplingParams is made, the rest when the
    request meets the engine."""
    with pytest.raises(DFlashError, match=field):
        rt.generate(ids, SamplingParams(**settings))


class _OracleDrafts:
    """Wraps an engine: drafts are the true greedy continuation with one slot corrupted at random and random
    confidences, so adaptive verification sees long accepts, short blocks and everything between."""

    def __init__(self, inner, cont, prompt_len, seed=0):
        self.inner, self.info, self.codec = inner, inner.info, inner.codec
        self.cont, self.p = cont, prompt_len
        self.rng = np.random.default_rng(seed)
        self.blocks = []  # (drafts verified, tokens already produced) per step
        self.drafts = 0
        self.accumulates_context = inner.accumulates_context

    def new_sequence(self, max_tokens=None):
        return self.inner.new_sequence(max_tokens)

    def prefill(self, seq, ids):
        return self.inner.prefill(seq, ids)

    def decode(self, seq, token, greedy=False):
        return self.inner.decode(seq, token)

    def draft(self, seq, anchor, sp, uniforms, block_len=None):
        self.drafts += 1
        # consumes the pending context as a real draft would
        real = self.inner.draft(seq, anchor, sp, uniforms, block_len=block_len)
        if not sp.greedy:
            return real
        bs = self.info.block_size
        i = seq.length - self.p + 1  # cont[i - 1] is the anchor
        drafts = np.array((self.cont + [0] * bs)[i: i + bs - 1], np.int64)
        k = int(self.rng.integers(0, bs))
        if k < bs - 1:
            drafts[k] = (drafts[k] + 1) % (self.info.vocab_size - 2)
        seq.draft_confidence = self.rng.uniform(0.3, 1.0, bs - 1)
        return drafts, None

    def verify(self, seq, block, draft_probs, sp, uniforms):
        self.blocks.append((len(block) - 1, seq.length - self.p + 1))
        return self.inner.verify(seq, block, draft_probs, sp, uniforms)


def test_adaptive_verification_is_lossless_and_never_verifies_past_the_request(rt):
    ids, n = list(range(40, 52)), 40
    want = ar_generate(rt.engine.target, ids, max_new_tokens=n + 16).tokens
    bs = rt.engine.info.block_size
    oracle = _OracleDrafts(rt.engine, want, len(ids))
    got = DFlashRuntime(oracle, verify_token_cost=0.2).generate(ids, SamplingParams(max_new_tokens=n))
    assert got.tokens == want[:n]
    lengths = [m for m, _ in oracle.blocks]
    assert len(set(lengths)) > 2 and max(lengths) <= bs - 1 and min(lengths) < bs - 1
    assert all(m <= n - produced - 1 for m, produced in oracle.blocks)
    assert got.drafted_tokens == sum(lengths)
    # draft back-off: after drafts of which nothing was accepted, plain one-token steps with no draft before them
    assert 0 in lengths and oracle.drafts < len(oracle.blocks)
    oracle.blocks.clear()
    no_backoff = DFlashRuntime(oracle, verify_token_cost=0.2, max_skip=0).generate(ids,
                                                                                  SamplingParams(max_new_tokens=n))
    assert no_backoff.tokens == want[:n] and 0 not in [m for m, _ in oracle.blocks]
    # sampling keeps full blocks (the random stream is the reference's), but for the last, which holds only what the
    # request still needs (z-lab's verify_size)
    oracle.blocks.clear()
    DFlashRuntime(oracle).generate(ids, SamplingParams(max_new_tokens=12, temperature=0.7, seed=3))
    assert all(m == min(bs - 1, 12 - produced) for m, produced in oracle.blocks), oracle.blocks
