"""blockserve's n-gram speculation beside llama.cpp's lookup decoding (`llama-lookup`), batch 1, one
thread each, on the bundled GGUF and the tasks of benchmarks/spec_decode.py, greedy.

    python -m benchmarks.spec_decode_lookup [--max-tokens 96] [--k 4] [--rounds 3] [--tasks edit-code ...]
        [--json results/spec_decode_lookup.json]

llama.cpp is the native build of benchmarks/peers/build_llama_cpp.sh (`llama-lookup` among its
targets). Its plain rate is `llama-lookup --spec-draft-n-max 0` (no drafts: the same program
decoding one token per step) and its lookup rate `--spec-draft-n-max K`; each is a separate process,
and its rate is the output tokens over the prompt's encode plus the decode seconds it logs (the model
load is not counted). llama.cpp's lookup drafts from n-gram statistics of the context (n = 1..4,
its compiled-in LLAMA_NGRAM_MIN/MAX) without a static corpus; blockserve's from the latest match of
the last 5..2 tokens (prompt_lookup_max/min) with the step-cost rule of spec_decode/speculator.py.
blockserve's rate is the output tokens over the `generate` call's wall time (prefill included), with
`num_threads=1` and prefix caching off.

Each round runs the four cells of a task in turn (llama.cpp plain, llama.cpp lookup, blockserve
plain, blockserve n-gram), so the machine's load moves them alike; medians over the rounds. Prints
one JSON line per task: both engines' rates and ratios, whether each engine's speculative text equals
its plain text in every round (llama.cpp's as far as both go: llama-lookup stops once past -n, up to
k tokens later when drafts were accepted), the output tokens, the acceptance figures, the CPU flags
and the other processes' CPU share of each run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.cpu_share import CpuShare
from benchmarks.peers.native import HERE
from benchmarks.peers.native import CpuShare as ProcessCpuShare
from benchmarks.peers.native import engine_env
from benchmarks.spec_decode import TASKS
from blockserve import LLM, SamplingParams
from blockserve.bench.common import cpu_simd_flags
from blockserve.models.loader import default_model_path

_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNT = {name: re.compile(rf"{name}\s+=\s+(\d+)") for name in ("n_drafted", "n_accept")}


def llama_lookup(bin_dir: Path, model: str, prompt: str, max_tokens: int, k: int) -> dict:
    """One `llama-lookup` run, greedy, one thread: its output text, rate and draft counts."""
    cmd = [str(bin_dir / "llama-lookup"), "-m", model, "-p", prompt, "-n", str(max_tokens), "-t", "1", "-tb", "1",
           "--temp", "0", "-c", "2048", "--spec-draft-n-max", str(k), "--seed", "0"]
    with ProcessCpuShare() as share:  # counts the child's CPU time as ours
        proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env())
    out = proc.stderr
    encoded, decoded = _ENCODED.search(out), _DECODED.search(out)
    if proc.returncode != 0 or encoded is None or decoded is None:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}) or logged no timings:\n{out[-3000:]}")
    text = proc.stdout  # the prompt and the generated text (the logs go to stderr)
    counts = {name: int(m.group(1)) if (m := pattern.search(out)) else 0 for name, pattern in _COUNT.items()}
    tokens, seconds = int(decoded.group(1)), float(encoded.group(2)) + float(decoded.group(2))
    return {"tok_s": tokens / seconds, "text": text.rstrip(), "tokens": tokens, "others": share.others_share,
            **counts}


def blockserve_run(llm: LLM, prompt: str, params: SamplingParams) -> dict:
    with CpuShare() as share:
        began = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - began
    return {"tok_s": len(out.token_ids) / seconds, "text": out.text, "tokens": len(out.token_ids),
            "others": share.others}


def same_greedy_text(a: str, b: str) -> bool:
    """Whether two greedy outputs agree as far as both go (llama-lookup stops once past -n, up to k
    tokens later when drafts were accepted)."""
    return a.startswith(b) or b.startswith(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="drafts per step at most, both engines")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--json", type=Path, default=None, help="also write every line to this file")
    args = parser.parse_args()
    build = [str(HERE / "build_llama_cpp.sh"), "native", "llama-lookup"]
    bin_dir = Path(subprocess.run(build, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    model = str(default_model_path())
    plain = LLM(enable_prefix_caching=False, num_threads=1)
    ngram = LLM(enable_prefix_caching=False, num_threads=1, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    flags = cpu_simd_flags()
    lines = []
    for task in args.tasks:
        prompt = TASKS[task]
        cells: dict[str, list[dict]] = {"llama_plain": [], "llama_lookup": [], "plain": [], "ngram": []}
        before = ngram.engine.stats().speculation
        for _ in range(args.rounds):
            cells["llama_plain"].append(llama_lookup(bin_dir, model, prompt, args.max_tokens, 0))
            cells["llama_lookup"].append(llama_lookup(bin_dir, model, prompt, args.max_tokens, args.k))
            cells["plain"].append(blockserve_run(plain, prompt, params))
            cells["ngram"].append(blockserve_run(ngram, prompt, params))
        after = ngram.engine.stats().speculation
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        rate = {name: statistics.median(c["tok_s"] for c in runs) for name, runs in cells.items()}
        llama_drafted = sum(c["n_drafted"] for c in cells["llama_lookup"])
        llama_accepted = sum(c["n_accept"] for c in cells["llama_lookup"])
        line = {
            "task": task, "batch": 1, "threads": 1, "max_tokens": args.max_tokens, "k": args.k,
            "llama_cpp_plain_tok_s": round(rate["llama_plain"], 1),
            "llama_cpp_lookup_tok_s": round(rate["llama_lookup"], 1),
            "llama_cpp_ratio": round(rate["llama_lookup"] / rate["llama_plain"], 2),
            "llama_cpp_identical": all(same_greedy_text(p["text"], s["text"])
                                       for p, s in zip(cells["llama_plain"], cells["llama_lookup"])),
            "llama_cpp_tokens": [cells["llama_plain"][-1]["tokens"], cells["llama_lookup"][-1]["tokens"]],
            "llama_cpp_acceptance_rate": round(llama_accepted / llama_drafted, 2) if llama_drafted else None,
            "blockserve_plain_tok_s": round(rate["plain"], 1), "blockserve_ngram_tok_s": round(rate["ngram"], 1),
            "blockserve_ratio": round(rate["ngram"] / rate["plain"], 2),
            "blockserve_identical": all(p["text"] == s["text"] for p, s in zip(cells["plain"], cells["ngram"])),
            "blockserve_tokens": cells["plain"][-1]["tokens"],
            "blockserve_acceptance_rate": round(accepted / drafted, 2) if drafted else None,
            "others_cpu_share": {name: [None if c["others"] is None else round(c["others"], 2) for c in runs]
                                 for name, runs in cells.items()},
            "cpu_flags": flags,
        }
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.json is not None:
        args.json.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
