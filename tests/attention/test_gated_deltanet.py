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
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from blockserve.attention.metadata import BatchLayout
from blockserve.attention.state_decodes import causal_conv1d_step
from tests.attention.resume_checks import CUTS, assert_conv_captures, assert_resumes_exactly, exact

H, DK, DV = 4, 16, 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
                          chunk_size=8, dtype=torch.float32)
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


# Where the scheduler may have cut a prefill of L tokens into steps: anywhere, on or off the grid.
L = 100  # no multiple of the chunk sizes (16, 7)
@pytest.mark.parametrize("chunk", [16, 7])
@pytest.mark.parametrize("cuts", CUTS)
def test_resuming_on_the_chunk_grid_is_exact(cuts, chunk):
    """The state captured at a grid position p is bit for bit the state after exactly [0, p), and
    resuming from it is bit for bit the run through p (under the same later cuts); capturing
    changes nothing; the outputs still equal the token-by-token recurrence."""
    q, k, v, g, beta, state = random_inputs(L)

    def kernel(a, b, s, capture):
        return chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, chunk, a, capture)

    ref, ref_state, s = [], {}, state[None]
    for t in range(L):
        o, s = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        ref.append(o)
        ref_state[t + 1] = s[0]
    assert_resumes_exactly(kernel, L, cuts, state, list(range(chunk, L + 1, chunk)), torch.cat(ref), ref_state, 2e-5)


@pytest.mark.parametrize("cuts", CUTS)
def test_conv_captures_its_state_at_any_position(cuts):
    gen = torch.Generator().manual_seed(5)
    channels, width = 6, 4
    x = torch.randn(L, channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)

    def kernel(a, b, s, capture):
        return causal_conv1d(x[a:b], s, weight, bias, a, capture)

    assert_conv_captures(kernel, x, torch.zeros(channels, width - 1), cuts)


def test_capture_positions_are_checked():
    q, k, v, g, beta, state = random_inputs(40)
    with pytest.raises(ValueError, match="multiples of 16"):
        chunk_gated_delta_rule(q, k, v, g, beta, state, 16, 10, [24])
    with pytest.raises(ValueError, match=r"\(10, 50\]"):
        chunk_gated_delta_rule(q, k, v, g, beta, state, 16, 10, [64])
    with pytest.raises(ValueError, match=r"\(10, 50\]"):
        causal_conv1d(q[:, 0], torch.zeros(DK, 3), torch.randn(DK, 4), None, 10, [10])


def test_layer_chunks_on_the_absolute_grid():
    """A prefill cut at 13 then continued equals, bit for bit, the same cut once more at the grid
    position 24: the layer runs its chunks on positions, not on each step's tokens."""
    layer = GatedDeltaNet("l", num_k_heads=2, num_v_heads=4, head_k_dim=DK, head_v_dim=DV, conv_kernel_size=4,
                          chunk_size=8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    mixed = [torch.randn(40, layer.conv_dim, generator=gen)]
    g, beta = [-F.softplus(torch.randn(40, 4, generator=gen))], [torch.rand(40, 4, generator=gen)]
    weight = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5
    once = run_layer(layer, mixed, g, beta, weight, [[(0, 13)], [(0, 27)]])
    twice = run_layer(layer, mixed, g, beta, weight, [[(0, 13)], [(0, 11)], [(0, 16)]])
    exact(once[0], twice[0])
