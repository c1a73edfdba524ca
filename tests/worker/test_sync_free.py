"""The model forward never reads a device tensor back to the host (issue 17): on CUDA every
`.item()`, `.tolist()`, `int(t)`, `bool(t)` or `t.__index__()` in the forward stalls the step
until the GPU drains. Proven on the CPU: whole engine steps (batched prefill, prefix hits, chunked
prefill, decodes) with those methods patched to raise inside the model's forward only, for a
dense Llama, DeepSeek-V3 (MLA + MoE, the grouped expert route) and Kimi Linear (KDA + MLA + MoE).
A companion test shows the guard fires on the CPU's expert loop, which does read ids back."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig

from blockserve import LLM, SamplingParams
from blockserve.models.moe import Experts
from tests.models.conftest import VOCAB, save_random_model, tiny_model  # noqa: F401 (a fixture)

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
            raise HostRead(f"Tensor.{name} called inside the model forward (a host sync on a GPU)")
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, raiser(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def guard_forward(llm: LLM) -> None:
    model = llm.engine.core.runner.model
    forward = model.forward

    def guarded(*args, **kwargs):
        with host_reads_raise():
            return forward(*args, **kwargs)

    model.forward = guarded


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
        guard_forward(llm)
    params = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate(prompts()[:1], params, use_tqdm=False)  # cached: the others hit its prefix
    rest = llm.generate(prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + rest]


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_sync")
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None), path)
    return path


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


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_linear"])
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
