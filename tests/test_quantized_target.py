"""A target held in bf16 / int8 / int4 weights: every row of a forward gets the bits it gets
alone, so speculative output equals plain decoding in the same mode, token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_speculative import PIPELINES, PROMPTS, drafter_arg
from tiny import full_blocks, save_tiny

import dflash2
from dflash2 import InvalidOptionError
from dflash2.runtime.quant import QuantLinear

FORMATS = ("int8", "int4")


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {arch: save_tiny(root / arch, arch, seed=3) for arch in ("llama", "qwen2", "qwen3")}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("inputs", "outputs"), [(64, 160), (256, 1024), (1024, 256)])
def test_a_quantized_projection_gives_a_row_the_same_bits_in_any_block(inputs: int, outputs: int, fmt: str) -> None:
    weight = torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(0)) * 0.05
    layer = QuantLinear(weight, None, fmt)  # type: ignore[arg-type]
    x = torch.randn(80, inputs, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(80)])
        for rows in (*range(2, 17), 23, 32, 47, 80):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_verify_block_gives_each_row_the_bits_of_a_one_token_forward(
    targets: dict[str, Path], arch: str, fmt: str
) -> None:
    target = dflash2.load(targets[arch], weights=fmt).target
    layers = [m for m in target.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * target.spec.num_layers + 1  # qkv, o, gate_up, down in each layer; the LM head
    with torch.inference_mode():
        cache = target.new_cache(128)
        target(_ids(37, 0), cache, logits="none")
        start = cache.length
        block = _ids(9, 1)
        rows = target(block, cache).logits
        for k in (1, 2, 3, 5):  # a shorter block: the same rows
            cache.rollback(start)
            assert torch.equal(target(block[:, :k], cache).logits, rows[:, :k])  # type: ignore[index]
        cache.rollback(start)
        alone = torch.cat([target(block[:, i : i + 1], cache).logits for i in range(9)], dim=1)  # type: ignore[misc]
    assert torch.equal(alone, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prompt_prefilled_in_pieces_or_packed_with_others_gets_the_same_bits(
    targets: dict[str, Path], fmt: str
) -> None:
    """What the prefix cache (a prefill continuing a stored prefix) and concurrent streams (one
    forward for several requests) rely on."""
    target = dflash2.load(targets["llama"], weights=fmt).target
    prompt, other = _ids(40, 2), _ids(23, 3)
    with torch.inference_mode():
        whole = target(prompt, target.new_cache(64)).logits
        cache = target.new_cache(64)
        first = target(prompt[:, :17], cache).logits
        rest = target(prompt[:, 17:], cache).logits
        assert torch.equal(torch.cat([first, rest], dim=1), whole)  # type: ignore[list-item]
        mine, theirs = target.new_cache(64), target.new_cache(64)
        packed = target.forward_packed([(prompt[0, :30], mine, True), (other[0], theirs, True)])
        assert torch.equal(packed[0].logits, whole[:, :30])  # type: ignore[index]
        assert torch.equal(packed[1].logits, target(other, target.new_cache(64)).logits)  # type: ignore[arg-type]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("name", ["ngram", "self", "dflash2", "hybrid-dflash2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_speculative_greedy_equals_plain_decoding_in_the_same_mode(
    paths: dict[str, Path], fmt: str, name: str, pipeline: str
) -> None:
    plain = dflash2.load(paths["target"], weights=fmt)
    drafted = full_blocks(plain.with_drafter(drafter_arg(name, paths)))
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40).token_ids
        assert drafted.generate(prompt, max_new_tokens=40, pipeline=pipeline).token_ids == want


@pytest.mark.parametrize("fmt", ["int4"])
def test_self_drafting_a_quantized_target_accepts_every_token(paths: dict[str, Path], fmt: str) -> None:
    """The target drafting for itself in the same weights agrees with itself every time: verify rows
    equal decoding rows bit for bit (a drafter in other weights would only mostly agree)."""
    model = dflash2.load(paths["target"], weights=fmt, drafter=paths["target"], drafter_weights=fmt, block_size=5)
    stats = full_blocks(model).generate(PROMPTS[1], max_new_tokens=41).stats
    assert stats.acceptance_lengths == (5,) * 8


@pytest.mark.anyio
@pytest.mark.parametrize("fmt", FORMATS)
async def test_concurrent_streams_equal_running_alone(paths: dict[str, Path], fmt: str) -> None:
    plain = dflash2.load(paths["target"], weights=fmt)
    models: dict[str, Any] = {"plain": plain, "self": plain.with_drafter(paths["target"])}
    jobs = [(m, p) for m in models for p in PROMPTS]
    alone = [(await models[m].agenerate(p, max_new_tokens=32)).token_ids for m, p in jobs]
    together = await asyncio.gather(*(models[m].agenerate(p, max_new_tokens=32) for m, p in jobs))
    assert [r.token_ids for r in together] == alone
    assert max(s for r in together for s in r.stats.batch_sizes) > 1


def test_the_prefix_cache_keeps_a_quantized_mode_exact(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], weights="int4", drafter="ngram")
    cold = dflash2.load(paths["target"], weights="int4", drafter="ngram", prefix_cache=0)
    first = model.generate(PROMPTS[0], max_new_tokens=24)
    follow_up = PROMPTS[0] + first.text + " and then"
    warm = model.generate(follow_up, max_new_tokens=24)
    assert warm.stats.cached_tokens > 0
    assert warm.token_ids == cold.generate(follow_up, max_new_tokens=24).token_ids


def test_quantized_weights_are_checked_before_loading(paths: dict[str, Path]) -> None:
    with pytest.raises(InvalidOptionError, match="weights must be one of"):
        dflash2.load(paths["target"], weights="int3")
    with pytest.raises(InvalidOptionError, match="bf16 matmuls round a row"):
        dflash2.load(paths["target"], weights="bf16")
    with pytest.raises(InvalidOptionError, match="graphs='off'"):
        dflash2.load(paths["target"], weights="int8", graphs="static")
