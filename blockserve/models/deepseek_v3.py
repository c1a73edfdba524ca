"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) over the paged latent cache: MLA, dense first layers, MoE.

    x ─► embed ─► [ x += o(mla(norm x))   x += ffn(norm x) ] × L ─► norm ─► lm_head
                                               │
             layer < first_k_dense_replace: dense SwiGLU MLP
             otherwise: MoE = shared experts(x) + Σ_top-k  weight_e · expert_e(x)   (moe.py)

MLA (multi-head latent attention; mla_block.py, attention/mla.py) caches one latent row per
token. Each head's last `qk_rope_head_dim` dims carry RoPE (interleaved pairs when
`rope_interleave`, as the checkpoints are laid out). The softmax scale is qk_head_dim^-0.5,
times mscale^2 under YaRN. Routing: sigmoid scores, bias-corrected, group-limited top-k.

Not supported: DeepSeek-V3's fp8 checkpoints (`weight_scale_inv`) — dequantise to bf16/fp32
first — and its multi-token-prediction layer, whose weights (layers past num_hidden_layers) are
ignored as transformers ignores them.

Tensor-parallel (placement.tp): MLA heads sharded, the latent cache whole on every rank
(mla_block.py); the MLPs and every expert sharded by intermediate size (moe.py); the vocabulary split.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.layers import vocab_embedding
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, RMSNorm, require_activation
from blockserve.models.mla_block import MLABlock
from blockserve.models.moe import DeepseekMoE
from blockserve.models.placement import Placement
from blockserve.models.rotary import RotaryEmbedding
from blockserve.models.weights import GATE_UP, SWIGLU_EXPERTS, CheckpointLayout


def yarn_softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's convention)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attention_backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLABlock(config, layer_idx, attention_backend_cls, placement, use_rope=True,
                                  scale=yarn_softmax_scale(config))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = layer_idx < config.first_k_dense_replace
        tp = placement.tp
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp=tp) if dense else DeepseekMoE(config, tp)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config, attention_backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim, placement)  # computed here, not loaded
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
            self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i, attention_backend_cls, placement)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class DeepseekV3ForCausalLM(CausalLM):
    """`DeepseekV3ForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights`
    before use. The attention backend's name picks the MLA flavour (exact / whole_block)."""

    checkpoint = CheckpointLayout(fused=(GATE_UP,), experts=SWIGLU_EXPERTS, ignore_layers_past_config=True)
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        require_activation(hf_config, "silu", "DeepSeek-V3")
        super().__init__(hf_config, DeepseekV3Model(hf_config, attention_backend_cls, placement), placement)
