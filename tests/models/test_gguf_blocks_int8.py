"""csrc/gguf_blocks_int8.cpp (gguf_matmul_int8) and GGUFBlockLinear under int8 activations: x
rounded per block of 32 to int8 levels, integer dots with the blocks' levels, equals the float32
matmul of gguf-py's dequantised weights with round_per_block(x, 127), per format and build.

Tolerance: the float32 rounding of the sums. The kernel sums a block's factor times its integer dot
plus its constant (a min) times x's level sum, so the terms' magnitudes are those of the weight's
two parts, |a q| and |c|, not of w = a q + c: |error| <= 1e-5 * (|x| @ (|a q| + |c|)^T) + 1e-6,
with |a q| + |c| bounded by 2 |w| + 2 |c| (|a q| <= |w| + |c|).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockserve.models.gguf_block_linear import KERNEL_FORMATS, GGUFBlockLinear, block_shape
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import round_per_block
from blockserve.attention.paged_attention import BACKENDS
from tests.models.test_gguf_block_linear import BUILDS, dequantized, random_blocks
from tests.models.test_kquant_gguf import VOCAB, write_kquant_gguf
from tests.paged_harness import run_paged

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(any(ops is None or not ops.simd_lanes() for ops in BUILDS.values()),
                                 reason="the block kernels need native kernels built with AVX-512 or AVX2")]
ROWS = (1, 2, 3, 4, 5, 6, 7, 16, 300)  # each weight chunk dotted with 1-4 rows at once; past 4, tiles of 4 and 1-3
EXTREMES = np.array([65504.0, 0.0, -65504.0, -1.5e-3, 6e-8])  # largest finite, zero, negative, subnormal


def constants(format: str, raw: np.ndarray) -> np.ndarray:
    """|c| per weight: the magnitude of the term of w not proportional to its level (the mins), as
    gguf-py's dequantisation of the same blocks with every level zeroed gives it."""
    values, nbytes = block_shape(format)
    if format not in ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"):
        return np.zeros((raw.shape[0], raw.shape[1] // nbytes * values), np.float32)
    blocks = raw.reshape(-1, nbytes).copy()
    levels = {"Q4_1": slice(4, 20), "Q5_1": slice(4, 24), "Q2_K": slice(16, 80), "Q4_K": slice(16, 144),
              "Q5_K": slice(16, 176)}[format]
    blocks[:, levels] = 0
    if format == "Q2_K":
        blocks[:, :16] &= 0xf0  # the scales (low nibbles) zero, the mins (high) kept
    return np.abs(dequantized(format, blocks.reshape(raw.shape)))


def assert_int8_matmul(out: torch.Tensor, x: torch.Tensor, format: str, raw: np.ndarray) -> None:
    weight = torch.from_numpy(dequantized(format, raw)).double()
    rounded = round_per_block(x, 127).double()
    want = rounded @ weight.T
    magnitude = 2 * weight.abs() + 2 * torch.from_numpy(constants(format, raw)).double()
    bound = 1e-5 * (rounded.abs() @ magnitude.T) + 1e-6
    excess = ((out.double() - want).abs() - bound).max()
    assert excess <= 0, f"off by {excess:.3g} beyond float32 rounding"


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("format", KERNEL_FORMATS)
def test_int8_matmul_equals_the_rounded_float_matmul(build, format):
    ops, rng = BUILDS[build], np.random.default_rng(KERNEL_FORMATS.index(format))
    values = block_shape(format)[0]
    # not multiples of a 256-column chunk (32-value formats: a partial last chunk) nor of any row tile
    columns, rows = 2 * values + (0 if values == 256 else 96), 37
    for scales in (None, EXTREMES):
        raw = random_blocks(format, rows, columns, rng, scales)
        for m in ROWS:
            x = torch.randn(m, columns) * torch.logspace(-3, 3, columns)  # blocks of very different scales
            assert_int8_matmul(ops.gguf_matmul_int8(x, torch.from_numpy(raw), format), x, format, raw)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_a_row_gets_the_same_bits_whatever_shares_its_call(build):
    ops, rng = BUILDS[build], np.random.default_rng(7)
    raw = torch.from_numpy(random_blocks("Q4_K", 9, 512, rng))
    x = torch.randn(300, 512)
    together = ops.gguf_matmul_int8(x, raw, "Q4_K")
    for m in (0, 1, 150, 299):
        assert torch.equal(ops.gguf_matmul_int8(x[m:m + 1], raw, "Q4_K"), together[m:m + 1])


@pytest.mark.parametrize("format", ("Q4_K", "Q5_0"))
def test_the_bits_are_the_same_at_any_thread_count(format):
    """The weight rows are split over the task pool's threads: each output keeps its bits."""
    ops, rng = BUILDS["native"], np.random.default_rng(10)
    raw = torch.from_numpy(random_blocks(format, 300, 512, rng))  # several tasks at 1 and 9 rows
    x = torch.randn(9, 512)
    alone = [ops.gguf_matmul_int8(x[:m], raw, format) for m in (1, 9)]
    torch.set_num_threads(2)
    try:
        assert all(torch.equal(ops.gguf_matmul_int8(x[:m], raw, format), want) for m, want in zip((1, 9), alone))
    finally:
        torch.set_num_threads(1)


def test_zero_nan_and_bad_input():
    ops, rng = BUILDS["native"], np.random.default_rng(8)
    raw = torch.from_numpy(random_blocks("Q6_K", 3, 256, rng))
    x = torch.zeros(2, 256)
    x[1, 40] = float("nan")
    out = ops.gguf_matmul_int8(x, raw, "Q6_K")
    assert torch.equal(out[0], torch.zeros(3)) and out[1].isnan().all()
    with pytest.raises(RuntimeError, match="Q6_K rows of 512 values take 420 bytes"):
        ops.gguf_matmul_int8(torch.zeros(1, 512), raw, "Q6_K")
    with pytest.raises(RuntimeError, match="no kernel for GGUF format TQ1_0"):
        ops.gguf_matmul_int8(torch.zeros(1, 256), raw, "TQ1_0")


@pytest.mark.parametrize("format", ("Q4_K", "Q5_0"))
def test_the_linear_layer_runs_the_integer_kernel(format):
    """GGUFBlockLinear with activations="int8" computes the rounded x's product through the integer
    kernel (a fused layer's segments each in their own format), the bias after."""
    rng = np.random.default_rng(9)
    columns = 512
    parts = [random_blocks(format, 21, columns, rng), random_blocks("Q6_K", 3, columns, rng)]
    bias = torch.randn(24)
    linear = GGUFBlockLinear([(format, torch.from_numpy(parts[0])), ("Q6_K", torch.from_numpy(parts[1]))], columns,
                             bias, activations="int8")
    for m in (1, 16, 300):
        x = torch.randn(m, columns)
        out = linear(x) - bias
        assert_int8_matmul(out[:, :21], x, format, parts[0])
        assert_int8_matmul(out[:, 21:], x, "Q6_K", parts[1])
        assert torch.equal(out, torch.cat([BUILDS["native"].gguf_matmul_int8(x, torch.from_numpy(p), f)
                                           for f, p in ((format, parts[0]), ("Q6_K", parts[1]))], 1) + bias - bias)


def test_greedy_tokens_with_int8_activations_equal_the_rounded_float_path(tmp_path):
    """A tiny Q4_K_M-like GGUF (Q4_K, Q6_K, Q5_0) under int8 activations: the integer kernels give the
    tokens the float kernels give on the same rounded activations."""
    path = tmp_path / "model.gguf"
    write_kquant_gguf(path, "llama")
    model = load_model(str(path), BACKENDS["exact"], cache_dir=str(tmp_path / "cache"),
                       quantized_activations="int8").model
    linears = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    assert linears and all(m.integer_kernel for m in linears)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 23, 11)]
    _, integer = run_paged(model, prompts, 8, chunk=4, stagger=True)
    for linear in linears:
        linear.integer_kernel = False
    _, rounded_float = run_paged(model, prompts, 8, chunk=4, stagger=True)
    assert integer == rounded_float
