"""The training loop: schedule, batches, held-out evaluation, atomic checkpoints and resumption."""

from __future__ import annotations

import math
import reprlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from dflash_export.decoding.prompt_lookup import lookup_proposal
from dflash_export.decoding.request import is_finite_number, is_int
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_dir
from dflash_export.models.checkpoint import load_drafter
from dflash_export.models.drafter import DFlashDrafter, is_drafter_dir, save_drafter
from dflash_export.recipes import SEED_MAX
from dflash_export.train.blocks import (
    BlockBatch,
    LossOut,
    acceptance_stats,
    block_loss,
    build_blocks,
    default_gamma,
    position_weights,
    sample_anchors,
    train_forward,
)
from dflash_export.train.data import TrainSequence, load_tensors, short_reason, supervised


@dataclass
class TrainConfig:
    block_size: int = 8
    gamma: float | None = None
    lr: float = 3e-4
    warmup_steps: int = 20
    lr_decay_steps: int | None = None
    lr_min_ratio: float = 0.1
    batch_size: int = 4          # sequences per step
    blocks_per_seq: int = 16
    soft_weight: float = 0.5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    steps: int = 1000
    minutes: float | None = None
    checkpoint_every_s: float = 300.0
    log_every: int = 10
    eval_blocks_per_seq: int = 32
    target_key: str | None = None  # the target's files (data.target_files_key), kept in checkpoints
    extra: dict = field(default_factory=dict)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then flat or (lr_decay_steps set) cosine down to lr_min_ratio*lr at that step and flat after.
    A function of the total step only, so a resumed run follows the schedule an uninterrupted one would."""
    lr = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_decay_steps and step >= cfg.warmup_steps:
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps))
        lr *= cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return lr


def _vocab_of(seqs: Sequence[TrainSequence]) -> torch.Tensor:
    # a teacher-forced reply's own tokens are never labels (the target's argmaxes are, and they are in top_ids)
    ids = [s.ids[s.prompt_len:] for s in seqs if not s.teacher_forced] + [s.top_ids.flatten() for s in seqs]
    return torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.long)


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def make_batch(seqs: Sequence[TrainSequence], cfg: TrainConfig, mask_token_id: int, step: int) -> BlockBatch:
    g = _step_generator(cfg.seed, step)
    pick = torch.randint(0, len(seqs), (cfg.batch_size,), generator=g).tolist()
    chosen = [seqs[i] for i in pick]
    anchors = [sample_anchors(s, cfg.blocks_per_seq, g) for s in chosen]
    return build_blocks(chosen, anchors, cfg.block_size, mask_token_id)


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target, seqs: Sequence[TrainSequence], block_size: int,
             blocks_per_seq: int = 32, seed: int = 12345, device: torch.device | str = "cpu") -> dict:
    """Held-out position-k accuracy and implied τ, with the full-vocabulary LM head (as inference argmaxes). The
    blocks are laid out on the CPU and run on `device` (where the drafter and target are); the anchors depend on
    `seed` alone, so every evaluation of a run sees the same blocks. The drafter runs in eval mode and is left in
    the mode it came in.

    The yardstick on the very same blocks: `lookup_tau_est` is the τ prompt lookup (prompt_lookup.lookup_proposal on
    the tokens up to the anchor) would reach there, `copyable` the share of blocks whose first slot prompt lookup gets
    right, and `copy_acc1` / `other_acc1` the drafter's first-slot accuracy on those blocks and on the rest -- whether
    the drafter has learnt to copy what its context repeats."""
    if not seqs:
        return {}
    training = drafter.training
    drafter.eval()
    try:
        return _evaluate(drafter, target, seqs, block_size, blocks_per_seq, seed, device)
    finally:
        drafter.train(training)


def _evaluate(drafter: DFlashDrafter, target, seqs: Sequence[TrainSequence], block_size: int, blocks_per_seq: int,
              seed: int, device) -> dict:
    g = torch.Generator().manual_seed(seed)
    corr, val, look = [], [], []
    for s in seqs:
        anc = sample_anchors(s, blocks_per_seq, g)
        if not anc:
            continue
        batch = build_blocks([s], [anc], block_size, drafter.config.mask_token_id)
        placed = batch.to(device)
        hidden = train_forward(drafter, target.embed, placed)
        out = block_loss(hidden, placed, target.hf.get_output_embeddings().weight, None,
                         torch.ones(block_size - 1, device=device), 0.0)
        corr.append(out.correct.flatten(0, 1).cpu())
        val.append(out.valid.flatten(0, 1).cpu())
        ids = s.ids.tolist()
        labels = batch.labels[0]
        proposals = [lookup_proposal(ids[:a + 1], block_size - 1) for a in anc]
        look.append(torch.tensor([[k < len(p) and p[k] == int(labels[i, k]) for k in range(block_size - 1)]
                                  for i, p in enumerate(proposals)], dtype=torch.bool))
    if not corr:
        return {}
    correct, valid, lookup = torch.cat(corr), torch.cat(val), torch.cat(look) & torch.cat(val)
    stats = acceptance_stats(correct, valid)
    stats["lookup_tau_est"] = acceptance_stats(lookup, valid)["tau_est"]
    full = valid.all(-1)
    hit = lookup[full][:, 0]
    first = correct[full][:, 0].float()
    stats["copyable"] = float(hit.float().mean()) if len(hit) else 0.0
    stats["copy_acc1"] = float(first[hit].mean()) if bool(hit.any()) else 0.0
    stats["other_acc1"] = float(first[~hit].mean()) if bool((~hit).any()) else 0.0
    return stats


def save_checkpoint(work: Path, drafter: DFlashDrafter, optimizer, step: int, wall_s: float, best: dict,
                    target_key: str | None = None, seed: int | None = None) -> None:
    """`work/checkpoint/` = z-lab drafter + optimizer/step state (+ the target it trains against, the seed its
    batches are drawn with), replaced atomically as one directory."""
    state = {"step": step, "optimizer": optimizer.state_dict(), "wall_s": wall_s, "best": best}
    if target_key is not None:
        state["target"] = target_key
    if seed is not None:
        state["seed"] = seed
    try:
        with atomic_dir(work / "checkpoint") as tmp:
            save_drafter(drafter, tmp / "drafter")
            try:
                torch.save(state, tmp / "train_state.pt")
            except RuntimeError as e:  # torch's zip writer reports a short write (a full disk) as a RuntimeError
                raise DFlashError(f"cannot write checkpoint ({short_reason(e)})", path=work / "checkpoint") from None
    except OSError as e:
        raise DFlashError(f"cannot write checkpoint ({e.strerror or e})", path=work / "checkpoint") from None


def load_checkpoint(work: Path):
    """(drafter, train state) of `work/checkpoint`, or None when there is none. A checkpoint that is there but cannot
    be read back whole -- truncated, garbage, half of it missing -- is one DFlashError naming the file, never a
    silent fresh start."""
    ck = work / "checkpoint"
    state_path, drafter_dir = ck / "train_state.pt", ck / "drafter"
    if not ck.exists():
        return None
    if not state_path.is_file():
        raise DFlashError("corrupt checkpoint (train_state.pt is missing)", path=state_path)
    if not (drafter_dir / "config.json").is_file():
        raise DFlashError("corrupt checkpoint (the drafter's config.json is missing)", path=drafter_dir / "config.json")
    try:
        drafter = load_drafter(drafter_dir, dtype=torch.float32)
    except DFlashError as e:
        raise DFlashError(f"corrupt checkpoint ({e.message})", path=e.path or drafter_dir,
                          field=e.field) from None
    except Exception as e:
        raise DFlashError(f"corrupt checkpoint ({short_reason(e)})", path=drafter_dir) from None
    if state_path.stat().st_size == 0:
        raise DFlashError("corrupt checkpoint (empty file)", path=state_path)
    try:
        state = load_tensors(state_path)
    except Exception as e:  # zip errors (truncated), unpickling errors (garbage), ...
        raise DFlashError(f"corrupt checkpoint ({short_reason(e)})", path=state_path) from None
    problem = _train_state_problem(state, trainable_parameters(drafter))
    if problem:
        raise DFlashError(f"corrupt checkpoint ({problem})", path=state_path)
    return drafter, state


def _train_state_problem(state, params: Sequence[torch.nn.Parameter]) -> str | None:
    """What is wrong with a loaded train_state.pt for a drafter with `params`, or None."""
    if not isinstance(state, dict):
        return f"expected a dict, got {type(state).__name__}"
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a step count"
    wall = state.get("wall_s", 0.0)
    if not isinstance(wall, (int, float)) or not math.isfinite(wall):
        return f"wall_s {wall!r} is not a number"
    best = state.get("best", {})
    if not isinstance(best, dict):
        return "best is not a dict"
    tau = best.get("tau_est", 0.0)  # the held-out score each evaluation is compared with
    if not is_finite_number(tau):
        return f"best tau_est {tau!r} is not a number"
    if not isinstance(state.get("target", ""), str):
        return "target is not a string"
    seed = state.get("seed", 0)  # absent from checkpoints written before the seed was kept
    if not is_int(seed) or not 0 <= seed <= SEED_MAX:  # the range of --seed
        return f"seed {seed!r} is not a seed"
    opt = state.get("optimizer")
    try:
        ids = [i for g in opt["param_groups"] for i in g["params"]]
        if len(ids) != len(params):
            return f"optimizer state for {len(ids)} tensors, the drafter has {len(params)}"
        problem = _optimizer_groups_problem(opt["param_groups"], params)
        if problem:
            return problem
        for i, p in zip(ids, params):
            for key, v in opt["state"].get(i, {}).items():
                if not isinstance(v, torch.Tensor) or (key == "step" and v.numel() != 1):
                    return f"optimizer {key} is not a {'step count' if key == 'step' else 'tensor'}"
                if key != "step" and v.shape != p.shape:
                    return f"optimizer {key} of shape {tuple(v.shape)} for a parameter of shape {tuple(p.shape)}"
    except (TypeError, KeyError, AttributeError):
        return "no usable optimizer state"
    return None


def _optimizer_groups_problem(groups, params: Sequence[torch.nn.Parameter]) -> str | None:
    """What is wrong with the saved param_groups of the AdamW optimizer train_drafter makes, or None: each setting it
    reads must be there and of the kind a new optimizer's is (a flag a bool, a rate a finite number, betas a pair)."""
    fresh = torch.optim.AdamW(params).param_groups[0]  # no state until a step: the parameters are not touched
    for g in groups:
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in g:
                return f"optimizer setting {key} is missing"
        for key, v in g.items():
            if key == "params" or key not in fresh:
                continue
            want = fresh[key]
            if isinstance(want, bool) or want is None:
                ok, kind = isinstance(v, bool) or (want is None and v is None), "true or false"
            elif isinstance(want, tuple):
                ok = isinstance(v, (tuple, list)) and len(v) == len(want) and all(is_finite_number(x) for x in v)
                kind = f"{len(want)} numbers"
            else:
                ok, kind = is_finite_number(v), "a number"
            if not ok:
                return f"optimizer setting {key} {reprlib.repr(v)} is not {kind}"
    return None


def trainable_parameters(drafter: DFlashDrafter) -> list[torch.nn.Parameter]:
    """Everything the drafter owns (layers, fc, hidden_norm, norm); embedding and LM head are the target's."""
    return [p for n, p in drafter.named_parameters()]


def _resume_state(opt, start_state: dict | None, out: Path | None) -> tuple[int, float, dict]:
    """(step, wall seconds so far, best-so-far) to start from; loads the optimizer state when resuming."""
    step, wall0, best = 0, 0.0, {"tau_est": 0.0}
    if start_state is not None:
        opt.load_state_dict(start_state["optimizer"])
        step, wall0 = start_state["step"], start_state.get("wall_s", 0.0)
        # The best-so-far belongs to the directory it was exported to: a resumed run writing elsewhere, or to a
        # directory that no longer holds that drafter, starts afresh (else a better score recorded for a drafter
        # that is not there would keep the directory empty).
        if start_state.get("best", {}).get("out") == (str(out) if out is not None else None) and (
                out is None or is_drafter_dir(out)):
            best = start_state["best"]
    return step, wall0, best


def train_step(drafter: DFlashDrafter, target, opt, params, batch: BlockBatch, vocab, head: torch.Tensor,
               weights: torch.Tensor, cfg: TrainConfig, lr: float) -> LossOut:
    """One optimizer step on `batch` at learning rate `lr`; the batch, `vocab`, `head` and `weights` on the
    drafter's device. Returns the batch's loss and accept figures."""
    for group in opt.param_groups:
        group["lr"] = lr
    hidden = train_forward(drafter, target.embed, batch)
    res = block_loss(hidden, batch, head, vocab, weights, cfg.soft_weight)
    opt.zero_grad(set_to_none=True)
    res.loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return res


def _train_step(drafter: DFlashDrafter, target, opt, params, seqs: list[TrainSequence], vocab, head: torch.Tensor,
                weights: torch.Tensor, cfg: TrainConfig, step: int) -> tuple[float, LossOut]:
    """Step `step` of the schedule on the CPU: its batch (seeded by step) at its learning rate."""
    lr = learning_rate(cfg, step)
    batch = make_batch(seqs, cfg, drafter.config.mask_token_id, step)
    return lr, train_step(drafter, target, opt, params, batch, vocab, head, weights, cfg, lr)


def require_heldout(heldout: Sequence[TrainSequence]) -> None:
    """Refuse held-out data with no sequence to evaluate a block on (an anchor needs a label after it): without one,
    no drafter would ever be chosen and exported."""
    if not any(supervised(s) for s in heldout):
        raise DFlashError("no held-out data to choose the drafter by (none generated yet, or every held-out answer "
                          "is shorter than 2 tokens): run without --no-generate, or raise train.heldout_prompts",
                          field="train.heldout_prompts")


def train_drafter(drafter: DFlashDrafter, target, data_loader: Callable[[], list[TrainSequence]],
                  heldout: Sequence[TrainSequence], cfg: TrainConfig, work: Path, out: Path | None = None,
                  start_state: dict | None = None, progress=None, log: Callable[[dict], None] | None = None) -> dict:
    """Train until `cfg.steps` total steps or `cfg.minutes` of wall time; checkpoint to `work`, export the best
    drafter (by held-out implied τ) to `out`. Returns the last log record."""
    if out is not None:
        require_heldout(heldout)
    torch.manual_seed(cfg.seed)
    for p in target.hf.parameters():
        p.requires_grad_(False)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    weights = position_weights(cfg.block_size, gamma)
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, wall0, best = _resume_state(opt, start_state, out)
    first = step
    head = target.hf.get_output_embeddings().weight.detach()
    seqs = data_loader()
    if not seqs:
        raise DFlashError("no training sequences (the prompt set is empty or every response was empty)",
                          field="prompts")
    vocab = _vocab_of(seqs)
    t_start = time.perf_counter()
    deadline = None if cfg.minutes is None else t_start + cfg.minutes * 60
    last_ck = t_start
    window: list[dict] = []
    record: dict = {}
    drafter.train()

    def checkpoint_and_eval():
        nonlocal best
        ev = evaluate(drafter, target, heldout, cfg.block_size, cfg.eval_blocks_per_seq)
        wall = wall0 + time.perf_counter() - t_start
        rec = {"step": step, "wall_s": round(wall, 1), "sequences": len(seqs),
               "skipped_sequences": getattr(data_loader, "skipped", 0), "vocab": len(vocab),
               **{f"heldout_{k}": round(v, 4) for k, v in ev.items()}}
        if out is not None and ev and ev["tau_est"] >= best.get("tau_est", 0.0):
            best = {**ev, "step": step, "out": str(out)}
            save_drafter(drafter, out)
        save_checkpoint(work, drafter, opt, step, wall, best, cfg.target_key, cfg.seed)
        if log and (step > first or start_state is None):  # a finished run resumed: its record is in the log
            log({"event": "checkpoint", **rec, "best_step": best.get("step")})
        return rec

    while step < cfg.steps and (deadline is None or time.perf_counter() < deadline):
        lr, res = _train_step(drafter, target, opt, params, seqs, vocab, head, weights, cfg, step)
        if not math.isfinite(res.loss.item()):
            raise DFlashError(f"the training loss is {res.loss.item()} at step {step + 1} (non-finite data or "
                              "weights, or a learning rate too high); nothing of this step was saved",
                              field="train.lr")
        step += 1
        window.append({"loss": res.loss.item(), **acceptance_stats(res.correct, res.valid)})
        if progress is not None:
            progress(step, window[-1]["loss"])
        if step % cfg.log_every == 0:
            record = {"event": "train", "step": step, "lr": lr,
                      "wall_s": round(wall0 + time.perf_counter() - t_start, 1),
                      **{k: round(sum(w[k] for w in window) / len(window), 4) for k in window[0]}}
            window = []
            if log:
                log(record)
        if time.perf_counter() - last_ck > cfg.checkpoint_every_s:
            last_ck = time.perf_counter()
            checkpoint_and_eval()
            fresh = data_loader()  # data generation may be running alongside: pick up new shards
            if len(fresh) > len(seqs):
                seqs = fresh
                vocab = _vocab_of(seqs)
    final = checkpoint_and_eval()
    drafter.eval()
    return {**record, **final, "best": best}
