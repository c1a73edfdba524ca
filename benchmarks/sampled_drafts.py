"""Acceptance of a draft model's drafts at temperature > 0: drafts sampled from the draft's distribution
and verified by rejection sampling (what the engine does) against greedy drafts verified by comparison
with the target's own sample (the draft's argmax, which the target accepts with probability p(x)).

    python -m benchmarks.sampled_drafts [--temperature 0.8] [--max-tokens 96] [--k 4] [--rounds 3]
    python -m benchmarks.sampled_drafts --draft-model /tmp/smollm2-24.gguf   (benchmarks.truncated_draft)

The draft defaults to the bundled model itself, so a sampled draft's q is the target's p (up to
rounding): the acceptance ceiling, where greedy drafting accepts about sum_x p(x)^2 of the drafts.
Greedy drafting is the same engine with each ask's sampling parameters set to temperature 0 for the
draft only (its drafts are then its argmax and come without a distribution, so verification compares).
Every draft is verified (FlatStepCosts: the step-cost rule would shorten the drafts by the machine's
timings, which would move the acceptance figures). One process, the two modes alternating per round,
the same seeds; prints one JSON line per (task, mode) with the acceptance rate (accepted / drafted),
the mean accepted length (tokens emitted per verification, the target's own included), output
tok/s (medians of the rounds), the CPU flags and the other processes' CPU share while it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from benchmarks.cpu_share import CpuShare
from benchmarks.spec_decode import TASKS, task_prompt
from blockserve import LLM, SamplingParams
from blockserve.bench.common import cpu_simd_flags
from blockserve.models.loader import default_model_path
from blockserve.spec_decode.step_costs import FlatStepCosts

MODES = ("greedy drafts", "sampled drafts")


def draft_greedily(proposer, switch: dict) -> None:
    """While switch["greedy"] is set, `proposer` drafts each request's argmax (its asks' sampling at
    temperature 0), so the target verifies by comparison."""
    propose_batch = proposer.propose_batch

    def asking(asks):
        if switch["greedy"]:
            asks = [(rid, token_ids, k, dataclasses.replace(s, params=dataclasses.replace(s.params, temperature=0)))
                    for rid, token_ids, k, s in asks]
        return propose_batch(asks)

    proposer.propose_batch = asking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--draft-model", default=None, help="the draft's path (default: the bundled model itself)")
    args = parser.parse_args()
    llm = LLM(enable_prefix_caching=False, speculative_config={
        "method": "draft_model", "model": args.draft_model or str(default_model_path()),
        "num_speculative_tokens": args.k})
    speculator = llm.engine.speculator
    speculator.costs = FlatStepCosts()
    switch = {"greedy": False}
    draft_greedily(speculator.proposer, switch)
    flags = cpu_simd_flags()
    for task in args.tasks:
        prompt = task_prompt(llm, task)
        totals = {mode: [0, 0, 0] for mode in MODES}  # drafted, accepted, verifications
        rates = {mode: [] for mode in MODES}
        with CpuShare() as share:
            for round_ in range(args.rounds):
                params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=round_)
                for mode in MODES:
                    switch["greedy"] = mode == "greedy drafts"
                    before = llm.engine.stats().speculation
                    began = time.perf_counter()
                    output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                    rates[mode].append(len(output.token_ids) / (time.perf_counter() - began))
                    after = llm.engine.stats().speculation
                    totals[mode][0] += after.num_draft_tokens - before.num_draft_tokens
                    totals[mode][1] += after.num_accepted_tokens - before.num_accepted_tokens
                    totals[mode][2] += after.num_verifications - before.num_verifications
        for mode in MODES:
            drafted, accepted, verifications = totals[mode]
            print(json.dumps({
                "task": task, "mode": mode, "temperature": args.temperature, "k": args.k,
                "max_tokens": args.max_tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
                "drafted": drafted, "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "mean_accepted_length": round(1 + accepted / verifications, 2) if verifications else None,
                "tok_s": round(statistics.median(rates[mode]), 1),
                "others_cpu_share": None if share.others is None else round(share.others, 2), "cpu_flags": flags,
            }), flush=True)


if __name__ == "__main__":
    main()
