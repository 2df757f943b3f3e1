"""A decoder checkpoint checked against its config before any tensor is used.

``config.json`` says what every weight must look like (which tensors, their shapes); the
safetensors files say what they hold. :func:`check_weights` compares the two once, by the
checkpoint's own tensor names, and raises :class:`CorruptCheckpointError` naming the tensor and
the config fields that disagree: a mislabelled config, a wrong or transposed tensor, integer or
non-finite values, more layers in the weights than the config declares.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from dflash2.errors import CorruptCheckpointError
from dflash2.runtime.spec import ModelSpec

Shape = tuple[int, ...]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PROJECTION = re.compile(r"(_proj\.weight|^lm_head\.weight)$")


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[Shape, str]]:
    """Each weight a checkpoint of ``spec`` holds: its shape and the config fields that set it
    (a mixture-of-experts layer's experts are checked by the model's own loading)."""
    hidden, heads, kv, dim = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    attention = f"hidden_size={hidden}, num_attention_heads={heads}, num_key_value_heads={kv}, head_dim={dim}"
    out: dict[str, tuple[Shape, str]] = {
        "model.embed_tokens.weight": ((spec.vocab_size, hidden), f"vocab_size={spec.vocab_size}, hidden_size={hidden}"),
        "model.norm.weight": ((hidden,), f"hidden_size={hidden}"),
    }
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = ((spec.vocab_size, hidden), f"vocab_size={spec.vocab_size}, hidden_size={hidden}")
    for i in range(spec.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[p + "input_layernorm.weight"] = ((hidden,), f"hidden_size={hidden}")
        out[p + "post_attention_layernorm.weight"] = ((hidden,), f"hidden_size={hidden}")
        out[a + "q_proj.weight"] = ((heads * dim, hidden), attention)
        out[a + "k_proj.weight"] = ((kv * dim, hidden), attention)
        out[a + "v_proj.weight"] = ((kv * dim, hidden), attention)
        out[a + "o_proj.weight"] = ((hidden, heads * dim), attention)
        if spec.attention_bias:
            out[a + "q_proj.bias"] = ((heads * dim,), attention)
            out[a + "k_proj.bias"] = ((kv * dim,), attention)
            out[a + "v_proj.bias"] = ((kv * dim,), attention)
        if spec.qk_norm:
            out[a + "q_norm.weight"] = ((dim,), f"head_dim={dim}")
            out[a + "k_norm.weight"] = ((dim,), f"head_dim={dim}")
        m = p + "mlp."
        if spec.sparse(i):
            assert spec.moe is not None
            out[m + "gate.weight"] = ((spec.moe.experts, hidden), f"num_experts={spec.moe.experts}")
            continue
        mlp = f"hidden_size={hidden}, intermediate_size={spec.intermediate_size}"
        out[m + "gate_proj.weight"] = ((spec.intermediate_size, hidden), mlp)
        out[m + "up_proj.weight"] = ((spec.intermediate_size, hidden), mlp)
        out[m + "down_proj.weight"] = ((hidden, spec.intermediate_size), mlp)
    return out


def projection_names(spec: ModelSpec) -> list[str]:
    """The checkpoint's weights that the model's linear layers (attention and dense MLP projections,
    an untied LM head) are built from: the tensors a quantized model no longer holds."""
    return [name for name in expected_shapes(spec) if _PROJECTION.search(name)]


def check_weights(spec: ModelSpec, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``tensors`` are the weights ``spec`` describes.

    A tensor on the ``meta`` device (a weight read as its shape only) is checked for its name,
    shape and dtype, not its values."""
    model = spec.model_type
    for name, (shape, fields) in expected_shapes(spec).items():
        tensor = tensors.get(name)
        if tensor is None:
            raise CorruptCheckpointError(
                f"{where}: the weights have no {name}, which a {model} model with this config.json has: the "
                "checkpoint is incomplete, or config.json describes another model; download it again or fix "
                "config.json."
            )
        if tuple(tensor.shape) != shape:
            raise CorruptCheckpointError(
                f"{where}: {name} has shape {list(tensor.shape)}, but config.json ({fields}) makes it "
                f"{list(shape)}: config.json and the weights disagree; fix config.json or download the model again."
            )
    deeper = sorted({int(m.group(1)) for name in tensors if (m := _LAYER.match(name))} - set(range(spec.num_layers)))
    if deeper:
        held = max(deeper) + 1
        raise CorruptCheckpointError(
            f"{where}: the weights hold {held} layers, but config.json says num_hidden_layers={spec.num_layers}: "
            "fix config.json or download the model again."
        )
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise CorruptCheckpointError(
                f"{where}: {name} holds {str(tensor.dtype).removeprefix('torch.')} values; a model's weights are "
                "floating point: the file is damaged, download it again."
            )
        if not tensor.is_meta and not _all_finite(tensor):
            raise CorruptCheckpointError(
                f"{where}: {name} holds NaN or infinite values: the weights are damaged, download them again."
            )


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in ``tensor``: a NaN makes both extremes NaN, an infinity one of them.
    One pass without a mask as large as the tensor (``isfinite().all()`` took 25x as long on a
    7 GB checkpoint)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))
