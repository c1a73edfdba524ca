"""Which model class serves which `architectures` name of a config.json: one line per name,
"<module under blockserve.models>.<class>", imported when a model of it is loaded."""

from __future__ import annotations

import importlib

from blockserve.models.base import CausalLM

ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "deepseek_v3.DeepseekV3ForCausalLM",
    "Exaone4ForCausalLM": "exaone4.Exaone4ForCausalLM",
    "Gemma2ForCausalLM": "gemma2.Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3.Gemma3ForCausalLM",
    "Glm4ForCausalLM": "glm4.Glm4ForCausalLM",
    "GptOssForCausalLM": "gpt_oss.GptOssForCausalLM",
    "GraniteForCausalLM": "granite.GraniteForCausalLM",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid.GraniteMoeHybridForCausalLM",
    "KimiLinearForCausalLM": "kimi_linear.KimiLinearForCausalLM",
    "LlamaForCausalLM": "llama.LlamaForCausalLM",
    "MistralForCausalLM": "llama.LlamaForCausalLM",
    "MixtralForCausalLM": "llama_moe.MixtralForCausalLM",
    "Olmo2ForCausalLM": "olmo2.Olmo2ForCausalLM",
    "Phi3ForCausalLM": "llama.LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama.LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "llama_moe.Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "llama.LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "llama_moe.Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "qwen3_next.Qwen3NextForCausalLM",
    "SmolLM3ForCausalLM": "smollm3.SmolLM3ForCausalLM",
}


def model_class(architectures: list[str] | None) -> type[CausalLM]:
    """The class for the first supported name in a config's `architectures`; ValueError if none is."""
    for name in architectures or []:
        if name in ARCHITECTURES:
            module, _, cls = ARCHITECTURES[name].rpartition(".")
            return getattr(importlib.import_module(f"blockserve.models.{module}"), cls)
    found = ", ".join(architectures) if architectures else "none listed"
    raise ValueError(
        f"unsupported model architecture ({found}); blockserve supports: {', '.join(sorted(ARCHITECTURES))}. "
        "To ask for another, open an issue on the blockserve project naming the architecture and linking a "
        "checkpoint (its config.json); a family is added as one file under blockserve/models/ plus its line "
        "in blockserve/models/registry.py"
    )
