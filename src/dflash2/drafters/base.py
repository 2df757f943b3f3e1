"""The ``Drafter`` protocol every drafter implements, so engines never special-case one.

A ``Drafter`` holds what is shared (weights, settings) and is safe to use from several
requests at once; ``start`` gives a ``DraftSession`` with one request's state. The engine asks
the session for a draft from the verified state, verifies it, and tells the session the outcome.
Sessions that also implement ``PreDrafting`` can draft the next block while one is verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dflash2.config import SamplingConfig
from dflash2.runtime.graphs import StepMode


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of the verified text.

    ``tokens`` [k] ids; ``probs`` [k, vocab] the distribution each token was sampled from
    (after the request's temperature / top-k / top-p), or ``None`` for a deterministic draft
    (greedy decoding, n-gram lookup). ``confidence``: the drafter's probability of each token,
    where it knows one (the draft-length policy learns how often tokens of each confidence are
    accepted). ``alternatives``: per draft token, the drafter's next choices for its position,
    ``(token id, probability)`` best first (greedy drafting only); the engine may verify some of
    them beside the draft, as side branches in the same target forward. ``catch_up_s``: seconds
    of the call the drafter spent reading text it had fallen behind on (a new prompt, steps that
    another source drafted or none did) before drafting: a cost of that text, which the
    draft-length policy does not count as the price of a draft of this length.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: tuple[float, ...] = ()
    alternatives: tuple[tuple[tuple[int, float], ...], ...] = ()
    catch_up_s: float = 0.0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Outcome:
    """What verification decided for the last draft.

    ``accepted`` draft tokens were kept (``tokens``, the verified text's new tokens; whoever
    drafted them) and ``next_token`` follows them; it is the new last verified token, not yet
    processed by the target. ``hidden`` holds the target features (the drafter's
    ``capture_layers``) of the verified inputs ``[x, d_1 .. d_accepted]``. ``branch``: the last
    of ``tokens`` is one of the draft's alternatives (a side branch the target accepted), not the
    draft's own token at that position.
    """

    accepted: int
    next_token: int
    tokens: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None
    branch: bool = False

    def __post_init__(self) -> None:
        if len(self.tokens) != self.accepted:
            raise ValueError(f"an outcome of {self.accepted} accepted drafts lists {len(self.tokens)} tokens")


@dataclass(frozen=True)
class DraftContext:
    """The request a session drafts for, as known right after the prefill."""

    prompt_ids: list[int]
    first_token: int  # sampled from the prefill, the first last-verified token
    prompt_hidden: torch.Tensor | None  # [prompt_len, features] when capture_layers is set
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_tokens: int  # prompt + everything that may be generated: size caches by it
    # a drafter that drafts token by token asks after each token (the count so far, the drafter's
    # probability of the last) whether another one pays; ``None``: draft as many as asked
    keep_drafting: Callable[[int, float], bool] | None = None
    # what :meth:`Resumable.snapshot` of an earlier session of this drafter left, for a request
    # whose prompt starts as that session's text did (the prefix cache); ``None``: start cold
    resume: Any = None


class DraftSession(Protocol):
    def propose(self, max_tokens: int) -> Draft:
        """Draft at most ``max_tokens`` tokens after the last verified token (may return none)."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Learn the verification outcome of the last proposal."""
        ...

    def close(self) -> None:
        """Free the request's state (caches)."""
        ...


@runtime_checkable
class Drafter(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def block_size(self) -> int:
        """Tokens per verify forward at most: the last verified token + ``block_size - 1`` drafts."""
        ...

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (empty for most drafters)."""
        ...

    def start(self, context: DraftContext) -> DraftSession: ...


def drafter_context(drafter: Drafter) -> int | None:
    """Prompt + new tokens ``drafter`` can draft for: its optional ``max_context`` (``None``: no limit)."""
    limit = getattr(drafter, "max_context", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


MODEL_SOURCE = "model"  # the source of a drafter that has one


@runtime_checkable
class MixedDrafting(Protocol):
    """Sessions that draft from several sources (prompt lookup, a model), each with its own cost and
    acceptance: the engine asks which one drafts next before deciding how far to draft."""

    def next_source(self, max_tokens: int) -> str:
        """The source of the next proposal of at most ``max_tokens`` tokens (a short name)."""
        ...


@dataclass(frozen=True)
class PreDraft:
    """A draft made while the last proposal is still being verified, for the likely outcome:
    every proposed token accepted and followed by ``next_token``."""

    next_token: int
    draft: Draft

    def matches(self, outcome: Outcome, proposed: int) -> bool:
        return outcome.accepted == proposed and not outcome.branch and outcome.next_token == self.next_token


@runtime_checkable
class PreDrafting(Protocol):
    """Sessions that can draft ahead. ``predraft`` runs after ``propose`` and while its block is
    verified; the following ``observe`` keeps the pre-draft as the current proposal when it
    :meth:`PreDraft.matches` the outcome and drops it otherwise."""

    def can_predraft(self) -> bool:
        """Whether ``predraft`` would draft now (there is a proposal to draft after)."""
        ...

    def predraft(self, max_tokens: int) -> PreDraft | None: ...


@runtime_checkable
class Resumable(Protocol):
    """Sessions whose state a later request with the same prefix can start from (the prefix cache).

    ``snapshot`` is called when the request ends, with no phase running; what it returns comes back
    as ``DraftContext.resume`` to a later session of the same drafter, whose prompt may share only
    part of the text the snapshot covers. The request's output must come out as a cold one's: under
    sampling the resumed session must draft as a cold one would (the snapshot holds only state
    computed the way a cold start computes it); greedy output does not depend on the drafts.
    """

    def snapshot(self) -> Any: ...


@runtime_checkable
class BatchDrafting(Protocol):
    """A drafter that drafts for several of its sessions in one forward (concurrent streams)."""

    def propose_many(self, sessions: Sequence[DraftSession], max_tokens: Sequence[int]) -> list[Draft]:
        """``sessions[i].propose(max_tokens[i])`` for every i, as cheaply as the drafter can."""
        ...


@runtime_checkable
class StaticStepping(Protocol):
    """Drafters whose forwards can run as static steps (``runtime.graphs``: CUDA graphs on CUDA).

    The model calls :meth:`use_static_steps` once, with its graph mode, and before the first
    request :meth:`prepare_static_steps` (capture) from its verify worker.
    """

    def use_static_steps(self, mode: StepMode, context: int, slots: int) -> None:
        """Run sessions of at most ``context`` tokens on ``slots`` static slots in ``mode``."""
        ...

    def prepare_static_steps(self) -> None:
        """Build (capture) the static steps sessions will use."""
        ...

    def resident_sessions(self) -> bool:
        """Whether its sessions implement :class:`ResidentDrafting` (drafting with no host round trip)."""
        ...


@runtime_checkable
class ResidentDrafting(Protocol):
    """Sessions that can draft with no round trip through the host (static steps on the device).

    The resident pipeline starts a run of such steps with :meth:`DraftSession.propose`, drafts each
    later block with :meth:`propose_resident` from the device state of the last verification,
    never calling ``observe``, and ends the run with :meth:`resume`.
    """

    def can_stay_resident(self) -> bool:
        """Whether :meth:`propose_resident` can run now (the session holds a static slot)."""
        ...

    def propose_resident(self, last: torch.Tensor, features: torch.Tensor | None, kept: torch.Tensor) -> Draft:
        """``block_size - 1`` tokens after ``last`` (a device scalar), given the target ``features``
        [T, F] of the last verified block, of which the first ``kept`` (a device scalar) stay.
        Nothing is read back to the host."""
        ...

    def resume(self, last: int, features: torch.Tensor | None) -> None:
        """Host-driven again: ``last`` is the last verified token, ``features`` those of the tokens
        verified since the last draft."""
        ...
