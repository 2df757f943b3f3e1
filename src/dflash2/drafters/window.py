"""Which tokens of a request's text a model drafter reads: a bounded window over a long prompt.

A small LM drafter keeps its own cache and must run every token it reads through itself. Over a
long new prompt that catch-up can cost more than drafting saves (a 0.5B drafter spends seconds on
a thousand prompt tokens on a CPU). A ``View`` lets it read the first few tokens of the text (the
template's start, which attention leans on) and the last ``window`` tokens of a long stretch it has
not cached, skipping the middle: the drafter then sees a shorter text, positions closing over the
gap (rotary positions are relative, so the recent context reads as it would). What it drafts may
agree less often; the output never changes, since every token is verified by the target.
"""

from __future__ import annotations

from dataclasses import dataclass

SINK_TOKENS = 4  # first tokens of the text always read (the chat template's start)


@dataclass(frozen=True)
class View:
    """The source positions read, in order: each ``[a, b)`` of ``spans``, then all from ``tail`` on."""

    spans: tuple[tuple[int, int], ...] = ()
    tail: int = 0

    def of(self, tokens: list[int]) -> list[int]:
        """The tokens of ``tokens`` this view reads."""
        if not self.spans and self.tail == 0:
            return tokens
        return [t for a, b in self.spans for t in tokens[a:b]] + tokens[self.tail :]

    def up_to(self, position: int) -> View:
        """This view over the text before ``position``, reading everything from there on."""
        spans = [(a, min(b, position)) for a, b in self.spans if a < position]
        if self.tail < position:
            spans.append((self.tail, position))
        return _view(spans, position)

    def reading(self, length: int, window: int | None) -> View:
        """This view (reading everything from ``tail`` on) for a text of ``length`` tokens whose
        tokens from ``tail`` on are not cached yet: all of them, or of a stretch longer than
        ``window`` past the first ``SINK_TOKENS`` of the text, those first tokens and the last
        ``window``."""
        start = max(self.tail, SINK_TOKENS)
        if window is None or length - start <= window:
            return self
        spans = [*self.spans, (self.tail, start)] if self.tail < start else list(self.spans)
        return _view(spans, length - window)


def _view(spans: list[tuple[int, int]], tail: int) -> View:
    """The view of ``spans`` (in order; empty ones dropped, touching ones joined) and ``tail``."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return View() if out == [(0, tail)] or (not out and tail == 0) else View(tuple(out), tail)
