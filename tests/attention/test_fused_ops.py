"""The native fused layer ops against the PyTorch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockserve.models.rotary import apply_rotary
from blockserve.native.extension import fused_ops, quantized_matmul_ops, why_not_native

pytestmark = pytest.mark.skipif(why_not_native() is not None, reason=f"native kernels cannot be built here: {why_not_native()}")


@pytest.fixture(scope="module")
def ops():
    module = fused_ops()
    assert module is not None, "a compiler and ninja are here, so the fused ops must build"
    return module


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm_updates_both_in_place(ops, rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(rows, 96, generator=gen) * 3 for _ in range(3))
    want_residual = residual + x
    want = F.rms_norm(want_residual, (96,), weight[0], 1e-6)
    ops.add_rms_norm_(x, residual, weight[0], 1e-6)
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_rotates_the_leading_heads_of_each_row_only(ops, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    t, rotated, untouched = 5, 6, 2
    qkv = torch.randn(t, (rotated + untouched) * head_dim, generator=gen)
    angles = torch.rand(t, head_dim // 2, generator=gen) * 6
    want = apply_rotary(qkv[:, :rotated * head_dim].view(t, rotated, head_dim), angles.cos()[:, None], angles.sin()[:, None])
    rest = qkv[:, rotated * head_dim:].clone()
    ops.rotary_(qkv, rotated, head_dim, angles.cos(), angles.sin())
    torch.testing.assert_close(qkv[:, :rotated * head_dim].view(t, rotated, head_dim), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, rotated * head_dim:], rest)


def test_silu_and_mul_over_the_whole_range(ops):
    gate_up = torch.cat([torch.linspace(-120, 120, 1001).repeat(3, 1), torch.randn(3, 1001)], dim=1)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "avx2"])
def test_argmax_rows_is_torchs_argmax_ties_nan_and_infinities_included(portable):
    ops = quantized_matmul_ops(without_avx512=True) if portable else fused_ops()
    gen = torch.Generator().manual_seed(5)
    for rows, vocab in [(1, 49152), (3, 7), (9, 1000), (2, 33), (1, 1)]:
        x = torch.randn(rows, vocab, generator=gen)
        assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices)
    x = torch.randn(6, 100, generator=gen)
    x[0] = 0.0
    x[0, 3] = -0.0  # equal to 0.0: the first zero wins
    x[1, 70] = x[1, 50] = float("nan")  # the first NaN wins
    x[2] = float("-inf")
    x[3, 90] = x[3, 17] = 1e9  # a tie: the lower index
    x[4, 99] = float("inf")  # in the scalar tail
    x[5, 5] = float("nan")  # in a vector block, before any max
    assert ops.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist() == [0, 50, 0, 17, 99, 5]
    strided = torch.randn(8, 64, generator=gen)[::2]  # rows apart: the row stride is honoured
    assert torch.equal(ops.argmax_rows(strided), strided.max(dim=-1).indices)


def test_bad_input_is_refused_with_a_message(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_and_mul(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="shapes"):
        ops.add_rms_norm_(torch.zeros(2, 4), torch.zeros(2, 5), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.argmax_rows(torch.zeros(4, 6).t())
