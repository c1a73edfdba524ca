"""csrc/moe_experts.cpp against the Python loop over the experts (moe.Experts, route "loop") in
float64, in both builds (-march=native and the AVX2 one): float32 experts with every expert at
decode size (the one-job path) and with some past kMaxRows tokens (the GEMM path); experts in GGUF
blocks (Q4_K, Q6_K, Q8_0: gguf_matmul at 2 to ~75 tokens an expert) against their dequantised values;
GPT-OSS's experts (biases, clamped SwiGLU), MXFP4, float32 or in GGUF blocks, against its loop over
the (dequantised) weights. Also: an expert id out of range is refused, and no pairs give zeros.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from blockserve.models.gpt_oss import GptOssExperts, gpt_oss_expert_ops
from blockserve.models.moe import Experts
from blockserve.models.mxfp4 import dequantize_mxfp4
from tests.models.mxfp4_encoder import encode_mxfp4
from tests.models.test_gguf_block_linear import BUILDS, random_blocks

pytestmark = pytest.mark.skipif(any(ops is None or not hasattr(ops, "moe_experts") for ops in BUILDS.values()),
                                reason="the expert kernels need the native extension")

E, K = 8, 2


def _routing(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=gen).topk(K, dim=-1).indices
    weights = torch.rand(tokens, K, generator=gen)
    return weights / weights.sum(-1, keepdim=True), ids


def _reference(x, weights, ids, gate_up, down) -> torch.Tensor:
    experts = Experts(gate_up.shape[0], x.shape[1], down.shape[2]).double()
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    experts.route = "loop"
    with torch.no_grad():
        return experts(x.double(), weights.double(), ids)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens", [0, 1, 5, 40])  # 40 tokens: some experts past kMaxRows (the GEMM path)
def test_float32_experts_match_the_loop(build, tokens):
    gen = torch.Generator().manual_seed(tokens)
    H, I = 64, 48
    x = torch.randn(tokens, H, generator=gen)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / 8
    down = torch.randn(E, H, I, generator=gen) / 7
    weights, ids = _routing(tokens, E, tokens)
    out = BUILDS[build].moe_experts(x, weights, ids, gate_up, down)
    want = _reference(x, weights, ids, gate_up, down)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    if tokens == 40:
        assert ids.flatten().bincount(minlength=E).max() > 8  # the GEMM path ran


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens", [3, 40, 300])  # 2..75 tokens an expert: gguf_matmul's tiles at every size
def test_block_experts_match_their_dequantised_values(build, tokens):
    rng = np.random.default_rng(tokens)
    H, I = 256, 256
    formats = {"gate": "Q4_K", "up": "Q6_K", "down": "Q8_0"}
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    raw = {p: np.stack([random_blocks(formats[p], *shapes[p], rng) for _ in range(E)]) for p in formats}
    dense = {p: torch.from_numpy(np.stack([gguf.quants.dequantize(r, gguf.GGMLQuantizationType[formats[p]])
                                           for r in raw[p]])) for p in formats}
    x = torch.from_numpy(rng.standard_normal((tokens, H)).astype(np.float32))
    weights, ids = _routing(tokens, E, tokens)
    out = BUILDS[build].moe_experts_blocks(x, weights, ids, *(a for p in formats for a in (
        torch.from_numpy(raw[p]), formats[p])), I, "float32")
    want = _reference(x, weights, ids, torch.cat([dense["gate"], dense["up"]], dim=1), dense["down"])
    torch.testing.assert_close(out.double(), want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
    counts = ids.flatten().bincount(minlength=E)
    assert counts.max() > {3: 0, 40: 8, 300: 64}[tokens]  # past decode size, and past 64 rows


def test_an_expert_id_out_of_range_is_refused():
    ops = BUILDS["native"]
    x, weights = torch.randn(2, 8), torch.ones(2, K)
    with pytest.raises(RuntimeError, match="expert id 8 out of range"):
        ops.moe_experts(x, weights, torch.tensor([[0, 8], [1, 2]]), torch.randn(E, 8, 8), torch.randn(E, 8, 4))


def _gpt_oss_reference(x, weights, ids, gate_up, gate_up_bias, down, down_bias, alpha, limit) -> torch.Tensor:
    """GptOssExperts' loop in float64 over the dequantised weights (gate_up [E, 2I, H], down [E, H, I])."""
    experts = GptOssExperts(gate_up.shape[0], x.shape[1], down.shape[2], alpha, limit).double()
    experts.gate_up_proj.data.copy_(gate_up.transpose(1, 2))
    experts.down_proj.data.copy_(down.transpose(1, 2))
    experts.gate_up_proj_bias.data.copy_(gate_up_bias)
    experts.down_proj_bias.data.copy_(down_bias)
    with torch.no_grad():
        return experts(x.double(), weights.double(), ids)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens", [0, 3, 40])  # 40 tokens over 4 experts: some take mxfp4_matmul's GEMM
def test_gpt_oss_mxfp4_experts_match_the_loop(build, tokens):
    """moe_experts_mxfp4: biases, interleaved gate|up and the clamped SwiGLU (a limit the values cross
    on both sides), against the loop over the dequantised weights."""
    experts, H, I, alpha, limit = 4, 64, 32, 1.702, 1.5
    rng = np.random.default_rng(tokens)
    blocks = {}
    for name, shape in (("gate_up", (experts, 2 * I, H)), ("down", (experts, H, I))):
        blocks[name] = tuple(torch.from_numpy(a) for a in encode_mxfp4(rng.standard_normal(shape) / 4))
    dense = {name: dequantize_mxfp4(*pair) for name, pair in blocks.items()}
    gate_up_bias = torch.from_numpy(rng.standard_normal((experts, 2 * I)).astype(np.float32))
    down_bias = torch.from_numpy(rng.standard_normal((experts, H)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((tokens, H)).astype(np.float32))
    weights, ids = _routing(tokens, experts, tokens)
    out = BUILDS[build].moe_experts_mxfp4(x, weights, ids, *blocks["gate_up"], gate_up_bias, *blocks["down"],
                                           down_bias, alpha, limit)
    want = _gpt_oss_reference(x, weights, ids, dense["gate_up"], gate_up_bias, dense["down"], down_bias, alpha, limit)
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(out.double(), want, atol=1e-5 * max(1.0, scale), rtol=1e-5)
    if tokens:
        gate_up = x @ dense["gate_up"][0].T + gate_up_bias[0]
        assert (gate_up[:, 0::2] > limit).any() and (gate_up[:, 1::2] < -limit).any()  # the clamps are live
    if tokens == 40:
        assert ids.flatten().bincount(minlength=experts).max() >= 16  # the GEMM path ran


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens", [0, 3, 40])
def test_gpt_oss_float32_experts_match_the_loop(build, tokens):
    """moe_experts_gpt_oss: the checkpoint's input-major float32 experts, biases, clamped SwiGLU."""
    experts, H, I, alpha, limit = 4, 64, 48, 1.702, 1.5
    gen = torch.Generator().manual_seed(tokens)
    gate_up, down = torch.randn(experts, H, 2 * I, generator=gen) / 4, torch.randn(experts, I, H, generator=gen) / 4
    gate_up_bias, down_bias = torch.randn(experts, 2 * I, generator=gen), torch.randn(experts, H, generator=gen)
    x = torch.randn(tokens, H, generator=gen)
    weights, ids = _routing(tokens, experts, tokens)
    out = BUILDS[build].moe_experts_gpt_oss(x, weights, ids, gate_up, gate_up_bias, down, down_bias, alpha, limit)
    want = _gpt_oss_reference(x, weights, ids, gate_up.transpose(1, 2), gate_up_bias, down.transpose(1, 2),
                              down_bias, alpha, limit)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    if tokens:
        gu = x @ gate_up[0] + gate_up_bias[0]
        assert (gu[:, 0::2] > limit).any() and (gu[:, 1::2] < -limit).any()  # the clamps are live


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens", [0, 3, 40, 150])  # up to ~75 tokens an expert
def test_gpt_oss_block_experts_match_the_loop(build, tokens):
    """moe_experts_blocks_gpt_oss: GGUF blocks (Q8_0 gate, Q4_K up, Q6_K down), the interleaved
    gate_up bias and the clamped SwiGLU, against the loop over the dequantised weights."""
    experts, H, I, alpha = 4, 256, 256, 1.702
    rng = np.random.default_rng(tokens)
    formats = {"gate": "Q8_0", "up": "Q4_K", "down": "Q6_K"}
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    raw = {p: np.stack([random_blocks(formats[p], *shapes[p], rng) for _ in range(experts)]) for p in formats}
    dense = {p: torch.from_numpy(np.stack([gguf.quants.dequantize(r, gguf.GGMLQuantizationType[formats[p]])
                                           for r in raw[p]])) for p in formats}
    gate_up = torch.stack((dense["gate"], dense["up"]), dim=2).reshape(experts, 2 * I, H)  # gate rows even
    x = torch.from_numpy(rng.standard_normal((tokens, H)).astype(np.float32))
    gate_up_bias = torch.from_numpy(rng.standard_normal((experts, 2 * I)).astype(np.float32)) / 8
    down_bias = torch.from_numpy(rng.standard_normal((experts, H)).astype(np.float32))
    probe = torch.from_numpy(rng.standard_normal((8, H)).astype(np.float32)) @ gate_up[0].T + gate_up_bias[0]
    limit = float(probe.abs().median())  # both clamps cut some values
    weights, ids = _routing(tokens, experts, tokens)
    out = BUILDS[build].moe_experts_blocks_gpt_oss(x, weights, ids, *(a for p in formats for a in (
        torch.from_numpy(raw[p]), formats[p])), gate_up_bias, down_bias, alpha, limit, "float32")
    want = _gpt_oss_reference(x, weights, ids, gate_up, gate_up_bias, dense["down"], down_bias, alpha, limit)
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(out.double(), want, atol=1e-5 * max(1.0, scale), rtol=1e-4)
    if tokens:
        gu = x @ gate_up[0].T + gate_up_bias[0]
        assert (gu[:, 0::2] > limit).any() and (gu[:, 1::2] < -limit).any()  # the clamps are live
    if tokens >= 40:
        assert ids.flatten().bincount(minlength=experts).max() > (8 if tokens == 40 else 64)  # many rows an expert


def test_gpt_oss_layers_run_the_native_experts(monkeypatch):
    """A GPT-OSS MXFP4 layer takes the native route by default: forcing the loop gives the same output."""
    gen = np.random.default_rng(1)
    layer = GptOssExperts(4, 64, 32, 1.702, 7.0, mxfp4=True)
    for name in ("gate_up_proj", "down_proj"):
        shape = (4, *getattr(layer, f"{name}_blocks").shape[1:3])
        b, s = encode_mxfp4(gen.standard_normal((*shape[:2], shape[2] * 32)) / 4)
        getattr(layer, f"{name}_blocks").data.copy_(torch.from_numpy(b))
        getattr(layer, f"{name}_scales").data.copy_(torch.from_numpy(s))
        getattr(layer, f"{name}_bias").data.normal_()
    x = torch.randn(5, 64)
    weights, ids = _routing(5, 4, 2)
    calls = []
    ops = gpt_oss_expert_ops()
    monkeypatch.setattr("blockserve.models.gpt_oss.gpt_oss_expert_ops",
                        lambda: type("Spy", (), {"moe_experts_mxfp4": lambda self, *a: calls.append(1) or
                                                 ops.moe_experts_mxfp4(*a)})())
    with torch.no_grad():
        native = layer(x, weights, ids)
        layer.route = "loop"
        loop = layer(x, weights, ids)
    assert calls == [1]
    torch.testing.assert_close(native, loop, atol=1e-5, rtol=1e-5)
