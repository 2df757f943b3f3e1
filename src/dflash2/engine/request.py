"""One request's state and its phases, shared by the sync loop and the async pipeline.

Every phase is a plain synchronous function run inside a compute worker:

    prefill   target(prompt)                       -> first token, prompt features
    propose   session.propose(k)                   -> d_1 .. d_k   (maybe none)
    verify    target([x, d_1 .. d_k])               -> logits, features; k + 1 cache slots
    settle    verify.accept(...)                    -> a kept, next token n;
              cache.rollback(keeps x, d_1 .. d_a);  session.observe(a, n, features)

With a ``DecoderPool`` the request borrows a static slot for its lifetime (if one is free and it
fits): the prefill runs eagerly into the slot's cache, every verify forward as the slot's static
step (a CUDA graph on CUDA), or beside other slots' blocks as the pool's packed step, see
``runtime.graphs``.

With a ``PrefixCache`` the prefill starts from the stored state of the longest prefix of the
prompt another request left (target keys and values, target features, the drafter's state) and
runs only the rest; when the request ends its own state goes back to the store, as far as
eager forwards computed it (:attr:`Request.storable`, see ``engine.prefix_cache``).

The engines only decide what runs when (and what runs at the same time). Each phase runs
through :meth:`Request.use`, so a close from the event loop never frees state a worker is using:
it takes effect at once when no phase runs, else when the running ones end.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from dflash2.config import GenerationConfig, SamplingConfig
from dflash2.drafters.base import (
    MODEL_SOURCE,
    Draft,
    DraftContext,
    Drafter,
    DraftSession,
    MixedDrafting,
    Outcome,
    Resumable,
)
from dflash2.engine.draft_length import DraftLength
from dflash2.engine.prefix_cache import PrefixCache, Snapshot, drafter_entry
from dflash2.errors import DrafterError
from dflash2.runtime.graphs import DecoderPool, Slot
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import Decoder
from dflash2.runtime.workers import Timed, Worker, one_thread
from dflash2.sampling import choose, make_generator
from dflash2.stream import EngineCounters
from dflash2.verify import accept, branch_hit

T = TypeVar("T")


def check_draft(draft: object, wanted: int, vocab: int, drafter: str) -> None:
    """Raise :class:`DrafterError` unless ``draft`` is what a drafter must propose: a :class:`Draft`
    of at most ``wanted`` token ids of the target's vocabulary (values checked where they are on the
    host, so that nothing waits for a device), with its probabilities, confidence, alternatives and
    catch-up time as :class:`Draft` says."""
    if not isinstance(draft, Draft) or not isinstance(draft.tokens, torch.Tensor):
        raise DrafterError(f"the drafter {drafter!r} proposed a {type(draft).__name__}; propose() returns a Draft.")
    tokens = draft.tokens
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise DrafterError(
            f"the drafter {drafter!r} proposed tokens of dtype {str(tokens.dtype).removeprefix('torch.')} and shape "
            f"{list(tokens.shape)}; a Draft's tokens are a 1-D tensor of integer token ids (torch.long)."
        )
    if len(tokens) > wanted:
        raise DrafterError(f"the drafter {drafter!r} proposed {len(tokens)} tokens when asked for at most {wanted}.")
    if len(tokens) and tokens.device.type == "cpu":
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            raise DrafterError(
                f"the drafter {drafter!r} proposed token id {low if low < 0 else high}, outside the target's "
                f"vocabulary [0, {vocab})."
            )
    if draft.probs is not None and (draft.probs.dim() != 2 or draft.probs.shape[0] != len(tokens)):
        raise DrafterError(
            f"the drafter {drafter!r} proposed {len(tokens)} tokens with probabilities of shape "
            f"{list(draft.probs.shape)}; a Draft's probs hold one row per token."
        )
    _check_confidence(draft, drafter)
    _check_alternatives(draft, vocab, drafter)
    seconds = draft.catch_up_s
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0.0 <= seconds < math.inf:
        raise DrafterError(  # NaN fails too
            f"the drafter {drafter!r} reported catch_up_s={seconds!r}; it is the seconds it spent reading text "
            "it had fallen behind on before drafting, a finite number >= 0 (0 when it did not say)."
        )


def _check_confidence(draft: Draft, drafter: str) -> None:
    if draft.confidence and len(draft.confidence) != len(draft):
        raise DrafterError(
            f"the drafter {drafter!r} proposed {len(draft)} tokens with {len(draft.confidence)} confidence values; "
            "a Draft's confidence holds one probability per token, or none."
        )
    for sure in draft.confidence:
        if not 0.0 <= sure <= 1.0:  # NaN fails too
            raise DrafterError(
                f"the drafter {drafter!r} proposed a confidence of {sure}; a confidence is a probability in [0, 1]."
            )


def _check_alternatives(draft: Draft, vocab: int, drafter: str) -> None:
    if len(draft.alternatives) > len(draft):
        raise DrafterError(
            f"the drafter {drafter!r} proposed alternatives for {len(draft.alternatives)} positions of a "
            f"{len(draft)}-token draft; a Draft's alternatives hold at most one entry per token."
        )
    for i, choices in enumerate(draft.alternatives):
        for choice in choices:
            pair = isinstance(choice, tuple) and len(choice) == 2
            if not pair or not isinstance(choice[0], int) or not 0.0 <= choice[1] <= 1.0:
                raise DrafterError(
                    f"the drafter {drafter!r} proposed alternatives {choices!r} at draft position {i}; each "
                    "alternative is a (token id, probability) pair."
                )
            if not 0 <= choice[0] < vocab:
                raise DrafterError(
                    f"the drafter {drafter!r} proposed alternative token id {choice[0]}, outside the target's "
                    f"vocabulary [0, {vocab})."
                )


@dataclass(frozen=True)
class Verified:
    """Target output for a verified block: logits [k + 1 + b, vocab], features [k + 1 + b, F] or None.
    ``eager``: computed by an eager forward (a static step attends otherwise: see ``Request.storable``).
    ``branches``: the b side branches verified after the chain, ``(draft index, token, probability)``."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    eager: bool = True
    branches: tuple[tuple[int, int, float], ...] = ()


class Request:
    """A prompt being generated on ``target`` (with ``drafter``); owns its caches."""

    def __init__(
        self,
        target: Decoder,
        prompt_ids: list[int],
        config: GenerationConfig,
        sampling: SamplingConfig,
        drafter: Drafter | None,
        steps: DecoderPool | None = None,
        lengths: DraftLength | None = None,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.target = target
        # a store that keeps nothing (prefix_cache=0) is none: no features gathered, no state copied at the end
        self.prefixes = prefixes if prefixes is not None and prefixes.capacity > 0 else None
        self.lengths = lengths  # how far to draft each step (None: as far as the block allows)
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
        self._steps = steps
        self.slot: Slot | None = None  # borrowed from ``steps`` from the prefill until closed
        self.session: DraftSession | None = None
        self.last = -1  # the last emitted token, not yet in the target's cache
        self.verified = 0  # tokens in the target's cache that stay there
        self.generated = 0
        self.started = False
        self.closed = False
        self._lock = threading.Lock()
        self._phases = 0  # phases running now (in worker threads)
        # the prefix cache: the verified text, how much of its state eager forwards computed, its target features
        self.text: list[int] = list(prompt_ids)
        self.storable = 0
        self.cached_tokens = 0  # prompt tokens whose state came from the prefix cache
        self._features: list[torch.Tensor] = []
        self._resume: Any = None  # the drafter's stored state, for its session
        self._caught_up: set[str] = set()  # draft sources whose first draft (and catch-up) is behind

    @property
    def steps(self) -> DecoderPool | None:
        """The static slots this request borrows from (``None``: it runs eagerly)."""
        return self._steps

    @property
    def room(self) -> int:
        """Draft tokens that still fit: a step emits its drafts plus one."""
        return self.max_new - self.generated - 1

    def use(self, phase: Callable[[], T]) -> T | None:
        """Run ``phase`` unless the request is closed (then ``None``); a close meanwhile waits for its end."""
        if not self.hold():
            return None
        try:
            return phase()
        finally:
            self.release()

    def hold(self) -> bool:
        """Start a phase (``False``: the request is closed); every ``True`` needs its :meth:`release`."""
        with self._lock:
            if self.closed:
                return False
            self._phases += 1
            return True

    def release(self) -> None:
        """End a phase begun by :meth:`hold`; the caches go if the request was closed meanwhile."""
        with self._lock:
            self._phases -= 1
            free = self.closed and self._phases == 0
        if free:
            self._free()

    async def run(
        self, worker: Worker, phase: Callable[[], T], threads: int | None = None, synchronize: bool = True
    ) -> Timed:
        """Run ``phase`` on ``worker`` through :meth:`use`: its value is ``None`` if the request was closed."""
        return await worker.run(functools.partial(self.use, phase), threads, synchronize)

    def close(self) -> None:
        """Stop the request: its caches are freed now, or when the phases running now end."""
        with self._lock:
            already, self.closed = self.closed, True
            free = not already and self._phases == 0
        if free:
            self._free()

    def _free(self) -> None:
        try:
            with one_thread():  # often on the event loop's thread
                self._store()
        finally:
            session, self.session, self.cache = self.session, None, None
            slot, self.slot = self.slot, None
            try:
                if session is not None:
                    session.close()
            finally:
                if slot is not None and self._steps is not None:
                    self._steps.release(slot)

    def _store(self) -> None:
        """Leave the storable part of this request's state in the prefix cache (no phase runs now)."""
        if self.prefixes is None or self.cache is None or self.storable == 0:
            return
        length = min(self.storable, self.verified, self.cache.length)
        features = torch.cat(self._features)[:length] if self._features else None
        if self.capture and (features is None or len(features) < length):
            return  # the drafter's features are not all known: keep nothing rather than a part
        state = self.session.snapshot() if isinstance(self.session, Resumable) else None
        self.prefixes.insert(
            Snapshot(
                tuple(self.text[:length]),
                self.cache.k[:, 0, :, :length].clone(),
                self.cache.v[:, 0, :, :length].clone(),
                None if features is None else features.clone(),
                drafter_entry(self.drafter, state) if self.drafter is not None else None,
            )
        )

    def prefill(self) -> list[int]:
        ids = self.prefill_block()
        out = self.target(ids[None], self.cache, logits="last", capture=self.capture)
        assert out.logits is not None
        return self.prefilled(out.logits[0, -1], out.hidden[0] if out.hidden is not None else None)

    def prefill_block(self) -> torch.Tensor:
        """Take a cache (a static slot if one is free), fill it from the prefix cache where the prompt
        starts as a stored text does, and return the prompt's ids [P'] still to run through it."""
        self.started = True
        self.slot = self._steps.acquire(self.capacity) if self._steps is not None else None
        self.cache = self.slot.cache if self.slot is not None else self.target.new_cache(self.capacity)
        hit = self.prefixes.lookup(self.prompt) if self.prefixes is not None else None
        if hit is not None and self.capture and hit.snapshot.features is None:
            hit = None  # stored without the features this drafter reads
        if hit is not None:
            stored, length = hit.snapshot, hit.length
            self.cache.k[:, 0, :, :length] = stored.keys[:, :, :length]
            self.cache.v[:, 0, :, :length] = stored.values[:, :, :length]
            self.cache.advance(length)
            if stored.features is not None and self.capture:
                self._features.append(stored.features[:length])
            if self.drafter is not None:
                self._resume = stored.drafter_state(self.drafter)
            self.cached_tokens = self.counters.cached_tokens = length
        return torch.tensor(self.prompt[self.cached_tokens :], device=self.target.device)

    def prefilled(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> list[int]:
        """The first token from the prompt's last ``logits`` [vocab]; the drafting session starts
        from the prompt's features: those of the cached prefix, then ``hidden`` [P', F] (the rows
        that ran)."""
        self.last = int(choose(logits, self.sampling, self.generator))
        self.storable = len(self.prompt)
        self.text.append(self.last)
        if hidden is not None and self.capture:
            self._features.append(hidden)
            hidden = torch.cat(self._features) if len(self._features) > 1 else hidden
        self.generated, self.verified = 1, len(self.prompt)
        if self.drafter is not None:
            start = time.perf_counter()
            self.session = self.drafter.start(
                DraftContext(
                    prompt_ids=self.prompt,
                    first_token=self.last,
                    prompt_hidden=hidden,
                    sampling=self.sampling,
                    generator=make_generator(self.sampling, self.target.device, offset=1),
                    max_tokens=self.capacity,
                    keep_drafting=self.lengths.keep_drafting if self.lengths is not None else None,
                    resume=self._resume,
                )
            )
            self.counters.draft_s += time.perf_counter() - start
        return [self.last]

    @property
    def draft_limit(self) -> int:
        """Drafts the next step may hold: what the block and ``max_new_tokens`` allow."""
        block = self.drafter.block_size if self.drafter is not None else 1
        return max(0, min(self.room, block - 1))

    def propose(self) -> Draft:
        """A draft from the verified state, as long as the draft-length policy says (maybe none)."""
        wanted = self.wanted()
        return self.no_draft() if wanted is None else self.draft(wanted)

    def draft(self, wanted: int) -> Draft:
        """The session's draft of (at most) ``wanted`` tokens, timed; 0: it drafts nothing, it only keeps up."""
        assert self.session is not None
        start = time.perf_counter()
        draft = self.session.propose(wanted)
        return self.drafted(draft, time.perf_counter() - start, wanted)

    def wanted(self, batch: int = 1) -> int | None:
        """How far this step drafts, as the draft-length policy says (ask once per step) for a step
        that shares its forward with ``batch`` - 1 other streams; ``None`` when there is no session
        or no room, and the step drafts nothing."""
        limit = self.draft_limit
        if self.session is None or limit <= 0:
            return None
        if self.lengths is None:
            return limit
        source = self.session.next_source(limit) if isinstance(self.session, MixedDrafting) else MODEL_SOURCE
        return self.lengths.choose(limit, batch, source)

    def no_draft(self) -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long, device=self.target.device))

    def drafted(self, draft: Draft, seconds: float, wanted: int) -> Draft:
        """Check a draft of at most ``wanted`` tokens the session made in ``seconds``, count it and
        move it to the target's device."""
        assert self.drafter is not None
        check_draft(draft, wanted, self.target.spec.vocab_size, self.drafter.name)
        self.counters.draft_s += seconds
        if self.lengths is not None and len(draft) > 0:
            source = self.lengths.source
            if source in self._caught_up:  # less what the drafter spent reading text it had fallen behind on
                self.lengths.policy.record_draft(len(draft), max(0.0, seconds - draft.catch_up_s), source)
            else:  # a session's first draft also caught up on the prompt (a model drafter's prefill): no draft's price
                self._caught_up.add(source)
        return dataclasses.replace(draft, tokens=draft.tokens.to(self.target.device))

    def block(self, draft: Draft) -> torch.Tensor:
        """The tokens [1 + k] a verify forward runs: the last emitted token, then the draft."""
        return torch.cat([torch.tensor([self.last], device=self.target.device), draft.tokens.to(self.target.device)])

    def branches(self, draft: Draft) -> list[tuple[int, int, float]]:
        """The draft's alternatives to verify beside it (greedy eager forwards only; see ``engine.draft_length``)."""
        if not draft.alternatives or self.lengths is None or self.slot is not None or not self.sampling.greedy:
            return []
        assert self.cache is not None
        rows = min(self.cache.capacity - self.cache.length, 2 * (len(draft) + 1))
        return self.lengths.branches(draft.confidence, draft.alternatives, rows)

    def verify(self, draft: Draft) -> Verified:
        """One target forward over ``[last, draft...]`` (and the side branches worth verifying)."""
        assert self.cache is not None
        start = time.perf_counter()
        block = self.block(draft)
        if self.slot is not None:
            verified = Verified(*self.slot.forward(block, self.capture), eager=False)
        else:
            branches = self.branches(draft)
            if branches:
                block = torch.cat([block, torch.tensor([t for _, t, _ in branches], device=block.device)])
            rows = [i + 1 for i, _, _ in branches]
            out = self.target(block[None], self.cache, logits="all", capture=self.capture, branches=rows)
            assert out.logits is not None
            hidden = out.hidden[0] if out.hidden is not None else None
            verified = Verified(out.logits[0], hidden, branches=tuple(branches))
        self.counters.verify_s += time.perf_counter() - start
        return verified

    def settle(self, draft: Draft, verified: Verified, batch_size: int = 1) -> tuple[list[int], Outcome]:
        """Accept, roll the cache back to what stays, tell the drafter; return the new tokens.
        ``batch_size``: the streams whose steps ran in that target forward (see ``engine.batch``)."""
        assert self.cache is not None
        start = time.perf_counter()
        tokens = draft.tokens.to(self.target.device)
        k = len(tokens)
        chain = verified.logits[: k + 1]  # the side branches' rows follow
        accepted_t, token_t = accept(tokens, draft.probs, chain, self.sampling, self.generator)
        accepted, *block = torch.cat([accepted_t.view(1), tokens, token_t.view(1)]).tolist()  # one host copy
        emitted = [*block[:accepted], block[-1]]
        kept = verified.hidden[: accepted + 1] if verified.hidden is not None else None
        taken = branch_hit(accepted, k, emitted[-1], [(i, t) for i, t, _ in verified.branches])
        if taken is not None:  # the target took a side branch: its row holds the next token
            row = k + 1 + taken
            emitted.append(int(choose(verified.logits[row], self.sampling, self.generator)))
            self.cache.move(self.verified + row, self.verified + accepted + 1)
            if kept is not None and verified.hidden is not None:
                kept = torch.cat([kept, verified.hidden[row : row + 1]])
            self.counters.branch_hits += 1
        token, kept_tokens = emitted[-1], len(emitted) - 1
        if kept is not None and self.slot is not None:  # the slot's next step overwrites its outputs
            kept = kept.clone()
        if self.prefixes is not None and self.storable == self.verified and verified.eager:
            self.storable += kept_tokens + 1
            if kept is not None:
                self._features.append(kept)
        self.text += emitted
        self.verified += kept_tokens + 1
        self.cache.rollback(self.verified)
        outcome = Outcome(kept_tokens, token, tuple(emitted[:-1]), kept, branch=taken is not None)
        if self.session is not None:
            self.session.observe(outcome)
        if self.lengths is not None:
            self.lengths.record_outcome(len(draft), accepted, draft.confidence)
            if verified.branches:
                self.lengths.record_branches(verified.branches, accepted, taken)
        self.last = token
        self.generated += len(emitted)
        self.counters.steps += 1
        self.counters.drafted_tokens += len(draft)
        self.counters.acceptance_lengths.append(len(emitted))
        self.counters.batch_sizes.append(batch_size)
        self.counters.verify_s += time.perf_counter() - start
        return emitted, outcome

    def step(self) -> list[int]:
        """One whole serial step: draft, verify, settle (the sync loop's step); the new tokens."""
        before = self.counters.draft_s
        draft = self.propose()
        self.counters.wait_s += self.counters.draft_s - before  # drafting is all on the critical path
        emitted, _ = self.check(draft)
        return emitted

    def check(self, draft: Draft) -> tuple[list[int], Outcome]:
        """Verify and settle ``draft`` at once (a serial step), timing it for the draft-length policy."""
        start = time.perf_counter()
        verified = self.verify(draft)
        emitted, outcome = self.settle(draft, verified)
        if self.lengths is not None:  # settle read the result back: the time includes the device's
            self.lengths.policy.record_verify(len(draft) + 1 + len(verified.branches), time.perf_counter() - start)
        return emitted, outcome
