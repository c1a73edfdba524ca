"""The fused decode call (attention/rotary_decode.py) against the reference path it replaces:
rotary, the backend's cache write and its attention, op by op."""

from __future__ import annotations

import math

import pytest
import torch

from blockserve.attention.context import ForwardContext, LayerCache
from blockserve.attention.layer import Attention
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import ExactLengthAttention
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.models.rotary import apply_rotary
from blockserve.native.extension import paged_decode_kernel, why_not_native
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(why_not_native() is not None, reason=f"native kernels cannot be built here: {why_not_native()}")

HQ, HKV, BS = 6, 2, 4


def make_step(query_lens, num_computed, head_dim, cache_dtype, seed=0):
    """An attention layer, its NaN-poisoned cache with the earlier tokens written, the step's
    context, qkv and cos/sin: everything both paths take."""
    gen = torch.Generator().manual_seed(seed)
    attn = Attention("layer", HQ, HKV, head_dim, ExactLengthAttention(head_dim**-0.5), dtype=torch.float32)
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    need = [-(-n // BS) for n in seq_lens]
    order = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    k_cache = torch.full((sum(need) + 1, BS, HKV, head_dim), float("nan")).to(cache_dtype)
    k_cache[0] = 0
    v_cache = k_cache.clone()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int64)
    for i, (computed, blocks) in enumerate(zip(num_computed, need)):
        table[i, :blocks], order = torch.tensor(order[:blocks]), order[blocks:]
        for p in range(computed):
            slot = (table[i, p // BS], p % BS)
            k_cache[slot] = torch.randn(HKV, head_dim, generator=gen).to(cache_dtype)
            v_cache[slot] = torch.randn(HKV, head_dim, generator=gen).to(cache_dtype)
    layout = BatchLayout.build(query_lens, num_computed)
    ctx = ForwardContext({"layer": LayerCache(0, k_cache, v_cache)}, [AttentionMetadata.build(layout, table, BS)])
    t = sum(query_lens)
    qkv = torch.randn(t, (HQ + 2 * HKV) * head_dim, generator=gen)
    angles = layout.positions[:, None] * torch.rand(head_dim // 2, generator=gen)
    return attn, ctx, qkv, angles.cos(), angles.sin()


def reference(attn, ctx, qkv, cos, sin):
    """LlamaAttention's unfused path: q and k rotated, then the backend writes the cache and attends."""
    t, d = qkv.shape[0], attn.head_dim
    qk = apply_rotary(qkv[:, :(HQ + HKV) * d].view(t, HQ + HKV, d), cos[:, None], sin[:, None])
    return attn(qk[:, :HQ].reshape(t, -1), qk[:, HQ:].reshape(t, -1), qkv[:, (HQ + HKV) * d:], ctx)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 8])  # 64: the intrinsics path; 8: the portable one (float32 only)
def test_fused_decode_equals_the_reference_path(cache_dtype, head_dim):
    """Output and every cache slot (NaN where unwritten) match; 3 query heads per KV head, a
    sequence starting a fresh block, one ending one, partial blocks."""
    kernel = paged_decode_kernel()
    if not kernel.reads(torch.float32, cache_dtype, head_dim):
        pytest.skip(f"the decode kernel does not read {cache_dtype} caches at head size {head_dim} on this CPU")
    query_lens, computed = [1] * 5, [0, 3, 4, 9, 30]
    attn, ctx, qkv, cos, sin = make_step(query_lens, computed, head_dim, cache_dtype)
    ref_attn, ref_ctx, *_ = make_step(query_lens, computed, head_dim, cache_dtype)
    want = reference(ref_attn, ref_ctx, qkv.clone(), cos, sin)
    got = RotaryDecode(attn)(qkv, cos, sin, ctx)
    # the rotation's rounding (FMA or not) may move a rotated key by one ulp of the cache's dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[cache_dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    mine, theirs = ctx.layers["layer"], ref_ctx.layers["layer"]
    torch.testing.assert_close(mine.k_cache, theirs.k_cache, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(mine.v_cache, theirs.v_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("computed", [[700, 760, 720, 800, 740], [3000]])
def test_two_threads_attend_to_the_same_bits(computed):
    """Five sequences of ~750 keys, or one of 3000: enough work that the kernel splits it over two
    threads (tasks of >= 2^17 key elements on the task pool, one item per sequence and KV head, so
    one sequence's two KV heads go to two threads); each head is one thread's, so outputs and
    caches are bitwise equal, and match the reference path."""
    query_lens = [1] * len(computed)
    results = []
    for n in (1, 2):
        with torch_threads(n):
            attn, ctx, qkv, cos, sin = make_step(query_lens, computed, 64, torch.float32)
            results.append((RotaryDecode(attn)(qkv, cos, sin, ctx), ctx.layers["layer"].k_cache))
    (one, k_one), (two, k_two) = results
    assert torch.equal(one, two) and torch.equal(k_one.nan_to_num(7.0), k_two.nan_to_num(7.0))
    ref_attn, ref_ctx, qkv, cos, sin = make_step(query_lens, computed, 64, torch.float32)
    torch.testing.assert_close(one, reference(ref_attn, ref_ctx, qkv, cos, sin), rtol=1e-5, atol=1e-5)


def test_a_step_with_prefill_rows_is_left_to_the_reference_path():
    attn, ctx, qkv, cos, sin = make_step([1, 3], [5, 0], 64, torch.float32)
    before, cache_before = qkv.clone(), ctx.layers["layer"].k_cache.clone()
    assert RotaryDecode(attn)(qkv, cos, sin, ctx) is None
    assert torch.equal(qkv, before)
    assert torch.equal(cache_before.nan_to_num(7.0), ctx.layers["layer"].k_cache.nan_to_num(7.0))


def test_without_the_native_decode_kernel_nothing_is_fused():
    attn, ctx, qkv, cos, sin = make_step([1], [5], 64, torch.float32)
    attn.backend.decode_kernel = None
    assert RotaryDecode(attn)(qkv, cos, sin, ctx) is None


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    attn, ctx, qkv, cos, sin = make_step([1, 1], [2, 6], 64, torch.float32)
    cache, meta = ctx.for_layer("layer")
    meta.slot_mapping[1] = cache.k_cache.shape[0] * BS
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        RotaryDecode(attn)(qkv, cos, sin, ctx)
    assert torch.equal(qkv, before)


def test_scale_is_the_backends():
    """The fused call attends with the backend's scale, not an assumed 1/sqrt(D)."""
    attn, ctx, qkv, cos, sin = make_step([1, 1], [3, 7], 64, torch.float32)
    ref_attn, ref_ctx, *_ = make_step([1, 1], [3, 7], 64, torch.float32)
    attn.backend.scale = ref_attn.backend.scale = 0.5 / math.sqrt(64)
    torch.testing.assert_close(RotaryDecode(attn)(qkv.clone(), cos, sin, ctx),
                               reference(ref_attn, ref_ctx, qkv.clone(), cos, sin), rtol=1e-5, atol=1e-5)
