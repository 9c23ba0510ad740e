"""The command line agrees with itself: every command listed with its whole summary and ending its --help with an
example that parses; one --max-new-tokens default, one --engine type; --recipe wherever a pair is named; the exit
codes in the top-level help; `recipes` and `env`; `inspect --recipe` and `run --recipe`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dflash_export.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def _params(cmd: click.Command) -> dict[str, click.Parameter]:
    return {opt: p for p in cmd.params for opt in getattr(p, "opts", [])}


def test_every_command_is_listed_whole_and_ends_its_help_with_an_example_that_parses():
    top = _run("--help")
    assert top.exit_code == 0
    assert set(main.commands) == set(COMMANDS)
    listed = " ".join(top.output.split())  # summaries may wrap; none is cut
    assert "..." not in top.output.split("Commands:")[1]
    for name, cmd in main.commands.items():
        summary, example = COMMANDS[name]
        assert f"{name} {summary}" in listed, name
        r = _run(name, "--help")
        assert r.exit_code == 0 and "%%" not in r.output, name
        assert r.output.rstrip().endswith(f"Example:\n    {example}"), (name, r.output[-300:])
        words = shlex.split(example)
        assert words[:2] == ["dflash-export", name]
        cmd.make_context(name, words[2:])  # the example's options exist, have valid values, lack nothing required


def test_the_exit_codes_and_what_tau_counts_are_in_the_top_level_help():
    out = " ".join(_run("--help").output.split())
    assert "Exit codes: 0 done (every check held), 1 a check failed, 2 usage or input error (nothing done), " \
           "3 internal error." in out
    assert "τ (tau) = tokens committed per target verify pass (plain decoding: 1)" in out


def test_generating_commands_share_one_max_new_tokens_default_and_engine_is_one_type():
    defaults, engines = {}, {}
    for name, cmd in main.commands.items():
        p = _params(cmd)
        if "--max-new-tokens" in p:
            defaults[name] = p["--max-new-tokens"].default
        if "--engine" in p:
            engines[name] = (p["--engine"].metavar, type(p["--engine"].type), p["--engine"].type.file_okay)
    assert set(defaults) == {"run", "bench", "validate", "reference", "demo"}
    assert set(defaults.values()) == {128}, defaults
    assert set(engines) == {"run", "bench", "validate", "deploy", "serve"}
    assert set(engines.values()) == {("DIR", click.Path, False)}, engines


def test_every_command_that_names_a_pair_takes_recipe():
    for name in ("inspect", "reference", "export", "build", "run", "bench", "validate", "train", "demo"):
        assert "--recipe" in _params(main.commands[name]), name


def test_recipes_lists_every_recipe_file_on_one_line(monkeypatch):
    monkeypatch.delenv("QWEN3_8B", raising=False)
    monkeypatch.delenv("QWEN3_8B_DFLASH", raising=False)
    r = _run("recipes")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    names = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert [ln.split()[0] for ln in lines] == names
    by_name = {ln.split()[0]: ln for ln in lines}
    assert "Qwen/Qwen3-8B" in by_name["qwen3-8b"] and by_name["qwen3-8b"].endswith("[set $QWEN3_8B, $QWEN3_8B_DFLASH]")
    assert "[set" not in by_name["tiny-qwen3"]


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs /proc/cpuinfo")
def test_env_reports_backends_cpu_flags_and_the_gpu(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no nvidia-smi: no GPU
    r = _run("env", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["gpu"] == []
    flags = _cpuinfo_flags()
    for feature, flag in (("AVX2", "avx2"), ("FMA3", "fma"), ("F16C", "f16c"), ("AVX512F", "avx512f")):
        assert (feature in rep["cpu"]["isa"]) == (flag in flags), feature
    assert rep["backends"]["onnxruntime"] == "yes"  # this environment has torch, onnx, onnxruntime, tokenizers
    assert rep["libraries"]["onnxruntime"]["version"] == importlib.metadata.version("onnxruntime")
    text = _run("env").output
    assert "GPU: none" in text and "backends: onnxruntime yes" in text
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))  # where it is, not created by looking
    assert json.loads(_run("env", "--json").output)["cache"] == str(tmp_path / "cache")
    assert f"cache: {tmp_path / 'cache'} (DFLASH_CACHE moves it)" in _run("env").output
    assert not (tmp_path / "cache").exists()

    smi = bin_dir / "nvidia-smi"  # what nvidia-smi prints for its CSV query
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB'\n")
    smi.chmod(0o755)
    assert json.loads(_run("env", "--json").output)["gpu"] == ["NVIDIA H200, 143771 MiB"]

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxruntime" else real(n, *a))
    rep = json.loads(_run("env", "--json").output)
    assert rep["backends"]["onnxruntime"] == "no (onnxruntime)"
    assert rep["libraries"]["onnxruntime"]["version"] is None
    assert rep["libraries"]["onnxruntime"]["install"] == "pip install 'dflash-export[runtime]'"


def test_inspect_takes_a_recipe_or_a_drafter_and_its_target():
    from dflash_export.models.sources import resolve_source

    by_recipe = _run("inspect", "--recipe", "tiny-qwen3", "--json")
    by_pair = _run("inspect", resolve_source("tiny:qwen3/drafter"), "--target", resolve_source("tiny:qwen3/target"),
                   "--json")
    by_options = _run("inspect", "--drafter", "tiny:qwen3/drafter", "--target", "tiny:qwen3/target", "--json")
    for r in (by_recipe, by_pair, by_options):
        assert r.exit_code == 0, r.output
    assert json.loads(by_recipe.output) == json.loads(by_pair.output) == json.loads(by_options.output)
    assert json.loads(by_recipe.output)["ok"] is True
    r = _run("inspect")
    assert r.exit_code == 2
    assert r.output.strip() == "error: --recipe: give --recipe NAME, or DRAFTER and --target TARGET"


def test_run_takes_a_recipe_for_the_engine_build_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _run("build", "--recipe", "tiny-qwen3").exit_code == 0
    by_recipe = _run("run", "--recipe", "tiny-qwen3", "--max-new-tokens", "12", "hello there")
    by_engine = _run("run", "--engine", Path("engines") / "tiny-qwen3" / "onnxruntime", "--max-new-tokens", "12",
                     "hello there")
    assert by_recipe.exit_code == 0 and by_engine.exit_code == 0, by_recipe.output + by_engine.output
    assert by_recipe.stdout == by_engine.stdout and by_recipe.stdout.strip()
    # the engine a recipe picked is named; one given by --engine is the user's own words
    assert f"[engine] {Path.cwd() / 'engines' / 'tiny-qwen3' / 'onnxruntime'}\n" in by_recipe.stderr, by_recipe.stderr
    assert "[engine]" not in by_engine.stderr
    # every τ says what it counted: the drafter's chain (tiny-qwen3's recipe drafts chains), cut by cost or not
    assert "tokens per target pass (drafter chain; adaptive: drafts verified while they pay)" in by_recipe.stderr
    r = _run("run", "--recipe", "tiny-qwen3", "--max-new-tokens", "12", "--full-blocks", "--proposer", "tree+lookup",
             "hello there")
    assert "tokens per target pass (tree+lookup; every draft verified)" in r.stderr, r.stderr
    if "verify rows bit-identical to plain steps on this CPU" in by_recipe.stderr:
        assert r.stdout == by_recipe.stdout  # greedy: plain decoding's tokens whatever is drafted
    else:  # no row floor agrees on this CPU: `run` says DFlash is plain decoding's up to near-ties only
        assert "[numerics] lossless within kernel numerics on this CPU" in r.stderr, r.stderr
    r = _run("run", "hi")
    assert r.exit_code == 2 and "give --engine DIR (a built engine) or --recipe NAME" in r.output
    os.rename("engines", "elsewhere")
    r = _run("run", "--recipe", "tiny-qwen3", "hi")
    assert r.exit_code == 2 and "`dflash-export build --recipe tiny-qwen3 --backend onnxruntime`" in r.output


def test_build_says_a_verdict_short_of_bit_identity_of_the_engine_directory_it_built(tmp_path, monkeypatch, caplog):
    """On a CPU where no row floor makes verify rows bit-identical (the probe made to report so, as conftest's
    DFLASH_TEST_NO_BIT_IDENTICAL_FLOOR does), `build` says it once, of the directory it built: never of the
    temporary directory the engine was probed in before it was renamed into place."""
    import logging

    import numpy as np

    from dflash_export.engines import numerics

    real = numerics.probe_floor

    def probe_floor(engine, floor, rows=None, pad="host"):
        if floor > 1:
            engine.row_floor, engine.row_pad = floor, pad
            return False, float(np.finfo(np.float32).max)
        return False, real(engine, 1, rows, "host")[1]

    monkeypatch.setattr(numerics, "probe_floor", probe_floor)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash_export"):
        r = _run("build", "--recipe", "tiny-qwen3", "--out", tmp_path / "engines")
    assert r.exit_code == 0, r.output
    said = [ln for ln in r.output.splitlines() if "lossless within kernel numerics on this CPU" in ln]
    engine = tmp_path / "engines" / "tiny-qwen3" / "onnxruntime"
    assert len(said) == 1 and said[0].startswith(f"warning: {engine}: "), r.output
    assert ".tmp-" not in r.output + caplog.text, r.output + caplog.text


def test_reference_samples_with_every_seed_run_takes_and_does_not_read_other_draws_as_a_mismatch():
    top_seed = 2 ** 64 - 1  # the largest UINT64, a seed `run` and the served API take
    sampled = _run("reference", "--recipe", "tiny-qwen3", "--max-new-tokens", "8", "--temperature", "0.8",
                   "--seed", top_seed)
    assert sampled.exit_code == 0, sampled.output
    # sampled, the reference's drafter chain keeps AR's distribution, not its draws: no "identical to AR" verdict
    assert "identical to AR" not in sampled.output and "not expected when sampling" in sampled.output
    greedy = _run("reference", "--recipe", "tiny-qwen3", "--max-new-tokens", "8")
    assert greedy.exit_code == 0 and "identical to AR: True" in greedy.output, greedy.output
