"""The asynchronous pipeline: identical output, real overlap, cancellation, concurrency, hosts."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from tiny import SPEC_PROMPTS, SlowForward, full_blocks

import dflash2
from dflash2.drafters import Draft, DraftContext, Outcome
from dflash2.drafters.base import PreDraft
from dflash2.engine import OverlapPolicy

PROMPTS = SPEC_PROMPTS


def forced(model: dflash2.Model, schedule: str = "overlap") -> dflash2.Model:
    """The schedule forced, and full blocks every step (what these tests measure is the overlap)."""
    model.policy = OverlapPolicy(schedule=schedule)  # type: ignore[arg-type]
    return full_blocks(model)


@pytest.mark.parametrize("name", ["self", "random", "dflash1", "dflash2", "ngram", "hybrid"])
def test_predrafting_schedule_is_identical(name: str, paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    choices = {"self": paths["target"], "random": paths["random"], "ngram": "ngram"}
    choices["hybrid"] = [dflash2.drafters.NGramDrafter(min_ngram=1, max_ngram=2), paths["dflash2"]]
    drafter = choices.get(name) or paths[name]
    # the target drafting for itself in its own precision: every draft right
    model = forced(dflash2.load(paths["target"], drafter=drafter, drafter_weights="same"))
    for prompt in PROMPTS:
        completion = model.generate(prompt, max_new_tokens=48, pipeline="async")
        assert list(completion.token_ids) == references[prompt]
    if name == "self":  # the drafter is the target: every pre-draft is right
        stats = model.generate(PROMPTS[1], max_new_tokens=41, pipeline="async").stats
        assert stats.predraft_hits >= stats.steps - 2 > 0
        block = model.drafter.block_size  # type: ignore[union-attr]
        assert stats.acceptance_lengths[:-1] == (block,) * (len(stats.acceptance_lengths) - 1)


class SlowDrafter:
    """Wraps a drafter so that each proposal and pre-draft takes ``delay`` seconds more."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.name, self.block_size, self.capture_layers = "slow", inner.block_size, inner.capture_layers

    def start(self, context: DraftContext) -> Any:
        return SlowSession(self.inner.start(context), self.delay)


class SlowSession:
    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def propose(self, max_tokens: int) -> Draft:
        time.sleep(self.delay)
        return self.inner.propose(max_tokens)

    def can_predraft(self) -> bool:
        return bool(self.inner.can_predraft())

    def predraft(self, max_tokens: int) -> PreDraft | None:
        time.sleep(self.delay)
        return self.inner.predraft(max_tokens)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.anyio
async def test_slow_drafter_and_verifier_overlap_and_the_loop_stays_responsive(
    paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    base = dflash2.load(paths["target"], drafter=paths["target"], drafter_weights="same")
    # a verify forward slower than a pre-draft (delay and compute together), so each pre-draft
    # can hide whole: 3 of the 4 drafts run beside a verification, an ideal overlap of 0.75
    SlowForward(base, 0.08)
    model = forced(base.with_drafter(SlowDrafter(base.drafter, 0.05)))
    ticks, done = 0, False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            await anyio.sleep(0.005)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        started = time.perf_counter()
        completion = await model.agenerate(PROMPTS[0], max_new_tokens=48)
        elapsed = time.perf_counter() - started
        done = True
    stats = completion.stats
    assert list(completion.token_ids) == references[PROMPTS[0]]
    assert stats.overlap > 0.5, stats
    assert stats.predraft_hits > 0
    assert ticks >= elapsed / 0.005 / 4, (ticks, elapsed)  # the loop was never blocked for long
    # serial scheduling would pay both delays every step
    serial = await forced(model, "serial").agenerate(PROMPTS[0], max_new_tokens=48)
    assert serial.token_ids == completion.token_ids
    assert serial.stats.overlap == 0.0 and serial.stats.bubble > 0.3
    assert stats.bubble < serial.stats.bubble


class FailingSession:
    def propose(self, max_tokens: int) -> Draft:
        raise ValueError("drafter exploded")

    def observe(self, outcome: Outcome) -> None: ...

    def close(self) -> None: ...


class FailingDrafter:
    name, block_size, capture_layers = "failing", 4, ()

    def start(self, context: DraftContext) -> FailingSession:
        return FailingSession()


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_failing_drafter_raises_in_the_consumer(paths: dict[str, Path], pipeline: str) -> None:
    model = dflash2.load(paths["target"], drafter=FailingDrafter())
    with pytest.raises(ValueError, match="drafter exploded"):
        model.generate(PROMPTS[0], max_new_tokens=8, pipeline=pipeline)
    plain = model.with_drafter(None)
    assert len(plain.generate(PROMPTS[0], max_new_tokens=8, pipeline=pipeline).token_ids) == 8


@pytest.mark.anyio
@pytest.mark.timeout(600)
async def test_cancellation_at_random_points_leaks_nothing(
    paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    target = dflash2.load(paths["target"])
    models = [target, target.with_drafter(paths["target"]), target.with_drafter("ngram")]
    models.append(target.with_drafter(paths["dflash2"]))
    for m in models:  # start the worker threads
        await m.agenerate(PROMPTS[0], max_new_tokens=48)
    threads, tasks = sorted(t.name for t in threading.enumerate()), asyncio.all_tasks()
    rng = random.Random(0)
    for _ in range(100):
        model = rng.choice(models)
        prompt = rng.choice(PROMPTS)
        pipeline = rng.choice(["async", "async", "sync"])
        how = rng.choice(["break", "timeout", "cancel-task", "aclose"])
        if how == "break":
            stop_after = rng.randrange(1, 40)
            async with model.stream(prompt, max_new_tokens=48, pipeline=pipeline) as stream:
                async for i, _ in aenumerate(stream):
                    if i + 1 == stop_after:
                        break
            assert stream.completion.finish_reason == "cancelled"
        elif how == "timeout":
            limit, started = rng.uniform(0.0, 0.05), time.perf_counter()
            with anyio.move_on_after(limit) as scope:
                completion = await model.agenerate(prompt, max_new_tokens=48, pipeline=pipeline)
            assert time.perf_counter() - started < limit + 0.25  # a tiny model's step is a few ms
            if not scope.cancelled_caught:  # finished in time
                assert list(completion.token_ids) == references[prompt]
        elif how == "cancel-task":
            task = asyncio.ensure_future(model.agenerate(prompt, max_new_tokens=48, pipeline=pipeline))
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            stream = model.stream(prompt, max_new_tokens=48, pipeline=pipeline)
            for _ in range(rng.randrange(0, 10)):
                await stream.__anext__()
            await stream.aclose()
    assert sorted(t.name for t in threading.enumerate()) == threads
    assert asyncio.all_tasks() == tasks
    for model in models:
        for prompt in PROMPTS:
            completion = await model.agenerate(prompt, max_new_tokens=48)
            assert list(completion.token_ids) == references[prompt]


async def aenumerate(stream: dflash2.TokenStream) -> Any:
    i = 0
    async for tok in stream:
        yield i, tok
        i += 1


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["self", "dflash1", "ngram"])
async def test_four_concurrent_streams_equal_running_alone(
    name: str, paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    drafter = {"self": paths["target"], "ngram": "ngram"}.get(name) or paths[name]
    model = dflash2.load(paths["target"], drafter=drafter)
    prompts = [*PROMPTS, PROMPTS[0]]
    results = await asyncio.gather(*(model.agenerate(p, max_new_tokens=48) for p in prompts))
    for prompt, completion in zip(prompts, results, strict=True):
        assert list(completion.token_ids) == references[prompt]


def test_async_pipeline_under_trio(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = forced(dflash2.load(paths["target"], drafter=paths["dflash2"]))

    async def main() -> list[list[int]]:
        out: list[list[int]] = [[], []]

        async def one(i: int) -> None:
            async with model.stream(PROMPTS[i], max_new_tokens=48) as stream:
                async for tok in stream:
                    out[i].append(tok.id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
        return out

    out = anyio.run(main, backend="trio")
    assert out == [references[PROMPTS[0]], references[PROMPTS[1]]]


def test_sync_iterator_for_scripts(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = dflash2.load(paths["target"], drafter="ngram")
    ids = [tok.id for tok in model.stream_sync(PROMPTS[0], max_new_tokens=48)]
    assert ids == references[PROMPTS[0]]
    with model.stream_sync(PROMPTS[1], max_new_tokens=48) as stream:
        for i, _ in enumerate(stream):
            if i == 4:
                break
    assert stream.completion.finish_reason == "cancelled" and len(stream.completion.token_ids) == 5
    abandoned = iter(model.stream_sync(PROMPTS[2], max_new_tokens=48))
    next(abandoned)
    del abandoned  # garbage collection stops its event loop thread
    assert [t.id for t in model.stream_sync(PROMPTS[1], max_new_tokens=48)] == references[PROMPTS[1]]


@pytest.mark.anyio
async def test_sync_iterator_inside_a_loop_points_to_stream(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"])
    with pytest.raises(dflash2.StreamStateError, match="async for"):
        model.stream_sync("hi")


def test_overlap_policy_keeps_the_faster_schedule() -> None:
    policy = OverlapPolicy(explore=2, recheck_every=10)
    picks = []
    for _ in range(30):
        overlap = policy.overlap_next()
        picks.append(overlap)
        policy.record(overlap, 0.01 if overlap else 0.02, 1)
    assert picks[:4] == [True, True, False, False]
    assert picks[4:].count(False) <= 3  # only the periodic re-checks
    slow = OverlapPolicy(explore=2, recheck_every=10)
    for _ in range(30):
        overlap = slow.overlap_next()
        slow.record(overlap, 0.03 if overlap else 0.02, 1)
    assert slow.summary()["overlapped_s_per_token"] > slow.summary()["serial_s_per_token"]
    assert not slow.overlap_next()  # between re-checks the losing schedule is never picked
    with pytest.raises(dflash2.InvalidOptionError, match="schedule"):
        OverlapPolicy(schedule="sometimes")  # type: ignore[arg-type]
    with pytest.raises(dflash2.InvalidOptionError, match="recheck_every"):
        OverlapPolicy(recheck_every=0)


def _picks(policy: OverlapPolicy, steps: int, seconds: Callable[[int, bool], float]) -> list[bool]:
    picks = []
    for step in range(steps):
        overlap = policy.overlap_next()
        picks.append(overlap)
        policy.record(overlap, seconds(step, overlap), 1)
    return picks


def test_overlap_policy_rechecks_a_losing_schedule_ever_less_often() -> None:
    policy = OverlapPolicy(explore=2, recheck_every=10, max_recheck_every=40)
    picks = _picks(policy, 400, lambda _, overlap: 0.03 if overlap else 0.02)
    trials = [i for i, p in enumerate(picks) if p][2:]  # after the exploration
    gaps = [b - a for a, b in itertools.pairwise(trials)]
    assert gaps[:4] == [10, 20, 40, 40]  # the wait doubles, up to the cap
    assert len(trials) < 15


def test_overlap_policy_follows_a_change_of_the_lead() -> None:
    policy = OverlapPolicy(explore=2, recheck_every=10, max_recheck_every=80)
    picks = _picks(policy, 800, lambda step, overlap: (0.03 if step < 300 else 0.005) if overlap else 0.02)
    assert picks[-100:].count(True) >= 95  # overlapping became the faster schedule and is kept


@pytest.mark.timeout(300)
def test_stream_in_a_jupyter_kernel(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(f"import dflash2\nmodel = dflash2.load({str(paths['target'])!r}, drafter='ngram')"),
        nbformat.v4.new_code_cell(
            "ids = []\n"
            f"async for tok in model.stream({PROMPTS[0]!r}, max_new_tokens=48):\n"
            "    ids.append(tok.id)\n"
            "print(ids)"
        ),
        nbformat.v4.new_code_cell(
            f"completion = await model.agenerate({PROMPTS[1]!r}, max_new_tokens=48)\nprint(list(completion.token_ids))"
        ),
    ]
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3").execute()
    printed = [cell.outputs[0]["text"].strip() for cell in notebook.cells[1:]]
    assert printed == [str(references[PROMPTS[0]]), str(references[PROMPTS[1]])]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
@pytest.mark.parametrize("drafter", ["none", "ngram", "self"])
def test_generation_leaves_no_compute_threads_on_the_callers_thread(tmp_path: Path, drafter: str) -> None:
    """Tensor work dflash2 does on the caller's thread (storing a finished request's state in the
    prefix cache) must not start an OpenMP team there: beside the verify thread's own team, an
    idle one makes every later parallel region sleep and wake instead of spin (see runtime.workers)."""
    import torch
    from tiny import save_tiny

    from dflash2.runtime.workers import release_thread_pool

    if torch.get_num_threads() < 2:
        pytest.skip("one core: OpenMP starts no team")
    # a cache big enough that copying it is a parallel region: 4 layers x 4 heads x 64 dims a token
    path = save_tiny(tmp_path / "t", "llama", hidden_size=256, num_hidden_layers=4, num_key_value_heads=4)
    model = dflash2.load(path, device="cpu")
    if drafter != "none":
        model = model.with_drafter("ngram" if drafter == "ngram" else path)
    prompt = "the cache of this prompt is copied into the prefix cache when the request ends. " * 2
    model.generate(prompt, max_new_tokens=4)  # every thread dflash2 keeps is running now
    release_thread_pool()
    threads = len(list(Path("/proc/self/task").iterdir()))

    async def consume(text: str) -> None:
        async for _ in model.stream(text, max_new_tokens=8):
            pass

    async def side_by_side() -> None:  # concurrent streams share packed steps
        await asyncio.gather(consume(prompt[::-1]), consume(prompt[2:]))

    for pipeline in ("sync", "async"):
        model.generate(prompt[1:], max_new_tokens=8, pipeline=pipeline)
    asyncio.run(side_by_side())
    assert len(list(Path("/proc/self/task").iterdir())) == threads
