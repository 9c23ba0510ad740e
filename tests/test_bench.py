"""`dflash-export bench` and the benchmark scripts on built tiny engines: every mode checked against HF, tau pooled as
the reference pools it, the concurrency levels against each request run alone, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from target_support import exact_on_this_cpu

from dflash_export.engines.manifest import read_manifest
from dflash_export.errors import DFlashError

# the concurrency bench's prompts: short, long (past a block of context), one token, repeats
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65],
           [3 + (i * 7) % 200 for i in range(150)]]


@pytest.fixture(scope="module")
def built(ort_pair):
    return ort_pair


def test_engine_costs_benchmark_runs_on_a_built_engine(built):
    _, out, _, _ = built
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "engine_costs.py"
    r = subprocess.run([sys.executable, str(script), "--engine", str(out), "--threads", "1", "--reps", "2",
                        "--context", "20"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for key in ("step_1_ms", "verify_8_ms", "verify_16_ms", "ratio_verify_8", "ratio_verify_16"):
        assert key in r.stdout


def test_bench_runs_every_mode_and_checks_them_against_hf(built, tmp_path):
    from dflash_export.bench.suite import run_bench

    recipe, out, eng, _ = built
    report = run_bench(str(recipe.path), str(out), None, 2, 12, ["dflash", "dflash-full", "ar", "hf", "reference"],
                       str(tmp_path / "bench.json"))
    s = report["summary"]
    assert set(s) == {"dflash", "dflash-full", "ar", "hf", "reference"}
    for mode, fig in s.items():  # greedy: every mode is the target's own output (DFlash's: as the probe states)
        assert fig["identical_to_hf"] == "2/2" or (mode.startswith("dflash") and not exact_on_this_cpu(eng)), mode
        assert fig["tok_s_median"] > 0 and fig["peak_rss_mb"] > 0
    # full blocks on every step but the last of a request, which holds only what max_new_tokens leaves (as z-lab)
    assert recipe_block_size(out) - 2 < s["dflash-full"]["drafts_verified_per_step"] <= recipe_block_size(out) - 1
    assert s["ar"]["tau"] == 1.0 and set(report["ratios"]) >= {"dflash/ar", "dflash/hf", "dflash-full/ar"}
    # the prompt-lookup yardstick is reported for the speculative modes, replayed on their own output tokens
    assert {m for m in s if "tau_prompt_lookup" in s[m]} == {"dflash", "dflash-full", "reference"}
    assert all(1.0 <= s[m]["tau_prompt_lookup"] <= recipe_block_size(out) for m in ("dflash", "reference"))
    assert json.loads((tmp_path / "bench.json").read_text())["summary"].keys() == s.keys()


def test_bench_modes_take_turns_prompt_by_prompt_in_a_rotated_order(built):
    """Single stream with reps: every mode decodes a prompt before any mode starts the next, the mode that goes
    first rotates from one prompt to the next, every pass repeats the first token for token, and each pass's ratio
    is reported."""
    from dflash_export.bench.suite import run_bench

    recipe, out, eng, _ = built
    modes = ["dflash", "ar", "chain"]
    report = run_bench(str(recipe.path), str(out), None, 2, 8, modes, None, reps=2)
    raw = report["raw"]
    schedule = sorted((r["started"], m, r["pass"], r["prompt"]) for m in modes for r in raw[m]["runs"])
    assert [(p, i) for _, _, p, i in schedule] == [(p, i) for p in (0, 1) for i in (0, 1) for _ in modes]
    firsts = [m for k, (_, m, _, _) in enumerate(schedule) if k % len(modes) == 0]
    assert firsts == ["dflash", "ar", "chain", "dflash"]  # turn k starts with mode k mod 3
    for m in modes:
        runs = raw[m]["runs"]
        assert [r["tokens"] for r in runs[:2]] == [r["tokens"] for r in runs[2:]], m
        assert report["summary"][m]["identical_to_ar"] == "2/2" or (m != "ar" and not exact_on_this_cpu(eng))
        assert report["summary"][m]["tokens_total"] == sum(len(r["tokens"]) for r in runs[:2])  # one pass counted
    assert set(report["pass_ratios"]) == {"dflash/ar", "chain/ar"}
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in report["pass_ratios"].values())


def test_bench_compares_the_proposers_on_one_engine(built, monkeypatch, capsys):
    """Every proposer mode decodes the target's own output (identical to plain decoding on the engine), each with
    the prompt-lookup yardstick on its tokens and its ratio against AR; the table fits an 80-column terminal with no
    figure cut short."""
    from dflash_export.bench.suite import run_bench

    recipe, out, eng, _ = built
    monkeypatch.setenv("COLUMNS", "80")
    modes = ["ar", "chain", "tree", "lookup", "tree+lookup", "tree+lookup-full"]
    report = run_bench(str(recipe.path), str(out), None, 2, 16, modes, None)
    table = [ln for ln in capsys.readouterr().out.splitlines() if "│" in ln or "┃" in ln]
    assert max(len(ln) for ln in table) <= 80 and not any("…" in ln for ln in table), "\n".join(table)
    for mode in modes[1:]:  # a folded name: its row is the one with its tau, whole, beside the yardstick's
        tau = f"{report['summary'][mode]['tau']:.2f}"
        assert any(tau in ln and f"{report['summary'][mode]['tau_prompt_lookup']:.2f}" in ln for ln in table), mode
    s = report["summary"]
    for mode in modes[1:]:
        assert s[mode]["identical_to_ar"] == "2/2" or not exact_on_this_cpu(eng), mode
        assert "tau_prompt_lookup" in s[mode], mode
        assert f"{mode}/ar" in report["ratios"]


def test_bench_table_says_what_each_short_header_means(built, monkeypatch, capsys):
    """The caption explains every short header: `same` counts the prompts whose output equals the plain decoding
    row's (the row it names), and is said to be empty when no plain mode ran; the per-source line says what its
    parenthesised counts are."""
    from dflash_export.bench.suite import run_bench

    recipe, out, _, _ = built
    monkeypatch.setenv("COLUMNS", "80")
    run_bench(str(recipe.path), str(out), None, 1, 4, ["tree+lookup", "ar"], None)
    printed = capsys.readouterr().out
    words = " ".join(printed.split())
    ar_row = next(ln for ln in printed.splitlines() if "AR, same engine" in ln)
    assert ar_row.strip("│ ").startswith("(b)")
    assert "same: prompts whose output equals (b)'s" in words, printed
    assert "RSS MB: the mode's peak resident memory" in words
    assert "in parentheses: those no other source proposed" in words
    run_bench(str(recipe.path), str(out), None, 1, 4, ["tree+lookup"], None)
    assert "same: empty without an ar or hf mode" in " ".join(capsys.readouterr().out.split())


def recipe_block_size(engine_dir) -> int:
    return read_manifest(Path(engine_dir)).block_size


def test_bench_tau_is_pooled_over_prompts_like_the_reference():
    from dflash_export.bench.suite import _summary

    runs = [{"tokens": [1] * 8, "total_s": 1.0, "ttft_s": 0.1, "tau": 4.0, "steps": 2, "drafted": 14},
            {"tokens": [1] * 8, "total_s": 1.0, "ttft_s": 0.1, "tau": 1.0, "steps": 8, "drafted": 56}]
    s = _summary({"runs": runs, "peak_rss_mb": 1.0, "load_s": 0.0})
    assert s["tau"] == pytest.approx(16 / 10)  # not (4 + 1) / 2: a short looping answer must not pull it up
    assert s["drafts_verified_per_step"] == pytest.approx(7.0)


def test_bench_refuses_an_engine_of_another_recipe_and_bad_out_paths(built, tmp_path):
    from dflash_export.bench.suite import run_bench

    recipe, out, _, _ = built
    other = "tiny-llama" if recipe.name == "tiny-qwen3" else "tiny-qwen3"
    with pytest.raises(DFlashError, match=f"built for recipe '{recipe.name}', not '{other}'") as e:
        run_bench(other, str(out), None, 1, 4, ["ar"], None)
    assert "manifest.json: recipe" in str(e.value)
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    for bad in (tmp_path, afile / "b.json"):
        with pytest.raises(DFlashError, match="--out"):
            run_bench(recipe.name, str(out), None, 1, 4, ["ar"], str(bad))


def test_bench_refuses_a_prompt_the_engine_cannot_take_naming_the_suite_line_before_any_worker(built, tmp_path,
                                                                                                 monkeypatch):
    """A prompt too long for max_seq_len with the new tokens, or an id outside the vocabulary: one error naming the
    suite file and line from the parent (single stream and batched), not a worker's line naming neither."""
    from dflash_export.bench import suite as bench_suite

    recipe, out, engine, _ = built
    if recipe.name != "tiny-qwen3":
        pytest.skip("one recipe is enough")

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(bench_suite, "_run_interleaved", no_workers)
    monkeypatch.setattr(bench_suite, "run_concurrency", no_workers)
    f = tmp_path / "suite.jsonl"
    long = ", ".join(["5"] * (engine.info.max_seq_len - engine.info.block_size - 3))
    fits = f"exceeds the engine's max_seq_len {engine.info.max_seq_len}; --max-new-tokens 3 or fewer fits it"
    for line, what in ((f'{{"input_ids": [{long}]}}', fits),
                       (f'{{"input_ids": [3, {engine.info.vocab_size}]}}', "is outside the vocabulary")):
        f.write_text('{"prompt": "fine"}\n' + line + "\n")
        for run in (lambda: bench_suite.run_bench(recipe.name, str(out), str(f), 2, 4, ["ar"], None),
                    lambda: bench_suite.run_concurrency_bench(recipe.name, str(out), str(f), 2, 4, [1], ["ar"], None)):
            with pytest.raises(DFlashError, match=what) as e:
                run()
            assert str(e.value).startswith(f"{f}: line 2: ") and e.value.exit_code == 2, e.value
    # the same prompt with fewer new tokens fits: the check counts the tokens asked for
    f.write_text(f'{{"input_ids": [{long}]}}\n')
    with pytest.raises(AssertionError, match="a worker was started"):
        bench_suite.run_bench(recipe.name, str(out), str(f), 1, 3, ["ar"], None)


def test_bench_worker_failure_is_one_line_naming_the_file(built, tmp_path, capsys):
    """A worker's DFlashError travels to the parent whole (file and field); anything else becomes a short line."""
    import shutil

    from dflash_export.bench.suite import _job_recipe, _worker_failure, _worker_main
    from dflash_export.models.sources import resolve_source
    from dflash_export.recipes import load_recipe

    recipe, _, _, _ = built
    if recipe.name != "tiny-qwen3":
        pytest.skip("one recipe is enough")
    target = tmp_path / "target"
    shutil.copytree(resolve_source("tiny:qwen3/target"), target)
    with open(target / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    y = tmp_path / "trunc.yaml"
    y.write_text(f"name: trunc\ntarget: {target}\ndrafter: tiny:qwen3/drafter\nmax_seq_len: 256\n"
                 "chat_template: false\n")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mode": "hf", "recipe": _job_recipe(load_recipe(y)), "engine": "", "prompts": [[1, 2]],
                               "max_new": 2}))
    assert _worker_main(str(job)) == 2  # the worker process body, in-process
    err = _worker_failure("hf", 2, "some warning\n" + capsys.readouterr().err)
    msg = str(err)
    assert msg.startswith(str(target)) and msg.endswith("(bench mode hf)") and "\n" not in msg, msg
    short = str(_worker_failure("hf", 1, "Traceback (most recent call last):\n  ...\nValueError: boom\n"))
    assert short == "--modes hf: benchmark worker failed: ValueError: boom"
    assert "signal 9" in str(_worker_failure("ar", -9, ""))


def test_bench_runs_a_prompt_that_fills_the_context_with_fewer_new_tokens_than_its_warm_ups(built, tmp_path,
                                                                                              capsys):
    """A prompt of max_seq_len - block - 7 tokens with 7 new tokens fits the engine exactly (prompt + new tokens + a
    block); the bench's warm-ups (16 new tokens a worker, 8 a concurrency level) must not refuse it."""
    from dflash_export.bench.concurrency import run_concurrency
    from dflash_export.bench.suite import WORKER_REPLY, _job_recipe, _worker_main

    recipe, out, engine, _ = built
    if recipe.name != "tiny-qwen3":
        pytest.skip("one recipe is enough")
    new = 7
    prompt = [3 + (i * 7) % 200 for i in range(engine.info.max_seq_len - engine.info.block_size - new)]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mode": "ar", "recipe": _job_recipe(recipe), "engine": str(out), "prompts": [prompt],
                               "max_new": new}))
    assert _worker_main(str(job), ["0\n", "done\n"]) == 0, capsys.readouterr().err
    replies = [json.loads(ln[len(WORKER_REPLY):]) for ln in capsys.readouterr().out.splitlines()
               if ln.startswith(WORKER_REPLY)]
    assert [len(r["run"]["tokens"]) for r in replies if "run" in r] == [new]
    rep = run_concurrency(str(out), [prompt], new, [1], ["dflash", "ar"], threads=1)
    assert [r["tokens"] for r in rep["levels"]] == [new, new]


def test_concurrency_bench_reports_every_level_and_compares_with_alone(built, tmp_path):
    from dflash_export.bench.concurrency import run_concurrency

    _, out, eng, _ = built
    rep = run_concurrency(str(out), PROMPTS, 12, [1, 3], ["dflash", "ar"], threads=1)
    assert [(r["concurrency"], r["mode"]) for r in rep["levels"]] == [(1, "dflash"), (1, "ar"), (3, "dflash"),
                                                                      (3, "ar")]
    for r in rep["levels"]:
        assert r["identical_to_alone"] == "5/5" or not exact_on_this_cpu(eng)
        assert r["tokens"] == 60 and r["tok_s"] > 0
        assert r["latency_p50_s"] <= r["latency_p99_s"]
        assert r["target_rows"] >= r["engine_steps"] > 0 and r["modelled_cost"] >= r["engine_steps"]
        if r["mode"] == "ar":  # plain decoding: one row per sequence per call, no drafter, cost 1 + a(B - 1)
            assert r["draft_calls"] == r["probes"] == 0 and r["target_rows"] == r["tokens"] - 5  # 1st: prefill
    assert rep["divergences"] == [] or not exact_on_this_cpu(eng)


def test_concurrency_bench_table_fits_80_columns_with_no_header_cut(built, monkeypatch, capsys):
    from dflash_export.bench.concurrency import run_concurrency

    _, out, _, _ = built
    monkeypatch.setenv("COLUMNS", "80")
    run_concurrency(str(out), PROMPTS[:2], 4, [1, 2], ["dflash", "ar"], threads=1)
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.strip().startswith("conc-"))
    table = lines[head:head + 7]  # the two header lines, the rule and the four rows
    assert max(len(ln.rstrip()) for ln in table) <= 80 and not any("…" in ln for ln in table), "\n".join(table)
    assert "drafts" in table[0] and "peak MB" in table[1], "\n".join(table)


def test_concurrency_bench_gives_the_pass_by_pass_ratio_with_reps(built):
    from dflash_export.bench.concurrency import run_concurrency

    _, out, _, _ = built
    rep = run_concurrency(str(out), PROMPTS[:2], 4, [2], ["dflash", "ar"], threads=1, reps=2)
    d = next(r for r in rep["levels"] if r["mode"] == "dflash")
    assert len(d["pass_ratios_vs_ar"]) == 2 and all(x > 0 for x in d["pass_ratios_vs_ar"])
    # what a client waits, pass by pass: plain decoding's p50 latency over DFlash's
    assert len(d["p50_latency_ratios_vs_ar"]) == 2 and all(x > 0 for x in d["p50_latency_ratios_vs_ar"])
    assert d["identical_runs"] == [True, True]


def test_bench_samples_with_the_same_seeds_in_every_mode(built):
    """bench --temperature / --top-k / --top-p: sampled DFlash (the walk, chain and tree+lookup) emits what plain
    sampled decoding on the same engine emits for every prompt, alone and under continuous batching."""
    from dflash_export.bench.concurrency import run_concurrency
    from dflash_export.bench.suite import run_bench

    recipe, out, eng, _ = built
    sampling = {"temperature": 0.7, "top_k": 20, "top_p": 0.95}
    report = run_bench(str(recipe.path), str(out), None, 2, 12, ["dflash", "tree+lookup", "ar"], None, sampling)
    assert report["sampling"] == sampling
    exact = exact_on_this_cpu(eng)  # else each count may fall short at a near-tie of a draw
    for mode in ("dflash", "tree+lookup"):
        assert report["summary"][mode]["identical_to_ar"] == "2/2" or not exact, mode
    rep = run_concurrency(str(out), PROMPTS, 12, [1, 3], ["dflash", "ar"], threads=1, sampling=sampling)
    assert [r["identical_to_plain"] for r in rep["levels"] if r["mode"] == "dflash"] == ["5/5", "5/5"] or not exact
    assert (rep["divergences"] == [] and all(r["identical_to_alone"] == "5/5" for r in rep["levels"])) or not exact


def test_moe_costs_benchmark_times_every_form_and_the_expert_union(tmp_path):
    """benchmarks/moe_costs.py on its smoke-test shape (8 experts, 2 per token): every form at every precision and
    row count, the bound from the bandwidth probe, and the union of experts a block touches, between k and E and
    growing with the block."""
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, "benchmarks/moe_costs.py", "--shape", "tiny", "--layers", "1", "--rounds", "1",
                        "--reps", "1", "--bandwidth-mib", "8", "--cache", str(tmp_path / "cache"), "--json",
                        str(out)], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert set(rep["precisions"]) == {"fp32", "int8", "int4"}
    assert set(rep["precisions"]["fp32"]["ms"]) == {"sparse", "active", "dense"}
    assert set(rep["precisions"]["int4"]["ms"]) == {"sparse", "active"}
    for row in rep["precisions"].values():
        assert row["bound_ms"] > 0 and all(v > 0 for per in row["ms"].values() for v in per.values())
    union = [rep["expert_union"][str(n)] for n in (2, 4, 8, 16)]
    assert 2 <= union[0] <= union[1] <= union[2] <= union[3] <= 8


def test_bench_counts_accepted_drafts_per_source_with_and_without_the_static_index(built, tmp_path, capsys):
    """The +static modes merge the engine's static n-gram index, the others leave it out; every mode's accepted
    drafts are counted per source (a chain's are all the drafter's: its acceptance lengths less the bonus tokens),
    outputs stay identical to plain decoding, and a +static mode on an engine without an index is one error."""
    import shutil

    from dflash_export.bench.suite import run_bench
    from dflash_export.decoding.static_ngrams import StaticNgramIndex, store_static_index
    from dflash_export.engines.manifest import write_manifest

    recipe, out, eng, _ = built
    engine = tmp_path / "engine"
    shutil.copytree(out, engine)
    raw = json.loads((engine / "manifest.json").read_text())
    raw.pop("files")
    answers = [[3 + (i * 7 + j) % 200 for j in range(40)] for i in range(8)]
    raw["static_ngrams"] = store_static_index(engine, StaticNgramIndex.from_answers(answers), len(answers), 320)
    write_manifest(engine, raw)
    modes = ["ar", "chain", "tree+lookup", "tree+lookup+static", "lookup+static"]
    report = run_bench(str(recipe.path), str(engine), None, 2, 16, modes, None)
    s, raw_runs = report["summary"], report["raw"]
    for mode in modes[1:]:
        assert s[mode]["identical_to_ar"] == "2/2" or not exact_on_this_cpu(eng), mode
        assert set(s[mode]["accepted_by"]) == {"drafter", "context", "static"}
    accepted = sum(round(r["tau"] * r["steps"]) - r["steps"] for r in raw_runs["chain"]["runs"])
    assert s["chain"]["accepted_by"] == {"drafter": accepted, "context": 0, "static": 0}
    assert s["tree+lookup"]["accepted_by"]["static"] == 0
    assert "accepted drafts by source" in capsys.readouterr().out
    with pytest.raises(DFlashError, match="static"):
        run_bench(str(recipe.path), str(out), None, 1, 8, ["lookup+static"], None)
