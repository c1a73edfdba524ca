"""Activations whose value for an element does not depend on the tensor around it.

torch's fused silu, sigmoid and softplus round the tail of their vector loop (the last few
elements) along another path than the body: on AVX-512 the same token's outputs then differ in
the last bit with the number of tokens in the call, so a prefill cut at another position (a
prefix-cache checkpoint resumed) gave other bits. These are composed of exp, log1p and IEEE
arithmetic, which torch computes alike wherever an element falls; the state layers use them so
that resuming at a chunk boundary is exact (tests/attention/test_*::test_layer_chunks_on_the_absolute_grid).
"""

from __future__ import annotations

import torch

SOFTPLUS_THRESHOLD = 20.0  # torch's default: above it softplus(x) is x in float32


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return x / (1 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above SOFTPLUS_THRESHOLD."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
