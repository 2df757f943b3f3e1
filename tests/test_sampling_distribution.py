"""Sampling stays exact: on a vocabulary of 8, speculative samples follow the target's distribution.

The exact marginals of the 2nd and 3rd new token are computed by enumerating transformers'
own model; each drafter's empirical counts must pass a chi-square test (p > 0.001) just as
direct sampling does. Seeds are fixed, so the test is deterministic.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import load_in, save_tiny, save_tiny_dflash

import dflash2
from dflash2.config import SamplingConfig
from dflash2.drafters.window import SINK_TOKENS
from dflash2.engine import DraftLengthPolicy, OverlapPolicy
from dflash2.engine.draft_length import DraftLength
from dflash2.sampling import probabilities

VOCAB8 = 8
PROMPT = "\x01\x02\x03\x01\x02\x05\x01\x02"
SAMPLES = 1500
SMALL_VOCAB = {"vocab_size": VOCAB8, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    paths = {
        "target": save_tiny(root / "target", "llama", seed=2, std=0.15, **SMALL_VOCAB),
        "draft": save_tiny(root / "draft", "llama", seed=9, std=0.15, **SMALL_VOCAB),
        "dflash": save_tiny_dflash(root / "dflash", version=1, vocab=VOCAB8, mask_token_id=7, block_size=3),
        "dflash2": save_tiny_dflash(root / "dflash2", version=2, vocab=VOCAB8, mask_token_id=7, block_size=3),
    }
    for name in ("dflash", "dflash2", "draft"):  # the same drafters limited to drafting 5 of the 8 tokens
        limited = paths[f"{name}-vocab"] = root / f"{name}-vocab"
        shutil.copytree(paths[name], limited)
        (limited / "draft_vocab.json").write_text(json.dumps({"token_ids": [0, 1, 2, 4, 6]}))
    return paths


def exact_marginals(
    path: Path, prompt_ids: list[int], config: SamplingConfig, last: int = 3, model: dflash2.Model | None = None
) -> list[np.ndarray]:
    """P(t_2) .. P(t_last) under the target alone, by enumerating every prefix: transformers' model
    in float64, or ``model``'s own target (a quantized one: its logits are the reference)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval() if model is None else None

    def dist(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            if hf is None:
                assert model is not None
                logits = model.target(torch.tensor([ids]), model.target.new_cache(len(ids))).logits
                assert logits is not None
                return probabilities(logits[0, -1], config).double()
            return probabilities(hf(torch.tensor([ids])).logits[0, -1], config).double()

    marginals = [torch.zeros(VOCAB8, dtype=torch.float64) for _ in range(last - 1)]
    frontier = [([], 1.0)]  # (generated prefix, its probability)
    for position in range(1, last + 1):
        grown = []
        for prefix, weight in frontier:
            p = dist([*prompt_ids, *prefix]) * weight
            if position >= 2:
                marginals[position - 2] += p
            if position < last:
                grown += [([*prefix, t], float(p[t])) for t in range(VOCAB8) if p[t] > 0]
        frontier = grown
    return [m.numpy() for m in marginals]


def chi_square_p(counts: np.ndarray, probs: np.ndarray, n: int) -> float:
    expected = probs * n
    keep = expected >= 5  # pool rare cells so the test is valid
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def drafter_for(name: str, paths: dict[str, Path]) -> Any:
    if name == "hybrid":  # lookup drafts (no probabilities) and DFlash2 drafts (with them) in one stream
        return [dflash2.drafters.NGramDrafter(block_size=3, min_ngram=1), paths["dflash2"]]
    named = {"plain": None, "ngram": dflash2.drafters.NGramDrafter(block_size=3), "autoregressive": paths["draft"]}
    return named.get(name, paths.get(name.replace("autoregressive", "draft")))


# "name@weights": the drafter in those weights (a drafter's precision never changes the distribution)
NAMES_T1 = ["plain", "ngram", "autoregressive", "autoregressive@same", "autoregressive-vocab@same", "dflash"]
NAMES_TKP = ["ngram", "autoregressive", "autoregressive@int8", "autoregressive-vocab@int4", "dflash2", "dflash2@int4"]
CASES = [(name, CONFIGS[0]) for name in [*NAMES_T1, "dflash2", "dflash-vocab"]]
CASES += [(name, CONFIGS[1]) for name in [*NAMES_TKP, "dflash2-vocab", "hybrid"]]


def sample_marginals(model: dflash2.Model, config: SamplingConfig, tokens: int, **options: Any) -> list[np.ndarray]:
    """Counts of new tokens 2 .. ``tokens`` over ``SAMPLES`` seeded generations; and the drafts accepted."""
    sampling = {"temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p}
    counts = [np.zeros(VOCAB8) for _ in range(tokens - 1)]
    accepted = 0

    async def draw() -> list[dflash2.Completion]:
        return [
            await model.agenerate(PROMPT, max_new_tokens=tokens, seed=s, **sampling, **options) for s in range(SAMPLES)
        ]

    for completion in anyio.run(draw):
        for position in range(1, tokens):
            counts[position - 1][completion.token_ids[position]] += 1
        accepted += sum(completion.stats.acceptance_lengths) - completion.stats.steps
    return [*counts, np.array([accepted])]


def check_marginals(counts: list[np.ndarray], exact: list[np.ndarray]) -> None:
    for position, (observed, probs) in enumerate(zip(counts, exact, strict=True)):
        p = chi_square_p(observed, probs, SAMPLES)
        assert p > 1e-3, f"token {position + 2}: chi-square p = {p:.2e}"


@pytest.mark.parametrize(("name", "config"), CASES, ids=[f"{n}-{'t1' if c is CONFIGS[0] else 'tkp'}" for n, c in CASES])
def test_speculative_sampling_matches_the_target(name: str, config: SamplingConfig, paths: dict[str, Path]) -> None:
    name, _, weights = name.partition("@")
    drafter = drafter_for(name, paths)
    block = 3 if name != "plain" else None
    model = dflash2.load(paths["target"], drafter=drafter, block_size=block, drafter_weights=weights or "auto")
    prompt_ids = model.tokenizer(PROMPT).input_ids
    assert max(prompt_ids) < VOCAB8
    *counts, accepted = sample_marginals(model, config, 3, pipeline="sync")
    check_marginals(counts, exact_marginals(paths["target"], prompt_ids, config))
    if name not in ("plain", "ngram"):
        assert accepted[0] > 0  # the rejection path and the acceptance path both ran


QUANTIZED_TARGETS = [("autoregressive", "bf16"), ("autoregressive", "int8"), ("dflash2", "int4"), ("hybrid", "int4")]


@pytest.mark.parametrize(("name", "weights"), QUANTIZED_TARGETS)
def test_speculative_sampling_matches_a_quantized_target(name: str, weights: str, paths: dict[str, Path]) -> None:
    """A target in quantized weights: the distribution is its own, computed token by token."""
    config = CONFIGS[1]
    model = load_in(paths["target"], weights, drafter=drafter_for(name, paths), block_size=3)
    prompt_ids = model.tokenizer(PROMPT).input_ids
    *counts, accepted = sample_marginals(model, config, 3, pipeline="sync")
    check_marginals(counts, exact_marginals(paths["target"], prompt_ids, config, model=model))
    assert accepted[0] > 0


def test_a_windowed_drafter_samples_the_target(paths: dict[str, Path]) -> None:
    """A small LM drafter reading only the prompt's first tokens and the last 2 drafts from another
    distribution than the one that reads it all; the samples still follow the target's."""
    config = CONFIGS[1]
    model = dflash2.load(paths["target"], drafter=paths["draft"], block_size=3)
    assert isinstance(model.drafter, dflash2.drafters.AutoregressiveDrafter)
    prompt_ids = model.tokenizer(PROMPT).input_ids
    model.drafter.window = 2
    assert len(prompt_ids) > SINK_TOKENS + 2  # the drafter skips the middle of the prompt
    *counts, accepted = sample_marginals(model, config, 3, pipeline="sync")
    check_marginals(counts, exact_marginals(paths["target"], prompt_ids, config))
    assert accepted[0] > 0


@pytest.mark.parametrize(("name", "config"), [("autoregressive", CONFIGS[0]), ("dflash2", CONFIGS[1])])
def test_predrafted_sampling_matches_the_target(name: str, config: SamplingConfig, paths: dict[str, Path]) -> None:
    """The async pipeline pre-drafting every step: tokens 2..4 come from drafts made ahead."""
    model = dflash2.load(paths["target"], drafter=drafter_for(name, paths), block_size=3)
    model.policy = OverlapPolicy(schedule="overlap")
    prompt_ids = model.tokenizer(PROMPT).input_ids
    *counts, accepted = sample_marginals(model, config, 6, pipeline="async")
    check_marginals(counts[:3], exact_marginals(paths["target"], prompt_ids, config, last=4))
    assert accepted[0] > 0


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_same_seed_same_output(paths: dict[str, Path], pipeline: str) -> None:
    for name in ["plain", "ngram", "autoregressive", "dflash2"]:
        model = dflash2.load(
            paths["target"], drafter=drafter_for(name, paths), block_size=3 if name != "plain" else None
        )
        a = model.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=42, pipeline=pipeline)
        b = model.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=42, pipeline=pipeline)
        assert a.token_ids == b.token_ids, name


class VaryingLength(DraftLengthPolicy):
    """The draft-length policy under seeded sampling (which normally keeps full blocks), with
    fixed costs so that its choices, and so the test, are reproducible: k follows acceptance."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.requests: list[DraftLength] = []
        for tokens in (1, 2, 3):
            super().record_verify(tokens, 1.0 + 0.1 * (tokens - 1))
        for tokens in (1, 2):
            super().record_draft(tokens, 0.02 * tokens)

    def record_verify(self, tokens: int, seconds: float) -> None:
        pass

    def record_draft(self, tokens: int, seconds: float, source: str = "model") -> None:
        pass

    def start(self, fixed: bool = False) -> DraftLength:
        self.requests.append(super().start(fixed=False))
        return self.requests[-1]


@pytest.mark.parametrize(
    ("name", "config"), [("autoregressive", CONFIGS[0]), ("dflash2", CONFIGS[1]), ("ngram", CONFIGS[1])]
)
def test_a_draft_length_chosen_per_step_keeps_the_distribution(
    name: str, config: SamplingConfig, paths: dict[str, Path]
) -> None:
    model = dflash2.load(paths["target"], drafter=drafter_for(name, paths), block_size=3)
    lengths = model.lengths = VaryingLength()
    prompt_ids = model.tokenizer(PROMPT).input_ids
    *counts, _ = sample_marginals(model, config, 6, pipeline="sync")
    check_marginals(counts[:3], exact_marginals(paths["target"], prompt_ids, config, last=4))
    chosen = Counter(k for request in lengths.requests for k in request.chosen)
    common = [k for k, n in chosen.items() if n >= 0.05 * sum(chosen.values())]
    assert len(common) >= 2, chosen  # the length did vary from step to step
