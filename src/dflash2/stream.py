"""What users hold: ``Token``, ``Completion``, ``Stats`` and the ``TokenStream`` async iterator."""

from __future__ import annotations

import enum
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Protocol

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.from_thread import BlockingPortal
from transformers import PreTrainedTokenizerBase

from dflash2.config import GenerationConfig
from dflash2.errors import StreamStateError
from dflash2.tokenize import IncrementalDetokenizer, StopMatcher

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class Token:
    """One generated token and the text it adds (may be empty while a character is incomplete)."""

    id: int
    text: str


@dataclass(frozen=True)
class Stats:
    """Counters of one generation. Times are seconds; shares are in [0, 1]."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache (not prefilled)
    drafted_tokens: int = 0  # draft tokens verified (accepted or not)
    acceptance_lengths: tuple[int, ...] = ()
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overlap: float = 0.0
    bubble: float = 0.0
    predraft_hits: int = 0
    branch_hits: int = 0  # steps whose target took a side branch (a draft's alternative)
    batch_sizes: tuple[int, ...] = ()  # per step: the streams whose steps ran in that target forward

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the target ran (the rest came from the prefix cache)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def mean_batch_size(self) -> float:
        """Streams per target forward this stream's steps ran in, on average (1.0: always alone)."""
        return sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify forward (accepted drafts + the bonus); 1.0 = nothing accepted."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole call (prefill + decoding)."""
        total = self.time_to_first_token_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0


@dataclass(frozen=True)
class Completion:
    """A finished generation: the text, the new token ids and why it ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stats: Stats = field(default_factory=Stats)


@dataclass
class EngineCounters:
    """What the engine measures while it runs; the stream adds the timing it sees."""

    steps: int = 0
    cached_tokens: int = 0
    drafted_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # all drafting compute
    verify_s: float = 0.0  # all verification compute (forward + acceptance)
    hidden_s: float = 0.0  # drafting that ran while a verification was running
    wait_s: float = 0.0  # verifier idle, waiting for a draft
    predraft_hits: int = 0
    branch_hits: int = 0  # steps whose target took a side branch (a draft's alternative)
    batch_sizes: list[int] = field(default_factory=list)  # per step: streams in its target forward

    @property
    def overlap(self) -> float:
        return self.hidden_s / self.draft_s if self.draft_s > 0 else 0.0

    @property
    def bubble(self) -> float:
        busy = self.verify_s + self.wait_s
        return self.wait_s / busy if busy > 0 else 0.0


class TokenSource(Protocol):
    """The engine side of a stream: chunks of new token ids, one target forward per chunk."""

    counters: EngineCounters

    async def next_ids(self) -> list[int]: ...

    async def aclose(self) -> None: ...


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DONE = "done"


class TokenStream:
    """Async iterator of :class:`Token` and async context manager.

    ``break``, leaving ``async with``, ``await aclose()`` (from any task of the stream's loop)
    or cancelling the consuming task stops the engine after its running step and frees its
    cache; the model stays usable. A stream is iterated once: iterating an ended stream again
    raises :class:`~dflash2.StreamStateError`.
    """

    def __init__(
        self,
        source: TokenSource,
        tokenizer: PreTrainedTokenizerBase,
        prompt_tokens: int,
        config: GenerationConfig,
        eos_token_ids: frozenset[int],
    ) -> None:
        self._source = source
        self._config = config
        self._eos = eos_token_ids | frozenset(config.stop_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(config.stop)
        self._prompt_tokens = prompt_tokens
        self._ready: deque[Token] = deque()
        self._generated = 0
        self._ids: list[int] = []  # what was handed to the user
        self._text: list[str] = []
        self._state = _State.NEW
        self._busy = False  # a task is inside __anext__
        self._idle: anyio.Event | None = None  # set when that task leaves (for aclose from another task)
        self._finish: FinishReason | None = None
        self._t0: float | None = None
        self._t_first: float | None = None
        self._t_end: float | None = None

    # ------------------------------------------------------------ iteration
    def __aiter__(self) -> TokenStream:
        if self._state is _State.DONE:
            raise StreamStateError(
                "this stream has ended and cannot be iterated again; read stream.completion, "
                "or start a new one with model.stream(...)."
            )
        return self

    async def __anext__(self) -> Token:
        if self._busy:
            raise StreamStateError("this stream is already being iterated by another task; iterate it from one task.")
        self._busy = True
        try:
            await anyio.lowlevel.checkpoint()  # every token is a point where the consumer can be cancelled
            while not self._ready:
                if self._state is _State.DONE:
                    raise StopAsyncIteration
                if self._state is _State.NEW:
                    self._state, self._t0 = _State.RUNNING, time.perf_counter()
                ids = await self._source.next_ids()
                if self._state is _State.DONE:  # closed by another task while the step ran
                    raise StopAsyncIteration
                self._accept(ids)
                if self._finish is not None:
                    await self._close(self._finish)
            token = self._ready.popleft()
            self._ids.append(token.id)
            self._text.append(token.text)
            return token
        except StopAsyncIteration:
            raise
        except Exception:
            await self._close("error")
            raise
        except BaseException:  # cancellation, KeyboardInterrupt
            await self._close("cancelled")
            raise
        finally:
            self._busy = False
            if self._idle is not None:
                self._idle.set()
                self._idle = None

    def _accept(self, ids: list[int]) -> None:
        """Turn engine ids into tokens, ending exactly at EOS, a stop string or max_new_tokens."""
        if self._t_first is None:
            self._t_first = time.perf_counter()
        for token_id in ids:
            self._generated += 1
            text = self._stops.push(self._detok.push(token_id))
            if self._stops.stopped or token_id in self._eos:
                self._finish = "stop"
            elif self._generated >= self._config.max_new_tokens:
                self._finish = "length"
            if self._finish is not None and not self._stops.stopped:
                text += self._stops.push(self._detok.flush())
                if not self._stops.stopped:
                    text += self._stops.flush()
            self._ready.append(Token(token_id, text))
            if self._finish is not None:
                return

    # ------------------------------------------------------------ closing
    async def _close(self, reason: FinishReason) -> None:
        if self._state is _State.DONE:
            return
        self._state = _State.DONE
        self._finish = self._finish or reason
        self._t_end = time.perf_counter()
        with anyio.CancelScope(shield=True):  # free the cache even while being cancelled
            await self._source.aclose()

    async def aclose(self) -> None:
        """Stop generating and free the cache; tokens not yet handed out are dropped. Idempotent.

        Called from another task while the stream is being iterated, it returns once the running
        step has ended (the iterating task then sees the end of the stream).
        """
        if self._ready or self._state is not _State.DONE:
            self._ready.clear()
            self._finish = "cancelled"
        await self._close("cancelled")
        if self._busy:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------ results
    @property
    def completion(self) -> Completion:
        """The result; available once the stream has ended (exhausted or closed)."""
        if self._state is not _State.DONE or self._finish is None:
            raise StreamStateError("the stream is still running; iterate it to the end or await aclose() first.")
        return Completion(
            text="".join(self._text), token_ids=tuple(self._ids), finish_reason=self._finish, stats=self.stats
        )

    @property
    def stats(self) -> Stats:
        """Counters so far (final once the stream has ended)."""
        c = self._source.counters
        now = self._t_end if self._t_end is not None else time.perf_counter()
        first = self._t_first if self._t_first is not None else now
        start = self._t0 if self._t0 is not None else first  # never started: no time passed
        return Stats(
            prompt_tokens=self._prompt_tokens,
            new_tokens=len(self._ids),  # handed to the user
            steps=c.steps,
            acceptance_lengths=tuple(c.acceptance_lengths),
            time_to_first_token_s=first - start,
            decode_s=now - first,
            draft_s=c.draft_s,
            verify_s=c.verify_s,
            overlap=c.overlap,
            bubble=c.bubble,
            predraft_hits=c.predraft_hits,
            branch_hits=c.branch_hits,
            drafted_tokens=c.drafted_tokens,
            cached_tokens=c.cached_tokens,
            batch_sizes=tuple(c.batch_sizes),
        )


async def _next_or_none(stream: TokenStream) -> Token | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _shut(portal_cm: AbstractContextManager[BlockingPortal], portal: BlockingPortal, stream: TokenStream) -> None:
    try:
        portal.call(stream.aclose)
    finally:
        portal_cm.__exit__(None, None, None)


class BlockingTokenStream:
    """``for tok in model.stream_sync(...)``: a :class:`TokenStream` for scripts.

    The stream runs on an event loop in a helper thread (an anyio blocking portal) that starts
    with the first token and stops at the end, on ``close()``, on leaving ``with``, or when the
    iterator is garbage collected.
    """

    def __init__(self, stream: TokenStream) -> None:
        self._stream = stream
        self._portal: BlockingPortal | None = None
        self._finalizer: Callable[[], object] | None = None
        self._done = False

    def __iter__(self) -> BlockingTokenStream:
        return self

    def __next__(self) -> Token:
        if self._done:
            raise StopIteration
        if self._portal is None:
            portal_cm = anyio.from_thread.start_blocking_portal()
            self._portal = portal_cm.__enter__()
            self._finalizer = weakref.finalize(self, _shut, portal_cm, self._portal, self._stream)
        token = self._portal.call(_next_or_none, self._stream)
        if token is None:
            self.close()
            raise StopIteration
        return token

    def close(self) -> None:
        """Stop generating and free the cache. Idempotent."""
        self._done = True
        if self._finalizer is not None:
            self._finalizer()
            self._portal = None

    def __enter__(self) -> BlockingTokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def completion(self) -> Completion:
        return self._stream.completion

    @property
    def stats(self) -> Stats:
        return self._stream.stats
