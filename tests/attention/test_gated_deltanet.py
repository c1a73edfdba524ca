"""Gated DeltaNet: chunked form = recurrent form = transformers' torch fallback, and the layer
over state slots (decodes batched, prefill chunks continuing from the slot) = one full pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockserve.attention.context import ForwardContext, StateCache, StateMetadata
from blockserve.attention.gated_deltanet import (
    GatedDeltaNet,
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from blockserve.attention.metadata import BatchLayout
from tests.models.hybrid_helpers import one_torch_thread  # noqa: F401 (an autouse fixture)

H, DK, DV = 4, 16, 8


def random_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(length, H, DK, generator=gen)) * DK**-0.5
    k = l2norm(torch.randn(length, H, DK, generator=gen))
    v = torch.randn(length, H, DV, generator=gen)
    g = -F.softplus(torch.randn(length, H, generator=gen))  # log decay <= 0
    beta = torch.rand(length, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen) * 0.5
    return q, k, v, g, beta, state


def recurrent(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[0]):
        o, state = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                              state[None] if state.dim() == 3 else state)
        outs.append(o)
    return torch.cat(outs), state[0]


@pytest.mark.parametrize("length,chunk", [(1, 64), (7, 4), (64, 64), (70, 16), (130, 64)])
def test_chunked_equals_recurrent(length, chunk):
    q, k, v, g, beta, state = random_inputs(length)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk)
    out_r, state_r = recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out_c, out_r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state_c, state_r, atol=2e-5, rtol=1e-4)


def test_matches_transformers_fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    length = 45
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 1, length, H // 2, DK, generator=gen)  # two key heads, four value heads
    v = torch.randn(1, length, H, DV, generator=gen)
    g = -F.softplus(torch.randn(1, length, H, generator=gen))
    beta = torch.rand(1, length, H, generator=gen)
    state = torch.randn(1, H, DK, DV, generator=gen)
    expected, expected_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=16, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = l2norm(q[0]).repeat_interleave(2, dim=1) * DK**-0.5
    kn = l2norm(k[0]).repeat_interleave(2, dim=1)
    out, final = chunk_gated_delta_rule(qn, kn, v[0], g[0], beta[0], state[0], 16)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_state[0], atol=1e-5, rtol=1e-5)
    step, step_state = hf.torch_recurrent_gated_delta_rule(
        q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    mine, mine_state = recurrent_gated_delta_rule(qn[:1], kn[:1], v[0, :1], g[0, :1], beta[0, :1], state)
    torch.testing.assert_close(mine, step[:, 0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mine_state, step_state, atol=1e-6, rtol=1e-5)


def test_conv_continues_from_its_state():
    gen = torch.Generator().manual_seed(1)
    channels, width, length = 6, 4, 11
    x = torch.randn(length, channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    full = F.conv1d(x.T[None], weight[:, None], bias, padding=width - 1, groups=channels)[0, :, :length].T
    state = torch.zeros(channels, width - 1)
    y1, state = causal_conv1d(x[:2], state, weight, bias)  # shorter than the kernel
    y2, state = causal_conv1d(x[2:8], state, weight, bias)
    steps = []
    for t in range(8, length):
        y, s = causal_conv1d_step(x[t:t + 1], state[None], weight, bias)
        steps.append(y)
        state = s[0]
    torch.testing.assert_close(torch.cat([y1, y2, *steps]), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, x[-(width - 1):].T)


def run_layer(layer, mixed, g, beta, weight, schedule, num_slots=8):
    """Drive `layer` through steps of (seq, tokens) pairs; each sequence has its own slot."""
    shapes = layer.state_shapes
    cache = StateCache(0, [torch.zeros(num_slots, *shapes[0]), torch.zeros(num_slots, *shapes[1])])
    done = {i: 0 for i in range(len(mixed))}
    outs = {i: [] for i in range(len(mixed))}
    slot_of = {i: num_slots - 1 - i for i in range(len(mixed))}  # scattered, never the null slot 0
    for step in schedule:
        step = sorted(step, key=lambda item: item[1] != 1)  # decodes first
        layout = BatchLayout.build([n for _, n in step], [done[i] for i, _ in step])
        pick = lambda t: torch.cat([t[i][done[i]:done[i] + n] for i, n in step])  # noqa: E731
        ctx = ForwardContext({"l": cache}, [StateMetadata(layout, torch.tensor([slot_of[i] for i, _ in step]))])
        out = layer(pick(mixed), pick(g), pick(beta), weight, None, ctx)
        for j, (i, n) in enumerate(step):
            outs[i].append(out[layout.query_start[j]:layout.query_start[j + 1]])
            done[i] += n
    return [torch.cat(outs[i]) for i in range(len(mixed))]


def test_layer_over_slots_equals_one_pass():
    layer = GatedDeltaNet("l", num_k_heads=2, num_v_heads=4, head_k_dim=DK, head_v_dim=DV, conv_kernel_size=4,
                          chunk_size=8)
    gen = torch.Generator().manual_seed(2)
    lengths = [13, 9, 20]
    mixed = [torch.randn(n, layer.conv_dim, generator=gen) for n in lengths]
    g = [-F.softplus(torch.randn(n, 4, generator=gen)) for n in lengths]
    beta = [torch.rand(n, 4, generator=gen) for n in lengths]
    weight = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5
    # seq 0 prefills 10 then decodes; seq 1 joins with chunks of 3, 1 and 5; seq 2 prefills 20 in one go
    schedule = [[(0, 10)], [(0, 1), (1, 3)], [(0, 1), (1, 1), (2, 20)], [(0, 1), (1, 5)]]
    stepped = run_layer(layer, mixed, g, beta, weight, schedule)
    whole = run_layer(layer, mixed, g, beta, weight, [[(0, 13), (1, 9), (2, 20)]])
    for a, b in zip(stepped, whole):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
