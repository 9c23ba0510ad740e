"""`deploy` writes a checked Triton repository: the rendered config.pbtxt, the copied engine, the recorded limits, and a
one-line error for every bad engine, manifest or output path, with nothing left half-written. No server is started."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_support import (
    ROOT,
    assert_one_line,
    cli,
    copy_engine,
    drop_input,
    edit_manifest,
    engine_dir,  # noqa: F401 - a fixture
    make_torch_engine_dir,
    ort_engine,
    rehash,
    small_repo,  # noqa: F401 - a fixture
)

from dflash_export.deploy.pbtxt import ModelConfig, check_config_text, render_config
from dflash_export.deploy.repository import INPUTS, MARKER, OUTPUTS, write_repository
from dflash_export.errors import DFlashError


def test_rendered_config_parses_back_with_every_tensor():
    text = render_config(ModelConfig("dflash", INPUTS, OUTPUTS, instances=3, decoupled=True, max_queue_size=7,
                                     parameters={"engine_dir": "../x \"y\"/é"}))
    cfg = check_config_text(text, expect_name="dflash")
    assert [t["name"] for t in cfg["input"]] == [t.name for t in INPUTS]
    assert [t["data_type"] for t in cfg["output"]] == [t.data_type for t in OUTPUTS]
    assert all(t["optional"] is True for t in cfg["input"])  # generate works with text_input alone
    assert cfg["instance_group"][0]["count"] == 3
    assert cfg["model_transaction_policy"]["decoupled"] is True
    assert cfg["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 7
    assert cfg["parameters"]["value"]["string_value"] == "../x \"y\"/é"


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.replace('name: "dflash"', 'name: "9bad name"'), "name"),
    (lambda t: t.replace("TYPE_INT64", "TYPE_INT65", 1), "max_tokens.data_type"),
    (lambda t: t.replace("dims: [ 1 ]", "dims: [ 0 ]", 1), "text_input.dims"),
    (lambda t: t.replace("dims: [ 1 ]", "dims: [ ]", 1), "text_input.dims"),
    (lambda t: t.replace('name: "messages"', 'name: "text_input"'), "name"),
    (lambda t: t.replace('name: "text_output"', 'name: "text output"'), "name"),
    (lambda t: t.replace("data_type: TYPE_STRING\n    dims: [ 1 ]\n  }\n]",
                         "data_type: TYPE_STRING\n    dims: [ 1 ]\n    optional: true\n  }\n]"), "optional"),
    (lambda t: t.replace("count: 1", "count: 0"), "instance_group.count"),
    (lambda t: t.replace("max_queue_size: 64", "max_queue_size: -1"), "max_queue_size"),
    (lambda t: t.replace("input [", "input [ {", 1), "config.pbtxt"),
    # shapes the parser reads but the checks did not expect: a repeated field is a list, a message may be a scalar
    (lambda t: t.replace("data_type: TYPE_INT64", "data_type: TYPE_INT64\n    data_type: TYPE_INT32", 1),
     "max_tokens.data_type"),
    (lambda t: t.replace("instance_group [", "instance_group [ 5,"), "instance_group"),
    (lambda t: t.replace("default_queue_policy {\n    max_queue_size: 64\n  }", "default_queue_policy: 5"),
     "dynamic_batching.default_queue_policy"),
])
def test_config_checker_rejects_bad_config_naming_the_field(edit, field):
    good = render_config(ModelConfig("dflash", INPUTS, OUTPUTS, max_queue_size=64))
    check_config_text(good, expect_name="dflash")
    with pytest.raises(DFlashError) as e:
        check_config_text(edit(good), "repo/dflash/config.pbtxt", expect_name="dflash")
    assert field in str(e.value) and "repo/dflash/config.pbtxt" in str(e.value)


def test_config_checker_wants_the_directory_name():
    with pytest.raises(DFlashError, match="directory name"):
        check_config_text(render_config(ModelConfig("other", INPUTS, OUTPUTS)), expect_name="dflash")


def test_write_repository_layout_and_redeploy(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo", instances=3, max_queue_size=5)
    marker = json.loads((repo / MARKER).read_text())
    assert marker["models"] == ["dflash", "dflash_stream"]
    for name, decoupled in (("dflash", False), ("dflash_stream", True)):
        cfg = check_config_text((repo / name / "config.pbtxt").read_text(), expect_name=name)
        assert cfg["model_transaction_policy"]["decoupled"] is decoupled
        assert cfg["instance_group"][0]["count"] == 3
        assert cfg["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 5
        params = {p["key"]: p["value"]["string_value"] for p in cfg["parameters"]}
        assert (repo / name / params["engine_dir"] / "manifest.json").is_file()  # relative: the repo can move
        # Relocatable: no path of the deploying machine anywhere in the config (the stub's paths come from `serve`).
        text = (repo / name / "config.pbtxt").read_text()
        assert "sys_path" not in params and str(ROOT) not in text and str(tmp_path) not in text
        assert (repo / name / "1" / "model.py").read_text().startswith('"""Triton python-backend model')
    assert (repo / "dflash" / "engine" / "manifest.json").read_bytes() == (engine / "manifest.json").read_bytes()
    # Deploying again replaces the earlier repository; a foreign directory is never overwritten.
    write_repository(engine, repo, instances=1, decoupled=False)
    assert json.loads((repo / MARKER).read_text())["models"] == ["dflash"]
    assert not (repo / "dflash_stream").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(DFlashError, match="not written by"):
        write_repository(engine, foreign)
    assert (foreign / "keep.txt").is_file()
    with pytest.raises(DFlashError, match="--instances"):
        write_repository(engine, tmp_path / "r2", instances=0)


def test_deploy_cli_writes_repository_and_bad_engine_is_one_line_error(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "engine")
    r = subprocess.run([sys.executable, "-m", "dflash_export", "deploy", "--engine", str(engine), "--repo",
                        str(tmp_path / "ok"), "--instances", "2", "--max-queue-size", "9", "--no-stream"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "dflash-export serve --repo" in r.stdout
    cfg = check_config_text((tmp_path / "ok" / "dflash" / "config.pbtxt").read_text(), expect_name="dflash")
    assert cfg["instance_group"][0]["count"] == 2 and not (tmp_path / "ok" / "dflash_stream").exists()
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "dflash_export", "deploy", "--engine", str(tmp_path / "empty"),
                        "--repo", str(tmp_path / "repo")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "manifest.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "repo").exists()


def test_llmapi_repository_for_a_tensorrt_llm_bundle(tmp_path):
    from dflash_export.engines.tensorrt_llm import write_trtllm_bundle
    from dflash_export.recipes import load_recipe

    bundle = write_trtllm_bundle(load_recipe("tiny-qwen3"), tmp_path / "bundle")
    repo = write_repository(bundle, tmp_path / "repo")
    model = repo / "tensorrt_llm"
    cfg = check_config_text((model / "config.pbtxt").read_text(), expect_name="tensorrt_llm")
    assert cfg["backend"] == "python"
    # Batching, decoupling and instances are model.yaml's triton_config to set, so config.pbtxt leaves them out.
    assert "max_batch_size" not in cfg and "model_transaction_policy" not in cfg and "instance_group" not in cfg
    assert {t["name"] for t in cfg["input"]} >= {"text_input", "sampling_param_max_tokens", "streaming"}
    assert {t["name"] for t in cfg["output"]} >= {"text_output", "total_accepted_draft_tokens"}
    yaml_src = bundle / "triton" / "tensorrt_llm" / "1" / "model.yaml"
    assert (model / "1" / "model.yaml").read_bytes() == yaml_src.read_bytes()
    assert "decoding_type: DFlash" in (model / "1" / "model.yaml").read_text()
    assert "model.py" in (model / "README.txt").read_text()
    fake_py = tmp_path / "llmapi" / "model.py"
    fake_py.parent.mkdir()
    fake_py.write_text("# TensorRT-LLM's llmapi model.py would be here\n")
    write_repository(bundle, repo, llmapi_model_py=fake_py)
    assert (model / "1" / "model.py").read_text() == fake_py.read_text()


def _bundle_over_a_target_with_a_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """A TensorRT-LLM bundle (its directory holds no tokenizer) over a copy of the tiny Qwen3 target given a
    tokenizer.json and tokenizer_config.json: the tokenizer TensorRT-LLM serves (model.yaml's `model`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash_export.engines.tensorrt_llm import write_trtllm_bundle
    from dflash_export.models.sources import resolve_source
    from dflash_export.recipes import load_recipe

    target = tmp_path / "target"
    shutil.copytree(resolve_source("tiny:qwen3/target"), target)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: tok-trtllm\ntarget: {target}\ndrafter: tiny:qwen3/drafter\ndtype: float32\n"
                      "max_seq_len: 512\nbackends: [tensorrt-llm]\n")
    bundle = write_trtllm_bundle(load_recipe(recipe), tmp_path / "bundle")
    assert not any((bundle / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "codec.json"))
    return bundle, target


@pytest.mark.parametrize("template", [
    "{{ messages[0].content }}",
    [{"name": "default", "template": "{{ messages[0].content }}"}, {"name": "tool_use", "template": "x"}],
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
])
def test_a_tensorrt_llm_bundle_deploys_with_what_transformers_serves(tmp_path, template):
    """What TensorRT-LLM's tokenizer (transformers) takes deploys: a string template, a list of named templates, its
    `{% generation %}` tag."""
    bundle, target = _bundle_over_a_target_with_a_tokenizer(tmp_path)
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]", "chat_template": template}))
    r = cli("deploy", "--engine", bundle, "--repo", tmp_path / "repo")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").is_file()


@pytest.mark.parametrize("text, field", [
    ('{"eos_token": 5}', "eos_token"),
    ('{"bos_token": {"content": 1}}', "bos_token"),
    ('{"chat_template": 5}', "chat_template"),
    ('{"chat_template": ["one"]}', "chat_template[0]"),
    ('{"chat_template": [{"name": "default"}]}', "chat_template[0]"),
    ('{"chat_template": "x", ', None),
    ("[1]", None),
])
def test_a_tensorrt_llm_bundle_whose_served_tokenizer_config_is_malformed_is_refused(tmp_path, text, field):
    """The served target's tokenizer_config.json, malformed where transformers would fail to load or render it: one
    line naming the file (and field) from `deploy`, and nothing written; a build over it is refused the same way."""
    from dflash_export.engines.tensorrt_llm import write_trtllm_bundle
    from dflash_export.recipes import load_recipe

    bundle, target = _bundle_over_a_target_with_a_tokenizer(tmp_path)
    (target / "tokenizer_config.json").write_text(text)
    named = f"{target / 'tokenizer_config.json'}: {field + ': ' if field else ''}"
    r = cli("deploy", "--engine", bundle, "--repo", tmp_path / "repo")
    assert_one_line(r, named)
    assert not (tmp_path / "repo").exists()
    with pytest.raises(DFlashError) as e:
        write_trtllm_bundle(load_recipe(tmp_path / "recipe.yaml"), tmp_path / "bundle2")
    assert str(e.value).startswith(named) and not (tmp_path / "bundle2").exists(), str(e.value)


@pytest.mark.parametrize("fields, field", [
    ({"backend": "cuda"}, "backend"),
    ({"block_size": "four"}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"mask_token_id": -1}, "mask_token_id"),
    ({"mask_token_id": ...}, "mask_token_id"),
    ({"files": ["a"]}, "files"),
    ({"files": {"../../etc/passwd": "0" * 64}}, "files"),
    ({"recipe_path": "/nonexistent/recipe.yaml"}, "recipe_path"),
])
def test_deploy_validates_the_manifest_like_run(tmp_path, fields, field):
    engine = edit_manifest(make_torch_engine_dir(tmp_path / "engine"), **fields)
    with pytest.raises(DFlashError) as e:
        write_repository(engine, tmp_path / "repo")
    assert f"manifest.json: {field}" in str(e.value), str(e.value)
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("fields, field", [
    ({"engine_format": 1}, "engine_format"),
    ({"shapes": {"target_layers": 2}}, "shapes"),
    ({"vocab_size": "256"}, "vocab_size"),
    ({"stop_token_ids": "254"}, "stop_token_ids"),
    ({"max_seq_len": ...}, "max_seq_len"),
])
def test_deploy_validates_onnxruntime_manifest_fields(tmp_path, engine_dir, fields, field):
    if json.loads((engine_dir / "manifest.json").read_text())["backend"] != "onnxruntime":
        pytest.skip("no ONNX Runtime engine in this environment")
    engine = edit_manifest(copy_engine(engine_dir, tmp_path / "engine"), **fields)
    with pytest.raises(DFlashError) as e:
        write_repository(engine, tmp_path / "repo")
    assert f"manifest.json: {field}" in str(e.value), str(e.value)
    assert not (tmp_path / "repo").exists()


def test_deploy_cli_refuses_a_manifest_run_refuses(tmp_path):
    engine = edit_manifest(make_torch_engine_dir(tmp_path / "engine"), backend="cuda")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo")
    assert_one_line(r, f"{engine}/manifest.json: backend: unknown backend 'cuda'")
    edit_manifest(engine, backend="pytorch", block_size="four")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo")
    assert_one_line(r, "manifest.json: block_size:")
    assert not (tmp_path / "repo").exists()


def test_llmapi_model_py_only_for_tensorrt_llm_and_must_exist(tmp_path):
    from dflash_export.engines.tensorrt_llm import write_trtllm_bundle
    from dflash_export.recipes import load_recipe

    model_py = tmp_path / "model.py"
    model_py.write_text("# llmapi model\n")
    engine = make_torch_engine_dir(tmp_path / "engine")
    with pytest.raises(DFlashError, match="--llmapi-model-py: only used with a TensorRT-LLM bundle"):
        write_repository(engine, tmp_path / "repo", llmapi_model_py=model_py)
    bundle = write_trtllm_bundle(load_recipe("tiny-qwen3"), tmp_path / "bundle")
    for bad, msg in ((tmp_path / "missing.py", "file not found"), (tmp_path, "not a file"), ("", "empty path")):
        with pytest.raises(DFlashError, match=f"--llmapi-model-py: {msg}"):
            write_repository(bundle, tmp_path / "repo", llmapi_model_py=bad)
    assert not (tmp_path / "repo").exists()
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo", "--llmapi-model-py", model_py)
    assert_one_line(r, f"{model_py}: --llmapi-model-py:")
    assert not (tmp_path / "repo").exists()


def test_deploy_never_replaces_the_current_directory_or_its_parents(tmp_path, monkeypatch):
    engine = make_torch_engine_dir(tmp_path / "engine")
    # The worst case: the current directory is an earlier deploy, which deploy would otherwise replace.
    here = write_repository(engine, tmp_path / "work" / "repo")
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    for repo in ("", "  ", ".", "..", str(here), str(tmp_path)):
        with pytest.raises(DFlashError, match="--repo") as e:
            write_repository(engine, repo)
        assert "\n" not in str(e.value)
    assert (here / "notes.txt").read_text() == "mine" and Path.cwd() == here
    r = cli("deploy", "--engine", engine, "--repo", "", cwd=here)
    assert_one_line(r, "--repo: empty path")
    r = cli("deploy", "--engine", engine, "--repo", ".", cwd=here)
    assert_one_line(r, "--repo: is the current directory")
    assert (here / "notes.txt").read_text() == "mine"


def test_deploy_refuses_repo_inside_or_around_the_engine(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "a" / "engine")
    with pytest.raises(DFlashError, match="inside the engine directory"):
        write_repository(engine, engine / "repo")
    with pytest.raises(DFlashError, match="contains the engine directory"):
        write_repository(engine, tmp_path / "a")
    assert sorted(p.name for p in engine.iterdir()) == ["manifest.json"]


def test_deploy_repo_under_a_file_or_unwritable_is_one_line_up_front(tmp_path):
    engine = make_torch_engine_dir(tmp_path / "engine")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DFlashError, match="afile is a file, not a directory"):
        write_repository(engine, tmp_path / "afile" / "sub" / "repo")
    with pytest.raises(DFlashError, match="--repo: exists and is not a directory"):
        write_repository(engine, tmp_path / "afile")
    # /proc refuses new directories even to root (for whom permission bits do not count): tried before any work.
    with pytest.raises(DFlashError, match="--repo: cannot create it: creating anything in /proc fails"):
        write_repository(engine, "/proc/dflash-nope/repo")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "afile" / "repo")
    assert_one_line(r, "--repo: cannot create it:")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(DFlashError, match="is not writable"):
            write_repository(engine, ro / "repo")
        assert list(ro.iterdir()) == []


def test_deploy_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    from dflash_export.deploy import repository

    engine = make_torch_engine_dir(tmp_path / "engine")

    def fail(engine_dir, repo, *a, **k):
        (repo / "dflash").mkdir()
        raise OSError(28, "No space left on device", str(repo / "dflash" / "config.pbtxt"))

    monkeypatch.setattr(repository, "_write_python_models", fail)
    with pytest.raises(DFlashError, match="--repo: cannot write the repository .No space left"):
        write_repository(engine, tmp_path / "new" / "deeper" / "repo")
    assert not (tmp_path / "new").exists()


def test_check_repository_accepts_a_deploy_and_names_what_is_wrong(tmp_path, small_repo):
    from dflash_export.deploy.repository import check_repository

    assert check_repository(small_repo)["models"] == ["dflash"]
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "empty", "not a model repository written by `dflash-export deploy`"),
             (tmp_path / "nope", "model repository not found"),
             (tmp_path / "engine" / "manifest.json", "--repo: not a directory")]
    for repo, msg in cases:
        with pytest.raises(DFlashError, match=msg):
            check_repository(repo)

    def broken(edit):

        repo = tmp_path / f"broken{len(list(tmp_path.glob('broken*')))}"
        shutil.copytree(small_repo, repo)
        edit(repo)
        with pytest.raises(DFlashError) as e:
            check_repository(repo)
        return str(e.value)

    assert "extra: not one of the deployed models" in broken(lambda r: (r / "extra").mkdir())
    assert "dflash_repository.json: models" in broken(lambda r: (r / MARKER).write_text('{"models": []}'))
    assert "config.pbtxt: missing" in broken(lambda r: (r / "dflash" / "config.pbtxt").unlink())
    assert "model.py: missing" in broken(lambda r: (r / "dflash" / "1" / "model.py").unlink())
    msg = broken(lambda r: (r / "dflash" / "config.pbtxt").write_text(
        (r / "dflash" / "config.pbtxt").read_text().replace("TYPE_INT64", "TYPE_INT65", 1)))
    assert "config.pbtxt: input max_tokens.data_type" in msg

    def tamper(r):
        m = r / "dflash" / "engine" / "manifest.json"
        text = m.read_text().replace('"block_size": 4', '"block_size": "four"')
        m.unlink()
        m.write_text(text)

    assert "engine/manifest.json: block_size" in broken(tamper)

    def other_versions(r):
        cfg = r / "dflash" / "config.pbtxt"
        text = cfg.read_text()
        assert "tokenizers" in text
        cfg.write_text(re.sub(r'(\\"tokenizers\\": \\")[^\\\\]+', r"\g<1>0.0.1", text))

    assert "parameters.library_versions: deployed with tokenizers 0.0.1" in broken(other_versions)


def test_a_file_dropped_from_the_manifest_is_refused_not_trusted(tmp_path, engine_dir):
    engine = ort_engine(engine_dir, tmp_path / "engine")
    files = json.loads((engine / "manifest.json").read_text())["files"]
    data = next(rel for rel in files if rel.startswith("target") and rel.endswith(".data"))
    edit_manifest(engine, files={k: v for k, v in files.items() if k != data})
    (engine / data).write_bytes(b"\0" * (engine / data).stat().st_size)
    r = cli("run", "--engine", engine, "--max-new-tokens", "4", "hello")
    assert_one_line(r, f"{engine / data}: files: not listed in the manifest")
    with pytest.raises(DFlashError, match="not listed in the manifest"):
        write_repository(engine, tmp_path / "repo")
    # An extra file next to the graphs (whatever its name) is refused the same way; so is a listed one removed.
    (engine / data).unlink()
    edit_manifest(engine, files=files)
    assert_one_line(cli("run", "--engine", engine, "hello"), f"{engine / data}: files: file listed in the manifest "
                                                              "is missing")


def test_a_fifo_in_the_engine_is_refused_by_deploy_and_serve_without_waiting_on_it(tmp_path, small_repo):
    """A FIFO no process writes: copying or hashing it would wait forever; deploy and serve name it at once."""
    import socket

    engine = make_torch_engine_dir(tmp_path / "fifo-engine")
    os.mkfifo(engine / "fifo")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "fifo-repo", timeout=60)
    assert_one_line(r, f"{engine / 'fifo'}: files: not a regular file or directory")
    assert [p.name for p in tmp_path.iterdir() if "fifo-repo" in p.name] == []  # nor a temp directory
    os.mkfifo(small_repo / "dflash" / "engine" / "fifo")
    with socket.socket() as held:  # were the repository let through, serve would stop at this busy port
        held.bind(("127.0.0.1", 0))
        held.listen()
        r = cli("serve", "--repo", small_repo, "--port", held.getsockname()[1], timeout=60)
    assert_one_line(r, f"{small_repo / 'dflash' / 'engine' / 'fifo'}: files: not a regular file or directory")


def test_edited_shapes_and_swapped_graphs_are_named_errors(tmp_path, engine_dir):
    engine = ort_engine(engine_dir, tmp_path / "engine")
    shapes = json.loads((engine / "manifest.json").read_text())["shapes"]
    edit_manifest(engine, shapes={**shapes, "target_kv_heads": shapes["target_kv_heads"] + 1})
    assert_one_line(cli("run", "--engine", engine, "--max-new-tokens", "4", "hello"),
                    "manifest.json: shapes.target_kv_heads: manifest says")
    edit_manifest(engine, shapes={**shapes, "drafter_layers": shapes["drafter_layers"] + 1})
    assert_one_line(cli("run", "--engine", engine, "--max-new-tokens", "4", "hello"),
                    "manifest.json: shapes.drafter_layers: manifest says")
    edit_manifest(engine, shapes=shapes)
    # Swap the drafter and the LM head (and their external data), hashes recomputed.
    for a, b in (("drafter.onnx", "lm_head.onnx"),):
        (engine / a).rename(engine / "swap")
        (engine / b).rename(engine / a)
        (engine / "swap").rename(engine / b)
    rehash(engine)
    r = cli("run", "--engine", engine, "--max-new-tokens", "4", "hello")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert "graphs swapped or replaced" in r.stderr or "cannot load the graph" in r.stderr, r.stderr


def test_deploy_copies_engine_files_never_hard_links(tmp_path, engine_dir):
    engine = copy_engine(engine_dir, tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo", decoupled=False)
    for f in engine.iterdir():
        served = repo / "dflash" / "engine" / f.name
        assert served.stat().st_ino != f.stat().st_ino and served.stat().st_nlink == 1, f
    victim = next(f for f in engine.iterdir() if f.name != "manifest.json")
    before = (repo / "dflash" / "engine" / victim.name).read_bytes()
    with open(victim, "r+b") as fh:  # edit in place, as an editor or a rebuild writing into the file would
        fh.write(b"\x00\x01\x02")
    assert (repo / "dflash" / "engine" / victim.name).read_bytes() == before


def test_deploy_records_the_request_limits_serve_applies(tmp_path):
    from dflash_export.deploy.connection import Limits, Refused, parse_json_bounded

    engine = make_torch_engine_dir(tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo", max_body_bytes=4096, max_json_depth=4)
    assert json.loads((repo / MARKER).read_text())["limits"] == {"max_body_bytes": 4096, "max_json_depth": 4}
    with pytest.raises(DFlashError, match="--max-json-depth: must be in 2..256"):
        write_repository(engine, tmp_path / "repo2", max_json_depth=1)
    assert not (tmp_path / "repo2").exists()
    assert Limits(4096, 4).check().max_json_depth == 4
    # The depth scan ignores brackets inside strings and counts objects and arrays alike.
    assert parse_json_bounded(b'{"a": "[[[[[[[[", "b": [[1]]}', 4) == {"a": "[[[[[[[[", "b": [[1]]}
    with pytest.raises(Refused, match="nested deeper than 4 levels"):
        parse_json_bounded(b'{"a": [{"b": [[1]]}]}', 4)


def test_serve_lets_through_as_many_calls_at_once_as_the_models_hold_and_at_least_256(tmp_path):
    """The front's default bound on its calls to tritonserver: every model's instances x batch and queue, so that a
    full queue is still tritonserver's 503 rather than a wait at the front; 256 when that is less (a default deploy
    holds 2 x (8 + 64))."""
    from dflash_export.deploy.repository import upstream_call_bound

    repo = write_repository(make_torch_engine_dir(tmp_path / "engine"), tmp_path / "repo")
    assert upstream_call_bound(json.loads((repo / MARKER).read_text())) == 256
    both = ["dflash", "dflash_stream"]
    assert upstream_call_bound({"models": both, "instances": 2, "max_batch": 64, "max_queue_size": 64}) == 384
    assert upstream_call_bound({"models": ["dflash"], "instances": 4, "max_batch": 128, "max_queue_size": 0}) == 512
    assert upstream_call_bound({"models": both, "instances": 64, "max_batch": 256, "max_queue_size": 20000}) == 65536


def test_serves_of_one_engine_starting_at_once_share_one_cached_repository(tmp_path, engine_dir):
    """`serve --engine` writes its repository into the cache on first use. Four processes asking for it at once all get
    the same checked repository, written once (the same directory, not one renamed away under another's server), and
    nothing else is left in the cache."""
    import time

    # Each imports, says so, and waits for the go: the four calls start within a few milliseconds of each other.
    code = """if True:
        import os, sys, time
        from dflash_export.deploy.repository import cached_repository, check_repository
        open(sys.argv[2] + ".ready", "w").close()
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.002)
        repo, marker = cached_repository(sys.argv[1], max_batch=1)
        assert check_repository(repo) == marker
        print(repo, os.stat(repo).st_ino)
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_CACHE": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(engine_dir), str(tmp_path / f"p{i}"), str(go)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"p{i}.ready").exists() for i in range(4)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-1500:] for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1, paths  # one path and one inode: the directory each process got is the one that stays
    repo = Path(paths.pop().rsplit(" ", 1)[0])
    assert [p.name for p in (tmp_path / "cache" / "repos").iterdir()] == [repo.name]


def test_an_fp32_engine_in_a_shared_batch_is_deployed_without_a_note(tmp_path, engine_dir):
    """Only engines that quantize their activations get the note about shared batches (docs/serving.md)."""
    r = cli("deploy", "--engine", engine_dir, "--repo", tmp_path / "repo", "--max-batch", 4)
    assert r.returncode == 0, r.stderr
    assert "note:" not in r.stdout and json.loads((tmp_path / "repo" / MARKER).read_text())["precision"] == "fp32"


def _param_block(key: str, value: str) -> str:
    return f'parameters {{\n  key: "{key}"\n  value {{\n    string_value: "{value}"\n  }}\n}}\n'


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (old, path)
    path.write_text(text.replace(old, new))


# Each edit: what tritonserver would load or import from the repository; every one is refused before a server starts.
CODE_EDITS = {
    "model.py edited": (lambda r: _append(r / "dflash" / "1" / "model.py", "\nimport os\n"),
                        "dflash/1/model.py: not the model this version of dflash-export serves"),
    "module beside model.py": (lambda r: (r / "dflash" / "1" / "helpers.py").write_text("x = 1\n"),
                               "dflash/1/helpers.py: a file or directory that `dflash-export deploy` did not write"),
    "bytecode beside model.py": (lambda r: ((r / "dflash" / "1" / "__pycache__").mkdir(),
                                            (r / "dflash" / "1" / "__pycache__" / "model.cpython-311.pyc")
                                            .write_bytes(b"\0")),
                                 "dflash/1/__pycache__: a file or directory"),
    "another version": (lambda r: shutil.copytree(r / "dflash" / "1", r / "dflash" / "2"),
                        "dflash/2: a file or directory that `dflash-export deploy` did not write"),
    "file in the model directory": (lambda r: (r / "dflash" / "model.py").write_text("x = 1\n"),
                                    "dflash/model.py: a file or directory"),
    "model.py a link": (lambda r: (shutil.move(r / "dflash" / "1" / "model.py", r.parent / "elsewhere.py"),
                                   (r / "dflash" / "1" / "model.py").symlink_to(r.parent / "elsewhere.py")),
                        "dflash/1/model.py: a symbolic link"),
    "engine a link": (lambda r: (shutil.move(r / "dflash" / "engine", r.parent / "moved-engine"),
                                 (r / "dflash" / "engine").symlink_to(r.parent / "moved-engine")),
                      "dflash/engine: a symbolic link"),
    "another backend": (lambda r: _replace(r / "dflash" / "config.pbtxt", 'backend: "python"', 'backend: "onnx"'),
                        'dflash/config.pbtxt: backend: must be "python"'),
    "another model file": (lambda r: _append(r / "dflash" / "config.pbtxt", 'default_model_filename: "x.py"\n'),
                           "dflash/config.pbtxt: default_model_filename: not a field deploy writes"),
    "all versions": (lambda r: _append(r / "dflash" / "config.pbtxt", "version_policy: { all { } }\n"),
                     "dflash/config.pbtxt: version_policy: not a field deploy writes"),
    "an execution environment": (lambda r: _append(r / "dflash" / "config.pbtxt", _param_block(
        "EXECUTION_ENV_PATH", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")),
        "dflash/config.pbtxt: parameters.EXECUTION_ENV_PATH: not a parameter deploy writes"),
    "a sys.path": (lambda r: _append(r / "dflash" / "config.pbtxt", _param_block("sys_path", '[\\"/tmp\\"]')),
                   "dflash/config.pbtxt: parameters.sys_path: not a parameter deploy writes"),
    "an engine elsewhere": (lambda r: _replace(r / "dflash" / "config.pbtxt", 'string_value: "engine"',
                                               f'string_value: "{r.parent / "engine"}"'),
                            "dflash/config.pbtxt: parameters.engine_dir: must name the repository's own engine"),
    "an engine outside": (lambda r: _replace(r / "dflash" / "config.pbtxt", 'string_value: "engine"',
                                             'string_value: "../../engine"'),
                          "dflash/config.pbtxt: parameters.engine_dir: must name the repository's own engine"),
    "a thread count that is no number": (lambda r: _replace(r / "dflash" / "config.pbtxt", 'key: "threads"\n  value {\n'
                                                            '    string_value: "0"', 'key: "threads"\n  value {\n'
                                                            '    string_value: "two"'),
                                         "dflash/config.pbtxt: parameters.threads: must be an integer in 0..1024, "
                                         "got 'two'"),
    "a K/V bound below 0": (lambda r: _replace(r / "dflash" / "config.pbtxt", 'key: "max_kv_tokens"\n  value {\n'
                                               '    string_value: "0"', 'key: "max_kv_tokens"\n  value {\n'
                                               '    string_value: "-5"'),
                            "dflash/config.pbtxt: parameters.max_kv_tokens: must be an integer in 0..999999999999, "
                            "got '-5'"),
    "a hidden model": (lambda r: shutil.copytree(r / "dflash", r / ".dflash"),
                       ".dflash: not one of the deployed models"),
    "a model a link": (lambda r: (r / "other").symlink_to(r / "dflash"), "other: a symbolic link"),
    "a TensorRT-LLM marker": (lambda r: _replace(r / MARKER, '"backend": "pytorch"', '"backend": "tensorrt-llm"'),
                              "dflash_repository.json: backend: a TensorRT-LLM repository"),
}


def _set_marker(repo: Path, **fields) -> None:
    marker = json.loads((repo / MARKER).read_text())
    (repo / MARKER).write_text(json.dumps({**marker, **fields}))


def _set_param(repo: Path, key: str, old: str, new: str) -> None:
    _replace(repo / "dflash" / "config.pbtxt", f'key: "{key}"\n  value {{\n    string_value: "{old}"',
             f'key: "{key}"\n  value {{\n    string_value: "{new}"')


# Each edit: a marker whose recorded options are not what deploy writes, or a config.pbtxt that disagrees with them
# (the front sizes itself by the marker, tritonserver by the config): refused before a server starts, naming the field.
OPTION_EDITS = {
    "instances not a number": (lambda r: _set_marker(r, instances="x"),
                               f"{MARKER}: instances: must be an integer in 1..64, got 'x'"),
    "max_batch null": (lambda r: _set_marker(r, max_batch=None), f"{MARKER}: max_batch: must be an integer in 1..256"),
    "max_kv_tokens a string": (lambda r: _set_marker(r, max_kv_tokens="abc"), f"{MARKER}: max_kv_tokens: must be"),
    "plain not a bool": (lambda r: _set_marker(r, plain="no"), f"{MARKER}: plain: must be true or false"),
    "limits a list": (lambda r: _set_marker(r, limits=[]), f"{MARKER}: limits: expected a JSON object"),
    "body limit a string": (lambda r: _set_marker(r, limits={"max_body_bytes": "x"}),
                            f"{MARKER}: limits.max_body_bytes: must be an integer, got 'x'"),
    "body limit 0": (lambda r: _set_marker(r, limits={"max_body_bytes": 0}),
                     f"{MARKER}: limits.max_body_bytes: must be in 1..1073741824, got 0"),
    "more instances recorded": (lambda r: _set_marker(r, instances=2),
                                "dflash/config.pbtxt: instance_group: [{'count': 1, 'kind': 'KIND_CPU'}] differs from "
                                "[{'count': 2, 'kind': 'KIND_CPU'}]"),
    "more instances configured": (lambda r: _replace(r / "dflash" / "config.pbtxt", "count: 1", "count: 3"),
                                  "dflash/config.pbtxt: instance_group: [{'count': 3,"),
    "a GPU instance": (lambda r: _replace(r / "dflash" / "config.pbtxt", "KIND_CPU", "KIND_GPU"),
                       "dflash/config.pbtxt: instance_group: "),
    "a queue past Triton's field": (lambda r: _replace(r / "dflash" / "config.pbtxt", "max_queue_size: 64",
                                                       "max_queue_size: 5000000000"),
                                    "dflash/config.pbtxt: dynamic_batching: "),
    "a batch size": (lambda r: _replace(r / "dflash" / "config.pbtxt", "max_batch_size: 0", "max_batch_size: 8"),
                     "dflash/config.pbtxt: max_batch_size: 8 differs from 0"),
    "another shared batch": (lambda r: _set_param(r, "max_batch", "1", "4"),
                             "dflash/config.pbtxt: parameters.max_batch: '4' differs from '1'"),
    "a shared batch past the bound": (lambda r: _set_param(r, "max_batch", "1", "9999"),
                                      "dflash/config.pbtxt: parameters.max_batch: must be an integer in 1..256"),
    "a K/V bound configured": (lambda r: _set_param(r, "max_kv_tokens", "0", "4096"),
                               "dflash/config.pbtxt: parameters.max_kv_tokens: '4096' differs from '0'"),
    "another K/V memory share": (lambda r: _set_param(r, "kv_instances", "1", "2"),
                                 "dflash/config.pbtxt: parameters.kv_instances: '2' differs from '1'"),
    "plain decoding": (lambda r: _set_param(r, "mode", "dflash", "ar"),
                       "dflash/config.pbtxt: parameters.mode: 'ar' differs from 'dflash'"),
    "plain recorded": (lambda r: _set_marker(r, plain=True),
                       "dflash/config.pbtxt: parameters.mode: 'dflash' differs from 'ar'"),
    "a larger input": (lambda r: _replace(r / "dflash" / "config.pbtxt", 'name: "text_input"\n    data_type: '
                                          'TYPE_STRING\n    dims: [ 1 ]', 'name: "text_input"\n    data_type: '
                                          'TYPE_STRING\n    dims: [ 99999999999999999999 ]'),
                       "dflash/config.pbtxt: input text_input: "),
    "an input dropped": (lambda r: drop_input(r, "max_tokens"), "dflash/config.pbtxt: input max_tokens: missing"),
}


@pytest.mark.parametrize("edit", [*CODE_EDITS, *OPTION_EDITS])
def test_serve_refuses_what_deploy_did_not_write_naming_the_field(tmp_path, small_repo, edit):
    """Code or configuration tritonserver would load, or recorded options, that `deploy` did not write: refused by
    the repository check and by `serve --repo` in one line, before a server starts."""
    import socket

    from dflash_export.deploy.repository import check_repository

    change, message = {**CODE_EDITS, **OPTION_EDITS}[edit]
    change(small_repo)
    with pytest.raises(DFlashError) as e:
        check_repository(small_repo)
    assert message in str(e.value) and e.value.exit_code == 2, str(e.value)
    with socket.socket() as held:  # were the repository let through, serve would stop at this busy port
        held.bind(("127.0.0.1", 0))
        held.listen()
        r = cli("serve", "--repo", small_repo, "--port", held.getsockname()[1])
    assert_one_line(r, message)


def test_a_repository_deployed_before_input_ids_still_agrees_with_its_marker(small_repo):
    from dflash_export.deploy.repository import check_repository

    assert check_repository(drop_input(small_repo, "input_ids"))["models"] == ["dflash"]


def test_a_config_without_the_kv_memory_share_is_served_only_where_its_own_instances_are_all(tmp_path, small_repo):
    """Each model's config records how many instances, every model's, share the default K/V memory (`kv_instances`);
    a model stub given none counts its own model's instances. A one-model repository without it is served (that is
    every instance); a two-model one is refused before a server starts: its stubs would take twice the memory."""
    from dflash_export.deploy.repository import check_repository

    def drop_kv_instances(repo: Path) -> Path:
        for cfg in repo.glob("*/config.pbtxt"):
            text, n = re.subn(r'parameters \{\n  key: "kv_instances"\n  value \{\n    string_value: "\d+"\n  \}\n\}\n',
                              "", cfg.read_text())
            assert n == 1, cfg
            cfg.write_text(text)
        return repo

    assert check_repository(drop_kv_instances(small_repo))["models"] == ["dflash"]
    both = write_repository(make_torch_engine_dir(tmp_path / "engine2"), tmp_path / "both", instances=2)
    assert '"kv_instances"\n  value {\n    string_value: "4"' in (both / "dflash_stream" / "config.pbtxt").read_text()
    with pytest.raises(DFlashError) as e:
        check_repository(drop_kv_instances(both))
    assert str(e.value).startswith(f"{both / 'dflash' / 'config.pbtxt'}: parameters.kv_instances: missing, which the "
                                   "model reads as '2', not '4'") and str(e.value).endswith("deploy again"), e.value


@pytest.mark.parametrize("option, value, bound", [
    ("--max-queue-size", "4294967296", "0<=x<=4294967295"),  # Triton's max_queue_size is an unsigned 32-bit field
    ("--threads", "100000", "0<=x<=1024"),
    ("--max-queued-tokens", "1000000000000", "1<=x<=999999999999"),  # serve reads at most 12 digits back
    ("--max-kv-tokens", "99999999999999999999999999", "0<=x<=999999999999"),
])
def test_deploy_refuses_values_its_own_serve_could_not_load(tmp_path, option, value, bound):
    from dflash_export.deploy.repository import check_repository

    engine = make_torch_engine_dir(tmp_path / "engine")
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo", option, value)
    assert_one_line(r, f"{option}: {value} is not in the range {bound}")
    assert not (tmp_path / "repo").exists()
    with pytest.raises(DFlashError, match=option):
        write_repository(engine, tmp_path / "repo", **{option[2:].replace("-", "_"): int(value)})
    edge = bound.rsplit("=", 1)[1]  # the largest value deploy takes is one its serve takes
    r = cli("deploy", "--engine", engine, "--repo", tmp_path / "repo", option, edge)
    assert r.returncode == 0, r.stderr
    assert check_repository(tmp_path / "repo")["format"] == 2


def test_serve_cli_refuses_an_edited_model_py_in_one_line(tmp_path, small_repo):
    import socket

    _append(small_repo / "dflash" / "1" / "model.py", "\nopen('ran', 'w')\n")
    with socket.socket() as held:  # were the repository let through, serve would stop at this busy port
        held.bind(("127.0.0.1", 0))
        held.listen()
        r = cli("serve", "--repo", small_repo, "--port", held.getsockname()[1])
    assert_one_line(r, f"{small_repo / 'dflash' / '1' / 'model.py'}: not the model this version")
    assert not (ROOT / "ran").exists()


def test_a_deploy_of_both_models_is_served_and_a_changed_engine_is_refused(tmp_path):
    from dflash_export.deploy.repository import REPO_FORMAT, check_repository

    engine = make_torch_engine_dir(tmp_path / "engine")
    repo = write_repository(engine, tmp_path / "repo")
    marker = check_repository(repo)
    assert marker["models"] == ["dflash", "dflash_stream"] and marker["format"] == REPO_FORMAT

    def refused(edit) -> str:
        r = tmp_path / f"copy{len(list(tmp_path.glob('copy*')))}"
        shutil.copytree(repo, r, symlinks=True)
        edit(r)
        with pytest.raises(DFlashError) as e:
            check_repository(r)
        return str(e.value)

    assert "dflash_stream/config.pbtxt: parameters.engine_dir: must name the repository's own engine " \
           "'../dflash/engine'" in refused(lambda r: _replace(r / "dflash_stream" / "config.pbtxt",
                                                              "../dflash/engine", str(engine)))
    # Another engine (another recipe, or the same recipe rebuilt) with a manifest of its own that checks out.
    assert "dflash/engine/manifest.json: recipe: the repository's engine is for recipe 'tiny-qwen3', but deploy " \
           "recorded 'smollm2-135m'" in refused(lambda r: _replace(r / MARKER, "tiny-qwen3", "smollm2-135m"))
    assert "dflash/engine/manifest.json: engine_manifest_sha256: changed since deploy" in refused(
        lambda r: edit_manifest(r / "dflash" / "engine", block_size=8))
    # A repository of another version of the project (an older one has no `format`).
    assert f"dflash_repository.json: format: written by another version of dflash-export (repository format 1; " \
           f"this version serves format {REPO_FORMAT}): deploy again" in refused(
               lambda r: (r / MARKER).write_text(json.dumps({k: v for k, v in marker.items() if k != "format"})))


def test_the_repository_cache_keeps_what_serve_can_reuse_and_never_what_a_server_runs_from(tmp_path, engine_dir,
                                                                                          monkeypatch):
    """Each repository `serve --engine` caches holds a full copy of its engine. Asking for one removes those no
    `serve --engine` would pick again (engine rebuilt or gone, other code, a killed writer's temporary directory)
    and keeps the most recently used reusable ones, but never one a running server holds."""
    from dflash_export.deploy import repository

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    repos = tmp_path / "cache" / "repos"
    monkeypatch.setattr(repository, "_held_locks", [])

    def serve(engine, **options):  # a server starting: it holds its repository until `exit`
        return repository.cached_repository(engine, **options)[0], repository._held_locks[-1]

    def exit(server):
        server[1].close()

    def cached():
        return sorted(p.name for p in repos.iterdir())

    engine = copy_engine(engine_dir, tmp_path / "engine")
    other = copy_engine(engine_dir, tmp_path / "other")
    a1 = serve(engine, max_batch=1)
    exit(a1)
    a2 = serve(engine, max_batch=2)  # another option: a1 stays reusable
    assert cached() == sorted([a1[0].name, a2[0].name])
    # A rebuilt engine (its manifest's bytes differ) never reuses the old repositories: the free one goes, the one a
    # server still runs from stays until that server exits.
    manifest = json.loads((engine / "manifest.json").read_text())
    (engine / "manifest.json").write_text(json.dumps(manifest, indent=1))
    a3 = serve(engine, max_batch=1)
    assert a3[0] != a1[0] and cached() == sorted([a2[0].name, a3[0].name])
    assert (a2[0] / MARKER).is_file() and repository.check_repository(a2[0])
    exit(a2)
    exit(a3)
    stale = repos / f".{a1[0].name}.tmp-999999-x"  # a writer killed mid-copy (no process 999999 on test machines)
    live = repos / f".{a1[0].name}.tmp-{os.getpid()}-y"  # a writer still copying
    stale.mkdir()
    live.mkdir()
    again = serve(engine, max_batch=1)
    assert again[0] == a3[0] and (again[0] / MARKER).stat().st_ino == (a3[0] / MARKER).stat().st_ino  # reused
    assert cached() == sorted([a3[0].name, live.name])
    exit(again)
    live.rmdir()
    # The reusable ones past the newest four go, least recently used first; a deleted engine's go at once.
    servers = []
    for b in range(1, 6):
        servers.append(serve(other, max_batch=b))
        exit(servers[-1])
    assert cached() == sorted(s[0].name for s in servers)  # a3, used least recently, went with the fifth
    shutil.rmtree(other)
    last = serve(engine, max_batch=3)
    assert cached() == [last[0].name]
    exit(last)


def test_a_cached_repository_whose_marker_is_a_fifo_is_pruned_without_waiting_on_it(tmp_path, engine_dir,
                                                                                     monkeypatch):
    """A directory in the repository cache whose marker is a FIFO (its open waits for a writer that never comes):
    `serve --engine` asking for its own repository removes it as one it would never reuse, without waiting."""
    from wait_support import fails_after

    from dflash_export.deploy import repository

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(repository, "_held_locks", [])
    junk = tmp_path / "cache" / "repos" / "engine-0123456789abcdef"
    junk.mkdir(parents=True)
    os.mkfifo(junk / MARKER)
    with fails_after(10, "pruning waited on a marker"):
        repo, _ = repository.cached_repository(copy_engine(engine_dir, tmp_path / "engine"), max_batch=1)
    repository._held_locks[-1].close()
    assert sorted(p.name for p in repo.parent.iterdir()) == [repo.name]


def test_a_read_only_engine_deploys_to_a_repository_its_owner_can_replace_and_remove(tmp_path):
    """An engine installed read-only (another user's, an image layer) is copied into a repository whose directories
    its owner can write: deploying again replaces it, and removing it removes everything."""
    import stat

    engine = make_torch_engine_dir(tmp_path / "engine")
    for f in engine.iterdir():
        f.chmod(0o444)
    engine.chmod(0o555)
    try:
        for _ in range(2):
            repo = write_repository(engine, tmp_path / "out" / "repo")
            for d in [repo, *(p for p in repo.rglob("*") if p.is_dir())]:
                assert d.stat().st_mode & stat.S_IWUSR, d
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["repo"]  # no earlier copy left aside
        shutil.rmtree(repo)
        assert not repo.exists()
    finally:
        engine.chmod(0o755)


def test_a_repository_cache_that_cannot_be_written_names_the_variable_that_moves_it(tmp_path, monkeypatch):
    from dflash_export.deploy.repository import cached_repository

    engine = make_torch_engine_dir(tmp_path / "engine")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "locks").write_text("x\n")  # where its lock files go: a file, which not even root can write into
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    with pytest.raises(DFlashError, match=re.escape(f"{cache / 'locks'}: --engine: cannot write the model repository "
                                                    "cache (") + r".*\); set DFLASH_CACHE to a writable directory$"):
        cached_repository(engine, max_batch=1)
    assert sorted(p.name for p in cache.iterdir()) == ["locks"]


@pytest.mark.parametrize("name", ["with space", "$HOME", "it's", 'say "hi"', "-lead", "é", "semi;colon", "`id`",
                                  "new\nline", "star*", "~tilde", "a&b|c"])
def test_the_served_copy_path_reaches_the_stub_unchanged_through_its_shell(tmp_path, name):
    """tritonserver's python backend starts each stub with `bash -c` and the model's path unquoted on the command
    line: the served copy's path, whatever the repository's path holds, comes through the shell as one word,
    unchanged."""
    from dflash_export.deploy.triton_process import served_dir

    served = served_dir(tmp_path / "work", tmp_path / name / "repo")
    assert served.is_relative_to(tmp_path / "work" / "served")
    model = served / "dflash" / "1" / "model.py"
    out = subprocess.run(["bash", "-c", f"printf '<%s>' {model}"], capture_output=True, text=True, timeout=30)
    assert out.stdout == f"<{model}>", out
    assert served_dir(Path("/w"), Path("/srv/models/a-b_c.d+1/repo")) == Path("/w/served/srv/models/a-b_c.d+1/repo")


def test_two_first_installs_of_the_stub_numpy_make_one_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch):
    """Two `serve`s installing the stub's numpy 1 at once: pip runs once and both get the complete directory; a pip
    that fails (or dies) after writing part of it leaves no directory a later start would take for installed, and
    the next start installs afresh."""
    import threading

    from dflash_export.deploy import triton_install
    from dflash_export.errors import MissingDependency

    site = tmp_path / "cache" / "site"
    monkeypatch.setenv(triton_install.STUB_SITE_ENV, str(site))
    real = triton_install._numpy_major
    monkeypatch.setattr(triton_install, "_numpy_major", lambda where=None: 2 if where is None else real(where))
    calls, fail = [], []

    def pip(cmd, **kw):  # pip --target moving its files in one by one, the dist-info among the first
        target = Path(cmd[cmd.index("--target") + 1])
        calls.append(target)
        (target / "numpy-1.26.4.dist-info").mkdir()
        time.sleep(0.3)
        if fail:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: the wheel could not be written\n")
        (target / "numpy").mkdir()
        (target / "numpy" / "__init__.py").write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(triton_install.subprocess, "run", pip)
    fail.append(True)
    with pytest.raises(MissingDependency, match="could not install .*the wheel could not be written"):
        triton_install.ensure_stub_site()
    assert not site.exists() and [p.name for p in site.parent.iterdir()] == [".site.lock"]
    fail.clear()
    got = []
    threads = [threading.Thread(target=lambda: got.append(triton_install.ensure_stub_site())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [site, site] and len(calls) == 2  # the failed install and one of the two
    assert sorted(p.name for p in site.iterdir()) == [triton_install.STUB_MARKER, "numpy", "numpy-1.26.4.dist-info"]
    assert sorted(p.name for p in site.parent.iterdir()) == [".site.lock", "site"]


def test_a_marked_stub_numpy_directory_is_used_without_writing_to_it(tmp_path, monkeypatch):
    """The stub's numpy 1 directory, installed once and marked: a later `serve` only reads it, so it may be
    read-only (installed by another user, an image layer)."""
    from dflash_export.deploy import triton_install
    from dflash_export.errors import MissingDependency

    site = tmp_path / "site"
    (site / "numpy-1.26.4.dist-info").mkdir(parents=True)
    marker = site / triton_install.STUB_MARKER
    marker.touch()
    os.utime(marker, ns=(10**9, 10**9))
    monkeypatch.setenv(triton_install.STUB_SITE_ENV, str(site))
    real = triton_install._numpy_major
    monkeypatch.setattr(triton_install, "_numpy_major", lambda where=None: 2 if where is None else real(where))
    assert triton_install.ensure_stub_site(install=False) == site
    assert marker.stat().st_mtime_ns == 10**9 and sorted(p.name for p in site.iterdir()) == [
        triton_install.STUB_MARKER, "numpy-1.26.4.dist-info"]
    marker.unlink()  # unmarked, and the marker cannot be written (as root too: a link into no directory)
    marker.symlink_to(tmp_path / "gone" / "marker")
    with pytest.raises(MissingDependency, match=rf"^{re.escape(str(site))}: holds numpy 1 but not the "
                                                rf"{triton_install.STUB_MARKER} file .*{triton_install.STUB_SITE_ENV}"):
        triton_install.ensure_stub_site(install=False)


def test_a_library_installed_under_another_distribution_name_deploys(tmp_path, engine_dir, monkeypatch):
    """onnxruntime-gpu (or onnxruntime-openvino) provides the `onnxruntime` module under another distribution name,
    so pip's metadata has no `onnxruntime` version: the served engine imports it all the same, so deploy writes the
    repository (recording no version for that name) and serve's check takes it; a module that cannot be imported is
    refused, naming it and the install line, with nothing written."""
    import importlib.metadata as md
    import importlib.util

    from dflash_export.deploy.repository import check_repository
    from dflash_export.errors import MissingDependency

    engine = ort_engine(engine_dir, tmp_path / "engine")
    version = md.version

    def no_onnxruntime_distribution(name):
        if name == "onnxruntime":
            raise md.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(md, "version", no_onnxruntime_distribution)
    repo = write_repository(engine, tmp_path / "repo")
    cfg = check_config_text((repo / "dflash" / "config.pbtxt").read_text(), expect_name="dflash")
    recorded = json.loads({p["key"]: p["value"]["string_value"] for p in cfg["parameters"]}["library_versions"])
    assert "onnxruntime" not in recorded and "tokenizers" in recorded, recorded
    check_repository(repo)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else
                        find_spec(name, *a))
    with pytest.raises(MissingDependency, match="^--engine: onnxruntime is not installed: pip install 'dflash") as e:
        write_repository(engine, tmp_path / "repo2")
    assert e.value.field == "--engine" and not (tmp_path / "repo2").exists()
