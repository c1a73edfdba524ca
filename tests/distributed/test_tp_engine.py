"""Tensor parallelism through the whole engine, 2 gloo ranks of one thread each: TP=2 gives TP=1's
greedy tokens, and its top-3 logprobs per step (and prompt logprobs) within 1e-4 (the logits'
partial sums are added in another order); KV heads are sharded (or replicated when there are fewer
than ranks); shapes that cannot be sharded are refused at start-up; a rank that dies or raises
mid-run fails every request with EngineDead and leaves no process; rank 1 joining over env:// from
its own process (another "node" on loopback) serves the same tokens. The recurrent-state families:
test_tp_recurrent.py.

Each TP=2 engine spawns a process that imports torch and loads its shard: ~5-10 s each here, so
the default suite runs one engine per property and `-m tp_full` the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from blockserve.attention.paged_attention import BACKENDS
from blockserve.engine.llm import LLM
from blockserve.errors import EngineDead
from blockserve.models.llama import LlamaForCausalLM
from blockserve.models.placement import Placement
from blockserve.models.random_checkpoint import save_random_hybrid, save_random_model
from blockserve.sampling_params import SamplingParams
from tests.distributed.processes import child_pids
from tests.models.conftest import MLA_CONFIGS
from tests.server_process import free_port

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    # one KV head for two ranks: replicated; an odd vocabulary: the last rank's rows padded
    "llama-kv1": lambda: LlamaConfig(**_COMMON, vocab_size=511, num_key_value_heads=1),
    # q/k/v biases, tied embeddings: the vocab-parallel embedding is the LM head
    "qwen2-tied": lambda: Qwen2Config(**_COMMON, vocab_size=512, num_key_value_heads=2, tie_word_embeddings=True),
    # per-head q/k norms, head_dim apart from hidden / heads
    "qwen3": lambda: Qwen3Config(**_COMMON, vocab_size=512, num_key_value_heads=2, head_dim=32),
    # sliding and global layers (two KV groups), 1 + w norms, tied embeddings, soft-capped logits
    "gemma3": lambda: Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 3}, vocab_size=512, num_key_value_heads=2,
                                       head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                       final_logit_softcapping=30.0),
    # MLA (4 heads sharded, the latent cache whole on each rank), q through the low-rank path, a dense
    # first layer, then MoE: 8 experts sharded by intermediate size, group-limited routing, a shared expert
    "deepseek_v3": MLA_CONFIGS["deepseek_v3"],
}
SAVE = {"deepseek_v3": save_random_hybrid}  # the others: save_random_model
SLOWER = {"qwen2-tied", "qwen3"}  # tp_full: the default suite runs llama-kv1, gemma3, deepseek_v3
PROMPTS = [[5, 17, 301, 42, 9], list(range(100, 137)), [7] * 3]  # 37 tokens: prefill in chunks of 16
PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2)
ENGINE = dict(num_threads=1, kv_cache_memory="8MiB", max_model_len=128, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            SAVE.get(name, save_random_model)(FAMILIES[name](), path)
            built[name] = str(path)
        return built[name]

    return get


def _generate(path: str, **engine) -> tuple[list, list]:
    """(outputs, the KV groups' (spec, num_blocks)) of PROMPTS on a fresh engine, closed after."""
    with LLM(path, **ENGINE, **engine) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        groups = [(g.spec, g.num_blocks) for g in llm.engine.core.kv_config.groups]
    return outputs, groups


def _assert_same(tp1: list, tp2: list) -> None:
    """Greedy tokens equal; each step's top-3 logprobs and each prompt token's top-2 within 1e-4."""
    for request_one, request_two in zip(tp1, tp2):
        one, two = request_one.outputs[0], request_two.outputs[0]
        assert two.token_ids == one.token_ids
        prompt_one, prompt_two = request_one.prompt_logprobs[1:], request_two.prompt_logprobs[1:]
        assert len(prompt_two) == len(prompt_one) > 0
        for step_one, step_two in zip([*one.logprobs, *prompt_one], [*two.logprobs, *prompt_two]):
            assert step_one.keys() == step_two.keys()
            for token in step_one:
                assert abs(step_one[token].logprob - step_two[token].logprob) < 1e-4


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.tp_full] if f in SLOWER else [])
                                    for f in sorted(FAMILIES)])
def test_tp2_equals_tp1(saved, family):
    path = saved(family)
    before = child_pids()
    tp1, groups1 = _generate(path)
    tp2, groups2 = _generate(path, tensor_parallel_size=2)
    assert not child_pids() - before  # closed: rank 1 has exited
    _assert_same(tp1, tp2)
    kv_heads = FAMILIES[family]().num_key_value_heads
    if family == "deepseek_v3":  # one latent row per token, on every rank: the same cache as one device
        assert groups2 == groups1
        return
    for (spec1, blocks1), (spec2, blocks2) in zip(groups1, groups2):
        assert spec2.num_kv_heads == max(1, kv_heads // 2)  # sharded, or the one head replicated
        if kv_heads == 2:  # half the bytes per block per rank: about twice the blocks in the same budget
            assert blocks2 >= 2 * blocks1 - 2
        else:
            assert spec2 == spec1 and blocks2 == blocks1


class _Shard(SimpleNamespace):
    """Enough of a TensorParallelGroup to build (not run) a rank's shard."""


@pytest.mark.parametrize("overrides, dimension", [
    (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), "num_attention_heads = 6"),
    (dict(num_key_value_heads=3, num_attention_heads=12, hidden_size=96), "num_key_value_heads = 3"),
    (dict(intermediate_size=90), "intermediate_size = 90"),
])
def test_unshardable_shape_is_refused_naming_the_dimension(overrides, dimension):
    config = LlamaConfig(**{**_COMMON, "vocab_size": 64, "num_key_value_heads": 2, **overrides})
    with pytest.raises(ValueError, match=dimension):
        LlamaForCausalLM(config, BACKENDS["exact"], Placement(tp=_Shard(rank=0, size=4)))


def _fail_mid_step(llm: LLM, how: str) -> None:
    """On the next step, make rank 1 die (killed while rank 0 waits in the step's all-reduces)
    or raise (it is sent a step it cannot run; rank 0 runs the real one)."""
    executor = llm.engine.core.executor
    if how == "dies":
        run = executor.runner.execute

        def killed_then_run(step):
            executor.processes[0].kill()
            executor.processes[0].wait()
            return run(step)

        executor.runner.execute = killed_then_run
    else:
        broadcast = executor.group.broadcast_object
        executor.group.broadcast_object = lambda obj, **kw: broadcast("not a SchedulerOutput", **kw)


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("how, cause", [("dies", "Connection (closed|reset)"),
                                        pytest.param("raises", "rank 1: AttributeError", marks=pytest.mark.tp_full)])
def test_a_failed_rank_fails_every_request_and_leaves_no_process(saved, how, cause):
    before = child_pids()
    llm = LLM(saved("llama-kv1"), tensor_parallel_size=2, **ENGINE, distributed_timeout_s=20)
    try:
        assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        _fail_mid_step(llm, how)
        with pytest.raises(EngineDead, match=cause):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert not child_pids() - before  # stopped at once, not at close
        with pytest.raises(EngineDead):  # and so does every later request
            llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
        stats = llm.engine.stats()  # the failed requests were aborted: nothing holds a block
        assert stats.num_running == stats.num_waiting == 0 and not any(stats.kv_usage)
    finally:
        llm.close()


@pytest.mark.slow  # rank processes
def test_two_nodes_over_loopback_with_env(saved, monkeypatch):
    """Rank 1 as its own program (what torchrun or any launcher would start on another host)."""
    path = saved("llama-kv1")
    tp1, _ = _generate(path)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "blockserve.distributed.worker"],
                              env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1"})
    try:
        for key, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        tp2, _ = _generate(path, tensor_parallel_size=2, distributed_executor="external")
        assert worker.wait(timeout=30) == 0  # told to leave at close
    finally:
        worker.kill()
        worker.wait()
    _assert_same(tp1, tp2)
