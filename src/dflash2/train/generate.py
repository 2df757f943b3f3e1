"""Self-distillation data: the target answers the prompts itself, many at a time.

Prompts of a batch are left-padded to one length and the padding is masked out of attention
(``Decoder.forward(visible=...)``); each row stops at its EOS. Sampling uses the same
transform as generation (``dflash2.sampling``), seeded per batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash2.config import SamplingConfig
from dflash2.runtime.model import Decoder
from dflash2.sampling import choose, make_generator


@torch.inference_mode()
def generate_batch(
    target: Decoder,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_ids: frozenset[int],
) -> list[list[int]]:
    """Responses (new ids, ending at the first EOS when there is one) for each prompt."""
    width = max(len(p) for p in prompts)
    batch = len(prompts)
    device = target.device
    ids = torch.zeros(batch, width, dtype=torch.long, device=device)
    visible = torch.ones(batch, width + max_new_tokens, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        visible[row, : width - len(prompt)] = False
    cache = target.new_cache(width + max_new_tokens, batch=batch)
    generator = make_generator(sampling, device)
    out = target(ids, cache, logits="last", visible=visible[:, :width])
    responses: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    for step in range(max_new_tokens):
        assert out.logits is not None
        tokens = choose(out.logits[:, -1], sampling, generator).view(batch)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                responses[row].append(int(token))
                done[row] = token in eos_ids
        if all(done) or step + 1 == max_new_tokens:
            break
        out = target(tokens[:, None], cache, logits="last", visible=visible[:, : cache.length + 1])
    return responses
