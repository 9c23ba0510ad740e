"""engines/manifest.py: a built engine's manifest reads back typed and agrees with the checkpoints' own configs; an
engine whose files or fields do not match it is refused, with one line naming manifest.json and the field."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_export.engines.manifest import read_manifest
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError


@pytest.fixture(scope="module")
def built(ort_pair):
    return ort_pair


def _with_manifest(out, tmp_path, edit):
    """A copy of the engine directory `out` whose manifest.json went through `edit` (hashes left as they were)."""
    dst = tmp_path / "eng"
    shutil.copytree(out, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_manifest_reads_back_typed_and_agrees_with_the_checkpoints(built):
    """read_manifest hands loaders typed, read-only fields; each agrees with the checkpoints' own config.json."""
    from dataclasses import FrozenInstanceError

    from dflash_export.engines.manifest import Shapes
    from dflash_export.models.sources import resolve_source

    recipe, out, _, _ = built
    m = read_manifest(out)
    t = json.loads((resolve_source(recipe.target_path) / "config.json").read_text())
    d = json.loads((resolve_source(recipe.drafter_path) / "config.json").read_text())
    t_head = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    assert m.shapes == Shapes(t["num_hidden_layers"], t["num_key_value_heads"], t_head, d["num_hidden_layers"],
                              d["num_key_value_heads"], d["head_dim"])
    assert m.shared_tensors["shared.embed_tokens"].shape == (t["vocab_size"], t["hidden_size"])
    assert m.target_layer_ids == tuple(d["dflash_config"]["target_layer_ids"])
    assert m.mask_token_id == d["dflash_config"]["mask_token_id"] and m.vocab_size == t["vocab_size"]
    assert m.max_seq_len == recipe.max_seq_len and m.selector is None and m.optimized is True
    assert m.path == out / "manifest.json"
    with pytest.raises(FrozenInstanceError):
        m.block_size = 3
    with pytest.raises(TypeError):
        m.files["extra.bin"] = "0" * 64


def test_manifest_disagreeing_with_graphs_is_refused(built, tmp_path):
    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, lambda m: m.update(block_size=m["block_size"] + 1))
    with pytest.raises(DFlashError, match="block_size"):
        load_engine(dst, threads=1)


def test_manifest_vocab_size_disagreeing_with_the_embedding_is_refused(built, tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import main

    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, lambda m: m.update(vocab_size=m["vocab_size"] + 744))
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "hello", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {dst / 'manifest.json'}: vocab_size: manifest says "), r.output


@pytest.mark.parametrize("text, what", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"block_size": ' + "9" * 5000 + "}", "Exceeds the limit"),
])
def test_manifest_too_deep_or_with_a_too_long_integer_is_one_line(built, tmp_path, text, what):
    from click.testing import CliRunner

    from dflash_export.cli import main

    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, lambda m: None)
    (dst / "manifest.json").write_text(text)
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "hello", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {dst / 'manifest.json'}: not valid JSON (") and what in r.output, r.output


def test_modified_engine_file_is_refused(built, tmp_path):
    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, lambda m: None)
    with open(dst / "shared_weights.bin", "r+b") as f:
        f.write(b"\1\2\3\4")
    with pytest.raises(DFlashError, match="shared_weights.bin"):
        load_engine(dst, threads=1)


def test_incomplete_manifest_is_refused_with_the_field(built, tmp_path):
    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, lambda m: m.pop("shapes"))
    with pytest.raises(DFlashError, match="shapes"):
        load_engine(dst, threads=1)


def test_malformed_manifest_field_is_refused_with_the_field(built, tmp_path):
    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, lambda m: m.update(stop_token_ids="eos"))
    with pytest.raises(DFlashError, match="stop_token_ids"):
        load_engine(dst, threads=1)


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.update(files=["target.onnx"]), "files"),
    (lambda m: m.update(manifest_version=99), "manifest_version"),
    (lambda m: m.update(vocab_size=-5), "vocab_size"),
    (lambda m: m.update(block_size="4"), "block_size"),
    (lambda m: m.update(backend="mystery"), "backend"),
    (lambda m: m.update(mask_token_id=10**6), "mask_token_id"),
    (lambda m: m.update(stop_token_ids=[0, 10**6]), "stop_token_ids[1]"),
    (lambda m: m.update(max_draft_len=10**9), "max_draft_len"),
    (lambda m: m["shapes"].update(target_layers=None), "shapes.target_layers"),
    (lambda m: m.update(target_layer_ids=[1, 99]), "target_layer_ids"),
    (lambda m: m["flags"].update(draft_vocab=100000), "flags.draft_vocab"),
    (lambda m: m["flags"].update(row_pad_ops=["Softmax"]), "flags.row_pad_ops"),
    (lambda m: m["flags"].update(row_pad_ops="MatMul"), "flags.row_pad_ops"),
    (lambda m: m.update(shared_tensors=[]), "shared_tensors"),
    (lambda m: m["files"].update({"../../etc/passwd": "0" * 64}), "files"),
    (lambda m: m.pop("engine_format"), "engine_format"),
    (lambda m: m.update(selector="top-4"), "selector"),
    (lambda m: m.update(selector={"top_k": 1, "rank": 8}), "selector.top_k"),
    (lambda m: m.update(precision={"target": 8}), "precision.target"),
    (lambda m: m.update(precision={"target": "int3"}), "precision.target"),
    (lambda m: m["precision"].update(drafter="fp16"), "precision.drafter"),
    (lambda m: m["shared_tensors"]["shared.embed_tokens"].update(offset=None),
     "shared_tensors.shared.embed_tokens.offset"),
    (lambda m: m.update(max_seq_len=10**12), "max_seq_len"),
])
def test_malformed_manifest_is_one_line_naming_manifest_and_field(built, tmp_path, edit, field):
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.manifest import validate_manifest

    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, edit)
    with pytest.raises(DFlashError) as e:
        read_manifest(dst)  # the loader run, validate, bench and deploy all go through
    assert str(e.value).startswith(f"{dst / 'manifest.json'}: {field}"), str(e.value)
    with pytest.raises(DFlashError):
        validate_manifest(json.loads((dst / "manifest.json").read_text()), dst / "manifest.json")
    r = CliRunner().invoke(main, ["run", "--engine", str(dst), "hello", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert "manifest.json" in r.output and field.split(".")[0] in r.output


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(shapes=3), "expected an object, got an integer"),
    (lambda m: m.update(block_size={"n": 4}), "expected an integer, got an object"),
    (lambda m: m.update(files=[]), "got a list"),
])
def test_manifest_errors_name_json_types_in_json_words(built, tmp_path, edit, words):
    """manifest.json is JSON: its errors say "an object" as every other JSON file's do, never YAML's "a mapping"."""
    _, out, _, _ = built
    dst = _with_manifest(out, tmp_path, edit)
    with pytest.raises(DFlashError) as e:
        read_manifest(dst)
    assert words in str(e.value) and "mapping" not in str(e.value), str(e.value)


def _tensorrt_manifest(**plugins):
    base = {"namespace": "dflash", "version": "1", "ops": ["KVInjectedBlockAttention", "FusedVerify"],
            "requested": "aot", "implementation": {"KVInjectedBlockAttention": "aot", "FusedVerify": "aot"}}
    base.update(plugins)
    return {"backend": "tensorrt", "block_size": 4, "mask_token_id": 3, "files": {}, "plugins": base}


def test_tensorrt_manifest_records_the_plugin_path_typed(tmp_path):
    """The path a TensorRT build asked for and the one each plugin op was built with read back as one typed,
    read-only field."""
    from dflash_export.engines.manifest import PluginBuild, validate_manifest

    m = validate_manifest(_tensorrt_manifest(), tmp_path / "manifest.json")
    assert m.plugins == PluginBuild("dflash", "1", "aot", {"KVInjectedBlockAttention": "aot", "FusedVerify": "aot"})
    with pytest.raises(TypeError):
        m.plugins.implementation["FusedVerify"] = "jit"
    jit = validate_manifest(_tensorrt_manifest(requested="jit", implementation={"FusedVerify": "jit"}),
                            tmp_path / "manifest.json")
    assert jit.plugins.requested == "jit" and dict(jit.plugins.implementation) == {"FusedVerify": "jit"}
    assert validate_manifest({k: v for k, v in _tensorrt_manifest().items() if k != "plugins"},
                             tmp_path / "manifest.json").plugins is None


@pytest.mark.parametrize("plugins,field", [
    ({"requested": "python"}, "plugins.requested"),
    ({"requested": None}, "plugins.requested"),
    ({"implementation": {"FusedVerify": "aot (triton ptx)"}}, "plugins.implementation.FusedVerify"),
    ({"requested": "jit"}, "plugins.implementation.KVInjectedBlockAttention"),  # built otherwise than asked
    ({"implementation": ["aot"]}, "plugins.implementation"),
    ({"namespace": ""}, "plugins.namespace"),
])
def test_malformed_plugin_path_is_refused_with_the_field(tmp_path, plugins, field):
    from dflash_export.engines.manifest import validate_manifest

    with pytest.raises(DFlashError) as err:
        validate_manifest(_tensorrt_manifest(**plugins), tmp_path / "manifest.json")
    assert err.value.field == field and "manifest.json" in str(err.value)


def test_a_plugin_record_without_the_requested_path_is_refused(tmp_path):
    from dflash_export.engines.manifest import validate_manifest

    m = _tensorrt_manifest()
    del m["plugins"]["requested"]
    with pytest.raises(DFlashError) as err:
        validate_manifest(m, tmp_path / "manifest.json")
    assert err.value.field == "plugins.requested"


@pytest.mark.parametrize("engines,field", [
    ({"target_verify.engine": "x"}, "engines.target_verify.engine"),
    ({"target_verify.engine": {"profiles": "prefill"}}, "engines.target_verify.engine.profiles"),
    ({"target_verify.engine": {"profiles": [["prefill"]]}}, "engines.target_verify.engine.profiles[0]"),
    ({"drafter.engine": {"profiles": ["first_block", "step", "step"]}}, "engines.drafter.engine.profiles[2]"),
    ({"target_batch.engine": {"profiles": ["batch_prefill"], "max_batch": 4.0}},
     "engines.target_batch.engine.max_batch"),
    ({"lm_head.engine": {"profiles": ["batch"], "max_batch": None}}, "engines.lm_head.engine.max_batch"),
    ({"lm_head.engine": {"profiles": ["batch"], "max_batch": 0}}, "engines.lm_head.engine.max_batch"),
])
def test_malformed_tensorrt_engine_table_is_refused_with_the_field(tmp_path, engines, field):
    """What a TensorRT runner, its batch engines and deploy read of `engines`: each entry a mapping, its profile names
    distinct strings, its batch bound an integer >= 1; anything else one error naming the entry's field."""
    from dflash_export.engines.manifest import validate_manifest

    with pytest.raises(DFlashError) as err:
        validate_manifest({**_tensorrt_manifest(), "engines": engines}, tmp_path / "manifest.json")
    assert err.value.field == field and "manifest.json" in str(err.value)
