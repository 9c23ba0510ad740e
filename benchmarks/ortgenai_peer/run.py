"""This project's ONNX Runtime engines side by side with ONNX Runtime GenAI -- what an ONNX user on a CPU runs -- on
the same token ids.

    python benchmarks/ortgenai_peer/run.py                       # smollm2-135m, 8 prompts x 128 tokens, 2 rounds
    python benchmarks/ortgenai_peer/run.py --precisions int4 --ngram-grid 3:7 --rounds 1 --out peer.json

What it does (docs/figures.md, "ONNX Runtime GenAI peer benchmark"):
1. ONNX Runtime GenAI (PyPI `onnxruntime-genai`, --ortgenai-version) in its own virtual environment in the cache
   (`<cache>/ortgenai/<version>/venv`, never this project's), with the same onnxruntime version as this project's
   (checked: both sides then run the same kernels) and the torch / transformers / onnx versions its builder needs,
   pinned to this project's.
2. The recipe's target (for SmolLM2, the HF copy the project converts from the GGUF once) built by ORT GenAI's own
   builder (`python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu`: int4 is RTN, block 32,
   symmetric, accuracy level 4, like this project's) at each --precisions, into the cache.
3. This project's engines at the same precisions (built if absent), each loaded once in its own process; ORT GenAI's
   models likewise, one process per precision, all kept loaded (peak RSS is per process).
4. Interleaved rounds: for every prompt of every round each process runs it, in a rotated order, so load from other
   processes on a shared machine hits all systems alike. This project's processes decode plainly and with DFlash (the
   recipe's default decoding); ORT GenAI's plainly and with its n-gram (prompt-lookup) speculative decoding at each
   --ngram-grid setting (ngram_size:max_draft_tokens); the best setting per precision is the one with the highest
   median decode speed, and it is the yardstick of the ratios.
Both systems get the same token ids (the suite's held-out chat prompts encoded by this project's tokenizer), decode
greedily and stop at the same end-of-turn token; decode speed = tokens after the first / time after the first token
(both without the prompt's prefill). "identical to own plain" compares each system's speculative output with its own
plain decoding. Both sides run with the same intra-op threads and spinning off (this project's default; ORT GenAI
passes a session option with a string value that it does not know, here `session.intra_op.allow_spinning`, on to ONNX
Runtime as a config entry). Nothing of ORT GenAI is committed or installed outside the cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OG_VERSION = "0.18.0"
# ngram_size:max_draft_tokens. 7 drafts = the shipped drafter's block of 8; 4 = ORT GenAI's default draft length.
DEFAULT_GRID = "2:7,3:4,3:7,4:7"


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Pure parts (tests/test_bench.py) ----------------------------------------------------------------------------------


def parse_grid(spec: str) -> list[dict]:
    """'3:7,4:7' -> [{"ngram_size": 3, "max_draft_tokens": 7}, ...]; ORT GenAI's own ranges (ngram_size >= 2, 1 <=
    max_draft_tokens <= 16) are checked here, so a bad grid fails before any model is built."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        parts = item.split(":")
        try:
            n, k = (int(p) for p in parts)
        except ValueError:
            raise SystemExit(f"--ngram-grid: {item!r} is not NGRAM_SIZE:MAX_DRAFT_TOKENS (e.g. 3:7)") from None
        if n < 2 or not 1 <= k <= 16:
            raise SystemExit(f"--ngram-grid: {item!r}: ngram_size must be >= 2 and max_draft_tokens 1..16")
        setting = {"ngram_size": n, "max_draft_tokens": k}
        if setting not in out:
            out.append(setting)
    if not out:
        raise SystemExit("--ngram-grid: no setting given")
    return out


def grid_key(setting: dict) -> str:
    return f"ngram:{setting['ngram_size']}:{setting['max_draft_tokens']}"


def decode_rate(tokens: int, first_tokens: int, seconds_after_first: float) -> float:
    """Tokens per second after the first decode call (what both systems report without the prompt's prefill)."""
    n = tokens - first_tokens
    return n / seconds_after_first if n > 0 and seconds_after_first > 0 else 0.0


def identical(runs: list[dict], own_plain: list[dict]) -> int:
    """How many of `runs` produced exactly the tokens of the same prompt's plain run."""
    return sum(a["tokens"] == b["tokens"] for a, b in zip(runs, own_plain))


def med_rate(per: dict, key: tuple) -> float:
    return statistics.median(x["tok_s"] for x in per[key])


def best_setting(rounds: list[dict], precision: str, settings: list[str]) -> str:
    """The ORT GenAI n-gram setting with the highest median (over rounds) of per-round median decode speed."""
    return max(settings, key=lambda s: statistics.median(med_rate(per, ("ortgenai", precision, s)) for per in rounds))


def ratio(rounds: list[dict], num: tuple, den: tuple) -> float:
    """Median over rounds of the within-round ratio of median decode speeds."""
    return statistics.median(med_rate(per, num) / med_rate(per, den) for per in rounds)


def per_round(rounds: list[dict], precisions: list[str], settings: list[str], loads: list[float]) -> list[str]:
    """One line per precision and round: this project's plain / ORT GenAI plain and its DFlash / ORT GenAI's best
    n-gram setting (best over all rounds) within that round, with the load average at the round's end, so the spread
    a shared machine puts between rounds stays visible beside the medians."""
    lines = []
    for p in precisions:
        best = best_setting(rounds, p, settings)
        for r, per in enumerate(rounds):
            plain = med_rate(per, ("ours", p, "plain")) / med_rate(per, ("ortgenai", p, "plain"))
            dfl = med_rate(per, ("ours", p, "dflash")) / med_rate(per, ("ortgenai", p, best))
            line = (f"{p} round {r + 1}: plain {plain:.2f}x ORT GenAI plain, DFlash {dfl:.2f}x its n-gram "
                    f"{best.split(':', 1)[1]}")
            keys = [("ours", p, "plain"), ("ortgenai", p, "plain"), ("ours", p, "dflash"), ("ortgenai", p, best)]
            if all(x.get("cpu_ms_per_token") for k in keys for x in per[k]):
                # in CPU time per token (the other side's over ours: > 1 = this project cheaper), less load-bound
                cpu = [statistics.median(x["cpu_ms_per_token"] for x in per[k]) for k in keys]
                line += f"; in CPU ms per token {cpu[1] / cpu[0]:.2f}x and {cpu[3] / cpu[2]:.2f}x"
            lines.append(line + f" (load average {loads[r]:.1f})")
    return lines


def lossless_subset(rounds: list[dict], precisions: list[str], settings: list[str]) -> list[str]:
    """One line per precision: DFlash / ORT GenAI's best n-gram setting on only the prompts where that setting's
    output equals ORT GenAI's own plain decoding in every round (where both systems decode losslessly: elsewhere its
    n-gram decoding writes another text, whose repetitions lookups draft more easily), as a median over rounds of
    the within-round ratio of the two systems' median decode speeds over those prompts, with each side's median τ.
    Reported beside the targets, which count every prompt."""
    lines = []
    for p in precisions:
        best = best_setting(rounds, p, settings)
        og_plain, og_ngram, ours = ("ortgenai", p, "plain"), ("ortgenai", p, best), ("ours", p, "dflash")
        n = len(rounds[0][og_plain])
        keep = [i for i in range(n)
                if all(per[og_ngram][i]["tokens"] == per[og_plain][i]["tokens"] for per in rounds)]
        head = (f"{p}: on the {len(keep)}/{n} prompts where ORT GenAI's n-gram {best.split(':', 1)[1]} decodes its "
                "plain text")
        if not keep:
            lines.append(head + ": none")
            continue

        def med(per, key, field="tok_s"):
            return statistics.median(per[key][i][field] for i in keep)

        dfl = statistics.median(med(per, ours) / med(per, og_ngram) for per in rounds)
        gain = statistics.median(med(per, og_ngram) / med(per, og_plain) for per in rounds)
        lines.append(f"{head}: DFlash {dfl:.2f}x its n-gram (its n-gram {gain:.2f}x its plain); τ "
                     f"{med(rounds[0], ours, 'tau'):.2f} against its {med(rounds[0], og_ngram, 'tau'):.2f}")
    return lines


def summarize(rounds: list[dict], precisions: list[str], settings: list[str], rss: dict, weights: dict) -> list[dict]:
    """One row per (system, precision, mode): decode tok/s, ratios against ORT GenAI's plain and best n-gram decoding
    of the same precision within each round, tau, identical-to-own-plain count, peak RSS and weights (MiB)."""
    rows = []
    for p in precisions:
        best = best_setting(rounds, p, settings)
        og_plain, og_ngram = ("ortgenai", p, "plain"), ("ortgenai", p, best)
        for key in [("ours", p, "plain"), ("ours", p, "dflash"), og_plain] + [("ortgenai", p, s) for s in settings]:
            sysname, _, mode = key
            first = rounds[0][key]
            own = rounds[0][(sysname, p, "plain")]
            rows.append({
                "system": sysname, "precision": p, "mode": mode, "best": mode == best,
                "tok_s": statistics.median(med_rate(per, key) for per in rounds),
                "vs_ortgenai_plain": ratio(rounds, key, og_plain),
                "vs_ortgenai_ngram": ratio(rounds, key, og_ngram),
                "tau": statistics.median(x["tau"] for x in first),
                "identical_to_own_plain": None if mode == "plain" else identical(first, own),
                "prompts": len(first), "peak_rss_mb": rss[(sysname, p)], "weights_mb": weights[(sysname, p)],
            })
    return rows


def render_table(rows: list[dict]) -> str:
    head = ("| system | weights | mode | decode tok/s | × ORT GenAI plain | × ORT GenAI n-gram (best) | τ | "
            "identical to own plain | peak RSS MiB (weights) |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        mode = {"plain": "plain", "dflash": "DFlash"}.get(r["mode"], r["mode"]) + (" (best)" if r["best"] else "")
        ident = "—" if r["identical_to_own_plain"] is None else f"{r['identical_to_own_plain']}/{r['prompts']}"
        name = "this project" if r["system"] == "ours" else "ORT GenAI"
        lines.append(f"| {name} | {r['precision']} | {mode} | {r['tok_s']:.1f} | {r['vs_ortgenai_plain']:.2f} | "
                     f"{r['vs_ortgenai_ngram']:.2f} | {r['tau']:.2f} | {ident} | "
                     f"{r['peak_rss_mb']:.0f} ({r['weights_mb']:.0f}) |")
    return "\n".join(lines)


def verdicts(rows: list[dict], drafter_mb: dict) -> list[str]:
    """The targets, one line each: plain >= 1.05x ORT GenAI plain; DFlash >= 1.3x ORT GenAI's best n-gram and
    >= 1.6x its plain, identical to own plain on every prompt; peak RSS <= ORT GenAI's + the drafter's weights."""
    out = []
    for p in dict.fromkeys(r["precision"] for r in rows):
        get = {(r["system"], r["mode"]): r for r in rows if r["precision"] == p}
        plain, dfl, ogp = get[("ours", "plain")], get[("ours", "dflash")], get[("ortgenai", "plain")]
        checks = [
            ("plain / ORT GenAI plain", plain["vs_ortgenai_plain"], 1.05),
            ("DFlash / ORT GenAI n-gram", dfl["vs_ortgenai_ngram"], 1.3),
            ("DFlash / ORT GenAI plain", dfl["vs_ortgenai_plain"], 1.6),
        ]
        for what, got, want in checks:
            # three decimals: a ratio printed as the target itself must not read as met when it is not
            out.append(f"{p}: {what} {got:.3f}x (target >= {want}x): {'met' if got >= want else 'MISSED'}")
        ok = dfl["identical_to_own_plain"] == dfl["prompts"]
        out.append(f"{p}: DFlash identical to own plain {dfl['identical_to_own_plain']}/{dfl['prompts']}: "
                   f"{'met' if ok else 'MISSED'}")
        cap = ogp["peak_rss_mb"] + drafter_mb[p]
        out.append(f"{p}: peak RSS {dfl['peak_rss_mb']:.0f} MiB (target <= ORT GenAI's {ogp['peak_rss_mb']:.0f} + "
                   f"drafter {drafter_mb[p]:.0f} = {cap:.0f}): {'met' if dfl['peak_rss_mb'] <= cap else 'MISSED'}")
    return out


def venv_requirements(og_version: str, versions: dict) -> list[str]:
    """What ORT GenAI's venv installs: the runtime pinned to this project's onnxruntime (the same kernels on both
    sides), and its builder's libraries pinned to this project's (`versions`: distribution -> version)."""
    reqs = [f"onnxruntime-genai=={og_version}"]
    for dist in ("onnxruntime", "torch", "transformers", "onnx", "onnx-ir", "safetensors"):
        if versions.get(dist):
            reqs.append(f"{dist}=={versions[dist].split('+')[0]}")
    return reqs


# ORT GenAI: install, build -----------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def ortgenai_venv(root: Path, og_version: str) -> Path:
    """The venv's python, made once: onnxruntime-genai + this project's onnxruntime (refused if pip resolves another
    one) + the builder's libraries."""
    venv = root / og_version / "venv"
    py = venv / "bin" / "python"
    ours = {d: _version(d) for d in ("onnxruntime", "torch", "transformers", "onnx", "onnx-ir", "safetensors")}
    done = venv / ".dflash-complete"  # written last: an interrupted install is redone, never taken for a venv
    if not done.is_file():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        reqs = venv_requirements(og_version, ours)
        log(f"installing {', '.join(reqs)} into {venv}")
        try:
            subprocess.run([str(py), "-m", "pip", "install", "-q", *reqs], check=True)
        except subprocess.CalledProcessError:
            shutil.rmtree(venv, ignore_errors=True)
            raise SystemExit(f"pip could not install {' '.join(reqs)} into {venv}") from None
        done.write_text(" ".join(reqs) + "\n")
    probe = "import onnxruntime, onnxruntime_genai as og; print(onnxruntime.__version__, og.__version__)"
    got = subprocess.run([str(py), "-c", probe],
                         capture_output=True, text=True, check=True, cwd="/").stdout.split()
    if got[0] != ours["onnxruntime"]:
        raise SystemExit(f"{venv}: ORT GenAI runs onnxruntime {got[0]}, this project {ours['onnxruntime']}: "
                         "remove the venv to rebuild it")
    log(f"ORT GenAI {got[1]} on onnxruntime {got[0]} (this project: {ours['onnxruntime']})")
    return py


def ortgenai_model(py: Path, hf_dir: Path, precision: str, out: Path) -> Path:
    """ORT GenAI's builder run on `hf_dir` at `precision` for the CPU, once (written to a temp dir, then renamed)."""
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"building {out} with ORT GenAI's builder ({precision})")
    r = subprocess.run([str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
                        "-p", precision, "-e", "cpu", "-c", str(tmp.with_name(tmp.name + "-cache"))],
                       check=False, capture_output=True, text=True, cwd="/")
    shutil.rmtree(tmp.with_name(tmp.name + "-cache"), ignore_errors=True)
    if r.returncode != 0 or not (tmp / "genai_config.json").is_file():
        raise SystemExit(f"ORT GenAI's builder failed on {hf_dir}: {r.stderr[-800:]}")
    tmp.rename(out)
    return out


# ORT GenAI worker (runs in ORT GenAI's venv: standard library + onnxruntime_genai only) ----------------------------


def ortgenai_worker(model_dir: str, n: int, threads: int, grid: list[dict]) -> None:
    """One ORT GenAI model in this process, serving stdin lines of prompt ids with one stdout line each: plain
    decoding, then n-gram decoding at each grid setting. At end of input, one last line with the peak RSS."""
    import onnxruntime_genai as og

    cfg = og.Config(model_dir)
    # the same thread settings as this project's sessions: spinning off (ORT GenAI hands unknown string-valued
    # session options to ONNX Runtime as config entries)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1, "session.intra_op.allow_spinning": "0"}}}}))
    model = og.Model(cfg)

    def generate(ids: list[int], budget: int, spec: dict | None) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + budget)
        if spec:
            params.set_speculative_options(**spec)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        gen.generate_next_token()  # the first token, from the prompt's logits
        first = len(gen.get_sequence(0)) - len(ids)
        t0, c0 = time.perf_counter(), time.process_time()
        while not gen.is_done():
            gen.generate_next_token()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = [int(t) for t in gen.get_sequence(0)[len(ids):]]
        tau = 1.0
        if spec:
            st = gen.get_speculative_stats()
            forwards = st["target_forward_passes"] + st["standard_fallback_steps"]
            tau = (len(tokens) - first) / forwards if forwards else 1.0
        after = len(tokens) - first
        return {"tokens": tokens, "tok_s": decode_rate(len(tokens), first, dt), "tau": tau,
                "cpu_ms_per_token": 1000 * cpu / after if after > 0 else 0.0}

    warm = True
    for line in sys.stdin:
        ids = json.loads(line)
        if warm:  # one untimed short generation each way, as on this project's side
            generate(ids, 16, None)
            generate(ids, 16, grid[0])
            warm = False
        res = {"plain": generate(ids, n, None)}
        for s in grid:
            res[grid_key(s)] = generate(ids, n, s)
        print(json.dumps(res), flush=True)
    print(json.dumps({"peak_rss_mb": _vm_hwm_mb()}), flush=True)


def _vm_hwm_mb() -> float:
    hwm = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 1024


def _llamacpp_peer():
    """benchmarks/llamacpp_peer/run.py as a module: its engine worker (AR then DFlash per prompt, VmHWM at the end)
    and weight accounting serve here unchanged."""
    spec = importlib.util.spec_from_file_location("llamacpp_peer_run", REPO / "benchmarks/llamacpp_peer/run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def drafter_weights_mb(engine_dir: Path) -> float:
    """MiB of the drafter's own graphs (drafter + its draft head; the shared LM head is the target's)."""
    return sum(p.stat().st_size for p in engine_dir.iterdir()
               if p.name.startswith(("drafter.onnx", "draft_head.onnx"))) / 2 ** 20


# Main ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--og-worker", nargs=4, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--suite", default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--precisions", default="fp32,int4", help="built on both sides (fp32, int8, int4)")
    ap.add_argument("--ngram-grid", default=DEFAULT_GRID,
                    help="ORT GenAI n-gram settings NGRAM_SIZE:MAX_DRAFT_TOKENS, comma-separated")
    ap.add_argument("--ortgenai-version", default=OG_VERSION)
    ap.add_argument("--engines-root", default="engines")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()
    if args.og_worker:
        ortgenai_worker(args.og_worker[0], int(args.og_worker[1]), int(args.og_worker[2]),
                        json.loads(args.og_worker[3]))
        return 0
    grid = parse_grid(args.ngram_grid)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]

    sys.path.insert(0, str(REPO))
    from dflash_export.bench.script_args import at_least

    at_least(args, 1, "--num-prompts", "--max-new-tokens", "--rounds", "--threads")  # before ORT GenAI's install
    from dflash_export.bench.suite import encode_suite_prompts
    from dflash_export.engines.base import load_codec
    from dflash_export.engines.build import build_engine
    from dflash_export.files import cache_dir
    from dflash_export.models import load_target
    from dflash_export.recipes import load_recipe

    recipe = load_recipe(args.recipe)
    py = ortgenai_venv(cache_dir() / "ortgenai", args.ortgenai_version)
    hf_dir = Path(load_target(recipe.target_path).model_dir)
    og_models, engines = {}, {}
    for p in precisions:
        og_models[p] = ortgenai_model(py, hf_dir, p, cache_dir() / "ortgenai" / args.ortgenai_version / "models"
                                      / f"{recipe.name}-{hf_dir.name}-{p}")
        res = build_engine(recipe, "onnxruntime", args.engines_root, precision=p)
        log(f"{'reused' if res.reused else 'built'} {res.engine_dir}")
        engines[p] = res.engine_dir
    codec = load_codec(engines[precisions[0]])
    prompts = [list(map(int, ids)) for ids in
               encode_suite_prompts(recipe, args.suite or recipe.suite, args.num_prompts, codec)]

    peer = _llamacpp_peer()
    workers: dict = {}
    for p in precisions:
        workers[("ours", p)] = peer.engine_process(engines[p], args.max_new_tokens, args.threads)
        # the same environment both sides (no OpenMP worker spins between steps); ORT GenAI's venv sees this repo
        workers[("ortgenai", p)] = peer.JsonLineProcess(
            [str(py), __file__, "--og-worker", str(og_models[p]), str(args.max_new_tokens), str(args.threads),
             json.dumps(grid)], env={**peer.worker_env(), "PYTHONPATH": str(REPO)}, cwd="/")
    order = list(workers)
    settings = [grid_key(s) for s in grid]
    rounds, loads = [], []
    for r in range(args.rounds):
        per: dict = {}
        for i, ids in enumerate(prompts):
            k = (r * len(prompts) + i) % len(order)
            for sysname, p in order[k:] + order[:k]:
                res = workers[(sysname, p)].run(ids)
                for mode, x in res.items():
                    per.setdefault((sysname, p, "plain" if mode == "ar" else mode), []).append(x)
            log(f"round {r + 1}/{args.rounds}: prompt {i + 1}/{len(prompts)} done")
        rounds.append(per)
        loads.append(os.getloadavg()[0])
    rss = {key: w.close() for key, w in workers.items()}
    weights, drafter_mb = {}, {}
    for p in precisions:
        weights[("ours", p)] = peer.engine_weights_mb(engines[p])
        weights[("ortgenai", p)] = sum(f.stat().st_size for f in og_models[p].iterdir()
                                       if f.name.endswith((".onnx", ".onnx.data"))) / 2 ** 20
        drafter_mb[p] = drafter_weights_mb(engines[p])

    rows = summarize(rounds, precisions, settings, rss, weights)
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, the same token ids on both sides, "
          f"{args.rounds} interleaved rounds, {args.threads} threads; decode tok/s = median over rounds of the "
          "per-round median over prompts; ratios within a round, then the median\n")
    print(render_table(rows))
    print()
    for line in verdicts(rows, drafter_mb):
        print(line)
    for line in per_round(rounds, precisions, settings, loads):
        print(line)
    for line in lossless_subset(rounds, precisions, settings):
        print(line)
    for p in precisions:  # reported, not owed: the two systems' plain decoding side by side
        same = identical(rounds[0][("ours", p, "plain")], rounds[0][("ortgenai", p, "plain")])
        print(f"{p}: this project's plain decoding identical to ORT GenAI's plain on {same}/{len(prompts)} prompts")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "args": vars(args), "table": rows, "verdicts": verdicts(rows, drafter_mb), "prompts": len(prompts),
            "lossless_subset": lossless_subset(rounds, precisions, settings),
            "load_averages": loads,
            "rounds": [{"/".join(k): v for k, v in per.items()} for per in rounds]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
