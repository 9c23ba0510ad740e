"""The drafter computes exactly DESIGN.md's math, loads/saves the z-lab format, and its context cache is exact."""

import math

import pytest
import torch

from dflash_export.models import save_drafter
from dflash_export.models.checkpoint import load_drafter
from dflash_export.models.config import default_target_layer_ids


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, d):
    # x [S, D] for one head; rotate-half convention
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[:, d // 2:], x[:, : d // 2]], -1)
    return x * cos + rot * sin


def naive_block_hidden(sd, cfg, taps, ctx_pos, emb, blk_pos):
    """DESIGN.md's drafter math, written out per head in float64 with no shared code from the package."""
    sd = {k: v.double() for k, v in sd.items()}
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    ctx = _rms(taps.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = emb.double()
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        xn = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = xn @ sd[p + "self_attn.q_proj.weight"].T
        k_all = torch.cat([ctx, xn]) @ sd[p + "self_attn.k_proj.weight"].T
        v_all = torch.cat([ctx, xn]) @ sd[p + "self_attn.v_proj.weight"].T
        k_pos = torch.cat([ctx_pos, blk_pos])
        heads = []
        for h in range(cfg.num_attention_heads):
            kvh = h // (cfg.num_attention_heads // cfg.num_key_value_heads)
            qh = _rms(q[:, h * d:(h + 1) * d], sd[p + "self_attn.q_norm.weight"], eps)
            kh = _rms(k_all[:, kvh * d:(kvh + 1) * d], sd[p + "self_attn.k_norm.weight"], eps)
            vh = v_all[:, kvh * d:(kvh + 1) * d]
            qh, kh = _rope(qh, blk_pos, cfg.rope_theta, d), _rope(kh, k_pos, cfg.rope_theta, d)
            att = torch.softmax(qh @ kh.T / math.sqrt(d), dim=-1)  # no mask: non-causal over context + block
            heads.append(att @ vh)
        x = x + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        xn = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        g, u = xn @ sd[p + "mlp.gate_proj.weight"].T, xn @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["norm.weight"], eps)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_drafter_logits_equal_independent_recomputation(family, request):
    target, drafter = request.getfixturevalue(f"tiny_{family}")
    cfg = drafter.config
    torch.manual_seed(0)
    n_ctx, bs = 7, cfg.block_size
    taps = torch.randn(1, n_ctx, len(cfg.target_layer_ids) * cfg.target_hidden_size)
    ctx_pos = torch.arange(n_ctx)
    blk_ids = torch.full((1, bs), cfg.mask_token_id)
    blk_ids[0, 0] = 17
    blk_pos = torch.arange(n_ctx, n_ctx + bs)
    with torch.no_grad():
        logits = drafter.draft_logits(target, taps, ctx_pos[None], blk_ids, blk_pos[None])
        hidden = naive_block_hidden(drafter.state_dict(), cfg, taps[0], ctx_pos, target.embed(blk_ids)[0], blk_pos)
        expect = target.lm_head(hidden[1:].float()[None])
    assert logits.shape == (1, bs - 1, target.vocab_size)
    assert (logits - expect).abs().max().item() <= 1e-5


def test_context_cache_equals_recomputation(tiny_qwen3):
    """Feeding context in three chunks through the cache == feeding it all at once."""
    target, drafter = tiny_qwen3
    cfg = drafter.config
    torch.manual_seed(1)
    taps = torch.randn(1, 12, len(cfg.target_layer_ids) * cfg.target_hidden_size)
    blk = torch.full((1, cfg.block_size), cfg.mask_token_id)
    blk[0, 0] = 5
    blk_pos = torch.arange(12, 12 + cfg.block_size)[None]
    with torch.no_grad():
        full = drafter.draft_logits(target, taps, torch.arange(12)[None], blk, blk_pos)
        cache = drafter.new_cache()
        for a, b in [(0, 5), (5, 9)]:  # earlier blocks, whose outputs are discarded
            pos = torch.arange(b, b + cfg.block_size)[None]
            drafter.draft_logits(target, taps[:, a:b], torch.arange(a, b)[None], blk, pos, cache)
        cached = drafter.draft_logits(target, taps[:, 9:12], torch.arange(9, 12)[None], blk, blk_pos, cache)
    assert cache.length == 12
    assert (full - cached).abs().max().item() <= 1e-5


def test_save_load_round_trip_single_and_sharded(tiny_qwen3, tmp_path):
    _, drafter = tiny_qwen3
    save_drafter(drafter, tmp_path / "single")
    save_drafter(drafter, tmp_path / "sharded", max_shard_bytes=50_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    for d in ("single", "sharded"):
        again = load_drafter(tmp_path / d)
        for k, v in drafter.state_dict().items():
            assert torch.equal(v, again.state_dict()[k]), k
        assert again.config.target_layer_ids == drafter.config.target_layer_ids
        assert again.config.block_size == drafter.config.block_size


def test_default_target_layer_ids_follow_zlab_rule():
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 4) == [1, 9, 17, 25]


def test_sliding_window_layer_masks_far_context(tiny_qwen3, tmp_path):
    """A sliding layer ignores context further back than its window; a full layer does not."""
    target, drafter = tiny_qwen3
    import copy

    cfg = copy.deepcopy(drafter.config)
    cfg.layer_types = ["sliding_attention", "sliding_attention"]
    cfg.sliding_window = 3
    from dflash_export.models.drafter import DFlashDrafter

    slid = DFlashDrafter(cfg)
    slid.load_state_dict(drafter.state_dict())
    torch.manual_seed(2)
    taps = torch.randn(1, 10, len(cfg.target_layer_ids) * cfg.target_hidden_size)
    taps2 = taps.clone()
    taps2[:, :4] += 5.0  # change only far context (positions 0..3)
    blk = torch.full((1, cfg.block_size), cfg.mask_token_id)
    pos = torch.arange(10, 10 + cfg.block_size)[None]
    with torch.no_grad():
        a = slid.draft_logits(target, taps, torch.arange(10)[None], blk, pos)
        b = slid.draft_logits(target, taps2, torch.arange(10)[None], blk, pos)
        c = drafter.draft_logits(target, taps, torch.arange(10)[None], blk, pos)
        d = drafter.draft_logits(target, taps2, torch.arange(10)[None], blk, pos)
    assert torch.allclose(a, b, atol=1e-6)
    assert not torch.allclose(c, d, atol=1e-3)


@pytest.mark.filterwarnings("error")
def test_the_candidate_selector_at_a_temperature_near_zero_selects_the_greedy_walk():
    """DFlash 2's selector (PyTorch) sampling at T -> 0 draws the best-scoring candidate at every slot: the greedy walk,
    written out here in float64 numpy (top-k by logit, logit + successor . (predecessor[prev] * projection)), with a
    one-hot draft distribution on it and no NaN. T 1e-30 divides the scores without overflow; T 1e-310 and 5e-324
    overflow the quotient and take the limit."""
    from types import SimpleNamespace

    import numpy as np

    from dflash_export.models.drafter import CandidateSelector

    n, v, r, hidden_size, top_k, anchor = 7, 40, 4, 12, 5, 3
    selector = CandidateSelector(SimpleNamespace(selector_top_k=top_k, vocab_size=v, selector_rank=r,
                                                 hidden_size=hidden_size))
    torch.manual_seed(3)
    hidden, logits = torch.randn(n, hidden_size), torch.randn(n, v) * 4
    pred = selector.predecessor_codebook.weight.detach().double().numpy()
    succ = selector.successor_codebook.weight.detach().double().numpy()
    projected = hidden.double().numpy() @ selector.hidden_projection.weight.detach().double().numpy().T
    walk, prev = [], anchor
    for i, row in enumerate(logits.double().numpy()):
        cand = np.argsort(-row, kind="stable")[:top_k]
        scores = row[cand] + succ[cand] @ (pred[prev] * projected[i])
        assert np.sort(scores)[-1] - np.sort(scores)[-2] > 1e-3  # no near-tie float32 could reorder
        prev = int(cand[np.argmax(scores)])
        walk.append(prev)
    with torch.no_grad():
        greedy, none = selector.select(hidden, logits, anchor, 0.0)
        assert list(greedy) == walk and none is None
        for temperature in (1e-30, 1e-310, 5e-324):
            uniforms = np.random.default_rng(4).random(n)
            tokens, probs = selector.select(hidden, logits, anchor, temperature, uniforms)
            assert list(tokens) == walk, temperature
            assert not np.isnan(probs).any()
            np.testing.assert_array_equal(probs, np.eye(v)[walk])
