"""The routed experts' three routes (models/moe.py) compute the same thing: the loop over the
experts some token picked, the sync-free grouped route (sorted by expert, torch._grouped_mm)
that runs off the CPU, and the native kernel (csrc/moe_experts.cpp) the CPU takes in float32.
Equal within rounding, in float32 and bfloat16, with experts no token picked and experts every
token picked."""

from __future__ import annotations

import pytest
import torch

from blockserve.models.moe import Experts, expert_ops

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the output's scale


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    module = Experts(num_experts, hidden, inter)
    module.gate_up_proj = torch.nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=gen).to(dtype) * 0.2)
    module.down_proj = torch.nn.Parameter(torch.randn(num_experts, hidden, inter, generator=gen).to(dtype) * 0.2)
    return module


def routed(module: Experts, route: str, x, weights, ids) -> torch.Tensor:
    module.route = route
    return module(x, weights, ids)


@pytest.mark.parametrize(("route", "dtype"), [("grouped", torch.float32), ("grouped", torch.bfloat16),
                                             pytest.param("native", torch.float32, marks=pytest.mark.skipif(
                                                 expert_ops() is None, reason="needs the native kernels"))])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_route_matches_the_loop(route, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    module = experts(8, 32, 16, dtype)
    x = torch.randn(tokens, 32, generator=gen).to(dtype)
    # experts 0-5 only (6 and 7 idle), each token's 2 distinct experts, float32 weights (as routers give)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    loop, grouped = routed(module, "loop", x, weights, ids), routed(module, route, x, weights, ids)
    assert grouped.dtype == loop.dtype == dtype and grouped.shape == loop.shape
    scale = loop.float().abs().max()
    assert (grouped.float() - loop.float()).abs().max() <= TOLERANCE[dtype] * scale


def test_every_token_on_one_expert():
    module = experts(4, 16, 8, torch.float32)
    x = torch.randn(5, 16)
    ids = torch.full((5, 1), 2)
    weights = torch.ones(5, 1)
    torch.testing.assert_close(routed(module, "grouped", x, weights, ids), routed(module, "loop", x, weights, ids))
    if expert_ops() is not None:
        torch.testing.assert_close(routed(module, "native", x, weights, ids), routed(module, "loop", x, weights, ids))


def test_route_is_chosen_by_device_and_checked():
    module = experts(2, 8, 4, torch.float32)
    x, weights, ids = torch.randn(3, 8), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long)
    assert module.route is None  # by device: on the CPU in float32 the native kernel where it is built
    assert module._route_for(x) == ("loop" if expert_ops() is None else "native")
    assert module._route_for(x.bfloat16()) == "loop"
    torch.testing.assert_close(module(x, weights, ids), routed(module, "loop", x, weights, ids))
    with pytest.raises(ValueError, match="unknown expert route 'fast'"):
        routed(module, "fast", x, weights, ids)
