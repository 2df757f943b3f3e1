"""Run a matrix of runners over the same prompts; every output is checked against the reference."""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from dflash2.bench.data import Prompt
from dflash2.bench.runners import Runner, RunResult

PLAIN = "dflash2"  # dflash2's plain decoding: what speculative rows are a multiple of


@dataclass
class Row:
    """Aggregate of one runner on one dataset."""

    config: str
    group: str
    dataset: str
    prompts: int
    new_tokens: int
    seconds: float
    identical: int
    tokens_per_second: float = 0.0
    speedup: float = 0.0
    speedup_plain: float | None = None  # against dflash2's plain decoding in the same run
    exact: bool = True  # expected to equal the reference (False: a peer running other weights)
    mean_acceptance_length: float | None = None
    time_to_first_token_s: float | None = None
    overlap: float | None = None
    bubble: float | None = None
    predraft_hit_rate: float | None = None  # pre-drafts confirmed per verify step
    overlap_bound: float | None = None  # T_draft / (T_draft + T_verify): the most overlap can hide
    drafted_per_step: float | None = None  # draft tokens verified per target forward
    draft_ms_per_token: float | None = None  # drafting time per draft token verified
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def all_identical(self) -> bool:
        return self.identical == self.prompts

    @property
    def flagged(self) -> bool:
        """Outputs that should equal the reference's and do not all."""
        return self.exact and not self.all_identical


def run_matrix(
    runners: Sequence[Runner],
    prompts: Sequence[Prompt],
    encode: Any,
    max_new_tokens: int,
    reference: str,
    warmup: int = 1,
    progress: bool = True,
) -> list[Row]:
    """Each prompt goes through every runner in turn (interleaved, so drift hits all alike).

    ``reference`` names the runner whose outputs define "identical" (transformers plain greedy).
    The first ``warmup`` prompts run once through every runner untimed.
    """
    names = [r.name for r in runners]
    if reference not in names:
        raise ValueError(f"reference {reference!r} is not among the runners {names}")
    for prompt in prompts[:warmup]:
        ids = encode(prompt.prompt)
        for runner in runners:
            runner.run(prompt.prompt, ids, min(16, max_new_tokens))
    results: dict[tuple[str, str], list[tuple[RunResult, bool]]] = {}
    bar = tqdm(total=len(prompts) * len(runners), disable=not progress, desc="bench", unit="run")
    for prompt in prompts:
        ids = encode(prompt.prompt)
        outputs = {}
        for runner in runners:
            outputs[runner.name] = runner.run(prompt.prompt, ids, max_new_tokens)
            bar.update()
        expected = outputs[reference].token_ids
        for runner in runners:
            out = outputs[runner.name]
            results.setdefault((runner.name, prompt.dataset), []).append((out, out.token_ids == expected))
    bar.close()
    rows = [
        aggregate(runner, dataset, results[(runner.name, dataset)])
        for dataset in dict.fromkeys(p.dataset for p in prompts)
        for runner in runners
    ]
    for row in rows:
        base = next(r for r in rows if r.config == reference and r.dataset == row.dataset)
        row.speedup = row.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0
        plain = next((r for r in rows if r.config == PLAIN and r.dataset == row.dataset), None)
        if plain is not None and plain.tokens_per_second:
            row.speedup_plain = row.tokens_per_second / plain.tokens_per_second
    return rows


def aggregate(runner: Runner, dataset: str, runs: list[tuple[RunResult, bool]]) -> Row:
    """One row from a runner's timed runs on a dataset, each with whether it matched the reference."""
    tokens = sum(len(r.token_ids) for r, _ in runs)
    seconds = sum(r.seconds for r, _ in runs)
    lengths = [n for r, _ in runs for n in r.acceptance_lengths]
    ttfts = [r.time_to_first_token_s for r, _ in runs if r.time_to_first_token_s is not None]
    overlaps = [r.overlap for r, _ in runs if r.overlap is not None]
    bubbles = [r.bubble for r, _ in runs if r.bubble is not None]
    draft_s = sum(r.draft_s for r, _ in runs)
    verify_s = sum(r.verify_s for r, _ in runs)
    drafted = bool(lengths) and draft_s > 0
    draft_tokens = sum(r.drafted_tokens for r, _ in runs)
    return Row(
        config=runner.name,
        group=runner.group,
        exact=runner.exact,
        dataset=dataset,
        prompts=len(runs),
        new_tokens=tokens,
        seconds=seconds,
        identical=sum(same for _, same in runs),
        tokens_per_second=tokens / seconds if seconds else 0.0,
        mean_acceptance_length=sum(lengths) / len(lengths) if lengths else None,
        time_to_first_token_s=statistics.median(ttfts) if ttfts else None,
        overlap=statistics.mean(overlaps) if overlaps else None,
        bubble=statistics.mean(bubbles) if bubbles else None,
        predraft_hit_rate=sum(r.predraft_hits for r, _ in runs) / len(lengths) if drafted else None,
        overlap_bound=draft_s / (draft_s + verify_s) if drafted else None,
        drafted_per_step=draft_tokens / len(lengths) if drafted else None,
        draft_ms_per_token=1e3 * draft_s / draft_tokens if drafted and draft_tokens else None,
        acceptance_lengths=lengths,
    )


def machine_info() -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu, flags = platform.processor() or platform.machine(), set[str]()
    try:
        info: dict[str, str] = {}
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's fields
                key, colon, value = line.partition(":")
                if colon:
                    info.setdefault(key.strip(), value.strip())
        cpu, flags = info.get("model name", cpu), set(info.get("flags", "").split())
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        # the vector instructions torch's CPU kernels use here, and whether the CPU multiplies bf16 itself
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}) if flags else None,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
    }


def host(machine: dict[str, Any]) -> str:
    """The machine of a :func:`machine_info` record in words: ``AMD EPYC (AVX512, native bf16, 2 threads)``."""
    bf16 = {True: "native bf16", False: "no native bf16", None: None}[machine.get("native_bf16")]
    words = [w for w in (machine.get("cpu_capability"), bf16) if w] + [f"{machine['threads']} threads"]
    return f"{machine['cpu']} ({', '.join(words)})"
