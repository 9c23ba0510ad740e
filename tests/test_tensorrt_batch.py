"""Continuous batching on the TensorRT backend, proven on CPU against the EMULATION of the TensorRT API
(tests/tensorrt_emulation.py: each engine's ONNX graph run by ONNX Runtime behind TensorRT's engine / context calls,
shapes outside the active optimization profile refused). The engine directory is written by the build's own
`build_batch_engines` (plain-op graphs, profiles, manifest facts), only the TensorRT compilation replaced.

Proven here: the plain-op batch graphs hold standard ONNX ops only and compute what the ONNX Runtime flavor computes;
greedy tokens of prompts of different lengths, joining and leaving a batch, equal the PyTorch reference and the ONNX
Runtime batched engine; the batch's K/V are device tensors bound by address, never copied between host and device;
more sequences than the profiles take are refused; a directory built without the batch engines fails with one
DFlashError naming the manifest field. Not proven (needs a GPU): that TensorRT parses and builds
these graphs, its numerics, speed (README "GPU status")."""

from __future__ import annotations

import json

import numpy as np
import pytest
from target_support import assert_as_plain
from tensorrt_emulation import emulate_tensorrt, emulated_engine_dir
from test_batching import _oracle_drafts

from dflash_export.engines.base import SamplingParams
from dflash_export.engines.registry import load_engine
from dflash_export.errors import DFlashError
from dflash_export.runtime.batching import BatchingRuntime

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 41)), [7], [200, 13, 13, 13, 99, 5, 64, 65],
           [3 + (i * 7) % 200 for i in range(90)]]
MAX_BATCH = 3


@pytest.fixture(scope="module")
def pair(ort_pair, tmp_path_factory):
    """(emulated TensorRT engine with batch engines for <= MAX_BATCH sequences, ONNX Runtime engine, TorchEngine,
    the engine directory, the emulation module) of each tiny family (conftest's ort_pair); TensorRT emulated for the
    whole module."""
    recipe, _, ort_eng, torch_eng = ort_pair
    root = tmp_path_factory.mktemp(recipe.name)
    with pytest.MonkeyPatch.context() as mp:
        trt_backend = emulate_tensorrt(mp)
        out = emulated_engine_dir(root, recipe, max_batch=MAX_BATCH)
        eng = load_engine(out, device="cpu")
        yield eng, ort_eng, torch_eng, out, trt_backend
        eng.close()


@pytest.fixture(scope="module")
def reference(pair):
    """Each prompt's greedy continuation by the PyTorch reference (fp32), 40 tokens."""
    from dflash_export.runtime.reference import ar_generate

    return [ar_generate(pair[2].target, p, 40).tokens for p in PROMPTS]


def test_plain_op_batch_graphs_hold_standard_ops_only_and_compute_the_ort_flavor(pair):
    """What TensorRT parses: no com.microsoft / ORT-only / dflash node left, and every output equal to the ONNX Runtime
    flavor's graph it was made from, on shapes (3 sequences, padding biases) the export never traced."""
    import onnx
    import onnxruntime as ort

    from dflash_export.engines.tensorrt_batch import BATCH_FILES

    out = pair[3] / "onnx"
    rng = np.random.default_rng(0)
    dims = {"batch": 3, "seq": 4, "past": 7, "n_ctx": 5, "past_ctx": 6, "block": 4, "n_keys": 15, "rows": 9}
    manifest = json.loads((pair[3] / "manifest.json").read_text())
    for graph, (src, plain, engine_name) in BATCH_FILES.items():
        model = onnx.load(str(out / plain), load_external_data=False)
        assert all(onnx.defs.has(n.op_type, n.domain) for n in model.graph.node), graph
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}, graph
        assert manifest["engines"][engine_name]["max_batch"] == MAX_BATCH
        a, b = (ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"]) for f in (src, plain))
        feeds = {}
        for i in a.get_inputs():
            shape = [dims[d] if isinstance(d, str) else d for d in i.shape]
            if i.name == "num_logits":
                feeds[i.name] = np.array(dims["seq"], np.int64)
            elif i.type == "tensor(int64)":
                feeds[i.name] = np.broadcast_to(np.arange(shape[-1]), shape).astype(np.int64).copy()
            elif i.name == "past_bias":  # each sequence's committed keys first, then room for its block
                lengths = np.array([0, 2, 3])[:, None]
                feeds[i.name] = np.where(np.arange(shape[-1]) < lengths, 0.0, -np.inf).astype(np.float32)
            elif i.name == "key_bias":
                feeds[i.name] = np.where(rng.random(shape) < 0.3, -np.inf, 0.0).astype(np.float32)
                feeds[i.name][..., -1] = 0.0  # every query sees a key
            else:
                feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            np.testing.assert_allclose(y, x, atol=1e-5, rtol=1e-5)


def test_plain_op_pass_refuses_an_op_tensorrt_cannot_parse(tmp_path):
    from onnx import TensorProto, helper, save_model

    from dflash_export.engines.tensorrt_batch import plain_op_graph

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    node = helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft", name="gelu")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    save_model(model, str(tmp_path / "a.onnx"))
    with pytest.raises(DFlashError, match="com.microsoft::FastGelu.*not a standard ONNX op") as e:
        plain_op_graph(tmp_path / "a.onnx", tmp_path / "b.onnx")
    assert e.value.field == "FastGelu" and str(tmp_path / "a.onnx") in str(e.value)


def test_continuous_batching_on_emulated_tensorrt_equals_reference_and_ort_batch(pair, reference):
    """Five prompts of 1..90 tokens through a batch of at most 3 (joining and leaving between steps), drafts accepted
    at every length: each request's greedy tokens are the PyTorch reference's and the ONNX Runtime batched engine's;
    the target and drafter engines ran several sequences per call."""
    from dflash_export.engines.tensorrt_batch import BatchedTensorRTEngine

    eng, ort_eng, _, _, _ = pair
    max_new = [40, 25, 40, 17, 33]
    sps = [SamplingParams(max_new_tokens=n) for n in max_new]
    got = {}
    for name, engine in (("tensorrt", eng), ("onnxruntime", ort_eng)):
        rt = BatchingRuntime(engine, max_batch=MAX_BATCH, adaptive=False)
        conts, rng = {}, np.random.default_rng(0)
        true_add = rt.batch.add

        def add(max_tokens, _prompts=iter(PROMPTS), _refs=iter(reference)):
            seq = true_add(max_tokens)
            conts[id(seq)] = (next(_refs), len(next(_prompts)))
            return seq

        rt.batch.add = add
        _oracle_drafts(rt.batch, conts, rng)
        widths = []
        if name == "tensorrt":
            assert isinstance(rt.batch, BatchedTensorRTEngine)
            graphs = rt.batch.graphs
            for method in ("target_batch", "drafter"):
                true = getattr(graphs, method)

                def record(*args, _true=true, _method=method):
                    feeds = args[0] if _method == "target_batch" else args[1]
                    first = feeds["position_ids"] if _method == "target_batch" else next(iter(feeds.values()))
                    widths.append((_method, len(first)))  # sequences in the call
                    return _true(*args)

                setattr(graphs, method, record)
        reqs = [rt.submit(p, sp) for p, sp in zip(PROMPTS, sps)]
        while not rt.idle:
            rt.step()
        got[name] = [r.stats.tokens for r in reqs]
        for req, ref, sp, p in zip(reqs, reference, sps, PROMPTS):  # ONNX Runtime's: as its numerics probe states
            assert_as_plain(engine, p, req.stats.tokens, ref[: sp.max_new_tokens])
        assert max(max(r.stats.acceptance_lengths) for r in reqs) >= 2, name
        if name == "tensorrt":
            assert rt.batch.kv_bytes == 0  # an idle batch holds no K/V
            for method in ("target_batch", "drafter"):
                assert max(w for m, w in widths if m == method) == MAX_BATCH, (method, widths)
            del graphs.target_batch, graphs.drafter  # the instance's wrappers: the class methods again
    if ort_eng.numerics.bit_identical:
        assert got["tensorrt"] == got["onnxruntime"]


def test_the_batch_kv_stay_on_the_device_bound_by_address(pair, reference, monkeypatch):
    """The batch's K/V (target and drafter context) are torch tensors on the engine's device: every target call's
    past_key_i / past_value_i address is a slot of those very buffers, the new K/V rows and the drafter's present
    context come back as device tensors, and the only host -> device copies of a run are the small inputs -- no K/V,
    at any step (prefills, verifies, joins and leaves). The tokens stay the reference's."""
    import torch

    from dflash_export.engines.graph_engine import TARGET_BATCH

    eng = pair[0]
    rt = BatchingRuntime(eng, max_batch=MAX_BATCH, adaptive=False)
    batch, graphs = rt.batch, rt.batch.graphs
    uploads, bound, returned = [], [], []
    true_upload = graphs._upload

    def upload(name, value, dtype):
        uploads.append(name)
        return true_upload(name, value, dtype)

    ctx = graphs.graphs[TARGET_BATCH].context
    true_set = ctx.set_tensor_address

    def set_address(name, address):
        if name.startswith(("past_key_", "past_value_")):
            i = int(name.rsplit("_", 1)[1])
            buf = batch._buf.t_kv[2 * i + name.startswith("past_value_")]
            step = buf.stride(0) * buf.element_size()
            bound.append(isinstance(buf, torch.Tensor) and (address - buf.data_ptr()) % step == 0
                         and 0 <= address - buf.data_ptr() < buf.shape[0] * step)
        return true_set(name, address)

    def recording(method, first):
        true = getattr(graphs, method)

        def run(*args):
            outs = true(*args)
            returned.append(all(isinstance(o, torch.Tensor) for o in outs[first:])
                            and all(isinstance(b, torch.Tensor) for b in batch._buf.t_kv + batch._buf.d_kv))
            return outs
        return run

    monkeypatch.setattr(graphs, "_upload", upload)
    monkeypatch.setattr(ctx, "set_tensor_address", set_address)
    monkeypatch.setattr(graphs, "target_batch", recording("target_batch", 2))
    monkeypatch.setattr(graphs, "drafter", recording("drafter", 1))
    sps = [SamplingParams(max_new_tokens=n) for n in (30, 12, 30, 9, 20)]
    reqs = [rt.submit(p, sp) for p, sp in zip(PROMPTS, sps)]
    while not rt.idle:
        rt.step()
    for req, ref, sp in zip(reqs, reference, sps):
        assert req.stats.tokens == ref[: sp.max_new_tokens]
    assert bound and all(bound), bound
    assert len(returned) > len(PROMPTS) and all(returned)
    small = {"inputs_embeds", "grid_rows", "cells", "position_ids", "past_bias", "block_bias", "ctx", "ctx_positions",
             "block_embeds", "block_positions", "key_bias", "hidden"}
    assert uploads and set(uploads) <= small, sorted(set(uploads) - small)
    assert batch.kv_bytes == 0


def test_more_sequences_than_the_batch_profiles_take_are_refused(pair):
    """B > max_batch: refused when the batch is made (naming the manifest and max_batch), and by the engine's profile
    itself when a call asks for it anyway."""
    eng, _, _, out, _ = pair
    with pytest.raises(DFlashError, match=f"exceed the batch engines' profiles.*at most {MAX_BATCH}") as e:
        BatchingRuntime(eng, max_batch=MAX_BATCH + 1)
    assert e.value.field == "max_batch" and "manifest.json" in str(e.value)
    from dflash_export.engines.tensorrt_batch import batch_graphs

    graphs = batch_graphs(eng)
    b, s, cap = MAX_BATCH + 1, 2, 16
    kv = np.zeros((b, graphs.t_kv_heads, cap, graphs.t_head_dim), np.float32)

    def feeds(b):  # b sequences of s rows each, packed
        return {"grid_rows": np.arange(b * s).reshape(b, s), "cells": np.arange(b * s),
                "inputs_embeds": np.zeros((1, b * s, graphs.mask_row.shape[0]), np.float32),
                "position_ids": np.tile(np.arange(s), (b, 1)), "past_bias": np.full((b, cap), -np.inf, np.float32),
                "block_bias": np.zeros((b, s, s), np.float32)}

    with pytest.raises(DFlashError, match=r"\(4, 2\) of grid_rows is outside profile 'batch_step'") as e:
        graphs.target_batch(feeds(b), [kv] * (2 * graphs.t_layers))
    assert e.value.field == "grid_rows"
    with pytest.raises(DFlashError, match="outside profile 'batch'"):
        graphs.lm_head(np.zeros((1, MAX_BATCH * eng.info.block_size + 1, graphs.mask_row.shape[0]), np.float32))
    # inside the profile, the same call runs
    hidden = graphs.target_batch(feeds(MAX_BATCH), [kv[:MAX_BATCH]] * (2 * graphs.t_layers))[0]
    assert hidden.shape == (1, MAX_BATCH * s, graphs.mask_row.shape[0])


def test_an_engine_built_without_the_batch_engines_gives_one_clear_error(pair, tmp_path, monkeypatch):
    """A directory from before the batch engines (no engines entry) or with an entry lacking its batch bound: one
    DFlashError naming manifest.json, the field and the rebuild; single-request decoding still runs."""
    from dflash_export.engines.manifest import validate_manifest
    from dflash_export.recipes import load_recipe
    from dflash_export.runtime.single import DFlashRuntime

    _, ort_eng, _, full, trt_backend = pair
    emulate_tensorrt(monkeypatch)
    old = emulated_engine_dir(tmp_path, load_recipe(ort_eng.info.recipe))  # as built before this change
    eng = load_engine(old, device="cpu")
    with pytest.raises(DFlashError, match="no batched engine target_batch.engine.*rebuild the engine") as e:
        BatchingRuntime(eng, max_batch=2)
    assert e.value.field == "engines.target_batch.engine" and str(old / "manifest.json") in str(e.value)
    assert len(DFlashRuntime(eng).generate([1, 2, 3], SamplingParams(max_new_tokens=4)).tokens) == 4
    eng.close()
    m = json.loads((full / "manifest.json").read_text())
    del m["engines"]["drafter_batch.engine"]["max_batch"]
    eng = trt_backend.TensorRTEngine(full, validate_manifest(m, full / "manifest.json"), device="cpu")
    with pytest.raises(DFlashError, match="records no batch bound") as e:
        BatchingRuntime(eng, max_batch=2)
    assert e.value.field == "engines.drafter_batch.engine.max_batch"
    eng.close()


def test_the_batched_engine_follows_the_engine_backend(pair):
    """`BatchingRuntime` gets ONNX Runtime's batched engine for an ONNX Runtime engine, TensorRT's for a TensorRT one,
    and one DFlashError naming the backend for an engine with no batched runner (the PyTorch reference)."""
    from dflash_export.engines.ort_batch import BatchedOrtEngine
    from dflash_export.engines.registry import batched_engine
    from dflash_export.engines.tensorrt_batch import BatchedTensorRTEngine

    eng, ort_eng, torch_eng, _, _ = pair
    assert type(batched_engine(ort_eng, 2)) is BatchedOrtEngine
    assert type(batched_engine(eng, 2)) is BatchedTensorRTEngine
    with pytest.raises(DFlashError, match="onnxruntime and tensorrt backends \\(got pytorch\\)") as e:
        BatchingRuntime(torch_eng, max_batch=2)
    assert e.value.field == "backend"


def test_deploy_takes_a_batch_bound_up_to_the_one_the_engines_were_built_for(pair, tmp_path, monkeypatch):
    """`deploy --max-batch N` on a TensorRT engine: N up to the build's bound writes the repository; one more, or a
    directory without the batch engines, is refused before anything is written, naming the manifest and the field."""
    from dflash_export.deploy import repository
    from dflash_export.deploy.repository import write_repository
    from dflash_export.recipes import load_recipe

    # the emulation stands in for tensorrt, which deploy records for the served engine
    versions = repository.library_versions
    monkeypatch.setattr(repository, "library_versions",
                        lambda names: {"tensorrt": "10.13.3.9", **versions(tuple(n for n in names if n != "tensorrt"))})
    _, ort_eng, _, full, _ = pair
    repo = write_repository(full, tmp_path / "repo", max_batch=MAX_BATCH)
    cfg = (repo / "dflash" / "config.pbtxt").read_text()
    assert 'key: "max_batch"' in cfg and f'string_value: "{MAX_BATCH}"' in cfg
    with pytest.raises(DFlashError, match=f"{MAX_BATCH + 1} sequences per call.*built for at most {MAX_BATCH}") as e:
        write_repository(full, tmp_path / "repo2", max_batch=MAX_BATCH + 1)
    assert e.value.field == "--max-batch" and str(full / "manifest.json") in str(e.value)
    assert not (tmp_path / "repo2").exists()
    emulate_tensorrt(monkeypatch)
    old = emulated_engine_dir(tmp_path, load_recipe(ort_eng.info.recipe))
    with pytest.raises(DFlashError, match="no batched engine target_batch.engine") as e:
        write_repository(old, tmp_path / "repo3", max_batch=2)
    assert e.value.field == "engines.target_batch.engine" and not (tmp_path / "repo3").exists()
    # `serve --engine` without --max-batch takes 8, or the build's bound where that is less (the repository it
    # writes is checked as `serve` would, against the emulated tensorrt's version).
    from importlib import metadata

    installed = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "10.13.3.9" if name == "tensorrt" else installed(name))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(repository, "_held_locks", [])
    cached, _ = repository.cached_repository(full)
    assert json.loads((cached / "dflash_repository.json").read_text())["max_batch"] == min(8, MAX_BATCH)
    repository._held_locks.pop().close()


def test_the_concurrency_bench_runs_on_a_tensorrt_engine(pair, monkeypatch):
    """`bench --concurrency --engine DIR` on a TensorRT engine directory (load_engine pinned to the emulation's
    device): both modes run at every level, each request's tokens equal to the same request run alone (that the
    batched tokens are the reference's is the test above)."""
    from dflash_export.bench import concurrency as bench_batch

    _, _, _, full, _ = pair
    monkeypatch.setattr(bench_batch, "load_engine", lambda d, **kw: load_engine(d, device="cpu", **kw))
    rep = bench_batch.run_concurrency(str(full), PROMPTS, 24, [1, MAX_BATCH], ["dflash", "ar"], threads=1)
    assert [(r["concurrency"], r["mode"]) for r in rep["levels"]] == [(1, "dflash"), (1, "ar"), (MAX_BATCH, "dflash"),
                                                                      (MAX_BATCH, "ar")]
    assert all(r["identical_to_alone"] == f"{len(PROMPTS)}/{len(PROMPTS)}" for r in rep["levels"])
    assert rep["divergences"] == []


def test_build_reuses_a_tensorrt_engine_only_for_the_batch_bound_it_was_built_for(pair, tmp_path, monkeypatch):
    """`build --backend tensorrt --max-batch N`: an engine whose batch engines were built for N (or no N asked) is
    reused; another N rebuilds with that bound; `--max-batch` on ONNX Runtime (bounded where it runs) is refused."""
    from dflash_export.engines import build as build_mod
    from dflash_export.recipes import load_recipe

    _, ort_eng, _, _, _ = pair
    recipe = load_recipe(ort_eng.info.recipe)
    root = tmp_path / "engines"
    emulate_tensorrt(monkeypatch)
    (root / recipe.name).mkdir(parents=True)
    d = emulated_engine_dir(root / recipe.name, recipe, max_batch=MAX_BATCH)
    build_mod._record_inputs(d, build_mod.recipe_inputs(recipe))
    assert build_mod.build_engine(recipe, "tensorrt", root, max_batch=MAX_BATCH).reused
    assert build_mod.build_engine(recipe, "tensorrt", root).reused
    calls = []

    def builder(recipe, engine_dir, **options):
        calls.append(options)
        raise DFlashError("stop here")

    monkeypatch.setattr(build_mod, "backend_builder", lambda name: builder)
    with pytest.raises(DFlashError, match="stop here"):
        build_mod.build_engine(recipe, "tensorrt", root, max_batch=MAX_BATCH + 1)
    assert calls == [{"max_batch": MAX_BATCH + 1}]
    with pytest.raises(DFlashError, match=r"build time \(tensorrt\), not onnxruntime") as e:
        build_mod.build_engine(recipe, "onnxruntime", root, max_batch=4)
    assert e.value.field == "--max-batch"


def test_plain_op_batch_graphs_keep_rmsnorm_statistics_in_the_fp32_island(pair):
    """The plain-op RMSNorms carry the builder's fp32_island names, so the float16 copy TensorRT 11 would build
    (export/half.py) squares and averages in float32; the copy keeps the graph's I/O types."""
    import onnx

    from dflash_export.engines.tensorrt_batch import BATCH_FILES
    from dflash_export.export.builder import FP32_ISLAND
    from dflash_export.export.half import half_graph

    out = pair[3] / "onnx"
    normed = set()
    for graph, (_, plain, _) in BATCH_FILES.items():
        model = onnx.load(str(out / plain))
        means = [n for n in model.graph.node if n.op_type == "ReduceMean"]
        assert all(n.name.startswith(FP32_ISLAND) for n in means), graph
        if means:
            normed.add(graph)
        half = half_graph(model)
        assert [i.type.tensor_type.elem_type for i in half.graph.input] == \
            [i.type.tensor_type.elem_type for i in model.graph.input], graph
        assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in half.graph.initializer), graph
    assert normed >= {"target_batch", "drafter_batch"}
