"""The KV cache budget on CUDA: what `gpu_memory_utilization` of the device leaves after the
weights, the activations of the largest step and the decode steps' CUDA graphs (vLLM's rule).

    budget = gpu_memory_utilization * total device memory
             - memory in use after a profiling forward (weights, other processes, torch's context)
             - the forward's activation peak (allocated at its height, freed since)
             - what the CUDA graphs will hold: the largest decode graph, captured on a throwaway
               runner and released (the engine's graphs share one pool, sized by the largest)

The profiling forward is one real engine step (a throwaway scheduler, KV manager and model runner
over a KV cache just big enough for it) of one prompt of max_num_batched_tokens tokens (capped by
max_model_len - 1), so it runs every layer's real path, sampler included. On the CPU the budget
is `kv_cache_memory`; `profile_step` itself runs anywhere (tests run it on the CPU).
On CUDA a `kv_cache_memory` given instead of gpu_memory_utilization fixes the cache's size
(vLLM's kv_cache_memory_bytes): no profiling, but it must fit in the device's free memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockserve.engine.config import parse_memory
from blockserve.kv.capacity import plan_kv_cache
from blockserve.kv.manager import KVCacheManager
from blockserve.sampling_params import SamplingParams
from blockserve.scheduler.config import SchedulerConfig
from blockserve.scheduler.request import Request
from blockserve.scheduler.scheduler import Scheduler
from blockserve.worker.model_runner import ModelRunner


def fixed_cuda_kv_bytes(value: str | int | float, device: torch.device) -> int:
    """kv_cache_memory given on CUDA, in bytes. ValueError for a fraction (it would be of the host's
    memory; the GPU's share is gpu_memory_utilization) or more than `device` has free."""
    try:
        fraction = 0 < float(value) <= 1
    except (TypeError, ValueError):  # bytes with a unit
        fraction = False
    if fraction:
        raise ValueError(f"kv_cache_memory={value!r} is a fraction, which on CUDA would be of the host's memory: "
                         "give bytes with a unit ('4GiB'), or a share of the GPU with gpu_memory_utilization")
    kv_bytes = parse_memory(value)
    free, _ = torch.cuda.mem_get_info(device)
    if kv_bytes > free:
        raise ValueError(f"kv_cache_memory={value!r} ({kv_bytes / 2**30:.2f} GiB) is more than the "
                         f"{free / 2**30:.2f} GiB free on {device}")
    return kv_bytes


def _throwaway_runner(model: torch.nn.Module, groups: list, num_tokens: int, device: torch.device,
                      table_len: int | None = None) -> tuple[Scheduler, ModelRunner]:
    """A scheduler and model runner for one sequence of `num_tokens` tokens, over a KV cache just
    big enough for it. `groups`: the engine's (spec, layer names, reads_unwritten_slots) per KV group;
    `table_len`: the max_model_len the runner's block tables are sized for (None: the sequence's)."""
    max_model_len = num_tokens + 1
    need = sum(spec.page_size_bytes * max(1, len(layers)) * (spec.max_blocks_held(max_model_len, num_tokens) + 2)
               for spec, layers, _ in groups)
    kv_config = plan_kv_cache(groups, 2 * need, max_model_len, 1, num_tokens, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_model_len=max_model_len, max_num_seqs=1,
                                          max_num_batched_tokens=num_tokens), KVCacheManager(kv_config))
    return scheduler, ModelRunner(model, kv_config, 1, max(max_model_len, table_len or 0), seed=0, device=device)


def profile_step(model: torch.nn.Module, groups: list, num_tokens: int, device: torch.device) -> None:
    """Run one step of one prompt of `num_tokens` tokens through `model`. Everything it allocates
    is freed on return."""
    scheduler, runner = _throwaway_runner(model, groups, num_tokens, device)
    scheduler.add_request(Request("profile", [0] * num_tokens, SamplingParams(max_tokens=1, temperature=0.0)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))


def graph_probe(model: torch.nn.Module, groups: list, num_tokens: int, size: int, device: torch.device,
                max_model_len: int, capture=None) -> ModelRunner:
    """A throwaway runner holding `model`'s decode step captured at batch `size` (`capture`: as
    ModelRunner.capture_decode_graphs takes it); the graph lives as long as the runner. Its block
    tables are as wide as the engine's `max_model_len` makes them, as is what a captured step derives
    from them (flex's block mask). What grows with the cache's page count is not: its cache is small
    (on flex, ~17 bytes a page per attention group for the page map, and page lists up to 64 x the
    table width bytes per 16 rows: ~13 MB at 250k pages and 128k tokens)."""
    _, runner = _throwaway_runner(model, groups, num_tokens, device, max_model_len)
    runner.capture_decode_graphs([size], capture)
    return runner


@dataclass(frozen=True)
class CudaBudget:
    """The figures behind a CUDA KV budget, for the capacity report."""

    total: int
    in_use: int  # after the profiling forward, its cached blocks released
    activation_peak: int
    utilization: float
    graphs: int = 0  # held by the largest decode graph (0: no graphs)

    @property
    def kv_bytes(self) -> int:
        return int(self.utilization * self.total) - self.in_use - self.activation_peak - self.graphs

    def report(self) -> str:
        gib = 2**30
        graphs = f", {self.graphs / gib:.2f} GiB for CUDA graphs" if self.graphs else ""
        return (f"gpu_memory_utilization {self.utilization} of {self.total / gib:.2f} GiB = "
                f"{self.utilization * self.total / gib:.2f} GiB: {self.in_use / gib:.2f} GiB in use after the "
                f"profiling forward, {self.activation_peak / gib:.2f} GiB its activation peak{graphs}, "
                f"{self.kv_bytes / gib:.2f} GiB for the KV cache")


def cuda_kv_budget(device: torch.device, utilization: float, profile: Callable[[], None],
                   capture_graphs: Callable[[], object] | None = None) -> CudaBudget:
    """Measure `profile()` on CUDA `device` (see the module docstring), then, if given, the memory
    that what `capture_graphs()` returns holds until it is dropped. ValueError when nothing is
    left for the KV cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    graphs = 0
    if capture_graphs is not None:
        reserved = torch.cuda.memory_reserved(device)
        holder = capture_graphs()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up runs' activations go; the graphs' pool stays
        graphs = max(0, torch.cuda.memory_reserved(device) - reserved)
        del holder
        gc.collect()  # the graphs go with their runner
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = CudaBudget(total, total - free, max(0, peak), utilization, graphs)
    if budget.kv_bytes <= 0:
        raise ValueError(f"no memory left for the KV cache on {device}: {budget.report()}; raise "
                         "gpu_memory_utilization (--gpu-memory-utilization) or lower max_num_batched_tokens")
    return budget
