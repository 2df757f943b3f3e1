"""``ChatDFlash2``: a LangChain chat model running in-process on a loaded :class:`dflash2.Model`.

``invoke`` / ``ainvoke`` / ``stream`` / ``astream`` (and everything LangChain builds on them:
agents, chains, ``batch``) generate through the model's streams, so concurrent calls share its
target forwards. Messages map onto the chat template's roles (system, user, assistant, tool);
``stop`` and the sampling options map onto the SDK's; every answer carries ``usage_metadata``
(exact token counts) and the stream's statistics in ``response_metadata["dflash2"]``. Install
with the ``langchain`` extra.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from dflash2.api import Model, inside_event_loop
from dflash2.errors import InvalidPromptError
from dflash2.stream import Completion, Stats

T = TypeVar("T")
_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}


class ChatDFlash2(BaseChatModel):
    """A chat model over ``model``; the generation options are fields (overridable per call)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: Model
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def _llm_type(self) -> str:
        return "dflash2"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": str(self.model.checkpoint), **self._options({})}

    def _options(self, kwargs: dict[str, Any], stop: Sequence[str] | None = None) -> dict[str, Any]:
        options: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                   "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}  # fmt: skip
        options.update(kwargs)
        if stop:
            options["stop"] = list(stop)
        return options

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        options = self._options(kwargs, stop)
        done = _outside_loop(lambda: self.model.generate(to_prompt(messages), **options))
        return _result(done)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _result(await self.model.agenerate(to_prompt(messages), **self._options(kwargs, stop)))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt, options = to_prompt(messages), self._options(kwargs, stop)
        for chunk in _iterate_outside_loop(lambda: self._chunks_sync(prompt, options)):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunks_sync(self, prompt: Any, options: dict[str, Any]) -> Iterator[ChatGenerationChunk]:
        stream = self.model.stream_sync(prompt, **options)
        with stream:
            for token in stream:
                if token.text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=token.text))
        yield _last_chunk(stream.completion)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async with self.model.stream(to_prompt(messages), **self._options(kwargs, stop)) as stream:
            async for token in stream:
                if token.text:
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=token.text))
                    if run_manager:
                        await run_manager.on_llm_new_token(token.text, chunk=chunk)
                    yield chunk
        yield _last_chunk(stream.completion)


def to_prompt(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the chat template's ``{"role", "content"}`` dicts (text content only)."""
    out = []
    for message in messages:
        role = _ROLES.get(message.type)
        if role is None:
            why = f"a {message.type!r} message has no chat-template role (use system / human / ai / tool messages)."
            raise InvalidPromptError(why)
        out.append({"role": role, "content": message.text})
    return out


def _usage(stats: Stats) -> UsageMetadata:
    counts = {"input_tokens": stats.prompt_tokens, "output_tokens": stats.new_tokens,
              "total_tokens": stats.prompt_tokens + stats.new_tokens}  # fmt: skip
    return cast(UsageMetadata, counts)


def _metadata(done: Completion) -> dict[str, Any]:
    s = done.stats
    return {"finish_reason": done.finish_reason, "model_name": "dflash2",
            "dflash2": {"steps": s.steps, "mean_acceptance_length": s.mean_acceptance_length,
                        "tokens_per_second": s.tokens_per_second, "mean_batch_size": s.mean_batch_size}}  # fmt: skip


def _result(done: Completion) -> ChatResult:
    message = AIMessage(content=done.text, usage_metadata=_usage(done.stats), response_metadata=_metadata(done))
    return ChatResult(generations=[ChatGeneration(message=message)])


def _last_chunk(done: Completion) -> ChatGenerationChunk:
    """The closing chunk: no text, the usage and the finish reason (LangChain adds chunks up)."""
    message = AIMessageChunk(content="", usage_metadata=_usage(done.stats), response_metadata=_metadata(done))
    return ChatGenerationChunk(message=message)


def _outside_loop(work: Callable[[], T]) -> T:
    """Run blocking ``work`` here, or in a helper thread when this thread runs an event loop (Jupyter, trio)."""
    if not inside_event_loop():
        return work()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, work()))
        except BaseException as err:  # handed to the caller
            box.append((False, err))

    thread = threading.Thread(target=run, name="dflash2-langchain")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _iterate_outside_loop(make: Callable[[], Iterator[T]]) -> Iterator[T]:
    """Iterate ``make()`` here, or in a helper thread (items passed through a queue) inside an event loop."""
    if not inside_event_loop():
        yield from make()
        return
    items: queue.Queue[tuple[str, Any]] = queue.Queue()  # unbounded: the producer never blocks
    stop = threading.Event()

    def run() -> None:
        try:
            for item in make():
                if stop.is_set():
                    break
                items.put(("item", item))
            items.put(("end", None))
        except BaseException as err:  # handed to the caller
            items.put(("error", err))

    thread = threading.Thread(target=run, name="dflash2-langchain", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = items.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
