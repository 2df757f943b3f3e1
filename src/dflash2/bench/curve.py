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
from dflash2.bench.report import Panel, checked, lines_of, plot_lines, table
from dflash2.drafters.dflash import DFlashSpec, load_dflash_drafter, ours_to_zlab
from dflash2.engine.draft_length import DraftLengthPolicy
from dflash2.train.trainer import whole_checkpoints


@dataclass
class CurvePoint:
    step: int
    supervised_tokens: int  # block positions with a label seen by the optimizer so far
    mean_acceptance_length: float
    identical: int
    prompts: int
    dataset: str


def acceptance_curve(
    model: Model, run: Path, prompts: Sequence[Prompt], max_new_tokens: int, references: dict[int, tuple[int, ...]]
) -> list[CurvePoint]:
    """Mean acceptance length per dataset for every checkpoint under ``run/checkpoints``."""
    config = json.loads((run / "drafter" / "config.json").read_text())
    spec = DFlashSpec.from_config(config)
    points = []
    for path in whole_checkpoints(run / "checkpoints"):
        state = json.loads((path / "state.json").read_text())
        tokens = int(sum(sum(h["labels"]) for h in state["history"]))
        tensors = ours_to_zlab(spec, load_file(str(path / "model.safetensors")))
        drafted = model.with_drafter(load_dflash_drafter(config, tensors, model.target, name=path.name))
        drafted.lengths = DraftLengthPolicy(mode="fixed")  # whole blocks: what the drafter can draft
        for dataset in dict.fromkeys(p.dataset for p in prompts):
            mine = [(i, p) for i, p in enumerate(prompts) if p.dataset == dataset]
            runs = [drafted.generate(p.prompt, max_new_tokens=max_new_tokens, pipeline="sync") for _, p in mine]
            lengths = [n for c in runs for n in c.stats.acceptance_lengths]
            same = sum(c.token_ids == references[i] for (i, _), c in zip(mine, runs, strict=True))
            accepted = sum(lengths) / len(lengths) if lengths else 0.0
            points.append(CurvePoint(int(state["step"]), tokens, accepted, same, len(runs), dataset))
    return points


def curve_table(points: Sequence[CurvePoint]) -> str:
    columns = [">step", ">supervised tokens", "dataset", ">tokens per target forward", "identical"]
    rows = []
    for p in points:
        accepted, same = f"{p.mean_acceptance_length:.2f}", checked(p.identical, p.prompts)
        rows.append([p.step, f"{p.supervised_tokens:,}", p.dataset, accepted, same])
    return table(columns, rows)


def plot_curve(points: Sequence[CurvePoint], path: Path) -> Path:
    lines = lines_of(points, lambda p: p.dataset, lambda p: (p.supervised_tokens, p.mean_acceptance_length))
    panel = Panel("shipped drafter: acceptance vs training", "tokens per target forward", lines)
    return plot_lines(path, [panel], "supervised block tokens seen in training")
