"""A model drafter reads a window of a long uncached stretch of text: what it reads, and that the
output stays exactly the target's (cold, from the prefix cache, sync and async)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import hf_greedy

import dflash2
from dflash2 import GraphConfig, InvalidOptionError
from dflash2.drafters.autoregressive import AutoregressiveDrafter, AutoregressiveSession, DraftState
from dflash2.drafters.window import SINK_TOKENS, View
from dflash2.engine.draft_length import DraftLengthPolicy

LONG = "The quick brown fox jumps over the lazy dog; abc abc abc. " * 6
NEW = 24


def test_a_view_reads_its_spans_then_its_tail() -> None:
    text = list(range(100, 130))
    view = View().reading(30, window=10)
    assert view == View(((0, SINK_TOKENS),), 20)
    assert view.of(text) == [*text[:SINK_TOKENS], *text[20:]]
    assert view.of([*text, 7, 8]) == [*text[:SINK_TOKENS], *text[20:], 7, 8]  # what follows is read
    assert View().reading(14, window=10) == View()  # a stretch within the window is read whole
    assert View().reading(30, window=None) == View()
    assert View().up_to(12) == View()  # all of the text before 12, and all after
    # cached up to 26; 40 new tokens: a second gap, the stretch read before kept
    resumed = view.up_to(26)
    assert resumed == View(((0, SINK_TOKENS), (20, 26)), 26)
    again = resumed.reading(66, window=10)
    assert again == View(((0, SINK_TOKENS), (20, 26)), 56)
    assert again.of(list(range(66))) == [*range(SINK_TOKENS), *range(20, 26), *range(56, 66)]
    assert view.up_to(10) == View(((0, SINK_TOKENS),), 10)  # cut inside the gap: the gap stays skipped
    assert View().up_to(2).reading(30, window=10) == View(((0, SINK_TOKENS),), 20)  # the first tokens kept


def test_the_window_is_checked() -> None:
    for bad in (0, -3, 2.5, True, "256"):
        with pytest.raises(InvalidOptionError, match="window"):
            AutoregressiveDrafter(None, 10, window=bad)  # type: ignore[arg-type]
    drafter = object.__new__(AutoregressiveDrafter)
    drafter.window = None
    with pytest.raises(InvalidOptionError, match="window must be a positive int or None, got 0"):
        drafter.window = 0  # set later, as a user tunes a loaded model's drafter
    assert drafter.window is None


def _windowed(paths: dict[str, Path], window: int | None, **options: object) -> dflash2.Model:
    """The target drafting for itself in int4, reading ``window`` tokens of a new stretch, drafting
    whole blocks (the policy would not draft with so dear a drafter)."""
    model = dflash2.load(paths["target"], drafter=paths["target"], drafter_weights="int4", block_size=4, **options)
    assert isinstance(model.drafter, AutoregressiveDrafter)
    model.drafter.window = window
    model.lengths = DraftLengthPolicy(mode="fixed")
    return model


def _sessions(monkeypatch: pytest.MonkeyPatch) -> list[AutoregressiveSession]:
    """The sessions drafters start from now on (``static``: whether each began on a static slot)."""
    started: list[AutoregressiveSession] = []
    start = AutoregressiveDrafter.start

    def recording(self: AutoregressiveDrafter, context: dflash2.drafters.DraftContext) -> AutoregressiveSession:
        started.append(start(self, context))
        started[-1].static = started[-1]._slot is not None  # type: ignore[attr-defined]
        return started[-1]

    monkeypatch.setattr(AutoregressiveDrafter, "start", recording)
    return started


@pytest.mark.parametrize("pipeline", ["sync", "async", "static"])
def test_a_windowed_drafter_keeps_the_targets_tokens(
    pipeline: str, paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager forwards in both pipelines, and the static steps CUDA graphs replay (run eagerly)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    sessions = _sessions(monkeypatch)
    graphs = GraphConfig(mode="static", context=512, slots=1) if pipeline == "static" else "off"
    model = _windowed(paths, window=8, prefix_cache=0, graphs=graphs)
    pipeline = "sync" if pipeline == "static" else pipeline
    ids = model.tokenizer(LONG).input_ids
    assert len(ids) > SINK_TOKENS + 8 + 20
    out = model.generate(LONG, max_new_tokens=NEW, pipeline=pipeline)
    assert list(out.token_ids) == hf_greedy(hf, ids, NEW)[: len(out.token_ids)]
    assert out.stats.drafted_tokens > 0
    session = sessions[-1]  # (loading times a few drafts too)
    assert session._view == View(((0, SINK_TOKENS),), len(ids) + 1 - 8)
    assert session.static == (graphs != "off")  # type: ignore[attr-defined]
    assert len(session._cached) < SINK_TOKENS + 8 + NEW + 8  # the middle of the prompt was never run


def test_a_windowed_state_resumes_for_the_next_turn(paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation whose turns add long stretches: each turn resumes the drafter's windowed
    state (reading only the new stretch's window) and gives a cold run's tokens."""
    sessions = _sessions(monkeypatch)
    warm = _windowed(paths, window=8)
    cold = dflash2.load(paths["target"], prefix_cache=0)
    prompt = LONG[:200]
    for turn in range(3):
        out = warm.generate(prompt, max_new_tokens=NEW)
        assert out.token_ids == cold.generate(prompt, max_new_tokens=NEW).token_ids, turn
        session = sessions[-1]
        spans = session._view.spans
        assert len(spans) == 1 + turn  # the sink, then one kept stretch per earlier turn
        prompt = prompt + out.text + " Now again: " + LONG[:80]
    longest = max(warm.prefixes.snapshots(), key=len)
    state = longest.drafter_state(warm.drafter)
    assert isinstance(state, DraftState) and state.view == session._view
    unread = len(state.view.of(list(state.tokens))) - state.keys.shape[2]
    assert 0 < unread <= 4  # all it read of its text but the last step's tokens, never fed


def test_a_windowed_hit_keeps_a_seeded_sample(paths: dict[str, Path]) -> None:
    """Under sampling a resumed session reads what a cold one reads, so a seed gives the same text
    with or without the prefix cache, turn after turn."""
    warm = _windowed(paths, window=8)
    cold = _windowed(paths, window=8, prefix_cache=0)
    options: dict[str, Any] = {"temperature": 0.9, "seed": 5}
    prompt = LONG[:200]
    for turn in range(3):
        out = warm.generate(prompt, max_new_tokens=NEW, **options)
        assert turn == 0 or out.stats.cached_tokens > 0
        assert out.token_ids == cold.generate(prompt, max_new_tokens=NEW, **options).token_ids, turn
        prompt = prompt + out.text + " Now again: " + LONG[:80]
