"""`train` as a stage: recipe and options checked, data made or found, the loop run, the best drafter written."""

from __future__ import annotations

import json
import math
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_file, cache_dir, check_output_dir, removing_new_dirs
from dflash_export.models.checkpoint import load_drafter
from dflash_export.models.drafter import DFlashDrafter, check_drafter_fits, is_drafter_dir
from dflash_export.models.target import load_target
from dflash_export.recipes import MAX_PROMPTS, SEED_MAX, load_recipe
from dflash_export.train.data import (
    ShardLoader,
    answers_dir,
    check_prompt_source,
    data_dir,
    generate_shards,
    shard_paths,
    sharegpt_prompt_ids,
    sharegpt_reply_ids,
    sharegpt_source,
    synthetic_prompt_ids,
    target_files_key,
)
from dflash_export.train.init_drafter import drafter_from_target, grow_drafter
from dflash_export.train.loop import TrainConfig, load_checkpoint, require_heldout, train_drafter
from dflash_export.train.own_answers import own_answer_data


def _prompt_sources(recipe, target, opts):
    """(train prompts thunk, held-out prompts thunk, teacher-forced thunk, source name) for the recipe's prompt kind.
    The prompts, and the answers cached for them, follow the recipe's train.seed; --seed draws the batches and
    anchors from them. ShareGPT prompts are chat-templated as the recipe's `chat_template` says, as `run`, `bench`
    and the server encode a prompt for it: the drafter trains on the token sequences it will draft after."""
    if opts.prompts == "sharegpt":
        chat = recipe.chat_template

        def fitting(split: str, prompts: list) -> list:
            if not prompts:
                raise DFlashError(f"no ShareGPT {split} prompt fits in {opts.max_prompt_tokens} tokens",
                                  path=recipe.path, field="train.max_prompt_tokens")
            return prompts

        def train_src():  # callers take the first num_prompts: template no more than those
            return fitting("train", sharegpt_prompt_ids(target, "train", opts.max_prompt_tokens, seed=opts.seed,
                                                        limit=opts.num_prompts, chat_template=chat))

        def heldout_src():
            return fitting("held-out", sharegpt_prompt_ids(target, "heldout", opts.max_prompt_tokens, seed=0,
                                                           shuffle=False, limit=opts.heldout_prompts,
                                                           chat_template=chat))

        def tf_src():
            return sharegpt_reply_ids(target, "train", opts.max_prompt_tokens, opts.max_reply_tokens, opts.seed,
                                      chat_template=chat)
        return train_src, heldout_src, tf_src, sharegpt_source(opts.seed, chat)
    if opts.prompts == "synthetic":
        reserved = target.vocab_size - min(opts.mask_token_id or target.vocab_size - 1, target.vocab_size - 2)

        def tf_src():  # random "answers": exercises the teacher-forced path on tokenizer-less targets
            rows = [ids for _, ids in synthetic_prompt_ids(target.vocab_size, 2 * opts.teacher_forced_prompts,
                                                              opts.seed + 2_000_000, reserved)]
            return [(i, p + q, len(p)) for i, (p, q) in enumerate(zip(rows[0::2], rows[1::2]))]
        return (lambda: synthetic_prompt_ids(target.vocab_size, opts.num_prompts, opts.seed, reserved),
                lambda: synthetic_prompt_ids(target.vocab_size, opts.heldout_prompts, opts.seed + 1_000_000, reserved),
                tf_src, f"synthetic-s{opts.seed}")
    raise DFlashError(f"unknown prompt source {opts.prompts!r} (sharegpt, synthetic)", path=recipe.path,
                      field="train.prompts")


def _check_start(drafter: DFlashDrafter, target, opts, mask_id: int, where: Path, *, resumed: bool) -> None:
    """A drafter training starts from (a checkpoint, `--init-from`) must fit the target and the recipe: its block,
    mask token and (when the recipe names them) taps; a checkpoint also its number of layers (`--init-from` grows a
    drafter to the recipe's)."""
    check_drafter_fits(drafter, target, str(where))
    c = drafter.config
    taps = opts.target_layer_ids
    for name, have, want in (("block_size", c.block_size, opts.block_size),
                             ("mask_token_id", c.mask_token_id, mask_id),
                             ("target_layer_ids", list(c.target_layer_ids), list(taps) if taps else None),
                             ("num_hidden_layers", c.num_hidden_layers, opts.draft_layers if resumed else None)):
        if want is not None and have != want:
            recipe_field = "draft_layers" if name == "num_hidden_layers" else name
            raise DFlashError(f"{have} != the recipe's train.{recipe_field} {want}" + (
                " (a checkpoint of another recipe: train it in another --work-dir)" if resumed else ""),
                path=where, field=name)
    for name, value, default in (("output_multiplier", c.output_multiplier, 1.0),
                                 ("final_logit_softcapping", c.final_logit_softcapping, None)):
        if value != default:  # the block loss scores the LM head's plain logits
            raise DFlashError(f"{value}: training drafters with scaled draft logits is not supported", path=where,
                              field=f"dflash_config.{name}")



def _check_run_args(steps, minutes, checkpoint_minutes, threads, num_prompts, seed) -> None:
    """The options `train` takes besides the recipe, for callers that bypass the CLI's click types."""
    def bad(option: str, message: str):
        raise DFlashError(message, field=option)

    for option, v, low in (("--steps", steps, 0), ("--threads", threads, 1), ("--num-prompts", num_prompts, 0)):
        if v is not None and (not is_int(v) or v < low):
            bad(option, f"must be an integer >= {low}, got {v!r}")
    if num_prompts is not None and num_prompts > MAX_PROMPTS:
        bad("--num-prompts", f"must be an integer in [0, {MAX_PROMPTS}], got {num_prompts!r}")
    if seed is not None and (not is_int(seed) or not 0 <= seed <= SEED_MAX):
        bad("--seed", f"must be an integer in [0, {SEED_MAX}], got {seed!r}")
    for option, v in (("--minutes", minutes), ("--checkpoint-minutes", checkpoint_minutes)):
        if v is None and option == "--minutes":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad(option, f"must be a finite number > 0, got {v!r}")


@contextmanager
def _no_bar_on_error(bar):
    """On an error the progress bars vanish, so that the error is the only line the user sees."""
    try:
        yield
    except Exception:
        bar.live.transient = True
        bar.live.stop()
        bar.disable = True  # else Progress.stop prints a blank line on a non-terminal
        raise


def run_train(recipe_name, *, steps=None, minutes=None, out=None, seed=None, resume=False, work_dir=None,
              num_prompts=None, data_only=False, no_generate=False, checkpoint_minutes=5.0, threads=None,
              init_from=None, console=None, data_part=None) -> dict:
    """The `train` stage: data (cached) -> drafter (the last checkpoint when resuming, else `init_from` grown to the
    recipe's depth, else from the target) -> training -> `out`."""
    from dataclasses import replace

    from rich.console import Console

    console = console or Console(stderr=True)
    # Everything the run is told -- options, recipe fields, where it writes -- is checked before any work starts.
    _check_run_args(steps, minutes, checkpoint_minutes, threads, num_prompts, seed)
    part = _parse_part(data_part, data_only)
    recipe = load_recipe(recipe_name)  # checks every recipe field's type and range
    opts = recipe.train
    if num_prompts is not None:
        opts = replace(opts, num_prompts=num_prompts)
        if num_prompts + opts.teacher_forced_prompts < 1:
            raise DFlashError("the prompt set is empty: 0 training prompts and the recipe's teacher_forced_prompts "
                              "is 0", field="--num-prompts")
    seed = opts.seed if seed is None else seed
    if not recipe.target.startswith("tiny:") and opts.mask_token_id is None:
        raise DFlashError("a real target needs an explicit mask token (a reserved special-token row)",
                          path=recipe.path, field="train.mask_token_id")
    work = Path(work_dir) if work_dir else cache_dir() / "train" / f"{recipe.name}-seed{seed}"
    if out is None:
        if ":" in recipe.drafter.split("/")[0]:
            out = work / "drafter"  # a tiny:/pkg: drafter is generated, not a place to write to
        else:
            out = Path(recipe.drafter_path)
    out = Path(out)
    if not data_only:
        check_output_dir(work, "--work-dir")
        check_output_dir(out, "--out", command="train", is_previous_output=is_drafter_dir, replaced=True)
        curve = work / "curve.jsonl"
        if os.path.lexists(curve) and not curve.is_file():  # found only at the first record, after the data
            raise DFlashError("is not a file: the training curve is appended to it", path=curve, field="--work-dir")
    if threads:
        torch.set_num_threads(threads)

    target = load_target(recipe.target_path)
    check_prompt_source(recipe, target.model_dir)
    if not data_only:
        _check_apart(out, work, Path(target.model_dir))
    if opts.soft_topk > target.vocab_size:
        raise DFlashError(f"must be <= the target's vocabulary size {target.vocab_size}, got {opts.soft_topk}",
                          path=recipe.path, field="train.soft_topk")
    mask_id = opts.mask_token_id if opts.mask_token_id is not None else target.vocab_size - 1
    if opts.prompts == "synthetic" and mask_id < 2:  # synthetic prompts draw their ids from 1 .. below the mask id
        raise DFlashError(f"must be >= 2 with synthetic prompts, got {mask_id}", path=recipe.path,
                          field="train.mask_token_id")

    # a run that fails before its first checkpoint leaves no work directory: nothing in it could be resumed from
    with removing_new_dirs(work, keep_if=lambda w: (w / "checkpoint").exists()):
        return _run_train(recipe, opts, target, mask_id, work, out, seed, steps=steps, minutes=minutes, resume=resume,
                          data_only=data_only, no_generate=no_generate, checkpoint_minutes=checkpoint_minutes,
                          init_from=init_from, console=console, part=part)


def _check_apart(out: Path, work: Path, target_dir: Path) -> None:
    """--out, --work-dir and the target's directory kept apart: the drafter directory is replaced whole at every
    export, so it must not be, hold or lie in the target's files or the checkpoints and curve of --work-dir."""
    def real(p: Path) -> Path:
        return Path(os.path.realpath(p))

    def overlap(a: Path, b: Path) -> bool:
        return a == b or a in b.parents or b in a.parents

    o, w, t = real(out), real(work), real(target_dir)
    for option, path, p in (("--out", out, o), ("--work-dir", work, w)):
        if overlap(p, t):
            raise DFlashError(f"overlaps the target's directory {target_dir}; choose a directory outside it",
                              path=path, field=option)
    if o == w or o in w.parents or (w in o.parents and o.relative_to(w).parts[0] in ("checkpoint", "curve.jsonl")):
        raise DFlashError(f"overlaps the checkpoints and curve of --work-dir {work}; choose another directory",
                          path=out, field="--out")


def _progress(bar, task, name: str, console, log_lines: bool):
    """A data task's progress: the bar, and with `log_lines` on a non-terminal (the log file of a `--data-only`
    background job) one dated line per update, since rich draws nothing there until the task ends. A training run
    keeps its one-line error contract: no lines before the error."""
    def update(done, total, tps):
        bar.update(task, completed=done, info=f"{tps:.0f} tok/s")
        if log_lines and not console.is_terminal:
            console.print(f"{time.strftime('%H:%M:%S')} {name}: {done}/{total} prompts, {tps:.0f} tok/s",
                          soft_wrap=True)
    return update


def _parse_part(data_part, data_only: bool) -> tuple[int, int]:
    """`I/N` -> (I, N): this process makes the training shards i with i % N == I."""
    if data_part is None:
        return 0, 1
    if not data_only:
        raise DFlashError("only with --data-only (training reads every shard)", field="--data-part")
    m = re.fullmatch(r"(\d+)/(\d+)", str(data_part).strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise DFlashError(f"must be I/N with 0 <= I < N, got {data_part!r}", field="--data-part")
    return int(m.group(1)), int(m.group(2))


def _run_train(recipe, opts, target, mask_id: int, work: Path, out: Path, seed: int, *, steps, minutes, resume,
               data_only, no_generate, checkpoint_minutes, init_from, console, part=(0, 1)) -> dict:
    """run_train after its checks: the start drafter, data, training, the prompt list."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    target_key = target_files_key(target)
    drafter, start_state = _start_drafter(recipe, opts, target, mask_id, work, resume, init_from, console,
                                          target_key, seed)
    tap_ids = drafter.config.target_layer_ids
    tap_width = len(tap_ids) * target.hidden_size

    train_src, heldout_src, tf_src, src_name = _prompt_sources(recipe, target, opts)
    ddir = data_dir(target, tap_ids, opts.max_prompt_tokens, opts.max_new_tokens, opts.soft_topk, src_name)
    hdir = data_dir(target, tap_ids, opts.max_prompt_tokens, opts.max_new_tokens, opts.soft_topk,
                    src_name.replace("-s", "-heldout-s"))
    tdir = data_dir(target, tap_ids, opts.max_prompt_tokens, opts.max_reply_tokens, opts.soft_topk,
                    src_name.replace("-s", "-tf-s"))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as bar, _no_bar_on_error(bar):
        if not no_generate:
            for name, src, directory, n, tf, kind in (
                    ("held-out data", heldout_src, hdir, opts.heldout_prompts, False,
                     src_name.replace("-s", "-heldout-s")),
                    ("teacher-forced data", tf_src, tdir, opts.teacher_forced_prompts, True, None),
                    ("train data", train_src, ddir, opts.num_prompts, False, src_name)):
                if n == 0:
                    continue
                progress = _progress(bar, bar.add_task(name, total=n, info=""), name, console, log_lines=data_only)
                try:
                    _make_data(target, opts, src, directory, tap_ids, n, tf, kind,
                               part if kind == src_name else (0, 1), progress)
                except (MemoryError, RuntimeError) as e:
                    if not _out_of_memory(e):
                        raise
                    raise DFlashError("out of memory generating training data (gen_batch_size answers of up to "
                                      "max_prompt_tokens + max_new_tokens tokens at once); lower train.gen_batch_size "
                                      "(or max_new_tokens)", path=recipe.path, field="train.gen_batch_size") from None
        heldout_loader = ShardLoader([(hdir, opts.heldout_prompts)], target.vocab_size, tap_width, opts.soft_topk)
        heldout = heldout_loader()

        sources = [(d, n) for d, n in ((ddir, opts.num_prompts), (tdir, opts.teacher_forced_prompts)) if n]
        loader = ShardLoader(sources, target.vocab_size, tap_width, opts.soft_topk)

        if data_only:
            sequences = len(loader())
            _report_skipped(bar.console, loader, sequences, "training")
            _report_skipped(bar.console, heldout_loader, len(heldout), "held-out")
            return {"data_dir": str(ddir), "sequences": sequences, "skipped": loader.skipped,
                    "heldout_skipped": heldout_loader.skipped}

        if not any(d.is_dir() and shard_paths(d) for d, _ in sources):
            raise DFlashError("no training data: the prompt set is empty or not generated yet (run without "
                              "--no-generate)", path=ddir)
        if not loader() and loader.skipped:
            raise DFlashError(f"nothing to train on: each of the {loader.skipped} training answers is shorter than 2 "
                              "tokens (the target stopped at once), and a block needs an answer token with the next "
                              "one as its label; check the target's stop tokens and the recipe's prompts "
                              "(chat_template), or delete this data to make it again",
                              path=sources[0][0])
        require_heldout(heldout)  # before the lines below: a refusal is one line
        _report_skipped(bar.console, loader, len(loader()), "training")
        _report_skipped(bar.console, heldout_loader, len(heldout), "held-out")
        cfg = _train_config(opts, seed, steps, minutes, checkpoint_minutes, target_key)
        first = start_state["step"] if start_state else 0
        task = bar.add_task("train", total=cfg.steps, completed=first, info="")
        work.mkdir(parents=True, exist_ok=True)
        _start_curve(work / "curve.jsonl", first)
        try:
            result = train_drafter(drafter, target, loader, heldout, cfg, work, out, start_state,
                                   progress=lambda s, loss: bar.update(task, completed=s, info=f"loss {loss:.3f}"),
                                   log=_curve_logger(work / "curve.jsonl", bar))
        except (MemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            raise DFlashError("out of memory for a training step; lower train.batch_size (or blocks_per_seq, "
                              "block_size)", path=recipe.path, field="train.batch_size") from None
    if opts.prompts == "sharegpt":
        _write_prompt_list(out, loader)
    console.print(f"drafter: {out}  (best held-out implied τ {result['best'].get('tau_est', 0):.2f} "
                  f"at step {result['best'].get('step')})")
    return result


def _report_skipped(console, loader, kept: int, what: str) -> None:
    """One line when the `what` (training, held-out) data hold sequences that supervise no position (answers
    shorter than 2 tokens; held-out ones give no block to evaluate): how many were left out, and where they are."""
    if loader.skipped:
        where = " and ".join(str(d) for d, _ in loader.sources)
        console.print(f"skipped {loader.skipped} of {loader.skipped + kept} {what} sequences: answers shorter than "
                      f"2 tokens supervise no position ({where})", soft_wrap=True)


def _out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the CPU running out of memory: Python's MemoryError, or torch's allocator failing."""
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e)


def _start_drafter(recipe, opts, target, mask_id: int, work: Path, resume: bool, init_from, console,
                   target_key: str | None = None, seed: int | None = None):
    """(drafter, training state) to start from: the last checkpoint when resuming, else `init_from` grown to the
    recipe's depth, else a drafter made from the target (state None: step 0)."""
    start_state = None
    drafter = None
    if resume:
        loaded = load_checkpoint(work)
        if loaded is not None:
            drafter, start_state = loaded
            _check_start(drafter, target, opts, mask_id, work / "checkpoint" / "drafter", resumed=True)
            if target_key is not None and start_state.get("target", target_key) != target_key:
                raise DFlashError("the checkpoint was trained against another target (its files differ from "
                                  f"{target.model_dir}'s); train this one in another --work-dir",
                                  path=work / "checkpoint" / "train_state.pt", field="target")
            # a step's batch is drawn from (seed, step): another seed would splice a second data order onto the
            # first. A checkpoint that does not record its seed resumes with whichever it is given.
            made_with = start_state.get("seed", seed)
            if seed is not None and made_with != seed:
                raise DFlashError(f"the checkpoint was made with seed {made_with}, not {seed}: resume it with --seed "
                                  f"{made_with}, or train seed {seed} in another --work-dir",
                                  path=work / "checkpoint" / "train_state.pt", field="seed")
            console.print(f"resuming from step {start_state['step']} ({work / 'checkpoint'})")
        else:
            console.print(f"--resume: no checkpoint in {work} yet, starting from step 0")
    if drafter is None and init_from is not None:
        start = Path(init_from)
        if not (start / "config.json").exists() and (start / "drafter" / "config.json").is_file():
            raise DFlashError(f"a training checkpoint, not a drafter: give its drafter, {start / 'drafter'} (or "
                              "resume that run with --resume --work-dir)", path=start, field="--init-from")
        drafter = load_drafter(init_from, dtype=torch.float32)
        _check_start(drafter, target, opts, mask_id, Path(init_from), resumed=False)
        if drafter.config.num_hidden_layers != opts.draft_layers:
            n = drafter.config.num_hidden_layers
            drafter = grow_drafter(drafter, opts.draft_layers, recipe_path=recipe.path)
            console.print(f"growing {init_from} from {n} to {opts.draft_layers} layers (the new ones start as "
                          "identities)")
    if drafter is None:
        drafter = drafter_from_target(target, opts.draft_layers, opts.block_size, mask_id, opts.target_layer_ids,
                                      recipe_path=recipe.path)
    return drafter, start_state


def _make_data(target, opts, src, directory: Path, tap_ids, n: int, teacher_forced: bool, kind, part,
               progress) -> None:
    """One data set's shards: teacher-forced replies, or the target's own answers (tokens in pass 1, taps captured,
    then any missing features in pass 2). A failed run leaves the shards it finished (the next run resumes from
    them) and no cache directory it created empty."""
    if teacher_forced:
        with removing_new_dirs(directory):
            generate_shards(target, src, directory, tap_ids, opts.max_new_tokens, n, opts.gen_batch_size,
                            opts.soft_topk, teacher_forced=True, progress=progress)
        return
    answers = answers_dir(target, opts.max_prompt_tokens, opts.max_new_tokens, kind)
    with removing_new_dirs(directory), removing_new_dirs(answers):
        own_answer_data(target, src, directory, answers, tap_ids, opts.max_new_tokens, n, opts.gen_batch_size,
                        opts.soft_topk, progress, part=part)


def _train_config(opts, seed: int, steps, minutes, checkpoint_minutes, target_key: str | None = None) -> TrainConfig:
    return TrainConfig(block_size=opts.block_size, gamma=opts.gamma, lr=opts.lr, warmup_steps=opts.warmup_steps,
                       lr_decay_steps=opts.lr_decay_steps, lr_min_ratio=opts.lr_min_ratio,
                       batch_size=opts.batch_size, blocks_per_seq=opts.blocks_per_seq,
                       soft_weight=opts.soft_weight, seed=seed, steps=opts.steps if steps is None else steps,
                       minutes=minutes, checkpoint_every_s=checkpoint_minutes * 60, target_key=target_key)


def _start_curve(log_path: Path, first: int) -> None:
    """curve.jsonl as the run starting at step `first` continues it: the records up to that step (those of the run
    whose checkpoint it resumes from), none for a run from step 0 -- not those an interrupted run logged after its
    last checkpoint, which this run logs again."""
    if not log_path.is_file():
        return
    kept = []
    if first > 0:
        # bytes that are not UTF-8 (the log is ASCII JSON: a damaged file) spoil only their own line, dropped below
        for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # the half line of a run killed while writing it, or a damaged one
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= first:
                kept.append(line + "\n")
    with atomic_file(log_path) as f:
        f.writelines(kept)


def _curve_logger(log_path: Path, bar):
    """The training loop's `log`: every record appended to curve.jsonl, checkpoints also printed above the bars."""
    def log(rec):
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec.get("event") == "checkpoint":
            bar.console.print(" ".join(f"{k}={v}" for k, v in rec.items() if k != "event"))
    return log


def _write_prompt_list(out: Path, loader) -> None:
    """Beside a drafter trained on ShareGPT prompts: the record indices of its prompts."""
    indices = sorted({s.index for s in loader()})  # a prompt can be in both the generated and teacher-forced sets
    try:
        with atomic_file(out.parent / f"{out.name}-train-prompts.txt") as f:
            f.write("# ShareGPT V3 record indices whose first-turn prompt this drafter was trained on\n")
            f.write("\n".join(str(i) for i in indices) + "\n")
    except OSError as e:
        raise DFlashError(f"cannot write the prompt list ({e.strerror or e})", path=out.parent) from None
