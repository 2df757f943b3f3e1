"""The asynchronous pipeline: keep drafting while the target verifies.

Each step verifies the current block on the verify worker while the drafter, on its own
worker, pre-drafts the next block for the likely outcome (the whole block accepted, followed
by the drafter's guess of the bonus). If verification agrees, the next block is ready and the
verifier starts at once; if not, the pre-draft is dropped and the next block is drafted from
the verified state on the verify worker (the verifier waits for it anyway, so it gets all the
cores; on a CPU the draft worker runs one thread, see ``runtime.device``). The two coroutines
meet once per step inside a task group that lives only for that step, so cancelling the
consumer stops both within one step and nothing outlives the stream. Output is identical to
the sync loop (greedy) or identically distributed (sampling); only speed depends on the
prediction.
"""

from __future__ import annotations

import sys
import time

import anyio

from dflash2.drafters.base import Draft, PreDraft, PreDrafting
from dflash2.engine.policy import OverlapPolicy
from dflash2.engine.request import Request, Verified
from dflash2.runtime.device import Timed, Workers
from dflash2.stream import EngineCounters

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


class AsyncPipeline:
    """``TokenSource`` for ``pipeline="async"``."""

    def __init__(self, request: Request, workers: Workers, policy: OverlapPolicy) -> None:
        self.request = request
        self.counters: EngineCounters = request.counters
        self._workers = workers
        self._policy = policy
        self._ready: Draft | None = None  # a pre-draft that verification confirmed
        # a seeded sample must not depend on timing: such requests keep one schedule
        sampling = request.sampling
        self._fixed = not sampling.greedy and sampling.seed is not None

    async def next_ids(self) -> list[int]:
        r = self.request
        if not r.started:
            return list((await self._workers.verify.run(r.prefill)).value)
        if r.closed:
            return []
        started = time.perf_counter()
        draft, self._ready = self._ready, None
        if draft is None and r.session is None:  # plain decoding: nothing to draft
            draft = r.propose()
        if draft is None:  # nothing drafted ahead: the verifier waits for this one (drafted on its cores)
            job = await self._workers.verify.run(r.propose)
            draft = job.value
            self.counters.wait_s += job.end - job.start
        ahead = r.room - len(draft) - 1
        session = r.session
        can_overlap = len(draft) > 0 and ahead > 0 and isinstance(session, PreDrafting) and session.can_predraft()
        overlap = can_overlap and (self._fixed or self._policy.overlap_next())
        if overlap:
            emitted = await self._verify_while_predrafting(draft, ahead)
        else:
            emitted = list((await self._workers.verify.run(lambda: r.settle(draft, r.verify(draft))[0])).value)
        if can_overlap and not self._fixed:
            self._policy.record(overlap, time.perf_counter() - started, len(emitted))
        return emitted

    async def _verify_while_predrafting(self, draft: Draft, ahead: int) -> list[int]:
        r = self.request
        session = r.session
        assert isinstance(session, PreDrafting)
        jobs: dict[str, Timed] = {}

        async def verify() -> None:
            threads = self._workers.overlapped_verify_threads
            jobs["verify"] = await self._workers.verify.run(lambda: r.verify(draft), threads=threads)

        async def predraft() -> None:
            jobs["predraft"] = await self._workers.draft.run(lambda: self._timed_predraft(session, ahead))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(verify)
                tg.start_soon(predraft)
        except BaseExceptionGroup as group:  # a failing phase: raise its own error
            raise group.exceptions[0] from None
        v, p = jobs["verify"], jobs["predraft"]
        self.counters.hidden_s += max(0.0, min(v.end, p.end) - max(v.start, p.start))
        self.counters.wait_s += max(0.0, p.end - v.end)
        verified: Verified = v.value
        emitted, outcome = (await self._workers.verify.run(lambda: r.settle(draft, verified))).value
        pre: PreDraft | None = p.value
        if pre is not None and pre.matches(outcome, len(draft)):
            self._ready = Draft(pre.draft.tokens.to(r.target.device), pre.draft.probs)
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
        self._ready = None
