"""Gemma 2 (`Gemma2ForCausalLM`) over the paged KV cache: Gemma 3's decoder (gemma3.py) without the
q/k norms, with soft-capped attention scores and one RoPE for every layer.

    x ─► embed × √hidden ─► [ x += post_attn_norm(o(attn_softcap(rope(qkv(input_norm x)))))
                              x += post_ff_norm(down(gelu_tanh(gate) * up)(pre_ff_norm x)) ] × L ─► norm
      ─► logits = x · embedᵀ, tanh soft-capped by final_logit_softcapping

    attn_softcap: scores = softcap * tanh(q·k * query_pre_attn_scalar^-0.5 / softcap), then mask, softmax

What differs from Gemma 3: no RMSNorm over the q and k heads; `attn_logit_softcapping` caps the
attention scores (transformers' eager attention, the only one it runs Gemma 2 with); the RoPE
parameters are one set (`config.rope_parameters`) for sliding and full layers alike. Layers
alternate as `config.layer_types` says (sliding_attention: the last `sliding_window` tokens,
itself included; full_attention), each kind its own KV group, as in Gemma 3.

Soft-capping is done by the attention backend, which is told the cap: `exact` and `whole_block`
compute it explicitly (the native decode kernel, which cannot, is not used), `flex` as a
score_mod, and `triton` refuses the model at load.

Tensor-parallel (placement.tp): sharded as Gemma 3 is.
"""

from __future__ import annotations

from blockserve.attention.paged_attention import PagedAttention
from blockserve.models.base import CausalLM
from blockserve.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3TextModel, validate_gemma_layers
from blockserve.models.placement import Placement
from blockserve.models.weights import GATE_UP, QKV, CheckpointLayout


class Gemma2Attention(Gemma3Attention):
    qk_norm = False


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention = Gemma2Attention


class Gemma2TextModel(Gemma3TextModel):
    decoder_layer = Gemma2DecoderLayer
    rope_per_layer_type = False


class Gemma2ForCausalLM(CausalLM):
    """`Gemma2ForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before use."""

    checkpoint = CheckpointLayout(fused=(QKV, GATE_UP))
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        validate_gemma_layers(hf_config, "Gemma 2")
        super().__init__(hf_config, Gemma2TextModel(hf_config, attention_backend_cls, placement), placement,
                         final_logit_softcapping=hf_config.final_logit_softcapping)
