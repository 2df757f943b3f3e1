"""A drafting vocabulary: the token ids a drafter may draft, with a smaller LM head over them.

Tokens outside it are never drafted (the target still emits them, so the output never changes);
on a large vocabulary the LM head is a large share of a draft token's cost. A drafter checkpoint
may carry one beside its weights (``draft_vocab.json``: ``{"token_ids": [...]}``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dflash2.errors import DrafterError
from dflash2.runtime.linear import Linear
from dflash2.runtime.quant import weight_of

DRAFT_VOCAB_FILE = "draft_vocab.json"


def check_vocab(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``vocab`` as sorted, distinct int64 ids of the target's vocabulary, or ``DrafterError``."""
    ids = torch.as_tensor(vocab, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise DrafterError(f"the drafting vocabulary must be a non-empty set of token ids below {vocab_size}.")
    if torch.unique(ids).numel() != ids.numel():
        raise DrafterError("the drafting vocabulary lists a token id twice.")
    return ids.sort().values


def read_draft_vocab(checkpoint: Path) -> torch.Tensor | None:
    """The drafting vocabulary stored beside a drafter (``draft_vocab.json``: ``{"token_ids": [...]}``)."""
    path = checkpoint / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
        return torch.tensor([int(i) for i in ids], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as err:
        raise DrafterError(f'{path} is not a drafting vocabulary ({{"token_ids": [...]}}): {err}') from err


def vocab_head(lm_head: nn.Module, vocab: torch.Tensor, dtype: torch.dtype, multiple: int = 1) -> Linear:
    """A head of ``lm_head``'s rows for ``vocab`` (any format in, ``dtype`` out), zero rows added up
    to a multiple of ``multiple`` (a kernel's row tile; the caller keeps the first ``len(vocab)``)."""
    weight = weight_of(lm_head, vocab).to(dtype)
    rows = -(-weight.shape[0] // multiple) * multiple
    head = Linear(weight.shape[1], rows)
    head.weight = nn.Parameter(torch.cat([weight, weight.new_zeros(rows - len(vocab), weight.shape[1])]))
    return head.requires_grad_(False)


def to_full_vocab(probs: torch.Tensor, vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Distributions over ``vocab`` [..., len(vocab)] as ones over all ``vocab_size`` tokens (zero elsewhere)."""
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return full.index_copy_(-1, vocab, probs)
