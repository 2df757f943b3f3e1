"""Streams under random use and under load: nothing deadlocks, nothing is left behind, and no
stream's greedy output ever changes (property tests with hypothesis; load with 200 + 16 streams)."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import SPEC_PROMPTS

import dflash2
from dflash2.runtime.kv_cache import KVCache

MAX_NEW = 32
ACTIONS = ["read", "break", "aclose-from-another-task", "cancel-scope", "timeout", "aclose-before-reading"]


@pytest.fixture(scope="module")
def models(paths: dict[str, Path]) -> list[dflash2.Model]:
    target = dflash2.load(paths["target"])
    drafted = [target.with_drafter(d) for d in ("ngram", paths["target"], paths["dflash2"])]
    drafted.append(target.with_drafter(["ngram", paths["dflash1"]]))
    for model in [target, *drafted]:
        model.generate(SPEC_PROMPTS[0], max_new_tokens=MAX_NEW)  # start the worker threads
    return [target, *drafted]


@pytest.fixture(scope="module")
def expected(references: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    return {p: tuple(ids[:MAX_NEW]) for p, ids in references.items()}


def live_caches() -> int:
    gc.collect()
    return sum(type(o) is KVCache for o in gc.get_objects())


plan = st.tuples(
    st.integers(0, 4),  # model (drafter)
    st.sampled_from(SPEC_PROMPTS),
    st.sampled_from(["async", "sync"]),
    st.sampled_from(ACTIONS),
    st.integers(0, 12),  # tokens to read / 5 ms units to wait
)


Result = tuple[str, tuple[int, ...], bool]


async def run_plan(model: dflash2.Model, prompt: str, pipeline: Any, action: str, n: int) -> Result:
    """Run one stream the way ``action`` says; return (prompt, ids handed out, whether it ran to its end)."""
    stream = model.stream(prompt, max_new_tokens=MAX_NEW, pipeline=pipeline)
    ids: list[int] = []
    if action == "read":
        async with stream:
            ids = [tok.id async for tok in stream]
        return prompt, tuple(ids), True
    if action == "break":
        async with stream:
            async for tok in stream:
                ids.append(tok.id)
                if len(ids) > n:
                    break
    elif action == "aclose-from-another-task":
        async with anyio.create_task_group() as tg:

            async def close_later() -> None:
                await anyio.sleep(n * 0.005)
                await stream.aclose()

            tg.start_soon(close_later)
            ids = [tok.id async for tok in stream]
    elif action in ("cancel-scope", "timeout"):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() if action == "cancel-scope" else anyio.move_on_after(n * 0.005) as scope:
                if action == "cancel-scope":
                    tg.start_soon(_cancel_later, scope, n * 0.005)
                async with stream:
                    async for tok in stream:
                        ids.append(tok.id)
    else:
        await stream.aclose()
        with pytest.raises(dflash2.StreamStateError, match="cannot be iterated again"):
            stream.__aiter__()
    completion = stream.completion
    assert list(completion.token_ids) == ids
    return prompt, tuple(ids), completion.finish_reason != "cancelled"


async def _cancel_later(scope: anyio.CancelScope, seconds: float) -> None:
    await anyio.sleep(seconds)
    scope.cancel()


@pytest.mark.timeout(600)
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plans=st.lists(plan, min_size=1, max_size=4), backend=st.sampled_from(["asyncio", "trio"]))
def test_random_stream_life_cycles_never_deadlock_leak_or_change_output(
    models: list[dflash2.Model], expected: dict[str, tuple[int, ...]], plans: list[Any], backend: str
) -> None:
    threads, caches = sorted(t.name for t in threading.enumerate()), live_caches()
    results: list[Result] = []

    async def main() -> None:
        async def one(p: Any) -> None:
            index, prompt, pipeline, action, n = p
            results.append(await run_plan(models[index], prompt, pipeline, action, n))

        with anyio.fail_after(60):  # a deadlock fails here instead of hanging the suite
            async with anyio.create_task_group() as tg:
                for p in plans:
                    tg.start_soon(one, p)
        if backend == "asyncio":
            assert asyncio.all_tasks() == {asyncio.current_task()}

    anyio.run(main, backend=backend)
    assert len(results) == len(plans)
    for prompt, ids, complete in results:
        assert ids == expected[prompt][: len(ids)]  # whatever happened, the text is the target's
        if complete:
            assert ids == expected[prompt]
    assert sorted(t.name for t in threading.enumerate()) == threads
    assert live_caches() == caches


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


@pytest.mark.timeout(900)
def test_200_sequential_and_16_concurrent_streams_keep_memory_flat(
    models: list[dflash2.Model], expected: dict[str, tuple[int, ...]]
) -> None:
    def batch(count: int, offset: int = 0) -> list[tuple[int, str]]:
        return [((offset + i) % len(models), SPEC_PROMPTS[(offset + i) % len(SPEC_PROMPTS)]) for i in range(count)]

    async def sequential(jobs: list[tuple[int, str]]) -> None:
        for m, prompt in jobs:
            completion = await models[m].agenerate(prompt, max_new_tokens=MAX_NEW)
            assert completion.token_ids == expected[prompt], (m, prompt)

    async def concurrent(jobs: list[tuple[int, str]]) -> None:
        done = await asyncio.gather(*(models[m].agenerate(p, max_new_tokens=MAX_NEW) for m, p in jobs))
        for (m, prompt), completion in zip(jobs, done, strict=True):
            assert completion.token_ids == expected[prompt], (m, prompt)

    caches = live_caches()
    asyncio.run(sequential(batch(30)))  # warm up: caches of the allocator, tokenizer, workers
    asyncio.run(concurrent(batch(16)))
    before = rss()
    asyncio.run(sequential(batch(200, offset=1)))
    after_sequential = rss()
    for round_ in range(3):
        asyncio.run(concurrent(batch(16, offset=round_)))
    after_concurrent = rss()
    mib = [round(x / 2**20, 1) for x in (before, after_sequential, after_concurrent)]
    print(f"RSS MiB after warm-up {mib[0]}, after 200 sequential {mib[1]}, after 3 x 16 concurrent {mib[2]}")
    assert after_sequential <= before * 1.05, (before, after_sequential)
    assert after_concurrent <= before * 1.05, (before, after_concurrent)
    assert live_caches() == caches
