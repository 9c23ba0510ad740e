"""The Gated DeltaNet layer's two block forms (export/linear_attention.BLOCK_FORM): the Scan (one position per
iteration, the engines' default) and the chunked (WY / UT-transform) form, each held to transformers' own
Qwen3_5GatedDeltaNet over a prefill and verify-sized blocks with the state carried between calls."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from dflash_export.export import linear_attention as lin

HIDDEN, HK, HV, DK, DV, KERNEL = 64, 2, 4, 16, 8, 4
CHANNELS = 2 * HK * DK + HV * DV
SHAPES = {"key_heads": HK, "value_heads": HV, "key_dim": DK, "value_dim": DV, "conv_kernel": KERNEL,
          "conv_channels": CHANNELS}


@pytest.fixture(scope="module")
def layer():
    """transformers' Gated DeltaNet layer (random weights, a non-trivial norm and decay) and its state dict."""
    return _layer(HK, HV)


def _layer(hk: int, hv: int):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                            linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=DK,
                            linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL, vocab_size=32)
    torch.manual_seed(0)
    m = Qwen3_5GatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        m.norm.weight.add_(0.1 * torch.randn_like(m.norm.weight))
        m.dt_bias.add_(torch.randn_like(m.dt_bias))
    sd = {"l." + k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    return cfg, m, sd


def _session(sd, form: str, shapes: dict = SHAPES):
    model = lin.gated_delta_net_model(sd, "l.", types.SimpleNamespace(fused_projections=False), shapes, 1e-6,
                                      HIDDEN, form)
    return ort.InferenceSession(model.SerializeToString())


def _run(sess, x, conv, rec):
    """One call: (y, the committed conv window and state after its last row)."""
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, {"x": x, "conv_state_0": conv, "recurrent_state_0": rec})))
    return out["y"], out["conv_window_0"][:, :, -(KERNEL - 1):], out["recurrent_last_0"], out


@pytest.mark.parametrize("form", ["scan", "chunked"])
def test_each_block_form_equals_transformers_gated_delta_net(layer, form):
    """A prefill of 7 rows, then blocks of 16, 1, 5 and 64 rows with the state carried between calls: every row's
    output within 1e-5 of transformers' layer run on the same calls with its own cache."""
    from transformers.cache_utils import DynamicCache

    cfg, m, sd = layer
    sess = _session(sd, form)
    cache = DynamicCache(config=cfg)
    conv = np.zeros((1, CHANNELS, KERNEL - 1), np.float32)
    rec = np.zeros((1, HV, DK, DV), np.float32)
    rng = np.random.default_rng(1)
    for rows in (7, 16, 1, 5, 64):
        x = rng.standard_normal((1, rows, HIDDEN)).astype(np.float32)
        with torch.no_grad():
            want = m(torch.from_numpy(x), cache_params=cache).numpy()
        got, conv, rec, _ = _run(sess, x, conv, rec)
        assert np.abs(got - want).max() < 1e-5, (form, rows, float(np.abs(got - want).max()))


def test_scan_rows_are_one_row_steps_bits_and_chunked_rows_are_within_rounding(layer):
    """What each form promises a verify block: the Scan's row r is bit-identical to a one-row step after rows
    0..r-1 (so DFlash equals plain decoding on the engine); the chunked form's rows differ from those steps by
    rounding only (not bits: a verify row is then not a plain step's arithmetic)."""
    _, _, sd = layer
    rng = np.random.default_rng(2)
    conv0 = rng.standard_normal((1, CHANNELS, KERNEL - 1)).astype(np.float32)
    rec0 = (0.3 * rng.standard_normal((1, HV, DK, DV))).astype(np.float32)
    x = rng.standard_normal((1, 16, HIDDEN)).astype(np.float32)
    scan, chunked = _session(sd, "scan"), _session(sd, "chunked")
    steps, conv, rec = [], conv0, rec0
    for r in range(16):  # the Scan's one-row steps: the engine's plain decoding
        y, conv, rec, _ = _run(scan, x[:, r:r + 1], conv, rec)
        steps.append(y)
    steps = np.concatenate(steps, axis=1)
    block_scan = _run(scan, x, conv0, rec0)[0]
    block_chunked = _run(chunked, x, conv0, rec0)[0]
    assert np.array_equal(block_scan, steps)
    rel = np.abs(block_chunked - steps).max() / np.abs(steps).max()
    assert 0 < rel < 1e-5, rel


@pytest.mark.parametrize("value_heads", [3, 5, 6])
def test_scan_rows_are_one_row_steps_bits_whatever_the_number_of_value_heads(value_heads):
    """Value-head counts that are no multiple of a CPU's vector width (the decay's Softplus runs over [B, S, value
    heads]): a block of 1..7 rows still gives each row the bits of its one-row step."""
    _, _, sd = _layer(1, value_heads)
    shapes = dict(SHAPES, key_heads=1, value_heads=value_heads, conv_channels=2 * DK + value_heads * DV)
    sess = _session(sd, "scan", shapes)
    rng = np.random.default_rng(3)
    conv0 = rng.standard_normal((1, shapes["conv_channels"], KERNEL - 1)).astype(np.float32)
    rec0 = (0.3 * rng.standard_normal((1, value_heads, DK, DV))).astype(np.float32)
    x = rng.standard_normal((1, 7, HIDDEN)).astype(np.float32)
    steps, conv, rec = [], conv0, rec0
    for r in range(7):
        y, conv, rec, _ = _run(sess, x[:, r:r + 1], conv, rec)
        steps.append(y)
    for rows in range(2, 8):
        np.testing.assert_array_equal(_run(sess, x[:, :rows], conv0, rec0)[0],
                                      np.concatenate(steps[:rows], axis=1), err_msg=f"{rows} rows")


@pytest.mark.parametrize("recipe_name", ["tiny-qwen3.5", "tiny-qwen3-next"])
def test_tensorrt_build_of_a_hybrid_is_refused_by_name_before_anything_is_written(recipe_name, tmp_path):
    """`build --backend tensorrt` on a hybrid target (a recipe that lists the backend): one error naming the field
    and the backend that runs it, exit 2, no traceback, no engine directory (whether or not tensorrt and a GPU are
    present)."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    src = Path(__file__).resolve().parent.parent / "recipes" / f"{recipe_name}.yaml"
    recipe = tmp_path / f"{recipe_name}.yaml"
    recipe.write_text(src.read_text().replace("backends: [onnxruntime]", "backends: [onnxruntime, tensorrt]"))
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "--backend", "tensorrt", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "model_type" in r.output and "hybrid target" in r.output and "--backend onnxruntime" in r.output
    assert "Traceback" not in r.output and not out.exists()
