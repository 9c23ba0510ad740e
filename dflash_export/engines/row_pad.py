"""Padding inside the target graph: a one-token step whose matrix products and attention run as two rows while the
row-wise operators between them (the norms, the residual adds) run as one.

Why: on some CPUs a kernel's one-row path rounds differently from its many-row path (engines/numerics.py), so a plain
step must run the quantized products and GroupQueryAttention as >= 2 rows to give the bits a verify block gives. The
host can pad the whole step (copies of the token), but then every norm also runs two rows, and ONNX Runtime hands a
two-row norm to its thread pool: on a 2-core machine with spinning off that is a worker wake-up per norm, ~60 per
step. Padding in the graph pads only the inputs of the products and attention and slices the rows off again before
the next norm.

The rewrite adds one graph input, `row_index` (int64 [R]): the rows each padded region runs, as indices into the
step's S rows (arange(S) for an unpadded call; [0, 0] for a one-token step run as two rows). Every MatMul /
MatMulNBits / GroupQueryAttention takes its row inputs gathered by `row_index` (R rows); a norm, or any operator not
known to be row-wise, takes them sliced back to the first S rows. Attention then sees R rows at R positions (the
caller's position_ids, attention_bias, seqlens_k and total_seq_len are for R rows, as for host padding), the padding
row's K/V land past the committed length and are overwritten by the next step. Every output keeps S rows.

Which operators take padded rows is the build's choice (`pad_in_graph(..., products=...)`): attention alone, or the
matrix products too. Attention alone is tried first: where the products' one-row kernels give the bits of their
many-row ones (fp32 MatMul on AVX2 and AVX-512; MatMulNBits at accuracy level 4 on AVX-512 VNNI, not on AVX2), a
plain step then runs every product as one row and the graph carries one Gather / Slice pair per layer instead of one
per product region. Where they differ the build pads the products too (engines/ort_build.py).

Whether the rows such a step computes equal a verify block's is not assumed: the numerics probe checks it on the CPU
at every load, and falls back to padding on the host where a row-wise kernel's one-row path differs too (or, for a
graph padding attention alone, a product's does: an engine built on one CPU and loaded on another).
"""

from __future__ import annotations

from pathlib import Path

ROW_INDEX = "row_index"
# Operators that can take rows padded: each output row depends on its own input row only (products), or on the rows
# before it (causal attention), so a padding row appended after the real ones changes none of them.
ATTENTION_OPS = {"GroupQueryAttention": (0, 1, 2)}
PRODUCT_OPS = {"MatMul": (0,), "MatMulNBits": (0,)}
PAD_OPS = {**PRODUCT_OPS, **ATTENTION_OPS}
# Row-wise operators a padded region flows through unchanged (one output row per input row, nothing across rows).
ROW_WISE = {"Split", "QuickGelu", "Gelu", "FastGelu", "BiasGelu", "Sigmoid", "Silu", "Mul", "Add", "Sub", "Div",
            "Tanh", "Relu", "Softplus", "Neg", "Cast", "Identity", "Erf"}


def pad_in_graph(path: Path, products: bool = True) -> bool:
    """Rewrite the target graph at `path` in place (weights untouched: the external data keeps its files) so that
    it takes `row_index`, gathered into the inputs of attention and, with `products`, of the matrix products; False
    (file unchanged) when it has no row data to pad: no `inputs_embeds` input, already rewritten, or recurrent
    (Gated DeltaNet) layers whose per-row states the host reads."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    names = {i.name for i in g.input}
    if "inputs_embeds" not in names or ROW_INDEX in names or any(n.startswith("conv_state_") for n in names):
        return False
    pad_ops = PAD_OPS if products else ATTENTION_OPS
    consts = [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("row_pad_zero", [0]), ("row_pad_axis", [1]))]
    nodes = [helper.make_node("Shape", ["inputs_embeds"], ["row_pad_rows"], name="row_pad/rows", start=1, end=2)]
    state = {"inputs_embeds": "rows"}  # tensor -> "rows" (S rows) or "padded" (R rows)
    padded_of, rows_of = {}, {}

    def padded(t: str) -> str:
        if t not in padded_of:
            padded_of[t] = f"{t}/padded"
            nodes.append(helper.make_node("Gather", [t, ROW_INDEX], [padded_of[t]], name=f"row_pad/gather/{t}",
                                          axis=1))
        return padded_of[t]

    def unpadded(t: str) -> str:
        if t not in rows_of:
            rows_of[t] = f"{t}/rows"
            nodes.append(helper.make_node("Slice", [t, "row_pad_zero", "row_pad_rows", "row_pad_axis"], [rows_of[t]],
                                          name=f"row_pad/slice/{t}"))
        return rows_of[t]

    changed = False
    for node in g.node:
        row_inputs = [k for k, t in enumerate(node.input) if t and t in state]
        want = None
        if node.op_type in pad_ops and node.domain in ("", "com.microsoft"):
            want = "padded"
            for k in row_inputs:
                if k in pad_ops[node.op_type] and state[node.input[k]] == "rows":
                    node.input[k] = padded(node.input[k])
                    changed = True
            outs = node.output[:1]
        elif row_inputs:
            kinds = {state[node.input[k]] for k in row_inputs}
            if node.op_type in ROW_WISE and node.domain in ("", "com.microsoft") and kinds == {"padded"}:
                want = "padded"
            else:  # norms, mixed inputs, anything not known to be row-wise: the step's own S rows
                want = "rows"
                for k in row_inputs:
                    if state[node.input[k]] == "padded":
                        node.input[k] = unpadded(node.input[k])
            outs = node.output
        else:
            outs = []
        nodes.append(node)
        for o in outs:
            if o:
                state[o] = want
    for out in g.output:
        if state.get(out.name) == "padded":  # an output of a padded region: rename its producer's tensor
            raise ValueError(f"graph output {out.name} would be padded")
    if not changed:
        return False
    g.ClearField("node")
    g.node.extend(nodes)
    g.initializer.extend(consts)
    g.input.append(helper.make_tensor_value_info(ROW_INDEX, TensorProto.INT64, ["padded_rows"]))
    onnx.save(model, str(path))
    return True


def padded_ops(path: Path) -> list[str]:
    """The operator types of the graph at `path` whose inputs are gathered by `row_index` (sorted; [] if none)."""
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    padded, ops = set(), set()  # tensors of R rows: gathered, or made from gathered ones until sliced back
    for n in g.node:
        if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == ROW_INDEX:
            padded.add(n.output[0])
        elif not n.name.startswith("row_pad/") and any(t in padded for t in n.input):
            ops.add(n.op_type)
            padded.update(n.output[:1] if n.op_type in PAD_OPS else n.output)
    return sorted(ops & set(PAD_OPS))


def unpad_graph(path: Path) -> bool:
    """Undo `pad_in_graph` on the graph at `path` in place (False, unchanged, when it takes no `row_index`): every
    gathered or sliced copy is replaced by the tensor it was made from, and the padding's nodes, constants and input
    go."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    if ROW_INDEX not in {i.name for i in g.input}:
        return False
    source = {n.output[0]: n.input[0] for n in g.node if n.name.startswith("row_pad/") and n.op_type != "Shape"}
    nodes = [n for n in g.node if not n.name.startswith("row_pad/")]
    for n in nodes:
        for k, t in enumerate(n.input):
            if t in source:
                n.input[k] = source[t]
    g.ClearField("node")
    g.node.extend(nodes)
    keep = [i for i in g.initializer if i.name not in ("row_pad_zero", "row_pad_axis")]
    g.ClearField("initializer")
    g.initializer.extend(keep)
    inputs = [i for i in g.input if i.name != ROW_INDEX]
    g.ClearField("input")
    g.input.extend(inputs)
    onnx.save(model, str(path))
    return True
