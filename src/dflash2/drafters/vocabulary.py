"""A drafting vocabulary: the token ids a drafter may draft, with a smaller LM head over them.

Tokens outside it are never drafted (the target still emits them, so the output never changes);
on a large vocabulary the LM head is a large share of a draft token's cost. A drafter checkpoint
may carry one beside its weights (``draft_vocab.json``: ``{"token_ids": [...]}``). Without one a
small LM drafter of a large vocabulary drafts over its most frequent tokens and, from its
embedding table, over every token of the request's own text (:class:`ContextRows`): the
identifiers of a program, the names of a document, which a frequency cut would miss.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dflash2.errors import DrafterError
from dflash2.runtime.linear import Linear
from dflash2.runtime.model import Decoder
from dflash2.runtime.quant import weight_of

DRAFT_VOCAB_FILE = "draft_vocab.json"
HEAD_AGREEMENT = 0.25  # relative error within which an embedding table stands in for an untied LM head
LARGE_VOCAB = 100_000  # vocabularies of at least this many tokens get a default drafting vocabulary
FREQUENT_IDS = 65_536  # of which the lowest ids: a byte-level BPE numbers its pieces in merge order,
# the most frequent first (Qwen2.5-Coder's first 65,536 with the prompt's own tokens held every token
# of its greedy answers to 6 code prompts and 99.7 % of those to 6 chat prompts)


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


def frequent_vocab(vocab_size: int, special_ids: Sequence[int]) -> torch.Tensor | None:
    """The default drafting vocabulary of a vocabulary of ``vocab_size`` tokens: its first
    ``FREQUENT_IDS`` ids and its special tokens (an end of text among them); ``None`` below
    ``LARGE_VOCAB`` tokens, where the whole LM head is cheap enough."""
    if vocab_size < LARGE_VOCAB:
        return None
    special = [i for i in special_ids if FREQUENT_IDS <= i < vocab_size]
    return torch.unique(torch.cat([torch.arange(FREQUENT_IDS), torch.tensor(special, dtype=torch.long)]))


def embedding_head(model: Decoder) -> torch.Tensor | None:
    """``model``'s embedding table where it can score tokens as its LM head does: a tied head, or
    one whose products agree with the table's within ``HEAD_AGREEMENT`` (a GGUF file may store a
    tied head twice, quantized apart: Qwen2.5-Coder-0.5B's int4 head is 9 % from its table, as
    from its own fp32 weights 8 %, where an unrelated table is 140 % off); else ``None``."""
    table = model.embed_tokens.weight
    if model.spec.tie_word_embeddings:
        return table
    probe = torch.randn(4, table.shape[1], generator=torch.Generator().manual_seed(0)).to(table)
    with torch.inference_mode():
        head = model.lm_head(probe).float()
        mine = (probe @ table.t()).float()
    if head.shape != mine.shape:
        return None
    return table if float((head - mine).norm()) <= HEAD_AGREEMENT * float(head.norm()) else None


class ContextRows:
    """The tokens of a request's text outside a drafting vocabulary ``vocab``, with their rows of
    ``table`` (an embedding table standing in for the LM head: :func:`embedding_head`), so that a
    drafter may draft them too. ``drafting``: ``vocab`` then those tokens, the order of the
    logits a drafter makes of its head's and :meth:`logits`."""

    def __init__(self, table: torch.Tensor, vocab: torch.Tensor) -> None:
        self._table = table
        self._known = torch.zeros(table.shape[0], dtype=torch.bool)
        self._known[vocab.cpu()] = True
        self.drafting = vocab
        self.ids = torch.zeros(0, dtype=torch.long, device=table.device)
        self.rows = table.new_zeros(0, table.shape[1])

    def add(self, tokens: Sequence[int]) -> None:
        """Take in ``tokens`` (ids of the text), adding those not seen before."""
        if not tokens:
            return
        ids = torch.unique(torch.tensor(tokens, dtype=torch.long))
        ids = ids[ids < len(self._known)]  # a target's token past the drafter's table: never drafted
        new = ids[~self._known[ids]]
        if len(new) == 0:
            return
        self._known[new] = True
        new = new.to(self._table.device)
        self.ids = torch.cat([self.ids, new])
        self.rows = torch.cat([self.rows, self._table[new]])
        self.drafting = torch.cat([self.drafting, new])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [len(ids)] of the context tokens for a final hidden state ``hidden`` [H]."""
        return self.rows @ hidden.to(self.rows.dtype)
