"""A checkpoint's multi-token-prediction (MTP) layer as a model of its own, for speculative decoding.

    row j of a request:  token x[s+j+1], the target's final hidden state h[s+j] (ForwardContext.hidden_inputs)
        emb = target's embed_tokens(x)          (shared: the target's module, not loaded again)
        h'  = family layer(emb, h, rotary(j))   (normalise both, project [emb | h] to hidden, one decoder
                                                 layer over its own paged KV)
        logits of x[s+j+2] = family head(h')    (DeepSeek-V3: its own shared_head; Qwen3-Next: the target's lm_head)

`forward` returns h', the state a further draft chains from (row j + 1 takes it with the drafted
token). A family that has an MTP layer defines `mtp_layer(placement)` on its CausalLM
(models/deepseek_v3.py, models/qwen3_next.py); `load_mtp` builds it and reads its weights from the
target's safetensors. The rotary positions are the rows' (j, from s, the first position whose target
state the head was given): RoPE attends by position differences, so a head started past a
prefix-cache hit attends as one started at 0 would over the same rows.

Under tensor parallelism the head runs whole on rank 0, which alone proposes: its layer is loaded
unsharded, and since the target's embedding and lm_head are vocab-parallel there (each rank holds
1/N of the rows, and looking a token up or computing logits is a collective every rank must join),
the head reads unsharded copies of its own (`UnshardedVocab`: vocab_size x hidden_size each, the
lm_head only for a family whose head uses the target's). The target's final hidden states it is fed
are whole on every rank (the residual stream is all-reduced), so rank 0's are the head's input.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.models.base import CausalLM
from blockserve.models.half_linear import use_half_weights
from blockserve.models.loader import read_model_safetensors
from blockserve.models.weight_layout import use_input_major_linears
from blockserve.models.weights import CheckpointLayout, load_checkpoint
from blockserve.tensor_parallel.layers import vocab_embedding

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # the target's checkpoint names


class UnshardedVocab(nn.Module):
    """Whole copies of a tensor-parallel target's vocabulary tables, for a head that runs on rank 0 alone:
    `model.embed_tokens` and, where asked for, `lm_head` (named as the checkpoint names them)."""

    def __init__(self, vocab_size: int, hidden_size: int, with_lm_head: bool):
        super().__init__()
        with torch.device("meta"):
            self.model = nn.Module()
            self.model.embed_tokens = vocab_embedding(vocab_size, hidden_size, None)
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False) if with_lm_head else None


class MultiTokenPredictor(nn.Module):
    """`layer` (the family's MTP layer, weights loaded) over `target`'s rotary table and embedding (and
    lm_head), or over `vocab`'s copies of them where given (the target is tensor-parallel); the target's
    modules are shared, not parameters of this one, `vocab`'s are. Run by a ModelRunner of its own:
    forward reads ctx.hidden_inputs, one target (or chained) state per token."""

    kv_layers = CausalLM.kv_layers
    kv_cache_specs = CausalLM.kv_cache_specs

    def __init__(self, layer: nn.Module, target: CausalLM, vocab: UnshardedVocab | None = None):
        super().__init__()
        self.layer = layer
        self.vocab = vocab
        self._target = (target,)  # a tuple: not registered as a submodule

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] and ctx.hidden_inputs [T, hidden] -> the chained states [T, hidden]."""
        if ctx.hidden_inputs is None or ctx.hidden_inputs.shape[0] != input_ids.shape[0]:
            raise RuntimeError("the MTP head needs one hidden state per token (ForwardContext.hidden_inputs)")
        cos, sin = self.target.model.rotary(positions)
        embed = (self.target if self.vocab is None else self.vocab).model.embed_tokens
        return self.layer(embed(input_ids), ctx.hidden_inputs, cos, sin, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Chained states [N, hidden] -> the next tokens' logits [N, vocab] float32."""
        return self.layer.logits(hidden, self._target_logits)

    def _target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's lm_head (or vocab's copy) over `hidden`, logits as the target finishes them."""
        if self.vocab is None:
            return self.target.compute_logits(hidden)
        return self.target.finish_logits(self.vocab.lm_head(hidden).float())


def load_mtp(target: CausalLM, source: str | None) -> MultiTokenPredictor:
    """The MTP head of `target`, whose checkpoint is the model directory `source`, on the target's
    placement. ValueError naming what is missing: a family without MTP layers, a config that declares
    none (the family's field), a checkpoint that is not a model directory or lacks the layer's weights."""
    build = getattr(target, "mtp_layer", None)
    if build is None:
        raise ValueError(f"speculative_config.method 'mtp': {type(target).__name__} has no multi-token-prediction "
                         "layers (DeepSeek-V3 and Qwen3-Next checkpoints ship them); use ngram, suffix or "
                         "draft_model")
    placement = target.placement
    whole = dataclasses.replace(placement, tp=None)  # under tensor parallelism: rank 0 runs it alone
    layer, prefix, layout = build(whole)
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
    load_checkpoint(layer, itertools.chain([first], named), layout, whole, num_layers=0)
    vocab = None if placement.tp is None else load_unsharded_vocab(target, path, layer.reads_target_lm_head)
    for module in (layer, vocab):  # laid out as the loader lays out the target's modules
        if module is not None:
            if placement.keep_16bit_weights:
                use_half_weights(module)
            use_input_major_linears(module)
    return MultiTokenPredictor(layer.eval(), target, vocab)


def load_unsharded_vocab(target: CausalLM, path: Path, with_lm_head: bool) -> UnshardedVocab:
    """Whole copies of the tensor-parallel `target`'s embedding and (`with_lm_head`) lm_head, read from
    the model directory `path` (a tied lm_head from the embedding) on the target's device and dtype."""
    config = target.config
    vocab = UnshardedVocab(config.vocab_size, config.hidden_size, with_lm_head)
    wanted = {EMBEDDING: (EMBEDDING,)}
    if with_lm_head:
        if target.tie_word_embeddings:
            wanted[EMBEDDING] += (LM_HEAD,)
        else:
            wanted[LM_HEAD] = (LM_HEAD,)
    named = ((ours, tensor) for name, tensor in read_model_safetensors(path, wanted.__contains__)
             for ours in wanted[name])
    load_checkpoint(vocab, named, CheckpointLayout(), dataclasses.replace(target.placement, tp=None), num_layers=0)
    return vocab.eval()
