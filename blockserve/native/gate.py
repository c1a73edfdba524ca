"""The one test every native CPU kernel's caller makes: the kernels (csrc/, built for this CPU)
take CPU tensors of one dtype, so a CUDA tensor, or another dtype, takes the PyTorch path."""

from __future__ import annotations

import torch


def native_reads(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """True when a native CPU kernel taking `dtype` may be given `x`: on the CPU, and in `dtype`."""
    return x.device.type == "cpu" and x.dtype == dtype
