"""Both paged-attention backends (the exact one with and without its native decode kernel)
against dense attention, and their C1 behaviour under poison."""

from __future__ import annotations

import math

import pytest
import torch

from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS, PagedAttention
from blockserve.native.extension import paged_decode_kernel, why_not_native

VARIANTS = ["exact", "exact-pytorch", "whole_block"]  # exact: native decode kernel when built


def make_backend(variant: str) -> PagedAttention:
    backend = BACKENDS[variant.removesuffix("-pytorch")](1 / math.sqrt(D))
    if variant.endswith("-pytorch"):
        backend.decode_kernel = None
    return backend

HQ, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 120


def dense_reference(q, keys, values, query_pos, window=None):
    """q [n, Hq, D] at positions query_pos; keys/values [L, Hkv, D] for positions 0..L-1."""
    rep = HQ // HKV
    k = keys.repeat_interleave(rep, 1).transpose(0, 1)
    v = values.repeat_interleave(rep, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(D)  # [Hq, n, L]
    key_pos = torch.arange(keys.shape[0])
    mask = key_pos[None] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None] > query_pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def make_step(seqs, fill):
    """seqs: list of (num_computed, query_len), decodes first. Returns full K/V per sequence,
    the cache with earlier tokens written, block tables and the step's q/k/v."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.full((NUM_BLOCKS, BS, HKV, D), fill)
    v_cache = torch.full((NUM_BLOCKS, BS, HKV, D), fill)
    k_cache[0] = 0  # the null block
    v_cache[0] = 0
    free = list(range(1, NUM_BLOCKS))
    tables, full_k, full_v = [], [], []
    for computed, n in seqs:
        total = computed + n
        blocks = [free.pop(7 % len(free)) for _ in range(-(-total // BS))]
        tables.append(blocks)
        kk = torch.randn(total, HKV, D, generator=gen)
        vv = torch.randn(total, HKV, D, generator=gen)
        full_k.append(kk)
        full_v.append(vv)
        for p in range(computed):
            k_cache[blocks[p // BS], p % BS] = kk[p]
            v_cache[blocks[p // BS], p % BS] = vv[p]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(n for _, n in seqs), HQ, D, generator=gen)
    k = torch.cat([kk[c:] for kk, (c, _) in zip(full_k, seqs)])
    v = torch.cat([vv[c:] for vv, (c, _) in zip(full_v, seqs)])
    return k_cache, v_cache, table, q, k, v, full_k, full_v


SEQS = [(5, 1), (12, 1), (3, 1), (0, 9), (6, 5), (8, 4)]


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("window", [None, 5])
def test_matches_dense_attention(backend, window):
    k_cache, v_cache, table, q, k, v, full_k, full_v = make_step(SEQS, fill=0.0)
    layout = BatchLayout.build([n for _, n in SEQS], [c for c, _ in SEQS])
    meta = AttentionMetadata.build(layout, table, BS, window)
    out = make_backend(backend).forward(q, k, v, k_cache, v_cache, meta)
    for i, (c, n) in enumerate(SEQS):
        s = layout.query_start[i]
        ref = dense_reference(q[s : s + n], full_k[i], full_v[i], torch.arange(c, c + n), window)
        torch.testing.assert_close(out[s : s + n], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", VARIANTS)
def test_poisoned_unwritten_slots(backend):
    """C1: the exact-length backend is unaffected by NaN in unwritten slots; the whole-block
    backend, which declares that it reads them, turns NaN (so zeroing is required for it)."""
    k_cache, v_cache, table, q, k, v, *_ = make_step(SEQS, fill=0.0)
    layout = BatchLayout.build([n for _, n in SEQS], [c for c, _ in SEQS])
    meta = AttentionMetadata.build(layout, table, BS)
    clean = make_backend(backend).forward(q, k, v, k_cache, v_cache, meta)
    k_cache, v_cache, *_ = make_step(SEQS, fill=float("nan"))
    poisoned = make_backend(backend).forward(q, k, v, k_cache, v_cache, AttentionMetadata.build(layout, table, BS))
    if make_backend(backend).reads_unwritten_slots:
        assert poisoned.isnan().any()
    else:
        assert torch.equal(clean, poisoned)


@pytest.mark.parametrize("backend", VARIANTS)
def test_many_decodes_match_dense_attention(backend):
    """Enough decodes that the PyTorch path splits them into several length buckets; shuffled order."""
    seqs = [(c, 1) for c in (17, 3, 30, 9, 22, 5, 26, 12, 1, 28, 7, 19, 14, 24, 2, 11, 29, 6, 20, 15)] + [(4, 3)]
    k_cache, v_cache, table, q, k, v, full_k, full_v = make_step(seqs, fill=0.0)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    meta = AttentionMetadata.build(layout, table, BS)
    attention = make_backend(backend)
    out = attention.forward(q, k, v, k_cache, v_cache, meta)
    if getattr(attention, "decode_kernel", None) is None:
        assert len(meta.derived[(attention.name, "decode")]) > 1
    for i, (c, n) in enumerate(seqs):
        s = layout.query_start[i]
        ref = dense_reference(q[s : s + n], full_k[i], full_v[i], torch.arange(c, c + n))
        torch.testing.assert_close(out[s : s + n], ref, rtol=1e-5, atol=1e-5)


def test_native_decode_kernel_builds_where_a_compiler_exists():
    """Where a C++ compiler and ninja exist the kernel must build, so the tests above exercise it."""
    if why_not_native() is not None:
        pytest.skip(f"native kernels cannot be built here ({why_not_native()}): only the PyTorch path runs")
    assert paged_decode_kernel() is not None
    assert BACKENDS["exact"](1.0).decode_kernel is not None


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


@pytest.mark.parametrize("portable", [False, True], ids=["native-default", "native-without-avx512"])
def test_16bit_caches_are_read_natively_on_every_avx2_cpu(portable):
    """A CPU with AVX2 + FMA + F16C (e.g. Zen 3, no AVX-512) decodes float16 and bfloat16 caches in
    the native kernel at head sizes 64, 128 and 256, with or without AVX-512."""
    if why_not_native() is not None:
        pytest.skip(f"native kernels cannot be built here ({why_not_native()})")
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    kernel = paged_decode_kernel(without_avx512=portable)
    for dtype in (torch.float16, torch.bfloat16):
        assert all(kernel.reads(torch.float32, dtype, head) for head in (64, 128, 256))
        assert not kernel.reads(torch.float32, dtype, 8)


@pytest.mark.parametrize("portable", [False, True], ids=["native-default", "native-without-avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 4), (64, 32), (8, 4)])
def test_decode_kernel_reads_every_cache_dtype_exactly(portable, dtype, head_size, block_size):
    """Both compiled paths of the decode kernel against dense attention over the cache's own
    (rounded) values: 3 query heads per KV head, windows (key_start > 0), partial first and last
    blocks, NaN in every unwritten slot. A path that cannot read a cache says so in `reads`, and
    calling it anyway is a clear error, not a wrong result."""
    if why_not_native() is not None:
        pytest.skip(f"native kernels cannot be built here ({why_not_native()})")
    kernel = paged_decode_kernel(without_avx512=portable)
    hq, hkv = 6, 2
    lens, starts = [1, 5, 16, 17, 40, 70, 33], [0, 0, 3, 0, 20, 9, 0]
    gen = torch.Generator().manual_seed(0)
    need = [-(-n // block_size) for n in lens]
    order = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    k_cache = torch.full((sum(need) + 1, block_size, hkv, head_size), float("nan")).to(dtype)
    v_cache = k_cache.clone()
    table = torch.zeros(len(lens), max(need), dtype=torch.int64)
    q = torch.randn(len(lens), hq, head_size, generator=gen)
    refs = []
    for i, (n, start) in enumerate(zip(lens, starts)):
        blocks, order = order[: need[i]], order[need[i]:]
        table[i, : need[i]] = torch.tensor(blocks)
        keys = torch.randn(n, hkv, head_size, generator=gen).to(dtype)
        values = torch.randn(n, hkv, head_size, generator=gen).to(dtype)
        for p in range(n):
            k_cache[blocks[p // block_size], p % block_size] = keys[p]
            v_cache[blocks[p // block_size], p % block_size] = values[p]
        k = keys[start:].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, D]
        v = values[start:].float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        weights = (q[i][:, None] @ k.transpose(1, 2) / math.sqrt(head_size)).softmax(-1)
        refs.append((weights @ v)[:, 0])
    out = torch.empty_like(q)
    args = (out, q, k_cache, v_cache, table, torch.tensor(starts), torch.tensor(lens), 1 / math.sqrt(head_size))
    if not kernel.reads(torch.float32, dtype, head_size):
        assert dtype != torch.float32  # float32 is read everywhere
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            kernel(*args)
        return
    kernel(*args)
    torch.testing.assert_close(out, torch.stack(refs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True], ids=["native-default", "native-without-avx512"])
@pytest.mark.parametrize("dtype,head_size,block_size", [(torch.float32, 64, 16), (torch.bfloat16, 128, 4),
                                                        (torch.float16, 64, 32)])
def test_verification_chains_attend_as_their_rows_alone(portable, dtype, head_size, block_size):
    """A speculative verification's rows (decodes of one sequence at consecutive lengths over the same
    blocks) are attended together, each K and V row read once for all of them: every row's output,
    with and without sinks, is the same bits as the row attended alone, and matches dense attention.
    Chains crossing chunk and block boundaries, one with a window (key_start > 0), one longer than an
    item takes (19 rows), beside plain decodes."""
    if why_not_native() is not None:
        pytest.skip(f"native kernels cannot be built here ({why_not_native()})")
    kernel = paged_decode_kernel(without_avx512=portable)
    if not kernel.reads(torch.float32, dtype, head_size):
        pytest.skip("this build does not read 16-bit caches")
    hq, hkv = 6, 2
    gen = torch.Generator().manual_seed(0)
    # (positions written, first length attended, rows, key start): a chain's row r attends first + r keys
    sequences = [(40, 40, 1, 0), (36, 30, 5, 0), (70, 66, 3, 9), (60, 41, 19, 0), (17, 17, 1, 0), (9, 7, 2, 0)]
    width = max(-(-n // block_size) for n, *_ in sequences)
    k_cache = torch.full((len(sequences) * width + 1, block_size, hkv, head_size), float("nan")).to(dtype)
    v_cache = k_cache.clone()
    order = (torch.randperm(len(sequences) * width, generator=gen) + 1).tolist()
    tables, starts, lens, refs = [], [], [], []
    for written, first, rows, start in sequences:
        blocks, order = order[:width], order[width:]
        keys = torch.randn(written, hkv, head_size, generator=gen).to(dtype)
        values = torch.randn(written, hkv, head_size, generator=gen).to(dtype)
        for p in range(written):
            k_cache[blocks[p // block_size], p % block_size] = keys[p]
            v_cache[blocks[p // block_size], p % block_size] = values[p]
        for r in range(rows):
            tables.append(blocks)
            starts.append(start)
            lens.append(first + r)
            refs.append((keys[start:first + r].float(), values[start:first + r].float()))
    q = torch.randn(len(lens), hq, head_size, generator=gen)
    table, key_start, seq_lens = torch.tensor(tables), torch.tensor(starts), torch.tensor(lens)
    scale = 1 / math.sqrt(head_size)
    for sinks in (None, torch.randn(hq, generator=gen)):
        out = torch.empty_like(q)
        kernel(out, q, k_cache, v_cache, table, key_start, seq_lens, scale, sinks=sinks)
        for i, (keys, values) in enumerate(refs):
            alone = torch.empty_like(q[i:i + 1])
            kernel(alone, q[i:i + 1], k_cache, v_cache, table[i:i + 1], key_start[i:i + 1], seq_lens[i:i + 1], scale,
                   sinks=sinks)
            assert torch.equal(out[i], alone[0]), f"row {i}"
            k = keys.repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, D]
            v = values.repeat_interleave(hq // hkv, 1).transpose(0, 1)
            logits = q[i][:, None] @ k.transpose(1, 2) * scale  # [Hq, 1, L]
            if sinks is not None:
                logits = torch.cat([logits, sinks[:, None, None]], -1)
            weights = logits.softmax(-1)[..., :k.shape[1]]
            torch.testing.assert_close(out[i], (weights @ v)[:, 0], rtol=1e-5, atol=1e-5)
