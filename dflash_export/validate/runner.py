"""Validate a built engine against the PyTorch reference: greedy losslessness, acceptance, the T>0 distribution, speed.

`run_validation` takes an opened engine (any backend, or a wrapper with a planted fault) and the reference models, runs
the suite, and returns a `ValidationReport` holding every figure plus the list of failed thresholds. It never raises
on a failed threshold; the CLI turns `report.failures` into exit code 1 after the report files are written.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_export import __version__
from dflash_export.decoding.prompt_lookup import pooled_tau, prompt_lookup_steps
from dflash_export.decoding.sampling import probs_from_logits
from dflash_export.engines.base import Engine, SamplingParams
from dflash_export.engines.manifest import library_versions
from dflash_export.engines.numerics import cpu_features
from dflash_export.errors import DFlashError
from dflash_export.runtime.single import DFlashRuntime
from dflash_export.validate import checks
from dflash_export.validate.instrument import InstrumentedEngine


@dataclass
class ValidateOptions:
    max_new_tokens: int = 64
    temperature: float = 0.7          # of the distribution check; 0 skips it (!= 1: a doubled temperature shows)
    top_k: int = 0
    top_p: float = 0.9                # < 1: a nucleus fault shows
    dist_prompts: int = 2             # prompts the distribution check samples from
    dist_samples: int = 300           # seeds per prompt (power calculation: docs/stages.md "The T>0 distribution
                                      # check"); `validate` defaults to a quick 40, `--full` to 300
    dist_tokens: int | None = None    # tokens per sample; default block_size + 1 (prefill token + one DFlash step)
    dist_seed: int = 0                # offsets every sampled run's seed (0: the documented default stream)
    warmup: int = 1                   # untimed generations before timing
    repeats: int = 1                  # timed runs per prompt and way; medians are reported
    decoding: dict = field(default_factory=dict)  # DFlashRuntime proposer options; {} = the engine's recipe's


@dataclass
class Reference:
    """The yardstick: the recipe's target and drafter in PyTorch, loaded independently of the engine."""

    target: Any
    drafter: Any
    block_size: int | None = None

    @classmethod
    def from_recipe(cls, recipe, dtype: str | None = None) -> Reference:
        """`dtype`: default the recipe's."""
        import torch

        from dflash_export.models import load_target
        from dflash_export.models.checkpoint import load_drafter

        dtype = getattr(torch, dtype or recipe.dtype)
        return cls(load_target(recipe.target_path, dtype), load_drafter(recipe.drafter_path, dtype), recipe.block_size)

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits [len(ids), V] (row i predicts the token after ids[:i + 1])."""
        import torch

        t = torch.tensor([ids], dtype=torch.long)
        out = self.target.forward(t, torch.arange(len(ids))[None], self.target.new_cache())
        return out.logits[0].double().numpy()


@dataclass
class ValidationReport:
    recipe: str
    engine: dict[str, Any]
    suite: dict[str, Any]
    options: dict[str, Any]
    greedy: dict[str, Any] = field(default_factory=dict)
    acceptance: dict[str, Any] = field(default_factory=dict)
    distribution: dict[str, Any] = field(default_factory=dict)
    speed: dict[str, Any] = field(default_factory=dict)
    thresholds: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [t for t in self.thresholds if not t["passed"]]

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "passed": self.passed, "engine": self.engine, "suite": self.suite,
                "options": self.options, "thresholds": self.thresholds, "greedy": self.greedy,
                "acceptance": self.acceptance, "distribution": self.distribution, "speed": self.speed,
                "environment": self.environment}


def environment_info() -> dict[str, Any]:
    """Library versions and the machine, so a report says what it was measured on."""
    env: dict[str, Any] = {"tool_version": __version__, "versions": library_versions(("numpy", "scipy", "onnx",
                           "onnxruntime", "torch", "transformers", "tokenizers", "tensorrt", "matplotlib")),
                           "machine": {"platform": platform.platform(), "processor": platform.processor() or
                                       platform.machine(), "cpu_count": os.cpu_count(), "hostname": platform.node(),
                                       "cpu": cpu_features()}}
    try:
        import torch

        env["machine"]["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return env


class _Progress:
    """A rich progress bar on a terminal; on a pipe or a log file, a plain line whenever the phase changes and at
    least every `LINE_EVERY_S` seconds (a run of minutes must not look hung); nothing when disabled (tests)."""

    LINE_EVERY_S = 15.0

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        self.lines = False
        self.total, self.done = total, 0
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            console = Console(stderr=True)
            if not console.is_terminal:
                self.lines = True
                self.t0 = self.last = time.monotonic()
                self.phase = None
                return
            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                console=console, transient=True)
            self.task = self.bar.add_task("validate", total=total)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def step(self, description: str, n: int = 1) -> None:
        self.done += n
        if self.bar:
            self.bar.update(self.task, advance=n, description=description)
        elif self.lines:
            import sys

            now = time.monotonic()
            phase = description.split(" ")[0]
            if phase != self.phase or now - self.last >= self.LINE_EVERY_S or self.done == self.total:
                print(f"[{now - self.t0:6.1f} s] {self.done}/{self.total} {description}", file=sys.stderr, flush=True)
                self.phase, self.last = phase, now


def _greedy_params(opts: ValidateOptions) -> SamplingParams:
    return SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=0.0)


def _warm_up(engine: InstrumentedEngine, runtime, reference: Reference, ids: list[int], opts: ValidateOptions) -> None:
    from dflash_export.runtime.reference import ar_generate, spec_generate

    sp = SamplingParams(max_new_tokens=min(opts.max_new_tokens, 16))
    for _ in range(opts.warmup):
        runtime.generate(ids, sp, "dflash")
        runtime.generate(ids, sp, "ar")
        ar_generate(reference.target, ids, sp.max_new_tokens)
        spec_generate(reference.drafter, reference.target, ids, sp.max_new_tokens, block_size=reference.block_size)
    engine.reset()


def _greedy_prompt(engine: InstrumentedEngine, runtime, reference: Reference, pid: str, ids: list[int],
                   opts: ValidateOptions, codec) -> tuple[dict, dict]:
    """Run one prompt four ways (engine DFlash/AR, reference spec/AR), `opts.repeats` times each; return
    (losslessness row, raw timings and call logs). Tokens come from the first run; later runs must repeat them."""
    from dflash_export.runtime.reference import ar_generate, spec_generate

    sp = _greedy_params(opts)
    runs: dict[str, list] = {"ref_ar": [], "ref_spec": [], "dfl": [], "ar": []}
    logs: dict[str, list] = {"dfl": [], "ar": []}
    for _ in range(max(1, opts.repeats)):
        runs["ref_ar"].append(ar_generate(reference.target, ids, opts.max_new_tokens))
        runs["ref_spec"].append(spec_generate(reference.drafter, reference.target, ids, opts.max_new_tokens,
                                              block_size=reference.block_size))
        engine.reset()
        runs["dfl"].append(runtime.generate(ids, sp, "dflash"))
        logs["dfl"].append(engine.reset())
        runs["ar"].append(runtime.generate(ids, sp, "ar"))
        logs["ar"].append(engine.reset())
    ref_ar, ref_spec, dfl, ar = (runs[k][0] for k in ("ref_ar", "ref_spec", "dfl", "ar"))

    ref_logits = reference.next_token_logits(ids + dfl.tokens)[len(ids) - 1:]
    ref_next = np.argmax(ref_logits, axis=-1).tolist()
    online = checks.online_acceptance(logs["dfl"][0].steps, dfl.tokens, ref_next)
    div = checks.first_divergence(dfl.tokens, ref_ar.tokens)
    ar_div = checks.first_divergence(ar.tokens, ref_ar.tokens)
    own_div = checks.first_divergence(dfl.tokens, ar.tokens)
    margin = None
    if ar_div is not None and ar_div < len(ar.tokens) and ar_div < len(ref_ar.tokens):
        # How close the reference's own call was where the engine's plain decoding left it: its logit for its
        # token minus its logit for the engine's (small = a near tie that any rounding could flip).
        row_logits = (ref_logits[ar_div] if ar.tokens[:ar_div + 1] == dfl.tokens[:ar_div + 1] else
                      reference.next_token_logits(ids + ar.tokens[:ar_div])[-1])
        margin = float(row_logits[ref_ar.tokens[ar_div]] - row_logits[ar.tokens[ar_div]])
    row: dict[str, Any] = {
        "id": pid, "prompt_tokens": len(ids), "new_tokens": len(dfl.tokens),
        "identical": div is None, "first_divergence": div,
        "own_ar_identical": own_div is None, "own_ar_first_divergence": own_div,
        "engine_ar_identical": ar_div is None, "engine_ar_first_divergence": ar_div,
        "reference_logit_margin_at_divergence": margin,
        "diagnosis": checks.diagnose(dfl.tokens, ar.tokens, ref_ar.tokens),
        "reference_spec_identical": ref_spec.tokens == ref_ar.tokens,
        "deterministic": all(r.tokens == dfl.tokens for r in runs["dfl"]) and all(r.tokens == ar.tokens
                                                                                   for r in runs["ar"]),
        "tau": dfl.tau, "tau_online": float(np.mean(online)) if online else 1.0, "steps": len(dfl.acceptance_lengths),
    }
    if div is not None:
        row["around_divergence"] = {
            "engine": checks.window(dfl.tokens, div), "reference": checks.window(ref_ar.tokens, div),
            "engine_text": _safe_decode(codec, checks.window(dfl.tokens, div)),
            "reference_text": _safe_decode(codec, checks.window(ref_ar.tokens, div)),
        }

    def med(key: str, attr: str, scale: float = 1.0) -> float:
        return scale * checks.median(getattr(r, attr) for r in runs[key])

    timing = {"id": pid}
    for key, name in (("dfl", "engine_dflash"), ("ar", "engine_ar"), ("ref_spec", "reference_spec"),
                      ("ref_ar", "reference_ar")):
        timing[f"{name}_tok_s"] = med(key, "tokens_per_s")
        timing[f"{name}_tpot_ms"] = med(key, "tpot_s", 1e3)
    timing["speedup_vs_ar"] = _ratio(timing["engine_dflash_tok_s"], timing["engine_ar_tok_s"])
    timing["speedup_vs_reference"] = _ratio(timing["engine_dflash_tok_s"], timing["reference_spec_tok_s"])
    timing["speedup_vs_reference_ar"] = _ratio(timing["engine_dflash_tok_s"], timing["reference_ar_tok_s"])
    raw = {"timing": timing, "lengths": list(dfl.acceptance_lengths), "online": online, "answer": list(dfl.tokens),
           "draft_s": [x for lg in logs["dfl"] for x in lg.draft_s],
           "verify_s": [x for lg in logs["dfl"] for x in lg.verify_s],
           "decode_s": [x for lg in logs["ar"] for x in lg.decode_s],
           "dflash_loop_s": sum(r.total_s - r.ttft_s for r in runs["dfl"]),
           "dflash_steps": sum(len(r.acceptance_lengths) for r in runs["dfl"]),
           "ar_loop_s": sum(r.total_s - r.ttft_s for r in runs["ar"]),
           "ar_steps": sum(len(r.tokens) - 1 for r in runs["ar"])}
    return row, raw


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _safe_decode(codec, ids: list[int]) -> str:
    try:
        return codec.decode(ids)
    except Exception:  # a decode problem must not hide the divergence itself
        return ""


def _plain_logits(engine, ids: list[int], tokens: list[int]) -> np.ndarray:
    """The engine's own plain-decoding logits [len(tokens), V]: row j is what it samples token j from."""
    seq = engine.new_sequence(len(ids) + len(tokens) + engine.info.block_size)
    rows = [engine.prefill(seq, np.asarray(ids, np.int64))]
    for t in tokens[:-1]:
        rows.append(engine.decode(seq, int(t)))
    return np.stack(rows).astype(np.float64)


def _distribution_check(runtime, reference: Reference, prompts: list[tuple[str, list[int]]], opts: ValidateOptions,
                        block_size: int, progress: _Progress, own_engine=None) -> dict[str, Any]:
    """Sample the engine's DFlash output under many seeds and test it against the reference target's conditionals.

    For every sampled token the reference target's distribution given the engine's own prefix (one teacher-forced
    pass per sample) is its exact law under losslessness. Tokens with the same prefix share that law, so they are
    counted per prefix (a node of the tree the samples span) and each node's counts are compared with n * p by a
    likelihood-ratio G over per-token cells, summed over the tree and calibrated by simulation
    (`checks.conditional_g_test`). Samples are short (the prefill token + `dist_tokens` - 1 from DFlash steps) so that
    prefixes repeat. Only tokens that came out of a DFlash step are tested (the first token is a plain prefill draw); a
    token the target gives probability 0 fails outright. `own_engine` (quantized engines): the conditionals are the
    engine's own plain decoding's instead of the fp32 reference's -- what a quantized engine's DFlash owes exactness to.
    """
    n_tok = opts.dist_tokens or block_size + 1
    sp_base = dict(max_new_tokens=n_tok, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    nodes: dict[tuple, tuple[np.ndarray, dict[int, int]]] = {}
    impossible = 0
    t0 = time.perf_counter()
    for pi, (pid, ids) in enumerate(prompts):
        for s in range(opts.dist_samples):
            seed = 1_000_003 * pi + s + opts.dist_seed * 7_919_993
            st = runtime.generate(ids, SamplingParams(seed=seed, **sp_base), "dflash")
            logits = None
            for j, tok in enumerate(st.tokens):
                if j == 0:
                    continue  # the prefill draw: not the engine's verify step
                key = (pi, tuple(st.tokens[:j]))
                if key not in nodes:
                    if logits is None:  # one teacher-forced pass per sample that reaches a new prefix
                        logits = (_plain_logits(own_engine, ids, st.tokens) if own_engine is not None else
                                  reference.next_token_logits(ids + st.tokens[:-1])[len(ids) - 1:])
                    nodes[key] = (probs_from_logits(logits[j], opts.temperature, opts.top_k, opts.top_p), {})
                p, counts = nodes[key]
                if p[tok] <= 0:
                    impossible += 1
                    continue
                counts[tok] = counts.get(tok, 0) + 1
            progress.step(f"T={opts.temperature} sampling {pid}")
    fit = checks.conditional_g_test(nodes.values(), seed=opts.dist_seed)
    p_value = 0.0 if impossible else fit.p_value
    return {
        "ran": True, "test": ("per-prefix likelihood-ratio G vs " + ("the engine's own plain-decoding conditionals"
                                                                   if own_engine is not None else
                                                                   "reference conditionals") + ", simulated null"),
        "temperature": opts.temperature, "top_k": opts.top_k, "top_p": opts.top_p, "prompts": [p for p, _ in prompts],
        "samples_per_prompt": opts.dist_samples, "tokens_per_sample": n_tok, "tested_tokens": fit.n,
        "prefixes": fit.groups, "g": fit.statistic, "null_mean": fit.null_mean, "null_sd": fit.null_var ** 0.5,
        "p_value": p_value, "impossible_tokens": impossible, "seed": opts.dist_seed,
        "seconds": time.perf_counter() - t0,
    }


def _threshold(name: str, value: float, minimum: float, note: str = "") -> dict[str, Any]:
    return {"name": name, "value": float(value), "op": ">=", "threshold": float(minimum),
            "passed": bool(value >= minimum - 1e-12), "note": note}


def run_validation(recipe, engine: Engine, reference: Reference, prompts: list[tuple[str, list[int]]],
                   opts: ValidateOptions | None = None, suite: dict[str, Any] | None = None,
                   engine_meta: dict[str, Any] | None = None, show_progress: bool = False) -> ValidationReport:
    """Run every check of one engine on encoded `prompts` [(id, token ids)] and judge it by `recipe.thresholds`."""
    opts = opts or ValidateOptions()
    if not prompts:
        raise DFlashError("no prompts to validate on", field="--suite")
    inst = InstrumentedEngine(engine)
    # Steered by the recorded costs, never by costs fitted to this machine's clock: which drafts get verified -- and so
    # τ and every verdict judged on it -- must not depend on how loaded the machine validating is.
    runtime = DFlashRuntime(inst, **{**opts.decoding, "fit_costs": False})
    info = engine.info
    precision = ((engine_meta or {}).get("manifest") or {}).get("precision") or {}
    quantized = any(v != "fp32" for v in precision.values())
    bs = info.block_size
    run_dist = opts.temperature > 0 and opts.dist_samples > 0
    # The shortest prompts: every seed pays a prefill, and the test's power does not depend on prompt length.
    dist_prompts = sorted(prompts, key=lambda p: len(p[1]))[: max(1, opts.dist_prompts)] if run_dist else []
    report = ValidationReport(
        recipe=recipe.name,
        engine={"backend": info.backend, "recipe": info.recipe, "block_size": bs, "mask_token_id": info.mask_token_id,
                "vocab_size": info.vocab_size, "target_layer_ids": list(info.target_layer_ids), **(engine_meta or {})},
        suite={**(suite or {}), "prompts": len(prompts)},
        options={**opts.__dict__, "dist_tokens": opts.dist_tokens or bs + 1},
        environment=environment_info(),
    )
    rows, raws = [], []
    with _Progress(show_progress, 1 + len(prompts) + len(dist_prompts) * opts.dist_samples) as progress:
        progress.step("warming up (engine and PyTorch reference)", 0)
        _warm_up(inst, runtime, reference, prompts[0][1], opts)
        progress.step("greedy check")
        for pid, ids in prompts:
            row, raw = _greedy_prompt(inst, runtime, reference, pid, ids, opts, engine.codec)
            rows.append(row)
            raws.append(raw)
            progress.step(f"greedy {pid}")
        # The sampled check drafts and verifies at every step (no cost model): exactness does not depend on which
        # drafts a cost model keeps, and each sample is then one DFlash step that exercises the acceptance.
        dist_runtime = DFlashRuntime(inst, **{**opts.decoding, "adaptive": False}) if run_dist else None
        report.distribution = (_distribution_check(dist_runtime, reference, dist_prompts, opts, bs, progress,
                                                   own_engine=engine if quantized else None) if run_dist
                               else {"ran": False, "reason": ("temperature 0" if opts.temperature <= 0 else
                                                              "--dist-samples 0") + ": sampled check skipped"})

    # Lossless is owed against plain decoding on the same engine at its precision; a quantized engine's agreement with
    # the fp32 reference is reported (identical prompts, first divergences, the reference's logit margins there).
    key = "own_ar_identical" if quantized else "identical"
    report.greedy = _greedy_summary(rows, key, quantized)
    report.greedy["proposer"] = runtime.describe()
    report.greedy["tau_counts"] = runtime.tau_counts()
    numerics = getattr(engine, "numerics", None)  # ONNX Runtime engines probe their kernels on this CPU at load
    if numerics is not None:
        report.greedy["numerics"] = {**numerics.to_json(), "statement": numerics.statement}
    report.acceptance = _acceptance_summary(prompts, rows, raws, bs)
    report.speed = _speed_summary(raws, report.acceptance["tau"])
    report.thresholds = _judge(report, recipe.thresholds, rows, key, quantized, opts, run_dist)
    return report


def _greedy_summary(rows: list[dict], key: str, quantized: bool) -> dict[str, Any]:
    """Greedy losslessness over the prompts, judged by each row's `key` (identical to which plain decoding)."""
    n = len(rows)
    identical = sum(r[key] for r in rows)
    return {
        "identical_fraction": identical / n, "identical": identical, "prompts": n,
        "judged_against": "the engine's own plain decoding" if quantized else "the reference's plain decoding",
        "own_ar_identical_fraction": sum(r["own_ar_identical"] for r in rows) / n,
        "reference_agreement": {
            "engine_ar_identical": sum(r["engine_ar_identical"] for r in rows), "prompts": n,
            "first_divergences": [r["engine_ar_first_divergence"] for r in rows],
            "logit_margins": [r["reference_logit_margin_at_divergence"] for r in rows]},
        "engine_ar_identical_fraction": sum(r["engine_ar_identical"] for r in rows) / n,
        "reference_spec_identical_fraction": sum(r["reference_spec_identical"] for r in rows) / n,
        "deterministic": all(r["deterministic"] for r in rows),
        "per_prompt": rows,
    }


def _acceptance_summary(prompts: list[tuple[str, list[int]]], rows: list[dict], raws: list[dict],
                        bs: int) -> dict[str, Any]:
    """Acceptance lengths (replayed and online) with the prompt-lookup yardstick; adds each row's
    `tau_prompt_lookup`."""
    lengths = [x for r in raws for x in r["lengths"]]
    online = [x for r in raws for x in r["online"]]
    # the prompt-lookup yardstick, replayed on the engine's own output tokens with full blocks of bs (no decode)
    lookup = [prompt_lookup_steps(ids, r["answer"], bs) for (_, ids), r in zip(prompts, raws)]
    for row, steps in zip(rows, lookup):
        row["tau_prompt_lookup"] = pooled_tau([steps])
    return {
        "block_size": bs, "tau": float(np.mean(lengths)) if lengths else 1.0,
        "tau_online": float(np.mean(online)) if online else 1.0, "steps": len(lengths),
        "tau_prompt_lookup": pooled_tau(lookup),
        "histogram": {str(k + 1): c for k, c in enumerate(checks.histogram(lengths, bs))},
        "histogram_online": {str(k + 1): c for k, c in enumerate(checks.histogram(online, bs))},
        "tau_per_prompt": [r["tau"] for r in rows], "tau_online_per_prompt": [r["tau_online"] for r in rows],
    }


def _judge(report: ValidationReport, th, rows: list[dict], key: str, quantized: bool, opts: ValidateOptions,
           run_dist: bool) -> list[dict[str, Any]]:
    """The report's figures against the recipe's thresholds `th`, each with a note saying what failed."""
    n = len(rows)
    bad = [r for r in rows if not r[key]]
    note = "against the engine's own AR" if quantized else ""
    if bad:
        r = bad[0]
        where = r["own_ar_first_divergence"] if quantized else r["first_divergence"]
        note = (f"{len(bad)} prompt(s) differ; first: {r['id']} at token {where} "
                f"({'vs own AR' if quantized else r['diagnosis']})")
    thresholds = [
        _threshold("identical_fraction", report.greedy["identical_fraction"], th.min_identical_fraction, note),
        _threshold("tau", report.acceptance["tau"], th.min_tau,
                   f"online tau {report.acceptance['tau_online']:.2f}; prompt-lookup yardstick "
                   f"{report.acceptance['tau_prompt_lookup']:.2f} on the same tokens"),
        _threshold("speedup_vs_ar", report.speed["speedup_vs_ar"], th.min_speedup_vs_ar),
        _threshold("speedup_vs_reference", report.speed["speedup_vs_reference"], th.min_speedup_vs_reference),
    ]
    if opts.repeats > 1:
        nondet = [r["id"] for r in rows if not r["deterministic"]]
        thresholds.append(_threshold(
            "deterministic_fraction", 1 - len(nondet) / n, 1.0,
            f"outputs changed between repeated runs: {', '.join(map(str, nondet[:5]))}" if nondet else ""))
    if run_dist:
        d = report.distribution
        thresholds.append(_threshold(
            "distribution_p_value", d["p_value"], th.min_distribution_p_value,
            f"{d['test']}, {d['tested_tokens']} tokens" + (f", {d['impossible_tokens']} impossible tokens"
                                                           if d["impossible_tokens"] else "")))
    return thresholds


def _speed_summary(raws: list[dict], tau: float) -> dict[str, Any]:
    """Medians over prompts for the headline figures; pooled means for the cost model, so that its parts add up."""
    timing = [r["timing"] for r in raws]
    med = {k: checks.median(t[k] for t in timing) for k in timing[0] if k != "id"}

    def mean_ms(key: str) -> float:
        xs = [x for r in raws for x in r[key]]
        return 1e3 * float(np.mean(xs)) if xs else 0.0

    def per_step_ms(loop: str, steps: str) -> float:
        n = sum(r[steps] for r in raws)
        return 1e3 * sum(r[loop] for r in raws) / n if n else 0.0

    verify_ms, decode_ms = mean_ms("verify_s"), mean_ms("decode_s")
    # Per DFlash step (= verify call): the runtime's draft back-off skips drafting on some steps.
    n_verify = sum(len(r["verify_s"]) for r in raws)
    n_draft = sum(len(r["draft_s"]) for r in raws)
    draft_ms = 1e3 * sum(x for r in raws for x in r["draft_s"]) / n_verify if n_verify else 0.0
    step_ms = per_step_ms("dflash_loop_s", "dflash_steps")      # wall time of one DFlash step, loop included
    ar_step_ms = per_step_ms("ar_loop_s", "ar_steps")
    # A DFlash step commits tau tokens for one draft + one verify (+ the runtime's own work); an AR step commits one.
    return {
        **med, "statistic": "median over prompts",
        "per_prompt": timing,
        "cost_model": {
            "draft_ms": draft_ms, "drafts_per_step": n_draft / n_verify if n_verify else 0.0, "verify_ms": verify_ms,
            "dflash_overhead_ms": step_ms - draft_ms - verify_ms,
            "step_ms": step_ms, "ar_decode_ms": decode_ms, "ar_overhead_ms": ar_step_ms - decode_ms,
            "ar_step_ms": ar_step_ms, "tau": tau, "ms_per_token_dflash": step_ms / tau if tau else 0.0,
            "predicted_speedup_vs_ar": tau * ar_step_ms / step_ms if step_ms > 0 else 0.0,
            "engine_calls_only_speedup_vs_ar": (tau * decode_ms / (draft_ms + verify_ms)
                                                if draft_ms + verify_ms > 0 else 0.0),
            "measured_decode_speedup_vs_ar": _ratio(med["engine_ar_tpot_ms"], med["engine_dflash_tpot_ms"]),
        },
    }
