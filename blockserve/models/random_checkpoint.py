"""A checkpoint of random weights for any transformers config, saved as the engine's loader reads it:
the tiny models the parity tests, the GPU check and the step profiler run. Weights are far from
uniform logits (norms near 1, the rest N(0, 0.2)), so greedy tokens are not near-ties."""

from __future__ import annotations

import math

import torch


def save_random_model(hf_config, path, seed: int = 0):
    """A transformers model from `hf_config` with norms near 1 and other weights N(0, 0.2), saved to
    `path` with save_pretrained; returned, as the reference."""
    return _save_random(hf_config, path, seed)


def save_random_hybrid(hf_config, path, seed: int = 0):
    """Like save_random_model, plus: KDA decays in a range that keeps a memory of tens of tokens, and a
    non-zero e_score_correction_bias (a buffer, which save_random_model would leave zero)."""
    return _save_random(hf_config, path, seed, params={
        "A_log": lambda p: p.copy_(torch.empty_like(p).uniform_(math.log(0.02), math.log(0.2))),  # decay in [0.02, 0.2]
        "dt_bias": lambda p: p.normal_(-1.0, 0.5),
    }, buffers={"e_score_correction_bias": lambda b: b.normal_(0, 0.1)})


def _save_random(hf_config, path, seed: int, params=None, buffers=None):
    """Norms near 1, parameters ending in a key of `params` initialised by its function, the rest
    N(0, 0.2); buffers ending in a key of `buffers` likewise (the others keep their values)."""
    from transformers import AutoModelForCausalLM

    params, buffers = params or {}, buffers or {}
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            init = next((f for suffix, f in params.items() if name.endswith(suffix)), None)
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif init is not None:
                init(param)
            else:
                param.normal_(0, 0.2)
        for name, buffer in reference.named_buffers():
            init = next((f for suffix, f in buffers.items() if name.endswith(suffix)), None)
            if init is not None:
                init(buffer)
    reference.save_pretrained(path)
    return reference
