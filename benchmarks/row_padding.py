"""What a plain step costs with each way of padding it to the row floor, on one built engine, in one process.

    python benchmarks/row_padding.py --engine engines/smollm2-135m/onnxruntime-int4
    python benchmarks/row_padding.py --engine DIR --rounds 12 --steps 96 --threads 2

The engine as built (its graph pads what its build chose: attention alone, or the products too; engines/row_pad.py)
against a copy whose target graph pads the other way (the weights hard-linked or copied into a temporary directory,
only target.onnx rewritten; its probe runs on load as any engine's), and the engine itself at one row (no floor: not
bit-identical to verify rows where the floor is 2, the floor's remaining price). Each round decodes --steps plain
tokens after a --context-token prompt with each variant in a rotated order; per round the median step in wall time and
in process CPU time (every ONNX Runtime thread; spinning is off), then the medians over rounds of each variant's ratio
to the engine as built.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def padded_the_other_way(engine: Path, out: Path) -> list[str]:
    """A copy of `engine` in `out` whose target graph pads the products too if the engine's pads attention alone,
    else attention alone; returns what the copy's graph pads."""
    import json

    from dflash_export.engines.manifest import write_manifest
    from dflash_export.engines.row_pad import pad_in_graph, padded_ops, unpad_graph

    for f in engine.iterdir():
        if f.name in ("target.onnx", "manifest.json"):
            shutil.copy2(f, out / f.name)
        else:
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copy2(f, out / f.name)
    target = out / "target.onnx"
    products = padded_ops(target) == ["GroupQueryAttention"]
    unpad_graph(target)
    pad_in_graph(target, products=products)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["flags"]["row_pad_ops"] = padded_ops(target)
    manifest.pop("numerics", None)  # probed afresh at load
    write_manifest(out, manifest)
    return padded_ops(target)


def main() -> int:
    from dflash_export.bench.script_args import at_least

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    at_least(args, 1, "--rounds", "--steps", "--context", "--threads")

    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.registry import load_engine
    from dflash_export.engines.row_pad import padded_ops

    read_manifest(args.engine, verify_files=False)  # a missing engine: one error line, before its graph is read
    built_ops = padded_ops(args.engine / "target.onnx")
    with tempfile.TemporaryDirectory(prefix="row-padding-") as tmp:
        other_ops = padded_the_other_way(args.engine, Path(tmp))
        built, other, one = (load_engine(d, threads=args.threads) for d in (args.engine, Path(tmp), args.engine))
        one.row_floor = 1
        variants = {f"as built (pads {', '.join(built_ops) or 'nothing'}; floor {built.row_floor}, "
                    f"{built.row_pad})": built,
                    f"padding {', '.join(other_ops)} (floor {other.row_floor}, {other.row_pad})": other,
                    "one row, no floor (not bit-identical)": one}
        names = list(variants)
        prompt = np.random.default_rng(0).integers(3, min(5000, built.info.vocab_size), args.context)
        per = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % 3:] + names[:r % 3]:
                eng = variants[n]
                seq = eng.new_sequence(args.context + args.steps + 4)
                tok = int(eng.prefill(seq, prompt).argmax())
                wall, cpu = [], []
                for _ in range(args.steps):
                    w0, c0 = time.perf_counter(), time.process_time()
                    tok = int(eng.decode(seq, tok).argmax())
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
                per[n].append((statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3))
        load = os.getloadavg()[0]
        for eng in (built, other, one):
            eng.close()
    print(f"\n{args.engine}: {args.steps} plain steps after a {args.context}-token prompt, {args.rounds} rounds, "
          f"{args.threads} threads, load average {load:.1f} at the end\n")
    print("| plain step | wall ms (median round) | CPU ms | wall / as built | CPU / as built |")
    print("|---|---|---|---|---|")
    for n in names:
        w = statistics.median(x[0] for x in per[n])
        c = statistics.median(x[1] for x in per[n])
        rw = statistics.median(per[n][i][0] / per[names[0]][i][0] for i in range(args.rounds))
        rc = statistics.median(per[n][i][1] / per[names[0]][i][1] for i in range(args.rounds))
        print(f"| {n} | {w:.2f} | {c:.2f} | {rw:.3f} | {rc:.3f} |")
    return 0


if __name__ == "__main__":
    from dflash_export.bench import script_args

    script_args.run(main)
