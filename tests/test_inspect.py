"""`dflash-export inspect` catches each planted defect with its own message; bad input is one clear line, exit 2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dflash_export.cli import main
from dflash_export.models.sources import resolve_source


@pytest.fixture()
def pair(tmp_path):
    target = resolve_source("tiny:qwen3/target")
    drafter = tmp_path / "drafter"
    shutil.copytree(resolve_source("tiny:qwen3/drafter"), drafter)
    return drafter, target


def _edit_config(drafter: Path, fn):
    cfg = json.loads((drafter / "config.json").read_text())
    fn(cfg)
    (drafter / "config.json").write_text(json.dumps(cfg))


def _edit_weights(drafter: Path, fn):
    sd = load_file(str(drafter / "model.safetensors"))
    fn(sd)
    save_file(sd, str(drafter / "model.safetensors"))


def _inspect(drafter, target):
    return CliRunner().invoke(main, ["inspect", str(drafter), "--target", str(target)])


def test_good_pair_passes(pair):
    r = _inspect(*pair)
    assert r.exit_code == 0, r.output
    assert "OK" in r.output and "target_layer_ids" in r.output


DEFECTS = {
    "fc_width": (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("fc.weight", torch.zeros(64, 3 * 64))),
                 "fc.weight: input width 192"),
    "layer_out_of_range": (lambda d: _edit_config(d, lambda c: c["dflash_config"].__setitem__("target_layer_ids",
                                                                                              [1, 9])),
                           "layer 9 outside the target's 0..5"),
    "last_layer": (lambda d: _edit_config(d, lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, 5])),
                   "taken after the final norm"),
    "mask_outside_vocab": (lambda d: _edit_config(d, lambda c: c["dflash_config"].__setitem__("mask_token_id", 999)),
                           "999 outside the target's embedding rows"),
    "mask_is_stop": (lambda d: _edit_config(d, lambda c: c["dflash_config"].__setitem__("mask_token_id", 254)),
                     "is a stop token of the target"),
    "rope_theta": (lambda d: _edit_config(d, lambda c: c.__setitem__("rope_theta", 500000.0)),
                   "rope_theta: 500000 != target rope_theta 10000"),
    "rope_scaling": (lambda d: _edit_config(d, lambda c: c.__setitem__("rope_scaling", {"rope_type": "linear",
                                                                                         "factor": 2.0})),
                     "rope_scaling: {'rope_type': 'linear'"),
    "block_size_disagrees": (lambda d: _edit_config(d, lambda c: c.__setitem__("block_size", 8)),
                             "block_size 8 disagrees with dflash_config.block_size 4"),
    "block_size_too_small": (lambda d: _edit_config(d, lambda c: (c.__setitem__("block_size", 1),
                                                                  c["dflash_config"].pop("block_size"))),
                             "block_size: must be an integer >= 2"),
    "missing_tensor": (lambda d: _edit_weights(d, lambda sd: sd.pop("layers.1.mlp.up_proj.weight")),
                       "layers.1.mlp.up_proj.weight: missing tensor"),
    "unexpected_tensor": (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("embed_tokens.weight",
                                                                               torch.zeros(256, 64))),
                          "embed_tokens.weight: unexpected tensor"),
    "wrong_shape": (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("layers.0.self_attn.k_proj.weight",
                                                                         torch.zeros(16, 64))),
                    "layers.0.self_attn.k_proj.weight: shape (16, 64) != expected (32, 64)"),
    "mixed_dtypes": (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("norm.weight", sd["norm.weight"].half())),
                     "mixed tensor dtypes"),
    "num_target_layers": (lambda d: _edit_config(d, lambda c: c.__setitem__("num_target_layers", 36)),
                          "num_target_layers: 36 != target num_hidden_layers 6"),
    "gqa": (lambda d: _edit_config(d, lambda c: c.__setitem__("num_key_value_heads", 3)),
            "does not divide num_attention_heads"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_planted_defect_is_reported(pair, defect):
    plant, message = DEFECTS[defect]
    drafter, target = pair
    plant(drafter)
    r = _inspect(drafter, target)
    assert message in r.output, r.output
    if defect != "last_layer":  # a warning only: the pair still works
        assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_export", *args], capture_output=True, text=True, timeout=300)


def test_missing_config_is_one_line_exit_2(pair):
    drafter, target = pair
    (drafter / "config.json").unlink()
    r = _cli("inspect", str(drafter), "--target", str(target))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert f"{drafter}: not a DFlash drafter checkpoint (no config.json)" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_truncated_safetensors_is_one_line_exit_2(pair):
    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    drafter, target = pair
    f = drafter / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = _cli("inspect", str(drafter), "--target", str(target))
    assert r.returncode == 2 and "truncated safetensors" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(DFlashError, match="model.safetensors.*truncated"):
        load_drafter(drafter)


def test_wrong_tensor_shape_at_load(pair):
    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    drafter, _ = pair
    DEFECTS["wrong_shape"][0](drafter)
    with pytest.raises(DFlashError, match=r"layers.0.self_attn.k_proj.weight: shape \(16, 64\)"):
        load_drafter(drafter)


def _shard(drafter: Path) -> dict:
    """Split the drafter's weights into two shards and an index; returns the index's weight_map."""
    sd = load_file(str(drafter / "model.safetensors"))
    (drafter / "model.safetensors").unlink()
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: sd[n] for n in part}, str(drafter / fname))
        weight_map.update({n: fname for n in part})
    return weight_map


def _write_index(drafter: Path, weight_map: dict) -> Path:
    index = drafter / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", 7])
def test_an_index_never_leads_out_of_the_checkpoint(pair, where):
    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    drafter, target = pair
    outside = drafter.parent / "outside.safetensors"  # a complete, valid file beside the checkpoint
    shutil.copy(drafter / "model.safetensors", outside)
    weight_map = _shard(drafter)
    where = str(outside) if where == "ABSOLUTE" else where
    index = _write_index(drafter, {**weight_map, "fc.weight": where})
    r = _inspect(drafter, target)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"error: {index}: weight_map.fc.weight: " in r.output, r.output
    with pytest.raises(DFlashError, match="weight_map.fc.weight"):
        load_drafter(drafter)


def test_a_tensor_in_two_shards_is_refused_by_inspect_and_load(pair):
    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    drafter, target = pair
    weight_map = _shard(drafter)
    first, second = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == second)
    sd = load_file(str(drafter / first))
    sd[name] = torch.full_like(load_file(str(drafter / second))[name], 7.0)  # a second, different copy
    save_file(sd, str(drafter / first))
    _write_index(drafter, weight_map)
    r = _inspect(drafter, target)
    assert r.exit_code == 2 and f"error: {drafter / first}: {name}: tensor stored in two shards" in r.output, r.output
    with pytest.raises(DFlashError, match="tensor stored in two shards"):
        load_drafter(drafter)
