"""Device and dtype selection, and the compute workers that keep torch off the event loop."""

from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ClassVar, TypeVar, cast

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from dflash2.errors import InvalidOptionError, StreamStateError

T = TypeVar("T")
# Every worker thread is stopped and joined at interpreter exit: a thread that has run torch
# must not still be exiting while the process tears torch down (that aborts the process).
_THREADS: dict[threading.Thread, queue.SimpleQueue[Any]] = {}
_THREADS_LOCK = threading.Lock()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is the first CUDA device when there is one, else the CPU."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise InvalidOptionError(f"device must be a string such as 'auto', 'cpu' or 'cuda:0', not {device!r}.")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise InvalidOptionError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'.") from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError(f"device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'.")
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"device {device!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'.")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidOptionError(f"dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}.")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise InvalidOptionError(f"unknown dtype {dtype!r}; use 'auto' or one of {', '.join(_DTYPES)}.")
    return _DTYPES[dtype]


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
    and ``load`` frees the team its caller's thread acquired while loading.
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
            self._set_threads(count)

    def release(self) -> None:
        """Stop the calling thread's idle OpenMP team threads; the next parallel region starts a new team."""
        if self._pause is not None:
            self._pause(1)  # omp_pause_soft


_OMP = _OpenMP()


def release_thread_pool() -> None:
    """Free the calling thread's OpenMP team, so that dflash2's compute threads keep theirs fast."""
    _OMP.release()


def _serve(jobs: queue.SimpleQueue[Callable[[Any], None] | None], device: torch.device, threads: int | None) -> None:
    """A worker thread's loop; it holds no reference to its ``Worker``, so that can be collected."""
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    if threads is not None:
        _OMP.set_threads(threads)
    while (job := jobs.get()) is not None:
        job(stream)


class Worker:
    """One dedicated thread that runs compute jobs in order, awaitable from asyncio or trio.

    Inside the thread ``torch.inference_mode`` is on (it is thread-local) and, on CUDA, the
    worker's own stream is current, so a drafter and a verifier on two workers overlap on the
    GPU too. On the CPU ``threads`` is the number of cores its jobs use (a job may ask for
    another count). A job's exception is re-raised in the awaiting task; the thread lives on.
    A caller cancelled while its job runs waits for that job (one step) before the cancellation
    lands, so caches are never left half-written. The thread ends with ``close()``, when the
    worker is garbage collected, or at interpreter exit.
    """

    def __init__(self, name: str, device: torch.device, threads: int | None = None) -> None:
        self.name = name
        self.device = device
        self.threads = threads if device.type == "cpu" else None
        self._jobs: queue.SimpleQueue[Callable[[Any], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        weakref.finalize(self, self._jobs.put, None)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._closed:
                raise StreamStateError("these compute threads were closed; load the model again to generate.")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_serve,
                    args=(self._jobs, self.device, self.threads),
                    name=f"dflash2-{self.name}",
                    daemon=True,
                )
                self._thread.start()
                with _THREADS_LOCK:
                    for ended in [t for t in _THREADS if not t.is_alive()]:
                        del _THREADS[ended]
                    _THREADS[self._thread] = self._jobs

    def _job(self, fn: Callable[[], T], threads: int | None, done: Callable[[], None], box: list[Any]) -> Any:
        def job(stream: Any) -> None:
            start = time.perf_counter()
            other = threads is not None and self.threads is not None and threads != self.threads
            try:
                if other:
                    _OMP.set_threads(threads)  # type: ignore[arg-type]
                context = torch.cuda.stream(stream) if stream is not None else nullcontext()
                with torch.inference_mode(), context:
                    value = fn()
                    if stream is not None:
                        stream.synchronize()
                box.extend((True, Timed(value, start, time.perf_counter())))
            except BaseException as err:  # handed to the caller, never lost
                box.extend((False, err))
            finally:
                if other:
                    _OMP.set_threads(self.threads)  # type: ignore[arg-type]
                done()

        return job

    async def run(self, fn: Callable[[], T], threads: int | None = None) -> Timed:
        """Run ``fn`` in the worker thread (on ``threads`` cores if given); return its value and interval."""
        self._ensure_thread()
        token = anyio.lowlevel.current_token()
        finished = anyio.Event()
        box: list[Any] = []
        self._jobs.put(self._job(fn, threads, lambda: anyio.from_thread.run_sync(finished.set, token=token), box))
        with anyio.CancelScope(shield=True):
            await finished.wait()
        ok, result = box
        if not ok:
            raise result
        return result

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the worker thread and block until it returns (for synchronous callers)."""
        self._ensure_thread()
        finished = threading.Event()
        box: list[Any] = []
        self._jobs.put(self._job(fn, None, finished.set, box))
        finished.wait()
        ok, result = box
        if not ok:
            raise result
        return cast(T, result.value)

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread; later ``run`` calls raise."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=30)


@atexit.register
def _stop_all_threads() -> None:
    with _THREADS_LOCK:
        threads = list(_THREADS.items())
        _THREADS.clear()
    for _, jobs in threads:
        jobs.put(None)
    for thread, _ in threads:
        thread.join(timeout=30)


class Workers:
    """The verifier's and the drafter's compute threads of a device, shared by every model on it.

    On the CPU the verify worker runs every step on all of torch's threads, except while the
    drafter works at the same time on the draft worker: then it leaves one core to the drafter,
    whose worker always runs a single thread (see ``_OpenMP`` for why only one thread may run a
    multi-threaded team).
    """

    _shared: ClassVar[dict[torch.device, Workers]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        self.device = device
        self.threads = threads or torch.get_num_threads()
        self.verify = Worker("verify", device, self.threads)
        self.draft = Worker("draft", device, 1)

    @classmethod
    def shared(cls, device: torch.device) -> Workers:
        """The process-wide workers of ``device`` (created on first use)."""
        with cls._shared_lock:
            workers = cls._shared.get(device)
            if workers is None or workers.verify._closed:
                workers = cls._shared[device] = Workers(device)
            return workers

    @property
    def overlapped_verify_threads(self) -> int:
        """Cores the verifier keeps while the drafter runs beside it."""
        return max(1, self.threads - 1)

    def close(self) -> None:
        self.verify.close()
        self.draft.close()
