"""blockserve, the system under test: `LLM.generate` over the whole batch, and batch-1 decode latency."""

from __future__ import annotations

import gc

from benchmarks.peers.run_result import RunResult, check_counts, timed
from blockserve import LLM, SamplingParams
from blockserve.bench.latency import run_iteration


class BlockserveRunner:
    """Every run builds a fresh engine (KV cache, prefix cache) on the same loaded weights, so no
    run reuses another's prefix cache; prefix caching within a run follows engine_args."""

    def __init__(self, loaded, engine_args: dict, progress: bool):
        self.loaded, self.engine_args, self.progress = loaded, engine_args, progress

    def new_llm(self) -> LLM:
        return LLM(self.loaded, **self.engine_args)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
        llm = self.new_llm()
        keys = ("zero", "prepare", "forward", "sample", "steps")
        before = {k: getattr(llm.engine.step_timings(), k) for k in keys}
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs, seconds, cpu, load = timed(lambda: llm.generate(prompts, params, use_tqdm=self.progress))
        after = llm.engine.step_timings()
        phases = {k: getattr(after, k) - before[k] for k in keys}
        steps = phases.pop("steps")
        phases["scheduler+engine (rest)"] = seconds - sum(phases.values())
        tokens = [o.outputs[0].token_ids for o in outputs]
        check_counts("blockserve", tokens, max_tokens)
        extra = {
            "steps": steps,
            "ms_per_step": 1e3 * seconds / max(steps, 1),
            "phase_seconds": phases,
            "phase_share": {k: v / seconds for k, v in phases.items()},
            "prefix_cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
            "prefix_cached_per_request": [o.num_cached_tokens for o in outputs],  # in prompt order
        }
        del llm
        gc.collect()
        return RunResult(seconds, sum(map(len, tokens)), len(prompts), cpu, load, extra), tokens

    def itl(self, prompt: list[int], max_tokens: int) -> float:
        """Batch-1 seconds per token after the first, on a fresh engine: the request's TPOT from
        `blockserve bench latency`'s step loop, (last token's time - first's) / (max_tokens - 1)."""
        llm = self.new_llm()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        result = run_iteration(llm.engine, [prompt], params, "itl")
        if result["generated_tokens"] != max_tokens:
            raise RuntimeError(f"blockserve generated {result['generated_tokens']} tokens, expected {max_tokens}")
        return result["tpot"][0]
