"""The Engine contract (engines/base.Engine), one test per clause, over every runner this machine runs: the PyTorch
engine, the ONNX Runtime engine, the graph engine TensorRT engines run under (an ONNX Runtime runner over the
portable export, every call checked against the TensorRT profile it would select), and the TensorRT engine itself
(load_engine -> TensorRTEngine -> TensorRTRunner) on the emulated TensorRT API of tests/tensorrt_emulation.py.
Each runner is held to the target model itself (transformers' forward, its hidden states tapped by hand at
layer_id + 1, z-lab's rule) and to `reference.ar_generate`, never to another runner, so a new backend's runner
joins by adding one entry to RUNNERS.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from target_support import assert_as_plain

from dflash_export.engines.base import SamplingParams
from dflash_export.errors import DFlashError
from dflash_export.runtime.single import DFlashRuntime

RUNNERS = ("pytorch", "onnxruntime", "graph", "tensorrt-emulated")
PROMPT = list(range(30, 49))


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request, ort_pair, tmp_path_factory):
    """(engine under test, TorchEngine whose target / drafter modules are the reference) for one runner x family."""
    recipe, _, ort_eng, torch_eng = ort_pair
    if request.param == "pytorch":
        yield torch_eng, torch_eng
    elif request.param == "onnxruntime":
        yield ort_eng, torch_eng
    elif request.param == "tensorrt-emulated":
        from tensorrt_emulation import emulate_tensorrt, emulated_engine_dir

        from dflash_export.engines.registry import load_engine

        with pytest.MonkeyPatch.context() as mp:
            emulate_tensorrt(mp)
            eng = load_engine(emulated_engine_dir(tmp_path_factory.mktemp(f"{recipe.name}-trt"), recipe),
                              device="cpu")
            yield eng, torch_eng
            eng.close()
    else:
        from dflash_export.engines import graph_engine as ge
        from dflash_export.export import export_recipe

        onnx_dir = tmp_path_factory.mktemp(f"{recipe.name}-portable")
        export_recipe(recipe, onnx_dir)
        info = dataclasses.replace(ort_eng.info, backend="onnxruntime-portable")
        eng = ge.GraphEngine(ge.OrtGraphRunner(onnx_dir, check_profiles=(info.block_size, info.max_seq_len)), info,
                             ort_eng.codec)
        yield eng, torch_eng
        eng.close()


def _target_logits_and_taps(torch_eng, ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """The target model's own logits [S, V] and DFlash taps [1, S, n*H] (hidden_states[layer_id + 1], concatenated)."""
    layers = torch_eng.drafter.config.target_layer_ids
    with torch.no_grad():
        out = torch_eng.target.hf(torch.tensor([ids]), output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    return out.logits[0].float().numpy(), taps


def _continuation(torch_eng, n: int) -> list[int]:
    from dflash_export.runtime.reference import ar_generate

    return ar_generate(torch_eng.target, PROMPT, n).tokens


def test_prefill_and_decode_return_the_target_models_logits(runner):
    eng, ref = runner
    cont = _continuation(ref, 6)
    want, _ = _target_logits_and_taps(ref, PROMPT + cont[:5])
    seq = eng.new_sequence()
    np.testing.assert_allclose(eng.prefill(seq, np.array(PROMPT)), want[len(PROMPT) - 1], atol=1e-4)
    for i, t in enumerate(cont[:5]):
        np.testing.assert_allclose(eng.decode(seq, t), want[len(PROMPT) + i], atol=1e-4)
    assert seq.length == len(PROMPT) + 5


def test_greedy_drafts_are_the_drafters_argmax_over_the_tapped_context(runner):
    """After a prefill and after a verify, the greedy drafts are the argmax of the drafter module run over the whole
    context's taps at once (no cache), anchor at the committed length."""
    eng, ref = runner
    bs = eng.info.block_size
    mask = ref.drafter.config.mask_token_id
    cont = _continuation(ref, bs + 2)
    seq = eng.new_sequence()
    eng.prefill(seq, np.array(PROMPT))
    ids = list(PROMPT)
    for step in range(2):
        anchor = cont[len(ids) - len(PROMPT)]
        drafts, _ = eng.draft(seq, anchor, SamplingParams(), None)
        _, taps = _target_logits_and_taps(ref, ids)
        n = len(ids)
        block = torch.tensor([[anchor] + [mask] * (bs - 1)])
        with torch.no_grad():
            logits = ref.drafter.draft_logits(ref.target, taps, torch.arange(n)[None], block,
                                              torch.arange(n, n + bs)[None])
        np.testing.assert_array_equal(drafts[: bs - 1], torch.argmax(logits[0], -1).numpy(), err_msg=f"step {step}")
        # commit the anchor and one true token (a block whose third slot is wrong: accept 1)
        blk = np.array([anchor, cont[n - len(PROMPT) + 1]] + [0] * (bs - 2), np.int64)
        blk[2:] = (np.array(cont[n - len(PROMPT) + 2: n - len(PROMPT) + bs]) + 1) % (eng.info.vocab_size - 2)
        accept, emitted = eng.verify(seq, blk, None, SamplingParams(), None)
        assert (accept, emitted) == (1, cont[n - len(PROMPT) + 1: n - len(PROMPT) + 3])
        ids += cont[n - len(PROMPT): n - len(PROMPT) + 2]


def test_verify_commits_exactly_the_accepted_prefix_at_every_accept_length(runner):
    """Blocks from the target's own continuation with one slot corrupted: the accepted prefix is the uncorrupted one,
    the emitted tokens the target's, and the sequence grows by accept + 1 -- for every accept length 0..bs-1."""
    eng, ref = runner
    bs = eng.info.block_size
    cont = _continuation(ref, 120)
    seq = eng.new_sequence()
    eng.prefill(seq, np.array(PROMPT))
    done, accepts, k = 0, set(), 0
    while done + bs < len(cont) - 1:
        eng.draft(seq, cont[done], SamplingParams(), None)  # consumes the pending context, as the runtime does
        block = np.array(cont[done: done + bs], np.int64)
        bad = 1 + k % bs  # slot bad is corrupted (bs: none)
        k += 1
        if bad < bs:
            block[bad] = (block[bad] + 1) % (eng.info.vocab_size - 2)
        accept, emitted = eng.verify(seq, block, None, SamplingParams(), None)
        assert accept == bad - 1 and emitted == cont[done + 1: done + 2 + accept]
        accepts.add(accept)
        done += accept + 1
        assert seq.length == len(PROMPT) + done
    assert accepts == set(range(bs))


def test_greedy_generation_equals_the_reference_in_both_modes(runner):
    """Plain decoding gives the reference's tokens; DFlash gives them as the engine's numerics probe states for this
    CPU (target_support.assert_as_plain: exactly where it found verify rows bit-identical to plain steps)."""
    from dflash_export.runtime.reference import ar_generate

    eng, ref = runner
    for prompt in (PROMPT, [7], [200, 13, 13, 13, 99, 5, 64, 65]):
        want = ar_generate(ref.target, prompt, 40).tokens
        sp = SamplingParams(max_new_tokens=40)
        assert DFlashRuntime(eng).generate(prompt, sp, "ar").tokens == want
        assert_as_plain(eng, prompt, DFlashRuntime(eng).generate(prompt, sp, "dflash").tokens, want)


def test_a_block_past_max_seq_len_is_refused_naming_it(runner):
    """The engine itself refuses to run past its max_seq_len (the runtime checks requests before, the engine is the
    last line); the refusal names the limit."""
    eng, _ = runner
    seq = eng.new_sequence()
    eng.prefill(seq, np.arange(eng.info.max_seq_len - 2) % 200)
    with pytest.raises(DFlashError, match="max_seq_len"):
        eng.verify(seq, np.arange(eng.info.block_size), None, SamplingParams(), None)
