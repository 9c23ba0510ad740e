"""`dflash-export bench`: tok/s and time per output token for
(a) DFlash on the engine (adaptive verification; `dflash-full`: every draft verified), (b) AR on the same engine,
(c) transformers `generate` (PyTorch, recipe dtype) AR, (d) the PyTorch reference `spec_generate`; τ; peak RSS.

Each mode runs in its own process, kept loaded, so its peak RSS is its own, after a warm-up generation; the modes take
turns prompt by prompt (`_run_interleaved`); figures are medians over prompts (and passes: `reps`). Greedy outputs of
every mode are compared token for token with (c).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_export.bench.concurrency import run_concurrency
from dflash_export.decoding.prompt_lookup import prompt_lookup_tau
from dflash_export.engines.base import SamplingParams, load_codec
from dflash_export.engines.build import build_engine
from dflash_export.engines.manifest import check_engine_recipe
from dflash_export.engines.registry import load_engine, require_backend
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_file, check_output_file
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import Recipe, load_recipe
from dflash_export.runtime.single import DFlashRuntime
from dflash_export.validate.suites import check_suite_fits, encode_prompt, load_suite


def encode_suite_prompts(recipe, suite: str, n: int, codec, manifest=None,
                         max_new: int | None = None) -> list[list[int]]:
    """The suite's first `n` prompts as token ids; with the engine's `manifest`, each checked against its vocabulary
    and (given `max_new`) its max_seq_len with `max_new` tokens and a block, where the manifest records them: one
    error naming the suite's line, before any worker loads."""
    path, prompts = load_suite(suite, n)
    vocab = manifest.vocab_size if manifest is not None else None
    encoded = [encode_prompt(p, codec, recipe.chat_template, vocab or 1 << 62, path) for p in prompts]
    if vocab is not None and max_new is not None and manifest.max_seq_len is not None:
        check_suite_fits(manifest, prompts, encoded, max_new, path)
    return encoded


WORKER_ERROR = "dflash-bench-worker-error: "  # prefix of the JSON line a worker writes to stderr on a DFlashError
WORKER_REPLY = "dflash-bench-worker: "  # prefix of a worker's replies on stdout (a library may print there too)


def _loading(what, path):
    """Run `what()`; an unexpected exception becomes one DFlashError naming `path` (what was being loaded)."""
    try:
        return what()
    except DFlashError:
        raise
    except Exception as e:  # safetensors, transformers, onnxruntime: each raises its own types
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise DFlashError(f"cannot load ({type(e).__name__}: {first})" if first else
                          f"cannot load ({type(e).__name__})", path=path) from None


# Engine modes: the runtime settings each runs DFlash with. "dflash" is the engine's own recipe default (its
# manifest's `decoding`); the proposer modes pin one (decoding/tree.py) so they compare on the same engine, without
# the static n-gram index of the target's past answers (decoding/static_ngrams.py) unless the mode says +static.
NO_STATIC = {"static_ngrams": False}
ENGINE_MODES = {
    "dflash": {}, "dflash-full": {"adaptive": False, "proposer": "chain", **NO_STATIC}, "ar": {},
    "chain": {"proposer": "chain", **NO_STATIC}, "tree": {"proposer": "tree", **NO_STATIC},
    "lookup": {"proposer": "lookup", **NO_STATIC},
    "tree+lookup": {"proposer": "tree+lookup", "tree_mode": "spine", **NO_STATIC},
    "tree+lookup-full": {"proposer": "tree+lookup", "tree_mode": "full", **NO_STATIC},
    "lookup+static": {"proposer": "lookup", "static_ngrams": True},
    "tree+lookup+static": {"proposer": "tree+lookup", "tree_mode": "spine", "static_ngrams": True},
}
PROPOSER_MODES = ("chain", "tree", "lookup", "tree+lookup", "tree+lookup-full", "lookup+static", "tree+lookup+static")
MODES = (*ENGINE_MODES, "hf", "reference")
SPECULATIVE = [m for m in MODES if m not in ("ar", "hf")]


def _job_recipe(recipe) -> dict:
    """What a worker needs of the recipe, its pair already resolved (a pair from --target / --drafter has no YAML
    file to reload)."""
    return {"name": recipe.name, "target": recipe.target_path, "drafter": recipe.drafter_path, "dtype": recipe.dtype,
            "block_size": recipe.block_size, "max_seq_len": recipe.max_seq_len}


def sampling_params(sampling: dict | None, max_new: int, index: int) -> SamplingParams:
    """Prompt `index`'s settings: greedy, or sampled as `sampling` says (temperature, top_p, top_k) seeded with the
    prompt's index, so every mode draws with the same stream."""
    return SamplingParams(max_new_tokens=max_new, seed=index, **(sampling or {}))


def _describe_sampling(sampling: dict | None) -> str:
    s = sampling or {}
    if not s.get("temperature"):
        return "greedy"
    return f"T {s['temperature']:g}" + (f", top-k {s['top_k']}" if s.get("top_k") else "") + (
        f", top-p {s['top_p']:g}" if s.get("top_p", 1.0) < 1.0 else "")


def _load_mode(mode: str, recipe_fields: dict, engine_dir: str, sampling: dict | None):
    """Load what `mode` decodes with; returns (gen, load_s, sources): gen(ids, n, i) -> (tokens, total_s, ttft_s,
    acceptance lengths, drafted tokens) for prompt i, and the accepted drafts per source of each engine run
    (RunStats.accepted_by / accepted_only), appended as it runs."""
    recipe = Recipe(**recipe_fields)
    sources: list[tuple[dict, dict]] = []
    temperature = (sampling or {}).get("temperature", 0.0)
    if mode in ENGINE_MODES:
        t0 = time.perf_counter()
        engine = _loading(lambda: load_engine(engine_dir), engine_dir)
        load_s = time.perf_counter() - t0
        rt = DFlashRuntime(engine, **ENGINE_MODES[mode])

        def gen(ids, n, i=0):
            s = rt.generate(ids, sampling_params(sampling, n, i), "ar" if mode == "ar" else "dflash")
            sources.append((s.accepted_by, s.accepted_only))
            return s.tokens, s.total_s, s.ttft_s, s.acceptance_lengths, s.drafted_tokens
        return gen, load_s, sources
    import torch

    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.runtime.reference import spec_generate

    dtype = getattr(torch, recipe.dtype)
    t0 = time.perf_counter()
    target = _loading(lambda: load_target(recipe.target_path, dtype), resolve_source(recipe.target_path))
    drafter = _loading(lambda: load_drafter(recipe.drafter_path, dtype),
                       resolve_source(recipe.drafter_path)) if mode == "reference" else None
    load_s = time.perf_counter() - t0
    if mode == "reference":
        bs = drafter.spec(recipe.block_size).block_size

        def gen(ids, n, i=0):
            sp = sampling_params(sampling, n, i)
            r = spec_generate(drafter, target, ids, max_new_tokens=n, block_size=recipe.block_size,
                              temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed)
            return r.tokens, r.total_s, r.ttft_s, r.acceptance_lengths, (bs - 1) * len(r.acceptance_lengths)
        return gen, load_s, sources
    stop = target.stop_token_ids

    @torch.inference_mode()
    def gen(ids, n, i=0):
        x = torch.tensor([ids])
        sample = {"do_sample": True, "temperature": temperature, "top_k": sampling.get("top_k") or None,
                  "top_p": sampling.get("top_p", 1.0)} if temperature > 0 else {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(i)
        t = time.perf_counter()
        out = target.hf.generate(x, max_new_tokens=n, eos_token_id=stop or None,
                                 pad_token_id=stop[0] if stop else 0, **sample)
        total = time.perf_counter() - t
        return out[0, len(ids):].tolist(), total, 0.0, [], 0
    return gen, load_s, sources


def _run_prompt(mode: str, gen, sources: list, ids: list[int], max_new: int, index: int) -> dict:
    started = time.time()
    toks, total, ttft, acc, drafted = gen(ids, max_new, index)
    run = {"prompt": index, "started": started, "tokens": toks, "total_s": total, "ttft_s": ttft,
           "tau": (sum(acc) / len(acc)) if acc else 1.0, "steps": len(acc), "drafted": drafted}
    if sources and mode != "ar":
        run["accepted_by"], run["accepted_only"] = sources[-1]
    return run


def _peak_rss_mb() -> float:
    """This process's own peak RSS. VmHWM belongs to the address space made at exec; ru_maxrss would also carry the
    parent's peak across fork+exec (the parent may have just built the engine)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _summary(res: dict) -> dict:
    """Speeds: medians over every run (every pass); counts (τ, drafts, tokens, sources): over the first pass, which
    each later pass repeats token for token."""
    tps = [len(r["tokens"]) / r["total_s"] for r in res["runs"] if r["total_s"] > 0]
    tpot = [(r["total_s"] - r["ttft_s"]) / max(1, len(r["tokens"]) - 1) for r in res["runs"]]
    runs = [r for r in res["runs"] if r.get("pass", 0) == 0]
    # τ pooled over prompts (all accepted tokens / all steps), as the reference defines it: a per-prompt mean lets a
    # few short or looping answers (τ 3-4 on a handful of steps) pull the figure far up.
    steps_total = sum(r["steps"] for r in runs)
    tau = sum(r["tau"] * r["steps"] for r in runs) / steps_total if steps_total else 1.0
    return {"tok_s_median": statistics.median(tps), "tpot_ms_median": 1000 * statistics.median(tpot),
            "tau": tau, "peak_rss_mb": res["peak_rss_mb"],
            "drafts_verified_per_step": sum(r.get("drafted", 0) for r in runs) / steps_total if steps_total else 0.0,
            "tokens_total": sum(len(r["tokens"]) for r in runs), "load_s": res["load_s"],
            **({"accepted_by": _sum_sources(runs, "accepted_by"), "accepted_only": _sum_sources(runs, "accepted_only")}
               if any("accepted_by" in r for r in runs) else {})}


def _sum_sources(runs: list[dict], key: str) -> dict:
    """Accepted drafts per source (drafter / context / static) over the runs."""
    out: dict = {}
    for r in runs:
        for name, n in r.get(key, {}).items():
            out[name] = out.get(name, 0) + n
    return out


class _ModeWorker:
    """One mode's worker process, kept loaded: `ask(i)` decodes prompt i there and returns its run."""

    def __init__(self, mode: str, job: Path):
        self.mode = mode
        self.err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty library cannot fill it and stall
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_export.bench.suite", str(job)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"})

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(WORKER_REPLY):
                try:
                    return json.loads(line[len(WORKER_REPLY):])
                except ValueError:  # a reply cut short: the worker is not to be trusted further
                    self.proc.kill()
                    break
        rc = self.proc.wait()
        self.err.seek(0)
        raise _worker_failure(self.mode, rc if rc else 1, self.err.read())

    def ask(self, command: str) -> dict:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it has exited: reply() reads why
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()


def _run_interleaved(modes: list[str], job: dict, reps: int, console) -> dict:
    """Every mode in a process of its own, all kept loaded; each prompt is decoded by every mode before the next
    prompt, in an order rotated from one prompt to the next, `reps` passes over the prompts. A machine whose speed
    drifts (other jobs, clocks) then hits every mode alike, and no mode always runs first or second (on these 2-core
    machines the second of two modes run one after the other measured up to 14 % faster)."""
    n = len(job["prompts"])
    results = {m: {"mode": m, "runs": []} for m in modes}
    workers: dict[str, _ModeWorker] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode in modes:  # loaded one at a time, so each load time is its own
                path = Path(tmp) / f"job-{len(workers)}.json"
                path.write_text(json.dumps({"mode": mode, **job}), encoding="utf-8")
                workers[mode] = _ModeWorker(mode, path)
                results[mode]["load_s"] = workers[mode].reply()["load_s"]
            console.print(f"[bench] {', '.join(modes)}: {n} prompts x {job['max_new']} new tokens, interleaved"
                          + (f", {reps} passes" if reps > 1 else "") + " ...")
            for rep in range(reps):
                for i in range(n):
                    k = (rep * n + i) % len(modes)
                    for mode in modes[k:] + modes[:k]:
                        results[mode]["runs"].append({**workers[mode].ask(str(i))["run"], "pass": rep})
            for mode in modes:
                results[mode]["peak_rss_mb"] = workers[mode].ask("done")["peak_rss_mb"]
        finally:
            for w in workers.values():
                w.close()
    return results


def _pass_ratios(a: dict, b: dict) -> list[float]:
    """Mode a's decode speed over mode b's in each pass (all tokens / all seconds of the pass)."""
    out = []
    for rep in sorted({r["pass"] for r in a["runs"]}):
        speed = [sum(len(r["tokens"]) for r in x["runs"] if r["pass"] == rep)
                 / max(1e-9, sum(r["total_s"] for r in x["runs"] if r["pass"] == rep)) for x in (a, b)]
        out.append(speed[0] / speed[1] if speed[1] else 0.0)
    return out


def check_modes(modes: list[str]) -> None:
    """Every mode known and given once (one worker, or one run per level, each: a second would double its runs)."""
    for i, m in enumerate(modes):
        if m not in MODES:
            raise DFlashError(f"unknown mode {m!r} (known: {', '.join(MODES)})", field="--modes")
        if m in modes[:i]:
            raise DFlashError(f"mode {m!r} given twice", field="--modes")


def run_bench(recipe_name: str, engine_dir: str | None, suite: str | None, num_prompts: int, max_new: int,
              modes: list[str], out_json: str | None, sampling: dict | None = None, reps: int = 1) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    check_modes(modes)
    if out_json:
        check_output_file(out_json, "--out")  # before minutes of benchmarking, not after
    recipe = load_recipe(recipe_name)
    if engine_dir is None:
        recipe.check_new_tokens(max_new)  # before the build, which can take minutes
        engine_dir = str(build_engine(recipe, "onnxruntime").engine_dir)
    manifest = check_engine_recipe(Path(engine_dir), recipe)  # as validate does: another recipe's engine misleads
    if any(m in ENGINE_MODES for m in modes):  # here, not in each mode's worker
        require_backend(engine_dir, manifest)
    codec = load_codec(Path(engine_dir))  # the tokenizer alone: the engine loads in the workers
    prompts = encode_suite_prompts(recipe, suite or recipe.suite, num_prompts, codec, manifest, max_new)
    results = _run_interleaved(modes, {"recipe": _job_recipe(recipe), "engine": engine_dir, "prompts": prompts,
                                         "max_new": max_new, "sampling": sampling}, reps, console)
    summary = {m: _summary(r) for m, r in results.items()}
    # The prompt-lookup yardstick on each speculative mode's own output tokens (no second decode): the τ a free n-gram
    # drafter would reach on the same answers, so a drafter can be seen to beat it or not.
    bs = manifest.block_size  # the block the engine drafted (its spec)
    for m in SPECULATIVE:
        if m in results:
            summary[m]["tau_prompt_lookup"] = prompt_lookup_tau(
                [(p, r["tokens"]) for p, r in zip(prompts, results[m]["runs"])], bs)
    # Sampled: plain decoding on the same engine draws with the same stream (a walked DFlash output equals it);
    # transformers' sampler does not.
    sampled = bool((sampling or {}).get("temperature"))
    base = results.get("ar") if sampled else (results.get("hf") or results.get("ar"))
    if base:  # a prompt counts when every pass's output equals the base's output of the same pass
        for m, r in results.items():
            differs = {a["prompt"] for a, b in zip(r["runs"], base["runs"]) if a["tokens"] != b["tokens"]}
            summary[m]["identical_to_" + base["mode"]] = f"{len(prompts) - len(differs)}/{len(prompts)}"
    names = {"dflash": "(a) DFlash", "dflash-full": "(a') DFlash full", "ar": "(b) AR, same engine",
             "hf": "(c) HF generate", "reference": "(d) PyTorch spec",
             **{m: f"DFlash {m}" for m in PROPOSER_MODES}}
    # Short headers: the table fits 80 columns (a row the terminal wraps is unreadable), and the caption says what
    # each short header means. A long mode name folds inside its cell; the figures never shrink (cut to "1.…" they
    # were lost, in a log as in a terminal).
    same = (f"same: prompts whose output equals {names[base['mode']].split()[0]}'s token for token in every pass"
            if base else "same: empty without an ar or hf mode to compare with")
    table = Table(title=f"{recipe.name}: {_describe_sampling(sampling)}, {max_new} new tokens, {len(prompts)} prompts "
                  "(medians)",
                  caption="tau: tokens per target pass under the mode's drafting; lookup tau: prompt lookup replayed "
                          "on the same tokens; drafts: verified per step; RSS MB: the mode's peak resident memory; "
                          + same,
                  padding=(0, 1))
    table.add_column("mode", justify="left", overflow="fold")
    for col in ("tok/s", "ms/tok", "tau", "lookup\ntau", "drafts", "RSS\nMB", "same"):
        table.add_column(col, justify="right", no_wrap=True)
    for m, s in summary.items():
        ident = next((v for k, v in s.items() if k.startswith("identical_to_")), "")
        lookup = f"{s['tau_prompt_lookup']:.2f}" if "tau_prompt_lookup" in s else ""
        table.add_row(names[m], f"{s['tok_s_median']:.1f}", f"{s['tpot_ms_median']:.1f}", f"{s['tau']:.2f}", lookup,
                      f"{s['drafts_verified_per_step']:.2f}", f"{s['peak_rss_mb']:.0f}", ident)
    console.print(table)
    for m, s in summary.items():
        if s.get("accepted_by"):
            console.print(f"{names[m]}: accepted drafts by source (in parentheses: those no other source "
                          "proposed): " + ", ".join(
                f"{k} {v} ({s['accepted_only'].get(k, 0)})" for k, v in s["accepted_by"].items()))
    ratios = {}
    pairs = [("dflash", "ar"), ("dflash", "hf"), ("dflash", "reference"), ("dflash-full", "ar")]
    pairs += [(m, "ar") for m in PROPOSER_MODES]
    for a, b in pairs:
        if a in summary and b in summary:
            ratios[f"{a}/{b}"] = summary[a]["tok_s_median"] / summary[b]["tok_s_median"]
    if ratios:
        console.print("speedups: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    pass_ratios = {}
    if reps > 1:  # each pass's ratio of speeds: how far one pass's figure moves from the next on this machine
        pass_ratios = {k: _pass_ratios(results[k.split("/")[0]], results[k.split("/")[1]]) for k in ratios}
        console.print("pass by pass: " + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v)
                                                    for k, v in pass_ratios.items()))
    report = {"recipe": recipe.name, "engine": engine_dir, "max_new_tokens": max_new, "sampling": sampling or {},
              "reps": reps, "summary": summary, "ratios": ratios, "pass_ratios": pass_ratios, "raw": results}
    if out_json:
        with atomic_file(out_json) as f:
            f.write(json.dumps(report, indent=2) + "\n")
    return report


def run_concurrency_bench(recipe_name: str, engine_dir: str | None, suite: str | None, num_prompts: int,
                          max_new: int, levels: list[int], modes: list[str], out_json: str | None,
                          reps: int = 1, sampling: dict | None = None) -> dict:
    """`bench --concurrency`: continuous batching at each level (dflash_export.bench.concurrency), in this process."""
    check_modes(modes)  # a misspelt mode is refused here too, not dropped with the modes batching does not run
    modes = [m for m in modes if m in ("dflash", "ar")] or ["dflash", "ar"]
    if not levels or any(n < 1 for n in levels):  # before any engine is built
        raise DFlashError(f"expected positive integers, got {levels}", field="--concurrency")
    twice = next((n for i, n in enumerate(levels) if n in levels[:i]), None)
    if twice is not None:
        raise DFlashError(f"level {twice} given twice", field="--concurrency")
    if max(levels) > num_prompts:
        raise DFlashError(f"level {max(levels)} is more than --num-prompts {num_prompts}: a level keeps that many "
                          "requests in flight, one per prompt", field="--concurrency")
    if out_json:
        check_output_file(out_json, "--out")
    recipe = load_recipe(recipe_name)
    if engine_dir is None:
        recipe.check_new_tokens(max_new)  # before the build, which can take minutes
        engine_dir = str(build_engine(recipe, "onnxruntime").engine_dir)
    manifest = check_engine_recipe(Path(engine_dir), recipe)
    require_backend(engine_dir, manifest)
    prompts = encode_suite_prompts(recipe, suite or recipe.suite, num_prompts, load_codec(Path(engine_dir)),
                                   manifest, max_new)
    report = {"recipe": recipe.name, **run_concurrency(engine_dir, prompts, max_new, levels, modes, reps=reps,
                                                       sampling=sampling)}
    if out_json:
        with atomic_file(out_json) as f:
            f.write(json.dumps(report, indent=2) + "\n")
    return report


def _worker_failure(mode: str, returncode: int, stderr: str) -> DFlashError:
    """One line for a failed worker: its own DFlashError when it raised one (naming the file), else a short message."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(WORKER_ERROR):
            try:
                msg = json.loads(ln[len(WORKER_ERROR):])["message"]
            except (ValueError, KeyError, TypeError):
                break
            return DFlashError(f"{msg} (bench mode {mode})")
    if returncode < 0:
        why = f"killed by signal {-returncode}"
    else:
        why = lines[-1].strip()[:300] if lines else f"exit status {returncode}"
    return DFlashError(f"benchmark worker failed: {why}", field=f"--modes {mode}")


def _say(obj: dict) -> None:
    sys.stdout.write(WORKER_REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker_main(job: str, commands=None) -> int:
    """A mode's worker process: load, warm up, say ready; then decode the prompt each line of `commands` (stdin)
    names, one reply each, until "done" or the end of input; then its peak RSS. A DFlashError (a file that does not
    load) goes to stderr as one JSON line for the parent (`_worker_failure`)."""
    spec = json.loads(Path(job).read_text(encoding="utf-8"))
    mode, prompts, max_new = spec["mode"], spec["prompts"], spec["max_new"]
    try:
        gen, load_s, sources = _load_mode(mode, spec["recipe"], spec["engine"], spec.get("sampling"))
        # warm-up: first-call allocations and graph initialization are not steady state; never more new tokens than
        # the run asks for, so a prompt that fits the engine's context with them is not refused here
        gen(prompts[0], min(16, max_new))
        _say({"ready": True, "load_s": load_s})
        for line in commands if commands is not None else sys.stdin:
            if line.strip() == "done":
                break
            i = int(line)
            _say({"run": _run_prompt(mode, gen, sources, prompts[i], max_new, i)})
    except DFlashError as e:
        sys.stderr.write(WORKER_ERROR + json.dumps({"message": str(e)}) + "\n")
        return e.exit_code or 2
    _say({"peak_rss_mb": _peak_rss_mb()})
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
