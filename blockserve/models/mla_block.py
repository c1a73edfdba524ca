"""The projections around the paged MLA layer (attention/mla.py), as DeepSeek-V3 and Kimi Linear
build them.

    q          = q_proj x, or q_b_proj(q_a_layernorm(q_a_proj x)) when q_lora_rank is set    [T, H, Dn + Dr]
    latent | k = kv_a_proj_with_mqa x;  latent = kv_a_layernorm(latent)                      [T, R], [T, Dr]
    RoPE on the last Dr dims of q and on k (interleaved pairs when rope_interleave), unless NoPE
    out        = o_proj(mla(q, latent, k, kv_b_proj.weight))

MLA caches one latent row per token: the normalised `kv_lora_rank` compression and the shared
rope key. The attention backend's name picks the MLA flavour (exact / whole_block).

Tensor-parallel (placement.tp): q and kv_b_proj sharded by heads, o_proj row-parallel; the
low-rank projections and the latent they produce (the cache) are whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.mla import MLA_BACKENDS, MLAttention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.layers import head_linear, row_linear
from blockserve.models.layers import RMSNorm
from blockserve.models.placement import Placement
from blockserve.models.rotary import apply_rotary, apply_rotary_interleaved


class MLABlock(nn.Module):
    """`use_rope=False` (Kimi Linear): no position encoding at all, the rope part of keys and
    queries is used as is. `scale`: the softmax scale."""

    def __init__(self, config, layer_idx: int, attention_backend_cls: type[PagedAttention], placement: Placement,
                 use_rope: bool, scale: float):
        super().__init__()
        tp = placement.tp
        heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.use_rope = use_rope
        self.rope_interleave = bool(getattr(config, "rope_interleave", False))
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = head_linear(hidden, heads, self.qk_head_dim, tp)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers' default eps, not the config's
            self.q_b_proj = head_linear(self.q_lora_rank, heads, self.qk_head_dim, tp)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = head_linear(self.kv_lora_rank, heads, self.qk_nope_head_dim + self.v_head_dim, tp)
        self.kv_b_proj.keep_row_major = True  # MLAttention views its weight per head
        self.o_proj = row_linear(heads * self.v_head_dim, hidden, tp, bias=bias, what="num_attention_heads * v_head_dim")
        self.num_heads = heads // (1 if tp is None else tp.size)  # this rank's
        self.attn = MLAttention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.qk_nope_head_dim,
                                self.v_head_dim, MLA_BACKENDS[attention_backend_cls.name](scale),
                                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
                                dtype=placement.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.qk_head_dim)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.use_rope:
            rotate = apply_rotary_interleaved if self.rope_interleave else apply_rotary
            q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            q = torch.cat([q_nope, rotate(q_rope, cos, sin)], dim=-1)
            k_rope = rotate(k_rope[:, None], cos, sin)[:, 0]
        return self.o_proj(self.attn(q, latent, k_rope, self.kv_b_proj.weight, ctx))
