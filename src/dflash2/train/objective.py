"""The training objective as pure functions: anchors, block layout, visibility, weighted loss.

A training block for anchor ``a`` with ``clean`` tokens: positions ``s .. a`` hold real tokens
(``s = a - clean + 1``; ``clean = 1`` is the plain DFlash block ``[anchor, MASK ...]``), positions
``a + 1 .. a + B - 1`` hold the mask token and are predicted. The block sees the context features
of positions ``< s`` and, bidirectionally, itself; no other block. ``clean > 1`` is the layout of a
pre-draft (``[x, d_1 .. d_k, MASK ...]``, the drafts' features not known yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Weights [B - 1] of predicted positions k = 1 .. B-1: ``exp(-(k - 1) / gamma)``."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(first: int, length: int, count: int, clean: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` distinct anchors in ``[max(first, clean), length - 2]`` (at least one label)."""
    low = max(first, clean)
    high = length - 2
    if high < low:
        return torch.zeros(0, dtype=torch.long)
    choices = torch.randperm(high - low + 1, generator=generator)[:count] + low
    return choices.sort().values


def mix_anchors(uniform: torch.Tensor, replay: torch.Tensor, count: int) -> torch.Tensor:
    """Up to ``count`` distinct anchors: every ``replay`` one first (the caller picks which), then
    ``uniform`` ones, sorted."""
    chosen = torch.unique(replay)[:count]
    rest = uniform[~torch.isin(uniform, chosen)][: max(0, count - chosen.numel())]
    return torch.cat([chosen, rest]).sort().values


@dataclass(frozen=True)
class Blocks:
    """Flattened training blocks of one sequence."""

    ids: torch.Tensor  # [A, L] clean tokens then mask ids, L = clean + B - 1
    positions: torch.Tensor  # [A, L]
    starts: torch.Tensor  # [A] first position of each block (context features stop before it)
    labels: torch.Tensor  # [A, B - 1] target tokens of the masked positions, -100 past the end


def layout(
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    clean: int,
    block_size: int,
    mask_id: int,
    next_tokens: torch.Tensor | None = None,
) -> Blocks:
    """Blocks for ``anchors`` in the sequence ``tokens`` [N].

    The label of position p is ``next_tokens[p - 1]``, the token to predict after position
    p - 1: by default the sequence's own (``tokens[p]``); with the target's teacher-forced
    argmax it is what greedy verification accepts.
    """
    n = tokens.shape[0]
    follows = torch.cat([tokens[1:], tokens[-1:]]) if next_tokens is None else next_tokens
    width = clean + block_size - 1
    starts = anchors - clean + 1
    positions = starts[:, None] + torch.arange(width)[None, :]
    ids = torch.full((anchors.shape[0], width), mask_id, dtype=torch.long)
    ids[:, :clean] = tokens[positions[:, :clean]]
    targets = positions[:, clean:]
    labels = torch.where(targets < n, follows[(targets - 1).clamp(max=n - 2)], torch.full_like(targets, -100))
    return Blocks(ids, positions, starts, labels)


def visibility(blocks: Blocks, context: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [A * L, context + A * L]: each block sees context positions before its start and itself.

    Packed sequences (several in one forward): ``offsets`` [A] is the first context column of each
    block's own sequence; a block sees the columns ``offsets .. offsets + start - 1`` only.
    """
    a, width = blocks.ids.shape
    low = torch.zeros_like(blocks.starts) if offsets is None else offsets
    column = torch.arange(context)[None, :]
    ctx = (column >= low[:, None]) & (column < low[:, None] + blocks.starts[:, None])  # [A, C]
    ctx = ctx.repeat_interleave(width, dim=0)  # [A * L, C]
    owner = torch.arange(a).repeat_interleave(width)
    own = owner[:, None] == owner[None, :]  # [A * L, A * L]
    return torch.cat([ctx, own], dim=1)


def pack(parts: list[Blocks], lengths: list[int]) -> tuple[Blocks, torch.Tensor]:
    """The blocks of several sequences as one (their contexts concatenated, of ``lengths``), and
    each block's context offset for ``visibility``."""
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    offsets = torch.cat([starts[i].expand(b.starts.shape[0]) for i, b in enumerate(parts)])
    merged = Blocks(*(torch.cat([getattr(b, f) for b in parts]) for f in ("ids", "positions", "starts", "labels")))
    return merged, offsets


def weighted_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss (weighted mean CE), per-position correct counts [B - 1] and label counts [B - 1]."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none")
    valid = (labels != -100).float()
    w = weights[None, :] * valid
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp(min=1e-9)
    correct = ((logits.argmax(-1) == labels).float() * valid).sum(0)
    return loss, correct, valid.sum(0)
