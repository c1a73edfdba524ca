"""Loading Hugging Face weights into models whose q/k/v and gate/up projections are fused.

    model.layers.3.self_attn.q_proj.weight ┐
    model.layers.3.self_attn.k_proj.weight ├─► model.layers.3.self_attn.qkv_proj.weight (concatenated)
    model.layers.3.self_attn.v_proj.weight ┘
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# Hugging Face projection -> (our fused projection, its index among the parts)
FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load_fused_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       skip: Callable[[str], bool] = lambda name: False) -> None:
    """Materialise every parameter of `model` from (Hugging Face name, tensor) pairs, as float32,
    concatenating the parts of fused projections. Names for which `skip` is true are ignored.
    Raises ValueError naming unexpected, missing or mis-shaped weights."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in named_tensors:
        if skip(name):
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        target, index = name, None
        if proj in FUSED:
            fused, index = FUSED[proj]
            target = f"{parent}.{fused}.{leaf}"
        if target not in params:
            unexpected.append(name)
            continue
        if index is not None:
            parts = pending.setdefault(target, {})
            parts[index] = tensor
            if len(parts) < len(PARTS[fused]):
                continue
            tensor = torch.cat([parts[i] for i in range(len(parts))])
            del pending[target]
        set_parameter(model, target, tensor, params[target].shape, name)
        loaded.add(target)
    missing = [n for target in params if target not in loaded for n in _hf_names(target, pending.get(target, {}))]
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the {type(model).__name__} built from its config: "
            f"unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}, "
            f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def set_parameter(model: nn.Module, target: str, tensor: torch.Tensor, shape: torch.Size, name: str) -> None:
    """Replace parameter `target` of `model` with `tensor` (from checkpoint weight `name`) as float32."""
    if tensor.shape != shape:
        raise ValueError(
            f"weight {name} has shape {tuple(tensor.shape)} but the model built from the config expects "
            f"{tuple(shape)} for {target}; does config.json match the checkpoint?"
        )
    module_path, _, leaf = target.rpartition(".")
    weight = tensor.detach().to(torch.float32).contiguous()
    setattr(model.get_submodule(module_path), leaf, nn.Parameter(weight, requires_grad=False))


def _hf_names(target: str, received: dict[int, torch.Tensor]) -> list[str]:
    """The Hugging Face names of a parameter, less the fused parts already received."""
    module_path, _, leaf = target.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    if proj not in PARTS:
        return [target]
    return [f"{parent}.{part}.{leaf}" for i, part in enumerate(PARTS[proj]) if i not in received]
