"""Prompt lookup first, a model drafter otherwise: the best of both on text that repeats.

Code edits, RAG answers and loops copy long runs of earlier text, which an n-gram lookup
drafts for free and often in full; elsewhere a trained drafter does better. ``HybridDrafter``
asks its lookup first and uses the match when there is one (``lookup.min_ngram`` tokens of
suffix must match), else the model drafter's block. Both follow the verified text through
every outcome, whoever drafted; the model drafter's pre-drafting is used after its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash2.drafters.base import (
    Draft,
    DraftContext,
    Drafter,
    DraftSession,
    Outcome,
    PreDraft,
    PreDrafting,
    StaticStepping,
    drafter_context,
)
from dflash2.drafters.ngram import NGramDrafter
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


class HybridSession:
    def __init__(self, lookup: DraftSession, model: DraftSession, model_block: int) -> None:
        self._lookup = lookup
        self._model = model
        self._model_block = model_block
        self._from_model = False  # whether the current proposal is the model's
        self._proposed = 0
        self._pre: PreDraft | None = None

    def propose(self, max_tokens: int) -> Draft:
        found = self._lookup.propose(max_tokens)
        if len(found) > 0:
            self._model.propose(0)  # the model drafter holds no proposal this step
            draft, self._from_model = found, False
        else:
            draft, self._from_model = self._model.propose(min(max_tokens, self._model_block - 1)), True
        self._proposed = len(draft)
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

    def close(self) -> None:
        self._lookup.close()
        self._model.close()
