"""OLMo 2 (`Olmo2ForCausalLM`) over the paged KV cache: the Llama decoder (llama.py) with its norms
after each sublayer instead of before, and an RMSNorm over the whole q and the whole k projection.

    x ─► embed ─► [ x += post_attn_norm(o(attn(rope(q_norm(q), k_norm(k)), v)))
                    x += post_ff_norm(down(silu(gate) * up)(x)) ] × L ─► norm

    q_norm, k_norm   RMSNorm over all Hq·D (all Hkv·D) values of a token's q (k), before the heads
                     are split and rotated: one mean over every head

Tensor parallelism is not supported: the q/k norms' mean runs over every head, which a rank does
not hold (LlamaAttention refuses a projection norm over sharded heads).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.paged_attention import PagedAttention
from blockserve.models.layers import GatedMLP, RMSNorm
from blockserve.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, llama_attention_options
from blockserve.models.placement import Placement


class PostNormDecoderLayer(nn.Module):
    """x += post_attention_layernorm(attn(x)); x += post_feedforward_layernorm(mlp(x)): the norms on
    the sublayers' outputs, none on their inputs (OLMo 2, EXAONE 4)."""

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls, placement, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False),
                            tp=placement.tp)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's normed MLP output, the residual stream before it), as
        LlamaDecoderLayer's: the stream is x + residual (x alone when residual is None)."""
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, ctx))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    family = "OLMo 2"
    decoder_layer = PostNormDecoderLayer
    supports_tensor_parallel = False

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        return dataclasses.replace(llama_attention_options(config, layer_idx, head_dim), qk_norm="projection")
