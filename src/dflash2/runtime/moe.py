"""A sparse mixture-of-experts MLP (Qwen3-MoE): each token runs through the top-k of E SwiGLU experts.

The router scores every expert (softmax in fp32), each token keeps its k best (their weights
renormalised to sum to one when the config says ``norm_topk_prob``), and each expert runs once
over the tokens that picked it; its outputs, weighted, are added back in ascending expert
order, the order in which transformers sums them, so fp32 results match it bit for bit.
The experts' weights live stacked, ``gate_up`` [E, 2 I, D] and ``down`` [E, D, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.runtime.linear import Linear


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.router = Linear(hidden_size, experts)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(experts, hidden_size, intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens ``x`` [N, D]: the chosen experts [N, k] and their weights [N, k] (in x's dtype)."""
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(flat)
        picks, scales = chosen.flatten(), weights.flatten()  # token i's j-th choice at i * k + j
        order = torch.argsort(picks, stable=True)  # the picks grouped by expert, ascending
        counts = torch.bincount(picks, minlength=self.gate_up.shape[0]).tolist()
        out = torch.zeros_like(flat)
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            mine = order[begin : begin + count]
            begin += count
            rows = mine // self.top_k
            gate, up = F.linear(flat[rows], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert]) * scales[mine, None]
            out.index_add_(0, rows, y)
        return out.view_as(x)
