"""The drafting vocabulary: the fewest tokens that cover a share of what the drafter must predict.

A drafter only proposes tokens, so limiting it to the tokens the target actually produces
keeps drafting lossless while its LM head shrinks (SmolLM2: 49,152 rows; its self-distilled
answers use a small fraction of them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def covering_vocab(labels: Iterable[torch.Tensor], vocab_size: int, coverage: float) -> torch.Tensor:
    """Sorted ids of the most frequent tokens in ``labels`` whose counts reach ``coverage`` of all."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for chunk in labels:
        counts += torch.bincount(chunk.flatten().long(), minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)
    cumulative = counts[order].cumsum(0)
    needed = int(torch.searchsorted(cumulative, coverage * float(cumulative[-1]))) + 1
    return order[: min(needed, int((counts > 0).sum()))].sort().values
