"""Which model class serves which `architectures` name of a config.json."""

from __future__ import annotations

from torch import nn

from blockserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from blockserve.models.gemma3 import Gemma3ForCausalLM
from blockserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from blockserve.models.kimi_linear import KimiLinearForCausalLM
from blockserve.models.llama import LlamaForCausalLM
from blockserve.models.qwen3_next import Qwen3NextForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a config's `architectures`; ValueError if none is."""
    for name in architectures or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    found = ", ".join(architectures) if architectures else "none listed"
    raise ValueError(
        f"unsupported model architecture ({found}); blockserve supports: {', '.join(sorted(ARCHITECTURES))}"
    )
