"""Mamba2 SSD: chunked scan = single-step recurrence = transformers' torch fallback, and the layer
over state slots (decodes batched, prefill chunks continuing from the slot) = one full pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockserve.attention.context import ForwardContext, StateCache, StateMetadata
from blockserve.attention.mamba2 import Mamba2, segment_sum, ssd_chunk_scan, ssd_step
from blockserve.attention.metadata import BatchLayout
from tests.attention.resume_checks import CUTS, assert_resumes_exactly, exact

L = 100  # no multiple of the chunk sizes (16, 7)

H, P, N = 4, 8, 16
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, H, P, generator=gen)
    dt = F.softplus(torch.randn(length, H, generator=gen))
    A = -torch.rand(H, generator=gen) - 0.1
    B, C = torch.randn(2, length, H, N, generator=gen)
    D = torch.randn(H, generator=gen)
    state = torch.randn(H, P, N, generator=gen) * 0.5
    return x, dt, A, B, C, D, state


def recurrent(x, dt, A, B, C, D, state):
    outs, state = [], state[None]
    for t in range(x.shape[0]):
        y, state = ssd_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, state)
        outs.append(y)
    return torch.cat(outs), state[0]


def test_segment_sum():
    x = torch.tensor([1.0, 2.0, 3.0])
    inf = float("-inf")
    assert segment_sum(x).tolist() == [[0.0, inf, inf], [2.0, 0.0, inf], [5.0, 3.0, 0.0]]


@pytest.mark.parametrize("length,chunk", [(1, 8), (7, 4), (32, 32), (45, 16), (100, 32)])
def test_chunked_equals_recurrent(length, chunk):
    inputs = random_inputs(length)
    y_c, state_c = ssd_chunk_scan(*inputs, chunk)
    y_r, state_r = recurrent(*inputs)
    torch.testing.assert_close(y_c, y_r, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(state_c, state_r, atol=5e-5, rtol=1e-4)


def test_matches_transformers_fallback():
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    length, groups = 37, 2
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, length, H, P, generator=gen)
    dt_raw = torch.randn(1, length, H, generator=gen)
    dt_bias = torch.randn(H, generator=gen)
    A = -torch.rand(H, generator=gen) - 0.1
    B, C = torch.randn(2, 1, length, groups, N, generator=gen)
    D = torch.randn(H, generator=gen)
    state = torch.randn(1, H, P, N, generator=gen)
    expected, expected_state = hf.mamba2_chunk_scan(
        x, dt_raw, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias, initial_states=state, dt_softplus=True,
        return_final_states=True)
    dt = F.softplus(dt_raw[0] + dt_bias)
    Bh, Ch = (t[0].repeat_interleave(H // groups, dim=1) for t in (B, C))
    y, final = ssd_chunk_scan(x[0], dt, A, Bh, Ch, D, state[0], 16)
    torch.testing.assert_close(y, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_state[0], atol=1e-5, rtol=1e-5)

    hf_state = state.clone()  # updated in place
    step = hf.mamba2_selective_state_update(
        hf_state, x[:, 0], dt_raw[:, 0, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
        B[:, 0], C[:, 0], D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True)
    mine, mine_state = ssd_step(x[:, 0], dt[:1], A, Bh[:1], Ch[:1], D, state)
    torch.testing.assert_close(mine, step, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine_state, hf_state, atol=1e-5, rtol=1e-5)


def test_layer_over_slots_equals_one_pass():
    layer = Mamba2("l", num_heads=H, head_dim=P, n_groups=2, state_size=N, conv_kernel_size=4, chunk_size=8,
                   dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    lengths = [13, 9, 20]
    xbc = [torch.randn(n, layer.conv_dim, generator=gen) for n in lengths]
    dt = [torch.randn(n, H, generator=gen) for n in lengths]
    weight, bias = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5, torch.randn(layer.conv_dim, generator=gen)
    A, D, dt_bias = -torch.rand(H, generator=gen) - 0.1, torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    shapes = layer.state_shapes

    def run(schedule, num_slots=8):
        cache = StateCache(0, [torch.zeros(num_slots, *shapes[0]), torch.zeros(num_slots, *shapes[1])])
        done, outs = [0] * len(lengths), [[] for _ in lengths]
        for step in schedule:
            step = sorted(step, key=lambda item: item[1] != 1)  # decodes first
            layout = BatchLayout.build([n for _, n in step], [done[i] for i, _ in step])
            pick = lambda t: torch.cat([t[i][done[i]:done[i] + n] for i, n in step])  # noqa: E731
            ctx = ForwardContext({"l": cache}, [StateMetadata(layout, torch.tensor([7 - i for i, _ in step]))])
            out = layer(pick(xbc), pick(dt), weight, bias, A, D, dt_bias, ctx)
            for j, (i, n) in enumerate(step):
                outs[i].append(out[layout.query_start[j]:layout.query_start[j + 1]])
                done[i] += n
        return [torch.cat(o) for o in outs]

    stepped = run([[(0, 10)], [(0, 1), (1, 3)], [(0, 1), (1, 1), (2, 20)], [(0, 1), (1, 5)]])
    whole = run([[(0, 13), (1, 9), (2, 20)]])
    for a, b in zip(stepped, whole):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [16, 7])
@pytest.mark.parametrize("cuts", CUTS)
def test_resuming_on_the_chunk_grid_is_exact(cuts, chunk):
    """The state captured at a grid position p is bit for bit the state after exactly [0, p), and
    resuming from it is bit for bit the run through p (under the same later cuts); capturing
    changes nothing; the outputs still equal the token-by-token recurrence. (The conv is Gated
    DeltaNet's, tested there.)"""
    x, dt, A, B, C, D, state = random_inputs(L)

    def kernel(a, b, s, capture):
        return ssd_chunk_scan(x[a:b], dt[a:b], A, B[a:b], C[a:b], D, s, chunk, a, capture)

    ref, ref_state, s = [], {}, state[None]
    for t in range(L):
        y, s = ssd_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, s)
        ref.append(y)
        ref_state[t + 1] = s[0]
    assert_resumes_exactly(kernel, L, cuts, state, list(range(chunk, L + 1, chunk)), torch.cat(ref), ref_state, 5e-5)


def test_capture_positions_are_checked():
    x, dt, A, B, C, D, state = random_inputs(40)
    with pytest.raises(ValueError, match="multiples of 16"):
        ssd_chunk_scan(x, dt, A, B, C, D, state, 16, 10, [24])
    with pytest.raises(ValueError, match=r"\(10, 50\]"):
        ssd_chunk_scan(x, dt, A, B, C, D, state, 16, 10, [64])


def test_layer_chunks_on_the_absolute_grid():
    """A prefill cut at 13 then continued equals, bit for bit, the same cut once more at the grid
    position 24: the layer runs its chunks on positions, not on each step's tokens. 6 heads, so a
    token's dt is no whole SIMD vector: torch's own softplus rounds a vector loop's tail elements
    differently, which made the layer's inputs to the scan depend on the cut (attention/pointwise.py)."""
    heads = 6
    layer = Mamba2("l", num_heads=heads, head_dim=P, n_groups=2, state_size=N, conv_kernel_size=4, chunk_size=8,
                   dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    xbc, dt = torch.randn(40, layer.conv_dim, generator=gen), torch.randn(40, heads, generator=gen)
    weight, bias = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5, torch.randn(layer.conv_dim, generator=gen)
    A, D = -torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen)

    def run(cuts):
        cache = StateCache(0, [torch.zeros(2, layer.conv_dim, 3), torch.zeros(2, heads, P, N)])
        edges, outs = [0, *cuts, 40], []
        for a, b in zip(edges, edges[1:]):
            ctx = ForwardContext({"l": cache}, [StateMetadata(BatchLayout.build([b - a], [a]), torch.tensor([1]))])
            outs.append(layer(xbc[a:b], dt[a:b], weight, bias, A, D, dt_bias, ctx))
        return torch.cat(outs), cache.tensors

    (out, states), (out_cut, states_cut) = run([13]), run([13, 24])
    exact(out, out_cut)
    for a, b in zip(states, states_cut):
        exact(a, b)
