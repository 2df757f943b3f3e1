"""Test helpers for code built on dflash2: random-weight models, slowed forwards; no download.

:func:`save_random` writes a Hugging Face checkpoint of any shape with random weights and a
byte-level tokenizer (:func:`save_random_dflash`, a DFlash drafter for it): ``dflash2.load`` and
``transformers`` load it like any other, so an app's streaming, cancellation and serving can be
tested in seconds, and models of realistic shape timed where only the timing matters. The
tokenizer encodes every UTF-8 byte as one token; a larger ``vocab_size`` adds filler tokens that
encoding never produces but that decode to text, so a model with a realistic LM head still streams
printable output. :class:`SlowForward` makes every target forward of a model a known time longer,
so that a test can be sure a job is running when it interferes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}
SPECIALS = ["<s>", "</s>", "<pad>"]
BOS, EOS, PAD = 256, 257, 258
BYTE_VOCAB = 260
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256 + n
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def byte_tokenizer(vocab_size: int = BYTE_VOCAB) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: every UTF-8 byte is a token, so characters split.

    Ids 256-258 are ``<s>``, ``</s>`` and ``<pad>``; ids from 260 up to ``vocab_size`` are filler
    tokens ``f<id>`` (decodable, never produced by encoding).
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=_byte_of)
    vocab = {c: i for i, c in enumerate(byte_to_char)}
    for i, special in enumerate(SPECIALS):
        vocab[special] = 256 + i
    vocab.update({f"f{i}": i for i in range(BYTE_VOCAB, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


def random_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config of ``arch``: a tiny model unless ``overrides`` say otherwise."""
    kwargs: dict[str, Any] = {
        "vocab_size": BYTE_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "tie_word_embeddings": False,
    }
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 16
    if arch == "qwen3_moe":  # 4 experts, 2 per token; the last layer dense, as mlp_only_layers allows
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        kwargs["mlp_only_layers"] = [1]
    kwargs.update(overrides)
    return CONFIGS[arch](**kwargs)


def random_model(
    arch: str = "llama", seed: int = 0, std: float = 0.3, device: str = "cpu", dtype: Any = None, **overrides: Any
) -> Any:
    """A transformers model with random weights (norms in [0.5, 1.5], the rest N(0, std))."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(random_config(arch, **overrides), dtype=dtype).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std)
    return model


def save_random(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write config.json, model.safetensors and tokenizer files of a random model; return ``path``."""
    model = random_model(arch, seed, **overrides)
    model.save_pretrained(path)
    byte_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def save_random_dflash(
    path: Path,
    version: int = 1,
    target_layers: int = 2,
    target_layer_ids: tuple[int, ...] = (0, 1),
    block_size: int = 8,
    seed: int = 0,
    std: float = 0.3,
    vocab: int = BYTE_VOCAB,
    mask_token_id: int = PAD,
    shape: tuple[int, int, int, int, int, int] = (64, 96, 4, 2, 16, 2),
) -> Path:
    """A random-weight drafter in the z-lab checkpoint format, written name by name.

    The tensor names and shapes follow z-lab/dflash's published checkpoints (and their
    DFlash2 safetensors header), not dflash2's own exporter, so loading them tests the format.
    """
    hidden, inter, heads, kv_heads, head_dim, layers = shape
    config: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "num_target_layers": target_layers,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
        },
    }
    if version == 2:
        config["is_causal"] = False
        config["use_sliding_window"] = True
        config["sliding_window"] = 24
        config["max_window_layers"] = 0
        config["layer_types"] = ["sliding_attention"] * layers
        config["dflash_config"].update(
            {
                "conv_kernel_size": 2,
                "conv_group_size": 16,
                "selector_rank": 8,
                "selector_top_k": 4,
                "output_multiplier": 0.7,
                "final_logit_softcapping": 20.0,
            }
        )
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 0.5 + torch.rand(n, generator=g)

    t = {
        "fc.weight": rand(hidden, hidden * len(target_layer_ids)),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = norm(head_dim)
        t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        t[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        t[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        t[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        if version == 2:
            for conv in ("attention_conv", "mlp_conv"):
                t[p + f"{conv}.base_kernel"] = rand(2, 2, hidden)
                t[p + f"{conv}.kernel_projection.weight"] = rand(2 * 2 * (hidden // 16), hidden)
    if version == 2:
        t["candidate_selector.hidden_projection.weight"] = rand(8, hidden)
        t["candidate_selector.predecessor_codebook"] = rand(vocab, 8)
        t["candidate_selector.successor_codebook"] = rand(vocab, 8)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


class SlowForward:
    """Makes each forward of ``model``'s target ``delay`` seconds longer; counts the forwards begun
    (``calls``) and running now (``running``)."""

    def __init__(self, model: Any, delay: float) -> None:
        self.calls, self.running, self.delay = 0, 0, delay
        forward = model.target.forward

        def slow(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.running += 1
            try:
                time.sleep(self.delay)
                return forward(*args, **kwargs)
            finally:
                self.running -= 1

        model.target.forward = slow
