"""The synchronous reference loop: draft -> verify -> accept, one step per call.

It is the oracle the asynchronous pipeline is tested against, so it stays this small: every
step is one job on the model's verify worker (see ``engine/request.py`` for the phases).
"""

from __future__ import annotations

from dflash2.engine.request import Request
from dflash2.runtime.workers import Worker
from dflash2.stream import EngineCounters


class SyncPipeline:
    """``TokenSource`` for ``pipeline="sync"``; each ``next_ids`` is one target forward."""

    def __init__(self, request: Request, worker: Worker) -> None:
        self.request = request
        self.counters: EngineCounters = request.counters
        self._worker = worker

    async def next_ids(self) -> list[int]:
        r = self.request
        phase = r.step if r.started else r.prefill
        emitted = (await r.run(self._worker, phase)).value
        return [] if emitted is None else list(emitted)  # None: the request was closed

    async def aclose(self) -> None:
        self.request.close()
