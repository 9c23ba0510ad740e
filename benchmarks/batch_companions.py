"""Whether a request's batched answer depends on the requests beside it, and where batched and alone part, on a
built ONNX Runtime engine (plain greedy steps through ort_batch.BatchedOrtEngine, random prompts of 8-39 tokens).

    python benchmarks/batch_companions.py ENGINE_DIR [--steps 12] [--threads 1]

Prints, for request x (prompt 0):
1. the max |logits| difference of x's plain steps (teacher-forced on its tokens alone) between a batch [x, 1, 2]
   and batches that differ in x's slot, the companions, the K/V room they reserve and their blocks' rows;
2. the same difference as a function of the K/V buffers' length (the padded key length of the batched attention),
   every sequence reserving that room -- the aligned length the engine now uses and unaligned lengths beside it;
3. layer by layer, the K and V rows one plain step writes, batched (target_batch.onnx) against the single-stream
   step (the GQA graph): layer i's rows are a function of layer i-1's output, so the first layer that differs
   locates the first op;
4. the first token at which x's free-running greedy answer in each batch parts from x alone in a batch of its own,
   and from x decoded by the single-stream runtime (`run`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.ort_batch import BatchedOrtEngine
from dflash_export.engines.registry import load_engine
from dflash_export.runtime.single import DFlashRuntime


def main() -> None:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    at_least(args, 1, "--steps")
    at_least(args, 0, "--threads")
    eng = load_engine(args.engine, threads=args.threads)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=int(n)).tolist() for n in rng.integers(8, 40, size=8)]

    def decode(others, at=0, room=None, rows=None, force=None, align=None):
        """x (prompt 0) at slot `at` among prompts `others`; returns x's tokens, its step logits, the batch."""
        batch = BatchedOrtEngine(eng, max_batch=16)
        if align is not None:
            batch.key_align = align
        order = list(others)
        order.insert(at, 0)
        room = room or [200] * len(order)
        seqs = [batch.add(min(r, eng.info.max_seq_len)) for r in room]
        last = [int(np.argmax(lg)) for lg in batch.prefill(seqs, [prompts[i] for i in order])]
        tokens, out = [last[at]], []
        for step in range(args.steps):
            if force is not None:
                last[at] = force[step]
            blocks = [[last[i]] + [5 + step] * ((rows or {}).get(i, 1) - 1) for i in range(len(seqs))]
            logits = batch.target_step(seqs, blocks)
            for i, seq in enumerate(seqs):
                batch.commit(seq, 0)
                last[i] = int(np.argmax(logits[i][0]))
            tokens.append(last[at])
            out.append(logits[at][0])
        return tokens, np.stack(out), batch

    alone = decode([])[0]
    ref = decode([1, 2], force=alone)[1]
    print(f"engine {args.engine}; key_align {BatchedOrtEngine.key_align}")
    print("1. x's step logits in other batches, max |diff| against batch [x, 1, 2]:")
    for name, kw in [("x at slot 2", {"others": [1, 2], "at": 2}),
                     ("x at slot 1 of 5", {"others": [3, 4, 5, 6], "at": 1}),
                     ("a companion reserving 900", {"others": [1, 2], "room": [200, 900, 200]}),
                     ("companions' blocks of 8 rows", {"others": [1, 2], "rows": {1: 8, 2: 8}}),
                     ("slot 3, room 700, blocks of 8", {"others": [3, 4, 5], "at": 3, "room": [200, 700, 200, 200],
                                                        "rows": {0: 8}})]:
        print(f"   {name:32s} {float(np.abs(decode(force=alone, **kw)[1] - ref).max()):.3g}")
    print("2. buffer length: max |diff| of x's step logits against length 128 (unaligned, every sequence's room):")
    base = decode([1, 2], room=[128] * 3, force=alone, align=1)[1]
    diffs = {n: float(np.abs(decode([1, 2], room=[n] * 3, force=alone, align=1)[1] - base).max())
             for n in (129, 130, 132, 136, 140, 144, 160, 192, 256)}
    print("   " + " ".join(f"{n}:{v:.2g}" for n, v in diffs.items()))
    print("3. one step's K/V rows batched vs single-stream (GQA graph), per layer max |K diff| / max |V diff|:")
    kv = []
    for others in ([], [1, 2]):
        batch = BatchedOrtEngine(eng, max_batch=16)
        seqs = [batch.add(200) for _ in range(1 + len(others))]
        first = batch.prefill(seqs, [prompts[i] for i in [0] + others])
        n = seqs[0].length
        if others:
            batch.target_step(seqs, [[int(np.argmax(f))] for f in first])
        else:  # the single-stream step: the GQA graph (writes its K/V row in place)
            batch._run_target(seqs, [[int(np.argmax(first[0]))]], prefill=False)
        kv.append([buf[0, :, n].copy() for buf in batch._buf.t_kv])
    d = [float(np.abs(a - b).max()) for a, b in zip(*kv)]
    print("   " + " ".join(f"{i}:{d[2 * i]:.2g}/{d[2 * i + 1]:.2g}" for i in range(len(d) // 2)))
    print("4. first token where x's free-running greedy answer parts from x alone (None: never in "
          f"{args.steps + 1}):")
    single = DFlashRuntime(eng).generate(prompts[0], SamplingParams(max_new_tokens=args.steps + 1), "ar").tokens
    for others in ([1, 2], [3, 4, 5, 6], [7]):
        t = decode(others)[0]
        print(f"   batch {[0] + others}: {next((i for i, (p, q) in enumerate(zip(t, alone)) if p != q), None)}; "
              f"against `run` (single-stream): {next((i for i, (p, q) in enumerate(zip(t, single)) if p != q), None)}")


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
