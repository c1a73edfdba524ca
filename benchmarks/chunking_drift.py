"""How far a prompt's logprobs move when its prefill is chunked differently, per activations setting
of the GGUF blocks (models/quantized_linear.py): the bundled SmolLM2, one prompt, its prompt
logprobs with the whole prompt in one step and with token budgets that cut it into chunks (what a
prefix-cache hit or a busy batch does to a prefill).

    .venv/bin/python benchmarks/chunking_drift.py [--budgets 7 32] [--emulate-levels 32767]
        [--json results/chunking_drift.json]

float32 moves by float rounding (the chunks' attention sums in another order); int8 rounds x to
int8 per block of 32 in every linear layer, a discontinuous step, so the same rounding differences
can move an element one level and the moves add up over the layers. The figure is the largest
|logprob difference| over the prompt's tokens against the one-step prefill.

--emulate-levels L adds settings no kernel implements yet: float32 activations with x rounded per
block of 32 to +-L levels before every GGUF linear layer (L = 127 is int8's rounding, and
reproduces its figure; L = 32767 is what 16-bit activations would do), with their distance from
float32 activations' one-step logprobs.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.benchmark.common import environment, print_environment, write_json
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import ACTIVATIONS, QuantizedLinear

PROMPT = "The capital of France is Paris, and the capital of Spain is Madrid. The capital of Italy is"
WHOLE = 2048  # token budget: the prompt in one step


def prompt_logprobs(loaded, budget: int) -> list[float]:
    llm = LLM(loaded, max_model_len=256, max_num_batched_tokens=budget, kv_cache_memory="16MiB", num_threads=1)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    return [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]


def rounded_per_block(x, levels: int):
    """x rounded per block of 32 to s * round(x / s), s = max|x_b| / levels (0 for an all-zero block)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / levels)).reshape(x.shape)


@contextlib.contextmanager
def emulated_levels(levels: int):
    """Every QuantizedLinear takes x rounded to +-`levels` per block (its float32 kernels then
    compute that x exactly up to float rounding, as an integer kernel would)."""
    forward = QuantizedLinear.forward
    QuantizedLinear.forward = lambda self, x: forward(self, rounded_per_block(x, levels))
    try:
        yield
    finally:
        QuantizedLinear.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[7, 32], help="token budgets that chunk the prompt")
    parser.add_argument("--emulate-levels", type=int, nargs="*", default=[],
                        help="also float32 activations rounded per block to +-L levels (127: int8, 32767: int16)")
    parser.add_argument("--json", default="results/chunking_drift.json")
    args = parser.parse_args()
    env = environment()
    print_environment(env)
    drift = {}
    for activations in ACTIVATIONS:
        loaded = load_model(None, BACKENDS["exact"], quantized_activations=activations)
        whole = prompt_logprobs(loaded, WHOLE)
        drift[activations] = {budget: max(abs(a - b) for a, b in zip(prompt_logprobs(loaded, budget), whole))
                              for budget in args.budgets}
        print(f"{activations:>8}: " + ", ".join(f"budget {b}: max |d logprob| {d:.3g}" for b, d in drift[activations].items())
              + f"  (against one step; {len(whole)} prompt tokens)")
    float32_whole = prompt_logprobs(load_model(None, BACKENDS["exact"]), WHOLE)
    from_float32 = {}
    for levels in args.emulate_levels:
        name = f"float32 rounded to +-{levels}"
        loaded = load_model(None, BACKENDS["exact"])
        with emulated_levels(levels):
            whole = prompt_logprobs(loaded, WHOLE)
            drift[name] = {budget: max(abs(a - b) for a, b in zip(prompt_logprobs(loaded, budget), whole))
                           for budget in args.budgets}
        from_float32[name] = max(abs(a - b) for a, b in zip(whole, float32_whole))
        print(f"{name}: " + ", ".join(f"budget {b}: max |d logprob| {d:.3g}" for b, d in drift[name].items())
              + f"; one step against float32 activations: {from_float32[name]:.3g}")
    write_json(args.json, {"environment": env, "prompt": PROMPT, "drift": drift,
                           "one_step_against_float32": from_float32})


if __name__ == "__main__":
    main()
