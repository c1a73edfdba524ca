"""Kimi Linear (`KimiLinearForCausalLM`): MLA full-attention layers interleaved with Kimi Delta
Attention (KDA) layers, MoE feed-forward. Reference: transformers 5.24's kimi_linear model.

    x ─► embed ─► [ x += mixer(norm x)   x += ffn(norm x) ] × L ─► norm ─► lm_head

    layer_types[i]      "full_attention": MLA without position encoding (NoPE; the rope part of
                        keys and queries is used unrotated), latent rows in an MLASpec group
                        "linear_attention": KDA, conv + recurrent state in a LinearStateSpec slot
    mlp_layer_types[i]  "dense": SwiGLU MLP; "sparse": DeepSeek-V3's MoE (sigmoid, grouped top-k; moe.py)

KDA layer (attention/kda.py does the conv, the delta rule and the state slot):

    q, k, v = q_proj x, k_proj x, v_proj x  ─► short causal conv + SiLU (in the state layer)
    g    = -exp(A_log) * softplus(f_b(f_a x) + dt_bias)      per head and channel, [T, H, D]
    beta = sigmoid(b_proj x)                                 per head
    out  = o_proj( rmsnorm(kda(q, k, v, g, beta)) * o_norm.weight * sigmoid(g_b(g_a x)) )

Checkpoints: the names moonshotai/Kimi-Linear publishes (and save_pretrained writes):
`block_sparse_moe.` for the feed-forward, experts `w1` (gate) `w3` (up) `w2` (down), separate
`q_conv1d` / `k_conv1d` / `v_conv1d` (loaded as one `qkv_conv1d`), `f_a_proj` / `f_b_proj` /
`dt_bias` / `A_log` under `self_attn`. transformers' runtime names (`mlp.`, `forget_gate.`) are
accepted too.

Tensor-parallel (placement.tp, N ranks): KDA by head. q / k / v, f_b, g_b and b projections are
column-parallel by head, the q | k | v conv channels and dt_bias / A_log narrowed to this rank's
heads, the low-rank f_a / g_a whole on every rank, o_norm per head (whole weight), o_proj
row-parallel; each rank's state slot holds H/N heads. MLA heads sharded with the latent cache
whole on every rank (mla_block.py); the MLPs and every expert sharded by intermediate size (moe.py).
linear_num_heads, num_attention_heads and the intermediate sizes must divide by N.
"""

from __future__ import annotations

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.kda import KimiDeltaAttention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.layers import (
    head_linear,
    head_slice,
    local_heads,
    row_linear,
    shard_on_load,
    vocab_embedding,
)
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, GatedRMSNorm, RMSNorm, require_activation
from blockserve.models.mla_block import MLABlock
from blockserve.models.moe import DeepseekMoE
from blockserve.models.placement import Placement
from blockserve.models.weights import GATE_UP, SWIGLU_EXPERTS, CheckpointLayout, Fused


class KDABlock(nn.Module):
    """Projections, gates and output norm around the KDA state layer."""

    def __init__(self, config, layer_idx: int, placement: Placement):
        super().__init__()
        tp, heads = placement.tp, config.linear_num_heads
        self.num_heads = h = local_heads(heads, tp, "linear_num_heads")  # this rank's
        self.head_dim = d = config.linear_head_dim
        hidden, kernel = config.hidden_size, config.linear_conv_kernel_dim
        self.q_proj, self.k_proj, self.v_proj = (head_linear(hidden, heads, d, tp, what="linear_num_heads")
                                                 for _ in range(3))
        self.qkv_conv1d = nn.Conv1d(3 * h * d, 3 * h * d, kernel, groups=3 * h * d, bias=False)  # [q | k | v] channels
        by_head = None if tp is None else head_slice(heads, d, tp, "linear_num_heads")
        shard_on_load(self.qkv_conv1d.weight, None if tp is None else [by_head] * 3)
        self.f_a_proj = nn.Linear(hidden, d, bias=False)  # low rank: whole on every rank
        self.f_b_proj = head_linear(d, heads, d, tp, what="linear_num_heads")
        self.dt_bias = shard_on_load(nn.Parameter(torch.empty(h * d)), None if tp is None else [by_head])
        self.A_log = shard_on_load(nn.Parameter(torch.empty(1, 1, h, 1)),
                                   None if tp is None else [head_slice(heads, 1, tp, "linear_num_heads")], dim=2)
        self.b_proj = head_linear(hidden, heads, 1, tp, what="linear_num_heads")
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = head_linear(d, heads, d, tp, what="linear_num_heads")
        self.o_norm = GatedRMSNorm(d, config.rms_norm_eps, torch.sigmoid)  # per head: whole on every rank
        self.o_proj = row_linear(heads * d, hidden, tp, what="linear_num_heads * linear_head_dim")
        self.attn = KimiDeltaAttention(f"model.layers.{layer_idx}.self_attn", h, d, kernel, dtype=placement.dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = (self.f_b_proj(self.f_a_proj(x)) + self.dt_bias).view(t, h, d)
        g = -self.A_log.view(h, 1).exp() * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))  # as transformers
        beta = self.b_proj(x).sigmoid()
        o = self.attn(mixed, self.qkv_conv1d.weight[:, 0], g, beta, ctx)  # [T, H, D]
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        return self.o_proj(self.o_norm(o, gate).reshape(t, h * d))


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attention_backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.linear = config.layer_types[layer_idx] == "linear_attention"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.linear:
            self.self_attn = KDABlock(config, layer_idx, placement)
        else:
            scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
            self.self_attn = MLABlock(config, layer_idx, attention_backend_cls, placement, use_rope=False, scale=scale)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.mlp_layer_types[layer_idx] == "sparse"
        tp = placement.tp
        self.mlp = DeepseekMoE(config, tp) if sparse else GatedMLP(config.hidden_size, config.intermediate_size, tp=tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, ctx) if self.linear else self.self_attn(h, None, None, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearModel(nn.Module):
    def __init__(self, config, attention_backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
            self.layers = nn.ModuleList(KimiLinearDecoderLayer(config, i, attention_backend_cls, placement)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """No layer uses positions: MLA here is NoPE and KDA is recurrent."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class KimiLinearForCausalLM(CausalLM):
    """`KimiLinearForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights`
    before use. The attention backend's name picks the MLA flavour (exact / whole_block)."""

    checkpoint = CheckpointLayout(
        fused=(GATE_UP, Fused("qkv_conv1d", ("q_conv1d", "k_conv1d", "v_conv1d"))),
        experts=SWIGLU_EXPERTS,
        renames=(  # published / saved checkpoint names -> ours (transformers' runtime names)
            (r"\.block_sparse_moe\.", ".mlp."),
            (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
            (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
            (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
            (r"\.self_attn\.forget_gate\.", ".self_attn."),
        ),
        ignore_layers_past_config=True,
    )
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        require_activation(hf_config, "silu", "Kimi Linear")
        unknown = set(hf_config.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"unknown Kimi Linear layer types {sorted(unknown)}; "
                             "expected 'full_attention' (MLA) or 'linear_attention' (KDA) per layer")
        super().__init__(hf_config, KimiLinearModel(hf_config, attention_backend_cls, placement), placement)
