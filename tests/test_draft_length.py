"""The draft-length policy: the math, and what it chooses for drafters that are never or always right.

Output never depends on the length (greedy identity here, the sampling distribution in
``test_sampling_distribution.py``). Costs are injected, so that choices, and the tests, do not
depend on this machine's timing; speed itself is measured in the benchmarks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_speculative import ScriptedDrafter
from tiny import SPEC_PROMPTS

import dflash2
from dflash2 import InvalidOptionError
from dflash2.engine import DraftLengthPolicy
from dflash2.engine.draft_length import DraftLength, best_length, expected_yield


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


class InjectedCosts(DraftLengthPolicy):
    """Costs fixed in advance (a forward of T tokens: 1 + 0.1 (T - 1); a draft: 0.05 per step)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.requests: list[DraftLength] = []
        for tokens in range(1, 65):
            super().record_verify(tokens, self.forward(tokens))
            super().record_draft(tokens, 0.05)

    @staticmethod
    def forward(tokens: int) -> float:
        return 1.0 + 0.1 * (tokens - 1)

    def record_verify(self, tokens: int, seconds: float) -> None:
        pass

    def record_draft(self, tokens: int, seconds: float) -> None:
        pass

    def start(self, fixed: bool = False) -> DraftLength:
        self.requests.append(super().start(fixed))
        return self.requests[-1]

    def modelled_seconds(self) -> float:
        """What the requests' chosen lengths cost under these costs."""
        chosen = [k for request in self.requests for k in request.chosen]
        return sum(self.forward(k + 1) + (0.05 if k else 0.0) for k in chosen)


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


def test_a_drafter_that_is_always_right_drafts_whole_blocks(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter=paths["target"], block_size=5)  # the target drafting for itself
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


def test_bad_policy_options() -> None:
    with pytest.raises(InvalidOptionError, match="mode"):
        DraftLengthPolicy(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="prior_weight"):
        DraftLengthPolicy(prior_weight=0)
    with pytest.raises(InvalidOptionError, match="recheck_every"):
        DraftLengthPolicy(recheck_every=0)
