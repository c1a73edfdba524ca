"""First-GPU-run diagnostics (session 18): where flex faults, and triton vs exact in float32."""
import json, os, sys, time, traceback
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch
import gpu_check as gc_
from blockserve.attention.metadata import AttentionMetadata, BatchLayout, to_device
from blockserve.attention.paged_attention import BACKENDS
GPU = os.environ.get("DIAG_DEV", "cuda")


def engine_case(family, backend, graphs, poison, dtype, big=False):
    import tempfile
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / family
        gc_.save_family(family, path, "cpu")
        opts = dict(attention_backend=backend, enable_prefix_caching=True, max_num_batched_tokens=32,
                    max_model_len=96, kv_cache_memory="40GiB" if big else "64MiB")
        if poison:
            opts["poison"] = True
        if not graphs:
            opts["enforce_eager"] = True
        else:
            opts["cuda_graph_sizes"] = (1, 2, 4, 8)
        t = time.perf_counter()
        with gc_.LLM(str(path), device="cuda", dtype=dtype, block_size=16, check_integrity=not big, **opts) as llm:
            out["build_s"] = round(time.perf_counter() - t, 1)
            out["tokens"] = gc_.greedy(llm, gc_.prompts(8), 10)
            torch.cuda.synchronize()
            out["graph_sizes"] = llm.engine.cuda_graph_sizes
            out["s"] = round(time.perf_counter() - t, 1)
    return out


def triton_layers():
    res = {}
    gen = torch.Generator().manual_seed(0)
    for hq, hkv, d in [(4, 2, 16), (32, 8, 64)]:
        for qlens, done in [([1], [4]), ([1] * 3, [16, 30, 5]), ([1] * 8, [39] * 8), ([1] * 4, [99, 50, 3, 77]),
                            ([1, 1], [299, 600]), ([1], [1500]), ([5, 1, 1], [0, 10, 20]), ([20, 1], [7, 33])]:
            bs = 16
            seq = [q + c for q, c in zip(qlens, done)]
            width = max(-(-s // bs) for s in seq)
            pages = len(seq) * width
            table = (torch.randperm(pages, generator=gen) + 1).view(len(seq), width)
            meta_h = AttentionMetadata.build(BatchLayout.build(qlens, done), table, bs)
            T = sum(qlens)
            kc = torch.randn(pages + 1, bs, hkv, d, generator=gen)
            vc = torch.randn(pages + 1, bs, hkv, d, generator=gen)
            q, k, v = (torch.randn(T, h, d, generator=gen) for h in (hq, hkv, hkv))
            outs = {}
            for name in ("exact", "triton"):
                for dev in (["cpu", GPU] if name == "exact" else [GPU]):
                    meta = meta_h.with_tensors(*to_device(meta_h.tensors(), torch.device(dev)))
                    layer = BACKENDS[name](d ** -0.5)
                    o = layer.forward(q.to(dev), k.to(dev), v.to(dev), kc.clone().to(dev), vc.clone().to(dev), meta)
                    outs[f"{name}_{dev}"] = o.float().cpu()
            ref = outs["exact_cpu"]
            res[f"{hq}/{hkv}/{d} q{qlens} c{done}"] = {k: float((o - ref).abs().max()) for k, o in outs.items()}
    return res


if __name__ == "__main__":
    what = sys.argv[1]
    try:
        if what == "engine":
            r = engine_case(sys.argv[2], sys.argv[3], sys.argv[4] == "graphs", sys.argv[5] == "poison", sys.argv[6], sys.argv[7:] == ["big"])
        else:
            r = triton_layers()
        print("RESULT", what, sys.argv[2:], json.dumps(r))
    except Exception as e:
        print("FAILED", what, sys.argv[2:], type(e).__name__, str(e)[:300])
        traceback.print_exc(limit=-12)
