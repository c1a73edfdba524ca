"""QuantizedLinear: GGUF blocks packed for the native kernel give the matmul of the weights gguf's
own dequantiser produces, for the rows it handles; more rows go to the GEMM over tiles dequantised
from the same blocks (no float32 copy is kept).

Tolerances. activations="float32": x @ W^T up to float32 accumulation against float64:
  |error| <= 1e-5 * (|x| @ |W|^T) + 1e-6 (scaled by the terms' magnitudes, not the result's, which
  may be near zero; observed at K = 96: at most 2.2e-7 of |x| @ |W|^T).
activations="int8" and "int16" round x per block of 32 to L = 127 or 32767 levels either side of
zero first, so they are held to two rules:
  tight  against float64 (x rounded as the kernel rounds it) @ W^T: |error| <= 1e-5 * (|x~| @ |W|^T) + 1e-6
         (float32 accumulation of exact integer block dots);
  loose  against the float32 x @ W^T: |error| <= sum_k |w_k| * s_k / 2 (+ the tight slack), s_k the
         scale max|x_block| / L of x's block holding k: the rounding of x is at most half a step.
"""

from __future__ import annotations

import os
import signal
import time

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockserve.engine.config import DEFAULT_QUANTIZED_ACTIVATIONS, QUANTIZED_ACTIVATIONS, EngineConfig
from blockserve.models import quantized_linear, tiled_gemm
from blockserve.models.quantized_linear import (
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    EVERY_ROW,
    LEVELS,
    MAX_ROWS,
    QuantizedLinear,
    pack_blocks,
    round_per_block,
    use_quantized_linears,
)
from blockserve.models.weight_layout import PANEL_COLUMNS, PanelLinear
from blockserve.native.extension import ISA_ENV, fused_ops, quantized_matmul_ops
from tests.threads import torch_threads

ops = quantized_matmul_ops()
pytestmark = pytest.mark.skipif(ops is None or not ops.simd_lanes(),
                                reason="the quantized kernel needs native kernels built with AVX-512 or AVX2")


def rounded(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as an integer kernel rounds it (float64), and each element's block scale s (float64):
    s = max|x_block| / L, x ~ s * round-half-even(x * (L / max|x_block|)), in float32 as the kernel."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))  # one rounding
    scale = (amax / levels).double().expand(blocks.shape)
    return (torch.round(blocks * inv).double() * scale).reshape(x.shape), scale.reshape(x.shape)


def assert_float32_matmul(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """A float32 matmul's result against float64 x @ W^T (+ bias), the module docstring's rule."""
    w = weight.double()
    slack = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    error = (out.double() - (x.double() @ w.T + (0 if bias is None else bias.double()))).abs()
    assert out.shape == error.shape and (error <= slack).all(), \
        f"off x @ W^T by {(error - slack).max().item():.3g} past float32 accumulation"


def assert_rounded_matmul(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          levels: int = 127):
    """An integer kernel's result (x rounded to `levels` per block) against both rules of the module docstring."""
    x_rounded, scale = rounded(x, levels)
    w = weight.double()
    b = 0 if bias is None else bias.double()
    slack = 1e-5 * (x_rounded.abs() @ w.abs().T) + 1e-6
    tight = (out.double() - (x_rounded @ w.T + b)).abs()
    assert (tight <= slack).all(), f"off the rounded-x reference by {(tight - slack).max().item():.3g} past the slack"
    loose = (out.double() - (x.double() @ w.T + b)).abs()
    bound = 0.5 * (scale @ w.abs().T) + slack
    assert (loose <= bound).all(), f"off x @ W^T by {(loose - bound).max().item():.3g} past the rounding bound"


def quantized(rows: int, cols: int, format: str, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Raw GGUF blocks of a random matrix, and the float32 weights gguf dequantises them to."""
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[format])
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format]).copy())


def layer_over(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor, format: str,
               **kwargs) -> QuantizedLinear:
    """A QuantizedLinear of `weight`'s shape over `packed` (the weight's values are not kept)."""
    return QuantizedLinear(packed, format, weight.shape[0], weight.shape[1], bias, **kwargs)


def assert_layer_matmul(layer: QuantizedLinear, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None):
    """`layer`'s output against the rule of its activations (module docstring)."""
    if layer.activations in LEVELS:
        assert_rounded_matmul(out, x, weight, bias, LEVELS[layer.activations])
    else:
        assert_float32_matmul(out, x, weight, bias)


@pytest.mark.parametrize("activations", ["int8", "int16", "float32"])
@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 13, 64])  # 13: the last group of four is padded
def test_blocks_give_the_dequantised_matmul(format, rows, activations):
    raw, weight = quantized(rows, 96, format)
    bias = torch.randn(rows)
    # The rows the blocks serve (up to max_rows; int8: every row count, 300 crossing the kernel's
    # row tiles of 128) come from the kernel, more from the tiled GEMM (int16: on x rounded as the
    # kernel rounds it); both give the dequantised matmul, and the layer holds no float32 weight.
    layer = layer_over(weight, bias, pack_blocks(raw, format), format, activations=activations)
    assert layer.max_rows == MAX_ROWS[activations, ops.simd_lanes()]
    assert [p.dtype for p in layer.parameters()] == [torch.float32] and layer.bias.shape == (rows,)
    assert torch.equal(layer.weight, weight)  # the blocks' values, dequantised exactly
    served = (1, 2, 3, 4, 5, 7, 64, 300) if layer.max_rows == EVERY_ROW else (1, 2, 3, 4, 5, 7, layer.max_rows)
    for m in served:
        x = torch.randn(m, 96)
        assert_layer_matmul(layer, layer(x), x, weight, bias)
    if layer.max_rows < EVERY_ROW:
        x = torch.randn(layer.max_rows + 1, 96)
        layer.kernel = None  # past max_rows the kernel is not called
        assert_layer_matmul(layer, layer(x), x, weight, bias)


def test_the_isa_switch_gives_every_caller_the_avx2_build(monkeypatch):
    """BLOCKSERVE_NATIVE_ISA=avx2: the engine's kernels are the -mno-avx512f build, so its MAX_ROWS
    and code are a Zen 3's (how benchmarks/peers measure that path on an AVX-512 machine)."""
    avx2 = quantized_matmul_ops(without_avx512=True)
    if avx2 is None or avx2.simd_lanes() != 8:
        pytest.skip("no AVX2 build here")
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert quantized_matmul_ops() is avx2 and fused_ops() is avx2
    raw, weight = quantized(8, 64, "Q4_1")
    assert layer_over(weight, None, pack_blocks(raw, "Q4_1"), "Q4_1").max_rows == MAX_ROWS["float32", 8]
    monkeypatch.setenv(ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="choose native or avx2"):
        quantized_matmul_ops()


def test_decode_attention_splits_on_the_pool_up_to_the_float32_block_rows():
    """csrc/paged_decode.cpp's kPoolSeqs and MAX_ROWS["float32", lanes] are one number per build: a
    decode step the blocks serve (one native call, the DecodeStack) runs its attention on the pool too."""
    avx2 = quantized_matmul_ops(without_avx512=True)
    for build in (ops, *([avx2] if avx2 is not None and avx2.simd_lanes() else [])):
        assert build.pool_sequences() == MAX_ROWS["float32", build.simd_lanes()]


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
def test_integer_rows_get_the_same_bits_alone_or_in_a_batch(format, activations):
    """The integer kernels serve every row count up to max_rows (int8: all, row tiles included) and
    each output is the same arithmetic whatever shares the call: a row alone and in a batch of 300
    (int16: max_rows) get the same bits (a request's tokens do not depend on what shares its steps).
    Where the kernel cannot run (here: a 3-D x), the float32 layer takes x rounded as the kernel rounds it."""
    raw, weight = quantized(13, 96, format, seed=3)
    bias = torch.randn(13)
    layer = layer_over(weight, bias, pack_blocks(raw, format), format, activations=activations)
    rows = min(300, layer.max_rows)
    x = torch.randn(rows, 96)
    x[1, :32] = 0  # a zero block
    batched = layer(x)
    assert torch.equal(batched, torch.cat([layer(row[None]) for row in x]))
    assert torch.equal(batched[30:60], layer(x[30:60]))
    assert_layer_matmul(layer, batched, x, weight, bias)
    assert_layer_matmul(layer, layer(x[None]).reshape(rows, 13), x, weight, bias)
    assert layer(torch.full((rows, 96), float("nan"))).isnan().all()


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_round_per_block_is_the_kernels_rounding_to_the_bit(activations):
    """round_per_block (the float32 path where an integer kernel cannot run) rounds x exactly as the
    kernel does, ties included. The weight is Q8_0's identity (d = 2^-6, q = 64: w = 1 exactly), so
    the kernel's output is its rounded x, s * r in one float32 rounding; x sits at the rounding ties
    (r + 1/2) * s, where a second rounding in L / max|x_b| moves a level."""
    k = 256
    raw = np.zeros((k, k // 32, 34), np.uint8)
    raw[:, :, 0:2] = np.float16(2.0 ** -6).reshape(1, 1, 1).view(np.uint8)
    raw[np.arange(k), np.arange(k) // 32, 2 + np.arange(k) % 32] = 64
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(64, k, generator=generator).reshape(64, -1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    top = LEVELS[activations]
    levels = torch.randint(-top, top, x.shape, generator=generator).float()
    x = torch.where(x.abs() == amax, x, (levels + 0.5) * (amax / top)).reshape(64, k)
    layer = layer_over(torch.eye(k), None, pack_blocks(raw.reshape(k, -1), "Q8_0"), "Q8_0",
                            activations=activations)
    assert torch.equal(layer.kernel(x, layer.packed, k, False), round_per_block(x, top))


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_avx2_path_gives_the_dequantised_matmul(format):
    """The kernels as a CPU without AVX-512 gets them (compiled here with -mno-avx512f). Float32
    passes of 1-5 rows of x apply a block's scale to its dot product, passes of 6-8 to the weights
    (csrc/quantized_matmul.cpp's kPrescaleRows): 14 rows run one pass of each kind."""
    avx2 = quantized_matmul_ops(without_avx512=True)
    if avx2 is None or avx2.simd_lanes() != 8:
        pytest.skip("no AVX2 build here")
    raw, weight = quantized(13, 96, format)
    packed = pack_blocks(raw, format)
    for m in (1, 2, 3, 5, 6, 7, 8, 9, 10, 14, 61):
        x = torch.randn(m, 96)
        assert_float32_matmul(avx2.quantized_matmul(x, packed, 13, format != "Q8_0"), x, weight)
        assert_rounded_matmul(avx2.quantized_matmul_int8(x, packed, 13, format != "Q8_0"), x, weight)
        assert_rounded_matmul(avx2.quantized_matmul_int16(x, packed, 13, format != "Q8_0"), x, weight, levels=32767)


@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
def test_avx2_float32_rows_get_the_same_bits_in_passes_of_alike_arithmetic(format):
    """On AVX2, passes of 1-2 rows of x take a group's four output rows together and passes of 3-5
    one output row at a time. Q8_0: the same arithmetic per output in both, so a row gets the same
    bits in passes of 1 to 5. Q4_1: passes of 1-2 rows multiply x in another form (the kernel's
    mixed_halves), so a row gets the same bits in passes of 1 and 2 (alone, with one other row, or
    after a pass of 8) and in passes of 3 to 5. From 6 rows the scale moves onto the weights."""
    avx2 = quantized_matmul_ops(without_avx512=True)
    if avx2 is None or avx2.simd_lanes() != 8:
        pytest.skip("no AVX2 build here")
    q4_1 = format != "Q8_0"
    raw, weight = quantized(37, 192, format, seed=7)
    packed = pack_blocks(raw, format)
    x = torch.randn(10, 192)
    five = avx2.quantized_matmul(x[:5], packed, 37, q4_1)
    two = avx2.quantized_matmul(x[:2], packed, 37, q4_1)
    for m in range(1, 5):
        alike = two if q4_1 and m <= 2 else five
        assert torch.equal(avx2.quantized_matmul(x[:m], packed, 37, q4_1), alike[:m])
    after_eight = avx2.quantized_matmul(x, packed, 37, q4_1)[8:]
    assert torch.equal(after_eight, avx2.quantized_matmul(x[8:], packed, 37, q4_1))
    for out, rows in ((five, x[:5]), (two, x[:2]), (after_eight, x[8:])):
        assert_float32_matmul(out, rows, weight)


@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_features", [37, 39])  # the last group: one live output row, three
def test_avx512_float32_rows_get_the_same_bits_in_passes_of_any_size(format, out_features):
    """On AVX-512, passes of 1-4 rows of x take a group's four output rows together and passes of
    5-8 (a verification's k + 1 rows) two output rows at a time, with each output's arithmetic in
    the same order: every row gets the same bits alone and in a call of 1 to 17 rows (passes of
    8, then the remainder), whichever output rows of the padded last group are live."""
    if ops is None or ops.simd_lanes() != 16:
        pytest.skip("no AVX-512 build here")
    q4_1 = format != "Q8_0"
    raw, weight = quantized(out_features, 192, format, seed=11)
    packed = pack_blocks(raw, format)
    x = torch.randn(17, 192)
    alone = torch.cat([ops.quantized_matmul(row[None], packed, out_features, q4_1) for row in x])
    for m in range(2, 18):
        assert torch.equal(ops.quantized_matmul(x[:m], packed, out_features, q4_1), alone[:m]), m
    assert torch.equal(ops.quantized_matmul(x[3:9], packed, out_features, q4_1), alone[3:9])
    assert_float32_matmul(alone, x, weight)


def integer_kernel(build, activations: str):
    return {"int8": build.quantized_matmul_int8, "int16": build.quantized_matmul_int16}[activations]


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
def test_integer_rows_at_every_remainder_and_thread_count(format, activations):
    """Rows 1..64 (every remainder of the kernel's passes of four or eight rows), several blocks per row,
    blocks of x that are all zero, tiny or huge, and the same bits at 1 and 2 threads."""
    kernel = integer_kernel(ops, activations)
    raw, weight = quantized(37, 192, format, seed=5)
    packed = pack_blocks(raw, format)
    x = torch.randn(64, 192)
    x[3, 32:64] = 0  # a zero block: scale 0
    x[5, :32] *= 1e-30
    x[6, 64:96] *= 1e20
    x[7, 100] = 1e3  # one outlier in its block
    with torch_threads(1):
        one = [kernel(x[:m], packed, 37, format != "Q8_0") for m in range(1, 65)]
    with torch_threads(2):
        two = kernel(x, packed, 37, format != "Q8_0")
    for m, out in enumerate(one, 1):
        assert out.shape == (m, 37) and torch.equal(out, one[-1][:m])
    assert torch.equal(two, one[-1])
    assert_rounded_matmul(one[-1], x, weight, levels=LEVELS[activations])
    assert kernel(torch.zeros(0, 192), packed, 37, format != "Q8_0").shape == (0, 37)


def test_the_kernels_split_across_threads_to_the_same_bits():
    """4096 x 2304 (1024 row groups of 72 blocks): many tasks per call even at one row (a task is
    2048 group-block-rows for float32, 4096 for the integer kernels; the split does not depend on the
    format), so the kernels split over two threads, and each output is computed by one thread whatever the
    split: the same bits."""
    raw, weight = quantized(4096, 2304, "Q4_1", seed=2)
    packed = pack_blocks(raw, "Q4_1")
    for rows in (1, 16):
        x = torch.randn(rows, 2304, generator=torch.Generator().manual_seed(rows))
        results = []
        for n in (1, 2):
            with torch_threads(n):
                results.append([kernel(x, packed, 4096, True) for kernel in
                                (ops.quantized_matmul, ops.quantized_matmul_int8, ops.quantized_matmul_int16)])
        (float_one, *integer_one), (float_two, *integer_two) = results
        assert torch.equal(float_two, float_one) and all(map(torch.equal, integer_two, integer_one))
        assert_float32_matmul(float_one, x, weight)


def test_a_forked_child_splits_on_workers_of_its_own():
    """fork() copies only the calling thread: the pool's workers are gone in the child. Its first
    split at a new thread count (which resizes the pool) must start fresh workers and give the
    parent's bits, not wait forever to join workers that do not exist."""
    raw, _ = quantized(1024, 2304, "Q4_1", seed=3)
    packed = pack_blocks(raw, "Q4_1")
    x = torch.randn(1, 2304, generator=torch.Generator().manual_seed(3))
    with torch_threads(2):
        expected = ops.quantized_matmul(x, packed, 1024, True)  # the pool now has a worker
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return into pytest
            try:
                torch.set_num_threads(3)
                os._exit(0 if torch.equal(ops.quantized_matmul(x, packed, 1024, True), expected) else 1)
            finally:
                os._exit(2)
    deadline = time.monotonic() + 60
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if waited == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the task pool")
    assert os.waitstatus_to_exitcode(waited[1]) == 0, "the forked child's matmul differed from the parent's"


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
def test_integer_non_finite_rows_stay_non_finite(format, activations):
    """A NaN or an infinity in a row of x makes that row's outputs NaN or infinite (as x @ W^T), never a
    finite value; the other rows are untouched."""
    raw, weight = quantized(8, 64, format)
    x = torch.randn(4, 64)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    out = integer_kernel(ops, activations)(x, pack_blocks(raw, format), 8, format != "Q8_0")
    assert out[1].isnan().all() and not out[2].isfinite().any()
    assert_rounded_matmul(out[[0, 3]], x[[0, 3]], weight, levels=LEVELS[activations])


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_integer_q8_0_weights_at_the_ends_of_their_range(activations):
    """Q8_0 levels -128 and 127 against x levels -L and L: the integer products stay exact."""
    raw = np.zeros((4, 34), np.uint8)
    raw[:, 0:2] = np.full((4, 1), np.float16(0.5)).view(np.uint8)
    raw[:, 2:] = np.array([[-128] * 32, [127] * 32, [-128, 127] * 16, [127, -128] * 16], np.int8).view(np.uint8)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy())
    x = torch.tensor([[1.0, -1.0] * 16, [-1.0] * 32, [1.0] * 32])
    out = integer_kernel(ops, activations)(x, pack_blocks(raw, "Q8_0"), 4, False)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=0, atol=1e-4)


def test_activations_default_to_float32_and_unknown_ones_are_refused():
    raw, weight = quantized(8, 64, "Q4_1")
    packed = pack_blocks(raw, "Q4_1")
    layer = layer_over(weight, None, packed, "Q4_1")
    assert layer.activations == "float32" and layer.kernel is ops.quantized_matmul
    assert layer.max_rows == MAX_ROWS["float32", ops.simd_lanes()]
    layer = layer_over(weight, None, packed, "Q4_1", activations="int8")
    assert layer.activations == "int8" and layer.kernel is ops.quantized_matmul_int8 and layer.max_rows == EVERY_ROW
    layer = layer_over(weight, None, packed, "Q4_1", activations="int16")
    assert layer.kernel is ops.quantized_matmul_int16 and layer.max_rows == MAX_ROWS["float32", ops.simd_lanes()]
    with pytest.raises(ValueError, match="activations must be one of"):
        layer_over(weight, None, packed, "Q4_1", activations="int4")
    # EngineConfig's choices and default (torch-free) are the kernel's
    assert ACTIVATIONS == QUANTIZED_ACTIVATIONS and DEFAULT_ACTIVATIONS == DEFAULT_QUANTIZED_ACTIVATIONS
    assert EngineConfig().quantized_activations == DEFAULT_ACTIVATIONS
    with pytest.raises(ValueError, match="unknown quantized_activations 'int4'"):
        EngineConfig(quantized_activations="int4")


@pytest.mark.parametrize("activations", ["int8", "int16", "float32"])
def test_non_contiguous_rows(activations):
    raw, weight = quantized(8, 64, "Q4_1")
    layer = layer_over(weight, None, pack_blocks(raw, "Q4_1"), "Q4_1", activations=activations)
    x = torch.randn(3, 128)[:, ::2]
    assert_layer_matmul(layer, layer(x), x, weight)


def test_blocks_that_do_not_fit_the_weight_are_refused():
    raw, weight = quantized(8, 64, "Q8_0")
    with pytest.raises(ValueError, match="do not fit a 8 x 96 weight"):
        layer_over(torch.zeros(8, 96), None, pack_blocks(raw, "Q8_0"), "Q8_0")
    with pytest.raises(RuntimeError, match="bytes"):
        ops.quantized_matmul(torch.randn(1, 64), pack_blocks(raw, "Q8_0")[:-1].contiguous(), 8, False)
    for kernel in (ops.quantized_matmul_int8, ops.quantized_matmul_int16):
        with pytest.raises(RuntimeError, match="bytes"):
            kernel(torch.randn(1, 64), pack_blocks(raw, "Q8_0")[:-1].contiguous(), 8, False)
        with pytest.raises(RuntimeError, match="multiple of 32"):
            kernel(torch.randn(1, 48), pack_blocks(raw, "Q8_0"), 8, False)


class TwoLayer(nn.Module):
    """Fused q/k/v (as the Llama family) next to a plain projection, to attach blocks by name."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Linear(64, 24, bias=False)
        self.self_attn.o_proj = nn.Linear(64, 8, bias=False)


def test_fused_parts_concatenate_in_order_and_mixed_formats_stay_float32():
    model = TwoLayer()
    parts = {name: quantized(8, 64, "Q4_1", seed) for seed, name in enumerate("qkv")}
    model.self_attn.qkv_proj.weight.data = torch.cat([parts[n][1] for n in "qkv"])
    o_raw, o_weight = quantized(8, 64, "Q8_0", seed=3)
    model.self_attn.o_proj.weight.data = o_weight
    blocks = [(f"self_attn.{n}_proj.weight", "Q4_1", parts[n][0]) for n in "kqv"]  # any arrival order
    blocks.append(("self_attn.o_proj.weight", "Q8_0", o_raw))
    assert use_quantized_linears(model, blocks) == {f"self_attn.{n}_proj.weight" for n in "qkvo"}
    x = torch.randn(2, 64)
    assert isinstance(model.self_attn.qkv_proj, QuantizedLinear)
    assert_float32_matmul(model.self_attn.qkv_proj(x), x, torch.cat([parts[n][1] for n in "qkv"]))
    assert_float32_matmul(model.self_attn.o_proj(x), x, o_weight)

    mixed = TwoLayer()
    v_raw, _ = quantized(8, 64, "Q8_0")
    blocks = [(f"self_attn.{n}_proj.weight", "Q4_1", parts[n][0]) for n in "qk"]
    blocks.append(("self_attn.v_proj.weight", "Q8_0", v_raw))
    assert use_quantized_linears(mixed, blocks) == set()
    assert type(mixed.self_attn.qkv_proj) is nn.Linear


def test_panel_linear_is_the_same_linear():
    """A wide layer stored as column panels (the last one narrower) gives F.linear over its
    weight at any row count and input shape."""
    weight, bias = torch.randn(2 * PANEL_COLUMNS + 64, 96), torch.randn(2 * PANEL_COLUMNS + 64)
    panels = PanelLinear(weight, bias)
    assert [p.shape[1] for p in panels.panels] == [768, 768, 64]
    torch.testing.assert_close(panels.weight, weight, rtol=0, atol=0)
    for shape in ((1, 96), (40, 96), (2, 3, 96)):
        x = torch.randn(shape)
        assert_float32_matmul(panels(x).reshape(-1, weight.shape[0]), x.reshape(-1, 96), weight, bias)


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_tiles_dequantiser_gives_gguf_py_bits_at_extreme_scales(format):
    """quantized_dequantize (the prefill tiles' source; AVX-512 looks the 16 values d * q + m up per
    lane, AVX2 widens a vector of levels) equals gguf-py's dequantisation on random blocks whose
    scales and mins are the largest finite float16, zero, negative or subnormal, on either build,
    for rows off a group of four: bit for bit, but for Q4_0's zeros at a zero scale (packed as
    d * q + m with m = -8 d they come out +0 where gguf-py's d * (q - 8) gives -0: equal values)."""
    from tests.models.test_gguf_block_linear import random_blocks

    extremes = np.array([65504.0, 0.0, -65504.0, -1.5e-3, 6e-8, 0.25])
    raw = random_blocks(format, 11, 96, np.random.default_rng(7), extremes)
    weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format])
    packed = pack_blocks(raw, format)
    avx2 = quantized_matmul_ops(without_avx512=True)
    for build in (ops, *([avx2] if avx2 is not None and avx2.simd_lanes() else [])):
        for start, rows in ((0, 11), (4, 7), (8, 1)):
            ours = build.quantized_dequantize(packed, 11, 96, format != "Q8_0", start, rows).numpy()
            want = weight[start:start + rows]
            if format == "Q4_0":
                ours, want = ours + 0.0, want + 0.0  # -0 and +0 alike (x + 0.0 turns -0 into +0)
            assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q8_0"])
def test_many_rows_run_on_tiles_dequantised_from_the_blocks(format, monkeypatch):
    """Past max_rows a layer wider than one tile dequantises a tile of rows at a time (the last one
    shorter, rows not a multiple of four) into the GEMM: the float32 matmul of the weights, with
    no float32 weight resident; row ranges off a group of four are refused."""
    raw, weight = quantized(16 * 3 + 14, 64, format)
    layer = layer_over(weight, None, pack_blocks(raw, format), format, max_rows=2)
    monkeypatch.setattr(tiled_gemm, "TILE_VALUES", 23 * 64)  # tiles of 16 rows (ROW_STEP): 4 tiles, the last 14 rows
    tiles = []
    dequantize = layer.dequantize
    monkeypatch.setattr(layer, "dequantize", lambda start=0, rows=None: tiles.append((start, rows)) or
                        dequantize(start, rows))
    x = torch.randn(9, 64)
    assert_float32_matmul(layer(x), x, weight)
    assert tiles == [(0, 16), (16, 16), (32, 16), (48, 14)]
    assert layer.packed.numel() < weight.numel() * 2 and not list(layer.parameters())  # 1.2 bytes a weight at most
    for start, rows in ((2, 4), (0, 63), (-4, 4)):
        with pytest.raises(RuntimeError, match="rows"):
            dequantize(start, rows)
    avx2 = quantized_matmul_ops(without_avx512=True)
    for build in (ops, *([avx2] if avx2 is not None and avx2.simd_lanes() else [])):  # exact in either build
        assert torch.equal(build.quantized_dequantize(layer.packed, 62, 64, format != "Q8_0", 8, 54), weight[8:])
