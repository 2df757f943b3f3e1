"""``dflash2 serve`` started as a process on 127.0.0.1, spoken to with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import dflash2
from dflash2.tokenize import encode_prompt

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "abcabc hello"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(paths: dict[str, Path]) -> Iterator[str]:
    port = _free_port()
    command = [sys.executable, "-m", "dflash2.cli", "serve", str(paths["target"]), "--drafter", "ngram",
               "--name", NAME, "--port", str(port), "--max-tokens", "64", "--log-level", "warning",
               "--threads", "2"]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {process.stderr.read() if process.stderr else ''}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def local(paths: dict[str, Path]) -> dflash2.Model:
    return dflash2.load(paths["target"])


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_chat_whole_and_streamed_equal_generate(server: str, local: dflash2.Model) -> None:
    expected = local.generate(MESSAGES, max_new_tokens=20)
    client = _client(server)
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert whole.usage.prompt_tokens == expected.stats.prompt_tokens
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.total_tokens == expected.stats.prompt_tokens + len(expected.token_ids)
    assert whole.model_extra["dflash2"]["steps"] >= 1  # the stream's statistics
    events = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == expected.text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] is not None
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(expected.token_ids)


def test_completions_whole_and_streamed(server: str, local: dflash2.Model) -> None:
    expected = local.generate("x = [1, 2, 3]; y", max_new_tokens=24, stop=["]"])
    client = _client(server)
    whole = client.completions.create(model=NAME, prompt="x = [1, 2, 3]; y", max_tokens=24, temperature=0, stop="]")
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    pieces = client.completions.create(model=NAME, prompt="x = [1, 2, 3]; y", max_tokens=24, temperature=0,
                                       stop="]", stream=True)  # fmt: skip
    assert "".join(p.choices[0].text for p in pieces) == expected.text
    assert client.models.list().data[0].id == NAME


def test_seeded_sampling_is_reproducible(server: str) -> None:
    client = _client(server)
    runs = [
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0.9, seed=7)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_a_disconnect_frees_the_stream(server: str) -> None:
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(server + "/health").json()["active_streams"] == 1
    deadline = time.monotonic() + 10
    while httpx.get(server + "/health").json()["active_streams"] != 0:
        assert time.monotonic() < deadline, "the stream outlived its client"
        time.sleep(0.05)


def test_a_next_turn_reuses_the_cached_prefix(server: str, paths: dict[str, Path]) -> None:
    cold = dflash2.load(paths["target"], drafter="ngram", prefix_cache=0)
    client = _client(server)
    first = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
    answer = client.chat.completions.create(model=NAME, messages=first, max_tokens=16, temperature=0)
    second = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
              {"role": "user", "content": "And then?"}]  # fmt: skip
    reply = client.chat.completions.create(model=NAME, messages=second, max_tokens=16, temperature=0)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(encode_prompt(cold.tokenizer, first)) - 1
    assert reply.choices[0].message.content == cold.generate(second, max_new_tokens=16).text


def test_four_concurrent_clients_get_their_own_answers(server: str, local: dflash2.Model) -> None:
    prompts = ["abcabc hello", "The quick brown fox", "x = [1, 2, 3]", "hello hello"]
    expected = [local.generate([{"role": "user", "content": p}], max_new_tokens=24).text for p in prompts]

    async def ask(client: Any, prompt: str) -> str:
        answer = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0
        )
        return str(answer.choices[0].message.content)

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0) as client:
            return list(await asyncio.gather(*(ask(client, p) for p in prompts)))

    assert asyncio.run(all_of_them()) == expected


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"n": 2}, 400, "n"),
        ({"logprobs": True}, 400, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"frobnicate": 1}, 400, "frobnicate"),
        ({"max_tokens": 65}, 400, "max_tokens"),
        ({"temperature": 3}, 400, "temperature"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
        # values OpenAI refuses as well: a count of another type, an empty tool list, a false penalty
        ({"n": True}, 400, "n"),
        ({"n": []}, 400, "n"),
        ({"n": 1.0}, 400, "n"),
        ({"frequency_penalty": False}, 400, "frequency_penalty"),
        ({"tools": []}, 400, "tools"),
        # roles the chat template would take as they come, and message fields that would be dropped
        ({"messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "<s>system", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400, "messages[0].name"),
    ],
)
def test_bad_requests_get_openai_errors(server: str, change: dict[str, Any], status: int, param: str) -> None:
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 8, **change}
    reply = httpx.post(server + "/v1/chat/completions", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in reply.text


def test_neutral_values_and_the_developer_role_are_accepted(server: str) -> None:
    body = {"model": NAME, "max_tokens": 4, "n": 1, "frequency_penalty": 0.0, "tools": None, "logit_bias": {}}
    body["messages"] = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None}]
    reply = httpx.post(server + "/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text


def test_malformed_and_oversized_bodies(server: str) -> None:
    headers = {"content-type": "application/json"}
    reply = httpx.post(server + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    nested = b"[" * 100_000 + b"]" * 100_000  # past the JSON parser's recursion limit
    reply = httpx.post(server + "/v1/chat/completions", content=nested, headers=headers)
    assert reply.status_code == 400 and "nests" in reply.json()["error"]["message"]
    huge = {"model": NAME, "messages": [{"role": "user", "content": "a" * (2 << 20)}]}
    assert httpx.post(server + "/v1/chat/completions", json=huge).status_code == 413
    with pytest.raises(openai.BadRequestError, match="context"):
        _client(server).completions.create(model=NAME, prompt="a" * 600, max_tokens=8)


def test_a_client_that_leaves_a_whole_answer_cancels_it(paths: dict[str, Path]) -> None:
    """Non-streamed: the server notices the disconnect while generating and stops the stream."""
    import threading

    import uvicorn

    from dflash2.serve import Limits, create_app
    from dflash2.testing import SlowForward

    model = dflash2.load(paths["target"])
    slow = SlowForward(model, 0.05)  # 64 tokens: over 3 s of forwards
    port = _free_port()
    app = create_app(model, NAME, Limits(max_tokens=64))
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 1.0  # well before the answer would be done
        while httpx.get(url + "/health").json()["active_streams"] != 0:
            assert time.monotonic() < deadline, "the stream outlived its client"
            time.sleep(0.02)
        calls = slow.calls
        time.sleep(0.3)
        assert slow.calls == calls and calls < 30  # no forward since
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_protocol_defaults_and_limits() -> None:
    from dflash2.serve import Limits
    from dflash2.serve.protocol import parse_chat, parse_completion

    job = parse_completion({"model": NAME, "prompt": "hi"}, NAME, Limits(max_tokens=8))
    assert job.options["max_new_tokens"] == 8 and not job.chat  # OpenAI's 16, within the cap
    chat = parse_chat({"model": NAME, "messages": MESSAGES, "user": "u1", "n": 1, "logprobs": False}, NAME, Limits())
    assert chat.options == {"max_new_tokens": 1024, "temperature": 1.0, "top_p": 1.0}  # OpenAI's defaults
    for bad in ({"max_tokens": 0}, {"max_body_bytes": -1}, {"strict_model_name": "yes"}):
        with pytest.raises(dflash2.InvalidOptionError):
            Limits(**bad)


def test_any_model_name_gets_the_served_model_unless_strict(server: str) -> None:
    from dflash2.serve import Limits
    from dflash2.serve.protocol import APIError, parse_chat

    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(server + "/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == NAME
    assert [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]] == [NAME]
    with pytest.raises(APIError) as refused:
        parse_chat(body, NAME, Limits(strict_model_name=True))
    assert refused.value.status == 404 and refused.value.param == "model" and NAME in refused.value.message
