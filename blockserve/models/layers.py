"""Layers the families share: RMSNorms, the gated MLP, and the activation check.

    RMSNorm        x / rms(x) * w              (optionally the residual add fused in, Llama's stream)
    OffsetRMSNorm  x / rms(x) * (1 + w)        the checkpoint stores the offset: Gemma 3, Qwen3-Next
    GatedRMSNorm   x / rms(x) * w * act(g)     Kimi (sigmoid), Qwen3-Next (silu)
                   rms-normed (x * act(g)) * w, per group    Mamba2 (norm_before_gate=False)
    GatedMLP       down(act(gate x) * up x)    gate and up one matmul; SwiGLU with silu

rms(x) = sqrt(mean(x²) + eps) over the last dimension (or over each of `groups` equal slices of it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.native.extension import fused_ops
from blockserve.native.gate import native_reads
from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.tensor_parallel.layers import merged_column_linear, row_linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def require_activation(config, expected: str, family: str, key: str = "hidden_act") -> None:
    """ValueError unless the config's activation `key` is `expected` (what `family` implements)."""
    value = getattr(config, key)
    if value != expected:
        raise ValueError(f"{key} {value!r} is not supported by {family} (expected {expected!r})")


class RMSNorm(nn.Module):
    """`norm(x)`, or `norm(x, residual)` -> (norm(residual + x), residual + x): the residual add
    fused into the norm, in place on x and residual (both must be the caller's own tensors)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.fused = fused_ops()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self.fused is not None and native_reads(x) and x.dim() == 2:  # the kernel's device and dtype
            self.fused.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in float32 and returned in x's dtype: a zero
    weight is the identity (as transformers' Gemma3RMSNorm and Qwen3NextRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """norm(x, gate): rmsnorm(x) * weight * act(gate) (norm_before_gate), else
    rmsnorm(x * act(gate)) * weight; the norm runs within each of `groups` equal slices."""

    def __init__(self, dim: int, eps: float, activation: Callable[[torch.Tensor], torch.Tensor], *,
                 groups: int = 1, norm_before_gate: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.activation = eps, activation
        self.groups, self.norm_before_gate = groups, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gate = self.activation(gate)
        if not self.norm_before_gate:
            x = x * gate
        h = x if self.groups == 1 else x.unflatten(-1, (self.groups, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h if self.groups == 1 else h.flatten(-2)) * self.weight
        return h * gate if self.norm_before_gate else h


class GatedMLP(nn.Module):
    """down(act(gate) * up), with gate | up from one projection `gate_up_proj` [2I, H]; silu runs
    as one native pass (silu_and_mul) when the fused ops are built. With a tensor-parallel group
    `tp`, gate_up is column-parallel (this rank's I/N of each) and down row-parallel (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        self.gate_up_proj = merged_column_linear(hidden_size, (intermediate_size, intermediate_size), tp, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, tp, bias=bias, what="intermediate_size")
        self.activation = ACTIVATIONS[activation]
        self.fused = fused_ops() if activation == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and native_reads(gate_up) and gate_up.dim() == 2:  # the kernel's input
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)
