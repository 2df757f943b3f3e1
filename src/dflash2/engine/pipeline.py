"""The asynchronous pipeline: keep drafting while the target verifies.

Each step verifies the current block on the verify worker while the drafter, on its own
worker, pre-drafts the next block for the likely outcome (the whole block accepted, followed
by the drafter's guess of the bonus). If verification agrees, the next block is ready and the
verifier starts at once; if not, the pre-draft is dropped and the next block is drafted from
the verified state on the verify worker (the verifier waits for it anyway, so it gets all the
cores; on a CPU the draft worker runs one thread, see ``runtime.workers``). The two coroutines
meet once per step inside a task group that lives only for that step, so cancelling the
consumer stops both within one step and nothing outlives the stream. Output is identical to
the sync loop (greedy) or identically distributed (sampling); only speed depends on the
prediction. Whether a step overlaps at all is ``OverlapPolicy``'s measured choice; a step it
keeps serial is a single job on the verify worker, as in the sync loop.

While other streams of the model run, steps go through the model's ``Batcher`` instead (one
packed forward for all of them, serial inside); so does every step of a seeded sampling
request, so that what it draws never depends on what runs beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import anyio

from dflash2.drafters.base import Draft, PreDraft, PreDrafting
from dflash2.engine.batch import Batcher
from dflash2.engine.policy import OverlapPolicy
from dflash2.engine.request import Request, Verified, check_draft
from dflash2.runtime.workers import Timed, Workers
from dflash2.stream import EngineCounters

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


class AsyncPipeline:
    """``TokenSource`` for ``pipeline="async"``."""

    def __init__(self, request: Request, workers: Workers, policy: OverlapPolicy, batcher: Batcher) -> None:
        self.request = request
        self.counters: EngineCounters = request.counters
        self._workers = workers
        self._policy = policy
        self._batcher = batcher
        self._ready: Draft | None = None  # a pre-draft that verification confirmed
        # a seeded sample must not depend on timing or neighbours: such requests take the batcher's steps
        sampling = request.sampling
        self._fixed = not sampling.greedy and sampling.seed is not None

    async def next_ids(self) -> list[int]:
        r = self.request
        verify = self._workers.verify
        if not r.started:
            self._batcher.join(r)
        if self._fixed or self._batcher.shared:
            ready, self._ready = self._ready, None
            return await self._batcher.step(r, ready)
        if not r.started:
            return list((await r.run(verify, r.prefill)).value or [])
        started = time.perf_counter()
        ready, self._ready = self._ready, None
        # one job drafts (unless a pre-draft is ready), decides the schedule and, when the step
        # stays serial, verifies too: a serial step costs what a sync step costs
        step = (await r.run(verify, functools.partial(self._serial_step, ready))).value
        if step is None:  # the request was closed
            return []
        draft, emitted, can_overlap = step
        overlapped = emitted is None
        if emitted is None:  # pre-draft as far as this step drafted
            emitted = await self._verify_while_predrafting(draft, min(len(draft), r.room - len(draft) - 1))
        if can_overlap:
            self._policy.record(overlapped, time.perf_counter() - started, len(emitted))
        return emitted

    def _serial_step(self, ready: Draft | None) -> tuple[Draft, list[int] | None, bool]:
        """Draft if needed; verify and settle unless this step overlaps (then ``None`` for the tokens)."""
        r = self.request
        draft = ready
        if draft is None:
            before = self.counters.draft_s
            draft = r.propose()
            self.counters.wait_s += self.counters.draft_s - before  # the verifier waits for this draft
        session = r.session
        ahead = r.room - len(draft) - 1
        can_overlap = len(draft) > 0 and ahead > 0 and isinstance(session, PreDrafting) and session.can_predraft()
        if can_overlap and self._policy.overlap_next():
            return draft, None, True
        emitted, _ = r.check(draft)
        return draft, emitted, can_overlap

    async def _verify_while_predrafting(self, draft: Draft, ahead: int) -> list[int]:
        r = self.request
        if r.closed:  # by another task, since the serial step
            return []
        session = r.session
        assert isinstance(session, PreDrafting)
        jobs: dict[str, Timed] = {}

        async def verify() -> None:
            threads = self._workers.overlapped_verify_threads
            jobs["verify"] = await r.run(self._workers.verify, functools.partial(r.verify, draft), threads)

        async def predraft() -> None:
            jobs["predraft"] = await r.run(self._workers.draft, functools.partial(self._timed_predraft, session, ahead))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(verify)
                tg.start_soon(predraft)
        except BaseExceptionGroup as group:  # a failing phase: raise its own error
            raise group.exceptions[0] from None
        v, p = jobs["verify"], jobs["predraft"]
        self.counters.hidden_s += max(0.0, min(v.end, p.end) - max(v.start, p.start))
        self.counters.wait_s += max(0.0, p.end - v.end)
        verified: Verified | None = v.value
        if verified is None:  # the request was closed
            return []
        settled = (await r.run(self._workers.verify, functools.partial(r.settle, draft, verified))).value
        if settled is None:
            return []
        emitted, outcome = settled
        pre: PreDraft | None = p.value
        if pre is not None and pre.matches(outcome, len(draft)):
            assert r.drafter is not None
            check_draft(pre.draft, ahead, r.target.spec.vocab_size, r.drafter.name)
            self._ready = dataclasses.replace(pre.draft, tokens=pre.draft.tokens.to(r.target.device))
            self.counters.predraft_hits += 1
        return list(emitted)

    def _timed_predraft(self, session: PreDrafting, ahead: int) -> PreDraft | None:
        start = time.perf_counter()
        try:
            return session.predraft(ahead)
        finally:
            self.counters.draft_s += time.perf_counter() - start

    async def aclose(self) -> None:
        self.request.close()
        self._batcher.leave(self.request)
        self._ready = None
