"""Static steps (``graphs="static"``): the code CUDA graphs replay, run eagerly on the CPU.

The same outputs as eager decoding for every drafter and pipeline, greedy and seeded sampling;
fixed buffers reused across steps and requests; slots borrowed and given back; requests that do
not fit a slot run eagerly. The CUDA graph tests themselves are in ``test_cuda_graphs.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from test_speculative import DRAFTERS, drafter_arg
from tiny import SPEC_PROMPTS, full_blocks

import dflash2
from dflash2 import GraphConfig, InvalidOptionError
from dflash2.drafters import Draft
from dflash2.drafters.dflash import DFlashDrafter
from dflash2.engine import DraftLengthPolicy, OverlapPolicy
from dflash2.runtime.graphs import MAX_BUCKET, StaticStep, bucket, buckets_up_to

PROMPTS = SPEC_PROMPTS
MORE_PROMPTS = [*SPEC_PROMPTS, "hello hello hello hello", "a"]


def static(path: Path, drafter: Any = None, **graphs: Any) -> dflash2.Model:
    return dflash2.load(path, drafter=drafter, graphs=GraphConfig(mode="static", **graphs))


@pytest.mark.parametrize("schedule", ["sync", "async", "overlap"])
@pytest.mark.parametrize("name", [*DRAFTERS, "plain"])
def test_greedy_output_equals_transformers_for_every_drafter(
    name: str, schedule: str, paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    model = static(paths["target"], drafter_arg(name, paths) if name != "plain" else None)
    if schedule == "overlap":
        model.policy = OverlapPolicy(schedule="overlap")
    for prompt in PROMPTS:
        completion = model.generate(prompt, max_new_tokens=48, pipeline="sync" if schedule == "sync" else "async")
        assert list(completion.token_ids) == references[prompt]
    assert model.steps is not None and model.steps.free == len(model.steps.slots)  # every slot given back


@pytest.mark.parametrize("name", ["self", "dflash1", "dflash2"])
def test_the_drafter_drafts_what_it_drafts_eagerly(name: str, paths: dict[str, Path]) -> None:
    """Random drafters are rarely accepted, so the output alone would not show a wrong draft. Both
    verify the same blocks: static steps verify no side branches, so the eager model takes none."""
    path = drafter_arg(name, paths)
    eager = dflash2.load(paths["target"], drafter=path, graphs="off")
    eager.lengths = DraftLengthPolicy(mode="fixed", branches="off")
    stepped = full_blocks(static(paths["target"], path))
    for prompt in PROMPTS:
        assert drafts_of(stepped, prompt, "sync") == drafts_of(eager, prompt, "sync")
    assert stepped.drafter is not None and stepped.drafter.steps.free == len(stepped.drafter.steps.slots)  # type: ignore[attr-defined]


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("name", ["plain", "ngram", "self", "dflash2", "hybrid-dflash2"])
def test_seeded_sampling_equals_eager(name: str, pipeline: str, paths: dict[str, Path]) -> None:
    drafter = drafter_arg(name, paths) if name != "plain" else None
    eager = dflash2.load(paths["target"], drafter=drafter, graphs="off")
    stepped = static(paths["target"], drafter)
    # a seeded async stream keeps one schedule; the resident pipeline's is the sync loop's
    schedule = "sync" if stepped._resident() else pipeline
    for seed, prompt in enumerate(PROMPTS):
        options: Any = {"max_new_tokens": 40, "temperature": 0.8, "top_p": 0.95, "seed": seed}
        expected = eager.generate(prompt, **options, pipeline=schedule).token_ids  # type: ignore[arg-type]
        assert stepped.generate(prompt, **options, pipeline=pipeline).token_ids == expected  # type: ignore[arg-type]


def buffer_pointers(model: dflash2.Model) -> dict[str, int]:
    """Addresses of every static buffer: slot caches, step inputs and outputs, of target and drafter."""
    pointers: dict[str, int] = {}
    assert model.steps is not None and model.drafter is not None
    pools: dict[str, Any] = {"target": model.steps, "drafter": model.drafter.steps}  # type: ignore[attr-defined]
    for who, pool in pools.items():
        for i, slot in enumerate(pool.slots):
            pointers[f"{who}{i}.k"] = slot.cache.k.data_ptr()
            pointers[f"{who}{i}.v"] = slot.cache.v.data_ptr()
            for key, (inputs, step) in slot.steps.items():
                pointers[f"{who}{i}.{key}.in"] = inputs.data_ptr()
                for j, out in enumerate(step.outputs or ()):
                    if out is not None:
                        pointers[f"{who}{i}.{key}.out{j}"] = out.data_ptr()
    return pointers


def test_buffers_are_reused_across_steps_and_requests(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = static(paths["target"], paths["dflash2"], slots=1)
    model.generate(PROMPTS[0], max_new_tokens=48)
    first = buffer_pointers(model)
    assert any(".out" in key for key in first)  # the steps ran and kept their outputs
    for prompt in PROMPTS * 2:
        assert list(model.generate(prompt, max_new_tokens=48).token_ids) == references[prompt]
        after = buffer_pointers(model)
        assert {k: after[k] for k in first} == first  # the same buffers, whichever request
    assert len(after) - len(first) <= 4 * len(buckets_up_to(MAX_BUCKET))  # only sizes not seen yet were added


def test_static_step_outputs_stay_in_one_buffer() -> None:
    source = torch.zeros(3)
    step = StaticStep(lambda: (source * 2, None), "static")
    first = step.run()[0]
    source.fill_(1)
    second = step.run()[0]
    assert first is second and second is not None and second.tolist() == [2.0, 2.0, 2.0]


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    assert buckets_up_to(6) == (1, 2, 4, 8)
    with pytest.raises(ValueError):
        bucket(MAX_BUCKET + 1)


@pytest.mark.anyio
async def test_more_streams_than_slots_run_eagerly(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = static(paths["target"], paths["target"], slots=1)
    results: dict[str, list[int]] = {}

    async def run(prompt: str) -> None:
        results[prompt] = list((await model.agenerate(prompt, max_new_tokens=48)).token_ids)

    async with anyio.create_task_group() as tg:
        for prompt in PROMPTS:
            tg.start_soon(run, prompt)
    assert results == {p: references[p] for p in PROMPTS}
    assert model.steps is not None and model.steps.free == 1


def test_a_request_longer_than_a_slot_runs_eagerly(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = static(paths["target"], "ngram", context=40)
    assert model.steps is not None
    acquire = model.steps.acquire
    granted: list[bool] = []
    model.steps.acquire = lambda tokens: granted.append(tokens <= 40) or acquire(tokens)  # type: ignore[method-assign]
    assert list(model.generate(PROMPTS[0], max_new_tokens=48).token_ids) == references[PROMPTS[0]]
    assert list(model.generate(PROMPTS[0], max_new_tokens=8).token_ids) == references[PROMPTS[0]][:8]
    assert granted == [False, True]


def test_a_cancelled_stream_gives_its_slots_back(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = static(paths["target"], paths["dflash2"], slots=1)

    async def read_three() -> None:
        async with model.stream(PROMPTS[1], max_new_tokens=48) as stream:
            read = 0
            async for _ in stream:
                read += 1
                if read == 3:
                    break

    async def cancelled() -> None:
        with anyio.move_on_after(0.0):
            await model.agenerate(PROMPTS[1], max_new_tokens=48)

    for job in (read_three, cancelled):
        anyio.run(job)
        assert model.steps is not None and model.steps.free == 1
        assert model.drafter is not None and model.drafter.steps.free == 1  # type: ignore[attr-defined]
    assert list(model.generate(PROMPTS[1], max_new_tokens=48).token_ids) == references[PROMPTS[1]]


def test_warmup_builds_every_step_the_drafter_needs(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = static(paths["target"], paths["dflash2"], slots=2)
    model.warmup()
    assert model.steps is not None and model.drafter is not None
    sizes = buckets_up_to(model.drafter.block_size)
    capture = tuple(model.drafter.capture_layers)
    for slot in model.steps.slots:
        assert {(size, capture) for size in sizes} <= set(slot.steps)
    for slot in model.drafter.steps.slots:  # type: ignore[attr-defined]
        assert set(sizes) <= set(slot.steps)
    assert {(2, size) for size in sizes} <= set(model.drafter.steps.packed)  # type: ignore[attr-defined]
    assert {(2, size, capture) for size in sizes} <= set(model.steps.packed)  # two slots: batches of two
    assert model.steps.free == 2
    assert list(model.generate(PROMPTS[2], max_new_tokens=48).token_ids) == references[PROMPTS[2]]


def test_a_packed_static_step_equals_a_forward_per_slot(paths: dict[str, Path]) -> None:
    """Blocks of slots 0, 2 and 3 of a pool in one packed step (batch bucket 4, block bucket 8):
    each slot's logits, features and cache are those of an eager forward of its own; slot 1,
    holding a request that is not in the batch, keeps its cache."""
    model = static(paths["target"], slots=4, context=64)
    target, pool = model.target, model.steps
    assert pool is not None
    prompts = [model.tokenizer(p).input_ids for p in MORE_PROMPTS[:4]]
    slots = [pool.acquire(32) for _ in prompts]
    alone = [target.new_cache(128) for _ in prompts]
    capture = (0, 1)
    with torch.inference_mode():
        for slot, cache, ids in zip(slots, alone, prompts, strict=True):
            assert slot is not None
            target(torch.tensor([ids]), slot.cache, logits="none")
            target(torch.tensor([ids]), cache, logits="none")
        kept = slots[1].cache.k[:, :, :, : len(prompts[1])].clone()  # type: ignore[union-attr]
        blocks = {0: [5, 6, 7], 2: [9], 3: [1, 2, 3, 4, 5]}
        pointers = set()
        for _ in range(2):  # a second step reuses the buffers
            outs = pool.forward_packed([(slots[i], torch.tensor(b)) for i, b in blocks.items()], capture)  # type: ignore[misc]
            pointers.add(outs[0].logits.data_ptr())  # type: ignore[union-attr]
            for (i, block), out in zip(blocks.items(), outs, strict=True):
                own = target(torch.tensor([block]), alone[i], logits="all", capture=capture)
                assert own.logits is not None and out.logits is not None and own.hidden is not None
                assert out.logits.shape == own.logits.shape
                assert torch.allclose(out.logits, own.logits, atol=1e-5)
                assert torch.equal(out.logits.argmax(-1), own.logits.argmax(-1))
                assert torch.allclose(out.hidden, own.hidden, atol=1e-5)  # type: ignore[arg-type]
                cache = slots[i].cache  # type: ignore[union-attr]
                n = alone[i].length
                assert cache.length == n
                assert torch.allclose(cache.k[:, :, :, :n], alone[i].k[:, :, :, :n], atol=1e-5)
        assert torch.equal(slots[1].cache.k[:, :, :, : len(prompts[1])], kept)  # type: ignore[union-attr]
    assert set(pool.packed) == {(4, 8, capture)} and len(pointers) == 1
    for slot in slots:
        pool.release(slot)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["plain", "ngram", "self", "dflash2", "hybrid-dflash2"])
async def test_concurrent_streams_share_packed_static_steps(name: str, paths: dict[str, Path]) -> None:
    """Streams that hold slots verify together in the pool's packed steps (the resident pipeline
    leaves its device-resident run for them and comes back once alone); each stream's tokens are
    its tokens alone, greedy or seeded."""
    model = static(paths["target"], drafter_arg(name, paths) if name != "plain" else None, slots=8, context=256)
    jobs: list[tuple[str, dict[str, Any]]] = [
        (prompt, {"max_new_tokens": 12 + 9 * i, "pipeline": "sync" if i == 3 else "async"})
        for i, prompt in enumerate(MORE_PROMPTS)
    ]
    jobs.append((PROMPTS[0], {"max_new_tokens": 30, "temperature": 0.8, "seed": 3}))
    expected = [(await model.agenerate(p, **o)).token_ids for p, o in jobs]
    assert model.steps is not None and not model.steps.packed  # one stream at a time never packs
    for _ in range(2):
        results = await asyncio.gather(*(model.agenerate(p, **o) for p, o in jobs))
        assert [r.token_ids for r in results] == expected
    assert model.steps.packed and max(s for r in results for s in r.stats.batch_sizes) > 1
    assert model.steps.free == 8 and not model.batcher.shared
    drafters = (model.drafter, getattr(model.drafter, "model", None))  # a hybrid's model drafter
    dflash = next((d for d in drafters if isinstance(d, DFlashDrafter)), None)
    if dflash is not None:  # the DFlash sessions drafted together in the drafter pool's packed steps
        assert dflash.steps is not None and dflash.steps.packed and dflash.steps.free == 8


@pytest.mark.parametrize(("graphs", "hint"), [("graph", "graphs must be one of"), (True, "graphs must be one of")])
def test_bad_graph_options(graphs: Any, hint: str, paths: dict[str, Path]) -> None:
    with pytest.raises(InvalidOptionError, match=hint):
        dflash2.load(paths["target"], graphs=graphs, device="cpu")
    with pytest.raises(InvalidOptionError, match="slots"):
        GraphConfig(mode="static", slots=0)
    with pytest.raises(InvalidOptionError, match="context"):
        GraphConfig(mode="static", context=1.5)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_graphs_without_cuda_is_a_clear_error(paths: dict[str, Path]) -> None:
    with pytest.raises(InvalidOptionError, match="needs a CUDA device"):
        dflash2.load(paths["target"], graphs="cuda")


@pytest.fixture
def no_graph_capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """On the CPU nothing may try to capture a CUDA graph."""

    def refuse(self: StaticStep) -> None:
        raise AssertionError("a CUDA graph capture on the CPU")

    monkeypatch.setattr(StaticStep, "capture", refuse)
    yield


def test_eager_cpu_default_has_no_static_steps(paths: dict[str, Path], no_graph_capture: None) -> None:
    model = dflash2.load(paths["target"], drafter=paths["dflash2"], device="cpu")
    assert model.graph_mode == "off" and model.steps is None
    model.warmup()
    assert model.generate(PROMPTS[0], max_new_tokens=8).token_ids


# ---------------------------------------------------------------- the resident pipeline


class ResidentScripted:
    """A drafter whose sessions stay resident: the true continuation, corrupted so that step i keeps
    exactly ``script[i]`` drafts. It reads how far the text got from the resident step's ``kept``
    (a host read a real resident drafter never makes; fine on the CPU, and only in this test)."""

    capture_layers = (0,)  # the features tell ``resume`` how many tokens the last step kept

    def __init__(self, truth: list[int], script: list[int], block_size: int = 6) -> None:
        self.truth, self.script, self.block_size, self.name = truth, script, block_size, "resident-scripted"
        self.sessions: list[ResidentScriptedSession] = []

    def use_static_steps(self, mode: str, context: int, slots: int) -> None:
        pass

    def prepare_static_steps(self) -> None:
        pass

    def resident_sessions(self) -> bool:
        return True

    def start(self, context: Any) -> ResidentScriptedSession:
        self.sessions.append(ResidentScriptedSession(self))
        return self.sessions[-1]


class ResidentScriptedSession:
    def __init__(self, drafter: ResidentScripted) -> None:
        self.d = drafter
        self.position = 1  # the prefill produced truth[0]
        self.step = 0
        self.resident_drafts = 0

    def propose(self, max_tokens: int) -> Draft:
        k = min(self.d.block_size - 1, max_tokens)
        keep = self.d.script[self.step % len(self.d.script)]
        self.step += 1
        tokens = list(self.d.truth[self.position : self.position + k])
        if keep < len(tokens):
            tokens[keep] = (tokens[keep] + 1) % 256
        return Draft(torch.tensor(tokens, dtype=torch.long))

    def observe(self, outcome: Any) -> None:
        self.position += outcome.accepted + 1

    def can_stay_resident(self) -> bool:
        return True

    def propose_resident(self, last: torch.Tensor, features: torch.Tensor | None, kept: torch.Tensor) -> Draft:
        assert features is not None and last.dim() == 0 and kept.dim() == 0
        self.position += int(kept)
        assert int(last) == self.d.truth[self.position - 1]  # the step's input is the last verified token
        self.resident_drafts += 1
        return self.propose(self.d.block_size - 1)

    def resume(self, last: int, features: torch.Tensor | None) -> None:
        assert features is not None
        self.position += features.shape[0]
        assert last == self.d.truth[self.position - 1]

    def close(self) -> None:
        self.closed = True


def resident_model(paths: dict[str, Path], drafter: Any) -> dflash2.Model:
    model = static(paths["target"], drafter)
    assert model._resident()
    return model


def test_resident_steps_follow_scripted_acceptance(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    truth = references[PROMPTS[0]]
    script = [3, 0, 5, 2, 1, 4, 5, 5]
    drafter = ResidentScripted(truth, script)
    model = full_blocks(resident_model(paths, drafter))  # the first step too drafts the whole block
    completion = model.generate(PROMPTS[0], max_new_tokens=48)
    assert list(completion.token_ids) == truth
    lengths = completion.stats.acceptance_lengths
    assert lengths[: len(script)] == tuple(a + 1 for a in script)
    session = drafter.sessions[-1]
    assert session.resident_drafts >= len(script) and session.closed
    assert sum(lengths) == 47  # 1 token from the prefill


def test_the_host_reads_one_step_behind(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    from dflash2.engine import ResidentPipeline

    events: list[str] = []
    launch, read = ResidentPipeline._launch, ResidentPipeline._read

    def logged_launch(self: ResidentPipeline) -> Any:
        events.append("L")
        return launch(self)

    def logged_read(self: ResidentPipeline, launched: Any) -> list[int]:
        events.append("R")
        return read(self, launched)

    model = resident_model(paths, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ResidentPipeline, "_launch", logged_launch)
        patch.setattr(ResidentPipeline, "_read", logged_read)
        completion = model.generate(PROMPTS[1], max_new_tokens=20)
    assert list(completion.token_ids) == references[PROMPTS[1]][:20]
    # plain decoding, one token a step: each step is launched before the one ahead of it is read;
    # no step is launched that could pass max_new_tokens (19 steps after the prefill's token)
    assert "".join(events) == "LLR" + "LR" * 17 + "R"
    assert completion.stats.steps == 19


@pytest.mark.parametrize("n", [2, 7, 9, 13, 20])
def test_resident_max_new_tokens_inside_an_accepted_block(
    n: int, paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    truth = references[PROMPTS[0]]
    model = resident_model(paths, ResidentScripted(truth, [5]))
    completion = model.generate(PROMPTS[0], max_new_tokens=n)
    assert list(completion.token_ids) == truth[:n]
    assert completion.finish_reason == "length"


def test_resident_eos_and_stop_inside_an_accepted_block(
    paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    truth = references[PROMPTS[0]]
    model = resident_model(paths, ResidentScripted(truth, [5]))
    model.eos_token_ids = frozenset({truth[14]})  # inside the third block, with a step in flight
    completion = model.generate(PROMPTS[0], max_new_tokens=40)
    assert completion.finish_reason == "stop"
    assert list(completion.token_ids) == truth[: truth.index(truth[14]) + 1]
    model.eos_token_ids = frozenset()
    free = model.generate(PROMPTS[0], max_new_tokens=40)
    stop = free.text[20:22]
    stopped = model.generate(PROMPTS[0], max_new_tokens=40, stop=[stop])
    assert stopped.text == free.text[: free.text.index(stop)] and stopped.finish_reason == "stop"
    assert model.steps is not None and model.steps.free == len(model.steps.slots)


@pytest.mark.parametrize("name", ["plain", "dflash1", "dflash2"])
def test_resident_runs_where_it_can(name: str, paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    drafter = None if name == "plain" else paths[name]
    model = resident_model(paths, drafter)
    launched: list[int] = []
    from dflash2.engine import ResidentPipeline

    launch = ResidentPipeline._launch

    def counted(self: ResidentPipeline) -> Any:
        launched.append(1)
        return launch(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ResidentPipeline, "_launch", counted)
        completion = model.generate(PROMPTS[2], max_new_tokens=48)
    assert list(completion.token_ids) == references[PROMPTS[2]]
    assert len(launched) >= completion.stats.steps - 8  # every step but the tail's


def drafts_of(model: dflash2.Model, prompt: str, pipeline: str, stop_after: int | None = None) -> list[list[int]]:
    """Every draft a generation proposes, host-driven or resident (``stop_after``: break after that many tokens)."""
    drafts: list[list[int]] = []
    drafter = model.drafter
    assert drafter is not None
    start = drafter.start

    def recording_start(context: Any) -> Any:
        session = start(context)
        for method in ("propose", "propose_resident"):
            inner = getattr(session, method, None)
            if inner is None:
                continue

            def recorded(*args: Any, _inner: Any = inner) -> Draft:
                draft = _inner(*args)
                drafts.append([int(t) for t in draft.tokens])
                return draft

            setattr(session, method, recorded)
        return session

    async def generate() -> None:
        async with model.stream(prompt, max_new_tokens=48, pipeline=pipeline) as stream:  # type: ignore[arg-type]
            read = 0
            async for _ in stream:
                read += 1
                if read == stop_after:
                    break

    drafter.start = recording_start  # type: ignore[method-assign]
    try:
        anyio.run(generate)
    finally:
        del drafter.start
    return drafts


@pytest.mark.parametrize("name", ["dflash1", "dflash2"])
def test_resident_drafts_equal_the_sync_loops(name: str, paths: dict[str, Path]) -> None:
    """The drafter's device-side context (its length, the kept features) follows the text exactly,
    also on a slot whose last session ended in the middle of a resident run."""
    eager = full_blocks(dflash2.load(paths["target"], drafter=paths[name], graphs="off"))
    resident = full_blocks(resident_model(paths, paths[name]))
    drafts_of(resident, PROMPTS[0], "async", stop_after=6)  # leaves the slot mid-run
    for prompt in PROMPTS:
        expected = drafts_of(eager, prompt, "sync")
        assert drafts_of(resident, prompt, "async") == expected
