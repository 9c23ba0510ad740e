"""safetensors weights read with their headers bounds-checked first: a truncated, corrupt or missing shard is named by
file before any tensor is loaded."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from dflash_export.errors import DFlashError
from dflash_export.files import read_json_object

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


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
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise DFlashError("file not found", path=path) from None
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply, an integer too long to read
        raise DFlashError("corrupt safetensors header", path=path) from None
    if not isinstance(header, dict):
        raise DFlashError("corrupt safetensors header (not a JSON object)", path=path)
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets", (0, 0)) if isinstance(info, dict) else None
        if (not isinstance(offsets, (list, tuple)) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
            raise DFlashError("corrupt safetensors header (expected data_offsets [begin, end])", path=path,
                              field=name)
        begin, end = offsets
        if end > data_len:
            raise DFlashError(f"truncated safetensors file (tensor data cut off, {data_len} of {end} bytes)",
                              path=path, field=name)
    return header


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
            by_file.setdefault(fname, set()).add(name)
        out = {}
        for fname, names in by_file.items():
            header = safetensors_header(ckpt / fname)
            missing = names - set(header)
            if missing:
                raise DFlashError(f"index names tensors this shard lacks: {sorted(missing)[:3]}", path=ckpt / fname,
                                  field="weight_map")
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


def has_safetensors(model_dir: Path) -> bool:
    """Whether a model directory keeps its weights as safetensors (single file or sharded index)."""
    return (model_dir / "model.safetensors").exists() or (model_dir / "model.safetensors.index.json").exists()


def load_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = weight_files(ckpt)
    state = {}
    for fname in sorted(set(files.values())):
        try:
            with safe_open(str(fname), framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt data
            raise DFlashError(f"cannot read tensors ({e})", path=fname) from None
    return state
