"""The causal-LM shell every family's `*ForCausalLM` is.

    input_ids, positions [T] ─► model (the family's: embed_tokens ─► layers ─► norm) ─► hidden [T, H]
    hidden [N, H] ─► lm_head, or the tied embedding ─► / logits_scaling ─► tanh soft-cap ─► logits [N, V] fp32

A family subclass validates its config, builds its `model` (which holds `embed_tokens`) and
declares its `checkpoint` layout (weights.py); the shell owns the rest. The batch is flattened
(no batch dimension); each KV layer finds its cache slice and metadata in the ForwardContext.
Parameters are created on the meta device; `load_weights` materialises them.

Tensor parallelism (`placement.tp` set): a family that declares `supports_tensor_parallel` builds
its layers sharded (tensor_parallel/layers.py); the lm_head (or the tied, vocab-parallel
embedding) computes each rank's vocabulary rows and gathers the logits to rank 0, so
`compute_logits` returns None on the other ranks. A family that does not is refused here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from blockserve.attention.context import ForwardContext
from blockserve.tensor_parallel.layers import ParallelLMHead, gather_vocab_logits
from blockserve.kv.specs import KVCacheSpec
from blockserve.models.half_linear import use_half_weights
from blockserve.models.placement import Placement
from blockserve.models.weights import CheckpointLayout, load_checkpoint


class CausalLM(nn.Module):
    """`model`: the family's decoder, `forward(input_ids, positions, ctx)` -> hidden states.
    `logits_scaling` divides the logits (Granite's muP); `final_logit_softcapping` caps them
    with tanh (Gemma)."""

    checkpoint: ClassVar[CheckpointLayout] = CheckpointLayout()
    supports_tensor_parallel: ClassVar[bool] = False  # the family shards its layers over placement.tp

    @classmethod
    def check_tensor_parallel(cls, tp_size: int) -> None:
        """ValueError unless this family can be served over `tp_size` ranks (before anything is built)."""
        if tp_size > 1 and not cls.supports_tensor_parallel:
            raise ValueError(f"{cls.__name__} does not support tensor parallelism yet (tensor_parallel_size="
                             f"{tp_size}); serve it with tensor_parallel_size=1. Families that do: the Llama "
                             "family (Llama, Mistral, Qwen2, Qwen3, SmolLM2, Phi-3), Mixtral, Qwen2-MoE, Qwen3-MoE, "
                             "Gemma 2, Gemma 3, Granite 3, SmolLM3, GLM-4, EXAONE 4, GPT-OSS, DeepSeek-V3, "
                             "Qwen3-Next, Granite 4.0-H and Kimi Linear")

    def __init__(self, hf_config, model: nn.Module, placement: Placement, *, logits_scaling: float = 1.0,
                 final_logit_softcapping: float | None = None):
        type(self).check_tensor_parallel(1 if placement.tp is None else placement.tp.size)
        super().__init__()
        self.config = hf_config
        self.placement = placement
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.logits_scaling = logits_scaling
        self.final_logit_softcapping = final_logit_softcapping
        self.model = model
        if not self.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = (nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
                                if placement.tp is None else
                                ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size, placement.tp))
        # The tied lm_head over the GGUF's blocks of the embedding (models/quantized_linear.py), if any.
        self.quantized_lm_head: nn.Module | None = None
        # The tied lm_head over an embedding kept in 16 bits (models/half_linear.py), if any.
        self.tied_lm_head: nn.Module | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] int64 of the flattened batch -> final hidden states [T, hidden_size].
        Positions must be below max_position_embeddings."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32 (tensor-parallel: on rank 0;
        None on the others, after taking part in the gather)."""
        tp = self.placement.tp
        if tp is not None:
            if not self.tie_word_embeddings:
                logits = self.lm_head(hidden)
            else:  # this rank's vocabulary rows of the embedding (kept 16-bit: the tied_lm_head over them)
                local = (self.tied_lm_head(hidden) if self.tied_lm_head is not None
                         else F.linear(hidden, self.model.embed_tokens.weight).float())
                logits = gather_vocab_logits(local, self.config.vocab_size, tp)
            if logits is None:
                return None
        elif self.quantized_lm_head is not None:
            logits = self.quantized_lm_head(hidden)  # float32 by construction
        elif self.tied_lm_head is not None:
            logits = self.tied_lm_head(hidden)  # float32 by construction
        elif self.tie_word_embeddings:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        return self.finish_logits(logits)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The lm_head's float32 logits [N, vocab_size] -> the model's: divided by logits_scaling, then
        soft-capped, where the family does either."""
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def kv_layers(self) -> dict[str, nn.Module]:
        """Every module that holds KV (it declares `kv_cache_spec`, `reads_unwritten_slots` and
        `layer_name`, attention/layer.py), by layer name, in model order."""
        layers: dict[str, nn.Module] = {}
        for module in self.modules():
            if hasattr(module, "kv_cache_spec"):
                if module.layer_name in layers:
                    raise ValueError(f"two KV layers of {type(self).__name__} are named {module.layer_name}")
                layers[module.layer_name] = module
        return layers

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """What each KV layer stores per block of `block_size` tokens (or per state slot), as it declares."""
        return {name: layer.kv_cache_spec(block_size) for name, layer in self.kv_layers().items()}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Materialise every parameter from (checkpoint name, tensor) pairs on the placement's device
        and dtype, as the family's `checkpoint` layout says (weights.py); a tied lm_head's weight is
        ignored. Parameters may share memory with the given tensors. With the placement's
        `keep_16bit_weights`, the modules holding 16-bit weights become half_linear.py's. ValueError
        naming unexpected, missing or mis-shaped weights."""
        load_checkpoint(self, named_tensors, self.checkpoint, self.placement,
                        num_layers=self.config.num_hidden_layers,
                        ignore_names=frozenset({"lm_head.weight"} if self.tie_word_embeddings else ()))
        if self.placement.keep_16bit_weights:
            use_half_weights(self)
