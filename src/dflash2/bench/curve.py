"""Acceptance vs training: each kept checkpoint of a ``train-drafter`` run, measured on real prompts.

Every point drafts with the checkpoint through the SDK (greedy, sync pipeline) and checks its
output against plain decoding, so an acceptance figure never stands without exactness beside it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from dflash2.api import Model
from dflash2.bench.data import Prompt
from dflash2.bench.report import pyplot, save
from dflash2.config import Pipeline
from dflash2.drafters.dflash import DFlashSpec, load_dflash_drafter, ours_to_zlab
from dflash2.engine.draft_length import DraftLengthPolicy
from dflash2.stream import Stats


@dataclass
class CurvePoint:
    step: int
    supervised_tokens: int  # block positions with a label seen by the optimizer so far
    mean_acceptance_length: float
    identical: int
    prompts: int
    dataset: str


@dataclass
class _DatasetRun:
    """Greedy generations of one dataset's prompts, each compared with its reference."""

    stats: list[Stats]
    identical: int

    @property
    def checked(self) -> tuple[int, int]:
        return self.identical, len(self.stats)

    @property
    def mean_acceptance_length(self) -> float:
        lengths = [n for s in self.stats for n in s.acceptance_lengths]
        return sum(lengths) / len(lengths) if lengths else 0.0


def _run_dataset(
    model: Model,
    prompts: Sequence[Prompt],
    dataset: str,
    max_new_tokens: int,
    references: dict[int, tuple[int, ...]],
    pipeline: Pipeline,
) -> _DatasetRun:
    run = _DatasetRun([], 0)
    for i, p in enumerate(prompts):
        if p.dataset == dataset:
            completion = model.generate(p.prompt, max_new_tokens=max_new_tokens, pipeline=pipeline)
            run.stats.append(completion.stats)
            run.identical += completion.token_ids == references[i]
    return run


def checkpoint_steps(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def acceptance_curve(
    model: Model, run: Path, prompts: Sequence[Prompt], max_new_tokens: int, references: dict[int, tuple[int, ...]]
) -> list[CurvePoint]:
    """Mean acceptance length per dataset for every checkpoint under ``run/checkpoints``."""
    config = json.loads((run / "drafter" / "config.json").read_text())
    spec = DFlashSpec.from_config(config)
    points = []
    for path in checkpoint_steps(run):
        state = json.loads((path / "state.json").read_text())
        tokens = int(sum(sum(h["labels"]) for h in state["history"]))
        tensors = ours_to_zlab(spec, load_file(str(path / "model.safetensors")))
        drafted = model.with_drafter(load_dflash_drafter(config, tensors, model.target, name=path.name))
        drafted.lengths = DraftLengthPolicy(mode="fixed")  # whole blocks: what the drafter can draft
        for dataset in dict.fromkeys(p.dataset for p in prompts):
            result = _run_dataset(drafted, prompts, dataset, max_new_tokens, references, "sync")
            step = int(state["step"])
            points.append(CurvePoint(step, tokens, result.mean_acceptance_length, *result.checked, dataset))
    return points


def curve_table(points: Sequence[CurvePoint]) -> str:
    lines = [
        "| step | supervised tokens | dataset | tokens per target forward | identical |",
        "|---:|---:|---|---:|---|",
    ]
    for p in points:
        flag = "" if p.identical == p.prompts else " ⚠ NOT IDENTICAL"
        lines.append(
            f"| {p.step} | {p.supervised_tokens:,} | {p.dataset} | {p.mean_acceptance_length:.2f} "
            f"| {p.identical}/{p.prompts}{flag} |"
        )
    return "\n".join(lines)


def plot_curve(points: Sequence[CurvePoint], path: Path) -> Path:
    fig, ax = pyplot().subplots(figsize=(6.5, 4.0))
    for dataset in dict.fromkeys(p.dataset for p in points):
        mine = [p for p in points if p.dataset == dataset]
        ax.plot(
            [p.supervised_tokens for p in mine], [p.mean_acceptance_length for p in mine], marker="o", label=dataset
        )
    ax.set_xlabel("supervised block tokens seen in training")
    ax.set_ylabel("tokens per target forward")
    ax.set_title("shipped drafter: acceptance vs training")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)
