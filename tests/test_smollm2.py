"""End to end on the real SmolLM2-135M-Instruct: token-identical to transformers' greedy generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny import full_blocks, hf_greedy, save_tiny_dflash

import dflash2
from dflash2.demo_model import shipped_drafter
from dflash2.engine import OverlapPolicy

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


@pytest.fixture(scope="module")
def references(smollm2: dflash2.Model, hf_smollm2: Any) -> dict[int, list[int]]:
    from dflash2.tokenize import encode_prompt

    return {i: hf_greedy(hf_smollm2, encode_prompt(smollm2.tokenizer, p), 128) for i, p in enumerate(SPEC_PROMPTS)}


SPEC_PROMPTS = [RAW[1], CHAT[0], CHAT[2]]


def _random_dflash(path: Path) -> Path:
    # SmolLM2's shape: hidden 576, 9 heads / 3 kv heads of 64; one drafter layer reading 3 target layers
    return save_tiny_dflash(
        path,
        target_layers=30,
        target_layer_ids=(1, 14, 27),
        block_size=8,
        std=0.02,
        vocab=49152,
        mask_token_id=0,
        shape=(576, 1536, 9, 3, 64, 1),
    )


@pytest.mark.parametrize("drafter", ["ngram", "autoregressive", "dflash", "shipped", "hybrid"])
def test_speculative_greedy_identical_to_transformers(
    smollm2_gguf: Path, references: dict[int, list[int]], drafter: str, tmp_path: Path
) -> None:
    if drafter in ("shipped", "hybrid") and shipped_drafter() is None:
        pytest.skip("no drafter shipped in drafters/ yet")
    choices = {"ngram": "ngram", "autoregressive": smollm2_gguf, "shipped": shipped_drafter()}
    choices["hybrid"] = ["ngram", shipped_drafter()]
    arg: Any = choices.get(drafter) or _random_dflash(tmp_path / "d")
    block_size = {"autoregressive": 6, "dflash": 4}.get(drafter)
    weights = "same" if drafter == "autoregressive" else "auto"  # the target drafting for itself, unchanged
    model = dflash2.load(smollm2_gguf, drafter=arg, block_size=block_size, drafter_weights=weights)
    model.policy = OverlapPolicy(schedule="overlap")  # the async runs pre-draft every step
    full_blocks(model)  # and every step drafts a whole block
    runs = [(0, "sync")] + [(i, "async") for i in range(len(SPEC_PROMPTS))]
    lengths: list[int] = []
    for i, pipeline in runs:
        completion = model.generate(SPEC_PROMPTS[i], max_new_tokens=128, pipeline=pipeline)
        assert list(completion.token_ids) == references[i], (drafter, i, pipeline)
        if drafter == "autoregressive":  # the target as its own drafter: (nearly) everything accepted
            assert completion.stats.mean_acceptance_length > 5.0
            assert pipeline == "sync" or completion.stats.predraft_hits > 0
        lengths += completion.stats.acceptance_lengths
    if drafter == "shipped":  # trained: it gets drafts accepted (about 1.2 per forward when shipped)
        assert sum(lengths) / len(lengths) > 1.05


def test_chat_template_matches_transformers(smollm2: dflash2.Model) -> None:
    from dflash2.tokenize import encode_prompt

    text = smollm2.tokenizer.apply_chat_template(CHAT[2], add_generation_prompt=True, tokenize=False)
    assert smollm2.tokenizer.decode(encode_prompt(smollm2.tokenizer, CHAT[2])) == text
    assert text.endswith("<|im_start|>assistant\n")
