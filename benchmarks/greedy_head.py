"""What the screened greedy head (engines/greedy_head.py) saves: one engine loaded once, greedy decoding of held-out
chat prompts with its head screened and whole (a runtime each), alternating prompt by prompt (the order flipping each
time), plain decoding and the engine's default DFlash decoding; every output compared with the whole head's; then
the head call alone at 1..16 rows, each way, with a cache-sized buffer written between calls as a target step would.

    python benchmarks/greedy_head.py --engine engines/smollm2-135m/onnxruntime --prompts 8 --max-new-tokens 128

`--drafts`: the same for greedy drafts from the draft head's int8 copy (engines/greedy_head.py, "Drafting") against
the fp32 draft head: DFlash decoding each way (a runtime each), tok/s, tau, drafter passes and the drafts they had
accepted, every output against the fp32 draft head's; then the draft head call alone at 1..120 rows (a block of 15
rows per sequence, up to 8 sequences batched).

Not a test: minutes on 2 cores. `--min-params 0` screens any fp32 head (tiny engines).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-params", type=int, default=None)
    ap.add_argument("--drafts", action="store_true", help="greedy drafts: int8 copy against fp32 draft head")
    args = ap.parse_args(argv)
    at_least(args, 1, "--prompts", "--max-new-tokens", "--rounds")
    at_least(args, 0, "--skip", "--threads", "--min-params")

    from dflash_export.engines import greedy_head as gh
    from dflash_export.engines.base import SamplingParams
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.single import DFlashRuntime

    if args.min_params is not None:
        gh.MIN_PARAMS = args.min_params
    engine = load_engine(args.engine, threads=args.threads)
    if args.drafts:
        return _drafts(engine, args)
    screen = engine.greedy_head
    if screen is None:
        raise SystemExit(f"{args.engine}: no screened greedy head (not an fp32 Gemm head of >= {gh.MIN_PARAMS} "
                         "weights)")
    print(f"{args.engine}: head {screen.vocab} x {screen.hidden}, int8 screen "
          f"{'on' if screen.screen is not None else 'off (its load-time check failed)'}, int8 up to "
          f"{gh.INT8_MAX_ROWS} rows")
    # one runtime per way: each fits its own costs (a screened plain step is cheaper, so a verify row costs more of
    # one), as a process running either way would
    rts = {True: DFlashRuntime(engine), False: DFlashRuntime(engine)}
    rt = rts[True]
    ids = _prompt_ids(rt, args)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)

    def run(mode, on, x):
        engine.greedy_head = screen if on else None
        return rts[on].generate(x, sp, mode)

    res = _alternate(ids, args.rounds, ("ar", "dflash"), run)
    engine.greedy_head = screen
    for mode, name in (("ar", "plain decoding"), ("dflash", "DFlash (default decoding)")):
        on, off = res[(mode, True)], res[(mode, False)]
        same = sum(on["out"][i] == off["out"][i] for i in range(len(ids)))
        print(f"{name}: screened {on['n'] / on['s']:.1f} tok/s, whole head {off['n'] / off['s']:.1f} tok/s: "
              f"{(on['n'] / on['s']) / (off['n'] / off['s']):.3f}x; identical {same}/{len(ids)}")
    print(f"candidates per screened row {screen.candidates / max(1, screen.calls):.1f}; rows with more than one, "
          f"their logits computed again exactly: {screen.exact_rows} of {screen.calls}")

    x = np.stack([np.random.default_rng(0).standard_normal(screen.hidden).astype(np.float32)] * 16)
    if engine.info.vocab_size == screen.vocab:  # real rows: the hidden states of a short greedy run
        x = _hidden_rows(engine, ids[0], 16)
    evict = np.zeros((64, 4096), np.float32)
    print("head call, ms (median of 25): rows | int8 screen | fp32 screen | whole head")
    limit = gh.INT8_MAX_ROWS
    for n in (1, 2, 3, 4, 6, 8, 12, 16):
        cells = []
        for how in ("int8", "fp32", "whole"):
            ts = []
            for _ in range(25):
                evict += 1
                gh.INT8_MAX_ROWS = 99 if how == "int8" else 0
                t = time.perf_counter()
                screen.logits(x[:n][None]) if how != "whole" else engine._logits(x[:n][None])
                ts.append(time.perf_counter() - t)
            cells.append(f"{1000 * np.median(ts):.2f}" if how != "int8" or screen.screen is not None else "-")
        print(f"{n:>4} | " + " | ".join(cells))
    gh.INT8_MAX_ROWS = limit


def _prompt_ids(rt, args) -> list[list[int]]:
    from dflash_export.validate.suites import load_suite

    return [rt.encode(r.text) for r in load_suite("sharegpt-heldout", args.prompts, skip=args.skip)[1]]


def _alternate(ids, rounds: int, modes, run) -> dict:
    """Each prompt in each mode both ways, `run(mode, on, prompt ids) -> RunStats`, the ways' order flipping prompt by
    prompt and round by round. Per (mode, on): seconds, tokens, target passes, drafter tokens accepted, seconds
    proposing, and the tokens of each prompt."""
    res = {(m, on): {"s": 0.0, "n": 0, "steps": 0, "drafter": 0, "draft_s": 0.0, "out": {}}
           for m in modes for on in (True, False)}
    for rnd in range(rounds):
        for i, x in enumerate(ids):
            for mode in modes:
                for on in ((True, False) if (i + rnd) % 2 else (False, True)):
                    t = time.perf_counter()
                    st = run(mode, on, x)
                    r = res[(mode, on)]
                    r["s"] += time.perf_counter() - t
                    r["n"] += len(st.tokens)
                    r["steps"] += len(st.acceptance_lengths)
                    r["drafter"] += st.accepted_by["drafter"]
                    r["draft_s"] += st.draft_s
                    r["out"][i] = st.tokens
        print(f"\rround {rnd + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return res


def _drafts(engine, args) -> None:
    """`--drafts` (module docstring)."""
    from dflash_export.engines.base import SamplingParams
    from dflash_export.runtime.single import DFlashRuntime

    int8 = engine.greedy_draft_head
    if int8 is None:
        from dflash_export.engines.greedy_head import MIN_PARAMS

        raise SystemExit(f"{args.engine}: no int8 copy of the draft head (not an fp32 Gemm head of >= "
                         f"{MIN_PARAMS} weights)")
    rts = {True: DFlashRuntime(engine), False: DFlashRuntime(engine)}
    ids = _prompt_ids(rts[True], args)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)

    def run(mode, on, x):
        engine.greedy_draft_head = int8 if on else None
        return rts[on].generate(x, sp, mode)

    res = _alternate(ids, args.rounds, ("dflash",), run)
    engine.greedy_draft_head = int8
    for on, name in ((True, "int8 copy"), (False, "fp32 draft head")):
        r = res[("dflash", on)]
        print(f"DFlash, greedy drafts from the {name}: {r['n'] / r['s']:.1f} tok/s, tau {r['n'] / r['steps']:.2f}, "
              f"drafter tokens accepted {r['drafter']}, proposing {1000 * r['draft_s'] / r['steps']:.2f} ms a step")
    on, off = res[("dflash", True)], res[("dflash", False)]
    same = sum(on["out"][i] == off["out"][i] for i in range(len(ids)))
    print(f"int8 / fp32: {(on['n'] / on['s']) / (off['n'] / off['s']):.3f}x; identical {same}/{len(ids)}")
    hidden = engine._embed.shape[1]
    rng = np.random.default_rng(0)
    print("draft head call, ms (median of 25): rows | int8 copy | fp32")
    for n in (1, 7, 15, 30, 60, 120):
        x = rng.standard_normal((1, n, hidden)).astype(np.float32)
        cells = []
        for head in (int8, engine.draft_head):
            head.run(["logits"], {"hidden": x})
            ts = []
            for _ in range(25):
                t = time.perf_counter()
                head.run(["logits"], {"hidden": x})
                ts.append(time.perf_counter() - t)
            cells.append(f"{1000 * np.median(ts):.2f}")
        print(f"{n:>4} | " + " | ".join(cells))


def _hidden_rows(engine, prompt, n: int) -> np.ndarray:
    """The final hidden rows of n plain greedy steps after `prompt`."""
    seq = engine.new_sequence(len(prompt) + n + engine.info.block_size)
    tok = int(np.argmax(engine.prefill(seq, np.asarray(prompt, np.int64))))
    out = []
    for _ in range(n):
        hidden, _ = engine._run_target(seq, np.array([tok], np.int64), 1)
        seq.length += 1
        out.append(hidden[0, -1].copy())
        tok = int(np.argmax(engine._logits(hidden)[-1]))
    return np.stack(out)


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
