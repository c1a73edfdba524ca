"""How far a prompt's logprobs move when its prefill is chunked differently, per activations setting
of the GGUF blocks (models/quantized_linear.py): the bundled SmolLM2, one prompt, its prompt
logprobs with the whole prompt in one step and with token budgets that cut it into chunks (what a
prefix-cache hit or a busy batch does to a prefill).

    python -m benchmarks.chunking_drift [--budgets 7 32] [--emulate-levels 32767]
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

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.bench.common import environment, print_environment, write_json
from blockserve.models.loader import load_model
from blockserve.models.quantized_linear import ACTIVATIONS, QuantizedLinear, round_per_block

PROMPT = "The capital of France is Paris, and the capital of Spain is Madrid. The capital of Italy is"
WHOLE = 2048  # token budget: the prompt in one step


def prompt_logprobs(loaded, budget: int) -> list[float]:
    llm = LLM(loaded, max_model_len=256, max_num_batched_tokens=budget, kv_cache_memory="16MiB", num_threads=1)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    return [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]


@contextlib.contextmanager
def emulated_levels(levels: int):
    """Every QuantizedLinear takes x rounded to +-`levels` per block (its float32 kernels then
    compute that x exactly up to float rounding, as an integer kernel would)."""
    forward = QuantizedLinear.forward
    QuantizedLinear.forward = lambda self, x: forward(self, round_per_block(x, levels))
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
    drift, one_step, from_float32 = {}, {}, {}
    settings = [(activations, activations, contextlib.nullcontext()) for activations in ACTIVATIONS]
    settings += [(f"float32 rounded to +-{levels}", "float32", emulated_levels(levels)) for levels in args.emulate_levels]
    for name, activations, emulation in settings:
        loaded = load_model(None, BACKENDS["exact"], quantized_activations=activations)
        with emulation:
            one_step[name] = prompt_logprobs(loaded, WHOLE)
            drift[name] = {budget: max(abs(a - b) for a, b in zip(prompt_logprobs(loaded, budget), one_step[name]))
                           for budget in args.budgets}
        line = f"{name:>8}: " + ", ".join(f"budget {b}: max |d logprob| {d:.3g}" for b, d in drift[name].items())
        if name not in ACTIVATIONS:
            from_float32[name] = max(abs(a - b) for a, b in zip(one_step[name], one_step["float32"]))
            line += f"; one step against float32 activations: {from_float32[name]:.3g}"
        print(line + f"  (against one step; {len(one_step[name])} prompt tokens)")
    write_json(args.json, {"environment": env, "prompt": PROMPT, "drift": drift,
                           "one_step_against_float32": from_float32})


if __name__ == "__main__":
    main()
