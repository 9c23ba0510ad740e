"""`build` reuses unchanged engines, rebuilds changed ones, never leaves a loadable half-build, refuses tampering."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from target_support import assert_as_plain

from dflash_export.engines.build import build_engine
from dflash_export.engines.manifest import read_manifest
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import load_recipe

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


def test_an_engine_of_an_earlier_format_is_rebuilt_not_reused(own_recipe, tmp_path):
    """An engine whose graphs an earlier version of the builder wrote (its manifest's engine_format) is refused by
    the loader, so `build` makes it again even though its inputs are unchanged."""
    import json

    recipe, _ = own_recipe
    d = build_engine(recipe, "onnxruntime", tmp_path / "engines").engine_dir
    m = json.loads((d / "manifest.json").read_text())
    m["engine_format"] -= 1
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlashError, match="engine_format"):
        load_engine(d)
    again = build_engine(recipe, "onnxruntime", tmp_path / "engines")
    assert not again.reused
    load_engine(again.engine_dir)


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


def test_builds_of_one_engine_at_once_take_turns_and_never_mix(tmp_path, monkeypatch):
    """Two builds of one engine directory started together run one after the other: with the same inputs the later
    reuses the earlier's engine; with other inputs the engine left is whole, its manifest naming its own inputs."""
    import json
    import threading
    from types import SimpleNamespace

    import dflash_export.engines.build as build
    from dflash_export.engines.onnxruntime import ENGINE_FORMAT
    from dflash_export.engines.ort_build import graph_precisions
    from dflash_export.files import atomic_dir

    recipes = []
    for i in (1, 2):
        shutil.copytree(resolve_source("tiny:qwen3/drafter"), tmp_path / f"drafter{i}")
        (tmp_path / f"r{i}").mkdir()
        y = tmp_path / f"r{i}" / "mine.yaml"
        y.write_text(f"name: mine\ntarget: tiny:qwen3/target\ndrafter: {tmp_path / f'drafter{i}'}\nmax_seq_len: 256\n"
                     "chat_template: false\n")
        recipes.append(load_recipe(y))
    built = []

    def builder(recipe, engine_dir, **kwargs):  # the slower the first, the later it records its inputs
        first = recipe is recipes[0]
        with atomic_dir(engine_dir) as tmp:
            time.sleep(0.2 if first else 0.6)
            (tmp / "manifest.json").write_text(json.dumps({"tool": "dflash-export", "backend": "onnxruntime",
                                                           "drafter": str(recipe.drafter_path), "first": first}))
        built.append(recipe)

    def manifest(engine_dir):
        m = json.loads((Path(engine_dir) / "manifest.json").read_text())
        return SimpleNamespace(inputs=m.get("inputs"), backend="onnxruntime", engine_format=ENGINE_FORMAT,
                               precision=graph_precisions(recipes[0], None, None, None))

    record = build._record_inputs

    def slow_record(engine_dir, inputs):
        time.sleep(1.0 if json.loads((engine_dir / "manifest.json").read_text())["first"] else 0)
        record(engine_dir, inputs)

    monkeypatch.setattr(build, "backend_builder", lambda backend: builder)
    monkeypatch.setattr(build, "read_manifest", manifest)
    monkeypatch.setattr(build, "_record_inputs", slow_record)

    def at_once(*rs, force=False):
        results = [None] * len(rs)

        def one(i):
            try:
                results[i] = build_engine(rs[i], "onnxruntime", tmp_path / "engines", force=force)
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    results = at_once(recipes[0], recipes[0])
    assert sorted(r.reused for r in results) == [False, True] and len(built) == 1, results
    results = at_once(recipes[0], recipes[1], force=True)
    assert not any(isinstance(r, BaseException) for r in results), results
    engine = tmp_path / "engines" / "mine" / "onnxruntime"
    m = json.loads((engine / "manifest.json").read_text())
    mine = next(r for r in recipes if str(r.drafter_path) == m["drafter"])
    assert m["inputs"] == build.recipe_inputs(mine)
    assert sorted(p.name for p in engine.parent.iterdir()) == ["onnxruntime"]


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


@pytest.mark.parametrize("options, option", [
    ({"precision": "int8"}, "--precision"),
    ({"drafter_precision": "int4"}, "--drafter-precision"),
    ({"quantize_heads": False}, "--fp32-heads"),
])
@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt-llm"])
def test_onnxruntime_weight_options_for_another_backend_name_the_option(own_recipe, tmp_path, backend, options,
                                                                        option):
    """--precision, --drafter-precision and --fp32-heads shape ONNX Runtime graphs; for a backend that builds none
    each is one error naming the option given, before anything is built."""
    recipe, _ = own_recipe
    recipe.backends = ["onnxruntime", "tensorrt", "tensorrt-llm"]
    with pytest.raises(DFlashError) as e:
        build_engine(recipe, backend, tmp_path / "engines", **options)
    assert e.value.field == option and backend in str(e.value)
    assert not (tmp_path / "engines").exists()


def test_a_tensorrt_engine_without_batch_engines_is_rebuilt_not_reused(own_recipe, tmp_path, monkeypatch):
    """TensorRT fixes the continuous-batching bound at build time: a build reuses an earlier engine built for the
    bound asked (any, when none is asked), and rebuilds one built for another bound or without batch engines, the
    directory BatchingRuntime tells to rebuild with `build --backend tensorrt`."""
    import dataclasses
    import json

    from dflash_export.engines import registry
    from dflash_export.engines.tensorrt_batch import BATCH_FILES, DEFAULT_MAX_BATCH

    recipe, _ = own_recipe
    recipe.backends = ["onnxruntime", "tensorrt"]
    built = []

    def fake_build(recipe, engine_dir, max_batch=DEFAULT_MAX_BATCH, batch_engines=True):
        """Writes the manifest facts the batch bound is read from (no TensorRT here)."""
        built.append(max_batch if batch_engines else None)
        shutil.rmtree(engine_dir, ignore_errors=True)
        engine_dir.mkdir(parents=True)
        engines = {name: {"profiles": ["batch_prefill", "batch_step", "batch"], "max_batch": max_batch}
                   for _, _, name in BATCH_FILES.values()} if batch_engines else {}
        (engine_dir / "manifest.json").write_text(json.dumps({
            "backend": "tensorrt", "block_size": 4, "mask_token_id": 3, "files": {}, "engines": engines,
            "shared_tensors": {"shared.embed_tokens": {"offset": 0, "length": 8, "shape": [2, 4]}}}))

    builder = [fake_build]
    monkeypatch.setitem(registry.BACKENDS, "tensorrt",
                        dataclasses.replace(registry.BACKENDS["tensorrt"], builder=lambda: builder[0]))
    out = tmp_path / "engines"
    assert not build_engine(recipe, "tensorrt", out, max_batch=4).reused
    assert build_engine(recipe, "tensorrt", out, max_batch=4).reused
    assert build_engine(recipe, "tensorrt", out).reused
    assert not build_engine(recipe, "tensorrt", out, max_batch=2).reused and built == [4, 2]
    builder[0] = lambda r, d, **kw: fake_build(r, d, batch_engines=False)
    assert not build_engine(recipe, "tensorrt", out, force=True).reused  # an engine predating the batch engines
    builder[0] = fake_build
    assert not build_engine(recipe, "tensorrt", out).reused and built == [4, 2, None, DEFAULT_MAX_BATCH]
    assert build_engine(recipe, "tensorrt", out).reused


def test_a_tensorrt_batch_bound_above_what_deploy_serves_is_refused_before_building(own_recipe, tmp_path,
                                                                                       monkeypatch):
    """`build --max-batch N` sizes batch engines that `deploy --max-batch` and `serve` then fill: both take at most
    the same bound (engines/registry.py MAX_BATCH, 256), so a larger N is refused at build, naming --max-batch, with
    nothing built; the bound itself builds."""
    import dataclasses

    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines import registry

    recipe, _ = own_recipe
    recipe.backends = ["onnxruntime", "tensorrt"]
    built = []

    def fake_build(recipe, engine_dir, max_batch=None):
        built.append(max_batch)
        engine_dir.mkdir(parents=True)

    monkeypatch.setitem(registry.BACKENDS, "tensorrt",
                        dataclasses.replace(registry.BACKENDS["tensorrt"], builder=lambda: fake_build))
    out = tmp_path / "engines"
    with pytest.raises(DFlashError) as e:
        build_engine(recipe, "tensorrt", out, max_batch=257)
    assert (e.value.field, e.value.message) == ("--max-batch", "must be in 1..256, got 257")
    assert built == [] and not out.exists()
    with pytest.raises(DFlashError):
        build_engine(recipe, "tensorrt", out, max_batch=256)  # the fake writes no manifest: built, then refused
    assert built == [256]
    lines = {}
    for args in (["build", "--recipe", "tiny-qwen3", "--backend", "tensorrt", "--out", tmp_path / "cli"],
                 ["deploy", "--engine", tmp_path, "--repo", tmp_path / "repo"]):
        r = CliRunner().invoke(main, [str(a) for a in args] + ["--max-batch", "257"])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        lines[args[0]] = r.output.strip().splitlines()[-1]
    assert lines["build"] == lines["deploy"] == "error: --max-batch: 257 is not in the range 1<=x<=256.", lines
    assert built == [256] and not (tmp_path / "cli").exists()


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


def test_a_head_size_onnx_runtime_attention_cannot_run_is_refused_before_the_export(tmp_path):
    """ONNX Runtime's GroupQueryAttention takes head sizes that are multiples of 16 and says so only when the graph
    first runs: a target with head_dim 8 is one line naming its config and the field, before any export."""
    out = tmp_path / "engines" / "x"
    r = _cli("build", "--target", "tiny:llama-small-vocab/target", "--drafter", "tiny:llama-small-vocab/drafter",
             "--out", str(out))
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    config = resolve_source("tiny:llama-small-vocab/target") / "config.json"
    assert r.output.startswith(f"error: {config}: head_dim: 8, but ") and "multiples of 16" in r.output, r.output
    assert not (tmp_path / "engines").exists()


def test_a_static_index_of_sharegpt_answers_on_a_tokenizer_less_target_names_train_prompts_before_the_export(
        tmp_path, monkeypatch):
    """decoding.static_ngrams indexes the target's answers to the recipe's training prompts; ShareGPT's (the default
    train.prompts) are text, which a tiny random target has no tokenizer for: one line naming the recipe and
    train.prompts, exit 2, before any graph is exported, and no engine directory left."""
    from dflash_export.engines import ort_build

    exported = []
    monkeypatch.setattr(ort_build, "_export_optimized", lambda *a, **k: exported.append(a) or 1 / 0)
    y = tmp_path / "static.yaml"
    y.write_text("name: static\ntarget: tiny:llama/target\ndrafter: tiny:llama/drafter\nmax_seq_len: 256\n"
                 "decoding: {proposer: tree+lookup, static_ngrams: true, static_prompts: 32}\n")
    out = tmp_path / "engines"
    r = _cli("build", "--recipe", str(y), "--out", str(out))
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {y}: train.prompts: ") and "synthetic" in r.output, r.output
    assert not exported and not out.exists()


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


# ---------------------------------------------------------------------------------------------------------------------
# Any pair, any precision on the CPU backend: a bfloat16 recipe whose weights come from the Hugging Face cache

# The keys of the published config.json files of Qwen/Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16, with tiny sizes
# (hidden 64, 6 target layers, vocabulary 256) so that the build runs in seconds; dtype, block size 16, rope base,
# tied-embedding flag and sliding-window keys as published.
STANDIN_TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 250,
    "eos_token_id": 251, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 40960, "max_window_layers": 6, "model_type": "qwen3",
    "num_attention_heads": 4, "num_hidden_layers": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 256,
}
STANDIN_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0, "block_size": 16,
    "bos_token_id": 250, "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 4]}, "dtype": "bfloat16",
    "eos_token_id": 251, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 40960,
    "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_target_layers": 6, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 256,
}


def _write_hf_cache(cache: Path, repo_id: str, src: Path) -> Path:
    """Put the files of `src` into `cache` the way huggingface_hub lays a download out: blobs named by content hash,
    snapshots/<commit>/ of symbolic links to them, refs/main naming the commit. Returns the snapshot."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # an older snapshot that refs/main does not name: never the one taken
    (repo / "snapshots" / ("0" * 40)).mkdir()
    return snap


@pytest.fixture()
def qwen3_8b_standin(tmp_path, monkeypatch):
    """Tiny stand-ins of Qwen/Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16 in a Hugging Face cache the test writes
    (bfloat16 weights, the published config keys); HF_HUB_CACHE points at it, the recipe's variables name the ids."""
    import json

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_export.models.config import DrafterConfig
    from dflash_export.models.drafter import DFlashDrafter, save_drafter

    torch.manual_seed(0)
    keys = {k: v for k, v in STANDIN_TARGET.items() if k not in ("architectures", "torch_dtype",
                                                                 "transformers_version", "model_type")}
    target = Qwen3ForCausalLM(Qwen3Config(**keys)).to(torch.bfloat16)
    tdir = tmp_path / "src" / "target"
    target.save_pretrained(str(tdir), safe_serialization=True)
    (tdir / "config.json").write_text(json.dumps(STANDIN_TARGET, indent=2))
    d = STANDIN_DRAFTER
    drafter = DFlashDrafter(DrafterConfig(
        hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"], intermediate_size=d["intermediate_size"], rms_norm_eps=d["rms_norm_eps"],
        block_size=d["block_size"], mask_token_id=d["dflash_config"]["mask_token_id"],
        target_layer_ids=d["dflash_config"]["target_layer_ids"], num_target_layers=d["num_target_layers"],
        vocab_size=d["vocab_size"], target_hidden_size=d["hidden_size"], rope_theta=float(d["rope_theta"]),
        max_position_embeddings=d["max_position_embeddings"]))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.1)
    ddir = tmp_path / "src" / "drafter"
    save_drafter(drafter.to(torch.bfloat16), ddir)
    (ddir / "config.json").write_text(json.dumps(STANDIN_DRAFTER, indent=2))
    cache = tmp_path / "hf-cache"
    snaps = (_write_hf_cache(cache, "Qwen/Qwen3-8B", tdir), _write_hf_cache(cache, "z-lab/Qwen3-8B-DFlash-b16", ddir))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("QWEN3_8B", "Qwen/Qwen3-8B")
    monkeypatch.setenv("QWEN3_8B_DFLASH", "z-lab/Qwen3-8B-DFlash-b16")
    return snaps


def test_bf16_recipe_builds_int4_on_onnxruntime_from_the_hf_cache(qwen3_8b_standin, tmp_path):
    """`build --recipe qwen3-8b --precision int4`: the recipe asks bfloat16, its variables name Hugging Face ids, the
    weights are in the Hugging Face cache; the engine is built with int4 weights and says so, and it is lossless against
    plain
    decoding on itself."""
    import json

    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.single import DFlashRuntime

    target_snap, drafter_snap = qwen3_8b_standin
    r = _cli("build", "--recipe", "qwen3-8b", "--precision", "int4", "--out", str(tmp_path / "engines"))
    assert r.exit_code == 0, r.output
    edir = tmp_path / "engines" / "qwen3-8b" / "onnxruntime-int4"
    line = r.output.strip().splitlines()[-1]
    assert line.startswith(f"built {edir}") and "int4 weights" in line and "bfloat16" in line, line
    m = json.loads((edir / "manifest.json").read_text())
    assert m["precision"] == {"target": "int4", "drafter": "int4", "lm_head": "int4", "draft_head": "int4"}
    assert m["dtypes"]["checkpoint"] == "bfloat16" and m["dtypes"]["activations"] == "float32"
    assert m["block_size"] == 16 and m["target_layer_ids"] == [1, 4] and m["mask_token_id"] == 255
    assert m["quantization"]["target"]["bits"] == 4
    # the inputs are the snapshots refs/main names (symbolic links into blobs, as huggingface_hub writes them)
    assert any(k.startswith(str(target_snap)) for k in m["inputs"])
    assert any(k.startswith(str(drafter_snap)) for k in m["inputs"])
    engine = load_engine(edir)
    try:
        rt = DFlashRuntime(engine)
        ids = [5, 17, 99, 3, 42, 8]
        sp = SamplingParams(max_new_tokens=24)
        assert_as_plain(engine, ids, rt.generate(ids, sp, "dflash").tokens, rt.generate(ids, sp, "ar").tokens)
    finally:
        engine.close()


def test_pair_from_the_command_line_needs_no_recipe_file(qwen3_8b_standin, tmp_path):
    """--target / --drafter with Hugging Face ids: the same pair builds without any YAML, named after the drafter;
    the engine's target is the cached snapshot's (its logits match transformers' on the same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    target_snap, _ = qwen3_8b_standin
    r = _cli("build", "--target", "Qwen/Qwen3-8B", "--drafter", "z-lab/Qwen3-8B-DFlash-b16", "--out",
             str(tmp_path / "engines"))
    assert r.exit_code == 0, r.output
    edir = tmp_path / "engines" / "qwen3-8b-dflash-b16" / "onnxruntime"
    assert "fp32 weights" in r.output.strip().splitlines()[-1]
    engine = load_engine(edir)
    try:
        ids = [5, 17, 99, 3, 42, 8]
        seq = engine.new_sequence(64)
        logits = engine.prefill(seq, __import__("numpy").asarray(ids, "int64"))
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(str(target_snap), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].numpy()
    assert abs(logits - want).max() < 1e-3


def test_hf_id_missing_from_the_cache_is_one_line_saying_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    r = _cli("build", "--target", "Qwen/Qwen3-8B", "--drafter", "tiny:qwen3/drafter", "--out", str(tmp_path / "e"))
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert "`hf download Qwen/Qwen3-8B`" in r.output and str(tmp_path / "empty-cache") in r.output
    assert not (tmp_path / "e").exists()


def test_every_unset_variable_is_reported_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for var in ("QWEN3_8B", "QWEN3_8B_DFLASH"):
        monkeypatch.delenv(var, raising=False)
    for cmd in (["build"], ["validate"], ["bench"], ["export", "--out", str(tmp_path / "x")], ["reference"]):
        r = _cli(*cmd, "--recipe", "qwen3-8b")
        assert r.exit_code == 2 and r.output.count("\n") == 1, (cmd, r.output)
        assert "QWEN3_8B (target), QWEN3_8B_DFLASH (drafter) are not set" in r.output, r.output
    # one of the two set: only the other is named
    monkeypatch.setenv("QWEN3_8B", str(tmp_path))
    r = _cli("build", "--recipe", "qwen3-8b")
    assert "variable QWEN3_8B_DFLASH (drafter) is not set" in r.output and "QWEN3_8B (" not in r.output, r.output


def test_hf_cache_location_follows_huggingface_hub(tmp_path, monkeypatch):
    from dflash_export.models.sources import hf_cache_dir, resolve_source

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / "hub"
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    snap = _write_hf_cache(tmp_path / "home" / "hub", "org/some-model", src)
    assert resolve_source("org/some-model") == snap
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "home" / "hub"))
    assert resolve_source("org/some-model") == snap
    # a relative path that exists is a path, not an id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "some-model").mkdir(parents=True)
    assert resolve_source("org/some-model") == Path("org/some-model")


def test_quantization_reports_its_progress_node_by_node(tmp_path):
    """The quantizer's per-MatMul progress (done / total and the time left) reaches the build's status line, and its
    own per-node log lines do not reach the terminal."""
    import logging

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from dflash_export.engines import ort_build

    rng = np.random.default_rng(0)
    n, width = 5, 64
    inits = [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{i}") for i in range(n)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}" if i < n - 1 else "y"],
                              name=f"mm{i}") for i in range(n)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])], inits)
    path = tmp_path / "g.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, location="g.onnx.data")
    seen, records = [], []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    root = logging.getLogger()
    catch = Catch(logging.INFO)
    root.addHandler(catch)
    ort_build.report_stages(lambda text, new=True: seen.append((text, new)))
    try:
        info = ort_build.quantize_graph(path, "int4")
    finally:
        ort_build.report_stages(None)
        root.removeHandler(catch)
    assert info["matmuls_quantized"] == info["matmuls_total"] == n
    counts = [t for t, new in seen if not new]
    assert [c.split(": ")[1].split(" MatMuls")[0] for c in counts] == [f"{k}/{n}" for k in range(1, n)]
    assert all("s left" in c for c in counts)
    assert not [r for r in records if "quantize" in r.getMessage()]
