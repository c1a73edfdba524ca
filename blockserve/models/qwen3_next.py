"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet layers interleaved with gated full attention.

`config.layer_types` says which token mixer each layer has (by default three linear layers,
then one full-attention layer); the feed-forward is a sparse MoE with a gated shared expert
where `num_experts > 0` and the layer is a sparse step not in `mlp_only_layers`, else a dense MLP.

    x ─► embed ─► [ x += mixer(norm x)   x += ffn(norm x) ] × L ─► norm ─► lm_head

    linear_attention   qkvz, ba = proj(x); q|k|v ─► conv ─► gated delta rule (state slot);
                       out_proj(rmsnorm(o) * silu(z))
    full_attention     q|gate = q_proj(x); q, k RMS-normed per head; RoPE on the first
                       partial_rotary_factor of each head; paged attention; o * sigmoid(gate)
    sparse MoE         softmax router, top-k (renormalised if norm_topk_prob), SwiGLU experts,
                       + sigmoid(shared_expert_gate(x)) * shared_expert(x)

RMSNorms scale by (1 + weight) (the checkpoint stores the offset); the gated norm of the linear
layers scales by weight. KV: full-attention layers hold K/V blocks (FullAttentionSpec); linear
layers hold one state slot per request (LinearStateSpec: conv state, recurrent state), zeroed
for a new request because the spec says so (C1).

Tensor-parallel (placement.tp, N ranks): the linear layers by key head. The fused projections are
laid out per key head, so this rank's key heads are one run of rows:

    in_proj_qkvz  [k-head 0: q | k | rep v | rep z][k-head 1: ...] ...   rows of k-heads [r Hk/N, (r+1) Hk/N)
    in_proj_ba    [k-head 0: rep b | rep a][k-head 1: ...] ...
    conv1d        channels q | k | v, each narrowed to this rank's heads
    A_log, dt_bias  this rank's value heads; the gated norm is per value head (whole weight)
    out_proj      row-parallel

so each rank's state slot holds Hv/N heads (1/N of the bytes). Gated attention: q | gate by
heads, k / v by KV heads (replicated when N > num_key_value_heads), o_proj row-parallel. MoE:
the router and the shared expert's gate whole, experts and the shared expert sharded by
intermediate size. linear_num_key_heads, num_attention_heads and the intermediate sizes must
divide by N.

Multi-token prediction (`mtp.*` weights; models/mtp.py): loaded only for speculative_config method
"mtp" (skipped otherwise), as Qwen3NextMTPLayer: one gated full-attention layer with the sparse MoE,

    emb(x[t+1]), h[t] ─► fc([pre_fc_norm_embedding(emb) | pre_fc_norm_hidden(h)]) ─► layer ─► norm ─► h'
                                                                 h' ─► the target's lm_head ─► logits

h' (after `mtp.norm`) is also the state a further draft chains from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.gated_deltanet import GatedDeltaNet
from blockserve.attention.layer import Attention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.layers import (
    head_linear,
    head_slice,
    kv_linear,
    local_heads,
    local_kv_heads,
    row_linear,
    shard_on_load,
    vocab_embedding,
)
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, GatedRMSNorm, OffsetRMSNorm, require_activation
from blockserve.models.moe import SparseMoe, sparse_layer
from blockserve.models.placement import Placement
from blockserve.models.rotary import RotaryEmbedding, apply_rotary
from blockserve.models.weights import GATE_UP, SWIGLU_EXPERTS, CheckpointLayout


class Qwen3NextAttention(nn.Module):
    def __init__(self, config, layer_idx: int, backend_cls: type[PagedAttention], rotary_dim: int,
                 placement: Placement):
        super().__init__()
        tp, hidden = placement.tp, config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads = local_heads(heads, tp, "num_attention_heads"), local_kv_heads(kv_heads, tp)
        self.head_dim = d = config.head_dim
        self.rotary_dim = rotary_dim
        bias = config.attention_bias
        self.q_proj = head_linear(hidden, heads, 2 * d, tp, bias=bias)  # per head: q | gate
        self.k_proj = kv_linear(hidden, d, kv_heads, tp, bias=bias)
        self.v_proj = kv_linear(hidden, d, kv_heads, tp, bias=bias)
        self.o_proj = row_linear(heads * d, hidden, tp, bias=bias, what="num_attention_heads * head_dim")
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, self.head_dim,
                              backend_cls(self.head_dim**-0.5), dtype=placement.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([apply_rotary(rot, cos, sin), rest], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        out = self.attn(q, k, self.v_proj(x), ctx) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class Qwen3NextGatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int, placement: Placement):
        super().__init__()
        tp, hidden = placement.tp, config.hidden_size
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads ({v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({k_heads})")
        self.rep = rep = v_heads // k_heads
        # Whole key-head groups per rank (their value heads with them): this rank's share of each.
        self.num_k_heads = local_heads(k_heads, tp, "linear_num_key_heads")
        self.num_v_heads = self.num_k_heads * rep
        self.deltanet = GatedDeltaNet(f"model.layers.{layer_idx}.linear_attn", self.num_k_heads, self.num_v_heads,
                                      dk, dv, config.linear_conv_kernel_dim, dtype=placement.dtype)
        conv_dim = self.deltanet.conv_dim
        self.in_proj_qkvz = head_linear(hidden, k_heads, 2 * dk + 2 * rep * dv, tp, what="linear_num_key_heads")
        self.in_proj_ba = head_linear(hidden, k_heads, 2 * rep, tp, what="linear_num_key_heads")
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        q_or_k, v = (None, None) if tp is None else (head_slice(k_heads, dk, tp, "linear_num_key_heads"),
                                                      head_slice(v_heads, dv, tp, "linear_num_value_heads"))
        shard_on_load(self.conv1d.weight, None if tp is None else [q_or_k, q_or_k, v])  # channels q | k | v
        per_head = None if tp is None else [head_slice(v_heads, 1, tp, "linear_num_value_heads")]
        self.dt_bias = shard_on_load(nn.Parameter(torch.empty(self.num_v_heads)), per_head)
        self.A_log = shard_on_load(nn.Parameter(torch.empty(self.num_v_heads)), per_head)
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps, F.silu)  # per value head: whole on every rank
        self.out_proj = row_linear(v_heads * dv, hidden, tp, what="linear_num_value_heads * linear_value_head_dim")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, dk, dv, rep = x.shape[0], self.head_k_dim, self.head_v_dim, self.rep
        # Projections are grouped by key head: [q | k | rep value heads | rep z heads], [rep b | rep a].
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.num_k_heads, -1).split([dk, dk, rep * dv, rep * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * rep).split([rep, rep], dim=-1)
        mixed_qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        beta = b.reshape(t, -1).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, -1).float() + self.dt_bias)
        out = self.deltanet(mixed_qkv, g, beta, self.conv1d.weight[:, 0], None, ctx)
        out = self.norm(out, z.reshape(t, self.num_v_heads, dv))
        return self.out_proj(out.reshape(t, -1))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend_cls: type[PagedAttention], rotary_dim: int,
                 placement: Placement, layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type or config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen3NextGatedDeltaNet(config, layer_idx, placement)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(config, layer_idx, backend_cls, rotary_dim, placement)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {self.layer_type!r} "
                             "(expected 'linear_attention' or 'full_attention')")
        tp = placement.tp
        # A layer of the stack follows Qwen's sparse-step rule; one given its type (the MTP head's) is sparse
        # wherever the model has experts.
        sparse = sparse_layer(config, layer_idx) if layer_type is None else config.num_experts > 0
        self.mlp = (SparseMoe(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, normalize=config.norm_topk_prob,
                              shared_intermediate_size=config.shared_expert_intermediate_size, tp=tp)
                    if sparse else
                    GatedMLP(config.hidden_size, config.intermediate_size, tp=tp))
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            x = x + self.linear_attn(h, ctx)
        else:
            x = x + self.self_attn(h, cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def rotary_dim_of(config) -> int:
    """The leading dims of each attention head that carry RoPE (partial_rotary_factor of head_dim)."""
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


class Qwen3NextMTPLayer(nn.Module):
    """The multi-token-prediction head (checkpoint `mtp.*`): `forward(emb, hidden, cos, sin, ctx)`, the
    embeddings of the tokens after the target's hidden states -> the chained states (after `norm`),
    which `logits` turns into the next token's logits through the target's lm_head."""

    reads_target_lm_head = True

    def __init__(self, config, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, config.num_hidden_layers, backend_cls,
                                                           rotary_dim_of(config), placement, "full_attention")])
        self.norm = OffsetRMSNorm(hidden, config.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](x, cos, sin, ctx))

    def logits(self, chained: torch.Tensor, target_logits) -> torch.Tensor:
        """`target_logits` (hidden -> logits through the target's lm_head) of the chained states."""
        return target_logits(chained)


class Qwen3NextModel(nn.Module):
    def __init__(self, config, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        rotary_dim = rotary_dim_of(config)
        self.rotary = RotaryEmbedding(config, rotary_dim, placement)  # computed here, not loaded
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
            self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i, backend_cls, rotary_dim, placement)
                                        for i in range(config.num_hidden_layers))
            self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class Qwen3NextForCausalLM(CausalLM):
    """`Qwen3NextForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before
    use. Experts load per expert (`mlp.experts.N.gate_proj.weight`, as Qwen's checkpoints) or already
    stacked (`mlp.experts.gate_up_proj`, transformers' state_dict); multi-token-prediction weights
    (`mtp.*`) are skipped (`mtp_layer` builds their head for speculative decoding)."""

    checkpoint = CheckpointLayout(fused=(GATE_UP,), experts=SWIGLU_EXPERTS, ignore=(r"^mtp\.",))
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        require_activation(hf_config, "silu", "Qwen3-Next")
        super().__init__(hf_config, Qwen3NextModel(hf_config, attention_backend_cls, placement), placement)
        self.attention_backend_cls = attention_backend_cls  # for the MTP head, built on demand (mtp_layer)

    def mtp_layer(self, placement: Placement) -> tuple[nn.Module, str, CheckpointLayout]:
        """The multi-token-prediction head on `placement` (its group shards it; none: whole), on the meta
        device, with the checkpoint prefix of its weights (`mtp.`; only its first layer is read) and
        their layout."""
        with torch.device("meta"):
            layer = Qwen3NextMTPLayer(self.config, self.attention_backend_cls, placement)
        return layer, "mtp.", CheckpointLayout(fused=(GATE_UP,), experts=SWIGLU_EXPERTS, ignore=(r"^layers\.[1-9]",))
