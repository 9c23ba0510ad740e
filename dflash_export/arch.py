"""Per-architecture knowledge as data, in one place (like optimum's per-model-type configs).

Adding a new decoder family means adding one `ArchSpec` entry; no stage branches on `model_type` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP as transformers lays it out: `mlp.gate.weight` [E, H] (the router),
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I]."""

    num_experts: str = "num_experts"              # config keys
    top_k: str = "num_experts_per_tok"
    norm_topk_prob: str = "norm_topk_prob"        # renormalize the top-k softmax weights to sum to 1
    sparse_step: str = "decoder_sparse_step"      # layer i is MoE iff (i + 1) % step == 0 and i not in mlp_only
    mlp_only_layers: str = "mlp_only_layers"

    def layers(self, config) -> list[bool]:
        """Per layer, whether its MLP is the mixture of experts."""
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else \
            (lambda k, d=None: getattr(config, k, d))
        n, step = int(get("num_hidden_layers")), int(get(self.sparse_step, 1) or 1)
        dense = set(get(self.mlp_only_layers, None) or [])
        return [int(get(self.num_experts, 0) or 0) > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hf_architecture: str          # HF `architectures[0]`
    qk_norm: bool                 # per-head RMSNorm on q and k before RoPE (Qwen3): models/target, export/graph
    gguf_arch: str | None         # `general.architecture` in a GGUF file this project converts: models/gguf
    moe: MoeSpec | None = None    # the MLP of (some) layers is a mixture of experts: export/graph


ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm=True, gguf_arch="qwen3"),
    "llama": ArchSpec("llama", "LlamaForCausalLM", qk_norm=False, gguf_arch="llama"),
    # Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention; softmax router, top-k, optional
    # renormalization of the k weights, no shared expert.
    "qwen3_moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, gguf_arch=None, moe=MoeSpec()),
}

# Families transformers knows that a DFlash drafter exists for, refused by name until their layer kinds are built.
REFUSED: dict[str, str] = {
    "gpt_oss": "gpt-oss layers (attention sinks, alternating sliding-window attention, clamped SwiGLU experts with "
               "biases) have no export here yet",
    "qwen3_5": "Qwen3.5's Gated DeltaNet (linear attention) layers have no export here yet (their recurrent state "
               "would have to roll back to the accepted prefix after each verify)",
    "qwen3_5_moe": "Qwen3.5's Gated DeltaNet (linear attention) layers have no export here yet",
    "qwen3_next": "Qwen3-Next's Gated DeltaNet (linear attention) layers have no export here yet",
}

