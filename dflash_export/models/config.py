"""The drafter's contract: its config as z-lab's release reads it (a plain dataclass, no torch modules), z-lab's rule
for the target layers a drafter taps, and `DFlashSpec`, the constants every stage resolves once and shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_export.decoding.request import shown

# The longest sequence (prompt, answer and one block) any engine is built for: the graphs hold cos/sin tables of
# max_seq_len rows. A recipe's max_seq_len, and so every block, stays below it.
MAX_SEQ_LEN = 2**20
# The most decoder layers, and experts per mixture-of-experts layer, a config may name (the largest published models
# have some 130 layers and 512 experts): work and memory spent on a config grow with them before its weights are
# looked at (transformers' config classes build a list per layer, the checks an entry per layer and expert).
MAX_LAYERS = 1 << 10
MAX_EXPERTS = 1 << 10
# The longest context a config may give (max_position_embeddings, RoPE scaling's original_max_position_embeddings,
# a GGUF's context_length): 16 Mi tokens, past the longest published (Llama 4 Scout's 10 Mi) and 16 times the longest
# sequence an engine is built for (MAX_SEQ_LEN). No tensor's shape checks it; transformers' RoPE reads it as a float.
MAX_CONTEXT_LENGTH = 1 << 24
# The widest a config may make a layer (hidden size, MLP and expert widths, a head's channels), the most attention
# heads, and the largest vocabulary: some 64, 32 and 16 times the largest published (16384 hidden, 53248 MLP, 128
# heads, 262144 tokens). The weights' shapes are checked against them, but the settings derived from them first
# (head_dim from hidden_size / heads, RoPE's channels): a bound names a hostile value by its own key.
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 12
MAX_VOCAB = 1 << 22
# The bounds of config.json's sizes (a target's, a drafter's; a sliding window is a context's length at most); the
# layer and expert counts have checks of their own.
MAX_SIZES = {
    "max_position_embeddings": MAX_CONTEXT_LENGTH, "sliding_window": MAX_CONTEXT_LENGTH, "vocab_size": MAX_VOCAB,
    **dict.fromkeys(("hidden_size", "target_hidden_size", "intermediate_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim"),
                    MAX_WIDTH),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"),
                    MAX_HEADS),
}


def oversize(name: str, value: int) -> str | None:
    """Why config.json's size `name` of `value` is refused (past its MAX_SIZES bound), or None."""
    bound = MAX_SIZES.get(name)
    if bound is None or value <= bound:
        return None
    return f"{shown(value)}: more than the {bound} this project reads"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule when `target_layer_ids` is absent (Python's round, i.e. banker's rounding)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """The drafter's `config.json`, normalized. `target_hidden_size` comes from `fc.weight` when not given."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    vocab_size: int
    target_hidden_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None       # the non-default RoPE type and its parameters (transformers 4 form)
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    sliding_window: int | None = None      # effective window: None unless the config enables it (use_sliding_window)
    is_causal: bool | None = None          # top-level `is_causal`: None = causal exactly on sliding layers
    input_embedding_scale: float = 1.0     # block embeddings x this
    output_multiplier: float = 1.0         # draft logits x this ...
    final_logit_softcapping: float | None = None  # ... then c * tanh(logits / c) when set and > 0
    # DFlash 2 (z-lab's DFlash2DraftModel): grouped dynamic causal convolutions around attention and MLP, and a
    # candidate selector over the top-k draft tokens. All 0 for a DFlash drafter.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_parameters(self) -> dict:
        """RoPE as transformers 5 standardizes it: {rope_type, rope_theta, ...scaling parameters}."""
        params = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": float(self.rope_theta)}
        params.pop("type", None)
        return params

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (keys at most window-1 positions away), None for full attention."""
        if self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_causal(self, i: int) -> bool:
        """Whether layer i's block queries see only keys at or before their own position (z-lab: `is_causal`
        defaults to the layer being a sliding_attention layer)."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"

    @property
    def masked(self) -> bool:
        """Whether any layer needs an attention mask (is causal or windowed)."""
        return any(self.layer_causal(i) or self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size > 0

    @property
    def scales_logits(self) -> bool:
        return self.output_multiplier != 1.0 or bool(self.final_logit_softcapping and
                                                     self.final_logit_softcapping > 0)

    def to_dict(self) -> dict[str, Any]:
        """The z-lab `config.json` (ModelOpt writes the same keys)."""
        d = dict(self.extra)
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            hidden_act=self.hidden_act,
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            target_hidden_size=self.target_hidden_size,
            torch_dtype=self.torch_dtype,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        )
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = self.sliding_window is not None  # else transformers drops sliding_window
        if self.is_causal is not None:
            d["is_causal"] = bool(self.is_causal)
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", None)):
            if getattr(self, name) != default:
                d["dflash_config"][name] = getattr(self, name)
        if self.is_dflash2:
            d["architectures"] = ["DFlash2DraftModel"]
            d["dflash_config"].update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
                                      selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        return d


@dataclass(frozen=True)
class DFlashSpec:
    """The DFlash constants every stage must agree on, resolved once from the drafter's config and a recipe's block
    size (which may shorten the drafter's own) and passed down: export writes them into each graph's metadata, a
    build into the manifest, the reference and the runtimes draft with them. `contract_metadata` is the one place
    their graph-metadata spelling lives (export writes it, export's check and the ORT engine compare against it)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    kind: str = "dflash"                     # "dflash", or "dflash2" (causal convolutions + candidate selector)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def resolve(cls, config: DrafterConfig, block_size: int | None = None) -> DFlashSpec:
        """The spec of a drafter with this config, drafting blocks of `block_size` (None: the drafter's own)."""
        return cls(block_size=int(block_size or config.block_size), mask_token_id=int(config.mask_token_id),
                   target_layer_ids=tuple(int(t) for t in config.target_layer_ids),
                   kind="dflash2" if config.is_dflash2 else "dflash",
                   input_embedding_scale=float(config.input_embedding_scale),
                   output_multiplier=float(config.output_multiplier),
                   final_logit_softcapping=config.final_logit_softcapping)

    def contract_metadata(self, max_seq_len: int) -> dict[str, str]:
        """The graph-metadata keys (strings, as ONNX wants) an engine checks its graphs against."""
        import json

        return {"dflash.block_size": str(self.block_size),
                "dflash.target_layer_ids": json.dumps(list(self.target_layer_ids)),
                "dflash.mask_token_id": str(self.mask_token_id), "dflash.max_seq_len": str(max_seq_len)}
