"""A target held in bf16 / int8 / int4 weights: every row of a forward gets the bits it gets
alone, so speculative output equals plain decoding in the same mode, token for token."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_speculative import PIPELINES, PROMPTS, drafter_arg
from tiny import full_blocks, load_in, save_tiny

import dflash2
from dflash2 import InvalidOptionError
from dflash2.runtime.model import attend_rows
from dflash2.runtime.quant import HalfLinear, QuantLinear, rows_alone
from dflash2.runtime.workers import _OMP


def _packed_half(weight: torch.Tensor) -> HalfLinear:
    layer = HalfLinear(weight, None)
    layer.pack()  # as a loaded target computes
    return layer


FORMATS = ("bf16", "int8", "int4")
QUANTIZED = (QuantLinear, HalfLinear)


def _layer(weight: torch.Tensor, fmt: str) -> torch.nn.Module:
    return _packed_half(weight) if fmt == "bf16" else QuantLinear(weight, None, fmt)  # type: ignore[arg-type]


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
    layer = _layer(weight, fmt)
    if fmt == "bf16" and not rows_alone(layer, inputs):
        pytest.skip("this CPU's bf16 products round a row by the rows beside it")
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
    target = load_in(targets[arch], fmt).target
    layers = [m for m in target.modules() if isinstance(m, QUANTIZED)]
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
    target = load_in(targets["llama"], fmt).target
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
    plain = load_in(paths["target"], fmt)
    drafted = full_blocks(plain.with_drafter(drafter_arg(name, paths)))
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40).token_ids
        assert drafted.generate(prompt, max_new_tokens=40, pipeline=pipeline).token_ids == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_self_drafting_a_quantized_target_accepts_every_token(paths: dict[str, Path], fmt: str) -> None:
    """The target drafting for itself in the same weights agrees with itself every time: verify rows
    equal decoding rows bit for bit (a drafter in other weights would only mostly agree)."""
    model = load_in(paths["target"], fmt, drafter=paths["target"], drafter_weights=fmt, block_size=5)
    stats = full_blocks(model).generate(PROMPTS[1], max_new_tokens=41).stats
    assert stats.acceptance_lengths == (5,) * 8


@pytest.mark.anyio
@pytest.mark.parametrize("fmt", FORMATS)
async def test_concurrent_streams_equal_running_alone(paths: dict[str, Path], fmt: str) -> None:
    plain = load_in(paths["target"], fmt)
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
    with pytest.raises(InvalidOptionError, match="graphs='off'"):
        dflash2.load(paths["target"], weights="int8", graphs="static")


def test_a_bf16_target_is_refused_where_the_cpu_rounds_a_row_by_the_rows_beside_it(
    paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN picks its bf16 kernel by CPU, shape and row count; where a row's bits depend on the
    block it is in, a bf16 target could part from plain decoding, so load refuses it."""
    assert rows_alone(lambda x: 2 * x, 8)
    assert not rows_alone(lambda x: 2 * x + 1e-3 * (x.shape[0] > 4), 8)  # rounds by the row count
    monkeypatch.setattr("dflash2.runtime.quant.rows_alone", lambda layer, inputs: False)
    with pytest.raises(InvalidOptionError, match="weights='bf16' is not exact on this CPU"):
        dflash2.load(paths["target"], weights="bf16")
    assert dflash2.load(paths["target"], weights="int8").generate(PROMPTS[0], max_new_tokens=4).token_ids


def test_attention_of_rows_alone_gets_the_same_bits_on_any_number_of_threads() -> None:
    """The engine changes how many threads compute a forward as it measures; torch's CPU SDPA
    rounds a row by how many threads share it (a real 1.5B's shapes: 12 query heads over 2 kv
    heads of 128), so rows computed alone must not depend on the count."""
    g = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(1, 4, 12, 128, generator=g), *torch.randn(2, 1, 2, 200, 128, generator=g)
    out: dict[int, torch.Tensor] = {}

    def compute() -> None:  # on a thread of its own, its OpenMP count set as the engine's workers set it
        for count in (2, 1, 2):
            _OMP.set_threads(count)
            rows = [attend_rows(q[:, :n], keys[:, :, : 196 + n], values[:, :, : 196 + n]) for n in (1, 4)]
            out[count] = torch.cat(rows, 1)

    worker = threading.Thread(target=compute)
    worker.start()
    worker.join()
    assert torch.equal(out[1], out[2])
