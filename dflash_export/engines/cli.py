"""CLI for `build` (thin: parse and call)."""

from __future__ import annotations

import click

from dflash_export.clitypes import recipe_options
from dflash_export.engines.build import build_engine
from dflash_export.engines.registry import MAX_BATCH
from dflash_export.recipes import recipe_from_options


@click.command()
@recipe_options
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "tensorrt-llm"]), default="onnxruntime",
              show_default=True)
@click.option("--out", default="engines", show_default=True, help="Root of engine directories.")
@click.option("--force", is_flag=True, help="Rebuild even when the inputs are unchanged.")
@click.option("--precision", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="onnxruntime: weight precision of the target and LM head (default: the recipe's, else fp32); "
                   "int8 / int4 = block-wise MatMulNBits, lossless against plain decoding on the same engine.")
@click.option("--drafter-precision", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="onnxruntime: the drafter's and draft head's weight precision (default: --precision).")
@click.option("--fp32-heads", is_flag=True, help="onnxruntime: keep the LM head and draft head fp32 when the graphs "
                                                 "are quantized.")
@click.option("--max-batch", type=click.IntRange(1, MAX_BATCH), default=None,
              help=f"tensorrt: the most sequences per call the continuous-batching engines' profiles take, at most "
                   f"{MAX_BATCH} (default 8; deploy --max-batch may not pass it).")
def build(recipe, target, drafter, backend, out, force, precision, drafter_precision, fp32_heads, max_batch):
    """Build engines/<recipe>/<backend>[-<precision>]/ (reused when every input hash matches)."""
    import time

    from rich.console import Console

    from dflash_export.engines import ort_build

    r = recipe_from_options(recipe, target, drafter)
    console = Console(stderr=True, highlight=False)
    t0 = time.monotonic()
    with console.status(f"building {r.name} ({backend})") as status:
        def stage(text, new=True):
            if new:
                console.log(f"[{time.monotonic() - t0:5.1f} s] {text}")
            status.update(f"{text} ...")

        ort_build.report_stages(stage if console.is_terminal else None)
        try:
            res = build_engine(r, backend, out, force, precision, drafter_precision, False if fp32_heads else None,
                               max_batch)
        finally:
            ort_build.report_stages(None)
    from dflash_export.engines.manifest import read_manifest

    m = read_manifest(res.engine_dir, verify_files=False)  # hashed by the build; only its precision is read
    weights = ""
    if m.precision:
        p = m.precision
        weights = f"{p['target']} weights" + (f" (drafter {p['drafter']})" if p["drafter"] != p["target"] else "")
        if r.dtype != "float32":
            weights += f", from a {r.dtype} checkpoint"
        weights += "; "
    Console(highlight=False, soft_wrap=True).print(  # one line, whatever the path length
        f"{'reused' if res.reused else 'built'} {res.engine_dir} "
        f"({weights}{'inputs unchanged' if res.reused else f'{len(res.inputs)} input files hashed'})")
    recorded = m.raw.get("numerics")  # this build's probe (Numerics.to_json), said of the directory it built
    if not res.reused and isinstance(recorded, dict) and recorded.get("bit_identical") is False:
        from dflash_export.engines.numerics import Numerics

        console.print(f"warning: {res.engine_dir}: {Numerics(**recorded).statement}", soft_wrap=True)
