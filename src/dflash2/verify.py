"""Lossless acceptance of a draft block: pure tensor math, no model, no state.

A verify forward over ``[x, d_1 .. d_k]`` gives target logits ``L[0..k]``; ``L[i]`` scores the
token after input ``i``. Both rules return ``(accepted, next_token)`` as 0-dim tensors on the
logits' device (the engine reads them with one host copy per step): the first ``accepted`` draft
tokens are kept and ``next_token`` follows them (the bonus after a full accept, the correction
after a rejection). The output distribution equals the target's alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash2.config import SamplingConfig
from dflash2.sampling import probabilities, sample


def pick(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for a 0-dim device ``index``, without the host read that ``rows[index]`` does."""
    return rows.index_select(0, index.view(1))[0]


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix where the draft equals the target argmax; then the argmax after it.

    ``draft`` [k] ids, ``target_logits`` [k + 1, vocab].
    """
    choice = target_logits.argmax(-1)
    accepted = (draft == choice[: draft.shape[0]]).long().cumprod(0).sum()
    return accepted, pick(choice, accepted)


def speculative_sample(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. / Chen et al.), exact in distribution.

    With draft probabilities ``q`` [k, vocab]: keep ``d_i`` with probability
    ``min(1, p(d_i) / q(d_i))``; at the first rejection sample from ``normalize(max(0, p - q))``;
    after a full accept sample the bonus from ``p[k]``. Without ``q`` (a deterministic draft,
    e.g. n-gram lookup) the draft token is kept iff it equals a sample from ``p``, and that
    sample is the correction otherwise. ``target_probs`` [k + 1, vocab] are post-transform.

    Every position is decided at once (one uniform per draft token) and the next token is drawn
    from the one row the first rejection selects, so the rule is a few tensor ops with no host
    synchronisation. A deterministic draft is the case ``q = one_hot(d)``: ``d_i`` is kept with
    probability ``p(d_i)``, and a rejection samples ``p`` without ``d_i``, which is the law of
    "keep iff it equals a sample of p, else that sample".
    """
    k, vocab = draft.shape[0], target_probs.shape[-1]
    rows = torch.arange(k, device=draft.device)
    kept = target_probs[rows, draft]
    if draft_probs is not None:
        tiny = torch.finfo(draft_probs.dtype).tiny
        kept = kept / draft_probs[rows, draft].clamp_min(tiny)
    uniform = torch.rand(k, generator=generator, device=target_probs.device)
    accepted = (uniform < kept).long().cumprod(0).sum()
    p = pick(target_probs, accepted)  # the position of the first rejection, or the bonus row k
    if draft_probs is not None:
        q = pick(torch.cat([draft_probs, draft_probs.new_zeros(1, vocab)]), accepted)
    else:  # one_hot(d_accepted), or nothing after a full accept
        rejected = (accepted < k).to(p.dtype).view(1)
        q = p.new_zeros(vocab).scatter_(0, pick(torch.cat([draft, draft.new_zeros(1)]), accepted).view(1), rejected)
    residual = (p - q).clamp_min(0.0)  # unnormalized: sampling normalizes
    residual = torch.where(residual.sum() > 0, residual, p)
    return accepted, sample(residual, generator)


def accept(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy match at temperature 0, speculative sampling otherwise; 0-dim tensors on the logits' device."""
    if sampling.greedy:
        return greedy_accept(draft, target_logits)
    return speculative_sample(draft, draft_probs, probabilities(target_logits, sampling), generator)


def branch_hit(accepted: int, drafted: int, token: int, branches: Sequence[tuple[int, int]]) -> int | None:
    """Greedy decoding with side branches: which branch the target took, if any.

    ``branches`` lists ``(i, t)``: token ``t`` verified as an alternative to draft token ``i``
    (0-based), seeing the drafts before it. When the first ``accepted`` of ``drafted`` draft
    tokens were kept and ``token`` (the target's choice) replaces draft ``accepted``, a branch
    ``(accepted, token)`` already holds that token's forward: its index, else ``None``.
    """
    if accepted >= drafted:
        return None
    for j, (i, t) in enumerate(branches):
        if i == accepted and t == token:
            return j
    return None
