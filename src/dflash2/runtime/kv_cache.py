"""A static, preallocated KV cache whose rollback is a length change."""

from __future__ import annotations

import torch

from dflash2.errors import ContextLengthError


class KVCache:
    """Keys and values of every layer in two preallocated tensors.

    Shape ``[layers, batch, kv_heads, capacity, head_dim]``. ``length`` tokens are valid;
    a forward writes its block at ``[length, length + T)`` and then advances ``length``.
    Rolling back rejected tokens only lowers ``length``: nothing is copied or freed.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise ContextLengthError(
                f"the KV cache holds {self.capacity} tokens and {self.length} are used; "
                f"{new_tokens} more do not fit. Lower max_new_tokens or shorten the prompt."
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's keys/values of one layer; return all valid keys/values incl. the block."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def rollback(self, length: int) -> None:
        """Forget every token at position ``length`` and after."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} tokens")
        self.length = length

    def reset(self) -> None:
        self.length = 0
