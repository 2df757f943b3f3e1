"""One request's state and its phases, shared by the sync loop and the async pipeline.

Every phase is a plain synchronous function run inside a compute worker:

    prefill   target(prompt)                       -> first token, prompt features
    propose   session.propose(k)                   -> d_1 .. d_k   (maybe none)
    verify    target([x, d_1 .. d_k])               -> logits, features; k + 1 cache slots
    settle    verify.accept(...)                    -> a kept, next token n;
              cache.rollback(keeps x, d_1 .. d_a);  session.observe(a, n, features)

The engines only decide what runs when (and what runs at the same time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash2.config import GenerationConfig, SamplingConfig
from dflash2.drafters.base import Draft, DraftContext, Drafter, DraftSession, Outcome
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import Decoder
from dflash2.sampling import choose, make_generator
from dflash2.stream import EngineCounters
from dflash2.verify import accept


@dataclass(frozen=True)
class Verified:
    """Target output for a verified block: logits [k + 1, vocab], features [k + 1, F] or None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None


class Request:
    """A prompt being generated on ``target`` (with ``drafter``); owns its caches."""

    def __init__(
        self,
        target: Decoder,
        prompt_ids: list[int],
        config: GenerationConfig,
        sampling: SamplingConfig,
        drafter: Drafter | None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.counters = EngineCounters()
        self.prompt = prompt_ids
        self.sampling = sampling
        self.generator = make_generator(sampling, target.device)
        self.max_new = config.max_new_tokens
        block = drafter.block_size if drafter is not None else 1
        self.capacity = len(prompt_ids) + config.max_new_tokens + block
        self.capture = tuple(drafter.capture_layers) if drafter is not None else ()
        self.cache: KVCache | None = None
        self.session: DraftSession | None = None
        self.last = -1  # the last emitted token, not yet in the target's cache
        self.verified = 0  # tokens in the target's cache that stay there
        self.generated = 0
        self.closed = False

    @property
    def started(self) -> bool:
        return self.cache is not None

    @property
    def room(self) -> int:
        """Draft tokens that still fit: a step emits its drafts plus one."""
        return self.max_new - self.generated - 1

    def close(self) -> None:
        self.closed = True
        if self.session is not None:
            self.session.close()
        self.session, self.cache = None, None

    def prefill(self) -> list[int]:
        self.cache = self.target.new_cache(self.capacity)
        ids = torch.tensor([self.prompt], device=self.target.device)
        out = self.target(ids, self.cache, logits="last", capture=self.capture)
        assert out.logits is not None
        self.last = int(choose(out.logits[0, -1], self.sampling, self.generator))
        self.generated, self.verified = 1, len(self.prompt)
        if self.drafter is not None:
            start = time.perf_counter()
            self.session = self.drafter.start(
                DraftContext(
                    prompt_ids=self.prompt,
                    first_token=self.last,
                    prompt_hidden=out.hidden[0] if out.hidden is not None else None,
                    sampling=self.sampling,
                    generator=make_generator(self.sampling, self.target.device, offset=1),
                    max_tokens=self.capacity,
                )
            )
            self.counters.draft_s += time.perf_counter() - start
        return [self.last]

    def propose(self) -> Draft:
        if self.session is None or self.room <= 0 or self.closed:
            return Draft(torch.zeros(0, dtype=torch.long, device=self.target.device))
        start = time.perf_counter()
        draft = self.session.propose(self.room)
        self.counters.draft_s += time.perf_counter() - start
        return Draft(draft.tokens.to(self.target.device), draft.probs)

    def verify(self, draft: Draft) -> Verified:
        """One target forward over ``[last, draft...]``."""
        assert self.cache is not None
        start = time.perf_counter()
        block = torch.cat([torch.tensor([self.last], device=self.target.device), draft.tokens.to(self.target.device)])
        out = self.target(block[None], self.cache, logits="all", capture=self.capture)
        assert out.logits is not None
        self.counters.verify_s += time.perf_counter() - start
        return Verified(out.logits[0], out.hidden[0] if out.hidden is not None else None)

    def settle(self, draft: Draft, verified: Verified) -> tuple[list[int], Outcome]:
        """Accept, roll the cache back to what stays, tell the drafter; return the new tokens."""
        assert self.cache is not None
        start = time.perf_counter()
        accepted, token = accept(
            draft.tokens.to(self.target.device), draft.probs, verified.logits, self.sampling, self.generator
        )
        emitted = [int(t) for t in draft.tokens[:accepted]] + [token]
        self.verified += accepted + 1
        self.cache.rollback(self.verified)
        kept = verified.hidden[: accepted + 1] if verified.hidden is not None else None
        outcome = Outcome(accepted, token, tuple(emitted[:-1]), kept)
        if self.session is not None:
            self.session.observe(outcome)
        self.last = token
        self.generated += len(emitted)
        self.counters.steps += 1
        self.counters.acceptance_lengths.append(len(emitted))
        self.counters.verify_s += time.perf_counter() - start
        return emitted, outcome
