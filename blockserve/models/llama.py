"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral (no sliding window), Qwen2, Qwen3.

One decoder serves them all; the variants differ only in what the config switches on:

    Qwen2    bias on the q/k/v projections
    Qwen3    an RMSNorm over each q and k head before RoPE; `attention_bias` on every projection
    Llama    `attention_bias` / `mlp_bias` when the config sets them
    any      tied lm_head (`tie_word_embeddings`), RoPE with any scaling transformers knows

The batch is flattened (no batch dimension): `forward` takes the [T] token ids and positions of
every sequence in the step; each layer finds its cache slice and metadata in the context.

    x ─► embed ─► [ x += o(attn(rope(qkv(norm x))))  x += down(silu(gate) * up)(norm x) ] × L ─► norm

Each residual add is fused into the norm that follows it; with the native fused ops
(attention/native.py) the norm+add, the rotary embedding and silu*up are one pass each.

Q/K/V and gate/up are fused, one matmul each. Parameters are created on the meta device (no
time spent initialising them); `load_weights` materialises them from Hugging Face names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.attention.native import fused_ops
from blockserve.attention.paged_attention import PagedAttention
from blockserve.kv import FullAttentionSpec
from blockserve.models.fused_weights import load_fused_weights



def _sliding_window_active(config) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


class RMSNorm(nn.Module):
    """`norm(x)`, or `norm(x, residual)` -> (norm(residual + x), residual + x): the residual add
    fused into the norm, in place on x and residual (both must be the caller's own tensors)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.fused = fused_ops()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self.fused is not None and x.dtype == torch.float32 and x.dim() == 2:
            self.fused.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """cos/sin of every position below max_position_embeddings, computed once at construction.

    inv_freq comes from transformers' RoPE functions, so every scaling type it knows applies.
    "dynamic" equals the default inside the trained length, which is as far as the table goes;
    "longrope" uses its short factors below original_max_position_embeddings, long ones from there.
    """

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = config.rope_parameters
        rope_type = params.get("rope_type", "default")
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")[:, None]
        if rope_type == "default":  # as transformers' compute_default_rope_parameters
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu")
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}; "
                             f"transformers knows: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
        if 2 * inv_freq.numel() != head_dim:
            raise ValueError(f"partial rotary embeddings are not supported "
                             f"(rotary dim {2 * inv_freq.numel()}, head_dim {head_dim})")
        freqs = positions * inv_freq
        if rope_type == "longrope":
            original = params["original_max_position_embeddings"]
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu", seq_len=original + 1)
            freqs = torch.where(positions < original, freqs, positions * long_inv_freq)
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the tokens at `positions` (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head of x [T, H, D] (Hugging Face's rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=attention_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend_cls(head_dim**-0.5))
        self.fused = fused_ops()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:]
        if self.qk_norm:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif self.fused is not None and qkv.dtype == torch.float32:  # q and k heads rotated in place, one pass
            self.fused.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos[:, 0], sin[:, 0])
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        else:  # q and k heads rotated together: half the elementwise calls
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.fused = fused_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and gate_up.dtype == torch.float32:
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

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
    def __init__(self, config, head_dim: int, backend_cls: type[PagedAttention]):
        super().__init__()
        self.rotary = RotaryEmbedding(config, head_dim)  # computed here, not loaded
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(config, i, head_dim, backend_cls) for i in range(config.num_hidden_layers)
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`LlamaForCausalLM(hf_config, attention_backend_cls)`; call `load_weights` before use."""

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention]):
        super().__init__()
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported by the Llama family "
                             "(expected 'silu')")
        if _sliding_window_active(hf_config):
            raise ValueError(
                f"{hf_config.model_type} config has an active sliding window ({hf_config.sliding_window} tokens) "
                "which this implementation does not support; use a checkpoint without one (e.g. Mistral v0.2+)"
            )
        self.config = hf_config
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, self.head_dim, attention_backend_cls)
        if not self.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        # The tied lm_head over the GGUF's blocks of the embedding (models/quantized_linear.py), if any.
        self.quantized_lm_head: nn.Module | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] int64 of the flattened batch -> final hidden states [T, hidden_size].
        Positions must be below max_position_embeddings."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        if not self.tie_word_embeddings:
            return self.lm_head(hidden).float()
        if self.quantized_lm_head is not None:
            return self.quantized_lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def kv_cache_specs(self, block_size: int) -> dict[str, FullAttentionSpec]:
        spec = FullAttentionSpec(block_size, self.config.num_key_value_heads, self.head_dim, "float32")
        return {f"model.layers.{i}.self_attn": spec for i in range(self.config.num_hidden_layers)}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Materialise every parameter from (Hugging Face name, tensor) pairs, as float32.

        q/k/v and gate/up are concatenated into the fused projections. Parameters may share
        memory with the given tensors. Raises ValueError naming unexpected, missing or
        mis-shaped weights.
        """
        load_fused_weights(
            self, named_tensors,
            skip=lambda name: name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight"),
        )

