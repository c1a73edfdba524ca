"""Which model class serves which `architectures` name of a config.json, and what the supported-models
table says of it: one entry per name, its class "<module under blockserve.models>.<class>" imported
when a model of it is loaded (catalog.py prints the table)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from blockserve.models.base import CausalLM


@dataclass(frozen=True)
class Architecture:
    """One `architectures` name: the class serving it, the checkpoints people know it by, its
    layer kinds, and the test files (under tests/) holding it to transformers."""

    model: str
    family: str
    layer_kinds: str
    tested: tuple[str, ...]


_TINY = ("models/test_llama_tiny.py", "engine/test_tiny_engine.py")
_DENSE = ("models/test_dense_families.py", "engine/test_families_engine.py")
_DENSE_GGUF = (*_DENSE, "models/test_dense_gguf.py")
_MOE = ("models/test_moe_families.py", "engine/test_families_engine.py", "models/test_moe_gguf.py")
_MLA = ("models/test_mla_kda_tiny.py", "engine/test_mla_kda_engine.py")
_STATE = ("models/test_hybrid_tiny.py", "engine/test_hybrid_engine.py")

ARCHITECTURES: dict[str, Architecture] = {
    "DeepseekV3ForCausalLM": Architecture("deepseek_v3.DeepseekV3ForCausalLM", "DeepSeek-V3", "MLA, MoE", _MLA),
    "Exaone4ForCausalLM": Architecture("exaone4.Exaone4ForCausalLM", "EXAONE 4.0",
                                       "sliding window and full attention (without RoPE)", _DENSE_GGUF),
    "Gemma2ForCausalLM": Architecture("gemma2.Gemma2ForCausalLM", "Gemma 2",
                                      "sliding window and full attention, soft-capped scores", _DENSE_GGUF),
    "Gemma3ForCausalLM": Architecture("gemma3.Gemma3ForCausalLM", "Gemma 3 (text)", "sliding window and full attention",
                                      ("models/test_gemma3.py", "engine/test_gemma3_engine.py")),
    "Glm4ForCausalLM": Architecture("glm4.Glm4ForCausalLM", "GLM-4 (0414)",
                                    "full attention, sandwich norms, interleaved partial RoPE", _DENSE_GGUF),
    "GptOssForCausalLM": Architecture("gpt_oss.GptOssForCausalLM", "gpt-oss-20b, gpt-oss-120b (MXFP4 or bfloat16)",
                                      "sliding window and full attention with sinks, MoE",
                                      ("models/test_gpt_oss.py", "models/test_gpt_oss_mxfp4.py",
                                       "engine/test_families_engine.py", "models/test_gpt_oss_gguf.py",
                                       "distributed/test_tp_gpt_oss.py")),
    "GraniteForCausalLM": Architecture("granite.GraniteForCausalLM", "Granite 3.x (dense)",
                                       "full attention, muP multipliers", _DENSE_GGUF),
    "GraniteMoeHybridForCausalLM": Architecture("granitemoehybrid.GraniteMoeHybridForCausalLM", "Granite 4.0-H",
                                                "Mamba2 and attention, MoE", _STATE),
    "KimiLinearForCausalLM": Architecture("kimi_linear.KimiLinearForCausalLM", "Kimi Linear",
                                          "MLA and Kimi Delta Attention, MoE", _MLA),
    "LlamaForCausalLM": Architecture("llama.LlamaForCausalLM", "Llama 2/3, SmolLM2", "full attention",
                                     (*_TINY, "models/test_smollm2.py")),
    "MistralForCausalLM": Architecture("llama.LlamaForCausalLM", "Mistral, Ministral",
                                       "full attention, or sliding window where the config sets one",
                                       ("models/test_llama_tiny.py", *_DENSE)),
    "MixtralForCausalLM": Architecture("llama_moe.MixtralForCausalLM", "Mixtral", "full attention, MoE", _MOE),
    "Olmo2ForCausalLM": Architecture("olmo2.Olmo2ForCausalLM", "OLMo 2", "full attention, post-norms, q/k norms",
                                     _DENSE_GGUF),
    "Phi3ForCausalLM": Architecture("llama.LlamaForCausalLM", "Phi-3, Phi-3.5, Phi-4, Phi-4-mini",
                                    "full attention or sliding window; LongRoPE, partial rotary", _DENSE_GGUF),
    "Qwen2ForCausalLM": Architecture("llama.LlamaForCausalLM", "Qwen2, Qwen2.5",
                                     "full attention, or sliding window where the config sets one", (*_TINY, *_DENSE)),
    "Qwen2MoeForCausalLM": Architecture("llama_moe.Qwen2MoeForCausalLM", "Qwen2-MoE",
                                        "full attention, MoE with a shared expert", _MOE),
    "Qwen3ForCausalLM": Architecture("llama.LlamaForCausalLM", "Qwen3", "full attention, q/k norms", _TINY),
    "Qwen3MoeForCausalLM": Architecture("llama_moe.Qwen3MoeForCausalLM", "Qwen3-30B-A3B, Qwen3-Coder-30B-A3B",
                                        "full attention, MoE", (*_MOE, "models/test_moe_gguf_blocks.py")),
    "Qwen3NextForCausalLM": Architecture("qwen3_next.Qwen3NextForCausalLM", "Qwen3-Next",
                                         "Gated DeltaNet and gated full attention, MoE", _STATE),
    "SmolLM3ForCausalLM": Architecture("smollm3.SmolLM3ForCausalLM", "SmolLM3", "full attention, layers without RoPE",
                                       _DENSE_GGUF),
}


def model_class(architectures: list[str] | None) -> type[CausalLM]:
    """The class for the first supported name in a config's `architectures`; ValueError if none is."""
    for name in architectures or []:
        if name in ARCHITECTURES:
            module, _, cls = ARCHITECTURES[name].model.rpartition(".")
            return getattr(importlib.import_module(f"blockserve.models.{module}"), cls)
    found = ", ".join(architectures) if architectures else "none listed"
    raise ValueError(
        f"unsupported model architecture ({found}); blockserve supports: {', '.join(sorted(ARCHITECTURES))}. "
        "To ask for another, open an issue on the blockserve project naming the architecture and linking a "
        "checkpoint (its config.json); a family is added as one file under blockserve/models/ plus its line "
        "in blockserve/models/registry.py"
    )
