"""Bench output: JSON with machine and versions, a markdown table in the docs, PNG plots."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from dflash2.bench.harness import Row

T = TypeVar("T")


def write_record(
    out: Path, section: str, machine: dict[str, Any], settings: dict[str, Any], key: str, items: Sequence[Any]
) -> Path:
    """``OUT/SECTION-DATE-TIME.json``: the machine, the settings, and under ``key`` the items (dataclasses or dicts)."""
    path = out / f"{section}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [asdict(item) if is_dataclass(item) and not isinstance(item, type) else item for item in items]
    path.write_text(json.dumps({"machine": machine, "settings": settings, key: records}, indent=2) + "\n")
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def checked(identical: int, prompts: int, exact: bool = True) -> str:
    """The identical-output cell: ``n/N``, flagged when outputs that should match do not all."""
    if not exact:  # a peer running other weights
        return f"{identical}/{prompts} (its own weights)"
    return f"{identical}/{prompts}" + ("" if identical == prompts else " ⚠ NOT IDENTICAL")


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; a column named with a leading ``>`` holds numbers (right-aligned)."""
    head = "| " + " | ".join(c.removeprefix(">") for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.startswith(">") else "---" for c in columns) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


def markdown_table(rows: Sequence[Row], reference: str = "transformers") -> str:
    """One line per configuration and dataset; rows without 100 % identical outputs are flagged
    (a peer that runs other weights, llama.cpp on the GGUF itself, is marked instead)."""
    plain = any(r.speedup_plain is not None for r in rows)
    columns = ["dataset", "configuration", ">tokens/s", f">speedup vs {reference}"]
    columns += [">× dflash2 plain"] * plain + [">tokens per target forward", ">TTFT (s)", ">overlap"]
    columns += [">overlap bound", ">bubble", ">pre-draft hits", "identical"]
    return table(
        columns,
        (
            [r.dataset, r.config, f"{r.tokens_per_second:.1f}", f"{r.speedup:.2f}×"]
            + [f"{fmt(r.speedup_plain, '.2f')}×"] * plain
            + [fmt(r.mean_acceptance_length, ".2f"), fmt(r.time_to_first_token_s, ".3f"), fmt(r.overlap, ".0%")]
            + [fmt(r.overlap_bound, ".0%"), fmt(r.bubble, ".0%"), fmt(r.predraft_hit_rate, ".0%")]
            + [checked(r.identical, r.prompts, r.exact)]
            for r in rows
        ),
    )


def update_section(doc: Path, name: str, content: str) -> None:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` (append if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{content.strip()}\n{end}"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


Lines = dict[str, list[tuple[float, float]]]  # label -> (x, y) points


def lines_of(items: Iterable[T], label: Callable[[T], str], point: Callable[[T], tuple[float, float]]) -> Lines:
    """``items`` as plot lines: one per ``label``, its ``point`` s in the items' order."""
    lines: Lines = {}
    for item in items:
        lines.setdefault(label(item), []).append(point(item))
    return lines


class Panel(NamedTuple):
    """One plot panel: lines of (x, y) points by label; ``bad`` points (outputs not identical) marked."""

    title: str
    ylabel: str
    lines: Lines
    bad: Sequence[tuple[float, float]] = ()


def plot_lines(
    path: Path, panels: Sequence[Panel], xlabel: str, log_x: bool = False, limit: float | None = None
) -> Path:
    """Panels side by side, each a line per label over the same x values (ticks at those values);
    ``limit``: a dashed bound (plain decoding's) drawn across the first panel."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=(5.5 * len(panels), 4.0), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, points in panel.lines.items():
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        if panel.bad:
            ax.scatter(*zip(*panel.bad, strict=True), marker="x", s=80, color="red", zorder=3, label="not identical")
        ax.set(title=panel.title, xlabel=xlabel, ylabel=panel.ylabel)
        if log_x:
            ax.set_xscale("log", base=2)
        xs = sorted({x for points in panel.lines.values() for x, _ in points})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if limit is not None:
        first = axes[0][0]
        first.axhline(limit, linestyle="--", color="gray", label=f"plain decoding's limit ({limit:.0f} tokens/s)")
        if limit > 10 * max(y for points in panels[0].lines.values() for _, y in points):
            first.set_yscale("log")  # the measured lines stay readable beside a far-away limit
        first.legend(fontsize=8)
    return save(fig, path)


def plot_tokens_per_second(rows: Sequence[Row], path: Path) -> Path:
    plt = pyplot()
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    configs = list(dict.fromkeys(r.config for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(configs) * len(datasets)), 4.0))
    width = 0.8 / max(1, len(datasets))
    for d, dataset in enumerate(datasets):
        values = [
            next((r.tokens_per_second for r in rows if r.config == c and r.dataset == dataset), 0.0) for c in configs
        ]
        xs = [i + d * width for i in range(len(configs))]
        bars = ax.bar(xs, values, width, label=dataset)
        for bar, config in zip(bars, configs, strict=True):
            row = next((r for r in rows if r.config == config and r.dataset == dataset), None)
            if row is not None and row.flagged:
                bar.set_hatch("//")
    ax.set_xticks([i + width * (len(datasets) - 1) / 2 for i in range(len(configs))], configs, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title("Greedy decoding throughput (hatched: outputs not identical)")
    ax.legend()
    return save(fig, path)


def plot_acceptance_histogram(rows: Sequence[Row], path: Path) -> Path | None:
    plt = pyplot()
    spec = [r for r in rows if r.acceptance_lengths and max(r.acceptance_lengths) > 1]
    if not spec:
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    top = max(max(r.acceptance_lengths) for r in spec)
    for r in spec:
        ax.hist(
            r.acceptance_lengths,
            bins=range(1, top + 2),
            alpha=0.5,
            label=f"{r.config} · {r.dataset}",
            density=True,
            align="left",
        )
    ax.set_xlabel("tokens per target forward")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=7)
    return save(fig, path)
