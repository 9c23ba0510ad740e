"""The parameter list of a Triton-compiled kernel, made to match what TensorRT's AOT plugin launch passes.

TensorRT launches an AOT plugin's kernel with one 64-bit device pointer per input, then the aot_impl's extra
arguments (32-bit integers here), then one pointer per output. Triton (>= 3.3) appends its own trailing pointer
parameters to every kernel's PTX `.entry` (global scratch, and from later releases profile scratch too), which its
own launcher fills and TensorRT's does not name. `launchable_ptx` makes the launched list independent of that: it
refuses a kernel whose compiled metadata asks for scratch memory or a launch TensorRT cannot make, checks that the
`.entry`'s leading parameters have the widths TensorRT passes, checks that the PTX never reads the trailing ones,
and removes them from the `.entry`. What is left is exactly what TensorRT passes, whatever Triton version compiled
it (one with no trailing parameters, as 3.2, is left as it was).

Plain text work on the PTX (no GPU, no Triton import): tests/trt_lane.py assembles the result with Triton's ptxas.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from dflash_export.errors import DFlashError

# `.param .u64 .ptr .global .align 1 name` / `.param .u32 name`: a type, state-space qualifiers, a name.
_PARAM = re.compile(r"^\.param\s+\.(?P<type>[a-z]+)(?P<bits>\d+)(?P<quals>(?:\s+\.[a-z]+(?:\s+\d+)?)*)\s+"
                    r"(?P<name>[A-Za-z_$][\w$]*)$")
_ENTRY = re.compile(r"\.entry\s+(?P<name>[A-Za-z_$][\w$]*)\s*\(")

# Triton's compiled-kernel metadata that changes how a kernel must be launched, and why TensorRT cannot do it.
# Absent fields (older Triton) read as the harmless default.
_LAUNCH_NEEDS = (
    ("global_scratch_size", 0, "global scratch memory, which Triton's launcher allocates and TensorRT's does not"),
    ("profile_scratch_size", 0, "profile scratch memory, which Triton's launcher allocates and TensorRT's does not"),
    ("num_ctas", 1, "a thread-block cluster launch, which TensorRT's AOT launch does not make"),
    ("launch_cooperative_grid", False, "a cooperative grid launch, which TensorRT's AOT launch does not make"),
    ("launch_pdl", False, "a programmatic-dependent launch, which TensorRT's AOT launch does not make"),
)


@dataclasses.dataclass(frozen=True)
class PtxParam:
    """One `.entry` parameter: its name, PTX type (`u64`, `b32`, ...), width in bits, and whether it is declared a
    pointer (`.ptr`)."""

    name: str
    type: str
    bits: int
    pointer: bool


@dataclasses.dataclass(frozen=True)
class PtxEntry:
    """A kernel's `.entry`: its name, parameters, and the character span of its parameter list (inside the
    parentheses) in the PTX text."""

    name: str
    params: tuple[PtxParam, ...]
    span: tuple[int, int]


def _abi_error(kernel: str, what: str, field: str = "ptx") -> DFlashError:
    return DFlashError(f"AOT kernel {kernel}: {what}", field=field)


def parse_entry(ptx: str, kernel: str) -> PtxEntry:
    """The `.entry` named `kernel` in `ptx`; DFlashError naming the kernel when it is absent, declared twice, or has a
    parameter this parser does not understand (an aggregate `.b8 name[n]`, say)."""
    found = [m for m in _ENTRY.finditer(ptx) if m.group("name") == kernel]
    if len(found) != 1:
        raise _abi_error(kernel, f"{len(found)} .entry declarations of it in the PTX (expected 1)")
    start = found[0].end()
    end = ptx.find(")", start)
    if end < 0:
        raise _abi_error(kernel, "unterminated .entry parameter list")
    params = []
    for i, raw in enumerate(p.strip() for p in ptx[start:end].split(",")):
        if not raw and i == 0 and not ptx[start:end].strip():
            break  # no parameters
        m = _PARAM.match(" ".join(raw.split()))
        if m is None:
            raise _abi_error(kernel, f"parameter {i} is not a scalar or pointer parameter: {raw!r}")
        params.append(PtxParam(m.group("name"), m.group("type") + m.group("bits"), int(m.group("bits")),
                               ".ptr" in m.group("quals").split()))
    return PtxEntry(kernel, tuple(params), (start, end))


def references(ptx: str, entry: PtxEntry, param: PtxParam) -> int:
    """How many times `param`'s name occurs in the PTX outside its own declaration (any read, address-of or mention
    counts: the check errs on the side of keeping a parameter)."""
    outside = ptx[:entry.span[0]] + ptx[entry.span[1]:]
    return len(re.findall(rf"(?<![\w$]){re.escape(param.name)}(?![\w$])", outside))


def check_launch_metadata(kernel: str, metadata: Any) -> None:
    """Refuse, by name, a compiled kernel whose Triton metadata asks for something TensorRT's AOT launch does not
    give (scratch memory, a cluster / cooperative / programmatic-dependent launch, tensor-descriptor arguments)."""
    for field, harmless, what in _LAUNCH_NEEDS:
        value = getattr(metadata, field, harmless)
        if value is not None and value != harmless:
            raise _abi_error(kernel, f"Triton compiled it to need {what} ({field} = {value!r})", field=field)
    descriptors = getattr(metadata, "tensordesc_meta", None)
    if descriptors:
        raise _abi_error(kernel, "Triton compiled it with tensor-descriptor arguments, which TensorRT's AOT launch "
                         "does not pass", field="tensordesc_meta")


def launchable_ptx(ptx: str, kernel: str, metadata: Any, widths: Sequence[int]) -> tuple[str, PtxEntry]:
    """(PTX, its `.entry`) whose parameters are exactly the `widths` (bits, in order) TensorRT passes.

    `metadata` is Triton's compiled-kernel metadata. The leading parameters must have those widths; each parameter
    past them must be a 64-bit value the PTX never mentions, which is then removed from the `.entry`. A kernel that
    needs scratch memory or a special launch is refused first (`check_launch_metadata`). Raises DFlashError naming
    the kernel and the offending parameter or metadata field."""
    check_launch_metadata(kernel, metadata)
    entry = parse_entry(ptx, kernel)
    n = len(widths)
    if len(entry.params) < n:
        raise _abi_error(kernel, f"the .entry declares {len(entry.params)} parameters, TensorRT passes {n}")
    for i, (param, bits) in enumerate(zip(entry.params, widths)):
        if param.bits != bits:
            raise _abi_error(kernel, f"parameter {i} ({param.name}) is {param.type}, TensorRT passes {bits} bits")
    extra = entry.params[n:]
    for param in extra:
        if param.bits != 64:
            raise _abi_error(kernel, f"trailing parameter {param.name} ({param.type}) is not one of Triton's "
                             "scratch pointers")
        used = references(ptx, entry, param)
        if used:
            raise _abi_error(kernel, f"trailing parameter {param.name}, which TensorRT does not pass, is used "
                             f"{used} time(s) in the PTX")
    if not extra:
        return ptx, entry
    kept = ptx[entry.span[0]:entry.span[1]].split(",")[:n]
    text = ptx[:entry.span[0]] + ",".join(kept).rstrip() + "\n" + ptx[entry.span[1]:]
    stripped = parse_entry(text, kernel)
    assert [p.bits for p in stripped.params] == list(widths)
    return text, stripped


def signature_widths(signature: dict[str, str]) -> list[int]:
    """Widths in bits of a Triton signature's run-time arguments (pointers 64, `i32` 32, ...), constexprs left
    out."""
    widths = []
    for name, typ in signature.items():
        if typ == "constexpr":
            continue
        if typ.startswith("*"):
            widths.append(64)
        else:
            m = re.fullmatch(r"[iuf]p?(\d+)|bf(16)", typ)
            if m is None:
                raise DFlashError(f"no width for Triton argument type {typ!r}", field=name)
            widths.append(int(m.group(1) or m.group(2)))
    return widths
