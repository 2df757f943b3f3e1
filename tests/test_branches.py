"""Side branches: a drafter's second choices verified beside its draft in the same target forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_speculative import PIPELINES, PROMPTS
from tiny import save_tiny

import dflash2
from dflash2.drafters import Draft, NGramDrafter, Outcome
from dflash2.drafters.base import PreDraft
from dflash2.engine import DraftLengthPolicy
from dflash2.engine.draft_length import best_branches
from dflash2.errors import InvalidOptionError
from dflash2.runtime.model import block_causal_mask, branch_mask, branch_positions
from dflash2.verify import branch_hit


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("branches")
    return {arch: save_tiny(root / arch, arch, seed=5) for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("weights", ["same", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_branch_row_equals_a_forward_of_its_own_text(targets: dict[str, Path], arch: str, weights: str) -> None:
    """Branch j stands in for chain row r: its logits are those of the text [prefix, x, d_1 .. d_r-1, branch]."""
    target = dflash2.load(targets[arch], weights=weights).target
    chain, alternatives = _ids(5, 1), _ids(3, 2)
    rows = [1, 3, 4]
    same = torch.equal if weights == "int4" else lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        cache = target.new_cache(64)
        target(_ids(20, 0), cache, logits="none")
        start = cache.length
        plain = target(chain, cache).logits
        cache.rollback(start)
        out = target(torch.cat([chain, alternatives], 1), cache, branches=rows).logits
        assert out is not None and plain is not None
        assert cache.length == start + 8
        assert same(out[:, :5], plain)  # the chain's rows see nothing of the branches
        for j, row in enumerate(rows):
            cache.rollback(start)
            text = torch.cat([chain[:, :row], alternatives[:, j : j + 1]], 1)
            alone = target(text, cache).logits
            assert alone is not None
            assert same(out[0, 5 + j], alone[0, -1]), (row, j)


def test_a_block_without_branches_gets_the_causal_mask() -> None:
    cpu = torch.device("cpu")
    assert torch.equal(branch_mask(5, branch_positions(5, 4, [], cpu)), block_causal_mask(5, 4, cpu))


def test_branches_need_an_eager_forward_after_a_chain_row(targets: dict[str, Path]) -> None:
    target = dflash2.load(targets["llama"]).target
    with torch.inference_mode(), pytest.raises(ValueError, match="side branches"):
        target(_ids(2, 0), target.new_cache(8), branches=[1, 1])


def test_the_branch_the_target_took() -> None:
    branches = [(0, 7), (2, 5), (2, 9)]
    assert branch_hit(2, 4, 9, branches) == 2  # draft 2 rejected, the target chose 9: the third branch
    assert branch_hit(2, 4, 8, branches) is None  # a token no branch holds
    assert branch_hit(1, 4, 5, branches) is None  # no branch at draft 1
    assert branch_hit(4, 4, 7, branches) is None  # the whole draft accepted: the token is a bonus


def test_branches_go_in_while_they_pay() -> None:
    chances, alternatives = [0.9, 0.5, 0.5], [[0.05], [0.4, 0.1], [0.3]]
    flat = [0.0] + [1.0] * 8  # a forward of up to 8 rows costs what one row does
    assert best_branches(chances, alternatives, flat, 0.3) == [(0, 0), (1, 0), (1, 1), (2, 0)]
    steep = [0.0] + [1.0 + 0.5 * n for n in range(8)]  # each row costs half a forward more
    assert best_branches(chances, alternatives, steep, 0.3) == []
    assert best_branches(chances, alternatives, flat[:6], 0.3) == [(1, 0)]  # one row left: the best branch
    # a taken branch that costs the drafter a forward as dear as the target's is not worth its row
    assert best_branches(chances, alternatives, flat, 0.3, taken=1.0) == []


def test_a_pre_draft_never_follows_a_branch() -> None:
    pre = PreDraft(5, Draft(torch.tensor([1, 2])))
    assert pre.matches(Outcome(3, 5, (1, 2, 3)), 3)
    assert not pre.matches(Outcome(3, 5, (1, 2, 3), branch=True), 3)


def test_branch_modes_are_validated() -> None:
    with pytest.raises(InvalidOptionError, match="branches"):
        DraftLengthPolicy(branches="some")  # type: ignore[arg-type]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize(("weights", "hybrid"), [("same", False), ("int4", False), ("same", True)])
def test_greedy_output_with_every_branch_verified_equals_plain_decoding(
    paths: dict[str, Path], weights: str, hybrid: bool, pipeline: str
) -> None:
    """A quantized copy of the target (in another format than the target's) drafts for it: mostly
    right, and where wrong often second-best. What each request leaves in the prefix cache (taken
    branches' keys and values included) equals a forward over its text."""
    plain = dflash2.load(paths["target"], weights=weights)
    drafter: Any = [NGramDrafter(min_ngram=3), paths["target"]] if hybrid else paths["target"]
    drafted = plain.with_drafter(drafter, drafter_weights="int8" if weights == "int4" else "int4")
    drafted.lengths = DraftLengthPolicy(branches="all")
    target = drafted.target
    same = torch.equal if weights == "int4" else lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    hits = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40)
        got = drafted.generate(prompt, max_new_tokens=40, pipeline=pipeline)
        assert got.token_ids == want.token_ids
        hits += got.stats.branch_hits
        text = [*drafted.tokenizer(prompt).input_ids, *got.token_ids, 0]
        stored = drafted.prefixes.lookup(text)
        assert stored is not None and stored.length == len(text) - 2  # all but the last token ran
        with torch.inference_mode():
            cache = target.new_cache(len(text))
            target(torch.tensor([text[: stored.length]]), cache, logits="none")
        assert same(stored.snapshot.keys[:, :, : stored.length], cache.k[:, 0, :, : stored.length])
        assert same(stored.snapshot.values[:, :, : stored.length], cache.v[:, 0, :, : stored.length])
    assert hits > 0


def _policy(per_row: float, branches: str = "auto") -> DraftLengthPolicy:
    policy = DraftLengthPolicy(branches=branches)  # type: ignore[arg-type]
    for rows in range(1, 9):
        policy.record_verify(rows, 1.0 + per_row * (rows - 1))
    policy.record_draft(1, 0.1)
    policy.record_draft(4, 0.4)
    return policy


def test_a_request_verifies_the_alternatives_that_pay() -> None:
    confidence = (0.9, 0.6, 0.6)
    alternatives = (((7, 0.05),), ((8, 0.3), (9, 0.05)), ((10, 0.3),))
    cheap = _policy(0.0).start()
    assert cheap.branches(confidence, alternatives, rows=8) == [(0, 7, 0.05), (1, 8, 0.3), (1, 9, 0.05), (2, 10, 0.3)]
    assert cheap.branches(confidence, alternatives, rows=5) == [(1, 8, 0.3)]  # one row left: the likeliest
    assert _policy(0.5).start().branches(confidence, alternatives, rows=8) == []  # rows as dear as half a forward
    assert _policy(0.0, "off").start().branches(confidence, alternatives, rows=8) == []
    assert len(_policy(0.5, "all").start().branches(confidence, alternatives, rows=6)) == 2  # as many as fit


def test_a_request_learns_how_often_alternatives_are_taken() -> None:
    policy = _policy(0.0)
    assert policy.branch_chance(0.3) == pytest.approx(0.3)  # nothing seen: taken at its word
    request = policy.start()
    for _ in range(30):  # alternatives at draft 1, never taken; the draft was rejected at 1 or 2
        request.record_branches([(1, 8, 0.3)], accepted=1, taken=None)
        request.record_branches([(1, 8, 0.3), (3, 9, 0.3)], accepted=2, taken=None)  # (3, 9) never reached
    assert policy.branch_chance(0.3) < 0.1
