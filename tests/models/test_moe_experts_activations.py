"""csrc/moe_experts.cpp's GGUF block experts under --quantized-activations, in both builds (-march=native
and the AVX2 one), bit for bit against the dense layers' kernels run per expert:

    int8    each expert's gate and up = gguf_matmul_int8 of its tokens' rows, h = silu(gate) * up,
            down = gguf_matmul_int8 of h (what GGUFBlockLinear computes under int8), weighted and
            summed per token in expert-id order
    int16   the same with x and h rounded by round_per_block(·, 32767) and gguf_matmul_decode

silu as the kernel computes it, g / (1 + expf(-g)) * u in float32, with the C library's expf; the
routing weights are powers of two, so weight times output is exact and the sum's rounding is the
reference's whether or not the kernel fuses the multiply-add. Gate and up in formats of one weight
layout (x arranged once for both) and of two; 1 to ~20 tokens an expert (the int8 kernel's
1-4-row and tiled paths). GPT-OSS's experts (biases, clamped SwiGLU) likewise; an unknown
activations name is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
import torch

from blockserve.models.quantized_linear import round_per_block
from tests.models.test_gguf_block_linear import BUILDS, random_blocks

pytestmark = pytest.mark.skipif(any(ops is None or not hasattr(ops, "moe_experts_blocks") for ops in BUILDS.values()),
                                reason="the expert kernels need the native extension")

E, K, H, I = 8, 2, 512, 256
_expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
_expf.restype, _expf.argtypes = ctypes.c_float, (ctypes.c_float,)
expf = np.frompyfunc(lambda v: _expf(v), 1, 1)


def _exp(x: torch.Tensor) -> torch.Tensor:
    with np.errstate(over="ignore"):  # expf's inf past its range, as the kernel's
        return torch.from_numpy(expf(x.numpy()).astype(np.float32))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate / (1 + _exp(-gate)) * up


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, E, generator=gen).topk(K, dim=-1).indices
    weights = torch.tensor([0.5, 0.25]).repeat(tokens, 1)  # powers of two: weight * y exact
    return weights, ids


def _reference(ops, activations: str, x, weights, ids, raw, formats, act, down_bias=None) -> torch.Tensor:
    """Per expert (id order) the dense kernels on its tokens' rows (down's bias added where given), then
    the weighted sum per token."""
    matmul = ops.gguf_matmul_int8 if activations == "int8" else ops.gguf_matmul_decode
    rounded = (lambda t: round_per_block(t, 32767)) if activations == "int16" else (lambda t: t)
    out = torch.zeros_like(x)
    for e in range(E):
        tokens, slot = torch.where(ids == e)
        if not len(tokens):
            continue
        xe = rounded(x[tokens])
        gate = matmul(xe, torch.from_numpy(raw["gate"][e]), formats["gate"])
        up = matmul(xe, torch.from_numpy(raw["up"][e]), formats["up"])
        y = matmul(rounded(act(e, gate, up)), torch.from_numpy(raw["down"][e]), formats["down"])
        if down_bias is not None:
            y = y + down_bias[e]
        for row, (t, s) in enumerate(zip(tokens.tolist(), slot.tolist())):
            out[t] += weights[t, s] * y[row]
    return out


def _experts(formats: dict[str, str], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    return {p: np.stack([random_blocks(formats[p], *shapes[p], rng, rng.uniform(0.5, 1.5, 16) * 2e-3)
                         for _ in range(E)]) for p in formats}


def _blocks(raw, formats):
    return [a for p in ("gate", "up", "down") for a in (torch.from_numpy(raw[p]), formats[p])]


FORMATS = [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},   # gate and up share a layout (Q4_K_M's experts)
           {"gate": "Q8_0", "up": "Q5_K", "down": "Q4_0"}]   # two layouts; a 32-value down


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("formats", FORMATS, ids=["one-layout", "two-layouts"])
def test_block_experts_equal_the_dense_kernels_per_expert(build, activations, formats):
    ops = BUILDS[build]
    raw = _experts(formats, FORMATS.index(formats))
    for tokens in (1, 7, 80):  # 80 tokens: ~20 an expert
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)) * torch.logspace(-2, 2, H)
        weights, ids = _routing(tokens, tokens)
        out = ops.moe_experts_blocks(x, weights, ids, *_blocks(raw, formats), I, activations)
        want = _reference(ops, activations, x, weights, ids, raw, formats, lambda e, g, u: _silu_mul(g, u))
        assert torch.equal(out, want), (tokens, float((out - want).abs().max()))
        if activations == "int8":  # the integer path is not the float one
            assert not torch.equal(out, ops.moe_experts_blocks(x, weights, ids, *_blocks(raw, formats), I, "float32"))
    assert ids.flatten().bincount(minlength=E).max() > 4  # some expert past the 4-row fused path


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_gpt_oss_block_experts_honour_int8(build):
    ops, formats = BUILDS[build], {"gate": "Q8_0", "up": "Q4_K", "down": "Q6_K"}
    raw = _experts(formats, 3)
    alpha, limit, tokens = 1.702, 0.05, 24
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, H, generator=gen)
    gate_up_bias, down_bias = torch.randn(E, 2 * I, generator=gen) / 50, torch.randn(E, H, generator=gen)
    weights, ids = _routing(tokens, 9)

    def act(e, gate, up):
        g = torch.clamp(gate + gate_up_bias[e, 0::2], max=limit)
        u = torch.clamp(up + gate_up_bias[e, 1::2], -limit, limit)
        return (u + 1) * g / (1 + _exp(-alpha * g))

    out = ops.moe_experts_blocks_gpt_oss(x, weights, ids, *_blocks(raw, formats), gate_up_bias, down_bias,
                                         alpha, limit, "int8")
    want = _reference(ops, "int8", x, weights, ids, raw, formats, act, down_bias)
    assert torch.equal(out, want), float((out - want).abs().max())


def test_unknown_activations_are_refused():
    ops, formats = BUILDS["native"], FORMATS[0]
    raw = _experts(formats, 0)
    weights, ids = _routing(2, 0)
    with pytest.raises(RuntimeError, match="activations must be float32, int8 or int16, not int4"):
        ops.moe_experts_blocks(torch.randn(2, H), weights, ids, *_blocks(raw, formats), I, "int4")
