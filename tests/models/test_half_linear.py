"""16-bit weights with float32 activations: csrc/half_matmul.cpp (AVX-512 and AVX2 + F16C builds) and
HalfLinear's tiled converting GEMM give the float32 matmul over the widened weights.

Tolerance: float32 accumulation against float64 over the same widened weights (widening is exact),
|error| <= 1e-5 * (|x| @ |W|^T) + 1e-6: scaled by the terms' magnitudes, not the result's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockserve.models.half_linear import (
    KERNEL_ROWS,
    HalfEmbedding,
    HalfLinear,
    converted_matmul,
    keeps_16bit,
    use_half_weights,
)
from blockserve.native.extension import ISA_ENV, half_matmul_ops

ROWS = (1, 2, 7, 16, 64, 300)
SHAPES = ((64, 96), (13, 37), (5, 16), (131, 1000))  # (out, in): tails of the group of 4 and of the lanes
DTYPES = (torch.bfloat16, torch.float16)


def builds() -> list:
    """The builds this CPU runs: the native one (AVX-512 where the host has it) and the AVX2 one."""
    found = {}
    for build in (half_matmul_ops(), half_matmul_ops(without_avx512=True)):
        if build is not None and build.half_matmul_lanes():
            found[build.half_matmul_lanes()] = build
    return [found[lanes] for lanes in sorted(found, reverse=True)]


def assert_float32_matmul(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    wide = weight.double()
    want = x.double() @ wide.t()
    bound = 1e-5 * (x.double().abs() @ wide.abs().t()) + 1e-6
    assert out.dtype == torch.float32 and out.shape == want.shape
    assert ((out.double() - want).abs() <= bound).all(), float(((out.double() - want).abs() - bound).max())


def test_avx512_and_avx2_builds_are_covered():
    """The AVX2 build compiles on any x86-64 host; the AVX-512 one wherever the host has it."""
    lanes = [build.half_matmul_lanes() for build in builds()]
    assert 8 in lanes
    flags = open("/proc/cpuinfo").read()
    assert (16 in lanes) == (" avx512f" in flags)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_float32_matmul_over_the_widened_weights(dtype):
    gen = torch.Generator().manual_seed(0)
    for build in builds():
        for out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features, generator=gen) * 3).to(dtype)
            for rows in ROWS:
                x = torch.randn(rows, in_features, generator=gen)
                assert_float32_matmul(build.half_matmul(x, weight), x, weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values_widen_exactly(dtype):
    """The largest finite values, subnormals, zeros and signed zeros of the format: each weight
    times a one-hot x is that weight, widened exactly."""
    info = torch.finfo(dtype)
    values = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4, 0.0, -0.0, 1.0, -3.5])
    weight = values.repeat(19, 1).t().contiguous().to(dtype)  # [8, 19]
    for build in builds():
        for k in range(19):
            x = torch.zeros(3, 19)
            x[:, k] = 1.0
            assert torch.equal(build.half_matmul(x, weight), weight.float()[:, k].expand(3, -1))


def test_a_row_gets_the_same_bits_alone_or_in_a_batch():
    """Every output is the same arithmetic whatever shares its call."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 200, generator=gen).to(torch.bfloat16)
    x = torch.randn(9, 200, generator=gen)
    for build in builds():
        batch = build.half_matmul(x, weight)
        for i in range(9):
            assert torch.equal(build.half_matmul(x[i : i + 1], weight), batch[i : i + 1])


def test_bad_inputs_are_refused():
    build = builds()[0]
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        build.half_matmul(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="columns"):
        build.half_matmul(torch.randn(2, 8), torch.randn(4, 9).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        HalfLinear(torch.randn(4, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_converting_gemm_equals_float32_matmul(dtype, monkeypatch):
    """Past the kernel's rows, tiles of the weight are widened in turn (here a few rows each)."""
    monkeypatch.setattr("blockserve.models.half_linear.TILE_BYTES", 16 * 4 * 37)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(131, 37, generator=gen).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, 37, generator=gen)
        assert_float32_matmul(converted_matmul(x, weight), x, weight)


def test_half_linear_takes_the_kernel_up_to_its_rows_then_the_gemm(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 64, generator=gen).to(torch.bfloat16), torch.randn(40, generator=gen)
    layer = HalfLinear(weight, bias)
    assert layer.kernel_rows == KERNEL_ROWS[builds()[0].half_matmul_lanes()]
    calls = []
    kernel = layer.kernel
    layer.kernel = lambda x, w: calls.append(x.shape[0]) or kernel(x, w)
    for rows in (1, layer.kernel_rows, layer.kernel_rows + 1):
        x = torch.randn(rows, 64, generator=gen)
        out = layer(x)
        assert_float32_matmul(out - bias, x, weight)
    assert calls == [1, layer.kernel_rows]
    x = torch.randn(2, 3, 64, generator=gen)  # leading dims are flattened and restored
    assert layer(x).shape == (2, 3, 40)


def test_the_isa_switch_gives_half_linear_the_avx2_build(monkeypatch):
    avx2 = half_matmul_ops(without_avx512=True)
    monkeypatch.setenv(ISA_ENV, "avx2")
    layer = HalfLinear(torch.randn(8, 32).to(torch.bfloat16))
    assert half_matmul_ops() is avx2 and layer.kernel_rows == KERNEL_ROWS[8]


def test_without_native_kernels_the_gemm_serves_every_row(monkeypatch):
    monkeypatch.setenv("BLOCKSERVE_NATIVE_KERNELS", "0")
    weight = torch.randn(24, 48).to(torch.float16)
    layer = HalfLinear(weight)
    assert layer.kernel is None
    x = torch.randn(3, 48)
    assert_float32_matmul(layer(x), x, weight)


def test_use_half_weights_takes_over_16bit_linears_and_embeddings_only():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tie_word_embeddings = True
            self.tied_lm_head = None
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(10, 8).to(torch.bfloat16)
            self.model.proj = nn.Linear(8, 6).to(torch.float16)
            self.model.proj.bias = nn.Parameter(torch.randn(6))
            self.model.wide = nn.Linear(8, 6)  # float32: left as it is
            self.model.matrix = nn.Linear(8, 6).to(torch.bfloat16)
            self.model.matrix.keep_row_major = True

    model = Tiny()
    assert not keeps_16bit(model.model.matrix, "weight") and not keeps_16bit(model.model.proj, "bias")
    assert use_half_weights(model) == 2
    assert isinstance(model.model.embed_tokens, HalfEmbedding) and isinstance(model.model.proj, HalfLinear)
    assert type(model.model.wide) is nn.Linear and type(model.model.matrix) is nn.Linear
    ids = torch.tensor([1, 7])
    assert torch.equal(model.model.embed_tokens(ids), model.model.embed_tokens.weight.float()[ids])
    assert model.tied_lm_head.weight is model.model.embed_tokens.weight  # shared, not copied
