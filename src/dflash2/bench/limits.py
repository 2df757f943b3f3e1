"""The physical limit of plain decoding: every new token reads all weights once from memory."""

from __future__ import annotations

import time

import torch

from dflash2.api import Model
from dflash2.runtime.linear import Packable


def memory_bandwidth_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth seen by torch: the best of a few full passes over a large tensor."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: Model) -> int:
    """Bytes of weights a decoding step reads: every projection and the LM head as they compute
    (pre-packed or quantized), and the norms; the embedding table only serves a row per token."""
    total = 0
    for module in model.target.modules():
        if isinstance(module, Packable):
            used = module.packed_weight if module.packed else module.weight
            total += used.numel() * used.element_size()
            if module.bias is not None:
                total += module.bias.numel() * module.bias.element_size()
        elif not isinstance(module, torch.nn.Embedding):
            own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            total += sum(t.numel() * t.element_size() for t in own if t.device.type != "meta")
    return total


def plain_decoding_limit(bandwidth_gbps: float, weights: int) -> float:
    """Tokens/s that plain decoding (one full weight read per token) cannot exceed."""
    return bandwidth_gbps * 1e9 / weights
