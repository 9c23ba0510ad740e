"""Building an ONNX Runtime engine directory: export the recipe's pair, optimize the graphs with ORT and save them,
quantize them block-wise when asked, and write the files `engines/onnxruntime.OrtEngine` opens (its module docstring
describes the directory). Imports torch (to export); serving never imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from dflash_export.engines.base import load_codec
from dflash_export.engines.manifest import hash_inputs, write_manifest
from dflash_export.engines.onnxruntime import (
    DRAFT_HEAD,
    DRAFTER,
    ENGINE_FORMAT,
    HEAD,
    SELECTOR_FILES,
    SHARED,
    TARGET,
    TARGET_BATCH,
    _ort,
    default_threads,
)
from dflash_export.engines.row_pad import pad_in_graph, padded_ops, unpad_graph
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.export import (
    ORT_DRAFT_HEAD_FILE,
    ORT_DRAFTER_FILE,
    ORT_HEAD_FILE,
    ORT_TARGET_BATCH_FILE,
    ORT_TARGET_FILE,
    SHARED_FILE,
    export_models,
)
from dflash_export.files import atomic_dir, check_output_dir, is_engine_dir, native_path, removing_new_dirs
from dflash_export.models.sources import resolve_source
from dflash_export.recipes import PRECISIONS

_stage_reporter = None  # set by the CLI (build's progress line); None: silent


def report_stages(fn) -> None:
    """Have each long step of the build named to `fn(text)` as it starts (None: silent)."""
    global _stage_reporter
    _stage_reporter = fn


def stage(text: str, new: bool = True) -> None:
    """Name a step to the reporter: `new` a step that starts, else the progress of the running one (the CLI updates
    its status line without logging a line)."""
    if _stage_reporter is not None:
        _stage_reporter(text, new)


class _QuantProgress(logging.Handler):
    """Counts MatMulNBitsQuantizer's per-node records ("start to quantize NODE ...") into the running step's status:
    nodes done of `total` and the time left at the rate so far (its nodes are alike within a graph)."""

    def __init__(self, label: str, total: int):
        super().__init__(logging.INFO)
        self.label, self.total, self.done, self.t0 = label, total, 0, time.monotonic()

    def emit(self, record):
        msg = record.getMessage()
        if not msg.startswith("start to quantize ") or msg.startswith("start to quantize model"):
            return
        if self.done:
            left = (time.monotonic() - self.t0) / self.done * (self.total - self.done)
            stage(f"{self.label}: {self.done}/{self.total} MatMuls, about {left:.0f} s left", new=False)
        self.done += 1


def build_onnxruntime(recipe, out_dir, threads: int | None = None, draft_vocab: int | None = None,
                      precision: str | None = None, drafter_precision: str | None = None,
                      quantize_heads: bool | None = None) -> Path:
    """Export the recipe's pair, optimize its graphs for ONNX Runtime and write a complete engine directory.

    `draft_vocab`: draft among the first N token ids only (cheaper drafting, same lossless output; see OrtEngine).
    `precision` / `drafter_precision` (default: the recipe's): "fp32", "int8" or "int4" weights for the target and
    the drafter graphs (see `quantize_graph`); `quantize_heads` (default QUANTIZE_HEADS): the LM head follows the
    target's precision and the draft head the drafter's, else both heads stay fp32.

    Written in a temporary sibling and renamed when complete (errors.atomic_dir). Returns `out_dir`.
    """
    ort = _ort()
    out_dir = Path(out_dir)
    check_output_dir(out_dir, command="build", is_previous_output=is_engine_dir, replaced=True)
    if draft_vocab is not None and draft_vocab < 2:
        raise DFlashError(f"must be >= 2, got {draft_vocab}", path=recipe.path, field="draft_vocab")
    # The CPU backend computes in float32 whatever the checkpoint's dtype (a bfloat16 / float16 checkpoint is widened,
    # exactly); `--precision int8 / int4` quantizes the weights from there. The manifest records both.
    stage("loading the target and the drafter")
    target, drafter, spec, draft_vocab = _load_pair(recipe, draft_vocab)
    if recipe.decoding.static_ngrams:  # its answers are to the recipe's training prompts: checked before any export
        from dflash_export.train.data import check_prompt_source

        check_prompt_source(recipe, target.model_dir)
    dspec = drafter.spec(recipe.block_size)
    precisions = graph_precisions(recipe, precision, drafter_precision, quantize_heads)
    if drafter.config.is_dflash2 and draft_vocab is not None:
        raise DFlashError("a draft vocabulary would change DFlash 2's top-k candidates (z-lab takes them over the "
                          "whole vocabulary)", path=recipe.path, field="draft_vocab")
    with removing_new_dirs(out_dir), atomic_dir(out_dir, what="the engine") as tmp:
        stage("exporting and optimizing the graphs")
        res, manifest_shared = _export_optimized(ort, recipe, target, drafter, tmp, dspec.block_size, draft_vocab,
                                                 threads)
        quantization = _quantize_graphs(tmp, precisions, manifest_shared)
        # The target's attention (and, where this CPU needs it, its products: below) can then run a one-token step
        # as more rows without its norms doing so (engines/row_pad.py); whether that keeps plain steps equal to
        # verify rows is the probe's to say.
        pad_in_graph(tmp / TARGET, products=False)
        copy_tokenizer(target, drafter, tmp)
        selector = _save_selector(drafter, tmp)
        manifest = _ort_manifest(recipe, target, drafter, spec, dspec, precisions, quantization, draft_vocab, res,
                                 manifest_shared)
        if selector:
            manifest["selector"] = selector
        if recipe.decoding.static_ngrams:
            manifest["static_ngrams"] = _static_index(recipe, target, tmp)
        write_manifest(tmp, manifest)
        stage("probing this CPU's kernels (verify rows against plain steps)")
        choose_graph_padding(tmp, manifest, threads)
    return out_dir


def choose_graph_padding(engine_dir: Path, manifest: dict, threads: int | None) -> None:
    """Probe the engine on this CPU with its target padding attention alone in the graph; where that is not
    bit-identical at the floor the probe needs (a product's one-row kernel differs here: int4 MatMulNBits on AVX2),
    pad the products too and probe again. Records the floor, the verdict and what the graph pads in the manifest."""
    numerics = _record_numerics(engine_dir, manifest, threads)
    target = engine_dir / TARGET
    if numerics.row_floor > 1 and numerics.row_pad != "graph" and padded_ops(target) == ["GroupQueryAttention"]:
        stage("a product's one-row kernel differs on this CPU: padding the products in the graph too")
        unpad_graph(target)
        pad_in_graph(target, products=True)
        write_manifest(engine_dir, manifest)  # the files' hashes as they now are
        _record_numerics(engine_dir, manifest, threads)


def _record_numerics(engine_dir: Path, manifest: dict, threads: int | None):
    """Probe the finished engine on this CPU (engines/numerics.py) and record the row floor it found and the verdict,
    with the CPU's features, in the manifest: what a load on the same CPU then confirms first."""
    from dflash_export.engines.manifest import read_manifest
    from dflash_export.engines.onnxruntime import OrtEngine

    engine = OrtEngine(engine_dir, read_manifest(engine_dir), threads=threads, release_pages=False, probe_full=True)
    try:
        numerics = engine.numerics
    finally:
        engine.close()
    manifest["flags"]["plain_step_rows"] = numerics.row_floor
    manifest["flags"]["row_pad_ops"] = padded_ops(engine_dir / TARGET)
    manifest["numerics"] = numerics.to_json()
    write_manifest(engine_dir, manifest)
    return numerics


def _static_index(recipe, target, tmp: Path) -> dict:
    """The static n-gram index of the target's own greedy answers to the recipe's training prompts, stored in the
    engine (decoding/static_ngrams.py); returns the manifest's `static_ngrams` field."""
    from dflash_export.decoding.static_ngrams import StaticNgramIndex, store_static_index
    from dflash_export.train.own_answers import static_index_answers

    opts = recipe.decoding
    stage(f"indexing the target's own answers to {opts.static_prompts} training prompts (static n-grams)")
    answers = static_index_answers(target, recipe.train, opts.static_prompts, chat_template=recipe.chat_template)
    index = StaticNgramIndex.from_answers(answers, max_entries=opts.static_entries)
    return store_static_index(tmp, index, len(answers), sum(len(a) for a in answers))


def _load_pair(recipe, draft_vocab: int | None):
    """The recipe's target and drafter in float32, checked to fit each other; the target's spec; the draft
    vocabulary checked against it (None when it is the whole vocabulary: the ordinary head serves)."""
    import torch

    from dflash_export.export.graph import target_spec
    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.drafter import check_drafter_fits

    target = load_target(recipe.target_path, torch.float32)
    drafter = load_drafter(recipe.drafter_path, torch.float32)
    check_drafter_fits(drafter, target, str(resolve_source(recipe.drafter_path)))
    recipe.drafted_block(drafter.config.block_size)
    load_codec(target.model_dir)  # the tokenizer files the engine will copy, named where they are, before any work
    spec = target_spec(target)
    if spec.head_dim % 16:  # checked by the kernel only when it first runs: after minutes of export, as a crash
        raise DFlashError(f"{spec.head_dim}, but the onnxruntime engine's target attention is ONNX Runtime's "
                          "GroupQueryAttention, which takes head sizes that are multiples of 16 only (published "
                          "Qwen3 / LLaMA models have 64 or 128)", path=Path(target.model_dir) / "config.json",
                          field="head_dim")
    if draft_vocab is not None and draft_vocab > spec.vocab_size:
        raise DFlashError(f"must be <= the target vocabulary ({spec.vocab_size}), got {draft_vocab}",
                          path=recipe.path, field="draft_vocab")
    if draft_vocab is not None and draft_vocab == spec.vocab_size:
        draft_vocab = None  # the whole vocabulary: the ordinary head serves
    return target, drafter, spec, draft_vocab


def _export_optimized(ort, recipe, target, drafter, tmp: Path, bs: int, draft_vocab: int | None,
                      threads: int | None):
    """Export the pair's ORT graphs under `tmp`/export, optimize each into `tmp` and move the shared weights there.
    Returns the export result and the shared tensors' layout."""
    export_dir = tmp / "export"
    export_dir.mkdir()
    res = export_models(target, drafter, export_dir, recipe_name=recipe.name, block_size=bs,
                        max_len=recipe.max_seq_len, logits_atol=recipe.thresholds.logits_atol,
                        ctx_atol=recipe.thresholds.ctx_atol, ort_flavor=True, draft_vocab=draft_vocab)
    manifest_shared = _shared_layout(export_dir / ORT_HEAD_FILE, export_dir / "target_verify.onnx")
    # Optimize each graph once, now, and save the result: loads then skip optimization entirely.
    graphs = [(ORT_TARGET_FILE, TARGET), (ORT_DRAFTER_FILE, DRAFTER), (ORT_HEAD_FILE, HEAD),
              (ORT_TARGET_BATCH_FILE, TARGET_BATCH)]
    if draft_vocab:
        graphs.append((ORT_DRAFT_HEAD_FILE, DRAFT_HEAD))
    for src, dst in graphs:
        if not (export_dir / src).is_file():  # a graph this export did not write
            continue
        _optimize(ort, export_dir / src, tmp / dst, export_dir / SHARED_FILE, manifest_shared, threads)
    shutil.move(str(export_dir / SHARED_FILE), str(tmp / SHARED))
    shutil.rmtree(export_dir)
    return res, manifest_shared


def _quantize_graphs(tmp: Path, precisions: dict[str, str], manifest_shared: dict) -> dict:
    """Quantize every graph whose role is not fp32 (heads first rewritten as MatMuls); returns what each got."""
    quantization = {}
    for fname, role in ((TARGET, "target"), (DRAFTER, "drafter"), (HEAD, "lm_head"), (DRAFT_HEAD, "draft_head"),
                        (TARGET_BATCH, "target")):
        if (tmp / fname).is_file() and precisions[role] != "fp32":
            if role in ("lm_head", "draft_head"):
                _head_as_matmul(tmp / fname, tmp / SHARED, manifest_shared)
            stage(f"quantizing {fname} to {precisions[role]}")
            quantization[role] = quantize_graph(tmp / fname, precisions[role])
    return quantization


def _save_selector(drafter, tmp: Path) -> dict | None:
    """DFlash 2: save the selector's two codebooks (the walk over the top-k runs on the host with them) and return
    the manifest's `selector`; None for a DFlash drafter."""
    if not drafter.config.is_dflash2:
        return None
    sel = drafter.candidate_selector
    for fname, table in ((SELECTOR_FILES[0], sel.predecessor_codebook), (SELECTOR_FILES[1],
                                                                          sel.successor_codebook)):
        np.save(tmp / fname, table.weight.detach().float().numpy())
    return {"top_k": drafter.config.selector_top_k, "rank": drafter.config.selector_rank}


def _ort_manifest(recipe, target, drafter, spec, dspec, precisions: dict[str, str], quantization: dict,
                  draft_vocab: int | None, res, manifest_shared: dict) -> dict:
    """The engine's manifest fields (write_manifest adds the files' hashes and the versions)."""
    return {
        "backend": "onnxruntime",
        "engine_format": ENGINE_FORMAT,
        "recipe": recipe.name,
        "recipe_path": str(recipe.path) if recipe.path else recipe.name,
        "inputs": hash_inputs([p for p in (recipe.path, target.model_dir, resolve_source(recipe.drafter_path))
                               if p]),
        "block_size": dspec.block_size,
        "target_layer_ids": list(dspec.target_layer_ids),
        "mask_token_id": dspec.mask_token_id,
        "max_seq_len": recipe.max_seq_len,
        "stop_token_ids": list(target.stop_token_ids),
        "vocab_size": spec.vocab_size,
        "dtypes": {"weights": "float32" if set(precisions.values()) == {"fp32"} else "mixed",
                   "activations": "float32", "kv_cache": "float32", "checkpoint": recipe.dtype},
        "precision": precisions,
        "quantization": quantization,
        "flags": {"graphs": "ort", "graph_optimization": "ORT_ENABLE_EXTENDED", "kv_cache": "in-place GQA buffer",
                  "lm_head": "own session, prepacked", "draft_vocab": draft_vocab,
                  "tree_verify": True,  # the target graph takes position_ids + attention_bias (whole draft trees)
                  # the first row floor the numerics probe tries (_record_numerics then records the one it found)
                  "plain_step_rows": 1 if precisions["target"] == "fp32" and precisions["lm_head"] == "fp32" else 2,
                  **STEP_COSTS.get((precisions["target"], precisions["drafter"]), {}),
                  **MOE_VERIFY_COSTS.get((target.arch.model_type, precisions["target"]), {}),
                  "export": res.metadata},
        "optimized": True,
        "shared_tensors": manifest_shared,
        "shapes": {"target_layers": spec.num_layers, "target_kv_heads": spec.num_kv_heads,
                   "target_head_dim": spec.head_dim, "drafter_layers": drafter.config.num_hidden_layers,
                   "drafter_kv_heads": drafter.config.num_key_value_heads,
                   "drafter_head_dim": drafter.config.head_dim},
        "export_seconds": round(res.seconds, 2),
        "decoding": dataclasses.asdict(recipe.decoding),
    }


# Block-wise weight quantization by ONNX Runtime's own MatMulNBitsQuantizer: every MatMul with a constant weight becomes
# a MatMulNBits node (weights in blocks of QUANT_BLOCK along K, one fp32 scale each, symmetric: like llama.cpp's Q4_0 /
# Q8_0). Symmetric int4 because the integer zero point of the asymmetric format cannot hold a Q4_1 block's float
# minimum: on SmolLM2 (a dequantized Q4_1 GGUF) asymmetric int4 shifted whole blocks and its logits correlated 0.88
# with fp32, symmetric 0.92 (float zero points, HQQ, lose the int8 kernels). accuracy_level 4 = int8 activations,
# integer dot products (VNNI / AMX on x86). Whether a row comes out bit-identical whatever the number of rows is a
# property of the CPU (on AVX-512 VNNI yes for M >= 1; on AVX2 int4's one-row kernel differs from its M > 1 rows):
# the engine probes it at build and load (engines/numerics.py) and pads short steps to the row floor that agrees.
QUANT_BLOCK = 32


QUANT_ACCURACY_LEVEL = 4


QUANT_SYMMETRIC = {"int8": True, "int4": True}


QUANT_BITS = {"int8": 8, "int4": 4}


# Whether the LM head (target) and the draft head (drafter) are quantized with their graphs by default. Measured on
# SmolLM2 int4, interleaved in one process on the loaded 2-core machine: the int4 head on two rows took 11.3 ms against
# the fp32 head's 43.7 (medians of 190), a whole step 41 ms against 52; it moves the logits little next to the body
# (correlation with fp32 0.918 against 0.930 with an fp32 head). So the heads follow their graph's precision.
QUANTIZE_HEADS = True


# The adaptive verification's cost model per (target, drafter) precision, in plain (two-row) steps, measured by
# benchmarks/engine_costs.py on SmolLM2 (README): int8 rows cost more than fp32's, int4's most (its int8 kernel runs
# row by row). Engines without an entry use the runtime's fp32 defaults (0.07, 0.3).
STEP_COSTS = {("int8", "int8"): {"verify_token_cost": 0.1, "draft_cost": 0.37},
              ("int4", "int4"): {"verify_token_cost": 0.25, "draft_cost": 0.44}}


# Mixture-of-experts targets: a verify block reads the union of its rows' experts, so each verified row costs more
# than in a dense target. Measured by benchmarks/moe_costs.py at the published per-layer shapes (Qwen3-30B-A3B,
# gpt-oss-20b; random routing, the layers only: an upper bound for a whole model), (verify(16) / step - 1) / 15,
# on a 2-core AMD EPYC with AVX2 (docs/targets.md). Replaces STEP_COSTS's verify_token_cost for those targets.
MOE_VERIFY_COSTS = {("qwen3_moe", "fp32"): {"verify_token_cost": 0.26},
                    ("qwen3_moe", "int8"): {"verify_token_cost": 0.32},
                    ("qwen3_moe", "int4"): {"verify_token_cost": 0.38},
                    ("gpt_oss", "fp32"): {"verify_token_cost": 0.30},
                    ("gpt_oss", "int8"): {"verify_token_cost": 0.31},
                    ("gpt_oss", "int4"): {"verify_token_cost": 0.33}}


def graph_precisions(recipe, precision: str | None = None, drafter_precision: str | None = None,
                     quantize_heads: bool | None = None) -> dict[str, str]:
    """The weight precision of each graph of the engine: target, drafter, lm_head, draft_head."""
    target = precision or getattr(recipe, "precision", None) or "fp32"
    draft = drafter_precision or (getattr(recipe, "drafter_precision", None) if precision is None else None) or target
    for value, name in ((target, "precision"), (draft, "drafter_precision")):
        if value not in PRECISIONS:
            raise DFlashError(f"{value!r} is not one of {', '.join(PRECISIONS)}", path=recipe.path, field=name)
    heads = QUANTIZE_HEADS if quantize_heads is None else quantize_heads
    return {"target": target, "drafter": draft, "lm_head": target if heads else "fp32",
            "draft_head": draft if heads else "fp32"}


def _head_as_matmul(path: Path, shared_path: Path, shared: dict) -> None:
    """Rewrite an LM-head graph (Gemm transB over the shared [V,H] table, or over its own draft_head rows) as one
    MatMul over its own [H,V] weight, the form MatMulNBitsQuantizer quantizes. Metadata and I/O are kept."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    gemm = [n for n in model.graph.node if n.op_type == "Gemm"]
    if len(gemm) != 1:
        raise DFlashError(f"expected one Gemm in the LM-head graph, found {len(gemm)}", path=path)
    wname = gemm[0].input[1]
    if wname in shared:
        e = shared[wname]
        w = np.fromfile(shared_path, np.float32, count=e["length"] // 4, offset=e["offset"]).reshape(e["shape"])
    else:
        init = next(t for t in model.graph.initializer if t.name == wname)
        with native_path(path) as name:  # its external data, beside it
            w = numpy_helper.to_array(init, base_dir=os.path.dirname(name))
    g = model.graph
    hidden, logits = g.input[0], g.output[0]
    node = helper.make_node("MatMul", [hidden.name, "lm_head_weight"], [logits.name], name="lm_head_matmul")
    new_graph = helper.make_graph([node], g.name, [hidden], [logits],
                                  [numpy_helper.from_array(np.ascontiguousarray(w.T), "lm_head_weight")])
    new = helper.make_model(new_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    new.metadata_props.extend(model.metadata_props)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    with native_path(path) as name:
        onnx.save_model(new, name, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                        size_threshold=1024)


def quantize_graph(path: Path, precision: str) -> dict:
    """Quantize every MatMul of the saved graph `path` (weights in `path`.data) in place with ONNX Runtime's
    MatMulNBitsQuantizer; returns the settings for the manifest."""
    import onnx

    from dflash_export.export.moe import quantize_moe_experts

    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )
    except ImportError as e:
        raise MissingDependency(f"quantized engines need onnxruntime's quantization tools ({e.name}): "
                                "pip install 'dflash-export[onnx]'", field="precision") from None
    bits, sym = QUANT_BITS[precision], QUANT_SYMMETRIC[precision]
    with native_path(path) as name:
        model = onnx.load(name)
    n_matmul = sum(n.op_type == "MatMul" for n in model.graph.node)
    config = DefaultWeightOnlyQuantConfig(block_size=QUANT_BLOCK, is_symmetric=sym,
                                          accuracy_level=QUANT_ACCURACY_LEVEL, bits=bits)
    quant_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, propagate = quant_log.level, quant_log.propagate
    # It logs one INFO record per node: counted for the progress line, kept off the terminal.
    counter = _QuantProgress(f"quantizing {path.name} to {precision}", n_matmul)
    quant_log.setLevel(logging.INFO)
    quant_log.propagate = False
    quant_log.addHandler(counter)
    try:
        quantizer = MatMulNBitsQuantizer(model, algo_config=config)
        quantizer.process()
    finally:
        quant_log.removeHandler(counter)
        quant_log.setLevel(level)
        quant_log.propagate = propagate
    out = quantizer.model.model
    n_quant = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    experts = quantize_moe_experts(out, bits, QUANT_BLOCK, QUANT_ACCURACY_LEVEL)  # MoE -> QMoE: the experts' bytes
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    with native_path(path) as name:
        onnx.save_model(out, name, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                        size_threshold=1024)
    return {"quantizer": "onnxruntime.quantization.MatMulNBitsQuantizer", "op": "com.microsoft.MatMulNBits",
            "bits": bits, "block_size": QUANT_BLOCK, "symmetric": sym, "accuracy_level": QUANT_ACCURACY_LEVEL,
            "matmuls_quantized": n_quant, "matmuls_total": n_matmul,
            **({"moe_op": "com.microsoft.QMoE", **experts} if experts["moe_total"] else {})}


def _shared_layout(*model_paths: Path) -> dict[str, dict]:
    """Where each shared tensor sits in shared_weights.bin (read from the graphs' external-data entries)."""
    import onnx

    out = {}
    for model_path in model_paths:
        model = onnx.load(str(model_path), load_external_data=False)
        for t in model.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if ext.get("location") == SHARED_FILE:
                out[t.name] = {"offset": int(ext["offset"]), "length": int(ext["length"]), "shape": list(t.dims)}
    return out


def _optimize(ort, src: Path, dst: Path, shared_path: Path, shared: dict, threads: int | None) -> None:
    """Run ORT's graph optimizations on `src` and save the optimized model as `dst` (weights in `dst`.data).

    The shared tensors are supplied as user initializers so they are neither copied into the optimized file nor
    folded into other constants; the saved graph keeps referring to them by name.
    """
    so = ort.SessionOptions()
    # EXTENDED, not ALL: ALL adds layout transforms tied to this CPU's instruction set, unsafe to save and reload.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.intra_op_num_threads = threads or default_threads()
    raw = np.fromfile(shared_path, dtype=np.uint8)
    keep = []
    for name, e in shared.items():
        arr = raw[e["offset"]: e["offset"] + e["length"]].view(np.float32).reshape(e["shape"])
        val = ort.OrtValue.ortvalue_from_numpy(arr)
        keep.append(val)
        so.add_initializer(name, val)
    with native_path(src) as src_name, native_path(dst) as dst_name:
        so.optimized_model_filepath = dst_name
        ort.InferenceSession(src_name, so, providers=["CPUExecutionProvider"])
    _relink_shared(dst, shared)


def _relink_shared(model_path: Path, shared: dict) -> None:
    """ORT writes the user-supplied shared tensors into the optimized model's own data file; point them back at
    shared_weights.bin instead and rewrite the data file without them (one copy on disk for both graphs)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    data = model_path.with_name(model_path.name + ".data")
    new = model_path.with_name(model_path.name + ".data.tmp")
    raw = np.memmap(data, dtype=np.uint8, mode="r") if data.is_file() else None
    align = 64
    with open(new, "wb") as f:
        for t in model.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if t.name in shared:
                e = shared[t.name]
                ext = {"location": SHARED, "offset": str(e["offset"]), "length": str(e["length"])}
            elif ext.get("location") == data.name:
                off, length = int(ext["offset"]), int(ext["length"])
                pad = (-f.tell()) % align
                f.write(b"\0" * pad)
                ext["offset"] = str(f.tell())
                f.write(raw[off: off + length].tobytes())
            else:
                continue
            del t.external_data[:]
            for k, v in ext.items():
                entry = t.external_data.add()
                entry.key, entry.value = k, v
    del raw
    os.replace(new, data)
    onnx.save_model(model, str(model_path))


def copy_tokenizer(target, drafter, dst: Path) -> None:
    src = Path(target.model_dir)
    if (src / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
    else:  # tiny random pairs: byte codec, the mask id reserved
        codec = {"vocab_size": int(target.vocab_size), "reserved": [int(drafter.config.mask_token_id)]}
        (dst / "codec.json").write_text(json.dumps(codec) + "\n", encoding="utf-8")
