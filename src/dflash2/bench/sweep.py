"""Sweeps: tokens/s vs prompt length; tokens/s and acceptance vs block size (whole blocks, and
the draft-length policy's own choice beside them); and vs a model drafter's weight precision.

Every point goes through :func:`run_matrix`, so each output is checked against transformers greedy.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from dflash2.bench.data import Prompt
from dflash2.bench.harness import Row, run_matrix
from dflash2.bench.report import Lines, Panel, checked, fmt, lines_of, plot_lines, table
from dflash2.bench.runners import Runner
from dflash2.tokenize import encode_prompt

SWEEPS = ("prompt-length", "block-size", "drafter-weights")
WEIGHT_BITS = {"same": 32, "bf16": 16, "int8": 8, "int4": 4}  # "same" as an fp32 target
REFERENCE = "transformers"


@dataclass
class Point:
    """One runner at one sweep value; ``x`` is the nominal prompt length or the block size."""

    sweep: str
    x: int
    prompt_tokens: float  # mean actual prompt length of the point's prompts
    row: Row

    def as_dict(self) -> dict[str, Any]:
        return {"sweep": self.sweep, "x": self.x, "prompt_tokens": self.prompt_tokens, **asdict(self.row)}


def prompts_of_length(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], length: int, count: int, dataset: str
) -> list[Prompt]:
    """``count`` raw-text prompts of ``length`` tokens: real texts joined (prompt i starts at text i), then cut.

    Re-encoding the cut text can merge tokens across the cut, so the cut steps back until the
    text encodes to at most ``length`` tokens (it is almost always exactly ``length``).
    """
    prompts = []
    for i in range(count):
        parts: list[str] = []
        ids: list[int] = []
        while len(ids) < length:
            parts.append(texts[(i + len(parts)) % len(texts)])
            ids = encode_prompt(tokenizer, "\n".join(parts))
        cut = length
        text = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        while cut > 1 and len(encode_prompt(tokenizer, text)) > length:
            cut -= 1
            text = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        prompts.append(Prompt(dataset, f"{dataset}-{i}", text))
    return prompts


def _mean_prompt_tokens(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]) -> dict[str, float]:
    lengths: dict[str, list[int]] = {}
    for p in prompts:
        lengths.setdefault(p.dataset, []).append(len(encode_prompt(tokenizer, p.prompt)))
    return {d: statistics.mean(n) for d, n in lengths.items()}


def prompt_length_sweep(
    runners: Sequence[Runner],
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    lengths: Sequence[int],
    count: int,
    max_new_tokens: int,
    progress: bool = True,
) -> list[Point]:
    """Each runner on ``count`` prompts of each length (the runners must include ``transformers``)."""
    label = {f"humaneval@{n}": n for n in lengths}
    prompts = [p for name, n in label.items() for p in prompts_of_length(tokenizer, texts, n, count, name)]
    rows = run_matrix(
        runners,
        prompts,
        encode=lambda text: encode_prompt(tokenizer, text),
        max_new_tokens=max_new_tokens,
        reference=REFERENCE,
        progress=progress,
    )
    actual = _mean_prompt_tokens(tokenizer, prompts)
    return [Point("prompt-length", label[r.dataset], actual[r.dataset], r) for r in rows]


def drafted_sweep(
    sweep: str,
    reference: Runner,
    drafted: Sequence[tuple[int, Runner]],
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    progress: bool = True,
) -> list[Point]:
    """Drafted runners, each at its sweep value x (a block size, a drafter's weight bits), all on
    the same prompts, interleaved; the reference's rows are left out."""
    size = {runner.name: x for x, runner in drafted}
    rows = run_matrix(
        [reference, *(runner for _, runner in drafted)],
        prompts,
        encode=lambda prompt: encode_prompt(tokenizer, prompt),
        max_new_tokens=max_new_tokens,
        reference=reference.name,
        progress=progress,
    )
    actual = _mean_prompt_tokens(tokenizer, prompts)
    return [Point(sweep, size[r.config], actual[r.dataset], r) for r in rows if r.config in size]


def _lines(points: Sequence[Point], by: str, y: str) -> Lines:
    """The points as lines: one per value of the rows' field ``by``, their field ``y`` against x."""
    return lines_of(points, lambda p: getattr(p.row, by), lambda p: (p.x, getattr(p.row, y) or 0.0))


def _bad(points: Sequence[Point]) -> list[tuple[float, float]]:
    return [(p.x, p.row.tokens_per_second) for p in points if not p.row.all_identical]


def _cells(row: Row, extra: str, spec: str) -> list[str]:
    """The cells every sweep table has: tokens/s, speedup, tokens per target forward, the row's
    field ``extra`` and the identical-output check."""
    measured = [f"{row.tokens_per_second:.1f}", f"{row.speedup:.2f}×", fmt(row.mean_acceptance_length, ".2f")]
    return [*measured, fmt(getattr(row, extra), spec), checked(row.identical, row.prompts)]


MEASURED = [">tokens/s", ">speedup vs transformers", ">tokens per target forward"]


def prompt_length_table(points: Sequence[Point]) -> str:
    columns = ["prompt tokens", "configuration", *MEASURED, ">TTFT (s)", "identical"]
    rows = ([f"{p.prompt_tokens:.0f}", p.row.config, *_cells(p.row, "time_to_first_token_s", ".3f")] for p in points)
    return table(columns, rows)


def block_size_table(points: Sequence[Point]) -> str:
    columns = ["dataset", ">block size", "configuration", *MEASURED, ">draft tokens per step", "identical"]
    rows = ([p.row.dataset, p.x, p.row.config, *_cells(p.row, "drafted_per_step", ".2f")] for p in points)
    return table(columns, rows)


def drafter_weights_table(points: Sequence[Point]) -> str:
    bits = {b: name for name, b in WEIGHT_BITS.items()} | {32: "fp32 (same as the target)"}
    columns = ["dataset", "drafter weights", *MEASURED, ">ms per draft token", "identical"]
    rows = ([p.row.dataset, bits.get(p.x, p.x), *_cells(p.row, "draft_ms_per_token", ".1f")] for p in points)
    return table(columns, rows)


def plot_prompt_length(points: Sequence[Point], plain_limit: float, path: Path) -> Path:
    """Tokens/s vs prompt length per configuration, with the plain-decoding bandwidth limit."""
    lines = _lines(points, "config", "tokens_per_second")
    speed = Panel("decoding speed vs prompt length", "tokens / s", lines, _bad(points))
    return plot_lines(path, [speed], "prompt tokens", log_x=True, limit=plain_limit)


def plot_block_size(points: Sequence[Point], path: Path) -> Path:
    """Tokens/s (left) and tokens per target forward (right) vs block size, one line per dataset."""
    configs = ", ".join(dict.fromkeys(p.row.config.split("@")[0] for p in points))
    speed = Panel(configs, "tokens / s", _lines(points, "dataset", "tokens_per_second"), _bad(points))
    accepted = Panel(configs, "tokens per target forward", _lines(points, "dataset", "mean_acceptance_length"))
    return plot_lines(path, [speed, accepted], "block size")
