"""This project's ONNX Runtime engines side by side with llama.cpp -- what a CPU user runs today -- on the same prompts.

    python benchmarks/llamacpp_peer/run.py                        # smollm2-135m, 10 prompts x 256 tokens, 3 rounds
    python benchmarks/llamacpp_peer/run.py --num-prompts 6 --max-new-tokens 128 --rounds 2 --out peer.json

What it does (see the README section "llama.cpp peer benchmark"):
1. llama.cpp from the tree vendored in the PyPI sdist of llama-cpp-python (`pip download --no-binary :all:`), built
   once with cmake into the cache (`<cache>/llamacpp/<version>/build`, under `nice -n 19` with one compile job at a
   time, so a shared machine's other work goes first: ~35-45 min on 2 loaded cores).
2. The recipe's target converted with llama.cpp's own convert_hf_to_gguf.py (F16; Q4_1 by llama-quantize from it), the
   drafter with `convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET` (F16; llama.cpp's DFlash reads it).
3. This project's engines at each --precisions (built if absent), each loaded once in its own process (peak RSS).
4. llama.cpp decodes three ways: plainly (`llama-completion`), with its DFlash (`llama-speculative-simple
   --spec-type draft-dflash`) and with its own prompt-lookup speculative decoding (`--spec-type ngram-simple`: the
   last --llama-ngram N tokens looked up in the prompt and the answer so far, the M that followed them drafted, no
   draft model); this project's engines plainly and with DFlash.
5. Interleaved rounds: for every prompt of every round each system runs it, in a rotated order, so load from other
   processes on a shared machine hits all alike; the table gives medians over rounds of per-round medians over prompts,
   and the ratios are taken within a round before the median.
The prompts are the suite's chat prompts as this engine's token ids; llama.cpp gets their text, and a prompt counts only
when llama-tokenize gives back exactly those ids. Greedy; decode speed (tokens after the first / decode time), which
both systems report without the prompt's prefill. Nothing of llama.cpp is committed or installed outside the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LLAMA_TARGETS = ["llama-completion", "llama-speculative-simple", "llama-quantize", "llama-tokenize"]
# Built for this CPU (GGML_NATIVE); LLAMACPP_CMAKE_FLAGS overrides. Runs pass --no-repack: with it ggml keeps off its
# extra buffer types, among them the AMX kernels, which GGML_NATIVE compiles on these machines but which die with
# SIGILL on Q4_1 prompt processing (the VM advertises AMX it does not grant). x86 repacking covers neither F16 nor
# Q4_1, so for those types the flag costs nothing else.
CPU_FLAGS = os.environ.get("LLAMACPP_CMAKE_FLAGS", "").split() or ["-DGGML_NATIVE=ON"]


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# llama.cpp: fetch, build, convert ----------------------------------------------------------------------------------


def llamacpp_build(version: str | None) -> tuple[Path, Path]:
    """(source tree, bin dir) of llama.cpp vendored in llama-cpp-python's sdist, built once into the cache."""
    from dflash_export.files import cache_dir

    root = cache_dir() / "llamacpp"
    if version is None:  # the newest sdist the index has; reuse a build of it
        tmp = Path(tempfile.mkdtemp(prefix="llamacpp-sdist-"))
        _pip_download(None, tmp)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        version = sdist.name[len("llama_cpp_python-"):-len(".tar.gz")]
    else:
        tmp, sdist = None, None
    base = root / version
    src, build = base / "src", base / "build"
    bindir = build / "bin"
    if not (src / "convert_hf_to_gguf.py").is_file():
        if sdist is None:
            tmp = Path(tempfile.mkdtemp(prefix="llamacpp-sdist-"))
            _pip_download(version, tmp)
            sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        log(f"extracting llama.cpp from {sdist.name}")
        staging = base / "src.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(sdist) as tf:
            prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tf.extractall(staging, members=[m for m in members if m.name], filter="data")
        shutil.rmtree(src, ignore_errors=True)
        staging.rename(src)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if not all((bindir / t).is_file() for t in LLAMA_TARGETS):
        log(f"building llama.cpp {version} into {build} (nice -n 19, one job; ~35-45 min on 2 loaded cores, once)")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["nice", "-n", "19", "cmake", "-S", str(src), "-B", str(build), *gen,
                        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        *CPU_FLAGS], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["nice", "-n", "19", "cmake", "--build", str(build), "-j", "1",
                        "--target", *LLAMA_TARGETS], check=True, stdout=subprocess.DEVNULL)
    return src, bindir


def _pip_download(version: str | None, dest: Path) -> None:
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    log(f"pip download {spec} (sdist)")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                    str(dest), spec], check=True)


def convert(src: Path, bindir: Path, target_dir: Path, drafter_dir: Path, out: Path, types: list[str]
            ) -> dict[str, Path]:
    """GGUF files made by llama.cpp's own tools: target-<TYPE>.gguf for each type, drafter-F16.gguf."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    conv = [sys.executable, str(src / "convert_hf_to_gguf.py")]
    f16 = out / "target-F16.gguf"
    if not f16.is_file():
        log(f"converting the target {target_dir} -> {f16.name}")
        subprocess.run([*conv, str(target_dir), "--outtype", "f16", "--outfile", str(f16)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for t in types:
        path = out / f"target-{t}.gguf"
        if not path.is_file():
            if t in ("F32", "BF16"):
                subprocess.run([*conv, str(target_dir), "--outtype", t.lower(), "--outfile", str(path)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                log(f"llama-quantize {f16.name} -> {path.name}")
                subprocess.run([str(bindir / "llama-quantize"), str(f16), str(path), t], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        files[t] = path
    drafter = out / "drafter-F16.gguf"
    if not drafter.is_file():
        log(f"converting the drafter {drafter_dir} (--target-model-dir) -> {drafter.name}")
        subprocess.run([*conv, str(drafter_dir), "--target-model-dir", str(target_dir), "--outtype", "f16",
                        "--outfile", str(drafter)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files["drafter"] = drafter
    return files


def llama_tokenize(bindir: Path, model: Path, text: str) -> list[int]:
    r = subprocess.run([str(bindir / "llama-tokenize"), "-m", str(model), "-p", text, "--ids", "--log-disable"],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


# Runs argv[1:] as a child and prints its peak RSS: wait4's ru_maxrss of a child forked from this small process (a child
# forked straight from the benchmark would inherit the benchmark's own high-water mark, torch included, across exec).
_PEAK_RSS = ("import os, sys\n"
             "pid = os.fork()\n"
             "if pid == 0:\n"
             "    os.execvp(sys.argv[1], sys.argv[1:])\n"
             "_, status, ru = os.wait4(pid, 0)\n"
             "sys.stderr.write(f'\\npeak_rss_kb={ru.ru_maxrss}\\n')\n"
             "sys.exit(os.waitstatus_to_exitcode(status))\n")


def _measured(cmd: list[str]) -> subprocess.CompletedProcess:
    # errors="replace": a generation cut at -n can end inside a multi-byte character (llama.cpp prints raw bytes)
    return subprocess.run([sys.executable, "-c", _PEAK_RSS, *cmd], capture_output=True, text=True, errors="replace",
                          env=worker_env(), check=False)


def _peak_rss_mb(stderr: str) -> float:
    m = re.search(r"peak_rss_kb=(\d+)", stderr)
    return int(m.group(1)) / 1024 if m else 0.0


def worker_env() -> dict:
    # Idle OpenMP workers must not spin on a shared 2-core machine (they take the core from everyone else and
    # from the next step, measured several-fold slower under load); ONNX Runtime's are told the same.
    return {**os.environ, "OMP_WAIT_POLICY": "passive"}


def llama_plain(bindir: Path, model: Path, text: str, n: int, threads: int, ctx: int) -> dict:
    r = _measured([str(bindir / "llama-completion"), "-m", str(model), "-p", text, "-n", str(n),
                   "-t", str(threads), "--temp", "0", "-no-cnv", "--no-warmup", "-c", str(ctx),
                   "--no-display-prompt", "--no-repack"])
    if r.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {r.stderr[-800:]}")
    m = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", r.stderr)
    ms, runs = float(m.group(1)), int(m.group(2))
    return {"text": r.stdout, "tok_s": runs / ms * 1000 if ms > 0 else 0.0, "tau": 1.0,
            "peak_rss_mb": _peak_rss_mb(r.stderr)}


def llama_dflash(bindir: Path, model: Path, drafter: Path, text: str, n: int, threads: int, ctx: int,
                 n_draft: int) -> dict:
    return _speculative(bindir, model, text, n, threads, ctx,
                        ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_draft),
                         "-td", str(threads)])


def parse_ngram(spec: str) -> tuple[int, int | None]:
    """--llama-ngram 'N' or 'N:M' -> (N, M or None = the drafter's block size - 1); llama.cpp's own ranges."""
    try:
        parts = [int(x) for x in spec.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not 1 <= parts[0] <= 1024 or (len(parts) == 2 and not 1 <= parts[1] <= 1024):
        raise SystemExit(f"--llama-ngram: expected N or N:M with 1 <= N, M <= 1024 (lookup length : draft "
                         f"length), got {spec!r}")
    return parts[0], parts[1] if len(parts) == 2 else None


def llama_ngram(bindir: Path, model: Path, text: str, n: int, threads: int, ctx: int, size_n: int,
                size_m: int) -> dict:
    """llama.cpp's prompt-lookup decoding: no draft model; at each step the last `size_n` tokens of prompt + answer
    are looked up in them and the `size_m` tokens that followed their latest earlier occurrence are drafted."""
    return _speculative(bindir, model, text, n, threads, ctx,
                        ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(size_n),
                         "--spec-ngram-simple-size-m", str(size_m)])


def _speculative(bindir: Path, model: Path, text: str, n: int, threads: int, ctx: int, spec: list[str]) -> dict:
    r = _measured([str(bindir / "llama-speculative-simple"), "-m", str(model), *spec, "-p", text, "-n", str(n),
                   "-t", str(threads), "--temp", "0", "-c", str(ctx), "--no-repack"])
    if r.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed: {r.stderr[-800:]}")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", r.stderr)
    n_pred = int(re.search(r"n_predict = (\d+)", r.stderr).group(1))
    n_acc = int(re.search(r"n_accept\s+= (\d+)", r.stderr).group(1))
    out = r.stdout
    i = out.find(text)  # it echoes the prompt (specials included) before the generated text
    gen = out[i + len(text):] if i >= 0 else out
    return {"text": gen, "tok_s": int(m.group(1)) / float(m.group(2)), "tau": n_pred / max(1, n_pred - n_acc),
            "peak_rss_mb": _peak_rss_mb(r.stderr)}


# This project's engines -------------------------------------------------------------------------------------------


def engine_worker(engine_dir: str, n: int, threads: int) -> None:
    """One engine in this process, serving stdin lines of prompt ids with one stdout line each: AR then DFlash on the
    prompt (decode tok/s, tokens, tau). At end of input, one last line with the process's peak RSS."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime, RunStats

    eng = load_engine(engine_dir, threads=threads)
    rt = DFlashRuntime(eng)
    sp = SamplingParams(max_new_tokens=n)
    warm = True
    for line in sys.stdin:
        ids = json.loads(line)
        if warm:  # one untimed short generation each way
            rt.generate(ids, SamplingParams(max_new_tokens=16), "dflash")
            rt.generate(ids, SamplingParams(max_new_tokens=16), "ar")
            warm = False
        res = {}
        for mode in ("ar", "dflash"):
            st, cpu0 = RunStats(), None
            for _ in rt.stream(ids, sp, mode, st):
                if cpu0 is None:  # the first token (the prefill's) is out: decoding starts here
                    cpu0 = time.process_time()
            dec, cpu, after = st.total_s - st.ttft_s, time.process_time() - cpu0, len(st.tokens) - 1
            # CPU ms per token after the first, every thread of this process: a steadier figure than decode speed
            # on a machine that other jobs load
            res[mode] = {"tokens": st.tokens, "tok_s": after / dec if dec > 0 else 0.0, "tau": st.tau,
                         "cpu_ms_per_token": 1000 * cpu / after if after > 0 else 0.0}
        print(json.dumps(res), flush=True)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the forking parent (which holds torch here)
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_mb": int(hwm.split()[1]) / 1024}), flush=True)


class JsonLineProcess:
    """A model loaded once in its own process (peak RSS per process), driven one prompt at a time (a JSON line of
    token ids in, a JSON line of figures out), so rounds can interleave the systems prompt by prompt. Closing its
    input makes it print its peak RSS and exit."""

    def __init__(self, argv: list[str], env: dict | None = None, cwd: str | None = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env or worker_env(), cwd=cwd)

    def run(self, ids: list[int]) -> dict:
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args[1:3]} exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> float:
        self.proc.stdin.close()
        peak = json.loads(self.proc.stdout.readline())["peak_rss_mb"]
        self.proc.wait()
        return peak


def engine_process(engine_dir: Path, n: int, threads: int) -> JsonLineProcess:
    """This project's engine in its own process: AR then DFlash per prompt (`--worker`)."""
    return JsonLineProcess([sys.executable, __file__, "--worker", str(engine_dir), str(n), str(threads)])


def engine_weights_mb(engine_dir: Path) -> float:
    """MiB of weights the engine's sessions hold (benchmarks/engine_memory.py: graph files + the shared tensors a
    graph names; a quantized engine's embedding table is read row by row)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from engine_memory import weight_bytes

    return weight_bytes(engine_dir)[0]


# Main ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--suite", default=None)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--precisions", default="fp32,int8,int4", help="this project's engine precisions")
    ap.add_argument("--llama-types", default="F16,Q4_1", help="llama.cpp target types (F32, F16, Q8_0, Q4_1, ...)")
    ap.add_argument("--llama-ngram", default="3", help="llama.cpp n-gram decoding: N (lookup length) or N:M "
                    "(M drafted tokens; default the drafter's block size - 1, DFlash's draft length)")
    ap.add_argument("--llama-version", default="0.3.36", help="llama-cpp-python sdist version ('' = newest)")
    ap.add_argument("--engines-root", default="engines")
    ap.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()
    if args.worker:
        engine_worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return 0
    from dflash_export.bench.script_args import at_least

    at_least(args, 1, "--num-prompts", "--max-new-tokens", "--rounds", "--threads")  # before the build of llama.cpp

    from dflash_export.bench.suite import encode_suite_prompts
    from dflash_export.engines.base import load_codec
    from dflash_export.engines.build import build_engine
    from dflash_export.files import cache_dir
    from dflash_export.models import load_target
    from dflash_export.models.sources import resolve_source
    from dflash_export.recipes import load_recipe

    recipe = load_recipe(args.recipe)
    src, bindir = llamacpp_build(args.llama_version or None)
    target_dir = Path(load_target(recipe.target_path).model_dir)
    drafter_dir = resolve_source(recipe.drafter_path)
    types = [t.strip() for t in args.llama_types.split(",") if t.strip()]
    ggufs = convert(src, bindir, target_dir, drafter_dir, cache_dir() / "llamacpp" / "gguf" / recipe.name, types)

    engines = {}
    for p in [p.strip() for p in args.precisions.split(",") if p.strip()]:
        res = build_engine(recipe, "onnxruntime", args.engines_root, precision=p)
        log(f"{'reused' if res.reused else 'built'} {res.engine_dir}")
        engines[p] = res.engine_dir
    first = next(iter(engines.values()))
    codec = load_codec(first)
    bs = json.loads((first / "manifest.json").read_text())["block_size"]
    prompts, texts = [], []
    for ids in encode_suite_prompts(recipe, args.suite or recipe.suite, args.num_prompts, codec):
        text = codec.decode(ids, skip_special=False)
        if llama_tokenize(bindir, ggufs[types[0]], text) == list(ids):
            prompts.append(list(ids))
            texts.append(text)
    log(f"{len(prompts)} of {args.num_prompts} prompts tokenize to the same ids in llama.cpp")
    size_n, size_m = parse_ngram(args.llama_ngram)
    size_m = size_m or bs - 1
    ctx = max(len(p) for p in prompts) + args.max_new_tokens + 2 * max(bs, size_m + 1) + 16

    systems = [("ours", p, m) for p in engines for m in ("ar", "dflash")] + \
              [("llama.cpp", t, m) for t in types for m in ("ar", "dflash", "ngram")]
    # Interleaved prompt by prompt: for each prompt every system runs (order rotated), so a busy or quiet stretch of
    # the shared machine falls on all systems alike; this project's engines stay loaded in their own processes.
    workers = {p: engine_process(d, args.max_new_tokens, args.threads) for p, d in engines.items()}
    rounds = []
    order = list(engines) + [f"llama:{t}" for t in types]
    for r in range(args.rounds):
        per: dict = {}
        for i, (ids, text) in enumerate(zip(prompts, texts)):
            k = (r * len(prompts) + i) % len(order)
            for item in order[k:] + order[:k]:
                if item.startswith("llama:"):
                    t = item.split(":", 1)[1]
                    per.setdefault(("llama.cpp", t, "ar"), []).append(
                        llama_plain(bindir, ggufs[t], text, args.max_new_tokens, args.threads, ctx))
                    per.setdefault(("llama.cpp", t, "dflash"), []).append(
                        llama_dflash(bindir, ggufs[t], ggufs["drafter"], text, args.max_new_tokens, args.threads,
                                     ctx, bs - 1))
                    per.setdefault(("llama.cpp", t, "ngram"), []).append(
                        llama_ngram(bindir, ggufs[t], text, args.max_new_tokens, args.threads, ctx, size_n, size_m))
                else:
                    res = workers[item].run(ids)
                    per.setdefault(("ours", item, "ar"), []).append(res["ar"])
                    per.setdefault(("ours", item, "dflash"), []).append(res["dflash"])
            log(f"round {r + 1}/{args.rounds}: prompt {i + 1}/{len(prompts)} done")
        rounds.append(per)
    for p, w in workers.items():
        peak = w.close()
        for per in rounds:
            per[("ours", p, "rss")] = peak

    def med_tok_s(per, key):
        return statistics.median(x["tok_s"] for x in per[key])

    table = []
    for key in systems:
        sysname, prec, mode = key
        last = rounds[0][key]
        if mode != "ar":
            own = rounds[0][(sysname, prec, "ar")]
            # llama-speculative-simple commits whole accepted runs and so may print a token or more past -n: its
            # output is identical when it starts with the plain run's text
            ident = sum((a["tokens"] == b["tokens"]) if sysname == "ours" else
                        a["text"].rstrip().startswith(b["text"].rstrip()) for a, b in zip(last, own))
        else:
            ident = None
        row = {"system": sysname, "precision": prec, "mode": mode,
               "tok_s": statistics.median(med_tok_s(per, key) for per in rounds),
               "tau": statistics.median(x["tau"] for x in last), "identical_to_own_ar": ident,
               "prompts": len(last)}
        for t in types:
            if ("llama.cpp", t, "ar") in rounds[0]:
                row[f"vs_llama_{t}_plain"] = statistics.median(
                    med_tok_s(per, key) / med_tok_s(per, ("llama.cpp", t, "ar")) for per in rounds)
                row[f"vs_llama_{t}_ngram"] = statistics.median(
                    med_tok_s(per, key) / med_tok_s(per, ("llama.cpp", t, "ngram")) for per in rounds)
                # per round, so the spread a shared machine puts between rounds is visible
                row[f"rounds_vs_llama_{t}_plain"] = [
                    med_tok_s(per, key) / med_tok_s(per, ("llama.cpp", t, "ar")) for per in rounds]
        if sysname == "ours":
            row["peak_rss_mb"] = max(per[(sysname, prec, "rss")] for per in rounds)
            row["weights_mb"] = engine_weights_mb(engines[prec])
        else:  # per process: the GGUF files are memory-mapped, so their pages count in it
            row["peak_rss_mb"] = max(x["peak_rss_mb"] for per in rounds for x in per[key])
            row["weights_mb"] = (ggufs[prec].stat().st_size + (ggufs["drafter"].stat().st_size
                                                                 if mode == "dflash" else 0)) / 2 ** 20
        table.append(row)
    cols = [f"vs_llama_{t}_{m}" for t in types for m in ("plain", "ngram")]
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, {args.rounds} interleaved rounds, "
          f"{args.threads} threads; tok/s = decode speed, median over rounds of the per-round median over prompts; "
          f"llama.cpp n-gram: ngram-simple, lookup {size_n}, draft {size_m}\n")
    print("| system | weights | mode | tok/s | " + " | ".join(f"× llama.cpp {t} {m}" for t in types
                                                              for m in ("plain", "n-gram"))
          + " | τ | identical to own AR | peak RSS MiB (× weights) |")
    print("|---" * (7 + len(cols)) + "|")
    for row in table:
        ratios = " | ".join(f"{row[c]:.2f}" for c in cols)
        ident = "—" if row["identical_to_own_ar"] is None else f"{row['identical_to_own_ar']}/{row['prompts']}"
        rss = f"{row['peak_rss_mb']:.0f} ({row['peak_rss_mb'] / row['weights_mb']:.2f}×)"
        mode = {"ar": "plain", "dflash": "DFlash", "ngram": f"n-gram {size_n}:{size_m}"}[row["mode"]]
        print(f"| {row['system']} | {row['precision']} | {mode} | "
              f"{row['tok_s']:.1f} | {ratios} | {row['tau']:.2f} | {ident} | {rss} |")
    print("\nper round, × llama.cpp plain of the same type: " + "; ".join(
        f"{row['system']} {row['precision']} {row['mode']} / {t}: "
        + " ".join(f"{x:.2f}" for x in row[f"rounds_vs_llama_{t}_plain"]) for row in table for t in types))
    if "fp32" in engines:  # agreement with fp32 is reported, not owed: the first token where plain decoding differs
        base = rounds[0][("ours", "fp32", "ar")]
        for p in engines:
            if p != "fp32":
                divs = [next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                             None if len(a["tokens"]) == len(b["tokens"]) else min(len(a["tokens"]),
                                                                                   len(b["tokens"])))
                        for a, b in zip(rounds[0][("ours", p, "ar")], base)]
                print(f"\n{p} plain decoding identical to fp32's on {sum(d is None for d in divs)}/{len(divs)} "
                      f"prompts; first divergences {divs}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "table": table, "llama_cpp_version": str(src),
                                              "prompts": len(prompts),
                                              "rounds": [{"/".join(k): v for k, v in per.items()} for per in rounds]},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
