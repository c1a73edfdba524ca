"""EXAONE 4.0 (`Exaone4ForCausalLM`) over the paged KV cache: OLMo 2's post-norm layers (olmo2.py)
with Qwen3's per-head q/k norms, and local layers interleaved with global ones that have no RoPE.

    x ─► embed ─► [ x += post_attn_norm(o(attn(rope?(q_norm, k_norm per head)(qkv x))))
                    x += post_ff_norm(down(silu(gate) * up)(x)) ] × L ─► norm

    layer type (config.layer_types)   attention                                   RoPE
    sliding_attention                 the last `sliding_window` tokens, itself in   yes
    full_attention                    all tokens                                    only if the config has no sliding_window

(as transformers: a global layer of a model with sliding layers has no position embedding.) The
two kinds declare different KV specs, hence two KV groups, as Gemma 3's.
"""

from __future__ import annotations

import dataclasses

from blockserve.models.llama import AttentionOptions, LlamaForCausalLM, llama_attention_options
from blockserve.models.olmo2 import PostNormDecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    family = "EXAONE 4"
    decoder_layer = PostNormDecoderLayer

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        return dataclasses.replace(llama_attention_options(config, layer_idx, head_dim), qk_norm="head",
                                   rotary=config.sliding_window is None or sliding)
