"""How many tokens to draft each step: the length that maximises expected tokens per second.

A step that drafts k tokens verifies k + 1 and emits the accepted drafts plus one token. If
``p[j]`` is the chance that draft j + 1 is right given that the ones before it were, the step
yields ``1 + sum_{i<k} prod_{j<=i} p[j]`` tokens on average; it costs the target's forward over
k + 1 tokens plus the drafting. So the policy keeps three measurements, all running means:

- acceptance by position, counted per request and started from the model's running totals
  (a new request trusts the model's history as much as a few steps of its own);
- the target's forward time by block length, measured on this device when a drafter is set and
  kept current by every serial step;
- the drafter's time by draft length;
- for steps that share a packed forward with other streams (``engine.batch``), a line fitted per
  batch size B: seconds = fixed_B + per_token_B * tokens. A stream's step in such a batch costs its
  share of the fixed part plus its own rows, fixed_B / B + per_token_B * (k + 1) + drafting, so the
  more streams share a forward the less a draft has to save to pay for its rows.

and drafts ``argmax_k yield(k) / cost(k)`` tokens, with k = 0 a plain step that drafts nothing.
When drafting stops paying the policy still tries a draft now and then, after a wait that doubles
while drafting keeps losing, so a request whose text turns repetitive is noticed. Output never
depends on k (each step is lossless whatever its length); seeded sampling requests keep the
full length, so that a seed gives the same tokens whatever the timing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from dflash2.errors import InvalidOptionError

LengthMode = Literal["auto", "fixed"]
DECAY = 0.98  # the model's acceptance totals forget old requests slowly
EMA = 0.25  # weight of a new timing in a running mean
MIN_SPREAD = 1.0  # variance of the token counts (tokens²) a packed-forward line needs before it is used


def expected_yield(accept: Sequence[float], k: int) -> float:
    """Expected tokens emitted by a step drafting ``k`` tokens: 1 + sum of prod(accept[:i + 1]), i < k."""
    total, reach = 1.0, 1.0
    for p in accept[:k]:
        reach *= p
        total += reach
    return total


class _Line:
    """A least-squares line seconds = fixed + per_token * tokens over decayed sums of observations."""

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self._n, self._x, self._y = d * self._n + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_token)``, both ≥ 0, or ``None`` while the token counts seen barely vary."""
        if self._n < 2:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        if var < MIN_SPREAD:
            return None
        slope = max(0.0, (self._xy / self._n - mean_x * mean_y) / var)
        return max(0.0, mean_y - slope * mean_x), slope


def best_length(accept: Sequence[float], cost: Sequence[float], limit: int, lowest: int = 0) -> int:
    """The k in ``[lowest, limit]`` with the most expected tokens per second; ``cost[k]`` is a step's seconds."""
    best, best_rate = lowest, -1.0
    for k in range(lowest, limit + 1):
        rate = expected_yield(accept, k) / cost[k] if cost[k] > 0 else float("inf")
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class _Means:
    """Running means of seconds by length; a length never measured takes its nearest measured neighbour's."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, length: int, seconds: float) -> None:
        old = self._seconds.get(length)
        self._seconds[length] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def at(self, length: int) -> float | None:
        if not self._seconds:
            return None
        if length in self._seconds:
            return self._seconds[length]
        nearest = min(self._seconds, key=lambda n: (abs(n - length), -n))
        return self._seconds[nearest]

    def known(self) -> dict[int, float]:
        return dict(self._seconds)


@dataclass
class DraftLengthPolicy:
    """The model's side: forward and drafting times, acceptance totals; :meth:`start` gives a request's side.

    ``mode="fixed"`` always drafts as far as the block allows (what every step did before).
    """

    mode: LengthMode = "auto"
    prior_weight: float = 4.0  # steps of its own a request needs to outweigh the model's totals
    recheck_every: int = 8  # plain steps before a draft is tried again ...
    max_recheck_every: int = 512  # ... doubling while drafting keeps losing, up to this many
    _verify: _Means = field(default_factory=_Means)
    _draft: _Means = field(default_factory=_Means)
    _packed: dict[int, _Line] = field(default_factory=dict)  # by batch size
    _accepted: list[float] = field(default_factory=list)  # by position, decayed
    _tried: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "fixed"):
            raise InvalidOptionError(f"mode must be 'auto' or 'fixed', not {self.mode!r}.")
        if not isinstance(self.prior_weight, (int, float)) or self.prior_weight <= 0:
            raise InvalidOptionError(f"prior_weight must be a number > 0, got {self.prior_weight!r}.")
        for name in ("recheck_every", "max_recheck_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive int, got {value!r}.")

    def start(self, fixed: bool = False) -> DraftLength:
        """A request's policy; ``fixed`` (seeded sampling) keeps the full length."""
        return DraftLength(self, fixed or self.mode == "fixed")

    def record_verify(self, tokens: int, seconds: float) -> None:
        """A target step (forward + acceptance) over ``tokens`` tokens took ``seconds``."""
        with self._lock:
            self._verify.record(tokens, seconds)

    def record_packed(self, rows: int, tokens: int, seconds: float) -> None:
        """A packed target forward over ``rows`` streams' blocks, ``tokens`` in all, took ``seconds``."""
        with self._lock:
            self._packed.setdefault(rows, _Line()).record(tokens, seconds)

    def record_draft(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._draft.record(tokens, seconds)

    def record_outcome(self, proposed: int, accepted: int) -> None:
        with self._lock:
            _count(self._accepted, self._tried, proposed, accepted, DECAY)

    def prior(self, length: int) -> list[float]:
        """The model's acceptance rate by position (Laplace-smoothed: 1/2 where nothing was seen)."""
        with self._lock:
            return [
                (self._accepted[i] + 1) / (self._tried[i] + 2) if i < len(self._tried) else 0.5 for i in range(length)
            ]

    def costs(self, limit: int, batch: int = 1) -> list[float] | None:
        """Seconds of a step drafting k = 0 .. ``limit`` tokens, or ``None`` before any forward was timed.

        ``batch`` > 1: the step's share of a packed forward of that many streams, once that batch
        size's line is known (until then, and alone, a forward of its own)."""
        with self._lock:
            line = self._packed[batch].fit() if batch > 1 and batch in self._packed else None
            if line is None and self._verify.at(1) is None:
                return None
            draft = [0.0] + [self._draft.at(k) or 0.0 for k in range(1, limit + 1)]
            if line is not None:
                fixed, per_token = line
                return [fixed / batch + per_token * (k + 1) + draft[k] for k in range(limit + 1)]
            return [(self._verify.at(k + 1) or 0.0) + draft[k] for k in range(limit + 1)]

    def summary(self) -> dict[str, dict[int, float]]:
        with self._lock:
            lines = {b: line.fit() for b, line in self._packed.items()}
            packed = {b: fit[0] for b, fit in lines.items() if fit is not None}
            per_token = {b: fit[1] for b, fit in lines.items() if fit is not None}
            return {
                "verify_s": self._verify.known(),
                "draft_s": self._draft.known(),
                "packed_fixed_s": packed,
                "packed_per_token_s": per_token,
            }


def _count(accepted: list[float], tried: list[float], proposed: int, kept: int, decay: float = 1.0) -> None:
    """Positions 1..kept were right; position kept + 1 (if proposed) was wrong."""
    seen = min(proposed, kept + 1)
    while len(tried) < seen:
        accepted.append(0.0)
        tried.append(0.0)
    if decay != 1.0:
        for i in range(len(tried)):
            accepted[i] *= decay
            tried[i] *= decay
    for i in range(seen):
        tried[i] += 1
        accepted[i] += 1 if i < kept else 0


class DraftLength:
    """One request's draft length: its own acceptance counts on top of the model's."""

    def __init__(self, policy: DraftLengthPolicy, fixed: bool) -> None:
        self.policy = policy
        self.fixed = fixed
        self._accepted: list[float] = []
        self._tried: list[float] = []
        self._plain_steps = 0  # in a row, chosen because drafting did not pay
        self._wait = policy.recheck_every
        self.chosen: list[int] = []  # every length chosen (for stats and tests)

    def accept_rates(self, length: int) -> list[float]:
        prior, w = self.policy.prior(length), self.policy.prior_weight
        own = [(self._accepted[i], self._tried[i]) if i < len(self._tried) else (0.0, 0.0) for i in range(length)]
        return [(a + w * p) / (n + w) for (a, n), p in zip(own, prior, strict=True)]

    def choose(self, limit: int, batch: int = 1) -> int:
        """Tokens to draft now, at most ``limit``; ``batch``: the streams whose steps share this forward."""
        k = self._choose(limit, batch) if limit > 0 else 0
        self.chosen.append(k)
        return k

    def _choose(self, limit: int, batch: int) -> int:
        costs = self.policy.costs(limit, batch)
        if self.fixed or costs is None:
            return limit
        accept = self.accept_rates(limit)
        k = best_length(accept, costs, limit)
        if k > 0:
            self._plain_steps, self._wait = 0, self.policy.recheck_every
            return k
        self._plain_steps += 1
        if self._plain_steps < self._wait:
            return 0
        # drafting has not paid for a while: try the best draft again, and wait longer next time
        self._plain_steps = 0
        self._wait = min(2 * self._wait, self.policy.max_recheck_every)
        return best_length(accept, costs, limit, lowest=1)

    def record_outcome(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            _count(self._accepted, self._tried, proposed, accepted)
            self.policy.record_outcome(proposed, accepted)
