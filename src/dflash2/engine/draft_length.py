"""How many tokens to draft each step: the length that maximises expected tokens per second.

A step that drafts k tokens verifies k + 1 and emits the accepted drafts plus one token. If
``p[j]`` is the chance that draft j + 1 is right given that the ones before it were, the step
yields ``1 + sum_{i<k} prod_{j<=i} p[j]`` tokens on average; it costs the target's forward over
k + 1 tokens plus the drafting. So the policy keeps these measurements, all running means:

- acceptance by position, counted per request and started from the model's running totals
  (a new request trusts the model's history as much as a few steps of its own);
- the target's forward time by block length, measured on this device when a drafter is set and
  kept current by every serial step;
- the drafter's time as a line in the draft length (fixed + per token: one forward for a block
  drafter, one per token for an autoregressive one), timed at load and by every draft but a
  request's first from each source (where a model drafter also prefills its cache on the prompt:
  a cost of the request, not of the draft's length), less the time a drafter reports it spent
  reading text it had fallen behind on (``Draft.catch_up_s``: steps another source drafted, or
  none did);
- for steps that share a packed forward with other streams (``engine.batch``), a line fitted per
  batch size B: seconds = fixed_B + per_token_B * tokens. A stream's step in such a batch costs its
  share of the fixed part plus its own rows, fixed_B / B + per_token_B * (k + 1) + drafting, so the
  more streams share a forward the less a draft has to save to pay for its rows;

and drafts ``argmax_k yield(k) / cost(k)`` tokens, with k = 0 a plain step that drafts nothing.
A drafter made of several (prompt lookup, then a model) keeps one set of drafting measurements
per source, since a lookup's drafts are free and right or wrong in long runs.

Drafters that draft token by token also report how sure they are of each token; for them the
step does not stop at a length fixed in advance: after each token the drafter asks
:meth:`DraftLength.keep_drafting`, which maps its confidence to a chance of acceptance (learnt
per source from outcomes, by confidence bin) and drafts on while drafting further is expected
to raise the step's tokens per second: the next token, or a few more where the target's forward
cost rises in a jump that one token alone does not pay for.

A greedy drafter may also offer its next choices for each draft token (``Draft.alternatives``).
Verifying one beside the draft, as a side branch of the same target forward, costs a row; if
the draft goes wrong exactly there and the target picks that alternative, the branch's row
already holds the next token, one more token for the step. So the policy verifies, of the
alternatives, those whose expected tokens (the chance to reach the position times the chance
the alternative is the target's, learnt by its probability as for draft tokens) raise the
step's expected tokens per second most, within the block lengths whose forward was timed: on a
device where a forward over a few more rows costs little more, a step gains tokens at no cost.

When drafting stops paying the policy still tries a draft now and then, after a wait that doubles
while drafting keeps losing, so a request whose text turns repetitive is noticed. Output never
depends on k (each step is lossless whatever its length); seeded sampling requests keep the
full length, so that a seed gives the same tokens whatever the timing.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from dflash2.drafters.base import MODEL_SOURCE as SOURCE
from dflash2.errors import InvalidOptionError

LengthMode = Literal["auto", "fixed"]
BranchMode = Literal["auto", "off", "all"]
DECAY = 0.98  # the model's acceptance totals forget old requests slowly
EMA = 0.25  # weight of a new timing in a running mean
MIN_SPREAD = 1.0  # variance of the token counts (tokens²) a fitted line needs before it is used
CONFIDENCE_BINS = (0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.97, 0.99)  # upper edges; a last bin up to 1


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


def best_branches(
    chances: Sequence[float],
    alternatives: Sequence[Sequence[float]],
    verify: Sequence[float],
    drafting: float,
    taken: float = 0.0,
) -> list[tuple[int, int]]:
    """Which alternatives to verify beside a draft, as ``(draft index, rank)``, sorted.

    ``chances[i]``: the chance draft token i is right given the ones before it; ``alternatives[i][r]``:
    the chance the r-th alternative at i is the target's token given that position is reached;
    ``verify[n]``: seconds of a target forward over n rows (n up to ``len(verify) - 1``, the most
    rows allowed); ``drafting``: the step's drafting seconds; ``taken``: what a taken branch
    costs besides its row (the drafter then catches up one more token). Alternatives go in by
    expected tokens, as many as give the most expected tokens per second.
    """
    k = len(chances)
    values: list[tuple[float, int, int]] = []
    reach = 1.0
    for i in range(k):
        values += [(reach * chance, i, r) for r, chance in enumerate(alternatives[i])]
        reach *= chances[i]
    values.sort(key=lambda v: -v[0])
    tokens = expected_yield(chances, k)
    best, best_rate = 0, tokens / (verify[k + 1] + drafting)
    extra = 0.0
    for m, (value, _, _) in enumerate(values[: max(0, len(verify) - k - 2)], 1):
        tokens += value
        extra += value * taken
        rate = tokens / (verify[k + 1 + m] + drafting + extra)
        if rate > best_rate:
            best, best_rate = m, rate
    return sorted((i, r) for _, i, r in values[:best])


def worth_more(yielded: float, reach: float, chance: float, costs: Sequence[float], drafted: int) -> bool:
    """Whether drafting on raises a step's expected tokens per second.

    The step has drafted ``drafted`` tokens and is expected to yield ``yielded`` tokens for
    ``costs[drafted]`` seconds; its last draft is reached (every draft before it right) with
    probability ``reach``, and each further draft is taken to be right with probability
    ``chance``. Drafting on pays if stopping at any longer length (costing ``costs[k]``) would
    yield more per second: a step's cost rises in jumps where the target's forward takes another
    kernel tile, so the next token alone may not pay where a few more would.
    """
    rate = yielded / costs[drafted]
    more = yielded
    for k in range(drafted + 1, len(costs)):
        reach *= chance
        more += reach
        if more / costs[k] > rate:
            return True
    return False


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


class _Confidence:
    """Acceptance by the drafter's confidence in its token (decayed counts per bin). A bin with few
    outcomes leans on the source's acceptance over every bin, and that, while it has few outcomes
    itself, on the confidence: as if the drafter were calibrated until it shows otherwise."""

    def __init__(self) -> None:
        self._right = [0.0] * (len(CONFIDENCE_BINS) + 1)
        self._seen = [0.0] * (len(CONFIDENCE_BINS) + 1)
        self._all_right = self._all_seen = 0.0

    def record(self, confidence: float, right: bool) -> None:
        i = bisect.bisect_left(CONFIDENCE_BINS, confidence)
        self._right[i] = DECAY * self._right[i] + right
        self._seen[i] = DECAY * self._seen[i] + 1
        self._all_right = DECAY * self._all_right + right
        self._all_seen = DECAY * self._all_seen + 1

    def chance(self, confidence: float, weight: float) -> float:
        i = bisect.bisect_left(CONFIDENCE_BINS, confidence)
        overall = (self._all_right + weight * confidence) / (self._all_seen + weight)
        return (self._right[i] + weight * overall) / (self._seen[i] + weight)

    def known(self) -> dict[float, float]:
        edges = (*CONFIDENCE_BINS, 1.0)
        return {edges[i]: self._right[i] / self._seen[i] for i in range(len(edges)) if self._seen[i] > 0}


@dataclass
class _Source:
    """What one drafting source measured: its cost by draft length and acceptance by position / confidence."""

    line: _Line = field(default_factory=_Line)
    means: _Means = field(default_factory=_Means)
    accepted: list[float] = field(default_factory=list)  # by position, decayed
    tried: list[float] = field(default_factory=list)
    confidence: _Confidence = field(default_factory=_Confidence)
    alternatives: _Confidence = field(default_factory=_Confidence)  # side branches, by their probability
    confident: bool = False  # its drafts report confidence: it asks keep_drafting token by token

    def seconds(self, k: int) -> float:
        """Seconds to draft ``k`` tokens (0 while nothing was timed)."""
        if k == 0:
            return 0.0
        line = self.line.fit()
        if line is not None:
            return line[0] + line[1] * k
        return self.means.at(k) or 0.0


@dataclass
class DraftLengthPolicy:
    """The model's side: forward and drafting times, acceptance totals; :meth:`start` gives a request's side.

    ``mode="fixed"`` always drafts as far as the block allows (what every step did before).
    ``branches``: ``"auto"`` verifies the alternatives that pay (see the module docstring),
    ``"off"`` none, ``"all"`` every one offered (as far as the timed block lengths reach).
    """

    mode: LengthMode = "auto"
    branches: BranchMode = "auto"
    prior_weight: float = 4.0  # steps of its own a request needs to outweigh the model's totals
    recheck_every: int = 8  # plain steps before a draft is tried again ...
    max_recheck_every: int = 512  # ... doubling while drafting keeps losing, up to this many
    _verify: _Means = field(default_factory=_Means)
    _packed: dict[int, _Line] = field(default_factory=dict)  # by batch size
    _sources: dict[str, _Source] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "fixed"):
            raise InvalidOptionError(f"mode must be 'auto' or 'fixed', not {self.mode!r}.")
        if self.branches not in ("auto", "off", "all"):
            raise InvalidOptionError(f"branches must be 'auto', 'off' or 'all', not {self.branches!r}.")
        if not isinstance(self.prior_weight, (int, float)) or self.prior_weight <= 0:
            raise InvalidOptionError(f"prior_weight must be a number > 0, got {self.prior_weight!r}.")
        for name in ("recheck_every", "max_recheck_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive int, got {value!r}.")

    def start(self, fixed: bool = False) -> DraftLength:
        """A request's policy; ``fixed`` (seeded sampling) keeps the full length."""
        return DraftLength(self, fixed or self.mode == "fixed")

    def _source(self, source: str) -> _Source:
        return self._sources.setdefault(source, _Source())

    def record_verify(self, tokens: int, seconds: float) -> None:
        """A target step (forward + acceptance) over ``tokens`` tokens took ``seconds``."""
        with self._lock:
            self._verify.record(tokens, seconds)

    def record_packed(self, rows: int, tokens: int, seconds: float) -> None:
        """A packed target forward over ``rows`` streams' blocks, ``tokens`` in all, took ``seconds``."""
        with self._lock:
            self._packed.setdefault(rows, _Line()).record(tokens, seconds)

    def record_draft(self, tokens: int, seconds: float, source: str = SOURCE) -> None:
        """``source`` drafted ``tokens`` tokens in ``seconds``."""
        with self._lock:
            measured = self._source(source)
            measured.line.record(tokens, seconds)
            measured.means.record(tokens, seconds)

    def record_outcome(
        self, proposed: int, accepted: int, source: str = SOURCE, confidence: Sequence[float] = ()
    ) -> None:
        """``accepted`` of ``proposed`` drafts of ``source`` were right; ``confidence``: the
        drafter's, per draft token, when it reports it."""
        with self._lock:
            measured = self._source(source)
            _count(measured.accepted, measured.tried, proposed, accepted, DECAY)
            measured.confident = measured.confident or bool(confidence)
            for i, sure in enumerate(confidence[: accepted + 1]):
                measured.confidence.record(sure, i < accepted)

    def record_branches(self, outcomes: Sequence[tuple[float, bool]], source: str = SOURCE) -> None:
        """Side branches of ``source`` whose position was reached: ``(probability, taken)`` each."""
        with self._lock:
            measured = self._source(source)
            for probability, taken in outcomes:
                measured.alternatives.record(probability, taken)

    def branch_chance(self, probability: float, source: str = SOURCE) -> float:
        """How likely an alternative of this probability is the target's token where it is reached."""
        with self._lock:
            return self._source(source).alternatives.chance(probability, self.prior_weight)

    def draft_seconds(self, tokens: int, source: str = SOURCE) -> float:
        """Seconds ``source`` takes to draft ``tokens`` tokens, as measured (0 before any timing)."""
        with self._lock:
            return self._source(source).seconds(tokens)

    def verify_seconds(self) -> list[float]:
        """Seconds of a target forward over n = 0 .. the most rows timed (0 for n = 0; a length
        never timed takes its nearest timed neighbour's)."""
        with self._lock:
            known = self._verify.known()
            return [0.0, *(self._verify.at(n) or 0.0 for n in range(1, max(known) + 1))] if known else []

    def prior(self, length: int, source: str = SOURCE) -> list[float]:
        """The model's acceptance rate by position (Laplace-smoothed: 1/2 where nothing was seen)."""
        with self._lock:
            measured = self._source(source)
            a, n = measured.accepted, measured.tried
            return [(a[i] + 1) / (n[i] + 2) if i < len(n) else 0.5 for i in range(length)]

    def chance(self, confidence: float, source: str = SOURCE) -> float:
        """How likely a draft token the drafter is ``confidence`` sure of is right (learnt by bin)."""
        with self._lock:
            return self._source(source).confidence.chance(confidence, self.prior_weight)

    def confident(self, source: str = SOURCE) -> bool:
        """Whether ``source`` reports its confidence per token (then :meth:`DraftLength.keep_drafting` stops it)."""
        with self._lock:
            return self._source(source).confident

    def costs(self, limit: int, batch: int = 1, source: str = SOURCE) -> list[float] | None:
        """Seconds of a step drafting k = 0 .. ``limit`` tokens, or ``None`` before any forward was timed.

        ``batch`` > 1: the step's share of a packed forward of that many streams, once that batch
        size's line is known (until then, and alone, a forward of its own)."""
        with self._lock:
            line = self._packed[batch].fit() if batch > 1 and batch in self._packed else None
            if line is None and self._verify.at(1) is None:
                return None
            measured = self._source(source)
            draft = [measured.seconds(k) for k in range(limit + 1)]
            if line is not None:
                fixed, per_token = line
                return [fixed / batch + per_token * (k + 1) + draft[k] for k in range(limit + 1)]
            return [(self._verify.at(k + 1) or 0.0) + draft[k] for k in range(limit + 1)]

    def summary(self) -> dict[str, dict[int, float]]:
        with self._lock:
            lines = {b: line.fit() for b, line in self._packed.items()}
            packed = {b: fit[0] for b, fit in lines.items() if fit is not None}
            per_token = {b: fit[1] for b, fit in lines.items() if fit is not None}
            drafting = self._sources.get(SOURCE, _Source())
            return {
                "verify_s": self._verify.known(),
                "draft_s": {k: drafting.seconds(k) for k in drafting.means.known()},
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
        self._own: dict[str, tuple[list[float], list[float]]] = {}  # by source: accepted, tried
        self._plain_steps = 0  # in a row, chosen because drafting did not pay
        self._wait = policy.recheck_every
        self.chosen: list[int] = []  # every length chosen (for stats and tests)
        # the step being drafted: its source, costs by length, expected yield so far and reach
        self.source = SOURCE
        self._costs: list[float] | None = None
        self._yielded = self._reach = 1.0

    def accept_rates(self, length: int, source: str = SOURCE) -> list[float]:
        prior, w = self.policy.prior(length, source), self.policy.prior_weight
        accepted, tried = self._own.get(source, ([], []))
        own = [(accepted[i], tried[i]) if i < len(tried) else (0.0, 0.0) for i in range(length)]
        return [(a + w * p) / (n + w) for (a, n), p in zip(own, prior, strict=True)]

    def choose(self, limit: int, batch: int = 1, source: str = SOURCE) -> int:
        """Tokens to draft now, at most ``limit``; ``batch``: the streams whose steps share this
        forward; ``source``: which of the drafter's sources drafts this step. A drafter that
        consults :meth:`keep_drafting` may go on past the returned length, up to ``limit``."""
        self.source, self._yielded, self._reach = source, 1.0, 1.0
        self._costs = self.policy.costs(limit, batch, source) if limit > 0 else None
        k = self._choose(limit) if limit > 0 else 0
        self.chosen.append(k)
        return k

    def _choose(self, limit: int) -> int:
        costs = self._costs
        if self.fixed or costs is None:
            return limit
        accept = self.accept_rates(limit, self.source)
        k = best_length(accept, costs, limit)
        if k > 0:
            self._plain_steps, self._wait = 0, self.policy.recheck_every
            return limit if self.policy.confident(self.source) else k  # then keep_drafting decides
        self._plain_steps += 1
        if self._plain_steps < self._wait:
            return 0
        # drafting has not paid for a while: try the best draft again, and wait longer next time
        self._plain_steps = 0
        self._wait = min(2 * self._wait, self.policy.max_recheck_every)
        return best_length(accept, costs, limit, lowest=1)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        """Whether to draft token ``drafted + 1`` of this step, the ``drafted``-th having been
        drafted with probability ``confidence`` (the drafter's own). Expects the next token to be
        as likely right as this one; never stops a seeded sample (see the module docstring)."""
        costs = self._costs
        if self.fixed or costs is None:
            return True
        if drafted + 1 >= len(costs):
            return False
        chance = self.policy.chance(confidence, self.source)
        self._reach *= chance
        self._yielded += self._reach
        return worth_more(self._yielded, self._reach, chance, costs, drafted)

    def branches(
        self, confidence: Sequence[float], alternatives: Sequence[Sequence[tuple[int, float]]], rows: int
    ) -> list[tuple[int, int, float]]:
        """The alternatives to verify beside a draft of these ``confidence`` values, as ``(draft
        index, token, probability)``, in a forward of at most ``rows`` rows (chain and branches)."""
        policy, k = self.policy, len(confidence)
        if policy.branches == "off" or not alternatives or k == 0:
            return []
        at = [alternatives[i] if i < len(alternatives) else () for i in range(k)]  # one entry per draft token
        offered = [(i, token, p) for i in range(k) for token, p in at[i]]
        if policy.branches == "all":
            return offered[: max(0, rows - k - 1)]
        verify = policy.verify_seconds()[: rows + 1]
        if len(verify) <= k + 2:
            return []
        chances = [policy.chance(c, self.source) for c in confidence]
        chance_of = [[policy.branch_chance(p, self.source) for _, p in at[i]] for i in range(k)]
        drafting = policy.draft_seconds(k, self.source)
        per_token = drafting / k  # a taken branch: the drafter reads one more token next step
        chosen = best_branches(chances, chance_of, verify, drafting, per_token)
        return [(i, *at[i][r]) for i, r in chosen]

    def record_branches(self, branches: Sequence[tuple[int, int, float]], accepted: int, taken: int | None) -> None:
        """After a step that verified ``branches``: those at positions the chain reached (draft
        index ≤ ``accepted``) were right when they are the ``taken`` one (its index)."""
        reached = [(p, j == taken) for j, (i, _, p) in enumerate(branches) if i <= accepted]
        if reached:
            self.policy.record_branches(reached, self.source)

    def record_outcome(self, proposed: int, accepted: int, confidence: Sequence[float] = ()) -> None:
        if proposed > 0:
            own = self._own.setdefault(self.source, ([], []))
            _count(own[0], own[1], proposed, accepted)
            self.policy.record_outcome(proposed, accepted, self.source, confidence)
