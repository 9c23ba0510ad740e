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
    # refused before transformers' config class builds a list of 10**9 layer kinds
    "layers_past_the_limit": (lambda d: _edit_config(d, lambda c: c.__setitem__("num_hidden_layers", 10**9)),
                              "num_hidden_layers: 1000000000 layers: more than the 1024 this project reads"),
    # no tensor's shape checks the context, and RoPE's tables read it (and the scales) as floats
    "context_past_the_limit": (lambda d: _edit_config(d, lambda c: c.__setitem__("max_position_embeddings", 2**40)),
                               "max_position_embeddings: 1099511627776: more than the 16777216 this project reads"),
    "head_dim_past_the_limit": (lambda d: _edit_config(d, lambda c: c.__setitem__("head_dim", 2**40)),
                                "head_dim: 1099511627776: more than the 1048576 this project reads"),
    "scale_past_floats_range": (lambda d: _edit_config(d, lambda c: c.__setitem__("input_embedding_scale", 10**400)),
                                "input_embedding_scale: expected a number a float holds, got 100000000000...000000 "
                                "(401 digits)"),
    "rope_base_past_floats_range": (lambda d: _edit_config(d, lambda c: c.__setitem__("rope_theta", 10**400)),
                                    "rope_theta: expected a positive number (the RoPE base), got "
                                    "100000000000...000000 (401 digits)"),
    "window_past_the_limit": (lambda d: _edit_config(d, lambda c: c.update(
        layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=2**70)),
        "sliding_window: 1180591620717411303424: more than the 16777216 this project reads"),
    "more_taps_than_target_layers": (lambda d: _edit_config(d, lambda c: c["dflash_config"].__setitem__(
        "target_layer_ids", list(range(10**6)))), "target_layer_ids: 1000000 layers tapped, more than "
                                                  "num_target_layers 6"),
}


def test_the_summary_shows_a_long_or_bracketed_path_whole_in_a_narrow_terminal(pair, tmp_path):
    """A value wider than its cell folds onto more lines instead of being cut to "…", and is shown as written, never
    read as rich markup: the drafter's directory, named with brackets and long, reads back whole from the table."""
    _, target = pair
    drafter = tmp_path / ("[red]" + "d" * 60) / "drafter"
    shutil.copytree(resolve_source("tiny:qwen3/drafter"), drafter)
    r = CliRunner(env={"COLUMNS": "60"}).invoke(main, ["inspect", str(drafter), "--target", str(target)])
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    rows = [ln.split("│")[1:3] for ln in r.output.splitlines() if ln.count("│") == 3]  # (key, value) cell lines
    start = next(i for i, (key, _) in enumerate(rows) if key.strip() == "drafter")
    end = next(i for i, (key, _) in enumerate(rows) if i > start and key.strip())
    assert "".join(value.strip() for _, value in rows[start:end]) == str(drafter), r.output


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


def test_taps_outside_the_target_are_one_finding(pair):
    drafter, target = pair
    _edit_config(drafter, lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, 9, 10, 11]))
    r = _inspect(drafter, target)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    outside = [ln for ln in r.output.splitlines() if "outside the target's" in ln]
    assert outside == [f"error: {drafter / 'config.json'}: dflash_config.target_layer_ids: layer 9 outside the "
                       "target's 0..5 (3 such layers)"], r.output


def test_thousands_of_unexpected_tensors_are_counted_not_listed(pair):
    from dflash_export.models.checkpoint import MAX_MISSING_LISTED

    drafter, target = pair
    _edit_weights(drafter, lambda sd: sd.update({f"extra.{i}": torch.zeros(1) for i in range(3000)}))
    r = _inspect(drafter, target)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    named = [ln for ln in r.output.splitlines() if ": unexpected tensor" in ln]
    assert len(named) == MAX_MISSING_LISTED, r.output
    assert f"error: {drafter}: weights: {3000 - MAX_MISSING_LISTED} more unexpected tensors (3000 in all)" in r.output


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


def _config_error(drafter, target, field):
    """`inspect` and the loader both refuse the drafter with one line naming its config.json and `field`."""
    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    r = _inspect(drafter, target)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(errors) == 1 and errors[0].startswith(f"error: {drafter / 'config.json'}: {field}: "), r.output
    with pytest.raises(DFlashError) as e:
        load_drafter(drafter)
    assert e.value.field == field and e.value.path == drafter / "config.json", e.value
    return errors[0]


def _set_block(cfg, block, max_positions):
    cfg["block_size"] = cfg["dflash_config"]["block_size"] = block
    cfg["max_position_embeddings"] = max_positions


@pytest.mark.parametrize("block, max_positions", [(63, 64), (64, 64), (10**9, 1024)])
def test_a_block_fits_the_drafters_positions(pair, block, max_positions):
    # A block drafts positions n .. n + block_size - 1 after n >= 1 context tokens, all below max_position_embeddings.
    drafter, target = pair
    _edit_config(drafter, lambda c: _set_block(c, block, max_positions))
    if block < max_positions:
        r = _inspect(drafter, target)
        assert r.exit_code == 0 and "OK" in r.output, r.output
    else:
        line = _config_error(drafter, target, "dflash_config.block_size")
        assert f"a block of {block} positions" in line and f"max_position_embeddings {max_positions}" in line


def test_a_block_size_that_is_not_an_integer_is_refused(pair):
    drafter, target = pair
    _edit_config(drafter, lambda c: _set_block(c, 1e9, 2**24))
    assert "must be an integer >= 2, got 1000000000.0" in _config_error(drafter, target, "dflash_config.block_size")


@pytest.mark.parametrize("block", [2**20 - 1, 2**20])
def test_a_drafter_block_is_refused_exactly_when_no_recipe_could_hold_it(pair, tmp_path, block):
    drafter, target = pair
    recipe = tmp_path / "r.yaml"
    # The longest max_seq_len a recipe takes, found by asking the recipe loader.
    longest = next(n for n in (2**20, 2**20 + 1) if not _loads(recipe, f"max_seq_len: {n + 1}\n"))
    fits = _loads(recipe, f"max_seq_len: {longest}\nblock_size: {block}\n")
    _edit_config(drafter, lambda c: _set_block(c, block, 2**24))
    if fits:
        assert _inspect(drafter, target).exit_code == 0
    else:
        assert "longest sequence" in _config_error(drafter, target, "dflash_config.block_size")


def _loads(recipe: Path, extra: str) -> bool:
    from dflash_export.errors import DFlashError
    from dflash_export.recipes import load_recipe

    recipe.write_text("name: r\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n" + extra)
    try:
        load_recipe(str(recipe))
    except DFlashError:
        return False
    return True


@pytest.mark.parametrize("field, value", [
    ("max_position_embeddings", 0), ("max_position_embeddings", -5), ("max_position_embeddings", True),
    ("num_key_value_heads", 0), ("num_key_value_heads", 3), ("head_dim", -16), ("head_dim", True), ("head_dim", 15),
    ("intermediate_size", 0), ("vocab_size", -1), ("target_hidden_size", 0), ("target_hidden_size", "64"),
    ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6),
])
def test_a_drafter_size_that_is_not_a_positive_integer_its_attention_can_use_is_refused(pair, field, value):
    # Sizes and counts are integers >= 1 (a bool is not one); K/V heads are shared by whole groups of query heads and
    # RoPE rotates the two halves of a head, so num_key_value_heads divides num_attention_heads and head_dim is even.
    # rms_norm_eps is added under a square root (> 0).
    drafter, target = pair
    _edit_config(drafter, lambda c: c.__setitem__(field, value))
    _config_error(drafter, target, field)


@pytest.mark.parametrize("value", ["false", 0])
def test_attention_bias_is_json_true_or_false(pair, value):
    # "false" is truthy in Python: read as a bias it would load bias tensors the checkpoint may not hold, or ignore
    # those it does. inspect and the loader refuse it with one line naming the field.
    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    drafter, target = pair
    _edit_config(drafter, lambda c: c.__setitem__("attention_bias", value))
    r = _inspect(drafter, target)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "attention_bias" in errors[0], r.output
    with pytest.raises(DFlashError) as e:
        load_drafter(drafter)
    assert "attention_bias" in str(e.value) and e.value.path == drafter / "config.json", e.value


@pytest.mark.parametrize("key, value", [("torch_dtype", "nonsense"), ("dtype", "int8"), ("torch_dtype", 5),
                                        ("dtype", "torch.float16")])
def test_a_drafter_dtype_transformers_cannot_load_as_floats_is_refused(pair, key, value):
    from transformers import Qwen3Config

    try:  # transformers itself: an error, or something that is not a floating-point torch dtype
        declared = Qwen3Config.from_dict({key: value}).dtype
    except Exception:
        declared = None
    assert not (isinstance(declared, torch.dtype) and declared.is_floating_point)
    drafter, target = pair
    _edit_config(drafter, lambda c: (c.pop("torch_dtype", None), c.__setitem__(key, value)))
    _config_error(drafter, target, key)


def test_dtype_and_torch_dtype_are_read_as_transformers_reads_them(pair):
    from transformers import Qwen3Config

    from dflash_export.models.checkpoint import load_drafter

    drafter, _ = pair
    keys = {"dtype": "float16", "torch_dtype": "bfloat16"}
    _edit_config(drafter, lambda c: c.update(keys))
    want = str(Qwen3Config.from_dict(keys).dtype).removeprefix("torch.")
    assert want == "float16"
    assert load_drafter(drafter).config.torch_dtype == want


@pytest.mark.parametrize("heads, kv", [(32, ...), (8, None), (4, ...)])
def test_absent_attention_sizes_take_the_defaults_of_the_config_class_zlab_builds_the_drafter_from(pair, heads, kv):
    # z-lab's release builds its drafter from transformers' Qwen3Config: an absent head_dim is 128 (not hidden_size /
    # num_attention_heads), an absent num_key_value_heads 32, a null one the query heads.
    from transformers import Qwen3Config

    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import parse_drafter_config

    drafter, _ = pair
    cfg = json.loads((drafter / "config.json").read_text())
    cfg.pop("head_dim")
    cfg["num_attention_heads"] = heads
    if kv is ...:
        cfg.pop("num_key_value_heads")
    else:
        cfg["num_key_value_heads"] = kv
    zlab = Qwen3Config.from_dict({k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    if heads % zlab.num_key_value_heads:
        with pytest.raises(DFlashError) as e:
            parse_drafter_config(cfg, drafter / "config.json")
        assert e.value.field == "num_key_value_heads" and "Qwen3Config's default" in str(e.value)
        return
    c = parse_drafter_config(cfg, drafter / "config.json")
    assert (c.head_dim, c.num_key_value_heads) == (zlab.head_dim, zlab.num_key_value_heads)
    assert c.head_dim == 128 != c.hidden_size // heads


@pytest.mark.parametrize("edit", [lambda c: c.pop("vocab_size"), lambda c: c.__setitem__("vocab_size", 7)])
def test_a_plain_drafters_own_vocab_size_is_read_nowhere(pair, tmp_path, edit):
    # The drafter embeds and reads out through the target's tables; z-lab's model reads vocab_size only for DFlash-2's
    # codebooks. Absent or another value: inspect passes (a warning at most) and drafting is token for token what the
    # unedited drafter drafts.
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.drafter import check_drafter_fits
    from dflash_export.models.target import load_target
    from dflash_export.runtime.reference import spec_generate

    drafter, target_dir = pair
    edited = tmp_path / "edited"
    shutil.copytree(drafter, edited)
    _edit_config(edited, edit)
    r = _inspect(edited, target_dir)
    assert r.exit_code == 0 and "error:" not in r.output, r.output
    target = load_target(target_dir)
    runs = []
    for d in (drafter, edited):
        loaded = load_drafter(d)
        check_drafter_fits(loaded, target, str(d))
        runs.append(spec_generate(loaded, target, [3, 5, 7, 11], max_new_tokens=24).tokens)
    assert runs[0] == runs[1]
