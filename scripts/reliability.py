"""``python scripts/reliability.py``: the figures of docs/reliability.md, measured on a tiny model.

Each probe reproduces a way an SDK user's app can hang or stall (a deadline around a stream, an
event loop that ends with a job in flight, ``aclose()`` from another task, a loop that blocks)
with every target forward slowed to a known length, and prints what happened as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

import dflash2
from dflash2.testing import SlowForward, save_random

PROMPT = "The quick brown fox"


def _in_thread(fn: Callable[[], Any], timeout: float) -> str:
    box: list[str] = []
    thread = threading.Thread(target=lambda: box.append(str(fn())), daemon=True)
    thread.start()
    thread.join(timeout)
    return "hung" if thread.is_alive() else ("ok" if box else "raised")


def deadline(path: Path, backend: str, limit: float = 0.15, forward: float = 0.1) -> dict[str, Any]:
    """``anyio.move_on_after(limit)`` around ``agenerate``: how long until the caller is back, how many forwards ran."""
    model = dflash2.load(path)
    slow = SlowForward(model, forward)

    async def main() -> float:
        started = time.perf_counter()
        with anyio.move_on_after(limit):
            await model.agenerate(PROMPT, max_new_tokens=30)
        return time.perf_counter() - started

    elapsed = anyio.run(main, backend=backend)
    return {
        "backend": backend,
        "deadline_s": limit,
        "forward_s": forward,
        "returned_after_s": elapsed,
        "forwards": slow.calls,
    }


def ended_loop(path: Path) -> dict[str, Any]:
    """``asyncio.run(wait_for(agenerate, 0.1))``, then a ``generate()`` from another thread."""
    model = dflash2.load(path)
    slow = SlowForward(model, 0.1)

    async def main() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(model.agenerate(PROMPT, max_new_tokens=30), 0.1)

    asyncio.run(main())
    slow.delay = 0.0
    return {"next_generate": _in_thread(lambda: model.generate(PROMPT, max_new_tokens=5), timeout=20)}


def aclose_from_another_task(path: Path, trials: int = 18) -> dict[str, Any]:
    """A disconnect handler's ``await stream.aclose()`` while another task iterates the stream."""
    model = dflash2.load(path, drafter=path)
    SlowForward(model, 0.03)
    errors: list[str] = []

    async def main(wait: float) -> None:
        stream = model.stream(PROMPT, max_new_tokens=48)

        async def consume() -> None:
            try:
                async for _ in stream:
                    pass
            except Exception as err:  # what the iterating task got
                errors.append(type(err).__name__)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(wait)
            await stream.aclose()

    for trial in range(trials):
        anyio.run(main, 0.01 + 0.013 * trial)
    return {"trials": trials, "iterator_errors": len(errors), "kinds": sorted(set(errors))}


def blocked_loop(path: Path, block_s: float = 1.0) -> dict[str, Any]:
    """Largest gap between tokens of a stream while another thread's event loop blocks for ``block_s``."""
    model = dflash2.load(path)
    SlowForward(model, 0.02)
    gaps: list[float] = []

    async def smooth() -> None:
        last = time.perf_counter()
        async for _ in model.stream(PROMPT, max_new_tokens=70):
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()

    async def blocking() -> None:
        async def block() -> None:
            await asyncio.sleep(0.2)
            time.sleep(block_s)

        blocker = asyncio.create_task(block())
        await model.agenerate("abcabc", max_new_tokens=30)
        await blocker

    threads = [threading.Thread(target=asyncio.run, args=(f(),)) for f in (smooth, blocking)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return {"block_s": block_s, "max_gap_s": max(gaps), "tokens": len(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random(Path(tmp) / "tiny", "llama", seed=0)
        results = {
            "deadline": [deadline(path, backend) for backend in ("asyncio", "trio")],
            "aclose_from_another_task": aclose_from_another_task(path),
            "blocked_loop": blocked_loop(path),
            "ended_loop": ended_loop(path),  # last: on a hanging build it leaves the worker dead
        }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
