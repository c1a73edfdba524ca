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
down_proj [E, I, H], down_proj_bias [E, H]. A checkpoint whose config says
`quantization_config.quant_method: "mxfp4"` (the released gpt-oss-20b/120b, or llama.cpp's GGUF of
them: gpt_oss_gguf.py) holds the two projections as MXFP4 instead, kept as read (mxfp4.py, 4.25 bits
a weight) and run, a whole layer's experts in one call, by csrc/moe_experts.cpp's moe_experts_mxfp4
(float32 experts by its moe_experts_gpt_oss: GptOssExperts' routes): gate_up_proj_blocks [E, 2I, H/32, 16] with gate_up_proj_scales [E, 2I, H/32],
down_proj_blocks [E, H, I/32, 16] with down_proj_scales [E, H, I/32] (each expert's weight as
[out, in]); the biases stay floating point.

Tensor-parallel (placement.tp): attention as the Llama family's (heads, KV heads, o_proj
row-parallel), each rank's sinks those of its own heads; the router whole on every rank; every
expert sharded by its intermediate size, rank r holding entries [s, s + n) of the I, n = I / N:

    gate_up_proj [E, H, 2I]            columns [2s, 2s + 2n): its gate and up pairs, still interleaved
    gate_up_proj_blocks / _scales      rows [2s, 2s + 2n) (whole rows: every block whole)
    gate_up_proj_bias [E, 2I]          entries [2s, 2s + 2n)
    down_proj [E, I, H]                rows [s, s + n)
    down_proj_blocks / _scales         blocks [s/32, (s + n)/32) of each row: n must be whole blocks,
                                       else refused naming the tensor and the sizes that keep them whole
    down_proj_bias [E, H]              on rank 0; zeros on the others, so the all-reduce adds it once

and the ranks' partial outputs are all-reduced once per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.paged_attention import PagedAttention
from blockserve.models.layers import RMSNorm
from blockserve.models.mxfp4 import BLOCK, mxfp4_matmul
from blockserve.models.llama import (AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                     sliding_window_of)
from blockserve.models.placement import Placement
from blockserve.models.weights import QKV, CheckpointLayout
from blockserve.native.extension import mxfp4_ops
from blockserve.tensor_parallel.group import TensorParallelGroup
from blockserve.tensor_parallel.layers import Slice, even_slice, shard_on_load

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


def is_mxfp4(config) -> bool:
    """Whether the config's `quantization_config` says the experts are MXFP4."""
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) \
        else getattr(quantization, "quant_method", None)
    if method not in (None, "mxfp4"):
        raise ValueError(f"GPT-OSS quantization_config.quant_method {method!r} is not read (mxfp4 is, or none)")
    return method == "mxfp4"


def _mxfp4_parameters(experts: int, rows: int, columns: int) -> tuple[nn.Parameter, nn.Parameter]:
    if columns % BLOCK:
        raise ValueError(f"MXFP4 experts need sizes divisible by {BLOCK}; got a projection of {columns} inputs")
    blocks = torch.empty(experts, rows, columns // BLOCK, BLOCK // 2, dtype=torch.uint8)
    scales = torch.empty(experts, rows, columns // BLOCK, dtype=torch.uint8)
    return nn.Parameter(blocks, requires_grad=False), nn.Parameter(scales, requires_grad=False)


def intermediate_shard(intermediate_size: int, tp: TensorParallelGroup | None, what: str,
                       mxfp4: bool = False) -> Slice | None:
    """This rank's entries of each expert's intermediate size (None on one device). ValueError
    unless N divides it, or, with `mxfp4`, where a rank's share of down_proj's inputs would cut a
    32-value MXFP4 block: naming `what` (the down_proj_blocks tensor) and the sizes that keep whole blocks."""
    if tp is None:
        return None
    if mxfp4 and intermediate_size % BLOCK == 0 and intermediate_size % (tp.size * BLOCK):
        whole = [n for n in range(1, intermediate_size // BLOCK + 1) if intermediate_size % (n * BLOCK) == 0]
        raise ValueError(f"{what}: intermediate_size = {intermediate_size} over tensor_parallel_size = {tp.size} "
                         f"would cut its {BLOCK}-value MXFP4 blocks; the tensor_parallel_size values that keep them "
                         f"whole: {', '.join(map(str, whole))}")
    return even_slice(intermediate_size, tp, "intermediate_size")


def expert_biases(num_experts: int, intermediate_size: int, hidden_size: int, shard: Slice | None,
                  tp: TensorParallelGroup | None) -> tuple[nn.Parameter, nn.Parameter]:
    """(gate_up_proj_bias [E, 2I], down_proj_bias [E, H]); with `tp`, this rank's (module
    docstring): the interleaved gate|up entries of its `shard`, and down's bias whole on rank 0 and
    zeros on the others, so the all-reduce adds it once."""
    gate_up = nn.Parameter(torch.empty(num_experts, 2 * (intermediate_size if shard is None else shard.size)))
    down = nn.Parameter(torch.empty(num_experts, hidden_size))
    if tp is not None:
        shard_on_load(gate_up, [_pairs(shard)], dim=1)
        if not tp.is_first:
            down.weight_loader = lambda tensor, *, part, expert: torch.zeros_like(tensor)
    return gate_up, down


def _pairs(shard: Slice) -> Slice:
    """The gate|up entries (interleaved: gate j at 2j, up j at 2j + 1) of intermediate entries `shard`."""
    return Slice(2 * shard.full, 2 * shard.start, 2 * shard.size)


def gpt_oss_expert_ops():
    """The native module when it has csrc/moe_experts.cpp's GPT-OSS experts (moe_experts_mxfp4 and
    moe_experts_gpt_oss), else None."""
    ops = mxfp4_ops()
    return ops if ops is not None and hasattr(ops, "moe_experts_gpt_oss") else None


class GptOssExperts(nn.Module):
    """The routed experts with biases and the clamped SwiGLU (module docstring), in the checkpoint's
    layout, floating point or (`mxfp4`) MXFP4. forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H].
    Two routes compute it (equal up to rounding):

        native   float32 activations on the CPU with the native kernels, experts in MXFP4 or float32:
                 the whole layer in one call (csrc/moe_experts.cpp's moe_experts_mxfp4, a decode
                 step's experts as one job over all their weight rows; moe_experts_gpt_oss, one
                 addmm per expert picked), the pairs grouped by expert
        loop     one matmul pair per expert some token picked (ids read on the host): other dtypes
                 and devices, or no native kernels

    `route`: None picks; "loop" forces the loop (how tests hold the native route to it).

    `tp`: this rank's share of every expert's intermediate size (module docstring), the output
    all-reduced; `what` names the module in errors."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float,
                 mxfp4: bool = False, tp: TensorParallelGroup | None = None, what: str = "mlp.experts"):
        super().__init__()
        self.alpha, self.limit, self.mxfp4, self.tp = alpha, limit, mxfp4, tp
        self.route: str | None = None
        self.shard = intermediate_shard(intermediate_size, tp, f"{what}.down_proj_blocks", mxfp4)
        local = intermediate_size if self.shard is None else self.shard.size
        pairs = None if self.shard is None else [_pairs(self.shard)]
        if mxfp4:
            self.gate_up_proj_blocks, self.gate_up_proj_scales = _mxfp4_parameters(num_experts, 2 * local, hidden_size)
            self.down_proj_blocks, self.down_proj_scales = _mxfp4_parameters(num_experts, hidden_size, local)
            blocks = None if self.shard is None else [
                Slice(self.shard.full // BLOCK, self.shard.start // BLOCK, self.shard.size // BLOCK)]
            for param in (self.gate_up_proj_blocks, self.gate_up_proj_scales):
                shard_on_load(param, pairs, dim=1)  # whole rows
            for param in (self.down_proj_blocks, self.down_proj_scales):
                shard_on_load(param, blocks, dim=2)  # whole blocks of each row's inputs
        else:
            self.gate_up_proj = shard_on_load(nn.Parameter(torch.empty(num_experts, hidden_size, 2 * local)), pairs,
                                              dim=2)
            self.down_proj = shard_on_load(nn.Parameter(torch.empty(num_experts, local, hidden_size)),
                                           None if self.shard is None else [self.shard], dim=1)
        self.gate_up_proj_bias, self.down_proj_bias = expert_biases(num_experts, intermediate_size, hidden_size,
                                                                    self.shard, tp)

    def gate_up(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.mxfp4:
            return mxfp4_matmul(x, self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e]) + self.gate_up_proj_bias[e]
        return torch.addmm(self.gate_up_proj_bias[e], x, self.gate_up_proj[e])

    def down(self, hidden: torch.Tensor, e: int) -> torch.Tensor:
        if self.mxfp4:
            return mxfp4_matmul(hidden, self.down_proj_blocks[e], self.down_proj_scales[e]) + self.down_proj_bias[e]
        return torch.addmm(self.down_proj_bias[e], hidden, self.down_proj[e])

    def clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.route not in (None, "loop", "native"):
            raise ValueError(f"unknown GPT-OSS expert route {self.route!r}; choose native, loop or None")
        ops = gpt_oss_expert_ops()
        native = ops is not None and x.device.type == "cpu" and x.dtype == torch.float32 and (
            self.mxfp4 or self.gate_up_proj.dtype == torch.float32)
        if self.route == "native" and not native:
            raise RuntimeError("the native GPT-OSS expert route needs float32 activations on the CPU, MXFP4 or "
                               "float32 experts, and the native kernels")
        if native and self.route != "loop":
            routing = (x.contiguous(), weights.float().contiguous(), ids.long().contiguous())
            biases = (self.gate_up_proj_bias.float().contiguous(), self.down_proj_bias.float().contiguous())
            if self.mxfp4:
                out = ops.moe_experts_mxfp4(*routing, self.gate_up_proj_blocks, self.gate_up_proj_scales, biases[0],
                                            self.down_proj_blocks, self.down_proj_scales, biases[1],
                                            self.alpha, self.limit)
            else:
                out = ops.moe_experts_gpt_oss(*routing, self.gate_up_proj.contiguous(), biases[0],
                                              self.down_proj.contiguous(), biases[1], self.alpha, self.limit)
        else:
            out = torch.zeros_like(x)
            for e in ids.unique().tolist():  # only the experts some token picked, in id order
                tokens, slot = torch.where(ids == e)  # a token meets each expert at most once
                hidden = self.clamped_swiglu(self.gate_up(x[tokens], e))
                y = self.down(hidden, e) * weights[tokens, slot, None]
                out.index_add_(0, tokens, y.to(out.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)


class GptOssMoe(nn.Module):
    """`router` then `experts`; named as the checkpoint's `mlp.router` and `mlp.experts` (`what`: this
    module's name in errors). With `tp`: the router whole, the experts sharded."""

    def __init__(self, config, tp: TensorParallelGroup | None = None, what: str = "mlp"):
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                     config.swiglu_alpha, config.swiglu_limit, mxfp4=is_mxfp4(config), tp=tp,
                                     what=f"{what}.experts")

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
        self.mlp = GptOssMoe(config, placement.tp, f"model.layers.{layer_idx}.mlp")


class GptOssForCausalLM(LlamaForCausalLM):
    """`GptOssForCausalLM(hf_config, attention_backend_cls[, placement])`; call `load_weights` before use."""

    family = "GPT-OSS"
    decoder_layer = GptOssDecoderLayer
    checkpoint = CheckpointLayout(fused=(QKV,))
    supports_tensor_parallel = True

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
