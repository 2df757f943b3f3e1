"""``ModelSpec``: the decoder shape read from a transformers config, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from dflash2.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# RoPE types whose inverse frequencies do not change with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class MoESpec:
    """The sparse MLP of a mixture-of-experts decoder: E experts, top-k routing, which layers."""

    experts: int
    top_k: int
    intermediate_size: int
    normalize: bool  # renormalise the k chosen weights to sum to one (``norm_topk_prob``)
    layers: frozenset[int]

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> MoESpec:
        """Qwen3-MoE's rule: layer i is sparse unless in ``mlp_only_layers``, every ``decoder_sparse_step``-th."""
        experts, step = int(config.num_experts), int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        layers = frozenset(
            i for i in range(config.num_hidden_layers) if i not in dense and experts > 0 and (i + 1) % step == 0
        )
        return cls(experts, int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                   bool(config.norm_topk_prob), layers)  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """Everything the runtime needs to build a decoder; derived from a HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_type: str
    eos_token_ids: tuple[int, ...]
    hf_config: PretrainedConfig
    moe: MoESpec | None = None  # a mixture-of-experts model's routing (Qwen3-MoE); None: dense

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts."""
        return self.moe is not None and layer in self.moe.layers

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; dflash2 runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} decoders. Pick a checkpoint of one of those families."
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu').")
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                "sliding-window attention layers are not supported yet; use a checkpoint with use_sliding_window=false."
            )
        rope_type = rope_type_of(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Qwen3 read `attention_bias`.
            attention_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_type=rope_type,
            eos_token_ids=eos_ids,
            hf_config=config,
            moe=MoESpec.from_hf_config(config) if model_type == "qwen3_moe" else None,
        )

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        return rope_frequencies(self.hf_config, self.head_dim)


def rope_type_of(config: PretrainedConfig) -> str:
    """The config's RoPE type, rejected unless its frequencies are static."""
    rope_type = str(rope_parameters_of(config).get("rope_type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}."
        )
    return rope_type


def rope_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed exactly as transformers does."""
    rope_type = rope_type_of(config)
    with torch.device("cpu"):  # real values even while a model is being built on "meta"
        if rope_type == "default":
            theta = rope_parameters_of(config)["rope_theta"]
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            return 1.0 / (theta**exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)


def rope_parameters_of(config: PretrainedConfig) -> dict[str, Any]:
    """The RoPE settings of a transformers 5 (``rope_parameters``) or 4 (``rope_theta`` / ``rope_scaling``) config."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers < 5 keeps rope_theta / rope_scaling apart
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if not math.isfinite(float(params.get("rope_theta", 10000.0))):
        raise UnsupportedModelError("rope_theta must be a finite number.")
    return params
