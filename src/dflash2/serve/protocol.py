"""The OpenAI wire format: requests checked and mapped onto ``Model.stream`` options, responses built.

Pure functions, no HTTP: :func:`parse_chat` / :func:`parse_completion` turn a JSON body into a
:class:`Job` or raise :class:`APIError` (an OpenAI-shaped 4xx); the ``*_response`` / ``*_chunk``
functions build the bodies. Options the SDK does not implement are refused by name, never
ignored; fields that do not change the output (``user``, ``metadata``, ``store``) are accepted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash2.errors import InvalidOptionError
from dflash2.stream import Stats

# fields that do not change what is generated
_HARMLESS = ("user", "metadata", "store", "service_tier")
# fields refused unless they hold the value that changes nothing
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logprobs": False,
    "top_logprobs": None,
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "parallel_tool_calls": None,
    "response_format": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "n": 1,
    "modalities": None,
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the server allows: the ``max_tokens`` cap (also the default), the body size, and
    whether a request must name the served model (``strict_model_name``; by default any name is
    served by the one model, as clients that send a fixed name such as ``gpt-4o-mini`` expect)."""

    max_tokens: int = 1024
    max_body_bytes: int = 1 << 20
    strict_model_name: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive int, got {value!r}.")
        if not isinstance(self.strict_model_name, bool):
            raise InvalidOptionError(f"strict_model_name must be a bool, got {self.strict_model_name!r}.")


@dataclass(frozen=True)
class Job:
    """A checked request: the prompt (text or messages), the SDK options, and how to answer."""

    prompt: str | list[dict[str, str]]
    options: dict[str, Any]
    stream: bool
    include_usage: bool
    chat: bool
    model: str
    id: str = field(default_factory=lambda: f"{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse_chat(body: Any, served: str, limits: Limits) -> Job:
    """A ``/v1/chat/completions`` body."""
    body = _object(body)
    _known(body, ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                  "stream", "stream_options"))  # fmt: skip
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    return _job(body, served, limits, parsed, chat=True)


def parse_completion(body: Any, served: str, limits: Limits) -> Job:
    """A ``/v1/completions`` body (one prompt string)."""
    body = _object(body)
    _known(body, ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "'prompt' must be one non-empty string (batches of prompts are not supported).", "prompt")
    if "max_tokens" not in body:
        body = {**body, "max_tokens": min(16, limits.max_tokens)}  # OpenAI's default for completions
    return _job(body, served, limits, prompt, chat=False)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object.")
    return body


_COUNTS = ("n", "best_of")  # integers: 1.0 or true are not a count
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system


def _known(body: Mapping[str, Any], accepted: tuple[str, ...]) -> None:
    for key, value in body.items():
        if key in accepted or key in _HARMLESS:
            continue
        if key in _NEUTRAL:
            if _neutral(key, value):
                continue
            raise APIError(400, f"'{key}' is not supported by dflash2 serve (only {_NEUTRAL[key]!r}).", key,
                           "unsupported_parameter")  # fmt: skip
        raise APIError(400, f"unrecognized request argument supplied: {key}", key, "unrecognized_argument")


def _neutral(key: str, value: Any) -> bool:
    """Whether ``value`` is the value of ``key`` that changes nothing, of the type OpenAI takes for it
    (``n: true`` or ``n: 1.0`` is not ``n: 1``, ``tools: []`` is not an absent tool list)."""
    neutral = _NEUTRAL[key]
    if value is None:
        return True
    if key == "logit_bias":
        return value == {}
    if isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, int) and not isinstance(value, bool):
        kinds: tuple[type, ...] = (int,) if key in _COUNTS else (int, float)
        return isinstance(value, kinds) and value == neutral
    return False


def _message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"{where} must be an object with a string 'role'.", where)
    role = message["role"]
    if role not in ROLES:
        tools = " (dflash2 serve has no tool calling)" if role in ("tool", "function") else ""
        raise APIError(400, f"{where}.role is {role!r}; it must be one of {', '.join(ROLES)}{tools}.", f"{where}.role")
    for key, value in message.items():  # name, tool_calls, ... would change the prompt: never dropped
        if key not in ("role", "content") and value is not None:
            raise APIError(400, f"{where}.{key} is not supported by dflash2 serve.", f"{where}.{key}",
                           "unsupported_parameter")  # fmt: skip
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f"{where}.content: only text parts are supported.", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts.", f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _job(body: Mapping[str, Any], served: str, limits: Limits, prompt: Any, chat: bool) -> Job:
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required.", "model")
    if model != served and limits.strict_model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served}'.", "model",
                       "model_not_found")  # fmt: skip
    options: dict[str, Any] = {"max_new_tokens": _max_tokens(body, limits)}
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    options["temperature"] = temperature
    options["top_p"] = _number(body, "top_p", 0.0, 1.0, 1.0)
    if options["top_p"] == 0.0:
        raise APIError(400, "'top_p' must be greater than 0.", "top_p")
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise APIError(400, "'seed' must be an integer.", "seed")
        options["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings.", "stop")
        options["stop"] = stops
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean.", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise APIError(400, "'stream_options' supports only include_usage.", "stream_options")
    if stream_options and not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true.", "stream_options")
    return Job(prompt, options, stream, bool(stream_options.get("include_usage", False)), chat, served)


def _max_tokens(body: Mapping[str, Any], limits: Limits) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return limits.max_tokens
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise APIError(400, f"'{name}' must be a positive integer.", name)
    if value > limits.max_tokens:
        raise APIError(400, f"'{name}' is {value}; this server allows at most {limits.max_tokens}.", name)
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise APIError(400, f"'{name}' must be a number in [{low:g}, {high:g}].", name)
    return float(value)


def finish_reason(reason: str) -> str:
    """The SDK's finish reason as OpenAI names it (EOS and stop strings are both 'stop')."""
    return "length" if reason == "length" else "stop"


def usage(stats: Stats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def extension(stats: Stats) -> dict[str, Any]:
    """The ``dflash2`` field: the stream's speculative-decoding statistics."""
    return {
        "steps": stats.steps,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "mean_batch_size": round(stats.mean_batch_size, 4),
        "time_to_first_token_s": round(stats.time_to_first_token_s, 6),
        "decode_s": round(stats.decode_s, 6),
        "tokens_per_second": round(stats.tokens_per_second, 3),
        "draft_s": round(stats.draft_s, 6),
        "verify_s": round(stats.verify_s, 6),
    }


def response(job: Job, text: str, reason: str, stats: Stats) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    if job.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = finish_reason(reason)
    return {
        "id": _id(job), "object": kind, "created": job.created, "model": job.model, "choices": [choice],
        "usage": usage(stats), "dflash2": extension(stats),
    }  # fmt: skip


def chunk(job: Job, text: str | None, reason: str | None = None, first: bool = False) -> dict[str, Any]:
    """One streamed event: a text delta, or (``reason`` set) the last one with the finish reason."""
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = finish_reason(reason) if reason is not None else None
    return {"id": _id(job), "object": kind, "created": job.created, "model": job.model, "choices": [choice]}


def usage_chunk(job: Job, stats: Stats) -> dict[str, Any]:
    """The last event of a stream with ``include_usage``: no choices, the usage and the statistics."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    return {
        "id": _id(job), "object": kind, "created": job.created, "model": job.model, "choices": [],
        "usage": usage(stats), "dflash2": extension(stats),
    }  # fmt: skip


def _id(job: Job) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + job.id
