"""Peak resident memory of ONNX Runtime engines against their weight bytes, and where it goes.

    python benchmarks/engine_memory.py --engine engines/smollm2-135m/onnxruntime-int8 \\
        --engine engines/smollm2-135m/onnxruntime-int4 --num-prompts 4 --max-new-tokens 128 --rounds 2

Each engine runs in fresh processes (one per engine, setting and round), so every peak is that engine's alone: the
process imports numpy, onnxruntime and the runtime (RSS "before load"), loads the engine, then decodes the recipe
suite's first prompts plain and with DFlash. Peak RSS is the process's VmHWM at the end. "weights" are the bytes the
engine's sessions hold: its graph files (*.onnx + *.onnx.data) and the tensors of shared_weights.bin a graph names (an
fp32 engine's tied LM head); the embedding table, read a row at a time (pread) and never resident, is listed apart.

Each engine also runs with `release_pages=False` (the engine before the weight-page release, see
`engines.onnxruntime._release_weight_pages`), in the same rounds and alternating order, so the memory it saves and
its effect on speed (decode tok/s, same-round ratio) come from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def worker(engine_dir: str, release: bool, prompts: list[list[int]], max_new: int, threads: int) -> dict:
    import numpy  # noqa: F401  (counted in the process's own memory, before the engine)
    import onnxruntime  # noqa: F401

    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    before = _status()
    eng = load_engine(engine_dir, threads=threads, release_pages=release)
    loaded = _status()
    rt = DFlashRuntime(eng)
    rt.generate(prompts[0], SamplingParams(max_new_tokens=8), "dflash")  # warm-up, untimed
    speed: dict[str, list[float]] = {"ar": [], "dflash": []}
    tokens: dict[str, list] = {"ar": [], "dflash": []}
    for ids in prompts:
        for mode in ("ar", "dflash"):
            st = rt.generate(ids, SamplingParams(max_new_tokens=max_new), mode)
            dec = st.total_s - st.ttft_s
            speed[mode].append((len(st.tokens) - 1) / dec if dec > 0 else 0.0)
            tokens[mode].append(list(st.tokens))
    end = _status()
    return {"before_load_mb": before["VmRSS"], "loaded_mb": loaded["VmRSS"], "peak_mb": end["VmHWM"],
            "anon_mb": end["RssAnon"], "file_mb": end["RssFile"], "released_mb": eng.released_bytes / 2 ** 20,
            "ar_tok_s": statistics.median(speed["ar"]), "dflash_tok_s": statistics.median(speed["dflash"]),
            "identical": sum(a == b for a, b in zip(tokens["ar"], tokens["dflash"])), "prompts": len(prompts)}


def weight_bytes(engine_dir: Path) -> tuple[float, float]:
    """(MiB of weights the sessions hold, MiB of shared_weights.bin no graph refers to) of an engine directory.

    The sessions hold their graph files (*.onnx, *.onnx.data; the batched-verify graph aside) and whatever tensors of
    shared_weights.bin a graph names (an fp32 engine's LM head: the tied embedding matrix); the rest of that file (the
    embedding table of a quantized engine) is only read a row at a time."""
    import onnx

    from dflash_export.engines.onnxruntime import TARGET_BATCH

    # target_batch.onnx (batched verify, engines/ort_batch.py) is opened only by a batch's first many-row verify:
    # one request at a time never holds it
    graphs = [p for p in engine_dir.iterdir() if p.name.endswith((".onnx", ".onnx.data"))
              and not p.name.startswith(TARGET_BATCH)]
    held = sum(p.stat().st_size for p in graphs)
    shared_file = engine_dir / "shared_weights.bin"
    referenced = {}
    for p in graphs:
        if p.suffix == ".onnx":
            for t in onnx.load(str(p), load_external_data=False).graph.initializer:
                ext = {e.key: e.value for e in t.external_data}
                if ext.get("location") == shared_file.name:
                    referenced[ext.get("offset", "0")] = int(ext["length"])
    held += sum(referenced.values())
    rest = (shared_file.stat().st_size if shared_file.is_file() else 0) - sum(referenced.values())
    return held / 2 ** 20, rest / 2 ** 20


def main() -> int:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine", action="append", required=False, default=[], help="engine directory (repeatable)")
    ap.add_argument("--recipe", default="smollm2-135m", help="whose suite gives the prompts")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (default: the usable cores)")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()
    at_least(args, 1, "--num-prompts", "--max-new-tokens", "--rounds")
    at_least(args, 0, "--threads")
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker(job["engine"], job["release"], job["prompts"], job["max_new"], job["threads"])))
        return 0
    if not args.engine:
        ap.error("give at least one --engine")

    from dflash_export.bench.suite import encode_suite_prompts
    from dflash_export.engines.base import load_codec
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.recipes import load_recipe

    recipe = load_recipe(args.recipe)
    engines = [Path(e) for e in args.engine]
    for e in engines:  # a missing engine is refused here, not by the first worker process
        read_manifest(e, verify_files=False)
    prompts = [list(map(int, p)) for p in encode_suite_prompts(recipe, recipe.suite, args.num_prompts,
                                                               load_codec(engines[0]))]
    threads = args.threads or None
    results: dict[tuple[str, bool], list[dict]] = {}
    for r in range(args.rounds):
        for e in engines:
            order = (True, False) if (r + engines.index(e)) % 2 == 0 else (False, True)
            for release in order:
                job = {"engine": str(e), "release": release, "prompts": prompts, "max_new": args.max_new_tokens,
                       "threads": threads}
                out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                                     text=True)
                if out.returncode != 0:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                results.setdefault((str(e), release), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"[memory {time.strftime('%H:%M:%S')}] round {r + 1}/{args.rounds} {e.name} "
                      f"release={release} done", file=sys.stderr, flush=True)

    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, {args.rounds} rounds; memory: max over "
          "rounds; tok/s: median over rounds of the per-process median over prompts\n")
    print("| engine | weight pages released | weights MiB | shared_weights.bin MiB read by row (not resident) "
          "| RSS before load MiB | peak RSS MiB | peak / weights | (peak − before load) / weights "
          "| anon / file MiB at end | plain tok/s | DFlash tok/s | DFlash identical to plain |")
    print("|---" * 12 + "|")
    table = []
    for e in engines:
        w, emb = weight_bytes(e)
        for release in (False, True):
            runs = results[(str(e), release)]
            peak = max(x["peak_mb"] for x in runs)
            before = max(x["before_load_mb"] for x in runs)
            row = {"engine": str(e), "release_pages": release, "weights_mb": w, "embedding_file_mb": emb,
                   "before_load_mb": before, "peak_mb": peak, "peak_over_weights": peak / w,
                   "engine_over_weights": (peak - before) / w,
                   "anon_mb": max(x["anon_mb"] for x in runs), "file_mb": max(x["file_mb"] for x in runs),
                   "released_mb": max(x["released_mb"] for x in runs),
                   "ar_tok_s": statistics.median(x["ar_tok_s"] for x in runs),
                   "dflash_tok_s": statistics.median(x["dflash_tok_s"] for x in runs),
                   "identical": min(x["identical"] for x in runs), "prompts": len(prompts)}
            table.append(row)
            print(f"| {e.name} | {'yes' if release else 'no'} ({row['released_mb']:.0f} MiB) | {w:.0f} | {emb:.0f} | "
                  f"{before:.0f} | {peak:.0f} | {peak / w:.2f}× | {(peak - before) / w:.2f}× | "
                  f"{row['anon_mb']:.0f} / {row['file_mb']:.0f} | {row['ar_tok_s']:.1f} | {row['dflash_tok_s']:.1f} "
                  f"| {row['identical']}/{len(prompts)} |")
    print("\nSame-round speed ratio, pages released / kept (median over rounds):")
    for e in engines:
        on, off = results[(str(e), True)], results[(str(e), False)]
        for mode in ("ar", "dflash"):
            ratio = statistics.median(a[f"{mode}_tok_s"] / b[f"{mode}_tok_s"] for a, b in zip(on, off))
            print(f"  {e.name} {'plain' if mode == 'ar' else 'DFlash'}: {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "table": table,
                                              "runs": {f"{k[0]}|{k[1]}": v for k, v in results.items()}},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
