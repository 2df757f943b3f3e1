"""On-policy refinement data: where a drafter, run through dflash2's own speculative loop, is wrong.

Supervised DFlash training puts its blocks at random anchors of the target's answers. In the
speculative loop a block starts where the last one ended, and what verification rejects there
are the drafter's real errors. ``collect`` runs a drafter through the sync loop (greedy, whole
blocks) on training prompts and records every step: the anchor (the index, in prompt + answer,
of the last verified token the block was drafted from), the proposal, and how many of its tokens
verification kept. The answer is the target's own greedy one, as in self-distillation. Training
with ``TrainConfig.refine`` replays the anchors of rejected blocks beside random ones.

Records live in ``out/data/onpolicy.jsonl``, one line per prompt with its hash, so a run resumes
and never pairs them with other prompts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dflash2.api import Model
from dflash2.config import GenerationConfig, SamplingConfig
from dflash2.engine import DraftLengthPolicy, Request
from dflash2.errors import InvalidOptionError
from dflash2.train.data import prompt_key, read_records, writing


@dataclass(frozen=True)
class Step:
    """One speculative step: drafted from ``anchor`` (index in prompt + answer), ``proposed``, ``accepted`` kept."""

    anchor: int
    proposed: tuple[int, ...]
    accepted: int

    @property
    def rejected(self) -> bool:
        return self.accepted < len(self.proposed)


@dataclass(frozen=True)
class Run:
    """A prompt, the target's greedy answer to it, and the drafter's steps along the way."""

    prompt: list[int]
    response: list[int]
    steps: tuple[Step, ...]

    def errors(self) -> list[int]:
        """Anchors of the blocks verification cut short."""
        return [s.anchor for s in self.steps if s.rejected]


def run_one(model: Model, prompt: list[int], max_new_tokens: int) -> Run:
    """The sync loop on ``prompt`` (greedy, whole blocks), step by step, in the calling thread."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    fixed = DraftLengthPolicy(mode="fixed").start()  # the drafter's own blocks, whole
    request = Request(model.target, prompt, config, SamplingConfig(), model.drafter, model.steps, fixed)
    steps: list[Step] = []
    eos = model.eos_token_ids
    try:
        response = request.prefill()
        while not eos.intersection(response) and request.room >= 0:
            anchor = len(prompt) + len(response) - 1
            draft = request.propose()
            emitted, outcome = request.check(draft)
            steps.append(Step(anchor, tuple(int(t) for t in draft.tokens), outcome.accepted))
            response += emitted
    finally:
        request.close()
    for end, token in enumerate(response):  # an accepted block may run past EOS or max_new_tokens
        if token in model.eos_token_ids:
            response = response[: end + 1]
            break
    return Run(prompt, response[:max_new_tokens], tuple(steps))


def collect(
    model: Model, prompts: Sequence[list[int]], path: Path, max_new_tokens: int, progress: bool = True
) -> list[Run]:
    """``run_one`` for every prompt on the model's verify worker; cached in ``path`` and resumed from it."""
    if model.drafter is None:
        raise InvalidOptionError("on-policy data needs a drafter: the one to refine.")
    keys = [prompt_key(p) for p in prompts]
    done: dict[int, Run] = {}
    for record in read_records(path, repair=True):
        index = int(record["index"])
        if index >= len(prompts):
            continue
        if record["prompt"] != keys[index]:
            raise InvalidOptionError(
                f"{path} holds on-policy runs of other prompts (prompt {index} differs); refine with a new --out."
            )
        steps = tuple(Step(a, tuple(p), k) for a, p, k in record["steps"])
        done[index] = Run(prompts[index], [int(t) for t in record["response"]], steps)
    bar = tqdm(total=len(prompts), initial=len(done), disable=not progress, desc="on-policy", unit="prompt")
    with writing("the on-policy runs", path.parent):  # on close too: a full disk fails the last flush
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as sink:
            for index, prompt in enumerate(prompts):
                if index in done:
                    continue
                run = model.workers.verify.call(functools.partial(run_one, model, prompt, max_new_tokens))
                done[index] = run
                recorded = [[s.anchor, list(s.proposed), s.accepted] for s in run.steps]
                entry = {"index": index, "prompt": keys[index], "response": run.response, "steps": recorded}
                sink.write(json.dumps(entry) + "\n")
                sink.flush()
                bar.update()
    bar.close()
    return [done[i] for i in range(len(prompts))]
