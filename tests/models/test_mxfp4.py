"""MXFP4 weights read in place (models/mxfp4.py, csrc/mxfp4.cpp): the dequantised values are
transformers' (its own dequantiser, an independent reference) and the test encoder's; the kernel,
in the native and the AVX2 build (1 to 64 rows: the row-at-a-time and the tiled paths), and the
PyTorch path (native kernels off) are the float32 matmul over those values.

Tolerance of a matmul: float32 accumulation against float64,
|error| <= 1e-5 * (|x| @ |W|^T) + 1e-6 (the terms' magnitudes, not the result's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from blockserve.models.mxfp4 import dequantize_mxfp4, mxfp4_matmul
from blockserve.native.extension import mxfp4_ops
from tests.models.mxfp4_encoder import decode_mxfp4, encode_mxfp4
from tests.models.test_gguf_block_linear import assert_matmul

BUILDS = {"native": mxfp4_ops(), "avx2": mxfp4_ops(without_avx512=True)}
needs_native = pytest.mark.skipif(any(ops is None for ops in BUILDS.values()),
                                  reason="the MXFP4 kernel needs the native kernels built")
ROWS = (1, 2, 7, 16, 64)


def random_mxfp4(n: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes, scales 2^-10 .. 2^3 and a few extremes (2^-127, the smallest)."""
    blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(117, 131, (n, k // 32), dtype=np.uint8)
    scales[0, 0] = 0
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def test_dequantised_values_are_transformers_and_the_encoders():
    rng = np.random.default_rng(0)
    blocks, scales = random_mxfp4(24, 96, rng)
    blocks, scales = blocks.reshape(2, 12, 3, 16), scales.reshape(2, 12, 3)  # [E, N, K/32, 16]
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # back to [E, N, K]
    assert torch.equal(ours, theirs)
    assert np.array_equal(ours.double().numpy(), decode_mxfp4(blocks.numpy(), scales.numpy()))
    weights = rng.normal(0, 0.2, (5, 64))
    encoded = decode_mxfp4(*encode_mxfp4(weights))
    assert np.abs(encoded - weights).max() <= np.abs(weights).max() / 4  # 4 bits: a step of a quarter of the peak


def test_mismatched_blocks_and_scales_are_named():
    blocks, scales = random_mxfp4(4, 64, np.random.default_rng(1))
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[:, :1])


@needs_native
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_kernel_is_the_float32_matmul_of_the_dequantised_weights(build):
    ops = BUILDS[build]
    rng = np.random.default_rng(2)
    blocks, scales = random_mxfp4(40, 96, rng)
    weight = decode_mxfp4(blocks.numpy(), scales.numpy())
    for rows in ROWS:
        x = torch.from_numpy(rng.normal(0, 1, (rows, 96)).astype(np.float32))
        assert_matmul(ops.mxfp4_matmul(x, blocks, scales), x, weight)
    with pytest.raises(RuntimeError, match="x has 64 columns"):
        ops.mxfp4_matmul(torch.zeros(2, 64), blocks, scales)


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_dispatch_and_the_pytorch_path_are_the_matmul(native, monkeypatch):
    monkeypatch.setenv("BLOCKSERVE_NATIVE_KERNELS", native)  # "0": the PyTorch path
    assert (mxfp4_ops() is None) == (native == "0") or BUILDS["native"] is None
    rng = np.random.default_rng(3)
    blocks, scales = random_mxfp4(16, 64, rng)
    x = torch.from_numpy(rng.normal(0, 1, (7, 64)).astype(np.float32))
    assert_matmul(mxfp4_matmul(x, blocks, scales), x, decode_mxfp4(blocks.numpy(), scales.numpy()))
