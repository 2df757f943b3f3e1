"""Tiny random fp32 models (built by ``dflash2.testing``) and z-lab-format drafters for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dflash2
from dflash2.testing import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    SPECIALS,
    SlowForward,
    byte_tokenizer,
    random_config,
    random_model,
)
from dflash2.testing import BYTE_VOCAB as VOCAB
from dflash2.testing import save_random as save_tiny
from dflash2.testing import save_random_dflash as save_tiny_dflash

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "PAD",
    "SPECIALS",
    "VOCAB",
    "SlowForward",
    "byte_tokenizer",
    "save_tiny",
    "save_tiny_dflash",
]

# prompts of the speculative tests (byte tokenizer: every character is a token)
SPEC_PROMPTS = ["abcabcabc hello abcabc", "The quick brown fox", "x = [1, 2, 3]; y = [1, 2, 3]"]

tiny_config = random_config
tiny_hf_model = random_model


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


def full_blocks(model: Any) -> Any:
    """Draft as far as the block allows every step (the draft-length policy's ``"fixed"`` mode):
    for tests of what a drafter drafts and accepts, not of how far drafting pays."""
    from dflash2.engine import DraftLengthPolicy

    model.lengths = DraftLengthPolicy(mode="fixed")
    return model


def load_in(path: Path, weights: str, **options: Any) -> dflash2.Model:
    """``dflash2.load(path, weights=weights, ...)``; bf16 is skipped on a CPU whose bf16 products
    round a row by the rows beside it (load refuses it there, as tests/test_quantized_target.py checks)."""
    try:
        return dflash2.load(path, weights=weights, **options)
    except dflash2.InvalidOptionError as e:
        if weights == "bf16" and "not exact on this CPU" in str(e):
            pytest.skip("this CPU's bf16 products round a row by the rows beside it")
        raise
