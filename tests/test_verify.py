"""The pure acceptance rules."""

from __future__ import annotations

import torch

from dflash2.config import SamplingConfig
from dflash2.verify import accept, greedy_accept, speculative_sample


def one_hot_logits(choices: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_greedy_accept_prefix_and_bonus() -> None:
    logits = one_hot_logits([1, 2, 3, 4])
    assert greedy_accept(torch.tensor([1, 2, 3]), logits) == (3, 4)  # all kept, bonus after
    assert greedy_accept(torch.tensor([1, 5, 3]), logits) == (1, 2)  # stops at the first mismatch
    assert greedy_accept(torch.tensor([0, 2, 3]), logits) == (0, 1)
    assert greedy_accept(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 1)  # plain decoding


def test_identical_draft_distribution_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    for _ in range(50):
        draft = torch.multinomial(p[:3], 1, generator=g)[:, 0]
        accepted, _ = speculative_sample(draft, p[:3], p, g)
        assert accepted == 3


def test_impossible_draft_token_is_rejected_and_corrected() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    accepted, token = speculative_sample(torch.tensor([0]), q, p, g)
    assert (accepted, token) == (0, 1)  # residual max(0, p - q) only has token 1


def test_deterministic_draft_is_kept_iff_it_equals_a_sample() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert speculative_sample(torch.tensor([1, 0]), None, p, g) == (2, 1)
    assert speculative_sample(torch.tensor([1, 1]), None, p, g) == (1, 0)


def test_accept_dispatches_on_temperature() -> None:
    logits = one_hot_logits([2, 3])
    assert accept(torch.tensor([2]), None, logits, SamplingConfig(), None) == (1, 3)
    g = torch.Generator().manual_seed(1)
    accepted, token = accept(torch.tensor([2]), None, logits * 10, SamplingConfig(temperature=1.0), g)
    assert (accepted, token) == (1, 3)  # near one-hot target: the sample equals the draft
