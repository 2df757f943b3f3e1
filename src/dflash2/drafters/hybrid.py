"""Prompt lookup first, a model drafter otherwise: the best of both on text that repeats.

Code edits, RAG answers and loops copy long runs of earlier text, which an n-gram lookup
drafts for free and often in full; elsewhere a trained drafter does better. ``HybridDrafter``
asks its lookup first and uses the match when there is one (``lookup.min_ngram`` tokens of
suffix must match), else the model drafter's block. Both follow the verified text through
every outcome, whoever drafted; the model drafter's pre-drafting is used after its own blocks.
The engine measures the two sources apart (``MixedDrafting``): a lookup's drafts cost nothing
and are right or wrong in long runs, a model's cost a forward or several.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash2.drafters.base import (
    MODEL_SOURCE,
    BatchDrafting,
    Draft,
    DraftContext,
    Drafter,
    DraftSession,
    Outcome,
    PreDraft,
    PreDrafting,
    Resumable,
    StaticStepping,
    drafter_context,
)
from dflash2.drafters.ngram import NGramDrafter, NGramSession
from dflash2.errors import DrafterError
from dflash2.runtime.graphs import StepMode


@dataclass(frozen=True)
class HybridDrafter:
    """``lookup`` when the text repeats, ``model`` otherwise."""

    model: Drafter
    lookup: NGramDrafter = field(default_factory=lambda: HybridDrafter.default_lookup())

    @staticmethod
    def default_lookup() -> NGramDrafter:
        """Lookup only on 3+ matching tokens: shorter matches are better left to the model drafter."""
        return NGramDrafter(min_ngram=3, max_ngram=4)

    def __post_init__(self) -> None:
        if not isinstance(self.lookup, NGramDrafter):
            raise DrafterError("a hybrid drafter's lookup must be an NGramDrafter.")
        if isinstance(self.model, (HybridDrafter, NGramDrafter)):
            raise DrafterError("a hybrid drafter's model must be a model drafter (DFlash or autoregressive).")

    @property
    def name(self) -> str:
        return f"{self.lookup.name}+{self.model.name}"

    @property
    def block_size(self) -> int:
        return max(self.model.block_size, self.lookup.block_size)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(self.model.capture_layers)

    @property
    def max_context(self) -> int | None:
        return drafter_context(self.model)

    def use_static_steps(self, mode: StepMode, context: int, slots: int) -> None:
        if isinstance(self.model, StaticStepping):
            self.model.use_static_steps(mode, context, slots)

    def prepare_static_steps(self) -> None:
        if isinstance(self.model, StaticStepping):
            self.model.prepare_static_steps()

    def resident_sessions(self) -> bool:
        return False  # the lookup reads the verified tokens on the host

    def start(self, context: DraftContext) -> HybridSession:
        return HybridSession(self.lookup.start(context), self.model.start(context), self.model.block_size)

    def propose_many(self, sessions: Sequence[DraftSession], max_tokens: Sequence[int]) -> list[Draft]:
        """Each session's ``propose``: lookups on the host, the model drafter's blocks of the sessions
        whose lookup found nothing in one forward when it drafts for several at once."""
        mine = [s for s in sessions if isinstance(s, HybridSession)]
        if len(mine) != len(sessions):
            raise DrafterError("propose_many takes sessions of this drafter only.")
        drafts = {i: found for i, s in enumerate(mine) if (found := s.look_up(max_tokens[i])) is not None}
        misses = [i for i in range(len(mine)) if i not in drafts]
        limits = [min(max_tokens[i], self.model.block_size - 1) for i in misses]
        models = [mine[i].model_session for i in misses]
        if isinstance(self.model, BatchDrafting) and len(misses) > 1:
            made = self.model.propose_many(models, limits)
        else:
            made = [m.propose(k) for m, k in zip(models, limits, strict=True)]
        for i, draft in zip(misses, made, strict=True):
            drafts[i] = mine[i].took_model(draft)
        return [drafts[i] for i in range(len(mine))]


LOOKUP_SOURCE = "lookup"


class HybridSession:
    def __init__(self, lookup: NGramSession, model: DraftSession, model_block: int) -> None:
        self._lookup = lookup
        self._model = model
        self._model_block = model_block
        self._from_model = False  # whether the current proposal is the model's
        self._proposed = 0
        self._pre: PreDraft | None = None

    def next_source(self, max_tokens: int) -> str:
        return LOOKUP_SOURCE if max_tokens > 0 and self._lookup.finds() else MODEL_SOURCE

    def propose(self, max_tokens: int) -> Draft:
        found = self.look_up(max_tokens)
        if found is not None:
            return found
        return self.took_model(self._model.propose(min(max_tokens, self._model_block - 1)))

    def look_up(self, max_tokens: int) -> Draft | None:
        """The lookup's draft, if it found one (the model drafter then holds no proposal this step)."""
        found = self._lookup.propose(max_tokens)
        if len(found) == 0:
            return None
        self._model.propose(0)
        self._from_model, self._proposed = False, len(found)
        return found

    @property
    def model_session(self) -> DraftSession:
        return self._model

    def took_model(self, draft: Draft) -> Draft:
        """Use the model drafter's ``draft`` (made by its session) as this step's proposal."""
        self._from_model, self._proposed = True, len(draft)
        return draft

    def can_predraft(self) -> bool:
        return self._from_model and isinstance(self._model, PreDrafting) and self._model.can_predraft()

    def predraft(self, max_tokens: int) -> PreDraft | None:
        if not self.can_predraft():
            return None
        assert isinstance(self._model, PreDrafting)
        self._pre = self._model.predraft(max_tokens)
        return self._pre

    def observe(self, outcome: Outcome) -> None:
        pre, self._pre = self._pre, None
        self._lookup.observe(outcome)
        self._model.observe(outcome)
        # a confirmed pre-draft is the next proposal: the engine verifies it without asking again
        hit = pre is not None and pre.matches(outcome, self._proposed)
        self._from_model = hit
        self._proposed = len(pre.draft) if pre is not None and hit else 0

    def snapshot(self) -> Any:
        """The model drafter's state for the prefix cache (the lookup rebuilds its index from the text)."""
        return self._model.snapshot() if isinstance(self._model, Resumable) else None

    def close(self) -> None:
        self._lookup.close()
        self._model.close()
