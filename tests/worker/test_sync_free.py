"""The model forward never reads a device tensor back to the host: on CUDA every
`.item()`, `.tolist()`, `int(t)`, `bool(t)` or `t.__index__()` in the forward stalls the step
until the GPU drains. Proven on the CPU: whole engine steps (batched prefill, prefix hits, chunked
prefill, decodes) with those methods patched to raise inside the model's forward only, for a
dense Llama, DeepSeek-V3 (MLA + MoE, the grouped expert route), Kimi Linear (KDA + MLA + MoE), Qwen3-Next
(Gated DeltaNet) and Granite 4.0-H (Mamba2).
A companion test shows the guard fires on the CPU's expert loop, which does read ids back. The
sampler too reads nothing back where that would wait (async scheduling's premise)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.models.moe import Experts
from blockserve.models.random_checkpoint import save_random_model
from blockserve.worker.sampler import Sampler
from blockserve.worker.sampling_batch import SamplingBatch, SamplingRow, make_generator
from tests.models.conftest import VOCAB, tiny_model  # noqa: F401 a fixture
from tests.structured.test_sampler_grammar import AllowOnly

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HOST_READS = ("item", "tolist", "__int__", "__bool__", "__index__", "__float__", "numpy")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def host_reads_raise():
    """Within: every Tensor method that copies a value to the host raises HostRead."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def raiser(name):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} called where nothing may be read back (a host sync on a GPU)")
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, raiser(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def guard(owner, name: str) -> None:
    """From now on `owner.name(...)` raises HostRead where it reads a tensor back."""
    method = getattr(owner, name)

    def guarded(*args, **kwargs):
        with host_reads_raise():
            return method(*args, **kwargs)

    setattr(owner, name, guarded)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    return [shared + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 6)] + \
        [torch.randint(0, VOCAB, (11,), generator=gen).tolist()]


def run(path, guarded: bool = True, **options) -> list[list[int]]:
    llm = LLM(model=str(path), max_model_len=64, max_num_batched_tokens=8, seed=0, **options)
    for module in llm.engine.core.runner.model.modules():
        if isinstance(module, Experts):
            module.route = "grouped"  # the route off the CPU
    if guarded:
        guard(llm.engine.core.runner.model, "forward")
    params = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate(prompts()[:1], params, use_tqdm=False)  # cached: the others hit its prefix
    rest = llm.generate(prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + rest]


def save_tiny_llama(path, max_position_embeddings: int = 256):
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=max_position_embeddings, bos_token_id=None,
                                  eos_token_id=None, pad_token_id=None), path)
    return path


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama_sync"))


def test_guard_catches_a_host_read():
    """The guard itself: each patched method raises inside, and all are restored after."""
    t = torch.tensor([3])
    with host_reads_raise():
        for read in (lambda: t.item(), lambda: t.tolist(), lambda: int(t), lambda: bool(t), lambda: [0, 1][t]):
            with pytest.raises(HostRead):
                read()
    assert int(t) == 3 and t.tolist() == [3]


@pytest.mark.parametrize("backend", ["exact", "whole_block"])
def test_llama_forward_is_sync_free(llama_path, backend):
    assert all(len(tokens) == 3 for tokens in run(llama_path, attention_backend=backend))


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_linear", "qwen3_next", "granitemoehybrid"])
def test_mla_moe_and_hybrid_forward_is_sync_free(tiny_model, name):
    path, _ = tiny_model(name)
    assert all(len(tokens) == 3 for tokens in run(path))


def test_cpu_expert_loop_reads_the_host():
    """The loop route (the CPU's) does read ids back, the grouped route does not: the guard tells."""
    module = Experts(4, 8, 4)
    module.gate_up_proj = torch.nn.Parameter(torch.randn(4, 8, 8))
    module.down_proj = torch.nn.Parameter(torch.randn(4, 8, 4))
    x, weights, ids = torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[0, 1], [2, 1], [3, 0]])
    with host_reads_raise():
        module.route = "grouped"
        module(x, weights, ids)
        module.route = "loop"
        with pytest.raises(HostRead):
            module(x, weights, ids)


def test_the_sampler_reads_nothing_back_where_that_waits():
    """Off the CPU the sampler queues its work without reading a value back (async scheduling then
    overlaps the next step's host work with the device): proven on the CPU with the native kernels
    off and `reads_back` off, every filter, penalty, bias, seed, min_tokens (on constrained rows too:
    the grammar wins when it allows only what min_tokens blocks) and logprobs in one batch. The tokens
    equal the CPU's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=1.0, seed=4, top_p=0.5), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                             logit_bias={5: 2.0}),
              SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[7])]
    logits = torch.cat([logits, logits[:2]])
    logits[6:, 9] = 100.0  # the model wants EOS

    def batch_rows():
        constrained = [SamplingRow(SamplingParams(temperature=0, min_tokens=4), [1], [], None, 9, AllowOnly(ids, VOCAB))
                       for ids in ([9], [9, 50])]  # only EOS: EOS; with another token: not EOS
        return [SamplingRow(p, [1, 2, 3], [4, 7], make_generator(p.seed, "cpu") if p.seed is not None else None, 9)
                for p in params] + constrained

    want = Sampler(device="cpu", seed=0)(logits, SamplingBatch.build(batch_rows(), "cpu"))
    rows = batch_rows()
    sampler = Sampler(device="cpu", seed=0)
    sampler.native, sampler.reads_back = None, False
    batch = SamplingBatch.build(rows, "cpu")
    with host_reads_raise():
        samples = sampler.sample(logits, batch)
    got = samples.host()
    assert got.token_ids[0] == want.token_ids[0] == int(logits[0].argmax())
    assert got.token_ids[3:] == want.token_ids[3:]  # greedy rows: the same whichever kernels
    assert got.token_ids[6:] == [9, 50]
    assert got.logprobs[3].top_ids == want.logprobs[3].top_ids


def test_prompt_logprobs_are_read_back_with_the_result_not_at_launch(llama_path):
    """Prompt logprobs over chunked prompts read nothing back while the step is launched (their values
    are checked against transformers in tests/engine/test_prompt_logprobs.py)."""
    llm = LLM(model=str(llama_path), max_model_len=64, max_num_batched_tokens=8, seed=0)
    guard(llm.engine.core.runner.prompt_logprobs, "compute")
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    for prompt, output in zip(prompts(), outputs):
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        assert all(token in entry and len(entry) >= 2 for token, entry in zip(prompt[1:], entries[1:]))
