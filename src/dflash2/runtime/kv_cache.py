"""A static, preallocated KV cache whose rollback is a length change."""

from __future__ import annotations

import copy

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
        zeroed: bool = False,
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        # a static step attends over the whole buffer, masked: 0 x NaN garbage would still be NaN
        new = torch.zeros if zeroed else torch.empty
        self.k = new(shape, dtype=dtype, device=device)
        self.v = new(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise ContextLengthError(
                f"the KV cache holds {self.capacity} tokens and {self.length} are used; "
                f"{new_tokens} more do not fit. Lower max_new_tokens or shorten the prompt."
            )

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's keys/values [B, KV, T, D] of one layer and return the keys/values to attend over.

        Without ``positions`` the block goes at ``length`` and the valid keys (block included) come
        back. With ``positions`` (a device tensor: static steps, see ``runtime.graphs``), [T] for
        every row or [B, T] row by row, the block goes there and the whole buffer comes back: no
        shape depends on the length, and the caller's mask hides what is not valid.
        """
        if positions is not None:
            if positions.dim() == 2:
                index = positions[:, None, :, None].expand_as(k)
                self.k[layer].scatter_(2, index, k)
                self.v[layer].scatter_(2, index, v)
            else:
                self.k[layer].index_copy_(2, positions, k)
                self.v[layer].index_copy_(2, positions, v)
            return self.k[layer], self.v[layer]
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over batch rows ``[start, stop)`` of this one's buffers (shared, not copied), empty."""
        view = copy.copy(self)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.length = 0
        return view

    def move(self, source: int, target: int) -> None:
        """Copy the keys and values at position ``source`` to ``target`` in every layer (an accepted
        side branch takes the place of the chain token it stood in for)."""
        self.k[:, :, :, target] = self.k[:, :, :, source]
        self.v[:, :, :, target] = self.v[:, :, :, source]

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def rollback(self, length: int) -> None:
        """Forget every token at position ``length`` and after."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} tokens")
        self.length = length

    def reset(self) -> None:
        self.length = 0
