"""Granite 3.x dense (`GraniteForCausalLM`) over the paged KV cache: the Llama decoder (llama.py)
with Granite's four muP scalars.

    x ─► embed × embedding_multiplier ─► [ x += residual_multiplier · o(attn(rope(qkv(norm x))))
                                           x += residual_multiplier · down(silu(gate) * up)(norm x) ] × L
      ─► norm ─► logits / logits_scaling            attention scale: attention_multiplier (not D^-0.5)
"""

from __future__ import annotations

import dataclasses

import torch

from blockserve.attention.context import ForwardContext
from blockserve.attention.paged_attention import PagedAttention
from blockserve.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, llama_attention_options
from blockserve.models.placement import Placement


class GraniteDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer with each sublayer's output scaled by residual_multiplier before its residual add."""

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        super().__init__(config, layer_idx, head_dim, backend_cls, placement, options)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        attended = self.self_attn(x, cos, sin, ctx) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    family = "Granite"
    decoder_layer = GraniteDecoderLayer

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        return dataclasses.replace(llama_attention_options(config, layer_idx, head_dim),
                                   scale=config.attention_multiplier)

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        super().__init__(hf_config, attention_backend_cls, placement,
                         embedding_multiplier=hf_config.embedding_multiplier, logits_scaling=hf_config.logits_scaling)
