"""kv_cache_dtype: attention K/V stored as float16, bfloat16 or int8 through the whole engine.

The tiny model has head size 64, so decodes go to the native kernel's 16-bit path where it is
built (AVX-512 or AVX2), else to the gathered PyTorch path. float16 (11-bit mantissa) and bfloat16
(8 bits) move the logits by their rounding, enough to flip this random model's greedy picks within
a few tokens, so the logits are bounded and the engine runs check the storage (tests/attention
checks the reads exactly): the cache must really hold 16-bit values, and the same memory must hold
twice the blocks. A cold prompt attends its K/V as the cache holds them, as a prefix hit does (C4).

int8 and fp8 (codes and a float16 scale per head vector, attention/kv_quant.py) must hold 3.8x the
float32 blocks (the rotated 4-bit form 7x, k8v4's int8 keys with 4-bit values 5x), read the same
through every CPU backend, survive recycled poisoned blocks (C1:
identical epoch to epoch with the derived zeroing; broken on a whole-block reader without it), and
give the same tokens with prefix caching on and off (C4). A dtype a backend or layer kind cannot
read is refused at start-up (MLA latents take int8 and fp8: tests/engine/test_mla_kv_cache_dtype.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.cli import build_parser
from blockserve.config_args import config_from_namespace
from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.mla import MLA_BACKENDS, MLAttention
from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.config import EngineConfig
from blockserve.engine.core import refuse_unreadable_kv_dtype
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import FullAttentionSpec, MLASpec, with_kv_cache_dtype
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from blockserve.worker.kv_tensors import KVCacheTensors
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 (a fixture)
from tests.scenarios import engine_prompts

CONFIG = dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
PROMPT_LENS = (3, 9, 21, 30, 44)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-head64")
    save_random_model(LlamaConfig(**CONFIG), path)
    return str(path)


def run(path: str, kv_cache_dtype: str, **options) -> tuple[list[list[int]], LLM]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(path, **{"block_size": 16, "kv_cache_memory": "4MiB", "kv_cache_dtype": kv_cache_dtype, **options})
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def test_16bit_caches_round_the_logits_by_their_precision(model_path):
    """Against the float32 cache, a prompt's last logits (magnitude ~6) move by 4e-3 with float16
    and 3.7e-2 with bfloat16 on this model (bounded here at 2x that), float16 less than bfloat16:
    enough to flip a random model's near-tied greedy picks within a few tokens, so the engine runs
    below check storage and capacity, not tokens."""
    model = load_model(model_path, BACKENDS["exact"]).model
    tokens = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = last_logits(model, "auto", tokens, [24])
    error = {d: (last_logits(model, d, tokens, [24]) - reference).abs().max().item() for d in ("float16", "bfloat16")}
    assert 0 < error["float16"] < 2**-7 and error["float16"] < error["bfloat16"] < 2**-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_cache_holds_16bit_values_and_twice_the_blocks(model_path, dtype):
    _, full = run(model_path, "auto")
    got, half = run(model_path, dtype)
    assert all(len(tokens) == 40 for tokens in got)
    caches = half.engine.core.runner.layer_caches.values()
    assert {c.k_cache.dtype for c in caches} == {getattr(torch, dtype)}
    blocks = lambda llm: sum(g.num_blocks for g in llm.engine.core.kv_config.groups)  # noqa: E731
    assert blocks(half) >= 2 * blocks(full) - 2


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int3")


QUANTIZED = pytest.mark.parametrize("dtype", ["int8", "fp8", "int4", "k8v4"])
STORED = {"int8": (torch.int8,) * 2, "fp8": (torch.float8_e4m3fn,) * 2, "int4": (torch.uint8,) * 2,
          "k8v4": (torch.int8, torch.uint8)}  # K's, V's
# K's and V's row bytes: codes, then the scale (4-bit: and minimum)
ROW_BYTES = {"int8": (64 + 2,) * 2, "fp8": (64 + 2,) * 2, "int4": (32 + 4,) * 2, "k8v4": (64 + 2, 32 + 4)}
AGAINST_FLOAT16 = {"int8": "1.94x", "fp8": "1.94x", "int4": "3.56x", "k8v4": "2.51x"}
AGAINST_FLOAT32 = {"int8": 3.8, "fp8": 3.8, "int4": 7, "k8v4": 5}
# k8v4 stores each side as int8 and int4 do: with one backend each below (whole blocks for C1, where
# zeroing forced off must break; exact reads for C4), its own tensors and zero orders are covered.
# triton's kernel joins under backend_full: Triton's interpreter takes ~40 s a dtype here (its kernel's poison
# tests and quantized engines run by default in tests/attention/test_triton_attention.py).
PER_BACKEND = pytest.mark.parametrize("backend,dtype", [
    *((b, d) for b in ("exact", "whole_block") for d in ("int8", "fp8", "int4")), ("whole_block", "k8v4"),
    *(pytest.param("triton", d, marks=[pytest.mark.slow, pytest.mark.backend_full])
      for d in ("int8", "fp8", "int4", "k8v4"))])


@QUANTIZED
def test_quantized_cache_holds_codes_scales_and_3_8x_the_float32_tokens(model_path, dtype):
    _, full = run(model_path, "auto")
    got, quantized = run(model_path, dtype, check_integrity=True)
    assert all(len(tokens) == 40 for tokens in got)
    caches = quantized.engine.core.runner.layer_caches.values()
    assert {((c.k_cache.dtype, c.v_cache.dtype), (c.k_cache.shape[-1], c.v_cache.shape[-1])) for c in caches} == {
        (STORED[dtype], ROW_BYTES[dtype])}
    blocks = lambda llm: sum(g.num_blocks for g in llm.engine.core.kv_config.groups)  # noqa: E731
    assert blocks(quantized) >= AGAINST_FLOAT32[dtype] * blocks(full)
    assert f"{AGAINST_FLOAT16[dtype]} float16" in quantized.engine.core.kv_config.capacity_report()
    # every backend reads the same codes: the native kernel, the gathered path, whole blocks
    assert run(model_path, dtype, attention_backend="whole_block")[0] == got


# 2 layers x 4 slots x 2 heads x a K and a V row's bytes: 17 blocks hold one request of 64 tokens, far
# fewer than engine_prompts() need at once, so blocks recycle within an epoch.
def small_quantized_cache(dtype: str) -> dict:
    return dict(block_size=4, max_model_len=64, kv_cache_memory=17 * 2 * 4 * 2 * sum(ROW_BYTES[dtype]))


def epochs(llm: LLM, count: int) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=10)
    return [[o.outputs[0].token_ids for o in llm.generate(engine_prompts(), params, use_tqdm=False)]
            for _ in range(count)]


@PER_BACKEND
def test_recycled_poisoned_quantized_blocks(model_path, backend, dtype):
    """C1 on quantized bytes: every garbage block holds poison codes and NaN scales. With the derived
    zeroing, every epoch gives the unpoisoned outputs; with zeroing forced off, the exact backend
    still does and the whole-block one, which reads unwritten slots, breaks."""
    options = dict(small_quantized_cache(dtype), kv_cache_dtype=dtype)
    want = epochs(LLM(model_path, **options), 1)[0]
    assert epochs(LLM(model_path, attention_backend=backend, poison=True, **options), 3) == [want] * 3
    unzeroed = epochs(LLM(model_path, attention_backend=backend, poison=True, unsafe_disable_zeroing=True,
                          **options), 2)
    if BACKENDS[backend].reads_unwritten_slots:
        assert unzeroed != [want] * 2
    else:
        assert unzeroed == [want] * 2


@torch.inference_mode()
def last_logits(model, stored: str, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """The last token's logits of `tokens` fed in `chunks` (ends) through a paged cache of `stored`."""
    block_size = 4
    specs = model.kv_cache_specs(block_size)
    (spec,) = {with_kv_cache_dtype(s, stored) for s in specs.values()}
    blocks = len(tokens) // block_size + 1
    kv = KVCacheTensors(KVCacheConfig((KVCacheGroup(spec, blocks + 1, False, tuple(specs)),)), device="cpu")
    table = torch.arange(1, blocks + 1).view(1, blocks)
    computed = 0
    for end in chunks:
        layout = BatchLayout.build([end - computed], [computed])
        ctx = ForwardContext(kv.layer_caches(), [AttentionMetadata.build(layout, table, block_size)])
        logits = model.compute_logits(model(torch.tensor(tokens[computed:end]), layout.positions, ctx))
        computed = end
    return logits[-1].float()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_cold_prompt_attends_its_kv_as_the_cache_holds_it(model_path, tiny_model, family):
    """C4 for every stored dtype narrower than the model's: a whole cold prompt must attend its own
    K/V (MLA: latent rows) as the cache stores them, since a prefix hit or a later chunk reads them
    from there. Attending the unrounded values moved the logits by up to 0.1 with bfloat16."""
    path = model_path if family == "llama" else str(tiny_model(family)[0])
    model = load_model(path, BACKENDS["exact"]).model
    tokens = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    for stored in ("float16", "bfloat16", "int8"):
        cold, warm = last_logits(model, stored, tokens, [24]), last_logits(model, stored, tokens, [16, 24])
        # MLA's cold prompt expands its latents where a warm one absorbs the up-projection: a float32
        # cache differs by ~6e-6 between the two ways; attending unrounded latents moved them by 6e-3.
        assert torch.equal(cold, warm) if family == "llama" else torch.allclose(cold, warm, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend,dtype", [
    *((b, d) for b in ("exact", "whole_block") for d in ("int8", "fp8", "int4")), ("exact", "k8v4")])
def test_quantized_prefix_caching_on_equals_off(model_path, backend, dtype):
    """C4: a prefix hit reads the stored codes (never re-quantised); a cold prompt attends the same
    dequantised K/V, so the tokens do not change."""
    options = dict(small_quantized_cache(dtype), kv_cache_memory="1MiB", attention_backend=backend,
                   kv_cache_dtype=dtype)
    off = epochs(LLM(model_path, enable_prefix_caching=False, **options), 1)[0]
    cached = LLM(model_path, enable_prefix_caching=True, **options)
    assert epochs(cached, 2) == [off, off]
    assert cached.engine.core.scheduler.kv.prefix_cache_stats().hits > 0


def test_quantized_dtypes_are_refused_where_they_cannot_be_read():
    """Start-up names the backend (or layer kind) and the dtype, never a silent fallback. Every
    attention backend reads every quantized form; the triton MLA backend reads the one-byte latent
    forms only (int4 and k8v4 are refused for MLA specs earlier, by with_kv_cache_dtype:
    tests/engine/test_mla_kv_cache_dtype.py)."""
    cpu = torch.device("cpu")
    attn = Attention("layers.0", 4, 2, 64, BACKENDS["triton"](0.125), dtype=torch.float32)
    for dtype in ("int8", "fp8", "int4", "k8v4"):  # triton reads them all
        refuse_unreadable_kv_dtype("layers.0", attn, with_kv_cache_dtype(attn.kv_cache_spec(16), dtype), cpu)
    mla = MLAttention("layers.0", 4, 16, 16, MLA_BACKENDS["triton"](0.125), kv_lora_rank=32, qk_rope_head_dim=8,
                      dtype=torch.float32)
    assert mla.backend.quantized_kv_dtypes == ("int8", "float8_e4m3fn")  # its real declaration, nothing patched
    for dtype in ("int8", "fp8"):
        refuse_unreadable_kv_dtype("layers.0", mla, with_kv_cache_dtype(mla.kv_cache_spec(16), dtype), cpu)
    with pytest.raises(ValueError, match="'int4_rotated' cannot be read by attention backend 'triton'"):
        refuse_unreadable_kv_dtype("layers.0", mla, with_kv_cache_dtype(attn.kv_cache_spec(16), "int4"), cpu)
    refuse_unreadable_kv_dtype("layers.0", Attention("layers.0", 4, 2, 64, BACKENDS["exact"](0.125),
                                                     dtype=torch.float32),
                               with_kv_cache_dtype(attn.kv_cache_spec(16), "int8"), cpu)
    with pytest.raises(ValueError, match="'int4' is not built for MLA"):
        with_kv_cache_dtype(MLASpec(16, 32, 8), "int4")
    split = with_kv_cache_dtype(attn.kv_cache_spec(16), "k8v4")  # a side the backend cannot read is named
    with pytest.raises(ValueError, match="'int4_rotated' cannot be read by attention backend 'triton'"):
        refuse_unreadable_kv_dtype("layers.0", mla, split, cpu)
    with pytest.raises(ValueError, match="'float32' with v_cache_dtype 'int4' is not built"):  # the model's K
        with_kv_cache_dtype(attn.kv_cache_spec(16), "int8", k_cache_dtype="auto", v_cache_dtype="int4")


def test_fp8_on_a_gpu_older_than_sm89_is_refused_at_start_up(monkeypatch):
    """The triton kernel converts e4m3 codes on sm_89 and newer only: on an older GPU (its capability
    stubbed: no GPU here) start-up refuses fp8 naming the device and int8; int8 and int4 pass, and
    fp8 passes on sm_89 and on the CPU (the interpreter)."""
    attn = Attention("layers.0", 4, 2, 64, BACKENDS["triton"](0.125), dtype=torch.float32)
    fp8 = with_kv_cache_dtype(attn.kv_cache_spec(16), "fp8")
    gpu = torch.device("cuda", 0)
    capability = {"now": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    with pytest.raises(ValueError, match=r"'float8_e4m3fn' cannot be read by attention backend 'triton' on "
                                         r"cuda:0 .*8\.9 or newer; cuda:0 is 8\.0: use kv_cache_dtype int8"):
        refuse_unreadable_kv_dtype("layers.0", attn, fp8, gpu)
    for dtype in ("int8", "int4"):
        refuse_unreadable_kv_dtype("layers.0", attn, with_kv_cache_dtype(attn.kv_cache_spec(16), dtype), gpu)
    capability["now"] = (8, 9)
    refuse_unreadable_kv_dtype("layers.0", attn, fp8, gpu)
    refuse_unreadable_kv_dtype("layers.0", attn, fp8, torch.device("cpu"))


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench", "latency"]], ids=" ".join)
def test_every_command_takes_the_quantized_kv_cache_dtypes(command):
    for dtype in ("int8", "fp8", "int4", "k8v4"):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", dtype])
        assert config_from_namespace(EngineConfig, args).kv_cache_dtype == dtype
    args = build_parser().parse_args([*command, "--k-cache-dtype", "fp8", "--v-cache-dtype", "int4"])
    config = config_from_namespace(EngineConfig, args)
    assert (config.kv_cache_dtype, config.k_cache_dtype, config.v_cache_dtype) == ("auto", "fp8", "int4")


def test_split_kv_dtypes_are_checked_when_the_config_is_built():
    """A K/V pair no kernel reads, or an unknown side, fails at EngineConfig naming the fields."""
    with pytest.raises(ValueError, match="unknown k_cache_dtype 'int3'"):
        EngineConfig(k_cache_dtype="int3")
    with pytest.raises(ValueError, match="k_cache_dtype 'int4' with v_cache_dtype 'int8' is not built"):
        EngineConfig(kv_cache_dtype="int4", v_cache_dtype="int8")
    assert EngineConfig(k_cache_dtype="int8", v_cache_dtype="int4").kv_spec(FullAttentionSpec(16, 2, 64)).v_dtype == (
        "int4_rotated")


@pytest.mark.parametrize("family", [pytest.param("granitemoehybrid", marks=pytest.mark.slow), "qwen3_next"])
def test_hybrid_int8_caching_on_equals_off(tiny_model, family):
    """Hybrids: attention layers on int8, recurrent states on float32 (and their checkpoints). Two
    turns of three conversations sharing a system prompt, poisoned: caching on (blocks hit, states
    restored) gives caching off's tokens."""
    path, _ = tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, VOCAB, (70,), generator=gen).tolist()
    first = [system + torch.randint(0, VOCAB, (5 + 6 * c,), generator=gen).tolist() for c in range(3)]
    follow_ups = [torch.randint(0, VOCAB, (9,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6)

    def turns(caching: bool):
        llm = LLM(str(path), block_size=4, max_model_len=192, kv_cache_memory="16MiB", kv_cache_dtype="int8",
                  poison=True, check_integrity=True, enable_prefix_caching=caching)
        replies = [o.outputs[0].token_ids for o in llm.generate(first, params, use_tqdm=False)]
        second = [p + r + f for p, r, f in zip(first, replies, follow_ups)]
        outputs = llm.generate(second, params, use_tqdm=False)
        return replies + [o.outputs[0].token_ids for o in outputs], sum(o.num_cached_tokens for o in outputs)

    on, hits = turns(True)
    assert turns(False) == (on, 0)
    assert hits > 0


def test_int4_is_refused_for_a_model_with_mla_layers(tiny_model):
    path, _ = tiny_model("kimi_linear")
    with pytest.raises(ValueError, match="'int4' is not built for MLA"):
        LLM(str(path), kv_cache_dtype="int4", kv_cache_memory="16MiB", max_model_len=192)


@pytest.mark.model_quality
def test_needle_retrieval_is_unchanged_by_the_quantized_caches():
    """The bundled model finds a passphrase at 10%, 50% and 90% of a 1024-token prose prompt with the
    float32 cache (so the check can fail), and with every quantized cache as well."""
    from blockserve.bench.needle import needle_cases, needle_retrieval
    from blockserve.models.default_model import default_model_path

    found = {}
    for dtype in ("auto", "int8", "fp8", "int4", "k8v4"):
        llm = LLM(str(default_model_path()), kv_cache_dtype=dtype, kv_cache_memory="128MiB", max_model_len=1040)
        found[dtype] = needle_retrieval(llm, needle_cases(llm.get_tokenizer(), [1024], [0.1, 0.5, 0.9]))
    assert found["auto"] == [True] * 3
    assert found == {dtype: [True] * 3 for dtype in found}
