"""The resident pipeline: speculative steps that stay on the device; the host reads one step behind.

With static steps (``graphs="cuda"``, or ``"static"`` run eagerly) a whole step is device work:
the draft (a DFlash drafter's static block forward from the last verification's features, or
none for plain decoding), the verify forward, acceptance (``verify.accept`` returns device
tensors), the rollback (the slot's device length moves by ``accepted + 1``) and the drafter's
context update (the next draft reads the verified features and how many of them stay). Each
step's ``[accepted, drafts..., next token]`` is copied to host memory behind an event, and the
host reads it while the next step already runs: the device never waits for Python between
steps, and nothing in the loop synchronises it.

A run of resident steps starts from the host's state (a host-driven draft) and ends while a
launched step can still not pass ``max_new_tokens`` (a step launched before the previous one is
read may emit a whole block), or as soon as other streams of the model run: then the steps go
through the model's ``Batcher`` (one packed static step for all of them, see ``engine.batch``)
until the stream is alone again. The tail, requests without a static slot, and drafters that need
the host between steps run the sync loop's steps. Stop strings and EOS end the stream as always
(the stream reads only verified tokens); a step launched past them is dropped with the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dflash2.drafters.base import ResidentDrafting
from dflash2.engine.batch import Batcher
from dflash2.engine.request import Request
from dflash2.runtime.workers import Worker
from dflash2.stream import EngineCounters
from dflash2.verify import accept


class _Clock:
    """Marks along a launched step: CUDA events (read once the step has ended) or wall-clock times."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """The intervals between consecutive marks."""
        pairs = zip(self._marks, self._marks[1:], strict=False)
        if self._cuda:
            return [a.elapsed_time(b) / 1000 for a, b in pairs]
        return [b - a for a, b in pairs]


@dataclass
class _Launched:
    """A step on its way: its tokens land in ``host`` once ``done`` has happened."""

    host: torch.Tensor  # [accepted, d_1 .. d_k, next token]
    done: Any  # a CUDA event, or None where the copy has already happened
    clock: _Clock
    host_drafted: bool  # its draft was made by ``Request.propose``, which counted its time


class ResidentPipeline:
    """``TokenSource`` whose steps stay on the device when they can (see the module docstring)."""

    def __init__(self, request: Request, worker: Worker, batcher: Batcher) -> None:
        self.request = request
        self.counters: EngineCounters = request.counters
        self._worker = worker
        self._batcher = batcher
        drafter = request.drafter
        self._block = drafter.block_size if drafter is not None else 1  # tokens a step may emit
        self._pending: _Launched | None = None
        self._last: torch.Tensor | None = None  # the next step's input token (device), during a run
        self._features: torch.Tensor | None = None  # the last verification's features (the slot's output)
        self._kept: torch.Tensor | None = None  # how many of them stay (device)
        self._accepted = 0  # of the last step read
        self._hosts: dict[int, list[torch.Tensor]] = {}

    async def next_ids(self) -> list[int]:
        r = self.request
        if not r.started:
            self._batcher.join(r)
        if self._pending is None and self._batcher.shared:  # between runs, beside other streams
            return await self._batcher.step(r)
        if not r.started:
            return list((await r.run(self._worker, r.prefill)).value or [])
        emitted = (await r.run(self._worker, self._step, synchronize=False)).value
        return [] if emitted is None else emitted  # None: the request was closed

    async def aclose(self) -> None:
        self.request.close()
        self._batcher.leave(self.request)

    def _can_stay(self) -> bool:
        r = self.request
        if r.slot is None:
            return False
        return r.session is None or (isinstance(r.session, ResidentDrafting) and r.session.can_stay_resident())

    def _fits(self, unread: int) -> bool:
        """Whether one more step surely ends within ``max_new_tokens``, with ``unread`` steps launched."""
        return self.request.generated + (unread + 1) * self._block <= self.request.max_new

    def _step(self) -> list[int]:
        if self._pending is None:
            if not (self._can_stay() and self._fits(0)):
                return self.request.step()
            self._pending = self._launch()
        following = self._launch() if self._fits(1) and not self._batcher.shared else None
        emitted = self._read(self._pending)
        self._pending = following
        if following is None:
            self._leave()
        return emitted

    def _launch(self) -> _Launched:
        """Queue one step on the device; nothing is read back."""
        r = self.request
        assert r.slot is not None
        clock = _Clock(r.target.device)
        session = r.session
        host_drafted = self._last is None or not isinstance(session, ResidentDrafting)
        if self._last is None:  # a run starts from the host's state
            r.slot.start.fill_(r.verified)
            self._last = torch.full((), r.last, dtype=torch.long, device=r.target.device)
        if host_drafted:  # the run's first draft, or plain decoding (no draft)
            draft = r.propose()
        else:
            assert isinstance(session, ResidentDrafting) and self._kept is not None
            draft = session.propose_resident(self._last, self._features, self._kept)
        clock.mark()
        block = torch.cat([self._last.view(1), draft.tokens])
        logits, hidden = r.slot.forward(block, r.capture, resident=True)
        accepted, token = accept(draft.tokens, draft.probs, logits, r.sampling, r.generator)
        self._kept = accepted + 1
        r.slot.start.add_(self._kept)  # the rollback: the rejected drafts fall out of the length
        self._last, self._features = token, hidden
        clock.mark()
        out = torch.cat([accepted.view(1), draft.tokens, token.view(1)])
        host = self._host_buffer(out.shape[0])
        host.copy_(out, non_blocking=True)
        done = None
        if out.is_cuda:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        return _Launched(host, done, clock, host_drafted)

    def _read(self, launched: _Launched) -> list[int]:
        """Wait for a launched step's tokens (the step after it keeps the device busy); the new tokens."""
        r, c = self.request, self.counters
        if launched.done is not None:
            launched.done.synchronize()
        accepted, *block = launched.host.tolist()
        emitted = [*block[:accepted], block[-1]]
        draft_s, verify_s = launched.clock.seconds()
        if not launched.host_drafted:
            c.draft_s += draft_s
        c.wait_s += draft_s  # the verifier waits for every draft: they run in turn on one stream
        c.verify_s += verify_s
        c.steps += 1
        c.drafted_tokens += len(block) - 1
        c.acceptance_lengths.append(len(emitted))
        c.batch_sizes.append(1)
        self._accepted = accepted
        r.verified += accepted + 1
        r.last = emitted[-1]
        r.generated += len(emitted)
        if r.cache is not None:
            r.cache.length = r.verified  # the host's copy of the slot's length
        return emitted

    def _leave(self) -> None:
        """End the run: the drafter drafts from the host's state again."""
        session = self.request.session
        if isinstance(session, ResidentDrafting):
            features = self._features[: self._accepted + 1].clone() if self._features is not None else None
            session.resume(self.request.last, features)
        self._last = self._features = self._kept = None

    def _host_buffer(self, size: int) -> torch.Tensor:
        """One of two host buffers of ``size`` (pinned on CUDA), in turn: two steps may be unread."""
        pair = self._hosts.get(size)
        if pair is None:
            pin = self.request.target.device.type == "cuda"
            pair = self._hosts[size] = [torch.empty(size, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        pair.reverse()
        return pair[0]
