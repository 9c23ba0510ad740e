"""`dflash-export validate` behind the click command: resolve recipe, engine and suite, run, write the report, judge.

Bad input (unknown recipe, missing engine, malformed suite) raises DFlashError (exit 2) before anything runs; a failed
threshold raises CheckFailed (exit 1) after the report is written, so a failing run still leaves its evidence.
"""

from __future__ import annotations

from pathlib import Path

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.manifest import check_engine_recipe
from dflash_export.engines.registry import load_engine
from dflash_export.errors import CheckFailed, DFlashError
from dflash_export.files import check_output_dir
from dflash_export.recipes import load_recipe
from dflash_export.runtime.single import DFlashRuntime
from dflash_export.validate.report import summary_rows, write_report
from dflash_export.validate.runner import Reference, ValidateOptions, run_validation
from dflash_export.validate.suites import encode_prompt, load_suite

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def reference_threads() -> int:
    """Intra-op threads of the PyTorch reference: half the cores this process may use (at least one). Its OpenMP
    workers spin-wait between ops, and on a shared machine a descheduled worker stalls every op: on the shared
    2-core machine (load average ~3 from other jobs) SmolLM2-135M's reference decoded 32 tokens in 12.4 s with
    torch's default 2 threads and in 2.9 s with one (spec_generate: 53.5 s and 5.4 s); `validate --recipe
    smollm2-135m` with 8 prompts x 64 tokens and 60 seeds took 18 min 17 s before, 7 min 35 s after (load 4-7).
    DFLASH_REFERENCE_THREADS overrides it."""
    import os

    if os.environ.get("DFLASH_REFERENCE_THREADS", "").isdigit():
        return max(1, int(os.environ["DFLASH_REFERENCE_THREADS"]))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def default_engine_dir(recipe_name: str) -> Path:
    """`engines/<recipe>/onnxruntime` under the working directory, else under the repository; when only a quantized
    engine was built (`onnxruntime-int4`, ...) that one; DFlashError if none, or if several and no fp32 one."""
    rel = Path("engines") / recipe_name
    for root in (Path.cwd() / rel, REPO_ROOT / rel):
        if (root / "onnxruntime" / "manifest.json").is_file():
            return root / "onnxruntime"
        built = sorted(d for d in root.glob("onnxruntime-*") if (d / "manifest.json").is_file())
        if len(built) == 1:
            return built[0]
        if built:
            raise DFlashError(f"several engines built for recipe {recipe_name!r} ({', '.join(d.name for d in built)}"
                              f" under {root}): pass one with --engine DIR", field="--engine")
    raise DFlashError(f"no engine built for recipe {recipe_name!r} at {rel / 'onnxruntime'}: build it first with "
                      f"`dflash-export build --recipe {recipe_name} --backend onnxruntime`, or pass --engine DIR",
                      field="--engine")


def open_engine(engine_dir: Path, recipe):
    """Load the engine and refuse one built for another recipe (comparing it with this reference would mislead)."""
    manifest = check_engine_recipe(engine_dir, recipe)
    recorded = ("tool_version", "libraries", "dtype", "build_flags", "precision", "quantization")
    meta = {"dir": str(engine_dir), "manifest": {k: manifest.raw[k] for k in recorded if k in manifest.raw}}
    return load_engine(engine_dir, manifest), meta


def check_fits(engine, prompts, encoded, max_new_tokens: int, path: Path) -> None:
    """Refuse, before minutes of generation, a prompt the engine cannot take (too long for max_seq_len)."""
    runtime = DFlashRuntime(engine)
    for p, (_, ids) in zip(prompts, encoded):
        try:
            runtime.check_request(ids, SamplingParams(max_new_tokens=max_new_tokens))
        except DFlashError as e:
            raise DFlashError(f"prompt {p.id!r}: {e}", path=path, field=f"line {p.line}") from None


def run_validate(recipe_name: str, engine_dir: str | None, suite: str | None, num_prompts: int | None,
                 max_new_tokens: int, temperature: float, report_dir: str | None, dist_samples: int = 300,
                 repeats: int = 1, top_k: int = 0, top_p: float = 0.9, show_progress: bool = True, echo=print,
                 decoding: dict | None = None):
    """The whole command. Returns the ValidationReport when every threshold holds; raises CheckFailed otherwise."""
    if report_dir:  # checked first: a report that cannot be written must not cost minutes of validation
        check_output_dir(report_dir, "--report")
    recipe = load_recipe(recipe_name)
    # Read the suite before loading any model, so a malformed file fails in a second.
    path, prompts = load_suite(suite or recipe.suite, num_prompts)
    edir = Path(engine_dir) if engine_dir else default_engine_dir(recipe.name)
    engine, meta = open_engine(edir, recipe)
    try:
        encoded = [(p.id, encode_prompt(p, engine.codec, recipe.chat_template, engine.info.vocab_size, path))
                   for p in prompts]
        check_fits(engine, prompts, encoded, max_new_tokens, path)
        import torch

        torch.set_num_threads(reference_threads())
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
    out = Path(report_dir) if report_dir else Path("reports") / "validate" / recipe.name / engine.info.backend
    files = write_report(report, out)
    for check, value, threshold, status in summary_rows(report):
        echo(f"  {status:4}  {check:22} {value:>8}  {threshold}")
    echo(f"report: {files['md']}")
    if report.failures:
        parts = [f"{t['name']} {t['value']:.4g} < {t['threshold']:.4g}" + (f" ({t['note']})" if t["note"] else "")
                 for t in report.failures]
        raise CheckFailed(f"{len(parts)} threshold(s) failed: " + "; ".join(parts))
    return report
