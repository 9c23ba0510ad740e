"""The target's own answers (pass 1 batched greedy decoding with capture, pass 2 features) against plain unbatched
greedy decoding and one full forward, and resumption shard by shard."""

import re

import pytest
import torch

from dflash_export.runtime.reference import ar_generate
from dflash_export.train.data import load_shards
from dflash_export.train.own_answers import (
    SHARD_SIZE,
    answer_paths,
    feature_shards,
    generate_answer_shards,
    greedy_answers,
)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(i, torch.randint(1, 250, (int(torch.randint(2, 11, (1,), generator=g)),), generator=g).tolist())
            for i in range(n)]


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_llama"])
def test_batched_answers_equal_unbatched_greedy_with_refills_and_early_stops(arch, request):
    target, _ = request.getfixturevalue(arch)
    prompts = _prompts(9)
    # stop tokens taken from two unstopped answers (at steps 3 and 6), so some rows stop early and free their slot
    stop = [ar_generate(target, prompts[j][1], 8).tokens[k] for j, k in ((1, 3), (4, 6))]
    # batch 3 over 9 prompts of different lengths: slots free up at different steps and take the next prompts
    got = {a.key: a for a in greedy_answers(target.hf, prompts, 14, stop, batch_size=3)}
    assert sorted(got) == list(range(9))
    lengths = set()
    for i, p in prompts:
        want = ar_generate(target, p, 14, stop_token_ids=stop).tokens
        assert got[i].answer == want, i
        lengths.add(len(want))
    assert len(lengths) > 1  # some answers did stop early


@pytest.mark.parametrize("last_layer", [False, True])
def test_captured_taps_and_topk_equal_one_full_forward(tiny_qwen3, last_layer):
    target, drafter = tiny_qwen3
    taps_ids = list(drafter.config.target_layer_ids)
    if last_layer:  # HF's last hidden state is after the final norm: the decoder's tap must be the same
        taps_ids[-1] = target.hf.config.num_hidden_layers - 1
    prompts = _prompts(5, seed=1)
    for a in greedy_answers(target.hf, prompts, 10, [], batch_size=2, tap_ids=taps_ids, topk=3):
        full = torch.tensor(a.prompt + a.answer)
        out = target.forward(full[None], torch.arange(len(full))[None], target.new_cache(), taps_ids)
        # every position but the last (never fed back; stored as zeros, never visible to a block)
        torch.testing.assert_close(a.taps[:-1].float(), out.taps[0, :-1].half().float(), atol=2e-3, rtol=2e-3)
        assert not a.taps[-1].any()
        logp = torch.log_softmax(out.logits[0, len(a.prompt) - 1:-1].float(), -1)
        want_logp, want_ids = logp.topk(3, -1)
        assert torch.equal(a.top_ids, want_ids)
        torch.testing.assert_close(a.top_logp, want_logp, atol=1e-4, rtol=1e-4)
        assert a.top_ids[:, 0].tolist() == a.answer  # greedy: the answer is the argmax of every step


def test_shards_resume_and_pass_two_rebuilds_the_captured_features(tmp_path, tiny_qwen3):
    target, drafter = tiny_qwen3
    taps_ids = drafter.config.target_layer_ids
    prompts = _prompts(SHARD_SIZE + 5, seed=2)
    tok, feat = tmp_path / "tokens", tmp_path / "features"
    assert generate_answer_shards(target, prompts, tok, feat, taps_ids, 6, batch_size=8, topk=2) == len(prompts)
    assert [p.name for p in answer_paths(tok)] == ["answers-00000.pt", "answers-00001.pt"]
    captured = load_shards(feat)
    assert [s.index for s in captured] == [i for i, _ in prompts]
    stamp = (tok / "answers-00000.pt").stat().st_mtime_ns
    (tok / "answers-00001.pt").unlink()
    (feat / "shard-00001.pt").unlink()
    generate_answer_shards(target, prompts, tok, feat, taps_ids, 6, batch_size=8, topk=2)
    assert (tok / "answers-00000.pt").stat().st_mtime_ns == stamp  # a finished shard is never redone
    assert [s.ids.tolist() for s in load_shards(feat)] == [s.ids.tolist() for s in captured]
    # pass 2 from the tokens alone gives the same sequences, labels and (up to fp16 rounding) features
    rebuilt_dir = tmp_path / "rebuilt"
    assert feature_shards(target, tok, rebuilt_dir, taps_ids, topk=2) == 2
    for a, b in zip(load_shards(rebuilt_dir), captured):
        assert torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len and not a.teacher_forced
        assert torch.equal(a.top_ids, b.top_ids)
        torch.testing.assert_close(a.taps[:-1].float(), b.taps[:-1].float(), atol=2e-3, rtol=2e-3)
    # two processes sharing the work (--data-part 0/2 and 1/2) make exactly the shards one process makes
    split_tok, split_feat = tmp_path / "split-tokens", tmp_path / "split-features"
    assert generate_answer_shards(target, prompts, split_tok, split_feat, taps_ids, 6, batch_size=8, topk=2,
                                  part=(1, 2)) == len(prompts) - SHARD_SIZE  # only shard 1 is this part's
    assert [p.name for p in answer_paths(split_tok)] == ["answers-00001.pt"]
    generate_answer_shards(target, prompts, split_tok, split_feat, taps_ids, 6, batch_size=8, topk=2, part=(0, 2))
    assert [s.ids.tolist() for s in load_shards(split_feat)] == [s.ids.tolist() for s in captured]


def test_source_that_runs_dry_exactly_when_the_batch_empties_ends_cleanly(tiny_qwen3):
    target, _ = tiny_qwen3
    prompts = _prompts(4, seed=5)
    # 2 rows at a time, all stopping after 3 tokens: the batch empties twice, the second time with nothing left
    got = list(greedy_answers(target.hf, prompts, 3, [], batch_size=2))
    assert sorted(a.key for a in got) == [0, 1, 2, 3] and all(len(a.answer) == 3 for a in got)
    assert list(greedy_answers(target.hf, [], 3, [], batch_size=2)) == []


def test_static_index_answers_that_fail_leave_no_empty_cache_folder(tmp_path, tiny_qwen3, monkeypatch):
    from dflash_export.recipes import TrainOptions
    from dflash_export.train import own_answers

    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(own_answers, "SlotCache", no_memory)
    with pytest.raises(MemoryError):
        own_answers.static_index_answers(tiny_qwen3[0], TrainOptions(prompts="synthetic", max_new_tokens=4), 3)
    assert not (tmp_path / "cache" / "train-data").exists()


def test_features_of_a_short_answer_shard_are_rebuilt_once_it_is_made_whole(tmp_path, tiny_qwen3):
    """Answers for 40 prompts leave a last shard of 8 with its features; answering 64 (the static index's way, no
    features) makes that shard whole, and pass 2 then rebuilds its features instead of keeping the 8."""
    target, drafter = tiny_qwen3
    taps_ids = drafter.config.target_layer_ids
    prompts = _prompts(2 * SHARD_SIZE, seed=3)
    tok, feat = tmp_path / "tokens", tmp_path / "features"
    assert generate_answer_shards(target, prompts[:SHARD_SIZE + 8], tok, feat, taps_ids, 4, batch_size=8) == 40
    assert generate_answer_shards(target, prompts, tok, None, None, 4, batch_size=8) == 2 * SHARD_SIZE
    assert feature_shards(target, tok, feat, taps_ids) == 2
    assert [s.index for s in load_shards(feat)] == [i for i, _ in prompts]


def test_the_static_index_never_answers_a_prompt_a_heldout_record_asks(tmp_path, tiny_qwen3, monkeypatch):
    """The split goes by record index, and some train records open with a prompt that a held-out record (what
    evaluation suites are drawn from) asks verbatim: their answers are generated with `train`'s shards but never
    indexed."""
    from dflash_export.recipes import TrainOptions
    from dflash_export.train import data, own_answers
    from dflash_export.train.sharegpt import sharegpt_conversations, sharegpt_prompts

    asked = {t for c in sharegpt_conversations("heldout") for _, t in c.messages[-1:]}
    train = sharegpt_prompts("train")
    leaked = [p.index for p in train if p.text in asked][:3]
    clean = [p.index for p in train if p.text not in asked][:3]
    assert len(leaked) == 3
    target, _ = tiny_qwen3
    ids = dict(zip(leaked + clean, (p for _, p in _prompts(6, seed=4))))
    order = [leaked[0], clean[0], leaked[1], clean[1], leaked[2], clean[2]]
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "sharegpt_prompt_ids", lambda *a, **k: [(i, ids[i]) for i in order])
    got = own_answers.static_index_answers(target, TrainOptions(prompts="sharegpt", max_new_tokens=5), 6)
    assert got == [ar_generate(target, ids[i], 5, stop_token_ids=target.stop_token_ids).tokens for i in clean]


def test_the_static_index_answers_the_prompts_as_the_recipe_templates_them_and_caches_them_apart(
        tmp_path, tiny_qwen3, monkeypatch):
    """`build`'s static index answers the recipe's training prompts chat-templated or not as its `chat_template`
    says (as `train` makes them, and as `run` encodes a prompt), and the answers of each setting are cached under
    their own name: the templated ones under the name they always had."""
    from dflash_export.recipes import TrainOptions
    from dflash_export.train import data, own_answers

    target, _ = tiny_qwen3
    prompts = {True: _prompts(3, seed=5), False: _prompts(3, seed=6)}
    asked = []

    def sharegpt_prompt_ids(*a, chat_template=True, **k):
        asked.append(chat_template)
        return prompts[chat_template]

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "sharegpt_prompt_ids", sharegpt_prompt_ids)
    monkeypatch.setattr("dflash_export.train.sharegpt.asking_heldout", lambda: set())
    for chat in (True, False):
        got = own_answers.static_index_answers(target, TrainOptions(prompts="sharegpt", max_new_tokens=4), 3,
                                               chat_template=chat)
        assert got == [ar_generate(target, ids, 4, stop_token_ids=target.stop_token_ids).tokens
                       for _, ids in prompts[chat]]
    assert asked == [True, False]
    made = sorted(re.sub(r"-[0-9a-f]{16}$", "", d.name) for d in (tmp_path / "cache" / "train-data").iterdir())
    assert made == ["sharegpt-s0-answers", "sharegpt-untemplated-s0-answers"]
