"""Pure math for choosing tokens: the temperature / top-k / top-p transform and sampling.

Target and drafter probabilities go through the same :func:`probabilities` so the lossless
acceptance rule compares like with like.
"""

from __future__ import annotations

import os

import torch

from dflash2.config import SamplingConfig


def make_generator(config: SamplingConfig, device: torch.device, offset: int = 0) -> torch.Generator | None:
    """A seeded generator for sampling (``None`` for greedy). No seed means a fresh random one.

    ``offset`` derives independent streams from one seed (the drafter's is ``offset=1``).
    """
    if config.greedy:
        return None
    generator = torch.Generator(device=device)
    seed = config.seed + offset if config.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    generator.manual_seed(seed)
    return generator


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-k and the top-p nucleus (fp32).

    Works on any leading shape; the last axis is the vocabulary. Requires ``temperature > 0``.
    """
    scores = logits.float() / config.temperature
    vocab = scores.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already cover top_p; always keep the first
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` [..., vocab]: the argmax of ``p / E``, ``E ~ Exp(1)`` i.i.d.

    This exponential race is what ``torch.multinomial`` computes for one sample (the same ids
    from the same generator state), minus its validity checks, which read the device from the
    host: here sampling never waits for the GPU.
    """
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


def choose(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a sample from the transformed distribution, one id per row."""
    if config.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, config), generator)
