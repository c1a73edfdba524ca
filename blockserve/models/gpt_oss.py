"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b) over the paged KV cache.

The decoder is the Llama family's (llama.py) with these differences:

    attention     q/k/v and o biases; a learned sink logit per head in the softmax's denominator
                  (`self_attn.sinks`, AttentionOptions.sinks: the backends' `sinks`)
    layers        "sliding_attention" (a window of `sliding_window` tokens, itself included) and
                  "full_attention", as `config.layer_types` says: two KV specs, two KV groups
    RoPE          YaRN (rope_parameters' "yarn", by transformers' own frequency function)
    feed-forward  every layer a mixture of experts (below)

    x ─► embed ─► [ x += o(attn_sinks(rope(qkv(norm x))))   x += moe(norm x) ] × L ─► norm ─► lm_head

    router   logits = x Wᵀ + b  [T, E];  ids = top-k of the logits;  weights = softmax over those k
    expert   gu = x W_gu[e] + b_gu[e]   gate = gu[..., 0::2] (≤ limit), up = gu[..., 1::2] (in ±limit)
             y = ((up + 1) · gate · sigmoid(alpha · gate)) W_down[e] + b_down[e]
    moe(x)   Σ over the k experts of weight · y

Expert weights are held as the checkpoint stores them (transformers' layout, bfloat16 variants):
gate_up_proj [E, H, 2I] (gate and up interleaved by column), gate_up_proj_bias [E, 2I],
down_proj [E, I, H], down_proj_bias [E, H]. The MXFP4 checkpoints (`*_blocks` / `*_scales`) are
not read: the loader names those tensors as unexpected.

Tensor parallelism is not supported (the sinks and the interleaved expert columns are not sharded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.paged_attention import PagedAttention
from blockserve.models.layers import RMSNorm
from blockserve.models.llama import (AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                     sliding_window_of)
from blockserve.models.placement import Placement
from blockserve.models.weights import QKV, CheckpointLayout

LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssRouter(nn.Module):
    """weight [E, H], bias [E]: (weights [T, k] softmaxed over the chosen logits, expert ids [T, k])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, ids = F.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1), ids


class GptOssExperts(nn.Module):
    """The routed experts with biases and the clamped SwiGLU (module docstring), in the checkpoint's
    layout. forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]: one matmul pair per expert some
    token picked (ids read on the host)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # only the experts some token picked, in id order
            tokens, slot = torch.where(ids == e)  # a token meets each expert at most once
            hidden = self.clamped_swiglu(torch.addmm(self.gate_up_proj_bias[e], x[tokens], self.gate_up_proj[e]))
            y = torch.addmm(self.down_proj_bias[e], hidden, self.down_proj[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class GptOssMoe(nn.Module):
    """`router` then `experts`; named as the checkpoint's `mlp.router` and `mlp.experts`."""

    def __init__(self, config):
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                     config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer (its forward) with GptOssMoe as its `mlp`."""

    def __init__(self, config, layer_idx: int, head_dim: int, backend_cls: type[PagedAttention], placement: Placement,
                 options: AttentionOptions | None = None):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, backend_cls, placement, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMoe(config)


class GptOssForCausalLM(LlamaForCausalLM):
    """`GptOssForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before use."""

    family = "GPT-OSS"
    decoder_layer = GptOssDecoderLayer
    checkpoint = CheckpointLayout(fused=(QKV,))
    supports_tensor_parallel = False

    @classmethod
    def validate(cls, config) -> None:
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if unknown or len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} per layer ({config.num_hidden_layers} "
                             f"layers); got {config.layer_types}")
        if not (isinstance(config.sliding_window, int) and config.sliding_window > 0):
            raise ValueError(f"GPT-OSS needs a positive sliding_window; got {config.sliding_window!r}")

    @classmethod
    def attention_options(cls, config, layer_idx: int, head_dim: int) -> AttentionOptions:
        bias = bool(config.attention_bias)
        return AttentionOptions(window=sliding_window_of(config, layer_idx), qkv_bias=bias, o_bias=bias, sinks=True)
