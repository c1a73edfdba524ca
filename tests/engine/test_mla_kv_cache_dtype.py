"""kv_cache_dtype int8 and fp8 on MLA layers (attention/latent_quant.py) through the whole engine, on
the tiny DeepSeek-V3 model (tests/models/conftest.py: 3 MLA layers, kv_lora_rank 32, rope dim 16).

A token's latent row is 52 bytes quantized (48 codes, two float16 scales) against 192 in float32,
so the same memory holds 3.69x the tokens (1.85x float16's). Through recycled poisoned blocks the
derived zeroing keeps every epoch's tokens those of an unpoisoned engine; with zeroing forced off a
backend that reads whole blocks breaks (C1). Prefix caching on and off give the same tokens (C4: a
cold prompt attends its dequantised rows). Quantisation changes the logits, so against the float32
cache the test holds teacher-forced next-token distributions to a KL and a top-1 agreement bound,
not to equality. Kimi Linear's recurrent states stay float32 beside an int8 latent cache; int4 and
K/V splits are refused for MLA naming the choice, and so is fp8 where the triton kernel cannot read it.
"""

from __future__ import annotations

import pytest
import torch

from blockserve import LLM, SamplingParams
from blockserve.attention.context import ForwardContext
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.mla import MLA_BACKENDS, MLAttention
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.core import refuse_unreadable_kv_dtype
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import LinearStateSpec, MLASpec, with_kv_cache_dtype
from blockserve.models.loader import load_model
from blockserve.worker.kv_tensors import KVCacheTensors
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 (a fixture)
from tests.scenarios import engine_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MLA_LAYERS, ROW_VALUES = 3, 32 + 16
ROW_BYTES = {"auto": 4 * ROW_VALUES, "int8": ROW_VALUES + 4, "fp8": ROW_VALUES + 4}
STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
BS = 4


@pytest.fixture(scope="module")
def deepseek(tiny_model) -> str:
    path, _ = tiny_model("deepseek_v3")
    return str(path)


def blocks(llm: LLM) -> int:
    return sum(g.num_blocks for g in llm.engine.core.kv_config.groups)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_latent_cache_holds_codes_and_scales(deepseek, dtype):
    """The cache tensor holds rows of codes and scales, the same memory holds 3.69x the float32
    cache's tokens, and the capacity report says so against float16 (1.85x)."""
    memory = dict(block_size=BS, kv_cache_memory="1MiB")
    quantized, full = LLM(deepseek, kv_cache_dtype=dtype, **memory), LLM(deepseek, **memory)
    (tensor,), = quantized.engine.core.runner.kv.tensors
    assert tensor.dtype == STORED[dtype] and tensor.shape[-1] == ROW_BYTES[dtype]
    assert blocks(quantized) >= ROW_BYTES["auto"] / ROW_BYTES[dtype] * blocks(full) - 1
    report = quantized.engine.core.kv_config.capacity_report()
    assert f"of {dtype} (" in report and "1.85x float16" in report


SLOW = [pytest.mark.slow, pytest.mark.backend_full]


@pytest.mark.parametrize("backend", ["whole_block", *(pytest.param(b, marks=SLOW) for b in ("exact", "flex"))])
def test_float16_and_bfloat16_latents_are_stored_as_asked(deepseek, backend):
    """A float kv_cache_dtype is honoured for the latent rows too: half the float32 row, twice the
    tokens in the same memory, and through recycled poisoned blocks every epoch gives the unpoisoned
    engine's tokens (their closeness to the float32 cache is test_quantized_latents_stay_close_to_the_float32_cache's)."""
    full = LLM(deepseek, block_size=BS, kv_cache_memory="1MiB")
    for dtype in ("float16", "bfloat16"):
        llm = LLM(deepseek, block_size=BS, kv_cache_memory="1MiB", kv_cache_dtype=dtype)
        (tensor,), = llm.engine.core.runner.kv.tensors
        assert tensor.dtype == getattr(torch, dtype) and tensor.shape[-1] == ROW_VALUES
        assert blocks(llm) >= 2 * blocks(full) - 1
        options = dict(small_cache("auto"), kv_cache_dtype=dtype, attention_backend=backend,
                       kv_cache_memory=18 * MLA_LAYERS * BS * ROW_VALUES * 2)
        want = epochs(LLM(deepseek, **options), 1)
        assert epochs(LLM(deepseek, poison=True, **options), 2) == want * 2


def test_recurrent_states_stay_float32_beside_an_int8_latent_cache(tiny_model):
    path, _ = tiny_model("kimi_linear")
    llm = LLM(str(path), kv_cache_dtype="int8", kv_cache_memory="16MiB", max_model_len=192)
    specs = {type(g.spec): g.spec for g in llm.engine.core.kv_config.groups}
    assert specs[MLASpec].dtype == "int8" and set(specs[LinearStateSpec].dtypes) == {"float32"}


def small_cache(dtype: str) -> dict:
    """18 blocks of 4 tokens (one request of max_model_len 64): far fewer than engine_prompts() need
    at once, so blocks recycle within an epoch."""
    return dict(block_size=BS, max_model_len=64, kv_cache_memory=18 * MLA_LAYERS * BS * ROW_BYTES[dtype],
                kv_cache_dtype=dtype)


def epochs(llm: LLM, count: int) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=10)
    return [[o.outputs[0].token_ids for o in llm.generate(engine_prompts(VOCAB), params, use_tqdm=False)]
            for _ in range(count)]


PER_BACKEND = pytest.mark.parametrize("backend,dtype", [
    ("whole_block", "int8"),
    *(pytest.param(b, d, marks=SLOW) for b, d in (("whole_block", "fp8"), ("exact", "int8"), ("exact", "fp8"),
                                                 ("flex", "int8"), ("triton", "int8"), ("triton", "fp8")))])


@PER_BACKEND
def test_recycled_poisoned_latent_blocks(deepseek, backend, dtype):
    """C1 on quantized latent rows: every garbage block holds poison codes and NaN scales. With the
    derived zeroing every epoch gives the unpoisoned engine's tokens; with zeroing forced off a
    backend that reads only written rows still does, and one that reads whole blocks breaks."""
    options = small_cache(dtype)
    want = epochs(LLM(deepseek, **options), 1)[0]
    loaded = load_model(deepseek, BACKENDS[backend])
    assert epochs(LLM(loaded, attention_backend=backend, poison=True, **options), 3) == [want] * 3
    unzeroed = epochs(LLM(loaded, attention_backend=backend, poison=True, unsafe_disable_zeroing=True, **options), 2)
    if MLA_BACKENDS[backend].reads_unwritten_slots:
        assert unzeroed != [want] * 2
    else:
        assert unzeroed == [want] * 2


@pytest.mark.parametrize("backend,dtype", [("exact", "fp8"), pytest.param("whole_block", "int8", marks=SLOW)])
def test_prefix_caching_on_equals_off(deepseek, backend, dtype):
    """C4: a prefix hit reads the stored codes; a cold prompt attends its own rows dequantised, the
    same values, so the tokens do not change."""
    options = dict(small_cache(dtype), kv_cache_memory="1MiB", attention_backend=backend, poison=True)
    off = epochs(LLM(deepseek, enable_prefix_caching=False, **options), 1)[0]
    cached = LLM(deepseek, enable_prefix_caching=True, **options)
    assert epochs(cached, 2) == [off, off]
    assert cached.engine.core.scheduler.kv.prefix_cache_stats().hits > 0


# -- against the float32 cache ---------------------------------------------------------------------

SEQS, LENGTH, PREFILL = 4, 48, 16  # a 16-token prefill, then 32 decode steps reading the cache
# (mean KL(float32 || dtype) at most, top-1 agreement at least), about 2.5x from what was measured:
# int8 3.7e-3 and 0.94, fp8 0.074 and 0.77 over these 192 positions. This random model is that
# sensitive with any cache: full attention's int8 and fp8 caches on tests/engine/test_kv_cache_dtype.py's
# random Llama measure 1.3e-3 / 0.96 and 0.025 / 0.85 the same way. A float16 latent cache (rounding
# 2^-11, not 2^-8 of int8's step) measures below 1e-4.
BOUNDS = {"int8": (1e-2, 0.85), "float8_e4m3fn": (0.2, 0.6), "float16": (1e-4, 0.97)}


@torch.inference_mode()
def teacher_forced_logprobs(model, stored: str | None, tokens: list[list[int]]) -> torch.Tensor:
    """Next-token log-probabilities [SEQS * LENGTH, vocab] of `tokens` through a paged cache (the
    model's one KV group: MLA latents, or full attention's K/V) stored as `stored` (None: the model's
    dtype): each sequence's first PREFILL tokens in one step, then one token a step."""
    (spec,) = set(model.kv_cache_specs(BS).values())
    spec = spec if stored is None else spec.with_dtype(stored)
    per_seq = LENGTH // BS
    kv = KVCacheTensors(KVCacheConfig((KVCacheGroup(spec, SEQS * per_seq + 1, False,
                                                    tuple(model.kv_cache_specs(BS))),)), device="cpu")
    table = torch.arange(1, SEQS * per_seq + 1).view(SEQS, per_seq)
    logprobs = torch.empty(SEQS, LENGTH, model.config.vocab_size)
    computed = 0
    for end in [PREFILL, *range(PREFILL + 1, LENGTH + 1)]:
        layout = BatchLayout.build([end - computed] * SEQS, [computed] * SEQS)
        ctx = ForwardContext(kv.layer_caches(), [AttentionMetadata.build(layout, table, BS)])
        ids = torch.tensor([t for row in tokens for t in row[computed:end]])
        logits = model.compute_logits(model(ids, layout.positions, ctx)).float()
        logprobs[:, computed:end] = logits.view(SEQS, end - computed, -1).log_softmax(-1)
        computed = end
    return logprobs.flatten(0, 1)


def test_quantized_latents_stay_close_to_the_float32_cache(deepseek):
    """Teacher-forced over the same tokens (each decode step reads the cache), the next-token
    distributions over int8, fp8 and float16 latent caches stay within BOUNDS of the float32 cache's:
    mean KL(float32 || dtype) and the share of positions whose most likely token is the same.
    Quantisation changes the logits, so these are bounds, not equality; the order float16 < int8 <
    fp8 follows each form's rounding."""
    model = load_model(deepseek, BACKENDS["exact"]).model
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (SEQS, LENGTH), generator=gen).tolist()
    reference = teacher_forced_logprobs(model, None, tokens)
    kl = {}
    for stored, (max_kl, min_top1) in BOUNDS.items():
        got = teacher_forced_logprobs(model, stored, tokens)
        kl[stored] = (reference.exp() * (reference - got)).sum(-1).mean().item()
        top1 = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
        print(f"{stored}: mean KL {kl[stored]:.2e}, top-1 agreement {top1:.3f}")
        assert 0 < kl[stored] <= max_kl and top1 >= min_top1
    assert kl["float16"] < kl["int8"] < kl["float8_e4m3fn"]


@pytest.mark.model_quality
def test_full_attention_caches_are_as_sensitive_on_a_random_llama(tmp_path):
    """The BOUNDS' context: the same teacher-forced measure of full attention's int8 and fp8 caches on
    tests/engine/test_kv_cache_dtype.py's random Llama (head size 64) gives KL of the same order, so
    the MLA figures reflect how sensitive random models are, not a flaw of the latent form."""
    from transformers import LlamaConfig

    from blockserve.models.random_checkpoint import save_random_model
    from tests.engine.test_kv_cache_dtype import CONFIG

    save_random_model(LlamaConfig(**CONFIG), tmp_path)
    model = load_model(str(tmp_path), BACKENDS["exact"]).model
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (SEQS, LENGTH), generator=gen).tolist()
    reference = teacher_forced_logprobs(model, None, tokens)
    for stored, (max_kl, min_top1) in BOUNDS.items():
        got = teacher_forced_logprobs(model, stored, tokens)
        kl = (reference.exp() * (reference - got)).sum(-1).mean().item()
        top1 = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
        print(f"full attention {stored}: mean KL {kl:.2e}, top-1 agreement {top1:.3f}")
        assert kl <= max_kl and top1 >= min_top1


# -- refusals --------------------------------------------------------------------------------------

def test_unbuilt_latent_dtypes_are_refused_naming_them(deepseek):
    """int4 latents and K/V splits are refused when the spec is made (and the engine with it), naming
    the choice; int8 and fp8 give quantized specs."""
    spec = MLASpec(16, 32, 16)
    assert with_kv_cache_dtype(spec, "fp8") == MLASpec(16, 32, 16, "float8_e4m3fn")
    assert with_kv_cache_dtype(spec, "int8").page_size_bytes == 16 * (48 + 4)
    assert with_kv_cache_dtype(spec, "float16") == MLASpec(16, 32, 16, "float16")
    with pytest.raises(ValueError, match="'int4' is not built for MLA layers' latent cache; its quantized forms "
                                         "are int8, fp8"):
        with_kv_cache_dtype(spec, "int4")
    for options in (dict(kv_cache_dtype="k8v4"), dict(kv_cache_dtype="auto", k_cache_dtype="int8"),
                    dict(kv_cache_dtype="int8", v_cache_dtype="auto")):
        with pytest.raises(ValueError, match="MLA layer's latent row is its keys and values both"):
            with_kv_cache_dtype(spec, **options)
    with pytest.raises(ValueError, match="must be even"):
        MLASpec(16, 31, 16, "int8")
    with pytest.raises(ValueError, match="'int4' is not built for MLA"):
        LLM(deepseek, kv_cache_dtype="int4", kv_cache_memory="1MiB")


def test_fp8_latents_on_a_gpu_older_than_sm89_are_refused_for_triton(monkeypatch):
    """The triton MLA kernel converts e4m3 codes on sm_89 and newer only: an older GPU (capability
    stubbed) refuses fp8 latents at start-up naming the backend, the dtype and int8; int8 passes."""
    mla = MLAttention("layers.0", 4, 16, 16, MLA_BACKENDS["triton"](0.125), kv_lora_rank=32, qk_rope_head_dim=16,
                      dtype=torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    gpu = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"'float8_e4m3fn' cannot be read by attention backend 'triton' on cuda:0 "
                                         r".*use kv_cache_dtype int8"):
        refuse_unreadable_kv_dtype("layers.0", mla, with_kv_cache_dtype(mla.kv_cache_spec(16), "fp8"), gpu)
    refuse_unreadable_kv_dtype("layers.0", mla, with_kv_cache_dtype(mla.kv_cache_spec(16), "int8"), gpu)
