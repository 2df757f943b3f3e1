"""Reuse a finished request's state for the next one that starts the same way.

Agents and chat clients resend the whole conversation every turn. A :class:`PrefixCache` keeps,
for recently finished (or cancelled) requests, the target's keys and values of their verified
text, the target features a DFlash drafter reads, and the drafter's own state where it has one;
a new request takes the longest stored prefix of its prompt and prefills only the rest.

Exactness: a request stores its state as far as eager forwards computed it
(:attr:`Request.storable`; static steps attend over a whole masked cache, so they store their
prompt only). The stored prompt rows are a cold prefill's bit for bit; rows computed after it (a
verify block, a one-token step) agree with a cold prefill of the whole text to fp32 rounding (a
forward's kernels depend on its row count), the same difference speculative verification already
makes against one-token decoding, so greedy output with a hit equals a cold run's (tested for
every drafter, sync and async, batched, and seeded sampling).

Entries are immutable copies: a hit copies the state into the new request's own cache, so an
entry in use is never written, and evicting one never touches a running request. The store holds
at most ``capacity`` tokens in all and evicts the least recently used entries first.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash2.errors import InvalidOptionError
from dflash2.tokenize import common_prefix


@dataclass(frozen=True)
class Snapshot:
    """One request's state for the first ``len(tokens)`` tokens of its verified text.

    ``keys`` / ``values`` [layers, kv_heads, T, head_dim] of the target; ``features`` [T, F], the
    target features of the drafter's capture layers (``None`` without them); ``drafter``: the
    drafter's own state (see ``DraftSession.snapshot``), with the drafter it belongs to.
    """

    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    features: torch.Tensor | None = None
    drafter: tuple[Any, Any] | None = None  # (weak reference to the drafter, its state)

    def __len__(self) -> int:
        return len(self.tokens)

    def drafter_state(self, drafter: object) -> Any:
        """The state ``drafter`` stored (``None``: another drafter's, or none)."""
        if self.drafter is None:
            return None
        owner, state = self.drafter
        return state if owner() is drafter else None


@dataclass(frozen=True)
class Hit:
    """The stored state of a prompt's first ``length`` tokens."""

    snapshot: Snapshot
    length: int


@dataclass
class _Entry:
    snapshot: Snapshot
    used: int  # the store's clock at the last lookup or insert


@dataclass
class PrefixCache:
    """A bounded store of request states keyed by their token prefix (see the module docstring).

    ``capacity``: tokens of state kept in all (0: nothing is kept). ``minimum``: shorter shared
    prefixes are not worth a lookup's copy and are prefilled instead.
    """

    capacity: int
    minimum: int = 8
    _entries: list[_Entry] = field(default_factory=list)
    _clock: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    hits: int = 0
    lookups: int = 0

    def __post_init__(self) -> None:
        for name in ("capacity", "minimum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidOptionError(f"prefix_cache {name} must be an int >= 0, got {value!r}.")

    @property
    def tokens(self) -> int:
        """Tokens of state held now (at most ``capacity``)."""
        with self._lock:
            return sum(len(e.snapshot) for e in self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> Hit | None:
        """The longest stored prefix of ``prompt``, leaving its last token to compute (``None``: none
        of at least ``minimum`` tokens)."""
        if self.capacity == 0:
            return None
        limit = len(prompt) - 1  # the last prompt token must run: its logits give the first new token
        with self._lock:
            self.lookups += 1
            best: _Entry | None = None
            length = 0
            for entry in self._entries:
                shared = common_prefix(entry.snapshot.tokens, prompt, limit)
                if shared > length:
                    best, length = entry, shared
            if best is None or length < max(1, self.minimum):
                return None
            best.used = next(self._clock)
            self.hits += 1
            return Hit(best.snapshot, length)

    def insert(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot`` (cut to ``capacity`` tokens); entries it extends leave, the least
        recently used go while the store holds more than ``capacity`` tokens."""
        if self.capacity == 0 or len(snapshot) < max(1, self.minimum):
            return
        if len(snapshot) > self.capacity:
            snapshot = _cut(snapshot, self.capacity)
        with self._lock:
            for entry in self._entries:
                held = entry.snapshot
                if (
                    common_prefix(held.tokens, snapshot.tokens, len(snapshot)) == len(snapshot)
                    and (snapshot.features is None or held.features is not None)
                    and (snapshot.drafter is None or held.drafter is not None)
                ):
                    entry.used = next(self._clock)  # already held, as long or longer, with as much
                    return
            self._entries = [
                e for e in self._entries
                if common_prefix(e.snapshot.tokens, snapshot.tokens, len(e.snapshot)) < len(e.snapshot)
            ]  # fmt: skip
            self._entries.append(_Entry(snapshot, next(self._clock)))
            while sum(len(e.snapshot) for e in self._entries) > self.capacity:
                self._entries.remove(min(self._entries, key=lambda e: e.used))

    def snapshots(self) -> list[Snapshot]:
        """The stored snapshots, least recently used first."""
        with self._lock:
            return [e.snapshot for e in sorted(self._entries, key=lambda e: e.used)]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _cut(snapshot: Snapshot, length: int) -> Snapshot:
    features = snapshot.features[:length] if snapshot.features is not None else None
    return Snapshot(
        snapshot.tokens[:length],
        snapshot.keys[:, :, :length].clone(),
        snapshot.values[:, :, :length].clone(),
        features,
        snapshot.drafter,  # the drafter's state is cut where it is used (its own length)
    )


def drafter_entry(drafter: object, state: Any) -> tuple[Any, Any] | None:
    """How a snapshot holds a drafter's ``state``: with a weak reference to the drafter."""
    return None if state is None else (weakref.ref(drafter), state)
