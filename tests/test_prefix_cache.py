"""The prefix cache: a request that starts as an earlier one's text did reuses its state, and its
output is exactly a cold run's (greedy tokens, seeded samples), for every drafter and pipeline."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import SPEC_PROMPTS, hf_greedy

import dflash2
from dflash2 import InvalidOptionError
from dflash2.engine.draft_length import DraftLengthPolicy
from dflash2.engine.prefix_cache import PrefixCache, Snapshot

NEW = 24
DRAFTERS = ["none", "ngram", "self-int4", "self-same", "dflash2", "hybrid"]


def _drafter(name: str, paths: dict[str, Path]) -> tuple[Any, str]:
    return {
        "none": (None, "auto"),
        "ngram": ("ngram", "auto"),
        "self-int4": (paths["target"], "int4"),
        "self-same": (paths["target"], "same"),
        "dflash2": (paths["dflash2"], "auto"),
        "hybrid": (["ngram", paths["dflash1"]], "auto"),
    }[name]


def _snapshot(tokens: list[int], layers: int = 2) -> Snapshot:
    n = len(tokens)
    return Snapshot(tuple(tokens), torch.zeros(layers, 1, n, 4), torch.zeros(layers, 1, n, 4))


def test_the_store_finds_the_longest_stored_prefix_and_stays_in_its_bound() -> None:
    store = PrefixCache(capacity=100, minimum=2)
    assert store.lookup(list(range(50))) is None
    store.insert(_snapshot(list(range(40))))
    store.insert(_snapshot([*range(10), 99, 98, 97]))
    hit = store.lookup([*range(30), 7])
    assert hit is not None and hit.length == 30 and len(hit.snapshot) == 40
    hit = store.lookup(list(range(40)))
    assert hit is not None and hit.length == 39  # the prompt's last token always runs
    assert store.lookup([5, 6, 7]) is None  # nothing stored starts this way
    assert store.lookup([0, 9]) is None  # a shared prefix under ``minimum``
    store.insert(_snapshot(list(range(60))))  # extends the first entry, which leaves
    assert len(store) == 2 and store.tokens == 73
    store.insert(_snapshot(list(range(100, 140))))  # over the bound: the least recently used goes
    assert store.tokens <= 100
    hit = store.lookup([*range(10), 99, 98, 1])  # the 13-token entry (12 shared) left; the 60 shares 10
    assert hit is not None and hit.length == 10 and len(hit.snapshot) == 60
    store.insert(_snapshot(list(range(500, 700))))  # longer than the whole store: cut to it
    assert store.tokens == 100
    assert PrefixCache(0).lookup([1, 2, 3]) is None
    with pytest.raises(InvalidOptionError, match="prefix_cache"):
        dflash2.load("unused", prefix_cache=-1)


def _conversation(model: dflash2.Model, first: str, **options: Any) -> tuple[str, str]:
    """A first turn, then a second prompt that repeats the first turn's text and adds to it."""
    answer = model.generate(first, max_new_tokens=NEW, **options).text
    return first, first + answer + " and then"


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_a_hit_gives_a_cold_runs_tokens(name: str, pipeline: str, paths: dict[str, Path]) -> None:
    drafter, weights = _drafter(name, paths)
    warm = dflash2.load(paths["target"], drafter=drafter, drafter_weights=weights)
    cold = dflash2.load(paths["target"], drafter=drafter, drafter_weights=weights, prefix_cache=0)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    for prompt in SPEC_PROMPTS:
        _, second = _conversation(warm, prompt, pipeline=pipeline)
        hit = warm.generate(second, max_new_tokens=NEW, pipeline=pipeline)
        assert hit.stats.cached_tokens >= len(warm.tokenizer(prompt).input_ids), (name, prompt)
        assert hit.stats.prefilled_tokens == hit.stats.prompt_tokens - hit.stats.cached_tokens
        reference = cold.generate(second, max_new_tokens=NEW, pipeline=pipeline)
        assert reference.stats.cached_tokens == 0
        assert hit.token_ids == reference.token_ids, (name, prompt)
        assert list(hit.token_ids) == hf_greedy(hf, warm.tokenizer(second).input_ids, NEW)[: len(hit.token_ids)]


@pytest.mark.parametrize("name", ["none", "self-int4", "dflash2"])
def test_a_hit_keeps_a_seeded_sample(name: str, paths: dict[str, Path]) -> None:
    drafter, weights = _drafter(name, paths)
    warm = dflash2.load(paths["target"], drafter=drafter, drafter_weights=weights)
    cold = dflash2.load(paths["target"], drafter=drafter, drafter_weights=weights, prefix_cache=0)
    options: dict[str, Any] = {"temperature": 0.9, "seed": 5}
    _, second = _conversation(warm, SPEC_PROMPTS[1], **options)
    hit = warm.generate(second, max_new_tokens=NEW, **options)
    assert hit.stats.cached_tokens > 0
    assert hit.token_ids == cold.generate(second, max_new_tokens=NEW, **options).token_ids


def test_the_stored_state_is_a_cold_prefills(paths: dict[str, Path]) -> None:
    """The stored prompt rows are a cold prefill's bit for bit; the verified blocks' rows agree with
    a cold prefill of the whole text to fp32 rounding, as any two row counts of one forward do."""
    model = dflash2.load(paths["target"], drafter=paths["target"], drafter_weights="same")
    model.lengths = DraftLengthPolicy(mode="fixed")  # whole blocks (the policy would not draft with so dear a drafter)
    model.generate(SPEC_PROMPTS[2], max_new_tokens=40)  # prefill, then verify blocks of several rows
    (entry,) = model.prefixes.snapshots()
    prompt = len(model.tokenizer(SPEC_PROMPTS[2]).input_ids)
    assert len(entry) > prompt  # verified blocks kept too
    ids = torch.tensor([entry.tokens])
    for rows in (prompt, len(entry)):
        cache = model.target.new_cache(len(entry.tokens))
        with torch.no_grad():
            model.target(ids[:, :rows], cache, logits="none")
        for cold, stored in ((cache.k, entry.keys), (cache.v, entry.values)):
            if rows == prompt:
                assert torch.equal(cold[:, 0, :, :rows], stored[:, :, :rows])
            else:
                torch.testing.assert_close(cold[:, 0, :, :rows], stored, rtol=1e-5, atol=1e-5)


def test_plain_decoding_stores_its_answer_too(paths: dict[str, Path]) -> None:
    """One-token steps' rows are kept as verify blocks' are: equal to a cold prefill's to fp32 rounding."""
    model = dflash2.load(paths["target"])
    prompt = model.tokenizer(SPEC_PROMPTS[1]).input_ids
    first = model.generate(SPEC_PROMPTS[1], max_new_tokens=NEW)
    (entry,) = model.prefixes.snapshots()
    assert entry.tokens == (*prompt, *first.token_ids[:-1])  # the last token was never fed
    hit = model.prefixes.lookup([*entry.tokens, 7])
    assert hit is not None and hit.length == len(entry)
    cache = model.target.new_cache(len(entry))
    with torch.no_grad():
        model.target(torch.tensor([entry.tokens]), cache, logits="none")
    torch.testing.assert_close(cache.k[:, 0], entry.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, 0], entry.values, rtol=1e-5, atol=1e-5)


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["none", "hybrid"])
async def test_concurrent_readers_of_one_prefix(name: str, paths: dict[str, Path]) -> None:
    drafter, weights = _drafter(name, paths)
    warm = dflash2.load(paths["target"], drafter=drafter, drafter_weights=weights)
    cold = dflash2.load(paths["target"], drafter=drafter, drafter_weights=weights, prefix_cache=0)
    base = SPEC_PROMPTS[0] * 3
    await warm.agenerate(base, max_new_tokens=4)
    prompts = [base + tail for tail in (" one", " two", " three", " four")]
    together = await asyncio.gather(*(warm.agenerate(p, max_new_tokens=NEW) for p in prompts))  # batched
    for prompt, completion in zip(prompts, together, strict=True):
        assert completion.stats.cached_tokens > 0
        assert completion.token_ids == (await cold.agenerate(prompt, max_new_tokens=NEW)).token_ids


@pytest.mark.anyio
async def test_a_cancelled_request_leaves_a_usable_prefix(paths: dict[str, Path]) -> None:
    warm = dflash2.load(paths["target"], drafter=["ngram", paths["dflash1"]])
    cold = dflash2.load(paths["target"], drafter=["ngram", paths["dflash1"]], prefix_cache=0)
    prompt = SPEC_PROMPTS[2] * 2
    seen = []
    async with warm.stream(prompt, max_new_tokens=200) as stream:
        async for tok in stream:
            seen.append(tok.id)
            if len(seen) == 10:  # leave mid-way
                break
    assert len(seen) == 10
    second = prompt + " more"
    hit = await warm.agenerate(second, max_new_tokens=NEW)
    assert hit.stats.cached_tokens > 0
    assert hit.token_ids == (await cold.agenerate(second, max_new_tokens=NEW)).token_ids


def test_static_slots_take_hits_too(paths: dict[str, Path]) -> None:
    warm = dflash2.load(paths["target"], drafter=paths["dflash2"], graphs="static")
    cold = dflash2.load(paths["target"], drafter=paths["dflash2"], graphs="static", prefix_cache=0)
    _, second = _conversation(warm, SPEC_PROMPTS[1])
    hit = warm.generate(second, max_new_tokens=NEW)
    assert hit.stats.cached_tokens > 0
    assert hit.token_ids == cold.generate(second, max_new_tokens=NEW).token_ids


def test_the_store_stays_within_its_bound(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter="ngram", prefix_cache=150)
    for i in range(12):
        model.generate(f"{i} {SPEC_PROMPTS[i % 3]} {i * 7}", max_new_tokens=8)
        assert model.prefixes.tokens <= 150
    assert len(model.prefixes) >= 2
