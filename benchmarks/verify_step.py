"""What a speculative verification step costs against a plain decode step, on the bundled model at
batch 1: the runner's forward time (model and lm head) of a step of 1 row and of k + 1 rows.

    python -m benchmarks.verify_step [--k 4] [--rounds 3] [--steps 40]

A request continues a repetitive list (n-gram drafts are all accepted) and every draft is verified
(FlatStepCosts: no step-cost rule), so nearly every step scores k + 1 rows. Two ways to run those rows, alternating in one process:

    decode   the engine's own: the k + 1 rows attend as k + 1 decodes of growing length
             (worker/input_batch.py), so the step runs the decoder stack's one native call
    prefill  the rows as one prefill chunk (InputBatch._verifying patched to choose none): the
             module tree and the prefill attention, as a verification ran before the decode path

Prints one JSON line per path: the median forward milliseconds of the 1-row steps (speculation
off) and of the k + 1-row steps, their ratio, the CPU flags and the other processes' CPU share.
"""

from __future__ import annotations

import argparse
import json
import statistics
from unittest import mock

from benchmarks.cpu_share import CpuShare
from benchmarks.spec_decode import TASKS
from blockserve import LLM, SamplingParams
from blockserve.bench.common import cpu_simd_flags
from blockserve.spec_decode import speculator as speculator_module
from blockserve.spec_decode.step_costs import FlatStepCosts
from blockserve.worker.input_batch import InputBatch


def forward_ms(llm: LLM, prompt: str, steps: int, rows: int | None) -> list[float]:
    """Forward milliseconds of the steps that scored `rows` rows of one request (None: every step
    after the prefill, speculation off)."""
    engine = llm.engine
    timings = engine.step_timings()
    engine.add_request("timed", prompt, SamplingParams(temperature=0, max_tokens=steps * 8, ignore_eos=True))
    engine.step()  # the prefill
    samples = []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        drafted = engine.stats().speculation.num_draft_tokens if rows else 0
        before = timings.forward
        engine.step()
        seconds = timings.forward - before
        if rows is None or engine.stats().speculation.num_draft_tokens - drafted == rows - 1:
            samples.append(1000 * seconds)
    engine.abort_request(["timed"])
    while engine.has_unfinished_requests():
        engine.step()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per path and round")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    plain = LLM(enable_prefix_caching=False)
    with mock.patch.object(speculator_module, "StepCosts", FlatStepCosts):  # every step verifies all its drafts
        speculative = LLM(enable_prefix_caching=False, speculative_config=spec)
    prompt = TASKS["continue-list"]
    samples: dict[str, list[float]] = {"one-row": [], "decode": [], "prefill": []}
    with CpuShare() as share:
        for _ in range(args.rounds):
            samples["one-row"] += forward_ms(plain, prompt, args.steps, None)
            samples["decode"] += forward_ms(speculative, prompt, args.steps, args.k + 1)
            with mock.patch.object(InputBatch, "_verifying", lambda self, out: set()):
                samples["prefill"] += forward_ms(speculative, prompt, args.steps, args.k + 1)
    one_row = statistics.median(samples["one-row"])
    for path in ("decode", "prefill"):
        rows_ms = statistics.median(samples[path])
        print(json.dumps({
            "path": path, "k": args.k, "one_row_ms": round(one_row, 2), "k_plus_1_rows_ms": round(rows_ms, 2),
            "ratio": round(rows_ms / one_row, 2), "steps": len(samples[path]),
            "others_cpu_share": None if share.others is None else round(share.others, 2),
            "cpu_flags": cpu_simd_flags(),
        }), flush=True)


if __name__ == "__main__":
    main()
