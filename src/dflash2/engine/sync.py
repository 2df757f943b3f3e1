"""The synchronous reference loop: draft -> verify -> accept, one step per call.

It is the oracle the asynchronous pipeline is tested against, so it stays small:

    prefill   target(prompt)                       -> first token, prompt features
    draft     session.propose(k)                   -> d_1 .. d_k   (maybe none)
    verify    target([x, d_1 .. d_k])               -> logits, features; k + 1 cache slots
    accept    verify.accept(...)                    -> a kept, next token n
    rollback  cache.rollback(start + a + 1)         keeps x, d_1 .. d_a
    emit      d_1 .. d_a, n;  session.observe(a, n, features of x, d_1 .. d_a)

Without a drafter every draft is empty and each step is plain decoding. Compute runs in a
worker thread, so the event loop stays free.
"""

from __future__ import annotations

import time

import torch

from dflash2.config import GenerationConfig, SamplingConfig
from dflash2.drafters.base import Draft, DraftContext, Drafter, DraftSession, Outcome
from dflash2.runtime.device import run_in_worker
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import Decoder
from dflash2.sampling import choose, make_generator
from dflash2.stream import EngineCounters
from dflash2.verify import accept


def padded_size(rows: int, packed: tuple[int, ...], room: int) -> int:
    """Forward size for a ``rows``-token block: the next pre-packed size when that is cheaper.

    On CPU a packed GEMM over a few extra rows beats the unpacked one (SmolLM2-135M: 5 tokens
    81 ms unpacked, 8 tokens 55 ms packed), so blocks are padded up to at most twice their size.
    """
    fits = [p for p in packed if rows <= p <= min(2 * rows, room)]
    return min(fits) if fits else rows


class SyncPipeline:
    """One request on ``target`` (and ``drafter``); owns its caches, ``aclose`` frees them."""

    def __init__(
        self,
        target: Decoder,
        prompt_ids: list[int],
        config: GenerationConfig,
        sampling: SamplingConfig,
        drafter: Drafter | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.counters = EngineCounters()
        self._prompt = prompt_ids
        self._sampling = sampling
        self._generator = make_generator(sampling, target.device)
        self._max_new = config.max_new_tokens
        block = drafter.block_size if drafter is not None else 1
        self._capacity = len(prompt_ids) + config.max_new_tokens + block
        self._capture = tuple(drafter.capture_layers) if drafter is not None else ()
        self._cache: KVCache | None = None
        self._session: DraftSession | None = None
        self._last = -1  # the last emitted token, not yet in the target's cache
        self._verified = 0
        self._generated = 0
        self._closed = False

    async def next_ids(self) -> list[int]:
        return await run_in_worker(self._prefill if self._cache is None else self._step)

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            self._session.close()
        self._session, self._cache = None, None

    # ------------------------------------------------------------ phases
    def _prefill(self) -> list[int]:
        self._cache = self.target.new_cache(self._capacity)
        ids = torch.tensor([self._prompt], device=self.target.device)
        out = self.target(ids, self._cache, logits="last", capture=self._capture)
        assert out.logits is not None
        self._last = int(choose(out.logits[0, -1], self._sampling, self._generator))
        self._generated = 1
        self._verified = len(self._prompt)  # tokens in the target's cache that stay there
        if self.drafter is not None:
            start = time.perf_counter()
            self._session = self.drafter.start(
                DraftContext(
                    prompt_ids=self._prompt,
                    first_token=self._last,
                    prompt_hidden=out.hidden[0] if out.hidden is not None else None,
                    sampling=self._sampling,
                    generator=self._generator,
                    max_tokens=self._capacity,
                )
            )
            self.counters.draft_s += time.perf_counter() - start
        return [self._last]

    def _step(self) -> list[int]:
        if self._closed:
            return []
        draft = self._draft(self._max_new - self._generated - 1)
        logits, hidden = self._verify(draft)
        start = time.perf_counter()
        accepted, token = accept(draft.tokens, draft.probs, logits, self._sampling, self._generator)
        emitted = [int(t) for t in draft.tokens[:accepted]] + [token]
        assert self._cache is not None
        self._cache.rollback(self._verified + accepted + 1)
        self._verified += accepted + 1
        if self._session is not None:
            kept = hidden[: accepted + 1] if hidden is not None else None
            self._session.observe(Outcome(accepted, token, kept))
        self._last = token
        self._generated += len(emitted)
        self.counters.steps += 1
        self.counters.acceptance_lengths.append(len(emitted))
        self.counters.verify_s += time.perf_counter() - start
        return emitted

    def _draft(self, room: int) -> Draft:
        if self._session is None or room <= 0:
            return Draft(torch.zeros(0, dtype=torch.long, device=self.target.device))
        start = time.perf_counter()
        draft = self._session.propose(room)
        self.counters.draft_s += time.perf_counter() - start
        tokens = draft.tokens.to(self.target.device)
        return Draft(tokens, draft.probs)

    def _verify(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over ``[last, draft...]``: logits [k + 1, vocab], features [k + 1, F]."""
        assert self._cache is not None
        start = time.perf_counter()
        block = torch.cat([torch.tensor([self._last], device=self.target.device), draft.tokens])
        used = block.shape[0]
        room = min(self._cache.capacity, self.target.spec.max_position_embeddings) - self._cache.length
        size = padded_size(used, self.target.packed_rows, room)
        if size > used:  # filler rows after the block change nothing before them (causal)
            block = torch.cat([block, block[-1:].expand(size - used)])
        out = self.target(block[None], self._cache, logits="all", capture=self._capture)
        assert out.logits is not None
        self.counters.verify_s += time.perf_counter() - start
        hidden = out.hidden[0, :used] if out.hidden is not None else None
        return out.logits[0, :used], hidden
