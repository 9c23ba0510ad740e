"""`dflash-export validate`: a healthy engine passes, planted faults fail for the right reason, reports hold together,
malformed suites are refused with their line number.

A random tiny drafter has τ ≈ 1, which cannot show a τ collapse, so the session first trains one (a few seconds, cached
on disk) on the tiny Qwen3 target's own greedy outputs for the `tiny-random` prompts: with correct taps it reaches τ ≈ 4
on them, and feeding it the wrong layers' outputs visibly lowers τ.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from target_support import report_exact_on_this_cpu

from dflash_export.errors import CheckFailed, DFlashError

MAX_NEW = 16      # the trained drafter memorised 20 tokens per prompt: stay inside them
NUM_PROMPTS = 3
_TRAIN_VERSION = 1


def _suite_ids(vocab_size: int, mask_id: int) -> list[list[int]]:
    from dflash_export.models.tokenization import ByteCodec
    from dflash_export.validate.suites import encode_prompt, load_suite

    path, prompts = load_suite("tiny-random")
    codec = ByteCodec(vocab_size, {mask_id})
    return [encode_prompt(p, codec, False, vocab_size, path) for p in prompts]


def _train_drafter(out: Path) -> None:
    """Fit the tiny drafter to the target's greedy continuations (hard labels) with the train module's block layout."""
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.drafter import save_drafter
    from dflash_export.train.blocks import build_blocks, train_forward
    from dflash_export.train.data import generate_sequences, synthetic_prompt_ids

    torch.manual_seed(0)
    target = load_target("tiny:qwen3/target")
    drafter = load_drafter("tiny:qwen3/drafter")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    cfg = drafter.config
    prompts = list(enumerate(_suite_ids(target.vocab_size, cfg.mask_token_id)))
    prompts += [(100 + i, ids) for i, ids in synthetic_prompt_ids(target.vocab_size, 8, seed=0)]
    seqs = generate_sequences(target, prompts, cfg.target_layer_ids, max_new_tokens=20, batch_size=16)
    anchors = [list(range(s.prompt_len, len(s.ids) - 1)) for s in seqs]
    batch = build_blocks(seqs, anchors, cfg.block_size, cfg.mask_token_id)
    batch.taps = batch.taps.clone()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    drafter.train()
    bs = cfg.block_size
    for _ in range(100):
        hidden = train_forward(drafter, target.embed, batch)
        b, nq, h = hidden.shape
        logits = target.lm_head(hidden.view(b, nq // bs, bs, h)[:, :, 1:])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_drafter(drafter.eval(), out)


@pytest.fixture(scope="session")
def trained_drafter_dir() -> Path:
    from dflash_export.files import cache_dir

    suite = (Path(__file__).resolve().parent.parent / "validate" / "tiny-random.jsonl").read_bytes()
    key = hashlib.sha256(suite + f"v{_TRAIN_VERSION}".encode()).hexdigest()[:10]
    out = cache_dir() / "tests" / f"validate-trained-drafter-{key}"
    if not (out / "config.json").is_file():
        _train_drafter(out)
    return out


@pytest.fixture(scope="session")
def recipe_path(trained_drafter_dir, tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("recipe") / "tiny-trained.yaml"
    p.write_text(
        "name: tiny-trained\n"
        "target: tiny:qwen3/target\n"
        f"drafter: {trained_drafter_dir}\n"
        "dtype: float32\nmax_seq_len: 256\nchat_template: false\nsuite: tiny-random\n"
        # speed on a tiny model measures the machine's load, not DFlash: no floor (the floor's own tests set one)
        "thresholds:\n  min_identical_fraction: 1.0\n  min_tau: 3.0\n  min_distribution_p_value: 0.001\n"
        "  min_speedup_vs_ar: 0.0\n"
    )
    return p


@pytest.fixture(scope="session")
def recipe(recipe_path):
    from dflash_export.recipes import load_recipe

    return load_recipe(recipe_path)


@pytest.fixture(scope="session")
def reference(recipe):
    from dflash_export.validate.runner import Reference

    return Reference.from_recipe(recipe)


@pytest.fixture(scope="session")
def prompts(trained_drafter_dir):
    from dflash_export.models.tiny import TINY

    spec = TINY["qwen3"]
    return [(f"p{i}", ids) for i, ids in enumerate(_suite_ids(spec.vocab_size, spec.mask_token_id)[:NUM_PROMPTS])]


def _engine(recipe, cls=None, target=None):
    from dflash_export.engines.torch_ref import TorchEngine
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter

    cls = cls or TorchEngine
    return cls(target or load_target(recipe.target_path), load_drafter(recipe.drafter_path), recipe.name,
               recipe.max_seq_len)


def _run(recipe, engine, reference, prompts, **opts):
    from dflash_export.validate.runner import ValidateOptions, run_validation

    o = dict(max_new_tokens=MAX_NEW, temperature=0.0, dist_samples=0, warmup=1)
    o.update(opts)
    return run_validation(recipe, engine, reference, prompts, ValidateOptions(**o))


def _failed(report) -> set[str]:
    return {t["name"] for t in report.failures}


# ---------------------------------------------------------------------------------------------------------------------
# A healthy engine, through the CLI, and its report


@pytest.fixture(scope="session")
def healthy_cli_run(recipe_path, recipe, tmp_path_factory):
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.manifest import write_manifest

    root = tmp_path_factory.mktemp("healthy")
    engine_dir = root / "engine"
    engine_dir.mkdir()
    write_manifest(engine_dir, {"backend": "pytorch", "recipe": recipe.name, "recipe_path": str(recipe_path),
                                "block_size": 4, "mask_token_id": 255})
    report_dir = root / "report"
    res = CliRunner().invoke(main, ["validate", "--recipe", str(recipe_path), "--engine", str(engine_dir),
                                    "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW),
                                    "--dist-samples", "40", "--repeats", "2", "--report", str(report_dir),
                                    "--no-progress"])
    return res, report_dir


def test_healthy_engine_passes_every_threshold(healthy_cli_run):
    res, _ = healthy_cli_run
    assert res.exit_code == 0, res.output
    assert "FAIL" not in res.output
    assert "distribution_p_value" in res.output and "deterministic_fraction" in res.output


def test_report_files_parse_and_their_figures_agree(healthy_cli_run):
    _, out = healthy_cli_run
    rep = json.loads((out / "report.json").read_text())
    assert rep["passed"] is True
    g, a, s, d = rep["greedy"], rep["acceptance"], rep["speed"], rep["distribution"]
    assert g["prompts"] == NUM_PROMPTS == len(g["per_prompt"])
    assert g["identical_fraction"] == sum(r["identical"] for r in g["per_prompt"]) / g["prompts"] == 1.0
    assert all(r["first_divergence"] is None and r["diagnosis"] == "identical" for r in g["per_prompt"])
    hist = {int(k): v for k, v in a["histogram"].items()}
    assert sorted(hist) == [1, 2, 3, 4] and sum(hist.values()) == a["steps"]
    assert a["tau"] == pytest.approx(sum(k * v for k, v in hist.items()) / a["steps"])
    assert a["tau"] > 3.0
    # Lossless: the engine's own acceptance and the one judged against the reference target agree (the last,
    # truncated step of a prompt may be judged short).
    assert a["tau"] - 0.5 <= a["tau_online"] <= a["tau"] + 1e-9
    # the prompt-lookup yardstick on the same tokens, pooled like tau, from per-prompt figures in [1, bs]
    assert all(1.0 <= r["tau_prompt_lookup"] <= a["block_size"] for r in g["per_prompt"])
    assert 1.0 <= a["tau_prompt_lookup"] <= a["block_size"]
    for p in s["per_prompt"]:
        assert p["speedup_vs_ar"] == pytest.approx(p["engine_dflash_tok_s"] / p["engine_ar_tok_s"])
    assert s["speedup_vs_ar"] == pytest.approx(np.median([p["speedup_vs_ar"] for p in s["per_prompt"]]))
    cm = s["cost_model"]
    assert cm["step_ms"] == pytest.approx(cm["draft_ms"] + cm["verify_ms"] + cm["dflash_overhead_ms"])
    assert cm["dflash_overhead_ms"] >= 0 and cm["ar_overhead_ms"] >= 0
    assert cm["predicted_speedup_vs_ar"] == pytest.approx(cm["tau"] * cm["ar_step_ms"] / cm["step_ms"])
    # The tau-weighted model explains the measured decode speedup (only the truncated last step separates them).
    assert cm["predicted_speedup_vs_ar"] == pytest.approx(cm["measured_decode_speedup_vs_ar"], rel=0.35)
    assert d["ran"] and 0.0 <= d["p_value"] <= 1.0 and d["impossible_tokens"] == 0
    by_name = {t["name"]: t for t in rep["thresholds"]}
    assert by_name["tau"]["value"] == a["tau"] and by_name["distribution_p_value"]["value"] == d["p_value"]
    assert {"versions", "machine"} <= set(rep["environment"])
    md = (out / "report.md").read_text()
    assert "**PASS**" in md and "| tau |" in md and f"{a['tau']:.2f}" in md
    from matplotlib.image import imread

    for name in ("tau_histogram.png", "speedup_per_prompt.png", "tokens_per_s.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert imread(out / name).shape[0] > 100


def test_plot_titles_fit_inside_their_figures(healthy_cli_run, tmp_path, monkeypatch):
    """Every plot's title lies inside its PNG, for the longest shipped recipe name and the narrowest figure."""
    import matplotlib.figure

    from dflash_export.recipes import list_recipes
    from dflash_export.validate.report import _plots
    from dflash_export.validate.runner import ValidationReport

    _, out = healthy_cli_run
    rep = json.loads((out / "report.json").read_text())
    keys = ("engine", "suite", "options", "greedy", "acceptance", "distribution", "speed", "thresholds")
    report = ValidationReport(recipe=max(list_recipes(), key=len), **{k: rep[k] for k in keys})
    seen = []
    save = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        save(fig, *args, **kwargs)  # drawn: the extents are the PNG's
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            if ax.get_title():
                box = ax.title.get_window_extent(renderer)
                seen.append((ax.get_title(), box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    _plots(report, tmp_path)
    assert len(seen) == 3 and all(inside for _, inside in seen), seen


def test_too_few_prompts_and_seeds_are_warned_about_and_progress_shows_on_a_pipe(recipe_path, recipe, tmp_path):
    """`--num-prompts 1 --dist-samples 1` still runs, but says what so little cannot show (the greedy bound is the
    exact 95 % one for 0 divergent of n: 1 - 0.05^(1/n)); with stderr not a terminal, progress comes as lines."""
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.manifest import write_manifest
    from dflash_export.validate.command import power_warnings

    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    write_manifest(engine_dir, {"backend": "pytorch", "recipe": recipe.name, "recipe_path": str(recipe_path),
                                "block_size": 4, "mask_token_id": 255})
    res = CliRunner().invoke(main, ["validate", "--recipe", str(recipe_path), "--engine", str(engine_dir),
                                    "--num-prompts", "1", "--max-new-tokens", "8", "--dist-samples", "1",
                                    "--report", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 2, res.stderr
    assert "1 prompt(s)" in warnings[0] and "only below 95%" in warnings[0]
    assert "1 seed(s) x 1 prompt(s)" in warnings[1] and "says next to nothing" in warnings[1]
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith("[") and " s] " in ln]
    assert progress and progress[-1].split(" s] ")[1].startswith("3/3 "), res.stderr
    # the thresholds of the power table (docs/stages.md): measured with 2 prompts, so seeds x prompts / 2 counts
    assert "only below 28%" in power_warnings(9, 2, 300, 0.7)[0]  # 1 - 0.05 ** (1 / 9) = 0.283
    assert power_warnings(10, 2, 300, 0.7) == [] and power_warnings(50, 2, 600, 1.0) == []
    assert "not reliably a dropped 3-10 % nucleus token" in power_warnings(10, 2, 100, 0.7)[0]
    assert "not reliably" in power_warnings(10, 1, 200, 0.7)[0]  # 200 x 1 prompt = 100 x 2
    assert "about 50 and 65 seeds" in power_warnings(10, 2, 40, 0.7)[0]
    assert "not tested" in power_warnings(10, 2, 40, 0.0)[0]


def test_a_missing_report_library_is_exit_2_before_any_work(recipe_path, tmp_path, monkeypatch):
    """A validate whose plots cannot be drawn (no matplotlib) says so first, with the install line, exit 2 -- not
    after minutes of work with exit 1, the code of a failed threshold."""
    import importlib.util

    from click.testing import CliRunner

    from dflash_export.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    res = CliRunner().invoke(main, ["validate", "--recipe", str(recipe_path), "--engine", str(tmp_path / "none")])
    assert res.exit_code == 2, res.output
    assert "error: matplotlib: not installed; validate's report needs it: pip install 'dflash-export[validate]'" \
        in res.output


def test_onnxruntime_engine_found_by_default_path_passes(recipe_path, recipe, tmp_path, monkeypatch):
    """The shipped backend, built for real, validated the way a deployer runs it: no --engine, default location."""
    pytest.importorskip("onnxruntime")
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.ort_build import build_onnxruntime

    build_onnxruntime(recipe, tmp_path / "engines" / recipe.name / "onnxruntime", threads=1)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["validate", "--recipe", str(recipe_path), "--num-prompts", "2",
                                    "--max-new-tokens", str(MAX_NEW), "--dist-samples", "30", "--no-progress"])
    rep = json.loads((tmp_path / "reports" / "validate" / recipe.name / "onnxruntime" / "report.json").read_text())
    assert rep["engine"]["backend"] == "onnxruntime" and rep["engine"]["dir"].endswith("onnxruntime")
    assert rep["acceptance"]["tau"] > 3.0
    if report_exact_on_this_cpu(rep):
        assert res.exit_code == 0, res.output
        assert rep["greedy"]["identical_fraction"] == 1.0
    else:  # a near-tie may part DFlash from plain decoding: identical_fraction alone may fail, and says why
        assert {t["name"] for t in rep["thresholds"] if not t["passed"]} <= {"identical_fraction"}, res.output


def test_each_engine_build_gets_its_own_default_report(recipe_path, recipe, tmp_path, monkeypatch):
    """Validating the fp32 engine and then the int8 one of the same recipe without --report keeps both reports: each
    goes to reports/validate/<recipe>/<the engine directory's name>, and its title names that build."""
    pytest.importorskip("onnxruntime")
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.ort_build import build_onnxruntime

    engines = tmp_path / "engines" / recipe.name
    for precision in ("fp32", "int8"):
        build_onnxruntime(recipe, engines / ("onnxruntime" if precision == "fp32" else "onnxruntime-int8"), threads=1,
                          precision=precision)
    monkeypatch.chdir(tmp_path)
    for name in ("onnxruntime", "onnxruntime-int8"):
        res = CliRunner().invoke(main, ["validate", "--recipe", str(recipe_path), "--engine", str(engines / name),
                                        "--num-prompts", "1", "--max-new-tokens", "8", "--dist-samples", "0",
                                        "--no-progress"])
        assert res.exit_code in (0, 1), res.output
    for name in ("onnxruntime", "onnxruntime-int8"):
        report = tmp_path / "reports" / "validate" / recipe.name / name
        assert Path(json.loads((report / "report.json").read_text())["engine"]["dir"]).name == name
        assert (report / "report.md").read_text().startswith(f"# dflash-export validate: {recipe.name} ({name}) ")


# ---------------------------------------------------------------------------------------------------------------------
# Planted faults


def test_wrong_tap_offset_collapses_tau(recipe, reference, prompts):
    engine = _engine(recipe)
    # The classic export bug: tap hidden_states[id] (the layer's input) instead of hidden_states[id + 1].
    engine.info.target_layer_ids = [i - 1 for i in engine.info.target_layer_ids]
    report = _run(recipe, engine, reference, prompts)
    assert _failed(report) == {"tau"}, report.thresholds
    assert report.acceptance["tau"] < 3.0
    assert report.greedy["identical_fraction"] == 1.0  # taps only slow it down; greedy output stays lossless
    assert report.distribution == {"ran": False, "reason": "temperature 0: sampled check skipped"}


def test_skipped_sampled_check_says_which_option_skipped_it(recipe, reference, prompts):
    report = _run(recipe, _engine(recipe), reference, prompts[:1], temperature=0.7, dist_samples=0)
    assert report.distribution == {"ran": False, "reason": "--dist-samples 0: sampled check skipped"}


def test_perturbed_target_weight_fails_with_first_divergence(recipe, reference, prompts):
    from dflash_export.models import load_target

    target = load_target(recipe.target_path)
    with torch.no_grad():
        w = target.hf.model.layers[2].mlp.down_proj.weight
        w.add_(0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    report = _run(recipe, _engine(recipe, target=target), reference, prompts)
    assert "identical_fraction" in _failed(report)
    bad = [r for r in report.greedy["per_prompt"] if not r["identical"]]
    assert bad
    r = bad[0]
    assert r["diagnosis"] == "export changed the model" and not r["engine_ar_identical"]
    w = r["around_divergence"]
    at = min(r["first_divergence"], 4)
    assert w["engine"][:at] == w["reference"][:at] and w["engine"][at] != w["reference"][at]
    note = {t["name"]: t for t in report.thresholds}["identical_fraction"]["note"]
    assert f"at token {r['first_divergence']}" in note
    from dflash_export.validate.report import render_markdown

    md = render_markdown(report)
    assert "**FAIL**" in md and f"| {r['id']} | {r['first_divergence']} | export changed the model |" in md
    r["id"] = "a|b\nc"  # a suite's id as written: one row of the divergence table still, its bar escaped
    rows = [line for line in render_markdown(report).splitlines() if "export changed the model |" in line]
    assert rows[0].startswith("| a\\|b⏎c | ") and len(rows) == len(bad[:10])


def test_broken_sampler_fails_the_distribution_check(recipe, reference, prompts):
    from dflash_export.decoding.sampling import probs_from_logits, sample_from
    from dflash_export.engines.torch_ref import TorchEngine

    class SkipsRejection(TorchEngine):
        """Takes every sampled draft (no p/q test): outputs follow the drafter's distribution, not the target's. It
        samples chains (no host-side walk), so the runtime hands it the chain's uniforms."""

        host_accept = False

        @torch.inference_mode()
        def verify(self, seq, block, draft_probs, sp, uniforms, accept=None):
            if sp.greedy:
                return super().verify(seq, block, draft_probs, sp, uniforms, accept=accept)
            bs = len(block)
            pos = torch.arange(seq.length, seq.length + bs)[None]
            out = self.target.forward(torch.from_numpy(block)[None], pos, seq.t_cache, self.info.target_layer_ids)
            p = probs_from_logits(out.logits[0, -1].double().numpy(), sp.temperature, sp.top_k, sp.top_p)
            accept = bs - 1
            seq.length += bs
            seq.taps, seq.taps_pos = out.taps, pos
            return accept, [int(t) for t in block[1:]] + [sample_from(p, uniforms[-1])]

    report = _run(recipe, _engine(recipe, SkipsRejection), reference, prompts[:1], temperature=1.0,
                  dist_samples=40, dist_prompts=1)
    assert _failed(report) == {"distribution_p_value"}, report.thresholds
    assert report.distribution["p_value"] < 1e-3


def test_healthy_sampler_passes_with_top_k_and_top_p(recipe, reference, prompts):
    report = _run(recipe, _engine(recipe), reference, prompts[1:2], temperature=0.8, top_k=20, top_p=0.9,
                  dist_samples=40, dist_prompts=1)
    d = report.distribution
    assert report.passed, report.thresholds
    assert d["impossible_tokens"] == 0 and d["top_k"] == 20 and d["top_p"] == 0.9 and d["tested_tokens"] == 40 * 4


# ---------------------------------------------------------------------------------------------------------------------
# Planted subtle sampling faults against the distribution check at its DEFAULT settings (T 0.7, top-p 0.9, 300 seeds
# x 2 prompts). The random tiny target is nearly uniform over its 256 tokens (top probability ~0.03 at T=1), which no
# LLM is; its LM head scaled by 5 (= sampling it at T/5) gives conditionals like a real model's at T=0.7 / top-p 0.9
# (top probability 0.45-0.85 over 2-7 tokens). Greedy output, and with it the trained drafter's fit, is unchanged: the
# drafter reads the same LM head. benchmarks/sampling_power.py measures the same on 20 seeds per row (README).

SHARPEN = 5.0


def sharpened_target(scale: float = SHARPEN):
    from dflash_export.models import load_target

    target = load_target("tiny:qwen3/target")
    with torch.no_grad():
        target.hf.get_output_embeddings().weight.mul_(scale)
    return target


@pytest.fixture(scope="module")
def sharp(recipe):
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.validate.runner import Reference

    return sharpened_target(), load_drafter(recipe.drafter_path), Reference(sharpened_target(),
                                                                            load_drafter(recipe.drafter_path))


def _default_distribution_check(recipe, sharp, fault, seed=0):
    """validate at its defaults on the sharpened pair (the greedy half on the two prompts the T>0 half samples)."""
    from dflash_export.validate.faults import faulty_engine
    from dflash_export.validate.runner import ValidateOptions, run_validation

    target, drafter, reference = sharp
    from dflash_export.models.tiny import TINY

    spec = TINY["qwen3"]
    suite = _suite_ids(spec.vocab_size, spec.mask_token_id)
    prompts = [(f"p{i}", ids) for i, ids in enumerate(sorted(suite, key=len)[:2])]
    engine = faulty_engine(fault, target, drafter, recipe.name, recipe.max_seq_len)
    opts = ValidateOptions(max_new_tokens=MAX_NEW, dist_seed=seed)
    d = ValidateOptions()
    assert (opts.temperature, opts.top_p, opts.dist_samples, opts.dist_prompts) == (d.temperature, d.top_p, 300, 2)
    # the two shortest suite prompts: what the distribution check samples from anyway; the greedy half runs on them
    report = run_validation(recipe, engine, reference, prompts, opts)
    return report


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["residual_from_p", "bonus_from_wrong_row", "top_p_off_by_one",
                                   "temperature_twice", "draft_probs_wrong_slot", "walk_one_uniform",
                                   "walk_parent_row", "walk_argmax_child"])
def test_each_planted_sampling_fault_fails_validate_at_its_defaults(recipe, sharp, fault):
    report = _default_distribution_check(recipe, sharp, fault)
    d = report.distribution
    assert "distribution_p_value" in _failed(report), (fault, d)
    assert d["p_value"] < 1e-3 and d["samples_per_prompt"] == 300, (fault, d)
    assert report.greedy["identical_fraction"] == 1.0  # greedy cannot see a sampling fault


@pytest.mark.slow
def test_correct_sampler_passes_validate_at_its_defaults(recipe, sharp):
    """Seed 0 of the benchmark's 20 (README: 20 seeds, at most 1 false alarm allowed, 0 seen; the statistic's own
    calibration over 20 seeds is the next test, on synthetic exact draws, in seconds)."""
    report = _default_distribution_check(recipe, sharp, None)
    d = report.distribution
    assert d["p_value"] >= 1e-3 and d["impossible_tokens"] == 0, d
    assert "distribution_p_value" not in _failed(report)


def test_g_test_null_calibration_over_20_seeds_and_power_against_a_dropped_token():
    """The statistic alone on exact draws from known conditionals (a prefix tree of thin and thick nodes, like the
    sampled check's): 20 seeds give at most one p < 1e-3 and a roughly uniform spread; dropping one 5 % token from the
    sampler (the top-p fault's signature) is caught."""
    from dflash_export.validate.checks import conditional_g_test

    def tree(rng, drop=False):
        groups = []
        for _ in range(40):
            k = int(rng.integers(2, 7))
            p = np.zeros(64)
            p[rng.choice(64, k, replace=False)] = rng.dirichlet(np.ones(k))
            p[int(np.argsort(-p)[0])] += 0.05
            p /= p.sum()
            n = int(rng.choice([1, 2, 5, 20, 80, 300]))
            q = p.copy()
            if drop:  # the smallest-but-not-negligible token never drawn
                q[int(np.argsort(-p)[k - 1])] = 0.0
                q /= q.sum()
            toks = rng.choice(64, n, p=q)
            counts: dict[int, int] = {}
            for t in toks:
                counts[int(t)] = counts.get(int(t), 0) + 1
            groups.append((p, counts))
        return groups

    ps = [conditional_g_test(tree(np.random.default_rng(seed)), seed=seed).p_value for seed in range(20)]
    assert sum(p < 1e-3 for p in ps) <= 1 and sum(p < 0.5 for p in ps) in range(4, 17), ps
    assert conditional_g_test(tree(np.random.default_rng(99), drop=True)).p_value < 1e-3


def test_g_test_catches_a_sampler_sharper_than_the_target_on_prefixes_seen_once():
    """Most sampled prefixes are seen once; a sampler drawing from p^(1/0.7) renormalised (temperature applied twice
    at T 0.7) picks likelier tokens, so G falls below its null mean: the two-sided p-value catches it, where the upper
    tail alone (computed here from the fit's moments) reads it as a perfect fit. Exact draws still pass."""
    from scipy.stats import chi2

    from dflash_export.validate.checks import conditional_g_test

    def groups(rng, sharpen):
        out = []
        for _ in range(600):
            k = int(rng.integers(3, 9))
            p = np.zeros(64)
            p[rng.choice(64, k, replace=False)] = rng.dirichlet(np.ones(k))
            q = p ** (1 / 0.7) if sharpen else p
            out.append((p, {int(rng.choice(64, p=q / q.sum())): 1}))
        return out

    fit = conditional_g_test(groups(np.random.default_rng(1), sharpen=True))
    scale, dof = fit.null_var / (2 * fit.null_mean), 2 * fit.null_mean ** 2 / fit.null_var
    assert fit.statistic < fit.null_mean and chi2.sf(fit.statistic / scale, dof) > 0.5  # upper tail: no alarm
    assert fit.p_value < 1e-3, fit
    assert conditional_g_test(groups(np.random.default_rng(2), sharpen=False)).p_value > 1e-3


def test_g_test_on_peaked_conditionals_reads_the_likeliest_outcome_as_typical():
    """Prefixes whose conditional puts 1 - 1e-5 on one token carry their null variance in a token the simulation
    rarely or never draws. Every prefix drawing its likely token (probability (1 - 1e-5)^20 > 0.9998) is the most
    typical outcome there is: p stays high rather than a crash on a zero simulated variance or a p of 0.01 from a
    chi-square of near-zero dof. One rare draw among 400 prefixes (binomial tail P(K >= 1) = 1 - (1 - 1e-5)^400 =
    0.00399) must not read as rarer than that."""
    from scipy.stats import binom

    from dflash_export.validate.checks import conditional_g_test

    p = np.array([1 - 1e-5, 1e-5])
    for seed in range(5):
        assert conditional_g_test([(p, {0: 1})] * 20, seed=seed).p_value > 0.5
    tail = binom.sf(0, 400, 1e-5)
    for seed in range(3):
        assert conditional_g_test([(p, {1: 1})] + [(p, {0: 1})] * 399, seed=seed).p_value >= tail


def test_g_test_where_g_cannot_vary_under_the_null():
    """A prefix uniform over its k tokens and seen once has G = 2 ln k whatever is drawn: the sum is a constant under
    the null (zero variance), so any draw fits (p = 1)."""
    from dflash_export.validate.checks import conditional_g_test

    fit = conditional_g_test([(np.full(4, 0.25), {2: 1})] * 3 + [(np.array([0.5, 0.5, 0.0]), {1: 1})])
    assert fit.statistic == pytest.approx(3 * 2 * np.log(4) + 2 * np.log(2))
    assert fit.p_value == 1.0


def test_speculation_fault_is_told_apart_from_an_export_fault(recipe, reference, prompts):
    from dflash_export.engines.torch_ref import TorchEngine

    class WrongSecondBonus(TorchEngine):
        """The second DFlash step emits a wrong bonus token; the target itself (and so AR decoding) is intact."""

        def new_sequence(self, max_tokens=None):
            self.steps = 0
            return super().new_sequence(max_tokens)

        @torch.inference_mode()
        def verify(self, seq, block, draft_probs, sp, uniforms):
            accept, emitted = super().verify(seq, block, draft_probs, sp, uniforms)
            self.steps += 1
            if self.steps == 2:
                emitted = emitted[:-1] + [(emitted[-1] + 1) % (self.info.vocab_size - 2)]
            return accept, emitted

    report = _run(recipe, _engine(recipe, WrongSecondBonus), reference, prompts)
    bad = [r for r in report.greedy["per_prompt"] if not r["identical"]]
    assert len(bad) == len(prompts)
    assert all(r["diagnosis"] == "speculation changed the output" and r["engine_ar_identical"] for r in bad)
    # Online tau judges each step's drafts after the engine's own (now wrong) prefix, as the engine's intact target
    # did: the early divergence does not zero the figure, it agrees with the engine's own tau.
    a = report.acceptance
    assert a["tau_online"] > 2.0 and a["tau_online"] == pytest.approx(a["tau"], abs=0.25)
    assert report.greedy["engine_ar_identical_fraction"] == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("content, where, what", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', "line 2", "invalid JSON"),
    ('{"prompt": "ok"}\n\n{"text": "no prompt field"}\n', "line 3", "exactly one of"),
    ('{"messages": [{"role": "user"}]}\n', "line 1", "messages[0]"),
    ('{"input_ids": [1, -2]}\n', "line 1", "non-negative"),
    ('["a list"]\n', "line 1", "JSON object"),
    ('{"prompt": "ok"}\n' + "[" * 100000 + "]" * 100000 + "\n", "line 2", "invalid JSON (nested too deeply)"),
    ('{"input_ids": [' + "9" * 5000 + "]}\n", "line 1", "invalid JSON (Exceeds the limit"),
    ("", None, "empty"),
    ("\n\n", None, "empty"),
    # a \ud800 escape is valid JSON but no text: the tokenizer, the report and the plots would each fail on it
    ('{"prompt": "ok"}\n{"prompt": "a \\ud800"}\n', "line 2", "prompt: lone surrogate \\ud800 at character 2"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "\\udcff", "content": "x"}]}\n', "line 1",
     "messages[1].role: lone surrogate \\udcff"),
    ('{"prompt": "ok", "id": "x\\ud800"}\n', "line 1", "id: lone surrogate"),
    ('{"prompt": "ok", "x": ' + "[" * 500 + '"\\ud800"' + "]" * 500 + "}\n", "line 1", "lone surrogate"),
    ('{"prompt": "ok", "prompt": "other"}\n', "line 1", "key 'prompt' given twice"),
    ('{"prompt": "ok", "%s": 1, "%s": 2}\n' % ("k" * 100000, "k" * 100000), "line 1",
     "key '%s...%s' given twice" % ("k" * 60, "k" * 17)),
])
def test_malformed_suite_is_refused_with_its_line(tmp_path, content, where, what):
    from dflash_export.validate.suites import load_suite

    f = tmp_path / "suite.jsonl"
    f.write_text(content)
    with pytest.raises(DFlashError) as e:
        load_suite(str(f))
    msg = str(e.value)
    assert str(f) in msg and what in msg and e.value.exit_code == 2
    if where:
        assert where in msg


def test_suite_formats_and_named_suites():
    from dflash_export.validate.suites import list_suites, load_suite

    assert {"tiny-random", "humaneval"} <= set(list_suites())
    _, prompts = load_suite("tiny-random")
    assert {p.kind for p in prompts} == {"text", "messages", "input_ids"}
    _, few = load_suite("humaneval", 5)
    assert len(few) == 5 and few[0].id == "HumanEval/0"
    _, later = load_suite("humaneval", 3, skip=20)  # the rows after those a benchmark keeps out
    assert [p.id for p in later] == ["HumanEval/20", "HumanEval/21", "HumanEval/22"]


def test_cli_exit_codes_for_bad_input(tmp_path, recipe_path):
    from click.testing import CliRunner

    from dflash_export.cli import main

    runner = CliRunner()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    res = runner.invoke(main, ["validate", "--recipe", str(recipe_path), "--suite", str(bad), "--engine", "x"])
    assert res.exit_code == 2 and "line 2" in res.output
    res = runner.invoke(main, ["validate", "--recipe", str(recipe_path)])
    assert res.exit_code == 2 and "dflash-export build --recipe tiny-trained" in res.output
    res = runner.invoke(main, ["validate", "--recipe", str(recipe_path), "--suite", "no-such-suite"])
    assert res.exit_code == 2 and "tiny-random" in res.output
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "short"}\n{"input_ids": [%s]}\n' % ", ".join(["5"] * 300))
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    from dflash_export.engines.manifest import write_manifest

    write_manifest(engine_dir, {"backend": "pytorch", "recipe": "tiny-trained", "recipe_path": str(recipe_path),
                                "block_size": 4, "mask_token_id": 255})
    res = runner.invoke(main, ["validate", "--recipe", str(recipe_path), "--suite", str(long), "--engine",
                               str(engine_dir)])
    assert res.exit_code == 2 and "line 2" in res.output and "max_seq_len" in res.output


def test_failed_threshold_is_exit_1_and_names_the_check(recipe, reference, prompts, tmp_path):
    from dflash_export.validate.command import validate_engine
    from dflash_export.validate.runner import ValidateOptions

    engine = _engine(recipe)
    engine.info.target_layer_ids = [i - 1 for i in engine.info.target_layer_ids]
    with pytest.raises(CheckFailed) as e:
        validate_engine(recipe, engine, reference, prompts[:1], ValidateOptions(max_new_tokens=8, temperature=0),
                        {"name": "tiny-random"}, {}, tmp_path, echo=lambda *_: None)
    assert e.value.exit_code == 1 and "tau" in str(e.value)
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is False  # evidence written before failing


def _slow_drafter_engine(recipe, delay_s: float):
    """The healthy engine with a drafter that takes `delay_s` longer per call: same tokens, DFlash slower than plain
    decoding on the same engine (which never drafts)."""
    import time as _time

    from dflash_export.engines.torch_ref import TorchEngine

    class SlowDraft(TorchEngine):
        def draft(self, *a, **k):
            _time.sleep(delay_s)
            return super().draft(*a, **k)

    return _engine(recipe, SlowDraft)


def test_dflash_slower_than_plain_decoding_fails_unless_the_recipe_lowers_the_floor(recipe, reference, prompts,
                                                                                     tmp_path):
    import dataclasses

    from dflash_export.recipes import Thresholds
    from dflash_export.validate.command import validate_engine
    from dflash_export.validate.runner import ValidateOptions

    assert Thresholds().min_speedup_vs_ar == 1.0  # the default floor: never slower than plain decoding
    recipe = dataclasses.replace(recipe, thresholds=dataclasses.replace(recipe.thresholds, min_speedup_vs_ar=1.0))
    lines: list[str] = []
    opts = ValidateOptions(max_new_tokens=MAX_NEW, temperature=0)
    with pytest.raises(CheckFailed) as e:
        validate_engine(recipe, _slow_drafter_engine(recipe, 0.05), reference, prompts[:2], opts,
                        {"name": "tiny-random"}, {}, tmp_path / "a", echo=lines.append)
    assert "speedup_vs_ar" in str(e.value)
    row = next(ln for ln in lines if "speedup_vs_ar" in ln)
    assert row.lstrip().startswith("FAIL") and "DFlash slower than plain decoding" in row, row
    # identical outputs all the same: the speed alone failed
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert [t["name"] for t in rep["thresholds"] if not t["passed"]] == ["speedup_vs_ar"]
    # a recipe that accepts it: passes, and the summary still says it is slower
    lenient = dataclasses.replace(recipe, thresholds=dataclasses.replace(recipe.thresholds, min_speedup_vs_ar=0.0))
    lines.clear()
    validate_engine(lenient, _slow_drafter_engine(recipe, 0.05), reference, prompts[:2], opts,
                    {"name": "tiny-random"}, {}, tmp_path / "b", echo=lines.append)
    row = next(ln for ln in lines if "speedup_vs_ar" in ln)
    assert row.lstrip().startswith("PASS") and "DFlash slower than plain decoding" in row, row


def test_quick_defaults_and_full_flag(monkeypatch):
    """Without options validate runs the first 10 prompts and 40 seeds (minutes on the default pair); --full the
    whole suite and the 300 seeds of the power calculation; explicit options win over both; --target / --drafter
    name a pair without a recipe file."""
    from click.testing import CliRunner

    import dflash_export.validate.cli as vcli
    from dflash_export.cli import main

    seen = []
    monkeypatch.setattr(vcli, "run_validate", lambda recipe, engine, suite, n, max_new, t, report, samples, **kw:
                        seen.append((recipe.name, n, samples, max_new)))
    for args in (["--recipe", "tiny-qwen3"], ["--recipe", "tiny-qwen3", "--full"],
                 ["--recipe", "tiny-qwen3", "--full", "--num-prompts", "3", "--dist-samples", "7"],
                 ["--target", "tiny:qwen3/target", "--drafter", "tiny:qwen3/drafter"]):
        r = CliRunner().invoke(main, ["validate", *args])
        assert r.exit_code == 0, r.output
    assert seen == [("tiny-qwen3", 10, 40, 128), ("tiny-qwen3", None, 300, 128), ("tiny-qwen3", 3, 7, 128),
                    ("drafter", 10, 40, 128)]


# ---------------------------------------------------------------------------------------------------------------------
# The rules, alone


def test_first_divergence_and_diagnosis():
    from dflash_export.validate.checks import diagnose, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert diagnose([1, 9], [1, 2], [1, 2]) == "speculation changed the output"
    assert diagnose([1, 9], [1, 9], [1, 2]) == "export changed the model"


def test_online_acceptance_is_not_spoiled_by_an_early_divergence():
    from dflash_export.validate.checks import online_acceptance
    from dflash_export.validate.instrument import StepRecord

    # The engine diverged from the reference at output 1 (7 instead of 2). Judged against the reference's greedy
    # choice after the engine's own prefix, later steps whose drafts match count in full.
    engine = [1, 7, 8, 9, 10, 11, 12]
    ref_next = [1, 2, 8, 9, 10, 11, 12, 13]      # reference argmax after prompt + engine[:j]
    steps = [StepRecord(1, [7, 8, 9], 0), StepRecord(2, [8, 9, 10], 3), StepRecord(6, [12, 13, 14], 1)]
    assert online_acceptance(steps, engine, ref_next) == [1, 4, 3]


def test_g_test_counts_every_token_of_a_prefix_in_its_own_cell():
    """Hand-computed G: p = [0.5, 0.3, 0.2], counts [6, 3, 1] of n = 10 -> 2 * (6 ln(6/5) + 3 ln(3/3) + 1 ln(1/2))."""
    from dflash_export.validate.checks import conditional_g_test

    fit = conditional_g_test([(np.array([0.5, 0.3, 0.2, 0.0]), {0: 6, 1: 3, 2: 1})], replicates=4000)
    assert fit.statistic == pytest.approx(2 * (6 * np.log(1.2) + np.log(0.5)))
    assert fit.n == 10 and fit.groups == 1 and 0.3 < fit.p_value < 1.0
    # the null mean of G for multinomial(10, p) with 3 cells is close to 2 (its chi-square limit)
    assert 1.6 < fit.null_mean < 2.6


def test_suite_of_random_bytes_is_one_line(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.validate.suites import load_suite

    f = tmp_path / "random.jsonl"
    f.write_bytes(b'{"prompt": "fine"}\n' + bytes(range(128, 256)) * 4 + b"\n")
    with pytest.raises(DFlashError, match="not UTF-8") as e:
        load_suite(str(f))
    assert str(e.value).startswith(f"{f}: line 2: ")
    r = CliRunner().invoke(main, ["validate", "--recipe", "tiny-qwen3", "--suite", str(f), "--engine", "x"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output


def test_suite_text_that_is_not_unicode_is_one_line_before_any_engine_loads(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import main

    f = tmp_path / "surrogate.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": "hi \\ud800 there", "id": "s"}\n')
    r = CliRunner().invoke(main, ["validate", "--recipe", "tiny-qwen3", "--suite", str(f), "--engine", "x"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output == f"error: {f}: line 2: prompt: lone surrogate \\ud800 at character 3 (not valid Unicode text)\n"


def test_a_directory_in_place_of_a_report_file_is_refused_first_and_the_earlier_report_kept(tmp_path, monkeypatch):
    """A report file name taken by a directory: refused before any work, and (made after that check) before the first
    file of the new report is moved in, so the earlier report is never half replaced."""
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.validate import report as report_mod

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    files = {"report.json": '{"old": true}\n', **{n: "old png" for n in report_mod.PLOTS.values()}}
    for name, text in files.items():
        (earlier / name).write_text(text)
    (earlier / "report.md").mkdir()
    r = CliRunner().invoke(main, ["validate", "--recipe", "tiny-qwen3", "--engine", str(tmp_path / "none"),
                                  "--report", str(earlier)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {earlier / 'report.md'}: --report: is a directory where the report writes")

    class Report:
        def to_dict(self):
            return {"new": True}

    monkeypatch.setattr(report_mod, "render_markdown", lambda r: "# new\n")
    monkeypatch.setattr(report_mod, "_plots", lambda r, out: [(out / n).write_text("new png")
                                                              for n in report_mod.PLOTS.values()])
    with pytest.raises(DFlashError, match="report.md: --report: is a directory"):
        report_mod.write_report(Report(), earlier)
    assert {p.name: p.read_text() for p in earlier.iterdir() if p.is_file()} == files
    assert sorted(p.name for p in earlier.iterdir()) == sorted([*files, "report.md"])  # no staging directory left


def test_plots_show_prompt_ids_as_written_never_as_mathtext(tmp_path):
    """Prompt ids come from the suite: `$\\foo{$` (an unknown mathtext command) or one `$` is drawn as text."""
    from dflash_export.validate.report import PLOTS, _plots
    from dflash_export.validate.runner import ValidationReport

    ids = ["a$\\foo{$b", "one $ sign", "line\n$x$"]
    speed = {"per_prompt": [{"id": i, "speedup_vs_ar": 1.0, "speedup_vs_reference": 2.0} for i in ids],
             "speedup_vs_ar": 1.0, "engine_dflash_tok_s": 3.0, "engine_ar_tok_s": 3.0, "reference_spec_tok_s": 1.0,
             "reference_ar_tok_s": 1.0}
    acceptance = {"histogram": {"1": 3, "2": 1}, "histogram_online": {"1": 3, "2": 1}, "tau": 1.2, "tau_online": 1.2}
    _plots(ValidationReport(recipe="tiny", engine={}, suite={}, options={}, acceptance=acceptance, speed=speed),
           tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PLOTS.values())


def test_report_path_that_cannot_be_a_directory_is_refused_first(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x\n")
    for report in (afile, afile / "x"):
        # the engine does not even exist: the report path is checked before anything else
        r = CliRunner().invoke(main, ["validate", "--recipe", "tiny-qwen3", "--engine", str(tmp_path / "none"),
                                      "--report", str(report)])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
        assert f"{report}: --report: " in r.output
    assert afile.read_text() == "x\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a mounted /proc")
def test_report_under_a_directory_that_refuses_new_files_is_refused_first(tmp_path):
    """/proc takes no new files from anyone, root included, although its permission bits (all `os.access` reads)
    say root may write there: the report path is tried before the engine is even looked for."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    for report in ("/proc/dflash-report", "/proc/dflash-report/sub"):
        r = CliRunner().invoke(main, ["validate", "--recipe", "tiny-qwen3", "--engine", str(tmp_path / "none"),
                                      "--report", report])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
        assert r.output.startswith(f"error: {report}: --report: cannot create it: creating anything in /proc fails "), \
            r.output
    assert not Path("/proc/dflash-report").exists()


def test_quantized_engine_is_judged_against_its_own_plain_decoding(recipe_path, recipe, tmp_path, monkeypatch):
    """An int4 engine (trained drafter, so blocks get accepted): lossless against its own AR greedily and at T>0
    (the sampled check uses the engine's own plain-decoding conditionals), agreement with the fp32 reference
    reported -- identical prompts, first divergences, the reference's logit margins there."""
    pytest.importorskip("onnxruntime")
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.engines.ort_build import build_onnxruntime

    eng = build_onnxruntime(recipe, tmp_path / "engines" / recipe.name / "onnxruntime-int4", threads=1,
                            precision="int4")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["validate", "--recipe", str(recipe_path), "--engine", str(eng), "--num-prompts",
                                    "3", "--max-new-tokens", str(MAX_NEW), "--dist-samples", "30", "--no-progress",
                                    "--report", "rep"])
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    # tau may fall under the recipe's 3.0: the drafter memorised the fp32 target's continuations, which int4 changes;
    # and on a tiny model a DFlash step costs more than it saves (the default floor of 1.0x then fails, and says so)
    failed = {t["name"] for t in rep["thresholds"] if not t["passed"]}
    allowed = {"tau", "speedup_vs_ar"} | (set() if report_exact_on_this_cpu(rep) else {"identical_fraction"})
    assert failed <= allowed, res.output
    if any(t["name"] == "speedup_vs_ar" and t["value"] < 1 for t in rep["thresholds"]):
        assert "DFlash slower than plain decoding on this engine" in res.output
    g = rep["greedy"]
    if report_exact_on_this_cpu(rep):
        assert g["identical_fraction"] == 1.0 and g["own_ar_identical_fraction"] == 1.0
    assert g["judged_against"] == "the engine's own plain decoding"
    agree = g["reference_agreement"]
    assert agree["prompts"] == 3 and len(agree["first_divergences"]) == len(agree["logit_margins"]) == 3
    for d, m in zip(agree["first_divergences"], agree["logit_margins"]):
        assert (d is None) == (m is None) and (m is None or m >= 0)  # the reference preferred its own token
    assert "own plain-decoding" in rep["distribution"]["test"] and rep["distribution"]["p_value"] >= 0.001
    assert rep["engine"]["manifest"]["precision"]["target"] == "int4"
    assert "vs the fp32 reference" in (tmp_path / "rep" / "report.md").read_text()


def test_default_engine_is_the_fp32_one_else_the_only_one_built(tmp_path, monkeypatch):
    from dflash_export.engines.build import default_engine_dir

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "engines" / "some-pair"
    with pytest.raises(DFlashError, match="no engine built"):
        default_engine_dir("some-pair")
    for name in ("onnxruntime-int4", "onnxruntime-int8", "onnxruntime"):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.json").write_text("{}")
        if name == "onnxruntime-int4":
            assert default_engine_dir("some-pair") == Path("engines/some-pair/onnxruntime-int4").resolve()
        elif name == "onnxruntime-int8":
            with pytest.raises(DFlashError, match="onnxruntime-int4, onnxruntime-int8.*--engine"):
                default_engine_dir("some-pair")
    assert default_engine_dir("some-pair") == Path("engines/some-pair/onnxruntime").resolve()


def test_a_report_that_cannot_be_written_whole_leaves_the_earlier_one(tmp_path, monkeypatch):
    import errno

    from dflash_export.errors import DFlashError
    from dflash_export.validate import report as report_mod

    class Report:
        def to_dict(self):
            return {"new": True}

    def full_disk(report, out):
        (out / report_mod.PLOTS["tau_histogram"]).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_mod, "render_markdown", lambda r: "# new\n")
    monkeypatch.setattr(report_mod, "_plots", full_disk)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    files = {"report.json": '{"old": true}\n', "report.md": "# old\n",
             **{n: "old png" for n in report_mod.PLOTS.values()}}
    for name, text in files.items():
        (earlier / name).write_text(text)
    with pytest.raises(DFlashError, match="--report: cannot write the report"):
        report_mod.write_report(Report(), earlier)
    assert {p.name: p.read_text() for p in earlier.iterdir()} == files
    with pytest.raises(DFlashError):
        report_mod.write_report(Report(), tmp_path / "new" / "report")
    assert not (tmp_path / "new").exists()
