"""End to end on the real SmolLM2-135M-Instruct: token-identical to transformers' greedy generate."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import hf_greedy

import dflash2

pytestmark = pytest.mark.smollm2

RAW = [
    "The three most important inventions of the 20th century are",
    "def quicksort(arr):\n",
    "Once upon a time, in a small village by the sea,",
]
CHAT = [
    [{"role": "user", "content": "What is the capital of France? Explain its history briefly."}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "List three uses of Python."},
    ],
]


@pytest.mark.parametrize("prompt", RAW + CHAT, ids=[f"raw{i}" for i in range(3)] + [f"chat{i}" for i in range(3)])
def test_greedy_identical_to_transformers(smollm2: dflash2.Model, hf_smollm2: Any, prompt: Any) -> None:
    from dflash2.tokenize import encode_prompt

    ids = encode_prompt(smollm2.tokenizer, prompt)
    expected = hf_greedy(hf_smollm2, ids, 64)
    completion = smollm2.generate(prompt, max_new_tokens=64)
    assert list(completion.token_ids) == expected
    assert completion.text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_template_matches_transformers(smollm2: dflash2.Model) -> None:
    from dflash2.tokenize import encode_prompt

    text = smollm2.tokenizer.apply_chat_template(CHAT[2], add_generation_prompt=True, tokenize=False)
    assert smollm2.tokenizer.decode(encode_prompt(smollm2.tokenizer, CHAT[2])) == text
    assert text.endswith("<|im_start|>assistant\n")
