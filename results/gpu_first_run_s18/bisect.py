"""Session 18, call 3: where CUDA-graph decode steps go wrong (triton, tiny llama, float32)."""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch
import gpu_check as gc_
from blockserve.attention.context import ForwardContext
from blockserve.worker import cuda_graphs
from blockserve.worker.cuda_graphs import DecodeGraphs

records = []


def checked_run(self, step):
    n = step.layout.num_seqs
    graph = self.graphs[min(s for s in self.graphs if s >= n)]
    host = self._host_inputs(graph.size, step)
    graph.inputs.copy_(host)
    torch.cuda.synchronize()
    inputs_ok = torch.equal(graph.inputs.cpu(), host)
    graph.replay()
    torch.cuda.synchronize()
    out = graph.output[:n].clone()
    dev = step.to(self.device)
    eager = self.model(dev.input_ids, dev.positions, ForwardContext(self.kv.layer_caches(), dev.metadata, {}))
    torch.cuda.synchronize()
    records.append((graph.size, n, inputs_ok, float((out - eager).abs().max()), float(eager.abs().max())))
    return eager


def no_pool_capture(device):
    def capture(forward):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = forward()
        return graph.replay, output
    return capture


def tokens(path, **opts):
    with gc_.LLM(str(path), device="cuda", dtype="float32", block_size=16, kv_cache_memory="64MiB",
                 attention_backend="triton", max_num_batched_tokens=32, max_model_len=96, **opts) as llm:
        return gc_.greedy(llm, gc_.prompts(8), 10)


with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "llama"
    gc_.save_family("llama", path, "cpu")
    ref = tokens(path, enforce_eager=True)
    print("eager", ref)
    for label, opts in [("graphs8", dict(cuda_graph_sizes=(8,))), ("graphs1248", dict(cuda_graph_sizes=(1, 2, 4, 8)))]:
        got = tokens(path, **opts)
        print(label, "equal" if got == ref else f"DIFFER {got}")
    original = cuda_graphs.cuda_capture
    cuda_graphs.cuda_capture = no_pool_capture
    import blockserve.worker.model_runner as mr
    mr.cuda_capture = no_pool_capture
    got = tokens(path, cuda_graph_sizes=(1, 2, 4, 8))
    print("nopool1248", "equal" if got == ref else f"DIFFER {got}")
    mr.cuda_capture = cuda_graphs.cuda_capture = original
    run = DecodeGraphs.run
    DecodeGraphs.run = checked_run
    got = tokens(path, cuda_graph_sizes=(1, 2, 4, 8))
    DecodeGraphs.run = run
    print("checked (eager outputs used)", "equal" if got == ref else "DIFFER")
    print("records (size, n, inputs_ok, max|graph-eager|, max|eager|):")
    for r in records[:40]:
        print(" ", r)
