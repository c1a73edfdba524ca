"""A GGUF file's model config read straight from its metadata, without transformers, for the
families whose config is a plain renaming of llama.cpp's keys: Llama, Mixtral (a Llama with
experts), Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE and Phi-3.

`GGUFConfig` carries the attributes the model classes and the engine read, with the values
transformers' config class of that family gets from the same file (renamed as its GGUF loader does,
its defaults where a key is absent: Qwen3's head_dim is its 128, Mistral's sliding_window its 4096,
Phi-3's eos and pad ids its 32000, Qwen2-MoE's sliding_window its 0, Qwen3-MoE's routing renormalised
as llama.cpp's, as there); an attribute transformers' class for that family lacks is absent here too
(`getattr(config, name, default)` sees the same). Phi-3 as the loader reads it for transformers: the
sliding window (0: none), a partial rotary factor from rope.dimension_count; a Phi-3 with LongRoPE
(rope_factors_long / _short tensors: Phi-3.5-mini, Phi-4-mini), whose rotary frequencies
transformers' functions compute from its config, is not read here (native_config). Every other
family keeps transformers' config (models/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gguf

from blockserve.models.gguf_metadata import special_token_id

# GGUF architecture -> model_type (llama.cpp writes Mixtral as "llama" with experts: _family)
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen2moe": "qwen2_moe", "qwen3": "qwen3",
            "qwen3moe": "qwen3_moe", "phi3": "phi3"}
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM"}
_EXPERT_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
# llama.cpp's keys under "<arch>." -> the config's names (transformers' GGUF loader's renaming)
_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
         "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
         "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
         "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
         "vocab_size": "vocab_size"}
# and per family, beyond those
_FAMILY_KEYS = {"mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
                "qwen2_moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                              "expert_feed_forward_length": "moe_intermediate_size",
                              "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
                "qwen3_moe": {"attention.key_length": "head_dim", "expert_count": "num_experts",
                              "expert_used_count": "num_experts_per_tok",
                              "expert_feed_forward_length": "moe_intermediate_size"}}
_TOKEN_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}
# transformers' defaults per family, for keys a file may leave out
_DEFAULTS = {"llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                       "bos_token_id": 1, "eos_token_id": 2},
             "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                         "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
             "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
             "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                       "head_dim": 128},
             "mixtral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                         "bos_token_id": 1, "eos_token_id": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
             "qwen2_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                           "intermediate_size": 5632, "sliding_window": 0, "num_experts": 60,
                           "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632, "qkv_bias": True},
             "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                           "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
                           "moe_intermediate_size": 768, "norm_topk_prob": True},
             "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                      "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# the attributes beyond the common ones that each family's transformers config has
_HAS = {"llama": ("head_dim", "attention_bias", "mlp_bias", "pretraining_tp"),
        "mistral": ("head_dim", "sliding_window"),
        "qwen2": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
        "qwen3": ("head_dim", "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
                  "layer_types"),
        "mixtral": ("head_dim", "sliding_window", "num_experts", "num_local_experts", "num_experts_per_tok",
                    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"),
        "qwen2_moe": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "num_experts",
                      "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
                      "router_aux_loss_coef", "qkv_bias"),
        "qwen3_moe": ("head_dim", "attention_bias", "use_sliding_window", "sliding_window", "num_experts",
                      "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "decoder_sparse_step", "mlp_only_layers", "output_router_logits", "router_aux_loss_coef"),
        "phi3": ("sliding_window", "original_max_position_embeddings", "embd_pdrop", "resid_pdrop",
                 "partial_rotary_factor")}
# attributes absent (as on transformers' config) where their value is None (Qwen3-MoE's head_dim: where
# the file has no attention.key_length)
_ABSENT_IF_NONE = ("rope_freq_divisors", "partial_rotary_factor", "head_dim")
# llama.cpp's rope.dimension_count read as head_dim (transformers' mapping for these; Qwen3 keeps its default)
_ROTARY_HEAD_DIM = ("llama", "mistral", "mixtral")


@dataclass(frozen=True, repr=False, eq=False)
class GGUFConfig:
    """A config of one of FAMILIES from GGUF metadata; the attributes its family's transformers
    config lacks are absent (AttributeError), as there."""

    model_type: str
    architectures: list[str]  # lists, as transformers' (a frozen config: not to be changed)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    # llama.cpp's per-dimension divisors of the rotary frequencies (a file's rope_freqs tensor: Llama
    # 3.1's llama3 scaling); absent (AttributeError) where the file has none, as on transformers' config
    rope_freq_divisors: list[float] | None = None
    # per family (_HAS)
    head_dim: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    pretraining_tp: int = 1
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] = field(default_factory=list)
    original_max_position_embeddings: int = 4096
    embd_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    partial_rotary_factor: float | None = None
    num_experts: int = 0
    num_local_experts: int = 0  # transformers' name of num_experts (its attribute_map)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False

    def __getattribute__(self, name: str) -> Any:
        if name in _ABSENT.get(object.__getattribute__(self, "model_type"), ()) or (
                name in _ABSENT_IF_NONE and object.__getattribute__(self, name) is None):
            raise AttributeError(f"{object.__getattribute__(self, 'model_type')} config has no {name!r}")
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return f"GGUFConfig({self.to_dict()})"

    def to_dict(self) -> dict:
        """The config's attributes (those its family has), as plain values."""
        absent = _ABSENT[self.model_type]
        values = {name: object.__getattribute__(self, name) for name in self.__dataclass_fields__ if name not in absent}
        for name in _ABSENT_IF_NONE:
            if name in values and values[name] is None:
                del values[name]
        return {name: list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
                for name, value in values.items()}


_OPTIONAL = {name for names in _HAS.values() for name in names}
_ABSENT = {family: tuple(sorted(_OPTIONAL - set(names))) for family, names in _HAS.items()}


def _family(reader: gguf.GGUFReader, arch: str) -> str | None:
    """The model_type gguf_config reads this GGUF file of architecture `arch` as; None where it is
    left to transformers: another architecture, experts in a family without them, LongRoPE factor
    tensors, a Mixtral without rope.dimension_count (transformers' head_dim is then None)."""
    experts = reader.fields.get(f"{arch}.expert_count")
    model_type = FAMILIES.get(arch)
    if arch == "llama" and experts is not None and experts.contents() > 0:
        model_type = "mixtral" if f"{arch}.rope.dimension_count" in reader.fields else None
    elif experts is not None and experts.contents() > 0 and model_type not in _EXPERT_FAMILIES:
        model_type = None
    if any(tensor.name.startswith("rope_factors_") for tensor in reader.tensors):
        model_type = None
    return model_type


def native_config(reader: gguf.GGUFReader, arch: str) -> bool:
    """Whether gguf_config reads the config of this GGUF file of architecture `arch` (_family)."""
    return _family(reader, arch) is not None


def gguf_config(reader: gguf.GGUFReader, arch: str, rope_freq_divisors: list[float] | None = None) -> GGUFConfig:
    """The config of a GGUF file of architecture `arch`, with the file's rope_freqs divisors (read by
    the loader, None where it has none); ValueError naming a missing required key, or for a file
    native_config does not take."""
    model_type = _family(reader, arch)
    if model_type is None:
        raise ValueError(f"the config of this {arch} GGUF is read through transformers (experts, LongRoPE or "
                         f"another family than {', '.join(_CLASSES)}): load it with models.loader.load_model")
    values: dict[str, Any] = dict(_DEFAULTS[model_type])
    for key, name in {**_KEYS, **_FAMILY_KEYS.get(model_type, {})}.items():
        if (found := reader.fields.get(f"{arch}.{key}")) is not None:
            values[name] = found.contents()
    for key, name in _TOKEN_KEYS.items():  # an id outside the vocabulary is dropped with a warning
        if (found := special_token_id(reader, key)) is not None:
            values[name] = found
    missing = [f"{arch}.{key}" for key, name in _KEYS.items() if name in _REQUIRED and name not in values]
    if missing:
        raise ValueError(f"GGUF file lacks {', '.join(missing)}: it is not a complete {arch} model; convert it again")
    values.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    values["rope_parameters"] = {"rope_theta": values.pop("rope_theta"), "rope_type": "default"}
    values["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in reader.tensors)
    if model_type in _ROTARY_HEAD_DIM:
        rotary = reader.fields.get(f"{arch}.rope.dimension_count")
        values["head_dim"] = rotary.contents() if rotary is not None else \
            values["hidden_size"] // values["num_attention_heads"]
    if "layer_types" in _HAS[model_type]:
        values["layer_types"] = ["full_attention"] * values["num_hidden_layers"]
    if model_type == "phi3":
        _phi3(reader, arch, values)
    if "num_local_experts" in _HAS[model_type]:  # one value, both names (transformers' attribute_map)
        values["num_experts"] = values["num_local_experts"] = values.get("num_experts", values.get("num_local_experts"))
    return GGUFConfig(model_type=model_type, architectures=[_CLASSES[model_type]],
                      rope_freq_divisors=rope_freq_divisors, **values)


def _phi3(reader: gguf.GGUFReader, arch: str, values: dict) -> None:
    """Phi-3's window and partial rotary factor into `values`, as transformers' Phi3Config takes them
    from the loader (rope_parameters always holds the factor, 1.0 where none is given; the attribute
    only where one is)."""
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    if window is not None and window.contents():  # 0: the converter's "no window" (Phi-4)
        values["sliding_window"] = window.contents()
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    rotary = reader.fields.get(f"{arch}.rope.dimension_count")
    factor = 1.0
    if rotary is not None and rotary.contents() != head_dim:  # Phi-4-mini
        factor = values["partial_rotary_factor"] = rotary.contents() / head_dim
    values["rope_parameters"]["partial_rotary_factor"] = factor
