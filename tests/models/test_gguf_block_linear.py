"""csrc/gguf_blocks.cpp and GGUFBlockLinear / GGUFBlockEmbedding: GGUF blocks read in place give
exactly gguf-py's dequantised values, and their matmul the float32 matmul of those values.

The blocks are random bytes with the float16 scale fields set (gguf-py cannot write every format):
ordinary scales, and the extremes (the largest finite float16, zero, negative scales and mins).
Tolerance of a matmul: float32 accumulation against float64,
|error| <= 1e-5 * (|x| @ |W|^T) + 1e-6 (the terms' magnitudes, not the result's).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from blockserve.models.gguf_block_linear import (KERNEL_FORMATS, MAX_ROWS, SCALE_OFFSETS,
                                                 GGUFBlockEmbedding, GGUFBlockLinear, block_shape, check_blocks)
from blockserve.models.quantized_linear import round_per_block
from blockserve.models import tiled_gemm
from blockserve.native.extension import ISA_ENV, quantized_matmul_ops

BUILDS = {"native": quantized_matmul_ops(), "avx2": quantized_matmul_ops(without_avx512=True)}
pytestmark = pytest.mark.skipif(any(ops is None or not ops.simd_lanes() for ops in BUILDS.values()),
                                reason="the block kernels need native kernels built with AVX-512 or AVX2")
ROWS = (1, 2, 7, 16, 64, 300)


def random_blocks(format: str, rows: int, columns: int, rng: np.random.Generator,
                  scales: np.ndarray | None = None) -> np.ndarray:
    """[rows, row bytes] random blocks of `format` whose float16 scale fields hold `scales`
    (cycled), or random ones of either sign up to 1e-2."""
    values, nbytes = block_shape(format)
    raw = rng.integers(0, 256, (rows * columns // values, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[format]:
        if scales is None:
            field = rng.uniform(-1e-2, 1e-2, raw.shape[0])
        else:
            field = np.resize(scales, raw.shape[0])
        raw[:, offset:offset + 2] = field.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dequantized(format: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format])


def assert_matmul(out: torch.Tensor, x: torch.Tensor, weight: np.ndarray) -> None:
    w = torch.from_numpy(weight).double()
    want = x.double() @ w.T
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    excess = ((out.double() - want).abs() - bound).max()
    assert excess <= 0, f"off by {excess:.3g} beyond float32 rounding"


def test_the_kernels_read_every_format_they_name():
    for ops in BUILDS.values():
        assert tuple(ops.gguf_block_formats()) == KERNEL_FORMATS


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("format", KERNEL_FORMATS)
def test_dequantize_and_matmul_equal_gguf_py(build, format):
    ops, rng = BUILDS[build], np.random.default_rng(KERNEL_FORMATS.index(format))
    values = block_shape(format)[0]
    columns, rows = 2 * values + (0 if values == 256 else 96), 37  # not multiples of any tile
    extremes = np.array([65504.0, 0.0, -65504.0, -1.5e-3, 6e-8])  # largest finite, zero, negative, subnormal
    for scales in (None, extremes):
        raw = random_blocks(format, rows, columns, rng, scales)
        weight = dequantized(format, raw)
        ours = ops.gguf_dequantize(torch.from_numpy(raw), format, columns).numpy()
        assert np.array_equal(ours.view(np.uint32), weight.view(np.uint32)), "not gguf-py's bits"
        for m in ROWS:
            x = torch.randn(m, columns)
            assert_matmul(ops.gguf_matmul(x, torch.from_numpy(raw), format), x, weight)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_register_tile_shape(build):
    """gguf_matmul multiplies 4 weight rows at a time (then the rest one by one), dequantised in
    registers, with 4 (AVX-512) or 2 (AVX2) rows of x at a time up to 8 (AVX-512) or 2 (AVX2) rows,
    and past that through a buffer in tiles of 4 weight rows x 4 rows of x (AVX-512) or 2 x 6 (AVX2):
    every remainder of both, across more than one tile."""
    ops, rng = BUILDS[build], np.random.default_rng(4)
    raw = random_blocks("Q5_0", 9, 64, rng)
    weight = dequantized("Q5_0", raw)
    x = torch.randn(13, 64)
    for n in range(1, 10):
        for m in range(1, 14):
            assert_matmul(ops.gguf_matmul(x[:m], torch.from_numpy(raw[:n]), "Q5_0"), x[:m], weight[:n])


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("format, rows, columns", [("Q4_K", 300, 2048), ("Q8_0", 64, 2816)])
def test_panels_of_k_when_x_outgrows_the_cache(build, format, rows, columns):
    """gguf_matmul takes K in panels of 1024 columns (whole blocks; 1024, 1024 then 768 of 2816), adding
    each panel's sums to the last: the same product."""
    ops, rng = BUILDS[build], np.random.default_rng(5)
    raw = random_blocks(format, 7, columns, rng)
    x = torch.randn(rows, columns)
    assert_matmul(ops.gguf_matmul(x, torch.from_numpy(raw), format), x, dequantized(format, raw))


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_a_row_gets_the_same_bits_whatever_shares_its_call(build):
    """gguf_matmul sums a row's products in one order whether the row is alone, beside a few others
    (each register tile shape, weights dequantised in registers), or in a call of more rows (through
    the buffer), over one panel of K or several, in every format."""
    ops, rng = BUILDS[build], np.random.default_rng(6)
    for format in KERNEL_FORMATS:
        columns = 2048 if block_shape(format)[0] == 256 else 1088  # two panels of K, the second partial
        raw = torch.from_numpy(random_blocks(format, 9, columns, rng))
        x = torch.randn(40, columns)
        together = ops.gguf_matmul(x, raw, format)
        for m in (1, 2, 3, 5, 8, 9):
            assert torch.equal(ops.gguf_matmul(x[:m], raw, format), together[:m]), (format, m)
        for m in (0, 20, 39):
            assert torch.equal(ops.gguf_matmul(x[m:m + 1], raw, format), together[m:m + 1]), (format, m)


@pytest.mark.parametrize("format", ("Q4_K", "Q6_K", "Q5_0"))
def test_the_linear_layer_across_row_counts_segments_and_tiles(format, monkeypatch):
    rng = np.random.default_rng(1)
    values = block_shape(format)[0]
    columns = 2 * values
    monkeypatch.setattr(tiled_gemm, "TILE_VALUES", 64 * columns)  # tiles of 64 rows (a small layer)
    rows = 64 + 5  # two tiles for many rows, the second partial
    parts = [random_blocks(format, rows, columns, rng), random_blocks("Q8_0", 3, columns, rng)]
    weight = np.concatenate([dequantized(format, parts[0]), dequantized("Q8_0", parts[1])])
    bias = torch.randn(rows + 3)
    linear = GGUFBlockLinear([(format, torch.from_numpy(parts[0])), ("Q8_0", torch.from_numpy(parts[1]))], columns,
                             bias)
    for m in (1, MAX_ROWS, MAX_ROWS + 1, 300):
        x = torch.randn(m, columns)
        assert_matmul(linear(x) - bias, x, weight)
    x = torch.randn(2, 3, columns)  # leading dimensions kept
    assert linear(x).shape == (2, 3, rows + 3)
    int8 = GGUFBlockLinear([(format, torch.from_numpy(parts[0]))], columns, activations="int8")
    x = torch.randn(5, columns)
    assert_matmul(int8(x), round_per_block(x, 127), weight[:rows])


@pytest.mark.parametrize("isa", ["native", pytest.param("avx2", marks=pytest.mark.slow)])
def test_a_decode_row_gets_the_same_bits_in_any_batch_the_blocks_serve(isa, monkeypatch):
    """Up to 64 rows (a decode step's batch of 64 requests; the decoder stack serves as many) the
    layer runs the block kernels, whose sums do not depend on the rows beside a row: a request's
    output is the same alone as in a batch of up to 8 (the limbs: a batch-1 verification's rows), and
    the same in any batch of 9 to 64 (a fused projection's parts in different formats), where a GEMM
    over dequantised tiles would sum in an order of its own per batch size."""
    monkeypatch.setenv(ISA_ENV, isa)
    rng = np.random.default_rng(7)
    columns = 512
    parts = [("Q4_K", torch.from_numpy(random_blocks("Q4_K", 37, columns, rng))),
             ("Q6_K", torch.from_numpy(random_blocks("Q6_K", 6, columns, rng)))]
    linear = GGUFBlockLinear(parts, columns)
    x = torch.randn(64, columns)
    eight, batch = linear(x[:8]), linear(x)
    for m in (1, 2, 5):
        assert torch.equal(linear(x[:m]), eight[:m]), m
    assert torch.equal(linear(x[7:8]), eight[7:])
    for m in (9, 16, 64):
        assert torch.equal(linear(x[:m]), batch[:m]), m
    assert torch.equal(linear(x[-9:]), batch[-9:])


def test_the_embedding_dequantises_the_rows_looked_up():
    rng = np.random.default_rng(2)
    raw = random_blocks("Q4_K", 50, 512, rng)
    embedding = GGUFBlockEmbedding("Q4_K", torch.from_numpy(raw), 512)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert np.array_equal(embedding(ids).numpy(), dequantized("Q4_K", raw)[ids.numpy()])
    assert embedding.resident_bytes() == raw.nbytes


def test_corrupt_blocks_are_refused_naming_the_tensor():
    rng = np.random.default_rng(3)
    raw = random_blocks("Q6_K", 4, 256, rng)
    check_blocks("blk.0.ffn_down.weight", "Q6_K", raw, 4, 256)
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight.*bytes of Q6_K blocks for a 5 x 256"):
        check_blocks("blk.0.ffn_down.weight", "Q6_K", raw, 5, 256)
    raw[2, 208:210] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight: Q6_K blocks with non-finite scales"):
        check_blocks("blk.0.ffn_down.weight", "Q6_K", raw, 4, 256)
    with pytest.raises(ValueError, match="do not hold rows of 512 values"):
        GGUFBlockLinear([("Q6_K", torch.from_numpy(raw))], 512)
    with pytest.raises(ValueError, match="no block kernel for GGUF format TQ1_0"):
        GGUFBlockLinear([("TQ1_0", torch.from_numpy(raw))], 256)


@pytest.mark.parametrize("format", KERNEL_FORMATS)
def test_every_scale_field_is_checked(format):
    """Each float16 scale of each format (d, and dmin / m where it has them) is checked: inf and
    NaN in any one block are refused; the finite extremes are accepted."""
    values, _ = block_shape(format)
    extremes = np.array([65504, -65504, 6e-8, -0.0, 0.0], np.float16)  # largest, a subnormal, signed zeros
    raw = random_blocks(format, 3, 2 * values, np.random.default_rng(4), scales=extremes)
    check_blocks("w", format, raw, 3, 2 * values)
    for offset in SCALE_OFFSETS[format]:
        for bad in (np.inf, -np.inf, np.nan):
            planted = raw.copy().reshape(6, -1)
            planted[4, offset:offset + 2] = np.array([bad], np.float16).view(np.uint8)
            with pytest.raises(ValueError, match=f"w: {format} blocks with non-finite scales"):
                check_blocks("w", format, planted.reshape(3, -1), 3, 2 * values)
