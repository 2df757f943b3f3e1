"""Tiny random fp32 models of each supported family, saved as real checkpoints (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
SPECIALS = ["<s>", "</s>", "<pad>"]
BOS, EOS, PAD = 256, 257, 258
VOCAB = 260
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: every UTF-8 byte is a token, so characters split."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_to_char)}
    for i, special in enumerate(SPECIALS):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256 + n
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
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
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return CONFIGS[arch](**kwargs)


def tiny_hf_model(arch: str = "llama", seed: int = 0, std: float = 0.3, **overrides: Any) -> Any:
    """A transformers model with random weights large enough to give peaked distributions."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std)
    return model


def save_tiny(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write config.json, model.safetensors and tokenizer files; return the directory."""
    model = tiny_hf_model(arch, seed, **overrides)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def hf_greedy(model: Any, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate``: the reference every exactness test compares with."""
    ids = torch.as_tensor(prompt_ids).reshape(1, -1)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        )
    return [int(t) for t in out[0, ids.shape[1] :]]
