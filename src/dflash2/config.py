"""Frozen, validated option dataclasses. Unknown keys and wrong types are rejected loudly."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypedDict

from dflash2.errors import InvalidOptionError

Pipeline = Literal["async", "sync"]
PIPELINES: tuple[str, ...] = ("async", "sync")
MAX_SEED = 2**63  # seeds (and the drafter's seed + 1) must fit torch's 64-bit generator seed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidOptionError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidOptionError(f"top_p must be a number in (0, 1], got {self.top_p!r}; use 1.0 to disable it.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidOptionError(f"top_k must be an int >= 0, got {self.top_k!r}; use 0 to disable it.")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise InvalidOptionError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}.")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    """When generation ends and which pipeline runs it."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    pipeline: Pipeline = "async"

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidOptionError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}.")
        stop: Any = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidOptionError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}.")
        object.__setattr__(self, "stop", tuple(stop))
        ids: Any = self.stop_token_ids
        if isinstance(ids, int) and not isinstance(ids, bool):
            ids = (ids,)
        if ids is None:
            ids = ()
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise InvalidOptionError(
                f"stop_token_ids must be a token id or a list of token ids (ints >= 0), got {self.stop_token_ids!r}."
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.pipeline, str) or self.pipeline not in PIPELINES:
            raise InvalidOptionError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}.")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are made: tokens per draft block (the verified block is ``block_size`` long)."""

    block_size: int = 16

    def __post_init__(self) -> None:
        if not _is_int(self.block_size) or not 2 <= self.block_size <= 64:
            raise InvalidOptionError(f"block_size must be an int in [2, 64], got {self.block_size!r}.")


GraphMode = Literal["auto", "off", "static", "cuda"]
GRAPH_MODES: tuple[str, ...] = ("auto", "off", "static", "cuda")


@dataclass(frozen=True)
class GraphConfig:
    """How forwards run (``load(graphs=...)``; see ``runtime.graphs``).

    ``mode``: ``"cuda"`` replays captured CUDA graphs of static steps (the default on CUDA);
    ``"off"`` runs eagerly with shapes that follow each request (the default on the CPU);
    ``"static"`` runs the static steps eagerly, the code the graphs hold (tests, debugging);
    ``"auto"`` picks by device. ``context``: prompt + new tokens a request may need to use the
    static steps (a longer one runs eagerly); ``slots``: requests that use them at once, each
    holding a KV cache of ``context`` tokens (as many as ``load``'s default ``max_batch``, so
    that concurrent streams share one packed static step).
    """

    mode: GraphMode = "auto"
    context: int = 4096
    slots: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in GRAPH_MODES:
            raise InvalidOptionError(f"graphs must be one of {GRAPH_MODES} or a GraphConfig, got {self.mode!r}.")
        if not _is_int(self.context) or self.context < 1:
            raise InvalidOptionError(f"GraphConfig.context must be an int >= 1, got {self.context!r}.")
        if not _is_int(self.slots) or self.slots < 1:
            raise InvalidOptionError(f"GraphConfig.slots must be an int >= 1, got {self.slots!r}.")

    @classmethod
    def of(cls, value: GraphConfig | str) -> GraphConfig:
        """A mode name or a config, as ``load(graphs=...)`` takes it."""
        return value if isinstance(value, GraphConfig) else cls(mode=value)  # type: ignore[arg-type]

    def resolve(self, device_type: str) -> Literal["off", "static", "cuda"]:
        """The mode on ``device_type`` (``"cuda"`` needs a CUDA device)."""
        if self.mode == "auto":
            return "cuda" if device_type == "cuda" else "off"
        if self.mode == "cuda" and device_type != "cuda":
            raise InvalidOptionError("graphs='cuda' needs a CUDA device; use 'static' or 'off' on the CPU.")
        return self.mode


class GenerationOptions(TypedDict, total=False):
    """The keyword options of ``Model.stream`` / ``agenerate`` / ``generate`` (type checkers see them)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: int | Sequence[int] | None
    pipeline: Pipeline


def _field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def reject_unknown(options: Mapping[str, Any], allowed: list[str], where: str) -> None:
    """Raise ``InvalidOptionError`` naming the closest valid option for each unknown key."""
    for key in options:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise InvalidOptionError(
                f"unknown option {key!r} for {where}.{hint} Valid options: {', '.join(sorted(allowed))}."
            )


def parse_generation_options(options: Mapping[str, Any]) -> tuple[GenerationConfig, SamplingConfig]:
    """Split ``stream()`` / ``generate()`` keyword arguments into the two configs."""
    gen_keys, sampling_keys = _field_names(GenerationConfig), _field_names(SamplingConfig)
    reject_unknown(options, gen_keys + sampling_keys, "generation")
    gen = GenerationConfig(**{k: v for k, v in options.items() if k in gen_keys})
    sampling = SamplingConfig(**{k: v for k, v in options.items() if k in sampling_keys})
    return gen, sampling
