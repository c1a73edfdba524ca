"""SmolLM3 (`SmolLM3ForCausalLM`) over the paged KV cache: the Llama decoder (llama.py) in which the
layers `config.no_rope_layers` marks 0 have no position embedding (NoPE; every fourth, by default).

    layer i   x += o(attn(rope(qkv(norm x))))   if no_rope_layers[i] == 1
              x += o(attn(qkv(norm x)))         if no_rope_layers[i] == 0

A sliding window applies on the layers `layer_types` marks sliding_attention (use_sliding_window).
"""

from __future__ import annotations

import dataclasses

from blockserve.models.llama import AttentionOptions, LlamaForCausalLM, llama_attention_options


class SmolLM3ForCausalLM(LlamaForCausalLM):
    family = "SmolLM3"

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        return dataclasses.replace(llama_attention_options(config, layer_idx, head_dim),
                                   rotary=bool(config.no_rope_layers[layer_idx]))
