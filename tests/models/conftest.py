"""Tiny random models built from transformers configs at test time (random weights saved by
blockserve.models.random_checkpoint, so the real loader reads them); the hybrid families the model
and engine tests share (`tiny_model`)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    GraniteMoeHybridConfig,
    KimiLinearConfig,
    Qwen3NextConfig,
)

from blockserve.models.random_checkpoint import save_random_hybrid, save_random_model

VOCAB = 512
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # generation runs its length
_MLA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, num_experts_per_tok=2, max_position_embeddings=256,
            **_NO_SPECIAL_TOKENS)
MLA_CONFIGS = {  # saved with save_random_hybrid
    # 3 layers: 1 dense then 2 MoE; q through the low-rank path; 8 experts in 4 groups, 2 kept
    "deepseek_v3": lambda: DeepseekV3Config(
        **_MLA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=48, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True),
    # 4 layers: KDA, MLA, KDA, MLA; layer 0 dense, the rest MoE (8 experts, one group)
    "kimi_linear": lambda: KimiLinearConfig(
        **_MLA, num_hidden_layers=4, q_lora_rank=None, num_local_experts=8, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, linear_num_heads=2, linear_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2),
}
STATE_CONFIGS = {  # saved with save_random_model
    # Gated DeltaNet with 2 key / 4 value heads, gated attention with partial RoPE (1/4 of each head),
    # a sparse MoE (router, top-2 of 4, gated shared expert) on layers 0 and 2, a dense MLP on layer 1.
    "qwen3_next": lambda: Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=256, **_NO_SPECIAL_TOKENS),
    # Mamba2 with 8 heads in 2 groups and 8-token scan chunks, RoPE attention, top-2 of 4 experts plus
    # the shared MLP, and non-trivial muP multipliers.
    "granitemoehybrid": lambda: GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
        position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=1.5, max_position_embeddings=256, **_NO_SPECIAL_TOKENS),
}


def state_model_prompts(count: int = 16) -> list[list[int]]:
    """The STATE_CONFIGS tests' prompts: `count` of 1 to 37 tokens; a third share a 13-token prefix."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, VOCAB, (13,), generator=gen).tolist()
    out = []
    for i in range(count):
        n = 1 + (i * 7) % 25
        tail = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        out.append(shared + tail if i % 3 == 2 else tail)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """name (of MLA_CONFIGS or STATE_CONFIGS) -> (path of the saved model, its transformers reference),
    built on first use. Import it into a test module outside tests/models to use it there."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            if name in MLA_CONFIGS:
                built[name] = path, save_random_hybrid(MLA_CONFIGS[name](), path)
            else:
                built[name] = path, save_random_model(STATE_CONFIGS[name](), path)
        return built[name]

    return get
