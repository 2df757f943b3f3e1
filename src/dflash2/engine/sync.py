"""The synchronous reference loop, one target forward per step, compute in a worker thread."""

from __future__ import annotations

import time

import torch

from dflash2.config import GenerationConfig, SamplingConfig
from dflash2.runtime.device import run_in_worker
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import Decoder
from dflash2.sampling import choose, make_generator
from dflash2.stream import EngineCounters


class SyncPipeline:
    """Prefill, then decode: each ``next_ids`` call is one target forward.

    Owns the request's KV cache; ``aclose`` frees it.
    """

    def __init__(
        self, target: Decoder, prompt_ids: list[int], config: GenerationConfig, sampling: SamplingConfig
    ) -> None:
        self.target = target
        self.counters = EngineCounters()
        self._prompt = prompt_ids
        self._sampling = sampling
        self._generator = make_generator(sampling, target.device)
        self._capacity = len(prompt_ids) + config.max_new_tokens
        self._cache: KVCache | None = None
        self._last: int | None = None

    async def next_ids(self) -> list[int]:
        return await run_in_worker(self._prefill if self._cache is None else self._decode)

    async def aclose(self) -> None:
        self._cache = None

    def _choose(self, logits: torch.Tensor) -> int:
        return int(choose(logits, self._sampling, self._generator).item())

    def _prefill(self) -> list[int]:
        self._cache = self.target.new_cache(self._capacity)
        ids = torch.tensor([self._prompt], device=self.target.device)
        logits = self.target(ids, self._cache, logits="last").logits
        assert logits is not None
        self._last = self._choose(logits[0, -1])
        return [self._last]

    def _decode(self) -> list[int]:
        assert self._cache is not None and self._last is not None
        start = time.perf_counter()
        ids = torch.tensor([[self._last]], device=self.target.device)
        logits = self.target(ids, self._cache, logits="last").logits
        assert logits is not None
        self._last = self._choose(logits[0, -1])
        self.counters.steps += 1
        self.counters.acceptance_lengths.append(1)
        self.counters.verify_s += time.perf_counter() - start
        return [self._last]
