"""Input-major (column-major) storage for linear weights, chosen once after loading.

`F.linear(x, W)` with W [out, in] stored row-major runs the "x @ W^T" GEMM; with the same W
stored column-major (strides (1, out)), `W^T` is a contiguous [in, out] matrix and the GEMM is a
plain "x @ B". On x86 CPUs the latter runs 1.2-1.6x faster at the 8-64 rows of a decode batch
(docs/performance.md); the values are the same matrix, so modules and `F.linear` calls
are unchanged. Weights read as matrices elsewhere (e.g. reshaped per head) must stay row-major:
such a module sets `keep_row_major = True`.
"""

from __future__ import annotations

import torch
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, stored so that its transpose is contiguous."""
    return weight.t().contiguous().t()


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
