"""Per-architecture knowledge as data, in one place (like optimum's per-model-type configs).

Adding a new decoder family means adding one `ArchSpec` entry; no stage branches on `model_type` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hf_architecture: str          # HF `architectures[0]`
    qk_norm: bool                 # per-head RMSNorm on q and k before RoPE (Qwen3): models/target, export/graph
    gguf_arch: str | None         # `general.architecture` in a GGUF file this project converts: models/gguf


ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm=True, gguf_arch="qwen3"),
    "llama": ArchSpec("llama", "LlamaForCausalLM", qk_norm=False, gguf_arch="llama"),
}

