"""CUDA graphs (``graphs="cuda"``): replayed graphs against eager forwards, and no host sync in the loop.

These run only where CUDA is (the GPU check runs them: ``python scripts/gpu/check.py``); the CPU
suite checks the same static steps run eagerly (``test_static_steps.py``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import SPEC_PROMPTS

import dflash2
from dflash2.config import GenerationConfig, SamplingConfig
from dflash2.engine import OverlapPolicy, Request, ResidentPipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

DRAFTERS = ["plain", "ngram", "self", "dflash1", "dflash2"]


def drafter_for(name: str, paths: dict[str, Path]) -> Any:
    return {"plain": None, "ngram": "ngram", "self": paths["target"]}.get(name, paths.get(name))


def cuda_model(paths: dict[str, Path], name: str, graphs: str) -> dflash2.Model:
    drafter = drafter_for(name, paths)
    return dflash2.load(paths["target"], drafter=drafter, device="cuda", dtype="float32", graphs=graphs)


@pytest.mark.parametrize("schedule", ["sync", "async", "overlap"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_graph_replay_equals_eager_in_fp32(name: str, schedule: str, paths: dict[str, Path]) -> None:
    eager, graphed = cuda_model(paths, name, "off"), cuda_model(paths, name, "cuda")
    if schedule == "overlap":
        eager.policy = OverlapPolicy(schedule="overlap")
        graphed.policy = OverlapPolicy(schedule="overlap")
    pipeline = "sync" if schedule == "sync" else "async"
    for prompt in SPEC_PROMPTS:
        expected = eager.generate(prompt, max_new_tokens=48, pipeline=pipeline).token_ids
        assert graphed.generate(prompt, max_new_tokens=48, pipeline=pipeline).token_ids == expected
    assert graphed.steps is not None
    replays = sum(step.replays for slot in graphed.steps.slots for _, step in slot.steps.values())
    assert replays > 0 and all(step.captured for slot in graphed.steps.slots for _, step in slot.steps.values())


@pytest.mark.parametrize("name", ["plain", "dflash1", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_no_host_sync_inside_the_resident_loop(name: str, temperature: float, paths: dict[str, Path]) -> None:
    model = cuda_model(paths, name, "cuda")
    ids = model.tokenizer(SPEC_PROMPTS[0]).input_ids
    config, sampling = GenerationConfig(max_new_tokens=200), SamplingConfig(temperature=temperature, seed=1)
    request = Request(model.target, ids, config, sampling, model.drafter, model.steps)
    pipeline = ResidentPipeline(request, model.workers.verify, model.batcher)
    with torch.inference_mode():
        request.prefill()
        for _ in range(3):  # the run starts from the host's state (a host-driven draft may sync)
            pipeline._step()
        assert pipeline._pending is not None  # steady state: a step in flight
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                pipeline._step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        request.close()
    assert request.counters.steps >= 12


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["plain", "ngram", "dflash2"])
async def test_concurrent_streams_replay_packed_graphs(name: str, paths: dict[str, Path]) -> None:
    """Four concurrent streams verify together in the pool's packed graphs (one per batch bucket and
    block bucket), and DFlash sessions draft together in the drafter's; each stream's tokens are its
    eager tokens alone."""
    eager, graphed = cuda_model(paths, name, "off"), cuda_model(paths, name, "cuda")
    prompts = [*SPEC_PROMPTS, "hello hello hello hello"]
    expected = [(await eager.agenerate(p, max_new_tokens=24 + 8 * i)).token_ids for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(graphed.agenerate(p, max_new_tokens=24 + 8 * i) for i, p in enumerate(prompts)))
    assert [r.token_ids for r in results] == expected
    assert graphed.steps is not None and max(s for r in results for s in r.stats.batch_sizes) > 1
    packed = [step for _, _, step in graphed.steps.packed.values()]
    assert all(step.captured for step in packed) and sum(step.replays for step in packed) > 0
    if name == "dflash2":  # the sessions drafted together in the drafter pool's packed graphs
        drafted = [entry[-1] for entry in graphed.drafter.steps.packed.values()]  # type: ignore[union-attr]
        assert all(step.captured for step in drafted) and sum(step.replays for step in drafted) > 0
