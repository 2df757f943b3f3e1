"""Device and dtype selection, and the compute workers that keep torch off the event loop."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

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


def _serve(jobs: queue.SimpleQueue[Callable[[Any], None] | None], device: torch.device) -> None:
    """A worker thread's loop; it holds no reference to its ``Worker``, so that can be collected."""
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    while (job := jobs.get()) is not None:
        job(stream)


class Worker:
    """One dedicated thread that runs compute jobs in order, awaitable from asyncio or trio.

    Inside the thread ``torch.inference_mode`` is on (it is thread-local) and, on CUDA, the
    worker's own stream is current, so a drafter and a verifier on two workers overlap on the
    GPU too. A job's exception is re-raised in the awaiting task; the thread lives on. A caller
    cancelled while its job runs waits for that job (one step) before the cancellation lands,
    so caches are never left half-written. The thread ends with ``close()`` or when the worker
    is garbage collected.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self._jobs: queue.SimpleQueue[Callable[[Any], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        weakref.finalize(self, self._jobs.put, None)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._closed:
                raise StreamStateError("this model was closed; load it again to generate.")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_serve, args=(self._jobs, self.device), name=f"dflash2-{self.name}", daemon=True
                )
                self._thread.start()
                with _THREADS_LOCK:
                    for ended in [t for t in _THREADS if not t.is_alive()]:
                        del _THREADS[ended]
                    _THREADS[self._thread] = self._jobs

    async def run(self, fn: Callable[[], T]) -> Timed:
        """Run ``fn`` in the worker thread; return its value with the interval it ran in."""
        self._ensure_thread()
        token = anyio.lowlevel.current_token()
        done = anyio.Event()
        box: list[Any] = []

        def job(stream: Any) -> None:
            start = time.perf_counter()
            try:
                context = torch.cuda.stream(stream) if stream is not None else nullcontext()
                with torch.inference_mode(), context:
                    value = fn()
                    if stream is not None:
                        stream.synchronize()
                box.extend((True, Timed(value, start, time.perf_counter())))
            except BaseException as err:  # handed to the awaiting task, never lost
                box.extend((False, err))
            finally:
                anyio.from_thread.run_sync(done.set, token=token)

        self._jobs.put(job)
        with anyio.CancelScope(shield=True):
            await done.wait()
        ok, result = box
        if not ok:
            raise result
        return result

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
    """The verifier's and the drafter's threads of one model; shared by all its streams."""

    def __init__(self, device: torch.device) -> None:
        self.verify = Worker("verify", device)
        self.draft = Worker("draft", device)
        self.device = device

    def close(self) -> None:
        self.verify.close()
        self.draft.close()


class ThreadBudget:
    """Splits the CPU cores between drafter and verifier while both compute at once.

    torch's intra-op thread count is process-wide, so while any overlapped phase runs each
    side gets half of the cores (1 + 1 on 2 cores); when the last one ends the full count is
    restored. On CUDA nothing changes.
    """

    _lock = threading.Lock()
    _active = 0
    _full = 0

    def __init__(self, device: torch.device) -> None:
        self.cpu = device.type == "cpu"

    def split(self) -> AbstractContextManager[Any]:
        return _Split() if self.cpu else nullcontext()


class _Split:
    def __enter__(self) -> None:
        with ThreadBudget._lock:
            if ThreadBudget._active == 0:
                ThreadBudget._full = torch.get_num_threads()
                if ThreadBudget._full >= 2:
                    torch.set_num_threads(ThreadBudget._full // 2)
            ThreadBudget._active += 1

    def __exit__(self, *exc: object) -> None:
        with ThreadBudget._lock:
            ThreadBudget._active -= 1
            if ThreadBudget._active == 0 and ThreadBudget._full >= 2:
                torch.set_num_threads(ThreadBudget._full)
