"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) over the paged latent cache: MLA, dense first layers, MoE.

    x ─► embed ─► [ x += o(mla(norm x))   x += ffn(norm x) ] × L ─► norm ─► lm_head
                                               │
             layer < first_k_dense_replace: dense SwiGLU MLP
             otherwise: MoE = shared experts(x) + Σ_top-k  weight_e · expert_e(x)   (moe.py)

MLA (multi-head latent attention; mla_block.py, attention/mla.py) caches one latent row per
token. Each head's last `qk_rope_head_dim` dims carry RoPE (interleaved pairs when
`rope_interleave`, as the checkpoints are laid out). The softmax scale is qk_head_dim^-0.5,
times mscale^2 under YaRN. Routing: sigmoid scores, bias-corrected, group-limited top-k.

Multi-token prediction (`num_nextn_predict_layers`; models/mtp.py): the checkpoint's layer
`model.layers.{num_hidden_layers}` is loaded only for speculative_config method "mtp" (it drafts,
DeepseekV3MTPLayer); otherwise it is ignored, as transformers ignores it.

    emb(x[t+1]), h[t] ─► eh_proj([enorm(emb) | hnorm(h)]) ─► decoder block ─► h'   (chained)
                                                  h' ─► shared_head.norm ─► shared_head.head ─► logits

Not supported: DeepSeek-V3's fp8 checkpoints (`weight_scale_inv`) — dequantise to bf16/fp32 first.

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

MTP_FIELD = "num_nextn_predict_layers"


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


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """The first multi-token-prediction layer (checkpoint `model.layers.{num_hidden_layers}.*`, its
    `embed_tokens` copy left out: the target's is used). `forward(emb, hidden, cos, sin, ctx)`: the
    embeddings of the tokens after the target's hidden states -> the chained states, which
    `logits` turns into the next token's logits."""

    reads_target_lm_head = False  # its shared_head is its own

    def __init__(self, config, attention_backend_cls: type[PagedAttention], placement: Placement):
        super().__init__(config, config.num_hidden_layers, attention_backend_cls, placement)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.shared_head.head = nn.Linear(hidden, config.vocab_size, bias=False)

    def forward(self, emb, hidden, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        return super().forward(x, cos, sin, ctx)

    def logits(self, chained: torch.Tensor, target_logits) -> torch.Tensor:
        """Its own head's logits (`target_logits`, the target's lm_head, is not read)."""
        return self.shared_head.head(self.shared_head.norm(chained)).float()


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
        self.attention_backend_cls = attention_backend_cls  # for the MTP layer, built on demand (mtp_layer)

    def mtp_layer(self, placement: Placement) -> tuple[nn.Module, str, CheckpointLayout]:
        """The first multi-token-prediction layer on `placement` (its group shards it; none: whole), on the
        meta device, with the checkpoint prefix of its weights and their layout; ValueError naming
        num_nextn_predict_layers where the config has none."""
        count = getattr(self.config, MTP_FIELD, None) or 0
        if count < 1:
            raise ValueError(f"speculative_config.method 'mtp': this DeepSeek-V3 checkpoint has no multi-token-"
                             f"prediction layer (config.json {MTP_FIELD} is {count}); use a checkpoint that "
                             "ships one, or another method (ngram, suffix, draft_model)")
        with torch.device("meta"):
            layer = DeepseekV3MTPLayer(self.config, self.attention_backend_cls, placement)
        layout = CheckpointLayout(fused=(GATE_UP,), experts=SWIGLU_EXPERTS, ignore=(r"^embed_tokens\.",))
        return layer, f"model.layers.{self.config.num_hidden_layers}.", layout
