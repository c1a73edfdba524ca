"""Shared by the hybrid-model tests (Qwen3-Next, Granite 4.0-H): tiny configs, prompts, a paged
harness with state slots, and the greedy comparison with its near-tie rule.

The harness runs a model as the engine would, without the engine: group 0 is the attention
group (blocks scattered over the cache), group 1 the state group (one slot per sequence, also
scattered). Every unused block and slot holds NaN, and a sequence's slot is zeroed when it is
handed out, as the engine's zero order does (C1), so any read of foreign state shows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteMoeHybridConfig, Qwen3NextConfig

from blockserve.attention.context import ForwardContext, LayerCache, StateCache, StateMetadata
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.kv import LinearStateSpec

VOCAB = 512
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # generate runs the full length

CONFIGS = {
    # Gated DeltaNet with 2 key / 4 value heads, gated attention with partial RoPE (1/4 of each head),
    # a sparse MoE (router, top-2 of 4, gated shared expert) on layers 0 and 2, a dense MLP on layer 1.
    "qwen3_next": lambda: Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=256, **NO_SPECIAL_TOKENS),
    # Mamba2 with 8 heads in 2 groups and 8-token scan chunks, RoPE attention, top-2 of 4 experts plus
    # the shared MLP, and non-trivial muP multipliers.
    "granitemoehybrid": lambda: GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
        position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=1.5, max_position_embeddings=256, **NO_SPECIAL_TOKENS),
}


NEW_TOKENS = 8
_BUILT: dict[str, tuple] = {}  # per config: built once per test session, shared by the test modules


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Run these tests on one intra-op thread: on a small, busy machine torch's thread pool makes
    tiny ops (a depthwise conv1d, an index_add_) take tens of milliseconds each. Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def built(name: str, tmp_path_factory):
    """(path, transformers reference, its greedy NEW_TOKENS for every prompt) of the tiny `name` model,
    saved with save_random_model."""
    from tests.models.conftest import save_random_model

    if name not in _BUILT:
        path = tmp_path_factory.mktemp(name)
        reference = save_random_model(CONFIGS[name](), path)
        _BUILT[name] = path, reference, reference_generate(reference, prompts(), NEW_TOKENS)
    return _BUILT[name]


def prompts(count: int = 16) -> list[list[int]]:
    """`count` prompts of 1 to 37 tokens; a third of them share a 13-token prefix."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, VOCAB, (13,), generator=gen).tolist()
    out = []
    for i in range(count):
        n = 1 + (i * 7) % 25
        tail = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        out.append(shared + tail if i % 3 == 2 else tail)
    return out


@torch.no_grad()
def reference_generate(reference, prompt_sets: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
            for p in prompt_sets]


@torch.no_grad()
def assert_greedy_match(reference, prompt_sets, got, expected, near_tie: float = 1e-3) -> None:
    """Greedy tokens equal transformers', except that at the first divergence of a sequence the two
    tokens may be a near-tie under the reference (log-probabilities within `near_tie`); what follows
    a tie is not compared."""
    assert len(got) == len(expected)
    for prompt, ours, theirs in zip(prompt_sets, got, expected):
        if ours == theirs:
            continue
        assert len(ours) == len(theirs), (ours, theirs)
        j = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        logprobs = reference(torch.tensor([prompt + theirs[:j]])).logits[0, -1].float().log_softmax(-1)
        gap = float(logprobs[theirs[j]] - logprobs[ours[j]])
        assert gap <= near_tie, f"prompt {prompt}: token {j} is {ours[j]}, transformers {theirs[j]} " \
                                f"(log-probability gap {gap:.4f}: not a near-tie)\n ours   {ours}\n theirs {theirs}"


@torch.inference_mode()
def run_paged_states(model, prompt_sets: list[list[int]], max_new_tokens: int, *, block_size: int = 4,
                     chunk: int | None = None, stagger: bool = False, seed: int = 0):
    """Greedy generation through paged attention blocks and state slots (see the module docstring).

    `chunk`: prefill tokens per step (None: the whole prompt). `stagger`: sequence i joins at step i,
    so prefill chunks and decodes share steps. Returns per prompt the logits of every prompt
    position [L, vocab] and the generated token ids.
    """
    specs = model.kv_cache_specs(block_size)
    attn_specs = {n: s for n, s in specs.items() if not isinstance(s, LinearStateSpec)}
    state_specs = {n: s for n, s in specs.items() if isinstance(s, LinearStateSpec)}
    assert len(set(attn_specs.values())) == 1 and len(set(state_specs.values())) == 1, "one group of each kind"
    attn_spec, state_spec = next(iter(attn_specs.values())), next(iter(state_specs.values()))

    gen = torch.Generator().manual_seed(seed)
    need = [-(-(len(p) + max_new_tokens) // block_size) for p in prompt_sets]
    num_blocks, num_slots = 1 + sum(need), 1 + 2 * len(prompt_sets)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    slot_order = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    nan = float("nan")
    layers = {}
    for name, spec in attn_specs.items():
        k, v = torch.full((2, num_blocks, block_size, spec.num_kv_heads, spec.head_size), nan)
        k[0], v[0] = 0, 0  # the null block
        layers[name] = LayerCache(0, k, v)
    for name in state_specs:
        tensors = [torch.full((num_slots, *shape), nan) for shape in state_spec.shapes]
        for t in tensors:
            t[0] = 0
        layers[name] = StateCache(1, tensors)

    seqs = []
    for i, prompt in enumerate(prompt_sets):
        slot = slot_order[i]
        for name in state_specs:  # the zero order for a new slot
            for t in layers[name].tensors:
                t[slot] = 0
        seqs.append(dict(prompt=prompt, start=i if stagger else 0, blocks=order[:need[i]], slot=slot,
                         computed=0, logits=[], generated=[]))
        order = order[need[i]:]
    step = 0
    while any(len(s["generated"]) < max_new_tokens for s in seqs):
        batch = []
        for s in seqs:
            if step < s["start"] or len(s["generated"]) == max_new_tokens:
                continue
            if s["computed"] < len(s["prompt"]):
                tokens = s["prompt"][s["computed"]: s["computed"] + (chunk or len(s["prompt"]))]
            else:
                tokens = [s["generated"][-1]]
            batch.append((s, tokens))
        batch.sort(key=lambda item: len(item[1]) > 1)  # decodes first
        layout = BatchLayout.build([len(t) for _, t in batch], [s["computed"] for s, _ in batch])
        width = max(len(s["blocks"]) for s, _ in batch)
        table = torch.tensor([s["blocks"] + [0] * (width - len(s["blocks"])) for s, _ in batch])
        metadata = [AttentionMetadata.build(layout, table, attn_spec.block_size),
                    StateMetadata(layout, torch.tensor([s["slot"] for s, _ in batch]))]
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        logits = model.compute_logits(model(input_ids, layout.positions, ForwardContext(layers, metadata)))
        for i, (s, tokens) in enumerate(batch):
            rows = logits[layout.query_start[i]: layout.query_start[i + 1]]
            if s["computed"] < len(s["prompt"]):
                s["logits"].append(rows)
            s["computed"] += len(tokens)
            if s["computed"] >= len(s["prompt"]):
                s["generated"].append(int(rows[-1].argmax()))
        step += 1
    return [torch.cat(s["logits"]) for s in seqs], [s["generated"] for s in seqs]
