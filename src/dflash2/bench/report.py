"""Bench output: JSON with machine and versions, a markdown table in the docs, PNG plots."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from dflash2.bench.harness import Row


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


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(rows: Sequence[Row], reference: str = "transformers") -> str:
    """One line per configuration and dataset; rows without 100 % identical outputs are flagged
    (a peer that runs other weights, llama.cpp on the GGUF itself, is marked instead)."""
    plain = any(r.speedup_plain is not None for r in rows)
    lines = [
        f"| dataset | configuration | tokens/s | speedup vs {reference} "
        + ("| × dflash2 plain " if plain else "")
        + "| tokens per target forward | TTFT (s) | overlap | overlap bound | bubble | pre-draft hits | identical |",
        "|---|---|---:|---:|" + ("---:|" if plain else "") + "---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        flag = " ⚠ NOT IDENTICAL" if r.flagged else "" if r.exact else " (its own weights)"
        vs_plain = f"| {_fmt(r.speedup_plain, '.2f')}× " if plain else ""
        lines.append(
            f"| {r.dataset} | {r.config} | {r.tokens_per_second:.1f} | {r.speedup:.2f}× {vs_plain}"
            f"| {_fmt(r.mean_acceptance_length, '.2f')} | {_fmt(r.time_to_first_token_s, '.3f')} "
            f"| {_fmt(r.overlap, '.0%')} | {_fmt(r.overlap_bound, '.0%')} | {_fmt(r.bubble, '.0%')} "
            f"| {_fmt(r.predraft_hit_rate, '.0%')} | {r.identical}/{r.prompts}{flag} |"
        )
    return "\n".join(lines)


def update_section(doc: Path, name: str, content: str) -> None:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` (append if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{content.strip()}\n{end}"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


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
