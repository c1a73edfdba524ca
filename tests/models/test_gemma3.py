"""Gemma 3 (local sliding-window + global layers) on tiny random configs against transformers.

The harness below runs the model through the paged cache with one block table and one
`AttentionMetadata` per KV group, as the engine does, and releases sliding-window blocks as
they leave the window: their memory is filled with NaN and their table entry points at the
null block, so a backend that read outside the window would show it in the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers import Gemma3TextConfig

from blockserve.attention.context import ForwardContext, LayerCache
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.attention.paged_attention import BACKENDS
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.kv.capacity import plan_kv_cache
from blockserve.models.gemma3 import Gemma3ForCausalLM
from blockserve.models.loader import load_model
from tests.models.conftest import save_random_model, step_batch

S, F = "sliding_attention", "full_attention"
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
             query_pre_attn_scalar=24, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
CONFIGS = {
    # Gemma 3 4B-like: 5 local per global, linear rope scaling on the global layers only, tied embeddings.
    "w8-linear-rope": lambda: Gemma3TextConfig(
        **SIZES, num_hidden_layers=6, num_key_value_heads=2, sliding_window=8, layer_types=[S] * 5 + [F],
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                         F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}),
    # A window that is no multiple of the block size, final logit soft-capping, untied lm_head,
    # one KV head, attention bias, and a global layer first.
    "w13-softcap-untied": lambda: Gemma3TextConfig(
        **SIZES, num_hidden_layers=4, num_key_value_heads=1, sliding_window=13, layer_types=[F, S, S, F],
        final_logit_softcapping=30.0, tie_word_embeddings=False, attention_bias=True),
}
NEW_TOKENS = 10


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 11, 22, 31)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(model path, transformers reference, per prompt (prompt logits, greedy tokens))."""
    path = tmp_path_factory.mktemp(request.param)
    reference = save_random_model(CONFIGS[request.param](), path)
    expected = []
    with torch.no_grad():
        for p in prompts():
            ids = torch.tensor([p])
            logits = reference(ids).logits[0]
            tokens = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                        do_sample=False)[0, len(p):].tolist()
            expected.append((logits, tokens))
    return path, reference, expected


@dataclass
class _Seq:
    prompt: list[int]
    start_step: int
    tables: list[list[int]]  # per group: block ids, 0 (the null block) once released
    computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


@torch.inference_mode()
def run_paged_groups(model, prompts: list[list[int]], max_new_tokens: int, *, block_size: int = 4,
                     chunk: int | None = None, stagger: bool = False, seed: int = 0):
    """Greedy generation through the paged cache, one group (pool, block tables, metadata) per
    distinct KV spec. `chunk`: prefill tokens per step; `stagger`: sequence i joins at step i.

    Returns, per prompt, the logits of every prompt position [L, vocab] and the generated ids.
    """
    specs = model.kv_cache_specs(block_size)
    group_specs = list(dict.fromkeys(specs.values()))
    need = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    num_blocks = 1 + sum(need)
    caches = {}
    for name, spec in specs.items():
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_size)
        caches[name] = LayerCache(group_specs.index(spec), torch.zeros(shape), torch.zeros(shape))
    seqs = [_Seq(p, i if stagger else 0, []) for i, p in enumerate(prompts)]
    gen = torch.Generator().manual_seed(seed)
    for _ in group_specs:  # each group scatters its sequences' blocks over its own pool
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        for s, n in zip(seqs, need):
            s.tables.append(order[:n])
            order = order[n:]
    step = 0
    while any(len(s.generated) < max_new_tokens for s in seqs):
        batch = step_batch(seqs, step, max_new_tokens, chunk)
        layout = BatchLayout.build([len(t) for _, t in batch], [s.computed for s, _ in batch])
        metadata = []
        for g, spec in enumerate(group_specs):
            width = max(len(s.tables[g]) for s, _ in batch)
            table = torch.tensor([s.tables[g] + [0] * (width - len(s.tables[g])) for s, _ in batch])
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            metadata.append(AttentionMetadata.build(layout, table, block_size, window))
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        logits = model.compute_logits(model(input_ids, layout.positions, ForwardContext(caches, metadata)))
        for i, (s, tokens) in enumerate(batch):
            rows = logits[layout.query_start[i]: layout.query_start[i + 1]]
            if s.computed < len(s.prompt):
                s.prompt_logits.append(rows)
            s.computed += len(tokens)
            if s.computed >= len(s.prompt):
                s.generated.append(int(rows[-1].argmax()))
            _release_out_of_window(s, group_specs, caches, block_size)
        step += 1
    return [torch.cat(s.prompt_logits) for s in seqs], [s.generated for s in seqs]


def _release_out_of_window(seq: _Seq, group_specs, caches, block_size: int) -> None:
    """As SlidingWindowManager does, release the blocks wholly before the window; here they
    also become NaN, so any later read of them shows."""
    for g, spec in enumerate(group_specs):
        if not isinstance(spec, SlidingWindowSpec):
            continue
        table = seq.tables[g]
        for i in range(min(spec.num_skipped_tokens(seq.computed) // block_size, len(table))):
            if table[i]:
                for cache in caches.values():
                    if cache.group == g:
                        cache.k_cache[table[i]] = float("nan")
                        cache.v_cache[table[i]] = float("nan")
                table[i] = 0


def assert_greedy_equal(reference, prompt: list[int], got: list[int], expected: list[int], tol: float = 1e-4):
    """Greedy tokens equal, except that where they first differ the reference's top two
    log-probabilities may be within `tol` of each other (a near-tie either choice honours)."""
    if got == expected:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    with torch.no_grad():
        logprobs = reference(torch.tensor([prompt + expected[:j]])).logits[0, -1].log_softmax(-1)
    gap = float(logprobs[expected[j]] - logprobs[got[j]])
    assert gap < tol, f"greedy tokens differ at {j}: got {got}, transformers {expected} (logprob gap {gap:.2e})"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("mode", ["whole-prompt", "chunked-staggered"])
def test_logits_and_greedy_match_transformers(tiny, backend, mode):
    path, reference, expected = tiny
    loaded = load_model(str(path), BACKENDS[backend])
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    options = dict(chunk=5, stagger=True) if mode == "chunked-staggered" else {}
    logits, generated = run_paged_groups(loaded.model, prompts(), NEW_TOKENS, **options)
    worst = 0.0
    for p, got_logits, got, (ref_logits, ref_tokens) in zip(prompts(), logits, generated, expected):
        worst = max(worst, float((got_logits - ref_logits).abs().max()))
        torch.testing.assert_close(got_logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert_greedy_equal(reference, p, got, ref_tokens)
    print(f"max |logit - transformers| = {worst:.2e}")


def test_two_groups_with_different_specs(tiny):
    path, reference, _ = tiny
    model = load_model(str(path), BACKENDS["exact"]).model
    specs = model.kv_cache_specs(4)
    config = reference.config
    for i, layer_type in enumerate(config.layer_types):
        spec = specs[f"model.layers.{i}.self_attn"]
        if layer_type == S:
            assert spec == SlidingWindowSpec(4, config.num_key_value_heads, 16, "float32",
                                             sliding_window=config.sliding_window)
        else:
            assert type(spec) is FullAttentionSpec
    assert len(set(specs.values())) == 2


def _config(**overrides) -> Gemma3TextConfig:
    return Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 2, "num_key_value_heads": 2, "sliding_window": 8,
                               "layer_types": [S, F], **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                           F: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}), "dynamic"),
])
def test_unsupported_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        Gemma3ForCausalLM(_config(**overrides), BACKENDS["exact"])


def test_metadata_without_the_window_is_refused(tiny):
    """A caller that gives a sliding layer full-attention metadata gets an error, not wrong logits."""
    path, _, _ = tiny
    model = load_model(str(path), BACKENDS["exact"]).model
    specs = model.kv_cache_specs(4)
    caches = {n: LayerCache(0, torch.zeros(3, 4, s.num_kv_heads, s.head_size),
                            torch.zeros(3, 4, s.num_kv_heads, s.head_size)) for n, s in specs.items()}
    layout = BatchLayout.build([3], [0])
    meta = AttentionMetadata.build(layout, torch.tensor([[1]]), 4)
    with pytest.raises(ValueError, match="sliding_window"):
        model(torch.tensor([1, 2, 3]), layout.positions, ForwardContext(caches, [meta]))


# -- memory -------------------------------------------------------------------------------------

def concurrent_long_requests(specs: dict, memory_bytes: int, max_model_len: int, chunk: int) -> int:
    """How many decoding requests of `max_model_len` tokens fit at once in the pools that
    `plan_kv_cache` builds from `memory_bytes` for prefill chunks of up to `chunk` tokens."""
    groups: dict = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    config = plan_kv_cache([(spec, tuple(names), False) for spec, names in groups.items()], memory_bytes,
                           max_model_len, max_num_seqs=256, max_chunk_tokens=chunk)
    return min((g.num_blocks - 1) // g.spec.max_blocks_held(max_model_len, 1) for g in config.groups)


def test_sliding_layers_serve_more_long_requests_than_all_global(capsys):
    """The Gemma 3 layout (5 local : 1 global, window 1024) against the same model with every
    layer global, in the same KV memory, for requests of 8192 tokens. Prints the ratios: the
    pools are planned for the longest prefill chunk, so a smaller chunk cap leaves more room."""
    block_size, window, max_model_len, memory = 16, 1024, 8192, 2**30
    config = Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 12, "num_key_value_heads": 2,
                                 "sliding_window": window, "max_position_embeddings": max_model_len,
                                 "layer_types": ([S] * 5 + [F]) * 2})
    gemma = Gemma3ForCausalLM(config, BACKENDS["exact"]).kv_cache_specs(block_size)
    all_global = {name: FullAttentionSpec(block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
                  for name, spec in gemma.items()}
    # What one decoding request holds, in layer-blocks: the ratio an ideal split would reach.
    ideal = (sum(s.max_blocks_held(max_model_len, 1) for s in all_global.values())
             / sum(s.max_blocks_held(max_model_len, 1) for s in gemma.values()))
    lines = []
    for chunk in (1, 256, 2048):  # 2048: the engine's default max_num_batched_tokens
        hybrid = concurrent_long_requests(gemma, memory, max_model_len, chunk)
        full = concurrent_long_requests(all_global, memory, max_model_len, chunk)
        lines.append(f"prefill chunk cap {chunk:4}: Gemma 3 layout {hybrid:3}, all global {full:3}, "
                     f"x{hybrid / full:.2f}")
        assert full >= 1 and hybrid > full
        if chunk == 1:
            assert math.isclose(hybrid / full, ideal, rel_tol=0.1)
    with capsys.disabled():
        print(f"\n  concurrent {max_model_len}-token requests in {memory >> 20} MiB of KV "
              f"(12 layers, window {window}, block {block_size}; ideal x{ideal:.2f}):")
        for line in lines:
            print("   ", line)
