"""Kimi Delta Attention: the chunked form equals the recurrent form (and transformers' reference
implementations) on random inputs; the layer carries conv and recurrent state in the slot."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from blockserve.attention.context import ForwardContext, StateCache, StateMetadata
from blockserve.attention.kda import KimiDeltaAttention, causal_conv, kda_chunked, kda_recurrent, kda_step, l2norm
from blockserve.attention.metadata import BatchLayout
from tests.attention.resume_checks import CUTS, assert_conv_captures, assert_resumes_exactly, exact

T, H, D, K = 100, 3, 16, 4  # T: no multiple of the resume tests' chunk sizes (16, 7)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def inputs(seed: int = 0, strength: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, D, generator=gen) * strength  # log decay, per channel
    beta = torch.rand(T, H, generator=gen)
    state = torch.randn(H, D, D, generator=gen) * 0.1
    return l2norm(q) * D**-0.5, l2norm(k), v, g, beta, state


@pytest.mark.parametrize("chunk_size", [64, 16, 5])
@pytest.mark.parametrize("strength", [0.05, 2.0, 20.0])
def test_chunked_equals_recurrent(chunk_size, strength):
    q, k, v, g, beta, state = inputs(strength=strength)
    out_r, state_r = kda_recurrent(q, k, v, g, beta, state)
    out_c, state_c = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(out_c, out_r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state_c, state_r, atol=2e-5, rtol=1e-4)


def test_matches_transformers_reference():
    """transformers' torch fallbacks of fla's fused_recurrent_kda / chunk_kda (l2norm and the
    Dk^-0.5 scale inside the kernel there; before the call here)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, H, D, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, T, H, D, generator=gen), torch.rand(1, T, H, generator=gen)
    state = torch.randn(1, H, D, D, generator=gen) * 0.1
    want, want_state = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, state, True, use_qk_l2norm_in_kernel=True)
    want_c, _ = hf.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    args = (l2norm(q[0]) * D**-0.5, l2norm(k[0]), v[0], g[0], beta[0], state[0])
    got, got_state = kda_recurrent(*args)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-6, rtol=1e-6)
    got_c, _ = kda_chunked(*args)
    torch.testing.assert_close(got_c, want_c[0], atol=2e-5, rtol=1e-4)


def test_causal_conv_in_pieces_equals_whole():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(20, 12, generator=gen), torch.randn(12, K, generator=gen)
    want = hf.causal_conv1d_fn(x.T[None], w)[0].T  # zero history, as a fresh sequence
    state = torch.zeros(12, K - 1)
    pieces = []
    for s, e in [(0, 7), (7, 8), (8, 9), (9, 20)]:
        out, state = causal_conv(x[s:e], state, w)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[-(K - 1):].T)


def _layer_step(layer, tensors, mixed, w, g, beta, slots, query_lens, computed):
    layout = BatchLayout.build(query_lens, computed)
    ctx = ForwardContext({layer.layer_name: StateCache(0, tensors)}, [StateMetadata(layout, torch.tensor(slots))])
    return layer(mixed, w, g, beta, ctx)


def test_layer_carries_state_through_slots():
    """Two sequences in slots 3 and 1: one as a prefill chunk, then decodes batched with the other's
    chunks, equals each sequence computed in one piece from a zero state."""
    layer = KimiDeltaAttention("kda", H, D, K, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    n = [11, 13]
    mixed = [torch.randn(m, 3 * H * D, generator=gen) for m in n]
    g = [-torch.rand(m, H, D, generator=gen) for m in n]
    beta = [torch.rand(m, H, generator=gen) for m in n]
    w = torch.randn(3 * H * D, K, generator=gen)
    spec = layer.kv_cache_spec(16)
    assert spec.shapes == ((3 * H * D, K - 1), (H, D, D)) and spec.dtypes == ("float32",) * 2
    assert spec.starts_zeroed

    def fresh():
        return [torch.zeros(5, *s) for s in spec.shapes]

    want = [_layer_step(layer, fresh(), mixed[i], w, g[i], beta[i], [1], [n[i]], [0]) for i in range(2)]
    tensors = fresh()
    got = [[], []]
    got[0].append(_layer_step(layer, tensors, mixed[0][:6], w, g[0][:6], beta[0][:6], [3], [6], [0]))
    a = 6
    for b, e in [(0, 5), (5, 10), (10, 13)]:  # seq 0 decodes (first), seq 1 prefills in chunks
        x = torch.cat([mixed[0][a:a + 1], mixed[1][b:e]])
        out = _layer_step(layer, tensors, x, w, torch.cat([g[0][a:a + 1], g[1][b:e]]),
                          torch.cat([beta[0][a:a + 1], beta[1][b:e]]), [3, 1], [1, e - b], [a, b])
        got[0].append(out[:1])
        got[1].append(out[1:])
        a += 1
    got[0].append(_layer_step(layer, tensors, mixed[0][a:], w, g[0][a:], beta[0][a:], [3], [n[0] - a], [a]))
    for i in range(2):
        torch.testing.assert_close(torch.cat(got[i]), want[i], atol=2e-5, rtol=1e-4)


def test_new_request_reads_its_slot():
    """The layer never re-zeroes: a new request reads whatever its slot holds, so a recycled slot
    that was not zeroed shows (which is why LinearStateSpec demands zeroing, C1)."""
    layer = KimiDeltaAttention("kda", H, D, K, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    mixed, g = torch.randn(5, 3 * H * D, generator=gen), -torch.rand(5, H, D, generator=gen)
    beta, w = torch.rand(5, H, generator=gen), torch.randn(3 * H * D, K, generator=gen)
    zeroed = [torch.zeros(3, *s) for s in layer.kv_cache_spec(16).shapes]
    stale = [t.clone().fill_(float("nan")) for t in zeroed]
    stale[0][0] = stale[1][0] = 0  # the null slot
    assert _layer_step(layer, zeroed, mixed, w, g, beta, [2], [5], [0]).isfinite().all()
    assert _layer_step(layer, stale, mixed, w, g, beta, [2], [5], [0]).isnan().all()


@pytest.mark.parametrize("chunk_size", [16, 7])
@pytest.mark.parametrize("cuts", CUTS)
def test_resuming_on_the_chunk_grid_is_exact(cuts, chunk_size):
    """The state captured at a grid position p is bit for bit the state after exactly [0, p), and
    resuming from it is bit for bit the run through p (under the same later cuts); capturing
    changes nothing; the outputs still equal the token-by-token recurrence."""
    q, k, v, g, beta, state = inputs(strength=0.5)

    def kernel(a, b, s, capture):
        return kda_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, chunk_size, a, capture)

    ref, ref_state, s = [], {}, state
    for t in range(T):
        o, s = kda_step(q[t], k[t], v[t], g[t], beta[t], s)
        ref.append(o)
        ref_state[t + 1] = s
    grid = list(range(chunk_size, T + 1, chunk_size))
    assert_resumes_exactly(kernel, T, cuts, state, grid, torch.stack(ref), ref_state, 2e-5)


@pytest.mark.parametrize("cuts", CUTS)
def test_conv_captures_its_state_at_any_position(cuts):
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(T, 12, generator=gen), torch.randn(12, K, generator=gen)

    def kernel(a, b, s, capture):
        return causal_conv(x[a:b], s, w, a, capture)

    assert_conv_captures(kernel, x, torch.zeros(12, K - 1), cuts)


def test_capture_positions_are_checked():
    q, k, v, g, beta, state = inputs()
    with pytest.raises(ValueError, match="multiples of 16"):
        kda_chunked(q[10:50], k[10:50], v[10:50], g[10:50], beta[10:50], state, 16, 10, [24])
    with pytest.raises(ValueError, match=r"\(10, 50\]"):
        kda_chunked(q[10:50], k[10:50], v[10:50], g[10:50], beta[10:50], state, 16, 10, [64])
    with pytest.raises(ValueError, match=r"\(10, 50\]"):
        causal_conv(q[10:50, 0], torch.zeros(D, K - 1), torch.randn(D, K), 10, [10])


def test_layer_chunks_on_the_absolute_grid():
    """A prefill cut at 13 then continued equals, bit for bit, the same cut once more at the grid
    position 24: the layer runs its chunks on positions, not on each step's tokens."""
    layer = KimiDeltaAttention("kda", H, D, K, dtype=torch.float32)
    layer.chunk_size = 8
    gen = torch.Generator().manual_seed(6)
    n = 40
    mixed, g = torch.randn(n, 3 * H * D, generator=gen), -torch.rand(n, H, D, generator=gen)
    beta, w = torch.rand(n, H, generator=gen), torch.randn(3 * H * D, K, generator=gen)

    def run(cuts):
        tensors = [torch.zeros(2, 3 * H * D, K - 1), torch.zeros(2, H, D, D)]
        edges = [0, *cuts, n]
        out = [_layer_step(layer, tensors, mixed[a:b], w, g[a:b], beta[a:b], [1], [b - a], [a])
               for a, b in zip(edges, edges[1:])]
        return torch.cat(out), tensors

    (out, states), (out_cut, states_cut) = run([13]), run([13, 24])
    exact(out, out_cut)
    for a, b in zip(states, states_cut):
        exact(a, b)
