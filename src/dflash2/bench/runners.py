"""One runner per configuration in the matrix; each turns prompt ids into new ids, timed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dflash2.api import Model
from dflash2.runtime.workers import Worker


@dataclass
class RunResult:
    token_ids: list[int]
    seconds: float
    time_to_first_token_s: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    overlap: float | None = None
    bubble: float | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    predraft_hits: int = 0


class Runner(Protocol):
    name: str
    group: str  # "peer" or "ours"

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult: ...


class TransformersRunner:
    """``transformers.generate``, greedy; optional prompt lookup or an assistant model.

    It runs on ``worker``, the thread dflash2 computes on, so that both see the same threads.
    """

    group = "peer"

    def __init__(self, model: Any, worker: Worker, name: str = "transformers", **generate_kwargs: Any) -> None:
        self.model = model
        self.worker = worker
        self.name = name
        self.kwargs = generate_kwargs

    def _generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        pad = self.model.config.pad_token_id
        out: torch.Tensor = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad if pad is not None else 0,
            **self.kwargs,
        )
        return out

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        ids = torch.tensor([prompt_ids], device=self.model.device)
        start = time.perf_counter()
        out = self.worker.call(lambda: self._generate(ids, max_new_tokens))
        seconds = time.perf_counter() - start
        return RunResult([int(t) for t in out[0, len(prompt_ids) :]], seconds)


class DFlash2Runner:
    """``Model.generate`` with fixed options (drafter and pipeline are the model's / options')."""

    group = "ours"

    def __init__(self, model: Model, name: str, **options: Any) -> None:
        self.model = model
        self.name = name
        self.options = options

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        start = time.perf_counter()
        completion = self.model.generate(prompt, max_new_tokens=max_new_tokens, **self.options)
        seconds = time.perf_counter() - start
        s = completion.stats
        return RunResult(
            list(completion.token_ids),
            seconds,
            time_to_first_token_s=s.time_to_first_token_s,
            acceptance_lengths=list(s.acceptance_lengths),
            overlap=s.overlap,
            bubble=s.bubble,
            draft_s=s.draft_s,
            verify_s=s.verify_s,
            predraft_hits=s.predraft_hits,
        )
