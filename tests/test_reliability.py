"""Never hang, never lose a stream: event loops that end, cancellation, closing, shared workers.

Each test reproduces a way the SDK used to hang or break (issue 17); the forwards of the target
are slowed down (``SlowForward``) so that a job is surely running when the test interferes.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tiny import SPEC_PROMPTS, SlowForward, full_blocks

import dflash2
from dflash2.engine import OverlapPolicy
from dflash2.runtime.workers import Workers

PROMPT = SPEC_PROMPTS[1]
FORWARD_S = 0.1  # each slowed forward
SLACK_S = 0.15  # scheduling noise allowed on top of one forward


def slowed(paths: dict[str, Path], drafter: Any = None, delay: float = FORWARD_S) -> tuple[dflash2.Model, SlowForward]:
    model = dflash2.load(paths["target"], drafter=drafter)
    return model, SlowForward(model, delay)


def in_thread(fn: Any, timeout: float = 60) -> Any:
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it does not return."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "hung"
    assert result, "raised (see the thread's traceback above)"
    return result[0]


# ---------------------------------------------------------------- event loops that end
def test_a_timed_out_asyncio_run_leaves_the_workers_serving(
    paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    model, slow = slowed(paths)

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(model.agenerate(PROMPT, max_new_tokens=30), 0.15)
        assert slow.running == 0  # the caller left after the running forward, not during it

    asyncio.run(main())  # the loop is gone once the worker finishes that forward
    slow.delay = 0.0
    completion = in_thread(lambda: model.generate(PROMPT, max_new_tokens=48))
    assert list(completion.token_ids) == references[PROMPT]
    assert model.workers.verify.replaced == 0  # the thread never died


def test_a_stopped_loop_that_is_never_closed_blocks_no_one(
    paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    model, slow = slowed(paths)
    loop = asyncio.new_event_loop()
    task = loop.create_task(model.agenerate(PROMPT, max_new_tokens=30))
    loop.call_later(0.15, loop.stop)
    loop.run_forever()  # stops with a job in flight; the loop stays open, nobody runs it
    slow.delay = 0.0
    completion = in_thread(lambda: model.generate(PROMPT, max_new_tokens=48))
    assert list(completion.token_ids) == references[PROMPT]
    task.cancel()
    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    loop.close()


SIGINT_SCRIPT = """
import os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
import dflash2
from tiny import SlowForward
model = dflash2.load({target!r})
slow = SlowForward(model, 0.1)
threading.Timer(0.35, os.kill, (os.getpid(), signal.SIGINT)).start()
started = time.perf_counter()
try:
    model.generate({prompt!r}, max_new_tokens=200)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted after", round(time.perf_counter() - started, 2), "s; forwards running:", slow.running)
slow.delay = 0.0
print("again", list(model.generate({prompt!r}, max_new_tokens=48).token_ids))
"""


def test_ctrl_c_during_generate_then_generate_again(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    script = SIGINT_SCRIPT.format(tests=str(Path(__file__).parent), target=str(paths["target"]), prompt=PROMPT)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "interrupted after" in out and "forwards running: 0" in out, out
    assert f"again {references[PROMPT]}" in out, out


# ---------------------------------------------------------------- cancellation lands within one forward
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(("drafter", "pipeline"), [(None, "async"), ("ngram", "sync"), ("self", "async")])
def test_anyio_deadlines_land_within_one_forward(
    backend: str, drafter: str | None, pipeline: str, paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    model, slow = slowed(paths, paths["target"] if drafter == "self" else drafter)
    if drafter == "self":
        model.policy = OverlapPolicy(schedule="overlap")  # the step runs two workers at once
        full_blocks(model)
    deadline = 0.35

    async def main() -> None:
        started = time.perf_counter()
        with anyio.move_on_after(deadline) as scope:
            await model.agenerate(PROMPT, max_new_tokens=40, pipeline=pipeline)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - started
        assert scope.cancelled_caught
        assert slow.running == 0
        assert elapsed < deadline + FORWARD_S + SLACK_S, elapsed
        assert slow.calls <= deadline / FORWARD_S + 2, slow.calls  # the prefill + the steps begun in time
        calls, started = slow.calls, time.perf_counter()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(deadline):
                await model.agenerate(PROMPT, max_new_tokens=40, pipeline=pipeline)  # type: ignore[arg-type]
        assert time.perf_counter() - started < deadline + FORWARD_S + SLACK_S
        assert slow.calls - calls <= deadline / FORWARD_S + 2
        async with anyio.create_task_group() as tg:  # a task group cancelled from outside
            tg.start_soon(model.agenerate, PROMPT)
            await anyio.sleep(deadline)
            started = time.perf_counter()
            tg.cancel_scope.cancel()
        assert time.perf_counter() - started < FORWARD_S + SLACK_S
        slow.delay = 0.0
        completion = await model.agenerate(PROMPT, max_new_tokens=48, pipeline=pipeline)  # type: ignore[arg-type]
        assert list(completion.token_ids) == references[PROMPT]

    anyio.run(main, backend=backend)


def test_a_cancelled_task_leaves_after_the_running_forward(paths: dict[str, Path]) -> None:
    model, slow = slowed(paths)

    async def main() -> None:
        for wait in (0.05, 0.15, 0.25):
            task = asyncio.create_task(model.agenerate(PROMPT, max_new_tokens=30))
            await asyncio.sleep(wait)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert slow.running == 0
        if sys.version_info >= (3, 11):  # asyncio.timeout cancels and un-cancels the task itself
            started = time.perf_counter()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.25):
                    await model.agenerate(PROMPT, max_new_tokens=30)
            assert slow.running == 0 and time.perf_counter() - started < 0.25 + FORWARD_S + SLACK_S

    asyncio.run(main())


def test_a_queued_job_of_a_cancelled_stream_is_taken_back(paths: dict[str, Path]) -> None:
    """A stream waiting behind another stream's forward leaves at once when cancelled, and never runs it."""
    model, slow = slowed(paths, delay=0.3)

    async def main() -> None:
        busy = asyncio.create_task(model.agenerate(PROMPT, max_new_tokens=3))
        await asyncio.sleep(0.05)  # its prefill runs now
        queued = asyncio.create_task(model.agenerate(PROMPT, max_new_tokens=3))
        await asyncio.sleep(0.05)
        calls, started = slow.calls, time.perf_counter()
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert time.perf_counter() - started < 0.1  # did not wait for the other stream's forward
        await busy
        assert slow.calls - calls == 2  # the busy stream's two steps; the queued prefill never ran

    asyncio.run(main())


# ---------------------------------------------------------------- closing from another task
@pytest.mark.parametrize("pipeline", ["async", "sync"])
def test_aclose_from_another_task_ends_the_iterator_cleanly(paths: dict[str, Path], pipeline: str) -> None:
    model, slow = slowed(paths, paths["target"], delay=0.03)
    model.policy = OverlapPolicy(schedule="overlap")
    full_blocks(model)

    async def main(wait: float) -> None:
        stream = model.stream(PROMPT, max_new_tokens=48, pipeline=pipeline)  # type: ignore[arg-type]
        received: list[int] = []

        async def consume() -> None:
            async for tok in stream:
                received.append(tok.id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(wait)
            await stream.aclose()
            assert slow.running == 0 and stream._source.request.cache is None  # type: ignore[attr-defined]
        assert stream.completion.finish_reason == "cancelled"
        assert list(stream.completion.token_ids) == received

    for trial in range(18):
        anyio.run(main, 0.01 + 0.013 * trial)
    slow.delay = 0.0
    assert len(model.generate(PROMPT, max_new_tokens=8).token_ids) == 8


# ---------------------------------------------------------------- the event loop never computes
@pytest.mark.parametrize("pipeline", ["async", "sync"])
def test_the_event_loop_never_waits_for_a_forward(paths: dict[str, Path], pipeline: str) -> None:
    """Each forward takes 0.15 s; the loop must keep ticking every few ms all the same (run the
    forwards on the loop thread, as a mutation, and the largest gap is >= 0.15 s)."""
    model, slow = slowed(paths, paths["target"], delay=0.15)
    model.policy = OverlapPolicy(schedule="overlap")
    full_blocks(model)
    gaps: list[float] = []

    async def main() -> None:
        done = False

        async def ticker() -> None:
            last = time.perf_counter()
            while not done:
                await anyio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await model.agenerate(PROMPT, max_new_tokens=12, pipeline=pipeline)  # type: ignore[arg-type]
            done = True

    anyio.run(main)
    assert slow.calls >= 3 and len(gaps) > 30
    assert max(gaps) < 0.075, max(gaps)


# ---------------------------------------------------------------- many loops, one worker
def test_a_blocked_loop_does_not_stall_the_streams_of_another(paths: dict[str, Path]) -> None:
    model, _ = slowed(paths, delay=0.02)
    gaps: list[float] = []

    def smooth() -> None:
        async def main() -> None:
            last = time.perf_counter()
            async for _ in model.stream(PROMPT, max_new_tokens=70):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        asyncio.run(main())

    def blocking() -> None:
        async def main() -> None:
            async def block_the_loop() -> None:
                await asyncio.sleep(0.2)
                time.sleep(1.0)  # a sync call in a handler, a debugger: meanwhile its stream's step ends

            blocker = asyncio.create_task(block_the_loop())
            await model.agenerate(SPEC_PROMPTS[0], max_new_tokens=30)
            await blocker

        asyncio.run(main())

    threads = [threading.Thread(target=smooth), threading.Thread(target=blocking)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(gaps) == 70
    assert max(gaps) < 0.3, max(gaps)  # was 1.0 s: the worker waited for the blocked loop


# ---------------------------------------------------------------- workers that die or get stuck
def test_a_dead_worker_thread_is_replaced(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = dflash2.load(paths["target"])
    workers = Workers(model.device)
    model.workers = workers
    model.generate(PROMPT, max_new_tokens=2)
    lane = workers.verify._lanes[0]
    lane.stop()  # the thread ends as if it had died
    lane.thread.join(10)
    completion = in_thread(lambda: model.generate(PROMPT, max_new_tokens=48))
    assert list(completion.token_ids) == references[PROMPT]
    assert workers.verify.replaced == 1
    workers.close()


def test_a_stuck_job_does_not_stall_other_streams(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    from dflash2.drafters import Draft, DraftContext, Outcome

    release = threading.Event()

    class Stuck:
        name, block_size, capture_layers = "stuck", 4, ()

        def start(self, context: DraftContext) -> Any:
            return self

        def propose(self, max_tokens: int) -> Draft:
            release.wait(30)  # a drafter that hangs (a deadlock in user code)
            raise RuntimeError("stuck drafter released")

        def observe(self, outcome: Outcome) -> None: ...

        def close(self) -> None: ...

    target = dflash2.load(paths["target"])
    workers = Workers(target.device)
    workers.verify.stall_s = 0.5
    target.workers = workers
    stuck = target.with_drafter(Stuck())
    stuck.workers = workers

    async def main() -> None:
        with anyio.move_on_after(0.3):
            await stuck.agenerate(PROMPT, max_new_tokens=8)  # cancelled while stuck: leaves at stall_s
        async with anyio.create_task_group() as tg:
            tg.start_soon(stuck.agenerate, PROMPT)  # a second stream stuck the same way
            await anyio.sleep(0.7)  # the running job is now over stall_s: this stream gets a new thread
            completion = await target.agenerate(PROMPT, max_new_tokens=48)
            assert list(completion.token_ids) == references[PROMPT]
            tg.cancel_scope.cancel()

    started = time.perf_counter()
    anyio.run(main)
    assert time.perf_counter() - started < 10
    assert workers.verify.replaced >= 1
    release.set()
    workers.close()
