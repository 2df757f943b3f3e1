"""How many cores the verify thread computes on: all it may use, unless other work on the machine
makes fewer faster.

A parallel region of torch's OpenMP splits its work evenly between its threads and ends when the
last one is done. When another busy process shares one of those cores, the thread that runs
there gets part of it, every region waits for that thread, and a forward made of hundreds of
regions slows by far more than the core it lost: measured on a 2-core AMD EPYC (SmolLM2-135M,
plain decoding, 64 tokens), 29.6 tokens/s on 2 threads and 20.1 on 1 alone, but 8.4 on 2 and 21.7
on 1 beside one busy process. So with ``threads="auto"`` the verify thread measures, every
``every_s`` seconds before a job, a fixed parallel workload at its current thread count and at
one fewer and one more, and computes on whichever was fastest until the next measurement (a
change must beat the current count by ``margin``). Measuring takes 30-50 ms on 2 cores (under 1 %
of the time at one measurement in 5 s); a change of the load is followed within ``every_s``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from dflash2.errors import InvalidOptionError

Threads = int | Literal["auto"]


def check_threads(threads: object) -> int:
    """``threads`` as a thread count, or a clear error."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise InvalidOptionError(f"threads must be a positive int or 'auto', got {threads!r}.")
    return threads


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class _Workload:
    """Matrix products of a fixed size, a few milliseconds in all: long enough to span the time
    slices a busy neighbour takes (a product within one slice never sees it), with the same rows
    per thread on any machine (``rows_per_thread`` x ``limit`` rows)."""

    def __init__(self, limit: int, rows_per_thread: int = 192, size: int = 384, repeats: int = 4) -> None:
        generator = torch.Generator().manual_seed(0)
        self._a = torch.randn(rows_per_thread * limit, size, generator=generator)
        self._b = torch.randn(size, size, generator=generator)
        self._repeats = repeats

    def __call__(self) -> None:
        with torch.inference_mode():
            for _ in range(self._repeats):
                torch.mm(self._a, self._b)


@dataclass
class ThreadPolicy:
    """The verify thread's thread count, at most ``limit``; see the module docstring."""

    limit: int
    every_s: float = 5.0
    margin: float = 0.1  # a new count must be this much faster than the current one
    trials: int = 3  # timings per count; their median counts
    workload: Callable[[], None] | None = field(default=None, repr=False)  # None: fixed matrix products
    current: int = field(init=False)
    _next_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.current = check_threads(self.limit)

    def due(self, now: float) -> bool:
        """Whether the next job should first measure (never with one core to choose from)."""
        return self.limit > 1 and now >= self._next_s

    def measure(self, set_threads: Callable[[int], None]) -> int:
        """Time the workload at the current count and its neighbours (through ``set_threads``, on
        the calling thread); keep the fastest; return the count now current."""
        if self.workload is None:
            self.workload = _Workload(self.limit)
        workload = self.workload
        seconds: dict[int, float] = {}
        for count in sorted({max(1, self.current - 1), self.current, min(self.limit, self.current + 1)}):
            set_threads(count)
            workload()  # the team at this size is started
            runs = []
            for _ in range(self.trials):
                start = time.perf_counter()
                workload()
                runs.append(time.perf_counter() - start)
            seconds[count] = statistics.median(runs)
        best = min(seconds, key=seconds.__getitem__)
        if seconds[best] < (1 - self.margin) * seconds[self.current]:
            self.current = best
        set_threads(self.current)
        self._next_s = time.perf_counter() + self.every_s
        return self.current
