"""The pure acceptance rules, and the vectorized sampler against the exact law of the textbook rule."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from dflash2.config import SamplingConfig
from dflash2.verify import accept, greedy_accept, speculative_sample


def ints(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    accepted, token = pair
    assert accepted.dim() == 0 and token.dim() == 0  # tensors: the engine reads them in one copy
    return int(accepted), int(token)


def one_hot_logits(choices: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_greedy_accept_prefix_and_bonus() -> None:
    logits = one_hot_logits([1, 2, 3, 4])
    assert ints(greedy_accept(torch.tensor([1, 2, 3]), logits)) == (3, 4)  # all kept, bonus after
    assert ints(greedy_accept(torch.tensor([1, 5, 3]), logits)) == (1, 2)  # stops at the first mismatch
    assert ints(greedy_accept(torch.tensor([0, 2, 3]), logits)) == (0, 1)
    assert ints(greedy_accept(torch.tensor([], dtype=torch.long), logits[:1])) == (0, 1)  # plain decoding


def test_identical_draft_distribution_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    for _ in range(50):
        draft = torch.multinomial(p[:3], 1, generator=g)[:, 0]
        accepted, _ = ints(speculative_sample(draft, p[:3], p, g))
        assert accepted == 3


def test_impossible_draft_token_is_rejected_and_corrected() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    assert ints(speculative_sample(torch.tensor([0]), q, p, g)) == (0, 1)  # residual max(0, p - q) is token 1


def test_deterministic_draft_is_kept_iff_it_equals_a_sample() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert ints(speculative_sample(torch.tensor([1, 0]), None, p, g)) == (2, 1)
    assert ints(speculative_sample(torch.tensor([1, 1]), None, p, g)) == (1, 0)


def test_accept_dispatches_on_temperature() -> None:
    logits = one_hot_logits([2, 3])
    assert ints(accept(torch.tensor([2]), None, logits, SamplingConfig(), None)) == (1, 3)
    g = torch.Generator().manual_seed(1)
    pair = accept(torch.tensor([2]), None, logits * 10, SamplingConfig(temperature=1.0), g)
    assert ints(pair) == (1, 3)  # near one-hot target: the sample equals the draft


def exact_law(q: torch.Tensor, p: torch.Tensor, with_q: bool) -> dict[tuple[int, int], float]:
    """P(accepted = i, next = t) of the textbook rule when each draft token is drawn from ``q``.

    Position i keeps its token with probability sum_x min(p_i, q_i) (with ``q``) or sum_x q_i p_i
    (the draft must equal a sample of p); a rejection there gives t with probability
    max(0, p_i(t) - q_i(t)) or p_i(t) (1 - q_i(t)); after a full accept t ~ p_k.
    """
    k, vocab = q.shape
    law: dict[tuple[int, int], float] = {}
    reach = 1.0
    for i in range(k):
        rejected = (p[i] - q[i]).clamp_min(0.0) if with_q else p[i] * (1 - q[i])
        for t in range(vocab):
            law[(i, t)] = reach * float(rejected[t])
        reach *= float(torch.minimum(p[i], q[i]).sum() if with_q else (p[i] * q[i]).sum())
    for t in range(vocab):
        law[(k, t)] = reach * float(p[k, t])
    return law


@pytest.mark.parametrize("with_q", [True, False])
def test_vectorized_sampler_has_the_law_of_the_textbook_rule(with_q: bool) -> None:
    """The joint law of (accepted, next token), drafts drawn from q, passes a chi-square test."""
    g = torch.Generator().manual_seed(3)
    vocab, k, trials = 4, 3, 8000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g, dtype=torch.float64), -1)
    law = exact_law(q, p, with_q)
    assert abs(sum(law.values()) - 1) < 1e-9
    counts = Counter(
        ints(speculative_sample(torch.multinomial(q, 1, generator=g)[:, 0], q if with_q else None, p, g))
        for _ in range(trials)
    )
    keys = [key for key, prob in law.items() if prob > 0]
    assert set(counts) <= set(keys)
    observed = [counts[key] for key in keys]
    expected = [law[key] * trials for key in keys]
    assert chisquare(observed, expected).pvalue > 0.001, (counts, law)
