"""The printout: throughput table, greedy-token agreement, batch-1 inter-token latency, roofline
and the goals; the medians and ratios also go into `results` (the JSON)."""

from __future__ import annotations

import statistics

from blockserve.bench.roofline import loaded_bound_line

FOUR_BIT = ("llama.cpp-batched", "llama.cpp-sequential")  # Q4_1 weights: their tokens are not expected to match


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    identical = sum(a == b for a, b in zip(ours, theirs))
    first_diff = {}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            first_diff[i] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical": identical, "total": len(ours), "first_difference_at": first_diff}


def report(results: dict, systems: list[str], tokens_by_system: dict) -> None:
    roof = results["roofline"]
    medians = throughput(results, systems, tokens_by_system) if systems else {}
    itl = inter_token_latency(results, roof)
    print_roofline(results)
    if medians:
        goals(results, medians, itl)


def throughput(results: dict, systems: list[str], tokens_by_system: dict) -> dict:
    workload = results["workload"]
    medians = {}
    for s in systems:
        runs = [rnd[s] for rnd in results["rounds"]]
        medians[s] = {k: statistics.median(run[k] for run in runs) for k in ("tok_s", "req_s", "seconds", "cpu_per_wall")}
        medians[s]["tok_s_all_rounds"] = [run["tok_s"] for run in runs]
    ours = medians["blockserve"]["tok_s"]
    for s in systems:
        medians[s]["blockserve_ratio"] = ours / medians[s]["tok_s"]
    results["medians"] = medians
    parity = {s: compare_tokens(tokens_by_system["blockserve"], tokens_by_system[s]) for s in systems if s != "blockserve"}
    results["parity_vs_blockserve"] = parity

    print(f"\n== offline throughput: {workload['num_prompts']} prompts x {workload['max_tokens']} new tokens, "
          f"median of {len(results['rounds'])} round(s) ==")
    print(f"{'system':<21} {'tok/s':>9} {'req/s':>7} {'seconds':>9} {'cpu/wall':>9} {'blockserve x':>13}   rounds (tok/s)")
    for s in systems:
        m = medians[s]
        rounds = " ".join(f"{x:.1f}" for x in m["tok_s_all_rounds"])
        print(f"{s:<21} {m['tok_s']:9.1f} {m['req_s']:7.3f} {m['seconds']:9.1f} {m['cpu_per_wall']:9.2f} "
              f"{m['blockserve_ratio']:12.2f}x   {rounds}")
    for s, reason in results["skipped"].items():
        print(f"{s:<21} skipped: {reason}")
    for s, p in parity.items():
        note = "" if p["identical"] == p["total"] else \
            f" (first differences at token {sorted(p['first_difference_at'].values())})"
        label = "4-bit weights, differences expected" if s in FOUR_BIT else "same fp32 weights"
        print(f"greedy tokens identical to blockserve ({label}): {s} {p['identical']}/{p['total']}{note}")

    bs_runs = [rnd["blockserve"] for rnd in results["rounds"]]
    mid = sorted(bs_runs, key=lambda run: run["tok_s"])[len(bs_runs) // 2]
    print(f"blockserve (median round): {mid['seconds']:.1f} s, {mid['tok_s']:.1f} tok/s, {mid['req_s']:.3f} req/s, "
          f"{mid['steps']} steps ({mid['ms_per_step']:.1f} ms/step), "
          f"{mid['prefix_cached_prompt_tokens']} of {workload['prompt_tokens_total']} prompt tokens from the prefix cache")
    print("blockserve step profile (share of total time): " + ", ".join(
        f"{k} {100 * v:.1f}%" for k, v in mid["phase_share"].items()))
    return medians


def inter_token_latency(results: dict, roof: dict) -> dict:
    """Median ms per token after the first, batch 1, over prompts and rounds, per system."""
    rounds = [r for r in results["itl_rounds"] if r]
    if not rounds:
        return {}
    itl = {s: 1e3 * statistics.median(x for r in rounds for x in r[s]) for s in rounds[0]}
    results["itl_median_ms"] = itl
    lens = results["workload"]["itl_prompt_lens"]
    print(f"\n== batch-1 inter-token latency: {len(lens)} prompt(s) of {lens} tokens, "
          f"{results['workload']['max_tokens']} new tokens, median of {len(rounds)} round(s) ==")
    for s, ms in itl.items():
        ratio = "" if s == "blockserve" else f"   {ms / itl['blockserve']:.2f}x blockserve's"
        print(f"{s:<21} {ms:7.1f} ms/token{ratio}")
    print(f"(batch-1 weight-bandwidth bound: fp32 {roof['batch1_bandwidth_bound_ms_per_token']:.1f} ms/token, "
          f"as blockserve loads the GGUF {roof['batch1_loaded_bound_ms_per_token']:.1f} ms/token; blockserve reads "
          f"the GGUF's Q4_1/Q8_0 blocks at batch 1, the same weight values transformers dequantises to fp32; "
          f"llama.cpp reads the same blocks, with activations quantised to 8 bits)")
    return itl


def print_roofline(results: dict) -> None:
    roof, env, f = results["roofline"], results["environment"], results["roofline"]["flops"]
    print(f"\n== roofline (fp32, {env['torch_num_threads']} threads) ==")
    shaped = ", ".join(f"{k} {v:.0f}" for k, v in roof["linear_gflops_model_shapes"].items())
    print(f"GEMM peak {roof['gemm_peak_gflops']:.0f} GFLOP/s (best of: 2048^3 matmul {roof['gemm_2048_gflops']:.0f}; "
          f"model-shaped linears [MxKxN] {shaped})")
    print(f"memory bandwidth: copy {roof['copy_bandwidth_gbs']:.1f} GB/s (read + write, 512 MiB tensor); "
          f"read-only {roof['read_bandwidth_gbs']:.1f} GB/s (sum)")
    print(f"workload: {f['total'] / 1e12:.3f} TFLOP = linear {f['linear'] / 1e12:.3f} + lm_head {f['lm_head'] / 1e12:.3f} "
          f"+ attention {f['attention'] / 1e12:.3f} (avg context {f['avg_context']:.0f}); "
          f"{f['per_generated_token'] / 1e6:.0f} MFLOP per generated token, prefill included "
          f"(per computed token, 2 x params + attention: {f['rule_of_thumb_per_token'] / 1e6:.0f})")
    print(f"compute bound: {roof['compute_bound_tok_s']:.0f} tok/s ({roof['compute_bound_s']:.1f} s for the workload)")
    print(f"batch-1 weight-bandwidth bound: {roof['weight_bytes_per_token'] / 1e6:.0f} MB of fp32 weights per token -> "
          f"{roof['batch1_bandwidth_bound_ms_per_token']:.1f} ms/token, {roof['batch1_bandwidth_bound_tok_s']:.1f} tok/s "
          f"at the copy bandwidth ({roof['batch1_read_bandwidth_bound_ms_per_token']:.1f} ms/token at the read-only one)")
    if loaded_bound_line(roof):
        print(loaded_bound_line(roof))
    medians = results.get("medians", {})
    if "hf-sequential" in medians:
        print(f"hf-sequential (batch 1): {100 * medians['hf-sequential']['tok_s'] / roof['batch1_bandwidth_bound_tok_s']:.0f}% "
              f"of the batch-1 bandwidth bound")


def goals(results: dict, medians: dict, itl: dict) -> None:
    """The goals, last: 1.5x the best peer's throughput, 60% of the compute roofline, and a
    batch-1 inter-token latency 1.5x lower than transformers generate."""
    print("\n== goals ==")
    hf = itl.get("transformers generate")
    if hf:
        print(f"batch-1 inter-token latency: blockserve {itl['blockserve']:.1f} ms, transformers generate "
              f"{hf:.1f} ms: {hf / itl['blockserve']:.2f}x lower (goal: 1.5x)")
    ours = medians["blockserve"]["tok_s"]
    computed = results["roofline"].get("blockserve_computed", results["roofline"])
    fraction = ours / computed["compute_bound_tok_s"]
    results["blockserve_fraction_of_compute_roofline"] = fraction
    cached = computed["flops"]["computed_positions"] != results["roofline"]["flops"]["computed_positions"]
    print(f"blockserve's roofline fraction counts the work it computed: {computed['flops']['total'] / 1e12:.3f} TFLOP"
          + (f" of the workload's {results['roofline']['flops']['total'] / 1e12:.3f} (prompt tokens from its prefix "
             f"cache excluded); the peers' fractions count the whole workload" if cached else ""))
    peers = {s: m["tok_s"] for s, m in medians.items() if not s.startswith("blockserve")}
    if peers:
        best = max(peers, key=peers.get)
        results["best_peer"] = {"system": best, "tok_s": peers[best], "blockserve_ratio": ours / peers[best]}
        print(f"blockserve: {ours / peers[best]:.2f}x the best peer ({best}, {peers[best]:.1f} tok/s; goal: 1.5x), "
              f"{100 * fraction:.1f}% of the compute roofline (goal: 60%)")
    else:
        print(f"blockserve: no peer ran; {100 * fraction:.1f}% of the compute roofline (goal: 60%)")
    for s in medians:
        if s.startswith("blockserve-"):  # blockserve with another setting, e.g. a float16 KV cache
            share = medians[s]["tok_s"] / computed["compute_bound_tok_s"]
            results.setdefault("fraction_of_compute_roofline", {})[s] = share
            print(f"{s}: {100 * share:.1f}% of the compute roofline")
