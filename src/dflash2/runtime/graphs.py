"""Static steps: forwards whose shapes and buffers never change, so that CUDA graphs can replay them.

A small-batch forward on a GPU is launch-bound: on an H200, one token of a 1.1 B model took
8.6 ms in eager PyTorch against 0.46 ms to read its weights. A CUDA graph (``torch.cuda.CUDAGraph``,
no ``torch.compile``, no Triton) launches a captured forward as one unit, but only if every shape
and every buffer address is the same at each replay. So a static step:

- runs on a ``Slot``: a KV cache of fixed capacity that requests borrow and give back, so the
  graphs captured on it serve every request;
- takes its tokens in a fixed input buffer (a block is padded up to the next power of two, its
  *bucket*; the padding goes after the real tokens, whose outputs it cannot change under the
  causal mask, and is overwritten before it becomes part of the text) and the cache length in a
  0-dim device tensor written before each run;
- leaves its outputs in fixed buffers, valid until the slot's next step.

A ``DecoderPool`` keeps its slots' caches as the rows of one KV store, so that the blocks of
several slots also run as one static step (``DecoderPool.forward_packed``: concurrent streams,
one graph per batch bucket and block bucket).

``StaticStep`` is that contract for any forward function that reads only fixed tensors. In
``"static"`` mode it runs the function eagerly (the CPU, tests, debugging: the very code the graph
holds); in ``"cuda"`` mode it captures the function once, at first use or at warm-up, and
replays it. Captures of one slot share a memory pool, so their outputs are valid until that
slot's next step, which is the contract in both modes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch

from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.model import Decoder, ForwardOutput

StepMode = Literal["off", "static", "cuda"]
MAX_BUCKET = 64  # the largest block a drafter may ask for (SpeculativeConfig allows 2..64)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture, as the CUDA graph docs advise

_CAPTURE_LOCK = threading.Lock()  # one capture at a time in the process


def bucket(tokens: int) -> int:
    """The static size that holds ``tokens``: the next power of two."""
    if not 1 <= tokens <= MAX_BUCKET:
        raise ValueError(f"a static step holds 1..{MAX_BUCKET} tokens, not {tokens}")
    return 1 << (tokens - 1).bit_length()


def batch_bucket(rows: int, slots: int) -> int:
    """The rows a packed step over a pool's first ``rows`` slots runs: the next power of two, at most ``slots``."""
    return min(1 << (rows - 1).bit_length(), slots)


def batch_buckets(slots: int) -> tuple[int, ...]:
    """Every batch bucket (of two or more rows) of a pool of ``slots``."""
    return tuple(sorted({batch_bucket(n, slots) for n in range(2, slots + 1)}))


def buckets_up_to(tokens: int) -> tuple[int, ...]:
    """Every bucket a block of at most ``tokens`` may use."""
    return tuple(1 << i for i in range(bucket(tokens).bit_length()))


Outputs = tuple[torch.Tensor | None, ...]


class StaticStep:
    """``fn`` computed from fixed input tensors; :meth:`run` returns its outputs in fixed buffers.

    ``fn`` must read nothing but tensors that stay the same objects (written in place between
    runs) and must not change host state, since a graph replays only its kernels.
    """

    def __init__(self, fn: Callable[[], Outputs], mode: StepMode, pool: Any = None) -> None:
        if mode not in ("static", "cuda"):
            raise ValueError(f"a static step runs in 'static' or 'cuda' mode, not {mode!r}")
        self._fn = fn
        self._mode = mode
        self._pool = pool
        self._graph: Any = None
        self.outputs: Outputs | None = None
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def run(self) -> Outputs:
        if self._mode == "cuda":
            if self._graph is None:
                self.capture()
            self._graph.replay()
            self.replays += 1
            assert self.outputs is not None
            return self.outputs
        values = self._fn()
        if self.outputs is None:  # the first run allocates the buffers every later run writes into
            self.outputs = tuple(None if v is None else v.clone() for v in values)
        else:
            for buffer, value in zip(self.outputs, values, strict=True):
                if buffer is not None and value is not None:
                    buffer.copy_(value)
        return self.outputs

    def capture(self) -> None:
        """Record ``fn`` as a CUDA graph (after warm-up runs on a side stream); runs nothing afterwards."""
        with _CAPTURE_LOCK:
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the drafter's thread may launch work of its own while this one captures
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self.outputs = self._fn()
            self._graph = graph


class Slot:
    """A KV cache of fixed capacity and the static forwards of a decoder over it.

    A request holds a slot from its prefill until it closes; the prefill itself runs eagerly
    (its length varies), every later forward through :meth:`forward` (or, beside other slots of
    its pool, :meth:`DecoderPool.forward_packed`). The cache is row ``row`` of the pool's store.
    """

    def __init__(self, decoder: Decoder, cache: KVCache, mode: StepMode, row: int = 0) -> None:
        self.decoder = decoder
        self.mode = mode
        self.cache = cache
        self.row = row
        self.start = torch.zeros((), dtype=torch.long, device=decoder.device)  # cache.length, on the device
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.steps: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, StaticStep]] = {}

    def step(self, size: int, capture: Sequence[int] = ()) -> tuple[torch.Tensor, StaticStep]:
        """The input buffer [1, size] and the step of ``size`` tokens capturing ``capture`` (made on first use)."""
        key = (size, tuple(capture))
        if key not in self.steps:
            ids = torch.zeros((1, size), dtype=torch.long, device=self.decoder.device)

            def forward() -> Outputs:
                out = self.decoder(ids, self.cache, logits="all", capture=key[1], start=self.start)
                return out.logits, out.hidden

            self.steps[key] = (ids, StaticStep(forward, self.mode, self.pool))
        return self.steps[key]

    def forward(
        self, tokens: torch.Tensor, capture: Sequence[int] = (), resident: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Process ``tokens`` [T] after the cached ones: logits [T, vocab] and features [T, F] (or ``None``).

        The cache advances by T. The outputs are views of the step's fixed buffers: use (or
        copy) them before the slot's next forward. ``resident``: the length lives on the device
        only (``start``, which the caller moves after acceptance); ``cache.length`` is neither
        read nor advanced, so nothing waits for the host.
        """
        count = tokens.shape[0]
        size = bucket(count)
        if not resident:
            self.cache.check_room(size)
            self.start.fill_(self.cache.length)
        ids, step = self.step(size, capture)
        ids[0, :count].copy_(tokens, non_blocking=True)
        logits, hidden = step.run()
        if not resident:
            self.cache.advance(count)
        assert logits is not None
        return logits[0, :count], hidden[0, :count] if hidden is not None else None

    def reset(self) -> None:
        self.cache.reset()

    def prepare(self, size: int, capture: Sequence[int] = ()) -> None:
        """Build (and in ``"cuda"`` mode capture) the step of ``size`` tokens now."""
        _, step = self.step(size, capture)
        if self.mode == "cuda" and not step.captured:
            self.start.fill_(0)
            step.capture()


class Reusable(Protocol):
    """What a pool needs of a slot: a way to empty it for the next request, and steps to build ahead."""

    def reset(self) -> None: ...

    def prepare(self, size: int, capture: Sequence[int] = ()) -> None: ...


S = TypeVar("S", bound=Reusable)


class StepPool(Generic[S]):
    """Static slots that requests borrow for their lifetime (or run eagerly when none fits or is free).

    ``context`` is the most tokens a request may need to get a slot.
    """

    def __init__(self, slots: Sequence[S], context: int) -> None:
        self.context = context
        self._slots = list(slots)
        self._free = list(self._slots)  # in the slots' order: the first free one goes first
        self._lock = threading.Lock()

    @property
    def slots(self) -> tuple[S, ...]:
        return tuple(self._slots)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def acquire(self, tokens: int) -> S | None:
        """A free slot with its cache emptied, if ``tokens`` fit one and one is free; else ``None``."""
        if tokens > self.context:
            return None
        with self._lock:
            slot = self._free.pop(0) if self._free else None
        if slot is not None:
            slot.reset()
        return slot

    def release(self, slot: S) -> None:
        with self._lock:
            if slot in self._slots and slot not in self._free:
                self._free.append(slot)
                self._free.sort(key=self._slots.index)

    def prepare(self, sizes: Sequence[int], capture: Sequence[int] = ()) -> None:
        """Build (capture) the steps of ``sizes`` on every free slot (a busy one captures at first use)."""
        with self._lock:
            idle, self._free = self._free, []
        try:
            for slot in idle:
                for size in sizes:
                    slot.prepare(size, capture)
        finally:
            with self._lock:
                self._free.extend(idle)
                self._free.sort(key=self._slots.index)


class DecoderPool(StepPool[Slot]):
    """The slots of a decoder, whose caches are the rows of one KV store, and the packed static
    steps over them: the blocks of several slots in one forward (``forward_packed``), with one
    static step (one CUDA graph) per batch bucket and block bucket.

    A packed step over a batch bucket of B runs rows ``0 .. B - 1`` of the store, each block
    padded to the bucket of the longest: a slot not in the batch (free, or its stream not in this
    step) writes its padding past every slot's context, where no query looks. Slots are handed
    out lowest row first, so the rows in use stay at the front.
    """

    def __init__(self, decoder: Decoder, mode: StepMode, context: int, slots: int) -> None:
        self.decoder = decoder
        self.mode = mode
        # each row holds ``context`` tokens and room for a padded block after them
        self.store = decoder.new_cache(context + MAX_BUCKET, batch=slots, zeroed=True)
        super().__init__([Slot(decoder, self.store.rows(i, i + 1), mode, row=i) for i in range(slots)], context)
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.packed: dict[tuple[int, int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor, StaticStep]] = {}

    def packed_step(
        self, rows: int, size: int, capture: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor, StaticStep]:
        """The input ids [rows, size], cache lengths [rows] and step of a packed batch (made on first use)."""
        key = (rows, size, tuple(capture))
        if key not in self.packed:
            device = self.decoder.device
            ids = torch.zeros((rows, size), dtype=torch.long, device=device)
            starts = torch.zeros(rows, dtype=torch.long, device=device)
            cache = self.store.rows(0, rows)

            def forward() -> Outputs:
                out = self.decoder(ids, cache, logits="all", capture=key[2], start=starts)
                return out.logits, out.hidden

            self.packed[key] = (ids, starts, StaticStep(forward, self.mode, self.pool))
        return self.packed[key]

    def forward_packed(
        self, blocks: Sequence[tuple[Slot, torch.Tensor]], capture: Sequence[int] = ()
    ) -> list[ForwardOutput]:
        """The tokens [T] of several slots of this pool after their cached ones, in one static step.

        Per block: logits [1, T, vocab] and features [1, T, F] (or ``None``), views of the step's
        fixed buffers (use them before the pool's next packed step); each slot's cache advances by T.
        """
        counts = [int(tokens.shape[0]) for _, tokens in blocks]
        size = bucket(max(counts))
        rows = batch_bucket(max(slot.row for slot, _ in blocks) + 1, len(self.slots))
        ids, starts, step = self.packed_step(rows, size, capture)
        lengths = [self.store.capacity - size] * rows  # rows not in the batch: past every context
        for (slot, tokens), count in zip(blocks, counts, strict=True):
            slot.cache.check_room(size)
            lengths[slot.row] = slot.cache.length
            ids[slot.row, :count].copy_(tokens, non_blocking=True)
        starts.copy_(torch.tensor(lengths), non_blocking=True)
        logits, hidden = step.run()
        assert logits is not None
        outs = []
        for (slot, _), count in zip(blocks, counts, strict=True):
            slot.cache.advance(count)
            row = slice(slot.row, slot.row + 1)
            outs.append(ForwardOutput(logits[row, :count], hidden[row, :count] if hidden is not None else None))
        return outs

    def prepare_packed(self, sizes: Sequence[int], capture: Sequence[int] = ()) -> None:
        """Build (in ``"cuda"`` mode capture) the packed steps of every batch bucket and block size."""
        for count in batch_buckets(len(self.slots)):
            for size in sizes:
                _, starts, step = self.packed_step(count, size, capture)
                if self.mode == "cuda" and not step.captured:
                    starts.fill_(self.store.capacity - size)  # the capture writes past every context
                    step.capture()
