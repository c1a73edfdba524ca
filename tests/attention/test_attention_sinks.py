"""Attention sinks (GPT-OSS: each query head's learned logit in the softmax's denominator, weighing no
value) in every paged-attention backend, against a dense reference built from the full K/V of each
sequence: `exact` and `whole_block` (decodes, prefill chunks, mixed steps, a sliding window), `flex`
(one scaled FlexAttention call), `triton` (its kernel in Triton's interpreter, with and without key
splits), the native decode kernel (both builds: AVX-512 and AVX2; the portable and the intrinsics
paths; float32, float16 and bfloat16 caches), on caches whose unused slots hold NaN where the backend reads only written slots. Sinks of
N(0, 4) make the denominator's extra term matter (asserted: the outputs move). The triton and flex
cases are `slow` (the interpreter, FlexAttention's eager trace); tests/models/test_gpt_oss.py runs flex
by default through the model."""

from __future__ import annotations

import math

import pytest
import torch

from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.triton_paged import TRITON_UNAVAILABLE, paged_attention
from blockserve.native.extension import paged_decode_kernel, why_not_native
from tests.attention.test_paged_attention import HQ, HKV, D, BS, make_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SINKS = torch.randn(HQ, generator=torch.Generator().manual_seed(3)) * 2
STEPS = {  # (tokens computed before the step, query tokens), decodes first
    "prefill": [(0, 9), (0, 3)],
    "decode": [(5, 1), (12, 1), (3, 1), (16, 1)],
    "mixed": [(5, 1), (12, 1), (0, 9), (6, 5), (8, 4)],
}
SCALE = 1 / math.sqrt(D)


def dense_reference(seqs, full_k, full_v, q, window, sinks):
    """Each query row's attention over its sequence's keys (causal, windowed), sink in the softmax."""
    out, row = [], 0
    for (computed, n), keys, values in zip(seqs, full_k, full_v):
        keys, values = keys.repeat_interleave(HQ // HKV, 1), values.repeat_interleave(HQ // HKV, 1)
        for i in range(n):
            pos = computed + i
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", q[row], keys[lo:pos + 1]) * SCALE
            if sinks is not None:
                scores = torch.cat([scores, sinks[:, None]], dim=1)
            weights = scores.softmax(-1)[:, :pos + 1 - lo]
            out.append(torch.einsum("hk,khd->hd", weights, values[lo:pos + 1]))
            row += 1
    return torch.stack(out)


def run(backend: str, seqs, window, sinks, fill):
    k_cache, v_cache, table, q, k, v, full_k, full_v = make_step(seqs, fill=fill)
    meta = AttentionMetadata.build(BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs]), table, BS, window)
    attention = BACKENDS[backend](SCALE, sinks=sinks is not None)
    got = attention.forward(q, k, v, k_cache, v_cache, meta, **({} if sinks is None else {"sinks": sinks}))
    return got, dense_reference(seqs, full_k, full_v, q, window, sinks)


BACKEND_CASES = ["exact", "whole_block", pytest.param("flex", marks=pytest.mark.slow),
                 pytest.param("triton", marks=pytest.mark.slow)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_sinks_match_the_dense_reference(backend, step, window):
    if backend == "triton" and TRITON_UNAVAILABLE is not None:
        pytest.skip(f"Triton unavailable: {TRITON_UNAVAILABLE}")
    reads_only_written = backend in ("exact", "triton")
    got, want = run(backend, STEPS[step], window, SINKS, float("nan") if reads_only_written else 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, without = run(backend, STEPS[step], window, None, 0.0)
    assert float((want - without).abs().max()) > 0.05  # the sinks matter here


@pytest.mark.slow  # Triton's interpreter
@pytest.mark.skipif(TRITON_UNAVAILABLE is not None, reason=f"Triton unavailable: {TRITON_UNAVAILABLE}")
@pytest.mark.parametrize("splits", [2, 4])
def test_triton_key_splits_add_the_sink_once(splits):
    """Decode rows whose keys are split over programs: the combine adds each head's sink once."""
    seqs = [(299, 1), (150, 1), (3, 1)]
    k_cache, v_cache, table, q, k, v, full_k, full_v = make_step(seqs, fill=float("nan"))
    meta = AttentionMetadata.build(BatchLayout.build([1, 1, 1], [c for c, _ in seqs]), table, BS)
    BACKENDS["exact"](SCALE, sinks=True).forward(q, k, v, k_cache, v_cache, meta, sinks=SINKS)  # writes K/V
    got = paged_attention(torch.empty_like(q), q, k_cache, v_cache, meta, SCALE, splits=splits, sinks=SINKS)
    torch.testing.assert_close(got, dense_reference(seqs, full_k, full_v, q, None, SINKS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["exact", "whole_block", "flex", "triton"])
def test_sinks_given_exactly_when_declared(backend):  # refused before any kernel runs
    seqs = STEPS["decode"]
    k_cache, v_cache, table, q, k, v, *_ = make_step(seqs, fill=0.0)
    meta = AttentionMetadata.build(BatchLayout.build([1] * len(seqs), [c for c, _ in seqs]), table, BS)
    with pytest.raises(ValueError, match="without sink logits"):
        BACKENDS[backend](SCALE, sinks=True).forward(q, k, v, k_cache, v_cache, meta)
    with pytest.raises(ValueError, match="with sink logits"):
        BACKENDS[backend](SCALE).forward(q, k, v, k_cache, v_cache, meta, sinks=SINKS)


@pytest.mark.parametrize("without_avx512", [False, True], ids=["native-default", "native-without-avx512"])
@pytest.mark.parametrize("dtype,head_size", [(torch.float32, 8), (torch.float32, 64), (torch.float16, 64),
                                             (torch.bfloat16, 128)])
def test_native_decode_kernel_adds_the_sinks(without_avx512, dtype, head_size):
    """Decodes of contexts of 1 to 70 keys, some starting past key 0 (a window), over NaN-filled caches."""
    if why_not_native() is not None:
        pytest.skip(f"native kernels cannot be built here ({why_not_native()})")
    kernel = paged_decode_kernel(without_avx512=without_avx512)
    if not kernel.reads(torch.float32, dtype, head_size):
        pytest.skip(f"this CPU's build does not read {dtype} caches")
    hq, hkv, block_size = 6, 2, 16
    lens, starts = [1, 17, 40, 70], [0, 0, 20, 9]
    gen = torch.Generator().manual_seed(5)
    sinks = torch.randn(hq, generator=gen) * 2
    need = [-(-n // block_size) for n in lens]
    k_cache = torch.full((sum(need) + 1, block_size, hkv, head_size), float("nan")).to(dtype)
    v_cache = k_cache.clone()
    table = torch.zeros(len(lens), max(need), dtype=torch.int64)
    q = torch.randn(len(lens), hq, head_size, generator=gen)
    want, next_block = [], 1
    for i, (n, start) in enumerate(zip(lens, starts)):
        blocks = list(range(next_block, next_block + need[i]))
        next_block += need[i]
        table[i, :need[i]] = torch.tensor(blocks)
        keys = torch.randn(n, hkv, head_size, generator=gen).to(dtype)
        values = torch.randn(n, hkv, head_size, generator=gen).to(dtype)
        for p in range(n):
            k_cache[blocks[p // block_size], p % block_size] = keys[p]
            v_cache[blocks[p // block_size], p % block_size] = values[p]
        k = keys[start:].float().repeat_interleave(hq // hkv, 1)
        v = values[start:].float().repeat_interleave(hq // hkv, 1)
        scores = torch.cat([torch.einsum("hd,khd->hk", q[i], k) * head_size**-0.5, sinks[:, None]], dim=1)
        want.append(torch.einsum("hk,khd->hd", scores.softmax(-1)[:, :-1], v))
    out = torch.empty_like(q)
    kernel(out, q, k_cache, v_cache, table, torch.tensor(starts), torch.tensor(lens), head_size**-0.5, sinks=sinks)
    torch.testing.assert_close(out, torch.stack(want), rtol=1e-4, atol=1e-5)
    plain = torch.empty_like(q)
    kernel(plain, q, k_cache, v_cache, table, torch.tensor(starts), torch.tensor(lens), head_size**-0.5)
    assert float((plain - out).abs().max()) > 0.05  # the sinks matter here
