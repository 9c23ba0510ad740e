"""Train the smollm2-135m drafter further on one NVIDIA GPU, from the shipped drafter, on the target's own answers.

The recipe's `train` runs on CPUs, where the shipped drafter got ~1900 steps of 4 sequences: too little compute for it
to learn to copy what its context repeats (recipes/smollm2-135m/README.md). This script spends a GPU's minutes on the
same objective with the same code (train/blocks.py: block layout, masks, loss; train/loop.py: batches, the optimizer
step, the held-out evaluation) and only moves tensors: the target's greedy answers are made on the GPU in large
batches, their taps and top-4 soft targets come from one causal forward, batches are laid out by CPU workers and the
drafter steps on the GPU. Its learning rate follows a cosine over the run's seconds, not its steps (a GPU's step count
is not known in advance).

Two steps, because the GPU machine has no package index and no model hub (transformers' GGUF reader needs PyPI `gguf`,
which is carried there as a wheel):
  python scripts/gpu_train.py prepare DIR          (here) prompts as token ids (every user turn of the ShareGPT
                                                   train split, index < 12 000, with as much of its conversation as
                                                   fits 384 tokens, chat-templated; and 256 first turns of the
                                                   held-out split, index >= 12 000, <= 128 tokens, for the
                                                   evaluation), the target's config files, a digest of its fp32
                                                   weights
  python3 scripts/gpu_train.py run DIR --out OUT   (there) target from the GGUF (transformers' loader, checked against
                                                   the digest), answers, features, training, best drafter by the
                                                   held-out implied τ, saved in <= 12 MB shards
  python3 scripts/gpu_train.py run DIR --tiny      the same code on the tiny LLaMA pair, for a smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
T0 = time.monotonic()
HELDOUT_PROMPTS = 256  # held-out split prompts `prepare` writes; `run --heldout` answers the first of them


def log(msg: str) -> None:
    print(f"[gpu_train {time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------- prepare
def pack(rows: list[tuple[int, list[int]]]) -> dict:
    """(index, ids) rows as three tensors (int32 ids, one flat run, and where each row ends): a list of lists of
    Python ints pickles to ~10x the bytes, and the device machine takes 64 MiB a call."""
    return {"index": torch.tensor([i for i, _ in rows], dtype=torch.int64),
            "ends": torch.tensor([len(p) for _, p in rows], dtype=torch.int64).cumsum(0),
            "ids": torch.tensor([t for _, p in rows for t in p], dtype=torch.int32)}


def unpack(d: dict) -> list[tuple[int, list[int]]]:
    ends = d["ends"].tolist()
    ids = d["ids"].tolist()
    return [(int(i), ids[(ends[r - 1] if r else 0):e]) for r, (i, e) in enumerate(zip(d["index"].tolist(), ends))]


def prepare(out: Path, num_prompts: int, max_prompt_tokens: int) -> None:
    from dflash_export.models.target import load_target, resolve_target_dir
    from dflash_export.recipes import load_recipe
    from dflash_export.train.data import sharegpt_conversation_ids, sharegpt_prompt_ids

    recipe = load_recipe("smollm2-135m")
    target = load_target(recipe.target)
    out.mkdir(parents=True, exist_ok=True)
    prompts = sharegpt_conversation_ids(target, "train", max_prompt_tokens, seed=0, limit=num_prompts)
    # evaluation prompts from the held-out split (index >= 12 000), which no drafter of this project trained on
    heldout = sharegpt_prompt_ids(target, "heldout", 128, seed=0, limit=HELDOUT_PROMPTS)
    torch.save({"prompts": pack(prompts), "heldout": pack(heldout), "stop_token_ids": target.stop_token_ids},
               out / "prompts.pt")
    src = resolve_target_dir(recipe.target)
    (out / "target").mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, out / "target" / name)
    (out / "target" / "digest.txt").write_text(weights_digest(target.hf) + "\n")
    log(f"{len(prompts)} training and {len(heldout)} held-out prompts, the target's config and digest written to "
        f"{out}")


# ---------------------------------------------------------------------------------------------------------- target
def load_gguf_target(gguf: Path, cfg_dir: Path, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from dflash_export.models.target import TargetModel, read_target_config

    config = AutoConfig.from_pretrained(str(cfg_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:  # what models/gguf.py does
        state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        model.tie_weights()
    except Exception as e:  # another transformers: its public path (which wants accelerate, installed there)
        log(f"load_gguf_checkpoint failed ({type(e).__name__}: {e}); from_pretrained(gguf_file=...) instead")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg, _ = read_target_config(cfg_dir)
    return TargetModel(model.to(device), cfg_dir, cfg)


# ------------------------------------------------------------------------------------------------------ answers
@torch.inference_mode()
def greedy_answers(target, prompts, max_new: int, batch: int, deadline: float, device) -> list[tuple[int, list, list]]:
    """(index, prompt ids, answer ids) for as many prompts as fit before `deadline`: left-padded batches of similar
    lengths, greedy, cut after the first stop token."""
    from dflash_export.train.data import cut_at_stop, left_padded

    stop = set(target.stop_token_ids)
    pad = next(iter(target.stop_token_ids), 0)
    # prompts come in a seeded order and a deadline may cut it anywhere: lengths are sorted within windows of four
    # batches only (little padding), so that what is answered is a sample of every length, not the shortest ones
    window = 4 * batch
    order = [i for w0 in range(0, len(prompts), window)
             for i in sorted(range(w0, min(w0 + window, len(prompts))), key=lambda i: len(prompts[i][1]))]
    out = []
    for b0 in range(0, len(order), batch):
        if out and time.monotonic() > deadline:  # one batch at least
            log(f"answers: deadline reached after {len(out)} prompts")
            break
        rows = [prompts[i] for i in order[b0:b0 + batch]]
        ids, attn = left_padded([p for _, p in rows], pad)
        gen = target.hf.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=sorted(stop) or None, pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None).cpu()
        out += [(index, p, cut_at_stop(gen[r, ids.shape[1]:].tolist(), stop)) for r, (index, p) in enumerate(rows)]
        n_tok = sum(len(a) for _, _, a in out)
        log(f"answers: {len(out)} prompts, {n_tok} answer tokens")
    return out


@torch.inference_mode()
def features(target, answers, tap_ids, batch: int, device, topk: int = 4):
    """TrainSequences (CPU tensors) from one causal forward per batch: taps of every position, top-k soft targets."""
    from dflash_export.models.target import tap_hidden_states
    from dflash_export.train.data import TrainSequence

    pad = next(iter(target.stop_token_ids), 0)
    seqs = []
    for b0 in range(0, len(answers), batch):
        rows = answers[b0:b0 + batch]
        full = [p + a for _, p, a in rows]
        s_max = max(len(f) for f in full)
        ids = torch.full((len(rows), s_max), pad, dtype=torch.long)
        for r, f in enumerate(full):
            ids[r, :len(f)] = torch.tensor(f)
        res = target.hf(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
        taps = tap_hidden_states(res.hidden_states, tap_ids)
        for r, ((index, p, a), f) in enumerate(zip(rows, full)):
            if len(a) < 2:
                continue
            logp = torch.log_softmax(res.logits[r, len(p) - 1: len(f) - 1].float(), dim=-1)
            top_logp, top_ids = logp.topk(topk, dim=-1)
            seqs.append(TrainSequence(torch.tensor(f), len(p), taps[r, :len(f)].to(torch.float16).cpu(),
                                      top_ids.cpu(), top_logp.cpu(), index))
        del res, taps
    return seqs


# ------------------------------------------------------------------------------------------------------ training
class Batches(torch.utils.data.Dataset):
    """Batch `step` of the training schedule, laid out on a CPU worker (train/loop.make_batch, train/blocks.py)."""

    def __init__(self, seqs, cfg, mask_id: int, steps: int):
        self.seqs, self.cfg, self.mask_id, self.steps = seqs, cfg, mask_id, steps

    def __len__(self):
        return self.steps

    def __getitem__(self, step):
        from dataclasses import asdict

        from dflash_export.train.loop import make_batch

        return asdict(make_batch(self.seqs, self.cfg, self.mask_id, step))


def train(drafter, target, seqs, heldout, cfg, seconds: float, device, out: Path, workers: int) -> list[dict]:
    from dflash_export.models.drafter import save_drafter
    from dflash_export.train.blocks import BlockBatch, default_gamma, position_weights
    from dflash_export.train.loop import _vocab_of, evaluate, train_step, trainable_parameters

    def heldout_stats():
        return evaluate(drafter, target, heldout, cfg.block_size, cfg.eval_blocks_per_seq, device=device)

    torch.backends.cuda.matmul.allow_tf32 = True  # the drafter's training only; answers and features ran in fp32
    for p in target.hf.parameters():
        p.requires_grad_(False)
    weights = position_weights(cfg.block_size, cfg.gamma or default_gamma(cfg.block_size)).to(device)
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    head = target.hf.get_output_embeddings().weight.detach()
    vocab = _vocab_of(seqs).to(device)
    loader = torch.utils.data.DataLoader(Batches(seqs, cfg, drafter.config.mask_token_id, 10 ** 7), batch_size=None,
                                         shuffle=False, num_workers=workers, pin_memory=device.type == "cuda",
                                         prefetch_factor=4 if workers else None,
                                         multiprocessing_context="fork" if workers else None)
    curve = []
    base = heldout_stats()
    best = {"step": 0, **base}
    curve.append({"step": 0, "wall_s": round(time.monotonic() - T0, 1), **{f"heldout_{k}": round(v, 4)
                                                                            for k, v in base.items()}})
    log(f"held-out before training: {curve[-1]}")
    save_drafter(_half(drafter), out, max_shard_bytes=12 << 20)
    t_start = time.monotonic()
    last_eval, window = t_start, []
    drafter.train()
    for step, d in enumerate(loader):
        frac = (time.monotonic() - t_start) / seconds
        if frac >= 1.0:
            break
        warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))  # --warmup 0: the full rate from the first step
        lr = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        batch = BlockBatch(**d).to(device, non_blocking=True)
        res = train_step(drafter, target, opt, params, batch, vocab, head, weights, cfg, lr)
        window.append(res.loss.detach())
        if time.monotonic() - last_eval > 45 or (time.monotonic() - t_start) / seconds >= 1.0:
            last_eval = time.monotonic()
            ev = heldout_stats()
            rec = {"step": step + 1, "wall_s": round(time.monotonic() - T0, 1), "lr": lr,
                   "loss": round(float(torch.stack(window).mean()), 4),
                   **{f"heldout_{k}": round(v, 4) for k, v in ev.items()}}
            window = []
            curve.append(rec)
            log(str(rec))
            if ev["tau_est"] > best["tau_est"]:
                best = {"step": step + 1, **ev}
                save_drafter(_half(drafter), out, max_shard_bytes=12 << 20)
    ev = heldout_stats()
    curve.append({"step": step, "wall_s": round(time.monotonic() - T0, 1), "final": True,
                  **{f"heldout_{k}": round(v, 4) for k, v in ev.items()}})
    if ev["tau_est"] > best["tau_est"]:
        best = {"step": step, **ev}
        save_drafter(_half(drafter), out, max_shard_bytes=12 << 20)
    log(f"best: {best}")
    return curve


def _half(drafter):
    import copy

    return copy.deepcopy(drafter).to(torch.float16)


def run(args) -> int:
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.train.loop import TrainConfig

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    end = T0 + args.seconds
    log(f"device {device} {torch.cuda.get_device_name(0) if device.type == 'cuda' else ''}, torch {torch.__version__}")
    if args.tiny:
        from dflash_export.models.target import load_target
        from dflash_export.models.tiny import tiny_pair_path
        from dflash_export.train.data import synthetic_prompt_ids

        target = load_target(tiny_pair_path("llama/target"))
        target.hf.to(device)
        drafter = load_drafter(tiny_pair_path("llama/drafter"), torch.float32)
        prompts = synthetic_prompt_ids(target.vocab_size, 96, seed=0)
        held_prompts, prompts = prompts[:8], prompts[8:]
        max_new, gen_batch = 24, 32
    else:
        data = torch.load(args.dir / "prompts.pt", weights_only=True)
        if not isinstance(data.get("heldout"), dict):
            raise SystemExit(f"{args.dir / 'prompts.pt'}: written by an older `prepare`: run it again")
        prompts = unpack(data["prompts"])[: args.prompts]
        held_prompts = unpack(data["heldout"])[: args.heldout]
        target = load_gguf_target(args.gguf, args.dir / "target", device)
        digest = weights_digest(target.hf)
        want = (args.dir / "target" / "digest.txt").read_text().strip()
        log(f"target loaded: fp32 weights digest {'equals' if digest == want else 'DIFFERS FROM'} the CPU copy's")
        drafter = load_drafter(ROOT / "recipes" / "smollm2-135m" / "drafter", torch.float32)
        max_new, gen_batch = args.max_new_tokens, args.gen_batch
    drafter.to(device)
    taps = list(drafter.config.target_layer_ids)
    # the held-out answers first (a deadline must not leave the evaluation without them), then the training answers
    held_answers = greedy_answers(target, held_prompts, max_new, gen_batch, math.inf, device)
    held = features(target, held_answers, taps, 32, device)
    answers = greedy_answers(target, prompts, max_new, gen_batch, min(end - 60, T0 + args.answer_seconds), device)
    seqs = features(target, answers, taps, 32, device)
    log(f"features: {len(seqs)} training / {len(held)} held-out sequences, "
        f"{sum(len(s.ids) - s.prompt_len for s in seqs)} answer tokens")
    cfg = TrainConfig(block_size=drafter.config.block_size, lr=args.lr, warmup_steps=args.warmup,
                      batch_size=args.batch, blocks_per_seq=args.blocks_per_seq, soft_weight=0.5, seed=0)
    seconds = max(5.0, end - time.monotonic() - args.reserve)
    log(f"training for {seconds:.0f} s")
    curve = train(drafter, target, seqs, held, cfg, seconds, device, args.out / "drafter", args.workers)
    (args.out / "curve.json").write_text(json.dumps({"curve": curve, "answers": len(answers),
                                                     "train_sequences": len(seqs), "heldout": len(held),
                                                     "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    log("done")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir", type=Path)
    p.add_argument("--prompts", type=int, default=None, help="at most this many (default: every one that fits)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--gguf", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--tiny", action="store_true")
    r.add_argument("--cpu", action="store_true")
    r.add_argument("--seconds", type=float, default=480.0, help="the whole run, loading included")
    r.add_argument("--answer-seconds", type=float, default=150.0)
    r.add_argument("--reserve", type=float, default=15.0, help="seconds kept for the last evaluation and save")
    r.add_argument("--prompts", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=384)
    r.add_argument("--gen-batch", type=int, default=1024)
    r.add_argument("--batch", type=int, default=32, help="sequences per step")
    r.add_argument("--blocks-per-seq", type=int, default=32)
    r.add_argument("--heldout", type=int, default=64, help="held-out split prompts answered for the evaluation")
    r.add_argument("--lr", type=float, default=1e-4, help="peak rate (3e-4 over 2 560 answers memorised them)")
    r.add_argument("--warmup", type=int, default=100)
    r.add_argument("--workers", type=int, default=12)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dir, args.prompts, args.max_prompt_tokens)
        return 0
    if not args.tiny and not (args.dir / "prompts.pt").is_file():  # checked before --out is made
        ap.error(f"{args.dir / 'prompts.pt'}: not found: run `prepare {args.dir}` first (or give --tiny)")
    if not args.tiny and (args.gguf is None or not args.gguf.is_file()):
        ap.error(f"--gguf: the target's GGUF file is needed without --tiny ({args.gguf or 'not given'}: not found)")
    args.out.mkdir(parents=True, exist_ok=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
