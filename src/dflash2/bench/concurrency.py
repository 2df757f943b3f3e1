"""Concurrency sweep: 1, 2, 4, 8 streams at once on one model, beside transformers on a padded batch.

At each level n the prompts run in rounds of n streams started together (``asyncio.gather`` of
``Model.agenerate``). Aggregate tokens/s is every new token of the rounds over their summed wall
time; per-stream tokens/s is each stream's new tokens over its own time (first call to last
token), averaged; time to first token is each stream's, averaged. Every stream's tokens are
checked against the reference: the same prompt generated alone by dflash2's plain greedy decoding
(itself identical to transformers in the matrix). The peer, ``transformers-batch``, runs each
round's prompts left-padded into one ``generate`` call (greedy, its rows cut at their EOS) on the
thread dflash2 computes on; it has no time to first token.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dflash2.api import Model
from dflash2.bench.data import Prompt
from dflash2.bench.report import Panel, fmt, lines_of, plot_lines, table
from dflash2.tokenize import encode_prompt

PEER = "transformers-batch"


@dataclass
class Level:
    """One configuration at one number of concurrent streams, on one dataset."""

    config: str
    dataset: str
    streams: int
    prompts: int
    new_tokens: int
    seconds: float  # wall time of the rounds, summed
    per_stream_tokens_per_second: float
    time_to_first_token_s: float | None
    mean_batch_size: float | None  # streams per target forward, as the streams saw it
    identical: int

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


async def _round(
    model: Model, prompts: Sequence[Prompt], max_new_tokens: int, options: dict[str, Any]
) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    runs = (model.agenerate(p.prompt, max_new_tokens=max_new_tokens, **options) for p in prompts)
    done = await asyncio.gather(*runs)
    return time.perf_counter() - start, list(done)


def dflash2_level(
    model: Model,
    config: str,
    prompts: Sequence[Prompt],
    streams: int,
    max_new_tokens: int,
    references: dict[str, tuple[int, ...]],
    options: dict[str, Any],
) -> Level:
    """``prompts`` in rounds of ``streams`` concurrent streams on ``model`` (``options``: the pipeline)."""
    seconds, completions = 0.0, []
    for i in range(0, len(prompts), streams):
        took, done = asyncio.run(_round(model, prompts[i : i + streams], max_new_tokens, options))
        seconds += took
        completions += done
    stats = [c.stats for c in completions]
    return Level(
        config=config,
        dataset=prompts[0].dataset,
        streams=streams,
        prompts=len(prompts),
        new_tokens=sum(s.new_tokens for s in stats),
        seconds=seconds,
        per_stream_tokens_per_second=statistics.fmean(s.tokens_per_second for s in stats),
        time_to_first_token_s=statistics.fmean(s.time_to_first_token_s for s in stats),
        mean_batch_size=statistics.fmean(s.mean_batch_size for s in stats if s.batch_sizes) if stats else None,
        identical=sum(c.token_ids == references[p.id] for p, c in zip(prompts, completions, strict=True)),
    )


def transformers_level(
    hf: Any,
    model: Model,
    prompts: Sequence[Prompt],
    streams: int,
    max_new_tokens: int,
    references: dict[str, tuple[int, ...]],
) -> Level:
    """``prompts`` in left-padded batches of ``streams`` through transformers' ``generate``."""
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    seconds, new_tokens, identical, per_stream = 0.0, 0, 0, []
    for i in range(0, len(prompts), streams):
        chunk = prompts[i : i + streams]
        encoded = [encode_prompt(model.tokenizer, p.prompt) for p in chunk]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])

        def generate(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> torch.Tensor:
            with torch.inference_mode():
                out: torch.Tensor = hf.generate(
                    ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
                )
            return out

        start = time.perf_counter()
        out = model.workers.verify.call(generate)
        took = time.perf_counter() - start
        seconds += took
        for prompt, row in zip(chunk, out[:, width:].tolist(), strict=True):
            tokens = _until_eos(row, model.eos_token_ids)
            new_tokens += len(tokens)
            per_stream.append(len(tokens) / took)
            identical += tuple(tokens) == references[prompt.id]
    return Level(
        PEER, prompts[0].dataset, streams, len(prompts), new_tokens, seconds, statistics.fmean(per_stream), None, None,
        identical,
    )  # fmt: skip


def _until_eos(row: list[int], eos: frozenset[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row


def levels_table(levels: Sequence[Level]) -> str:
    """One row per (dataset, configuration, streams), with the gain over that configuration alone."""
    alone = {(lv.dataset, lv.config): lv.tokens_per_second for lv in levels if lv.streams == 1}
    columns = ["dataset", "config", ">streams", ">aggregate tok/s", ">× one stream", ">per-stream tok/s"]
    columns += [">time to first token (s)", ">streams per forward", "identical"]
    rows = []
    for lv in levels:
        base = alone.get((lv.dataset, lv.config))
        gain = fmt(lv.tokens_per_second / base if base else None, ".2f")
        rows.append([lv.dataset, lv.config, lv.streams, f"{lv.tokens_per_second:.1f}", gain,
                     f"{lv.per_stream_tokens_per_second:.1f}", fmt(lv.time_to_first_token_s, ".2f"),
                     fmt(lv.mean_batch_size, ".2f"), f"{lv.identical}/{lv.prompts}"])  # fmt: skip
    return table(columns, rows)


def levels_as_dicts(levels: Sequence[Level]) -> list[dict[str, Any]]:
    return [{**asdict(lv), "tokens_per_second": lv.tokens_per_second} for lv in levels]


def plot_levels(levels: Sequence[Level], path: Path) -> Path:
    """Aggregate tokens/s against concurrent streams, one panel per dataset."""
    panels = []
    for dataset in sorted({lv.dataset for lv in levels}):
        mine = [lv for lv in levels if lv.dataset == dataset]
        lines = lines_of(mine, lambda lv: lv.config, lambda lv: (lv.streams, lv.tokens_per_second))
        panels.append(Panel(dataset, "aggregate tokens / s", lines))
    return plot_lines(path, panels, "concurrent streams", log_x=True)
