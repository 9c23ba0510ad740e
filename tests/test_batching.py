"""Batched ONNX Runtime engine and continuous batching: every sequence of a batch -- different prompt lengths,
different block lengths, joining and leaving between steps -- gets the PyTorch reference's greedy tokens and exactly
the tokens it gets run alone (as the engine's numerics probe states for this CPU: target_support.assert_as_plain);
batched logits and drafts match the reference / the unbatched graph."""

from __future__ import annotations

import time

import numpy as np
import pytest
from target_support import assert_as_plain, assert_transformers_greedy

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.ort_batch import BatchedOrtEngine
from dflash_export.errors import DFlashError
from dflash_export.runtime.batching import BatchingRuntime
from dflash_export.runtime.single import DFlashRuntime

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65],
           [3 + (i * 7) % 200 for i in range(150)], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]


@pytest.fixture(scope="module")
def built(ort_pair):
    recipe, _, eng, torch_eng = ort_pair
    return recipe, eng, torch_eng


@pytest.fixture(scope="module")
def reference(built):
    """Each prompt's greedy continuation, 64 tokens: plain decoding on the engine alone, held to the PyTorch reference
    target's greedy choice (fp32) with near-ties allowed either way (target_support.TIE: the tiny llama target's
    52nd token after [7] is one, 1.4e-4 apart)."""
    _, eng, torch_eng = built
    sp = SamplingParams(max_new_tokens=64)
    conts = [DFlashRuntime(eng).generate(p, sp, "ar").tokens for p in PROMPTS]
    for p, cont in zip(PROMPTS, conts):
        assert_transformers_greedy(torch_eng.target.hf, p, cont, eng.info.stop_token_ids, 64)
    return conts


def _reference_logits(torch_eng, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch_eng.target.hf(torch.tensor([ids])).logits[0].float().numpy()


def test_batched_prefill_and_verify_logits_match_the_reference(built, reference):
    """Prompts of 1..150 tokens prefilled in one call, then one call verifying blocks of 1..bs rows (the reference
    continuation): every real row's logits are the PyTorch target's at that position."""
    _, eng, torch_eng = built
    bs = eng.info.block_size
    batch = BatchedOrtEngine(eng, max_batch=len(PROMPTS))
    seqs = [batch.add(len(p) + 64 + bs) for p in PROMPTS]
    first = batch.prefill(seqs, PROMPTS)
    for p, row in zip(PROMPTS, first):
        ref = _reference_logits(torch_eng, p)[-1]
        np.testing.assert_allclose(row, ref, atol=1e-4)
        assert int(np.argmax(row)) == int(np.argmax(ref))
    blocks = [np.array(cont[: 1 + i % bs]) for i, cont in enumerate(reference)]  # 1..bs rows, mixed in one call
    got = batch.target_step(seqs, blocks)
    for p, blk, lg in zip(PROMPTS, blocks, got):
        # row i predicts the token after block[i]: the reference's position len(p) + i
        ref = _reference_logits(torch_eng, p + list(blk))[len(p): len(p) + len(blk)]
        np.testing.assert_allclose(lg, ref, atol=1e-4)
        assert (np.argmax(lg, -1) == np.argmax(ref, -1)).all()


def test_batched_drafts_equal_each_sequence_drafted_alone(built):
    """One drafter call over sequences whose cached context, new context and block lengths all differ (padded and
    masked by key_bias) drafts for each what the unbatched graph drafts for it alone, over two steps."""
    _, eng, _ = built
    assert eng.drafter_batches
    bs = eng.info.block_size
    sp = SamplingParams()
    prompts = PROMPTS[:4]
    lens2 = [bs - i % 3 for i in range(4)]
    batch = BatchedOrtEngine(eng, max_batch=4)
    seqs = [batch.add(len(p) + 64) for p in prompts]
    batch.prefill(seqs, prompts)
    r1 = batch.draft(seqs, [p[-1] for p in prompts], [sp] * 4, [None] * 4, [bs] * 4)
    conf1 = [s.draft_confidence for s in seqs]
    blocks = [np.array([p[-1], *d[: 1 + i]]) for i, (p, (d, _)) in enumerate(zip(prompts, r1))]
    batch.target_step(seqs, blocks)
    for i, seq in enumerate(seqs):  # commit 1 + i % 2 tokens: new context of different lengths
        batch.commit(seq, min(i % 2, len(blocks[i]) - 1))
    r2 = batch.draft(seqs, [5] * 4, [sp] * 4, [None] * 4, lens2)
    conf2 = [s.draft_confidence for s in seqs]
    for i, p in enumerate(prompts):  # the same two steps, alone
        s = eng.new_sequence(len(p) + 64)
        eng.prefill(s, np.array(p))
        d1, _ = eng.draft(s, p[-1], sp, None, block_len=bs)
        np.testing.assert_array_equal(r1[i][0], d1)
        np.testing.assert_allclose(conf1[i], s.draft_confidence, rtol=1e-5)
        _, ctx = eng._run_target(s, blocks[i], len(blocks[i]))
        keep = min(i % 2, len(blocks[i]) - 1) + 1
        s.ctx, s.ctx_pos = ctx[:, :keep], np.arange(s.length, s.length + keep, dtype=np.int64)[None]
        s.length += keep
        d2, _ = eng.draft(s, 5, sp, None, block_len=lens2[i])
        np.testing.assert_array_equal(r2[i][0], d2)
        np.testing.assert_allclose(conf2[i], s.draft_confidence, rtol=1e-5)


def _oracle_drafts(batch: BatchedOrtEngine, conts: dict, rng, confidence: float = 0.99):
    """Replace the batch's drafts by each sequence's reference continuation with one token corrupted at a random
    slot (the tiny drafter is random and rarely accepted): every accept length gets exercised."""
    true_draft = batch.draft

    def draft(seqs, anchors, sps, uniforms, block_lens):
        out = true_draft(seqs, anchors, sps, uniforms, block_lens)  # keeps the drafter's context cache in step
        fixed = []
        for seq, (d, p), bl in zip(seqs, out, block_lens):
            cont, n_prompt = conts[id(seq)]
            done = seq.length - n_prompt + 1
            d = np.array((list(cont[done: done + bl - 1]) + [0] * bl)[: bl - 1], np.int64)
            k = int(rng.integers(0, bl))
            if k < bl - 1:
                d[k] = (d[k] + 1) % batch.info.vocab_size
            if seq.draft_confidence is not None:
                seq.draft_confidence = np.full(bl - 1, confidence)
            fixed.append((d, p))
        return fixed

    batch.draft = draft


@pytest.mark.parametrize("adaptive", [True, False])
def test_continuous_batching_greedy_tokens_equal_reference_and_alone(built, reference, adaptive):
    """Six requests through a batch of at most 3 (they join and leave between steps), drafts that are accepted at
    every length: each request's tokens are the reference's and those of the request run alone."""
    _, eng, _ = built
    rng = np.random.default_rng(0)
    max_new = [64, 40, 64, 17, 64, 33]
    sps = [SamplingParams(max_new_tokens=n) for n in max_new]
    rt = BatchingRuntime(eng, max_batch=3, adaptive=adaptive)
    conts = {}
    true_add = rt.batch.add

    def add(max_tokens, _prompts=iter(PROMPTS), _refs=iter(reference)):
        seq = true_add(max_tokens)
        p = next(_prompts)
        conts[id(seq)] = (next(_refs), len(p))
        return seq

    rt.batch.add = add
    _oracle_drafts(rt.batch, conts, rng)
    widths = []
    reqs = [rt.submit(p, sp) for p, sp in zip(PROMPTS, sps)]
    while not rt.idle:
        rt.step()
        widths.append(len(rt.active))
        assert len(rt.active) <= 3
    assert max(widths) == 3 and rt.batch.kv_bytes == 0  # an idle engine holds no K/V
    single = DFlashRuntime(eng)
    for req, ref, sp, p in zip(reqs, reference, sps, PROMPTS):
        assert_as_plain(eng, p, req.stats.tokens, ref[: sp.max_new_tokens])
        assert_as_plain(eng, p, req.stats.tokens, single.generate(p, sp).tokens)
    assert max(max(r.stats.acceptance_lengths) for r in reqs) > 2


@pytest.mark.parametrize("proposer", ["lookup", "tree+lookup"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_batched_lookup_branches_decode_as_the_reference(built, reference, proposer, adaptive):
    """Greedy requests whose steps propose the context's lookup branches (merged with the drafter's block for
    tree+lookup) in a batch of at most 3, a sampled one beside them: greedy tokens are the reference's, lookups get
    accepted on the repetitive prompts, sampled tokens are plain sampling's of the request alone. The costs stay the
    recorded ones: fitted from the tiny model's call times, which a loaded machine stretches, they could price every
    lookup row out (seen once in a fresh clone's run)."""
    _, eng, _ = built
    rt = BatchingRuntime(eng, max_batch=3, adaptive=adaptive, proposer=proposer, fit_costs=False)
    sps = [SamplingParams(max_new_tokens=48) for _ in PROMPTS]
    sps[2] = SamplingParams(max_new_tokens=24, temperature=0.8, seed=3)
    reqs = [rt.submit(p, sp) for p, sp in zip(PROMPTS, sps)]
    while not rt.idle:
        rt.step()
    for i, (req, ref, sp) in enumerate(zip(reqs, reference, sps)):
        want = ref[:48] if sp.greedy else DFlashRuntime(eng).generate(PROMPTS[i], sp, "ar").tokens
        assert_as_plain(eng, PROMPTS[i], req.stats.tokens, want, sp)
    # lookups accepted somewhere by the greedy requests
    assert max(max(r.stats.acceptance_lengths) for r, sp in zip(reqs, sps) if sp.greedy) > 1
    assert rt.a == rt.a_recorded and rt.costs.rows.line() is None  # nothing fitted


def test_continuous_batching_mixed_modes_and_plain(built, reference):
    """DFlash, plain decoding and sampled requests in one batch (with the real, random drafter)."""
    _, eng, _ = built
    single = DFlashRuntime(eng)
    rt = BatchingRuntime(eng, max_batch=4)
    jobs = [(p, SamplingParams(max_new_tokens=30), m) for p, m in zip(PROMPTS, ["dflash", "ar"] * 3)]
    jobs += [(PROMPTS[i], SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=i), m)
             for i, m in ((0, "dflash"), (1, "ar"), (3, "dflash"))]
    reqs = [rt.submit(p, sp, m) for p, sp, m in jobs]
    while not rt.idle:
        rt.step()
    for req, (p, sp, m) in zip(reqs, jobs):
        alone = single.generate(p, sp, m)
        assert_as_plain(eng, p, req.stats.tokens, alone.tokens, sp)
        if sp.greedy:
            assert_as_plain(eng, p, req.stats.tokens, reference[PROMPTS.index(p)][:30])


def test_bounds_cancel_and_bad_requests(built):
    _, eng, _ = built
    rt = BatchingRuntime(eng, max_batch=2, max_queued_tokens=40)
    rt.submit(PROMPTS[1], SamplingParams(max_new_tokens=8))  # 31 tokens queued
    with pytest.raises(DFlashError) as e:
        rt.submit(PROMPTS[3], SamplingParams(max_new_tokens=8))  # +8 fits, then +31 does not
        rt.submit(PROMPTS[1], SamplingParams(max_new_tokens=8))
    assert e.value.field == "max_queued_tokens"
    for bad, fld in (([], "text_input"), ([eng.info.vocab_size], "input_ids")):
        with pytest.raises(DFlashError) as e:
            rt.submit(bad, SamplingParams())
        assert e.value.field == fld
    with pytest.raises(DFlashError) as e:
        rt.submit([1], SamplingParams(max_new_tokens=eng.info.max_seq_len))
    assert e.value.field == "max_tokens"
    c = rt.submit([5], SamplingParams(max_new_tokens=50))
    rt.step()
    assert len(rt.active) == 2
    rt.cancel(rt.active[0].req)
    rt.step()
    while not rt.idle:
        rt.step()
    assert c.done and rt.batch.kv_bytes == 0
    with pytest.raises(DFlashError) as e:
        BatchingRuntime(eng, max_batch=0)
    assert e.value.field == "max_batch"


def test_scheduler_verifies_less_as_load_grows(built):
    """The rule in closed form: each sequence verifies draft k while q[b,k] >= rate * a (its rows are packed: they
    cost the others nothing). One sequence: the single runtime's verify_length; many sequences at a plain-decoding
    rate: fewer; at twice that rate: none (plain batched decoding)."""
    from dflash_export.decoding.sampling import verify_length
    from dflash_export.runtime.batching import _Active

    _, eng, _ = built
    bs = eng.info.block_size
    rt = BatchingRuntime(eng)
    conf = np.array([0.9, 0.8, 0.7, 0.5, 0.9, 0.9, 0.9][: bs - 1])

    def acts(n):
        out = []
        for _ in range(n):
            a = _Active.__new__(_Active)
            a.req = type("R", (), {"sp": SamplingParams(max_new_tokens=100)})()
            a.emit, a.block_len = type("E", (), {"produced": 0})(), bs  # nothing produced yet
            a.seq = type("S", (), {"draft_confidence": conf})()
            a.spine_scores = None  # no lookup branch: the drafter's confidences decide
            a.whole = None  # a chain, no whole tree
            out.append(a)
        return out

    for rate in (0.5, 1.0, 2.0, 5.0):
        rt.rate = rate
        one = acts(1)
        assert rt._choose_step(one, one, 0.0) == [1 + verify_length(conf, rate * rt.a)]
    rt.rate = 1.0
    one = acts(1)
    [alone] = rt._choose_step(one, one, 0.0)
    many = acts(16)
    rt.rate = 16 / (1 + rt.a * 15)  # what plain decoding of 16 sequences yields per unit of cost
    rows = rt._choose_step(many, many, 0.0)
    assert rows == [1 + verify_length(conf, rt.rate * rt.a)] * 16 and 1 < rows[0] < alone
    rt.rate = 1 / rt.a  # a bar of 1: no draft is that sure
    assert rt._choose_step(many, many, 0.0) == [1] * 16


def test_probes_back_off_while_drafting_does_not_pay(built, reference):
    """While drafting does not pay, one sequence probes after 8 plain steps, then after 16, 32, 64, 64, ...: over 130
    steps of two requests that is 4 probes (steps 8, 24, 56, 120), not 16; the tokens stay the reference's."""
    _, eng, _ = built
    rt = BatchingRuntime(eng, max_batch=2, max_skip=7)
    rt._drafting_pays = lambda b: False
    sp = SamplingParams(max_new_tokens=160, stop_token_ids=[])  # both stay in the batch for the 130 steps
    reqs = [rt.submit(p, sp) for p in PROMPTS[:2]]
    for _ in range(130):
        rt.step()
        assert len(rt.active) == 2
    assert rt.probes == 4
    for req, ref, p in zip(reqs, reference[:2], PROMPTS):
        n = min(len(ref), len(req.stats.tokens))
        assert_as_plain(eng, p, req.stats.tokens[:n], ref[:n])


def test_when_drafting_does_not_pay_a_dflash_batch_does_plain_decodings_work_plus_its_probes(built, reference):
    """"Never worse than plain batched decoding", counted rather than timed: with drafting unprofitable for the
    batch, DFlash requests make exactly the target calls plain decoding makes for the same load (same calls, same
    rows), and the only extra work is one single-sequence drafter call per probe -- 4 probes in 130 steps (steps 8,
    24, 56, 120 of the back-off), so the cost model's total exceeds plain decoding's by 4 draft costs, no more."""
    _, eng, _ = built
    sp = SamplingParams(max_new_tokens=160, stop_token_ids=[])
    work = {}
    for mode in ("dflash", "ar"):
        rt = BatchingRuntime(eng, max_batch=3, max_skip=7)
        rt._drafting_pays = lambda b: False
        reqs = [rt.submit(p, sp, mode) for p in PROMPTS[:3]]
        for _ in range(130):
            rt.step()
        for req, ref, p in zip(reqs, reference[:3], PROMPTS):
            n = min(len(ref), len(req.stats.tokens))
            assert_as_plain(eng, p, req.stats.tokens[:n], ref[:n])
        work[mode] = rt
    d, a = work["dflash"], work["ar"]
    assert (d.steps, d.target_rows) == (a.steps, a.target_rows) == (130, 130 * 3)
    assert (d.draft_calls, d.draft_seqs, d.probes) == (4, 4, 4) and (a.draft_calls, a.draft_seqs) == (0, 0)
    assert d.modelled_cost - a.modelled_cost == pytest.approx(4 * d.draft_cost)


def test_engines_without_the_batch_graph_verify_one_sequence_per_call(built, reference, monkeypatch):
    """Engines built before target_batch.onnx: many-row blocks run one sequence per GQA call, same tokens."""
    _, eng, _ = built
    monkeypatch.setattr(type(eng), "batch_target_session", lambda self: None)
    rt = BatchingRuntime(eng, max_batch=4, adaptive=False)
    got = rt.generate_many(PROMPTS, SamplingParams(max_new_tokens=40))
    for g, r, p in zip(got, reference, PROMPTS):
        assert_as_plain(eng, p, g.tokens, r[:40])


def test_service_shares_one_batch_between_threads_and_frees_a_dropped_request(built, reference):
    import threading

    from dflash_export.runtime.batching import BatchingService

    _, eng, _ = built
    svc = BatchingService(eng, max_batch=3, idle_release_s=0.2)
    got, errors = {}, []

    def client(i):
        try:
            got[i] = [t for ev in svc.stream(PROMPTS[i], SamplingParams(max_new_tokens=30)) for t in ev.tokens]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and sorted(got) == list(range(len(PROMPTS)))
        for i, r in enumerate(reference):
            assert_as_plain(eng, PROMPTS[i], got[i], r[:30])
        dropped = svc.stream(PROMPTS[4], SamplingParams(max_new_tokens=60))
        next(dropped)
        dropped.close()  # the consumer went away: cancelled at the next step boundary
        assert_as_plain(eng, PROMPTS[0], [t for ev in svc.stream(PROMPTS[0], SamplingParams(max_new_tokens=5))
                                          for t in ev.tokens], reference[0][:5])
        assert not svc.runtime.active
        deadline = time.monotonic() + 30  # the K/V buffers outlive the last request until the batch idles 0.2 s
        while svc.runtime.batch.kv_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.runtime.batch.kv_bytes == 0
    finally:
        svc.close()


def test_kv_buffers_are_reported_at_every_resize_and_freed_when_the_batch_empties(built):
    """What the served model logs (`dflash-kv:` lines, benchmarks/soak.py): every reallocation with its size, the
    target part equal to the closed form slots x capacity x layers x 2 x kv_heads x head_dim x 4 bytes of the
    target's own config, and 0 once the last sequence leaves."""
    _, eng, torch_eng = built
    cfg = torch_eng.target.hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    seen = []
    batch = BatchedOrtEngine(eng, max_batch=4)
    batch.on_resize = lambda nbytes, slots, cap: seen.append((nbytes, slots, cap))
    seqs = [batch.add(40), batch.add(90)]
    batch.prefill(seqs, [[1, 2, 3], [4, 5, 6, 7]])
    batch.draft(seqs, [3, 7], [SamplingParams()] * 2, [None] * 2, [eng.info.block_size] * 2)
    assert len(seen) >= 2 and seen[-1][0] == batch.kv_bytes  # the target's buffers, then the drafter's
    nbytes, slots, cap = seen[-1]
    target_part = sum(b.nbytes for b in batch._buf.t_kv)
    # capacity: the longest prompt (4 rows, not the reservations of 40 and 90) rounded up to the 64 keys the batched
    # attention's lanes need
    assert (slots, cap) == (2, 64) and target_part == slots * cap * per_token and nbytes > target_part
    for s in list(seqs):
        batch.remove(s)
    assert seen[-1] == (0, 0, 0) and batch.kv_bytes == 0
    # a server's batch keeps them across an empty moment (reused, not reallocated) until it releases them
    batch.keep_buffers = True
    s = batch.add(90)
    batch.prefill([s], [[1, 2, 3]])
    held, n_events = batch.kv_bytes, len(seen)
    batch.remove(s)
    s = batch.add(60)
    assert batch.kv_bytes == held and len(seen) == n_events and s.slot == 0
    batch.remove(s)
    batch.release()
    assert seen[-1] == (0, 0, 0) and batch.kv_bytes == 0


def test_the_buffers_hold_the_rows_the_sequences_reached_not_the_rows_they_may_reach(built, reference):
    """Every call of a batch attends over its buffers' whole length, so they follow the sequences: a request that may
    run to max_seq_len (a chat request without max_tokens) takes no more rows than its prompt and a step need, grows
    them by at most 64 rows past what a step needs as it goes, and once the longest sequence leaves the rest get
    shorter buffers back; every request's tokens are still those it gets alone."""
    _, eng, _ = built
    bs, align = eng.info.block_size, BatchedOrtEngine.key_align
    caps = []
    rt = BatchingRuntime(eng, max_batch=2)
    rt.batch.on_resize = lambda nbytes, slots, cap: caps.append(cap)
    short_p, long_p = PROMPTS[0], PROMPTS[4]  # 5 and 150 tokens
    long_sp = SamplingParams(max_new_tokens=min(64, eng.info.max_seq_len - len(long_p) - bs))
    short_sp = SamplingParams(max_new_tokens=eng.info.max_seq_len - len(short_p) - bs)  # may fill the engine
    short = rt.submit(short_p, short_sp)
    rt.step()
    assert rt.batch._buf.t_cap == align  # the prompt and a block, not max_seq_len
    long = rt.submit(long_p, long_sp)
    while not long.done:
        rt.step()
        assert rt.batch._buf.t_cap < max(a.seq.length for a in rt.active) + bs + 64
    grown = max(caps)
    assert grown >= len(long_p) + long_sp.max_new_tokens  # the long request's rows were there while it ran
    assert rt.batch._buf.t_cap < grown  # and given back once it left, the short one still running
    for _ in range(8):
        rt.step()
    rt.cancel(short)
    rt.step()
    single = DFlashRuntime(eng)
    assert_as_plain(eng, long_p, long.stats.tokens, single.generate(long_p, long_sp).tokens)
    got = short.stats.tokens
    assert_as_plain(eng, short_p, got, single.generate(short_p, SamplingParams(max_new_tokens=len(got))).tokens)


def test_steps_at_the_buffers_end_run_padded_to_the_row_floor(built, monkeypatch):
    """The buffers hold the rows the sequences reached, so a one-token step may find only its own row left before
    their end: they grow by the padding rows too, and every step runs at least the engine's row floor (its kernels'
    path, which plain steps of the engine alone take: docs/numerics.md), whatever the buffers' length."""
    _, eng, _ = built
    monkeypatch.setattr(eng, "row_floor", max(2, eng.row_floor))
    batch = BatchedOrtEngine(eng, max_batch=2)
    calls, real = [], batch.graphs.target_batch

    def spy(feeds, past):
        calls.append((int(feeds["position_ids"][0, 0]), feeds["grid_rows"].shape[1], past[0].shape[2]))
        return real(feeds, past)

    monkeypatch.setattr(batch.graphs, "target_batch", spy)
    prompt = [3 + (i * 7) % 200 for i in range(60)]
    seq = batch.add(len(prompt) + 80 + eng.info.block_size)
    logits = batch.prefill([seq], [prompt])[0]
    for _ in range(80):  # past two key_align boundaries (64, 128)
        logits = batch.target_step([seq], [[int(np.argmax(logits))]])[0][-1]
        batch.commit(seq, 0)
    # the prefill ran the engine's own graph: the calls are the 80 steps
    assert len(calls) == 80 and {cap for _, _, cap in calls} >= {64, 128}
    assert all(rows >= eng.row_floor for _, rows, _ in calls), [c for c in calls if c[1] < eng.row_floor]


def test_requests_from_other_threads_join_the_running_batch_at_the_next_step(built, reference):
    """A request submitted while another is being decoded joins at the next step boundary: it waits neither for the
    running request to finish nor for the scheduler to let go of a lock (one held through every step and retaken at
    once starved the submitting threads: they got in after tens of steps, or after the running request ended)."""
    import threading

    from dflash_export.runtime.batching import BatchingService

    _, eng, _ = built
    svc = BatchingService(eng, max_batch=4)
    step = svc.runtime.batch.target_step

    def slow_step(*a, **k):  # ~30 ms a step, as a real model's: the long request lasts seconds
        time.sleep(0.03)
        return step(*a, **k)

    svc.runtime.batch.target_step = slow_step
    started, stop, long_tokens, got, waited = threading.Event(), threading.Event(), [], {}, {}

    def long_client():
        for ev in svc.stream(PROMPTS[0], SamplingParams(max_new_tokens=400, stop_token_ids=[]), mode="ar"):
            long_tokens.extend(ev.tokens)
            started.set()
            if stop.is_set():
                return

    def short_client(i):
        at = svc.runtime.steps
        got[i] = []
        for ev in svc.stream(PROMPTS[i], SamplingParams(max_new_tokens=6)):
            if not got[i]:
                waited[i] = svc.runtime.steps - at  # steps the running batch made before this request's first token
            got[i].extend(ev.tokens)

    try:
        runner = threading.Thread(target=long_client, daemon=True)
        runner.start()
        assert started.wait(60)
        shorts = [threading.Thread(target=short_client, args=(i,), daemon=True) for i in (1, 2, 3)]
        for t in shorts:
            t.start()
        for t in shorts:
            t.join(timeout=60)
        still_running = runner.is_alive() and len(long_tokens) < 400
        stop.set()
        runner.join(timeout=60)
        assert still_running, "the short requests waited for the long one to finish"
        assert max(waited.values()) <= 3, waited
        for i in (1, 2, 3):
            assert_as_plain(eng, PROMPTS[i], got[i], reference[i][:6])
    finally:
        stop.set()
        svc.close()


def test_a_served_answers_stats_carry_its_batchs_kv_bound_and_its_wait_to_join(built):
    """The model's last answer (deploy/handler.py step_stats, which the front's /metrics reads) says the K/V bound of
    the shared batch the request ran in and the seconds it waited to join it, here behind a request that held the
    bound's cells."""
    from dflash_export.deploy.handler import GenerateRequest, RequestRunner, generate_text
    from dflash_export.runtime.batching import BatchingService

    _, eng, _ = built
    align = BatchedOrtEngine.key_align
    svc = BatchingService(eng, max_batch=2, max_kv_tokens=align)  # one short request at a time
    step = svc.runtime.batch.target_step

    def slow_step(*a, **k):  # 10 ms a step: the first request holds the bound for 0.3 s at least
        time.sleep(0.01)
        return step(*a, **k)

    svc.runtime.batch.target_step = slow_step
    try:
        runner = RequestRunner(svc)
        first = svc.stream(PROMPTS[0], SamplingParams(max_new_tokens=30, stop_token_ids=[]), mode="ar")
        next(first)  # joined: the next request waits for it to finish
        out = generate_text(runner, GenerateRequest("hello", SamplingParams(max_new_tokens=6), chat=False))
        assert sum(len(ev.tokens) for ev in first) == 29
        stats = out.step_stats
        assert stats["kv_token_limit"] == align and stats["admission_wait_s"] >= 0.2, stats
    finally:
        svc.close()


def test_a_service_loads_the_batched_verify_graph_before_its_first_request(built):
    """Served memory is all there once the model is ready (benchmarks/soak.py takes the idle RSS then)."""
    from dflash_export.engines.registry import load_engine
    from dflash_export.runtime.batching import BatchingService

    _, eng, _ = built
    fresh = load_engine(eng.engine_dir, threads=1)
    assert fresh._target_batch is None  # a single-request engine never loads it
    svc = BatchingService(fresh, max_batch=2)
    try:
        assert fresh._target_batch is not None and not svc.runtime.active
    finally:
        svc.close()


def test_an_engine_failure_ends_the_running_and_queued_requests_and_the_service_goes_on(built, reference):
    """A step that raises ends every request then in the batch or waiting to join with that error (each consumer's
    `stream` raises it); the queue's tokens are given back, and the next request runs on a fresh batch, correctly."""
    import threading

    from dflash_export.runtime.batching import BatchingService

    _, eng, _ = built
    svc = BatchingService(eng, max_batch=1)
    gate, failed = threading.Event(), []

    def failing_step(*a, **k):
        gate.wait(30)  # until the second request is queued behind the first
        raise RuntimeError("device lost")

    svc.runtime.batch.target_step = failing_step

    def client(i):
        try:
            list(svc.stream(PROMPTS[i], SamplingParams(max_new_tokens=8)))
        except RuntimeError as e:
            failed.append((i, str(e)))

    try:
        first = threading.Thread(target=client, args=(0,), daemon=True)
        first.start()
        deadline = time.monotonic() + 30
        while not svc.runtime.active and time.monotonic() < deadline:
            time.sleep(0.01)
        second = threading.Thread(target=client, args=(1,), daemon=True)
        second.start()
        while not svc.runtime.queue and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        first.join(30)
        second.join(30)
        assert sorted(failed) == [(0, "device lost"), (1, "device lost")]
        assert not svc.runtime.queue and svc.runtime.queued_tokens == 0 and not svc.runtime.active
        assert svc.runtime.batch.target_step is not failing_step  # a fresh batch
        got = [t for ev in svc.stream(PROMPTS[2], SamplingParams(max_new_tokens=6)) for t in ev.tokens]
        assert_as_plain(eng, PROMPTS[2], got, reference[2][:6])
    finally:
        gate.set()
        svc.close()


@pytest.mark.parametrize("with_stop", [True, False], ids=["stop-check", "reader-only"])
def test_a_stop_check_drops_a_running_request_at_the_next_step_however_far_its_reader_trails(built, with_stop):
    """A request cancelled while its reader spends 0.2 s over its last event, the batch stepping on: with its stop check
    (`RequestRunner.run(stopped=...)`), the batch commits at most one more step for it (the one it was in, counted
    from the request's own statistics) and the reader's next event ends its stream with RequestCancelled naming why;
    with only the reader's check between events, the batch runs on for as long as the reader trails."""
    import threading

    from dflash_export.deploy.handler import GenerateRequest, RequestCancelled, RequestRunner
    from dflash_export.runtime.batching import BatchingService
    from dflash_export.runtime.single import RunStats

    _, eng, _ = built
    svc = BatchingService(eng, max_batch=2)
    gone = threading.Event()
    stats = RunStats()

    def cancelled(queued: bool = False):
        return "the client went away" if gone.is_set() else None

    try:
        req = GenerateRequest("", SamplingParams(max_new_tokens=400, stop_token_ids=[]), ids=[7, 8, 9])
        chunks = RequestRunner(svc, mode="ar").run(req, cancelled, stats, gone.is_set if with_stop else None)
        next(chunks)
        next(chunks)
        gone.set()
        committed = len(stats.acceptance_lengths)
        time.sleep(0.2)  # the reader busy with the last chunk (a slow client)
        with pytest.raises(RequestCancelled, match="the client went away"):
            next(chunks)
        after = len(stats.acceptance_lengths) - committed
        assert after <= 1 if with_stop else after > 1, after
    finally:
        svc.close()


def test_a_request_cancelled_while_queued_leaves_without_a_prefill(built):
    """A request waiting to join a full batch whose client goes away leaves the queue at the next poll: its stream
    ends, the Triton handler raises RequestCancelled with the reason, and the batch never prefills it."""
    import threading

    from dflash_export.deploy.handler import GenerateRequest, RequestCancelled, RequestRunner
    from dflash_export.runtime.batching import BatchingService

    _, eng, _ = built
    svc = BatchingService(eng, max_batch=1)
    batch = svc.runtime.batch
    step, prefill, prefilled = batch.target_step, batch.prefill, []

    def slow_step(*a, **k):
        time.sleep(0.03)
        return step(*a, **k)

    def counting_prefill(seqs, prompts):
        prefilled.extend(prompts)
        return prefill(seqs, prompts)

    batch.target_step, batch.prefill = slow_step, counting_prefill
    stop, gone, asked = threading.Event(), threading.Event(), []

    def long_client():
        for _ in svc.stream(PROMPTS[0], SamplingParams(max_new_tokens=400, stop_token_ids=[]), mode="ar"):
            if stop.is_set():
                return

    def cancelled(queued: bool = False):
        asked.append(queued)
        return "the client went away" if gone.is_set() else None

    try:
        runner = threading.Thread(target=long_client, daemon=True)
        runner.start()
        deadline = time.monotonic() + 30
        while not prefilled and time.monotonic() < deadline:
            time.sleep(0.01)
        req = GenerateRequest("Hello there", SamplingParams(max_new_tokens=6))
        outcome = []

        def queued_client():
            try:
                outcome.extend(RequestRunner(svc).run(req, cancelled))
            except RequestCancelled as e:
                outcome.append(e)

        waiting = threading.Thread(target=queued_client, daemon=True)
        waiting.start()
        while not svc.runtime.queue and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # several polls while queued
        gone.set()
        waiting.join(10)
        assert not waiting.is_alive() and runner.is_alive()  # out while the long request still runs
        assert len(outcome) == 1 and isinstance(outcome[0], RequestCancelled), outcome
        assert "went away" in str(outcome[0]) and True in asked
        assert not svc.runtime.queue and svc.runtime.queued_tokens == 0  # out of the queue bound at once
        stop.set()
        runner.join(30)
        deadline = time.monotonic() + 10
        while svc.runtime.queue and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(prefilled) == 1  # the long request's prompt: the cancelled one was never prefilled
    finally:
        stop.set()
        svc.close()


@pytest.mark.parametrize("proposer", ["chain", "tree+lookup"])
def test_sampled_requests_in_a_batch_are_plain_sampling_draw_for_draw(built, proposer):
    """Sampled requests that walk (T 0.7 and 1.0, with and without top-k / top-p) beside greedy ones, under the
    batch's cost model: each emits what plain sampled decoding of the request alone emits with the same seed; the
    drafter's own sampled chain ("chain") stays the single-stream runtime's, draw for draw."""
    _, eng, _ = built
    settings = [(0.7, 0, 1.0), (1.0, 20, 0.95), (0.7, 20, 0.95), (1.0, 0, 1.0)]
    for sampling in ("walk", "chain"):
        rt = BatchingRuntime(eng, max_batch=4, proposer=proposer, sampling=sampling)
        jobs = [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=32, temperature=t, top_k=k, top_p=p, seed=i))
                for i, (t, k, p) in enumerate(settings)]
        jobs.append((PROMPTS[4], SamplingParams(max_new_tokens=32)))
        reqs = [rt.submit(p, sp) for p, sp in jobs]
        while not rt.idle:
            rt.step()
        single = DFlashRuntime(eng, proposer=proposer, sampling=sampling)
        for req, (p, sp) in zip(reqs, jobs):
            want = single.generate(p, sp, "ar" if sampling == "walk" else "dflash").tokens
            assert_as_plain(eng, p, req.stats.tokens, want, sp)
        assert all(r.stats.verify_s > 0 for r in reqs) and sum(r.stats.draft_s for r in reqs) > 0


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("proposer, sampling", [("chain", "walk"), ("tree+lookup", "walk"), ("chain", "chain")])
def test_sampled_requests_at_a_temperature_near_zero_decode_as_greedy(built, reference, proposer, sampling):
    """T -> 0 in a batch (T 1e-310 or 5e-324: logits / T overflows float64, the tempered drafter scores float32):
    every request gets the reference's greedy tokens, DFlash and plain alike."""
    _, eng, _ = built
    settings = [(1e-310, 0, 1.0), (5e-324, 20, 0.95), (1e-40, 0, 0.5)]
    sps = [SamplingParams(max_new_tokens=32, temperature=t, top_k=k, top_p=p, seed=i)
           for i, (t, k, p) in enumerate(settings)]
    for mode in ("dflash", "ar"):
        rt = BatchingRuntime(eng, max_batch=4, proposer=proposer, sampling=sampling)
        for stats, want, sp, p in zip(rt.generate_many(PROMPTS[:3], sps, mode), reference, sps, PROMPTS):
            assert_as_plain(eng, p, stats.tokens, want[:32], sp)


def test_the_row_cost_is_fitted_from_the_target_calls_within_a_span_of_the_recorded_one(built):
    """Target calls timed as 1 + x r seconds (r rows) fit a = x / (1 + x), a row's cost against a one-row call:
    taken above the recorded cost (x = 0.2) and below it down to a quarter of it (x = 0.04 against the recorded
    0.07: a batch's packed rows are cheaper than a single sequence's verify rows on int4); calls whose rows cost
    next to nothing leave a quarter of the recorded cost, not zero."""
    _, eng, _ = built

    def fitted(x):
        rt = BatchingRuntime(eng, max_batch=4)
        for i in range(40):
            r = 1 + i % 6
            rt._learn_row_cost(r, 1.0 + x * r)
        return rt

    assert fitted(0.2).a == pytest.approx(0.2 / 1.2)
    below = fitted(0.04)
    assert below.a_recorded > 0.04 / 1.04 > below.a_recorded / 4
    assert below.a == pytest.approx(0.04 / 1.04)
    cheap = fitted(0.001)
    assert cheap.a == pytest.approx(cheap.a_recorded / 4)


def test_the_draft_cost_is_priced_in_the_row_fits_unit(built):
    """A batch's target calls timed 1.6 + 0.08 r seconds (r rows: a batch whose one-row call, c0 + c1 = 1.68 s,
    carries its sequences' cost) and its drafts of B_d sequences 0.3 (1 + DRAFT_ROW_COST (B_d - 1)) seconds: the
    drafter costs 0.3 / 1.68 of the fit's unit, the unit its rows are priced in (a = 0.08 / 1.68); drafts timed
    next to nothing leave a quarter of the recorded cost; before the fit has a line, the recorded cost."""
    from dflash_export.runtime.batching import DRAFT_ROW_COST
    _, eng, _ = built
    rt = BatchingRuntime(eng, max_batch=4)
    recorded = rt.draft_cost_recorded
    for i in range(6):  # no line yet: the recorded cost
        rt._learn_draft_cost(1 + i % 3, 0.3 * (1 + DRAFT_ROW_COST * (i % 3)))
        rt._learn_row_cost(8 + i % 5, 1.6 + 0.08 * (8 + i % 5))
    assert rt.draft_cost == recorded
    for i in range(60):
        rt._learn_draft_cost(1 + i % 3, 0.3 * (1 + DRAFT_ROW_COST * (i % 3)))
        rt._learn_row_cost(8 + i % 5, 1.6 + 0.08 * (8 + i % 5))
    assert rt.a == pytest.approx(0.08 / 1.68)
    assert rt.draft_cost == pytest.approx(0.3 / 1.68)
    for _ in range(200):
        rt._learn_draft_cost(8, 1e-6)
    assert rt.draft_cost == pytest.approx(recorded / 4)


@pytest.mark.parametrize("proposer, adaptive", [("tree+lookup", False), ("tree+lookup", True), ("tree", False)])
def test_whole_trees_in_a_batch_decode_as_plain_decoding(built, reference, proposer, adaptive):
    """tree_mode "full": greedy and walked sampled requests verify whole trees (the drafter's top-K and the context's
    lookups) beside plain ones, several sequences per target call, each block its own tree (positions length + depth,
    ancestor-only bias), the accepted path's K/V kept in place. Greedy tokens are the PyTorch reference's, plain
    batched decoding's and single-stream plain decoding's; sampled ones are plain sampling's with the same seed; some
    accepted paths leave the tree's first branch, so the K/V move and the mask are exercised (every node verified;
    under the cost model the random drafter's nodes rarely pay, and the tokens are the same)."""
    _, eng, _ = built
    rt = BatchingRuntime(eng, max_batch=4, proposer=proposer, tree_mode="full", adaptive=adaptive)
    assert rt.batch.verifies_trees(4)
    paths, tree_calls = [], []
    commit, target_step = rt.batch.commit, rt.batch.target_step

    def spy_commit(seq, accept, path=None):
        paths.append(path)
        return commit(seq, accept, path)

    def spy_target_step(seqs, blocks, trees=None, greedy=None):
        tree_calls.append(sum(t is not None and not t.is_chain for t in trees or []))
        return target_step(seqs, blocks, trees, greedy)

    rt.batch.commit, rt.batch.target_step = spy_commit, spy_target_step
    jobs = [(p, SamplingParams(max_new_tokens=40), "dflash") for p in PROMPTS]
    jobs[1] = (PROMPTS[1], SamplingParams(max_new_tokens=40), "ar")
    jobs += [(PROMPTS[3], SamplingParams(max_new_tokens=32, temperature=0.7, seed=5), "dflash"),
             (PROMPTS[4], SamplingParams(max_new_tokens=32, temperature=1.0, top_k=20, top_p=0.95, seed=6), "dflash")]
    reqs = [rt.submit(p, sp, m) for p, sp, m in jobs]
    while not rt.idle:
        rt.step()
    plain = BatchingRuntime(eng, max_batch=4)
    plain_reqs = [plain.submit(p, sp, "ar") for p, sp, _ in jobs]
    while not plain.idle:
        plain.step()
    single = DFlashRuntime(eng)
    for req, plain_req, (p, sp, _) in zip(reqs, plain_reqs, jobs):
        want = single.generate(p, sp, "ar").tokens
        assert_as_plain(eng, p, req.stats.tokens, want, sp)
        assert_as_plain(eng, p, plain_req.stats.tokens, want, sp)
        if sp.greedy:
            assert_as_plain(eng, p, req.stats.tokens, reference[PROMPTS.index(p)][:40])
    if adaptive:
        return
    assert rt.trees_verified > 0 and max(tree_calls) >= 2  # trees of several sequences in one call
    if proposer == "tree":  # the drafter's top-K alone (a random drafter: its accepted paths stay short)
        return
    off_first = [q for q in paths if q is not None and q != list(range(len(q)))]
    assert off_first, "no accepted path left the tree's first branch"


def test_the_served_kv_bound_defaults_to_what_the_available_memory_holds_and_the_note_says_it(built):
    """deploy / serve bound each instance's shared batch by K/V tokens: by default the tokens whose K/V and context
    features waiting for the drafter (per-token size computed from the HF configs, held against the buffers a full
    batch really takes) fit in half of the memory available, shared by the instances, at most a full batch of
    full-length sequences; the note says it."""
    from dflash_export.deploy.kv_memory import default_kv_tokens, kv_reservation_bytes
    from dflash_export.deploy.repository import kv_memory_note
    from dflash_export.engines.manifest import read_manifest

    _, eng, torch_eng = built

    def per_token(cfg):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4

    t_token = per_token(torch_eng.target.hf.config)
    d_token = per_token(torch_eng.drafter.config) + 4 * torch_eng.drafter.config.hidden_size  # + a feature row
    manifest = read_manifest(eng.engine_dir, verify_files=False)
    L = eng.info.max_seq_len
    bound = kv_reservation_bytes(manifest, 4)
    assert bound == 4 * L * (t_token + d_token)
    batch = BatchedOrtEngine(eng, max_batch=4)
    seqs = [batch.add(L) for _ in range(4)]
    long = [3 + (i * 7) % 200 for i in range(L - eng.info.block_size)]  # the buffers follow the sequences' rows:
    assert batch.aligned(len(long)) == L                                 # prompts that fill them
    batch.prefill(seqs, [long] * 4)
    target_part = sum(b.nbytes for b in batch._buf.t_kv)
    assert target_part == 4 * L * t_token and batch.kv_bytes <= bound  # the drafter's grows with the context
    for s in seqs:
        batch.remove(s)

    token = t_token + d_token
    available = 1000 * token + 7
    assert default_kv_tokens(manifest, 2, 4, available) == 250  # half of 1000 tokens' bytes, over 2 instances
    assert default_kv_tokens(manifest, 1, 4, 10 * 4 * L * token) == 4 * L  # never more than a full batch
    assert default_kv_tokens(manifest, 1, 4, None) is None  # memory unknown: unbounded
    note = kv_memory_note(eng.engine_dir, 2, 4, 1, available=available)
    assert "at most 250 K/V tokens" in note and "HTTP 400" in note and "Warning" not in note, note
    note = kv_memory_note(eng.engine_dir, 2, 4, 1, available=available, max_kv_tokens=600)
    assert "at most 600 K/V tokens" in note and "Warning" in note, note  # 2 x 600 tokens pass 1000 tokens' bytes
    assert kv_memory_note(eng.engine_dir, 2, 1, 1, available=0) is None  # one sequence at a time: no shared batch


def test_a_served_instance_works_out_its_default_kv_bound_once_the_batched_graph_is_loaded(built, monkeypatch):
    """The model stub's default bound comes from the memory available after the batched graph (a second copy of the
    target's weights) is loaded, not before: the load takes memory the bound would otherwise count on."""
    import importlib
    import json
    import sys
    import types

    from dflash_export import environment
    from dflash_export.deploy import kv_memory
    from dflash_export.engines.manifest import read_manifest

    _, eng, _ = built
    backend = types.ModuleType("triton_python_backend_utils")  # what the stub provides; only the policy is read
    backend.using_decoupled_model_transaction_policy = lambda config: False
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    monkeypatch.delitem(sys.modules, "dflash_export.deploy.triton_model", raising=False)
    triton_model = importlib.import_module("dflash_export.deploy.triton_model")
    seen = []
    preload = BatchedOrtEngine.preload
    monkeypatch.setattr(BatchedOrtEngine, "preload", lambda self: (seen.append("load"), preload(self))[1])
    monkeypatch.setattr(environment, "available_memory_bytes", lambda: (seen.append("memory"), 10 ** 8)[1])
    config = {"parameters": {"engine_dir": {"string_value": str(eng.engine_dir)}, "max_batch": {"string_value": "4"}},
              "instance_group": [{"count": 1}], "output": []}
    model = triton_model.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": "/"})
    try:
        assert seen == ["load", "memory"]
        want = kv_memory.default_kv_tokens(read_manifest(eng.engine_dir, verify_files=False), 1, 4, 10 ** 8)
        runtime = model.service.runtime
        assert want and runtime.max_kv_tokens == runtime.batch.kv_token_limit == want
        with pytest.raises(DFlashError, match="max_kv_tokens"):
            runtime.set_kv_bound(0)
    finally:
        model.finalize()
        sys.modules.pop("dflash_export.deploy.triton_model", None)  # bound to the stand-in backend


def test_what_the_default_kv_bound_admits_fits_the_memory_it_was_given(built):
    """The default bound's cells filled at their worst take at most the memory they were given, counted off the
    arrays themselves (shapes x item sizes): two full-length slots, one drafting every step (its context K/V grown by
    doubling) and one never drafting (every committed token's context features waiting for the drafter)."""
    from dflash_export.deploy.kv_memory import KV_MEMORY_FRACTION, default_kv_tokens, kv_bytes_per_token
    from dflash_export.engines.manifest import read_manifest

    _, eng, _ = built
    manifest = read_manifest(eng.engine_dir, verify_files=False)
    rows = eng.info.max_seq_len // BatchedOrtEngine.key_align * BatchedOrtEngine.key_align  # one slot's rows
    available = int(2 * rows * kv_bytes_per_token(manifest) / KV_MEMORY_FRACTION)
    bound = default_kv_tokens(manifest, 1, 2, available)
    assert bound == 2 * rows

    def held() -> int:
        arrays = batch._buf.t_kv + batch._buf.d_kv + [c for s in batch.seqs for c in s.ctx_parts]
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays)

    batch = BatchedOrtEngine(eng, max_batch=2)
    batch.kv_token_limit = bound
    drafting, plain = batch.add(rows), batch.add(rows)
    prompt = [3 + (i * 7) % 200 for i in range(rows // 2 + 20)]  # a first draft's rows, doubled, pass a slot's
    last = [int(np.argmax(lg)) for lg in batch.prefill([drafting, plain], [prompt, prompt])]
    bs, sp, most = eng.info.block_size, SamplingParams(), 0
    while drafting.length + bs < rows:
        batch.draft([drafting], [last[0]], [sp], [None], [bs])
        logits = batch.target_step([drafting, plain], [[t] for t in last])  # plain steps: one row each
        for seq in (drafting, plain):
            batch.commit(seq, 0)
        last = [int(np.argmax(lg[0])) for lg in logits]
        most = max(most, held())
    assert most <= KV_MEMORY_FRACTION * available, (most, KV_MEMORY_FRACTION * available)
    assert batch._buf.d_cap <= batch._buf.t_cap == rows and batch._buf.slots == 2
    assert sum(len(c) for c in plain.ctx_parts) == plain.length  # none of its context went to the drafter


def _cells(eng, tokens: int) -> int:
    """A slot's K/V rows for a sequence of `tokens`: rounded up to the batched engine's key alignment."""
    align = BatchedOrtEngine.key_align
    return -(-tokens // align) * align


def _held_cells(rt) -> int:
    """The K/V token cells the batch's target buffers hold (slots x rows), read off the buffers themselves."""
    bufs = rt.batch._buf.t_kv
    return bufs[0].shape[0] * bufs[0].shape[2] if bufs else 0


def test_a_kv_bound_admits_in_arrival_order_within_the_bound_and_decodes_as_alone(built):
    """max_kv_tokens: the buffers never hold more cells than the bound; a request that does not fit waits at the
    head and the ones behind it wait too (they would fit beside the first); capacity frees as sequences finish; every
    request's greedy tokens are those it gets alone, and its stats hold the bound and how long it waited to join."""
    _, eng, _ = built
    bs, align = eng.info.block_size, BatchedOrtEngine.key_align
    specs = [(PROMPTS[0], 20), (PROMPTS[1], 40), (PROMPTS[2], 17), (PROMPTS[3], 20)]  # A, B, C, D
    need = [_cells(eng, len(p) + n + bs) for p, n in specs]
    assert need == [align, 2 * align, align, align] and eng.info.max_seq_len >= 2 * align  # the load's premise
    bound = 3 * align  # A + C + D fit together (3 x align); B beside anything does not (2 x 2 align)
    rt = BatchingRuntime(eng, max_batch=4, max_kv_tokens=bound)
    rt.batch.keep_buffers = True  # as a served batch keeps them: B's longer rows outlive B, C and D need fewer
    reqs = [rt.submit(p, SamplingParams(max_new_tokens=n)) for p, n in specs]
    joins, held = [], []
    while not rt.idle:
        rt.step()
        joins.append([i for i, r in enumerate(reqs) if r.joined and all(i not in j for j in joins)])
        held.append(_held_cells(rt))
        live = [a.req for a in rt.active]
        assert len(live) * max([need[reqs.index(r)] for r in live], default=0) <= bound
    assert max(held) <= bound
    assert [j for j in joins if j] == [[0], [1], [2, 3]]  # B waited for A, and C and D waited behind B
    waits = [r.stats.admission_wait_s for r in reqs]  # what each request's stats report (served: /metrics)
    assert 0 <= waits[0] < waits[1] < min(waits[2:]) and all(r.stats.kv_token_limit == bound for r in reqs)
    single = DFlashRuntime(eng)
    for req, (p, n) in zip(reqs, specs):
        assert_as_plain(eng, p, req.stats.tokens, single.generate(p, SamplingParams(max_new_tokens=n)).tokens)

    unbounded = BatchingRuntime(eng, max_batch=4)  # the same load without the bound: all four join at once
    reqs = [unbounded.submit(p, SamplingParams(max_new_tokens=n)) for p, n in specs]
    unbounded.step()
    assert all(r.joined for r in reqs) and all(r.stats.kv_token_limit == 0 for r in reqs)


def test_a_request_larger_than_the_kv_bound_is_refused_and_cancels_free_capacity(built):
    _, eng, _ = built
    bs, align = eng.info.block_size, BatchedOrtEngine.key_align
    assert eng.info.max_seq_len >= 3 * align + 1
    bound = 4 * align
    rt = BatchingRuntime(eng, max_batch=4, max_kv_tokens=bound)
    rt.batch.keep_buffers = True  # as a served batch keeps them (s2 joining below shrinks x's rows under s1)
    with pytest.raises(DFlashError) as e:  # bound + 1 tokens: one more than the whole bound
        rt.submit(PROMPTS[0], SamplingParams(max_new_tokens=bound + 1 - len(PROMPTS[0]) - bs))
    assert e.value.field == "max_kv_tokens" and str(bound) in str(e.value)
    assert not rt.queue
    big = SamplingParams(max_new_tokens=3 * align - len(PROMPTS[0]) - bs)  # 3 x align rows
    assert _cells(eng, len(PROMPTS[0]) + big.max_new_tokens + bs) == 3 * align
    # An active sequence cancelled: the one waiting for its rows joins at the next step.
    x = rt.submit(PROMPTS[0], big)
    y = rt.submit(PROMPTS[0], big)
    rt.step()
    assert x.joined and not y.joined
    rt.step()
    assert not y.joined  # 2 x 3 align cells do not fit
    rt.cancel(x)
    rt.step()
    assert y.joined and x.done and _held_cells(rt) <= bound
    rt.cancel(y)
    rt.step()
    assert rt.idle
    # A queued request cancelled at the head: the one behind it (which fits) joins.
    small, long = SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=align - 1 - bs)
    s1 = rt.submit(PROMPTS[2], long)  # running through the steps below
    rt.step()
    head = rt.submit(PROMPTS[0], big)  # beside s1: 2 x 3 align cells
    s2 = rt.submit(PROMPTS[2], small)
    rt.step()
    assert not head.joined and not s2.joined
    rt.cancel(head)
    rt.step()
    assert s2.joined and head.done and not head.joined and _held_cells(rt) == 2 * align
    while not rt.idle:
        rt.step()
        assert _held_cells(rt) <= bound
    assert_as_plain(eng, PROMPTS[2], s1.stats.tokens, DFlashRuntime(eng).generate(PROMPTS[2], long).tokens)
    with pytest.raises(DFlashError) as e:
        BatchingRuntime(eng, max_batch=2, max_kv_tokens=0)
    assert e.value.field == "max_kv_tokens"


@pytest.mark.parametrize("tree_mode", ["spine", "full"])
def test_batched_requests_count_their_accepted_drafts_by_source(built, tree_mode):
    """The lookup proposer's drafts are all the context's: in a batch, each request's count for it is the drafts its
    answer kept, which without stop tokens (blocks never deeper than the tokens still owed) is its accepted tokens
    (kept per step less one); the drafter and the static index are counted nothing. Looping prompts (a plain answer
    repeated) get lookups accepted."""
    _, eng, _ = built
    plain = DFlashRuntime(eng)
    loops = [p + 3 * plain.generate(p, SamplingParams(max_new_tokens=10), "ar").tokens for p in PROMPTS[:4]]
    rt = BatchingRuntime(eng, max_batch=4, proposer="lookup", tree_mode=tree_mode, adaptive=False)
    reqs = [rt.submit(p, SamplingParams(max_new_tokens=24, stop_token_ids=[])) for p in loops]
    while not rt.idle:
        rt.step()
    for r in reqs:
        s = r.stats
        assert s.accepted_by == s.accepted_only == {"drafter": 0, "context": s.accepted_tokens, "static": 0}, s
    assert sum(r.stats.accepted_tokens for r in reqs) > 10


def test_batched_chain_drafts_count_for_the_drafter_alone(built):
    """Chain steps verify the drafter's own block: each request's drafts kept by its answer (drafts that are its plain
    continuation, one corrupted at a random slot, so every accept length occurs) count for the drafter, proposed by it
    and by it alone, and for no other source. Without stop tokens (blocks never deeper than the tokens still owed)
    that is its accepted tokens."""
    _, eng, _ = built
    sp = SamplingParams(max_new_tokens=24, stop_token_ids=[])
    prompts = PROMPTS[:3]
    plain = DFlashRuntime(eng)
    refs = iter([plain.generate(p, sp, "ar").tokens for p in prompts])
    rt = BatchingRuntime(eng, max_batch=3, proposer="chain", adaptive=False)
    conts = {}
    true_add = rt.batch.add

    def add(max_tokens, _prompts=iter(prompts)):
        seq = true_add(max_tokens)
        conts[id(seq)] = (next(refs), len(next(_prompts)))
        return seq

    rt.batch.add = add
    _oracle_drafts(rt.batch, conts, np.random.default_rng(0))
    reqs = [rt.submit(p, sp) for p in prompts]
    while not rt.idle:
        rt.step()
    for r in reqs:
        s = r.stats
        assert s.accepted_by == s.accepted_only == {"drafter": s.accepted_tokens, "context": 0, "static": 0}, s
    assert sum(r.stats.accepted_tokens for r in reqs) > 5
