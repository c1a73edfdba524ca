"""gguf_matmul_limbs and gguf_matmul_decode (the float32 default of a GGUF block layer's decode
batches): x taken as four base-255 integer limbs per block of 32 (csrc/block_limbs.h) and dotted
with the blocks' levels by the int8 kernel equals the float32 matmul of gguf-py's dequantised
weights with x itself (not a rounding of it), per format and build, to float32 rounding; that holds
for activations whose magnitudes within a block span many orders, where an 8- or 16-bit rounding
would not. Tolerance as tests/models/test_gguf_blocks_int8.py's (the terms' magnitudes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockserve.models.gguf_block_linear import KERNEL_FORMATS, GGUFBlockLinear, block_shape
from tests.models.test_gguf_block_linear import BUILDS, dequantized, random_blocks
from tests.models.test_gguf_blocks_int8 import EXTREMES, constants

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(any(ops is None or not ops.simd_lanes() for ops in BUILDS.values()),
                                 reason="the block kernels need native kernels built with AVX-512 or AVX2")]
ROWS = (1, 2, 3, 5, 8, 9, 16, 64)


def wide_range_x(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """Activations whose magnitudes within a block of 32 span about 8 orders (e^(+-9))."""
    return torch.randn(rows, columns, generator=generator) * torch.exp(3 * torch.randn(rows, columns, generator=generator))


def excess(out: torch.Tensor, x: torch.Tensor, format: str, raw: np.ndarray) -> float:
    """How far out is from x @ W^T (float64) beyond float32 rounding of the terms (<= 0: within)."""
    weight = torch.from_numpy(dequantized(format, raw)).double()
    magnitude = 2 * weight.abs() + 2 * torch.from_numpy(constants(format, raw)).double()
    bound = 1e-5 * (x.double().abs() @ magnitude.T) + 1e-6
    return ((out.double() - x.double() @ weight.T).abs() - bound).max().item()


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("format", KERNEL_FORMATS)
def test_limbs_give_the_float32_matmul_of_x_itself(build, format):
    ops, rng = BUILDS[build], np.random.default_rng(KERNEL_FORMATS.index(format))
    generator = torch.Generator().manual_seed(KERNEL_FORMATS.index(format))
    values = block_shape(format)[0]
    columns = 2 * values + (0 if values == 256 else 96)
    for scales in (None, EXTREMES):
        raw = random_blocks(format, 37, columns, rng, scales)
        for m in ROWS:
            x = wide_range_x(m, columns, generator)
            out = ops.gguf_matmul_limbs(x, torch.from_numpy(raw), format)
            assert excess(out, x, format, raw) <= 0, (format, m)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_int8_rounding_would_fail_where_the_limbs_pass(build):
    """The check above can fail: x rounded to int8 per block (the opt-in fast mode) is far outside
    float32 rounding on the same wide-range activations."""
    ops, rng = BUILDS[build], np.random.default_rng(11)
    raw = random_blocks("Q4_K", 16, 512, rng)
    x = wide_range_x(4, 512, torch.Generator().manual_seed(11))
    assert excess(ops.gguf_matmul_limbs(x, torch.from_numpy(raw), "Q4_K"), x, "Q4_K", raw) <= 0
    assert excess(ops.gguf_matmul_int8(x, torch.from_numpy(raw), "Q4_K"), x, "Q4_K", raw) > 0


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_blocks_of_zeros_tiny_huge_and_non_finite_values(build):
    """A block of zeros gives exact zeros; magnitudes far apart (blocks below 2^-97, rows of 1e30)
    stay within float32 rounding; a NaN or an infinity in a block makes its row's
    outputs NaN, and only its row's."""
    ops, rng = BUILDS[build], np.random.default_rng(12)
    raw = random_blocks("Q6_K", 8, 512, rng)
    x = torch.zeros(5, 512)
    x[1, :32] = torch.randn(32) * 1e-35
    x[1, 32:64] = torch.randn(32) * 1e-30
    x[2] = torch.randn(512) * 1e3
    x[3, 7] = float("nan")
    x[4, 300] = float("inf")
    out = ops.gguf_matmul_limbs(x, torch.from_numpy(raw), "Q6_K")
    assert torch.equal(out[0], torch.zeros(8))
    assert excess(out[1:3], x[1:3], "Q6_K", raw) <= 0
    assert out[3:].isnan().all()
    huge = torch.randn(1, 512) * 1e30
    assert excess(ops.gguf_matmul_limbs(huge, torch.from_numpy(raw), "Q6_K"), huge, "Q6_K", raw) <= 0


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_a_row_gets_the_same_bits_in_any_call_of_up_to_8_rows(build):
    """gguf_matmul_decode: up to 8 rows the limbs serve, and a row's result does not depend on what
    shares its call; past 8 rows gguf_matmul serves, whose rows are likewise independent."""
    ops, rng = BUILDS[build], np.random.default_rng(13)
    for format in KERNEL_FORMATS:
        columns = 1024 if block_shape(format)[0] == 256 else 544
        raw = torch.from_numpy(random_blocks(format, 11, columns, rng))
        x = torch.randn(20, columns)
        eight = ops.gguf_matmul_decode(x[:8], raw, format)
        assert torch.equal(eight, ops.gguf_matmul_limbs(x[:8], raw, format))
        for m in (1, 2, 5, 7):
            assert torch.equal(ops.gguf_matmul_decode(x[:m], raw, format), eight[:m]), (format, m)
        assert torch.equal(ops.gguf_matmul_decode(x[7:8], raw, format), eight[7:8])
        twenty = ops.gguf_matmul_decode(x, raw, format)
        assert torch.equal(twenty, ops.gguf_matmul(x, raw, format))
        assert torch.equal(ops.gguf_matmul_decode(x[:9], raw, format), twenty[:9]), format


def test_the_layer_runs_the_limbs_for_a_decode_row():
    """GGUFBlockLinear's float32 default takes one row through gguf_matmul_decode (the limbs): the
    same bits as the kernel, and the float32 product of x itself."""
    rng = np.random.default_rng(14)
    raw = random_blocks("Q4_K", 12, 512, rng)
    linear = GGUFBlockLinear([("Q4_K", torch.from_numpy(raw))], 512)
    x = wide_range_x(1, 512, torch.Generator().manual_seed(14))
    out = linear(x)
    assert torch.equal(out, linear.ops.gguf_matmul_limbs(x, torch.from_numpy(raw), "Q4_K"))
    assert excess(out, x, "Q4_K", raw) <= 0
