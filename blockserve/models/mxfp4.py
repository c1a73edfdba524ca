"""MXFP4 weights (OCP microscaling, gpt-oss's experts) as the Hugging Face checkpoint stores them,
multiplied in place:

    blocks uint8 [..., N, K/32, 16]   32 e2m1 values per block, two a byte, the low nibble first
    scales uint8 [..., N, K/32]       e8m0: the block's values times 2^(scale - 127)

    W [N, K] = the blocks' values, K = 32 · blocks                      (transformers' dequantisation,
                                                                        before its transpose)

`mxfp4_matmul(x, blocks, scales)` is x @ W^T: csrc/mxfp4.cpp's kernel where native kernels are
built (each weight row widened into a buffer of K floats, never the matrix), else PyTorch over
`dequantize_mxfp4` of that one matrix, a float32 copy that lives for the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockserve.native.extension import mxfp4_ops

BLOCK = 32  # values per block (one scale)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., N, K] of blocks [..., N, K/32, 16] and scales [..., N, K/32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                         f"blocks must be [..., N, K/32, 16] and scales [..., N, K/32]")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N], W [N, K] MXFP4 (module docstring)."""
    ops = mxfp4_ops()
    if ops is not None and hasattr(ops, "mxfp4_matmul") and x.device.type == "cpu":
        return ops.mxfp4_matmul(x, blocks, scales)
    return F.linear(x, dequantize_mxfp4(blocks, scales).to(x.dtype))
