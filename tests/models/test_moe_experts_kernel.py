"""csrc/moe_experts.cpp against the Python loop over the experts (moe.Experts, route "loop") in
float64, in both builds (-march=native and the AVX2 one): float32 experts with every expert at
decode size (the one-job path) and with some past kMaxRows tokens (the GEMM path); experts in GGUF
blocks (Q4_K, Q6_K, Q8_0: the gguf_blocks.cpp entry points) against their dequantised values.
Also: an expert id out of range is refused, and no pairs give zeros.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from blockserve.models.moe import Experts
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
@pytest.mark.parametrize("tokens", [3, 40])
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
        torch.from_numpy(raw[p]), formats[p])), I)
    want = _reference(x, weights, ids, torch.cat([dense["gate"], dense["up"]], dim=1), dense["down"])
    torch.testing.assert_close(out.double(), want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


def test_an_expert_id_out_of_range_is_refused():
    ops = BUILDS["native"]
    x, weights = torch.randn(2, 8), torch.ones(2, K)
    with pytest.raises(RuntimeError, match="expert id 8 out of range"):
        ops.moe_experts(x, weights, torch.tensor([[0, 8], [1, 2]]), torch.randn(E, 8, 8), torch.randn(E, 8, 4))
