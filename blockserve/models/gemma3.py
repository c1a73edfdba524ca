"""Gemma 3 text (`Gemma3ForCausalLM`) over the paged KV cache: local and global layers interleaved.

Each layer is "sliding_attention" (local: a token sees the last `sliding_window` tokens, itself
included) or "full_attention" (global), as `config.layer_types` says. The two kinds declare
different KV specs, so the engine forms two groups: the sliding group frees a request's blocks
as they fall out of the window; the full group keeps them all.

    x ─► embed × √hidden ─► [ x += post_attn_norm(o(attn(rope_t(qk_norm(qkv(input_norm x))))))
                              x += post_ff_norm(down(gelu_tanh(gate) * up)(pre_ff_norm x)) ] × L ─► norm
      ─► logits = x · embedᵀ  (tanh soft-capped by final_logit_softcapping when set)

    layer type          KV spec                        RoPE (config.rope_parameters[type])
    sliding_attention   SlidingWindowSpec(window)      local base (rope_local_base_freq), no scaling
    full_attention      FullAttentionSpec              global base, with the checkpoint's scaling

What differs from Llama: every RMSNorm scales by (1 + weight); q and k are RMS-normed per head
before RoPE; four norms per layer; the attention scale is query_pre_attn_scalar ** -0.5.

Sliding-window convention: transformers' Gemma 3 mask lets query q see key k iff
q - sliding_window < k <= q (masking_utils.sliding_window_overlay: `kv_idx > q_idx - window`),
i.e. the last `sliding_window` tokens, itself included. That is exactly SlidingWindowSpec's and
the paged backends' convention, so the config's window is used unchanged.

Gemma 3 checkpoints leave attention logit soft-capping unset; a config that sets it is rejected
(Gemma 2, which uses it, is gemma2.py: these layers with the hooks below).

Tensor-parallel (placement.tp): sharded as the Llama family is (heads, intermediate size, vocabulary).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.tensor_parallel.layers import local_kv_heads, qkv_linear, row_linear, vocab_embedding
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, OffsetRMSNorm, require_activation
from blockserve.models.placement import Placement
from blockserve.models.rotary import apply_rotary, inverse_frequencies
from blockserve.models.weights import GATE_UP, QKV, CheckpointLayout

SLIDING, FULL = "sliding_attention", "full_attention"

# RoPE types whose frequencies depend on the running sequence length: not precomputable here.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class GemmaRotary(nn.Module):
    """Inverse frequencies of one layer type's RoPE, from `config.rope_parameters[layer_type]`
    (layer_type None: from `config.rope_parameters`, one set for every layer, as Gemma 2's).

    Computed the way transformers' Gemma3RotaryEmbedding computes them, so cos/sin match it
    bit for bit: (position * inv_freq).cos() * attention_scaling, in float32.
    """

    def __init__(self, config, layer_type: str | None, head_dim: int, placement: Placement):
        super().__init__()
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(f"Gemma {layer_type or 'all'} layers with rope_type {rope_type!r} are not supported "
                             f"(their frequencies depend on the sequence length)")
        by_type = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scaling = inverse_frequencies(config, params, head_dim, placement.device, **by_type)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)
        self.dtype = placement.dtype

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the tokens at `positions` (broadcast over heads)."""
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = (freqs.cos() * self.scaling).to(self.dtype), (freqs.sin() * self.scaling).to(self.dtype)
        return cos[:, None], sin[:, None]


class Gemma3Attention(nn.Module):
    """Scores scaled by query_pre_attn_scalar ** -0.5 and, where the config sets
    attn_logit_softcapping, soft-capped by the backend."""

    qk_norm: ClassVar[bool] = True  # an RMSNorm (1 + w) over each q and k head before RoPE

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        tp = placement.tp
        bias = bool(config.attention_bias)
        self.qkv_proj = qkv_linear(config.hidden_size, head_dim, config.num_attention_heads,
                                   config.num_key_value_heads, tp, bias=bias)
        self.num_heads = config.num_attention_heads // (1 if tp is None else tp.size)  # this rank's
        self.num_kv_heads = local_kv_heads(config.num_key_value_heads, tp)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = row_linear(config.num_attention_heads * head_dim, config.hidden_size, tp, bias=bias,
                                 what="num_attention_heads * head_dim")
        if self.qk_norm:
            self.q_norm = OffsetRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = OffsetRMSNorm(head_dim, config.rms_norm_eps)
        window = config.sliding_window if config.layer_types[layer_idx] == SLIDING else None
        scale, softcap = config.query_pre_attn_scalar**-0.5, config.attn_logit_softcapping
        backend = backend_cls(scale) if softcap is None else backend_cls(scale, softcap=softcap)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend, dtype=placement.dtype, sliding_window=window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class Gemma3DecoderLayer(nn.Module):
    attention: ClassVar[type[nn.Module]] = Gemma3Attention

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.self_attn = self.attention(config, layer_idx, head_dim, backend_cls, placement)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation="gelu_pytorch_tanh",
                            tp=placement.tp)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    decoder_layer: ClassVar[type[nn.Module]] = Gemma3DecoderLayer
    rope_per_layer_type: ClassVar[bool] = True  # config.rope_parameters[layer type]; False: one set for all

    def __init__(self, config, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        head_dim = config.head_dim
        self.rotary = nn.ModuleDict({t: GemmaRotary(config, t if self.rope_per_layer_type else None, head_dim, placement)
                                     for t in sorted(set(config.layer_types))})
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=placement.dtype,
                                                         device=placement.device), persistent=False)
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
            self.layers = nn.ModuleList(self.decoder_layer(config, i, head_dim, backend_cls, placement)
                                        for i in range(config.num_hidden_layers))
            self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rope = {t: rotary(positions) for t, rotary in self.rotary.items()}
        x = self.embed_tokens(input_ids) * self.embed_scale
        for layer in self.layers:
            x = layer(x, *rope[layer.layer_type], ctx)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    """`Gemma3ForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before use.
    Local layers hold a sliding window of `config.sliding_window` tokens (itself included, as in
    transformers' mask), global layers full attention: two specs, hence two KV groups."""

    checkpoint = CheckpointLayout(fused=(QKV, GATE_UP))
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        _validate(hf_config)
        super().__init__(hf_config, Gemma3TextModel(hf_config, attention_backend_cls, placement), placement,
                         final_logit_softcapping=hf_config.final_logit_softcapping)


def _validate(config) -> None:
    """Reject, with an actionable message, what this implementation would otherwise serve wrongly."""
    if config.attn_logit_softcapping is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported for Gemma 3 "
                         "(its checkpoints leave it unset; Gemma 2's soft-capped attention is gemma2.py)")
    validate_gemma_layers(config, "Gemma 3")


def validate_gemma_layers(config, family: str) -> None:
    """What Gemma 2 and 3 share: causal attention, gelu_pytorch_tanh, a sliding or full type per
    layer and a positive window where a layer slides. ValueError naming the setting otherwise."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported for generation")
    require_activation(config, "gelu_pytorch_tanh", family, key="hidden_activation")
    unknown = sorted(set(config.layer_types) - {SLIDING, FULL})
    if unknown or len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must give one of {SLIDING!r} / {FULL!r} per layer "
                         f"({config.num_hidden_layers} layers); got {config.layer_types}")
    if SLIDING in config.layer_types and not (isinstance(config.sliding_window, int) and config.sliding_window > 0):
        raise ValueError(f"the config has sliding_attention layers but sliding_window={config.sliding_window!r}")
