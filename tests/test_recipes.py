"""Recipes: every shipped recipe parses; a bad key, type or value is one line naming the file and the field."""

import subprocess
import sys

import pytest

from dflash_export.errors import DFlashError
from dflash_export.recipes import list_recipes, load_recipe


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_export", *args], capture_output=True, text=True, timeout=300)


def test_unknown_recipe_key_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\nblock_sise: 4\n")
    r = _cli("reference", "--recipe", str(bad))
    assert r.returncode == 2 and "bad.yaml: block_sise: unknown key" in r.stderr and "Traceback" not in r.stderr


def test_wrong_recipe_type_names_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: a\ndrafter: b\nmax_seq_len: lots\nthresholds: {min_tau: fast}\n")
    with pytest.raises(DFlashError, match=r"max_seq_len: expected an integer, got a string \('lots'\)"):
        load_recipe(bad)
    bad.write_text("name: x\ntarget: a\ndrafter: b\nthresholds: {min_tau: fast}\n")
    with pytest.raises(DFlashError, match=r"thresholds.min_tau: expected a number, got a string \('fast'\)"):
        load_recipe(bad)
    # PyYAML (YAML 1.1) reads an exponent without a dot as text: the message says how to write the number
    bad.write_text("name: x\ntarget: a\ndrafter: b\ntrain: {lr: 3E-4}\n")
    with pytest.raises(DFlashError, match=r"train.lr: expected a number, got a string \('3E-4'\); YAML reads 3E-4 as "
                                          r"text, write it with a dot: 3.0e-4"):
        load_recipe(bad)
    bad.write_text("name: x\ntarget: a\ndrafter: b\ntrain: {lr: 3.0e-4}\n")
    assert load_recipe(bad).train.lr == 3e-4
    bad.write_text("name: x\ntarget: a\ndrafter: b\nbackends: [onnxruntime, cuda]\n")
    with pytest.raises(DFlashError, match=r"backends\[1\]: 'cuda' is not one of"):
        load_recipe(bad)


@pytest.mark.parametrize("body, field, expect", [
    ("decoding:\n  proposer: null\n", "decoding.proposer", "expected a string, got null"),
    ("chat_template: 1\n", "chat_template", "expected a boolean, got an integer (1)"),
    ("train: {lr: true}\n", "train.lr", "expected a number, got a boolean (true)"),
    ("max_seq_len: 512.5\n", "max_seq_len", "expected an integer, got a number (512.5)"),
    ("thresholds: 3\n", "thresholds", "expected a mapping, got an integer (3)"),
    ("backends: onnxruntime\n", "backends", "expected a list, got a string ('onnxruntime')"),
    ("backends: [null]\n", "backends[0]", "expected a string, got null"),
])
def test_a_wrong_type_is_named_in_yamls_words(tmp_path, body, field, expect):
    """The project's words for types (a string, an integer, null, a mapping), YAML's true / false: never Python's
    type names (str, NoneType) or reprs (None, True)."""
    y = tmp_path / "r.yaml"
    y.write_text("name: r\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n" + body)
    with pytest.raises(DFlashError) as e:
        load_recipe(y)
    assert (e.value.path, e.value.field, e.value.message) == (y, field, expect)


def test_shipped_recipes_all_parse():
    names = list_recipes()
    for required in ("qwen3-4b", "qwen3-8b", "qwen3-coder-30b-a3b", "llama3.1-8b-instruct", "tiny-qwen3", "tiny-llama"):
        assert required in names
    for n in names:
        r = load_recipe(n)
        assert r.name == n


@pytest.mark.parametrize("line, field", [("precision: int3\n", "precision"), ("drafter_precision: fp16\n",
                                                                            "drafter_precision")])
def test_bad_precision_in_a_recipe_names_the_field(tmp_path, line, field):
    y = tmp_path / "bad.yaml"
    y.write_text("name: bad\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n" + line)
    with pytest.raises(DFlashError, match=field):
        load_recipe(y)


@pytest.mark.parametrize("line, field", [("decoding: {proposer: beam}\n", "decoding.proposer"),
                                         ("decoding: {tree_mode: all}\n", "decoding.tree_mode"),
                                         ("decoding: {sampled_tree_mode: all}\n", "decoding.sampled_tree_mode"),
                                         ("decoding: {tree_top_k: 9}\n", "decoding.tree_top_k"),
                                         ("decoding: {tree_nodes: 0}\n", "decoding.tree_nodes"),
                                         ("decoding: {budget: 3}\n", "decoding.budget")])
def test_bad_decoding_options_name_the_field(tmp_path, line, field):
    y = tmp_path / "bad.yaml"
    y.write_text("name: bad\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n" + line)
    with pytest.raises(DFlashError, match=field.replace(".", r"\.")):
        load_recipe(y)


@pytest.mark.parametrize("text, line, key", [
    ("train:\n  steps: 6\n  lr: 0.1\n  steps: 7\n", 7, "steps"),      # YAML itself would keep the last one
    ("max_seq_len: 64\nmax_seq_len: 128\n", 5, "max_seq_len"),
])
def test_a_key_given_twice_is_one_line_naming_its_line(tmp_path, text, line, key):
    y = tmp_path / "twice.yaml"
    y.write_text("name: twice\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n" + text)
    r = _cli("reference", "--recipe", str(y))
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == f"error: {y}: line {line}: invalid YAML (duplicate key '{key}')\n", r.stderr


def test_a_merged_key_may_still_be_overridden(tmp_path):
    y = tmp_path / "merge.yaml"
    y.write_text("name: merge\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n"
                 "train:\n  <<: {steps: 60, lr: 0.1}\n  steps: 70\n")
    r = load_recipe(y)
    assert (r.train.steps, r.train.lr) == (70, 0.1)


def test_a_value_of_the_wrong_type_is_quoted_short_however_large(tmp_path):
    # ten lines of anchors and aliases make a list of 10**7 elements; the error quotes a few of them
    anchors = "backends: [&a0 [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)) + "]\n"
    y = tmp_path / "aliases.yaml"
    y.write_text(anchors + "name: *a6\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n")
    with pytest.raises(DFlashError) as e:
        load_recipe(y)
    message = str(e.value)
    assert message.startswith(f"{y}: name: expected a string, got a list ([[[...], [...], [...], [...], ...], "), \
        message
    assert len(message) < len(str(y)) + 200, message


def test_a_tiny_source_is_checked_without_importing_torch(tmp_path):
    y = tmp_path / "nope.yaml"
    y.write_text("name: nope\ntarget: tiny:nope/target\ndrafter: tiny:qwen3/drafter\n")
    code = ("import sys; from dflash_export.errors import DFlashError; from dflash_export.recipes import load_recipe\n"
            f"r = load_recipe({str(y)!r}); assert r.drafter_path == 'tiny:qwen3/drafter'\n"
            "try:\n    r.target_path\nexcept DFlashError as e:\n    print(e.path, e.field, sep='|')\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == f"{y}|target\n", r.stdout + r.stderr
