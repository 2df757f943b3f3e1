"""Memory stays flat under traffic like a server's: prompts of every length, greedy and sampled,
every drafter, 16 streams at a time, through the SDK and through ``dflash2 serve``.

The CI run is short; ``DFLASH2_SOAK_STREAMS=1024 pytest tests/test_soak.py -s`` is the full one
(its figures are in docs/reliability.md). RSS is read after a warm-up, at the middle and at the end:
over the second half it must grow less than 5 %.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

import dflash2

STREAMS = int(os.environ.get("DFLASH2_SOAK_STREAMS", "320"))
CONCURRENT = 16
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired", "cats"]


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A prompt of 1 to 60 words and the options a client might send with it."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    options: dict[str, Any] = {"max_new_tokens": rng.randint(1, 40)}
    if rng.random() < 0.5:
        options.update(temperature=0.8, top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]))
        if rng.random() < 0.5:
            options["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.3:
        options["pipeline"] = "sync"
    return prompt, options


def soak(models: list[dflash2.Model], streams: int, seed: int = 0) -> list[float]:
    """Rounds of ``CONCURRENT`` streams over random models and requests; RSS after warm-up,
    at the middle, at the end."""
    rng = random.Random(seed)

    async def round_(count: int) -> None:
        jobs = [(rng.choice(models), *request(rng)) for _ in range(count)]
        done = await asyncio.gather(*(m.agenerate(p, **o) for m, p, o in jobs))
        assert all(c.finish_reason in ("stop", "length") for c in done)

    rounds = max(4, streams // CONCURRENT)
    for _ in range(2):  # warm-up: the allocator, the kernels' first shapes, the workers
        asyncio.run(round_(CONCURRENT))
    marks = [rss_mib()]
    for i in range(rounds):
        asyncio.run(round_(CONCURRENT))
        if i + 1 == rounds // 2:
            marks.append(rss_mib())
    marks.append(rss_mib())
    return marks


@pytest.mark.timeout(1800)
def test_memory_stays_flat_under_varied_traffic(paths: dict[str, Path]) -> None:
    target = dflash2.load(paths["target"])
    models = [target, *(target.with_drafter(d) for d in ("ngram", paths["target"], paths["dflash2"]))]
    models.append(target.with_drafter(["ngram", paths["dflash1"]]))
    started = time.perf_counter()
    warm, middle, end = soak(models, STREAMS)
    print(
        f"{STREAMS} streams in {time.perf_counter() - started:.0f} s; RSS MiB after warm-up {warm:.1f}, "
        f"at the middle {middle:.1f}, at the end {end:.1f} (second half {100 * (end / middle - 1):+.1f} %)"
    )
    assert end <= middle * 1.05, (warm, middle, end)


@pytest.mark.timeout(1800)
def test_memory_stays_flat_through_the_server(paths: dict[str, Path]) -> None:
    pytest.importorskip("uvicorn")
    import socket

    import uvicorn

    from dflash2.serve import Limits, create_app

    model = dflash2.load(paths["target"], drafter=["ngram", paths["dflash1"]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(model, "tiny", Limits(max_tokens=64)), port=port,
                                           log_level="error"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    rng = random.Random(1)

    async def round_() -> None:
        async def ask(client: httpx.AsyncClient) -> None:
            prompt, options = request(rng)
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
            body["max_tokens"] = options["max_new_tokens"]
            body["temperature"] = options.get("temperature", 0.0)
            body["stream"] = rng.random() < 0.5
            try:  # a third of the clients leave early
                timeout = 0.05 if rng.random() < 0.33 else 60.0
                await client.post(url, json=body, timeout=timeout)
            except httpx.TimeoutException:
                pass

        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(ask(client) for _ in range(CONCURRENT)))

    try:
        while not server.started:
            time.sleep(0.05)
        rounds = max(4, STREAMS // CONCURRENT)
        for _ in range(2):
            asyncio.run(round_())
        marks = [rss_mib()]
        for i in range(rounds):
            asyncio.run(round_())
            if i + 1 == rounds // 2:
                marks.append(rss_mib())
        marks.append(rss_mib())
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    warm, middle, end = marks
    print(f"server: RSS MiB after warm-up {warm:.1f}, at the middle {middle:.1f}, at the end {end:.1f}")
    assert end <= middle * 1.05, marks
