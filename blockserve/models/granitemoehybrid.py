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

Tensor-parallel (placement.tp, N ranks): Mamba2 by head. in_proj packs five parts, each narrowed
to this rank's share; B and C belong to groups, sharded too, or (N a multiple of mamba_n_groups)
the one group of this rank's heads, replicated on the N / n_groups ranks that share it:

    in_proj   gate [H P] | x [H P] | B [G N] | C [G N] | dt [H]    heads / groups of this rank
    conv1d    channels x | B | C, narrowed alike; A_log, dt_bias, D: this rank's heads
    norm      rmsnorm per group of H/G heads: local when the group is on this rank alone, else
              its sum of squares all-reduced over the ranks that share it (one small all-reduce)
    out_proj  row-parallel

Each rank's state slot holds H/N heads. Attention: q by heads, k / v by KV heads (replicated when
N > num_key_value_heads), o_proj row-parallel; the router whole, experts and the shared MLP sharded
by intermediate size. mamba_n_heads, num_attention_heads and the intermediate sizes must divide by N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.mamba2 import Mamba2
from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.tensor_parallel.layers import (
    head_linear,
    head_slice,
    kv_linear,
    local_heads,
    local_kv_heads,
    row_linear,
    shard_on_load,
    shared_head_slice,
    sliced_column_linear,
    vocab_embedding,
)
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, GatedRMSNorm, RMSNorm, require_activation
from blockserve.models.moe import Experts
from blockserve.models.placement import Placement
from blockserve.models.rotary import RotaryEmbedding, apply_rotary
from blockserve.models.weights import CheckpointLayout


class SharedGroupGatedRMSNorm(nn.Module):
    """Mamba2's gated norm, rmsnorm(x * silu(gate)) * weight over a group of `group_size` channels
    that this rank holds only part of (its heads are 1/N of one group shared by several ranks):
    each rank's sum of squares goes into its group's column, one all-reduce adds them up."""

    def __init__(self, dim: int, group: int, num_groups: int, group_size: int, eps: float, tp: TensorParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.group, self.num_groups, self.group_size, self.eps, self.tp = group, num_groups, group_size, eps, tp

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x * F.silu(gate)
        sums = x.new_zeros(x.shape[0], self.num_groups, dtype=torch.float32)
        sums[:, self.group] = x.float().pow(2).sum(-1)
        mean = self.tp.all_reduce(sums)[:, self.group, None] / self.group_size
        return (x * torch.rsqrt(mean + self.eps).to(x.dtype)) * self.weight


class GraniteMambaLayer(nn.Module):
    def __init__(self, config, layer_idx: int, placement: Placement):
        super().__init__()
        tp, hidden = placement.tp, config.hidden_size
        heads, head_dim = config.mamba_n_heads, config.mamba_d_head
        groups, state = config.mamba_n_groups, config.mamba_d_state
        if heads % groups:
            raise ValueError(f"mamba_n_heads ({heads}) must be a multiple of mamba_n_groups ({groups})")
        local = local_heads(heads, tp, "mamba_n_heads")
        if tp is None:
            per_head = per_group = x_rows = None
        else:  # this rank's heads, and the groups they read B and C from
            x_rows = head_slice(heads, head_dim, tp, "mamba_n_heads")
            per_group = shared_head_slice(groups, state, tp, "mamba_n_groups")
            per_head = head_slice(heads, 1, tp, "mamba_n_heads")
        local_groups = groups if tp is None else per_group.size // state
        self.ssm = Mamba2(f"model.layers.{layer_idx}.mamba", local, head_dim, local_groups, state,
                          config.mamba_d_conv, config.mamba_chunk_size,
                          config.time_step_limit or (0.0, float("inf")), dtype=placement.dtype)
        self.intermediate_size, conv_dim = local * head_dim, self.ssm.conv_dim
        full = heads * head_dim
        self.in_proj = sliced_column_linear(  # gate | x | B | C | dt
            hidden, [full, full, groups * state, groups * state, heads],
            None if tp is None else [x_rows, x_rows, per_group, per_group, per_head], bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.mamba_d_conv, groups=conv_dim, bias=config.mamba_conv_bias)
        channels = None if tp is None else [x_rows, per_group, per_group]  # x | B | C
        shard_on_load(self.conv1d.weight, channels)
        if self.conv1d.bias is not None:
            shard_on_load(self.conv1d.bias, channels)
        heads_only = None if tp is None else [per_head]
        self.dt_bias = shard_on_load(nn.Parameter(torch.empty(local)), heads_only)
        self.A_log = shard_on_load(nn.Parameter(torch.empty(local)), heads_only)
        self.D = shard_on_load(nn.Parameter(torch.empty(local)), heads_only)
        if tp is None or groups >= tp.size:  # every norm group whole on one rank
            self.norm = GatedRMSNorm(self.intermediate_size, config.rms_norm_eps, F.silu, groups=local_groups,
                                     norm_before_gate=False)
        else:
            self.norm = SharedGroupGatedRMSNorm(self.intermediate_size, per_group.start // state, groups,
                                                full // groups, config.rms_norm_eps, tp)
        shard_on_load(self.norm.weight, None if tp is None else [x_rows])
        self.out_proj = row_linear(full, hidden, tp, bias=config.mamba_proj_bias, what="mamba_n_heads * mamba_d_head")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate, xBC, dt = self.in_proj(x).split([self.intermediate_size, self.ssm.conv_dim, self.ssm.num_heads], dim=-1)
        y = self.ssm(xBC, dt, self.conv1d.weight[:, 0], self.conv1d.bias, -self.A_log.float().exp(), self.D,
                     self.dt_bias, ctx)
        return self.out_proj(self.norm(y, gate))


class GraniteAttention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        tp, hidden = placement.tp, config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads = local_heads(heads, tp, "num_attention_heads"), local_kv_heads(kv_heads, tp)
        self.head_dim = head_dim
        bias = config.attention_bias
        self.q_proj = head_linear(hidden, heads, head_dim, tp, bias=bias)
        self.k_proj = kv_linear(hidden, head_dim, kv_heads, tp, bias=bias)
        self.v_proj = kv_linear(hidden, head_dim, kv_heads, tp, bias=bias)
        self.o_proj = row_linear(heads * head_dim, hidden, tp, bias=bias, what="num_attention_heads * head_dim")
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

    def __init__(self, config, tp: TensorParallelGroup | None = None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        # whole on every rank, so every rank routes alike
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.intermediate_size, tp)

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
        tp = placement.tp
        self.block_sparse_moe = MoE(config, tp) if config.num_local_experts > 0 else None
        self.shared_mlp = GatedMLP(config.hidden_size, config.shared_intermediate_size, tp=tp)
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
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
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
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        require_activation(hf_config, "silu", "Granite 4.0-H")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        super().__init__(hf_config, GraniteMoeHybridModel(hf_config, head_dim, attention_backend_cls, placement),
                         placement, logits_scaling=hf_config.logits_scaling)
