"""Where a plain decoding step's time goes, this project's ONNX Runtime engine against ONNX Runtime GenAI, on the same
prompt ids, in alternating rounds.

    python benchmarks/ortgenai_peer/step_profile.py --engine engines/smollm2-135m/onnxruntime --precision fp32
    python benchmarks/ortgenai_peer/step_profile.py --engine engines/smollm2-135m/onnxruntime-int4 --precision int4 \\
        --steps 64 --rounds 6

Each side is one process kept loaded (ORT GenAI's in its venv of benchmarks/ortgenai_peer/run.py, its model built by
that script). A round: each process prefills the prompt and takes --steps plain one-token steps, each timed in wall
time and in the process's CPU time (all threads); this project's steps are split into the target graph's run, the LM
head's run and the host's share (embedding rows, bindings, reading outputs, the Python between). The order of the two
processes alternates by round; the table gives every round (medians over its steps), so the spread a shared machine
puts between rounds is visible, and the within-round ratio ours / ORT GenAI. `--row-floor 1` runs this project's
steps at one row whatever the engine's probe chose (not bit-identical to verify rows where the floor is 2: a
measurement of what the floor costs, never a decoding mode).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _steps_out(wall: list[float], cpu: list[float], **parts: list[float]) -> dict:
    out = {"wall_ms": statistics.median(wall) * 1e3, "cpu_ms": statistics.median(cpu) * 1e3}
    out.update({k: statistics.median(v) * 1e3 for k, v in parts.items()})
    return out


class _Timed:
    """A session whose run / run_with_iobinding calls add their wall time to `spent`."""

    def __init__(self, sess, spent: list[float]):
        self._sess, self._spent = sess, spent

    def __getattr__(self, name):
        attr = getattr(self._sess, name)
        if name not in ("run", "run_with_iobinding"):
            return attr

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._spent[0] += time.perf_counter() - t
        return timed


def ours_worker(engine_dir: str, threads: int, row_floor: int) -> None:
    sys.path.insert(0, str(REPO))
    from dflash_export.engines.registry import load_engine

    eng = load_engine(engine_dir, threads=threads)
    if row_floor:
        eng.row_floor = row_floor
    t_spent, h_spent = [0.0], [0.0]
    eng.target, eng.head = _Timed(eng.target, t_spent), _Timed(eng.head, h_spent)
    for line in sys.stdin:
        req = json.loads(line)
        ids, steps = req["ids"], req["steps"]
        seq = eng.new_sequence(len(ids) + steps + 1)
        last = int(eng.prefill(seq, ids).argmax())
        wall, cpu, tgt, head, host = [], [], [], [], []
        for _ in range(steps):
            t_spent[0] = h_spent[0] = 0.0
            w0, c0 = _clock()
            last = int(eng.decode(seq, last).argmax())
            w1, c1 = _clock()
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
            tgt.append(t_spent[0])
            head.append(h_spent[0])
            host.append(w1 - w0 - t_spent[0] - h_spent[0])
        print(json.dumps(_steps_out(wall, cpu, target_ms=tgt, head_ms=head, host_ms=host)), flush=True)


def ortgenai_worker(model_dir: str, threads: int) -> None:
    import onnxruntime_genai as og

    cfg = og.Config(model_dir)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1, "session.intra_op.allow_spinning": "0"}}}}))
    model = og.Model(cfg)
    for line in sys.stdin:
        req = json.loads(line)
        ids, steps = req["ids"], req["steps"]
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + steps + 1)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        gen.generate_next_token()
        wall, cpu = [], []
        for _ in range(steps):
            w0, c0 = _clock()
            gen.generate_next_token()
            w1, c1 = _clock()
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
        print(json.dumps(_steps_out(wall, cpu)), flush=True)


class _Proc:
    def __init__(self, argv: list[str]):
        env = {**os.environ, "OMP_WAIT_POLICY": "passive", "PYTHONPATH": str(REPO)}
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")

    def run(self, ids: list[int], steps: int) -> dict:
        self.p.stdin.write(json.dumps({"ids": ids, "steps": steps}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited ({self.p.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def _peer_module():
    spec = importlib.util.spec_from_file_location("ortgenai_peer_run", Path(__file__).with_name("run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs="+", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine", help="this project's engine directory")
    ap.add_argument("--precision", default="fp32", help="ORT GenAI model precision (fp32, int4)")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--row-floor", type=int, default=0, help="this project's steps at this many rows (0: the probe's)")
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "ours":
            ours_worker(rest[0], int(rest[1]), int(rest[2]))
        else:
            ortgenai_worker(rest[0], int(rest[1]))
        return 0
    if not args.engine:
        raise SystemExit("--engine: this project's engine directory is required")

    sys.path.insert(0, str(REPO))
    from dflash_export.bench.script_args import at_least, refuse

    at_least(args, 1, "--steps", "--rounds", "--threads")  # before ORT GenAI's install
    at_least(args, 0, "--row-floor")
    if not (Path(args.engine) / "manifest.json").is_file():
        refuse("--engine", f"{args.engine}: not a built engine directory (no manifest.json)")
    from dflash_export.bench.suite import encode_suite_prompts
    from dflash_export.engines.base import load_codec
    from dflash_export.files import cache_dir
    from dflash_export.recipes import load_recipe

    peer = _peer_module()
    recipe = load_recipe(args.recipe)
    root = cache_dir() / "ortgenai"
    py = peer.ortgenai_venv(root, peer.OG_VERSION)
    models = sorted((root / peer.OG_VERSION / "models").glob(f"{recipe.name}-*-{args.precision}"))
    if not models:
        raise SystemExit(f"no ORT GenAI {args.precision} model under {root}: run benchmarks/ortgenai_peer/run.py "
                         f"--precisions {args.precision} once")
    ids = list(next(iter(encode_suite_prompts(recipe, recipe.suite, 1, load_codec(Path(args.engine))))))
    ours = _Proc([sys.executable, __file__, "--worker", "ours", str(Path(args.engine).resolve()), str(args.threads),
                  str(args.row_floor)])
    og = _Proc([str(py), __file__, "--worker", "ortgenai", str(models[-1]), str(args.threads)])
    ours.run(ids, 8), og.run(ids, 8)  # warm-up
    print(f"{len(ids)}-token prompt, {args.steps} plain steps per round, {args.threads} threads, spinning off; "
          f"medians over the round's steps, ms (load average at start {os.getloadavg()[0]:.1f})\n")
    print("| round | order | ours wall | ours CPU | target | LM head | host | ORT GenAI wall | ORT GenAI CPU | "
          "wall ours/GenAI | CPU ours/GenAI | load |")
    print("|---" * 12 + "|")
    ratios = []
    for r in range(args.rounds):
        first = r % 2 == 0
        a = ours.run(ids, args.steps) if first else None
        b = og.run(ids, args.steps)
        if not first:
            a = ours.run(ids, args.steps)
        ratios.append((a["wall_ms"] / b["wall_ms"], a["cpu_ms"] / b["cpu_ms"]))
        print(f"| {r + 1} | {'ours first' if first else 'GenAI first'} | {a['wall_ms']:.2f} | {a['cpu_ms']:.2f} | "
              f"{a['target_ms']:.2f} | {a['head_ms']:.2f} | {a['host_ms']:.3f} | {b['wall_ms']:.2f} | "
              f"{b['cpu_ms']:.2f} | {ratios[-1][0]:.3f} | {ratios[-1][1]:.3f} | {os.getloadavg()[0]:.1f} |",
              flush=True)
    ours.close()
    og.close()
    print(f"\nmedian over rounds: wall ours/GenAI {statistics.median(x[0] for x in ratios):.3f}, "
          f"CPU ours/GenAI {statistics.median(x[1] for x in ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
