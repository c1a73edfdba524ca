"""The GPU check's tiny random models (configs per family, saved with blockserve.models.random_checkpoint)
and their reference: transformers' own greedy tokens and log-probabilities."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, KimiLinearConfig, Qwen3NextConfig

VOCAB = 512
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # generation runs its length
_MLA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, num_experts_per_tok=2, max_position_embeddings=256,
            **NO_SPECIAL_TOKENS)


def deepseek_v3() -> DeepseekV3Config:
    """3 layers: 1 dense then 2 MoE; q through the low-rank path; 8 experts in 4 groups, 2 kept."""
    return DeepseekV3Config(**_MLA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=48, n_routed_experts=8,
                            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True, rope_interleave=True)


def kimi_linear() -> KimiLinearConfig:
    """4 layers: KDA, MLA, KDA, MLA; layer 0 dense, the rest MoE (8 experts, one group)."""
    return KimiLinearConfig(**_MLA, num_hidden_layers=4, q_lora_rank=None, num_local_experts=8, n_shared_experts=1,
                            n_group=1, topk_group=1, routed_scaling_factor=2.446, linear_num_heads=2,
                            linear_head_dim=16, linear_conv_kernel_dim=4,
                            layer_types=["linear_attention", "full_attention"] * 2)


def qwen3_next() -> Qwen3NextConfig:
    """Gated DeltaNet with 2 key / 4 value heads, gated attention with partial RoPE (1/4 of each head),
    a sparse MoE (router, top-2 of 4, gated shared expert) on layers 0 and 2, a dense MLP on layer 1."""
    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=256, **NO_SPECIAL_TOKENS)


@torch.no_grad()
def reference_outputs(reference, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list]]:
    """Per prompt: transformers' greedy `new_tokens` tokens, and the log-softmax of its logits at each
    of those steps."""
    out = []
    for p in prompts:
        result = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
        out.append((result.sequences[0, len(p):].tolist(), [step[0].log_softmax(-1) for step in result.logits]))
    return out


def greedy_difference(got: list[list[int]], reference) -> str | None:
    """None where every sequence's greedy tokens equal the reference's (`reference_outputs`); else the
    first sequence that differs, the position, and the reference's log-probability gap there."""
    if len(got) != len(reference):
        return f"{len(got)} sequences, transformers {len(reference)}"
    for i, (tokens, (want, want_logprobs)) in enumerate(zip(got, reference)):
        if len(tokens) != len(want):
            return f"sequence {i}: {len(tokens)} tokens, transformers {len(want)}"
        if tokens != want:
            j = next(k for k, (a, b) in enumerate(zip(tokens, want)) if a != b)
            gap = float(want_logprobs[j][want[j]] - want_logprobs[j][tokens[j]])
            return (f"sequence {i}, token {j}: {tokens[j]}, transformers {want[j]} (reference log-probability gap "
                    f"{gap:.2e})\n ours   {tokens}\n theirs {want}")
    return None
