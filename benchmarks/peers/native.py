"""blockserve against llama.cpp built natively, side by side in one run: offline batches, batch-1
inter-token latency and streaming servers at 1 / 16 / 64 clients, at each thread count.

    make bench-peers-native                  (1 thread and all cores; results/peers_native.json)
    python -m benchmarks.peers.native --threads 1 2 [--rounds 2] [--clients 1 16 64] [--skip-server]
        [--input-len 112] [--max-tokens 128] [--batch 64] [--skip-offline] [--isa avx2] [--json PATH]
        [--blockserve-flags '' '--quantized-activations int8' ...] [--model FILE.gguf]

llama.cpp is built once by benchmarks/peers/build_llama_cpp.sh (from the llama-cpp-python sdist's
vendor/llama.cpp, -DGGML_NATIVE=ON, cached outside the repository). Both systems load the same
bundled SmolLM2-135M Q4_1 GGUF (or --model), each with its own defaults otherwise (llama.cpp: float16 KV;
blockserve: float32 KV, GGUF blocks for small batches), and every command is a separate process,
run as a user would:

    offline   llama-batched-bench -npp P -ntg G -npl B -t T        (one context, B parallel sequences)
              blockserve bench throughput --random-input-len P --num-prompts B --max-tokens G --num-threads T
              generated tokens / wall time of the whole batch, prefill included
    batch-1   llama-batched-bench ... -npl 1: T_TG / G              blockserve bench latency --batch-sizes 1: ITL p50
    server    llama-server -np 64 -t T         blockserve serve --num-threads T
              both driven by `blockserve bench serve --endpoint completions` with the same random token-id
              prompts (P tokens, G new, greedy, EOS ignored) at each --clients concurrency;
              output tok/s, TTFT p50, ITL p50 (gaps between content chunks: a server that holds
              back incomplete UTF-8 sends some chunks of 2+ tokens) and TPOT p50 (per token)
    memory    each server's peak RSS (VmHWM) once it answers /health: the model loaded, nothing served

Each --blockserve-flags value is one blockserve configuration ('' its defaults), measured beside the
same llama.cpp runs. Cells run interleaved (llama.cpp, then each blockserve configuration, per round)
and report medians over --rounds, each configuration's ratio to llama.cpp's median.
blockserve's offline run also measures the fp32 roofline (GEMM peak, bandwidth) after its workload
and reports its computed work's share of the compute bound.

--isa avx2 measures both engines as a CPU without AVX-512 (a Zen 3) runs them, on an AVX-512 machine:
llama.cpp built for AVX2 + FMA + F16C (build_llama_cpp.sh avx2); blockserve with its native kernels
built -mno-avx512f (BLOCKSERVE_NATIVE_ISA=avx2) and torch's own kernels held to AVX2
(ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA).
Each figure carries the other processes' share of the CPU during it: (all CPUs' busy time - the
measured processes' CPU time) / (wall time x CPUs), from /proc/stat and psutil. The CPU's SIMD flags,
the thread count and OMP settings go into the JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from blockserve.bench.common import environment, print_environment
from blockserve.models.default_model import default_model_path

HERE = Path(__file__).resolve().parent
BLOCKSERVE = [sys.executable, "-m", "blockserve.cli"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count()], help="thread counts, one table each")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each cell, interleaved; medians reported")
    ap.add_argument("--input-len", type=int, default=112, help="prompt tokens (random ids)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (EOS ignored)")
    ap.add_argument("--batch", type=int, default=64, help="offline batch (parallel sequences)")
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 16, 64], help="concurrent streaming clients")
    ap.add_argument("--requests-per-client", type=float, default=2.0,
                    help="requests per server run = clients x this (at least 4)")
    ap.add_argument("--skip-server", action="store_true", help="offline and batch-1 cells only")
    ap.add_argument("--skip-offline", action="store_true", help="batch-1 and server cells only")
    ap.add_argument("--blockserve-flags", nargs="+", default=[""], help="engine flags for the blockserve commands, "
                    "one configuration each, e.g. '' '--quantized-activations int8' (default: blockserve's defaults)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="native: each engine built for this CPU; avx2: both held to AVX2 (see above)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--model", type=Path, default=None, help="the GGUF both engines load (default: bundled)")
    args = ap.parse_args()
    if args.isa == "avx2":
        os.environ.update(AVX2_ENVIRONMENT)

    env = environment()
    print_environment(env)
    if inherited := [k for k in OPENMP_VARIABLES if k in os.environ]:
        print(f"note: {', '.join(inherited)} not passed to the engines (each runs with its own defaults)")
    env["isa"] = args.isa
    targets = ["llama-batched-bench", *([] if args.skip_server else ["llama-server"])]
    bin_dir = Path(subprocess.run([str(HERE / "build_llama_cpp.sh"), args.isa, *targets], check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1])
    model = str(args.model or default_model_path())
    print(f"llama.cpp binaries: {bin_dir}; model {model}")
    configs = {blockserve_name(flags): flags for flags in args.blockserve_flags}
    if len(configs) != len(args.blockserve_flags):
        ap.error("--blockserve-flags: each configuration once")
    systems = ["llama.cpp", *configs]
    results = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()}, "llama_cpp": str(bin_dir),
               "systems": systems, "tables": []}
    for threads in args.threads:
        table = {"threads": threads, "cells": {}}
        results["tables"].append(table)
        cells = table["cells"]
        for r in range(args.rounds):
            for name, runs in offline_cells(bin_dir, model, args, threads, configs).items():
                cells.setdefault(name, {system: [] for system in systems})
                for system, run in runs.items():
                    cells[name][system].append(run())
                print(f"[{threads} thr, round {r + 1}] {name}: " + ", ".join(
                    f"{system} {cells[name][system][-1]['value']:.2f}" for system in systems), flush=True)
                save(results, args.json)
            if not args.skip_server:
                for system in systems:
                    start = start_llama_server(bin_dir, model, threads, args) if system == "llama.cpp" else \
                        start_blockserve(model, threads, configs[system])
                    with Server(start) as server:
                        cells.setdefault("peak RSS after load, MiB", {s: [] for s in systems})
                        cells["peak RSS after load, MiB"][system].append({"value": server.peak_rss_mib,
                                                                          "others_cpu_share": float("nan")})
                        print(f"[{threads} thr, round {r + 1}] {system} server: peak RSS after load "
                              f"{server.peak_rss_mib:.0f} MiB", flush=True)
                        for clients in args.clients:
                            cells.setdefault(f"server {clients} clients", {s: [] for s in systems})
                            try:
                                run = serve_load(server, clients, args)
                            except RuntimeError as error:  # kept as a failed cell; the other cells still count
                                cells[f"server {clients} clients"][system].append({"failed": str(error)[-3000:]})
                                print(f"[{threads} thr, round {r + 1}] {system} server, {clients} clients: FAILED",
                                      flush=True)
                                continue
                            cells[f"server {clients} clients"][system].append(run)
                            print(f"[{threads} thr, round {r + 1}] {system} server, {clients} clients: "
                                  f"{run['value']:.1f} tok/s, TTFT p50 {run['ttft_p50_ms']:.0f} ms, "
                                  f"ITL p50 {run['itl_p50_ms']:.1f} ms, TPOT p50 {run['tpot_p50_ms']:.1f} ms", flush=True)
                            save(results, args.json)
    env["load_average_end"] = list(os.getloadavg())
    report(results)
    save(results, args.json)
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


def save(results: dict, path: Path | None) -> None:
    """The results so far, rewritten after every cell: a run cut short keeps what it measured."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


# -- measuring ----------------------------------------------------------------------------------


class CpuShare:
    """The other processes' share of the machine's CPUs while a block runs: all CPUs' busy time
    from /proc/stat, minus the CPU time of the measured processes (and their children)."""

    def __init__(self, pids: list[int] | None = None):
        self.pids = pids or []

    def _busy(self) -> float:
        times = psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0)

    def _ours(self) -> float:
        total = 0.0
        for pid in self.pids:
            try:
                proc = psutil.Process(pid)
                for p in (proc, *proc.children(recursive=True)):
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        children = os.times()
        return total + children.children_user + children.children_system

    def __enter__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._busy(), self._ours()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.ours = self._ours() - self.ours0
        others = max(0.0, self._busy() - self.busy0 - self.ours)
        self.others_share = others / (self.wall * psutil.cpu_count())


# Set in this process, these would reach both engines and override their own defaults: llama.cpp's
# OpenMP threads spin, blockserve's sleep (thread_policy.py). An inherited
# OMP_WAIT_POLICY=PASSIVE made llama.cpp's batch-1 ITL 36.3 ms instead of ~9.
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
# What holds blockserve to the code a CPU without AVX-512 runs: its native kernels' -mno-avx512f
# build, and torch's vectorised kernels, MKL's GEMM and oneDNN at AVX2.
AVX2_ENVIRONMENT = {"BLOCKSERVE_NATIVE_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def engine_env() -> dict[str, str]:
    """This process's environment without OPENMP_VARIABLES: each engine runs as a user starts it."""
    return {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}


def run_process(cmd: list[str]) -> tuple[str, CpuShare]:
    with CpuShare() as share:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr, share


def batched_bench(bin_dir: Path, model: str, args, threads: int, batch: int) -> dict:
    """One llama-batched-bench row: B sequences of P prompt tokens, G generated each."""
    ctx = batch * (args.input_len + args.max_tokens) + 64
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(args.input_len), "-ntg", str(args.max_tokens), "-npl", str(batch), "-t", str(threads),
           "-tb", str(threads)]
    out, share = run_process(cmd)
    rows = [line for line in out.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    if not rows:
        raise RuntimeError(f"no result row in llama-batched-bench's output:\n{out[-2000:]}")
    pp, tg, b, n_kv, t_pp, s_pp, t_tg, s_tg, t, s = (float(x) for x in rows[-1].strip("| ").split("|"))
    return {"pp": pp, "tg": tg, "batch": b, "t_pp_s": t_pp, "t_tg_s": t_tg, "t_s": t,
            "generated_tok_s": b * tg / t, "itl_ms": 1e3 * t_tg / tg, "others_cpu_share": share.others_share,
            "command": " ".join(cmd)}


def blockserve_name(flags: str) -> str:
    """A blockserve configuration's name in the tables: 'blockserve' plus its flags."""
    return " ".join(["blockserve", *flags.split()])


def blockserve_bench(kind: str, args, threads: int, extra: list[str], flags: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out_json = Path(d) / "out.json"
        cmd = [*BLOCKSERVE, "bench", kind, "--random-input-len", str(args.input_len), "--max-tokens",
               str(args.max_tokens), "--num-threads", str(threads), "--no-progress", "--output-json", str(out_json),
               *(["--model", str(args.model)] if args.model else []), *extra, *flags.split()]
        _, share = run_process(cmd)
        record = json.loads(out_json.read_text())
    return {"record": record, "others_cpu_share": share.others_share, "command": " ".join(cmd)}


def offline_cells(bin_dir: Path, model: str, args, threads: int, configs: dict[str, str]) -> dict:
    """Cell name -> {system: its run}, llama.cpp first; each run returns a dict with `value`."""
    def llama_offline():
        r = batched_bench(bin_dir, model, args, threads, args.batch)
        return {**r, "value": r["generated_tok_s"]}

    def ours_offline(flags: str):
        # with the fp32 roofline measured after the run (in its process): the share of the compute bound
        # its computed work reached (prefix-cache hits are not counted as work)
        r = blockserve_bench("throughput", args, threads, ["--num-prompts", str(args.batch)], flags)
        return {**r, "value": r["record"]["generated_tokens_per_s"],
                "fraction_of_compute_roofline": r["record"]["fraction_of_compute_roofline"]}

    def llama_itl():
        r = batched_bench(bin_dir, model, args, threads, 1)
        return {**r, "value": r["itl_ms"]}

    def ours_itl(flags: str):
        r = blockserve_bench("latency", args, threads, ["--batch-sizes", "1", "--num-iters", "3", "--no-roofline"],
                             flags)
        return {**r, "value": r["record"]["batch_sizes"][0]["itl_ms"]["median"]}

    def cell(llama, ours) -> dict:
        return {"llama.cpp": llama, **{name: (lambda flags=flags: ours(flags)) for name, flags in configs.items()}}

    cells = {} if args.skip_offline else {f"offline batch {args.batch}, generated tok/s": cell(llama_offline,
                                                                                                ours_offline)}
    return {**cells, "batch-1 inter-token latency, ms": cell(llama_itl, ours_itl)}


def _peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(bin_dir: Path, model: str, threads: int, args) -> tuple[list[str], int]:
    port, slots = free_port(), max(args.clients or [1])
    return [str(bin_dir / "llama-server"), "-m", model, "-np", str(slots), "-c",
            str(slots * (args.input_len + args.max_tokens + 16)), "-t", str(threads), "-tb", str(threads),
            "--threads-http", str(slots + 4), "--host", "127.0.0.1", "--port", str(port)], port


def start_blockserve(model: str, threads: int, flags: str) -> tuple[list[str], int]:
    port = free_port()
    return [*BLOCKSERVE, "serve", "--model", model, "--num-threads", str(threads), "--host", "127.0.0.1",
            "--port", str(port), *flags.split()], port


class Server:
    """A server process for the length of a `with` block: started, waited for (/health), stopped."""

    def __init__(self, command: tuple[list[str], int]):
        self.cmd, self.port = command
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=engine_env())
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.cmd[0]} exited: {self.log.read()[-3000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.peak_rss_mib = _peak_rss_mib(self.proc.pid)
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{' '.join(self.cmd)} did not become healthy in 600 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def serve_load(server: Server, clients: int, args, attempts: int = 2) -> dict:
    """One bench serve run at `clients`; a run with a failed request is run again (once by default),
    and the failures are kept in the record."""
    failures = []
    for attempt in range(attempts):
        try:
            return {**_serve_load(server, clients, args, seed=1000 * clients + attempt), "failed_attempts": failures}
        except RuntimeError as error:
            failures.append(str(error)[-1500:])
            print(f"{server.cmd[0]} at {clients} clients: a run failed, retrying ({str(error)[-300:]})", flush=True)
    raise RuntimeError(f"{server.cmd[0]} at {clients} clients failed {attempts} times:\n" + "\n".join(failures))


def _serve_load(server: Server, clients: int, args, seed: int) -> dict:
    """`seed`: the random prompts' (one per client count and attempt: both servers get the same
    prompts, and neither finds a run's prompts in its prompt cache from an earlier run or a retry)."""
    requests = max(4, round(clients * args.requests_per_client))
    with tempfile.TemporaryDirectory() as d:
        out_json = Path(d) / "serve.json"
        cmd = [*BLOCKSERVE, "bench", "serve", "--base-url", server.url, "--endpoint", "completions",
               "--random-input-len", str(args.input_len), "--max-tokens", str(args.max_tokens), "--num-prompts",
               str(requests), "--max-concurrency", str(clients), "--seed", str(seed), "--no-progress",
               "--output-json", str(out_json)]
        with CpuShare([server.proc.pid]) as share:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench serve against {server.cmd[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
        load = json.loads(out_json.read_text())["loads"][0]
    if load["completion_tokens"] != requests * args.max_tokens:
        raise RuntimeError(f"{server.cmd[0]} generated {load['completion_tokens']} tokens, expected "
                           f"{requests * args.max_tokens}")
    return {"value": load["output_throughput"], "ttft_p50_ms": load["ttft_ms"]["median"],
            "itl_p50_ms": load["itl_ms"]["median"], "tpot_p50_ms": load["tpot_ms"]["median"], "requests": requests, "load": load,
            "server_command": " ".join(server.cmd), "others_cpu_share": share.others_share,
            "server_cpu_per_wall": share.ours / share.wall}


# -- the table ----------------------------------------------------------------------------------


def report(results: dict) -> None:
    """Medians per cell, with each blockserve configuration's ratio to llama.cpp (higher is better for
    blockserve, whatever the unit)."""
    systems = results.get("systems", ["llama.cpp", "blockserve"])
    ours = systems[1:]
    for table in results["tables"]:
        isa = "AVX2 builds" if results["environment"]["isa"] == "avx2" else "native builds"
        print(f"\n== {table['threads']} thread(s), {isa}: median of {results['args']['rounds']} round(s); "
              f"others' CPU share in brackets; x: blockserve's lead (llama.cpp / blockserve where "
              f"lower is better, blockserve / llama.cpp otherwise) ==")
        for i, system in enumerate(systems):
            print(f"  [{i}] {system}")
        table["medians"] = {}
        for name, all_runs in table["cells"].items():
            runs = {s: [r for r in v if "value" in r] for s, v in all_runs.items()}
            if not all(runs.values()):
                failed = ", ".join(s for s, v in runs.items() if not v)
                print(f"{name:<42} failed in every round: {failed} (the errors are in the JSON)")
                continue
            lower_is_better = name.startswith(("batch-1", "peak RSS"))
            med = {s: statistics.median(r["value"] for r in v) for s, v in runs.items()}
            share = {s: statistics.median(r["others_cpu_share"] for r in v) for s, v in runs.items()}
            ratio = {s: med["llama.cpp"] / med[s] if lower_is_better else med[s] / med["llama.cpp"] for s in ours}
            entry = {**{s: med[s] for s in systems}, "blockserve_ratio": ratio, "others_cpu_share": share}
            line = f"{name:<42} " + "  ".join(
                f"[{i}] {med[s]:.2f} [{share[s]:.0%}]" + (f" {ratio[s]:.2f}x" if s in ratio else "")
                for i, s in enumerate(systems))
            if name.startswith("offline"):
                entry["blockserve_fraction_of_fp32_compute_roofline"] = roof = {s: statistics.median(
                    r["fraction_of_compute_roofline"] for r in runs[s]) for s in ours}
                line += "\n    fp32 compute roofline share: " + ", ".join(f"[{i + 1}] {roof[s]:.1%}"
                                                                          for i, s in enumerate(ours))
            if name.startswith("server"):
                for key in ("ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms"):
                    entry[key] = {s: statistics.median(r[key] for r in v) for s, v in runs.items()}
                line += "\n    TTFT / ITL / TPOT p50 ms: " + ", ".join(
                    f"[{i}] {entry['ttft_p50_ms'][s]:.0f} / {entry['itl_p50_ms'][s]:.1f} / {entry['tpot_p50_ms'][s]:.1f}"
                    for i, s in enumerate(systems))
            table["medians"][name] = entry
            print(line)


if __name__ == "__main__":
    sys.exit(main())
