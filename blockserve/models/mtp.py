"""A checkpoint's multi-token-prediction (MTP) layer as a model of its own, for speculative decoding.

    row j of a request:  token x[s+j+1], the target's final hidden state h[s+j] (ForwardContext.hidden_inputs)
        emb = target's embed_tokens(x)          (shared: the target's module, not loaded again)
        h'  = family layer(emb, h, rotary(j))   (normalise both, project [emb | h] to hidden, one decoder
                                                 layer over its own paged KV)
        logits of x[s+j+2] = family head(h')    (DeepSeek-V3: its own shared_head; Qwen3-Next: the target's lm_head)

`forward` returns h', the state a further draft chains from (row j + 1 takes it with the drafted
token). A family that has an MTP layer defines `mtp_layer()` on its CausalLM (models/deepseek_v3.py,
models/qwen3_next.py); `load_mtp` builds it and reads its weights from the target's safetensors.
The rotary positions are the rows' (j, from s, the first position whose target state the head was
given): RoPE attends by position differences, so a head started past a prefix-cache hit attends as
one started at 0 would over the same rows.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.models.base import CausalLM
from blockserve.models.half_linear import use_half_weights
from blockserve.models.loader import read_model_safetensors
from blockserve.models.weight_layout import use_input_major_linears
from blockserve.models.weights import load_checkpoint


class MultiTokenPredictor(nn.Module):
    """`layer` (the family's MTP layer, weights loaded) over `target`'s embedding and rotary table; the
    target's modules are shared, not parameters of this one. Run by a ModelRunner of its own: forward
    reads ctx.hidden_inputs, one target (or chained) state per token."""

    kv_layers = CausalLM.kv_layers
    kv_cache_specs = CausalLM.kv_cache_specs

    def __init__(self, layer: nn.Module, target: CausalLM):
        super().__init__()
        self.layer = layer
        self._target = (target,)  # a tuple: not registered as a submodule

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] and ctx.hidden_inputs [T, hidden] -> the chained states [T, hidden]."""
        if ctx.hidden_inputs is None or ctx.hidden_inputs.shape[0] != input_ids.shape[0]:
            raise RuntimeError("the MTP head needs one hidden state per token (ForwardContext.hidden_inputs)")
        model = self.target.model
        cos, sin = model.rotary(positions)
        return self.layer(model.embed_tokens(input_ids), ctx.hidden_inputs, cos, sin, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Chained states [N, hidden] -> the next tokens' logits [N, vocab] float32."""
        return self.layer.logits(hidden, self.target)


def load_mtp(target: CausalLM, source: str | None) -> MultiTokenPredictor:
    """The MTP head of `target`, whose checkpoint is the model directory `source`, on the target's
    placement. ValueError naming what is missing: a family without MTP layers, a config that declares
    none (the family's field), a checkpoint that is not a model directory or lacks the layer's weights."""
    build = getattr(target, "mtp_layer", None)
    if build is None:
        raise ValueError(f"speculative_config.method 'mtp': {type(target).__name__} has no multi-token-prediction "
                         "layers (DeepSeek-V3 and Qwen3-Next checkpoints ship them); use ngram, suffix or "
                         "draft_model")
    layer, prefix, layout = build()
    path = None if source is None else Path(source).expanduser()
    if path is None or not path.is_dir():
        raise ValueError(f"speculative_config.method 'mtp': the MTP layer is read from a model directory's "
                         f"safetensors ({prefix}*), but the model is {source!r}; serve the model directory")
    named = ((name[len(prefix):], tensor)
             for name, tensor in read_model_safetensors(path, lambda n: n.startswith(prefix)))
    first = next(named, None)
    if first is None:
        raise ValueError(f"speculative_config.method 'mtp': {path} has no {prefix}* weights (the multi-token-"
                         "prediction layer); use a checkpoint that ships them, or another method")
    placement = target.placement
    load_checkpoint(layer, itertools.chain([first], named), layout, placement, num_layers=0)
    if placement.keep_16bit_weights:
        use_half_weights(layer)
    use_input_major_linears(layer)
    return MultiTokenPredictor(layer.eval(), target)
