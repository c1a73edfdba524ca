"""The `triton` backend on the CPU: its kernel (attention/triton_paged.py) run by Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) against the exact-length backend on tiny paged steps
(prefill, decode, mixed, long contexts, sliding window, prefix hit, stale table entries), its C1
declaration under poison (it reads no unwritten slot), the same over int8, fp8, rotated 4-bit and
k8v4 caches read in place, tiny engines giving the exact backend's greedy tokens (plain and
quantized caches), and the same kernel compiled for a Hopper GPU (sm_90) out of interpreter mode.
(The MLA flavour's kernel parity and poison tests are tests/attention/test_mla.py's, which run
every MLA backend.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from unittest.mock import patch

import pytest
import torch

from blockserve import LLM
from blockserve.attention import kv_quant, triton_paged
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.triton_attention import TritonAttention
from blockserve.attention.triton_paged import (
    MAX_TILE_ELEMENTS,
    PREFILL_TILE,
    TRITON_UNAVAILABLE,
    interpreting,
    key_splits,
    paged_attention,
    tile_rows,
)
from blockserve.models.random_checkpoint import save_random_model
from tests.attention.test_flex_attention import MODELS, STEPS, engine_greedy_tokens, forward
from tests.attention.test_kv_quant import empty_cache
from tests.attention.test_paged_attention import BS, HKV, NUM_BLOCKS, D, make_step
from tests.models.conftest import tiny_model  # noqa: F401 a fixture

pytestmark = [pytest.mark.skipif(TRITON_UNAVAILABLE is not None, reason=f"Triton unavailable: {TRITON_UNAVAILABLE}"),
              pytest.mark.usefixtures("one_torch_thread")]

LONG = [(3, 1), (0, 40), (20, 19), (33, 1)]  # tiles of several rows, contexts of many pages


def test_runs_interpreted():
    assert interpreting(), "tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported"


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("step", sorted(STEPS) + ["long"])
def test_matches_exact_backend(step, window):
    seqs = LONG if step == "long" else STEPS[step]
    torch.testing.assert_close(forward("triton", seqs, window), forward("exact", seqs, window), rtol=1e-5, atol=1e-5)


def test_prefix_hit_shared_block():
    seqs = [(6, 1), (7, 3)]  # the second's first block (4 computed tokens) is the first's
    torch.testing.assert_close(forward("triton", seqs, share_first_block=True),
                               forward("exact", seqs, share_first_block=True), rtol=1e-5, atol=1e-5)


def test_stale_table_entries_are_ignored():
    """Entries past a sequence's last block (another sequence's block, a NaN free block) are not read."""
    seqs = STEPS["mixed"]
    k_cache, v_cache, table, q, k, v, *_ = make_step(seqs, fill=float("nan"))
    free = next(b for b in range(NUM_BLOCKS) if b not in table.unique().tolist())
    stale = torch.tensor([int(table[2, 1])] + [free] * (len(seqs) - 1))[:, None]
    table = torch.cat([table, stale], dim=1)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    outs = [BACKENDS[name](1 / math.sqrt(D)).forward(q, k, v, k_cache.clone(), v_cache.clone(),
                                                       AttentionMetadata.build(layout, table, BS))
            for name in ("triton", "exact")]
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seqs", [STEPS["mixed"], LONG], ids=["mixed", "long"])
def test_poison_c1(seqs, window):
    """C1: the page loads are masked to written slots (reads_unwritten_slots = False): with every
    unwritten slot NaN and nothing zeroed, the output is bit-identical to the clean run."""
    assert not TritonAttention.reads_unwritten_slots
    assert torch.equal(forward("triton", seqs, window, fill=float("nan")), forward("triton", seqs, window))


# A quantized cache's K and V codes (attention/kv_quant.py): one form for both, or int8 keys over 4-bit values
QUANTIZED = {"int8": (torch.int8,) * 2, "fp8": (torch.float8_e4m3fn,) * 2, "int4": (torch.uint8,) * 2,
             "k8v4": (torch.int8, torch.uint8)}


def quantized_step(seqs, dtype: str, poison: bool):
    """make_step's step over caches of `dtype`'s codes: every block but the null one poisoned (poison
    codes, NaN scales) or zeroed, then the earlier tokens written as codes and scales."""
    _, _, table, q, k, v, full_k, full_v = make_step(seqs, fill=0.0)
    caches = []
    for codes, full in zip(QUANTIZED[dtype], (full_k, full_v)):
        cache = empty_cache((NUM_BLOCKS, BS, HKV), D, codes)
        kv_quant.fill_rows(cache, 0, torch.arange(1, NUM_BLOCKS), poison=poison)
        for row, (computed, _), values in zip(table, seqs, full):
            pos = torch.arange(computed)
            kv_quant.write(cache.view(-1, HKV, cache.shape[-1]), row[pos // BS] * BS + pos % BS, values[:computed])
        caches.append(cache)
    return *caches, table, q, k, v


def exact_pytorch(scale: float):
    """The exact-length backend on its gathered PyTorch path (no native build needed)."""
    backend = BACKENDS["exact"](scale)
    backend.decode_kernel = None
    return backend


@pytest.mark.parametrize("dtype,window", [(d, None) for d in sorted(QUANTIZED)] + [("k8v4", 5)])
def test_quantized_caches_match_exact(dtype, window):
    """Over a quantized cache (codes read in place, scales folded in registers, 4-bit queries rotated
    and output un-rotated) the kernel gives the exact backend's attention over the dequantised cache to
    float32 rounding, decodes, tiles of several rows and many pages alike; every unwritten slot holds
    poison codes and NaN scales, and the output is bit-identical to that over a zeroed cache (C1)."""
    seqs = LONG
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    outs = {}
    for poison in (True, False):
        k_cache, v_cache, table, q, k, v = quantized_step(seqs, dtype, poison)
        meta = lambda: AttentionMetadata.build(layout, table, BS, window)  # noqa: E731 (a fresh one per call)
        outs[poison] = TritonAttention(1 / math.sqrt(D)).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta())
        if poison:
            want = exact_pytorch(1 / math.sqrt(D)).forward(q, k, v, k_cache, v_cache, meta())
    assert not outs[True].isnan().any()
    torch.testing.assert_close(outs[True], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("dtype", ["int8", "k8v4"])
def test_quantized_key_splits_match_exact(dtype):
    """Decode rows with their keys split over programs read quantized pages as one program does."""
    seqs = LONG_DECODES
    k_cache, v_cache, table, q, k, v = quantized_step(seqs, dtype, poison=True)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    want = exact_pytorch(1 / math.sqrt(D)).forward(q, k, v, k_cache, v_cache,
                                                   AttentionMetadata.build(layout, table, BS))
    got = paged_attention(torch.empty_like(q), q, k_cache, v_cache, AttentionMetadata.build(layout, table, BS),
                          1 / math.sqrt(D), splits=4)
    if kv_quant.is_rotated(v_cache):
        got = kv_quant.unrotate_output(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_quantized_caches_refused_where_not_read():
    """MLA's two-part keys read a quantized cache only as latent rows with their scales, and a cache
    whose rows do not hold the queries' head size is refused, each with a clear error rather than a
    wrong read."""
    seqs = STEPS["decode"]
    k_cache, v_cache, table, q, *_ = quantized_step(seqs, "int8", poison=False)
    meta = AttentionMetadata.build(BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs]), table, BS)
    with pytest.raises(ValueError, match="one-part keys with their own values, or as MLA's latent rows"):
        paged_attention(torch.empty_like(q), q, k_cache, k_cache, meta, 1.0, value_is_k1=True)
    with pytest.raises(ValueError, match="rows hold 8 values, the kernel reads 16"):
        wide = torch.cat([q, q], -1)
        paged_attention(torch.empty_like(wide), wide, k_cache, v_cache, meta, 1.0)


LONG_DECODES = [(299, 1), (150, 1), (3, 1)]  # contexts of several key steps each, and one of one


@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("splits", [2, 4])
def test_key_splits_match_exact(splits, window):
    """Decode rows with their keys split over several programs and combined (flash-decoding): the
    exact backend's output, unwritten slots NaN (nothing read), short contexts' empty splits included."""
    seqs = LONG_DECODES
    k_cache, v_cache, table, q, k, v, *_ = make_step(seqs, fill=float("nan"))
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    want = BACKENDS["exact"](1 / math.sqrt(D)).forward(q, k, v, k_cache, v_cache, AttentionMetadata.build(
        layout, table, BS, window))  # writes the step's K/V into the caches, which the kernel reads
    got = paged_attention(torch.empty_like(q), q, k_cache, v_cache, AttentionMetadata.build(layout, table, BS, window),
                          1 / math.sqrt(D), splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_key_splits_are_for_decode_steps_only():
    seqs = STEPS["mixed"]
    k_cache, v_cache, table, q, *_ = make_step(seqs, fill=0.0)
    meta = AttentionMetadata.build(BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs]), table, BS)
    with pytest.raises(ValueError, match="decode-only steps"):
        paged_attention(torch.empty_like(q), q, k_cache, v_cache, meta, 1.0, splits=2)


def test_key_split_choice():
    """About two programs per multiprocessor, a power of two, none for prefill tiles or short tables."""
    def meta(num_seqs, table_width):
        layout = BatchLayout.build([1] * num_seqs, [5] * num_seqs)
        return AttentionMetadata.build(layout, torch.ones(num_seqs, table_width, dtype=torch.int64), 16)

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    with patch.object(triton_paged, "_multiprocessors", lambda device: 132 if device.type == "cuda" else 0):
        assert key_splits(meta(1, 256), 1, 8, gpu) == 16  # batch 1, 8 KV heads: 16 splits (MAX_SPLITS)
        assert key_splits(meta(4, 256), 1, 32, gpu) == 8  # 264 // 32 = 8
        assert key_splits(meta(64, 256), 1, 512, gpu) == 1
        assert key_splits(meta(1, 32), 1, 8, gpu) == 2  # 512 keys at most: two splits of 256
        assert key_splits(meta(1, 256), 16, 8, gpu) == 1  # a prefill tile
        assert key_splits(meta(1, 256), 1, 8, cpu) == 1


def test_strided_queries():
    """Queries sliced out of a wider projection (rows not contiguous) read the right elements."""
    seqs = STEPS["mixed"]
    k_cache, v_cache, table, q, k, v, *_ = make_step(seqs, fill=0.0)
    wide = torch.cat([q, torch.randn_like(q)], dim=-1)[..., : q.shape[-1]]
    assert not wide.is_contiguous()
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
    meta = lambda: AttentionMetadata.build(layout, table, BS)  # noqa: E731 (a fresh one per call)
    backend = TritonAttention(1 / math.sqrt(D))
    torch.testing.assert_close(backend.forward(wide, k, v, k_cache.clone(), v_cache.clone(), meta()),
                               backend.forward(q.contiguous(), k, v, k_cache.clone(), v_cache.clone(), meta()))


@pytest.mark.parametrize("family", sorted(MODELS) + ["deepseek_v3"])
def test_engine_greedy_tokens_equal_exact(family, tmp_path, tiny_model):
    """The greedy tokens of attention_backend='triton' equal 'exact''s (engine_greedy_tokens: chunked
    prefill, prefix hits, poison on, no zeroing for triton's groups)."""
    if family in MODELS:
        save_random_model(MODELS[family](), tmp_path)
        path = tmp_path
    else:
        path = tiny_model(family)[0]
    tokens = engine_greedy_tokens(path, ("exact", "triton"))
    assert tokens["triton"] == tokens["exact"]


@pytest.mark.slow  # two engines, one through Triton's interpreter: 3-6 s a dtype on 2 cores
@pytest.mark.parametrize("dtype", sorted(QUANTIZED))
def test_engine_greedy_tokens_equal_exact_on_quantized_caches(dtype, tmp_path):
    """With a quantized KV cache, poison on and no zeroing for triton's groups (engine_greedy_tokens),
    attention_backend='triton' gives 'exact''s greedy tokens over the same dtype."""
    save_random_model(MODELS["llama"](), tmp_path)
    tokens = engine_greedy_tokens(tmp_path, ("exact", "triton"), kv_cache_dtype=dtype)
    assert tokens["triton"] == tokens["exact"]


# One child process, Triton out of interpreter mode (no GPU needed): the kernel of each launch the GPU
# check's families make, compiled for sm_90 by Triton's compiler and ptxas; and the CPU's refusal.
COMPILE_CHILD = textwrap.dedent("""
    import json, torch
    from blockserve.attention.metadata import AttentionMetadata, BatchLayout
    from blockserve.attention.triton_attention import TritonAttention
    from blockserve.attention.triton_paged import compile_for

    def meta_for(seqs, window=None):
        layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs])
        width = max(-(-(c + n) // 16) for c, n in seqs)
        table = torch.arange(1, 1 + len(seqs) * width).view(len(seqs), width)
        return AttentionMetadata.build(layout, table, 16, window)

    def attention(dtype, hq, hkv, d, window, seqs, splits=1):
        meta = meta_for(seqs, window)
        q, cache = torch.empty(meta.slot_mapping.shape[0], hq, d, dtype=dtype), torch.empty(64, 16, hkv, d, dtype=dtype)
        return compile_for(90, torch.empty_like(q), q, cache, cache, meta, d ** -0.5, splits=splits)

    def mla(dtype, h, r, dr, seqs, splits=1):
        meta = meta_for(seqs)
        t = meta.slot_mapping.shape[0]
        q, q_rope = torch.empty(t, h, r, dtype=dtype), torch.empty(t, h, dr, dtype=dtype)
        pages = torch.empty(64, 16, r + dr, dtype=dtype)[:, :, None]
        return compile_for(90, torch.empty_like(q), q, pages[..., :r], pages[..., :r], meta, 0.1, q2=q_rope,
                           k2=pages[..., r:], value_is_k1=True, splits=splits)

    def quantized(k_codes, v_codes, seqs, splits=1):  # llama_1b's widths over quantized caches, bfloat16 queries
        meta = meta_for(seqs)
        q = torch.empty(meta.slot_mapping.shape[0], 32, 64, dtype=torch.bfloat16)
        k, v = (torch.empty(64, 16, 8, 36 if codes == torch.uint8 else 66, dtype=torch.uint8).view(codes)
                for codes in (k_codes, v_codes))
        return compile_for(90, torch.empty_like(q), q, k, v, meta, 0.125, splits=splits)

    def mla_quantized(codes, seqs):  # DeepSeek-V3's widths over a one-byte latent cache, bfloat16 queries
        meta = meta_for(seqs)
        t = meta.slot_mapping.shape[0]
        q, q_rope = torch.empty(t, 128, 512, dtype=torch.bfloat16), torch.empty(t, 128, 64, dtype=torch.bfloat16)
        pages = torch.empty(64, 16, 1, 512 + 64 + 4, dtype=torch.uint8)
        scales = pages[..., -4:].view(torch.float16)
        pages = pages.view(codes)
        return compile_for(90, torch.empty_like(q), q, pages[..., :512], pages[..., :512], meta, 0.1, q2=q_rope,
                           k2=pages[..., 512:576], value_is_k1=True, key_scales=scales)

    decode, mixed = [(30, 1)] * 4, [(30, 1), (0, 40), (17, 9)]
    kernels = {}
    # each code form on each side, in decode and prefill tiles and with key splits
    kernels["int8_decode"] = quantized(torch.int8, torch.int8, decode)
    kernels["fp8_mixed"] = quantized(torch.float8_e4m3fn, torch.float8_e4m3fn, mixed)
    kernels["int4_decode_split"] = quantized(torch.uint8, torch.uint8, decode, splits=8)
    kernels["k8v4_mixed"] = quantized(torch.int8, torch.uint8, mixed)
    kernels["mla_fp8_mixed"] = mla_quantized(torch.float8_e4m3fn, mixed)  # both parts' codes bitcast, two scales
    for dtype in (torch.bfloat16, torch.float32):
        for name, seqs in (("decode", decode), ("mixed", mixed)):
            key = f"{str(dtype)[6:]}_{name}"
            kernels[f"llama_1b_{key}"] = attention(dtype, 32, 8, 64, None, seqs)  # the throughput model
            kernels[f"gemma3_window_{key}"] = attention(dtype, 4, 2, 16, 6, seqs)
            kernels[f"mla_deepseek_v3_{key}"] = mla(dtype, 128, 512, 64, seqs)  # the real model's widths
            kernels[f"mla_tiny_{key}"] = mla(dtype, 4, 16, 4, seqs)
        key = f"{str(dtype)[6:]}_decode_split"  # small batches of long contexts: key splits and their combine
        kernels[f"llama_1b_{key}"] = attention(dtype, 32, 8, 64, None, decode, splits=8)
        kernels[f"mla_deepseek_v3_{key}"] = mla(dtype, 128, 512, 64, decode, splits=4)
    meta = meta_for(decode)
    q = torch.zeros(4, 4, 16)
    try:
        cache = torch.zeros(16, 16, 2, 16)
        TritonAttention(0.25).forward(q, q[:, :2], q[:, :2], cache, cache.clone(), meta)
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    print(json.dumps({"refusal": refusal, "kernels": {f"{name}/{i}": {"cubin": len(k.asm["cubin"]),
                                                                       "shared": k.metadata.shared}
                                                      for name, compiled in kernels.items()
                                                      for i, k in enumerate(compiled)}}))
""")

HOPPER_SHARED_MEMORY = 232448  # bytes of shared memory one block may use on sm_90


def test_compiles_for_hopper():
    """The kernels a GPU run launches compile for sm_90 (Triton's compiler and its ptxas, no GPU),
    quantized caches' included, each within Hopper's shared memory; and the CPU out of interpreter mode
    is refused clearly."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert "TRITON_INTERPRET=1" in report["refusal"]
    assert len(report["kernels"]) == 16 + 2 * 2 * 2 + 5 + 1  # the split variants: attention and combine kernels
    for name, kernel in report["kernels"].items():
        assert kernel["cubin"] > 0, name
        assert kernel["shared"] <= HOPPER_SHARED_MEMORY, (name, kernel["shared"])


@pytest.mark.parametrize("heads, width", [(1, 16), (2, 32), (8, 576), (16, 576), (4, 64), (3, 80)])
def test_tiles_are_powers_of_two(heads, width):
    meta = AttentionMetadata.build(BatchLayout.build([1, 9], [4, 0]), torch.ones(2, 4, dtype=torch.int64), BS)
    rows = tile_rows(meta, heads, width)
    assert 1 <= rows <= PREFILL_TILE and rows & (rows - 1) == 0 and rows * heads * width <= max(MAX_TILE_ELEMENTS,
                                                                                                heads * width)
    decode_only = AttentionMetadata.build(BatchLayout.build([1, 1], [4, 7]), torch.ones(2, 4, dtype=torch.int64), BS)
    assert tile_rows(decode_only, heads, width) == 1


def test_an_engine_that_cannot_run_the_backend_refuses_at_start(tmp_path, monkeypatch):
    """Outside Triton's interpreter a CPU engine with attention_backend='triton' fails when it is built,
    saying what to do, instead of failing its first request; so does one without Triton installed."""
    save_random_model(MODELS["llama"](), tmp_path)
    monkeypatch.setattr(triton_paged, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="attention_backend 'triton' cannot run on cpu: .*TRITON_INTERPRET=1"):
        LLM(str(tmp_path), attention_backend="triton", kv_cache_memory="1MiB")
    monkeypatch.setattr(triton_paged, "TRITON_UNAVAILABLE", "the triton package is not installed; pip install triton")
    with pytest.raises(ValueError, match="pip install triton"):
        LLM(str(tmp_path), attention_backend="triton", kv_cache_memory="1MiB")
