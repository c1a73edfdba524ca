"""What every `blockserve bench` command shares: the environment record (thread settings
included), percentile summaries, the JSON result file, and the workload arguments."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path

PERCENTILES = (50, 90, 99)


def environment() -> dict:
    """The machine, the versions, the commit (+dirty) and the thread settings, for the record."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=Path(__file__).parent).stdout.strip())
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blockserve_commit": commit,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_simd_flags": cpu_simd_flags(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        **thread_settings(),
        "load_average_start": list(os.getloadavg()),
    }


# The instruction sets the native kernels' paths depend on (native/csrc/, compiled -march=native).
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_simd_flags() -> list[str]:
    """Which of SIMD_FLAGS this CPU has (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return []
    return [flag for flag in SIMD_FLAGS if flag in flags]


def thread_settings() -> dict:
    """The settings every figure depends on: torch threads and the OpenMP environment."""
    import torch

    return {
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),  # a spin length instead of a policy (thread_policy.py)
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
    }


def describe_threads(settings: dict | None = None) -> str:
    s = settings or thread_settings()
    return (f"torch threads {s['torch_num_threads']} (interop {s['torch_num_interop_threads']}), "
            f"OMP_NUM_THREADS={s['OMP_NUM_THREADS']}, OMP_WAIT_POLICY={s['OMP_WAIT_POLICY']}"
            + (f", GOMP_SPINCOUNT={s['GOMP_SPINCOUNT']}" if s.get("GOMP_SPINCOUNT") else ""))


def print_environment(env: dict) -> None:
    print(f"machine: {env['cpu']} ({' '.join(env['cpu_simd_flags'])}), {env['cpus_usable']} usable CPUs; "
          f"torch {env['torch']}, python {env['python']}; load average {' '.join(f'{x:.2f}' for x in env['load_average_start'])}; "
          f"blockserve {env['blockserve_commit']}")
    print(f"threads: {describe_threads(env)}")
    if env["OMP_WAIT_POLICY"] is None and env.get("GOMP_SPINCOUNT") is None and env["torch_num_threads"] > 1:
        print("note: no OpenMP wait policy is set (libgomp spins 300k iterations); blockserve's commands set "
              "one (blockserve/thread_policy.py)")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict:
    """count, mean, median, p90, p99 (and min/max) of `values` times `scale` (1e3: seconds -> ms).
    An empty list gives count 0 and null statistics."""
    if not values:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    xs = [v * scale for v in values]
    return {"count": len(xs), "mean": statistics.fmean(xs), "median": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "min": min(xs), "max": max(xs)}


def format_summary(name: str, s: dict, unit: str = "ms") -> str:
    if not s["count"]:
        return f"{name:<6} (none)"
    return (f"{name:<6} median {s['median']:9.2f} {unit}  mean {s['mean']:9.2f}  p90 {s['p90']:9.2f}  "
            f"p99 {s['p99']:9.2f}  (n={s['count']})")


def write_json(path: str | Path | None, results: dict) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}")


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def args_record(args: argparse.Namespace) -> dict:
    """The command's arguments as JSON (without the dispatch function)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}


def add_workload_args(parser: argparse.ArgumentParser, default_num_prompts: int | None = 64) -> None:
    g = parser.add_argument_group("workload")
    if default_num_prompts is not None:
        g.add_argument("--num-prompts", type=int, default=default_num_prompts,
                       help="requests (more than the chat workload's 64 cycle through them)")
    g.add_argument("--random-input-len", type=int, default=None,
                   help="random token-id prompts of this length instead of the fixed chat workload")
    g.add_argument("--max-tokens", "--random-output-len", dest="max_tokens", type=int, default=128,
                   help="new tokens per request (greedy, EOS ignored, so every request generates exactly this many)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


# -- offline engines ----------------------------------------------------------------------------


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineConfig's, blockserve/config_args.py); --kv-cache-memory left
    unset sizes the cache to the workload (`engine_config_for`)."""
    from blockserve.config_args import add_config_arguments
    from blockserve.engine.config import EngineConfig

    add_config_arguments(parser, EngineConfig, title="engine", defaults={"kv_cache_memory": None},
                         notes={"kv_cache_memory": "default: 1.5x what the workload needs with every request running"})


def load_for_bench(args: argparse.Namespace):
    """(the EngineConfig of the engine flags, the model loaded once as that config says). The
    torch threads are set first, so loading runs with them too; engines are built on the model
    with `new_engine` (a fresh KV and prefix cache each time). With --kv-cache-memory unset the
    config holds the default until `engine_config_for` sizes it."""
    from blockserve.config_args import config_from_namespace
    from blockserve.engine.config import EngineConfig
    from blockserve.engine.core import load_model_for

    config = config_from_namespace(EngineConfig, args)
    return config, load_model_for(config)


def kv_bytes_needed(loaded, config, token_counts: list[int]) -> int:
    """KV cache bytes for requests of these total lengths all running at once, in `config`'s block
    size and K/V dtypes."""
    specs = [config.kv_spec(s) for s in loaded.model.kv_cache_specs(config.block_size).values()]
    return sum(spec.max_blocks_held(n) * spec.page_size_bytes for spec in specs for n in token_counts)


def engine_config_for(config, loaded, token_counts: list[int], size_kv_cache: bool):
    """`config`, or with `size_kv_cache` (--kv-cache-memory left unset) `config` with a cache 1.5x
    what requests of these total lengths need when all run at once (so no run is limited by
    preemption unless asked), and at least one request of max_model_len."""
    import dataclasses

    from blockserve.engine.core import resolve_max_model_len

    if not size_kv_cache:
        return config
    max_len = resolve_max_model_len(config, loaded.hf_config)
    need = max(kv_bytes_needed(loaded, config, token_counts), kv_bytes_needed(loaded, config, [max_len]))
    return dataclasses.replace(config, kv_cache_memory=int(1.5 * need) + 64 * 2**20)


def new_engine(config, loaded):
    """An LLMEngine over an EngineCore built on the already loaded model."""
    from blockserve.engine.core import EngineCore
    from blockserve.engine.llm_engine import LLMEngine

    return LLMEngine(config, EngineCore(config, loaded))


def bench_prompts(args: argparse.Namespace, loaded, num_prompts: int) -> tuple[list[list[int]], str]:
    """(token-id prompts, a description): the fixed chat workload, or random prompts with
    --random-input-len. More than 64 chat prompts cycle through the 64 conversations."""
    from blockserve.bench.workloads import CONVERSATIONS, random_prompts, workload_prompts

    if args.random_input_len is not None:
        prompts = random_prompts(num_prompts, args.random_input_len, loaded.hf_config.vocab_size, args.seed)
        return prompts, f"random token ids, {args.random_input_len} per prompt"
    if loaded.tokenizer is None or not getattr(loaded.tokenizer, "chat_template", None):
        raise ValueError("the fixed chat workload needs a model with a chat template; use --random-input-len")
    base = workload_prompts(loaded.tokenizer, min(num_prompts, len(CONVERSATIONS)))
    return [base[i % len(base)] for i in range(num_prompts)], "the fixed chat workload"


def engine_record(config) -> dict:
    from dataclasses import asdict

    return asdict(config)
