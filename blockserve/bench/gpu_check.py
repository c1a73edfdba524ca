"""The GPU check: everything a run on a GPU should prove, in one go, written as one JSON and a short
text report under --results:

    environment   torch, triton, CUDA, GPU, driver, transformers
    parity        greedy tokens of a batch of prompts vs transformers on the same device, for tiny random
                  Llama, Gemma 3, DeepSeek-V3, Qwen3-Next and Kimi Linear models built here, per attention
                  backend, with prefix caching on and off, chunked prefill and preemption (the rule below)
    poison        C1 per attention backend: with poison on, epochs through a recycling cache pass the rule
                  under the derived zero flags; with zeroing forced off, a backend that declares
                  reads_unwritten_slots must fail it and one that does not must still pass
    attention     one attention layer's decode step per backend at batch x context 1x4096, 16x4096, 64x1024
                  and 256x1024 (Llama-1B heads, blocks of 16): microseconds and KV bytes read per second,
                  the kernels' own comparison (throughput's short contexts leave attention a small share)
    throughput    decode tok/s of a ~1B Llama-shaped random model at batch 1/16/64/256 vs transformers
                  `generate` (static batch) in the same run and vs the HBM bound (weight bytes per step
                  / measured device copy bandwidth), flex and triton with CUDA graphs for decode (one step
                  at a time, and with async scheduling), then every backend without: the measurement that
                  picks the GPU's attention backend and whether async scheduling becomes CUDA's default;
                  and per variant the median step split into the host's work and its wait for the device

On CUDA each backend's sections run in a process of their own, after one that measures
throughput's baseline (the model, the HBM bound, transformers): a CUDA fault (an illegal address, a
device-side assert) is sticky, so in one process the first backend's fault would fail every later
section. A part that dies or overruns its share of the budget is named in the report.

The parity rule. The truth is transformers in float32 on the same device. In float32 (CPU) our greedy
tokens must equal its tokens exactly. In bfloat16 greedy tokens cannot be compared one by one: these
tiny models' logits are far from uniform, and bfloat16 (~3 significant digits) moves them enough that
transformers' own bfloat16 greedy tokens leave its float32 ones at gaps of up to ~3 nats (measured on
the CPU for DeepSeek-V3 and Kimi Linear), so any near-tie threshold fails a correct engine. Instead each
generated token is scored by the float32 model on the sequence generated so far: its regret is the
float32 log-probability of the best token minus that of the token chosen (0 for the float32 greedy
choice). Our mean regret over the batch (8 prompts x 12 tokens) may exceed that of transformers' own
bfloat16 greedy tokens by at most 0.25 nats: on the CPU, over every family, backend and scenario, the
excess ran from -0.04 to +0.08 (a few tokens with regrets of 1-4 nats move the mean by ~0.03 each;
results/gpu_check_parity_cpu_bf16.json), while a broken path costs over a nat per token (NaN reads
with zeroing off: 3.1 against transformers' 0.008, results/gpu_check_poison_cpu_bf16.json).

    bash benchmarks/gpu_check.sh                      # on a machine with an NVIDIA GPU (~8 minutes on an H200)
    blockserve bench gpu-check --device cpu --smoke   # tiny shapes, seconds (tests/benchmark/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from blockserve.bench.tiny_families import (
    deepseek_v3,
    greedy_difference,
    kimi_linear,
    qwen3_next,
    reference_outputs,
)
from blockserve import LLM, SamplingParams
from blockserve.attention.metadata import AttentionMetadata, BatchLayout, to_device
from blockserve.models.random_checkpoint import save_random_hybrid, save_random_model
from blockserve.attention.paged_attention import BACKENDS
from blockserve.attention.triton_paged import interpreting as triton_interpreting
from blockserve.engine.config import EngineConfig
from blockserve.worker.sampler import SampledTokens

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
FAMILIES = {
    "llama": lambda: (save_random_model, LlamaConfig(**TINY)),
    "gemma3": lambda: (save_random_model, Gemma3TextConfig(**{**TINY, "num_hidden_layers": 4}, head_dim=16,
                                                           query_pre_attn_scalar=16, sliding_window=10,
                                                           layer_types=["sliding_attention", "sliding_attention",
                                                                        "full_attention", "sliding_attention"])),
    "deepseek_v3": lambda: (save_random_hybrid, deepseek_v3()),
    "qwen3_next": lambda: (save_random_model, qwen3_next()),
    "kimi_linear": lambda: (save_random_hybrid, kimi_linear()),
}
# Blocks of 16 tokens (FlexAttention's smallest CUDA tile). "preemption" runs in a cache that holds
# one request but not the batch (`small_cache`).
SCENARIOS = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=24),
    "preemption": dict(max_num_batched_tokens=32, max_model_len=96, max_num_seqs=8),
}
BILLION = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)  # 1.17e9 parameters
REGRET_MARGIN_NATS = 0.25  # the parity rule's bfloat16 allowance (module docstring)
PARITY_SHARE = 0.5  # of the time budget, for poison and parity together
ATTENTION_SHARE = 0.1  # then for the attention kernels' timings


def add_parser(sub) -> None:
    """`blockserve bench gpu-check`."""
    parser = sub.add_parser("gpu-check", help="the GPU check: parity, C1 per backend, kernels, throughput",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=command)


def main() -> None:
    """`python -m blockserve.bench.gpu_check` (how the check starts its parts)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(command(parser.parse_args()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts: seconds, for tests")
    parser.add_argument("--results", default="results/gpu_check", help="where gpu_check.json and .txt go")
    parser.add_argument("--budget-s", type=float, default=450.0, help="sections start only within this time")
    parser.add_argument("--sections", type=_names, default=SECTIONS, help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--backends", type=_names, help="comma-separated attention backends (default: the GPU's)")
    parser.add_argument("--families", type=_names, help=f"comma-separated parity families, of {','.join(FAMILIES)}")
    parser.add_argument("--isolate", action="store_true", help="each backend in a process of its own (CUDA's default)")
    parser.add_argument("--in-process", action="store_true", help="everything in this process (the CPU's default)")
    parser.add_argument("--baseline", help=argparse.SUPPRESS)  # a part's: the baseline another process measured
    parser.add_argument("--baseline-only", help=argparse.SUPPRESS)  # a part's: measure the baseline into this folder
    parser.add_argument("--references", type=Path, help=argparse.SUPPRESS)  # a part's: the parts' shared references


def command(args: argparse.Namespace) -> int:
    """Run the check as `args` say; 0 when it passes, 1 when it does not."""
    dtype = _dtype(args.device)
    if args.baseline_only:
        folder = Path(args.baseline_only)
        folder.mkdir(parents=True, exist_ok=True)
        baseline = throughput_baseline(args.device, dtype, args.smoke, time.perf_counter() + args.budget_s, folder)
        (folder / "baseline.json").write_text(json.dumps(baseline))
        return 0
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)

    def write(report: dict) -> None:  # after every section, so a run cut short still leaves its results
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (out / "gpu_check.txt").write_text(summary(report))

    isolate = args.isolate or (args.device != "cpu" and not args.in_process)
    if isolate:
        (out / "parts.log").unlink(missing_ok=True)
        report = run_isolated(args.device, args.smoke, args.budget_s, write, args.sections, args.backends,
                              args.families, out / "parts.log")
    else:
        report = run(args.device, args.smoke, args.budget_s, write, args.sections, args.backends, args.families,
                     args.baseline, args.references)
    print(summary(report))
    return 0 if report["ok"] else 1


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


SECTIONS = ("poison", "parity", "attention", "throughput")


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def _header(device: str, smoke: bool) -> dict:
    return {"environment": environment(device), "device": device, "dtype": str(_dtype(device)).removeprefix("torch."),
            "smoke": smoke, "parity_rule": __doc__.split("The parity rule. ")[1].split("\n\n")[0]}


def run(device: str, smoke: bool, budget_s: float, write=lambda report: None, only=SECTIONS, names=None,
        families=None, baseline_dir=None, references: Path | None = None) -> dict:
    """The check's sections in `only` (default all; a rerun after a fix may take fewer), over the attention
    backends in `names` (default GPU_BACKENDS) and the parity families in `families` (default all), in
    this process: every section's results, and `ok` (parity and poison passed where run); `write` gets
    the report so far after each section. `baseline_dir`: throughput's baseline, measured elsewhere;
    `references`: the parity references' folder, shared with other processes."""
    start = time.perf_counter()
    dtype = _dtype(device)
    report = _header(device, smoke)
    parity_until = start + PARITY_SHARE * budget_s  # parity's runs stop there; poison and throughput follow
    sections = [("poison", lambda: poison(device, dtype, smoke, names, references)),
                ("parity", lambda: parity(device, dtype, smoke, parity_until, names, families, references)),
                ("attention", lambda: attention_kernels(device, dtype, smoke,
                                                        parity_until + ATTENTION_SHARE * budget_s, names)),
                ("throughput", lambda: throughput(device, dtype, smoke, start + budget_s, names, baseline_dir))]
    for name, section in [(name, section) for name, section in sections if name in only]:
        if time.perf_counter() - start > budget_s:
            report[name] = {"skipped": f"over the {budget_s:.0f} s budget"}
            continue
        began = time.perf_counter()
        try:
            report[name] = section()
        except Exception as error:  # one broken section must not hide the others' results
            report[name] = failure(error)
        report[name + "_s"] = round(time.perf_counter() - began, 1)
        _finish(report, start)
        write(report)
    _finish(report, start)
    write(report)
    return report


ISOLATED_ORDER = ("triton", "flex", "exact", "whole_block")  # the likeliest to work, and quickest to compile, first
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # a part imports this copy of blockserve
UNIT_GRACE_S = 60.0  # a part may overrun its share by this much (a compile, a capture) before it is stopped


def run_isolated(device: str, smoke: bool, budget_s: float, write=lambda report: None, only=SECTIONS, names=None,
                 families=None, logs: Path | None = None) -> dict:
    """run(), each part in a process of its own, as on a GPU: a CUDA fault (an illegal address, a
    device-side assert) is sticky and fails every later call in its process, so one backend's fault must
    not cost the others' results. The throughput
    baseline goes first, then each backend's sections, each part given the budget left in proportion to
    its sections. A part that dies or overruns keeps what it wrote and is named under its sections'
    `failed_units`; every part's exit is in `units`, and the end of its output goes to `logs`. The parts
    share the parity references: transformers' outputs are computed once."""
    start = time.perf_counter()
    report = {**_header(device, smoke), "units": {}}
    main_names = backends(device, smoke, names)
    poison_names = poison_backends(device, smoke, names)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        baseline = work / "baseline"
        (work / "references").mkdir()
        if "throughput" in only:
            report["units"]["baseline"] = _part(device, smoke, ["--baseline-only", str(baseline), "--budget-s",
                                                                str(budget_s / 4)], budget_s / 4 + UNIT_GRACE_S,
                                                work / "baseline.log", logs)
            if (baseline / "baseline.json").exists():
                report["throughput"] = {**load_baseline(baseline), "errors": {}}
            else:
                report["throughput"] = {"error": "the baseline failed", **report["units"]["baseline"]}
        order = sorted(set(main_names) | (set(poison_names) if "poison" in only else set()),
                       key=lambda b: ISOLATED_ORDER.index(b) if b in ISOLATED_ORDER else len(ISOLATED_ORDER))
        plan = [(b, [s for s in only if (b in poison_names if s == "poison" else b in main_names)
                     and (s != "throughput" or (baseline / "baseline.json").exists())]) for b in order]
        plan = [(b, sections) for b, sections in plan if sections]
        for i, (backend, sections) in enumerate(plan):
            left = budget_s - (time.perf_counter() - start)
            share = max(0.0, left) * len(sections) / sum(len(s) for _, s in plan[i:])
            if share < 1:  # the earlier parts overran: this one's sections are skipped, as in-process runs skip
                for name in sections:
                    report.setdefault(name, {}).setdefault("skipped", []).append(f"{backend} (no time left)")
                continue
            args = ["--budget-s", f"{share:.1f}", "--sections", ",".join(sections), "--backends", backend,
                    "--results", str(work / backend), "--in-process", "--references", str(work / "references")]
            args += ["--families", ",".join(families)] if families else []
            args += ["--baseline", str(baseline)] if "throughput" in sections else []
            grace = UNIT_GRACE_S if i < len(plan) - 1 else UNIT_GRACE_S / 3  # the last ends inside the wrapper's stop
            outcome = report["units"][backend] = _part(device, smoke, args, share + grace, work / f"{backend}.log",
                                                       logs)
            written = work / backend / "gpu_check.json"
            merge(report, json.loads(written.read_text()) if written.exists() else {}, backend, sections, outcome)
            _finish_merged(report, start)
            write(report)
    _finish_merged(report, start)
    write(report)
    return report


LOG_TAIL_CHARS = 20000  # of each part's output, appended to the run's log of parts


def _part(device: str, smoke: bool, args: list[str], timeout_s: float, log: Path, logs: Path | None = None) -> dict:
    """Run this script in a process (and session) of its own with `args`, its output to `log` (and its
    end appended to `logs`); how it ended: seconds, exit code ("timeout": stopped, with whatever it
    started), the log's tail unless it exited normally (0, or 1 for a failed check)."""
    command = [sys.executable, "-m", "blockserve.bench.gpu_check", "--device", device, *(["--smoke"] if smoke else []),
               *args]
    began = time.perf_counter()
    with open(log, "w") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (PACKAGE_PARENT, os.environ.get("PYTHONPATH"))))}
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its compile workers too
            child.wait()
            rc = "timeout"
    outcome = {"s": round(time.perf_counter() - began, 1), "rc": rc}
    output = log.read_text(errors="replace")
    if logs is not None:
        with open(logs, "a") as out:
            out.write(f"=== part {' '.join(args)}: exit {rc} after {outcome['s']} s\n")
            out.write(output[-LOG_TAIL_CHARS:] + "\n")
    if rc not in (0, 1):
        outcome["log_tail"] = output[-1500:]
        print(f"part {args} ended {rc}:\n{outcome['log_tail']}", flush=True)
    return outcome


def merge(report: dict, part: dict, backend: str, sections: list[str], outcome: dict) -> None:
    """One backend's part report into `report`, section by section; a section the part did not finish
    (its process died, or the section raised) is named under that section's `failed_units`, one it did
    not start for time under `skipped`."""
    for name in sections:
        got = part.get(name)
        into = report.setdefault(name, {})
        if got is not None and isinstance(got.get("skipped"), str):  # not started: the part's budget was spent
            into.setdefault("skipped", []).append(f"{backend} ({got['skipped']})")
        elif got is None or "error" in got:
            into.setdefault("failed_units", {})[backend] = got if got is not None else outcome
        elif name == "poison":
            into.setdefault("backends", {}).update(got["backends"])
        elif name == "parity":
            into.setdefault("runs", {}).update(got["runs"])
            into.setdefault("skipped", []).extend(got["skipped"])
        elif name == "attention":
            into.update(heads=got["heads"], block_size=got["block_size"])
            into.setdefault("kernels", {}).update(got["kernels"])
            into.setdefault("flex_masks", {}).update(got["flex_masks"])
            into.setdefault("skipped", []).extend(got["skipped"])
        else:  # throughput: this backend's rates into the baseline's rows
            for b, row in got["batches"].items():
                into["batches"][int(b)].update({k: v for k, v in row.items() if k.startswith("blockserve_")})
            into["errors"].update(got["errors"])
            into["skipped"].extend(k for k in got["skipped"] if k not in into["skipped"])


def _finish_merged(report: dict, start: float) -> None:
    for name, key in (("poison", "backends"), ("parity", "runs")):
        if name in report:
            section = report[name]
            section["ok"] = (bool(section.get(key)) and all(r["ok"] for r in section.get(key, {}).values())
                             and not section.get("failed_units"))
    if "batches" in report.get("throughput", {}):
        report["throughput"]["fastest"] = fastest(report["throughput"]["batches"])
        report["throughput"]["goals"] = goals(report["throughput"]["batches"])
    _finish(report, start)


def _finish(report: dict, start: float) -> None:
    report["total_s"] = round(time.perf_counter() - start, 1)
    report["ok"] = all(isinstance(report[k], dict) and report[k].get("ok") for k in ("parity", "poison") if k in report)


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": __import__("transformers").__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            env["driver"] = f"nvidia-smi failed: {error}"
    return env


def prompts(count: int) -> list[list[int]]:
    """`count` prompts of 3 to 62 tokens; a third share a 20-token prefix (prefix hits mid-block)."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 512, (20,), generator=gen).tolist()
    out = []
    for i in range(count):
        tail = torch.randint(0, 512, (3 + (i * 11) % 40,), generator=gen).tolist()
        out.append(shared + tail if i % 3 == 2 else tail)
    return out


def save_family(family: str, path: Path, device: str):
    """Save family's tiny random model to `path`; its transformers model on `device`, in float32."""
    save, config = FAMILIES[family]()
    return save(config, path).to(device=device, dtype=torch.float32)


@dataclass
class Reference:
    """What a batch's greedy tokens are judged against (the parity rule, module docstring): the float32
    transformers model, its greedy outputs, and in bfloat16 the mean regret of transformers' own bfloat16
    greedy tokens."""

    model: torch.nn.Module
    prompts: list[list[int]]
    outputs: list  # reference_outputs of the float32 model
    low_precision_regret: float | None = None

    @staticmethod
    def build(family: str, path: Path, device: str, dtype: torch.dtype, batch: list[list[int]],
              new_tokens: int, cache: Path | None = None) -> Reference:
        """The family's model saved to `path` and judged on `batch`; with `cache`, a folder the parts of an
        isolated run share, the outputs and regret another part computed for these very weights (their
        digest is in the key), or computed here and left there for the next."""
        model = save_family(family, path, device)
        key = hashlib.sha256(repr((str(device), str(dtype), batch, new_tokens)).encode())
        for weight in model.state_dict().values():
            key.update(weight.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        cached = None if cache is None else cache / f"{family}-{key.hexdigest()[:16]}.pt"
        if cached is not None and cached.exists():
            saved = torch.load(cached)
            return Reference(model, batch, saved["outputs"], saved["low_precision_regret"])
        outputs = reference_outputs(_on_device(model, device), batch, new_tokens)
        reference = Reference(model, batch, outputs)
        if dtype != torch.float32:
            low = copy.deepcopy(model).to(dtype)
            low_tokens = [tokens for tokens, _ in reference_outputs(_on_device(low, device), batch, new_tokens)]
            del low
            reference.low_precision_regret = reference.mean_regret(low_tokens)
        if cached is not None:
            partial = cached.with_suffix(".partial")
            torch.save({"outputs": outputs, "low_precision_regret": reference.low_precision_regret}, partial)
            partial.replace(cached)  # whole or absent, should the part die here
        return reference

    @torch.no_grad()
    def mean_regret(self, outputs: list[list[int]]) -> float:
        """Mean over the generated tokens of the float32 model's log-probability of its best token minus
        that of the token generated, each scored on the sequence generated before it."""
        device = next(self.model.parameters()).device
        regrets = []
        for prompt, tokens in zip(self.prompts, outputs):
            logits = self.model(torch.tensor([prompt + tokens], device=device)).logits[0].float()
            logprobs = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)
            chosen = logprobs.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
            regrets.append(logprobs.max(-1).values - chosen)
        return torch.cat(regrets).mean().item()


GPU_BACKENDS = ("exact", "flex", "triton")  # whole_block imitates a tile-reading kernel on the CPU: poison only
PARITY_GRAPH_SIZES = (1, 2, 4, 8)  # the parity and poison batches' decode sizes (8 prompts)


def backends(device: str, smoke: bool, names=None) -> list[str]:
    """Which of `names` (default GPU_BACKENDS) parity, poison and throughput run: on CPU smoke the default
    one (flex is eager there); on the CPU triton only in Triton's interpreter (TRITON_INTERPRET=1, as the
    tests run)."""
    names = GPU_BACKENDS if names is None else names
    if device == "cpu":
        return ["exact"] if smoke else [name for name in names if name != "triton" or triton_interpreting()]
    return list(names)


def engine(model, device: str, dtype: torch.dtype, **options) -> LLM:
    """An engine on `device`; on CUDA with a backend that captures decode steps (flex, triton) they replay
    CUDA graphs (captured at the parity batches' sizes unless `options` say otherwise), as a GPU user
    gets by default."""
    budget = {} if "gpu_memory_utilization" in options else {"kv_cache_memory": "64MiB"}  # tiny models' few blocks
    backend = BACKENDS[options.get("attention_backend", EngineConfig.attention_backend)]
    if device != "cpu" and backend.captures_decode and not options.get("enforce_eager"):
        options.setdefault("cuda_graph_sizes", PARITY_GRAPH_SIZES)
    return LLM(model, device=device, dtype=str(dtype).removeprefix("torch."),
               **{"block_size": 16, "check_integrity": True, **budget, **options})


def small_cache(model: str, device: str, dtype: torch.dtype, **options) -> dict:
    """Engine options for a KV cache whose attention groups hold one request of max_model_len tokens (and a block
    to spare), so a batch must preempt; state groups get the slot per running request (and the null slot) that the
    engine reserves. A probe engine gives the bytes per block of each group (a state group: per slot)."""
    with engine(model, device, dtype, **options) as probe:
        groups = probe.engine.kv_cache_config.groups
    per_request = -(-options["max_model_len"] // 16)
    state_slots = options.get("max_num_seqs", EngineConfig.max_num_seqs) + 1  # kv/capacity.py's reservation
    return {"kv_cache_memory": sum(g.spec.page_size_bytes * len(g.layer_names) *
                                   (state_slots if g.is_state else per_request + 2) for g in groups)}


def greedy(llm: LLM, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=new_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def judge(got: list[list[int]], reference: Reference) -> dict:
    """The parity rule (module docstring) as a verdict, not an assertion."""
    if reference.low_precision_regret is None:  # float32: the same tokens
        difference = greedy_difference(got, reference.outputs)
        return {"ok": True} if difference is None else {"ok": False, "failure": difference[:600]}
    regret = reference.mean_regret(got)
    return {"ok": regret <= reference.low_precision_regret + REGRET_MARGIN_NATS, "mean_regret": round(regret, 4),
            "transformers_low_precision_regret": round(reference.low_precision_regret, 4)}


def parity(device: str, dtype: torch.dtype, smoke: bool, until: float, names=None, families=None,
           references: Path | None = None) -> dict:
    """Greedy parity per family, backend and scenario, scenario by scenario (so a short budget still
    covers every family and backend once); runs not started by `until` (perf_counter) are listed as
    skipped. `references`: a folder of references shared between processes (Reference.build)."""
    batch, new_tokens = prompts(8), 10 if smoke else 12
    families = ["gemma3"] if smoke else list(families or FAMILIES)  # smoke: the sliding + full model
    scenarios = ["prefix-caching", "preemption"] if smoke else list(SCENARIOS)
    results, skipped = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        judged = {family: Reference.build(family, Path(tmp) / family, device, dtype, batch, new_tokens, references)
                  for family in families}
        for scenario in scenarios:
            for family, reference in judged.items():
                path = Path(tmp) / family
                for backend in backends(device, smoke, names):
                    key = f"{family}/{backend}/{scenario}"
                    if time.perf_counter() > until:
                        skipped.append(key)
                        continue
                    options = dict(SCENARIOS[scenario], attention_backend=backend)
                    try:
                        if scenario == "preemption":
                            options.update(small_cache(str(path), device, dtype, **options))
                        with engine(str(path), device, dtype, **options) as llm:
                            runs = 2 if scenario == "prefix-caching" else 1  # the second from the cache
                            verdicts = [judge(greedy(llm, batch, new_tokens), reference) for _ in range(runs)]
                            result = {"ok": all(v["ok"] for v in verdicts), "passes": verdicts,
                                      "cuda_graph_sizes": llm.engine.cuda_graph_sizes}
                            if scenario == "preemption":
                                result["preemptions"] = llm.engine.stats().num_preemptions
                                result["ok"] &= result["preemptions"] > 0
                    except Exception as error:
                        result = {"ok": False, **failure(error)}
                    results[key] = result
    return {"ok": all(r["ok"] for r in results.values()), "runs": results, "skipped": skipped}


def failure(error: Exception) -> dict:
    """An exception as a result: its message and the innermost frames of where it was raised (all a
    GPU run leaves to debug from once the machine is given back)."""
    return {"error": f"{type(error).__name__}: {error}"[:600],
            "where": "".join(traceback.format_exception(error, limit=-8))[-2000:]}


class _on_device:
    """transformers' generate with input ids moved to the model's device (reference_outputs builds them on
    the CPU); logits come back on the CPU."""

    def __init__(self, model, device: str):
        self.model, self.device = model, device

    def generate(self, input_ids, attention_mask, **kwargs):
        out = self.model.generate(input_ids.to(self.device), attention_mask=attention_mask.to(self.device), **kwargs)
        out.sequences = out.sequences.cpu()
        out.logits = tuple(step.float().cpu() for step in out.logits)
        return out


def poison_backends(device: str, smoke: bool, names=None) -> list[str]:
    """The poison section's backends: of `names` (default every one, whole_block's tile-reading
    imitation included) those `backends` runs; on CPU smoke exact and whole_block."""
    return ["exact", "whole_block"] if smoke else backends(device, False, sorted(names or BACKENDS))


def poison(device: str, dtype: torch.dtype, smoke: bool, names=None, references: Path | None = None) -> dict:
    """C1 per backend on tiny Gemma 3 (sliding + full groups): see the module docstring. `references`: as
    parity's."""
    batch, new_tokens = prompts(8), 10
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemma3"
        reference = Reference.build("gemma3", path, device, dtype, batch, new_tokens, references)
        for backend in poison_backends(device, smoke, names):
            small = dict(max_num_batched_tokens=32, max_model_len=96, enable_prefix_caching=True,
                         attention_backend=backend, poison=True)
            try:
                small.update(small_cache(str(path), device, dtype, **small))
                with engine(str(path), device, dtype, **small) as llm:
                    flags = [g.zero_new_blocks for g in llm.engine.kv_cache_config.groups]
                    epochs = [greedy(llm, batch, new_tokens) for _ in range(2)]
                    recycled = llm.engine.stats().num_preemptions
                    graph_sizes = llm.engine.cuda_graph_sizes
                with engine(str(path), device, dtype, unsafe_disable_zeroing=True, **small) as llm:
                    unzeroed = greedy(llm, batch, new_tokens)
                reads = BACKENDS[backend].reads_unwritten_slots
                zeroed, unzeroed = judge(epochs[0], reference), judge(unzeroed, reference)
                zeroed_ok, unzeroed_matches = epochs[0] == epochs[1] and zeroed["ok"], unzeroed["ok"]
                results[backend] = {
                    "reads_unwritten_slots": reads, "zero_flags": flags, "preemptions": recycled,
                    "cuda_graph_sizes": graph_sizes, "verdicts": {"zeroed": zeroed, "zeroing_off": unzeroed},
                    "derived_flags_match": zeroed_ok, "zeroing_off_matches": unzeroed_matches,
                    "ok": zeroed_ok and flags == [reads] * len(flags) and unzeroed_matches != reads and recycled > 0}
            except Exception as error:
                results[backend] = {"ok": False, **failure(error)}
    return {"ok": all(r["ok"] for r in results.values()), "backends": results}


LLAMA_1B_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=64)


def attention_kernels(device: str, dtype: torch.dtype, smoke: bool, until: float, names=None) -> dict:
    """Per backend and (batch, context): one attention layer's decode step, microseconds (median of
    repeats, the step's metadata reused as by every layer after the first) and the K/V bytes it reads
    per second. A measurement not started by `until` (perf_counter) is named in "skipped"."""
    shapes = [(2, 40)] if smoke else [(1, 4096), (16, 4096), (64, 1024), (256, 1024)]
    heads, block_size = LLAMA_1B_HEADS, 16
    hq, hkv, d = heads["num_heads"], heads["num_kv_heads"], heads["head_dim"]
    gen = torch.Generator().manual_seed(0)
    results, skipped = {}, []
    for batch, context in shapes:
        pages = batch * -(-context // block_size)
        k_cache = torch.randn(pages + 1, block_size, hkv, d, generator=gen).to(device, dtype)
        v_cache = torch.randn(pages + 1, block_size, hkv, d, generator=gen).to(device, dtype)
        table = (torch.randperm(pages, generator=gen) + 1).view(batch, -1)
        host = AttentionMetadata.build(BatchLayout.build([1] * batch, [context - 1] * batch), table, block_size)
        q, k, v = (torch.randn(batch, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
        kv_bytes = 2 * batch * context * hkv * d * k_cache.element_size()
        for backend in backends(device, smoke, names):
            key = f"{backend}/{batch}x{context}"
            if time.perf_counter() > until:
                skipped.append(key)
                continue
            try:
                layer = BACKENDS[backend](d ** -0.5)
                meta = host.with_tensors(*to_device(host.tensors(), torch.device(device)))
                step_s = _median_s(lambda: layer.forward(q, k, v, k_cache, v_cache, meta), 3 if smoke else 23)
                results[key] = {"us": round(step_s * 1e6, 1), "kv_gb_s": round(kv_bytes / step_s / 1e9, 1)}
            except Exception as error:
                results[key] = failure(error)
        del k_cache, v_cache
        _empty_cache(device)
    flex = "flex" in backends(device, smoke, names)
    masks = flex_masks(device, smoke, shapes, block_size, until, skipped) if flex else {}
    return {"heads": heads, "block_size": block_size, "kernels": results, "flex_masks": masks, "skipped": skipped}


MASK_PAGES = 250_000  # about the pages of 16 tokens the 1B model's KV cache has on an H200
MASK_CHUNK = (2048, 32768)  # a prefill chunk's tokens and the context it ends at
MASK_GRAPH_WIDTH = 8192  # a captured graph's table columns at 128k tokens (Llama 3's) and block size 16


def flex_masks(device: str, smoke: bool, shapes, block_size: int, until: float, skipped: list) -> dict:
    """flex's block mask of one step (flex_attention.step_mask over a cache of MASK_PAGES pages),
    microseconds: as eager steps build it per (batch, context) decode shape and for MASK_CHUNK, and as a
    captured step does (its tables MASK_GRAPH_WIDTH columns wide, whatever the contexts; timed eagerly)
    for the largest decode shape. What flex adds to each step per attention group, before its layers."""
    from blockserve.attention.flex_attention import step_mask

    cols = lambda context: -(-context // block_size)  # noqa: E731
    cases = {f"{b}x{c}": (b, 0, c, cols(c), False) for b, c in shapes}
    if not smoke:
        tokens, context = MASK_CHUNK
        cases[f"chunk{tokens}x{context}"] = (0, tokens, context, cols(context), False)
        batch, context = max(shapes)
        cases[f"captured{batch}x{context}@{MASK_GRAPH_WIDTH}"] = (batch, 0, context, MASK_GRAPH_WIDTH, True)
    results = {}
    for key, (batch, tokens, context, width, captured) in cases.items():
        if time.perf_counter() > until:
            skipped.append(f"flex_mask/{key}")
            continue
        try:
            host = step_metadata(batch, context - tokens - (batch > 0), tokens, width, MASK_PAGES, block_size, captured)
            meta = host.with_tensors(*to_device(host.tensors(), torch.device(device)))
            build = lambda: step_mask(meta, MASK_PAGES, torch.device(device), compact=False)  # noqa: E731
            results[key] = {"us": round(_median_s(build, 3 if smoke else 13) * 1e6, 1)}
        except Exception as error:
            results[key] = failure(error)
    return results


def step_metadata(batch: int, context: int, prefill: int, width: int, num_pages: int, bs: int,
                  captured: bool) -> AttentionMetadata:
    """`batch` decodes at `context` tokens, then one `prefill`-token chunk after `context` tokens, each on
    distinct random pages of a cache of `num_pages`; tables `width` columns wide, null-padded."""
    query_lens = [1] * batch + ([prefill] if prefill else [])
    computed = [context] * len(query_lens)
    needs = [-(-(c + q) // bs) for c, q in zip(computed, query_lens)]
    if max(needs) > width or sum(needs) >= num_pages:
        raise ValueError(f"width {width} must hold {max(needs)} columns and num_pages {num_pages} "
                         f"more than the {sum(needs)} pages in use")
    pages = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0))[:sum(needs)] + 1).tolist()
    table = torch.zeros(len(needs), width, dtype=torch.int64)
    start = 0
    for row, n in enumerate(needs):
        table[row, :n] = torch.tensor(pages[start:start + n])
        start += n
    meta = AttentionMetadata.build(BatchLayout.build(query_lens, computed), table, bs)
    meta.static_shapes = captured
    return meta


def throughput(device: str, dtype: torch.dtype, smoke: bool, until: float, names=None, baseline_dir=None) -> dict:
    """Decode tok/s per batch size: blockserve (each backend) and transformers, both as
    B * (N - 1) / (time for N tokens - time for 1 token), and the HBM bound. A measurement not
    started by `until` (perf_counter) is left out and named in "skipped". `baseline_dir`: where another
    process saved the model and measured the baseline (`throughput_baseline`); None: measured here."""
    if baseline_dir is not None:
        return throughput_variants(load_baseline(baseline_dir), baseline_dir, device, dtype, smoke, until, names)
    with tempfile.TemporaryDirectory() as tmp:
        baseline = throughput_baseline(device, dtype, smoke, until, tmp)
        return throughput_variants(baseline, tmp, device, dtype, smoke, until, names)


def throughput_baseline(device: str, dtype: torch.dtype, smoke: bool, until: float, model_dir) -> dict:
    """The ~1B Llama-shaped random model saved to `model_dir`, the HBM bound and transformers' decode
    tok/s per batch size: what every backend's rates are compared with."""
    batches, prompt_len, new_tokens = ([1, 4], 8, 4) if smoke else ([1, 16, 64, 256], 32, 65)
    shape = TINY if smoke else BILLION
    gen = torch.Generator().manual_seed(0)
    results = {"model": shape, "prompt_tokens": prompt_len, "new_tokens": new_tokens}
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds for 1e9 parameters on a GPU
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype).eval()
    model.save_pretrained(model_dir)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, smoke)
    step_s = weight_bytes / bandwidth
    results.update(weight_bytes=weight_bytes, copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
                   hbm_bound_step_ms=round(step_s * 1e3, 3))
    rows = results["batches"] = {}
    skipped = results["skipped"] = []
    for b in batches:
        rows[b] = {"hbm_bound_tok_s": round(b / step_s, 1)}
        if time.perf_counter() > until:
            skipped.append(f"transformers batch {b}")
            continue
        ids = torch.randint(0, shape["vocab_size"], (b, prompt_len), generator=gen)
        hf = functools.partial(_hf_generate, model, ids.to(device))
        hf(2)  # warm-up
        rows[b]["transformers_tok_s"] = _rate(hf, b, new_tokens)
    del model
    _empty_cache(device)
    return results


def load_baseline(model_dir) -> dict:
    """The baseline another process wrote to `model_dir`/baseline.json (batch sizes back to ints)."""
    results = json.loads((Path(model_dir) / "baseline.json").read_text())
    results["batches"] = {int(b): row for b, row in results["batches"].items()}
    return results


def throughput_variants(results: dict, model_dir, device: str, dtype: torch.dtype, smoke: bool, until: float,
                        names=None) -> dict:
    """`results` (a baseline) with blockserve's rates per engine variant added to its batches, the
    variants' failures under "errors" and the fastest variant per batch size."""
    rows, batches = results["batches"], list(results["batches"])
    errors = results["errors"] = {}
    gen = torch.Generator().manual_seed(1)
    for label, options in engine_variants(device, smoke, batches, names).items():
        try:
            _engine_rates(rows, model_dir, device, dtype, label, options, batches, results["prompt_tokens"],
                          results["new_tokens"], until, results["skipped"], gen)
        except Exception as error:  # one variant's failure leaves the others' figures
            errors[label] = failure(error)
    results["fastest"] = fastest(rows)
    results["goals"] = goals(rows)
    return results


def fastest(rows: dict) -> dict:
    """Per batch size, the blockserve variant of the highest tok/s."""
    return {b: max(rates, key=rates.get) for b, row in rows.items()
            if (rates := {k.removeprefix("blockserve_").removesuffix("_tok_s"): v for k, v in row.items()
                          if k.startswith("blockserve_") and k.endswith("_tok_s")})}


def goals(rows: dict) -> dict:
    """The throughput goals against the best variant measured (None where nothing was): decode at
    the largest batch at >= 50% of the HBM bound; batch 1 with CUDA graphs within 1.5x of the bound's
    step (a rate >= 1/1.5 of its); transformers beaten >= 3x at every batch above 1."""
    def best(row: dict, suffix: str, graphs_only: bool = False):
        values = [(v, k.removeprefix("blockserve_").removesuffix(suffix)) for k, v in row.items()
                  if k.startswith("blockserve_") and k.endswith(suffix) and (not graphs_only or "_cuda_graphs" in k)]
        return max(values, default=None)

    def verdict(found, bound: float) -> dict | None:
        return None if found is None else {"value": found[0], "variant": found[1], "met": found[0] >= bound}

    largest = max(rows, default=None)
    batched = [verdict(best(row, "_vs_transformers"), 3.0) for b, row in rows.items() if b > 1]
    at_largest = None if largest is None else verdict(best(rows[largest], "_vs_hbm_bound"), 0.5)
    return {"largest_batch_vs_hbm_bound>=0.5": None if at_largest is None else {"batch": largest, **at_largest},
            "batch_1_graphs_vs_hbm_bound>=0.667": verdict(best(rows[1], "_vs_hbm_bound", graphs_only=True), 1 / 1.5)
            if 1 in rows else None,
            "vs_transformers>=3_at_every_batch>1": None if not batched or None in batched else
            {"met": all(v["met"] for v in batched), "lowest": min(v["value"] for v in batched)}}


def engine_variants(device: str, smoke: bool, batches: list[int], names=None) -> dict[str, dict]:
    """label -> engine options of the throughput runs: on CUDA each backend that captures decode steps
    with CUDA graphs (at the measured batch sizes) first, one step at a time and with async scheduling,
    then each backend eager (exact's decode cannot be captured)."""
    variants = {}
    if device != "cpu":
        for backend in backends(device, smoke, names):
            if BACKENDS[backend].captures_decode:
                graphs = dict(attention_backend=backend, cuda_graph_sizes=tuple(batches))
                variants[f"{backend}_cuda_graphs"] = graphs
                variants[f"{backend}_cuda_graphs_async"] = dict(graphs, async_scheduling=True)
    for backend in backends(device, smoke, names):
        variants[backend if device == "cpu" else f"{backend}_eager"] = dict(attention_backend=backend,
                                                                          enforce_eager=device != "cpu")
    return variants


def _engine_rates(rows, model_dir, device, dtype, label, options, batches, prompt_len, new_tokens, until, skipped,
                  gen):
    """blockserve's decode tok/s with engine `options` per batch size, into rows[b] under `label`."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    # No integrity check after each step here: it walks every block (~9 ms a step at batch 256 on a CPU)
    budget = {} if device == "cpu" else {"gpu_memory_utilization": 0.5}  # the budget a GPU user gets, profiled
    began = time.perf_counter()
    with engine(model_dir, device, dtype, **options, **budget, enable_prefix_caching=False, check_integrity=False,
                max_num_seqs=max(batches), max_model_len=prompt_len + new_tokens + 16) as llm:
        # Loading, the KV budget's profile and the graphs' capture, under the first batch size's row
        rows[batches[0]][f"blockserve_{label}_startup_s"] = round(time.perf_counter() - began, 2)
        for b in batches:
            ids = torch.randint(0, vocab, (b, prompt_len), generator=gen).tolist()
            if time.perf_counter() > until:
                skipped.append(f"{label} batch {b}")
                continue
            # The warm-up (compiles, allocates): what a user's first requests of this size wait
            rows[b][f"blockserve_{label}_warmup_s"] = round(_timed(lambda: greedy(llm, ids, 2)), 2)
            rate = _rate(lambda n: greedy(llm, ids, n), b, new_tokens)
            rows[b][f"blockserve_{label}_tok_s"] = rate
            with StepSplit(llm) as split:
                greedy(llm, ids, new_tokens)
            rows[b].update({f"blockserve_{label}_{k}": v for k, v in split.medians().items()})
            rows[b][f"blockserve_{label}_vs_hbm_bound"] = round(rate / rows[b]["hbm_bound_tok_s"], 3)
            if "transformers_tok_s" in rows[b]:
                rows[b][f"blockserve_{label}_vs_transformers"] = round(rate / rows[b]["transformers_tok_s"], 2)


class StepSplit:
    """Times each engine step whole and the host's wait for the device in it: the read of a step's
    samples (SampledTokens.host, patched on the class while in the block), which waits for the device
    to finish that step. A step's host work is the rest, the floor under its time however fast the
    device: where it is above the HBM bound's step, the host, not the kernels, holds throughput back.
    One step at a time the host waits for the step it just launched; with async scheduling for the one
    before, while the new one runs, so there the wait is only what the host's work did not cover."""

    def __init__(self, llm: LLM):
        self.engine = llm.engine
        self.steps: list[tuple[float, float]] = []  # (step seconds, of which waiting for the device)

    def __enter__(self) -> StepSplit:
        host, step, wait = SampledTokens.host, self.engine.step, [0.0]

        def waiting_host(samples):
            began = time.perf_counter()
            if samples.ready is not None:
                samples.ready.synchronize()
            wait[0] += time.perf_counter() - began
            return host(samples)

        def timed_step():
            wait[0], began = 0.0, time.perf_counter()
            outputs = step()
            self.steps.append((time.perf_counter() - began, wait[0]))
            return outputs

        SampledTokens.host, self.engine.step, self._host = waiting_host, timed_step, host
        return self

    def __exit__(self, *exc) -> None:
        SampledTokens.host = self._host
        del self.engine.step  # the instance attribute; the method shows through again

    def medians(self) -> dict[str, float]:
        """Median step, device wait and host work in ms over the steps taken (decode dominates)."""
        return {name: round(statistics.median(values) * 1e3, 3) for name, values in (
            ("step_ms", [s for s, _ in self.steps]), ("device_wait_ms", [w for _, w in self.steps]),
            ("host_ms", [s - w for s, w in self.steps]))}


def _timed(call) -> float:
    """Seconds `call()` takes, the device's queued work included (synchronised before and after)."""
    _sync()
    began = time.perf_counter()
    call()
    _sync()
    return time.perf_counter() - began


def _median_s(call, repeats: int) -> float:
    """The median of `repeats` timed calls, the first three (compilation, warm-up) left out where more ran."""
    times = [_timed(call) for _ in range(repeats)]
    return statistics.median(times[3:] or times)


def _rate(generate, batch: int, new_tokens: int) -> float:
    """Decode tokens per second from two timed runs: N tokens and 1 token (prefill and the first token)."""
    first = _timed(lambda: generate(1))
    full = _timed(lambda: generate(new_tokens))
    return round(batch * (new_tokens - 1) / max(full - first, 1e-9), 1)


def _hf_generate(model, ids: torch.Tensor, n: int):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)


def copy_bandwidth(device: str, smoke: bool) -> float:
    """Bytes read + written per second by a device-to-device copy (the best of 10 after warm-up)."""
    n = (1 << 22) if smoke else (1 << 30)  # 4 MiB / 1 GiB of bytes
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        _sync()
        began = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - began)
    return 2 * n / best


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def summary(report: dict) -> str:
    """The short text report."""
    env = report["environment"]
    lines = [f"gpu_check on {report['device']} ({report['dtype']}{', smoke' if report['smoke'] else ''}): "
             f"{'OK' if report['ok'] else 'FAILED'} in {report['total_s']} s",
             "environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    for name in [name for name in ("parity", "poison") if name in report]:  # a rerun may leave sections out
        section = report[name]
        runs = section.get("runs") or section.get("backends")
        if runs is None:
            lines.append(f"{name}: {section}")
            continue
        bad = [k for k, r in runs.items() if not r["ok"]]
        skipped = section.get("skipped") or []
        lines.append(f"{name}: {len(runs) - len(bad)}/{len(runs)} ok" + (f"; failed: {', '.join(bad)}" if bad else "")
                     + (f"; {len(skipped)} skipped for time: {', '.join(skipped)}" if skipped else ""))
        for k in bad:
            lines.append(f"  {k}: {json.dumps(runs[k])[:400]}")
    for name in SECTIONS:  # parts of an isolated run that did not finish a section
        for unit, what in report.get(name, {}).get("failed_units", {}).items():
            lines.append(f"{name}: the {unit} part did not finish it: {json.dumps(what)[:400]}")
    if "units" in report:
        lines.append("parts (exit code, seconds): " + ", ".join(f"{unit} {u['rc']} {u['s']}"
                                                                for unit, u in report["units"].items()))
    kernels = report.get("attention", {}).get("kernels")
    if kernels is not None:
        lines.append("attention decode layer (us, KV GB/s): " + ", ".join(
            f"{k} {r['us']} us {r['kv_gb_s']} GB/s" if "us" in r else f"{k} {r['error'][:80]}"
            for k, r in kernels.items()))
    elif "attention" in report:
        lines.append(f"attention: {report['attention']}")
    masks = report.get("attention", {}).get("flex_masks")
    if masks:
        lines.append(f"flex block mask per step over {MASK_PAGES} pages (us): " + ", ".join(
            f"{k} {r['us']}" if "us" in r else f"{k} {r['error'][:80]}" for k, r in masks.items()))
    tp = report.get("throughput", {})
    if "batches" in tp:
        lines.append(f"throughput (decode tok/s; HBM bound step {tp['hbm_bound_step_ms']} ms at "
                     f"{tp['copy_bandwidth_gb_s']} GB/s):")
        for b, row in tp["batches"].items():
            lines.append(f"  batch {b}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        lines.append("fastest blockserve variant per batch: " + ", ".join(f"{b}: {label}"
                                                                        for b, label in tp["fastest"].items()))
        lines.append("goals: " + "; ".join(f"{goal} {json.dumps(v)}" for goal, v in tp.get("goals", {}).items()))
        lines += [f"  {label} failed: {error['error'][:300]}" for label, error in tp["errors"].items()]
    elif "throughput" in report:
        lines.append(f"throughput: {tp}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
