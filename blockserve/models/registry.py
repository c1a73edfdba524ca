"""Which model class serves which `architectures` name of a config.json: one line per name,
"<module under blockserve.models>.<class>", imported when a model of it is loaded."""

from __future__ import annotations

import importlib

from blockserve.models.base import CausalLM

ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "deepseek_v3.DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM": "gemma3.Gemma3ForCausalLM",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid.GraniteMoeHybridForCausalLM",
    "KimiLinearForCausalLM": "kimi_linear.KimiLinearForCausalLM",
    "LlamaForCausalLM": "llama.LlamaForCausalLM",
    "MistralForCausalLM": "llama.LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama.LlamaForCausalLM",
    "Qwen3ForCausalLM": "llama.LlamaForCausalLM",
    "Qwen3NextForCausalLM": "qwen3_next.Qwen3NextForCausalLM",
}


def model_class(architectures: list[str] | None) -> type[CausalLM]:
    """The class for the first supported name in a config's `architectures`; ValueError if none is."""
    for name in architectures or []:
        if name in ARCHITECTURES:
            module, _, cls = ARCHITECTURES[name].rpartition(".")
            return getattr(importlib.import_module(f"blockserve.models.{module}"), cls)
    found = ", ".join(architectures) if architectures else "none listed"
    raise ValueError(
        f"unsupported model architecture ({found}); blockserve supports: {', '.join(sorted(ARCHITECTURES))}"
    )
