"""Speculative decoding over recurrent-state layers (Gated DeltaNet, Mamba2, KDA): a request's k + 1
verified rows run as one chain of decode steps, and after a partial rejection the rollback leaves
in its slot exactly (bitwise) the state of decoding only the accepted tokens, one step at a time, on
rank 0 at once and on a tensor-parallel rank above 0 from the rows' states it kept until the count came."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockserve.attention.context import ForwardContext, StateCache, StateMetadata
from blockserve.attention.gated_deltanet import GatedDeltaNet
from blockserve.attention.kda import KimiDeltaAttention
from blockserve.attention.mamba2 import Mamba2
from blockserve.attention.metadata import BatchLayout
from blockserve.worker.state_rollback import StateRollback

SLOT_A, SLOT_B, CHECKPOINT, NUM_SLOTS = 5, 3, 7, 8
PREFIX_A, PREFIX_B, ROWS = 9, 6, 4  # tokens before the step; the verified request's rows (3 drafts)


def gated_deltanet(gen):
    layer = GatedDeltaNet("l", num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=4, conv_kernel_size=4,
                          chunk_size=8, dtype=torch.float32)
    weight = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5

    def tokens(n):
        return (torch.randn(n, layer.conv_dim, generator=gen), -F.softplus(torch.randn(n, 4, generator=gen)),
                torch.rand(n, 4, generator=gen))

    return layer, tokens, lambda mixed, g, beta, ctx: layer(mixed, g, beta, weight, None, ctx)


def mamba2(gen):
    layer = Mamba2("l", num_heads=4, head_dim=4, n_groups=2, state_size=8, conv_kernel_size=4, chunk_size=8,
                   dtype=torch.float32)
    weight, bias = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5, torch.randn(layer.conv_dim, generator=gen)
    A, D, dt_bias = -torch.rand(4, generator=gen) - 0.1, torch.randn(4, generator=gen), torch.randn(4, generator=gen)

    def tokens(n):
        return torch.randn(n, layer.conv_dim, generator=gen), torch.randn(n, 4, generator=gen)

    return layer, tokens, lambda xbc, dt, ctx: layer(xbc, dt, weight, bias, A, D, dt_bias, ctx)


def kda(gen):
    layer = KimiDeltaAttention("l", 2, 8, 4, dtype=torch.float32)
    weight = torch.randn(layer.conv_dim, 4, generator=gen) * 0.5

    def tokens(n):
        return (torch.randn(n, layer.conv_dim, generator=gen), -F.softplus(torch.randn(n, 2, 8, generator=gen)),
                torch.rand(n, 2, generator=gen))

    return layer, tokens, lambda mixed, g, beta, ctx: layer(mixed, weight, g, beta, ctx)


def _step(call, cache, inputs, query_lens, computed, slots, chains=(), row_captures=()):
    meta = StateMetadata(BatchLayout.build(query_lens, computed), torch.tensor(slots), chains=list(chains),
                         row_captures=list(row_captures))
    return call(*inputs, ForwardContext({"l": cache}, [meta])), meta


@pytest.mark.parametrize("make", [gated_deltanet, mamba2, kda])
@pytest.mark.parametrize("accepted", [0, 1, ROWS - 1])
@pytest.mark.parametrize("deferred", [False, True], ids=["rank-0", "rank-1"])
def test_rollback_leaves_the_accepted_prefix_state(make, accepted, deferred):
    """`deferred`: a tensor-parallel rank above 0, which keeps the rows' states past the step's release
    and rolls back once the next step tells it the accepted count."""
    gen = torch.Generator().manual_seed(4)
    layer, tokens, call = make(gen)
    cache = StateCache(0, [torch.zeros(NUM_SLOTS, *s) for s in layer.kv_cache_spec(4).shapes])
    a, b = tokens(PREFIX_A + ROWS), tokens(PREFIX_B + 1)
    # Prefill both requests in one step (A in its own slot, B in another).
    _step(call, cache, [torch.cat([x[:PREFIX_A], y[:PREFIX_B]]) for x, y in zip(a, b)], [PREFIX_A, PREFIX_B],
          [0, 0], [SLOT_A, SLOT_B])
    prefilled = [t.clone() for t in cache.tensors]

    # Reference: plain decode steps, A's tokens one at a time (B decodes beside A's first).
    plain = StateCache(0, [t.clone() for t in prefilled])
    outs, states_after = [], []
    for i in range(ROWS):
        rows = [x[PREFIX_A + i:PREFIX_A + i + 1] for x in a]
        if i == 0:
            rows = [torch.cat([x, y[PREFIX_B:]]) for x, y in zip(rows, b)]
        out, _ = _step(call, plain, rows, [1] * (2 if i == 0 else 1), [PREFIX_A + i, PREFIX_B][:2 if i == 0 else 1],
                       [SLOT_A, SLOT_B][:2 if i == 0 else 1])
        outs.append(out)
        states_after.append([t[SLOT_A].clone() for t in plain.tensors])
        if i == 0:
            b_state = [t[SLOT_B].clone() for t in plain.tensors]

    # The verification: A's ROWS rows as one chain beside B's decode, capturing the state after row 1.
    verify = StateCache(0, [t.clone() for t in prefilled])
    rows = [torch.cat([x[PREFIX_A:], y[PREFIX_B:]]) for x, y in zip(a, b)]
    out, meta = _step(call, verify, rows, [1] * (ROWS + 1), [PREFIX_A + i for i in range(ROWS)] + [PREFIX_B],
                      [SLOT_A] * ROWS + [SLOT_B], chains=[(0, ROWS)], row_captures=[(1, CHECKPOINT)])
    for i in range(ROWS):  # every row's output is plain decoding's, bit for bit
        assert torch.equal(out[i], outs[i][0]), i
    assert torch.equal(out[ROWS], outs[0][1])
    assert all(torch.equal(t[SLOT_B], s) for t, s in zip(verify.tensors, b_state))
    assert all(torch.equal(t[SLOT_A], s) for t, s in zip(verify.tensors, states_after[-1]))
    assert all(torch.equal(t[CHECKPOINT], s) for t, s in zip(verify.tensors, states_after[1]))
    if accepted < ROWS - 1:  # before the rollback the slot holds state after rejected drafts
        assert not all(torch.equal(t[SLOT_A], s) for t, s in zip(verify.tensors, states_after[accepted]))

    rollback = StateRollback({"A": (0, ROWS)}, [meta], {"l": verify})
    if deferred:
        pending = rollback.defer("A")
        rollback.release()
        assert all(torch.equal(t[SLOT_A], s) for t, s in zip(verify.tensors, states_after[-1]))
        pending(accepted + 1)
    else:
        rollback("A", accepted + 1)
        rollback.release()
    assert all(torch.equal(t[SLOT_A], s) for t, s in zip(verify.tensors, states_after[accepted]))
    assert all(torch.equal(t[SLOT_B], s) for t, s in zip(verify.tensors, b_state))
    assert not meta.row_states  # released

    # Decoding on from the rolled-back slot is decoding on from the accepted prefix.
    nxt = [x[PREFIX_A + accepted + 1:PREFIX_A + accepted + 2] for x in a]
    if accepted + 1 < ROWS:
        got, _ = _step(call, verify, nxt, [1], [PREFIX_A + accepted + 1], [SLOT_A])
        assert torch.equal(got, outs[accepted + 1][:1])


def test_a_chain_outside_the_decode_rows_is_refused():
    gen = torch.Generator().manual_seed(1)
    layer, tokens, call = gated_deltanet(gen)
    cache = StateCache(0, [torch.zeros(NUM_SLOTS, *s) for s in layer.kv_cache_spec(4).shapes])
    with pytest.raises(ValueError, match="outside the 2 decode rows"):
        _step(call, cache, tokens(2), [1, 1], [3, 4], [SLOT_A, SLOT_A], chains=[(1, 2)])


def test_a_rollback_keeping_more_rows_than_verified_is_refused():
    rollback = StateRollback({"A": (0, 3)}, [], {})
    with pytest.raises(ValueError, match="4 tokens kept of 3 verified"):
        rollback("A", 4)
