"""CUDA graphs for decode steps (worker/cuda_graphs.py), proven without a GPU.

CI has no GPU, so the capture is replaced by a stand-in with the semantics that matter: the
forward runs once to "capture" with host reads forbidden (CUDA forbids syncs while capturing),
once more on fake tensors (torch's FakeTensorMode raises on an op whose output shape depends on
values: boolean indexing, nonzero, unique), and each replay runs it again over the same static
metadata objects, whose host lists still hold the capture's placeholders. A layer that reads a
host value (a list, a host-built gather) thus gets the capture-time value on replay, as under a
real graph, while everything computed from the static tensors is recomputed. With it, engines
whose decode steps replay padded buckets must give the eager engine's tokens and logprobs for
every family, and a backend that reads host lists must be caught. Like a real graph, the stand-in
holds the captured forward only weakly: the engine must keep alive what the captured kernels read
(replayed freed metadata gives wrong tokens, then out-of-range indices). The GPU itself
is checked by blockserve/bench/gpu_check.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import Gemma3TextConfig

from blockserve import LLM, SamplingParams
from blockserve.engine.config import EngineConfig
from blockserve.kv.specs import cdiv
from blockserve.models.moe import Experts
from blockserve.models.random_checkpoint import save_random_model
from blockserve.worker.cuda_graphs import default_graph_sizes, graph_blockers
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 a fixture
from tests.worker.test_sync_free import HostRead, host_reads_raise, llama_path  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def no_native_kernels(monkeypatch):
    """The CPU's native kernels are opaque to fake tensors, and a GPU never runs them."""
    monkeypatch.setenv("BLOCKSERVE_NATIVE_KERNELS", "0")


SIZES = (1, 2, 4, 8)
KV_MEMORY = 512 * 1024  # a small cache: a captured flex step attends over all of it on the CPU
NEW_TOKENS = (9, 3, 6, 12, 1, 7)  # per prompt: decode batches shrink from 5 rows to 1 (buckets 8, 4 padded)


class FrozenCapture:
    """The stand-in for CUDA graph capture (see the module docstring); counts replays per size.
    `fake`: also run the fake-tensor pass (torch's grouped_mm, the MoE route a graph can hold,
    declares bfloat16 operands only, so float32 MoE models skip it)."""

    def __init__(self, fake: bool = True):
        self.replays: list[int] = []
        self.fake = fake

    def __call__(self, forward):
        with host_reads_raise():
            output = forward()
        if self.fake:
            with FakeTensorMode(allow_non_fake_inputs=True):  # raises on a value-dependent shape
                forward()
        captured = weakref.ref(forward)  # a real graph holds pointers only: the caller must keep it alive

        def replay():
            self.replays.append(output.shape[0])
            again = captured()
            assert again is not None, "the captured forward was dropped: a real replay would read freed memory"
            with host_reads_raise():
                output.copy_(again())

        return replay, output


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 6)] + \
        [shared + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (2, 9, 5)]


def engine(path, backend: str = "flex", dtype: str = "float32") -> LLM:
    llm = LLM(model=str(path), attention_backend=backend, max_model_len=64, max_num_seqs=8,
              max_num_batched_tokens=32, seed=0, kv_cache_memory=KV_MEMORY, dtype=dtype)
    for module in llm.engine.core.runner.model.modules():
        if isinstance(module, Experts):
            module.route = "grouped"  # the route bfloat16 takes on a GPU; the CPU's loop reads the host
    return llm


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs; twice over, so the second pass hits the prefix cache."""
    out = []
    for _ in range(2):
        params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0) for n in NEW_TOKENS]
        for o in llm.generate(prompts(), params, use_tqdm=False):
            c = o.outputs[0]
            out.append((c.token_ids, [entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids)]))
    return out


def with_graphs(llm: LLM, fake: bool = True) -> FrozenCapture:
    capture = FrozenCapture(fake)
    llm.engine.capture_decode_graphs(SIZES, capture)  # refuses a model with graph blockers
    assert llm.engine.cuda_graph_sizes == SIZES
    return capture


def assert_same(graphed, eager):
    assert [tokens for tokens, _ in graphed] == [tokens for tokens, _ in eager]
    for (_, lp_graphed), (_, lp_eager) in zip(graphed, eager):
        torch.testing.assert_close(torch.tensor(lp_graphed), torch.tensor(lp_eager), atol=2e-5, rtol=0)


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_graphs")
    s, f = "sliding_attention", "full_attention"
    save_random_model(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       query_pre_attn_scalar=16, max_position_embeddings=256, sliding_window=10,
                                       layer_types=[s, s, f, s], bos_token_id=None, eos_token_id=None,
                                       pad_token_id=None), path)
    return path


DENSE = ("llama", "gemma3")
MOE = ("deepseek_v3", "kimi_linear", "qwen3_next", "granitemoehybrid")


def family_path(family, request, tiny_model):
    return request.getfixturevalue(f"{family}_path") if family in DENSE else tiny_model(family)[0]


@pytest.mark.parametrize("family", DENSE + MOE)
def test_replayed_decode_steps_equal_eager_ones(family, request, tiny_model):
    """Full attention, sliding windows (Gemma 3), MLA with MoE (DeepSeek-V3), KDA + MLA (Kimi
    Linear), Gated DeltaNet (Qwen3-Next) and Mamba2 (Granite 4.0-H), in float32: the same tokens,
    and logprobs to float rounding (a padded bucket is a matmul of more rows)."""
    path = family_path(family, request, tiny_model)
    eager = generate(engine(path))
    llm = engine(path)
    capture = with_graphs(llm, fake=family in DENSE)
    graphed = generate(llm)
    assert_same(graphed, eager)
    assert set(capture.replays) == set(SIZES)  # every bucket replayed


@pytest.mark.slow  # ~12 s
@pytest.mark.parametrize("family", MOE)
def test_moe_families_capture_in_bfloat16(family, request, tiny_model):
    """The MoE families in bfloat16 (their GPU dtype), fake-tensor pass included: captured, and
    the eager engine's greedy tokens (bfloat16 logprobs differ by rounding, up to ~0.1 here)."""
    path = family_path(family, request, tiny_model)
    eager = generate(engine(path, dtype="bfloat16"))
    llm = engine(path, dtype="bfloat16")
    with_graphs(llm)
    assert [tokens for tokens, _ in generate(llm)] == [tokens for tokens, _ in eager]


@pytest.mark.slow  # the Triton kernel in its interpreter, ~10 s a family
@pytest.mark.parametrize("family", ["llama", "deepseek_v3", *(pytest.param(f, marks=pytest.mark.backend_full)
                                                                  for f in ("gemma3", "kimi_linear"))])
def test_triton_decode_steps_replay_equal_eager(family, request, tiny_model):
    """The triton backend's kernel (run by Triton's interpreter) reads only the step's tensors: full,
    sliding and MLA layers replayed in padded buckets give the eager engine's tokens and logprobs.
    (No fake-tensor pass: a Triton launch needs real memory; its tile map's ops are torch's, as flex's.)"""
    path = family_path(family, request, tiny_model)
    eager = generate(engine(path, "triton"))
    llm = engine(path, "triton")
    capture = with_graphs(llm, fake=False)
    assert_same(generate(llm), eager)
    assert set(capture.replays) == set(SIZES)


@pytest.mark.slow  # the Triton kernel in its interpreter, ~15 s a family
@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("llama", marks=pytest.mark.backend_full)])
def test_triton_key_splits_in_replayed_steps_equal_unsplit_eager(family, request, tiny_model, monkeypatch):
    """Decode steps whose keys are split over programs (as on a GPU with idle multiprocessors; forced
    here) and combined, replayed from captured graphs: the unsplit eager engine's tokens and logprobs."""
    from blockserve.attention import triton_paged

    path = family_path(family, request, tiny_model)
    eager = generate(engine(path, "triton"))
    monkeypatch.setattr(triton_paged, "_multiprocessors", lambda device: 64)
    monkeypatch.setattr(triton_paged, "MIN_SPLIT_KEYS", 16)
    splits = []
    choose = triton_paged.key_splits
    monkeypatch.setattr(triton_paged, "key_splits", lambda *args: splits.append(choose(*args)) or splits[-1])
    llm = engine(path, "triton")
    with_graphs(llm, fake=False)
    assert_same(generate(llm), eager)
    assert max(splits) > 1


@pytest.mark.slow  # traces the compiled flex call, ~15 s
@pytest.mark.backend_full
def test_the_cuda_flex_call_traces_as_one_graph(request, tiny_model, monkeypatch):
    """On CUDA flex_attention is compiled (fullgraph, dynamic shapes): its block mask and mask_mod,
    built from the step's tensors (a captured step's too), must trace without a graph break, and
    several models in one process must stay within the recompile limit (gpu_check runs five).
    Checked on the CPU with the same call through Dynamo and AOT autograd (backend aot_eager: no
    code generation) for full, sliding (Gemma 3), MLA (absorbed: value width != key width) and
    hybrid models: the same tokens and logprobs as the eager reference."""
    from torch._dynamo.utils import counters

    import blockserve.attention.flex_attention as flex

    families = ["llama", "gemma3", "deepseek_v3", "kimi_linear", "qwen3_next"]
    expected = {}
    for family in families:
        llm = engine(family_path(family, request, tiny_model))
        with_graphs(llm, fake=False)
        expected[family] = generate(llm)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(flex, "_attend", flex.compiled_flex("aot_eager"))
    for family in families:
        llm = engine(family_path(family, request, tiny_model))
        with_graphs(llm, fake=False)
        assert_same(generate(llm), expected[family])
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]


def test_padding_writes_the_scratch_block_never_the_null_block(llama_path):
    llm = engine(llama_path)
    with_graphs(llm)
    generate(llm)
    kv = llm.engine.core.runner.kv
    for g, tensors in enumerate(kv.tensors):
        cache = tensors[0]  # [layers, 2, blocks, ...]
        assert not cache[:, :, 0].any()  # C1: the null block is still zero
        assert cache[:, :, kv.scratch_slot(g)].any()  # the padding rows wrote here


def test_a_closed_engine_frees_its_graphs_without_the_cycle_collector(llama_path):
    """Each graph keeps its captured forward, which must not refer back to the graphs: a dropped
    engine's KV cache (on CUDA, the device's memory) goes as soon as its last reference does."""
    llm = engine(llama_path)
    with_graphs(llm, fake=False)
    kv = weakref.ref(llm.engine.core.runner.kv)
    gc.disable()
    try:
        llm.close()
        assert kv() is None
    finally:
        gc.enable()


def test_the_stand_in_catches_a_backend_that_reads_host_lists(llama_path):
    """whole_block builds its decode gathers from the host's seq_lens: captured, it would replay the
    capture's placeholders (one-token sequences). The stand-in must see that, or the tests above
    prove nothing."""
    eager = generate(engine(llama_path, "whole_block"))
    llm = engine(llama_path, "whole_block")
    assert graph_blockers(llm.engine.core.runner.model)  # the engine would never capture it...
    llm.engine.core.runner.capture_decode_graphs(SIZES, FrozenCapture())  # ...so force it
    try:
        graphed = generate(llm)
    except HostRead:
        return
    assert [tokens for tokens, _ in graphed] != [tokens for tokens, _ in eager]


def test_graph_blockers_name_what_cannot_be_captured(llama_path, tiny_model):
    assert graph_blockers(engine(llama_path, "flex").engine.core.runner.model) == []
    assert graph_blockers(engine(llama_path, "triton").engine.core.runner.model) == []
    exact = LLM(model=str(llama_path), attention_backend="exact", max_model_len=64)
    assert graph_blockers(exact.engine.core.runner.model) == [
        "attention backend 'exact' builds its gathers from host lists (use 'flex' or 'triton')"]
    with pytest.raises(ValueError, match="cannot be captured: attention backend 'exact' builds its gathers"):
        exact.engine.capture_decode_graphs(SIZES, FrozenCapture())
    assert exact.engine.cuda_graph_sizes == ()
    deepseek = LLM(model=str(tiny_model("deepseek_v3")[0]), attention_backend="flex", max_model_len=64)
    assert graph_blockers(deepseek.engine.core.runner.model) == [
        "MoE experts in float32 take the expert loop, which reads the routing back to the host (use --dtype bfloat16)"]


@pytest.mark.slow  # ~8 s
def test_the_engine_captures_only_what_it_may(llama_path, caplog):
    """EngineCore's choice on CUDA (asked here of a CPU engine): graphs at the default sizes with flex
    or triton; none with enforce_eager; a warning naming the reason for a backend that cannot be
    captured, or an error when cuda_graph_sizes asked for graphs anyway."""
    import dataclasses

    def choose(backend, **options):
        core = LLM(model=str(llama_path), attention_backend=backend, max_model_len=64, max_num_seqs=6).engine.core
        return core._decode_graph_sizes(dataclasses.replace(core.config, **options))

    assert choose("flex") == choose("triton") == (1, 2, 4, 6)
    assert choose("triton", cuda_graph_sizes=(3,)) == (3,)
    assert choose("flex", enforce_eager=True) == ()
    with caplog.at_level("WARNING", logger="blockserve"):
        assert choose("exact") == ()
    assert "CUDA graphs: off" in caplog.text and "'exact' builds its gathers from host lists" in caplog.text
    with pytest.raises(ValueError, match="cuda_graph_sizes given, but this model's decode cannot be captured"):
        choose("exact", cuda_graph_sizes=(1, 2))


def test_the_kv_budget_probe_captures_the_largest_graph_on_a_throwaway_runner(llama_path):
    """What the CUDA KV budget subtracts for graphs is measured on a runner of its own (its own small
    cache), captured at the largest size, with block tables as wide as the engine's (what flex's mask
    derives from them in the graph grows with them); the engine's runner and cache are untouched."""
    from blockserve.engine.kv_budget import CudaBudget, graph_probe

    llm = engine(llama_path, "triton")
    core = llm.engine.core
    groups = [(g.spec, g.layer_names, False) for g in core.kv_config.groups]
    capture = FrozenCapture(fake=False)
    probe = graph_probe(core.runner.model, groups, 32, 8, torch.device("cpu"), core.runner.max_model_len, capture)
    assert probe is not core.runner and probe.kv is not core.runner.kv
    assert set(probe.graphs.graphs) == {8} and capture.replays == []
    block_sizes = {g: group.spec.block_size for g, group in enumerate(core.kv_config.groups)}
    assert {g: table.shape[1] for g, table in probe.graphs.tables.items()} == \
        {g: cdiv(core.runner.max_model_len, bs) for g, bs in block_sizes.items()}
    assert all(cdiv(core.runner.max_model_len, bs) > cdiv(32 + 1, bs) for bs in block_sizes.values())  # not the probe's own
    assert core.runner.graphs is None
    budget = CudaBudget(total=100 << 30, in_use=10 << 30, activation_peak=2 << 30, utilization=0.9, graphs=1 << 30)
    assert budget.kv_bytes == int(0.9 * (100 << 30)) - (13 << 30)
    assert "1.00 GiB for CUDA graphs" in budget.report()
    assert "CUDA graphs" not in CudaBudget(100 << 30, 10 << 30, 2 << 30, 0.9).report()


def test_default_sizes():
    assert default_graph_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert default_graph_sizes(5) == (1, 2, 4, 5)
    assert default_graph_sizes(1) == (1,)


def test_config_errors(llama_path):
    with pytest.raises(ValueError, match="from 1 to max_num_seqs"):
        EngineConfig(max_num_seqs=4, cuda_graph_sizes=(1, 8))
    with pytest.raises(ValueError, match="enforce_eager forbids"):
        EngineConfig(cuda_graph_sizes=(1,), enforce_eager=True)
    with pytest.raises(ValueError, match="CUDA only"):
        LLM(model=str(llama_path), device="cpu", cuda_graph_sizes=(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_cuda_graphs_equal_eager_on_cuda(llama_path, backend):
    outs = []
    for options in (dict(enforce_eager=True), dict(cuda_graph_sizes=SIZES)):
        with LLM(model=str(llama_path), device="cuda", dtype="float32", attention_backend=backend, max_model_len=64,
                 max_num_seqs=8, max_num_batched_tokens=32, seed=0, kv_cache_memory=KV_MEMORY,
                 **options) as llm:  # closed: the GPU's memory is free for the next
            assert llm.engine.cuda_graph_sizes == (() if "enforce_eager" in options else SIZES)
            outs.append(generate(llm))
    assert [t for t, _ in outs[0]] == [t for t, _ in outs[1]]
