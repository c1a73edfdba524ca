"""Routed SwiGLU experts stored stacked, as Granite 4.0-H and Qwen3-Next checkpoints (or their
per-expert weights, stacked by the loader) provide them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """SwiGLU experts stored as [E, 2I, H] (gate | up) and [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; index, weights [T, k]: each token's experts and their weights."""
        out = torch.zeros_like(x)
        for expert in index.unique().tolist():
            token, slot = (index == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out[token] += y  # a token meets each expert at most once
        return out
