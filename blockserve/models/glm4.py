"""GLM-4 (`Glm4ForCausalLM`: GLM-4-0414) over the paged KV cache: the Llama decoder (llama.py) with
a norm after each sublayer as well as before, and interleaved RoPE on part of each head.

    x ─► embed ─► [ x += post_self_attn_norm(o(attn(rope_pairs(qkv(input_norm x)))))
                    x += post_mlp_norm(down(silu(gate) * up)(post_attention_norm x)) ] × L ─► norm

    rope_pairs   pairs (x0, x1), (x2, x3), ... of the first partial_rotary_factor of each head rotated
                 (transformers' GLM layout); the rest pass unchanged
    biases       on q/k/v when attention_bias (GLM-4: yes), never on o

The checkpoint stores gate_up_proj fused, as this model holds it.
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


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls, placement, options)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)  # before the MLP, despite its name
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp=placement.tp)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's normed MLP output, the residual stream before it), as
        LlamaDecoderLayer's, the residual adds fused into the pre-norms."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.post_self_attn_layernorm(self.self_attn(x, cos, sin, ctx)),
                                                    residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    family = "GLM-4"
    decoder_layer = Glm4DecoderLayer

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        return dataclasses.replace(llama_attention_options(config, layer_idx, head_dim), interleaved=True,
                                   o_bias=False)
