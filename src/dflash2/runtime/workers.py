"""The compute workers that keep torch off the event loop, and never hang their callers.

A ``Worker`` is a dedicated thread that runs jobs in order. How a job meets its caller:

- The caller submits a ``_Job`` and awaits an event of its own loop. The worker sets that event
  through the loop's own thread-safe call (``call_soon_threadsafe`` on asyncio,
  ``run_sync_soon`` on trio): it never waits for the caller's loop, so a loop that blocks, ends
  or is closed costs the worker nothing and every other loop keeps being served.
- A caller cancelled while its job is still queued takes it back (the job is skipped) and
  leaves at once. A caller cancelled while its job runs waits for the job's end (one step), so a
  request's caches are never left half-written, then re-raises the cancellation; if the job has
  run longer than ``stall_s`` it leaves anyway (the request frees itself when the job ends).
- A job's exception, of any kind, is re-raised in its caller; the thread lives on. A thread
  that died anyway is replaced by the next submission; a thread whose job has run longer than
  ``stall_s`` is retired: the jobs queued behind it move to a fresh thread, and the retired one
  ends after its job.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import enum
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any, ClassVar, TypeVar, cast

import anyio
import anyio.lowlevel
import torch

from dflash2.errors import StreamStateError
from dflash2.runtime.threads import ThreadPolicy, Threads, available_cores, check_threads

T = TypeVar("T")
log = logging.getLogger("dflash2")
STALL_S = 60.0  # a job running longer than this is treated as stuck (see the module docstring)


class Timed:
    """A job's result with the wall-clock interval it ran in (``time.perf_counter``)."""

    __slots__ = ("end", "start", "value")

    def __init__(self, value: Any, start: float, end: float) -> None:
        self.value, self.start, self.end = value, start, end


class _OpenMP:
    """The calling thread's OpenMP settings, through the runtime torch loaded (libgomp or libomp).

    Why dflash2 cares: libgomp lets idle team threads spin (so the next parallel region starts at
    once) only while it manages no more threads than there are cores; beyond that every region
    pays a sleep/wake-up. Measured on this project's 2-core CPU (SmolLM2-135M, one token): 34 ms
    on the only multi-threaded thread, 49-55 ms when another thread kept its own OpenMP team. So
    every parallel compute runs on one thread (the verify worker); the draft worker runs 1 thread;
    ``load`` frees the team its caller's thread acquired while loading; and the little tensor work
    dflash2 does on a caller's thread (storing a finished request's state) runs in
    :func:`one_thread`, which starts no team there.
    """

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(None)
            self._set_threads: Any = lib.omp_set_num_threads
            self._pause: Any = lib.omp_pause_resource_all
        except (OSError, AttributeError):  # no OpenMP in this build: nothing to tune
            self._set_threads = self._pause = None

    def set_threads(self, count: int) -> None:
        """Threads of the calling thread's parallel regions (its own setting: other threads keep theirs)."""
        if self._set_threads is not None:
            torch.get_num_threads()  # torch sets a thread's count at its first use there: let it, then set ours
            self._set_threads(count)

    def release(self) -> None:
        """Stop the calling thread's idle OpenMP team threads; the next parallel region starts a new team."""
        if self._pause is not None:
            self._pause(1)  # omp_pause_soft


_OMP = _OpenMP()


def release_thread_pool() -> None:
    """Free the calling thread's OpenMP team, so that dflash2's compute threads keep theirs fast."""
    _OMP.release()


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's tensor work on the calling thread alone: a thread that is not a compute
    worker (an event loop's, a caller's) must not start an OpenMP team (see ``_OpenMP``)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    _OMP.set_threads(1)
    try:
        yield
    finally:
        _OMP.set_threads(before)


def _loop_waker(event: anyio.Event) -> Callable[[], None]:
    """A callable that sets ``event`` (of the running loop) from any thread, without waiting for the loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:

        def wake() -> None:
            with suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(event.set)

        return wake
    import trio

    token = trio.lowlevel.current_trio_token()

    def wake_trio() -> None:
        with suppress(trio.RunFinishedError):  # the run has ended: nobody is waiting any more
            token.run_sync_soon(event.set)

    return wake_trio


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    SKIPPED = "skipped"


class _Job:
    """One call of ``fn`` in a worker thread: run once, or skipped if taken back while queued."""

    def __init__(
        self, fn: Callable[[], Any], threads: int | None, wake: Callable[[], None], synchronize: bool = True
    ) -> None:
        self._fn = fn
        self._threads = threads
        self._synchronize = synchronize
        self._wake = wake
        self._lock = threading.Lock()
        self.state = _State.QUEUED
        self.started = 0.0
        self._ok = False
        self._result: Any = None

    @property
    def own_threads(self) -> bool:
        """Whether the job runs on its worker's thread count (it asked for none of its own)."""
        return self._threads is None

    def take_back(self) -> bool:
        """Skip the job if it has not started; return whether it will never run."""
        with self._lock:
            if self.state is _State.QUEUED:
                self.state = _State.SKIPPED
            return self.state is _State.SKIPPED

    @property
    def done(self) -> bool:
        return self.state is _State.DONE

    def running_for(self) -> float:
        return time.perf_counter() - self.started if self.state is _State.RUNNING else 0.0

    def run(self, stream: Any, own_threads: int | None) -> None:
        """In the worker thread: run ``fn`` with inference mode (and the worker's CUDA stream) on."""
        with self._lock:
            if self.state is not _State.QUEUED:
                return
            self.state, self.started = _State.RUNNING, time.perf_counter()
        other = self._threads is not None and own_threads is not None and self._threads != own_threads
        try:
            if other:
                _OMP.set_threads(self._threads)  # type: ignore[arg-type]
            context = torch.cuda.stream(stream) if stream is not None else nullcontext()
            with torch.inference_mode(), context:
                value = self._fn()
                if stream is not None and self._synchronize:
                    stream.synchronize()
            self._ok, self._result = True, Timed(value, self.started, time.perf_counter())
        except BaseException as err:  # handed to the caller, never lost
            self._ok, self._result = False, err
        finally:
            if other:
                _OMP.set_threads(own_threads)  # type: ignore[arg-type]
            with self._lock:
                self.state = _State.DONE
            self._wake()  # never blocks, never raises

    def fail(self, err: BaseException) -> None:
        """In the worker thread: end the job with ``err`` instead of running it."""
        with self._lock:
            if self.state is not _State.QUEUED:
                return
            self.state = _State.DONE
        self._ok, self._result = False, err
        self._wake()

    def outcome(self) -> Timed:
        if not self._ok:
            raise self._result
        return cast(Timed, self._result)


class _Lane:
    """A thread and its own job queue; the job it runs now is ``current``."""

    def __init__(self, name: str, device: torch.device, threads: int | None, policy: ThreadPolicy | None) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.current: _Job | None = None
        self.thread = threading.Thread(target=_serve, args=(self, device, threads, policy), name=name, daemon=True)

    def stop(self) -> None:
        self.jobs.put(None)


def _serve(lane: _Lane, device: torch.device, threads: int | None, policy: ThreadPolicy | None) -> None:
    """A worker thread's loop; it holds no reference to its ``Worker``, so that can be collected.
    With a ``policy`` the thread count of jobs that do not ask for one is the policy's."""
    broken: BaseException | None = None
    try:
        stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    except Exception as err:  # every job gets this error instead of waiting for a thread that cannot run it
        stream, broken = None, err
    if threads is not None:
        _OMP.set_threads(threads)
    while (job := lane.jobs.get()) is not None:
        lane.current = job
        try:
            if broken is not None:
                job.fail(broken)
            else:
                if policy is not None and job.own_threads and policy.due(time.perf_counter()):
                    threads = policy.measure(_OMP.set_threads)
                job.run(stream, threads)
        except BaseException:  # pragma: no cover - job.run hands every error to its caller
            log.exception("dflash2 worker %s: a job failed outside its guard", threading.current_thread().name)
        lane.current = None


# Every worker thread is stopped and joined at interpreter exit: a thread that has run torch
# must not still be exiting while the process tears torch down (that aborts the process).
_LANES: weakref.WeakSet[_Lane] = weakref.WeakSet()
_LANES_LOCK = threading.Lock()


class Worker:
    """One dedicated thread that runs compute jobs in order, awaitable from asyncio or trio.

    Inside the thread ``torch.inference_mode`` is on (it is thread-local) and, on CUDA, the
    worker's own stream is current, so a drafter and a verifier on two workers overlap on the
    GPU too. On the CPU ``threads`` is the number of cores its jobs use (a job may ask for
    another count). See the module docstring for how jobs meet their callers, cancellation,
    errors and stuck jobs. The thread ends with ``close()``, when the worker is garbage
    collected, or at interpreter exit.
    """

    def __init__(
        self,
        name: str,
        device: torch.device,
        threads: int | None = None,
        stall_s: float = STALL_S,
        policy: ThreadPolicy | None = None,
    ) -> None:
        self.name = name
        self.device = device
        cpu = device.type == "cpu"
        self.policy = policy if cpu else None
        self.threads = (policy.limit if policy is not None else threads) if cpu else None
        self.stall_s = stall_s
        self.replaced = 0  # threads that died or were retired as stuck, and were replaced
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []  # the live lane, when there is one (a list the finalizer can hold)
        self._closed = False
        weakref.finalize(self, _stop_lanes, self._lanes)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def threads_now(self) -> int | None:
        """The thread count of jobs that ask for none: the policy's current choice, if it has one."""
        return self.policy.current if self.policy is not None else self.threads

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise StreamStateError("these compute threads were closed; load the model again to generate.")
            lane = self._lanes[0] if self._lanes else None
            if lane is None:
                lane = self._start_lane()
            elif not lane.thread.is_alive() or (lane.current is not None and lane.current.running_for() > self.stall_s):
                lane = self._replace(lane)
            lane.jobs.put(job)

    def _start_lane(self) -> _Lane:
        lane = _Lane(f"dflash2-{self.name}", self.device, self.threads_now, self.policy)
        lane.thread.start()
        self._lanes[:] = [lane]
        with _LANES_LOCK:
            _LANES.add(lane)
        return lane

    def _replace(self, old: _Lane) -> _Lane:
        """A fresh thread for the jobs queued on ``old``, whose thread died or is stuck in a job."""
        why = "died" if not old.thread.is_alive() else f"has run one job for over {self.stall_s:.0f} s"
        log.warning("dflash2 worker %s %s; its queued jobs move to a new thread", self.name, why)
        lane = self._start_lane()
        self.replaced += 1
        while True:
            try:
                job = old.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                lane.jobs.put(job)
        old.stop()  # a stuck thread ends once its job returns
        return lane

    async def run(self, fn: Callable[[], T], threads: int | None = None, synchronize: bool = True) -> Timed:
        """Run ``fn`` in the worker thread (on ``threads`` cores if given); return its value and interval.

        On CUDA the worker's stream is synchronised after ``fn`` so its tensors are ready for any
        thread; ``synchronize=False`` is for jobs that return host values only and leave work
        queued on the stream on purpose (the resident pipeline's one-step-behind reads).
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        finished = anyio.Event()
        job = _Job(fn, threads, _loop_waker(finished), synchronize)
        self._submit(job)
        try:
            await finished.wait()
        except BaseException:
            if not job.take_back():
                await self._wait_out(job, finished)
            raise
        return job.outcome()

    async def _wait_out(self, job: _Job, finished: anyio.Event) -> None:
        """After a cancellation: wait for the running job to end, at most until it counts as stuck."""
        cancelled = anyio.get_cancelled_exc_class()
        with anyio.CancelScope(shield=True):
            while not job.done and (left := self.stall_s - job.running_for()) > 0:
                try:
                    with anyio.move_on_after(left):
                        await finished.wait()
                except cancelled:  # a second native asyncio cancel; the first is re-raised after
                    continue

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the worker thread and block until it returns (for synchronous callers)."""
        finished = threading.Event()
        job = _Job(fn, None, finished.set)
        self._submit(job)
        finished.wait()
        return cast(T, job.outcome().value)

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread; later ``run`` calls raise."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes)
            self._lanes.clear()
        for lane in lanes:
            lane.stop()
            if lane.thread.is_alive() and lane.thread is not threading.current_thread():
                lane.thread.join(timeout=30)


def _stop_lanes(lanes: list[_Lane]) -> None:
    for lane in lanes:
        lane.stop()


@atexit.register
def _stop_all_threads() -> None:
    with _LANES_LOCK:
        lanes = list(_LANES)
    for lane in lanes:
        lane.stop()
    for lane in lanes:
        if lane.thread.is_alive():
            lane.thread.join(timeout=30)


class Workers:
    """The verifier's and the drafter's compute threads of a device, shared by every model on it.

    On the CPU the verify worker runs every step on ``threads`` cores (``"auto"``: as many of
    torch's threads as the process may run on, fewer while other work on the machine makes fewer
    faster, see ``runtime.threads``), except while the drafter works at the same time on the draft
    worker: then it leaves one core to the drafter, whose worker always runs a single thread (see
    ``_OpenMP`` for why only one thread may run a multi-threaded team).
    """

    _shared: ClassVar[dict[tuple[torch.device, Threads], Workers]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: torch.device, threads: Threads = "auto") -> None:
        self.device = device
        limit = min(torch.get_num_threads(), available_cores())
        self.threads = check_threads(threads) if threads != "auto" else limit
        policy = ThreadPolicy(limit) if threads == "auto" and device.type == "cpu" else None
        self.verify = Worker("verify", device, self.threads, policy=policy)
        self.draft = Worker("draft", device, 1)

    @classmethod
    def shared(cls, device: torch.device, threads: Threads = "auto") -> Workers:
        """The process-wide workers of ``device`` with ``threads`` (created on first use)."""
        with cls._shared_lock:
            workers = cls._shared.get((device, threads))
            if workers is None or workers.verify.closed:
                workers = cls._shared[(device, threads)] = Workers(device, threads)
            return workers

    @property
    def overlapped_verify_threads(self) -> int:
        """Cores the verifier keeps while the drafter runs beside it."""
        return max(1, (self.verify.threads_now or 1) - 1)

    def close(self) -> None:
        self.verify.close()
        self.draft.close()
