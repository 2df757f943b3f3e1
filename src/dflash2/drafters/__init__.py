"""Drafters: what proposes tokens for the target to verify.

``load_drafter`` turns the ``drafter=`` argument of :func:`dflash2.load` into a ``Drafter``:
``"ngram"``, a DFlash / DFlash2 checkpoint (detected by its ``dflash_config``), a small causal LM
with the target's tokenizer, ``["ngram", <one of those models>]`` (prompt lookup first, the model
otherwise), or a ready ``Drafter`` object.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from transformers import PreTrainedTokenizerBase

from dflash2.drafters.autoregressive import AutoregressiveDrafter
from dflash2.drafters.base import Draft, DraftContext, Drafter, DraftSession, Outcome
from dflash2.drafters.dflash import DFlashDrafter, DFlashSpec, load_dflash_drafter
from dflash2.drafters.hybrid import HybridDrafter
from dflash2.drafters.ngram import NGramDrafter
from dflash2.drafters.vocabulary import embedding_head, frequent_vocab, read_draft_vocab
from dflash2.errors import DrafterError, InvalidOptionError, TokenizerMismatchError
from dflash2.runtime import twin
from dflash2.runtime.loader import (
    load_decoder,
    load_safetensors,
    load_spec,
    load_tokenizer,
    read_config,
    resolve_checkpoint,
)
from dflash2.runtime.model import Decoder
from dflash2.runtime.packed import load_quantized, quantize_cached
from dflash2.runtime.quant import WeightFormat, check_weight_format, int4_available

__all__ = [
    "AutoregressiveDrafter",
    "DFlashDrafter",
    "Draft",
    "DraftContext",
    "DraftSession",
    "Drafter",
    "HybridDrafter",
    "NGramDrafter",
    "Outcome",
    "check_same_tokenizer",
    "draft_weights",
    "load_drafter",
]


def check_same_tokenizer(target: PreTrainedTokenizerBase, drafter: PreTrainedTokenizerBase) -> None:
    """Raise ``TokenizerMismatchError`` unless both map every token string to the same id."""
    if target.get_vocab() != drafter.get_vocab():
        raise TokenizerMismatchError(
            "the drafter's tokenizer differs from the target's, so its token ids cannot be verified; "
            "use a drafter from the same model family (same vocabulary), or drafter='ngram'."
        )


def load_drafter(
    drafter: Any,
    target: Decoder,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int | None = None,
    weights: str = "auto",
) -> Drafter | None:
    """The drafter ``drafter`` names, for ``target``; ``weights``: see :func:`draft_weights`."""
    fmt = draft_weights(weights, target.device)
    if drafter is None:
        return None
    if isinstance(drafter, str) and drafter == "ngram":
        return NGramDrafter() if block_size is None else NGramDrafter(block_size=block_size)
    if isinstance(drafter, (list, tuple)):
        return _hybrid(drafter, target, tokenizer, block_size, weights)
    if not isinstance(drafter, (str, os.PathLike)):
        if isinstance(drafter, Drafter):
            return drafter
        raise DrafterError(
            f"drafter must be None, 'ngram', a hub id or path, or a Drafter object; got {type(drafter).__name__}."
        )
    checkpoint = resolve_checkpoint(drafter)
    raw = read_config(checkpoint)
    name = os.path.basename(str(drafter).rstrip("/")) or str(drafter)
    if DFlashSpec.is_dflash_config(raw):
        tensors = load_safetensors(checkpoint)
        vocab = read_draft_vocab(checkpoint)
        dflash = load_dflash_drafter(raw, tensors, target, block_size=block_size, name=name, vocab=vocab)
        if weights != "auto":
            dflash.quantize(fmt)
        return dflash
    copies = None
    if weights == "auto" and twin.bf16_pays(load_spec(checkpoint), fmt, target.device):
        draft_model = load_decoder(checkpoint, target.dtype, target.device)
        copies = twin.halves(draft_model)  # from the full-precision weights, before quantizing
        quantize_cached(draft_model, fmt, checkpoint)
    else:
        draft_model = load_quantized(checkpoint, fmt, target.dtype, target.device)
    check_same_tokenizer(tokenizer, load_tokenizer(checkpoint))
    vocab, context = read_draft_vocab(checkpoint), False
    if vocab is None:  # a large vocabulary's frequent tokens + the text's, where the embeddings score them
        frequent = frequent_vocab(min(target.spec.vocab_size, draft_model.spec.vocab_size), tokenizer.all_special_ids)
        if frequent is not None and embedding_head(draft_model) is not None:
            vocab, context = frequent, True
    return AutoregressiveDrafter(
        draft_model,
        target.spec.vocab_size,
        block_size=block_size or AutoregressiveDrafter.default_block_size,
        name=name,
        vocab=vocab,
        prefill=twin.assemble(draft_model, copies) if copies is not None else None,
        context=context,
    )


def draft_weights(weights: str, device: object) -> WeightFormat:
    """The weight format a model drafter runs in: ``weights`` itself, or for ``"auto"`` the
    cheapest that keeps a drafter's agreement: int4 on the CPU (``"bf16"`` where the int4 kernel
    is missing), and on other devices the target's own precision (``"same"``: no conversion).
    Under ``"auto"`` an autoregressive drafter on a CPU that multiplies bf16 faster than the int4
    kernel over many rows also keeps a bf16 copy of its projections for prefills
    (:mod:`dflash2.runtime.twin`).

    A drafter's precision only changes how often its tokens are accepted, never the output.
    DFlash drafters keep the target's precision under ``"auto"`` (their cost is the shared LM head).
    """
    cpu = getattr(device, "type", None) == "cpu"
    if weights == "auto":
        return ("int4" if int4_available(device) else "bf16") if cpu else "same"  # type: ignore[arg-type]
    fmt = check_weight_format(weights, "drafter_weights")
    if fmt in ("int8", "int4") and not cpu:
        raise InvalidOptionError(
            f"drafter_weights={fmt!r} runs on the CPU only (torch's weight-only kernels); on {device} use 'bf16' or "
            "'same'."
        )
    return fmt


def _hybrid(
    spec: list[Any] | tuple[Any, ...],
    target: Decoder,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int | None,
    weights: str,
) -> HybridDrafter:
    """``["ngram" or an NGramDrafter, <model drafter>]`` -> a ``HybridDrafter``."""
    usage = (
        "a drafter list is ['ngram', <a DFlash or autoregressive drafter>]: prompt lookup first, the model otherwise."
    )
    if len(spec) != 2 or not (spec[0] == "ngram" or isinstance(spec[0], NGramDrafter)):
        raise DrafterError(usage)
    model = load_drafter(spec[1], target, tokenizer, block_size, weights)
    if model is None or isinstance(model, (NGramDrafter, HybridDrafter)):
        raise DrafterError(usage)
    lookup = HybridDrafter.default_lookup() if spec[0] == "ngram" else spec[0]
    if block_size is not None:  # the block size asked for holds for both halves
        lookup = dataclasses.replace(lookup, block_size=block_size)
    return HybridDrafter(model, lookup)
