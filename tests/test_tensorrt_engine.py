"""The engine logic TensorRT engines run under (graph_engine.GraphEngine), proven without TensorRT: driven by an ONNX
Runtime runner over the very graphs a TensorRT build compiles, with every call checked against the optimization
profile the TensorRT runner would select. Greedy output equals the PyTorch reference and the ONNX Runtime engine;
seeded sampling equals the ONNX Runtime and PyTorch engines; every accept length commits and crops the caches
correctly; a request that fills max_seq_len stays inside the profiles. TensorRTRunner itself runs against an
EMULATION of the TensorRT API (ONNX Runtime behind TensorRT's engine / context calls, on CPU tensors): it proves the
runner's own bookkeeping, not TensorRT's behaviour. Without TensorRT, loading a TensorRT engine names the extra and the
GPU; with TensorRT and a GPU, the last test builds and runs a real engine (never run yet: README "GPU status")."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
from target_support import assert_as_plain
from tensorrt_emulation import emulate_tensorrt, emulated_engine_dir

from dflash_export.engines import graph_engine as ge
from dflash_export.engines.base import SamplingParams
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.runtime.single import DFlashRuntime

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65]]
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def engines(request, tmp_path_factory):
    """(graph engine over the portable export, OrtEngine, TorchEngine) for one tiny family."""
    from dflash_export.engines.ort_build import build_onnxruntime
    from dflash_export.engines.torch_ref import TorchEngine
    from dflash_export.export import export_recipe
    from dflash_export.recipes import load_recipe

    recipe = load_recipe(request.param)
    root = tmp_path_factory.mktemp(request.param)
    export_recipe(recipe, root / "onnx")
    ort_eng = load_engine(build_onnxruntime(recipe, root / "onnxruntime", threads=1), threads=1)
    info = dataclasses.replace(ort_eng.info, backend="onnxruntime-portable")
    runner = ge.OrtGraphRunner(root / "onnx", check_profiles=(info.block_size, info.max_seq_len))
    eng = ge.GraphEngine(runner, info, ort_eng.codec)
    yield eng, ort_eng, TorchEngine.from_recipe(recipe)
    eng.close()
    ort_eng.close()


def test_greedy_dflash_and_ar_equal_reference_and_ort_engine(engines):
    from dflash_export.runtime.reference import ar_generate

    eng, ort_eng, torch_eng = engines
    for prompt in PROMPTS:
        ref = ar_generate(torch_eng.target, prompt, 40).tokens
        sp = SamplingParams(max_new_tokens=40)
        for mode in ("dflash", "ar"):
            assert DFlashRuntime(eng).generate(prompt, sp, mode).tokens == ref, (mode, prompt)
        assert_as_plain(ort_eng, prompt, DFlashRuntime(ort_eng).generate(prompt, sp).tokens, ref)


def test_a_fixed_block_engine_asked_for_trees_drafts_chains(engines):
    """The graph engine (TensorRT's runner logic) verifies blocks of exactly block_size: asked for tree+lookup it
    drafts the chain, says so, and decodes the reference's tokens."""
    from dflash_export.runtime.reference import ar_generate

    eng, _, torch_eng = engines
    rt = DFlashRuntime(eng, proposer="tree+lookup")
    assert rt.describe().startswith("chain (this engine verifies fixed blocks")
    for prompt in PROMPTS:
        sp = SamplingParams(max_new_tokens=40)
        assert rt.generate(prompt, sp).tokens == ar_generate(torch_eng.target, prompt, 40).tokens, prompt


def test_seeded_sampling_equals_ort_and_torch_engines(engines):
    """Same seed, same uniforms consumed in the same order: the same tokens and acceptance lengths."""
    eng, ort_eng, torch_eng = engines
    for seed, (t, k, p) in enumerate([(0.8, 0, 1.0), (1.0, 20, 1.0), (0.6, 0, 0.9)]):
        sp = SamplingParams(max_new_tokens=24, temperature=t, top_k=k, top_p=p, seed=seed)
        for prompt in PROMPTS[:2]:
            got = DFlashRuntime(eng).generate(prompt, sp)
            for other in (torch_eng, ort_eng):  # whole last blocks, as the fixed TensorRT profiles take them
                want = DFlashRuntime(other, full_last_block=True).generate(prompt, sp)
                assert (got.tokens, got.acceptance_lengths) == (want.tokens, want.acceptance_lengths), (
                    other.info.backend, sp, prompt)


def test_every_accept_length_commits_and_crops_like_the_ort_engine(engines):
    """The tiny drafter is random and rarely accepted, so blocks come from the reference continuation with one slot
    corrupted: accept lengths 0..bs-1 all occur, and the target cache is cropped to the committed tokens each time."""
    from dflash_export.runtime.reference import ar_generate

    eng, ort_eng, torch_eng = engines
    bs = eng.info.block_size
    rng = np.random.default_rng(1)
    prompt = list(range(30, 49))
    cont = ar_generate(torch_eng.target, prompt, 120).tokens
    sp = SamplingParams()
    seqs = [e.new_sequence() for e in (eng, ort_eng)]
    first = [e.prefill(s, np.array(prompt)) for e, s in zip((eng, ort_eng), seqs)]
    np.testing.assert_allclose(first[0], first[1], atol=1e-4)
    done, accepts = 0, set()
    while done + bs < len(cont) - 1:
        drafts = [e.draft(s, cont[done], sp, None)[0] for e, s in zip((eng, ort_eng), seqs)]
        np.testing.assert_array_equal(drafts[0], drafts[1])
        block = np.array(cont[done: done + bs], np.int64)
        k = int(rng.integers(1, bs + 1))
        if k < bs:
            block[k] = (block[k] + 1) % (eng.info.vocab_size - 2)
        results = [e.verify(s, block, None, sp, None) for e, s in zip((eng, ort_eng), seqs)]
        assert results[0] == results[1]
        accept, emitted = results[0]
        assert emitted == cont[done + 1: done + 2 + accept]
        accepts.add(accept)
        done += accept + 1
        assert seqs[0].length == seqs[1].length == seqs[0].t_kv.length == len(prompt) + done
        assert seqs[0].d_kv.length == len(prompt) + done - accept - 1  # context features cached up to the anchor
    assert accepts == set(range(bs))


def test_a_request_filling_max_seq_len_stays_inside_the_profiles(engines):
    """The largest request the runtime admits (prompt + max_tokens + block == max_seq_len) runs end to end with every
    call inside the TensorRT profile it selects: the drafter's steady-state context cache reaches max_seq_len-bs-1."""
    eng, _, _ = engines
    bs, limit = eng.info.block_size, eng.info.max_seq_len
    prompt = [3 + (i * 7) % 200 for i in range(limit - bs - 24)]
    for mode in ("dflash", "ar"):
        stats = DFlashRuntime(eng).generate(prompt, SamplingParams(max_new_tokens=24, stop_token_ids=[]), mode)
        assert len(stats.tokens) == 24


def test_runs_outside_the_named_profile_are_refused(engines):
    eng, _, _ = engines
    runner = eng.runner
    seq = eng.new_sequence()
    feeds = {"input_ids": np.array([[1, 2]]), "position_ids": np.array([[0, 1]]), "num_logits": np.array(1),
             "draft_tokens": np.zeros((1, 0), np.int64), "draft_probs": np.zeros((1, 1, 1), np.float32),
             "uniforms": np.zeros((1, 1), np.float32)}
    with pytest.raises(DFlashError, match="outside profile 'decode'"):  # decode takes exactly one token
        runner.run(ge.TARGET, ge.DECODE, feeds, ["logits"], seq.t_kv)
    with pytest.raises(DFlashError, match="no optimization profile 'warmup'"):
        runner.run(ge.TARGET, "warmup", feeds, ["logits"], seq.t_kv)
    assert seq.t_kv.length == 0
    assert runner.run(ge.TARGET, ge.PREFILL, feeds, ["logits"], seq.t_kv)["logits"].shape == (1, 1, 256)
    assert seq.t_kv.length == 2
    seq = eng.new_sequence()
    eng.prefill(seq, np.array([1, 2]))
    with pytest.raises(DFlashError, match="prefill runs once"):  # the prefill profile is for an empty cache
        eng.prefill(seq, np.array([3]))


def _tensorrt_manifest(**overrides):
    m = {"backend": "tensorrt", "recipe": "tiny-qwen3", "block_size": 4, "mask_token_id": 255, "vocab_size": 256,
         "stop_token_ids": [0], "max_seq_len": 512, "target_layer_ids": [1, 3], "files": {},
         "engines": {"target_verify.engine": {"profiles": ["prefill", "verify", "decode"]},
                     "drafter.engine": {"profiles": ["first_block", "step"]}}}
    m.update(overrides)
    return m


def _typed(m: dict, engine_dir):
    from dflash_export.engines.manifest import validate_manifest

    return validate_manifest(m, engine_dir / "manifest.json")


def test_tensorrt_engine_info_comes_from_the_manifest(tmp_path):
    from dflash_export.engines.tensorrt import tensorrt_engine_info

    info = tensorrt_engine_info(_typed(_tensorrt_manifest(), tmp_path))
    assert (info.backend, info.block_size, info.mask_token_id, info.vocab_size, info.max_seq_len) == (
        "tensorrt", 4, 255, 256, 512)
    assert info.stop_token_ids == [0] and info.target_layer_ids == [1, 3]
    m = _tensorrt_manifest()
    del m["stop_token_ids"]
    with pytest.raises(DFlashError, match="stop_token_ids.*rebuild"):
        tensorrt_engine_info(_typed(m, tmp_path))
    with pytest.raises(DFlashError, match="not a tensorrt engine"):
        tensorrt_engine_info(_typed(_tensorrt_manifest(backend="tensorrt-llm"), tmp_path))


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
def test_without_tensorrt_loading_an_engine_names_the_extra_and_the_gpu(tmp_path):
    from dflash_export.engines.tensorrt import TensorRTEngine

    (tmp_path / "manifest.json").write_text(json.dumps(_tensorrt_manifest()))
    pattern = r"dflash-export\[tensorrt\].*NVIDIA GPU"
    with pytest.raises(MissingDependency, match=pattern):
        load_engine(tmp_path)
    with pytest.raises(MissingDependency, match=pattern):
        TensorRTEngine(tmp_path, _typed(_tensorrt_manifest(), tmp_path))


def _engine_table_dir(tmp_path, files=("target_verify.engine", "drafter.engine"), **overrides):
    """A TensorRT engine directory with stand-in plan files `files` and `_tensorrt_manifest(**overrides)`."""
    from dflash_export.engines.manifest import write_manifest

    out = tmp_path / "tensorrt"
    out.mkdir(parents=True)
    for name in files:
        (out / name).write_bytes(b"plan")
    m = _tensorrt_manifest(**overrides)
    del m["files"]
    write_manifest(out, m)
    return out


def test_deploy_refuses_an_engine_table_without_what_the_runner_opens(tmp_path):
    """`run` and `deploy` check the two engines the runner opens before anything loads or is written: each among the
    manifest's files, with the profiles the engine logic selects; else one error naming the manifest and the field."""
    from dflash_export.engines.registry import check_engine_manifest

    check_engine_manifest(_engine_table_dir(tmp_path / "ok"))
    engines = _tensorrt_manifest()["engines"]
    with pytest.raises(DFlashError, match=r"drafter.engine profiles \[\] lack") as e:
        check_engine_manifest(_engine_table_dir(tmp_path / "a", engines={"target_verify.engine":
                                                                          engines["target_verify.engine"]}))
    assert e.value.field == "engines" and str(e.value.path).endswith("manifest.json")
    with pytest.raises(DFlashError, match="drafter.engine is not among the files") as e:
        check_engine_manifest(_engine_table_dir(tmp_path / "b", files=("target_verify.engine",)))
    assert e.value.field == "files"


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
def test_without_tensorrt_deploy_of_a_tensorrt_engine_names_the_library_and_writes_nothing(tmp_path):
    """The repository is served from this environment, which must import what the engine needs: without tensorrt,
    `deploy` (and `serve --engine`, which deploys into the cache) is one line naming it, exit 2, nothing written."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    engine = _engine_table_dir(tmp_path)
    r = CliRunner().invoke(main, ["deploy", "--engine", str(engine), "--repo", str(tmp_path / "repo")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert "tensorrt is not installed" in r.output and "dflash-export[tensorrt]" in r.output
    assert not (tmp_path / "repo").exists()


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
@pytest.mark.parametrize("command, extra", [
    ("run", ["hi"]), ("bench", ["--recipe", "tiny-qwen3"]), ("bench", ["--recipe", "tiny-qwen3", "--concurrency", "1"]),
    ("validate", ["--recipe", "tiny-qwen3"]),
])
def test_without_tensorrt_an_engine_given_with_engine_names_its_manifest_first(tmp_path, monkeypatch, command, extra):
    """The user named the engine, not a backend: without tensorrt, `--engine DIR` on a TensorRT engine is one line
    naming DIR/manifest.json and its `backend` field with the install line (no `--backend`), exit 2, and nothing
    before it (validate's sample-size warnings come after the input is checked; bench starts no worker)."""
    from click.testing import CliRunner

    from dflash_export.cli import main

    monkeypatch.chdir(tmp_path)
    engine = _engine_table_dir(tmp_path)
    r = CliRunner().invoke(main, [command, "--engine", str(engine), *extra])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.output.splitlines()
    assert len(lines) == 1, r.output
    assert lines[0].startswith(f"error: {engine / 'manifest.json'}: backend: "), lines[0]
    assert "tensorrt is not installed" in lines[0] and "pip install 'dflash-export[tensorrt]'" in lines[0], lines[0]
    assert "--backend" not in lines[0], lines[0]
    with pytest.raises(MissingDependency) as e:
        load_engine(engine)
    assert (e.value.path, e.value.field) == (engine / "manifest.json", "backend")


def test_build_records_what_the_engine_needs_to_run(tmp_path):
    """build_tensorrt writes the codec / tokenizer and the stop ids + vocabulary (read from the target's config),
    so a TensorRT engine directory describes itself like an ONNX Runtime one."""
    from dflash_export.engines.tensorrt import tensorrt_engine_info, write_serving_files
    from dflash_export.engines.torch_ref import TorchEngine
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.tokenization import TextCodec
    from dflash_export.recipes import load_recipe

    recipe = load_recipe("tiny-llama")
    facts = write_serving_files(recipe, load_drafter(recipe.drafter_path), tmp_path)
    ref = TorchEngine.from_recipe(recipe)
    assert facts == {"stop_token_ids": ref.info.stop_token_ids, "vocab_size": ref.info.vocab_size}
    info = tensorrt_engine_info(_typed(_tensorrt_manifest(**facts), tmp_path))
    assert info.stop_token_ids == ref.info.stop_token_ids
    codec = TextCodec.from_dir(tmp_path)
    assert codec.encode("hi") == ref.codec.encode("hi")


@pytest.fixture()
def emulated_tensorrt(monkeypatch):
    """TensorRT replaced by the emulation (tests/emulated_tensorrt.py) and CUDA streams by no-ops."""
    return emulate_tensorrt(monkeypatch)


def test_tensorrt_runner_on_emulated_tensorrt_matches_the_ort_engine(engines, emulated_tensorrt, tmp_path):
    """load_engine -> TensorRTEngine -> TensorRTRunner, end to end on CPU: greedy (DFlash and AR) equals the
    reference, seeded sampling equals the ONNX Runtime engine, a request filling max_seq_len stays in the profiles,
    and the device caches hold exactly the committed rows."""
    from dflash_export.recipes import load_recipe

    eng_ref, ort_eng, _ = engines
    recipe = load_recipe(ort_eng.info.recipe)
    eng = load_engine(emulated_engine_dir(tmp_path, recipe), device="cpu")
    assert type(eng).__name__ == "TensorRTEngine" and eng.info.vocab_size == ort_eng.info.vocab_size
    for prompt in PROMPTS[:3]:
        sp = SamplingParams(max_new_tokens=24)
        want = DFlashRuntime(eng_ref).generate(prompt, sp).tokens
        for mode in ("dflash", "ar"):
            assert DFlashRuntime(eng).generate(prompt, sp, mode).tokens == want, (mode, prompt)
        sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=3)
        got = DFlashRuntime(eng).generate(prompt, sp)
        want = DFlashRuntime(ort_eng, full_last_block=True).generate(prompt, sp)  # fixed profiles: whole blocks
        assert (got.tokens, got.acceptance_lengths) == (want.tokens, want.acceptance_lengths), prompt
    bs, limit = eng.info.block_size, eng.info.max_seq_len
    prompt = [3 + (i * 7) % 200 for i in range(limit - bs - 12)]
    sp = SamplingParams(max_new_tokens=12, stop_token_ids=[])
    assert DFlashRuntime(eng).generate(prompt, sp).tokens == DFlashRuntime(eng_ref).generate(prompt, sp).tokens
    eng.close()


def test_tensorrt_runner_on_emulated_tensorrt_switches_profiles_only_when_the_step_kind_changes(
        engines, emulated_tensorrt, tmp_path):
    from dflash_export.recipes import load_recipe

    recipe = load_recipe(engines[1].info.recipe)
    eng = load_engine(emulated_engine_dir(tmp_path, recipe), device="cpu")
    contexts = [eng.runner.graphs[g].context for g in ("target_verify", "drafter")]
    stats = DFlashRuntime(eng).generate(PROMPTS[1], SamplingParams(max_new_tokens=16))
    assert len(stats.acceptance_lengths) > 2
    # a new context starts on profile 0 (prefill / first_block); the steps after it stay on verify / step
    assert [c.profile_switches for c in contexts] == [1, 1]
    from dflash_export.runtime.reference import ar_generate

    bs = eng.info.block_size
    cont = ar_generate(engines[2].target, PROMPTS[0], 2 * bs + 1).tokens
    seq = eng.new_sequence()
    eng.prefill(seq, np.array(PROMPTS[0]))
    eng.draft(seq, cont[0], SamplingParams(), None)
    # the reference continuation as the block: every draft accepted, nothing to crop
    assert eng.verify(seq, np.array(cont[:bs]), None, SamplingParams(), None) == (bs - 1, cont[1: bs + 1])
    assert [c.profile_switches for c in contexts] == [3, 2]  # target: prefill, verify; drafter: first_block
    eng.draft(seq, cont[bs], SamplingParams(), None)
    block = np.array(cont[bs: 2 * bs])
    block[1] = (block[1] + 1) % (eng.info.vocab_size - 2)  # first draft wrong: the cache is cropped to the anchor
    assert eng.verify(seq, block, None, SamplingParams(), None) == (0, [cont[bs + 1]])
    assert [c.profile_switches for c in contexts] == [3, 3]  # drafter: now step
    # device caches hold exactly the committed rows, as a dense prefix of their buffers
    kvh, d, _ = seq.t_kv.layout["key_0"]
    assert seq.t_kv.length == seq.length == len(PROMPTS[0]) + bs + 1
    assert seq.t_kv.past("key_0").shape == (1, kvh, seq.length, d)
    eng.close()


def test_tensorrt_engine_on_emulated_tensorrt_refuses_a_manifest_without_the_profiles_it_selects(
        emulated_tensorrt, tmp_path):
    from dflash_export.recipes import load_recipe

    out = emulated_engine_dir(tmp_path, load_recipe("tiny-qwen3"))
    m = json.loads((out / "manifest.json").read_text())
    m["engines"]["drafter.engine"]["profiles"] = ["first_block", "steady"]
    with pytest.raises(DFlashError, match=r"drafter.engine profiles.*lack \['step'\]"):
        emulated_tensorrt.TensorRTEngine(out, _typed(m, out), device="cpu")


WALK_NOTE = ("sampled requests draw the drafter's chain and accept with min(1, p/q) (the recipe's walk needs host "
             "acceptance over any block length, which fixed blocks do not give)")


def test_tensorrt_engine_says_what_it_runs_of_the_recorded_decoding(emulated_tensorrt, tmp_path):
    """The manifest carries the recipe's `decoding`; the engine runs the drafter's chain and chain sampling and says
    so: a recorded walk becomes chain sampling, a recorded tree or lookup proposer the chain, each with its reason."""
    from dflash_export.recipes import load_recipe

    recipe = load_recipe("tiny-qwen3")
    out = emulated_engine_dir(tmp_path, recipe)
    eng = emulated_tensorrt.TensorRTEngine(out, _typed(json.loads((out / "manifest.json").read_text()), out),
                                           device="cpu")
    assert eng.info.decoding == dataclasses.asdict(recipe.decoding) and recipe.decoding.sampling == "walk"
    assert eng.decoding == {"proposer": "chain", "sampling": "chain", "sampling_note": WALK_NOTE}
    rt = DFlashRuntime(eng)
    assert rt.describe() == "chain" and rt.describe(0.7) == "chain"  # a fixed-block engine's runtime agrees
    eng.close()
    m = json.loads((out / "manifest.json").read_text())
    m["decoding"]["sampling"] = "chain"
    eng = emulated_tensorrt.TensorRTEngine(out, _typed(m, out), device="cpu")
    assert eng.decoding == {"proposer": "chain", "sampling": "chain"}
    eng.close()
    for proposer in ("tree", "lookup", "tree+lookup"):
        m["decoding"]["proposer"] = proposer
        eng = emulated_tensorrt.TensorRTEngine(out, _typed(m, out), device="cpu")
        assert (eng.decoding["proposer"], eng.decoding["sampling"]) == ("chain", "chain")
        assert eng.decoding["proposer_note"].startswith(f"the recipe's {proposer} needs draft trees")
        assert DFlashRuntime(eng).describe() == "chain (this engine verifies fixed blocks: no trees or lookups)"
        eng.close()


def test_build_of_a_tree_recipe_records_that_the_engines_run_the_chain():
    """build --backend tensorrt of a recipe asking for trees and lookups (the shipped smollm2-135m recipe does): the
    manifest records the recipe's `decoding` and that the engines propose the drafter's chain, with the reason."""
    from dflash_export.decoding.options import DecodingOptions
    from dflash_export.engines.tensorrt_runtime import tensorrt_decoding

    runs = tensorrt_decoding(dataclasses.asdict(DecodingOptions(proposer="tree+lookup")))
    assert runs["proposer"] == "chain" and "build --backend onnxruntime" in runs["proposer_note"]
    assert runs["sampling"] == "chain" and runs["sampling_note"] == WALK_NOTE


def test_a_static_ngram_index_is_neither_built_nor_asked_of_a_fixed_block_engine(engines):
    """A recipe's static n-gram index feeds trees and lookups, which TensorRT engines do not run: the build records
    that none is built, and asking a fixed-block engine for it points to the backend that runs it, not to a rebuild
    that would make none."""
    from dflash_export.decoding.options import DecodingOptions
    from dflash_export.engines.tensorrt_runtime import tensorrt_decoding

    runs = tensorrt_decoding(dataclasses.asdict(DecodingOptions(static_ngrams=True)))
    assert "none is built" in runs["static_ngrams_note"] and "onnxruntime" in runs["static_ngrams_note"]
    assert "static_ngrams_note" not in tensorrt_decoding(dataclasses.asdict(DecodingOptions()))
    eng = engines[0]
    assert eng.fixed_block and eng.info.static_index is None
    with pytest.raises(DFlashError, match="fixed blocks.*build --backend onnxruntime") as e:
        DFlashRuntime(eng, static_ngrams=True)
    assert e.value.field == "static_ngrams" and "build it with" not in str(e.value)


def _gpu_ready() -> bool:
    if not HAS_TENSORRT:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _gpu_ready(), reason="needs tensorrt and an NVIDIA GPU")
def test_on_gpu_tensorrt_engine_is_lossless_and_follows_its_onnx_runtime_twin(tmp_path):
    """The device check (nothing above runs real TensorRT): build tiny-qwen3 (fp32, TF32 off), then
    - the build recorded which plugin implementation TensorRT used and found one plugin layer per dflash node;
    - greedy DFlash on the engine equals greedy AR on the same engine over the whole output (128 tokens): lossless;
    - both equal the ORT runner over the directory's onnx/ graphs (the same fp32 graphs), whole output;
    - sampled DFlash output (T=0.7, top-p 0.9) fits the PyTorch reference's conditionals (validate's check)."""
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.tensorrt import build_tensorrt
    from dflash_export.recipes import load_recipe
    from dflash_export.validate.runner import Reference, ValidateOptions, _distribution_check, _Progress

    recipe = load_recipe("tiny-qwen3")
    out = build_tensorrt(recipe, tmp_path / "tensorrt")
    manifest = read_manifest(out)
    impl = manifest.plugins.implementation  # the build asked for the AOT kernels (TensorRT >= 10.12)
    assert manifest.plugins.requested == "aot" and dict(impl) == {"KVInjectedBlockAttention": "aot",
                                                                  "FusedVerify": "aot"}
    layers = manifest.engines["drafter.engine"]["plugin_layers"]
    assert layers == manifest.engines["drafter.engine"]["plugins"], layers
    eng = load_engine(out)
    twin = ge.GraphEngine(ge.OrtGraphRunner(out / "onnx", check_profiles=(eng.info.block_size, eng.info.max_seq_len)),
                          eng.info, eng.codec)
    for prompt in PROMPTS:
        sp = SamplingParams(max_new_tokens=128, stop_token_ids=[])
        dflash = DFlashRuntime(eng).generate(prompt, sp, "dflash").tokens
        assert len(dflash) == 128
        assert dflash == DFlashRuntime(eng).generate(prompt, sp, "ar").tokens, prompt
        assert dflash == DFlashRuntime(twin).generate(prompt, sp).tokens, prompt
    reference = Reference.from_recipe(recipe)
    opts = ValidateOptions(dist_samples=100)
    dist = _distribution_check(DFlashRuntime(eng), reference, [("a", PROMPTS[0]), ("b", PROMPTS[2])], opts,
                               eng.info.block_size, _Progress(False, 0))
    assert dist["impossible_tokens"] == 0 and dist["p_value"] >= 1e-3, dist
    eng.close()
