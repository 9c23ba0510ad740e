"""GGUF targets: converted once to an HF-format directory (fp32, dequantized) and cached by the file's hash.

transformers' GGUF loader does the dequantization; this module adds what it does not promise: the file's header is
read and checked first (layout, settings, tokenizer, tensor shapes and types: one error naming the key or tensor, never
a traceback from inside the loader), the conversion is cached atomically (a half-written copy is never taken for a
finished one) and the fields that silently change generation -- rope_theta, rms_norm_eps, tied embeddings, eos / stop
ids, the chat template, RoPE scaling, a mixture of experts' counts and width -- are checked against the GGUF metadata
itself.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import mmap
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from dflash_export.decoding.request import is_finite_number, is_int, is_positive_number
from dflash_export.errors import DFlashError
from dflash_export.files import atomic_dir, cache_dir, sha256_file
from dflash_export.models.arch import ARCHS, sliding_windows
from dflash_export.models.config import MAX_CONTEXT_LENGTH, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from dflash_export.models.hfutil import quiet_transformers, stop_token_ids_of
from dflash_export.models.rope import rope_parameters_of

# Bump when the conversion changes so cached copies are rebuilt. 4: the tokenizer files carry the GGUF's special tokens
# (SmolLM2: eos <|im_end|>, no BOS added), no GGUF byte copy posing as tokenizer.model, and the transformers-5 config
# carries a top-level rope_theta too. 5: the GGUF's RoPE scaling (linear, YaRN, Llama 3's divisors) is kept.
_CONVERSION_VERSION = 5


_ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE divisors, one per frequency (llama.cpp's LLM_TENSOR_ROPE_FREQS)
_HEADER = 24  # magic, version, tensor count, key/value count
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Array items the metadata may hold in all, read into Python lists at some 8 to 50 bytes each whatever their size in
# the file (a 1-byte item included): a vocabulary's tokens, scores, types and merges are about 10**6 of them.
MAX_GGUF_ARRAY_ITEMS = 1 << 22
# Bytes of text (keys, string values, tensor names) the header may hold in all, each string refused by its length
# before it is read: a vocabulary and its merges are some 10 MiB, a chat template some 10 KiB; a bad length would
# otherwise copy gigabytes of tensor data into memory.
MAX_GGUF_TEXT_BYTES = 1 << 28
# Values of rope_freqs.weight read with the header: one per frequency, head_dim / 2 of them.
_MAX_ROPE_FREQS = 1 << 16
# The most work deriving the merges of a SentencePiece vocabulary that has none may take: each split of each token is
# tried, its two parts copied and looked up, so the work grows with the sum of the tokens' squared lengths. A
# 128000-token vocabulary sums to some 10**7 (0.5 s); at the bound, a vocabulary whose every split is a pair of tokens
# (the worst case) takes some 4 s.
MAX_DERIVED_MERGES_WORK = 1 << 25
# The most a setting may give (config.py says why each bound): the layers (a config of more is refused by
# read_target_config after the conversion, and transformers builds a list per layer), the experts (likewise), the
# context (written to the converted config as its max_position_embeddings, the target's context; YaRN's original
# context), the widths, head counts and vocabulary size. The widths, head counts and vocabulary size are checked
# against the tensors' shapes or the token list too, but only after the settings derived from them (head_dim from
# embedding_length / head_count): the bound names a hostile value by its own key.
_MAX_SETTINGS = {"block_count": MAX_LAYERS, "expert_count": MAX_EXPERTS, "context_length": MAX_CONTEXT_LENGTH,
                 "rope.scaling.original_context_length": MAX_CONTEXT_LENGTH, "vocab_size": MAX_VOCAB,
                 **dict.fromkeys(("embedding_length", "feed_forward_length", "expert_feed_forward_length",
                                  "attention.key_length", "attention.value_length", "rope.dimension_count"), MAX_WIDTH),
                 **dict.fromkeys(("attention.head_count", "attention.head_count_kv"), MAX_HEADS)}


class _Cursor:
    """Reads GGUF values from `buf`; a DFlashError names `field` where the bytes run out or make no sense."""

    def __init__(self, buf, order: str, path: Path):
        self.buf, self.pos, self.order, self.path, self.field = buf, 0, order, path, "header"
        self.items = 0  # array items read so far
        self.text_bytes = 0  # bytes of text read so far

    def fail(self, message: str):
        raise DFlashError(message, path=self.path, field=self.field)

    def need(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            self.fail(f"the file ends at byte {len(self.buf)}, inside {what} (truncated?)")

    def count(self, n: int, field: str) -> None:
        """A header count of more entries than the file has bytes is an error before any is read (a file cut short
        inside its entries is named by the entry it stops in)."""
        if n > len(self.buf):
            raise DFlashError(f"{n} entries cannot fit in a file of {len(self.buf)} bytes (a bad count, or the file is "
                              "cut short)", path=self.path, field=field)

    def take(self, fmt: str, what: str) -> tuple:
        fmt = self.order + fmt
        n = struct.calcsize(fmt)
        self.need(n, what)
        self.pos += n
        return struct.unpack_from(fmt, self.buf, self.pos - n)

    def text(self, what: str) -> str:
        (n,) = self.take("Q", what)
        self.text_bytes += n
        if self.text_bytes > MAX_GGUF_TEXT_BYTES:
            self.fail(f"{what} of {n} bytes takes the header's text past {MAX_GGUF_TEXT_BYTES} bytes in all (a "
                      "vocabulary and its merges are some 10 MiB; a bad length?)")
        self.need(n, what)
        self.pos += n
        try:
            return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8 text")

    def entry(self, where: str, kind: str, seen: dict) -> str:
        """An entry's name (a key, a tensor's), read at `where`; errors after it name the entry. A name already in
        `seen` is an error."""
        self.field = where
        name = self.text(f"its {kind}")
        self.field = name or where
        if name in seen:
            self.fail(f"the {kind} is given twice")
        return name

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype], what)[0]
        if vtype == _STRING:
            return self.text(what)
        if vtype != _ARRAY:
            self.fail(f"unknown GGUF value type {vtype}")
        itype, count = self.take("IQ", what)
        if depth > 4:
            self.fail("arrays nested more than 4 deep")
        if itype in _SCALARS:  # read at once: a token list's scores / types are long
            import numpy as np

            dtype = np.dtype(_SCALARS[itype]).newbyteorder(self.order)
            self.need(count * dtype.itemsize, what)
            self.add_items(count)
            self.pos += count * dtype.itemsize
            return np.frombuffer(self.buf, dtype, count, self.pos - count * dtype.itemsize).tolist()
        self.need(count * 8, what)  # a string or array item takes at least its 8-byte length
        self.add_items(count)
        return [self.value(itype, what, depth + 1) for _ in range(count)]

    def add_items(self, n: int) -> None:
        """Count `n` more array items against MAX_GGUF_ARRAY_ITEMS, before any of them is read."""
        self.items += n
        if self.items > MAX_GGUF_ARRAY_ITEMS:
            self.fail(f"arrays of more than {MAX_GGUF_ARRAY_ITEMS} items in all (a vocabulary's lists hold about "
                      "10**6)")


def read_gguf_metadata(path: Path) -> dict:
    """The GGUF key/values, plus `tensor_names` and `tensors` ({name: (shape in PyTorch's order, GGML type
    name)}), from the header alone (no tensor data read). The layout is checked on the way: DFlashError naming the
    part that is cut short or that no GGUF reader takes -- the magic, the version, a key of an unknown value type
    or given twice, a tensor name given twice, an unknown tensor type, tensor data past the end of the file or
    overlapping another tensor's, a count or length past what a header holds (refused before it is read).
    Read here rather than with the `gguf` package's GGUFReader, which maps every tensor up front (2.3 s against 0.1 s
    on SmolLM2) and fails on a cut or foreign file with a numpy error that names no part of it; its tables of value
    and tensor types are what this reader takes."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
    except ImportError:
        raise DFlashError("GGUF targets need the `gguf` package (pip install 'dflash-export[gguf]')",
                          path=path) from None
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER)
        if not head:
            raise DFlashError("the file is empty", path=path, field="magic")
        if head[:4] != b"GGUF"[:len(head)]:
            raise DFlashError(f"not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')", path=path, field="magic")
        if len(head) < _HEADER:
            raise DFlashError(f"the file ends at byte {len(head)}, inside the {_HEADER}-byte GGUF header (truncated?)",
                              path=path, field="header")
        order = "<" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF else ">"  # a big-endian file reads as 0x..0000
        (version,) = struct.unpack_from(order + "I", head, 4)
        if version not in READER_SUPPORTED_VERSIONS:
            raise DFlashError(f"GGUF version {version} is not one the `gguf` reader takes "
                              f"({', '.join(map(str, READER_SUPPORTED_VERSIONS))})", path=path, field="version")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, order, path)
            cur.pos = 8
            n_tensors, n_kv = cur.take("QQ", "the GGUF header")
            cur.count(n_kv, "kv_count")
            meta: dict = {}
            for i in range(n_kv):
                key = cur.entry(f"metadata key/value {i} of {n_kv}", "key", meta)
                (vtype,) = cur.take("I", "its value type")
                meta[key] = cur.value(vtype, "its value")
                if key == "general.alignment" and (vtype != 4 or not meta[key] or meta[key] & (meta[key] - 1)):
                    cur.fail(f"expected a power of two stored as uint32, got {meta[key]!r}")
            cur.count(n_tensors, "tensor_count")
            tensors: dict[str, tuple] = {}
            for i in range(n_tensors):
                name = cur.entry(f"tensor info {i} of {n_tensors}", "tensor name", tensors)
                (n_dims,) = cur.take("I", "its dimension count")
                if not 1 <= n_dims <= 4:
                    cur.fail(f"{n_dims} dimensions (GGML tensors have 1 to 4)")
                dims = cur.take("Q" * n_dims, "its shape")
                raw_type, offset = cur.take("IQ", "its type and offset")
                try:
                    qtype = GGMLQuantizationType(raw_type)
                except ValueError:
                    cur.fail(f"unknown GGML tensor type {raw_type}")
                block, type_size = GGML_QUANT_SIZES[qtype]
                if dims[0] % block:
                    cur.fail(f"rows of {dims[0]} values do not split into {qtype.name} blocks of {block}")
                tensors[name] = tuple(reversed(dims)), qtype.name, offset, math.prod(dims) // block * type_size
            data = cur.pos + -cur.pos % meta.get("general.alignment", 32)
            _check_tensor_data(tensors, data, size, path)
            shape, qtype, offset, _ = tensors.get(_ROPE_FREQS, ((), "", 0, 0))
            # llama3 RoPE factors: a few values, read with the header (a longer tensor is refused by its shape)
            if qtype == "F32" and len(shape) == 1 and shape[0] <= _MAX_ROPE_FREQS:
                import numpy as np

                meta[_ROPE_FREQS] = np.frombuffer(buf, np.dtype(order + "f4"), shape[0], data + offset).tolist()
    meta["tensor_names"] = list(tensors)
    meta["tensors"] = {name: t[:2] for name, t in tensors.items()}
    return meta


def _check_tensor_data(tensors: dict, data: int, size: int, path: Path) -> None:
    """Each tensor's bytes (`tensors`: {name: (shape, type, offset, bytes)}, offsets from `data`) lie inside the
    file and share no byte with another tensor's (llama.cpp lays them out one after the other; a tensor read from
    another's bytes would be converted without a word): DFlashError naming the tensor."""
    end, last = 0, None
    for name, (_, _, offset, nbytes) in sorted(tensors.items(), key=lambda t: t[1][2]):
        if data + offset + nbytes > size:
            raise DFlashError(f"its data (bytes {data + offset}..{data + offset + nbytes}) runs past the end "
                              f"of the file ({size} bytes; truncated, or a bad offset)", path=path, field=name)
        if nbytes and offset < end:
            raise DFlashError(f"its data (bytes {data + offset}..{data + offset + nbytes}) overlaps {last}'s "
                              f"(to byte {data + end}; a bad offset)", path=path, field=name)
        if nbytes:
            end, last = offset + nbytes, name


@functools.cache
def _dequantizable(type_name: str) -> bool:
    """Whether the `gguf` package (what transformers' reader calls) dequantizes tensors of this GGML type."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_gguf_metadata(meta: dict, path: Path) -> None:
    """The GGUF's settings, tokenizer and tensors against each other, before any conversion: DFlashError naming the
    first key or tensor that is missing, of the wrong type, out of range, or that disagrees with the rest (what
    read_target_config and target_weight_problems check on an HF directory, said in the GGUF's own names)."""
    arch, spec = meta.get("general.architecture"), _arch_of(meta)
    if spec is None:
        known = sorted(a.gguf_arch for a in ARCHS.values() if a.gguf_arch)
        raise DFlashError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(known)})", path=path,
                          field="general.architecture")

    def fail(key: str, message: str):
        raise DFlashError(message, path=path, field=key)

    def size(name: str, required: bool = False) -> int | None:
        return _int_setting(meta, path, name, 1, required)

    layers, hidden = size("block_count", True), size("embedding_length", True)
    # A mixture-of-experts file needs no dense width: llama.cpp reads feed_forward_length only to derive the
    # experts' width when expert_feed_forward_length is absent (gguf_moe_settings).
    heads, ff = size("attention.head_count", True), size("feed_forward_length", spec.moe is None)
    kv_heads = size("attention.head_count_kv") or heads
    for name in ("context_length", "vocab_size", "rope.dimension_count", "attention.value_length"):
        size(name)
    if heads % kv_heads:
        fail(f"{arch}.attention.head_count_kv", f"{kv_heads} does not divide attention.head_count {heads}")
    head_dim = size("attention.key_length")
    if head_dim is None:
        if hidden % heads:
            fail(f"{arch}.attention.head_count", f"{heads} does not divide embedding_length {hidden}")
        head_dim = hidden // heads
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        fail(f"{arch}.attention.value_length", f"{meta[f'{arch}.attention.value_length']} != key_length {head_dim} "
             "(the HF model has one head_dim)")
    for name in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        v = meta.get(f"{arch}.{name}")
        if v is not None and not is_positive_number(v):
            fail(f"{arch}.{name}", f"expected a positive number, got {v!r}")
    vocab = _check_tokenizer(meta, path)
    if meta.get(f"{arch}.vocab_size", vocab) != vocab:
        fail(f"{arch}.vocab_size", f"{meta[f'{arch}.vocab_size']} != {vocab} tokens in tokenizer.ggml.tokens")
    layer = {"attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,), "attn_q.weight": (heads * head_dim, hidden),
             "attn_k.weight": (kv_heads * head_dim, hidden), "attn_v.weight": (kv_heads * head_dim, hidden),
             "attn_output.weight": (hidden, heads * head_dim)}
    moe = gguf_moe_settings(meta, path)
    if moe is None:
        layer.update({"ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden), "ffn_down.weight": (hidden, ff)})
    else:  # every layer a mixture of experts: the router, then each expert's gate / up / down stacked on a first axis
        n, width = moe[spec.moe.num_experts], moe[spec.moe.intermediate_size]
        layer.update({"ffn_gate_inp.weight": (n, hidden), "ffn_gate_exps.weight": (n, width, hidden),
                      "ffn_up_exps.weight": (n, width, hidden), "ffn_down_exps.weight": (n, hidden, width)})
    if spec.qk_norm:
        layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
    rope_dim = meta.get(f"{arch}.rope.dimension_count") or head_dim  # checked above
    if rope_dim != head_dim:
        fail(f"{arch}.rope.dimension_count", f"{rope_dim} != head_dim {head_dim} (RoPE on part of a head is not "
             "supported for this architecture)")
    top = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden),
           _ROPE_FREQS: (head_dim // 2,)}
    tensors = meta["tensors"]
    if not tensors:
        fail("tensors", "the file holds no tensors (a vocabulary-only GGUF?)")
    seen: dict[int, int] = {}
    for name, (shape, qtype) in tensors.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < layers:
            want = layer.get(parts[2])
            seen[int(parts[1])] = seen.get(int(parts[1]), 0) + (want is not None)
        else:
            want = top.get(name)
        if want is None:
            fail(name, f"not a tensor of a {arch} model with block_count {layers} (the conversion would drop it)")
        if shape != want:
            fail(name, f"shape {list(shape)} != {list(want)} that the GGUF's settings give")
        if not _dequantizable(qtype):
            fail(name, f"tensor type {qtype} is not one the `gguf` package dequantizes")
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in tensors:
            fail(name, "missing")
    if len(seen) < layers or any(n != len(layer) for n in seen.values()):
        i = next(i for i in range(len(seen) + 1) if seen.get(i, 0) != len(layer))
        gone = next(f"blk.{i}.{t}" for t in layer if f"blk.{i}.{t}" not in tensors)
        fail(gone, f"missing (block_count is {layers})")
    gguf_rope_scaling(meta, path)


def _arch_of(meta: dict):
    """The ArchSpec of a GGUF whose `general.architecture` this project converts, else None."""
    arch = meta.get("general.architecture")
    return next((a for a in ARCHS.values() if a.gguf_arch is not None and a.gguf_arch == arch), None)


def _int_setting(meta: dict, path: Path, name: str, lo: int = 1, required: bool = False) -> int | None:
    """The architecture's setting `name` (`<arch>.<name>`): an integer >= `lo` (and at most its _MAX_SETTINGS bound),
    or None when absent and not `required`; else DFlashError naming the key."""
    arch = meta["general.architecture"]
    key, v = f"{arch}.{name}", meta.get(f"{arch}.{name}")
    if v is None and required:
        raise DFlashError(f"missing (a {arch} GGUF gives it)", path=path, field=key)
    if v is not None and (not is_int(v) or v < lo):
        raise DFlashError(f"expected {'a positive integer' if lo == 1 else f'an integer >= {lo}'}, got {v!r}",
                          path=path, field=key)
    if v is not None and v > _MAX_SETTINGS.get(name, v):
        raise DFlashError(f"{v}: more than the {_MAX_SETTINGS[name]} this project reads", path=path, field=key)
    return v


def gguf_moe_settings(meta: dict, path: Path) -> dict | None:
    """The mixture-of-experts settings a GGUF of a MoE family gives, as transformers' config fields, or None for a
    dense family; DFlashError naming the key that is missing, out of range, or means something transformers' model
    does not do. What llama.cpp's qwen3moe reads (llama-model.cpp, models/qwen3moe.cpp): `expert_count` (at least 2),
    `expert_used_count`, `expert_feed_forward_length` (absent: feed_forward_length / expert_used_count), and
    `expert_group_count` (group-limited routing when over 1). It routes every layer through the experts (a softmax
    over all of them, the top k, always renormalized to sum to 1, no shared expert) whatever other keys say: its
    gating function, weight scale and weight-norm keys are not read for qwen3moe, so they are not read here either.
    transformers' Qwen3-MoE says the same with norm_topk_prob true, decoder_sparse_step 1 and mlp_only_layers [], as
    the published Qwen3-30B-A3B / Qwen3-Coder-30B-A3B configs do."""
    spec = _arch_of(meta)
    if spec is None or spec.moe is None:
        return None
    arch = meta["general.architecture"]

    def number(name: str, lo: int, required: bool = True) -> int | None:
        return _int_setting(meta, path, name, lo, required)

    experts, used = number("expert_count", 2), number("expert_used_count", 1)
    if used > experts:
        raise DFlashError(f"{used} > expert_count {experts}", path=path, field=f"{arch}.expert_used_count")
    width = number("expert_feed_forward_length", 1, required=False)
    if width is None:
        ff = meta.get(f"{arch}.feed_forward_length")
        if not is_int(ff) or ff < used:
            raise DFlashError("missing, and no feed_forward_length to derive it from", path=path,
                              field=f"{arch}.expert_feed_forward_length")
        width = ff // used
    groups = number("expert_group_count", 0, required=False)
    if groups is not None and groups > 1:
        raise DFlashError(f"{groups} expert groups: group-limited routing is not {spec.hf_architecture}'s (it routes "
                          "over all experts)", path=path, field=f"{arch}.expert_group_count")
    return {spec.moe.num_experts: experts, spec.moe.top_k: used, spec.moe.intermediate_size: width,
            spec.moe.norm_topk_prob: True, spec.moe.sparse_step: 1, spec.moe.mlp_only_layers: []}


def gguf_rope_scaling(meta: dict, path: Path) -> dict | None:
    """The RoPE scaling a GGUF asks for, as transformers' standardized `rope_parameters` entries (without
    `rope_theta`), or None for none; DFlashError naming the key or tensor for a scaling this project cannot give the
    same meaning. transformers' GGUF reader keeps only the base, so the converted config would otherwise decode
    with unscaled RoPE where llama.cpp scales it. What llama.cpp reads (llama-model.cpp): `rope.scaling.type`
    (default linear) with `rope.scaling.factor` (or the older `rope.scale_linear`; 0 or absent = unscaled), YaRN's
    `original_context_length` and beta settings, and Llama 3's per-frequency divisors stored as the tensor
    `rope_freqs.weight` (no key: convert_hf_to_gguf.py writes the divisors of the checkpoint's `llama3` settings)."""
    arch = meta["general.architecture"]
    key = functools.partial("{}.rope.{}".format, arch)

    def fail(field: str, message: str):
        raise DFlashError(message, path=path, field=field)

    def number(name: str, lo: float = 0.0) -> float | None:
        v = meta.get(key(name))
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v < math.inf):
            fail(key(name), f"expected a number >= {lo:g}, got {v!r}")
        return v

    kind = meta.get(key("scaling.type"), "linear")
    if kind not in ("none", "linear", "yarn"):
        fail(key("scaling.type"), f"{kind!r} is not a RoPE scaling this project implements (none, linear, yarn)")
    for name in ("scaling.attn_factor", "scaling.alpha", "scaling.yarn_log_multiplier", "scaling.yarn_ext_factor"):
        if key(name) in meta:  # settings transformers' llama / qwen3 RoPE has no counterpart for
            fail(key(name), "a RoPE setting this project cannot honour")
    factor = number("scaling.factor")
    factor = factor if factor is not None else number("scale_linear")
    if kind == "none" or not factor or (kind == "linear" and factor == 1):
        scaling = None
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(factor)}
    else:
        if key("scaling.original_context_length") not in meta:
            fail(key("scaling.original_context_length"), "YaRN needs a positive integer, got None")
        orig = _int_setting(meta, path, "rope.scaling.original_context_length")
        scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig)}
        for name, field in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                            ("attn_factor", "attention_factor")):
            v = number(f"scaling.yarn_{name}")
            if v is not None:
                scaling[field] = float(v)
    if _ROPE_FREQS not in meta.get("tensors", ()):
        return scaling
    if meta["tensors"][_ROPE_FREQS][1] != "F32":
        fail(_ROPE_FREQS, f"stored as {meta['tensors'][_ROPE_FREQS][1]}, not F32 as llama.cpp reads it")
    if _ROPE_FREQS not in meta:  # read with the header only when short enough
        fail(_ROPE_FREQS, f"shape {list(meta['tensors'][_ROPE_FREQS][0])}: more than {_MAX_ROPE_FREQS} divisors")
    if scaling is not None:
        fail(_ROPE_FREQS, f"per-frequency RoPE divisors together with {scaling['rope_type']} scaling are not supported")
    theta = float(meta.get(key("freq_base"), 10000.0))
    return _llama3_scaling(meta[_ROPE_FREQS], theta, path)


_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling(divisors: list[float], theta: float, path: Path) -> dict | None:
    """transformers' `llama3` RoPE settings that divide each inverse frequency by `divisors` (a GGUF's
    rope_freqs.weight), or None when every divisor is 1. llama.cpp divides frequency i by divisor i; `llama3` divides
    the high frequencies (wavelength < original / high_freq_factor) by 1, the low ones (wavelength > original /
    low_freq_factor) by `factor`, and blends in between, linearly in original / wavelength. Llama 3's own settings
    (low 1, high 4, original 8192) are tried first, then the two that fit the blended divisors; whatever is chosen
    must reproduce every divisor (to float32 precision), else the file is refused."""
    import numpy as np

    f = np.asarray(divisors, np.float64)
    if not np.isfinite(f).all() or (f <= 0).any():
        raise DFlashError("RoPE divisors must be positive numbers", path=path, field=_ROPE_FREQS)
    if np.allclose(f, 1.0, rtol=0, atol=1e-7):
        return None
    dim = 2 * len(f)
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = float(f.max())
    original = _LLAMA3_DEFAULTS["original_max_position_embeddings"]  # any value: the settings act through its ratios

    def divisors_of(params: dict) -> np.ndarray:
        orig, lo, hi = (params[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"))
        smooth = (orig / wavelen - lo) / (hi - lo) if hi != lo else np.zeros_like(wavelen)
        blended = 1 / ((1 - smooth) / factor + smooth)
        return np.where(wavelen < orig / hi, 1.0, np.where(wavelen > orig / lo, factor, blended))

    candidates = [dict(_LLAMA3_DEFAULTS)]
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if mid.sum() >= 2:  # the blend: orig / wavelen = lo + smooth * (hi - lo), a line in smooth
        smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        slope, lo = np.polyfit(smooth, original / wavelen[mid], 1)
        candidates.append({"low_freq_factor": float(lo), "high_freq_factor": float(lo + slope),
                           "original_max_position_embeddings": original})
    elif mid.sum() == 0:  # a step from 1 to `factor`: any edge between the two wavelengths either side
        below, above = wavelen[f <= 1 + 1e-6].max(initial=wavelen[0] / 2), wavelen[f > 1 + 1e-6].min()
        hi, lo = (original / (below * (above / below) ** t) for t in (1 / 3, 2 / 3))
        candidates.append({"low_freq_factor": float(lo), "high_freq_factor": float(hi),
                           "original_max_position_embeddings": original})
    for params in candidates:
        if params["high_freq_factor"] > params["low_freq_factor"] > 0 and np.allclose(
                divisors_of(params), f, rtol=2e-6, atol=0):
            return {"rope_type": "llama3", "factor": factor, **params}
    shown = f"{np.round(f, 4).tolist()[:8]}{'...' if len(f) > 8 else ''}"
    raise DFlashError(f"RoPE divisors {shown} are not Llama 3's scaling of any settings (1 for the high frequencies, "
                      "a factor for the low ones, a blend between)", path=path, field=_ROPE_FREQS)


def _check_tokenizer(meta: dict, path: Path) -> int:
    """The tokenizer keys: a known model, a token list the scores / token types / merges / special ids agree with.
    Returns the number of tokens."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise DFlashError(f"expected 'gpt2' or 'llama', got {model!r}", path=path, field="tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise DFlashError("expected a non-empty list of strings" + ("" if tokens is None else f", got {tokens!r}"[:80]),
                          path=path, field="tokenizer.ggml.tokens")
    for key, right, words in (("tokenizer.ggml.scores", is_finite_number, "a finite number"),
                              ("tokenizer.ggml.token_type", is_int, "an integer")):
        v = meta.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != len(tokens)):
            got = f"{len(v)} entries" if isinstance(v, list) else repr(v)
            raise DFlashError(f"{got} for {len(tokens)} tokens in tokenizer.ggml.tokens", path=path, field=key)
        bad = next((i for i, x in enumerate(v or ()) if not right(x)), None)
        if bad is not None:
            raise DFlashError(f"entry {bad} is {v[bad]!r}, not {words}", path=path, field=key)
    merges = meta.get("tokenizer.ggml.merges")
    # llama.cpp reads a byte-level BPE's merges and refuses one without; transformers would make up merges from the
    # scores (another tokenizer than the file's) or fail without a word on which key is missing.
    if merges is None and model == "gpt2":
        raise DFlashError("missing (a 'gpt2' BPE vocabulary needs its merges)", path=path,
                          field="tokenizer.ggml.merges")
    if merges is None and "tokenizer.ggml.scores" not in meta:
        raise DFlashError(f"missing (a {model!r} vocabulary without merges needs its scores)", path=path,
                          field="tokenizer.ggml.scores")
    if merges is None:
        _check_derived_merges_work(tokens, path)
    if merges is not None:
        vocab = set(tokens)
        for i, m in enumerate(merges if isinstance(merges, list) else [merges]):
            pair = m.split(" ") if isinstance(m, str) else []
            if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
                raise DFlashError(f"merge {i} ({m!r}) is not two tokens whose join is a token", path=path,
                                  field="tokenizer.ggml.merges")
    for _, key in _SPECIAL:
        v = meta.get(key)
        if v is not None and (not is_int(v) or not 0 <= v < len(tokens)):
            raise DFlashError(f"{v!r} is not a token id (0..{len(tokens) - 1})", path=path, field=key)
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        if key in meta and not isinstance(meta[key], bool):
            raise DFlashError(f"expected a boolean, got {meta[key]!r}", path=path, field=key)
    if not isinstance(meta.get("tokenizer.chat_template", ""), str):
        raise DFlashError(f"expected a string, got {meta['tokenizer.chat_template']!r}", path=path,
                          field="tokenizer.chat_template")
    return len(tokens)


def _check_derived_merges_work(tokens: list[str], path: Path) -> None:
    """A SentencePiece vocabulary without merges has them derived in the conversion (_TokenList): refused where that
    would take more than a few seconds, naming the token list."""
    work = sum(len(t) ** 2 for t in tokens)
    if work > MAX_DERIVED_MERGES_WORK:
        raise DFlashError(f"{len(tokens)} tokens and no merges: deriving the merges tries each split of each token, "
                          f"work that grows with the tokens' squared lengths ({work} in all, more than the "
                          f"{MAX_DERIVED_MERGES_WORK} this project derives; a 128000-token SentencePiece vocabulary "
                          "is some 10**7)", path=path, field="tokenizer.ggml.tokens")


_CONVERTED_JSON = ("config.json", "tokenizer.json", "tokenizer_config.json")


def hf_dir_from_gguf(path) -> Path:
    """An HF model directory (config, fp32 safetensors, tokenizer with chat template) for GGUF file `path`.

    Built on first use under `cache_dir()/targets/<sha256 of the file>/`, then reused while whole (made again when
    not: `cached_model_whole`). Raises DFlashError naming the
    field when a generation-relevant setting does not survive the conversion.
    """
    path = Path(path)
    if not path.is_file():
        raise DFlashError("GGUF file not found", path=path)
    meta = read_gguf_metadata(path)
    check_gguf_metadata(meta, path)  # before the cache too: a copy converted before a check existed is not taken
    digest = sha256_file(path)
    out = cache_dir() / "targets" / f"{digest[:24]}-v{_CONVERSION_VERSION}"
    from dflash_export.models.weights import cached_model_whole

    if cached_model_whole(out, _CONVERTED_JSON):
        return out
    _check_room(meta, path, out)
    try:
        with atomic_dir(out) as tmp, _reading_as_llama_cpp():
            _convert(path, tmp, meta)
            check_conversion(tmp, meta, path)
    except OSError as e:  # full disk, permissions: one line, and atomic_dir has removed the partial copy
        raise DFlashError(f"cannot write the converted target ({e.strerror or e})", path=out) from None
    return out


_BASE_BYTES = 512 << 20  # torch, transformers and the tokenizer loaded: ~470 MiB measured on SmolLM2


def _conversion_bytes(meta: dict) -> tuple[int, int]:
    """(fp32 bytes of the converted weights, bytes of memory the conversion needs at its peak). Every tensor counts
    whole, a mixture of experts' stacked [experts, ...] tensors included: the weights are all held dequantized at
    once (the model takes the dequantized tensors themselves), plus two of the largest while one is dequantized (the
    dequantized array and its copy; an expert stack's gate and up halves are copied into their fused tensor, which is
    part of the weights). SmolLM2-135M: 513 MiB of fp32 weights, 1267 MiB peak RSS measured, 1251 MiB this estimate."""
    sizes = [math.prod(shape) * 4 for shape, _ in meta["tensors"].values()]
    weights = sum(sizes)
    return weights, weights + 2 * max(sizes) + _BASE_BYTES


def _check_room(meta: dict, path: Path, out: Path) -> None:
    """Refuse, before minutes of work, a conversion this machine has no room for: the memory _conversion_bytes
    gives, and the fp32 weights written to the cache."""
    from dflash_export.environment import available_memory_bytes

    weights, need = _conversion_bytes(meta)
    available = available_memory_bytes()
    gib = 1 << 30
    if available is not None and need > available:
        raise DFlashError(f"converting it to fp32 needs about {need / gib:.1f} GiB of memory ({weights / gib:.1f} GiB "
                          f"of weights), and {available / gib:.1f} GiB is available", path=path, field="tensors")
    probe = next((p for p in (out, *out.parents) if p.exists()), None)
    free = shutil.disk_usage(probe).free if probe is not None else None
    if free is not None and weights > free:
        raise DFlashError(f"its fp32 copy needs {weights / gib:.1f} GiB in {out.parent}, which has "
                          f"{free / gib:.1f} GiB free", path=path, field="tensors")


@contextmanager
def _replaced(module: str, name: str, make):
    """transformers' `module`.`name` replaced by `make(original)` while converting; left as it is where this
    transformers has no such module or attribute, or `make` returns None (another version: its own behaviour)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:  # _convert names the missing library
        mod = None
    original = getattr(mod, name, None)
    new = None if original is None else make(original)
    if new is None:
        yield
        return
    setattr(mod, name, new)
    try:
        yield
    finally:
        setattr(mod, name, original)


def _silent_bar(bar):
    """A tqdm class that draws nothing: transformers' GGUF reader draws a bar of its own ("Converting and
    de-quantizing GGUF tensors") with tqdm directly, besides the bars quiet_transformers turns off."""
    if not isinstance(bar, type):
        return None

    class Silent(bar):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _without_general_name(read_field):
    """transformers' read_field that reads no `general.name`: its GGUF reader takes a llama file named "mistral" for a
    Mistral (a config with a sliding window of 4096, a tokenizer converter it has none of, and "llama" rewritten to
    "mistral" in every key and string value), where llama.cpp reads the architecture from `general.architecture`
    alone. Without the name, the model transformers builds is the one `general.architecture` names."""
    return lambda reader, field: [] if field == "general.name" else read_field(reader, field)


class _TokenList(list):
    """A token list whose `in` is a set's. transformers derives the merges of a SentencePiece vocabulary that has none
    by testing each split of each token with `in` on the token list, time quadratic in the vocabulary's size (4000
    tokens 0.8 s, 16000 15 s); the same tests against a set give the same merges in time linear in it."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self._set = frozenset(self)

    def __contains__(self, token):
        return token in self._set


def _with_token_set(skeleton):
    """transformers' GGUFTokenizerSkeleton given a _TokenList where it derives merges (no merges in the file)."""
    if not isinstance(skeleton, type):
        return None

    class Skeleton(skeleton):
        def __init__(self, dict_):
            if "merges" not in dict_ and isinstance(dict_.get("tokens"), list):
                dict_ = {**dict_, "tokens": _TokenList(dict_["tokens"])}
            super().__init__(dict_)

    return Skeleton


_READER, _GGML = "transformers.modeling_gguf_pytorch_utils", "transformers.integrations.ggml"


@contextmanager
def _reading_as_llama_cpp():
    """transformers' GGUF reader, while converting: no progress bars on stderr (a failed conversion is the one error
    line), the architecture from `general.architecture` alone, and missing merges derived in linear time."""
    quiet_transformers()
    with _replaced(_READER, "tqdm", _silent_bar), _replaced(_READER, "read_field", _without_general_name), \
            _replaced(_GGML, "GGUFTokenizerSkeleton", _with_token_set):
        yield


def _convert(gguf_path: Path, out: Path, meta: dict) -> None:
    """Dequantize through transformers' GGUF reader into a model built from the GGUF's own config.

    `from_pretrained(gguf_file=...)` would do the same but insists on `accelerate` for this one path; the pieces it
    calls (config parsing, `load_gguf_checkpoint`'s name mapping + dequantization) do not need it.
    """
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from dflash_export.models.weights import check_finite, nonfinite_count

    quiet_transformers()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
        config.head_dim = _head_dim(meta)  # transformers' qwen3 mapping drops key_length (its config defaults to 128)
        # transformers' qwen3_moe mapping drops expert_feed_forward_length (its config defaults the experts' width to
        # 768, Qwen3-30B-A3B's) and takes norm_topk_prob from a table of its own: the GGUF's settings are set instead.
        moe = gguf_moe_settings(meta, gguf_path) or {}
        for key, value in moe.items():
            setattr(config, key, value)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
        # transformers' reader rewrites a renamed architecture inside every string value (qwen3moe -> qwen3_moe):
        # the template saved is the GGUF's own
        if isinstance(meta.get("tokenizer.chat_template"), str):
            tokenizer.chat_template = meta["tokenizer.chat_template"]
        with torch.device("meta"):  # no weights of its own: it takes the dequantized tensors (assign below)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf from dequantizing: named below, not warned
            state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    except (ValueError, OSError, KeyError, ImportError) as e:
        raise DFlashError(f"transformers cannot load this GGUF ({str(e).splitlines()[0]})", path=gguf_path) from None
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in state.items()}
    # Dequantized tensors that hold NaN or inf would be saved and cached as the target: refused here, each tensor
    # checked in the state dict already in memory, before anything is written, and named as the GGUF names it.
    bad = next((k for k, v in state.items() if nonfinite_count(v)), None)
    if bad is not None:
        name, part = _expert_gguf_part(bad, state[bad]) or (_gguf_name(bad, meta) or bad, state[bad])
        check_finite(part, gguf_path, name, f" (converted to {bad})" if name != bad else "")
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a shape transformers' config gives otherwise than check_gguf_metadata's reading
        raise DFlashError(f"GGUF tensors do not fit {type(model).__name__} ({_first_mismatch(e)})", path=gguf_path,
                          field="tensors") from None
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        bad = sorted(set(missing) - allowed_missing) or sorted(unexpected)
        raise DFlashError(f"GGUF tensors do not map onto {type(model).__name__} ({len(bad)} off, e.g. {bad[0]})",
                          path=gguf_path, field="tensors")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _write_special_tokens(out, meta, tokenizer)
    # transformers 5 writes the RoPE base inside `rope_parameters`; add the top-level `rope_theta` transformers 4
    # reads too, so the copy means the same thing to either (models/rope.py reads both). Its GGUF reader keeps no
    # RoPE scaling: the GGUF's is written in (gguf_rope_scaling).
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and "rope_theta" not in cfg:
        cfg["rope_theta"] = params["rope_theta"]
    scaling = gguf_rope_scaling(meta, gguf_path)
    if scaling:
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], **scaling}
    cfg.update(moe)  # written out even where they equal the config class's defaults, which save_pretrained leaves out
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def _gguf_name(hf_name: str, meta: dict) -> str | None:
    """The GGUF tensor that transformers' parameter `hf_name` is converted from, by the `gguf` package's name map
    (the one transformers' reader maps names with); None when no single tensor of the file is (experts that
    transformers stacks from several, a name the map does not know)."""
    try:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        arch = meta["general.architecture"]
        key = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, _, suffix = hf_name.rpartition(".")
            suffix = "." + suffix
        name = get_tensor_name_map(key, int(meta[f"{arch}.block_count"])).get_name(base)
    except (ImportError, StopIteration, KeyError, TypeError, ValueError):
        return None
    return name + suffix if name is not None and name + suffix in meta["tensor_names"] else None


def _expert_gguf_part(hf_name: str, tensor):
    """(the GGUF tensor, the part of `tensor` converted from it) for transformers' stacked experts of a Qwen3-MoE
    layer, where the `gguf` package's name map has no single tensor: `down_proj` is ffn_down_exps, and the fused
    `gate_up_proj` [experts, 2 * width, hidden] is ffn_gate_exps (rows :width, the first half that holds NaN / inf
    is named) and ffn_up_exps (the rest). None for any other parameter."""
    from dflash_export.models.weights import nonfinite_count

    layer, _, kind = hf_name.removeprefix("model.layers.").partition(".mlp.experts.")
    if not layer.isdigit() or kind not in ("gate_up_proj", "down_proj") or tensor.ndim != 3:
        return None
    if kind == "down_proj":
        return f"blk.{layer}.ffn_down_exps.weight", tensor
    gate, up = tensor.split(tensor.shape[1] // 2, dim=1)
    return (f"blk.{layer}.ffn_gate_exps.weight", gate) if nonfinite_count(gate) else \
        (f"blk.{layer}.ffn_up_exps.weight", up)


def _first_mismatch(e: RuntimeError) -> str:
    """The first `size mismatch for NAME: ...` sentence of load_state_dict's error, else its first line."""
    text = str(e)
    at = text.find("size mismatch for ")
    return text[at:].split(".\n")[0].split("\n")[0].rstrip(".") if at >= 0 else text.splitlines()[0]


_SPECIAL = (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id"))


def _write_special_tokens(out: Path, meta: dict, tokenizer) -> None:
    """Make the saved tokenizer say what the GGUF says, so transformers and llama.cpp's convert_hf_to_gguf.py read the
    same tokenizer as the engine: bos / eos / unk / pad from the GGUF ids (transformers' GGUF reader sets eos = bos
    for SmolLM2), add_bos_token / add_eos_token from the GGUF flags, and no `tokenizer.model` -- transformers saves
    the GGUF file itself under that name for a BPE vocabulary, which SentencePiece readers then fail on."""
    (out / "tokenizer.model").unlink(missing_ok=True)
    tokens = {name: tokenizer.convert_ids_to_tokens(int(meta[key])) for name, key in _SPECIAL if key in meta}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    for name, key in _SPECIAL:
        if name in tokens:
            cfg[name] = tokens[name]
            cfg[name + "_id"] = int(meta[key])
    cfg.update(add_bos_token=add_bos, add_eos_token=add_eos)
    if meta.get("tokenizer.ggml.model") == "gpt2":  # a byte-level BPE: served by tokenizer.json alone
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("vocab_file", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
    tok_path = out / "tokenizer.json"
    if tok_path.is_file() and meta.get("tokenizer.ggml.model") == "gpt2":
        # transformers' GGUF reader writes a byte-level BPE with SentencePiece-style decoding (byte fallback, a
        # decoder sequence) and a post-processor that prepends bos. The GGUF's vocabulary is plain byte-level BPE:
        # say so, so that llama.cpp's converter takes it as one (tokenizer model gpt2, not llama).
        tj = json.loads(tok_path.read_text(encoding="utf-8"))
        tj["model"]["byte_fallback"] = False
        tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        if not (add_bos or add_eos) and (tj.get("post_processor") or {}).get("type") == "TemplateProcessing":
            tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                                    "use_regex": True}
        tok_path.write_text(json.dumps(tj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    gen_path = out / "generation_config.json"
    if gen_path.is_file() and "eos_token" in tokens:
        gen = json.loads(gen_path.read_text(encoding="utf-8"))
        gen["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
        gen_path.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def _chat_template_of(model_dir: Path) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _head_dim(meta: dict) -> int:
    """A checked GGUF's attention head size: `attention.key_length`, else embedding_length / head_count (as llama.cpp
    reads it)."""
    arch = meta["general.architecture"]
    return int(meta.get(f"{arch}.attention.key_length")
               or meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"])


def check_conversion(model_dir: Path, meta: dict, gguf_path: Path) -> None:
    """Compare the converted config / tokenizer against GGUF metadata; DFlashError names the first field that
    differs."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    arch = meta["general.architecture"]

    def fail(field: str, want, got):
        raise DFlashError(f"conversion changed {field}: GGUF has {want!r}, converted config has {got!r}",
                          path=gguf_path, field=field)

    theta = meta.get(f"{arch}.rope.freq_base")
    params = rope_parameters_of(cfg, model_dir / "config.json", cfg.get("model_type", arch))
    if theta is not None and not math.isclose(float(params.get("rope_theta") or 0.0), float(theta), rel_tol=1e-6):
        fail("rope_theta", float(theta), params.get("rope_theta"))
    scaling = gguf_rope_scaling(meta, gguf_path) or {"rope_type": "default"}
    got = {k: params.get(k) for k in scaling}
    if got != scaling:
        fail("rope_parameters", scaling, got)
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon")
    # GGUF stores eps as float32: 1e-5 reads back as 9.99999975e-06, so compare at float32 precision.
    if eps is not None and not math.isclose(float(cfg.get("rms_norm_eps", 0.0)), float(eps), rel_tol=1e-6):
        fail("rms_norm_eps", float(eps), cfg.get("rms_norm_eps"))
    for key, field in ((f"{arch}.block_count", "num_hidden_layers"), (f"{arch}.embedding_length", "hidden_size"),
                       (f"{arch}.attention.head_count", "num_attention_heads"),
                       (f"{arch}.attention.head_count_kv", "num_key_value_heads")):
        if key in meta and int(meta[key]) != int(cfg.get(field, -1)):
            fail(field, int(meta[key]), cfg.get(field))
    if f"{arch}.attention.head_count" in meta and cfg.get("head_dim") != _head_dim(meta):
        fail("head_dim", _head_dim(meta), cfg.get("head_dim"))
    for field, want in (gguf_moe_settings(meta, gguf_path) or {}).items():
        if cfg.get(field) != want or type(cfg.get(field)) is not type(want):
            fail(field, want, cfg.get(field))
    spec = _arch_of(meta)
    if spec is not None and any(sliding_windows(spec, SimpleNamespace(**cfg))):  # llama.cpp windows none of them
        fail("sliding_window", None, cfg.get("sliding_window"))
    tied = "output.weight" not in meta["tensor_names"]
    if bool(cfg.get("tie_word_embeddings", False)) != tied:
        fail("tie_word_embeddings", tied, cfg.get("tie_word_embeddings"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None and int(eos) not in stop_token_ids_of(model_dir, cfg):
        fail("eos_token_id", int(eos), stop_token_ids_of(model_dir, cfg))
    tcfg_path = model_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
    for name, key in _SPECIAL:
        if key in meta and name in tcfg and tcfg.get(name + "_id", int(meta[key])) != int(meta[key]):
            fail(f"tokenizer_config.{name}", int(meta[key]), tcfg.get(name + "_id"))
    if "tokenizer.ggml.add_bos_token" in meta and bool(tcfg.get("add_bos_token")) != bool(
            meta["tokenizer.ggml.add_bos_token"]):
        fail("add_bos_token", bool(meta["tokenizer.ggml.add_bos_token"]), tcfg.get("add_bos_token"))
    if (model_dir / "tokenizer.model").is_file():
        fail("tokenizer.model", "no SentencePiece model (a BPE vocabulary)", "a tokenizer.model file")
    template = meta.get("tokenizer.chat_template")
    if template is not None and _chat_template_of(model_dir) != template:
        fail("chat_template", "the GGUF's template", "a different or missing template")
