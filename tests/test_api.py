"""The public API on a tiny model: options, stream life cycle, finishing, errors."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tiny import EOS, hf_greedy, save_tiny

import dflash2
from dflash2 import InvalidOptionError, StreamStateError

pytestmark = pytest.mark.anyio
PROMPT = "The quick brown fox"


def reference(model: dflash2.Model, prompt: Any, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.checkpoint, dtype=torch.float32).eval()
    return hf_greedy(hf, model.tokenizer(prompt).input_ids, n)


def test_generate_matches_transformers(tiny_dirs: dict[str, Path]) -> None:
    for arch, path in tiny_dirs.items():
        model = dflash2.load(path, device="cpu")
        completion = model.generate(PROMPT, max_new_tokens=64)
        expected = reference(model, PROMPT, 64)
        assert list(completion.token_ids) == expected, arch
        stop_at_eos = EOS in expected
        assert completion.finish_reason == ("stop" if stop_at_eos else "length")


def test_public_names() -> None:
    for name in ["load", "Model", "Token", "Completion", "Stats", "TokenStream", "DFlash2Error"]:
        assert hasattr(dflash2, name)
    assert issubclass(dflash2.InvalidOptionError, dflash2.DFlash2Error)


async def test_stream_yields_tokens_and_completion(tiny_model: dflash2.Model) -> None:
    tokens = []
    async with tiny_model.stream(PROMPT, max_new_tokens=20) as stream:
        async for tok in stream:
            assert isinstance(tok, dflash2.Token)
            tokens.append(tok)
    completion = stream.completion
    assert completion.token_ids == tuple(t.id for t in tokens)
    assert completion.text == "".join(t.text for t in tokens)
    stats = completion.stats
    assert stats.new_tokens == len(tokens)
    assert stats.steps == len(tokens) - 1  # the first token comes from the prefill
    assert stats.mean_acceptance_length == 1.0
    assert stats.prompt_tokens == len(tiny_model.tokenizer(PROMPT).input_ids)
    assert stats.tokens_per_second > 0


async def test_plain_async_for_without_context_manager(tiny_model: dflash2.Model) -> None:
    ids = [tok.id async for tok in tiny_model.stream(PROMPT, max_new_tokens=12)]
    assert tuple(ids) == (await tiny_model.agenerate(PROMPT, max_new_tokens=12)).token_ids


async def test_break_then_next_request_is_unaffected(tiny_model: dflash2.Model) -> None:
    fresh = await tiny_model.agenerate(PROMPT, max_new_tokens=30)
    async with tiny_model.stream(PROMPT, max_new_tokens=30) as stream:
        async for i, _ in _aenumerate(stream):
            if i == 4:
                break
    assert stream.completion.finish_reason == "cancelled"
    assert len(stream.completion.token_ids) == 5
    again = await tiny_model.agenerate(PROMPT, max_new_tokens=30)
    assert again.token_ids == fresh.token_ids


async def _aenumerate(stream: dflash2.TokenStream) -> Any:
    i = 0
    async for tok in stream:
        yield i, tok
        i += 1


async def test_aclose_is_idempotent_and_completion_needs_an_end(tiny_model: dflash2.Model) -> None:
    stream = tiny_model.stream(PROMPT, max_new_tokens=10)
    with pytest.raises(StreamStateError, match="still running"):
        _ = stream.completion
    await stream.__anext__()
    await stream.aclose()
    await stream.aclose()
    assert stream.completion.finish_reason == "cancelled"
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_cancelling_the_consumer_frees_the_stream(tiny_model: dflash2.Model) -> None:
    fresh = await tiny_model.agenerate(PROMPT, max_new_tokens=25)
    streams: list[dflash2.TokenStream] = []

    async def consume() -> None:
        async with tiny_model.stream(PROMPT, max_new_tokens=400) as stream:
            streams.append(stream)
            async for _ in stream:
                await asyncio.sleep(0.01)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert streams[0].completion.finish_reason == "cancelled"
    assert (await tiny_model.agenerate(PROMPT, max_new_tokens=25)).token_ids == fresh.token_ids


async def test_concurrent_streams_equal_running_alone(tiny_model: dflash2.Model) -> None:
    prompts = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    alone = [await tiny_model.agenerate(p, max_new_tokens=24) for p in prompts]
    together = await asyncio.gather(*(tiny_model.agenerate(p, max_new_tokens=24) for p in prompts))
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


async def test_event_loop_stays_responsive(tiny_model: dflash2.Model) -> None:
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await tiny_model.agenerate(PROMPT, max_new_tokens=40)
    done.set()
    await task
    assert ticks > 40  # the loop ran other work while tokens were computed in a worker thread


def test_iterating_from_two_tasks_is_refused(tiny_model: dflash2.Model) -> None:
    async def main() -> None:
        stream = tiny_model.stream(PROMPT, max_new_tokens=30)
        first = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(StreamStateError, match="another task"):
            await stream.__anext__()
        await first
        await stream.aclose()

    asyncio.run(main())


def test_works_under_trio(tiny_model: dflash2.Model) -> None:
    async def main() -> list[int]:
        return [tok.id async for tok in tiny_model.stream(PROMPT, max_new_tokens=10)]

    ids = anyio.run(main, backend="trio")
    assert tuple(ids) == tiny_model.generate(PROMPT, max_new_tokens=10).token_ids


async def test_generate_inside_a_running_loop_points_to_agenerate(tiny_model: dflash2.Model) -> None:
    with pytest.raises(StreamStateError, match="agenerate"):
        tiny_model.generate(PROMPT)


def test_generate_from_a_worker_thread(tiny_model: dflash2.Model) -> None:
    result: list[dflash2.Completion] = []
    thread = threading.Thread(target=lambda: result.append(tiny_model.generate(PROMPT, max_new_tokens=5)))
    thread.start()
    thread.join(60)
    assert result and len(result[0].token_ids) == 5


# ---------------------------------------------------------------- finishing
def test_max_new_tokens_is_exact(tiny_model: dflash2.Model) -> None:
    for n in (1, 2, 7):
        completion = tiny_model.generate("zzz", max_new_tokens=n)
        assert len(completion.token_ids) <= n
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == n


def test_eos_ends_generation(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "eosy", "llama", seed=0)
    model = dflash2.load(path, device="cpu")
    free = model.generate(PROMPT, max_new_tokens=12)
    # declare the 4th generated token an EOS token: generation must end right there, incl. it
    model.eos_token_ids = frozenset({free.token_ids[3]})
    completion = model.generate(PROMPT, max_new_tokens=12)
    assert completion.finish_reason == "stop"
    assert completion.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[3]) + 1]


def test_stop_string_cuts_text(tiny_model: dflash2.Model) -> None:
    free = tiny_model.generate(PROMPT, max_new_tokens=40)
    text = free.text
    stop = text[10:13]
    assert stop and stop in text
    cut = tiny_model.generate(PROMPT, max_new_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert stop not in cut.text
    assert len(cut.token_ids) < len(free.token_ids)


def test_sampling_is_seeded(tiny_model: dflash2.Model) -> None:
    a = tiny_model.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=7)
    b = tiny_model.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=7)
    c = tiny_model.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_tokens": 5}, "Did you mean 'max_new_tokens'"),
        ({"temprature": 0.5}, "Did you mean 'temperature'"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"pipeline": "fast"}, "pipeline"),
    ],
)
def test_bad_options_are_named_errors(tiny_model: dflash2.Model, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        tiny_model.stream(PROMPT, **options)


def test_prompt_longer_than_context(tiny_model: dflash2.Model) -> None:
    with pytest.raises(dflash2.ContextLengthError, match="Shorten the prompt"):
        tiny_model.stream("x" * 600, max_new_tokens=4)
    with pytest.raises(dflash2.ContextLengthError, match="lower max_new_tokens"):
        tiny_model.stream(PROMPT, max_new_tokens=600)
    assert tiny_model.generate(PROMPT, max_new_tokens=3).token_ids  # still usable


def test_bad_prompt_is_a_named_error(tiny_model: dflash2.Model) -> None:
    with pytest.raises(dflash2.InvalidPromptError):
        tiny_model.stream({"text": "hi"})
