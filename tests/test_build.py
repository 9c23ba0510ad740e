"""`build` reuses unchanged engines, rebuilds changed ones, never leaves a loadable half-build, refuses tampering."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_export.engines.build import build_engine
from dflash_export.engines.manifest import read_manifest
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.recipes import load_recipe
from dflash_export.sources import resolve_source

pytest.importorskip("onnxruntime")


@pytest.fixture()
def own_recipe(tmp_path):
    """A tiny recipe whose drafter lives in tmp_path, so the test can change it."""
    drafter = tmp_path / "drafter"
    shutil.copytree(resolve_source("tiny:qwen3/drafter"), drafter)
    y = tmp_path / "mine.yaml"
    y.write_text("name: mine\ntarget: tiny:qwen3/target\ndrafter: drafter\nmax_seq_len: 256\nchat_template: false\n")
    return load_recipe(y), drafter


def test_rebuild_with_unchanged_inputs_reuses_and_changed_input_rebuilds(own_recipe, tmp_path):
    recipe, drafter = own_recipe
    first = build_engine(recipe, "onnxruntime", tmp_path / "engines")
    assert not first.reused
    m1 = read_manifest(first.engine_dir)
    assert m1.block_size == 4 and m1.mask_token_id == 255 and m1.inputs
    again = build_engine(recipe, "onnxruntime", tmp_path / "engines")
    assert again.reused and again.engine_dir == first.engine_dir
    # change one drafter weight: the hash differs, so the engine is rebuilt
    from safetensors.torch import load_file, save_file

    sd = load_file(str(drafter / "model.safetensors"))
    sd["norm.weight"] = sd["norm.weight"] + 0.5
    save_file(sd, str(drafter / "model.safetensors"))
    third = build_engine(recipe, "onnxruntime", tmp_path / "engines")
    assert not third.reused
    assert read_manifest(third.engine_dir).inputs != m1.inputs


def test_manifest_that_does_not_match_its_files_is_refused(own_recipe, tmp_path):
    recipe, _ = own_recipe
    d = build_engine(recipe, "onnxruntime", tmp_path / "engines").engine_dir
    onnx_file = next(p for p in d.iterdir() if p.suffix in (".data", ".bin"))
    with open(onnx_file, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(DFlashError, match="does not match its manifest hash"):
        load_engine(d)
    # and a rebuild repairs it rather than reusing it
    assert not build_engine(recipe, "onnxruntime", tmp_path / "engines").reused


def test_interrupted_build_leaves_nothing_that_loads(tmp_path):
    out = tmp_path / "engines"
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny-llama.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "build", "--recipe", str(recipe), "--out",
                             str(out), "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    parent = out / "tiny-llama"
    while time.time() < deadline:  # kill as soon as the temporary build directory has content
        tmp = list(parent.glob(".onnxruntime.tmp-*")) if parent.is_dir() else []
        if tmp and any(tmp[0].iterdir()):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (parent / "onnxruntime").exists()
    with pytest.raises(DFlashError, match="not found"):
        load_engine(parent / "onnxruntime")
    for half in parent.glob(".onnxruntime.tmp-*"):
        with pytest.raises(DFlashError, match="no manifest.json"):
            load_engine(half)


def test_backend_without_library_is_one_clear_error(own_recipe, tmp_path):
    recipe, _ = own_recipe
    recipe.backends = ["onnxruntime", "tensorrt"]
    pytest.importorskip("dflash_export.engines.tensorrt")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    with pytest.raises(DFlashError, match="tensorrt"):
        build_engine(recipe, "tensorrt", tmp_path / "engines")


def test_backend_not_in_recipe_is_refused(own_recipe, tmp_path):
    recipe, _ = own_recipe
    with pytest.raises(DFlashError, match="not listed in the recipe's backends"):
        build_engine(recipe, "tensorrt-llm", tmp_path / "engines")


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one line, nothing deleted that build did not write, nothing half-made left behind


def _cli(*args):
    from click.testing import CliRunner

    from dflash_export.cli import main

    return CliRunner().invoke(main, list(args))


def test_build_refuses_to_replace_a_directory_it_did_not_write(own_recipe, tmp_path):
    recipe, _ = own_recipe
    victim = tmp_path / "engines" / "mine" / "onnxruntime"
    victim.mkdir(parents=True)
    (victim / "notes.txt").write_text("mine\n")
    for force in (False, True):
        with pytest.raises(DFlashError, match="was not written by `dflash-export build`") as e:
            build_engine(recipe, "onnxruntime", tmp_path / "engines", force=force)
        assert str(victim) in str(e.value)
    assert (victim / "notes.txt").read_text() == "mine\n" and [p.name for p in victim.iterdir()] == ["notes.txt"]
    # an empty directory holds nothing to lose: it is built into
    (victim / "notes.txt").unlink()
    assert not build_engine(recipe, "onnxruntime", tmp_path / "engines").reused


def test_build_out_that_is_a_file_is_one_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x\n")
    for out in (f, f / "sub"):
        r = _cli("build", "--recipe", "tiny-llama", "--out", str(out))
        assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
        assert str(f) in r.output and "--out" in r.output
    assert f.read_text() == "x\n"


def test_mismatched_pair_names_the_drafter_and_leaves_no_folders(tmp_path):
    y = tmp_path / "mismatched.yaml"
    y.write_text("name: mismatched\ntarget: tiny:qwen3/target\ndrafter: tiny:llama-small-vocab/drafter\n"
                 "max_seq_len: 256\nchat_template: false\n")
    out = tmp_path / "engines"
    with pytest.raises(DFlashError) as e:
        build_engine(load_recipe(y), "onnxruntime", out)
    msg = str(e.value)
    assert str(resolve_source("tiny:llama-small-vocab/drafter")) in msg and "target_hidden_size" in msg
    assert "tmp-" not in msg and "\n" not in msg
    assert not out.exists()  # not even an empty engines/mismatched/


def test_draft_vocab_larger_than_the_vocabulary_is_refused(tmp_path):
    y = tmp_path / "dv.yaml"
    y.write_text("name: dv\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\nmax_seq_len: 256\n"
                 "chat_template: false\ndraft_vocab: 100000\n")
    out = tmp_path / "engines"
    with pytest.raises(DFlashError, match=r"draft_vocab: must be <= the target vocabulary \(256\)") as e:
        build_engine(load_recipe(y), "onnxruntime", out)
    assert str(y) in str(e.value)
    assert not out.exists()


def test_each_precision_builds_its_own_engine_directory(own_recipe, tmp_path):
    """fp32 stays at <recipe>/onnxruntime; a quantized build goes next to it, is reused by its precision, and a
    recipe's `precision` / `drafter_precision` choose the default."""
    recipe, _ = own_recipe
    fp32 = build_engine(recipe, "onnxruntime", tmp_path / "engines")
    int8 = build_engine(recipe, "onnxruntime", tmp_path / "engines", precision="int8")
    assert fp32.engine_dir.name == "onnxruntime" and int8.engine_dir.name == "onnxruntime-int8"
    assert read_manifest(int8.engine_dir).precision["target"] == "int8"
    assert read_manifest(fp32.engine_dir).precision == {k: "fp32" for k in ("target", "drafter", "lm_head",
                                                                              "draft_head")}
    assert build_engine(recipe, "onnxruntime", tmp_path / "engines", precision="int8").reused
    mixed = build_engine(recipe, "onnxruntime", tmp_path / "engines", precision="int4", drafter_precision="fp32")
    assert mixed.engine_dir.name == "onnxruntime-int4-drafter-fp32"
    assert read_manifest(mixed.engine_dir).precision == {"target": "int4", "drafter": "fp32", "lm_head": "int4",
                                                           "draft_head": "fp32"}
    y = recipe.path
    y.write_text(y.read_text() + "precision: int8\n")
    assert build_engine(load_recipe(y), "onnxruntime", tmp_path / "engines").engine_dir == int8.engine_dir


def test_backend_table_agrees_with_the_manifest_and_recipe_contracts():
    """engines/registry.BACKENDS is the one table build, run and deploy read; the manifest check (engines/base) and
    the recipe check (recipes.py) sit below it and keep their own name lists, which must name the same backends."""
    from dflash_export import recipes
    from dflash_export.engines import manifest, registry

    assert tuple(registry.BACKENDS) == manifest.BACKEND_NAMES
    assert registry.BUILDABLE == recipes.BACKENDS
    assert set(registry.OPENERS) == {"onnxruntime", "tensorrt", "pytorch"}  # a TensorRT-LLM bundle is TRT-LLM's
    with pytest.raises(DFlashError, match=r"unknown backend 'pytorch' \(onnxruntime, tensorrt, tensorrt-llm\)"):
        registry.backend_builder("pytorch")  # the reference engine has nothing to build
