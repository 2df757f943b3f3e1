"""How close the draft-length policy comes to the best a stopping rule can do with a model drafter.

For each prompt: the target's greedy text with the drafter (sync, the default policy), then the
drafter's own greedy choice and confidence after every prefix of that text, read as it reads while
drafting (teacher-forced, token by token). On that record a greedy chain of k drafts from any
position is accepted exactly as far as the choices are right, so steps can be replayed offline:
every fixed draft length, the policy's stopping rule (``worth_more`` with each confidence bin's
acceptance), and an oracle that drafts one past what will be accepted. Each is costed with the
target's forward and the drafter's token time as the policy measured them in the same run, and
reported against plain decoding in that cost model (no prompt prefill, chains only). Example::

    python scripts/draft_length_check.py --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b \\
        --out bench/results/draft-length-check.json
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import dflash2
from dflash2.bench.data import load_dataset
from dflash2.bench.harness import machine_info
from dflash2.config import SamplingConfig
from dflash2.demo_model import model_source
from dflash2.drafters.base import DraftContext
from dflash2.engine.draft_length import CONFIDENCE_BINS, worth_more
from dflash2.tokenize import encode_prompt

Record = list[tuple[bool, float]]  # per position after the first new token: drafter right?, its confidence
Rule = Callable[[Record, int], int]  # draft length at a position of a record


def teacher_forced(model: dflash2.Model, prompt_ids: list[int], text: list[int]) -> Record:
    """The drafter's greedy choice after each prefix of ``text``, fed one token at a time as in drafting."""
    assert model.drafter is not None
    drafter = model.drafter

    def job() -> Record:
        with torch.inference_mode():
            context = DraftContext(prompt_ids, text[0], None, SamplingConfig(), None, len(prompt_ids) + len(text) + 8)
            session = drafter.start(context)
            try:  # the session's own drafting step, one token after the given text (the engine's numerics)
                drafts = [session._draft_after(prompt_ids + text[:t], 1) for t in range(1, len(text))]  # type: ignore[attr-defined]
            finally:
                session.close()
        return [(int(d.tokens[0]) == text[t], d.confidence[0]) for t, d in enumerate(drafts, start=1)]

    return model.workers.verify.call(job)


def replay(records: Sequence[Record], rule: Rule, costs: Sequence[float]) -> tuple[float, float, float]:
    """Tokens per second, tokens per forward and drafts per step of ``rule`` over ``records``."""
    tokens = seconds = steps = drafted = 0.0
    for record in records:
        t = 0
        while t < len(record):
            k = min(rule(record, t), len(record) - t, len(costs) - 1)
            accepted = 0
            while accepted < k and record[t + accepted][0]:
                accepted += 1
            tokens, seconds, steps, drafted = tokens + accepted + 1, seconds + costs[k], steps + 1, drafted + k
            t += accepted + 1
    return tokens / seconds, tokens / steps, drafted / steps


def chances(records: Sequence[Record]) -> list[float]:
    """Acceptance by confidence bin (Laplace-smoothed), as the policy learns it."""
    counts = [[0, 0] for _ in range(len(CONFIDENCE_BINS) + 1)]
    for record in records:
        for right, sure in record:
            counts[bisect.bisect_left(CONFIDENCE_BINS, sure)][0] += right
            counts[bisect.bisect_left(CONFIDENCE_BINS, sure)][1] += 1
    return [(a + 1) / (n + 2) for a, n in counts]


def policy_rule(costs: Sequence[float], by_bin: Sequence[float]) -> Rule:
    """The policy's token-by-token stopping rule (``DraftLength.keep_drafting``)."""

    def rule(record: Record, t: int) -> int:
        k, yielded, reach = 0, 1.0, 1.0
        while t + k < len(record) and k + 1 < len(costs):
            chance = by_bin[bisect.bisect_left(CONFIDENCE_BINS, record[t + k][1])]
            k += 1
            reach *= chance
            yielded += reach
            if not worth_more(yielded, reach, chance, costs, k):
                break
        return k

    return rule


def fixed(k: int) -> Rule:
    return lambda record, t: k


def oracle(record: Record, t: int) -> int:
    accepted = 0
    while t + accepted < len(record) and record[t + accepted][0]:
        accepted += 1
    return accepted + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--datasets", default="humaneval,mtbench")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = dflash2.load(model_source(args.model), drafter=model_source(args.drafter), prefix_cache=0)
    assert model.drafter is not None
    limit = model.drafter.block_size - 1
    results = []
    for dataset in args.datasets.split(","):
        records: list[Record] = []
        forwards: list[int] = []
        for prompt in load_dataset(dataset, args.limit):
            completion = model.generate(prompt.prompt, max_new_tokens=args.max_new_tokens, pipeline="sync")
            text = list(completion.token_ids)
            records.append(teacher_forced(model, encode_prompt(model.tokenizer, prompt.prompt), text))
            forwards += completion.stats.acceptance_lengths
        verify = model.lengths.verify_seconds()
        costs = [verify[min(k + 1, len(verify) - 1)] + model.lengths.draft_seconds(k) for k in range(limit + 1)]
        rules = {f"fixed {k}": fixed(k) for k in range(limit + 1)}
        rules |= {"policy's rule": policy_rule(costs, chances(records)), "oracle": oracle}
        rows = {name: replay(records, rule, costs) for name, rule in rules.items()}
        plain = rows["fixed 0"][0]
        for name, (rate, per_forward, drafted) in rows.items():
            print(
                f"{dataset} {name:14s} {rate / plain:.3f}x plain, {per_forward:.2f} per forward, {drafted:.2f} drafts"
            )
        run = sum(forwards) / len(forwards)
        print(f"{dataset} the run itself: {run:.2f} tokens/forward (side branches included)")
        agreement = sum(r for rec in records for r, _ in rec) / sum(len(rec) for rec in records)
        replayed = {
            n: {"x_plain": r / plain, "tokens_per_forward": f, "drafts_per_step": d} for n, (r, f, d) in rows.items()
        }
        results.append({"dataset": dataset, "prompts": len(records), "costs_s": costs, "agreement": agreement,
                        "run_tokens_per_forward": run, "rules": replayed})  # fmt: skip
    settings = {
        "model": args.model,
        "drafter": args.drafter,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
    }
    record = {"machine": machine_info(), "settings": settings, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
