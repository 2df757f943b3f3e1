"""Prompts to token ids, and token ids back to text deltas that never split a character.

``IncrementalDetokenizer`` decodes a window of recent ids and releases text only once it no
longer ends in an incomplete UTF-8 sequence (U+FFFD). ``StopMatcher`` holds back any tail that
could still grow into a stop string and cuts the text where a stop string appears.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from dflash2.errors import InvalidPromptError

Prompt = str | Sequence[Mapping[str, str]]
_REPLACEMENT = "\ufffd"


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Any) -> list[int]:
    """A ``str`` is raw text; a list of ``{"role", "content"}`` dicts gets the chat template."""
    if isinstance(prompt, str):
        ids: list[int] = list(tokenizer(prompt).input_ids)
    elif isinstance(prompt, (list, tuple)):
        ids = _encode_messages(tokenizer, prompt)
    else:
        raise InvalidPromptError(
            f"prompt must be a str or a list of {{'role': ..., 'content': ...}} dicts, not {type(prompt).__name__}."
        )
    if not ids:
        raise InvalidPromptError("the prompt encodes to zero tokens; pass some text.")
    return ids


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two token sequences, at most ``limit``."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if n <= 0:
        return 0
    differ = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def _encode_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Any]) -> list[int]:
    if not messages:
        raise InvalidPromptError("the message list is empty; pass at least one {'role': 'user', 'content': ...}.")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise InvalidPromptError(f"message {i} must be a dict with string 'role' and 'content', got {message!r}.")
    if not tokenizer.chat_template:
        raise InvalidPromptError("this tokenizer has no chat template; pass the prompt as a plain string instead.")
    encoded = cast(
        Mapping[str, list[int]],
        tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=True
        ),
    )
    return list(encoded["input_ids"])


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas (special tokens skipped)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window (gives context for leading spaces)
        self._read = 0  # ids before this index have been released as text

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        """Add one id; return the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :] if len(text) > len(done) else ""


class StopMatcher:
    """Cuts text at the first stop string; holds back a tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Feed a text delta; return the part that is safe to release (nothing after a stop)."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return buffer[:cut]
        keep = max((_overlap(buffer, s) for s in self._stops), default=0)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
