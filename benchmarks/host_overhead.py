"""The engine's host work per decode step, the model's compute taken out, by batch size.

On a GPU the host's Python (scheduling, input preparation, sampling bookkeeping, outputs) runs while
the device waits, unless it is overlapped: at batch 256 a ~1B model's decode step is ~1 ms of HBM
time, so host work of the same order halves throughput. This measures that work on the CPU, where
it is the same Python: a 1-layer, 64-wide random Llama (its forward costs little) decodes `--batch`
greedy requests in steady state, and each engine step (LLMEngine.step) is timed whole and in parts
by wrappers around the calls that make it up:

    step        LLMEngine.step
    model       the model's forward and compute_logits (the only device work of a decode step)
    host        step - model
      schedule  Scheduler.schedule
      prepare   the runner's zero and prepare phases (RunnerTimings): its rows updated, C1's orders,
                the step's inputs built on the host
      sample    the runner's sample phase: the rows' SamplingBatch, the sampler (argmax here), the
                sampled tokens recorded
      update    Scheduler.update_from_output (stop checks, prefix-cache registration)
      rest      host - the above (the runner's other bookkeeping, LLMEngine's outputs; with --graphs
                also the graph's static inputs, built and copied at launch)

Medians per phase over `--steps` steps a round (and the host's mean: every block_size-th step each
request gains a block), the median round reported; every round carries
the other processes' CPU share (benchmarks/cpu_share.py). Compare two commits by running this
from each checkout in turn (the commit is recorded):

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_overhead.py
        [--batch 1 16 64 256] [--rounds 3] [--steps 50] [--async-scheduling] [--prefix-caching] [--graphs]
        [--max-model-len N] [--json results/host_overhead.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_share import CpuShare  # noqa: E402

from blockserve.attention.paged_attention import BACKENDS  # noqa: E402
from blockserve.bench.common import environment, write_json  # noqa: E402
from blockserve.engine.llm import LLM  # noqa: E402
from blockserve.models.loader import load_model  # noqa: E402
from blockserve.sampling_params import SamplingParams  # noqa: E402
from blockserve.scheduler import Scheduler  # noqa: E402
from blockserve.worker.cuda_graphs import default_graph_sizes  # noqa: E402

MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
PROMPT_TOKENS = 32
PHASES = ("step", "model", "host", "schedule", "prepare", "sample", "update", "rest")


class PhaseTimer:
    """Times the engine's calls named in PHASES (the scheduler's methods patched on its class, the
    model's on the instance); each call adds its seconds to `current`."""

    def __init__(self, engine, model: torch.nn.Module):
        self.current: dict[str, float] = {}
        self._wrap(Scheduler, "schedule", "schedule")
        self._wrap(Scheduler, "update_from_output", "update")
        self._wrap(model, "forward", "model")
        self._wrap(model, "compute_logits", "model")
        self.runner_timings = engine.step_timings()

    def runner_phases(self) -> dict[str, float]:
        """The runner's own accounting so far: prepare and sample, in seconds."""
        t = self.runner_timings
        return {"prepare": t.zero + t.prepare, "sample": t.sample}

    def _wrap(self, owner, name: str, phase: str) -> None:
        call = getattr(owner, name)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - began

        setattr(owner, name, timed)  # on the model, an instance attribute: shadows the method (forward too)


def capture_host_side_only(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for CUDA graph capture on the CPU (`--graphs`): the forward runs once, at capture, and a
    replay computes nothing (on a GPU the device runs it), so a decode step takes the graph path's host
    work only, its static inputs built and copied. The sampled tokens are then meaningless; nothing here
    reads them."""
    return (lambda: None), forward()


def measure(llm: LLM, timer: PhaseTimer, batch: int, steps: int, rounds: int) -> dict:
    """Per-phase medians (ms) of `steps` steady decode steps of `batch` requests, per round."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=rounds * steps + 16, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, MODEL["vocab_size"], (batch, PROMPT_TOKENS), generator=generator).tolist()
    for i, prompt in enumerate(ids):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    for _ in range(8):  # prefill, then decode warm
        engine.step()
    per_round = []
    for _ in range(rounds):
        samples = {phase: [] for phase in PHASES}
        with CpuShare() as share:
            for _ in range(steps):
                timer.current = {}
                before = timer.runner_phases()
                began = time.perf_counter()
                engine.step()
                parts = dict(timer.current, step=time.perf_counter() - began)
                parts.update({k: v - before[k] for k, v in timer.runner_phases().items()})
                parts["host"] = parts["step"] - parts["model"]
                parts["rest"] = parts["host"] - sum(parts[p] for p in ("schedule", "prepare", "sample", "update"))
                for phase in PHASES:
                    samples[phase].append(parts[phase])
        per_round.append({"ms": {p: round(statistics.median(v) * 1e3, 4) for p, v in samples.items()},
                          "host_mean_ms": round(statistics.fmean(samples["host"]) * 1e3, 4),
                          "others_cpu_share": share.others})
    while engine.has_unfinished_requests():
        engine.step()
    median_round = sorted(per_round, key=lambda r: r["ms"]["host"])[len(per_round) // 2]
    return {"batch": batch, **median_round, "host_us_per_request": round(median_round["ms"]["host"] * 1e3 / batch, 2),
            "rounds": per_round}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--async-scheduling", action="store_true", help="the engine schedules a step ahead (its "
                    "host work then includes the in-flight bookkeeping; on the CPU nothing overlaps)")
    ap.add_argument("--prefix-caching", action="store_true", help="prefix caching on (the blocks' hashes too)")
    ap.add_argument("--graphs", action="store_true", help="decode steps through the CUDA-graph path (the flex "
                    "backend), with a stand-in capture whose replays compute nothing: the graph path's host work")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: what the steps need; the block "
                    "tables are this long / 16 columns wide; a step's are as wide as its longest context, rounded up")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {"environment": environment(), "args": vars(args), "model": MODEL, "batches": []}
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(LlamaConfig(**MODEL)).save_pretrained(tmp)
        loaded = load_model(tmp, BACKENDS["flex" if args.graphs else "exact"])  # exact cannot be captured
        with LLM(loaded, device="cpu", max_num_seqs=max(args.batch), block_size=16,
                 enable_prefix_caching=args.prefix_caching, async_scheduling=args.async_scheduling,
                 max_model_len=args.max_model_len or PROMPT_TOKENS + args.rounds * args.steps + 32,
                 kv_cache_memory="64MiB") as llm:
            if args.graphs:
                llm.engine.capture_decode_graphs(default_graph_sizes(max(args.batch)), capture_host_side_only)
            timer = PhaseTimer(llm.engine, loaded.model)
            for batch in args.batch:
                row = measure(llm, timer, batch, args.steps, args.rounds)
                results["batches"].append(row)
                ms = row["ms"]
                print(f"batch {batch:4d}: step {ms['step']:.3f} ms = model {ms['model']:.3f} + host {ms['host']:.3f} "
                      f"(mean {row['host_mean_ms']:.3f}) "
                      f"({row['host_us_per_request']:.2f} us/request: schedule {ms['schedule']:.3f}, prepare "
                      f"{ms['prepare']:.3f}, sample {ms['sample']:.3f}, update {ms['update']:.3f}, rest "
                      f"{ms['rest']:.3f}); others' CPU share {row['others_cpu_share']}", flush=True)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
