"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3; and
the decoder the other dense families extend (each in its own file, with only what differs).

One decoder serves the family; the variants differ only in what the config switches on:

    Qwen2    bias on the q/k/v projections
    Qwen3    an RMSNorm over each q and k head before RoPE; `attention_bias` on every projection
    Llama    `attention_bias` / `mlp_bias` when the config sets them
    Mistral  a sliding window on every layer (`sliding_window`); Qwen2/3 on the layers `layer_types` marks
    Phi-3    q/k/v and gate/up stored fused (under our names); LongRoPE; partial rotary (Phi-4-mini)
    any      tied lm_head (`tie_word_embeddings`), RoPE with any scaling transformers knows, on the
             first partial_rotary_factor of each head

LongRoPE (Phi-3 128k, Phi-4-mini) rotates position p with the short factors below
original_max_position_embeddings and the long ones from there (rotary.py), whatever the batch,
chunking or prefix cache: transformers' generate up to that length. transformers runs a longer
sequence entirely with the long factors (generate recomputes one that grows past the length);
blockserve keeps the keys it computed below it.

    x ─► embed ─► [ x += o(attn(rope(qkv(norm x))))  x += down(silu(gate) * up)(norm x) ] × L ─► norm

A layer with a sliding window attends over the last `sliding_window` tokens, itself included (as
transformers' mask: key k visible to query q iff q - window < k <= q), and declares a
SlidingWindowSpec: its KV group frees a request's blocks as they fall out of the window.

What a family built on this decoder changes, through these hooks of LlamaForCausalLM:

    attention_options(config, i, head_dim)   layer i's AttentionOptions: window, no RoPE (NoPE), partial
                                             or interleaved rotary, q/k norm, scale, biases
    decoder_layer                            the layer class: where the norms sit, residual scaling
    __init__(..., embedding_multiplier=, logits_scaling=)

Each residual add is fused into the norm that follows it; with the native fused ops
(native/extension.py) the norm+add, the rotary embedding and silu*up are one pass each, and a
decode-only step's rotary + KV write + attention is one call (attention/rotary_decode.py), and
such a step runs the layers' native calls from one flat loop (llama_decode.py) when every layer
is a LlamaDecoderLayer (the loop is that layer's forward). Q/K/V and gate/up are fused, one
matmul each.

Tensor-parallel (placement.tp): q heads (with their attention sinks, where a family has them), kv
heads (replicated when N > num_key_value_heads) and the intermediate size sharded by rank, o_proj
and down_proj row-parallel, the vocabulary split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.native.extension import fused_ops
from blockserve.native.gate import native_reads
from blockserve.attention.paged_attention import PagedAttention
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.tensor_parallel.layers import (head_slice, local_kv_heads, qkv_linear, row_linear, shard_on_load,
                                               vocab_embedding)
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, RMSNorm, require_activation
from blockserve.models.llama_decode import decode_layers
from blockserve.models.placement import Placement
from blockserve.models.rotary import RotaryEmbedding, apply_rotary, apply_rotary_interleaved
from blockserve.models.weights import GATE_UP, QKV, CheckpointLayout


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's attention differs from plain Llama attention."""

    window: int | None = None  # attend over the last `window` tokens, itself included; None: all
    rotary: bool = True  # False: no position embedding in this layer (NoPE)
    rotary_dim: int | None = None  # the leading dims of each head that are rotated; None: all
    interleaved: bool = False  # RoPE on pairs (x0, x1), (x2, x3), ... (GLM) instead of the two halves
    qk_norm: str | None = None  # "head": RMSNorm over each q and k head; "projection": over all of q, of k
    scale: float | None = None  # the attention scale; None: head_dim ** -0.5
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False  # a learned logit per head in the softmax's denominator (GPT-OSS: `self_attn.sinks`)


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The window layer `layer_idx` attends over: the config's `sliding_window` on every layer, or, where
    the config lists `layer_types`, on those marked "sliding_attention". None (full attention) where
    it is unset, or at least max_position_embeddings (then it never excludes a key)."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or layer_types[layer_idx] == "sliding_attention" else None


def _sliding_window_active(config) -> bool:
    """Whether some layer of `config` attends over a sliding window."""
    return any(sliding_window_of(config, i) is not None for i in range(config.num_hidden_layers))


def rotary_dim_of(config, head_dim: int) -> int:
    """The rotated dims of each head: head_dim scaled by the RoPE parameters' partial_rotary_factor."""
    return int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


def llama_attention_options(config, layer_idx: int, head_dim: int) -> AttentionOptions:
    """The Llama family's attention for layer `layer_idx` (see the module docstring)."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    return AttentionOptions(
        window=sliding_window_of(config, layer_idx),
        rotary_dim=rotary_dim_of(config, head_dim),
        qk_norm="head" if config.model_type in ("qwen3", "qwen3_moe") else None,
        qkv_bias=attention_bias or getattr(config, "qkv_bias", config.model_type == "qwen2"),  # Qwen2-MoE: a field
        o_bias=attention_bias,
    )


class LlamaAttention(nn.Module):
    """Attention with RoPE over the paged cache; `options` (default: the Llama family's for this
    layer) say what differs. With full-width rotate_half RoPE straight from the projection, the
    native rotary and the one-call decode (RotaryDecode) run it."""

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        super().__init__()
        options = options or llama_attention_options(config, layer_idx, head_dim)
        tp = placement.tp
        self.qkv_proj = qkv_linear(config.hidden_size, head_dim, config.num_attention_heads,
                                   config.num_key_value_heads, tp, bias=options.qkv_bias)
        self.num_heads = config.num_attention_heads // (1 if tp is None else tp.size)  # this rank's
        self.num_kv_heads = local_kv_heads(config.num_key_value_heads, tp)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = row_linear(config.num_attention_heads * head_dim, config.hidden_size, tp, bias=options.o_bias,
                                 what="num_attention_heads * head_dim")
        self.qk_norm = options.qk_norm
        if options.qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        elif options.qk_norm == "projection":  # the norm's mean runs over every head: not shardable
            if tp is not None:
                raise ValueError("a q/k norm over the whole projection cannot be sharded over tensor-parallel ranks")
            self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        elif options.qk_norm is not None:
            raise ValueError(f"unknown qk_norm {options.qk_norm!r} (expected 'head' or 'projection')")
        self.rotary = options.rotary
        self.rotary_dim = options.rotary_dim or head_dim
        self.interleaved = options.interleaved
        scale = head_dim**-0.5 if options.scale is None else options.scale
        backend = backend_cls(scale, sinks=True) if options.sinks else backend_cls(scale)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend, dtype=placement.dtype, sliding_window=options.window)
        self.sinks = None  # or each of this rank's q heads' sink logit
        if options.sinks:
            self.sinks = shard_on_load(nn.Parameter(torch.empty(self.num_heads)),
                                       None if tp is None else [head_slice(config.num_attention_heads, 1, tp)])
        self.fused = fused_ops()
        # Every dim of every q and k head rotated in rotate_half's layout, straight from the projection:
        # what the native rotary and the one-call decode do.
        self.plain_rotary = (options.qk_norm is None and self.rotary and self.rotary_dim == head_dim
                             and not self.interleaved)
        self.rotary_decode = RotaryDecode(self.attn) if self.plain_rotary else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.rotary_decode is not None:  # a decode-only step: rotary, cache write and attention in one call
            out = self.rotary_decode(qkv, cos[:, 0], sin[:, 0], ctx)
            if out is not None:
                return self.o_proj(out)
        v = qkv[:, self.q_size + self.kv_size:]
        if not self.plain_rotary:
            q, k = self.positioned(qkv[:, :self.q_size + self.kv_size], cos, sin)
        elif self.fused is not None and native_reads(qkv):  # the kernel's device and dtype: q, k rotated in place
            self.fused.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos[:, 0], sin[:, 0])
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        else:  # q and k heads rotated together: half the elementwise calls
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(self.attn(q, k, v, ctx, self.sinks))

    def positioned(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] from the projection's q | k columns [T, (Hq + Hkv) D]: normed,
        then rotated, as the options say."""
        t = qk.shape[0]
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        return q, k

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rotary_dim dims of each head of x [T, H, D]; the rest pass unchanged."""
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary
        if self.rotary_dim == self.head_dim:
            return rotate(x, cos, sin)
        rotated, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([rotate(rotated, cos, sin), rest], dim=-1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls, placement, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False),
                            tp=placement.tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it): the residual
        adds happen inside the next norm (fused). residual None: x is the embedding output."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, ctx), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """embed (× embedding_multiplier) ─► the layers `make_layer(i)` builds ─► norm. Every layer takes
    and returns (x, residual) as LlamaDecoderLayer does; the final norm adds the two."""

    def __init__(self, config, head_dim: int, placement: Placement, make_layer: Callable[[int], nn.Module], *,
                 rotary_dim: int | None = None, embedding_multiplier: float = 1.0):
        super().__init__()
        self.rotary = RotaryEmbedding(config, rotary_dim or head_dim, placement)  # computed here, not loaded
        self.embedding_multiplier = embedding_multiplier
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
            self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.flat_decode = all(type(layer) is LlamaDecoderLayer for layer in self.layers)  # llama_decode.py's loop

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x, residual = self.embed_tokens(input_ids), None
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.flat_decode:
            hidden = decode_layers(self.layers, self.norm, x, cos, sin, ctx)  # a decode-only step, flat
            if hidden is not None:
                return hidden
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """`LlamaForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before use.
    A family built on it overrides the hooks below (see the module docstring)."""

    checkpoint = CheckpointLayout(fused=(QKV, GATE_UP))
    supports_tensor_parallel = True
    family: ClassVar[str] = "the Llama family"
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer

    @classmethod
    def validate(cls, config) -> None:
        """ValueError, naming the setting, for what this family would otherwise serve wrongly."""
        require_activation(config, "silu", cls.family)

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        return llama_attention_options(config, layer_idx, head_dim)

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement(), *,
                 embedding_multiplier: float = 1.0, logits_scaling: float = 1.0):
        family = type(self)
        family.validate(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

        def make_layer(i: int) -> nn.Module:
            options = family.attention_options(hf_config, i, head_dim)
            return family.decoder_layer(hf_config, i, head_dim, attention_backend_cls, placement, options)

        model = LlamaModel(hf_config, head_dim, placement, make_layer, rotary_dim=rotary_dim_of(hf_config, head_dim),
                           embedding_multiplier=embedding_multiplier)
        super().__init__(hf_config, model, placement, logits_scaling=logits_scaling)
