"""The engine's device and dtype: resolution and its errors, the flags, the profiling
step behind the CUDA KV budget (run on the CPU), and whole engines in bfloat16 on the CPU.

bfloat16 parity rule: greedy tokens against transformers in float32. bfloat16 keeps 8 bits of
mantissa, so logits move by ~1e-2 and near-ties flip: at a sequence's first difference, both
tokens must be in the reference's top 5 with log-probabilities under NEAR_TIE nats apart (what
follows is not compared). Measured: gaps of 3e-4 to 0.12 nats on these models. A bug in the bf16
path (wrong dtype mixing, a state kept in bf16 across a recurrence) moves tokens by far more.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.attention.paged_attention import BACKENDS
from blockserve.cli import build_parser
from blockserve.config_args import config_from_namespace
from blockserve.engine.config import EngineConfig
from blockserve.engine.device import resolve_device, resolve_device_plan, resolve_dtype
from blockserve.engine.kv_budget import fixed_cuda_kv_bytes, profile_step
from blockserve.models.loader import load_model
from blockserve.models.random_checkpoint import save_random_model
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 a fixture
from tests.parity import assert_greedy_parity, reference_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEAR_TIE = 0.3  # nats
NEW_TOKENS = 5
CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)


# -- resolution --------------------------------------------------------------------------------


def test_auto_follows_cuda_availability():
    assert resolve_device("auto", cuda_available=False) == CPU
    assert resolve_device("auto", cuda_available=True) == CUDA0
    assert resolve_device("cpu", cuda_available=True) == CPU
    assert resolve_device("cuda:1", cuda_available=True, cuda_count=2) == torch.device("cuda", 1)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", CUDA0) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16


def test_cuda_plan_gets_vllms_default_share():
    plan = resolve_device_plan("auto", "auto", None, cuda_available=True, cuda_count=1)
    assert (plan.device, plan.dtype, plan.gpu_memory_utilization) == (CUDA0, torch.bfloat16, 0.9)
    assert plan.placement.device == CUDA0 and plan.placement.dtype == torch.bfloat16
    cpu = resolve_device_plan("auto", "bfloat16", None, cuda_available=False)
    assert (cpu.device, cpu.dtype, cpu.gpu_memory_utilization) == (CPU, torch.bfloat16, None)


@pytest.mark.parametrize("args, message", [
    (("cuda", "auto", None), "CUDA is not available"),
    (("cuda:0", "auto", None), "CUDA is not available"),
    (("cpu", "auto", 0.5), "gpu_memory_utilization=0.5 applies to CUDA only"),
    (("auto", "auto", 0.5), "applies to CUDA only"),
    (("tpu", "auto", None), "unknown device 'tpu'"),
    (("cpu", "int8", None), "unknown dtype 'int8'"),
])
def test_resolution_errors(args, message):
    with pytest.raises(ValueError, match=message):
        resolve_device_plan(*args, cuda_available=False)


def test_cuda_index_past_the_device_count():
    with pytest.raises(ValueError, match="has 1 CUDA device"):
        resolve_device("cuda:3", cuda_available=True, cuda_count=1)


@pytest.mark.parametrize("fields, message", [
    (dict(device="gpu"), "unknown device 'gpu'"),
    (dict(dtype="half"), "unknown dtype 'half'"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=0.5, kv_cache_memory="1GiB"), "or gpu_memory_utilization .*, not both"),
])
def test_config_refuses_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_flags():
    args = build_parser().parse_args(["generate", "--device", "cpu", "--dtype", "bfloat16",
                                      "--gpu-memory-utilization", "0.8", "hi"])
    config = config_from_namespace(EngineConfig, args)
    assert (config.device, config.dtype, config.gpu_memory_utilization) == ("cpu", "bfloat16", 0.8)
    defaults = config_from_namespace(EngineConfig, build_parser().parse_args(["generate", "hi"]))
    assert (defaults.device, defaults.dtype, defaults.gpu_memory_utilization) == ("auto", "auto", None)


def test_kv_cache_memory_sizes_a_cuda_cache_in_bytes_only():
    """On CUDA kv_cache_memory fixes the cache's size instead of gpu_memory_utilization; a fraction
    would be of the host's memory, so it is refused (before the device is asked anything)."""
    for fraction in (0.2, "0.5", 1):
        with pytest.raises(ValueError, match="is a fraction, which on CUDA would be of the host's memory"):
            fixed_cuda_kv_bytes(fraction, torch.device("cuda"))
    assert EngineConfig().kv_cache_bytes() == 2**30 and EngineConfig(kv_cache_memory="64MiB").kv_cache_bytes() == 2**26


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("fields, message", [
    (dict(device="cuda"), "CUDA is not available"),
    (dict(gpu_memory_utilization=0.5), "applies to CUDA only"),
])
def test_engine_start_up_refuses(tmp_path, fields, message):
    """Refused before the model is read: the path need not even exist."""
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path / "absent"), **fields)


# -- engines in bfloat16 on the CPU --------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_bf16")
    reference = save_random_model(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
        pad_token_id=None), path)
    return path, reference_outputs(reference, prompts(), NEW_TOKENS)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 21, 30)]


def bf16_engine_parity(path, want) -> LLM:
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=64, max_num_batched_tokens=16)
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert_greedy_parity([o.outputs[0].token_ids for o in outputs], want, max_near_ties=len(want), close=NEAR_TIE)
    return llm


def test_llama_in_bfloat16(llama):
    llm = bf16_engine_parity(*llama)
    runner = llm.engine.core.runner
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert {t.dtype for tensors in runner.kv.tensors for t in tensors} == {torch.bfloat16}  # kv_cache_dtype auto


def test_hybrid_in_bfloat16_keeps_states_float32(tiny_model):
    path, reference = tiny_model("qwen3_next")
    llm = bf16_engine_parity(path, reference_outputs(reference, prompts(), NEW_TOKENS))
    runner = llm.engine.core.runner
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    dtypes = {(group.is_state, t.dtype) for group, tensors in zip(runner.kv.config.groups, runner.kv.tensors)
              for t in tensors}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}


# -- the profiling step behind the CUDA KV budget ------------------------------------------------


def test_profile_step_runs_the_largest_step(llama):
    loaded = load_model(str(llama[0]), BACKENDS["exact"])
    model = loaded.model
    groups = [(spec, (name,), model.kv_layers()[name].reads_unwritten_slots)
              for name, spec in model.kv_cache_specs(16).items()]
    seen = []
    forward = model.forward
    model.forward = lambda ids, positions, ctx: seen.append(ids.shape[0]) or forward(ids, positions, ctx)
    profile_step(model, groups, 40, CPU)
    assert seen == [40]  # one forward over all 40 prompt tokens


# -- the host-to-device path, on the CPU ---------------------------------------------------------


def test_step_inputs_survive_the_device_move(llama, monkeypatch):
    """The worker's one-copy move of a step's inputs (input_batch._on_device) runs on CUDA only; here
    the step's inputs are told to move to a device other than the CPU and the copy is a clone, so
    the repacking into device metadata (and each one's host twin) is exercised: greedy tokens must
    still equal transformers' exactly (as float32 engines do)."""
    import blockserve.worker.input_batch as input_batch

    moves = []
    monkeypatch.setattr(input_batch, "to_device", lambda tensors, device: moves.append(device) or
                        [t.clone() for t in tensors])
    monkeypatch.setattr(input_batch.StepInputs, "to", lambda step, device: input_batch._on_device(
        step, torch.device("meta")))
    llm = LLM(model=str(llama[0]), max_model_len=64, max_num_batched_tokens=8, attention_backend="whole_block")
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert moves and set(moves) == {torch.device("meta")}
    assert_greedy_parity([o.outputs[0].token_ids for o in outputs], llama[1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["exact", "triton"])
def test_llama_on_cuda_matches_cpu(llama, backend):
    """On CUDA the cache is sized by gpu_memory_utilization after a profiling step, as by default, but
    to about 1 GiB: 0.9 of an H200 would be ~30 million blocks of this tiny model to build."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    free, total = torch.cuda.mem_get_info()
    budget = {"cuda": {"gpu_memory_utilization": min(0.9, (total - free + 2**30) / total)},
              "cpu": {"kv_cache_memory": "64MiB"}}
    outs = []
    for device in ("cpu", "cuda"):
        with LLM(model=str(llama[0]), device=device, dtype="float32", max_model_len=64, max_num_batched_tokens=16,
                 attention_backend=backend if device == "cuda" else "exact", **budget[device]) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_weights_are_assembled_on_the_placement_in_its_dtype(llama, monkeypatch):
    """A bf16 model is never assembled from float32 host copies: each checkpoint tensor (float32
    here) is converted as it is read, so fused q|k|v and gate|up pieces are already bf16."""
    from blockserve.models import weights
    from blockserve.models.placement import Placement

    seen = []
    assemble = weights._Pieces.assemble

    def recording(self, target, shape):
        seen.extend(t.dtype for t in self.tensors.values())
        return assemble(self, target, shape)

    monkeypatch.setattr(weights._Pieces, "assemble", recording)
    loaded = load_model(str(llama[0]), BACKENDS["exact"], placement=Placement(dtype=torch.bfloat16))
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_close_lets_go_of_the_model_and_the_kv_cache(llama):
    """A closed engine holds no weights, KV tensors or graphs (on CUDA their memory goes back to the
    device, so the next engine of a test or notebook can size its cache), and refuses to step."""
    llm = LLM(model=str(llama[0]), device="cpu", kv_cache_memory="64MiB", max_model_len=64)
    model, kv = weakref.ref(llm.engine.core.loaded.model), weakref.ref(llm.engine.core.runner.kv)
    llm.close()
    gc.collect()
    assert model() is None and kv() is None
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="engine is closed"):
        llm.engine.core.step()


@pytest.mark.gpu
def test_close_gives_the_memory_back_on_cuda(llama):
    """A closed engine that kept its KV cache would leave the next one no room on the device.
    After close (graphs captured, a batch generated) what torch holds is back to about where it was."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with LLM(model=str(llama[0]), device="cuda", dtype="float32", attention_backend="triton", max_model_len=64,
             max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory="256MiB", cuda_graph_sizes=(1, 2, 4, 8)) as llm:
        llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        assert torch.cuda.memory_allocated() - before > 200 * 2**20  # the cache, about 256 MiB
    assert torch.cuda.memory_allocated() - before < 64 * 2**20  # cuBLAS workspaces and the like may stay


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "exact", "flex"])  # flex last: its compiles are the slowest
def test_async_scheduling_on_cuda_matches_one_step_at_a_time(llama, backend):
    """The next step launched before the last one's tokens are back (their ids filled in on the
    device, CUDA graphs replayed where the backend captures them) gives the tokens of one step at a time."""
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=NEW_TOKENS, logprobs=2),
              SamplingParams(temperature=0, max_tokens=NEW_TOKENS, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=2)]
    outs = []
    for ahead in (False, True):
        with LLM(model=str(llama[0]), device="cuda", dtype="float32", max_model_len=64, max_num_batched_tokens=16,
                 max_num_seqs=8, attention_backend=backend, kv_cache_memory="64MiB", async_scheduling=ahead,
                 check_integrity=True) as llm:  # graphs at 1, 2, 4, 8: few captures to compile
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)])
            llm.engine.core.scheduler.assert_idle()
    assert outs[0] == outs[1]
