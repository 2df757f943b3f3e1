"""A small causal LM with the target's tokenizer drafts k tokens one at a time.

It runs on the same runtime as the target, with its own KV cache per request. Under sampling
each draft token is sampled from the drafter's distribution after the request's temperature /
top-k / top-p transform, and that distribution travels with the draft for lossless acceptance.
"""

from __future__ import annotations

import torch

from dflash2.drafters.base import Draft, DraftContext, Outcome
from dflash2.errors import InvalidOptionError
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import Decoder
from dflash2.sampling import probabilities, sample


class AutoregressiveDrafter:
    """Drafts ``block_size - 1`` tokens per step with ``model`` (shares no weights with the target)."""

    capture_layers: tuple[int, ...] = ()
    default_block_size = 6

    def __init__(
        self, model: Decoder, target_vocab_size: int, block_size: int = default_block_size, name: str = "autoregressive"
    ) -> None:
        if not isinstance(block_size, int) or not 2 <= block_size <= 64:
            raise InvalidOptionError(f"block_size must be an int in [2, 64], got {block_size!r}.")
        self.model = model
        self.block_size = block_size
        self.name = name
        self.target_vocab_size = target_vocab_size
        model.pack([1])

    def start(self, context: DraftContext) -> AutoregressiveSession:
        return AutoregressiveSession(self, context)


class AutoregressiveSession:
    def __init__(self, drafter: AutoregressiveDrafter, context: DraftContext) -> None:
        self._d = drafter
        self._model = drafter.model
        self._sampling = context.sampling
        self._generator = context.generator
        self._cache: KVCache | None = self._model.new_cache(context.max_tokens + drafter.block_size)
        # Tokens the draft model has not processed yet; the last one is the last verified token.
        self._pending: list[int] = [*context.prompt_ids, context.first_token]
        self._proposed: list[int] = []

    def _step_logits(self, tokens: list[int]) -> torch.Tensor:
        assert self._cache is not None
        ids = torch.tensor([tokens], device=self._model.device)
        logits = self._model(ids, self._cache, logits="last").logits
        assert logits is not None
        return self._fit_vocab(logits[0, -1])

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Restrict (or pad) the drafter's logits to the target's vocabulary size."""
        vocab = self._d.target_vocab_size
        if logits.shape[-1] > vocab:
            return logits[..., :vocab]
        if logits.shape[-1] < vocab:
            pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def propose(self, max_tokens: int) -> Draft:
        k = min(self._d.block_size - 1, max_tokens)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        feed = self._pending
        for _ in range(k):
            logits = self._step_logits(feed)
            if self._sampling.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits, self._sampling)
                token = int(sample(q, self._generator))
                rows.append(q)
            tokens.append(token)
            feed = [token]
        # the draft model has processed pending + tokens[:-1]; the last draft token is not cached
        self._pending = tokens[-1:] if tokens else self._pending
        self._proposed = tokens
        probs = torch.stack(rows) if rows else None
        return Draft(torch.tensor(tokens, dtype=torch.long), probs)

    def observe(self, outcome: Outcome) -> None:
        assert self._cache is not None
        k, a = len(self._proposed), outcome.accepted
        if k == 0:
            self._pending = [*self._pending, outcome.next_token]
            return
        if a == k:
            # everything was accepted: the last draft token still has to be processed
            self._pending = [self._proposed[-1], outcome.next_token]
        else:
            # cached: ..., d_1 .. d_{k-1}; keep d_1 .. d_a, drop the rejected rest
            self._cache.rollback(self._cache.length - (k - 1 - a))
            self._pending = [outcome.next_token]
        self._proposed = []

    def close(self) -> None:
        self._cache = None
