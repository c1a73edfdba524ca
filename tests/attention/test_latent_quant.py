"""MLA's quantized latent caches (attention/latent_quant.py: int8, fp8): the round trip's error,
one scale per part against one per row, zero and poison rows (and the worker's tensors' fills), and
every MLA backend (triton's kernel in Triton's interpreter) over such a cache against the same
backend over the dequantised cache, with poisoned unwritten rows (C1)."""

from __future__ import annotations

import pytest
import torch

from blockserve import LLM, SamplingParams
from blockserve.attention import kv_quant, latent_quant
from blockserve.attention.mla import MLA_BACKENDS
from blockserve.attention.triton_paged import TRITON_UNAVAILABLE
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import MLASpec
from blockserve.worker.kv_tensors import KVCacheTensors
from tests.attention.test_mla import DN, SCALE, make_step
from tests.models.conftest import tiny_model  # noqa: F401 (a fixture)

CODES = pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
R, DR = 32, 16
E4M3_HALF_STEP = 2.0**-4  # 3 mantissa bits: rounding to nearest is within 2^-4 of the value
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # below 2^-6, codes are spaced 2^-9 apart (in units of the scale)


def latent_rows(n: int = 256, rope_magnitude: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalised latents [n, R] (as kv_a_layernorm gives them) and rope keys [n, DR] of RMS
    `rope_magnitude`."""
    gen = torch.Generator().manual_seed(2)
    c = torch.randn(n, R, generator=gen)
    c = c / c.pow(2).mean(-1, keepdim=True).sqrt()
    return c, torch.randn(n, DR, generator=gen) * rope_magnitude


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).mean().item()


@CODES
@pytest.mark.parametrize("rope_magnitude", [0.05, 1.0, 20.0])
def test_each_part_comes_back_within_its_own_step(codes, rope_magnitude):
    """Each value comes back within half its part's quantisation step: int8 within scale / 2, e4m3
    within 2^-4 of itself (2^-10 scale near zero), plus the float16 scale's rounding, whatever the
    other part's magnitude. Codes stay in range and the rows hold R + DR codes and two scales."""
    c, kr = latent_rows(rope_magnitude=rope_magnitude)
    rows = latent_quant.encode(c, kr, codes)
    assert rows.dtype == codes and rows.shape == (256, R + DR + latent_quant.SCALES_BYTES)
    back = latent_quant.decode(rows, R, torch.float32)
    scales = latent_quant.scales(rows).float()
    for part, got, scale in ((c, back[:, :R], scales[:, :1]), (kr, back[:, R:], scales[:, 1:])):
        torch.testing.assert_close(scale, part.abs().amax(-1, keepdim=True) / kv_quant.CODE_MAX[codes],
                                   rtol=2**-10, atol=0)
        rounding = part.abs() * 2**-10  # the float16 scale's rounding moves every code's value
        if codes == torch.int8:
            bound = scale / 2 * (1 + 1e-6) + rounding
        else:
            bound = torch.maximum(part.abs() * E4M3_HALF_STEP, scale * E4M3_SUBNORMAL_HALF_STEP) + rounding
        assert ((got - part).abs() <= bound).all()
    if codes == torch.int8:
        assert rows[:, :R + DR].abs().max() == 127 and rows[:, :R + DR].min() >= -127


def test_one_scale_per_part_against_one_per_row(tiny_model):
    """The layout's choice, measured on the tiny DeepSeek-V3 model's own cached rows (and with their
    rope keys scaled 4x and 10x): with its own scale each part's int8 error does not depend on the
    other's magnitude; with one scale per row the latent's grows with the rope key's. The figures
    are latent_quant.py's."""
    path, _ = tiny_model("deepseek_v3")
    llm = LLM(str(path), block_size=4, kv_cache_memory="1MiB", enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (40,), generator=gen).tolist() for _ in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    cache = llm.engine.core.runner.kv.tensors[0][0]
    rows = cache.reshape(-1, cache.shape[-1])
    rows = rows[rows.abs().sum(-1) > 0]  # the written rows
    c, kr = rows[:, :R], rows[:, R:]
    own, shared = {}, {}
    for scale_up in (1, 4, 10):
        for codes in (torch.int8, torch.float8_e4m3fn):
            parts = latent_quant.decode(latent_quant.encode(c, kr * scale_up, codes), R, torch.float32)
            one = kv_quant.decode(kv_quant.encode(torch.cat([c, kr * scale_up], -1), codes), torch.float32)
            own[scale_up, codes] = relative_error(parts[:, :R], c)
            shared[scale_up, codes] = relative_error(one[:, :R], c)
            print(f"k_rope x{scale_up} {codes}: latent's relative error {own[scale_up, codes]:.4f} with its own "
                  f"scale, {shared[scale_up, codes]:.4f} with the row's")
    assert rows.shape[0] > 100 and kr.pow(2).mean() > c.pow(2).mean()  # k_rope is the larger part here
    for key in own:
        assert own[key] <= shared[key]
        assert own[key] == own[(1, key[1])]  # untouched by the rope key's magnitude
    assert shared[1, torch.int8] > 1.2 * own[1, torch.int8]
    assert shared[10, torch.int8] > 10 * own[10, torch.int8]


@CODES
def test_zero_and_poison_rows(codes):
    """A zeroed row decodes to zeros; a poisoned one, scales included, to NaN in every value; other
    rows are untouched."""
    c, kr = latent_rows(8)
    cache = latent_quant.encode(c, kr, codes).view(2, 4, -1).clone()  # [blocks, bs, row]
    latent_quant.fill_rows(cache, 0, torch.tensor([1]), poison=True)
    assert latent_quant.decode(cache[1], R, torch.float32).isnan().all()
    assert latent_quant.scales(cache[1]).isnan().all()
    torch.testing.assert_close(latent_quant.decode(cache[0], R, torch.float32),
                               latent_quant.decode(latent_quant.encode(c[:4], kr[:4], codes), R, torch.float32))
    latent_quant.fill_rows(cache, 0, torch.tensor([1]), poison=False)
    assert (latent_quant.decode(cache[1], R, torch.float32) == 0).all()


def quantized_step(codes: torch.dtype, fill: float):
    """test_mla's step over a cache of `codes` rows (earlier tokens written as codes; with fill NaN,
    every unwritten row poisoned, codes and scales), and the same step over a float32 cache holding
    their dequantised values, with the step's own rows dequantised too."""
    plain, meta, q, c, kr, w_uk, w_uv, *_ = make_step(fill)
    rank = c.shape[-1]
    flat = plain.flatten(0, 1)
    unwritten = flat.isnan().any(-1)
    quantized = latent_quant.encode(flat[:, :rank].nan_to_num(0.0), flat[:, rank:].nan_to_num(0.0), codes)
    latent_quant.fill_rows(quantized, 0, unwritten.nonzero().flatten(), poison=True)
    dequantised = latent_quant.decode(quantized, rank, torch.float32).nan_to_num(0.0)
    step_rows = latent_quant.decode(latent_quant.encode(c, kr, codes), rank, torch.float32)
    inputs = meta, q, w_uk, w_uv
    return (quantized.view(*plain.shape[:2], -1), c, kr), (dequantised.view(plain.shape), step_rows[:, :rank],
                                                           step_rows[:, rank:]), inputs


NEEDS_TRITON = pytest.mark.skipif(TRITON_UNAVAILABLE is not None, reason=f"Triton: {TRITON_UNAVAILABLE}")
# Triton's interpreter takes ~2 s a case here: fp8 joins under backend_full (the fp8 launch compiles for
# sm_90 in test_triton_attention.py, and its bitcast reads are tested there on attention caches).
BACKEND_CODES = pytest.mark.parametrize("backend,codes", [
    *(pytest.param(b, c, id=f"{b}-{n}") for b in sorted(set(MLA_BACKENDS) - {"triton"})
      for c, n in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8"))),
    pytest.param("triton", torch.int8, marks=NEEDS_TRITON, id="triton-int8"),
    pytest.param("triton", torch.float8_e4m3fn, marks=[NEEDS_TRITON, pytest.mark.slow, pytest.mark.backend_full],
                 id="triton-fp8")])


@BACKEND_CODES
def test_backend_over_quantized_cache_equals_dequantised(backend, codes):
    """Over a quantized latent cache every backend gives its own attention over the dequantised
    cache (the step's rows dequantised as written) to float32 rounding, decodes and prefill chunks
    alike, and writes the step's rows as codes. With every unwritten row poisoned (codes and
    scales), a backend that reads only written rows is bit-identical to the zeroed cache's output;
    one that reads whole blocks turns NaN (C1: its blocks must be zeroed)."""
    backend_cls = MLA_BACKENDS[backend]
    outs = {}
    for poison in (False, True):
        (quantized, c, kr), (dequantised, c_back, kr_back), (meta, q, w_uk, w_uv) = quantized_step(
            codes, float("nan") if poison else 0.0)
        outs[poison] = backend_cls(SCALE).forward(q[..., :DN], q[..., DN:], c, kr, w_uk, w_uv, quantized, meta)
        if not poison:
            want = backend_cls(SCALE).forward(q[..., :DN], q[..., DN:], c_back, kr_back, w_uk, w_uv, dequantised,
                                              meta)
            torch.testing.assert_close(outs[False], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(quantized.flatten(0, 1)[meta.slot_mapping].view(torch.uint8),
                               latent_quant.encode(c, kr, codes).view(torch.uint8))
    if backend_cls.reads_unwritten_slots:
        assert outs[True].isnan().any()
    else:
        assert torch.equal(outs[True], outs[False])


@CODES
def test_worker_tensors_zero_and_poison_quantized_latent_blocks(codes):
    """The engine's KV tensors for a quantized MLA group: rows of R + DR codes and two scales; poison
    mode makes every block but the null one decode to NaN (scales included), and a zero order makes a
    block decode to zeros, in every layer."""
    spec = MLASpec(4, R, DR, {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn"}[codes])
    group = KVCacheGroup(spec, 6, True, ("layers.0", "layers.1"))
    kv = KVCacheTensors(KVCacheConfig((group,), poison_freed_blocks=True), device="cpu")
    (tensor,), = kv.tensors
    assert tensor.dtype == codes and tensor.shape == (2, 7, 4, spec.row_bytes) and spec.row_bytes == R + DR + 4
    values = latent_quant.decode(tensor, R, torch.float32)  # [layers, blocks + scratch, bs, R + DR]
    assert (values[:, 0] == 0).all() and values[:, 1:6].isnan().all()
    kv.zero_blocks(0, [2, 4])
    values = latent_quant.decode(tensor, R, torch.float32)
    assert (values[:, [2, 4]] == 0).all() and values[:, [1, 3, 5]].isnan().all()
