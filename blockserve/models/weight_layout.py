"""Input-major (column-major) storage for linear weights, chosen once after loading.

`F.linear(x, W)` with W [out, in] stored row-major runs the "x @ W^T" GEMM; with the same W
stored column-major (strides (1, out)), `W^T` is a contiguous [in, out] matrix and the GEMM is a
plain "x @ B". On x86 CPUs the latter is faster at the 8-64 rows of a decode batch
(measured in docs/performance.md); the values are the same matrix, so modules and `F.linear` calls
are unchanged. Weights read as matrices elsewhere (e.g. reshaped per head) must stay row-major:
such a module sets `keep_row_major = True`.

`PanelLinear` goes one step further for wide layers: W^T as separate contiguous panels of
PANEL_COLUMNS columns (~1.8 MB each at 576 inputs, within a 2 MB L2), one GEMM per panel into the
output's columns. That is faster than one GEMM over the whole W^T at 16-128 rows but slower at
1 row and at prefill sizes (measured in docs/performance.md), so it is used where something else
serves the smallest batches: the layers that keep GGUF blocks (models/quantized_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, stored so that its transpose is contiguous."""
    return weight.t().contiguous().t()


PANEL_COLUMNS = 768
PANEL_MIN_OUT = 2 * PANEL_COLUMNS


class PanelLinear(nn.Module):
    """`x @ W^T + b` with W^T [in, out] stored as contiguous column panels [in, <= PANEL_COLUMNS].

    The same values as the nn.Linear it replaces; `weight` reassembles W [out, in] (a copy, for
    inspection and tests: the forward never builds it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.panels = nn.ParameterList(
            nn.Parameter(weight[start : start + PANEL_COLUMNS].t().contiguous(), requires_grad=False)
            for start in range(0, self.out_features, PANEL_COLUMNS))
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(list(self.panels), 1).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = rows.new_empty(rows.shape[0], self.out_features)
        start = 0
        for panel in self.panels:
            torch.mm(rows, panel, out=out[:, start : start + panel.shape[1]])
            start += panel.shape[1]
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def use_input_major_linears(model: nn.Module) -> None:
    """Re-store every 2-D nn.Linear weight of `model` column-major, and the input embedding when it
    doubles as the lm_head (tied); modules with `keep_row_major = True` are left as they are."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and not getattr(module, "keep_row_major", False):
            _relayout(module)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)  # where every family keeps it
    if getattr(model, "tie_word_embeddings", False) and isinstance(embedding, nn.Embedding):
        _relayout(embedding)


def _relayout(module: nn.Module) -> None:
    weight = module.weight
    if weight.dim() == 2 and weight.device.type == "cpu" and weight.stride(0) != 1:
        module.weight = nn.Parameter(column_major(weight.detach()), requires_grad=False)
