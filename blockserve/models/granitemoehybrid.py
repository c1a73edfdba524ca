"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers interleaved with attention layers.

`config.layer_types` says which mixer each layer has ("linear_attention" is Mamba2); every
layer then runs a shared SwiGLU MLP, plus a top-k MoE where `num_local_experts > 0`. Granite's
muP multipliers scale the embeddings, each residual branch, the attention scores and the logits.

    x ─► embed * m_emb ─► [x += m_res mixer(norm x); x += m_res ffn(norm x)] × L ─► norm ─► lm_head / m_logits

    mamba        gate | xBC | dt = in_proj(x); xBC ─► conv ─► SSD scan (state slot);
                 out_proj(grouped_rmsnorm(y * silu(gate)))
    attention    q, k, v; RoPE only if position_embedding_type == "rope" (Granite 4.0-H uses none);
                 scale = attention_multiplier
    ffn          shared_mlp(x) (+ experts: softmax over the top-k router logits, SwiGLU)

KV: attention layers hold K/V blocks (FullAttentionSpec); Mamba2 layers hold one state slot per
request (LinearStateSpec: conv state, SSM state), zeroed for a new request because the spec
says so (C1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.mamba2 import Mamba2
from blockserve.attention.paged_attention import PagedAttention
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, GatedRMSNorm, RMSNorm, require_activation
from blockserve.models.moe import Experts
from blockserve.models.placement import Placement
from blockserve.models.rotary import RotaryEmbedding, apply_rotary
from blockserve.models.weights import CheckpointLayout


class GraniteMambaLayer(nn.Module):
    def __init__(self, config, layer_idx: int, placement: Placement):
        super().__init__()
        heads, head_dim = config.mamba_n_heads, config.mamba_d_head
        self.ssm = Mamba2(f"model.layers.{layer_idx}.mamba", heads, head_dim, config.mamba_n_groups,
                          config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size,
                          config.time_step_limit or (0.0, float("inf")), dtype=placement.dtype)
        self.intermediate_size, conv_dim = heads * head_dim, self.ssm.conv_dim
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate_size + conv_dim + heads,
                                 bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.mamba_d_conv, groups=conv_dim, bias=config.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GatedRMSNorm(self.intermediate_size, config.rms_norm_eps, F.silu, groups=config.mamba_n_groups,
                                 norm_before_gate=False)
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mamba_proj_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate, xBC, dt = self.in_proj(x).split([self.intermediate_size, self.ssm.conv_dim, self.ssm.num_heads], dim=-1)
        y = self.ssm(xBC, dt, self.conv1d.weight[:, 0], self.conv1d.bias, -self.A_log.float().exp(), self.D,
                     self.dt_bias, ctx)
        return self.out_proj(self.norm(y, gate))


class GraniteAttention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=bias)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend_cls(config.attention_multiplier), dtype=placement.dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(self.attn(q, k, self.v_proj(x), ctx))


class MoE(nn.Module):
    """Top-k of the router's logits, softmax over those k, SwiGLU experts."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, index = self.router(x).float().topk(self.top_k, dim=-1)
        return self.experts(x, top_logits.softmax(-1).to(x.dtype), index)


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.mamba = GraniteMambaLayer(config, layer_idx, placement)
        elif self.layer_type == "full_attention":
            self.self_attn = GraniteAttention(config, layer_idx, head_dim, backend_cls, placement)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {self.layer_type!r} "
                             "(expected 'linear_attention' (Mamba2) or 'full_attention')")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = MoE(config) if config.num_local_experts > 0 else None
        self.shared_mlp = GatedMLP(config.hidden_size, config.shared_intermediate_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, rope, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, ctx) if self.layer_type == "linear_attention" else self.self_attn(h, rope, ctx)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        ffn = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ffn = ffn + self.block_sparse_moe(h)
        return x + ffn * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        rope = config.position_embedding_type == "rope"
        self.rotary = RotaryEmbedding(config, head_dim, placement) if rope else None
        self.embedding_multiplier = config.embedding_multiplier
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(GraniteDecoderLayer(config, i, head_dim, backend_cls, placement)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rope = self.rotary(positions) if self.rotary is not None else None
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x)


class GraniteMoeHybridForCausalLM(CausalLM):
    """`GraniteMoeHybridForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights`
    before use. The MoE weights may come under Granite's checkpoint names (`input_linear`,
    `output_linear`, `router.layer`) or transformers' (`experts.gate_up_proj`, ...)."""

    checkpoint = CheckpointLayout(renames=(  # Granite's checkpoint names -> ours
        (r"\.block_sparse_moe\.input_linear\.weight$", ".block_sparse_moe.experts.gate_up_proj"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".block_sparse_moe.experts.down_proj"),
        (r"\.block_sparse_moe\.router\.layer\.", ".block_sparse_moe.router."),
        (r"\.shared_mlp\.input_linear\.", ".shared_mlp.gate_up_proj."),  # gate | up, as GatedMLP holds them
        (r"\.shared_mlp\.output_linear\.", ".shared_mlp.down_proj."),
    ))

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        require_activation(hf_config, "silu", "Granite 4.0-H")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        super().__init__(hf_config, GraniteMoeHybridModel(hf_config, head_dim, attention_backend_cls, placement),
                         placement, logits_scaling=hf_config.logits_scaling)
