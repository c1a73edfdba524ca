"""A paged-cache harness for models with any mix of KV groups (attention, MLA, linear state), and
the tiny random models and transformers references the MLA / KDA tests share.

Like `conftest.run_paged`, without the engine: each sequence gets its own blocks in every
attention / MLA group (scattered over the pool, block 0 is the null block) and its own slot in
every state group; the caches are the worker's own `KVCacheTensors`, so each layer sees exactly
the tensor layout the engine gives it.

    step 0   [p0 p0 p0 p0 p0]                      seq 0 prefills
    step 1   [d0][p1 p1 p1]                        seq 1 joins (stagger): decode + prefill
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, KimiLinearConfig

from blockserve.attention.context import ForwardContext, StateMetadata
from blockserve.attention.metadata import AttentionMetadata, BatchLayout
from blockserve.kv.config import KVCacheConfig, KVCacheGroup
from blockserve.kv.specs import LinearStateSpec
from blockserve.worker.kv_tensors import KVCacheTensors
from tests.models.conftest import step_batch

VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
               qk_nope_head_dim=16, v_head_dim=24, num_experts_per_tok=2, max_position_embeddings=256,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: generation runs its length
CONFIGS = {
    # 3 layers: 1 dense then 2 MoE; q through the low-rank path; 8 experts in 4 groups, 2 kept
    "deepseek_v3": lambda: DeepseekV3Config(
        **_COMMON, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=48, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True),
    # 4 layers: KDA, MLA, KDA, MLA; layer 0 dense, the rest MoE (8 experts, one group)
    "kimi_linear": lambda: KimiLinearConfig(
        **_COMMON, num_hidden_layers=4, q_lora_rank=None, num_local_experts=8, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, linear_num_heads=2, linear_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2),
}


def save_random_hybrid(hf_config, path, seed: int = 0):
    """Like conftest.save_random_model (norms near 1, other weights N(0, 0.2): logits far from
    uniform), plus: KDA decays in a range that keeps a memory of tens of tokens, and a non-zero
    e_score_correction_bias (a buffer, so save_random_model would leave it zero). Returns the
    transformers model, the reference."""
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("A_log"):  # decay rate exp(A_log) in [0.02, 0.2]
                param.copy_(torch.empty_like(param).uniform_(math.log(0.02), math.log(0.2)))
            elif name.endswith("dt_bias"):
                param.normal_(-1.0, 0.5)
            else:
                param.normal_(0, 0.2)
        for name, buffer in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    reference.save_pretrained(path)
    return reference


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from torch's intra-op threads, and on a loaded box the threads'
    contention makes these tests 10-30x slower; one thread for the module, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def saved_hybrid(tmp_path_factory):
    """name -> (path of the saved tiny random model, its transformers reference), built once per
    session on first use. Import it into a test module to use it."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (path, save_random_hybrid(CONFIGS[name](), path))
        return built[name]

    return get


@torch.no_grad()
def reference_outputs(reference, prompts: list[list[int]], new_tokens: int):
    """Per prompt: transformers' greedy tokens, and the log-softmax of its logits at each step."""
    out = []
    for p in prompts:
        result = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
        out.append((result.sequences[0, len(p):].tolist(), [step[0].log_softmax(-1) for step in result.logits]))
    return out


def close_divergence(got: list[int], want: list[int], want_logprobs, close: float = 0.1) -> bool:
    """The logprob-closeness rule (as tests/engine/test_smollm2_engine.py) at the first
    differing position, from the reference's side: both tokens in its top 5, their reference
    logprobs within `close` nats."""
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    top = want_logprobs[i].topk(5).indices.tolist()
    return got[i] in top and abs(float(want_logprobs[i][got[i]] - want_logprobs[i][want[i]])) <= close


def assert_tokens_match(got: list[list[int]], reference) -> int:
    """Greedy tokens equal the reference's, except near-ties by the closeness rule; returns how
    many prompts needed the rule."""
    near_ties = 0
    for i, (tokens, (want, want_logprobs)) in enumerate(zip(got, reference)):
        if tokens != want:
            assert close_divergence(tokens, want, want_logprobs), f"prompt {i}: {tokens} != {want}"
            near_ties += 1
    return near_ties


@dataclass
class _Seq:
    prompt: list[int]
    start_step: int
    blocks: dict[int, list[int]]  # group -> block ids (one slot for a state group)
    computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


@torch.inference_mode()
def run_paged_hybrid(model, prompts: list[list[int]], max_new_tokens: int, *, block_size: int = 4,
                     chunk: int | None = None, stagger: bool = False, seed: int = 0):
    """Greedy generation of `max_new_tokens` per prompt through paged caches of every kind the
    model declares. `chunk`: prefill tokens per step (None: whole prompts). `stagger`: sequence i
    joins at step i. Returns, per prompt, the logits of every prompt position and the tokens."""
    by_spec: dict = {}
    for name, spec in model.kv_cache_specs(block_size).items():
        by_spec.setdefault(spec, []).append(name)
    gen = torch.Generator().manual_seed(seed)
    groups, per_seq = [], [dict() for _ in prompts]
    for g, (spec, names) in enumerate(by_spec.items()):
        if isinstance(spec, LinearStateSpec):
            need = [1] * len(prompts)
        else:
            need = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
        num_blocks = 1 + sum(need)
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        for i, n in enumerate(need):
            per_seq[i][g], order = order[:n], order[n:]
        groups.append(KVCacheGroup(spec, num_blocks, False, tuple(names)))
    config = KVCacheConfig(tuple(groups))
    layers = KVCacheTensors(config).layer_caches()
    seqs = [_Seq(p, i if stagger else 0, blocks) for i, (p, blocks) in enumerate(zip(prompts, per_seq))]
    step = 0
    while any(len(s.generated) < max_new_tokens for s in seqs):
        batch = step_batch(seqs, step, max_new_tokens, chunk)
        layout = BatchLayout.build([len(t) for _, t in batch], [s.computed for s, _ in batch])
        metadata = []
        for g, group in enumerate(groups):
            if group.is_state:
                metadata.append(StateMetadata(layout, torch.tensor([s.blocks[g][0] for s, _ in batch])))
                continue
            width = max(len(s.blocks[g]) for s, _ in batch)
            table = torch.tensor([s.blocks[g] + [0] * (width - len(s.blocks[g])) for s, _ in batch])
            metadata.append(AttentionMetadata.build(layout, table, block_size))
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        logits = model.compute_logits(model(input_ids, layout.positions, ForwardContext(layers, metadata)))
        for i, (s, tokens) in enumerate(batch):
            rows = logits[layout.query_start[i]: layout.query_start[i + 1]]
            if s.computed < len(s.prompt):
                s.prompt_logits.append(rows)
            s.computed += len(tokens)
            if s.computed >= len(s.prompt):
                s.generated.append(int(rows[-1].argmax()))
        step += 1
    return [torch.cat(s.prompt_logits) for s in seqs], [s.generated for s in seqs]
