"""The Triton kernels of the two custom ops against their torch reference, on CPU under TRITON_INTERPRET=1.

Small shapes only (the interpreter runs every program in Python); tiles are forced small so multi-tile paths run.
"""

import os

# Before anything imports triton (transformers' Qwen3 does): triton reads the flag once, at its own import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dflash_export.decoding.sampling import verify_block
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.kernels import (
    EMIT_PAD,
    fused_verify,
    fused_verify_ref,
    kv_injected_block_attention,
    kv_injected_block_attention_ref,
)
from dflash_export.models.drafter import block_attention


def _triton_interprets() -> bool:
    """True when the imported triton runs kernels in its Python interpreter (no jit'd function left compiled)."""
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    return not any(isinstance(v, JITFunction) for v in vars(standard).values())


def _interpreted(module_name: str):
    """Import a kernel module under the Triton CPU interpreter, or skip (the subprocess test then covers it)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" or not _triton_interprets():
        pytest.skip("triton was imported before TRITON_INTERPRET=1; covered by test_kernels_in_fresh_interpreter")
    if module_name in sys.modules:
        return sys.modules[module_name]
    return importlib.import_module(module_name)


def test_kernels_in_fresh_interpreter():
    """When another test module imported triton first (compiled mode), rerun this file in a fresh process."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" and _triton_interprets():
        pytest.skip("the kernel tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.fixture(scope="module")
def attn_triton():
    return _interpreted("dflash_export.kernels.triton_attention").kv_injected_block_attention_triton


@pytest.fixture(scope="module")
def verify_triton():
    return _interpreted("dflash_export.kernels.triton_verify").fused_verify_triton


def _attention_inputs(B, H, KVH, S, T, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    kc, vc = torch.randn(B, KVH, T, D, generator=g), torch.randn(B, KVH, T, D, generator=g)
    kb, vb = torch.randn(B, KVH, S, D, generator=g), torch.randn(B, KVH, S, D, generator=g)
    return [t.to(dtype) for t in (q, kc, vc, kb, vb)]


@pytest.mark.parametrize("B,H,KVH,S,T,D", [
    (1, 4, 2, 4, 7, 16),    # GQA 2, block 4 (the tiny drafter's shape)
    (2, 4, 1, 5, 0, 8),     # no context yet (first draft step), MQA
    (1, 2, 2, 3, 37, 12),   # MHA, head_dim not a power of two, context spans several key tiles
    (1, 8, 2, 16, 20, 16),  # block 16, GQA 4
])
def test_block_attention_kernel_matches_reference_fp32(attn_triton, B, H, KVH, S, T, D):
    inputs = _attention_inputs(B, H, KVH, S, T, D)
    out = attn_triton(*inputs, block_n=16)
    ref = kv_injected_block_attention_ref(*inputs)
    assert out.shape == (B, H, S, D) and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-4


def test_block_attention_kernel_honours_scale_and_strides(attn_triton):
    q, kc, vc, kb, vb = _attention_inputs(1, 4, 2, 4, 9, 16, seed=3)
    # [B, S, H, D] storage viewed as [B, H, S, D]: the layout a projection's output has before a copy
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = attn_triton(q_strided, kc, vc, kb, vb, scale=0.3, block_n=16)
    ref = kv_injected_block_attention_ref(q, kc, vc, kb, vb, scale=0.3)
    assert (out - ref).abs().max().item() <= 1e-4


def test_block_attention_kernel_fp16_close_to_reference(attn_triton):
    inputs = _attention_inputs(1, 4, 2, 4, 11, 16, dtype=torch.float16, seed=5)
    out = attn_triton(*inputs, block_n=16)
    ref = kv_injected_block_attention_ref(*[t.float() for t in inputs])
    assert out.dtype == torch.float16
    assert (out.float() - ref).abs().max().item() <= 1e-2


def test_reference_equals_drafter_attention_on_concatenated_keys():
    q, kc, vc, kb, vb = _attention_inputs(2, 4, 2, 4, 6, 16, seed=7)
    expected = block_attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), 16 ** -0.5)
    assert torch.allclose(kv_injected_block_attention_ref(q, kc, vc, kb, vb), expected, atol=1e-6)


def _verify_case(B, BS, V, temperature, seed, agree=0.0):
    """Logits, drafts, draft probs and uniforms; `agree` mixes the target's own distribution into the draft's
    so that some drafts are accepted and the residual path and bonus path both run."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, BS, V, generator=g) * 3
    t = temperature if temperature > 0 else 1.0
    own = torch.softmax(logits[:, :-1] / t, -1)
    noise = torch.softmax(torch.randn(B, BS - 1, V, generator=g) * 2, -1)
    draft_probs = agree * own + (1 - agree) * noise
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).reshape(B, BS - 1)
    uniforms = torch.rand(B, BS, generator=g)
    return logits, draft_tokens, draft_probs, uniforms


def test_fused_verify_kernel_greedy_matches_reference(verify_triton):
    logits, _, _, _ = _verify_case(4, 5, 40, 0.0, seed=1)
    target_next = logits.argmax(-1)
    drafts = target_next[:, :-1].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % 40   # reject at slot 2
    drafts[2, 0] = (drafts[2, 0] + 1) % 40   # reject at once
    logits[3, 1, 7] = logits[3, 1, 9] = logits[3, 1].max() + 1  # a tie: argmax takes the first index
    drafts[3, 1] = 7
    got = verify_triton(logits, drafts, None, None, 0.0, block_v=16)
    ref = fused_verify_ref(logits, drafts)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert got[0].tolist() == [4, 2, 0, 4]
    assert got[1][1].tolist() == drafts[1, :2].tolist() + [int(target_next[1, 2]), EMIT_PAD, EMIT_PAD]


@pytest.mark.parametrize("temperature,agree", [(1.0, 0.0), (0.7, 0.9), (1.3, 0.99)])
def test_fused_verify_kernel_sampling_tokens_identical_to_reference(verify_triton, temperature, agree):
    for seed in range(3):
        case = _verify_case(3, 4, 50, temperature, seed=seed, agree=agree)
        got = verify_triton(*case, temperature, block_v=16)
        ref = fused_verify_ref(*case, temperature=temperature)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (seed, got, ref)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fused_verify_reference_equals_sampling_verify_block(temperature):
    for seed in range(4):
        logits, drafts, dprobs, unif = _verify_case(2, 5, 30, temperature, seed=seed, agree=0.95)
        if temperature == 0:
            drafts = logits.argmax(-1)[:, :-1].clone()
            drafts[0, seed % 4] = (drafts[0, seed % 4] + 1) % 30
        accept, emitted, n_emitted = fused_verify_ref(logits, drafts, dprobs, unif, temperature)
        for b in range(2):
            tp = torch.softmax(logits[b].double() / temperature, -1).numpy() if temperature else None
            a, toks = verify_block(tp, logits[b].numpy(), drafts[b].numpy(), dprobs[b].double().numpy(),
                                   unif[b].double().numpy(), greedy=temperature == 0)
            assert int(accept[b]) == a and int(n_emitted[b]) == len(toks)
            assert emitted[b, :len(toks)].tolist() == toks


def _attention_numpy(q, kc, vc, kb, vb, scale=None):
    """Hand-written float64 numpy attention (independent of the torch reference): softmax(q k^T * scale) v over the
    context keys followed by the block keys, query head h reading kv head h // (H / KVH)."""
    q, kc, vc, kb, vb = (np.asarray(t, np.float64) for t in (q, kc, vc, kb, vb))
    B, H, S, D = q.shape
    groups = H // kc.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = np.zeros((B, H, S, D))
    for b in range(B):
        for h in range(H):
            k = np.concatenate([kc[b, h // groups], kb[b, h // groups]])
            v = np.concatenate([vc[b, h // groups], vb[b, h // groups]])
            s = q[b, h] @ k.T * scale
            w = np.exp(s - s.max(-1, keepdims=True))
            out[b, h] = (w / w.sum(-1, keepdims=True)) @ v
    return out


def test_attention_closed_forms_on_the_cpu_dispatcher():
    """Independent expected values: q = 0 attends uniformly (the mean of every context and block value row of its kv
    head); one key only returns its value; random inputs equal a float64 numpy attention."""
    q, kc, vc, kb, vb = _attention_inputs(1, 4, 2, 3, 5, 8, seed=11)
    got = kv_injected_block_attention(torch.zeros_like(q), kc, vc, kb, vb)
    mean = torch.cat([vc, vb], 2).mean(2, keepdim=True)  # [1, KVH, 1, D]
    expected = mean.repeat_interleave(2, dim=1).expand(1, 4, 3, 8)
    assert torch.allclose(got, expected, atol=1e-6)
    one = [t[:, :, :1] for t in (q, kb, vb)]
    empty = kc[:, :, :0]
    got = kv_injected_block_attention(one[0], empty, empty, one[1], one[2])
    assert torch.allclose(got, one[2].repeat_interleave(2, dim=1), atol=1e-7)
    got = kv_injected_block_attention(q, kc, vc, kb, vb, scale=0.37)
    np.testing.assert_allclose(got.numpy(), _attention_numpy(q, kc, vc, kb, vb, 0.37), atol=1e-5)


# Hand-computed FusedVerify cases on V = 3 at temperature 1: p = [0.5, 0.3, 0.2] at every row (logits = log p), the
# draft distribution q = [0.8, 0.1, 0.1] at every slot. A draft of token 0 is accepted iff u * 0.8 < 0.5 (u < 0.625);
# a rejection resamples from max(p - q, 0) = [0, 0.2, 0.1] (cdf 0, 0.2, 0.3 of total 0.3); the bonus draws from p
# (cdf 0.5, 0.8, 1.0). The inverse-CDF rule takes the count of cdf entries <= u * total.
_P3 = [0.5, 0.3, 0.2]
_Q3 = [0.8, 0.1, 0.1]
VERIFY_CASES = [
    # (drafts, uniforms, expected accept_len, expected emitted tokens)
    ([0, 0], [0.60, 0.10, 0.85], 2, [0, 0, 2]),       # both accepted; bonus u=0.85 -> 0.85 >= 0.5, 0.8 -> token 2
    ([0, 0], [0.60, 0.65, 0.50], 1, [0, 1]),          # second rejected (0.65 >= 0.625); residual 0.5*0.3=0.15 -> 1
    ([0, 0], [0.70, 0.00, 0.70], 0, [2]),             # first rejected; residual 0.7*0.3=0.21 >= 0.2 -> token 2
    ([1, 0], [0.99, 0.30, 0.40], 2, [1, 0, 0]),       # token 1: q 0.1 < p 0.3 always accepted; bonus 0.4 -> token 0
    ([2, 1], [0.00, 0.99, 0.10], 2, [2, 1, 0]),       # p >= q for tokens 1 and 2: any uniform accepts
]


def _verify_case_3(drafts, uniforms):
    logits = torch.log(torch.tensor(_P3)).expand(1, 3, 3).contiguous()
    probs = torch.tensor(_Q3).expand(1, 2, 3).contiguous()
    return logits, torch.tensor([drafts]), probs, torch.tensor([uniforms])


@pytest.mark.parametrize("drafts,uniforms,accept,tokens", VERIFY_CASES)
def test_fused_verify_hand_computed_cases_on_the_cpu_dispatcher(drafts, uniforms, accept, tokens):
    got = fused_verify(*_verify_case_3(drafts, uniforms), temperature=1.0)
    assert got[0].tolist() == [accept] and got[2].tolist() == [accept + 1]
    assert got[1][0].tolist() == tokens + [EMIT_PAD] * (3 - len(tokens))


@pytest.mark.parametrize("drafts,uniforms,accept,tokens", VERIFY_CASES)
def test_fused_verify_kernel_hand_computed_cases(verify_triton, drafts, uniforms, accept, tokens):
    got = verify_triton(*_verify_case_3(drafts, uniforms), 1.0, block_v=2, block_bs=2)
    assert got[0].tolist() == [accept] and got[1][0].tolist() == tokens + [EMIT_PAD] * (3 - len(tokens))


def test_fused_verify_greedy_closed_form_on_the_cpu_dispatcher():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 3.0], [0.0, 0.0, 5.0]]])  # argmax 1, 0 (first of a tie), 2
    for drafts, accept, tokens in (([1, 0], 2, [1, 0, 2]), ([1, 2], 1, [1, 0]), ([0, 0], 0, [1])):
        got = fused_verify(logits, torch.tensor([drafts]))
        assert got[0].tolist() == [accept] and got[1][0].tolist() == tokens + [EMIT_PAD] * (3 - len(tokens))


@pytest.mark.parametrize("mutate,message", [
    (lambda x: [x[0][:, :3]] + x[1:], "multiple of num_kv_heads"),
    (lambda x: x[:3] + [x[3][:, :, :2], x[4]], "k_blk"),
    (lambda x: [x[0].double()] + x[1:], "dtype"),
    (lambda x: [x[0][0]] + x[1:], "4-D"),
])
def test_dispatch_rejects_bad_attention_shapes(mutate, message):
    inputs = _attention_inputs(1, 4, 2, 4, 3, 16)
    with pytest.raises(DFlashError, match=message):
        kv_injected_block_attention(*mutate(inputs))


def test_dispatch_rejects_bad_verify_inputs():
    logits, drafts, dprobs, unif = _verify_case(2, 4, 20, 1.0, seed=2)
    with pytest.raises(DFlashError, match="draft_tokens must be"):
        fused_verify(logits, drafts[:, :2])
    with pytest.raises(DFlashError, match="out of range"):
        fused_verify(logits, drafts + 100)
    with pytest.raises(DFlashError, match="needs draft_probs"):
        fused_verify(logits, drafts, temperature=0.5)
    with pytest.raises(DFlashError, match="uniforms must be"):
        fused_verify(logits, drafts, dprobs, unif[:, :2], temperature=0.5)
    with pytest.raises(DFlashError, match="unknown kernel backend"):
        fused_verify(logits, drafts, backend="cuda")


def test_forcing_triton_without_it_names_the_extra(monkeypatch):
    import dflash_export.kernels as kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(MissingDependency, match=r"dflash-export\[kernels\]"):
        kernels.fused_verify(*_verify_case(1, 3, 8, 0.0, seed=0)[:2], backend="triton")


def test_float32_uniforms_change_no_decision_outside_the_rounding_band():
    """The runtime draws float64 uniforms (numpy PCG64); the graphs and kernels take float32. Against numpy's float64
    `verify_block` on the same float64 probabilities, the torch op fed float32 uniforms takes the same accept / reject
    decisions and tokens for every draw whose decision margin |u * q - p| exceeds float32 rounding (~1e-7)."""
    rng = np.random.default_rng(0)
    checked = 0
    for seed in range(40):
        logits, drafts, dprobs, _ = _verify_case(1, 4, 20, 1.0, seed=seed, agree=0.9)
        unif = rng.random(4)
        p = np.exp(logits[0].double().numpy())
        p /= p.sum(-1, keepdims=True)
        q = dprobs[0].double().numpy()
        margins = [abs(unif[i] * q[i, int(d)] - p[i, int(d)]) for i, d in enumerate(drafts[0].tolist())]
        if min(margins) < 1e-6:
            continue
        want = verify_block(p, logits[0].numpy(), drafts[0].numpy(), q, unif, greedy=False)
        got = fused_verify(logits, drafts, dprobs, torch.from_numpy(unif).float()[None], 1.0)
        assert (int(got[0][0]), got[1][0, : int(got[2][0])].tolist()) == want, seed
        checked += 1
    assert checked >= 35


def test_gpu_check_cpu_dry_run_covers_every_section(tmp_path, monkeypatch):
    import json

    from dflash_export.validate import gpu_check

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # torch reference here: the interpreter path is the next test's
    assert gpu_check.main(["--cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-dry-run" and report["kernels"]["ok"]
    for section in ("kernels", "drafter_latency", "target_verify", "attention_vs_sdpa"):
        assert "error" not in report[section], report[section]
    # CPU timings mean nothing; the figures must still be the ratios of the times they are reported with
    lat = report["drafter_latency"]["kernel_eager"]
    assert lat["speedup_block_vs_sequential"] == pytest.approx(lat["4_single_steps_ms"] / lat["block_forward_ms"])
    tv = report["target_verify"]["eager"]
    assert tv["ratio"] == pytest.approx(tv["verify_4_tokens_ms"] / tv["decode_1_token_ms"])


def test_gpu_check_script_runs_from_the_repo_on_cpu(tmp_path):
    """With torch and triton alone, as the script says: onnx, onnxruntime and transformers not importable."""
    import json
    from pathlib import Path

    pytest.importorskip("triton")
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nfor m in ('onnx', 'onnxruntime', 'transformers'):\n"
                                           "    sys.modules[m] = None\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHON=sys.executable, OUT=str(tmp_path), PYTHONPATH=str(site))
    run = subprocess.run(["bash", str(script), "--cpu", "--sections", "kernels"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["kernel_backend"] == "triton" and report["kernels"]["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_check_without_a_gpu_says_so(tmp_path, capsys):
    from dflash_export.validate import gpu_check

    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_fused_verify_kernel_one_row_block_emits_the_target_token(verify_triton):
    # prefill runs FusedVerify on the last prompt row alone: no drafts, one token from the target
    logits, _, _, _ = _verify_case(2, 2, 30, 1.0, seed=6)
    logits = logits[:, :1].contiguous()
    no_drafts = torch.zeros(2, 0, dtype=torch.int64)
    for temperature, probs, unif in ((0.0, None, None), (1.0, torch.zeros(2, 0, 30), torch.rand(2, 1))):
        got = verify_triton(logits, no_drafts, probs, unif, temperature, block_v=16)
        ref = fused_verify_ref(logits, no_drafts, probs, unif, temperature)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


def test_aot_attention_kernel_argument_order_matches_reference():
    """The TensorRT AOT entry point (contiguous tensors; inputs, int32 scalars, outputs) computes the same thing."""
    module = _interpreted("dflash_export.kernels.triton_attention")
    B, H, KVH, S, T, D = 2, 4, 2, 4, 19, 16
    q, kc, vc, kb, vb = _attention_inputs(B, H, KVH, S, T, D, seed=8)
    out = torch.empty_like(q)
    block_m = 16
    module.kv_injected_block_attention_aot_kernel[(B * H, -(-S // block_m))](
        q, kc, vc, kb, vb, H, KVH, S, T, D, out, QK_SCALE=0.25 * 1.4426950408889634, BLOCK_M=block_m, BLOCK_N=16,
        BLOCK_D=16, PRECISION="ieee")
    assert (out - kv_injected_block_attention_ref(q, kc, vc, kb, vb, scale=0.25)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_aot_verify_kernel_argument_order_matches_reference(temperature):
    module = _interpreted("dflash_export.kernels.triton_verify")
    B, BS, V = 3, 4, 40
    logits, drafts, dprobs, unif = _verify_case(B, BS, V, temperature, seed=9, agree=0.9)
    outs = [torch.empty(B, dtype=torch.int64), torch.empty(B, BS, dtype=torch.int64), torch.empty(B, dtype=torch.int64)]
    module.fused_verify_aot_kernel[(B,)](
        logits, drafts, dprobs, unif, BS, V, *outs, INV_TEMP=1.0 / temperature if temperature else 1.0,
        GREEDY=temperature == 0, BLOCK_V=16, BLOCK_BS=4, PAD=EMIT_PAD)
    for a, b in zip(outs, fused_verify_ref(logits, drafts, dprobs, unif, temperature)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_fused_verify_kernel_blocks_longer_than_its_tile_are_not_cut(verify_triton, temperature):
    """A 70-row block through a 16-slot emitted tile: every accepted draft and the final token are written (the
    kernel loops over the tiles), as the reference emits them."""
    BS, V = 70, 12
    logits, drafts, dprobs, unif = _verify_case(2, BS, V, temperature, seed=12, agree=0.999)
    if temperature == 0:
        drafts = logits.argmax(-1)[:, :-1].clone()
        drafts[1, 66] = (drafts[1, 66] + 1) % V   # sequence 1 rejects at slot 66; sequence 0 accepts all 69
    got = verify_triton(logits, drafts, dprobs, unif, temperature, block_v=16, block_bs=16)
    ref = fused_verify_ref(logits, drafts, dprobs, unif, temperature)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    if temperature == 0:
        assert got[0].tolist() == [69, 66] and got[1][0, 69].item() == int(logits[0, 69].argmax())


def test_aot_verify_kernel_with_the_plugin_constants_serves_any_row_count():
    """The plugin compiles one FusedVerify kernel for every profile (num_logits 1 at prefill / decode, block_size at
    verify): run the AOT entry point with exactly the constants the plugin compiles in, at 1, 4 and 70 rows."""
    from dflash_export.engines.tensorrt import verify_aot_constexprs

    module = _interpreted("dflash_export.kernels.triton_verify")
    for temperature in (0.0, 0.8):
        consts = verify_aot_constexprs(temperature)
        assert "BS" not in consts and consts["BLOCK_BS"] < 70
        for BS in (1, 4, 70):
            B, V = 2, 24
            logits, drafts, dprobs, unif = _verify_case(B, max(BS, 2), V, temperature, seed=BS, agree=0.99)
            logits, drafts, dprobs = logits[:, :BS].contiguous(), drafts[:, :BS - 1].contiguous(), \
                dprobs[:, :BS - 1].contiguous()
            unif = unif[:, :BS].contiguous()
            if BS == 1:
                dprobs = torch.zeros(B, 1, V)  # TensorRT's minimum draft_probs shape (n_draft_or_1)
            outs = [torch.empty(B, dtype=torch.int64), torch.empty(B, BS, dtype=torch.int64),
                    torch.empty(B, dtype=torch.int64)]
            module.fused_verify_aot_kernel[(B,)](logits, drafts, dprobs, unif, BS, V, *outs, **consts)
            want = fused_verify_ref(logits, drafts, dprobs[:, :BS - 1], unif, temperature)
            for a, b in zip(outs, want):
                assert torch.equal(a, b), (temperature, BS)


def test_gpu_check_builds_every_plugin_alone_on_the_aot_path_first_then_the_jit_path(tmp_path, monkeypatch):
    """The order and the record of gpu_check's plugin_layers section, with TensorRT replaced (no GPU here): the
    builder stand-in keeps the ONNX graph it was handed and its "engine" runs that graph in ONNX Runtime, so each
    case still meets the torch reference. Every plugin is built alone with the AOT path asked for, then with the
    JIT path, and each case says which path it asked for and which was built."""
    import importlib.util
    import types

    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from dflash_export.engines import tensorrt as trt_backend
    from dflash_export.validate import gpu_lossless

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # triton: both plugin paths need it, the stand-ins do not
                        lambda name, *a: object() if name in ("tensorrt", "triton") else real_find_spec(name, *a))
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "11.4.0.106"
    trt.plugin = types.ModuleType("tensorrt.plugin")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trt.plugin)
    monkeypatch.setattr(trt_backend, "require_tensorrt", lambda gpu=True: trt)
    monkeypatch.setattr(trt_backend, "aot_plugins_supported", lambda trt, trtp: True)
    built = []

    def build(onnx_path, engine_path, profiles, dtype, workspace_gib=8.0, implementation=None):
        import onnx

        op = onnx.load(str(onnx_path)).graph.node[0].op_type
        built.append((op, implementation))
        engine_path.write_text(str(onnx_path))
        return {"requested": implementation, "implementation": {op: implementation}, "plugins": {op: 1},
                "plugin_layers": {op: 1}}

    def run_engine(trt, data, feeds):
        import onnx
        from onnx import TensorProto

        model = onnx.load(data.decode())
        half = any(v.dtype == torch.float16 for v in feeds.values())
        for v in list(model.graph.input) + list(model.graph.output):  # the function body computes in float32
            if v.type.tensor_type.elem_type == TensorProto.FLOAT16:
                v.type.tensor_type.elem_type = TensorProto.FLOAT
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        out = sess.run(None, {k: (v.float() if v.dtype == torch.float16 else v).numpy() for k, v in feeds.items()})
        return {o.name: torch.from_numpy(a).to(torch.float16) if half and a.dtype.kind == "f" else torch.from_numpy(a)
                for o, a in zip(sess.get_outputs(), out)}

    monkeypatch.setattr(trt_backend, "build_engine_file", build)
    monkeypatch.setattr(gpu_lossless, "_run_engine", run_engine)
    report = gpu_lossless.plugin_layers(tmp_path)
    paths = [p for _, p in built]
    assert paths == ["aot"] * 4 + ["jit"] * 4, built
    assert [op for op, _ in built[:4]] == [op for op, _ in built[4:]]
    cases = report["cases"]
    assert [c["case"].split("/")[0] for c in cases] == paths
    for c in cases:
        assert "error" not in c, c
        path = c["case"].split("/")[0]
        assert c["requested"] == path and set(c["implementation"].values()) == {path}
    assert report["ok"], cases
