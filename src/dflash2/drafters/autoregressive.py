"""A small causal LM with the target's tokenizer drafts k tokens one at a time.

It runs on the same runtime as the target, with its own KV cache per request, in whatever
weights it was loaded with (int4 by default on the CPU: its precision changes how often its
tokens are accepted, never the output), forwards over many tokens (the prompt) on a bf16 twin
where one was built (``runtime.twin``). Under sampling each draft token is sampled from the
drafter's distribution after the request's temperature / top-k / top-p transform, and that
distribution travels with the draft for lossless acceptance. After each token the session asks
the engine whether another one pays (``DraftContext.keep_drafting``), telling it how sure the
drafter was of the token. A drafting vocabulary (``vocab``: the token ids it may draft) puts a
smaller LM head in place of the full one: on a large vocabulary the head is a large share of a
draft token's cost, and tokens outside it are simply never drafted (the target still emits them).
Of a long stretch of text it has not cached (a new long prompt) it reads only a window
(:mod:`dflash2.drafters.window`), so that catching up on it stays short.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash2.config import SamplingConfig
from dflash2.drafters.base import Draft, DraftContext, Outcome, PreDraft
from dflash2.drafters.vocabulary import ContextRows, check_vocab, to_full_vocab, vocab_head
from dflash2.drafters.window import View
from dflash2.errors import InvalidOptionError
from dflash2.runtime.graphs import MAX_BUCKET, DecoderPool, Slot, StepMode
from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.linear import Linear
from dflash2.runtime.model import Decoder
from dflash2.runtime.quant import INT4_ROWS, format_of, quantize_linear
from dflash2.runtime.twin import TWIN_ROWS
from dflash2.sampling import probabilities, sample
from dflash2.tokenize import common_prefix

STEP_READING = 2  # tokens a step leaves to read: the last draft token and the bonus (or a correction)
ALTERNATIVES = 2  # next choices per greedy draft token offered for side branches (``Draft.alternatives``)


@dataclass(frozen=True)
class DraftState:
    """What an autoregressive session leaves for a later request: its cache over the tokens of
    ``tokens`` that ``view`` reads (the first ``keys.shape[2]`` of them)."""

    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, T, head_dim]
    values: torch.Tensor
    view: View


class AutoregressiveDrafter:
    """Drafts ``block_size - 1`` tokens per step with ``model`` (shares no weights with the target).

    ``window``: of a stretch of text it has not cached that is longer than this, it reads the
    text's first tokens and the last ``window`` (``None``: it reads everything). ``context``: with
    a ``vocab``, it also drafts any token of the request's text, scoring it by the model's embedding
    table (which must stand in for its LM head: :func:`~dflash2.drafters.vocabulary.embedding_head`).
    """

    capture_layers: tuple[int, ...] = ()
    default_block_size = 12  # a step drafts as far as the drafter is likely right (see engine.draft_length)
    default_window = 128

    def __init__(
        self,
        model: Decoder,
        target_vocab_size: int,
        block_size: int = default_block_size,
        name: str = "autoregressive",
        vocab: torch.Tensor | None = None,
        prefill: Decoder | None = None,
        window: int | None = default_window,
        context: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or not 2 <= block_size <= 64:
            raise InvalidOptionError(f"block_size must be an int in [2, 64], got {block_size!r}.")
        self.window = window
        self.model = model
        self.block_size = block_size
        self.name = name
        self.target_vocab_size = target_vocab_size
        self.steps: DecoderPool | None = None
        self.vocab: torch.Tensor | None = None  # sorted token ids it drafts (None: all)
        self.head: torch.nn.Module | None = None  # the LM head's rows of those ids, in its format
        self.prefill = prefill  # computes forwards of TWIN_ROWS tokens or more (runtime.twin), or None
        self.context = False  # also drafts the tokens of each request's text (see ContextRows)
        if vocab is not None:
            self.vocab = check_vocab(vocab, min(target_vocab_size, model.spec.vocab_size)).to(model.device)
            self.head = _head_over(model, self.vocab)
            self.context = context
        model.pack()

    @property
    def window(self) -> int | None:
        """Tokens it reads of the end of a long stretch of text it has not cached (``None``: all)."""
        return self._window

    @window.setter
    def window(self, window: int | None) -> None:
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise InvalidOptionError(f"window must be a positive int or None, got {window!r}.")
        self._window = window

    @property
    def max_context(self) -> int:
        """Prompt + new tokens it can draft for: its context. Nothing it drafts, ahead or not, lies
        past the request's last position (drafts never exceed what is left to generate)."""
        return self.model.spec.max_position_embeddings

    def use_static_steps(self, mode: StepMode, context: int, slots: int) -> None:
        self.steps = DecoderPool(self.model, mode, context, slots)

    def prepare_static_steps(self) -> None:
        if self.steps is not None:
            self.steps.prepare((1,))  # drafting is one token at a time; catching up uses other sizes

    def resident_sessions(self) -> bool:
        return False  # which cached tokens a draft reuses is decided on the host

    def start(self, context: DraftContext) -> AutoregressiveSession:
        return AutoregressiveSession(self, context)


def _head_over(model: Decoder, vocab: torch.Tensor) -> torch.nn.Module:
    """``model``'s LM head cut to the rows of ``vocab``, in the head's own format (rows padded to
    the int4 kernel's 16: the caller keeps the first ``len(vocab)``)."""
    head = vocab_head(model.lm_head, vocab, model.dtype, multiple=INT4_ROWS)
    quantized = quantize_linear(head, format_of(model.lm_head))
    if isinstance(quantized, Linear):
        quantized.pack()
    return quantized


class AutoregressiveSession:
    """Keeps the draft model's cache on the verified text; drafts by sequential forwards.

    ``_seq`` is the verified text (prompt + output; its last token is the last verified one)
    and ``_cached`` the tokens whose keys/values are in the draft cache. Before drafting, the
    cache is cut back to their common prefix and the rest of ``_seq`` is fed, so accepted,
    rejected and pre-drafted tokens all fall out of one rule.
    """

    def __init__(self, drafter: AutoregressiveDrafter, context: DraftContext) -> None:
        self._d = drafter
        self._model = drafter.model
        self._sampling = context.sampling
        self._generator = context.generator
        self._keep_drafting = context.keep_drafting
        capacity = context.max_tokens + 2 * drafter.block_size
        self._slot: Slot | None = drafter.steps.acquire(capacity) if drafter.steps is not None else None
        self._cache: KVCache | None = self._slot.cache if self._slot is not None else self._model.new_cache(capacity)
        self._seq: list[int] = [*context.prompt_ids, context.first_token]
        self._cached: list[int] = []  # the cached tokens of the view (``_view.of``) of the text
        self._view = View().reading(len(self._seq), drafter.window)  # what a cold session reads
        self._proposal: list[int] = []
        self._pre: PreDraft | None = None
        self._context: ContextRows | None = None
        self._scanned = 0  # tokens of ``_seq`` the context rows have taken in
        if drafter.context and drafter.vocab is not None:
            self._context = ContextRows(drafter.model.embed_tokens.weight, drafter.vocab)
        if isinstance(context.resume, DraftState) and self._slot is None:
            self._resume(context.resume)

    def _resume(self, state: DraftState) -> None:
        """Start from the state an earlier session left for a text this one's starts with. Greedy,
        it goes on reading what that session read, so that more of its cache serves (greedy output
        does not depend on the drafts); sampling, it reads what a cold session reads, so that a
        seed gives the same text with or without the prefix cache."""
        assert self._cache is not None
        common = common_prefix(state.tokens, self._seq, len(self._seq) - 1)  # the last token is fed for logits
        theirs = state.view.of(list(range(common)))[: state.keys.shape[2]]  # positions of its usable entries
        if self._sampling.greedy and theirs:
            self._view = state.view.up_to(theirs[-1] + 1).reading(len(self._seq), self._d.window)
        usable = common_prefix(self._view.of(list(range(len(self._seq)))), theirs)
        if usable == 0:
            return
        self._cache.k[:, 0, :, :usable] = state.keys[:, :, :usable]
        self._cache.v[:, 0, :, :usable] = state.values[:, :, :usable]
        self._cache.advance(usable)
        self._cached = self._view.of(self._seq)[:usable]

    def snapshot(self) -> DraftState | None:
        """The draft cache (see ``Resumable``), or ``None``; a static slot's (whose steps attend
        over the whole masked cache) is not kept."""
        if self._cache is None or self._slot is not None:
            return None
        n, cache = common_prefix(self._cached, self._view.of(self._seq)), self._cache
        if n == 0:
            return None
        keys, values = cache.k[:, 0, :, :n].clone(), cache.v[:, 0, :, :n].clone()
        return DraftState(tuple(self._seq), keys, values, self._view)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Restrict (or pad) the drafter's logits to the target's vocabulary size."""
        vocab = self._d.target_vocab_size
        if logits.shape[-1] > vocab:
            return logits[..., :vocab]
        if logits.shape[-1] < vocab:
            pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def _reader(self, tokens: int) -> Decoder:
        """The model that reads ``tokens`` tokens at once: the prefill twin for many, if there is one."""
        return self._d.prefill if self._d.prefill is not None and tokens >= TWIN_ROWS else self._model

    def _read(self, tokens: list[int]) -> float:
        """Process ``tokens`` after the cached ones, without logits (text the drafter fell behind
        on, read apart from drafting); the seconds that took."""
        assert self._cache is not None
        start = time.perf_counter()
        ids = torch.tensor(tokens, device=self._model.device)
        if self._slot is not None and len(tokens) <= MAX_BUCKET:
            self._slot.forward(ids)
        else:
            self._reader(len(tokens))(ids[None], self._cache, logits="none")
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
        self._cached.extend(tokens)
        return time.perf_counter() - start

    def _drafting_ids(self) -> torch.Tensor | None:
        """The token ids it drafts over now, in the order of :meth:`_feed`'s logits (None: all)."""
        return self._d.vocab if self._context is None else self._context.drafting

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Process ``tokens`` after the cached ones; logits after the last of them (over the
        drafting vocabulary and the context's tokens when there is one: :meth:`_drafting_ids`)."""
        assert self._cache is not None
        ids = torch.tensor(tokens, device=self._model.device)
        vocab, head, context = self._d.vocab, self._d.head, self._context
        model = self._reader(len(tokens))
        if self._slot is not None and len(tokens) <= MAX_BUCKET:
            last = self._slot.forward(ids)[0][-1]
            drafting = self._drafting_ids()
            last = last if drafting is None else last[drafting]
        elif head is not None and vocab is not None:  # the final hidden state through the vocabulary's head
            out = model(ids[None], self._cache, logits="none", capture=(model.spec.num_layers - 1,))
            assert out.hidden is not None
            last = head(out.hidden[0, -1:])[0, : len(vocab)]
            if context is not None and len(context.ids):
                last = torch.cat([last, context.logits(out.hidden[0, -1])])
        else:
            logits = model(ids[None], self._cache, logits="last").logits
            assert logits is not None
            last = logits[0, -1]
        self._cached.extend(tokens)
        return last if vocab is not None else self._fit_vocab(last)

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None, float, tuple[tuple[int, float], ...]]:
        """The next draft token from ``logits`` (greedy or sampled), its distribution over the
        target's vocabulary (sampling only), the drafter's probability of it and, when greedy, its
        next choices with theirs (see ``Draft.alternatives``)."""
        vocab = self._drafting_ids()
        others: tuple[tuple[int, float], ...] = ()
        if self._sampling.greedy:
            column = int(logits.argmax())
            probs = torch.softmax(logits.float(), -1)
            sure, row = float(probs[column]), None
            best, columns = probs.topk(ALTERNATIVES + 1)
            others = tuple(
                (c if vocab is None else int(vocab[c]), p)
                for p, c in zip(best.tolist(), columns.tolist(), strict=True)
                if c != column
            )[:ALTERNATIVES]
        else:
            q = probabilities(logits, self._sampling)
            column = int(sample(q, self._generator))
            sure, row = float(q[column]), q
            if vocab is not None:  # zero outside the drafting vocabulary
                row = to_full_vocab(q, vocab, self._d.target_vocab_size)
        return (column if vocab is None else int(vocab[column])), row, sure, others

    def _draft_after(self, context: list[int], count: int, stop_early: bool = False) -> Draft:
        """Draft up to ``count`` tokens continuing ``context`` (its last token included); with
        ``stop_early`` fewer when the engine says another token does not pay."""
        assert self._cache is not None
        if self._context is not None:  # the verified text's new tokens become draftable
            self._context.add(self._seq[self._scanned :])
            self._scanned = len(self._seq)
        context = self._view.of(context)
        common = common_prefix(self._cached, context, len(context) - 1)  # the last token is fed for logits
        self._cache.rollback(common)
        del self._cached[common:]
        fresh, catch_up_s = context[common:], 0.0
        if len(fresh) > STEP_READING:  # text it fell behind on: read apart, so that drafting is timed alone
            catch_up_s = self._read(fresh[:-1])
            fresh = fresh[-1:]
        logits = self._feed(fresh)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        sure: list[float] = []
        others: list[tuple[tuple[int, float], ...]] = []
        keep = self._keep_drafting if stop_early else None
        for i in range(count):
            token, row, p, alternatives = self._pick(logits)
            tokens.append(token)
            sure.append(p)
            others.append(alternatives)
            if row is not None:
                rows.append(row)
            if i + 1 == count or (keep is not None and not keep(i + 1, sure[-1])):
                break
            logits = self._feed([token])
        probs = torch.stack(rows) if rows else None
        offered = tuple(others) if any(others) else ()
        return Draft(torch.tensor(tokens, dtype=torch.long), probs, tuple(sure), offered, catch_up_s)

    def propose(self, max_tokens: int) -> Draft:
        k = min(self._d.block_size - 1, max_tokens)
        draft = self._draft_after(self._seq, k, stop_early=True) if k > 0 else Draft(torch.zeros(0, dtype=torch.long))
        self._proposal = draft.tokens.tolist()
        return draft

    def can_predraft(self) -> bool:
        return bool(self._proposal)

    def predraft(self, max_tokens: int) -> PreDraft | None:
        """Assume the whole proposal is accepted: guess the bonus, then draft after it."""
        k = min(self._d.block_size - 1, max_tokens)
        if not self._proposal or k <= 0:
            return None
        hypothesis = self._seq + self._proposal
        guess = self._draft_after(hypothesis, 1) if self._sampling.greedy else self._greedy_guess(hypothesis)
        bonus = int(guess.tokens[0])
        self._pre = PreDraft(bonus, self._draft_after([*hypothesis, bonus], k))
        return self._pre

    def _greedy_guess(self, context: list[int]) -> Draft:
        """Under sampling the bonus is drawn from the target; guess its most likely value."""
        saved, self._sampling = self._sampling, SamplingConfig()
        try:
            return self._draft_after(context, 1)
        finally:
            self._sampling = saved

    def observe(self, outcome: Outcome) -> None:
        pre, self._pre = self._pre, None
        if pre is not None and pre.matches(outcome, len(self._proposal)):
            self._seq += [*self._proposal, pre.next_token]
            self._proposal = [int(t) for t in pre.draft.tokens]
            return
        self._seq += [*outcome.tokens, outcome.next_token]
        self._proposal = []

    def close(self) -> None:
        self._cache = None
        slot, self._slot = self._slot, None
        if slot is not None and self._d.steps is not None:
            self._d.steps.release(slot)
