"""The quantized KV caches (attention/kv_quant.py: int8, float8_e4m3fn): quantisation error, zero
and poison rows, the native decode kernel (both builds) and the fused decode step on their rows,
and every CPU backend (triton's kernel in Triton's interpreter) over such a cache against dense
attention over its dequantised values."""

from __future__ import annotations

import math

import pytest
import torch

from blockserve.attention import kv_quant
from blockserve.attention.context import ForwardContext, LayerCache
from blockserve.attention.layer import Attention
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS, ExactLengthAttention
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.attention.triton_paged import TRITON_UNAVAILABLE
from blockserve.models.rotary import apply_rotary
from blockserve.native.extension import paged_decode_kernel, why_not_native

needs_native = pytest.mark.skipif(why_not_native() is not None, reason=f"no native kernels: {why_not_native()}")
BUILDS = pytest.mark.parametrize("without_avx512", [False, True], ids=["native-default", "native-avx2"])
CODES = pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
ALL_CODES = pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn, torch.uint8], ids=["int8", "fp8", "int4"])
# K and V codes: one dtype for both, or one-byte keys over rotated 4-bit values (k8v4)
KV_CODES = pytest.mark.parametrize("codes,v_codes", [
    (torch.int8, torch.int8), (torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.uint8, torch.uint8),
    (torch.int8, torch.uint8), (torch.float8_e4m3fn, torch.uint8)], ids=["int8", "fp8", "int4", "k8v4", "kfp8v4"])


def empty_cache(shape, head_size: int, codes: torch.dtype) -> torch.Tensor:
    """A zeroed cache [*shape, row] of `codes` rows of head_size values."""
    row = kv_quant.encode(torch.zeros(head_size), codes).shape[-1]
    return torch.zeros(*shape, row, dtype=torch.uint8).view(codes)


def dequantised(x: torch.Tensor, codes: torch.dtype, queries: torch.Tensor | None = None) -> torch.Tensor:
    """What attention over a cache of `codes` sees of x, in x's own coordinates (keys written with
    their tokens' `queries`, as attention takes them)."""
    back = kv_quant.decode(kv_quant.encode(x, codes, queries), torch.float32)
    return kv_quant.unrotate_output(back) if codes == torch.uint8 else back


def head_vectors(kind: str, n: int = 512, dim: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, dim, generator=gen)
    if kind == "outliers":  # a few channels 30x larger, as in real keys
        x[:, :3] *= 30
    return x


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_int8_error_is_half_a_step(kind):
    """Every value comes back within half a quantisation step (the row's scale) of itself; codes
    stay in [-127, 127] and the largest reaches 127."""
    x = head_vectors(kind)
    rows = kv_quant.encode(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == (512, 66)
    scale = rows[:, -2:].view(torch.float16).float()
    back = kv_quant.decode(rows, torch.float32)
    assert ((back - x).abs() <= 0.5 * scale * (1 + 1e-3)).all()
    assert rows[:, :-2].abs().max() == 127 and rows[:, :-2].min() >= -127
    relative = (back - x).norm(dim=-1) / x.norm(dim=-1)
    assert relative.mean() < (0.012 if kind == "random" else 0.06)


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_fp8_error_is_relative(kind):
    """e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (half an ulp) above the
    subnormal range, within half the smallest step below it."""
    x = head_vectors(kind)
    rows = kv_quant.encode(x, torch.float8_e4m3fn)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (512, 66)
    scale = rows[:, -2:].view(torch.float16).float()
    back = kv_quant.decode(rows, torch.float32)
    assert ((back - x).abs() <= torch.maximum(x.abs() / 16, 2.0**-10 * scale) * (1 + 1e-3)).all()
    assert back.abs().amax(-1).sub(x.abs().amax(-1)).abs().le(x.abs().amax(-1) / 16).all()


@pytest.mark.parametrize("dim", [64, 96])
def test_rotation_is_orthogonal_and_fixed(dim):
    """R (blockwise for 96: three 32-channel Hadamard blocks) is orthogonal, so q . k and norms are kept,
    and the same in every call (a cache written by one engine reads in the next)."""
    r = kv_quant.rotation(dim)
    torch.testing.assert_close(r @ r.t(), torch.eye(dim), atol=1e-6, rtol=0)
    x, y = torch.randn(2, 5, dim).unbind()
    torch.testing.assert_close((kv_quant.rotate_queries(x) * kv_quant.rotate_queries(y)).sum(-1), (x * y).sum(-1),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(kv_quant.unrotate_output(kv_quant.rotate_queries(x)), x, atol=1e-5, rtol=1e-5)
    kv_quant.rotation.cache_clear()
    assert torch.equal(kv_quant.rotation(dim), r)
    if dim == 96:  # blockwise: channel 0 spreads over its own 32-channel block only
        assert r[0, :32].ne(0).all() and r[0, 32:].eq(0).all()


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_int4_error_and_what_rotation_buys(kind):
    """4-bit rows: the rotated values come back within half the widest gap between two levels (plus
    the float16 rounding of the minimum) of themselves; on outlier-heavy vectors the rotation cuts the
    relative error ~3x against the same 4-bit codes without it, and asymmetric codes beat symmetric ones."""
    x = head_vectors(kind)
    rows = kv_quant.encode(x, torch.uint8)
    assert rows.dtype == torch.uint8 and rows.shape == (512, 36)
    y = kv_quant.rotate_queries(x)
    scale, minimum = rows[:, -4:].view(torch.float16).float().unbind(-1)
    back = kv_quant.decode(rows, torch.float32)
    gap = kv_quant.int4_levels().diff().max()
    assert ((back - y).abs() <= 0.5 * gap * scale[:, None] * 1.01 + 1e-3 * minimum.abs()[:, None]).all()
    rotated = ((kv_quant.unrotate_output(back) - x).norm(dim=-1) / x.norm(dim=-1)).mean()
    # encode quantises R x; fed R^T x it quantises x itself: the same codes without the rotation
    plain = kv_quant.decode(kv_quant.encode(kv_quant.unrotate_output(x), torch.uint8), torch.float32)
    unrotated = ((plain - x).norm(dim=-1) / x.norm(dim=-1)).mean()
    step = y.abs().amax(-1, keepdim=True) / 7
    symmetric = (((y / step).round().clamp(-8, 7) * step - y).norm(dim=-1) / y.norm(dim=-1)).mean()
    assert rotated < (0.1 if kind == "random" else 0.06) and rotated < symmetric
    if kind == "outliers":
        assert unrotated > 2.5 * rotated
    else:
        assert unrotated < 1.3 * rotated  # nothing to spread: the rotation neither helps nor hurts much


def test_int4_levels_fit_rotated_vectors_better_than_even_steps():
    """Each 4-bit code decodes to its level (INT4_LEVELS[c] * scale + minimum) and each value takes its
    nearest level; the levels, denser near the middle where rotated coordinates cluster, cut the
    squared error of rotated Gaussian vectors ~10% against 16 evenly spaced levels over the same
    minimum and maximum."""
    levels = kv_quant.int4_levels()
    assert levels[0] == 0 and levels[15] == 15 and torch.equal(levels, 15 - levels.flip(0))
    rows = torch.zeros(16, 36, dtype=torch.uint8)
    rows[:, 0] = torch.arange(16)  # code c in channel 0; channel 1 (high nibble) code 0
    rows[:, -4:].view(torch.float16).copy_(torch.tensor([[0.5, -2.0]]))
    assert torch.equal(kv_quant.decode(rows, torch.float32)[:, 0], levels * 0.5 - 2)
    y = kv_quant.rotate_queries(torch.randn(2048, 64, generator=torch.Generator().manual_seed(5)))
    rows = kv_quant.encode(kv_quant.unrotate_output(y), torch.uint8)
    scale, minimum = rows[:, -4:].view(torch.float16).float().split(1, -1)
    back = kv_quant.decode(rows, torch.float32)
    nearest = levels[((y - minimum) / scale)[..., None].sub(levels).abs().argmin(-1)] * scale + minimum
    assert torch.equal(back, nearest)
    low, high = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    step = (high - low) / 15
    even = ((y - low) / step).round() * step + low
    assert (back - y).pow(2).mean() < 0.92 * (even - y).pow(2).mean()


def query_like(n: int, heads: int, dim: int = 64, seed: int = 2) -> torch.Tensor:
    """Queries [n, heads, dim] as a model's are: a large direction shared by every token (per head;
    about 60% of the energy on the bundled model) plus per-token noise."""
    gen = torch.Generator().manual_seed(seed)
    common = 1.2 * torch.randn(heads, dim, generator=torch.Generator().manual_seed(3))
    return common + torch.randn(n, heads, dim, generator=gen)


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_int4_keys_steered_off_their_queries(kind):
    """4-bit keys written with their tokens' queries: the same row layout, scale and minimum, values
    still within 1.5 steps of themselves; the score error of those queries cut ~5x and of later ones
    (fresh tokens' queries: the shared direction with new noise) by ~15%, for a plain squared
    error ~8% higher than the plain rows'; without queries the rows are the plain ones."""
    x = head_vectors(kind).view(256, 2, 64)
    q = kv_quant.rotate_queries(query_like(256, 6))
    later = kv_quant.rotate_queries(query_like(256, 6, seed=4))
    plain_rows, rows = kv_quant.encode(x, torch.uint8), kv_quant.encode(x, torch.uint8, q)
    assert rows.shape == plain_rows.shape == (256, 2, 36)
    assert torch.equal(rows[..., -4:], plain_rows[..., -4:])  # the same scale and minimum: only codes move
    y = kv_quant.rotate_queries(x)
    scale = rows[..., -4:].view(torch.float16).float()[..., :1]
    errors = {}
    for name, r in (("plain", plain_rows), ("steered", rows)):
        e = kv_quant.decode(r, torch.float32) - y
        assert (e.abs() <= 1.5 * scale * 1.01).all()
        own, fresh = (torch.einsum("thgd,thd->thg", qq.view(256, 2, 3, 64), e).pow(2).mean().sqrt()
                      for qq in (q, later))
        errors[name] = (own, fresh, e.pow(2).mean())
    (own, fresh, mse), (own0, fresh0, mse0) = errors["steered"], errors["plain"]
    assert own < 0.3 * own0 and fresh < 0.9 * fresh0 and mse < 1.1 * mse0


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_fp8_keys_steered_off_their_queries(kind):
    """e4m3 keys written with their tokens' queries: the same row layout, each value within half of
    itself (a few e4m3 steps: a candidate scale, then moves) or two subnormal steps, the score error of
    those queries cut 5-10x and of later ones by 20-40%, the squared error no larger (the scale picked
    rounds the whole vector better too); without queries the rows are the plain ones."""
    x = head_vectors(kind).view(256, 2, 64)
    q, later = query_like(256, 6), query_like(256, 6, seed=4)
    plain_rows, rows = kv_quant.encode(x, torch.float8_e4m3fn), kv_quant.encode(x, torch.float8_e4m3fn, q)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == plain_rows.shape == (256, 2, 66)
    assert torch.equal(kv_quant.encode(x, torch.float8_e4m3fn, None).view(torch.uint8), plain_rows.view(torch.uint8))
    assert not torch.isnan(rows[..., :-2].float()).any()  # no NaN code
    errors = {}
    for name, r in (("plain", plain_rows), ("steered", rows)):
        scale = r[..., -2:].view(torch.float16).float()
        e = kv_quant.decode(r, torch.float32) - x
        assert (e.abs() <= torch.maximum(x.abs() / 2, 2.0**-8 * scale) * 1.01).all()
        own, fresh = (torch.einsum("thgd,thd->thg", qq.view(256, 2, 3, 64), e).pow(2).mean().sqrt()
                      for qq in (q, later))
        errors[name] = (own, fresh, e.pow(2).mean())
    (own, fresh, mse), (own0, fresh0, mse0) = errors["steered"], errors["plain"]
    assert own < 0.3 * own0 and fresh < 0.85 * fresh0 and mse < 1.05 * mse0


def test_fp8_levels_index_every_finite_code():
    """fp8_levels holds the 253 finite e4m3 values in ascending order, 0 at FP8_ZERO; a code byte's
    index and back is the byte (-0 comes back as +0)."""
    levels = kv_quant.fp8_levels()
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)]
    assert levels.numel() == 253 and levels[kv_quant.FP8_ZERO] == 0 and (levels[1:] > levels[:-1]).all()
    assert torch.equal(levels.sort().values, finite.unique())
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    index = kv_quant._fp8_index(codes)
    assert torch.equal(levels[index], codes.view(torch.float8_e4m3fn).float())
    assert torch.equal(kv_quant._fp8_bytes(index), torch.where(codes == 0x80, 0, codes))


def test_int4_key_queries_must_match_the_keys():
    """Queries for keys [T, Hkv, D] are [T, Hq, D] with Hq a multiple of Hkv: anything else is named."""
    for codes in (torch.uint8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=r"queries \(4, 3, 64\) do not match keys \(4, 2, 64\)"):
            kv_quant.encode(torch.randn(4, 2, 64), codes, torch.randn(4, 3, 64))


@ALL_CODES
def test_zero_and_poison_rows(codes):
    """Zeroed rows decode to 0 (and a zero vector encodes to them); poisoned rows to NaN: a NaN
    scale, and codes the quantiser never writes (int8 -128; e4m3's NaN)."""
    cache = kv_quant.encode(torch.randn(4, 3, 2, 8), codes)
    kv_quant.fill_rows(cache, 0, torch.tensor([1]), poison=False)
    kv_quant.fill_rows(cache, 0, torch.tensor([2]), poison=True)
    out = kv_quant.decode(cache, torch.float32)
    tail = 4 if codes == torch.uint8 else 2
    assert out[1].eq(0).all() and out[2].isnan().all() and out[[0, 3]].isfinite().all()
    assert (cache[2, ..., :-tail].view(torch.uint8) == kv_quant.POISON_BYTE[codes]).all()
    assert cache[2, ..., -tail:].view(torch.float16).isnan().all()
    assert kv_quant.encode(torch.zeros(2, 8), codes).view(torch.uint8).eq(0).all()


def paged_step(head_size: int, block_size: int, codes: torch.dtype, hq: int = 6, hkv: int = 2,
               v_codes: torch.dtype | None = None):
    """A poisoned quantized cache (values in `v_codes`, default `codes`) with sequences written at
    random blocks; the dense reference over each sequence's dequantised keys and values, as stored
    (rotated for the 4-bit form: the kernel takes rotated queries and leaves the output rotated)."""
    v_codes = codes if v_codes is None else v_codes
    lens, starts = [1, 5, 16, 17, 40, 70, 33], [0, 0, 3, 0, 20, 9, 0]
    gen = torch.Generator().manual_seed(0)
    need = [-(-n // block_size) for n in lens]
    order = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    k_cache = empty_cache((sum(need) + 1, block_size, hkv), head_size, codes)
    kv_quant.fill_rows(k_cache, 0, torch.arange(1, sum(need) + 1), poison=True)
    v_cache = empty_cache((sum(need) + 1, block_size, hkv), head_size, v_codes)
    kv_quant.fill_rows(v_cache, 0, torch.arange(1, sum(need) + 1), poison=True)
    table = torch.zeros(len(lens), max(need), dtype=torch.int64)
    q = torch.randn(len(lens), hq, head_size, generator=gen)
    refs = []
    for i, (n, start) in enumerate(zip(lens, starts)):
        blocks, order = order[: need[i]], order[need[i]:]
        table[i, : need[i]] = torch.tensor(blocks)
        keys = kv_quant.encode(torch.randn(n, hkv, head_size, generator=gen) * 3, codes)
        values = kv_quant.encode(torch.randn(n, hkv, head_size, generator=gen), v_codes)
        for p in range(n):
            k_cache.view(torch.uint8)[blocks[p // block_size], p % block_size] = keys[p].view(torch.uint8)
            v_cache.view(torch.uint8)[blocks[p // block_size], p % block_size] = values[p].view(torch.uint8)
        k = kv_quant.decode(keys[start:], torch.float32).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = kv_quant.decode(values[start:], torch.float32).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        weights = (q[i][:, None] @ k.transpose(1, 2) / math.sqrt(head_size)).softmax(-1)
        refs.append((weights @ v)[:, 0])
    return q, k_cache, v_cache, table, torch.tensor(starts), torch.tensor(lens), torch.stack(refs)


@needs_native
@BUILDS
@KV_CODES
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 4), (256, 32), (64, 32), (8, 4)])
def test_native_decode_reads_the_codes_in_place(without_avx512, codes, v_codes, head_size, block_size):
    """AVX-512, AVX2 (64, 128, 256) and the portable path (8) against dense attention over the
    dequantised cache (4-bit: over the rotated vectors it stores, as the kernel takes rotated
    queries): 3 query heads per KV head, windows, partial blocks, every unwritten row poisoned;
    K and V in one form or one-byte keys over 4-bit values."""
    kernel = paged_decode_kernel(without_avx512=without_avx512)
    assert kernel.reads(torch.float32, codes, head_size, v_codes)
    q, k_cache, v_cache, table, starts, lens, want = paged_step(head_size, block_size, codes, v_codes=v_codes)
    out = torch.empty_like(q)
    kernel(out, q, k_cache, v_cache, table, starts, lens, 1 / math.sqrt(head_size))
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


@needs_native
def test_native_decode_refuses_kv_pairs_it_does_not_read():
    """Only one-byte keys over 4-bit values may differ in form; 4-bit keys over int8 values are refused."""
    kernel = paged_decode_kernel()
    assert not kernel.reads(torch.float32, torch.uint8, 64, torch.int8)
    assert not kernel.reads(torch.float32, torch.float16, 64, torch.uint8)
    q, k_cache, _, table, starts, lens, _ = paged_step(64, 16, torch.uint8)
    _, _, v_cache, *_ = paged_step(64, 16, torch.int8)
    with pytest.raises(RuntimeError, match="keys over uint8"):
        kernel(torch.empty_like(q), q, k_cache, v_cache, table, starts, lens, 0.125)


@needs_native
def test_native_decode_refuses_a_cache_without_scales():
    q, k_cache, v_cache, table, starts, lens, _ = paged_step(64, 16, torch.int8)
    with pytest.raises(RuntimeError, match="D \\+ 2"):
        paged_decode_kernel()(torch.empty_like(q), q, k_cache[..., :64].contiguous(), v_cache[..., :64].contiguous(),
                              table, starts, lens, 0.125)


def fused_step(head_dim: int, codes: torch.dtype, hq: int = 6, hkv: int = 2, bs: int = 4, seed: int = 0,
               v_codes: torch.dtype | None = None, kernel=None):
    """A decode step of 5 sequences (one starting a fresh block, partial blocks) over poisoned caches of
    `codes` keys and `v_codes` values (default: `codes`) with the earlier tokens written; `kernel`: the
    backend's native decode kernel (default: this CPU's build)."""
    v_codes = codes if v_codes is None else v_codes
    gen = torch.Generator().manual_seed(seed)
    attn = Attention("layer", hq, hkv, head_dim, ExactLengthAttention(head_dim**-0.5), dtype=torch.float32)
    if kernel is not None:
        attn.backend.decode_kernel = kernel
    computed = [0, 3, 4, 9, 30]
    need = [-(-(c + 1) // bs) for c in computed]
    order = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    k_cache = empty_cache((sum(need) + 1, bs, hkv), head_dim, codes)
    v_cache = empty_cache((sum(need) + 1, bs, hkv), head_dim, v_codes)
    for cache in (k_cache, v_cache):
        kv_quant.fill_rows(cache, 0, torch.arange(1, sum(need) + 1), poison=True)
    table = torch.zeros(len(computed), max(need), dtype=torch.int64)
    for i, (c, blocks) in enumerate(zip(computed, need)):
        table[i, :blocks], order = torch.tensor(order[:blocks]), order[blocks:]
        for p in range(c):
            slot = (table[i, p // bs], p % bs)
            for cache, form in ((k_cache, codes), (v_cache, v_codes)):
                cache.view(torch.uint8)[slot] = kv_quant.encode(torch.randn(hkv, head_dim, generator=gen), form).view(torch.uint8)
    layout = BatchLayout.build([1] * len(computed), computed)
    ctx = ForwardContext({"layer": LayerCache(0, k_cache, v_cache)}, [AttentionMetadata.build(layout, table, bs)])
    qkv = torch.randn(len(computed), (hq + 2 * hkv) * head_dim, generator=gen)
    angles = layout.positions[:, None] * torch.rand(head_dim // 2, generator=gen)
    return attn, ctx, qkv, angles.cos(), angles.sin()


def assert_same_codes(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """Two caches' rows: the same bytes but for codes one step apart where the rotary's rounding (FMA
    or not) moved a value by an ulp (scales may then move by an ulp of float16 too)."""
    if torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
        return
    tail = kv_quant.scale_bytes(mine.dtype)
    if mine.dtype == torch.uint8:
        codes = lambda c: torch.stack([c[..., :-tail] & 15, c[..., :-tail] >> 4], -1).int()  # noqa: E731
    else:
        codes = lambda c: c.view(torch.int8)[..., :-tail].int()  # noqa: E731
    assert (codes(mine) - codes(theirs)).abs().max() <= 1
    scales = [c[..., -tail:].view(torch.float16).float() for c in (mine, theirs)]
    torch.testing.assert_close(scales[0], scales[1], rtol=2e-3, atol=0, equal_nan=True)


@needs_native
@BUILDS
@KV_CODES
@pytest.mark.parametrize("head_dim", [64, 8])
def test_fused_decode_writes_the_bytes_the_backend_writes(without_avx512, codes, v_codes, head_dim):
    """The fused rotary + quantised write + attention equals the backend's PyTorch path: the same
    bytes in every row (poison where unwritten; within a code where the rotary's rounding differs),
    the same output to float32 rounding. The rotated 4-bit form: k, v (and q over 4-bit keys) rotated
    in the fused call as kv_quant does, the output un-rotated once."""
    kernel = paged_decode_kernel(without_avx512=without_avx512)
    attn, ctx, qkv, cos, sin = fused_step(head_dim, codes, v_codes=v_codes, kernel=kernel)
    ref_attn, ref_ctx, *_ = fused_step(head_dim, codes, v_codes=v_codes, kernel=kernel)
    assert RotaryDecode(attn).fixed(ctx.layers["layer"], torch.float32) is not None  # the fused call covers it
    t, d, hq, hkv = qkv.shape[0], head_dim, 6, 2
    qk = apply_rotary(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos[:, None], sin[:, None])
    want = ref_attn(qk[:, :hq].reshape(t, -1), qk[:, hq:].reshape(t, -1), qkv[:, (hq + hkv) * d:], ref_ctx)
    got = RotaryDecode(attn)(qkv, cos, sin, ctx)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    mine, theirs = ctx.layers["layer"], ref_ctx.layers["layer"]
    assert torch.equal(mine.v_cache.view(torch.uint8), theirs.v_cache.view(torch.uint8))  # v is not RoPE-rotated
    assert_same_codes(mine.k_cache, theirs.k_cache)


@needs_native
@BUILDS
@pytest.mark.parametrize("codes,v_codes", [(torch.uint8, torch.uint8), (torch.int8, torch.uint8),
                                           (torch.float8_e4m3fn, torch.float8_e4m3fn),
                                           (torch.float8_e4m3fn, torch.uint8)], ids=["int4", "k8v4", "fp8", "kfp8v4"])
@pytest.mark.parametrize("head_dim", [64, 16, 96])  # 96: rotation blocks of 32
def test_fused_steered_write_equals_kv_quant_exactly(without_avx512, codes, v_codes, head_dim):
    """With no RoPE (cos 1, sin 0) the fused call's rows are kv_quant.encode's bytes exactly: rotated
    4-bit rows (the C++ signs are kv_quant's seeded ones, its butterflies combine the same sums in the
    same order) and keys steered off their queries (4-bit and e4m3: the same candidate scales and
    moves); its output is the PyTorch path's to float32 rounding."""
    kernel = paged_decode_kernel(without_avx512=without_avx512)
    attn, ctx, qkv, cos, sin = fused_step(head_dim, codes, v_codes=v_codes, kernel=kernel)
    ref_attn, ref_ctx, *_ = fused_step(head_dim, codes, v_codes=v_codes, kernel=kernel)
    cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    t, hq, hkv, d = qkv.shape[0], 6, 2, head_dim
    want = ref_attn(qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:], ref_ctx)
    q = qkv[:, :hq * d].reshape(t, hq, d)  # keys are steered off them (4-bit keys off the rotated ones)
    q = kv_quant.rotate_queries(q) if codes == torch.uint8 else q
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d).clone()
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).clone()
    torch.testing.assert_close(RotaryDecode(attn)(qkv, cos, sin, ctx), want, rtol=2e-5, atol=2e-5)
    slots = ctx.metadata[0].slot_mapping
    cache = ctx.layers["layer"]
    for side, x, dtype, queries in ((cache.k_cache, k, codes, q), (cache.v_cache, v, v_codes, None)):
        rows = side.view(-1, hkv, side.shape[-1])[slots]
        assert torch.equal(rows.view(torch.uint8), kv_quant.encode(x, dtype, queries).view(torch.uint8))


VARIANTS = ["exact", "exact-pytorch", "whole_block", "flex",
            pytest.param("triton", marks=pytest.mark.skipif(TRITON_UNAVAILABLE is not None, reason="no Triton"))]


@KV_CODES
@pytest.mark.parametrize("variant", VARIANTS)
def test_backends_attend_the_dequantised_cache(variant, codes, v_codes):
    """Decodes and prefill chunks (fresh and continued) over a quantized cache (K and V in one form, or
    one-byte keys over 4-bit values) equal dense attention over the dequantised K/V; on a poisoned
    cache the whole-page readers turn NaN and the exact one does not."""
    hq, hkv, d, bs = 4, 2, 8, 4
    seqs = [(5, 1), (12, 1), (3, 1), (0, 9), (6, 5)]
    gen = torch.Generator().manual_seed(0)
    results = {}
    for poison in (False, True):
        k_cache = empty_cache((40, bs, hkv), d, codes)
        kv_quant.fill_rows(k_cache, 0, torch.arange(1, 40), poison=poison)
        v_cache = empty_cache((40, bs, hkv), d, v_codes)
        kv_quant.fill_rows(v_cache, 0, torch.arange(1, 40), poison=poison)
        full_k, full_v, tables, free = [], [], [], list(range(1, 40))
        gen.manual_seed(0)
        for c, n in seqs:
            blocks = [free.pop(5 % len(free)) for _ in range(-(-(c + n) // bs))]
            tables.append(blocks + [0] * (4 - len(blocks)))
            full_k.append(torch.randn(c + n, hkv, d, generator=gen))
            full_v.append(torch.randn(c + n, hkv, d, generator=gen))
            for p in range(c):
                k_cache.view(torch.uint8)[blocks[p // bs], p % bs] = kv_quant.encode(full_k[-1][p], codes).view(torch.uint8)
                v_row = kv_quant.encode(full_v[-1][p], v_codes)
                v_cache.view(torch.uint8)[blocks[p // bs], p % bs] = v_row.view(torch.uint8)
        q = torch.randn(sum(n for _, n in seqs), hq, d, generator=gen)
        k = torch.cat([kk[c:] for kk, (c, _) in zip(full_k, seqs)])
        v = torch.cat([vv[c:] for vv, (c, _) in zip(full_v, seqs)])
        layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
        meta = AttentionMetadata.build(layout, torch.tensor(tables), bs)
        backend = BACKENDS[variant.removesuffix("-pytorch")](1 / math.sqrt(d))
        if variant.endswith("-pytorch"):
            backend.decode_kernel = None
        results[poison] = backend.forward(q, k, v, k_cache, v_cache, meta)
    out = results[False]
    for i, (c, n) in enumerate(seqs):
        s = layout.query_start[i]
        # the step's keys are written with its queries (rotated where the keys are)
        step_queries = kv_quant.rotate_queries(q[s:s + n]) if codes == torch.uint8 else q[s:s + n]
        keys = torch.cat([dequantised(full_k[i][:c], codes), dequantised(full_k[i][c:], codes, step_queries)])
        values = dequantised(full_v[i], v_codes)
        scores = q[s:s + n].transpose(0, 1) @ keys.repeat_interleave(2, 1).permute(1, 2, 0) / math.sqrt(d)
        mask = torch.arange(c + n)[None] <= torch.arange(c, c + n)[:, None]
        want = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values.repeat_interleave(2, 1).transpose(0, 1))
        torch.testing.assert_close(out[s:s + n], want.transpose(0, 1), rtol=2e-5, atol=2e-5)
    if backend.reads_unwritten_slots:
        assert results[True].isnan().any()
    else:
        assert torch.equal(results[True], out)


@pytest.mark.parametrize("dim", [64, 96, 8])
def test_rotation_butterflies_equal_the_matrix(dim):
    """rotate_queries / unrotate_output (butterflies, no matmul) apply R and R^T of `rotation`."""
    x = torch.randn(3, 4, dim)
    r_t = kv_quant.rotation(dim)
    torch.testing.assert_close(kv_quant.rotate_queries(x), x @ r_t, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(kv_quant.unrotate_output(x), x @ r_t.t(), atol=1e-6, rtol=1e-5)
