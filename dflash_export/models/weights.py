"""safetensors weights read with their headers bounds-checked first: a truncated, corrupt or missing shard is named by
file before any tensor is loaded."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError
from dflash_export.files import MAX_JSON_BYTES, DuplicateKey, native_path, read_json_object, unique_keys

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
# Bits per element of every dtype the safetensors format defines (what its own reader accepts).
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# The integer and boolean dtypes: no weight of a model that is not quantized is stored so (its values are floats;
# a header that says I32 for float32 bytes would make every value a huge integer, finite and silently wrong).
INTEGER_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})

# The longest header the safetensors library itself reads (its MAX_HEADER_SIZE): a longer one is refused before it is
# read into memory, however long the file.
MAX_HEADER_BYTES = 100_000_000
# The most dimensions a tensor's shape may have: no model weight has more than a handful, and a shape of thousands
# is only a header made to flood every message that shows it.
MAX_TENSOR_DIMS = 64



def _is_count(v) -> bool:
    return is_int(v) and v >= 0


def safetensors_header(path: Path) -> dict[str, Any]:
    """Parse and bounds-check a safetensors header without loading tensors."""
    if path.exists() and not path.is_file():
        raise DFlashError("not a file", path=path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise DFlashError("truncated safetensors file (no header)", path=path)
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise DFlashError("truncated safetensors file (header longer than file)", path=path)
            if n > MAX_HEADER_BYTES:
                raise DFlashError(f"corrupt safetensors header ({n} bytes long; the safetensors library reads at "
                                  f"most {MAX_HEADER_BYTES})", path=path)
            header = json.loads(f.read(n), object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise DFlashError("file not found", path=path) from None
    except DuplicateKey as e:
        raise DFlashError("corrupt safetensors header (key given twice)", path=path, field=e.shown) from None
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply, an integer too long to read
        raise DFlashError("corrupt safetensors header", path=path) from None
    if not isinstance(header, dict):
        raise DFlashError("corrupt safetensors header (not a JSON object)", path=path)
    data_len = size - 8 - n
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise DFlashError("corrupt safetensors header (expected an object of strings)", path=path,
                          field="__metadata__")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise DFlashError("corrupt safetensors header (expected data_offsets [begin, end])", path=path,
                              field=name)
        begin, end = offsets
        if end > data_len:
            raise DFlashError(f"truncated safetensors file (tensor data cut off, {data_len} of {end} bytes)",
                              path=path, field=name)
        dtype, shape = info.get("dtype"), info.get("shape")
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise DFlashError(f"corrupt safetensors header (unknown dtype {dtype!r})", path=path, field=name)
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise DFlashError(f"corrupt safetensors header (expected shape [non-negative integers], got "
                              f"{repr(shape)[:200]})", path=path, field=name)
        if len(shape) > MAX_TENSOR_DIMS:
            raise DFlashError(f"corrupt safetensors header (a shape of {len(shape)} dimensions, more than "
                              f"{MAX_TENSOR_DIMS})", path=path, field=name)
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if begin > end or bits % 8 or end - begin != bits // 8:
            raise DFlashError(f"corrupt safetensors header (data_offsets {offsets} do not hold {dtype} {shape})",
                              path=path, field=name)
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise DFlashError("corrupt safetensors header (tensor data overlapping another's or leaving a gap)",
                              path=path, field=name)
        covered = end
    if covered != data_len:
        raise DFlashError(f"corrupt safetensors file ({data_len - covered} bytes after the last tensor's data)",
                          path=path)
    return header


def cached_model_whole(d: Path, json_files: tuple[str, ...] = ("config.json",)) -> bool:
    """Whether a model directory this project wrote to its cache is still whole: each of `json_files` a JSON object,
    and model.safetensors' header sound and the file exactly as long as the header says. A copy cut short or emptied
    since (a full disk, a restore, a stray edit) is then made again rather than refused at every load. Bytes changed
    inside the tensor data are not looked for: that would read the whole file at each use."""
    from dflash_export.files import read_cache_json

    if not all(isinstance(read_cache_json(d / f, max_bytes=MAX_JSON_BYTES), dict) for f in json_files):
        return False
    try:
        safetensors_header(d / "model.safetensors")
    except DFlashError:
        return False
    return True


def weight_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from a single file or a sharded index (checked against the shards)."""
    single = ckpt / "model.safetensors"
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DFlashError("missing or invalid 'weight_map'", path=index, field="weight_map")
        by_file: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(_shard_name(index, name, fname), set()).add(name)
        out = {}
        for fname, names in by_file.items():
            header = safetensors_header(ckpt / fname)
            missing = names - set(header)
            if missing:
                raise DFlashError(f"index names tensors this shard lacks: {sorted(missing)[:3]}", path=ckpt / fname,
                                  field="weight_map")
            elsewhere = sorted(n for n in header if n != "__metadata__" and weight_map.get(n, fname) != fname)
            if elsewhere:
                raise DFlashError(f"tensor stored in two shards (the index names {weight_map[elsewhere[0]]!r})",
                                  path=ckpt / fname, field=elsewhere[0])
            out.update({n: ckpt / fname for n in names})
        return out
    if single.is_file():
        header = safetensors_header(single)
        return {n: single for n in header if n != "__metadata__"}
    files = sorted(ckpt.glob("*.safetensors"))
    if len(files) == 1:
        header = safetensors_header(files[0])
        return {n: files[0] for n in header if n != "__metadata__"}
    raise DFlashError("no model.safetensors or model.safetensors.index.json", path=ckpt)


def tensor_headers(ckpt: Path) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Tensor name -> (shape, safetensors dtype, file), from the headers only: no tensor data is read."""
    files = weight_files(ckpt)
    headers = {f: safetensors_header(f) for f in set(files.values())}
    return {name: (tuple(headers[f][name]["shape"]), headers[f][name]["dtype"], f) for name, f in files.items()}


def _shard_name(index: Path, name: str, fname) -> str:
    """A weight_map entry: a file name relative to the model directory, never a path leading out of it."""
    if not isinstance(fname, str) or not fname:
        raise DFlashError(f"expected a shard file name, got {fname!r}", path=index, field=f"weight_map.{name}")
    parts = PurePosixPath(fname).parts
    if PurePosixPath(fname).is_absolute() or ".." in parts:
        raise DFlashError(f"{fname!r} is not a file of the model directory", path=index, field=f"weight_map.{name}")
    return fname


def has_safetensors(model_dir: Path) -> bool:
    """Whether a model directory keeps its weights as safetensors (single file or sharded index)."""
    return (model_dir / "model.safetensors").exists() or (model_dir / "model.safetensors.index.json").exists()


def load_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (single file or shards), as stored; a tensor holding NaN or inf is a
    DFlashError naming its file and name (check_finite, on each tensor as it is read)."""
    from safetensors import safe_open

    files = weight_files(ckpt)
    by_file: dict[Path, list[str]] = {}
    for name, fname in files.items():
        by_file.setdefault(fname, []).append(name)
    state = {}
    for fname in sorted(by_file):
        try:
            with native_path(fname) as path, safe_open(path, framework="pt") as f:
                for name in by_file[fname]:  # the tensors the index assigns to this file, no other
                    state[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt data
            raise DFlashError(f"cannot read tensors ({e})", path=fname) from None
        for name in by_file[fname]:
            check_finite(state[name], fname, name)
    return state


# Elements per slice when non-finite values are counted: the slice's boolean mask (16 MiB) and, for a 16-bit or
# 8-bit dtype, its float32 copy (64 MiB) are all the count holds besides the tensor.
_COUNT_SLICE = 1 << 24
# The fp8 formats torch's aminmax lacks on the CPU, by the bits all set in each of their non-finite values and in no
# finite one: e5m2's exponent (inf and NaN); e4m3fn's exponent and mantissa (its NaN; it has no inf).
_FP8_NONFINITE_BITS = {getattr(torch, n): bits for n, bits in (("float8_e4m3fn", 0x7F), ("float8_e5m2", 0x7C))
                       if hasattr(torch, n)}


def _finite_bound(x: torch.Tensor) -> bool:
    return math.isfinite(x.item())


def nonfinite_count(t: torch.Tensor) -> int:
    """How many elements of `t` are NaN or +-inf (0 for integer and bool tensors).

    One torch.aminmax pass settles a finite tensor, which is nearly every one: NaN propagates to both results and an
    inf is the max or the min, so a finite min and max mean every element is finite. It runs on the tensor's own
    dtype, making no temporary. e4m3fn / e5m2 (fp8, which aminmax lacks on the CPU) are screened by their bits a
    slice at a time, any other dtype aminmax lacks by each slice upcast to float32 (exact: every float dtype widens
    to float32 with NaN and inf kept). Only a tensor that fails is counted, a slice at a time in float32 too, so no
    whole copy of a tensor in another dtype is ever held."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    t = t.detach()

    def slices():  # a non-contiguous tensor is copied (this one tensor) only when it is sliced
        return t.reshape(-1).split(_COUNT_SLICE)

    bits = _FP8_NONFINITE_BITS.get(t.dtype)
    if bits is not None:
        finite = all(int(s.view(torch.uint8).bitwise_and(bits).max()) != bits for s in slices())
    else:
        try:
            finite = all(_finite_bound(b) for b in torch.aminmax(t))
        except RuntimeError:  # "aminmax not implemented" for this dtype (NotImplementedError is a RuntimeError)
            finite = all(_finite_bound(b) for s in slices() for b in torch.aminmax(s.float()))
    if finite:
        return 0
    return sum(s.numel() - int(torch.isfinite(s.float()).sum()) for s in slices())


def narrows(loaded: torch.dtype, stored: torch.dtype) -> bool:
    """Whether float values stored as `stored` can overflow to inf loaded as `loaded` (float32 -> float16): a tensor
    found finite as stored is then checked again as loaded."""
    return loaded.is_floating_point and stored.is_floating_point and torch.finfo(loaded).max < torch.finfo(stored).max


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_finite(t: torch.Tensor, path, name: str, note: str = "") -> None:
    """A DFlashError naming `path` and tensor `name` when `t` holds NaN or inf: such a weight makes the model's
    logits NaN (argmax 0: garbage tokens) without any error. `note` follows the count (how the tensor was read)."""
    n = nonfinite_count(t)
    if n:
        raise DFlashError(f"{n} non-finite values (NaN/inf) of {t.numel()}{note}: a model built from this weight "
                          f"computes NaN", path=path, field=name)
