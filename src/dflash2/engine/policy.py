"""When drafting ahead pays: measured, per model and drafter, never assumed.

On one device the drafter and the verifier share compute (on a CPU: cores and memory
bandwidth), so overlapping them can lose. ``OverlapPolicy`` times both schedules —
*overlapped* (pre-draft during verification, cores split) and *serial* (sync scheduling) —
as seconds per emitted token, keeps the faster one and re-checks the other now and then:
each re-check that confirms the choice doubles the wait before the next one (a schedule that
keeps losing costs ever less), and a change of the lead brings the short wait back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

from dflash2.errors import InvalidOptionError

Schedule = Literal["auto", "overlap", "serial"]


@dataclass
class _Mean:
    total: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        # exponential decay keeps the estimate current as the text (and acceptance) changes
        self.total = 0.9 * self.total + seconds
        self.tokens = 0.9 * self.tokens + tokens

    @property
    def per_token(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0


@dataclass
class OverlapPolicy:
    """``schedule="auto"`` measures; ``"overlap"`` / ``"serial"`` force one schedule (tests, benchmarks)."""

    schedule: Schedule = "auto"
    explore: int = 6  # steps of each schedule before the first decision
    recheck_every: int = 48  # then one trial step of the other schedule after this many steps ...
    max_recheck_every: int = 1536  # ... doubling while the choice holds, up to this many
    _stats: dict[bool, _Mean] = field(default_factory=lambda: {True: _Mean(), False: _Mean()})
    _steps: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _wait: int = 0  # steps between re-checks now
    _next_check: int = 0  # step count of the next re-check
    _leader: bool | None = None

    def __post_init__(self) -> None:
        if self.schedule not in ("auto", "overlap", "serial"):
            raise InvalidOptionError(f"schedule must be 'auto', 'overlap' or 'serial', not {self.schedule!r}.")
        for name in ("explore", "recheck_every", "max_recheck_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive int, got {value!r}.")

    def overlap_next(self) -> bool:
        """Whether the next step should pre-draft while verifying."""
        if self.schedule != "auto":
            return self.schedule == "overlap"
        with self._lock:
            for mode in (True, False):
                if self._steps[mode] < self.explore:
                    return mode
            best = self._stats[True].per_token <= self._stats[False].per_token
            total = self._steps[True] + self._steps[False]
            if best != self._leader:  # a new lead (or the first decision): re-check soon
                self._leader, self._wait = best, self.recheck_every
                self._next_check = total + self._wait
            if total < self._next_check:
                return best
            self._next_check = total + self._wait
            self._wait = min(2 * self._wait, self.max_recheck_every)
            return not best

    def record(self, overlapped: bool, seconds: float, tokens: int) -> None:
        with self._lock:
            self._steps[overlapped] += 1
            self._stats[overlapped].add(seconds, tokens)

    def summary(self) -> dict[str, float]:
        with self._lock:
            return {
                "overlapped_s_per_token": self._stats[True].per_token,
                "serial_s_per_token": self._stats[False].per_token,
            }
