"""Concurrent streams share the target: packed forwards, identical outputs, joining, leaving, cancelling."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tiny import SPEC_PROMPTS

import dflash2

PROMPTS = [*SPEC_PROMPTS, "hello hello hello hello", "a"]


def test_packed_forward_equals_one_forward_per_request(paths: dict[str, Path]) -> None:
    """Prefills and verify blocks of several requests in one forward: each request's logits,
    features and cache are those of a forward of its own."""
    target = dflash2.load(paths["target"]).target
    tok = dflash2.load(paths["target"]).tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    capture = (0, 1)
    alone, packed = [target.new_cache(64) for _ in prompts], [target.new_cache(64) for _ in prompts]
    with torch.inference_mode():
        for cache, ids in zip(alone[1:], prompts[1:], strict=True):  # requests 1 and 2 are decoding already
            target(torch.tensor([ids]), cache, logits="none")
        for cache, ids in zip(packed[1:], prompts[1:], strict=True):
            target(torch.tensor([ids]), cache, logits="none")
        blocks = [torch.tensor(prompts[0]), torch.tensor([5, 6, 7, 8]), torch.tensor([9])]
        outs = target.forward_packed(
            [(blocks[0], packed[0], False), (blocks[1], packed[1], True), (blocks[2], packed[2], True)], capture
        )
        for i, (ids, cache) in enumerate(zip(blocks, alone, strict=True)):
            own = target(ids[None], cache, logits="last" if i == 0 else "all", capture=capture)
            assert own.logits is not None and outs[i].logits is not None and own.hidden is not None
            assert outs[i].logits.shape == own.logits.shape
            assert torch.allclose(outs[i].logits, own.logits, atol=1e-5)
            assert torch.equal(outs[i].logits.argmax(-1), own.logits.argmax(-1))
            assert torch.allclose(outs[i].hidden, own.hidden, atol=1e-5)  # type: ignore[arg-type]
            assert packed[i].length == cache.length
            n = cache.length
            assert torch.allclose(packed[i].k[:, :, :, :n], cache.k[:, :, :, :n], atol=1e-5)


@pytest.mark.parametrize("graphs", ["off", "static"])
@pytest.mark.parametrize("version", ["dflash1", "dflash2", "hybrid"])
def test_one_drafter_forward_drafts_for_several_sessions(paths: dict[str, Path], version: str, graphs: str) -> None:
    """``propose_many`` gives each session the draft it proposes alone, step after step (the hybrid
    drafter: lookups where they match, one DFlash forward for the others). With static steps the
    sessions hold static slots and draft together in the pool's packed static step."""
    from dflash2.config import SamplingConfig
    from dflash2.drafters.base import BatchDrafting, DraftContext, Outcome
    from dflash2.drafters.dflash import DFlashDrafter

    choice: Any = paths.get(version) or ["ngram", paths["dflash2"]]  # the lookup matches some prompts only
    model = dflash2.load(paths["target"], drafter=choice, graphs=graphs)
    drafter, target = model.drafter, model.target
    assert isinstance(drafter, BatchDrafting) and drafter is not None
    prompts = [model.tokenizer(p).input_ids for p in PROMPTS[:3]]
    capture = drafter.capture_layers

    def sessions() -> list[Any]:
        started = []
        with torch.inference_mode():
            for ids in prompts:
                prefill = target(torch.tensor([ids]), target.new_cache(len(ids)), logits="none", capture=capture)
                assert prefill.hidden is not None
                context = DraftContext(ids, ids[-1], prefill.hidden[0], SamplingConfig(), None, 256)
                started.append(drafter.start(context))
        return started

    alone, together = sessions(), sessions()
    hidden_width = target.spec.hidden_size * len(drafter.capture_layers)
    rng = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for step in range(4):
            limits = [7, 3, 0] if step == 1 else [7, 7, 7]
            one = [s.propose(k) for s, k in zip(alone, limits, strict=True)]
            many = drafter.propose_many(together, limits)
            for a, b in zip(one, many, strict=True):
                assert a.tokens.tolist() == b.tokens.tolist()
            for a, b, draft in zip(alone, together, one, strict=True):  # the same verified outcome for both
                kept = min(len(draft), 2)
                features = torch.randn(kept + 1, hidden_width, generator=rng)
                outcome = Outcome(kept, 5 + step, tuple(int(t) for t in draft.tokens[:kept]), features)
                a.observe(outcome)
                b.observe(outcome)
    dflash = next(d for d in (drafter, getattr(drafter, "model", None)) if isinstance(d, DFlashDrafter))
    assert bool(dflash.steps and dflash.steps.packed) == (graphs == "static")


def _models(paths: dict[str, Path], max_batch: int = 8, graphs: str = "off") -> dict[str, dflash2.Model]:
    """A model per drafter, sharing one target; ``graphs="static"``: four static slots shared by all."""
    config = dflash2.GraphConfig(mode=graphs, slots=4, context=256)  # type: ignore[arg-type]
    plain = dflash2.load(paths["target"], max_batch=max_batch, graphs=config)
    return {
        "plain": plain,
        "ngram": plain.with_drafter("ngram"),
        "self": plain.with_drafter(paths["target"]),
        "dflash2": plain.with_drafter(paths["dflash2"]),
        "hybrid": plain.with_drafter([dflash2.drafters.NGramDrafter(min_ngram=1, max_ngram=2), paths["dflash1"]]),
    }


def _request(rng: random.Random) -> dict[str, Any]:
    options: dict[str, Any] = {"max_new_tokens": rng.choice([1, 7, 24, 48]), "pipeline": rng.choice(["async", "sync"])}
    kind = rng.choice(["greedy", "greedy", "seeded", "stop"])
    if kind == "seeded":
        options.update(temperature=0.9, seed=rng.randrange(100))
    elif kind == "stop":
        options["stop"] = [rng.choice(["c", "lo", "e "])]
    return options


async def _alone(model: dflash2.Model, prompt: str, options: dict[str, Any]) -> tuple[int, ...]:
    return (await model.agenerate(prompt, **options)).token_ids


@pytest.mark.anyio
@pytest.mark.parametrize("streams", [1, 2, 4, 8])
async def test_concurrent_streams_each_equal_running_alone(paths: dict[str, Path], streams: int) -> None:
    models = _models(paths)
    rng = random.Random(streams)
    jobs = [(rng.choice(list(models)), rng.choice(PROMPTS), _request(rng)) for _ in range(streams)]
    expected = [await _alone(models[m], p, o) for m, p, o in jobs]
    results = await asyncio.gather(*(models[m].agenerate(p, **o) for m, p, o in jobs))
    for (m, p, o), want, got in zip(jobs, expected, results, strict=True):
        assert got.token_ids == want, (m, p, o)
    assert all(1 <= size <= 8 for r in results for size in r.stats.batch_sizes)


@pytest.mark.anyio
async def test_streams_of_one_model_share_forwards_and_respect_max_batch(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter="ngram", max_batch=3)
    results = await asyncio.gather(*(model.agenerate(p, max_new_tokens=40) for p in PROMPTS))
    sizes = [s for r in results for s in r.stats.batch_sizes]
    assert max(sizes) == 3 and all(len(r.stats.batch_sizes) == r.stats.steps for r in results)
    alone = [(await model.agenerate(p, max_new_tokens=40)).token_ids for p in PROMPTS]
    assert [r.token_ids for r in results] == alone
    assert (await model.agenerate(PROMPTS[0], max_new_tokens=8)).stats.mean_batch_size == 1.0
    with pytest.raises(dflash2.InvalidOptionError, match="max_batch"):
        dflash2.load(paths["target"], max_batch=0)


@pytest.mark.anyio
@pytest.mark.parametrize("graphs", ["off", "static"])
async def test_joining_leaving_and_cancelling_leave_the_others_unaffected(paths: dict[str, Path], graphs: str) -> None:
    models = _models(paths, max_batch=4, graphs=graphs)
    for m in models.values():  # start the worker threads (the draft one starts at its first job)
        await m.agenerate(PROMPTS[0], max_new_tokens=4)
        m.workers.draft.call(lambda: None)
    threads, tasks = sorted(t.name for t in threading.enumerate()), asyncio.all_tasks()
    rng = random.Random(0)
    for _ in range(12):
        jobs = [(rng.choice(list(models)), rng.choice(PROMPTS), _request(rng)) for _ in range(rng.randint(2, 6))]
        expected = [await _alone(models[m], p, o) for m, p, o in jobs]
        doomed = rng.randrange(len(jobs))  # cancelled at a random point while the others run

        async def run(i: int, job: tuple[str, str, dict[str, Any]], doomed: int = doomed) -> tuple[int, ...] | None:
            m, p, o = job
            await asyncio.sleep(rng.uniform(0, 0.02))  # joins at a random point
            if i != doomed:
                return (await models[m].agenerate(p, **o)).token_ids
            with anyio.move_on_after(rng.uniform(0, 0.03)):
                async with models[m].stream(p, **o) as stream:
                    async for _ in stream:
                        pass
            return None

        got = await asyncio.gather(*(run(i, job) for i, job in enumerate(jobs)))
        for i, (want, have) in enumerate(zip(expected, got, strict=True)):
            if i != doomed:
                assert have == want, jobs[i]
    assert sorted(t.name for t in threading.enumerate()) == threads
    assert asyncio.all_tasks() == tasks
    for m in models.values():  # nothing pending, nothing counted as running, every slot given back
        assert not m.batcher._pending and not m.batcher.shared
        assert m.steps is None or m.steps.free == len(m.steps.slots)


class _Open:
    """A stream of the property test and what was read from it."""

    def __init__(self, key: tuple[str, str], stream: dflash2.TokenStream) -> None:
        self.key, self.stream, self.ids, self.ended = key, stream, list[int](), False

    async def read(self, count: int) -> None:
        for _ in range(count):
            try:
                self.ids.append((await self.stream.__anext__()).id)
            except StopAsyncIteration:
                self.ended = True
                return


@pytest.mark.anyio
@pytest.mark.parametrize("graphs", ["off", "static"])
async def test_random_interleavings_never_change_greedy_output(paths: dict[str, Path], graphs: str) -> None:
    """Property: streams started, read a few tokens at a time and cancelled in random orders;
    every stream that runs to its end gives its greedy output alone. With static steps the
    streams that hold slots verify in packed static steps, the others (more streams than slots)
    in eager packed forwards, and the resident pipeline leaves its runs for the batched steps."""
    models = _models(paths, max_batch=3, graphs=graphs)
    expected = {(m, p): await _alone(model, p, {"max_new_tokens": 16}) for m, model in models.items() for p in PROMPTS}
    finished = 0
    for seed in range(8):
        rng = random.Random(seed)
        running: list[_Open] = []
        for _ in range(60):
            action = rng.choice(["start", "read", "read", "read", "read", "cancel"])
            if action == "start" or not running:
                key = (rng.choice(list(models)), rng.choice(PROMPTS))
                pipeline = rng.choice(["async", "sync"])
                running.append(_Open(key, models[key[0]].stream(key[1], max_new_tokens=16, pipeline=pipeline)))
            elif action == "cancel":
                await running.pop(rng.randrange(len(running))).stream.aclose()
            else:  # read a few tokens of several streams at once, so that their steps meet
                picked = rng.sample(running, min(len(running), rng.randint(1, 3)))
                await asyncio.gather(*(s.read(rng.randint(1, 10)) for s in picked))
                for s in [s for s in running if s.ended]:
                    assert tuple(s.ids) == expected[s.key], (seed, s.key)
                    running.remove(s)
                    finished += 1
        for s in running:
            await s.stream.aclose()
    assert finished >= 20
    for m in models.values():
        assert not m.batcher._pending and not m.batcher.shared
    steps = models["plain"].steps
    if graphs == "static":  # every slot given back; packed static steps ran
        assert steps is not None and steps.free == len(steps.slots) == 4 and steps.packed


@pytest.mark.anyio
async def test_a_joining_stream_gets_its_first_token_within_a_step_or_two(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter="ngram", max_batch=4)
    running = [model.stream(p, max_new_tokens=400, stop_token_ids=[]) for p in PROMPTS[:3]]
    seen: list[int] = []

    async def consume(stream: dflash2.TokenStream) -> None:
        async for _ in stream:
            await asyncio.sleep(0)

    async def join() -> None:
        with anyio.fail_after(30):
            while running[0].stats.steps < 5:  # the others are well under way
                await asyncio.sleep(0.001)
        before = running[0].stats.steps
        async with model.stream(PROMPTS[3], max_new_tokens=4) as late:
            await late.__anext__()
        seen.append(running[0].stats.steps - before)
        for stream in running:
            await stream.aclose()

    await asyncio.gather(join(), *(consume(s) for s in running))
    assert seen and seen[0] <= 2, seen  # the running step, then the one that prefilled it
