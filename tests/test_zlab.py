"""Checkpoints as z-lab's release (dflash 0.1.0, transformers 5) writes them, checked against its own code.

The oracle is independent of this project: `dflash.model` from PyPI (a test dependency, installed by ./dev without
its unrelated pins) builds, saves and runs each drafter kind; the project loads the saved directory and must give the
same greedy tokens and per-step acceptance lengths as z-lab's `dflash_generate`, block logits within 1e-4 (fp32), on
the PyTorch reference and on the ONNX Runtime engine.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash 0.1.0 (./dev installs it)")

VOCAB, HIDDEN, TARGET_LAYERS, MASK = 32, 64, 6, 31
THETA = 1_000_000.0
PROMPTS = [[1, 2, 3, 4, 5], [7, 3, 9, 9, 2, 11, 4, 8, 20, 1, 6], [5], [12, 13, 14, 15, 16, 17, 2, 3]]

# The checkpoint kinds of the issue: extra Qwen3Config / dflash_config keys on top of a plain drafter.
KINDS = {
    "plain": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
                "use_sliding_window": True},
    "scaled": {"dflash_config": {"input_embedding_scale": 1.7, "output_multiplier": 0.6,
                                 "final_logit_softcapping": 3.0}},
    "causal": {"is_causal": True},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": THETA,
                                 "original_max_position_embeddings": 512}},
    # DFlash 2: grouped dynamic causal convolutions + candidate selector (z-lab's DFlash2DraftModel)
    "dflash2": {"architectures": ["DFlash2DraftModel"],
                "dflash_config": {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
                                  "selector_top_k": 4}},
}


def _dflash_time(monkeypatch):
    # dflash_generate(return_stats=True) times with torch.cuda.synchronize; on a CPU only the clock is swapped.
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module")
def zlab_target(tmp_path_factory):
    """A tiny Qwen3 target saved by transformers 5 (rope base inside rope_parameters only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("zlab") / "target"
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=1024,
                      rope_parameters={"rope_type": "default", "rope_theta": THETA}, eos_token_id=VOCAB - 2,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)  # peaked distributions
        # Tokens 5 and 6 lead whenever the final hidden state's first feature is large (either sign); the drafters
        # below amplify the same feature, so a random drafter's guesses are often right and acceptance lengths vary.
        model.model.norm.weight[0] = 10.0
        model.lm_head.weight[5].zero_()
        model.lm_head.weight[6].zero_()
        model.lm_head.weight[5, 0], model.lm_head.weight[6, 0] = 1.0, -1.0
    model.save_pretrained(str(d))
    raw = json.loads((d / "config.json").read_text())
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == THETA  # as transformers 5 writes it
    return d


def _save_zlab_drafter(d, kind: str, seed: int = 1):
    """A drafter built and saved by z-lab's own DFlashDraftModel (its config keys and tensor names)."""
    from transformers import Qwen3Config

    extra = json.loads(json.dumps(KINDS[kind]))
    dflash_config = {"mask_token_id": MASK, "target_layer_ids": [1, 3], **extra.pop("dflash_config", {})}
    cfg = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=1024,
               rope_parameters={"rope_type": "default", "rope_theta": THETA}, num_target_layers=TARGET_LAYERS,
               block_size=4, dflash_config=dflash_config, architectures=["DFlashDraftModel"])
    cfg.update(extra)
    torch.manual_seed(seed)
    cls = zlab.DFlash2DraftModel if cfg["architectures"] == ["DFlash2DraftModel"] else zlab.DFlashDraftModel
    model = cls(Qwen3Config(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
        model.norm.weight[0] = 10.0  # see zlab_target
    model.save_pretrained(str(d))
    if cls is zlab.DFlash2DraftModel:
        # z-lab's released DFlash 2 checkpoints store the codebooks without `.weight` (its from_pretrained maps them)
        from safetensors.torch import load_file, save_file

        state = load_file(str(d / "model.safetensors"))
        for name in ("predecessor_codebook", "successor_codebook"):
            state[f"candidate_selector.{name}"] = state.pop(f"candidate_selector.{name}.weight")
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def zlab_pairs(zlab_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("zlab_drafters")
    return {kind: _save_zlab_drafter(root / kind, kind) for kind in KINDS}


def _zlab_models(target_dir, drafter_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    arch = json.loads((drafter_dir / "config.json").read_text())["architectures"]
    cls = zlab.DFlash2DraftModel if arch == ["DFlash2DraftModel"] else zlab.DFlashDraftModel
    drafter = cls.from_pretrained(str(drafter_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    return target, drafter


def _zlab_generate(target, drafter, ids, max_new):
    res = zlab.dflash_generate(drafter, target, torch.tensor([ids]), max_new_tokens=max_new, stop_token_ids=None,
                               temperature=0.0, return_stats=True)
    return res.output_ids[0, len(ids):].tolist(), list(res.acceptance_lengths)


@pytest.mark.parametrize("kind", list(KINDS))
def test_dflash_spec_is_what_zlab_reads_from_the_checkpoint(kind, zlab_target, zlab_pairs):
    """DFlashSpec, resolved once and passed to every stage, holds the constants z-lab's model takes from the same
    config: block size, mask id, taps, the kind of drafter and the embedding / logit scaling."""
    from dflash_export.models.checkpoint import load_drafter

    _, zd = _zlab_models(zlab_target, zlab_pairs[kind])
    spec = load_drafter(zlab_pairs[kind]).spec()
    assert (spec.block_size, spec.mask_token_id, spec.target_layer_ids) == (
        zd.block_size, zd.mask_token_id, tuple(zd.target_layer_ids))
    assert spec.kind == ("dflash2" if isinstance(zd, zlab.DFlash2DraftModel) else "dflash")
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        assert getattr(spec, key) == zlab._draft_value(zd.config, key, default), key
    assert load_drafter(zlab_pairs[kind]).spec(2).block_size == 2  # a recipe's shorter block


@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_equals_zlab_tokens_acceptance_and_block_logits(kind, zlab_target, zlab_pairs, monkeypatch):
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.runtime.reference import spec_generate

    _dflash_time(monkeypatch)
    z_target, z_drafter = _zlab_models(zlab_target, zlab_pairs[kind])
    target, drafter = load_target(zlab_target), load_drafter(zlab_pairs[kind])
    accepted = []
    for i, ids in enumerate(PROMPTS):
        max_new = 13 + 3 * i  # never a multiple of the block: the last block is shortened
        want_tokens, want_acc = _zlab_generate(z_target, z_drafter, ids, max_new)
        got = spec_generate(drafter, target, ids, max_new_tokens=max_new, stop_token_ids=[])
        assert got.tokens == want_tokens, (kind, i)
        assert got.acceptance_lengths == want_acc, (kind, i)
        accepted += want_acc
    assert max(accepted) > 2 and accepted.count(1) > 0, accepted  # a real comparison: lengths vary
    # Block logits of one drafting step after a prompt, from z-lab's model and compute_logits.
    ids = torch.tensor([PROMPTS[1]])
    n, bs = ids.shape[1], drafter.block_size
    with torch.no_grad():
        out = z_target(ids, output_hidden_states=True)
        taps = zlab.extract_context_feature(out.hidden_states, z_drafter.target_layer_ids)
        block = torch.full((1, bs), MASK)
        block[0, 0] = 7
        scale = float(zlab._draft_value(z_drafter.config, "input_embedding_scale", 1.0))
        hidden = z_drafter(target_hidden=taps, noise_embedding=zlab._raw_input_embeddings(z_target, block, scale),
                           position_ids=torch.arange(n + bs)[None])[:, 1:]
        want = z_drafter.compute_logits(hidden, zlab._output_head(z_target))
        got = drafter.draft_logits(target, target.forward(ids, torch.arange(n)[None], target.new_cache(),
                                                          drafter.config.target_layer_ids).taps,
                                   torch.arange(n)[None], block, torch.arange(n, n + bs)[None])
    assert (got - want).abs().max().item() <= 1e-4, kind


@pytest.fixture(scope="module")
def ort_engines(zlab_target, zlab_pairs, tmp_path_factory):
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.registry import load_engine
    from dflash_export.recipes import load_recipe

    root = tmp_path_factory.mktemp("zlab_ort")
    engines = {}
    for kind, drafter_dir in zlab_pairs.items():
        recipe_path = root / f"{kind}.yaml"
        recipe_path.write_text(f"name: zlab-{kind}\ntarget: {zlab_target}\ndrafter: {drafter_dir}\ndtype: float32\n"
                               "max_seq_len: 128\nchat_template: false\n")
        out = build_onnxruntime(load_recipe(recipe_path), root / kind, threads=1)
        engines[kind] = load_engine(out, threads=1)
    return engines


@pytest.mark.parametrize("kind", list(KINDS))
def test_ort_engine_equals_zlab_tokens_and_acceptance(kind, zlab_target, zlab_pairs, ort_engines, monkeypatch):
    """The engine verifying full blocks (as z-lab does) commits z-lab's tokens in z-lab's steps."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.single import DFlashRuntime

    _dflash_time(monkeypatch)
    z_target, z_drafter = _zlab_models(zlab_target, zlab_pairs[kind])
    rt = DFlashRuntime(ort_engines[kind], adaptive=False)
    for i, ids in enumerate(PROMPTS):
        max_new = 13 + 3 * i
        want_tokens, want_acc = _zlab_generate(z_target, z_drafter, ids, max_new)
        sp = SamplingParams(max_new_tokens=max_new, stop_token_ids=[])
        got = rt.generate(ids, sp)
        assert got.tokens == want_tokens, (kind, i)
        assert got.acceptance_lengths == want_acc, (kind, i)
        assert rt.generate(ids, sp, mode="ar").tokens == want_tokens  # = plain decoding on the same engine


def test_inspect_reads_transformers5_rope_and_names_what_it_cannot_honour(zlab_target, zlab_pairs, tmp_path):
    """rope_parameters is read (no false rope mismatch with the target); a dynamic RoPE type is refused by name."""
    import shutil

    from dflash_export.models.checkpoint import lint_pair

    for kind, drafter_dir in zlab_pairs.items():  # every kind the release writes lints clean against its target
        findings, summary = lint_pair(drafter_dir, zlab_target)
        errors = [f.field for f in findings if f.level == "error"]
        # the yarn drafter's RoPE is read, and differs from its target's (the project's lint rule)
        assert errors == (["rope_scaling"] if kind == "yarn" else []), (kind, [f.line() for f in findings])
        assert summary["rope"]["rope_theta"] == THETA
        assert summary["drafter kind"].startswith("DFlash 2" if kind == "dflash2" else "DFlash")
    bad = tmp_path / "dynamic"
    shutil.copytree(zlab_pairs["plain"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}
    (bad / "config.json").write_text(json.dumps(cfg))
    findings, _ = lint_pair(bad, zlab_target)
    assert any(f.field == "rope_parameters.rope_type" and "dynamic" in f.message for f in findings), \
        [f.line() for f in findings]


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["dflash_config"].__setitem__("is_causal", True), "dflash_config.is_causal"),
    (lambda c: c.__setitem__("use_sliding_window", False), "sliding_window"),
    (lambda c: c.__setitem__("hidden_act", "gelu"), "hidden_act"),
    (lambda c: c["dflash_config"].__setitem__("output_multiplier", "2"), "dflash_config.output_multiplier"),
    (lambda c: c.__setitem__("architectures", ["DFlash2DraftModel"]), "conv_kernel_size"),
    (lambda c: c.__setitem__("architectures", ["DFlash3DraftModel"]), "architectures"),
])
def test_keys_the_project_cannot_honour_are_refused_by_name(zlab_pairs, tmp_path, edit, field):
    import shutil

    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    d = tmp_path / "d"
    shutil.copytree(zlab_pairs["sliding"], d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        load_drafter(d)
    assert e.value.field == field, e.value


def test_ort_engine_applies_the_drafter_logit_scaling(ort_engines):
    """The scaled drafter's ORT engine reads multiplier and soft cap from its graph (not left at 1 / none)."""
    eng = ort_engines["scaled"]
    assert eng._draft_multiplier == pytest.approx(0.6) and eng._draft_softcap == pytest.approx(3.0)
    assert np.isclose(ort_engines["plain"]._draft_multiplier, 1.0) and ort_engines["plain"]._draft_softcap is None


@pytest.mark.parametrize("kind", ["sliding", "causal"])
def test_tensorrt_build_refuses_masked_drafters_by_name_before_needing_a_gpu(kind, zlab_target, zlab_pairs, tmp_path):
    """MaskedKVInjectedBlockAttention has no TensorRT plugin yet: the build says so, naming the key, on any machine."""
    from dflash_export.engines.tensorrt import build_tensorrt
    from dflash_export.errors import DFlashError
    from dflash_export.recipes import load_recipe

    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"name: zlab-{kind}\ntarget: {zlab_target}\ndrafter: {zlab_pairs[kind]}\n"
                           "dtype: float32\nmax_seq_len: 128\nchat_template: false\n")
    with pytest.raises(DFlashError) as e:
        build_tensorrt(load_recipe(recipe_path), tmp_path / "engine")
    assert e.value.field == ("is_causal" if kind == "causal" else "layer_types")
    assert not (tmp_path / "engine").exists()


def test_dflash2_selector_proposals_equal_zlab_and_sampling_keeps_the_target_distribution(zlab_target, zlab_pairs):
    """Greedy: the candidate selector's walk is z-lab's propose() on the same block. T>0: speculative sampling over
    the selector's candidates (q scattered on the vocabulary, 0 elsewhere) leaves the output distribution the
    target's: the first three tokens' histograms of spec and AR sampling agree (chi-square)."""
    from scipy import stats

    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.runtime.reference import ar_generate, spec_generate

    z_target, z_drafter = _zlab_models(zlab_target, zlab_pairs["dflash2"])
    target, drafter = load_target(zlab_target), load_drafter(zlab_pairs["dflash2"])
    ids = torch.tensor([PROMPTS[3]])
    n, bs = ids.shape[1], drafter.block_size
    with torch.no_grad():
        taps = zlab.extract_context_feature(z_target(ids, output_hidden_states=True).hidden_states,
                                            z_drafter.target_layer_ids)
        for anchor in (5, 6, 9):
            block = torch.full((1, bs), MASK)
            block[0, 0] = anchor
            hidden = z_drafter(target_hidden=taps, noise_embedding=zlab._raw_input_embeddings(z_target, block),
                               position_ids=torch.arange(n + bs)[None])[:, 1:]
            want = z_drafter.propose(hidden, block[:, 0], zlab._output_head(z_target), 0.0)[0][0].tolist()
            logits, mine = drafter.draft_step(target, target.forward(ids, torch.arange(n)[None], target.new_cache(),
                                                                     drafter.config.target_layer_ids).taps,
                                              torch.arange(n)[None], block, torch.arange(n, n + bs)[None])
            assert drafter.propose(logits[0], mine[0], anchor, 0.0)[0].tolist() == want
    samples, counts = 600, np.zeros((2, 3, VOCAB))
    for s in range(samples):
        for row, res in enumerate((spec_generate(drafter, target, PROMPTS[0], max_new_tokens=3, temperature=1.0,
                                                 stop_token_ids=[], seed=s),
                                   ar_generate(target, PROMPTS[0], max_new_tokens=3, temperature=1.0,
                                               stop_token_ids=[], seed=50_000 + s))):
            for j in range(3):
                counts[row, j, res.tokens[j]] += 1
    for j in range(3):
        a, b = counts[0, j], counts[1, j]
        keep = (a + b) >= 10
        table = np.stack([np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())])
        assert stats.chi2_contingency(table[:, table.sum(0) > 0])[1] > 1e-3, (j, a, b)


def test_dflash2_ort_engine_sampling_matches_the_reference_draw_for_draw(zlab_target, zlab_pairs, ort_engines):
    """T>0 on the engine (host-side selector walk over the graph's selector_hidden) against the PyTorch reference
    with the same seed: same tokens (same uniforms, same candidate order), so the engine inherits the reference's
    distribution check above."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.runtime.reference import spec_generate
    from dflash_export.runtime.single import DFlashRuntime

    target, drafter = load_target(zlab_target), load_drafter(zlab_pairs["dflash2"])
    rt = DFlashRuntime(ort_engines["dflash2"], adaptive=False, sampling="chain")  # the reference samples chains
    for seed in range(6):
        ids = PROMPTS[seed % len(PROMPTS)]
        want = spec_generate(drafter, target, ids, max_new_tokens=12, temperature=0.8, stop_token_ids=[], seed=seed)
        got = rt.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.8, stop_token_ids=[], seed=seed))
        assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths, seed


def test_dflash2_tensorrt_build_is_refused_by_name(zlab_target, zlab_pairs, tmp_path):
    from dflash_export.engines.tensorrt import build_tensorrt
    from dflash_export.errors import DFlashError
    from dflash_export.recipes import load_recipe

    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"name: zlab-dflash2\ntarget: {zlab_target}\ndrafter: {zlab_pairs['dflash2']}\n"
                           "dtype: float32\nmax_seq_len: 128\nchat_template: false\n")
    with pytest.raises(DFlashError) as e:
        build_tensorrt(load_recipe(recipe_path), tmp_path / "engine")
    assert e.value.field == "architectures" and "DFlash 2" in e.value.message
    assert not (tmp_path / "engine").exists()


def test_export_refuses_a_target_rope_its_tables_cannot_follow(zlab_target, zlab_pairs, tmp_path):
    """A dynamic-NTK target (inv_freq changes with the sequence length) is refused by name, not exported with the
    table of one length."""
    import shutil

    from dflash_export.errors import DFlashError
    from dflash_export.export import export_models
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter

    d = tmp_path / "target"
    shutil.copytree(zlab_target, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}
    (d / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "out").mkdir()
    with pytest.raises(DFlashError) as e:
        export_models(load_target(d), load_drafter(zlab_pairs["plain"]), tmp_path / "out", max_len=128)
    assert e.value.field == "rope_parameters.rope_type" and "dynamic" in e.value.message
