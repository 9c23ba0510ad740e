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
    intermediate_size: str = "moe_intermediate_size"  # each expert's width
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
    always_normalized: bool = False               # the top-k weights are renormalized whatever the config says

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
    hybrid: "HybridSpec | None" = None  # Gated DeltaNet (linear attention) layers between gated full attention
    text_config: bool = False      # composite (vision + text) config.json: the decoder's settings sit under text_config


ARCHS: dict[str, ArchSpec] = {
    # Qwen3 with use_sliding_window: transformers marks layers from max_window_layers on "sliding_attention".
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm=True, gguf_arch="qwen3", sliding_layers=True),
    "llama": ArchSpec("llama", "LlamaForCausalLM", qk_norm=False, gguf_arch="llama"),
    # Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention; softmax router, top-k, optional
    # renormalization of the k weights, no shared expert; with use_sliding_window every layer is windowed. Its GGUF
    # (llama.cpp's `qwen3moe`) has every layer a mixture of experts, renormalized: models/gguf.
    "qwen3_moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, gguf_arch="qwen3moe", moe=MoeSpec(),
                          sliding_layers=True),
}

ARCHS["gpt_oss"] = ArchSpec(
    # gpt-oss-20b / 120b: biased q/k/v/o, attention sinks, alternating sliding-window / full layers, YaRN RoPE (taken
    # from transformers' own rotary module), every layer a mixture of experts.
    "gpt_oss", "GptOssForCausalLM", qk_norm=False, gguf_arch=None, attention_sinks=True, sliding_layers=True,
    attn_implementation="eager",
    moe=MoeSpec(num_experts="num_local_experts", intermediate_size="intermediate_size", norm_topk_prob=None,
                sparse_step=None, mlp_only_layers=None, router="router", softmax_after_topk=True,
                interleaved_transposed=True, expert_bias=True, swiglu_limit="swiglu_limit", swiglu_alpha=1.702,
                up_plus_one=True))


def sliding_windows(arch: ArchSpec, config) -> list[int | None]:
    """Per layer, its sliding window (keys with position > query position - window are visible), or None. A family
    with sliding layers and no `layer_types` (Qwen3-MoE) windows every layer once config.sliding_window is set, as
    transformers' model does (its config sets the window only with use_sliding_window)."""
    n = int(getattr(config, "num_hidden_layers"))
    if not arch.sliding_layers:
        return [None] * n
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or [
        "sliding_attention" if window is not None else "full_attention"] * n)
    return [int(window) if t == "sliding_attention" and window else None for t in types]


@dataclass(frozen=True)
class HybridSpec:
    """Qwen3.5 / 3.6 and Qwen3-Next: `config.layer_types` marks each layer "linear_attention" (Gated DeltaNet: a
    depthwise causal conv of `linear_conv_kernel_dim` taps over q/k/v, then a recurrent state per value head
    [key_head_dim, value_head_dim] updated per token by the gated delta rule) or "full_attention" (Qwen3 attention
    whose q_proj also yields a per-channel output gate, sigmoid(gate) * attention before o_proj, and RoPE over the
    first `partial_rotary_factor` of each head). Every RMSNorm but the Gated DeltaNet's output norm scales by
    (1 + weight). The facts are transformers' own config classes' (Qwen3_5TextConfig, Qwen3_5MoeTextConfig,
    Qwen3NextConfig); the split of the input projections is the one thing that differs between the families."""

    fused_projections: bool  # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head; Qwen3.5: four projections
    shared_expert: bool = False  # MoE layers add a sigmoid-gated shared expert (mlp.shared_expert[_gate])

    @staticmethod
    def layer_kinds(config) -> list[str]:
        """Per layer, "linear_attention" or "full_attention", as transformers' config class derived them."""
        return list(config.layer_types)

    @staticmethod
    def linear_shapes(config) -> dict[str, int]:
        """The Gated DeltaNet's sizes: key / value heads and head dims, the conv kernel and the conv's channels."""
        hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        return {"key_heads": hk, "value_heads": hv, "key_dim": dk, "value_dim": dv,
                "conv_kernel": int(config.linear_conv_kernel_dim), "conv_channels": 2 * hk * dk + hv * dv}


_QWEN35_MOE = MoeSpec(sparse_step=None, mlp_only_layers=None, norm_topk_prob=None, always_normalized=True)
# Qwen3.5 / 3.6 dense and MoE (composite vision + text checkpoints and their text-only forms) and Qwen3-Next. The
# MoE routers are Qwen3-MoE's (softmax, top-k, renormalized: transformers' Qwen3_5Moe router always renormalizes).
for _name, _arch, _moe, _composite in (
        ("qwen3_5", "Qwen3_5ForCausalLM", None, True),
        ("qwen3_5_text", "Qwen3_5ForCausalLM", None, False),
        ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", _QWEN35_MOE, True),
        ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", _QWEN35_MOE, False)):
    ARCHS[_name] = ArchSpec(_name, _arch, qk_norm=True, gguf_arch=None, moe=_moe, text_config=_composite,
                            attn_implementation="eager",
                            hybrid=HybridSpec(fused_projections=False, shared_expert=_moe is not None))
ARCHS["qwen3_next"] = ArchSpec("qwen3_next", "Qwen3NextForCausalLM", qk_norm=True, gguf_arch=None, moe=MoeSpec(),
                               attn_implementation="eager",
                               hybrid=HybridSpec(fused_projections=True, shared_expert=True))

# transformers' config class of each family, for reading a config.json as transformers does (models/rope.py).
CONFIG_CLASSES = {"qwen3_5": "Qwen3_5TextConfig", "qwen3_5_text": "Qwen3_5TextConfig",
                  "qwen3_5_moe": "Qwen3_5MoeTextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
                  "qwen3_next": "Qwen3NextConfig"}


def text_settings(cfg: dict) -> dict:
    """A config.json's decoder settings: a composite checkpoint's `text_config` (its vision settings ignored) under
    the checkpoint's own model_type, anything else as it is."""
    arch = ARCHS.get(cfg.get("model_type"))
    if arch is None or not arch.text_config or not isinstance(cfg.get("text_config"), dict):
        return cfg
    out = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    out.update({k: v for k, v in cfg["text_config"].items() if k != "model_type"})
    return out


# Families transformers knows that a DFlash drafter exists for, refused by name until their layer kinds are built.
REFUSED: dict[str, str] = {}  # gpt_oss, the Qwen3.5 / Qwen3-Next hybrids: see ARCHS above

