"""Triton's model configuration (config.pbtxt), the parts this project writes: a typed description (`ModelConfig`,
`TensorSpec`), its renderer, and a reader for the protobuf text format that checks names, data types and dims -- every
config is rendered, parsed back and checked before it is written, and `deploy --check` reads it again.

Hand-written: the text format is small, and Triton's own parser (protobuf + the model_config proto) is not installed
here; what it accepts beyond these parts is refused by name rather than guessed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_export.errors import DFlashError

# Data types Triton's model configuration accepts (TYPE_STRING is Triton's BYTES).
DATA_TYPES = {"TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16",
              "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16"}

NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")  # model and tensor names
MAX_INSTANCES = 64
_TOKEN = re.compile(r'\s*(?:(#[^\n]*)|("(?:[^"\\]|\\.)*")|([{}\[\]:,])|([A-Za-z0-9_.+\-]+))', re.S)


@dataclass
class TensorSpec:
    name: str
    data_type: str
    dims: list[int]
    optional: bool = False


@dataclass
class ModelConfig:
    """The parts of Triton's ModelConfig this project writes."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    backend: str = "python"
    max_batch_size: int | None = 0     # None: leave it to the model (llmapi reads it from model.yaml)
    instances: int | None = 1          # None: leave instance_group to the model (llmapi sets it in model.yaml)
    decoupled: bool | None = False     # None: leave the transaction policy to the model
    max_queue_size: int | None = None  # None: no queue policy
    parameters: dict[str, str] = field(default_factory=dict)


def _quote(s: str) -> str:
    """A protobuf text-format string literal (non-ASCII as octal-escaped UTF-8 bytes)."""
    out = []
    for b in s.encode("utf-8"):
        c = chr(b)
        if c in '"\\':
            out.append("\\" + c)
        elif 32 <= b < 127:
            out.append(c)
        else:
            out.append(f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def _tensor_block(t: TensorSpec) -> str:
    lines = [f"    name: {_quote(t.name)}", f"    data_type: {t.data_type}",
             f"    dims: [ {', '.join(str(d) for d in t.dims)} ]"]
    if t.optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def render_config(cfg: ModelConfig) -> str:
    parts = [f"name: {_quote(cfg.name)}", f"backend: {_quote(cfg.backend)}"]
    if cfg.max_batch_size is not None:
        parts.append(f"max_batch_size: {cfg.max_batch_size}")
    if cfg.decoupled is not None:
        parts.append(f"model_transaction_policy {{\n  decoupled: {str(cfg.decoupled).lower()}\n}}")
    parts.append("input [\n" + ",\n".join(_tensor_block(t) for t in cfg.inputs) + "\n]")
    parts.append("output [\n" + ",\n".join(_tensor_block(t) for t in cfg.outputs) + "\n]")
    if cfg.instances is not None:
        parts.append(f"instance_group [\n  {{\n    count: {cfg.instances}\n    kind: KIND_CPU\n  }}\n]")
    if cfg.max_queue_size is not None:
        # The queue policy lives in the dynamic batcher; with max_batch_size 0 it batches nothing and only queues.
        parts.append("dynamic_batching {\n  default_queue_policy {\n"
                     f"    max_queue_size: {cfg.max_queue_size}\n  }}\n}}")
    for key, value in cfg.parameters.items():
        parts.append(f"parameters {{\n  key: {_quote(key)}\n  value {{\n    string_value: {_quote(value)}\n  }}\n}}")
    return "\n".join(parts) + "\n"


def _unquote(lit: str) -> str:
    raw = lit[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    return raw.encode("latin-1").decode("utf-8")


def parse_pbtxt(text: str, path="config.pbtxt") -> dict[str, Any]:
    """Parse the protobuf text format subset Triton configs use into dicts; repeated fields become lists."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise DFlashError(f"config.pbtxt syntax error at offset {pos}: {text[pos:pos + 20]!r}", path=path)
        pos = m.end()
        if m.group(1):
            continue
        if m.group(2):
            tokens.append(("str", _unquote(m.group(2))))
        elif m.group(3):
            tokens.append(("punct", m.group(3)))
        elif m.group(4):
            tokens.append(("word", m.group(4)))
    i = 0

    def fail(msg):
        raise DFlashError(f"config.pbtxt: {msg} (token {i})", path=path)

    def value():
        nonlocal i
        kind, tok = tokens[i]
        if tok == "{" and kind == "punct":
            i += 1
            return message("}")
        if tok == "[" and kind == "punct":
            i += 1
            items = []
            while not (tokens[i] == ("punct", "]")):
                items.append(value())
                if tokens[i] == ("punct", ","):
                    i += 1
            i += 1
            return items
        i += 1
        if kind == "str":
            return tok
        if kind != "word":
            fail(f"unexpected {tok!r}")
        if tok in ("true", "false"):
            return tok == "true"
        if re.fullmatch(r"[+-]?\d+", tok):
            return int(tok)
        if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", tok):
            return float(tok)
        return tok  # enum

    def message(end):
        nonlocal i
        out: dict[str, Any] = {}
        while i < len(tokens) and tokens[i] != ("punct", end or ""):
            kind, key = tokens[i]
            if kind != "word":
                fail(f"expected a field name, got {key!r}")
            i += 1
            if tokens[i] == ("punct", ":"):
                i += 1
            v = value()
            if key in out:
                prev = out[key]
                out[key] = (prev if isinstance(prev, list) else [prev]) + (v if isinstance(v, list) else [v])
            else:
                out[key] = v
            if i < len(tokens) and tokens[i] == ("punct", ","):
                i += 1
        if end:
            if i >= len(tokens):
                fail(f"missing {end!r}")
            i += 1
        return out

    try:
        return message(None)
    except IndexError:
        fail("unexpected end of file")
        raise  # unreachable


def check_config_text(text: str, path="config.pbtxt", expect_name: str | None = None) -> dict[str, Any]:
    """Check a config.pbtxt: name, backend, batch size, and every tensor's name / data type / dims.

    Returns the parsed config; DFlashError naming the file and the offending field otherwise.
    """
    cfg = parse_pbtxt(text, path)

    def err(field_name, msg):
        raise DFlashError(msg, path=path, field=field_name)

    name = cfg.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        err("name", f"model name must match {NAME_PATTERN.pattern}, got {name!r}")
    if expect_name is not None and name != expect_name:
        err("name", f"must equal the model's directory name {expect_name!r}, got {name!r}")
    if not isinstance(cfg.get("backend"), str) or not cfg["backend"]:
        err("backend", "missing or empty")
    mbs = cfg.get("max_batch_size", 0)
    if not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 0:
        err("max_batch_size", f"must be an integer >= 0, got {mbs!r}")
    seen: set[str] = set()
    for section in ("input", "output"):
        tensors = cfg.get(section, [])
        tensors = tensors if isinstance(tensors, list) else [tensors]
        if not tensors:
            err(section, "no tensors declared")
        for k, t in enumerate(tensors):
            where = f"{section}[{k}]"
            if not isinstance(t, dict):
                err(where, "must be a message")
            tname = t.get("name")
            if not isinstance(tname, str) or not NAME_PATTERN.match(tname):
                err(f"{where}.name", f"must match {NAME_PATTERN.pattern}, got {tname!r}")
            key = f"{section}:{tname}"
            if key in seen:
                err(f"{where}.name", f"duplicate {section} {tname!r}")
            seen.add(key)
            if not isinstance(t.get("data_type"), str) or t["data_type"] not in DATA_TYPES:  # a repeated one: a list
                err(f"{section} {tname}.data_type", f"unknown data type {t.get('data_type')!r}")
            dims = t.get("dims")
            dims = [dims] if isinstance(dims, int) and not isinstance(dims, bool) else dims
            if not isinstance(dims, list) or not dims:
                err(f"{section} {tname}.dims", "must be a non-empty list")
            if any(not isinstance(d, int) or isinstance(d, bool) or (d < 1 and d != -1) for d in dims):
                err(f"{section} {tname}.dims", f"each dim must be >= 1 or -1 (variable), got {dims}")
            if "optional" in t and (section == "output" or not isinstance(t["optional"], bool)):
                err(f"{section} {tname}.optional", "only inputs may be optional (true/false)")
    for g in cfg.get("instance_group", []) if isinstance(cfg.get("instance_group"), list) else []:
        if not isinstance(g, dict):
            err("instance_group", f"each item must be a message, got {g!r}")
        count = g.get("count", 1)
        if not isinstance(count, int) or not 1 <= count <= MAX_INSTANCES:
            err("instance_group.count", f"must be in 1..{MAX_INSTANCES}, got {count!r}")
        if g.get("kind", "KIND_CPU") not in ("KIND_CPU", "KIND_GPU", "KIND_AUTO", "KIND_MODEL"):
            err("instance_group.kind", f"unknown kind {g.get('kind')!r}")
    policy = cfg.get("dynamic_batching", {}).get("default_queue_policy", {}) if isinstance(
        cfg.get("dynamic_batching"), dict) else {}
    if not isinstance(policy, dict):
        err("dynamic_batching.default_queue_policy", f"must be a message, got {policy!r}")
    mqs = policy.get("max_queue_size", 0)
    if not isinstance(mqs, int) or mqs < 0:
        err("dynamic_batching.default_queue_policy.max_queue_size", f"must be >= 0, got {mqs!r}")
    return cfg


def write_config(model_dir: Path, cfg: ModelConfig) -> str:
    """Render, check and write `<model_dir>/config.pbtxt`; returns the text."""
    text = render_config(cfg)
    check_config_text(text, model_dir / "config.pbtxt", expect_name=model_dir.name)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text, encoding="utf-8")
    return text
