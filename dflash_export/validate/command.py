"""`dflash-export validate` behind the click command: resolve recipe, engine and suite, run, write the report, judge.

Bad input (unknown recipe, missing engine, malformed suite) raises DFlashError (exit 2) before anything runs; a failed
threshold raises CheckFailed (exit 1) after the report is written, so a failing run still leaves its evidence.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dflash_export.engines.build import default_engine_dir
from dflash_export.engines.manifest import check_engine_recipe, manifest_dir_name
from dflash_export.engines.registry import load_engine
from dflash_export.environment import env_int, install_hint
from dflash_export.errors import CheckFailed, MissingDependency
from dflash_export.recipes import load_recipe
from dflash_export.validate.report import check_report_dir, summary_rows, write_report
from dflash_export.validate.runner import Reference, ValidateOptions, run_validation
from dflash_export.validate.suites import check_suite_fits, encode_prompt, load_suite

MAX_REFERENCE_THREADS = 1024  # DFLASH_REFERENCE_THREADS' bound: torch takes an int32, each thread a stack


def reference_threads() -> int:
    """Intra-op threads of the PyTorch reference: half the cores this process may use (at least one). Its OpenMP
    workers spin-wait between ops, and on a shared machine a descheduled worker stalls every op: on the shared
    2-core machine (load average ~3 from other jobs) SmolLM2-135M's reference decoded 32 tokens in 12.4 s with
    torch's default 2 threads and in 2.9 s with one (spec_generate: 53.5 s and 5.4 s); `validate --recipe
    smollm2-135m` with 8 prompts x 64 tokens and 60 seeds took 18 min 17 s before, 7 min 35 s after (load 4-7).
    DFLASH_REFERENCE_THREADS (1..MAX_REFERENCE_THREADS) overrides it."""
    import os

    given = env_int("DFLASH_REFERENCE_THREADS", 1, MAX_REFERENCE_THREADS)
    if given is not None:
        return given
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def open_engine(engine_dir: Path, recipe):
    """Load the engine and refuse one built for another recipe (comparing it with this reference would mislead)."""
    manifest = check_engine_recipe(engine_dir, recipe)
    recorded = ("tool_version", "libraries", "dtype", "build_flags", "precision", "quantization")
    meta = {"dir": str(engine_dir), "name": manifest_dir_name(manifest),
            "manifest": {k: manifest.raw[k] for k in recorded if k in manifest.raw}}
    return load_engine(engine_dir, manifest), meta


# The libraries validate needs only after its work (the G-test's tail, the plots): checked before the work, so that a
# run cannot spend minutes and then fail on an import.
REPORT_LIBRARIES = ("scipy", "matplotlib")
# The power calculation of the sampled check (docs/stages.md, "The T>0 distribution check"), measured with 2 prompts:
# seeds per prompt at which every planted fault reached p < 0.001 in 3 of 3 runs.
POWER_FULL_SEEDS = 300
POWER_SMALLEST_MEASURED = 100
QUICK_PROMPTS = 10  # the default prompt count; fewer is warned about


def check_report_libraries() -> None:
    """MissingDependency (exit 2, the install line) for a library the report needs, before any work."""
    for module in REPORT_LIBRARIES:
        if importlib.util.find_spec(module) is None:
            raise MissingDependency(f"not installed; validate's report needs it: {install_hint(module)}",
                                    field=module)


def power_warnings(num_prompts: int, dist_prompts: int, dist_samples: int, temperature: float) -> list[str]:
    """What the run's sizes can and cannot show, one line each (empty at --full's sizes). `dist_prompts`: the
    prompts the sampled check draws from (the suite's shortest, at most 2)."""
    out = []
    if num_prompts < QUICK_PROMPTS:
        bound = 1 - 0.05 ** (1 / num_prompts)  # 95 % upper bound on a rate when 0 of n prompts diverge
        out.append(f"{num_prompts} prompt(s): even if every one is identical to plain decoding, that bounds the "
                   f"share of prompts that would diverge only below {bound:.0%} (95 % confidence); use "
                   f"--num-prompts {QUICK_PROMPTS} or more (--full: the whole suite)")
    if temperature <= 0 or dist_samples <= 0:
        out.append("no sampled check (temperature 0 or --dist-samples 0): losslessness at T > 0 is not tested")
        return out
    # The power table was measured on 2 prompts; fewer prompts test fewer tokens: scale to seeds-per-2-prompts.
    n = dist_samples * dist_prompts / 2
    if n >= POWER_FULL_SEEDS:
        return out
    where = "docs/stages.md, the sampled check's power table"
    if n < POWER_SMALLEST_MEASURED / 5:
        out.append(f"{dist_samples} seed(s) x {dist_prompts} prompt(s): far below the smallest size measured (100 "
                   f"seeds x 2 prompts, {where}), the sampled check's p-value says next to nothing; --full "
                   f"({POWER_FULL_SEEDS} seeds) catches all five planted faults")
    elif n >= POWER_SMALLEST_MEASURED:
        out.append(f"{dist_samples} seeds x {dist_prompts} prompt(s): the sampled check catches gross sampler faults "
                   f"(all four caught at 100 seeds x 2 prompts) but not reliably a dropped 3-10 % nucleus token "
                   f"(0/3 at 100, 3/3 at 200; {where}); --full ({POWER_FULL_SEEDS} seeds) catches all five")
    else:
        out.append(f"{dist_samples} seeds x {dist_prompts} prompt(s): below the smallest size measured (100 seeds x 2 "
                   f"prompts), the sampled check can be expected to catch only faults as gross as a bonus token from "
                   f"the wrong row or draft probabilities from the wrong slot; a residual drawn from p (p 4e-7 at "
                   f"100) or a temperature applied twice (2e-5 at 100) would, log p falling about linearly with the "
                   f"sample size, not reach p < 0.001 below about 50 and 65 seeds ({where}); --full "
                   f"({POWER_FULL_SEEDS} seeds) catches all five planted faults")
    return out


def run_validate(recipe_name: str, engine_dir: str | None, suite: str | None, num_prompts: int | None,
                 max_new_tokens: int, temperature: float, report_dir: str | None, dist_samples: int = 300,
                 repeats: int = 1, top_k: int = 0, top_p: float = 0.9, show_progress: bool = True, echo=print,
                 decoding: dict | None = None):
    """The whole command. Returns the ValidationReport when every threshold holds; raises CheckFailed otherwise."""
    if report_dir:  # checked first: a report that cannot be written must not cost minutes of validation
        check_report_dir(report_dir)
    check_report_libraries()
    threads = reference_threads()  # a bad DFLASH_REFERENCE_THREADS is refused before the engine loads
    recipe = load_recipe(recipe_name)
    # Read the suite before loading any model, so a malformed file fails in a second.
    path, prompts = load_suite(suite or recipe.suite, num_prompts)
    edir = Path(engine_dir) if engine_dir else default_engine_dir(recipe.name)
    engine, meta = open_engine(edir, recipe)
    try:
        if not report_dir:  # the default, under the current directory: checked as soon as the backend names it
            # one directory per engine build (onnxruntime, onnxruntime-int4, ...): a quantized engine's report never
            # replaces the fp32 engine's
            report_dir = str(Path("reports") / "validate" / recipe.name / meta["name"])
            check_report_dir(report_dir)
        encoded = [(p.id, encode_prompt(p, engine.codec, recipe.chat_template, engine.info.vocab_size, path))
                   for p in prompts]
        check_suite_fits(engine.info, prompts, [ids for _, ids in encoded], max_new_tokens, path)
        # after every check of the input (one error line, nothing before it), before the work
        for line in power_warnings(len(prompts), min(len(prompts), ValidateOptions.dist_prompts), dist_samples,
                                   temperature):
            print(f"warning: {line}", file=sys.stderr, flush=True)
        import torch

        torch.set_num_threads(threads)
        # An ONNX Runtime engine computes in fp32 whatever dtype the recipe asks of GPU backends: its reference too.
        reference = Reference.from_recipe(recipe, "float32" if engine.info.backend == "onnxruntime" else None)
        opts = ValidateOptions(max_new_tokens=max_new_tokens, temperature=temperature, dist_samples=dist_samples,
                               repeats=repeats, top_k=top_k, top_p=top_p, decoding=decoding or {})
        return validate_engine(recipe, engine, reference, encoded, opts, {"name": suite or recipe.suite,
                               "path": str(path)}, meta, report_dir, show_progress, echo)
    finally:
        engine.close()


def validate_engine(recipe, engine, reference, encoded, opts, suite_meta, engine_meta, report_dir, show_progress=False,
                    echo=print):
    """Run, write the report, print the summary; CheckFailed (exit 1) when a threshold fails."""
    report = run_validation(recipe, engine, reference, encoded, opts, suite_meta, engine_meta, show_progress)
    out = Path(report_dir)
    files = write_report(report, out)
    for check, value, threshold, status in summary_rows(report):
        echo(f"  {status:4}  {check:22} {value:>8}  {threshold}")
    echo(f"  tau: tokens per target pass ({report.greedy.get('tau_counts', '?')}); greedy, "
         f"{report.greedy['prompts']} prompt(s) x {report.options['max_new_tokens']} tokens")
    echo(f"report: {files['md']}")
    if report.failures:
        parts = [f"{t['name']} {t['value']:.4g} < {t['threshold']:.4g}" + (f" ({t['note']})" if t["note"] else "")
                 for t in report.failures]
        raise CheckFailed(f"{len(parts)} threshold(s) failed: " + "; ".join(parts))
    return report
