"""Per-architecture knowledge as data, in one place (like optimum's per-model-type configs).

Adding a new decoder family means adding one `ArchSpec` entry; no stage branches on `model_type` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP as transformers lays it out. Qwen3-MoE (the defaults): router `mlp.gate.weight`
    [E, H], softmax over all experts then top-k (optionally renormalized); `mlp.experts.gate_up_proj` [E, 2I, H] with
    the gate rows first, `mlp.experts.down_proj` [E, H, I]; SiLU(gate) * up. gpt-oss: router `mlp.router` with a
    bias, top-k of the logits then a softmax over those k; `gate_up_proj` [E, H, 2I] with gate and up interleaved
    (even / odd columns) and biases; gate clamped above at `swiglu_limit`, up to +-limit, gate * sigmoid(1.702 gate)
    * (up + 1)."""

    num_experts: str = "num_experts"              # config keys
    top_k: str = "num_experts_per_tok"
    norm_topk_prob: str | None = "norm_topk_prob"  # renormalize the top-k softmax weights to sum to 1
    sparse_step: str | None = "decoder_sparse_step"  # layer i is MoE iff (i + 1) % step == 0 and not mlp-only
    mlp_only_layers: str | None = "mlp_only_layers"
    router: str = "gate"                          # weight name under mlp.
    softmax_after_topk: bool = False              # gpt-oss: softmax over the k chosen logits
    interleaved_transposed: bool = False          # gpt-oss: gate_up [E, H, 2I] interleaved, down [E, I, H]
    expert_bias: bool = False
    swiglu_limit: str | None = None               # config key of the clamp (gpt-oss)
    swiglu_alpha: float = 1.0                     # gate * sigmoid(alpha * gate)
    up_plus_one: bool = False

    def layers(self, config) -> list[bool]:
        """Per layer, whether its MLP is the mixture of experts."""
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else \
            (lambda k, d=None: getattr(config, k, d))
        n = int(get("num_hidden_layers"))
        step = int(get(self.sparse_step, 1) or 1) if self.sparse_step else 1
        dense = set(get(self.mlp_only_layers, None) or []) if self.mlp_only_layers else set()
        return [int(get(self.num_experts, 0) or 0) > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hf_architecture: str          # HF `architectures[0]`
    qk_norm: bool                 # per-head RMSNorm on q and k before RoPE (Qwen3): models/target, export/graph
    gguf_arch: str | None         # `general.architecture` in a GGUF file this project converts: models/gguf
    moe: MoeSpec | None = None    # the MLP of (some) layers is a mixture of experts: export/graph
    attention_sinks: bool = False  # a learned per-head logit joins every softmax and is dropped after (gpt-oss)
    sliding_layers: bool = False   # config.layer_types marks layers "sliding_attention" (window config.sliding_window)
    attn_implementation: str = "sdpa"  # transformers' attention for the reference (sinks need "eager")


ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm=True, gguf_arch="qwen3"),
    "llama": ArchSpec("llama", "LlamaForCausalLM", qk_norm=False, gguf_arch="llama"),
    # Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention; softmax router, top-k, optional
    # renormalization of the k weights, no shared expert.
    "qwen3_moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, gguf_arch=None, moe=MoeSpec()),
}

ARCHS["gpt_oss"] = ArchSpec(
    # gpt-oss-20b / 120b: biased q/k/v/o, attention sinks, alternating sliding-window / full layers, YaRN RoPE (taken
    # from transformers' own rotary module), every layer a mixture of experts.
    "gpt_oss", "GptOssForCausalLM", qk_norm=False, gguf_arch=None, attention_sinks=True, sliding_layers=True,
    attn_implementation="eager",
    moe=MoeSpec(num_experts="num_local_experts", norm_topk_prob=None, sparse_step=None, mlp_only_layers=None,
                router="router", softmax_after_topk=True, interleaved_transposed=True, expert_bias=True,
                swiglu_limit="swiglu_limit", swiglu_alpha=1.702, up_plus_one=True))


def sliding_windows(arch: ArchSpec, config) -> list[int | None]:
    """Per layer, its sliding window (keys with position > query position - window are visible), or None."""
    n = int(getattr(config, "num_hidden_layers"))
    if not arch.sliding_layers:
        return [None] * n
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    window = getattr(config, "sliding_window", None)
    return [int(window) if t == "sliding_attention" and window else None for t in types]


# Families transformers knows that a DFlash drafter exists for, refused by name until their layer kinds are built.
REFUSED: dict[str, str] = {  # gpt_oss: see ARCHS above
    "qwen3_5": "Qwen3.5's Gated DeltaNet (linear attention) layers have no export here yet (their recurrent state "
               "would have to roll back to the accepted prefix after each verify)",
    "qwen3_5_moe": "Qwen3.5's Gated DeltaNet (linear attention) layers have no export here yet",
    "qwen3_next": "Qwen3-Next's Gated DeltaNet (linear attention) layers have no export here yet",
}

