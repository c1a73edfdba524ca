"""blockserve's n-gram speculation beside llama.cpp's lookup decoding (`llama-lookup`), batch 1, one
thread each, on the bundled GGUF and the tasks of benchmarks/spec_decode.py, greedy.

    python -m benchmarks.spec_decode_lookup [--max-tokens 96] [--k 4] [--rounds 3] [--tasks edit-code ...]
        [--draft-model self|FILE.gguf] [--json results/spec_decode_lookup.json]

llama.cpp is the native build of benchmarks/peers/build_llama_cpp.sh (`llama-lookup` among its
targets). Its plain rate is `llama-lookup --spec-draft-n-max 0` (no drafts: the same program
decoding one token per step) and its lookup rate `--spec-draft-n-max K`; each is a separate process,
and its rate is the output tokens over the prompt's encode plus the decode seconds it logs (the model
load is not counted). llama.cpp's lookup drafts from n-gram statistics of the context (n = 1..4,
its compiled-in LLAMA_NGRAM_MIN/MAX) without a static corpus; blockserve's from the latest match of
the last 5..2 tokens (prompt_lookup_max/min) with the step-cost rule of spec_decode/speculator.py.
blockserve's rate is the output tokens over the `generate` call's wall time (prefill included), with
`num_threads=1` and prefix caching off. With --draft-model, `llama-speculative -md FILE` (greedy
drafts of the draft model, one thread for each model) runs beside blockserve's draft_model method.

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
from benchmarks.spec_decode import TASKS, task_prompt
from blockserve import LLM, SamplingParams
from blockserve.bench.common import cpu_simd_flags
from blockserve.models.loader import default_model_path

_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # llama-speculative colours its accepted drafts
_COUNT = {name: re.compile(rf"{name}\s+=\s+(\d+)") for name in ("n_drafted", "n_accept")}


def llama_cpp(bin_dir: Path, program: str, model: str, prompt: str, max_tokens: int, extra: list[str]) -> dict:
    """One run of a llama.cpp speculation example (`llama-lookup`, `llama-speculative`), greedy, one
    thread: its output text, rate and draft counts."""
    cmd = [str(bin_dir / program), "-m", model, "-p", prompt, "-n", str(max_tokens), "-t", "1", "-tb", "1",
           "--temp", "0", "-c", "2048", "--seed", "0", *extra]
    with ProcessCpuShare() as share:  # counts the child's CPU time as ours
        proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env())
    out = proc.stderr
    encoded, decoded = _ENCODED.search(out), _DECODED.search(out)
    if proc.returncode != 0 or encoded is None or decoded is None:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}) or logged no timings:\n{out[-3000:]}")
    text = _ANSI.sub("", proc.stdout)  # the prompt and the generated text (the logs go to stderr)
    counts = {name: int(m.group(1)) if (m := pattern.search(out)) else 0 for name, pattern in _COUNT.items()}
    tokens, seconds = int(decoded.group(1)), float(encoded.group(2)) + float(decoded.group(2))
    return {"tok_s": tokens / seconds, "text": text.rstrip(), "tokens": tokens, "others": share.others_share,
            "drafted": counts["n_drafted"], "accepted": counts["n_accept"]}


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
    parser.add_argument("--draft-model", default=None,
                        help="also time a draft model (a GGUF file; 'self': the bundled model as its own draft): "
                             "llama-speculative beside blockserve's draft_model")
    parser.add_argument("--json", type=Path, default=None, help="also write every line to this file")
    args = parser.parse_args()
    targets = ["llama-lookup"] + (["llama-speculative"] if args.draft_model else [])
    build = [str(HERE / "build_llama_cpp.sh"), "native", *targets]
    bin_dir = Path(subprocess.run(build, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    model = str(default_model_path())
    draft = model if args.draft_model == "self" else args.draft_model
    k = str(args.k)
    engines = {"plain": LLM(enable_prefix_caching=False, num_threads=1),
               "ngram": LLM(enable_prefix_caching=False, num_threads=1, speculative_config={
                   "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 5})}
    programs = {"llama_cpp_plain": ("llama-lookup", ["--spec-draft-n-max", "0"]),
                "llama_cpp_lookup": ("llama-lookup", ["--spec-draft-n-max", k])}
    if draft:
        engines["draft_model"] = LLM(enable_prefix_caching=False, num_threads=1, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": args.k})
        programs["llama_cpp_speculative"] = ("llama-speculative", ["-md", draft, "-td", "1", "-tbd", "1",
                                                                   "--spec-draft-n-max", k])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    flags = cpu_simd_flags()
    lines = []
    for task in args.tasks:
        prompt = task_prompt(engines["plain"], task)
        cells: dict[str, list[dict]] = {name: [] for name in [*programs, *(f"blockserve_{e}" for e in engines)]}
        for _ in range(args.rounds):
            for name, (program, extra) in programs.items():
                cells[name].append(llama_cpp(bin_dir, program, model, prompt, args.max_tokens, extra))
            for name, llm in engines.items():
                before = llm.engine.stats().speculation
                run = blockserve_run(llm, prompt, params)
                after = llm.engine.stats().speculation
                if after is not None:
                    run["drafted"] = after.num_draft_tokens - before.num_draft_tokens
                    run["accepted"] = after.num_accepted_tokens - before.num_accepted_tokens
                cells[f"blockserve_{name}"].append(run)
        rate = {name: statistics.median(c["tok_s"] for c in runs) for name, runs in cells.items()}
        line = {"task": task, "batch": 1, "threads": 1, "max_tokens": args.max_tokens, "k": args.k, "draft": draft,
                "tok_s": {name: round(r, 1) for name, r in rate.items()}, "ratio": {}, "identical": {},
                "acceptance_rate": {}, "tokens": {name: runs[-1]["tokens"] for name, runs in cells.items()}}
        for name, runs in cells.items():
            plain = "llama_cpp_plain" if name.startswith("llama_cpp") else "blockserve_plain"
            if name == plain:
                continue
            line["ratio"][name] = round(rate[name] / rate[plain], 2)
            same = same_greedy_text if name.startswith("llama_cpp") else str.__eq__
            line["identical"][name] = all(same(p["text"], r["text"]) for p, r in zip(cells[plain], runs))
            drafted = sum(r.get("drafted", 0) for r in runs)
            line["acceptance_rate"][name] = round(sum(r["accepted"] for r in runs) / drafted, 2) if drafted else None
        line["others_cpu_share"] = {name: [None if c["others"] is None else round(c["others"], 2) for c in runs]
                                    for name, runs in cells.items()}
        line["cpu_flags"] = flags
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.json is not None:
        args.json.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
