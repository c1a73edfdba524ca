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

Attention logit soft-capping (Gemma 2's `attn_logit_softcapping`) is not implemented by the
paged backends: a config that sets it is rejected rather than served wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.paged_attention import PagedAttention
from blockserve.kv import FullAttentionSpec, SlidingWindowSpec
from blockserve.models.fused_weights import load_fused_weights
from blockserve.models.llama import apply_rotary

SLIDING, FULL = "sliding_attention", "full_attention"

# RoPE types whose frequencies depend on the running sequence length: not precomputable here.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight): a zero weight is the identity (Gemma's convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1.0 + self.weight)


class GemmaRotary(nn.Module):
    """Inverse frequencies of one layer type's RoPE, from `config.rope_parameters[layer_type]`.

    Computed the way transformers' Gemma3RotaryEmbedding computes them, so cos/sin match it
    bit for bit: (position * inv_freq).cos() * attention_scaling, in float32.
    """

    def __init__(self, config, layer_type: str, head_dim: int):
        super().__init__()
        params = config.rope_parameters[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":  # as transformers' compute_default_rope_parameters
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type not in _LENGTH_DEPENDENT_ROPE:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu", layer_type=layer_type)
        else:
            supported = ", ".join(sorted(set(ROPE_INIT_FUNCTIONS) - set(_LENGTH_DEPENDENT_ROPE)))
            raise ValueError(f"Gemma 3 {layer_type} layers with rope_type {rope_type!r} are not supported; "
                             f"supported: default, {supported}")
        if 2 * inv_freq.numel() != head_dim:
            raise ValueError(f"partial rotary embeddings are not supported "
                             f"(rotary dim {2 * inv_freq.numel()}, head_dim {head_dim})")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the tokens at `positions` (broadcast over heads)."""
        freqs = positions.float()[:, None] * self.inv_freq
        return (freqs.cos() * self.scaling)[:, None], (freqs.sin() * self.scaling)[:, None]


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == SLIDING else None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        bias = bool(config.attention_bias)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend_cls(config.query_pre_attn_scalar**-0.5))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        _, meta = ctx.for_layer(self.attn.layer_name)
        if meta.sliding_window != self.sliding_window:  # a caller that forgot the group's window
            raise ValueError(f"{self.attn.layer_name} is a {self.layer_type} layer (window {self.sliding_window}) "
                             f"but its metadata has sliding_window={meta.sliding_window}")
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, layer_idx, head_dim, backend_cls)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    def __init__(self, config, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.layer_types = list(config.layer_types)
        self.rotary = nn.ModuleDict({t: GemmaRotary(config, t, head_dim) for t in sorted(set(self.layer_types))})
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype (float32 here)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=torch.float32),
                             persistent=False)
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                Gemma3DecoderLayer(config, i, head_dim, backend_cls) for i in range(config.num_hidden_layers)
            )
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rope = {t: rotary(positions) for t, rotary in self.rotary.items()}
        x = self.embed_tokens(input_ids) * self.embed_scale
        for layer in self.layers:
            x = layer(x, *rope[layer.layer_type], ctx)
        return self.norm(x)


class Gemma3ForCausalLM(nn.Module):
    """`Gemma3ForCausalLM(hf_config, attention_backend_cls)`; call `load_weights` before use."""

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        _validate(hf_config)
        self.config = hf_config
        self.head_dim = hf_config.head_dim
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.final_logit_softcapping = hf_config.final_logit_softcapping
        self.model = Gemma3TextModel(hf_config, self.head_dim, attention_backend_cls)
        if not self.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] int64 of the flattened batch -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32, soft-capped if the config says so."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def kv_cache_specs(self, block_size: int) -> dict[str, FullAttentionSpec]:
        """Local layers: a sliding window of `config.sliding_window` tokens (itself included, as in
        transformers' mask); global layers: full attention. Two specs, hence two KV groups."""
        c = self.config
        full = FullAttentionSpec(block_size, c.num_key_value_heads, self.head_dim, "float32")
        local = SlidingWindowSpec(block_size, c.num_key_value_heads, self.head_dim, "float32",
                                  sliding_window=c.sliding_window) if SLIDING in c.layer_types else None
        return {f"model.layers.{i}.self_attn": local if t == SLIDING else full for i, t in enumerate(c.layer_types)}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Materialise every parameter from (Hugging Face name, tensor) pairs, as float32.

        q/k/v and gate/up are concatenated into the fused projections. Raises ValueError naming
        unexpected, missing or mis-shaped weights.
        """
        load_fused_weights(
            self, named_tensors,
            skip=lambda name: name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight"),
        )

def _validate(config) -> None:
    """Reject, with an actionable message, what this implementation would otherwise serve wrongly."""
    if config.attn_logit_softcapping is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported: the paged "
                         "attention backends do not soft-cap attention scores (Gemma 3 checkpoints leave it unset)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported for generation")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {config.hidden_activation!r} is not supported by Gemma 3 "
                         "(expected 'gelu_pytorch_tanh')")
    unknown = sorted(set(config.layer_types) - {SLIDING, FULL})
    if unknown or len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must give one of {SLIDING!r} / {FULL!r} per layer "
                         f"({config.num_hidden_layers} layers); got {config.layer_types}")
    if SLIDING in config.layer_types and not (isinstance(config.sliding_window, int) and config.sliding_window > 0):
        raise ValueError(f"the config has sliding_attention layers but sliding_window={config.sliding_window!r}")
