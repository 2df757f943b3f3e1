"""Model-free prompt lookup: continue the text the way it continued last time.

The last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up in the prompt and
the text generated so far; the tokens that followed their most recent earlier occurrence are
the draft. An index of every n-gram's latest position is kept up to date per token, so a lookup
costs a few dict probes. The block length adapts to the recent hit rate, and when nothing matches
no draft is proposed (the step is a plain one-token forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.drafters.base import Draft, DraftContext, Outcome
from dflash2.errors import InvalidOptionError


@dataclass(frozen=True)
class NGramDrafter:
    """Prompt-lookup drafter; ``block_size`` counts the verified token plus the drafts."""

    block_size: int = 10
    max_ngram: int = 3
    min_ngram: int = 1
    adaptive: bool = True
    name: str = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 2 <= self.block_size <= 64:
            raise InvalidOptionError(f"block_size must be an int in [2, 64], got {self.block_size!r}.")
        if not isinstance(self.min_ngram, int) or not isinstance(self.max_ngram, int):
            raise InvalidOptionError("min_ngram and max_ngram must be ints.")
        if not 1 <= self.min_ngram <= self.max_ngram <= 8:
            raise InvalidOptionError(
                f"need 1 <= min_ngram <= max_ngram <= 8, got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}."
            )

    def start(self, context: DraftContext) -> NGramSession:
        return NGramSession(self, [*context.prompt_ids, context.first_token])


class NGramSession:
    def __init__(self, drafter: NGramDrafter, tokens: list[int]) -> None:
        self._d = drafter
        self._tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest end
        self._previous: dict[tuple[int, ...], int] = {}  # the occurrence before the latest
        self._limit = drafter.block_size - 1
        self._proposed: list[int] = []
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        self._tokens.append(token)
        end = len(self._tokens)
        for n in range(self._d.min_ngram, self._d.max_ngram + 1):
            if end >= n:
                key = tuple(self._tokens[end - n :])
                if key in self._latest:
                    self._previous[key] = self._latest[key]
                self._latest[key] = end

    def _lookup(self) -> int | None:
        """Index where the continuation of the current suffix's previous occurrence starts."""
        end = len(self._tokens)
        for n in range(self._d.max_ngram, self._d.min_ngram - 1, -1):
            if end < n:
                continue
            key = tuple(self._tokens[end - n :])
            # the latest occurrence of the suffix is the suffix itself; use the one before
            where = self._previous.get(key)
            if where is not None and where < end:
                return where
        return None

    def finds(self) -> bool:
        """Whether the current suffix occurred before (a proposal would draft something)."""
        return self._lookup() is not None

    def propose(self, max_tokens: int) -> Draft:
        limit = min(self._limit, max_tokens)
        where = self._lookup() if limit > 0 else None
        proposed: list[int] = []
        if where is not None:
            # copy what followed the match; a continuation that runs into the present copies
            # its own start again (as LZ77 does), which extends periodic text
            end = len(self._tokens)
            for i in range(where, where + limit):
                proposed.append(self._tokens[i] if i < end else proposed[i - end])
        self._proposed = proposed
        return Draft(torch.tensor(proposed, dtype=torch.long))

    def observe(self, outcome: Outcome) -> None:
        for token in outcome.tokens:
            self._append(token)
        self._append(outcome.next_token)
        if self._d.adaptive and self._proposed:
            if outcome.accepted == len(self._proposed):
                self._limit = min(self._d.block_size - 1, self._limit * 2)
            elif outcome.accepted < len(self._proposed) // 2:
                self._limit = max(1, self._limit // 2)
        self._proposed = []

    def close(self) -> None:
        self._tokens.clear()
        self._latest.clear()
        self._previous.clear()
