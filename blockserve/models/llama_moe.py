"""The Llama family's mixture-of-experts members: Mixtral, Qwen2-MoE, Qwen3-MoE (Qwen3-30B-A3B,
Qwen3-Coder-30B-A3B).

The decoder is the Llama family's (llama.py), attention included: Mixtral's as Mistral's, Qwen2-MoE's
as Qwen2's (q/k/v bias, `qkv_bias`), Qwen3-MoE's as Qwen3's (an RMSNorm over each q and k head
before RoPE, `attention_bias`); a sliding window on the layers the config sets one. Only the
feed-forward differs: each layer's is the softmax-routed sparse MoE (moe.py) or a dense SwiGLU MLP.

    x ─► embed ─► [ x += o(attn(rope(qkv(norm x))))   x += ffn(norm x) ] × L ─► norm ─► lm_head

    Mixtral     every layer MoE; the top-k weights renormalised (and kept in float32)
    Qwen3-MoE   MoE where moe.sparse_layer says (experts, not in mlp_only_layers, every
                decoder_sparse_step-th layer), else dense; renormalised if norm_topk_prob
    Qwen2-MoE   as Qwen3-MoE, plus a shared expert scaled by sigmoid(shared_expert_gate(x))

The router's softmax runs in float32 (moe.softmax_top_k), as transformers'.

Tensor-parallel (placement.tp): attention as the Llama family; every expert and the shared expert
sharded by intermediate size, the router and the shared expert's gate whole on every rank (moe.py).
"""

from __future__ import annotations

from torch import nn

from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.models.layers import GatedMLP, RMSNorm
from blockserve.models.llama import AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from blockserve.models.moe import SparseMoe, sparse_layer
from blockserve.models.placement import Placement
from blockserve.models.weights import GATE_UP, QKV, SWIGLU_EXPERTS, CheckpointLayout, Fused

MIXTRAL_EXPERTS = (Fused("gate_up_proj", ("w1", "w3")), Fused("down_proj", ("w2",)))  # w1 gate, w3 up, w2 down


def moe_feed_forward(config, layer_idx: int, tp: TensorParallelGroup | None) -> nn.Module:
    """Layer `layer_idx`'s MoE, or its dense MLP (see the module docstring)."""
    if config.model_type == "mixtral":
        return SparseMoe(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                         config.intermediate_size, normalize=True, float32_weights=True, tp=tp)
    if not sparse_layer(config, layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, tp=tp)
    shared = config.shared_expert_intermediate_size if config.model_type == "qwen2_moe" else None
    return SparseMoe(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                     normalize=config.norm_topk_prob, shared_intermediate_size=shared, tp=tp)


class MoeDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer (its forward) with `moe_feed_forward` as its `mlp`."""

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls, placement, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = moe_feed_forward(config, layer_idx, placement.tp)


class LlamaMoeForCausalLM(LlamaForCausalLM):
    """The members' shell: LlamaForCausalLM with MoeDecoderLayer. Experts load per expert (as the
    checkpoints store them) or stacked (transformers' state_dict)."""

    decoder_layer = MoeDecoderLayer
    checkpoint = CheckpointLayout(fused=(QKV, GATE_UP), experts=SWIGLU_EXPERTS)


class Qwen3MoeForCausalLM(LlamaMoeForCausalLM):
    family = "Qwen3-MoE"


class Qwen2MoeForCausalLM(LlamaMoeForCausalLM):
    family = "Qwen2-MoE"


class MixtralForCausalLM(LlamaMoeForCausalLM):
    """Mixtral's checkpoints name the MoE `block_sparse_moe` and its experts' projections w1, w3, w2."""

    family = "Mixtral"
    checkpoint = CheckpointLayout(fused=(QKV, GATE_UP), experts=MIXTRAL_EXPERTS,
                                  renames=((r"\.block_sparse_moe\.", ".mlp."),))
