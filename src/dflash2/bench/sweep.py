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
from dflash2.bench.report import pyplot, save
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


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _identical(row: Row) -> str:
    return f"{row.identical}/{row.prompts}" + ("" if row.all_identical else " ⚠ NOT IDENTICAL")


def prompt_length_table(points: Sequence[Point]) -> str:
    lines = [
        "| prompt tokens | configuration | tokens/s | speedup vs transformers | tokens per target forward "
        "| TTFT (s) | identical |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for p in points:
        r = p.row
        lines.append(
            f"| {p.prompt_tokens:.0f} | {r.config} | {r.tokens_per_second:.1f} | {r.speedup:.2f}× "
            f"| {_fmt(r.mean_acceptance_length, '.2f')} | {_fmt(r.time_to_first_token_s, '.3f')} | {_identical(r)} |"
        )
    return "\n".join(lines)


def block_size_table(points: Sequence[Point]) -> str:
    lines = [
        "| dataset | block size | configuration | tokens/s | speedup vs transformers | tokens per target forward "
        "| draft tokens per step | identical |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for p in points:
        r = p.row
        lines.append(
            f"| {r.dataset} | {p.x} | {r.config} | {r.tokens_per_second:.1f} | {r.speedup:.2f}× "
            f"| {_fmt(r.mean_acceptance_length, '.2f')} | {_fmt(r.drafted_per_step, '.2f')} | {_identical(r)} |"
        )
    return "\n".join(lines)


def drafter_weights_table(points: Sequence[Point]) -> str:
    bits = {b: name for name, b in WEIGHT_BITS.items()} | {32: "fp32 (same as the target)"}
    lines = [
        "| dataset | drafter weights | tokens/s | speedup vs transformers | tokens per target forward "
        "| ms per draft token | identical |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for p in points:
        r = p.row
        lines.append(
            f"| {r.dataset} | {bits.get(p.x, p.x)} | {r.tokens_per_second:.1f} | {r.speedup:.2f}× "
            f"| {_fmt(r.mean_acceptance_length, '.2f')} | {_fmt(r.draft_ms_per_token, '.1f')} | {_identical(r)} |"
        )
    return "\n".join(lines)


def _mark_not_identical(ax: Any, points: Sequence[Point], y: Any) -> None:
    bad = [p for p in points if not p.row.all_identical]
    if bad:
        ax.scatter([p.x for p in bad], [y(p) for p in bad], marker="x", s=80, color="red", zorder=3)


def plot_prompt_length(points: Sequence[Point], plain_limit: float, path: Path) -> Path:
    """Tokens/s vs prompt length per configuration, with the plain-decoding bandwidth limit."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for config in dict.fromkeys(p.row.config for p in points):
        mine = [p for p in points if p.row.config == config]
        ax.plot([p.x for p in mine], [p.row.tokens_per_second for p in mine], marker="o", label=config)
    _mark_not_identical(ax, points, lambda p: p.row.tokens_per_second)
    ax.axhline(
        plain_limit,
        linestyle="--",
        color="gray",
        label=f"physical limit for plain decoding ({plain_limit:.0f} tokens/s)",
    )
    ax.set_xscale("log", base=2)
    xs = sorted({p.x for p in points})
    ax.set_xticks(xs, [str(x) for x in xs])
    if plain_limit > 10 * max((p.row.tokens_per_second for p in points), default=0.0):
        ax.set_yscale("log")  # keep the measured curves readable next to a far-away limit
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens / s")
    ax.set_title("Greedy decoding speed vs prompt length (red ×: outputs not identical)")
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_block_size(points: Sequence[Point], path: Path) -> Path:
    """Tokens/s (left) and tokens per target forward (right) vs block size, one line per dataset."""
    plt = pyplot()
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    for dataset in dict.fromkeys(p.row.dataset for p in points):
        mine = [p for p in points if p.row.dataset == dataset]
        speed.plot([p.x for p in mine], [p.row.tokens_per_second for p in mine], marker="o", label=dataset)
        accept.plot([p.x for p in mine], [p.row.mean_acceptance_length or 0.0 for p in mine], marker="o", label=dataset)
    _mark_not_identical(speed, points, lambda p: p.row.tokens_per_second)
    xs = sorted({p.x for p in points})
    for ax, label in ((speed, "tokens / s"), (accept, "tokens per target forward")):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("block size")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    configs = ", ".join(dict.fromkeys(p.row.config.split("@")[0] for p in points))
    fig.suptitle(f"{configs}: block size (red ×: outputs not identical)")
    return save(fig, path)
