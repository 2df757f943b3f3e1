"""How close the draft-length policy comes to the best a stopping rule can do with a model drafter.

For each prompt: the target's greedy text with the drafter (sync, the default policy), then the
drafter's own greedy choice and confidence after every prefix of that text, read as it reads while
drafting (teacher-forced, token by token). On that record a greedy chain of k drafts from any
position is accepted exactly as far as the choices are right, so steps can be replayed offline:
every fixed draft length, the policy's own choice (its ``DraftLength`` with what it learnt in the
run: acceptance by confidence, costs), and the best possible: the lengths that, knowing every
outcome, give the most tokens per second.
Each is costed with the target's forward and the drafter's token time as the policy measured them
in the same run, and reported against plain decoding in that cost model (no prompt prefill, chains
only). Example::

    python scripts/draft_length_check.py --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b \\
        --out bench/results/draft-length-check.json
"""

from __future__ import annotations

import argparse
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
from dflash2.engine.draft_length import DraftLengthPolicy
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


def policy_rule(policy: DraftLengthPolicy, limit: int) -> Rule:
    """The policy's own choice with what it learnt in the run (``DraftLength.choose``, then
    ``keep_drafting`` token by token, as a drafter that reports its confidence asks it)."""
    lengths = policy.start()

    def rule(record: Record, t: int) -> int:
        chosen = lengths.choose(min(limit, len(record) - t))
        if not policy.confident():
            return chosen
        k = 0
        while k < chosen:
            k += 1
            if not lengths.keep_drafting(k, record[t + k - 1][1]):
                break
        return k

    return rule


def fixed(k: int) -> Rule:
    return lambda record, t: k


def best_possible(records: Sequence[Record], costs: Sequence[float]) -> tuple[float, float, float]:
    """What ``replay`` reports for the draft lengths that give the most tokens per second on these
    records, knowing every outcome: a dynamic programme over positions maximising tokens minus
    rate x seconds, the rate raised to each optimum's own until it stops rising (Dinkelbach)."""
    rate = replay(records, fixed(0), costs)[0]
    while True:
        chosen = {id(record): _best_lengths(record, costs, rate) for record in records}

        def rule(record: Record, t: int, chosen: dict[int, list[int]] = chosen) -> int:
            return chosen[id(record)][t]

        best = replay(records, rule, costs)
        if best[0] <= rate * (1 + 1e-9):
            return best
        rate = best[0]


def _best_lengths(record: Record, costs: Sequence[float], rate: float) -> list[int]:
    """Per position, the draft length that maximises tokens - ``rate`` x seconds from there on."""
    n = len(record)
    right = [0] * (n + 1)  # right drafts in a row from each position
    for t in range(n - 1, -1, -1):
        right[t] = right[t + 1] + 1 if record[t][0] else 0
    value, choice = [0.0] * (n + 1), [0] * n
    for t in range(n - 1, -1, -1):
        options = [(k, min(k, right[t])) for k in range(min(len(costs) - 1, n - t) + 1)]
        scores = [a + 1 - rate * costs[k] + value[min(t + a + 1, n)] for k, a in options]
        value[t] = max(scores)
        choice[t] = options[scores.index(value[t])][0]
    return choice


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
        costs = model.lengths.costs(limit)
        assert costs is not None  # every generation timed its forwards
        rules = {f"fixed {k}": fixed(k) for k in range(limit + 1)}
        rules["policy's rule"] = policy_rule(model.lengths, limit)
        rows = {name: replay(records, rule, costs) for name, rule in rules.items()}
        rows["best possible"] = best_possible(records, costs)
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
