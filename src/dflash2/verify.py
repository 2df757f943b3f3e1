"""Lossless acceptance of a draft block: pure tensor math, no model, no state.

A verify forward over ``[x, d_1 .. d_k]`` gives target logits ``L[0..k]``; ``L[i]`` scores the
token after input ``i``. Both rules return ``(accepted, next_token)``: the first ``accepted``
draft tokens are kept and ``next_token`` follows them (the bonus after a full accept, the
correction after a rejection). The output distribution equals the target's alone.
"""

from __future__ import annotations

import torch

from dflash2.config import SamplingConfig
from dflash2.sampling import probabilities, sample


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix where the draft equals the target argmax; then the argmax after it.

    ``draft`` [k] ids, ``target_logits`` [k + 1, vocab].
    """
    choice = target_logits.argmax(-1)
    k = draft.shape[0]
    matches = (draft == choice[:k]).int().cumprod(0)
    accepted = int(matches.sum()) if k else 0
    return accepted, int(choice[accepted])


def speculative_sample(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. / Chen et al.), exact in distribution.

    With draft probabilities ``q`` [k, vocab]: keep ``d_i`` with probability
    ``min(1, p(d_i) / q(d_i))``; at the first rejection sample from ``normalize(max(0, p - q))``;
    after a full accept sample the bonus from ``p[k]``. Without ``q`` (a deterministic draft,
    e.g. n-gram lookup) the draft token is kept iff it equals a sample from ``p``, and that
    sample is the correction otherwise. ``target_probs`` [k + 1, vocab] are post-transform.
    """
    k = draft.shape[0]
    for i in range(k):
        token = int(draft[i])
        p = target_probs[i]
        if draft_probs is None:
            sampled = int(sample(p, generator))
            if sampled != token:
                return i, sampled
            continue
        q = draft_probs[i]
        ratio = float(p[token]) / max(float(q[token]), torch.finfo(q.dtype).tiny)
        if ratio >= 1.0 or float(torch.rand((), generator=generator, device=p.device)) < ratio:
            continue
        residual = (p - q).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if float(total) > 0 else p
        return i, int(sample(residual, generator))
    return k, int(sample(target_probs[k], generator))


def accept(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Greedy match at temperature 0, speculative sampling otherwise."""
    if sampling.greedy:
        return greedy_accept(draft, target_logits)
    return speculative_sample(draft, draft_probs, probabilities(target_logits, sampling), generator)
