"""The physical limit of plain decoding: every new token reads all weights once from memory."""

from __future__ import annotations

import time

import torch

from dflash2.api import Model


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
    """Bytes of the target's parameters (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.target.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def plain_decoding_limit(bandwidth_gbps: float, weights: int) -> float:
    """Tokens/s that plain decoding (one full weight read per token) cannot exceed."""
    return bandwidth_gbps * 1e9 / weights
