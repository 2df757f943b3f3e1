"""Concurrent streams share the target: their steps run as one packed forward (continuous batching).

A stream steps through the model's ``Batcher`` when it is not alone (or always, see the
pipelines): it puts its step on the pending list and submits one job to the model's verify
worker. The first of those jobs to run waits, briefly, until every running stream of the model
has its step pending (their consumers hand out the last tokens and come back within a fraction
of a millisecond; a consumer that does not is waited for at most ``GATHER_S``, or a fifth of the
last step, whichever is shorter), takes the oldest pending steps, at most ``max_batch``, and
runs them together: each request drafts its block (from a confirmed pre-draft when it has one),
one target forward verifies every block and prefills the prompts of requests that just joined
(``Decoder.forward_packed``: the weights are read once, each request attends over its own cache;
when every block is a verify block on a static slot of one pool, ``DecoderPool.forward_packed``
instead: one static step per batch bucket and block bucket, a CUDA graph on CUDA),
and each request settles its own outcome with its own generator, so a seeded stream draws what
it would draw alone. The jobs of steps already served return at once. Streams join and leave
between steps; a closed request is skipped (its caches go when the step ends). Steps are served
in arrival order, so a step waits for at most ceil(pending / max_batch) batches, and a new
stream's prompt is prefilled in the first batch after it arrives.

A batch of one runs the request's own phases (``Request.prefill`` / ``Request.step``), static
steps included, so a stream alone costs what it cost before.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from dflash2.drafters.base import BatchDrafting, Draft
from dflash2.engine.request import Request, Verified
from dflash2.runtime.graphs import MAX_BUCKET, Slot
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import ForwardOutput
from dflash2.runtime.workers import Worker

GATHER_S = 0.002  # the longest a batch waits for a running stream's next step


@dataclass(eq=False)
class _Step:
    """One request's pending step; ``emitted`` holds its new tokens once ``done``."""

    request: Request
    ready: Draft | None  # a pre-draft already confirmed for this step
    done: bool = False
    emitted: list[int] = field(default_factory=list)
    error: Exception | None = None


class Batcher:
    """Gathers the pending steps of a model's streams into packed target forwards."""

    def __init__(self, worker: Worker, max_batch: int = 8) -> None:
        self.worker = worker
        self.max_batch = max_batch
        self._pending: list[_Step] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._active: weakref.WeakSet[Request] = weakref.WeakSet()  # streams started and not closed
        self._last_s = 0.0  # how long the last batch took

    def join(self, request: Request) -> None:
        """Count ``request`` among the model's running streams (until :meth:`leave` or it is dropped)."""
        self._active.add(request)

    def leave(self, request: Request) -> None:
        self._active.discard(request)
        with self._lock:
            self._pending = [s for s in self._pending if s.request is not request]

    @property
    def shared(self) -> bool:
        """Whether more than one stream of the model is running."""
        return len(self._active) > 1

    async def step(self, request: Request, ready: Draft | None = None) -> list[int]:
        """One step of ``request`` (its prefill first), batched with whatever else is pending."""
        step = _Step(request, ready)
        with self._lock:
            self._pending.append(step)
            self._arrived.notify_all()
        try:
            await self.worker.run(functools.partial(self._serve, step))
        finally:
            with self._lock:  # a caller cancelled while its job was queued leaves no step behind
                if step in self._pending:
                    self._pending.remove(step)
        if step.error is not None:
            raise step.error
        return step.emitted

    def _serve(self, mine: _Step) -> None:
        """On the verify worker: run batches of pending steps until ``mine`` is done."""
        while True:
            with self._lock:
                if mine.done:
                    return
                self._arrived.wait_for(self._gathered, min(GATHER_S, self._last_s / 5))
                batch = self._pending[: self.max_batch]
                del self._pending[: len(batch)]
            if not batch:  # taken back by its cancelled caller
                return
            start = time.perf_counter()
            self._run(batch)
            self._last_s = time.perf_counter() - start

    def _gathered(self) -> bool:
        """Whether every running stream's step is pending (or ``max_batch`` of them are); under the lock."""
        running = sum(1 for r in list(self._active) if not r.closed)
        return len(self._pending) >= min(self.max_batch, running)

    def _run(self, batch: list[_Step]) -> None:
        held = [s for s in batch if s.request.hold()]  # a closed request is skipped
        try:
            if len(held) == 1:
                self._alone(held[0])
            elif held:
                self._together(held)
        finally:
            for s in batch:
                s.done = True
            for s in held:
                s.request.release()

    @staticmethod
    def _alone(step: _Step) -> None:
        r = step.request
        try:
            if not r.started:
                step.emitted = r.prefill()
            elif step.ready is not None:
                step.emitted = r.check(step.ready)[0]
            else:
                step.emitted = r.step()
        except Exception as err:  # raised in that stream's consumer
            step.error = err

    @staticmethod
    def _drafts(steps: list[_Step]) -> dict[int, Draft]:
        """The draft of every started step (by index): a confirmed pre-draft, one drafter forward
        for all the steps whose drafter drafts for several sessions at once, or each its own."""
        drafts: dict[int, Draft] = {}
        grouped: dict[int, list[tuple[int, int]]] = {}  # by drafter: (step index, tokens wanted)
        before = [s.request.counters.draft_s for s in steps]
        for i, s in enumerate(steps):
            r = s.request
            if s.ready is not None:
                drafts[i] = s.ready
                continue
            try:
                wanted = r.wanted(len(steps))
                if wanted is None:
                    drafts[i] = r.no_draft()
                elif isinstance(r.drafter, BatchDrafting):
                    grouped.setdefault(id(r.drafter), []).append((i, wanted))
                else:
                    drafts[i] = r.draft(wanted)
            except Exception as err:  # raised in that stream's consumer
                s.error = err
        for members in grouped.values():
            requests = [steps[i].request for i, _ in members]
            drafter = requests[0].drafter
            assert isinstance(drafter, BatchDrafting)
            start = time.perf_counter()
            try:
                sessions = [r.session for r in requests if r.session is not None]
                made = drafter.propose_many(sessions, [k for _, k in members])
            except Exception as err:
                for i, _ in members:
                    steps[i].error = err
                continue
            # each draft's share of the forward, plus the reading it alone caught up on
            share = (time.perf_counter() - start - sum(d.catch_up_s for d in made)) / len(members)
            for (i, wanted), r, draft in zip(members, requests, made, strict=True):
                try:
                    drafts[i] = r.drafted(draft, share + draft.catch_up_s, wanted)
                except Exception as err:  # raised in that stream's consumer
                    steps[i].error = err
        for i, s in enumerate(steps):  # the batch waits for every draft
            s.request.counters.wait_s += s.request.counters.draft_s - before[i]
        return drafts

    @staticmethod
    def _forward(live: list[tuple[_Step, Draft | None, torch.Tensor]]) -> tuple[list[ForwardOutput], bool]:
        """The packed target forward of ``live``: the pool's static step when every block is a
        verify block on a slot of one pool (a CUDA graph on CUDA), else eager; and whether it was eager."""
        first = live[0][0].request
        pool = first.steps
        slotted: list[tuple[Slot, torch.Tensor]] = []
        blocks: list[tuple[torch.Tensor, KVCache, bool]] = []
        for s, draft, ids in live:
            r = s.request
            assert r.cache is not None and r.capture == first.capture  # one model, one drafter
            blocks.append((ids, r.cache, draft is not None))
            if draft is not None and r.slot is not None and r.steps is pool and len(ids) <= MAX_BUCKET:
                slotted.append((r.slot, ids))
        if pool is not None and len(slotted) == len(live):
            return pool.forward_packed(slotted, first.capture), False
        return first.target.forward_packed(blocks, first.capture), True

    @staticmethod
    def _together(steps: list[_Step]) -> None:
        live: list[tuple[_Step, Draft | None, torch.Tensor]] = []  # the draft each verifies (None: a prefill)
        going = [s for s in steps if s.request.started]
        for s in steps:
            if not s.request.started:
                try:
                    live.append((s, None, s.request.prefill_block()))  # takes the cache; the prompt runs below
                except Exception as err:  # raised in that stream's consumer
                    s.error = err
        drafts = Batcher._drafts(going)
        for i, s in enumerate(going):
            if i in drafts and s.error is None:
                live.append((s, drafts[i], s.request.block(drafts[i])))
        if not live:
            return
        start = time.perf_counter()
        try:
            outs, eager = Batcher._forward(live)
        except Exception as err:
            for s, _, _ in live:
                s.error = err
            return
        seconds = time.perf_counter() - start
        if all(draft is not None for _, draft, _ in live):  # a prompt's rows would distort the line
            tokens = sum(len(ids) for _, _, ids in live)
            policies = {id(r.lengths.policy): r.lengths.policy for r in (s.request for s, _, _ in live) if r.lengths}
            for policy in policies.values():
                policy.record_packed(len(live), tokens, seconds)
        for (s, draft, _), out in zip(live, outs, strict=True):
            r = s.request
            assert out.logits is not None
            hidden = out.hidden[0] if out.hidden is not None else None
            try:
                if draft is None:
                    s.emitted = r.prefilled(out.logits[0, -1], hidden)
                else:
                    r.counters.verify_s += seconds
                    s.emitted = r.settle(draft, Verified(out.logits[0], hidden, eager), len(live))[0]
            except Exception as err:
                s.error = err
