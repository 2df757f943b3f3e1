"""The public API on a tiny model: options, stream life cycle, finishing, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tiny import EOS, full_blocks, hf_greedy, save_tiny

import dflash2
from dflash2 import StreamStateError

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


def test_stop_token_ids_end_generation_at_that_token(tiny_model: dflash2.Model) -> None:
    free = tiny_model.generate(PROMPT, max_new_tokens=30)
    token = free.token_ids[6]
    cut = tiny_model.generate(PROMPT, max_new_tokens=30, stop_token_ids=[token])
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: free.token_ids.index(token) + 1]  # like EOS: included
    assert tiny_model.generate(PROMPT, max_new_tokens=30, stop_token_ids=token).token_ids == cut.token_ids


def test_a_stop_string_that_names_a_special_token_stops_at_it(tiny_model: dflash2.Model) -> None:
    stream = tiny_model.stream(PROMPT, stop=["<pad>", "xyz"])
    assert stream._config.stop_token_ids == (tiny_model.tokenizer.convert_tokens_to_ids("<pad>"),)
    assert stream._config.stop == ("<pad>", "xyz")


# ---------------------------------------------------------------- stream life cycle
async def test_iterating_an_ended_stream_again_is_a_clear_error(tiny_model: dflash2.Model) -> None:
    stream = tiny_model.stream(PROMPT, max_new_tokens=5)
    ids = [tok.id async for tok in stream]
    assert len(ids) == 5
    with pytest.raises(StreamStateError, match="cannot be iterated again"):
        async for _ in stream:
            pass
    with pytest.raises(StopAsyncIteration):  # the iterator protocol itself keeps ending
        await stream.__anext__()


async def test_a_stream_closed_before_it_started_took_no_time(tiny_model: dflash2.Model) -> None:
    stream = tiny_model.stream(PROMPT, max_new_tokens=5)
    await asyncio.sleep(0.05)
    await stream.aclose()
    stats = stream.completion.stats
    assert stream.completion.finish_reason == "cancelled"
    assert stats.time_to_first_token_s == 0.0 and stats.decode_s == 0.0 and stats.new_tokens == 0


class _FailingClose:
    """A drafter whose sessions fail to close (a user drafter with a bug in ``close``)."""

    name, block_size, capture_layers = "failing-close", 4, ()

    def start(self, context: Any) -> _FailingClose:
        return self

    def propose(self, max_tokens: int) -> Any:
        from dflash2.drafters import Draft

        return Draft(torch.zeros(0, dtype=torch.long))

    def observe(self, outcome: Any) -> None: ...

    def close(self) -> None:
        raise RuntimeError("close failed")


async def test_a_failing_session_close_still_frees_the_cache(tiny_model: dflash2.Model) -> None:
    model = tiny_model.with_drafter(_FailingClose())
    stream = model.stream(PROMPT, max_new_tokens=20)
    await stream.__anext__()
    with pytest.raises(RuntimeError, match="close failed"):
        await stream.aclose()
    request = stream._source.request  # type: ignore[attr-defined]
    assert request.cache is None and request.session is None
    assert len((await tiny_model.agenerate(PROMPT, max_new_tokens=3)).token_ids) == 3


def test_an_error_mid_stream_is_finish_reason_error(tiny_model: dflash2.Model) -> None:
    class Exploding(_FailingClose):
        def propose(self, max_tokens: int) -> Any:
            raise ValueError("drafter exploded")

        def close(self) -> None: ...

    async def main() -> dflash2.TokenStream:
        stream = tiny_model.with_drafter(Exploding()).stream(PROMPT, max_new_tokens=20)
        with pytest.raises(ValueError, match="drafter exploded"):
            async for _ in stream:
                pass
        return stream

    stream = anyio.run(main)
    assert stream.completion.finish_reason == "error"
    assert len(stream.completion.token_ids) == 1  # the prefill's token was handed out


def test_hybrid_block_size_holds_for_its_lookup_too(paths: dict[str, Path]) -> None:
    lookup = dflash2.drafters.NGramDrafter(min_ngram=1, max_ngram=2)  # matches almost every step
    # whole blocks: what is tested is how far the lookup may draft, not how far drafting pays
    model = full_blocks(dflash2.load(paths["target"], drafter=[lookup, paths["dflash1"]], block_size=4))
    drafter = model.drafter
    assert isinstance(drafter, dflash2.drafters.HybridDrafter)
    assert drafter.lookup.block_size == 4 and drafter.model.block_size == 4
    verified: list[int] = []
    forward = model.target.forward

    def spy(ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        verified.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    model.target.forward = spy  # type: ignore[method-assign]
    model.generate(PROMPT, max_new_tokens=40)
    steps = verified[1:]  # after the prefill
    assert max(steps) == 4  # the lookup drafted full blocks of the size asked for, never more


def test_options_are_typed_for_type_checkers(tmp_path: Path) -> None:
    """A misspelt or mistyped option is a mypy error, not only a run-time one."""
    mypy_api = pytest.importorskip("mypy.api")
    root = Path(__file__).parents[1]
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "import dflash2\n\n\n"
        "def use(model: dflash2.Model) -> None:\n"
        '    model.generate("hi", temprature=0.5)\n'
        '    model.generate("hi", max_new_tokens="8")\n'
        '    model.stream("hi", temperature=0.5, stop=["x"], stop_token_ids=[2], pipeline="sync", seed=1)\n'
        '    model.stream("hi", pipeline="fast")\n'
    )
    out, _, status = mypy_api.run(
        ["--config-file", str(root / "pyproject.toml"), "--cache-dir", str(root / ".mypy_cache"), str(snippet)]
    )
    assert status == 1, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["5", "6", "8"], out
    assert 'Unexpected keyword argument "temprature"' in errors[0]


def test_typed_options_name_every_option() -> None:
    fields = {f.name for cls in (dflash2.GenerationConfig, dflash2.SamplingConfig) for f in dataclasses.fields(cls)}
    assert set(dflash2.GenerationOptions.__optional_keys__) == fields
