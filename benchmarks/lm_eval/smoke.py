"""lm-eval against a real `blockserve serve` (the bundled SmolLM2), through lm-eval's own
OpenAI-compatible backends, on two local tasks (no download):

    blockserve_smoke_mc   loglikelihood (multiple choice)  local-completions (echo + logprobs, max_tokens 1)
    blockserve_smoke_gen  generate_until                   local-completions, and local-chat-completions
                                                           (the chat template applied by lm-eval)

Then lm-eval's loglikelihoods are checked against the offline API's prompt logprobs for the very
token ids lm-eval sent (to 1e-3): the scores lm-eval reports are the engine's.

    make eval-smoke        (installs the `eval` extra: lm-eval and what it pulls)
    python -m benchmarks.lm_eval.smoke [--json PATH]

Run from the repository root: the task files name their data by relative path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = Path(__file__).resolve().parent
MODEL_NAME = "SmolLM2-135M-Instruct"
SERVE_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, threads: int, log_path: Path) -> subprocess.Popen:
    blockserve = Path(sys.executable).parent / "blockserve"
    command = [str(blockserve)] if blockserve.exists() else [sys.executable, "-m", "blockserve.cli"]
    log = open(log_path, "w")
    process = subprocess.Popen([*command, "serve", "--port", str(port), "--num-threads", str(threads), *SERVE_ARGS],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"blockserve serve exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"blockserve serve not healthy after 180 s:\n{log_path.read_text()}")


def saved_tokenizer(directory: Path) -> str:
    """The bundled model's tokenizer as a Hugging Face directory: lm-eval's huggingface tokenizer
    backend counts context tokens with it (the server has no /tokenizer_info for its remote one)."""
    from transformers import AutoTokenizer

    from blockserve.models.default_model import default_model_path

    path = default_model_path()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(directory)
    return str(directory)


def check_against_offline(lm, samples: list[dict], threads: int) -> float:
    """The largest |lm-eval's loglikelihood - the offline API's| over every scored choice."""
    from blockserve import LLM, SamplingParams

    requests = []
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            requests.append((context_ids, continuation_ids, response[0][0]))
    llm = LLM(max_model_len=1024, kv_cache_memory="64MiB", num_threads=threads)
    outputs = llm.generate([c + k for c, k, _ in requests],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    worst = 0.0
    for (context_ids, continuation_ids, reported), output in zip(requests, outputs):
        ids = output.prompt_token_ids
        offline = sum(output.prompt_logprobs[p][ids[p]].logprob for p in range(len(context_ids), len(ids)))
        worst = max(worst, abs(offline - reported))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    parser.add_argument("--json", type=Path, help="write lm-eval's results (without samples) here")
    args = parser.parse_args()
    os.chdir(ROOT)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # lm-eval's chat backend wants one; this server has no keys

    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="blockserve-lm-eval-") as tmp:
        tokenizer = saved_tokenizer(Path(tmp) / "tokenizer")
        log_path = Path(tmp) / "serve.log"
        started = time.perf_counter()
        server = start_server(port, args.threads, log_path)
        print(f"blockserve serve healthy on port {port} after {time.perf_counter() - started:.1f} s", flush=True)
        try:
            tasks = TaskManager(include_path=str(TASKS_DIR))
            base = f"http://127.0.0.1:{port}/v1"
            completions = get_model("local-completions")(
                model=MODEL_NAME, base_url=f"{base}/completions", tokenizer=tokenizer,
                tokenizer_backend="huggingface", num_concurrent=4, max_retries=1, max_length=1024)
            started = time.perf_counter()
            results = simple_evaluate(model=completions, tasks=["blockserve_smoke_mc", "blockserve_smoke_gen"],
                                      task_manager=tasks, log_samples=True)
            completions_s = time.perf_counter() - started
            print(f"\nlocal-completions ({completions_s:.1f} s)\n{make_table(results)}")
            worst = check_against_offline(completions, results["samples"]["blockserve_smoke_mc"], args.threads)
            print(f"lm-eval's loglikelihoods vs the offline API's prompt logprobs: max |difference| {worst:.2e}")

            chat = get_model("local-chat-completions")(
                model=MODEL_NAME, base_url=f"{base}/chat/completions", num_concurrent=4, max_retries=1)
            started = time.perf_counter()
            chat_results = simple_evaluate(model=chat, tasks=["blockserve_smoke_gen"], task_manager=tasks,
                                           apply_chat_template=True)
            print(f"\nlocal-chat-completions ({time.perf_counter() - started:.1f} s)\n{make_table(chat_results)}")
        finally:
            server.terminate()
            server.wait(timeout=30)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"completions": results["results"], "chat": chat_results["results"],
                                         "max_loglikelihood_difference": worst}, indent=2, default=str))
    mc, gen = results["results"]["blockserve_smoke_mc"], results["results"]["blockserve_smoke_gen"]
    ok = (worst < 1e-3 and all(math.isfinite(v) for k, v in mc.items() if k.startswith("acc") and ",none" in k
                                and not k.endswith("_stderr,none"))
          and "exact_match,last_integer" in gen)
    print("eval-smoke:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
