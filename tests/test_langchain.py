"""``ChatDFlash2``: LangChain's chat-model interface on an in-process model (invoke, stream, astream,
batch, usage, stop), each answer equal to ``model.generate`` on the same messages."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import dflash2

pytest.importorskip("langchain_core")
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage

from dflash2.integrations.langchain import ChatDFlash2

LC_MESSAGES = [SystemMessage("be brief"), HumanMessage("abcabc hello")]
SDK_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abcabc hello"}]


@pytest.fixture(scope="module")
def model(paths: dict[str, Path]) -> dflash2.Model:
    return dflash2.load(paths["target"], drafter="ngram")


def test_invoke_and_usage(model: dflash2.Model) -> None:
    chat = ChatDFlash2(model=model, max_new_tokens=20)
    expected = model.generate(SDK_MESSAGES, max_new_tokens=20)
    answer = chat.invoke(LC_MESSAGES)
    assert isinstance(answer, AIMessage) and answer.content == expected.text
    assert answer.usage_metadata == {
        "input_tokens": expected.stats.prompt_tokens,
        "output_tokens": len(expected.token_ids),
        "total_tokens": expected.stats.prompt_tokens + len(expected.token_ids),
    }
    assert answer.response_metadata["finish_reason"] == expected.finish_reason
    assert answer.response_metadata["dflash2"]["mean_acceptance_length"] >= 1.0


def test_stream_and_astream_add_up_to_invoke(model: dflash2.Model) -> None:
    chat = ChatDFlash2(model=model, max_new_tokens=20)
    expected = chat.invoke(LC_MESSAGES)
    chunks = list(chat.stream(LC_MESSAGES))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) > 2
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.content == expected.content and total.usage_metadata == expected.usage_metadata

    async def collect() -> str:
        return "".join([str(c.content) async for c in chat.astream(LC_MESSAGES)])

    assert asyncio.run(collect()) == expected.content


def test_stop_options_and_ainvoke_batch(model: dflash2.Model) -> None:
    chat = ChatDFlash2(model=model, max_new_tokens=30)
    expected = model.generate("x", max_new_tokens=30, stop=["c"])
    prompt = [HumanMessage("abcabc hello")]
    stopped = chat.invoke(prompt, stop=["c"])
    assert stopped.content == model.generate([{"role": "user", "content": "abcabc hello"}], max_new_tokens=30,
                                             stop=["c"]).text  # fmt: skip
    assert "c" not in str(stopped.content) and expected is not None
    short = chat.invoke(prompt, max_new_tokens=3)
    assert short.usage_metadata is not None and short.usage_metadata["output_tokens"] <= 3
    seeded = [chat.invoke(prompt, temperature=0.9, seed=5).content for _ in range(2)]
    assert seeded[0] == seeded[1]

    async def concurrently() -> list[str]:
        answers = await chat.abatch([[HumanMessage(p)] for p in ("The quick", "abcabc", "x = [1")])
        return [str(a.content) for a in answers]

    prompts = ("The quick", "abcabc", "x = [1")
    alone = [model.generate([{"role": "user", "content": p}], max_new_tokens=30).text for p in prompts]
    assert asyncio.run(concurrently()) == alone


def test_invoke_inside_a_running_loop(model: dflash2.Model) -> None:
    """Jupyter calls sync ``invoke`` from the loop's thread: it still works."""
    chat = ChatDFlash2(model=model, max_new_tokens=10)
    expected = chat.invoke(LC_MESSAGES).content

    async def inside() -> tuple[str, str]:
        whole = str(chat.invoke(LC_MESSAGES).content)
        streamed = "".join(str(c.content) for c in chat.stream(LC_MESSAGES))
        return whole, streamed

    assert asyncio.run(inside()) == (expected, expected)
