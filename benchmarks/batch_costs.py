"""Cost of the batched engine's calls, in single-sequence plain steps: target steps of B sequences x S rows (GQA
graph for S = 1, target_batch.onnx for S > 1), ragged ones (one sequence a block, the others one row) and drafts of
B sequences -- what batching.py's cost model reads (verify_token_cost, GRID_PAD_COST).

    python benchmarks/batch_costs.py [--engine engines/smollm2-135m/onnxruntime] [--context 200] [--reps 10]

Medians of `reps` calls after a warm-up, interleaved, on sequences with `context` committed tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.ort_batch import BatchedOrtEngine
from dflash_export.engines.registry import load_engine


def main() -> None:
    from dflash_export.bench.script_args import at_least, counts

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="engines/smollm2-135m/onnxruntime")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default="1,4,8,16")
    args = ap.parse_args()
    at_least(args, 1, "--context", "--reps")
    sizes = counts(args.batches, "--batches")
    eng = load_engine(args.engine)
    bs = eng.info.block_size
    top = min(10000, eng.info.vocab_size)  # random ids below it (any vocabulary: a tiny engine's too)
    sp = SamplingParams()
    rng = np.random.default_rng(0)
    times: dict[tuple, list[float]] = {}
    h_drafter = eng.drafter.get_inputs()[0].shape[2]  # ctx [B, C, H_drafter]
    batches = {}
    for b in sizes:
        batch = BatchedOrtEngine(eng, max_batch=b)
        seqs = [batch.add(args.context + 64) for _ in range(b)]
        batch.prefill(seqs, [rng.integers(100, top, args.context) for _ in range(b)])
        batch.draft(seqs, [5] * b, [sp] * b, [None] * b, [bs] * b)  # the prompt's features enter the draft cache
        batches[b] = (batch, seqs)
    for _ in range(args.reps + 1):
        for b, (batch, seqs) in batches.items():
            # S rows each; and ragged (S = -bs): one sequence bs rows, the others one, packed rows, attention padded
            for s in (1, bs) + ((-bs,) if b > 1 else ()):
                lens = [abs(s)] * b if s > 0 else [bs] + [1] * (b - 1)
                t = time.perf_counter()
                batch.target_step(seqs, [rng.integers(100, top, n) for n in lens])
                times.setdefault(("target", b, s), []).append(time.perf_counter() - t)
                for q in seqs:  # nothing committed: the cache keeps its length, the features stay pending
                    q._step_ctx = None
            d_lens = [q.d_len for q in seqs]
            for q in seqs:
                q.ctx_parts = [np.ones((2, h_drafter), np.float32)]  # two new context rows per draft
            t = time.perf_counter()
            batch.draft(seqs, [5] * b, [sp] * b, [None] * b, [bs] * b)
            times.setdefault(("draft", b, bs), []).append(time.perf_counter() - t)
            for q, d in zip(seqs, d_lens):  # the draft cache keeps its length from rep to rep
                q.d_len = d
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    unit = med[("target", 1, 1)]
    print(f"single-sequence plain step: {unit * 1000:.1f} ms (context {args.context})")
    for (kind, b, s), v in sorted(med.items()):
        if s < 0:
            continue
        print(f"{kind:6s} B={b:2d} S={s}: {v * 1000:7.1f} ms = {v / unit:5.2f} plain steps"
              f"  ({(v / unit - 1) / max(1, b * s - 1):.3f} per extra row)")
    # A call costs about c0 + r * rows + g * cells (cells = B x the longest block: attention's grid). The full and the
    # ragged call share their grid, so they give r; the ragged and the one-row call give g.
    for b in sorted({b for kind, b, s in med if s < 0}):
        full, ragged, one = med[("target", b, bs)], med[("target", b, -bs)], med[("target", b, 1)]
        r = (full - ragged) / ((b - 1) * (bs - 1))
        g = (ragged - one - r * (bs - 1)) / (b * (bs - 1))
        print(f"target B={b:2d} ragged (one sequence {bs} rows, {b - 1} one row): {ragged * 1000:7.1f} ms = "
              f"{ragged / unit:5.2f} plain steps; a row {r * 1000:.2f} ms, a grid cell {g * 1000:.2f} ms: a padding "
              f"cell costs {g / (r + g):.2f} of a verified row (batching.GRID_PAD_COST)")


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
