"""The draft-length policy: the math, and what it chooses for drafters that are never or always right.

Output never depends on the length (greedy identity here, the sampling distribution in
``test_sampling_distribution.py``). Costs are injected, so that choices, and the tests, do not
depend on this machine's timing; speed itself is measured in the benchmarks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from test_speculative import ScriptedDrafter
from tiny import SPEC_PROMPTS

import dflash2
from dflash2 import InvalidOptionError, SamplingConfig
from dflash2.drafters import Draft, DraftContext, Outcome
from dflash2.engine import DraftLengthPolicy
from dflash2.engine.draft_length import DraftLength, best_length, expected_yield, worth_more


def test_expected_yield() -> None:
    assert expected_yield([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_yield([0.5, 0.5], 2) == 1.75
    assert expected_yield([0.9, 0.9], 0) == 1.0
    assert expected_yield([0.0, 1.0], 2) == 1.0  # nothing after a sure rejection counts


def test_best_length() -> None:
    flat = [1.0] * 6
    assert best_length([1.0] * 5, flat, 5) == 5  # free verification, sure drafts: all of them
    assert best_length([0.0] * 5, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], 5) == 0  # never right: plain steps
    assert best_length([0.0] * 5, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], 5, lowest=1) == 1  # a re-check: the cheapest
    # 50 % per position, verification 10 % dearer per token: two drafts (1.75 / 1.2) beat one (1.5 / 1.1)
    assert best_length([0.5] * 5, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], 5) == 2


def test_drafting_on_looks_past_a_jump_in_cost() -> None:
    # a forward of 1-3 tokens costs 1, of 4-9 tokens 1.5 (another kernel tile): two drafts so far
    costs = [1.0, 1.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]
    yielded, reach = 1 + 0.95 + 0.95**2, 0.95**2
    assert (yielded + reach * 0.95) / costs[3] < yielded / costs[2]  # the third draft alone does not pay ...
    assert worth_more(yielded, reach, 0.95, costs, 2)  # ... but the drafts it opens the way to do
    assert not worth_more(yielded, reach, 0.3, costs, 2)  # unlikely drafts: stop
    assert worth_more(yielded, reach, 0.3, [1.0] * 9, 2)  # free ones: go on
    assert not worth_more(yielded, reach, 1.0, costs, 8)  # the block is full


class InjectedCosts(DraftLengthPolicy):
    """Costs fixed in advance (a forward of T tokens: 1 + 0.1 (T - 1); a draft: 0.05 per step)."""

    draft_s = 0.05  # a step's drafting, whatever its length ...
    draft_per_token_s = 0.0  # ... plus this per draft token

    def __post_init__(self) -> None:
        super().__post_init__()
        self.requests: list[DraftLength] = []
        for tokens in range(1, 65):
            super().record_verify(tokens, self.forward(tokens))
            super().record_draft(tokens, self.drafting(tokens))

    @classmethod
    def drafting(cls, tokens: int) -> float:
        return cls.draft_s + cls.draft_per_token_s * tokens if tokens else 0.0

    @staticmethod
    def forward(tokens: int) -> float:
        return 1.0 + 0.1 * (tokens - 1)

    def record_verify(self, tokens: int, seconds: float) -> None:
        pass

    def record_draft(self, tokens: int, seconds: float, source: str = "model") -> None:
        pass

    def start(self, fixed: bool = False) -> DraftLength:
        self.requests.append(super().start(fixed))
        return self.requests[-1]

    def modelled_seconds(self) -> float:
        """What the requests' chosen lengths cost under these costs."""
        chosen = [k for request in self.requests for k in request.chosen]
        return sum(self.forward(k + 1) + self.drafting(k) for k in chosen)


class DearDrafts(InjectedCosts):
    """Every draft token costs more than a target forward (1.5 s against 1 s)."""

    draft_s = 0.0
    draft_per_token_s = 1.5


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_drafter_that_is_never_right_costs_almost_nothing(paths: dict[str, Path], pipeline: str) -> None:
    plain = dflash2.load(paths["target"])
    truth = list(plain.generate(SPEC_PROMPTS[1], max_new_tokens=300).token_ids)
    model = dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [0]))  # every draft's first token wrong
    lengths = model.lengths = InjectedCosts()
    completion = model.generate(SPEC_PROMPTS[1], max_new_tokens=300, pipeline=pipeline)
    assert list(completion.token_ids) == truth
    steps = completion.stats.steps
    chosen = lengths.requests[0].chosen
    assert chosen.count(0) >= 0.95 * steps  # plain steps, but for a few re-checks
    assert lengths.modelled_seconds() <= 1.05 * steps * InjectedCosts.forward(1)  # within 5 % of plain


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_drafter_dearer_than_a_forward_costs_almost_nothing(paths: dict[str, Path], pipeline: str) -> None:
    plain = dflash2.load(paths["target"])
    truth = list(plain.generate(SPEC_PROMPTS[1], max_new_tokens=300).token_ids)
    model = dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [5]))  # every draft right
    lengths = model.lengths = DearDrafts()
    completion = model.generate(SPEC_PROMPTS[1], max_new_tokens=300, pipeline=pipeline)
    assert list(completion.token_ids) == truth
    steps = completion.stats.steps
    assert lengths.requests[0].chosen.count(0) >= 0.95 * steps  # right, but dearer than what they save
    assert lengths.modelled_seconds() <= 1.05 * steps * InjectedCosts.forward(1)  # within 5 % of plain


def test_a_drafter_that_is_always_right_drafts_whole_blocks(paths: dict[str, Path]) -> None:
    # the target drafting for itself, in its own precision
    model = dflash2.load(paths["target"], drafter=paths["target"], block_size=5, drafter_weights="same")
    lengths = model.lengths = InjectedCosts()
    completion = model.generate(SPEC_PROMPTS[1], max_new_tokens=41, pipeline="sync")
    chosen = lengths.requests[0].chosen
    assert len(chosen) >= 8 and set(chosen[2:-1]) == {4}  # whole blocks from the third step (the last has less room)
    assert completion.stats.mean_acceptance_length > 4.0


def test_a_request_starts_from_what_the_model_has_seen(paths: dict[str, Path]) -> None:
    plain = dflash2.load(paths["target"])
    truth = list(plain.generate(SPEC_PROMPTS[1], max_new_tokens=40).token_ids)
    model = dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [0]))
    lengths = model.lengths = InjectedCosts()
    model.generate(SPEC_PROMPTS[1], max_new_tokens=40)
    model.generate(SPEC_PROMPTS[1], max_new_tokens=40)
    first, second = lengths.requests
    assert first.chosen[0] > 0  # nothing known yet: drafting is tried
    assert second.chosen[0] == 0  # the model's history says it does not pay


def test_seeded_sampling_keeps_whole_blocks(paths: dict[str, Path]) -> None:
    plain = dflash2.load(paths["target"])
    truth = list(plain.generate(SPEC_PROMPTS[1], max_new_tokens=40).token_ids)
    model = dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [0]))
    lengths = model.lengths = InjectedCosts()
    model.generate(SPEC_PROMPTS[1], max_new_tokens=40, temperature=0.7, seed=3)
    chosen = lengths.requests[0].chosen  # timing must not change a seeded sample: as far as the room allows
    assert chosen == [min(5, 38 - generated) for generated in range(len(chosen))]


def test_calibration_times_every_block_length(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter="ngram")
    assert set(model.lengths.summary()["verify_s"]) == set(range(1, model.drafter.block_size + 1))  # type: ignore[union-attr]


class CatchingUp(ScriptedDrafter):
    """Right drafts, each in no time, but the first of a session takes 0.5 s: the session catches
    up on the prompt then, as a model drafter prefills its own cache on its first draft."""

    def start(self, context: DraftContext) -> Any:
        session = super().start(context)
        propose = session.propose

        def first(max_tokens: int) -> Draft:
            time.sleep(0.5)
            session.propose = propose
            return propose(max_tokens)

        session.propose = first
        return session


def _right_drafts(paths: dict[str, Path], drafter: type[ScriptedDrafter], pipeline: str) -> tuple[Any, Any]:
    """The model drafting with ``drafter`` (every draft right), and its completion, checked."""
    plain = dflash2.load(paths["target"])
    truth = list(plain.generate(SPEC_PROMPTS[1], max_new_tokens=40).token_ids)
    model = dflash2.load(paths["target"], drafter=drafter(truth, [99]))
    completion = model.generate(SPEC_PROMPTS[1], max_new_tokens=40, pipeline=pipeline)
    assert list(completion.token_ids) == truth
    return model, completion


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_sessions_catch_up_on_the_prompt_is_not_priced_as_drafting(paths: dict[str, Path], pipeline: str) -> None:
    model, completion = _right_drafts(paths, CatchingUp, pipeline)
    assert max(model.lengths.summary()["draft_s"].values()) < 0.05  # the 0.5 s is no draft's price
    assert completion.stats.steps <= 40 // 4  # so the drafts after the first went on in whole blocks


class FallingBehind(ScriptedDrafter):
    """Right drafts, each of which first spends 0.2 s reading text the drafter fell behind on (as a
    model drafter does after steps another source drafted, or none did), and says so."""

    def start(self, context: DraftContext) -> Any:
        session = super().start(context)
        propose = session.propose

        def behind(max_tokens: int) -> Draft:
            time.sleep(0.2)
            return dataclasses.replace(propose(max_tokens), catch_up_s=0.2)

        session.propose = behind
        return session


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_catching_up_on_text_is_not_priced_as_drafting(paths: dict[str, Path], pipeline: str) -> None:
    model, completion = _right_drafts(paths, FallingBehind, pipeline)
    assert max(model.lengths.summary()["draft_s"].values()) < 0.05  # reading is no draft's price
    assert completion.stats.draft_s > 0.2 * (completion.stats.steps - 1)  # though it counts as drafting time


def test_a_model_drafter_reports_catching_up(paths: dict[str, Path]) -> None:
    """The small LM drafter reads what it fell behind on (the prompt, steps it did not draft) apart
    from drafting, and reports how long that took; an ordinary step leaves nothing to catch up on."""
    model = dflash2.load(paths["target"], drafter=paths["target"], block_size=4)
    ids = model.tokenizer.encode(SPEC_PROMPTS[0])
    session = model.drafter.start(DraftContext(ids, 7, None, SamplingConfig(), None, len(ids) + 64))  # type: ignore[union-attr]
    first = session.propose(3)
    assert first.catch_up_s > 0  # the prompt
    tokens = tuple(int(t) for t in first.tokens)
    session.observe(Outcome(accepted=3, tokens=tokens, next_token=9))
    assert session.propose(3).catch_up_s == 0.0  # the last draft token and the bonus: a step's reading
    session.observe(Outcome(accepted=0, next_token=11))
    for token in (12, 13, 14):  # three plain steps: the drafter drafts nothing and reads nothing
        assert len(session.propose(0)) == 0
        session.observe(Outcome(accepted=0, next_token=token))
    assert session.propose(3).catch_up_s > 0
    session.close()


def test_a_shared_forward_prices_a_stream_at_its_share() -> None:
    policy = DraftLengthPolicy()
    for tokens in range(1, 6):  # alone: 1 s fixed, 0.1 s a token
        policy.record_verify(tokens, 1.0 + 0.1 * tokens)
    assert policy.costs(4, batch=4) == policy.costs(4)  # no packed forward timed yet: alone's curve
    for tokens in (8, 12, 20, 40, 8, 32):  # four streams (compute-bound): 0.4 s fixed, 0.1 s a token
        policy.record_packed(4, tokens, 0.4 + 0.1 * tokens)
    shared = policy.costs(4, batch=4)
    assert shared == pytest.approx([0.1 + 0.1 * (k + 1) for k in range(5)])
    assert policy.costs(4, batch=2) == policy.costs(4)  # another batch size: not known
    assert policy.summary()["packed_fixed_s"] == {4: pytest.approx(0.4)}
    # 40 % per position: alone, where a step's fixed second dominates, drafting pays; at a quarter
    # of the fixed cost each draft's rows cost more than it is expected to save
    request = policy.start()
    accept = [0.4] * 4
    assert best_length(accept, policy.costs(4) or [], 4) > 0
    assert best_length(accept, shared, 4) == 0
    for accepted in (4, 0, 4, 0, 0):  # 40 % for the first draft, the rest right after a right one
        request.record_outcome(4, accepted)
    assert request.choose(4, batch=4) == 0 and request.choose(4) == 4


def test_a_packed_line_needs_token_counts_that_vary() -> None:
    policy = DraftLengthPolicy()
    policy.record_verify(1, 1.0)
    for _ in range(10):
        policy.record_packed(8, 8, 3.0)  # every stream plain: fixed and per-token parts inseparable
    assert policy.costs(2, batch=8) == policy.costs(2)
    assert policy.summary()["packed_fixed_s"] == {}


@pytest.mark.anyio
async def test_concurrent_streams_time_their_packed_forwards(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter="ngram")
    alone = [(await model.agenerate(p, max_new_tokens=30)).token_ids for p in SPEC_PROMPTS]
    together = await asyncio.gather(*(model.agenerate(p, max_new_tokens=30) for p in SPEC_PROMPTS))
    assert [c.token_ids for c in together] == alone
    assert model.lengths._packed  # every batch without a prompt in it was timed, by its size


def _confident_policy(draft_per_token: float = 0.05) -> DraftLengthPolicy:
    """A policy with a forward of T tokens costing 1 + 0.1 (T - 1) s and drafts ``draft_per_token`` a token."""
    policy = DraftLengthPolicy()
    for tokens in range(1, 10):
        policy.record_verify(tokens, 1.0 + 0.1 * (tokens - 1))
    for tokens in range(1, 9):
        policy.record_draft(tokens, draft_per_token * tokens)
    return policy


def _drafted(request: DraftLength, confidence: list[float], limit: int = 8) -> int:
    """Tokens a drafter asking :meth:`DraftLength.keep_drafting` drafts when it is this sure of each."""
    k = request.choose(limit)
    drafted = 0
    while drafted < k:
        drafted += 1
        if not request.keep_drafting(drafted, confidence[drafted - 1]):
            break
    return drafted


def test_a_drafter_reporting_confidence_drafts_as_far_as_it_is_likely_right() -> None:
    policy = _confident_policy()
    request = policy.start()
    request.record_outcome(2, 2, (0.99, 0.99))  # it reports confidence: from now on it stops itself
    assert policy.confident()
    assert _drafted(request, [0.99] * 8) == 8  # sure and cheap: the whole block
    assert _drafted(request, [0.99, 0.99, 0.05, 0.99, 0.99, 0.99, 0.99, 0.99]) == 3  # stops at a token unlikely right
    dear = _confident_policy(draft_per_token=0.5).start()
    dear.record_outcome(2, 2, (0.99, 0.99))
    assert 1 <= _drafted(dear, [0.8] * 8) < 8  # dearer drafts stop sooner
    seeded = policy.start(fixed=True)
    assert _drafted(seeded, [0.01] * 8) == 8  # a seeded sample keeps whole blocks whatever it is told


def test_confidence_is_calibrated_by_outcomes() -> None:
    policy = _confident_policy()
    assert policy.chance(0.9) == pytest.approx(0.9)  # nothing seen: taken at its word
    request = policy.start()
    for _ in range(20):  # sure of tokens that are right only a fifth of the time
        for _ in range(4):
            request.record_outcome(5, 0, (0.99,) * 5)
        request.record_outcome(1, 1, (0.99,))
    assert policy.chance(0.99) < 0.5
    assert _drafted(request, [0.99] * 8) <= 2


def test_a_model_drafter_is_timed_at_load(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter=["ngram", paths["target"]])
    block = model.drafter.model.block_size  # type: ignore[union-attr]
    assert set(model.lengths.summary()["draft_s"]) == set(range(1, block))  # each length the model drafts


def test_a_hybrid_drafter_measures_its_lookup_apart(paths: dict[str, Path]) -> None:
    plain = dflash2.load(paths["target"])
    truth = list(plain.generate(SPEC_PROMPTS[1], max_new_tokens=120).token_ids)
    lookup = dflash2.drafters.NGramDrafter(min_ngram=1, max_ngram=2)  # single tokens recur: it finds matches
    hybrid = dflash2.drafters.HybridDrafter(ScriptedDrafter(truth, [5]), lookup)  # the model half always right
    model = dflash2.load(paths["target"], drafter=hybrid)
    assert list(model.generate(SPEC_PROMPTS[1], max_new_tokens=120).token_ids) == truth
    by_lookup, by_model = model.lengths.prior(3, "lookup"), model.lengths.prior(3)
    assert by_lookup != [0.5] * 3 and by_model != [0.5] * 3  # each learnt from its own drafts
    assert by_model[0] > 0.9 > by_lookup[0]  # the scripted model is right, the lookup of random text is not


def test_bad_policy_options() -> None:
    with pytest.raises(InvalidOptionError, match="mode"):
        DraftLengthPolicy(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="prior_weight"):
        DraftLengthPolicy(prior_weight=0)
    with pytest.raises(InvalidOptionError, match="recheck_every"):
        DraftLengthPolicy(recheck_every=0)
