"""``dflash2.load()`` and ``Model``: the public entry points."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from transformers import PreTrainedTokenizerBase
from typing_extensions import Unpack

from dflash2.config import (
    GenerationConfig,
    GenerationOptions,
    GraphConfig,
    GraphMode,
    SamplingConfig,
    SpeculativeConfig,
    parse_generation_options,
)
from dflash2.drafters import AutoregressiveDrafter, DFlashDrafter, Drafter, HybridDrafter, load_drafter
from dflash2.drafters.base import Draft, StaticStepping, drafter_context
from dflash2.engine import (
    AsyncPipeline,
    Batcher,
    DraftLengthPolicy,
    OverlapPolicy,
    Request,
    ResidentPipeline,
    SyncPipeline,
)
from dflash2.engine.prefix_cache import PrefixCache
from dflash2.errors import ContextLengthError, InvalidOptionError, StreamStateError
from dflash2.runtime.device import resolve_device, resolve_dtype
from dflash2.runtime.graphs import MAX_BUCKET, DecoderPool, buckets_up_to
from dflash2.runtime.loader import load_eos_ids, load_tokenizer, resolve_checkpoint
from dflash2.runtime.model import Decoder
from dflash2.runtime.packed import load_quantized
from dflash2.runtime.quant import check_bf16_rows, check_target_weights, check_weight_format
from dflash2.runtime.threads import Threads, check_threads
from dflash2.runtime.workers import Workers, release_thread_pool
from dflash2.stream import BlockingTokenStream, Completion, TokenSource, TokenStream
from dflash2.tokenize import Prompt, encode_prompt


class Model:
    """A loaded target model (and, later, its drafter). Safe to share between concurrent streams."""

    def __init__(
        self,
        target: Decoder,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        name: str,
        checkpoint: Path,
        drafter: Drafter | None = None,
        workers: Workers | None = None,
        graphs: GraphConfig | None = None,
        steps: DecoderPool | None = None,
        max_batch: int = 8,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.target = target
        # requests' state left for later ones that start the same way (shared with with_drafter's models)
        self.prefixes = prefixes if prefixes is not None else PrefixCache(0)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.name = name
        self.checkpoint = checkpoint  # the local directory the weights were read from
        self.drafter = drafter
        self.workers = workers if workers is not None else Workers.shared(target.device)
        self.batcher = Batcher(self.workers.verify, max_batch)  # concurrent streams share target forwards
        self._closed = False
        self.policy = OverlapPolicy()  # learns, per drafter, whether drafting ahead pays
        self.lengths = DraftLengthPolicy()  # learns, per drafter, how far drafting pays
        self.graphs = graphs if graphs is not None else GraphConfig()
        self.graph_mode = self.graphs.resolve(target.device.type)
        if self.graph_mode == "cuda" and target.spec.moe is not None:  # the expert loop reads its routing on the host
            if self.graphs.mode == "cuda":
                raise InvalidOptionError("a mixture-of-experts target cannot run as CUDA graphs; use graphs='off'.")
            self.graph_mode = "off"
        # the target's static slots (shared by every Model of this target, see with_drafter)
        self.steps = steps
        if steps is None and self.graph_mode != "off":
            context = min(self.graphs.context, target.spec.max_position_embeddings)
            self.steps = DecoderPool(target, self.graph_mode, context, self.graphs.slots)
        if self.steps is not None and isinstance(drafter, StaticStepping):
            # a drafter's caches also hold the blocks it drafts ahead of the verified text
            drafter.use_static_steps(self.graph_mode, self.steps.context + 2 * MAX_BUCKET, self.graphs.slots)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def max_context(self) -> int:
        """Prompt + new tokens that fit: the target's context, or the drafter's when that is shorter."""
        limit = drafter_context(self.drafter) if self.drafter is not None else None
        target = self.target.spec.max_position_embeddings
        return target if limit is None else min(target, limit)

    def __repr__(self) -> str:
        drafter = self.drafter.name if self.drafter is not None else None
        return f"Model({self.name!r}, drafter={drafter!r}, device={self.device}, dtype={self.dtype})"

    def with_drafter(self, drafter: Any, block_size: int | None = None, drafter_weights: str = "auto") -> Model:
        """The same target (weights shared, not copied) with another drafter; see :func:`load`."""
        if block_size is not None:
            block_size = SpeculativeConfig(block_size=block_size).block_size
        try:
            chosen = load_drafter(drafter, self.target, self.tokenizer, block_size, drafter_weights)
        finally:
            release_thread_pool()
        model = Model(
            self.target, self.tokenizer, self.eos_token_ids, self.name, self.checkpoint, chosen, self.workers,
            self.graphs, self.steps, self.batcher.max_batch, self.prefixes,
        )  # fmt: skip
        if model.graph_mode == "cuda":
            model.warmup()
        if chosen is not None:
            model.calibrate()
        return model

    def _filler(self, tokens: int = 16) -> list[int]:
        """A prompt for warm-up and calibration: any valid ids do."""
        return [i % self.target.spec.vocab_size for i in range(1, tokens + 1)]

    def calibrate(self) -> None:
        """Time the target's forward over 1 .. ``block_size`` tokens on this device (best of two)
        and a model drafter's drafts of 1 .. ``block_size - 1`` tokens: the cost curves the
        draft-length policy starts from (a drafter of your own is timed as it drafts); :meth:`with_drafter`
        calls it."""
        if self.drafter is None:
            return
        block = self.drafter.block_size
        config = GenerationConfig(max_new_tokens=block)
        request = Request(self.target, self._filler(), config, SamplingConfig(), None, self.steps)  # no session
        request.capture = tuple(self.drafter.capture_layers)  # but the forwards its verification runs
        times = self.workers.verify.call(functools.partial(_time_forwards, request, block))
        for tokens, seconds in times.items():
            self.lengths.record_verify(tokens, seconds)
        if not isinstance(self.drafter, (AutoregressiveDrafter, DFlashDrafter, HybridDrafter)):
            return
        config = GenerationConfig(max_new_tokens=block * block)
        request = Request(self.target, self._filler(), config, SamplingConfig(), self.drafter, self.steps)
        for tokens, seconds in self.workers.verify.call(functools.partial(_time_drafts, request, block)).items():
            self.lengths.record_draft(tokens, seconds)

    def warmup(self) -> None:
        """Build the static steps (capture the CUDA graphs) and run one short generation.

        With ``graphs="cuda"`` (the default on CUDA) :func:`load` and :meth:`with_drafter` call
        it, so the first request runs at steady-state speed; elsewhere it only warms the kernels.
        """
        block = self.drafter.block_size if self.drafter is not None else 1
        capture = tuple(self.drafter.capture_layers) if self.drafter is not None else ()
        if self.steps is not None:
            self.workers.verify.call(functools.partial(self.steps.prepare, buckets_up_to(block), capture))
            self.workers.verify.call(functools.partial(self.steps.prepare_packed, buckets_up_to(block), capture))
        if isinstance(self.drafter, StaticStepping):
            self.workers.verify.call(self.drafter.prepare_static_steps)
        config = GenerationConfig(max_new_tokens=4 * block)
        request = Request(self.target, self._filler(), config, SamplingConfig(), self.drafter, self.steps)
        self.workers.verify.call(functools.partial(_run_to_the_end, request))

    def close(self) -> None:
        """Refuse new streams on this model object (the compute threads are shared and stop at exit)."""
        self._closed = True

    def stream(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> TokenStream:
        """Start generating; iterate the returned stream with ``async for``.

        Options: ``max_new_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``seed``,
        ``stop`` (strings; one that names a special token stops at that token),
        ``stop_token_ids``, ``pipeline`` (``"async"`` or ``"sync"``).
        """
        if self._closed:
            raise StreamStateError("this model was closed; load it again to generate.")
        config, sampling = parse_generation_options(options)
        config = self._with_stop_tokens(config)
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        needed = len(prompt_ids) + config.max_new_tokens
        if needed > self.max_context:
            whose = "the model's" if self.max_context == self.target.spec.max_position_embeddings else "the drafter's"
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens and max_new_tokens is {config.max_new_tokens}: "
                f"{needed} > {whose} context of {self.max_context}. Shorten the prompt or lower max_new_tokens."
            )
        lengths = None
        if self.drafter is not None:  # a seeded sample must not depend on timing: it keeps the full length
            lengths = self.lengths.start(fixed=not sampling.greedy and sampling.seed is not None)
        request = Request(self.target, prompt_ids, config, sampling, self.drafter, self.steps, lengths, self.prefixes)
        source: TokenSource
        if config.pipeline == "sync":
            source = SyncPipeline(request, self.batcher)
        elif self._resident():
            source = ResidentPipeline(request, self.workers.verify, self.batcher)
        else:
            source = AsyncPipeline(request, self.workers, self.policy, self.batcher)
        return TokenStream(source, self.tokenizer, len(prompt_ids), config, self.eos_token_ids)

    def _resident(self) -> bool:
        """Whether async streams run the resident pipeline: static steps, and a drafter that can stay on the device."""
        if self.steps is None:
            return False
        return self.drafter is None or (isinstance(self.drafter, StaticStepping) and self.drafter.resident_sessions())

    def _with_stop_tokens(self, config: GenerationConfig) -> GenerationConfig:
        """Check ``stop_token_ids`` against the vocabulary; add the ids of stop strings that are special tokens."""
        vocab = self.target.spec.vocab_size
        for token_id in config.stop_token_ids:
            if token_id >= vocab:
                raise InvalidOptionError(f"stop_token_ids: {token_id} is not a token id (the vocabulary has {vocab}).")
        added = self.tokenizer.get_added_vocab()  # special and added tokens, which decoding may skip
        named = tuple(added[s] for s in config.stop if s in added and added[s] not in config.stop_token_ids)
        return dataclasses.replace(config, stop_token_ids=config.stop_token_ids + named) if named else config

    def stream_sync(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> BlockingTokenStream:
        """``for tok in model.stream_sync(...)``: :meth:`stream` for scripts (not inside an event loop)."""
        if inside_event_loop():
            raise StreamStateError(
                "stream_sync() blocks and cannot run inside a running event loop (Jupyter, asyncio, trio); "
                "use `async for tok in model.stream(...)` instead."
            )
        return BlockingTokenStream(self.stream(prompt, **options))

    async def agenerate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> Completion:
        """Generate to the end and return the :class:`Completion`."""
        async with self.stream(prompt, **options) as stream:
            async for _ in stream:
                pass
        return stream.completion

    def generate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> Completion:
        """Blocking version of :meth:`agenerate` for scripts (not inside a running event loop)."""
        if inside_event_loop():
            raise StreamStateError(
                "generate() blocks and cannot run inside a running event loop (Jupyter, asyncio, trio); "
                "use `await model.agenerate(...)` or `async for tok in model.stream(...)` instead."
            )
        return anyio.run(functools.partial(self.agenerate, prompt, **options))


def _time_forwards(request: Request, block: int) -> dict[int, float]:
    """Seconds of a verify forward of 1 .. ``block`` tokens after ``request``'s prompt (best of two)."""
    best: dict[int, float] = {}
    try:
        request.prefill()
        for _ in range(2):
            for size in range(1, block + 1):
                draft = Draft(torch.full((size - 1,), request.last, device=request.target.device))
                start = time.perf_counter()
                float(request.verify(draft).logits[-1, 0])  # read back: the time includes the device's
                best[size] = min(best.get(size, float("inf")), time.perf_counter() - start)
                assert request.cache is not None
                request.cache.rollback(request.verified)
    finally:
        request.close()
    return best


def _time_drafts(request: Request, block: int) -> dict[int, float]:
    """Seconds of drafting 1 .. ``block - 1`` tokens, a step each (after one untimed draft): drafts
    that come out shorter (a lookup that finds nothing) are not counted."""
    times: dict[int, float] = {}
    try:
        request.prefill()
        for wanted in range(block):
            if request.session is None or request.room < wanted:
                break
            start = time.perf_counter()
            draft = request.session.propose(max(wanted, 1))
            seconds = time.perf_counter() - start
            if wanted > 0 and len(draft) == wanted:
                times[wanted] = seconds
            request.check(Draft(draft.tokens.to(request.target.device), draft.probs))
    finally:
        request.close()
    return times


def _run_to_the_end(request: Request) -> None:
    """The sync loop in one call (warm-up): prefill, then steps until ``max_new_tokens``."""
    try:
        request.prefill()
        while request.room >= 0:
            request.step()
    finally:
        request.close()


def inside_event_loop() -> bool:
    """Whether this thread runs an event loop (asyncio or trio), where blocking calls must not wait."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
        return True
    except RuntimeError:
        return False


def load(
    target: str | os.PathLike[str],
    drafter: Any = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    weights: str = "same",
    block_size: int | None = None,
    drafter_weights: str = "auto",
    graphs: GraphConfig | GraphMode = "auto",
    max_batch: int = 8,
    prefix_cache: int = 4096,
    threads: Threads = "auto",
) -> Model:
    """Load a target model from a hub id, a local directory or a ``.gguf`` file, and a drafter.

    ``drafter``: ``None`` (plain decoding), ``"ngram"`` (prompt lookup), a hub id or directory of a
    DFlash / DFlash2 drafter or of a small causal LM with the target's tokenizer, or a
    :class:`dflash2.drafters.Drafter` object. ``weights``: the precision the target's projections
    and LM head are held in: ``"same"`` (as ``dtype``, the default), ``"bf16"``, ``"int8"`` or
    ``"int4"`` (weight-only, on the CPU; bf16 where the CPU's bf16 products pass a check at load, an
    ``InvalidOptionError`` otherwise); outside ``"same"`` every token is computed as decoding it
    alone computes it, so speculative output equals plain decoding in that mode token for token (how
    close that is to the full-precision model is the quantization's matter). ``block_size`` (tokens
    per verify forward, incl. the last verified one) overrides the drafter's default.
    ``drafter_weights``: the precision a model drafter runs in: ``"same"`` as the target,
    ``"bf16"``, ``"int8"`` or ``"int4"`` (weight-only); it changes how many drafts are accepted,
    never the output. ``"auto"``: int4 for a small causal LM on the CPU, else the same as the
    target. ``graphs``: CUDA graphs (``"cuda"``, the default on CUDA, captured at load), eager
    forwards (``"off"``, the default on the CPU), or a :class:`GraphConfig`. ``max_batch``: the most
    concurrent streams whose steps share one target forward (see ``engine.batch``).
    ``prefix_cache``: tokens of finished requests' state kept for later requests that start the same
    way (a chat's or an agent's next turn prefills only what is new); 0 turns it off.
    ``threads``: the cores a CPU forward computes on; ``"auto"``: as many as torch uses and the
    process may run on, fewer while other busy work on the machine makes fewer faster (measured
    now and then, see ``runtime.threads``).
    """
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or not 1 <= max_batch <= 256:
        raise InvalidOptionError(f"max_batch must be an int in [1, 256], got {max_batch!r}.")
    prefixes = PrefixCache(prefix_cache)  # checks the option before anything loads
    if threads != "auto":
        check_threads(threads)
    if not isinstance(target, (str, os.PathLike)):
        raise InvalidOptionError(f"target must be a hub id or a path, not {type(target).__name__}.")
    if block_size is not None:
        SpeculativeConfig(block_size=block_size)  # fail before loading anything
    if drafter_weights != "auto":
        check_weight_format(drafter_weights, "drafter_weights")
    target_weights = check_target_weights(weights)
    graph_config = GraphConfig.of(graphs)
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    steps = graph_config.resolve(resolved_device.type)  # fail before loading anything
    if target_weights != "same" and (steps != "off" or resolved_device.type != "cpu"):
        raise InvalidOptionError(
            f"weights={target_weights!r} runs on the CPU with eager forwards (graphs='off'); "
            f"got device {resolved_device.type!r}, graphs {steps!r}. Use weights='same' there."
        )
    checkpoint = resolve_checkpoint(target)
    try:
        decoder = load_quantized(checkpoint, target_weights, resolved_dtype, resolved_device)
        decoder.weights = target_weights  # its rows are computed alone: see Decoder.quantize
        decoder.pack()
        if target_weights == "bf16":
            check_bf16_rows(decoder)
        tokenizer = load_tokenizer(checkpoint)
        eos = load_eos_ids(checkpoint, decoder.spec)
        name = Path(str(target)).name or str(target)
        model = Model(
            decoder, tokenizer, eos, name=name, checkpoint=checkpoint, graphs=graph_config, max_batch=max_batch,
            prefixes=prefixes, workers=Workers.shared(resolved_device, threads),
        )  # fmt: skip
        return model.with_drafter(drafter, block_size, drafter_weights)
    finally:
        release_thread_pool()  # generation computes on dflash2's own threads (see runtime.workers)
