"""The synchronous reference loop: draft -> verify -> accept, one step per call.

It is the oracle the asynchronous pipeline is tested against, so it stays this small: every
step goes through the model's ``Batcher``, alone one job on the verify worker running the
request's own phases (see ``engine/request.py``), beside other streams one packed forward.
"""

from __future__ import annotations

from dflash2.engine.batch import Batcher
from dflash2.engine.request import Request
from dflash2.stream import EngineCounters


class SyncPipeline:
    """``TokenSource`` for ``pipeline="sync"``; each ``next_ids`` is one target forward."""

    def __init__(self, request: Request, batcher: Batcher) -> None:
        self.request = request
        self.counters: EngineCounters = request.counters
        self._batcher = batcher

    async def next_ids(self) -> list[int]:
        if not self.request.started:
            self._batcher.join(self.request)
        return await self._batcher.step(self.request)  # [] once the request was closed

    async def aclose(self) -> None:
        self.request.close()
        self._batcher.leave(self.request)
