"""Cold start to the first token, blockserve against llama.cpp on the same GGUF file, side by side:
each server process is started as a user starts it, polled on /health every POLL_S, then sent one
greedy completion of one token; the figure is the time from the process's spawn to that token's
response. Both are measured with the file in the page cache (a warm-up start of each runs first,
which also writes blockserve's cache entry for the file) and, for blockserve, with its native
kernels already built (the usual start) or, with --include-kernel-build, built inside the start
(a fresh TORCH_EXTENSIONS_DIR: the first start after installing or upgrading). Each row also gives
the time to /health and the process's peak RSS (VmHWM) at /health. blockserve's modules start from
compiled bytecode, as an installed package's do (the benchmark compiles it first: with
PYTHONDONTWRITEBYTECODE set and no __pycache__, every start would compile ~150 modules from source).

    python -m benchmarks.cold_start [--model FILE.gguf ...] [--threads 2] [--rounds 3]
        [--kv-cache-memory 32MiB] [--include-kernel-build] [--no-peer] [--baseline DIR] [--torch-floor]
        [--json results/cold_start.json]

--no-peer measures blockserve alone (where llama.cpp's peer build is not at hand). --baseline DIR
also starts the blockserve source tree in DIR (a checkout of an earlier commit, say) the same way,
in the same rounds: a before / after from one run. --torch-floor also times, in the same rounds, a
Python process that only imports torch, with the garbage collector paused as blockserve's start
imports it (spawn to the import's end; the process then leaves without tearing the interpreter
down): the part of any start of a Python engine on torch that no change to blockserve removes.

Both get a context of 512 tokens (blockserve's cache: --kv-cache-memory, which must hold 512 tokens of the
model's float32 K/V: 32MiB holds SmolLM2-135M's). Rounds alternate the two
engines; the medians are printed, with the other processes' share of the CPUs during each start (the servers' own CPU
time, reaped as they exit, is left out). llama.cpp: llama-server from the peer build
(benchmarks/peers/build_llama_cpp.sh), -np 1; blockserve: `blockserve serve`.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import blockserve
from blockserve.bench.common import environment, print_environment, write_json
from blockserve.models.default_model import default_model_path
from benchmarks.peers.native import BLOCKSERVE, HERE, CpuShare, engine_env, free_port

POLL_S = 0.02
TORCH_FLOOR = "python: import torch, nothing else"
TORCH_ONLY = "import gc, os; gc.disable(); import torch; os._exit(0)"
# a context of 512 tokens for both: llama.cpp's -c 512 (float16 KV), blockserve's float32 KV of 512 tokens
# of SmolLM2-135M (24 MiB) rounded up; blockserve's default would allocate (and zero) 1 GiB
KV_CACHE_MEMORY = "32MiB"
PROMPT = "The capital of France is"


def llama_command(bin_dir: Path, model: str, threads: int, port: int) -> list[str]:
    return [str(bin_dir / "llama-server"), "-m", model, "-np", "1", "-c", "512", "-t", str(threads), "-tb",
            str(threads), "--host", "127.0.0.1", "--port", str(port)]


def blockserve_command(model: str, threads: int, port: int, kv_cache_memory: str) -> list[str]:
    return [*BLOCKSERVE, "serve", "--model", model, "--num-threads", str(threads), "--max-model-len", "512",
            "--kv-cache-memory", kv_cache_memory, "--host", "127.0.0.1", "--port", str(port)]


def compiled(tree: Path) -> None:
    """The blockserve package under `tree` compiled to bytecode (__pycache__), as installing it does."""
    if not compileall.compile_dir(tree / "blockserve", quiet=1):
        raise RuntimeError(f"could not compile {tree / 'blockserve'} to bytecode")


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read() if response.status == 200 else None
    except OSError:
        return None


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def start_to_first_token(command: list[str], port: int, env: dict[str, str], cwd: Path | None = None) -> dict:
    """Spawn `command` (in `cwd`: `python -m` puts it first on the import path, so a blockserve tree's
    root there is the blockserve started), wait for /health, send a one-token completion; seconds
    from the spawn."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            while _get(url + "/health") is None:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"{command[0]} exited: {log.read()[-3000:].decode(errors='replace')}")
                if time.perf_counter() - start > 900:
                    raise RuntimeError(f"{' '.join(command)} did not become healthy in 900 s")
                time.sleep(POLL_S)
            healthy = time.perf_counter() - start
            rss_at_health = _peak_rss_mib(proc.pid)
            model = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                text = json.loads(response.read())["choices"][0]["text"]
            first_token = time.perf_counter() - start
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"healthy_s": healthy, "first_token_s": first_token, "peak_rss_mib_at_health": rss_at_health,
            "text": text}


def torch_import_s(env: dict[str, str]) -> dict:
    """Seconds from spawning a Python process that only imports torch (TORCH_ONLY) to its exit, and
    its peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", TORCH_ONLY], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"python -c {TORCH_ONLY!r} exited with {proc.returncode}")
    return {"first_token_s": seconds, "healthy_s": seconds, "peak_rss_mib_at_health": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=[str(default_model_path())])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default=KV_CACHE_MEMORY,
                        help="blockserve's KV cache: 512 tokens of the model (float32) fit in it")
    parser.add_argument("--include-kernel-build", action="store_true",
                        help="also one blockserve start whose native kernels are built inside it")
    parser.add_argument("--no-peer", action="store_true", help="blockserve alone: llama.cpp is not built or run")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another blockserve source tree (an earlier commit's checkout) started alike, same rounds")
    parser.add_argument("--torch-floor", action="store_true",
                        help="also time a Python process that only imports torch, in the same rounds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = environment()
    print_environment(env)
    bin_dir = None
    if not args.no_peer:
        built = subprocess.run([str(HERE / "build_llama_cpp.sh"), "native", "llama-server"], check=True,
                               capture_output=True, text=True)
        bin_dir = Path(built.stdout.strip().splitlines()[-1])
    tree = Path(blockserve.__file__).resolve().parents[1]
    compiled(tree)
    baseline = None
    if args.baseline is not None:
        if not (args.baseline / "blockserve" / "cli.py").is_file():
            raise SystemExit(f"--baseline {args.baseline}: no blockserve/cli.py there; give a blockserve source tree")
        baseline = args.baseline.resolve()
        compiled(baseline)
    results = []
    for model in args.model:
        systems = {"llama.cpp": (lambda port: llama_command(bin_dir, model, args.threads, port), engine_env(), None),
                   "blockserve": (lambda port: blockserve_command(model, args.threads, port, args.kv_cache_memory),
                                  engine_env(), tree)}
        if baseline is not None:
            systems["blockserve, baseline"] = (systems["blockserve"][0],
                                               {**engine_env(), "PYTHONPATH": str(baseline)}, baseline)
        if args.no_peer:
            del systems["llama.cpp"]
        for name, (command, system_env, cwd) in systems.items():  # warm-up: page cache, blockserve's cache entry
            port = free_port()
            start_to_first_token(command(port), port, system_env, cwd)
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        if args.torch_floor:
            runs[TORCH_FLOOR] = []
        for _ in range(args.rounds):
            for name, (command, system_env, cwd) in systems.items():
                port = free_port()
                with CpuShare() as share:
                    run = start_to_first_token(command(port), port, system_env, cwd)
                runs[name].append({**run, "other_cpu_share": share.others_share})
            if args.torch_floor:
                with CpuShare() as share:
                    run = torch_import_s(engine_env())
                runs[TORCH_FLOOR].append({**run, "other_cpu_share": share.others_share})
        if args.include_kernel_build:
            with tempfile.TemporaryDirectory() as build_dir:
                port = free_port()
                with CpuShare() as share:
                    command = blockserve_command(model, args.threads, port, args.kv_cache_memory)
                    run = start_to_first_token(command, port, {**engine_env(), "TORCH_EXTENSIONS_DIR": build_dir}, tree)
                runs["blockserve, kernels built in the start"] = [{**run, "other_cpu_share": share.others_share}]
        row = {"model": model, "threads": args.threads, "runs": runs,
               "median_first_token_s": {n: statistics.median(r["first_token_s"] for r in rs) for n, rs in runs.items()},
               "median_healthy_s": {n: statistics.median(r["healthy_s"] for r in rs) for n, rs in runs.items()},
               "peak_rss_mib_at_health": {n: statistics.median(r["peak_rss_mib_at_health"] for r in rs)
                                          for n, rs in runs.items()}}
        results.append(row)
        print(f"\n{Path(model).name}, {args.threads} threads (medians of {args.rounds}; warm page cache)")
        print(f"{'system':<40} {'first token s':>14} {'/health s':>10} {'peak RSS MiB':>13} {'others CPU':>11}")
        for name, rs in runs.items():
            print(f"{name:<40} {row['median_first_token_s'][name]:>14.2f} {row['median_healthy_s'][name]:>10.2f} "
                  f"{row['peak_rss_mib_at_health'][name]:>13.0f} "
                  f"{statistics.median(r['other_cpu_share'] for r in rs):>10.0%}")
        firsts = row["median_first_token_s"]
        if not args.no_peer:
            print(f"blockserve / llama.cpp, first token: {firsts['blockserve'] / firsts['llama.cpp']:.1f}x")
            if baseline is not None:
                print(f"baseline / llama.cpp, first token: {firsts['blockserve, baseline'] / firsts['llama.cpp']:.1f}x")
            if args.torch_floor:
                print(f"importing torch / llama.cpp's first token: {firsts[TORCH_FLOOR] / firsts['llama.cpp']:.2f}x")
    if args.json:
        write_json(args.json, {"environment": env, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
