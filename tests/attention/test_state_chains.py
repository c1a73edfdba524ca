"""A state layer's multi-token decode step (attention/state_decodes.py): verified chains of 1 to 5 rows
beside plain decodes in one step give every row the output and the states (kept per row, left in
the slot, captured into checkpoint slots) of decoding its tokens one plain step at a time, bit for
bit, per layer kind (Gated DeltaNet, Mamba2 with its conv state, KDA), on the native recurrence
(native/csrc/state_recurrence.cpp, both builds) and on the PyTorch one."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.context import ForwardContext, StateCache, StateMetadata
from blockserve.attention.metadata import BatchLayout
from blockserve.native.extension import DISABLE_ENV, ISA_ENV, state_recurrence_ops, why_not_native
from tests.attention.test_state_rollback import gated_deltanet, kda, mamba2

NUM_SLOTS = 16
# (rows, slot) per sequence in decode-row order; `None` rows: a plain decode (no chain)
SEQUENCES = [(3, 2), (None, 9), (5, 4), (1, 11), (None, 0), (2, 7), (4, 13)]
CAPTURES = {(2, 1): 15, (6, 2): 14}  # (sequence, row within it) -> checkpoint slot

RECURRENCES = ["native", "avx2", "torch"]


@pytest.fixture(params=RECURRENCES)
def recurrence(request, monkeypatch):
    """Which recurrence the layers run: the native kernel (this CPU's build, or the AVX2 one) or PyTorch's."""
    if request.param == "torch":
        monkeypatch.setenv(DISABLE_ENV, "0")
    else:
        if why_not_native() is not None:
            pytest.skip(f"no native build: {why_not_native()}")
        if request.param == "avx2":
            monkeypatch.setenv(ISA_ENV, "avx2")
        assert state_recurrence_ops() is not None
    return request.param


def _filled_cache(layer, gen):
    return StateCache(0, [torch.randn(NUM_SLOTS, *s, generator=gen) * 0.3 for s in layer.kv_cache_spec(4).shapes])


def _run(call, cache, inputs, slots, chains=(), row_captures=()):
    n = len(slots)
    meta = StateMetadata(BatchLayout.build([1] * n, [8] * n), torch.tensor(slots), chains=list(chains),
                         row_captures=list(row_captures))
    return call(*inputs, ForwardContext({"l": cache}, [meta])), meta


@pytest.mark.parametrize("make", [gated_deltanet, mamba2, kda])
def test_chains_beside_plain_decodes_step_every_row_as_decoding_it_alone(make, recurrence):
    gen = torch.Generator().manual_seed(7)
    layer, tokens, call = make(gen)
    start = _filled_cache(layer, gen)
    lengths = [rows or 1 for rows, _ in SEQUENCES]
    inputs = tokens(sum(lengths))
    firsts = [sum(lengths[:i]) for i in range(len(SEQUENCES))]

    # Reference: each sequence alone, one plain one-row step per token.
    expected_out, expected_states = [None] * len(inputs[0]), [None] * len(inputs[0])
    for (rows, slot), first, length in zip(SEQUENCES, firsts, lengths):
        alone = StateCache(0, [t.clone() for t in start.tensors])
        for row in range(first, first + length):
            out, _ = _run(call, alone, [x[row:row + 1] for x in inputs], [slot])
            expected_out[row] = out[0]
            expected_states[row] = [t[slot].clone() for t in alone.tensors]

    # One step: the chains and the plain decodes together, with captures after chain rows.
    cache = StateCache(0, [t.clone() for t in start.tensors])
    slots = [slot for (_, slot), length in zip(SEQUENCES, lengths) for _ in range(length)]
    chains = [(first, rows) for (rows, _), first in zip(SEQUENCES, firsts) if rows is not None]
    captures = [(firsts[seq] + i, slot) for (seq, i), slot in CAPTURES.items()]
    out, meta = _run(call, cache, inputs, slots, chains, captures)

    for row in range(len(slots)):
        assert torch.equal(out[row], expected_out[row]), row
        for kept, state in zip(meta.row_states["l"], expected_states[row]):
            assert torch.equal(kept[row], state), row
    for (_, slot), first, length in zip(SEQUENCES, firsts, lengths):  # the last row's states in the slot
        assert all(torch.equal(t[slot], s) for t, s in zip(cache.tensors, expected_states[first + length - 1]))
    for (seq, i), slot in CAPTURES.items():
        assert all(torch.equal(t[slot], s) for t, s in zip(cache.tensors, expected_states[firsts[seq] + i]))
    untouched = set(range(NUM_SLOTS)) - set(slots) - set(CAPTURES.values())
    assert all(torch.equal(t[s], u[s]) for t, u in zip(cache.tensors, start.tensors) for s in untouched)


@pytest.mark.parametrize("make", [gated_deltanet, mamba2, kda])
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_the_native_recurrence_computes_the_pytorch_one(make, build, monkeypatch):
    if why_not_native() is not None:
        pytest.skip(f"no native build: {why_not_native()}")
    if build == "avx2":
        monkeypatch.setenv(ISA_ENV, "avx2")
    results = {}
    for native in (True, False):
        gen = torch.Generator().manual_seed(3)
        layer, tokens, call = make(gen)
        cache = _filled_cache(layer, gen)
        inputs = tokens(6)
        monkeypatch.setenv(DISABLE_ENV, "1" if native else "0")
        out, meta = _run(call, cache, inputs, [1, 1, 1, 1, 5, 8], chains=[(0, 4)])
        results[native] = out, meta.row_states["l"], cache.tensors
    (out, kept, tensors), (ref_out, ref_kept, ref_tensors) = results[True], results[False]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for a, b in zip([*kept, *tensors], [*ref_kept, *ref_tensors]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_row_starting_from_a_later_row_is_refused():
    ops = state_recurrence_ops()
    if ops is None:
        pytest.skip(f"no native build: {why_not_native()}")
    q = torch.randn(2, 1, 4)
    table, after = torch.zeros(3, 1, 4, 4), torch.empty(2, 1, 4, 4)
    with pytest.raises(RuntimeError, match="row 0's source 1 is neither an earlier row nor a slot"):
        ops.delta_rule_rows(q, q, q, torch.zeros(2, 1), torch.ones(2, 1), table, torch.tensor([1, -1]),
                            torch.empty(2, 1, 4), after)
