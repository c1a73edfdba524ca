"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral (no sliding window), Qwen2, Qwen3.

One decoder serves them all; the variants differ only in what the config switches on:

    Qwen2    bias on the q/k/v projections
    Qwen3    an RMSNorm over each q and k head before RoPE; `attention_bias` on every projection
    Llama    `attention_bias` / `mlp_bias` when the config sets them
    any      tied lm_head (`tie_word_embeddings`), RoPE with any scaling transformers knows

    x ─► embed ─► [ x += o(attn(rope(qkv(norm x))))  x += down(silu(gate) * up)(norm x) ] × L ─► norm

Each residual add is fused into the norm that follows it; with the native fused ops
(native/extension.py) the norm+add, the rotary embedding and silu*up are one pass each, and a
decode-only step's rotary + KV write + attention is one call (attention/rotary_decode.py), and
such a step runs the layers' native calls from one flat loop (llama_decode.py).
Q/K/V and gate/up are fused, one matmul each.

Tensor-parallel (placement.tp): q heads, kv heads (replicated when N > num_key_value_heads) and
the intermediate size sharded by rank, o_proj and down_proj row-parallel, the vocabulary split.
"""

from __future__ import annotations

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.attention.layer import Attention
from blockserve.native.extension import fused_ops
from blockserve.native.gate import native_reads
from blockserve.attention.paged_attention import PagedAttention
from blockserve.attention.rotary_decode import RotaryDecode
from blockserve.tensor_parallel.layers import local_kv_heads, qkv_linear, row_linear, vocab_embedding
from blockserve.models.base import CausalLM
from blockserve.models.layers import GatedMLP, RMSNorm, require_activation
from blockserve.models.llama_decode import decode_layers
from blockserve.models.placement import Placement
from blockserve.models.rotary import RotaryEmbedding, apply_rotary
from blockserve.models.weights import GATE_UP, QKV, CheckpointLayout


def _sliding_window_active(config) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        tp = placement.tp
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = qkv_linear(config.hidden_size, head_dim, config.num_attention_heads,
                                   config.num_key_value_heads, tp, bias=qkv_bias)
        self.num_heads = config.num_attention_heads // (1 if tp is None else tp.size)  # this rank's
        self.num_kv_heads = local_kv_heads(config.num_key_value_heads, tp)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = row_linear(config.num_attention_heads * head_dim, config.hidden_size, tp, bias=attention_bias,
                                 what="num_attention_heads * head_dim")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn", self.num_heads, self.num_kv_heads, head_dim,
                              backend_cls(head_dim**-0.5), dtype=placement.dtype)
        self.fused = fused_ops()
        self.rotary_decode = None if self.qk_norm else RotaryDecode(self.attn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.rotary_decode is not None:  # a decode-only step: rotary, cache write and attention in one call
            out = self.rotary_decode(qkv, cos[:, 0], sin[:, 0], ctx)
            if out is not None:
                return self.o_proj(out)
        v = qkv[:, self.q_size + self.kv_size:]
        if self.qk_norm:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif self.fused is not None and native_reads(qkv):  # the kernel's device and dtype: q, k rotated in place
            self.fused.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos[:, 0], sin[:, 0])
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        else:  # q and k heads rotated together: half the elementwise calls
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls, placement)
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
    def __init__(self, config, head_dim: int, backend_cls: type[PagedAttention], placement: Placement):
        super().__init__()
        self.rotary = RotaryEmbedding(config, head_dim, placement)  # computed here, not loaded
        with torch.device("meta"):  # weights: materialised by load_weights
            self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, placement.tp)
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, head_dim, backend_cls, placement)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x, residual = self.embed_tokens(input_ids), None
        hidden = decode_layers(self.layers, self.norm, x, cos, sin, ctx)  # a decode-only step, flat (llama_decode.py)
        if hidden is not None:
            return hidden
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """`LlamaForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before use."""

    checkpoint = CheckpointLayout(fused=(QKV, GATE_UP))
    supports_tensor_parallel = True

    def __init__(self, hf_config, attention_backend_cls: type[PagedAttention], placement: Placement = Placement()):
        require_activation(hf_config, "silu", "the Llama family")
        if _sliding_window_active(hf_config):
            raise ValueError(
                f"{hf_config.model_type} config has an active sliding window ({hf_config.sliding_window} tokens) "
                "which this implementation does not support; use a checkpoint without one (e.g. Mistral v0.2+)"
            )
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        super().__init__(hf_config, LlamaModel(hf_config, head_dim, attention_backend_cls, placement), placement)
