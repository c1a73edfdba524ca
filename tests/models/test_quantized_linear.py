"""QuantizedLinear: GGUF blocks packed for the native kernel give the matmul of the weights gguf's
own dequantiser produces, for the rows it handles; more rows go to the float32 copy."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.native import quantized_matmul_ops
from blockserve.models.quantized_linear import QuantizedLinear, pack_blocks, sharing_linear, use_quantized_linears
from blockserve.models.weight_layout import PANEL_COLUMNS, PANEL_MIN_OUT, PanelLinear

ops = quantized_matmul_ops()
pytestmark = pytest.mark.skipif(ops is None or not ops.simd_lanes(),
                                reason="the quantized kernel needs native kernels built with AVX-512 or AVX2")


def quantized(rows: int, cols: int, format: str, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Raw GGUF blocks of a random matrix, and the float32 weights gguf dequantises them to."""
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[format])
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[format]).copy())


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 13, 64])  # 13: the last group of four is padded
def test_blocks_give_the_dequantised_matmul(format, rows):
    raw, weight = quantized(rows, 96, format)
    bias = torch.randn(rows)
    # A decoy float32 copy: up to max_rows rows must come from the blocks, more from the copy.
    decoy = torch.zeros_like(weight)
    layer = QuantizedLinear(sharing_linear(decoy, bias), pack_blocks(raw, format), format)
    assert layer.max_rows >= 8
    for m in (1, 2, 3, 4, 5, 7, layer.max_rows):
        x = torch.randn(m, 96)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(layer.max_rows + 1, 96)
    assert torch.equal(layer(x), F.linear(x, decoy, bias))


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_avx2_path_gives_the_dequantised_matmul(format):
    """The kernel as a CPU without AVX-512 gets it (compiled here with -mno-avx512f)."""
    avx2 = quantized_matmul_ops(without_avx512=True)
    if avx2 is None or avx2.simd_lanes() != 8:
        pytest.skip("no AVX2 build here")
    raw, weight = quantized(13, 96, format)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, 96)
        torch.testing.assert_close(avx2.quantized_matmul(x, pack_blocks(raw, format), 13, format != "Q8_0"),
                                   F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_non_contiguous_rows():
    raw, weight = quantized(8, 64, "Q4_1")
    layer = QuantizedLinear(sharing_linear(weight), pack_blocks(raw, "Q4_1"), "Q4_1")
    x = torch.randn(3, 128)[:, ::2]
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_blocks_that_do_not_fit_the_weight_are_refused():
    raw, weight = quantized(8, 64, "Q8_0")
    with pytest.raises(ValueError, match="do not fit a 8 x 96 weight"):
        QuantizedLinear(sharing_linear(torch.zeros(8, 96)), pack_blocks(raw, "Q8_0"), "Q8_0")
    with pytest.raises(RuntimeError, match="bytes"):
        ops.quantized_matmul(torch.randn(1, 64), pack_blocks(raw, "Q8_0")[:-1].contiguous(), 8, False)


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
    assert use_quantized_linears(model, blocks) == 2
    x = torch.randn(2, 64)
    assert isinstance(model.self_attn.qkv_proj, QuantizedLinear)
    torch.testing.assert_close(model.self_attn.qkv_proj(x), F.linear(x, model.self_attn.qkv_proj.weight),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.self_attn.o_proj(x), F.linear(x, o_weight), rtol=1e-5, atol=1e-5)

    mixed = TwoLayer()
    v_raw, _ = quantized(8, 64, "Q8_0")
    blocks = [(f"self_attn.{n}_proj.weight", "Q4_1", parts[n][0]) for n in "qk"]
    blocks.append(("self_attn.v_proj.weight", "Q8_0", v_raw))
    assert use_quantized_linears(mixed, blocks) == 0
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
        torch.testing.assert_close(panels(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_wide_layers_with_blocks_run_larger_batches_on_panels():
    """A wide layer that gets blocks keeps its float32 copy as panels (above max_rows, where the
    panels are faster); a narrow one stays an nn.Linear."""
    wide_raw, wide = quantized(PANEL_MIN_OUT, 64, "Q8_0")
    narrow_raw, narrow = quantized(8, 64, "Q8_0", seed=1)
    model = TwoLayer()
    model.mlp = nn.Module()
    model.mlp.fc = nn.Linear(64, PANEL_MIN_OUT, bias=False)
    model.mlp.fc.weight.data = wide.clone()
    model.self_attn.o_proj.weight.data = narrow.clone()
    blocks = [("mlp.fc.weight", "Q8_0", wide_raw), ("self_attn.o_proj.weight", "Q8_0", narrow_raw)]
    assert use_quantized_linears(model, blocks) == 2
    assert isinstance(model.mlp.fc.dense, PanelLinear) and type(model.self_attn.o_proj.dense) is nn.Linear
    for layer, weight in ((model.mlp.fc, wide), (model.self_attn.o_proj, narrow)):
        for rows in (1, layer.max_rows + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
