"""ONNX export of a recipe's pair: `target_verify.onnx` (feature-fused target + FusedVerify) and `drafter.onnx`
(KVInjectedBlockAttention layers), with the custom ops carried as model-local functions.

Files written (all in one directory):
  target_verify.onnx + target_verify.onnx.data     the target graph and its weights
  drafter.onnx + drafter.onnx.data                 the drafter graph and its weights
  shared_weights.bin                               embedding (+ LM head when untied), referenced by both graphs

Sharing decision: the embedding / LM head live once on disk, in `shared_weights.bin`, referenced by both graphs'
external data, so each file still runs standalone in plain ONNX Runtime and nothing is duplicated on disk. In memory,
the ORT engine (engines/onnxruntime.py) keeps one copy: its target and drafter graphs take embeddings as inputs
(rows read from that file on demand) and a single LM-head session owns the head matrix. Handing one buffer to both
sessions as a user initializer (SessionOptions.add_initializer) was tried first: it also holds one copy, but ORT cannot
prepack a user initializer, which made the 8-16 row LM head of verify ~1.6x slower (measured).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_export import __version__
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_dir, check_output_dir, native_path, removing_new_dirs
from dflash_export.models.rope import rope_problem
from dflash_export.models.sources import resolve_source

TARGET_FILE = "target_verify.onnx"
DRAFTER_FILE = "drafter.onnx"
SHARED_FILE = "shared_weights.bin"
FORMAT_VERSION = "1"


@dataclass
class ExportResult:
    out_dir: Path
    target_path: Path
    drafter_path: Path
    metadata: dict[str, str]
    seconds: float
    file_sizes: dict[str, int] = field(default_factory=dict)


def export_metadata(recipe_name: str, drafter, spec, max_len: int, logits_atol: float = 1e-4,
                    ctx_atol: float = 1e-4) -> dict[str, str]:
    """Runtime-critical facts written into each model so a file describes itself (values are strings, as ONNX wants)."""
    from dflash_export.export import ops

    c = drafter.config
    return {
        "dflash.format_version": FORMAT_VERSION,
        "dflash.recipe": recipe_name,
        **spec.contract_metadata(max_len),
        "dflash.opset": str(ops.ONNX_OPSET),
        "dflash.logits_atol": repr(float(logits_atol)),
        "dflash.ctx_atol": repr(float(ctx_atol)),
        "dflash.drafter_layers": str(c.num_hidden_layers),
        # z-lab 0.1.0's drafter keys, so the graphs describe what they compute (the ORT engine applies the last two
        # to the LM head's output)
        "dflash.input_embedding_scale": repr(spec.input_embedding_scale),
        "dflash.output_multiplier": repr(spec.output_multiplier),
        "dflash.final_logit_softcapping": json.dumps(spec.final_logit_softcapping),
        "dflash.attention": json.dumps([{"causal": c.layer_causal(i), "window": c.layer_window(i)}
                                        for i in range(c.num_hidden_layers)]),
        # DFlash 2: the drafter graph also outputs selector_hidden; the walk over the top-k runs on the host
        "dflash.selector_top_k": str(c.selector_top_k),
    }


def export_models(target, drafter, out_dir: Path, *, recipe_name: str = "", block_size: int | None = None,
                  max_len: int = 2048, logits_atol: float = 1e-4, ctx_atol: float = 1e-4,
                  ort_flavor: bool = False, draft_vocab: int | None = None) -> ExportResult:
    """Write both graphs for loaded (fp32) models into an existing, empty `out_dir`; checker + shape inference run.

    `ort_flavor` also writes the ONNX Runtime engine's graphs (fused contrib ops; embeddings in, hidden states out, one
    LM-head graph for both), sharing the data files: target_verify_ort.onnx, drafter_ort.onnx, lm_head_ort.onnx,
    target_batch_ort.onnx (the target for B sequences verifying blocks in one call); with
    `draft_vocab`, also draft_head_ort.onnx (an LM head over the first `draft_vocab` ids, for drafting only).
    """
    import onnx

    from dflash_export.export import builder, graph
    from dflash_export.models.drafter import check_drafter_fits

    check_drafter_fits(drafter, target)  # a misfit would otherwise surface as a shape-inference error on a temp file
    t_rope = dict(getattr(target.hf.config, "rope_parameters", None) or {})
    # The graphs carry fixed cos/sin tables: a length-dependent RoPE cannot follow. Hybrids rotate part of each head.
    problem = rope_problem(t_rope, partial_ok=target.arch.hybrid is not None)
    if problem:
        raise DFlashError(f"target {problem[1]}", path=target.model_dir / "config.json", field=problem[0])
    if ort_flavor:  # before any graph is written
        graph.check_batched_windows(target, drafter.config.block_size)
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    spec = drafter.spec(block_size)
    meta = export_metadata(recipe_name, drafter, spec, max_len, logits_atol, ctx_atol)
    shared_store = builder.WeightStore(out_dir / SHARED_FILE)
    t_store = builder.WeightStore(out_dir / (TARGET_FILE + ".data"))
    d_store = builder.WeightStore(out_dir / (DRAFTER_FILE + ".data"))
    try:
        outputs = [(TARGET_FILE, "target", "portable", t_store), (DRAFTER_FILE, "drafter", "portable", d_store)]
        if ort_flavor:
            outputs += [(ORT_TARGET_FILE, "target", "ort", t_store), (ORT_DRAFTER_FILE, "drafter", "ort", d_store),
                        (ORT_HEAD_FILE, "head", "ort", d_store)]
            outputs.append((ORT_TARGET_BATCH_FILE, "target", "ort_batch", t_store))
        if ort_flavor and draft_vocab:
            outputs.append((ORT_DRAFT_HEAD_FILE, "draft_head", "ort", d_store))
        for fname, kind, flavor, store in outputs:
            if kind == "drafter":
                model, inits, shared = graph.build_drafter_graph(target, drafter, max_len, flavor, store)
            elif kind == "head":
                model, inits, shared = graph.build_head_graph(target, None, store)
            elif kind == "draft_head":
                model, inits, shared = graph.build_head_graph(target, draft_vocab, store)
            else:
                model, inits, shared = graph.build_target_graph(target, drafter, max_len, flavor, store)
            builder.place_weights(model, inits, store, shared_store, shared)
            del inits
            onnx.helper.set_model_props(model, {**meta, "dflash.graph": fname, "dflash.flavor": flavor})
            onnx.save_model(model, str(out_dir / fname))
    finally:
        for s in (shared_store, t_store, d_store):
            s.close()
    for fname in (TARGET_FILE, DRAFTER_FILE):
        validate_file(out_dir / fname)
    sizes = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()}
    return ExportResult(out_dir, out_dir / TARGET_FILE, out_dir / DRAFTER_FILE, meta, time.perf_counter() - t0, sizes)


ORT_TARGET_FILE = "target_verify_ort.onnx"
ORT_DRAFTER_FILE = "drafter_ort.onnx"
ORT_HEAD_FILE = "lm_head_ort.onnx"
ORT_DRAFT_HEAD_FILE = "draft_head_ort.onnx"
ORT_TARGET_BATCH_FILE = "target_batch_ort.onnx"  # B sequences verifying blocks in one call (engines/ort_batch.py)


def validate_file(path: Path) -> None:
    """onnx.checker (full, external data resolved) + shape inference; failures name the file."""
    import onnx

    try:
        with native_path(path) as name:
            onnx.checker.check_model(name, full_check=True)
    except onnx.checker.ValidationError as e:
        raise DFlashError(f"onnx.checker failed: {str(e).splitlines()[0]}", path=path) from None
    except onnx.shape_inference.InferenceError as e:
        raise DFlashError(f"shape inference failed: {str(e).splitlines()[0]}", path=path) from None


EXPORT_MARKER = "export.json"  # written last into every `export` directory: what may later be replaced


def _export_file_names() -> set[str]:
    names = {TARGET_FILE, DRAFTER_FILE, SHARED_FILE, ORT_TARGET_FILE, ORT_DRAFTER_FILE, ORT_HEAD_FILE,
             ORT_DRAFT_HEAD_FILE, ORT_TARGET_BATCH_FILE, EXPORT_MARKER}
    return names | {n + ".data" for n in names if n.endswith(".onnx")}


def is_export_dir(d) -> bool:
    """Whether directory `d` is an earlier output of `export` (its marker file, or, for exports written before the
    marker existed, nothing but the files an export writes): only such a directory may be replaced."""
    d = Path(d)
    try:
        marker = json.loads((d / EXPORT_MARKER).read_text(encoding="utf-8"))
        if isinstance(marker, dict) and marker.get("tool") == "dflash-export" and marker.get("command") == "export":
            return True
    except (OSError, ValueError):
        pass
    try:
        names = {p.name for p in d.iterdir()}
    except OSError:
        return False
    return bool(names) and TARGET_FILE in names and names <= _export_file_names() and \
        all((d / n).is_file() for n in names)


def export_recipe(recipe, out_dir, ort_flavor: bool = False) -> ExportResult:
    """Load the recipe's target and drafter (fp32), write both graphs to `out_dir` atomically, and check them.
    `ort_flavor`: also the "ort" flavor graphs (see `export_models`; the TensorRT build compiles its batch engines
    from plain-op copies of them).

    An existing `out_dir` is replaced only when it is an earlier export (see `is_export_dir`); a drafter that does not
    fit the target is refused, naming the drafter and the field, before anything is written.
    """
    import torch

    from dflash_export.models import load_target
    from dflash_export.models.checkpoint import load_drafter
    from dflash_export.models.drafter import check_drafter_fits

    out_dir = Path(out_dir)
    check_output_dir(out_dir, command="export", is_previous_output=is_export_dir, replaced=True)
    target = load_target(recipe.target_path, torch.float32)
    drafter = load_drafter(recipe.drafter_path, torch.float32)
    check_drafter_fits(drafter, target, str(resolve_source(recipe.drafter_path)))
    recipe.drafted_block(drafter.config.block_size)
    th = recipe.thresholds
    with removing_new_dirs(out_dir):
        with atomic_dir(out_dir, what="the export") as tmp:
            res = export_models(target, drafter, tmp, recipe_name=recipe.name, block_size=recipe.block_size,
                                max_len=recipe.max_seq_len, logits_atol=th.logits_atol, ctx_atol=th.ctx_atol,
                                ort_flavor=ort_flavor)
            (tmp / EXPORT_MARKER).write_text(json.dumps({
                "tool": "dflash-export", "command": "export", "tool_version": __version__, "recipe": recipe.name,
                "files": sorted(res.file_sizes), "metadata": res.metadata}, indent=2) + "\n", encoding="utf-8")
        res.out_dir, res.target_path, res.drafter_path = out_dir, out_dir / TARGET_FILE, out_dir / DRAFTER_FILE
        check_export(out_dir, expected_from_recipe(recipe, drafter))
    return res


def expected_from_recipe(recipe, drafter) -> dict[str, str]:
    """The graph metadata an export of `recipe` must carry (the DFlash spec the recipe resolves to)."""
    return drafter.spec(recipe.block_size).contract_metadata(recipe.max_seq_len)


def check_model_contract(model, path: Path, expected: dict[str, str] | None = None) -> dict[str, str]:
    """Refuse a graph whose dflash nodes lack their plugin attributes or whose metadata disagrees with `expected`.

    Returns the model's metadata. `model` is an onnx.ModelProto (weights need not be loaded).
    """
    from dflash_export.export import ops

    meta = {p.key: p.value for p in model.metadata_props}
    for key in ("dflash.format_version", "dflash.block_size", "dflash.target_layer_ids", "dflash.mask_token_id"):
        if key not in meta:
            raise DFlashError("missing model metadata", path=path, field=key)
    for key, want in (expected or {}).items():
        if meta.get(key) != want:
            raise DFlashError(f"metadata {meta.get(key)!r} disagrees with the recipe ({want!r})", path=path, field=key)
    functions = {(f.domain, f.name) for f in model.functions}
    found = 0
    for node in model.graph.node:
        if node.domain != ops.DOMAIN:
            continue
        found += 1
        if node.op_type not in ops.REQUIRED_ATTRS:
            raise DFlashError(f"unknown dflash op {node.op_type!r}", path=path, field=node.name)
        have = {a.name: a for a in node.attribute}
        for attr in ops.REQUIRED_ATTRS[node.op_type]:
            if attr not in have:
                raise DFlashError(f"{node.op_type} node lacks attribute {attr!r}", path=path, field=node.name)
        if have["plugin_namespace"].s.decode() != ops.PLUGIN_NAMESPACE or \
                have["plugin_version"].s.decode() != ops.PLUGIN_VERSION:
            raise DFlashError(f"{node.op_type} plugin attributes differ from "
                              f"{ops.PLUGIN_NAMESPACE}/{ops.PLUGIN_VERSION}", path=path, field=node.name)
        if (ops.DOMAIN, node.op_type) not in functions:
            raise DFlashError(f"{node.op_type} has no model-local function (ONNX Runtime could not run it)",
                              path=path, field=node.name)
    if not found:
        raise DFlashError("no dflash custom-op node in the graph", path=path)
    return meta


def check_export(out_dir, expected: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """check_model_contract on both graphs of an export directory; returns their metadata by file name."""
    import onnx

    out = {}
    for fname in (TARGET_FILE, DRAFTER_FILE):
        path = Path(out_dir) / fname
        if not path.is_file():
            raise DFlashError("exported graph missing", path=path)
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # protobuf raises DecodeError and friends for truncated files
            raise DFlashError(f"not a readable ONNX file ({type(e).__name__})", path=path) from None
        out[fname] = check_model_contract(model, path, expected)
    return out


__all__ = ["ExportResult", "export_recipe", "is_export_dir", "EXPORT_MARKER", "export_models", "check_export",
           "check_model_contract", "TARGET_FILE", "DRAFTER_FILE", "SHARED_FILE", "ORT_TARGET_FILE", "ORT_DRAFTER_FILE",
           "ORT_HEAD_FILE", "ORT_DRAFT_HEAD_FILE"]
